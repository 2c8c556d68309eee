"""Build tiny, random-weight Hugging Face checkpoints and tokenizers for tests, fully offline."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]

TOKENIZER_VOCAB_SIZE = 768
MODEL_MAX_LENGTH = 1024

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

TRAINING_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A small engine reads a prompt, splits it into "
    "tokens, and predicts the next token one step at a time until it reaches the end.",
    "Once upon a time there was a little robot who lived in a quiet village by the sea. Every "
    "morning it walked to the market, bought bread and apples, and said hello to the baker.",
    "Language models are trained on large amounts of text. They learn which words tend to follow "
    "other words, and they can answer questions, write stories, and translate sentences.",
    "What is the capital of France? The capital of France is Paris. What is the capital of Japan? "
    "The capital of Japan is Tokyo. Numbers like 1, 2, 3, 42, 100 and 2024 appear in text too.",
    "She ordered a café au lait and a croissant; he was naïve enough to think the jalapeño salsa "
    "would be mild. The résumé listed Zürich, São Paulo, and Kraków as previous homes.",
    "日本語のテキストも少し含めます。東京は日本の首都です。中文也可以：你好，世界。"
    "한국어 문장도 있습니다. Привет, мир! Γειά σου κόσμε.",
    "Emoji make chats lively 🙂 🚀 🎉 ❤️ and so do symbols like €, £, ©, ™, → and ∑.",
    'def greet(name):\n    return f"Hello, {name}!"\n\n'
    "print(greet('world'))  # prints a greeting",
    "user: Can you help me plan a trip?\nassistant: Of course! Where would you like to go, and "
    "how many days do you have? I can suggest museums, parks, and good places to eat.",
]


def _train_tokenizer() -> Any:
    """Train a deterministic byte-level BPE ``tokenizers.Tokenizer`` on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_CORPUS * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _write_json(path: str, data: dict) -> None:
    """Write ``data`` as stable, indented JSON."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, ensure_ascii=False, sort_keys=True)
        handle.write("\n")


def make_tiny_tokenizer(path: str) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``path``.

    The result is a byte-level BPE tokenizer (any UTF-8 text round-trips) that
    ``transformers.AutoTokenizer.from_pretrained(path)`` loads offline with bos/eos/pad/unk set,
    a plain-text chat template, and a bos token prepended to every encoded prompt.
    """
    os.makedirs(path, exist_ok=True)
    _train_tokenizer().save(os.path.join(path, "tokenizer.json"))
    special_tokens = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
    }
    _write_json(os.path.join(path, "special_tokens_map.json"), special_tokens)
    _write_json(
        os.path.join(path, "tokenizer_config.json"),
        {
            **special_tokens,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": MODEL_MAX_LENGTH,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": True,
            "add_eos_token": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )


def tiny_tokenizer_vocab_size(path: str) -> int:
    """Number of tokens (special ones included) of the tokenizer written in ``path``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab_size()


_ARCH_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
}

# What each family's tiny config sets beyond the common ones, so its peculiarities matter:
# head_dim unlike hidden / heads, partial rotary, multipliers away from 1.
_ARCH_SETTINGS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 32, "sliding_window": None, "use_sliding_window": False},
    "mistral": {"head_dim": 24, "sliding_window": None},
    "phi3": {"partial_rotary_factor": 0.5, "sliding_window": None,
             "original_max_position_embeddings": MODEL_MAX_LENGTH},
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.6,
                "attention_multiplier": 0.2, "logits_scaling": 1.7},
}

# Mixture-of-experts sizes of the tiny models: more experts than are routed, experts
# narrower than the hidden size (each family's own key names).
TINY_MOE_SETTINGS: dict[str, dict[str, Any]] = {
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True, "head_dim": 16},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
              "norm_topk_prob": False},
}

WEIGHT_INIT_STD = 0.2
NORM_INIT_STD = 0.1


def tiny_model_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """Return a small transformers config (GQA, float32) for ``arch`` with ``overrides``."""
    import transformers

    if arch not in _ARCH_CLASSES:
        choices = sorted(_ARCH_CLASSES)
        raise ValueError(f"Unsupported tiny model arch {arch!r}; choose from {choices}")
    config_class = getattr(transformers, _ARCH_CLASSES[arch][0])
    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "initializer_range": WEIGHT_INIT_STD,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **_ARCH_SETTINGS.get(arch, {}),
    }
    settings.update(TINY_MOE_SETTINGS.get(arch, {}))
    settings.update(overrides)
    return config_class(**settings)


def _randomize_parameters(model: torch.nn.Module, seed: int, std: float) -> None:
    """Fill every parameter from a seeded generator: norms near 1, everything else N(0, std).

    Biases (qwen2's q/k/v) and norm weights are made non-trivial too, so a loader that drops or
    misplaces them changes the model's output.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + NORM_INIT_STD * noise)
            else:
                param.copy_(std * noise)


def _add_legacy_config_keys(path: str, config: Any) -> None:
    """Add the ``torch_dtype`` and ``rope_theta`` keys that most published config.json files use."""
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as handle:
        data = json.load(handle)
    data.setdefault("torch_dtype", "float32")
    rope = data.get("rope_parameters") or {}
    data.setdefault("rope_theta", rope.get("rope_theta", getattr(config, "rope_theta", None)))
    _write_json(config_path, data)


def make_tiny_model(
    path: str,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    **config_overrides: Any,
) -> str:
    """Write a tiny random-weight ``arch`` checkpoint (config, safetensors, tokenizer) to ``path``.

    Weights are drawn with ``seed`` and scaled (``WEIGHT_INIT_STD``) so that greedy decoding
    yields varied tokens rather than one repeated token. Returns ``path``.
    """
    import transformers

    make_tiny_tokenizer(path)
    config = tiny_model_config(
        arch,
        tiny_tokenizer_vocab_size(path),
        tie_word_embeddings=tie_word_embeddings,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCH_CLASSES[arch][1])(config).to(torch.float32).eval()
    _randomize_parameters(model, seed, config.initializer_range)
    model.save_pretrained(path, safe_serialization=True)
    _add_legacy_config_keys(path, config)
    return path


# ---- encoder/decoder models --------------------------------------------------------------


FFN_INIT_STD = 0.05
POSITION_INIT_STD = 2.0


def _randomize_encoder_decoder(model: torch.nn.Module, seed: int, keep: tuple[str, ...] = ()
                               ) -> None:
    """Seeded weights that give varied greedy tokens and stay well conditioned (float32
    logprobs within ~1e-5 of float64). LayerNorm weights are near 1 and their biases small
    (large norm biases make every output the same token); feed-forward layers are small (a
    dominant FFN pushes every position towards one direction) and learned positions large
    (so that the token changes from step to step); the rest is N(0, 0.2). Sharper attention
    varies the tokens more but amplifies rounding past a 1e-4 logprob tolerance. Parameters
    whose name contains a string of ``keep`` are left as they are; BART's
    `final_logits_bias` buffer is made slightly non-zero (0.01: enough for the logprobs to
    show a loader that drops it, too little to favour a few tokens)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if any(part in name for part in keep):
                continue
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + NORM_INIT_STD * noise)
            elif "norm" in name:
                param.copy_(NORM_INIT_STD * noise)
            elif ".fc" in name:
                param.copy_(FFN_INIT_STD * noise)
            elif "embed_positions" in name:
                param.copy_(POSITION_INIT_STD * noise)
            else:
                param.copy_(WEIGHT_INIT_STD * noise)
        for name, buffer in sorted(model.named_buffers()):
            if name == "final_logits_bias":
                buffer.copy_(0.01 * torch.randn(buffer.shape, generator=generator))


def make_tiny_bart(path: str, seed: int = 0) -> str:
    """Write a tiny random-weight BartForConditionalGeneration (2 + 2 layers, d_model 64)
    with the tiny tokenizer to ``path``: <DEC> = </s> = 2, <BOS> = <s> = 1. Returns ``path``."""
    import transformers

    make_tiny_tokenizer(path)
    config = transformers.BartConfig(
        vocab_size=tiny_tokenizer_vocab_size(path), d_model=64, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=MODEL_MAX_LENGTH,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, decoder_start_token_id=2,
        forced_eos_token_id=None, forced_bos_token_id=None, scale_embedding=True)
    torch.manual_seed(seed)
    model = transformers.BartForConditionalGeneration(config).to(torch.float32).eval()
    _randomize_encoder_decoder(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_whisper(path: str, seed: int = 0, multilingual: bool = False) -> str:
    """Write a tiny random-weight WhisperForConditionalGeneration (2 + 2 layers, d_model 64,
    80 mel bins, English-only vocabulary) with the real tiny.en tokenizer to ``path``, so
    that text decoder prompts and the default decoder prompt work. The encoder's sinusoidal
    positions are kept. ``multilingual``: the multilingual vocabulary's layout instead (see
    `_multilingual_whisper_tokenizer`). Returns ``path``."""
    import transformers

    from vllm.model_executor.model_loader.ct2_loader import load_ct2_tokenizer
    from vllm.transformers_utils.default_model import default_whisper_model_path

    os.makedirs(path, exist_ok=True)
    load_ct2_tokenizer(default_whisper_model_path()).save_pretrained(path)
    special: dict[str, int] = {}
    if multilingual:
        _multilingual_whisper_tokenizer(path)
        # <|endoftext|> 50257, <|startoftranscript|> 50258 (English-only: 50256, 50257).
        special = dict(bos_token_id=50257, eos_token_id=50257, pad_token_id=50257,
                       decoder_start_token_id=50258)
    config = transformers.WhisperConfig(
        vocab_size=51865 if multilingual else 51864, d_model=64, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
        max_source_positions=1500, max_target_positions=448, **special)
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(config).to(torch.float32).eval()
    _randomize_encoder_decoder(model, seed, keep=("encoder.embed_positions",))
    model.save_pretrained(path, safe_serialization=True)
    return path


def _multilingual_whisper_tokenizer(path: str) -> None:
    """Rewrites the English-only Whisper tokenizer in ``path`` to the multilingual layout:
    one more text token (an unused filler at 50256), so that every special and timestamp
    token moves up by one (<|endoftext|> 50257, <|startoftranscript|> 50258, <|en|> 50259,
    ... <|translate|> 50358, <|transcribe|> 50359, <|notimestamps|> 50363) and the vocabulary
    has 51865 ids. The language tokens are the same 99 in both."""
    file = os.path.join(path, "tokenizer.json")
    with open(file) as f:
        spec = json.load(f)
    first_special = spec["model"]["vocab"]["<|endoftext|>"]
    spec["model"]["vocab"]["<|endoftext|>"] = first_special + 1
    spec["model"]["vocab"]["<|filler|>"] = first_special
    for token in spec["added_tokens"]:
        if token["id"] >= first_special:
            token["id"] += 1
    with open(file, "w") as f:
        json.dump(spec, f)


# ---- vision-language models --------------------------------------------------------------

IMAGE_TOKEN = "<image>"
TINY_IMAGE_SIZE = 28  # 4 x 4 patches of 7 px: 16 image positions per image ("default")
TINY_PATCH_SIZE = 7


def make_tiny_llava(path: str, *, seed: int = 0, tower: str = "clip",
                    **config_overrides: Any) -> str:
    """Write a tiny random `LlavaForConditionalGeneration` (a 3-layer CLIP vision tower, or
    SigLIP's with `tower="siglip"`, the projector, a tiny Llama) with its tokenizer (plus
    `<image>`) and a CLIP image processor config (shortest edge 32, center crop 28) to
    ``path``. Returns ``path``."""
    import transformers
    from transformers import AutoTokenizer, CLIPImageProcessorPil

    make_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.save_pretrained(path)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    sizes: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, image_size=TINY_IMAGE_SIZE,
                                  patch_size=TINY_PATCH_SIZE)
    vision = (transformers.CLIPVisionConfig(**sizes, projection_dim=16) if tower == "clip"
              else transformers.SiglipVisionConfig(**sizes))
    text = tiny_model_config("llama", len(tokenizer))
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=image_token_id, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()  # float32
    _randomize_parameters(model, seed, WEIGHT_INIT_STD)
    model.save_pretrained(path, safe_serialization=True)
    CLIPImageProcessorPil(size={"shortest_edge": 32},
                          crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}
                          ).save_pretrained(path)
    return path


AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
TINY_MEL_BINS = 80


def make_tiny_qwen2_audio(path: str, *, seed: int = 0) -> str:
    """Write a tiny random `Qwen2AudioForConditionalGeneration` (a 2-layer Whisper-style audio
    encoder of width 32 over 80 mel bins, the projector, a tiny Qwen2) with its tokenizer
    (plus `<|audio_bos|>`, `<|AUDIO|>`, `<|audio_eos|>`) and a Whisper feature extractor
    config (16 kHz, 30 s windows) to ``path``. Returns ``path``."""
    import transformers
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    make_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    tokenizer.save_pretrained(path)
    audio = transformers.Qwen2AudioEncoderConfig(
        num_mel_bins=TINY_MEL_BINS, encoder_layers=2, encoder_attention_heads=4,
        encoder_ffn_dim=64, d_model=32, max_source_positions=1500)
    text = tiny_model_config("qwen2", len(tokenizer))
    config = transformers.Qwen2AudioConfig(
        audio_config=audio, text_config=text,
        audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    torch.manual_seed(seed)
    model = transformers.Qwen2AudioForConditionalGeneration(config).eval()  # float32
    _randomize_encoder_decoder(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    WhisperFeatureExtractor(feature_size=TINY_MEL_BINS).save_pretrained(path)
    return path


QWEN2_VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# Dynamic resolution of the tiny Qwen2-VL: 14-pixel patches merged 2 x 2, so an image is
# resized to multiples of 28 pixels, between 4 and 36 merged patches (56 x 56 .. 168 x 168).
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 168 * 168


def make_tiny_qwen2_vl(path: str, *, seed: int = 0, version: str = "2") -> str:
    """Write a tiny random `Qwen2VLForConditionalGeneration` (`version` "2.5":
    `Qwen2_5_VLForConditionalGeneration`) to ``path``: a 2-layer vision tower of width 32
    with 2-D rotary attention and the 2 x 2 patch merger (2.5: RMSNorms, a gated MLP, block
    0 attending within windows of 2 x 2 merge units, block 1 within the image), a tiny Qwen2
    with M-RoPE sections [2, 3, 3] over its 16-channel heads, its tokenizer (plus the vision
    tokens) and a Qwen2-VL image processor config (`QWEN2_VL_MIN_PIXELS` ..
    `QWEN2_VL_MAX_PIXELS`). Returns ``path``."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    make_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_TOKENS})
    tokenizer.save_pretrained(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_TOKENS}
    text = tiny_model_config("qwen2", len(tokenizer)).to_dict()
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": [2, 3, 3]}
    vision: dict[str, Any] = {"depth": 2, "num_heads": 4, "patch_size": 14,
                              "spatial_merge_size": 2, "temporal_patch_size": 2}
    if version == "2":
        vision |= {"embed_dim": 32, "hidden_size": text["hidden_size"], "mlp_ratio": 2}
        config_cls, model_cls = (transformers.Qwen2VLConfig,
                                 transformers.Qwen2VLForConditionalGeneration)
    else:
        vision |= {"hidden_size": 32, "out_hidden_size": text["hidden_size"],
                   "intermediate_size": 48, "window_size": 56, "fullatt_block_indexes": [1]}
        config_cls, model_cls = (transformers.Qwen2_5_VLConfig,
                                 transformers.Qwen2_5_VLForConditionalGeneration)
    config = config_cls(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(config).eval()  # float32
    _randomize_parameters(model, seed, WEIGHT_INIT_STD)
    model.save_pretrained(path, safe_serialization=True)
    Qwen2VLImageProcessorPil(size={"shortest_edge": QWEN2_VL_MIN_PIXELS,
                                   "longest_edge": QWEN2_VL_MAX_PIXELS}).save_pretrained(path)
    return path


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                 "eoi_token": "<end_of_image>"}
# The tiny Gemma 3: 56-pixel images of 8 x 8 patches of 7 px, pooled 2 x 2 to 16 rows each.
GEMMA3_IMAGE_SIZE = 56
GEMMA3_IMAGE_TOKENS = 16


def make_tiny_gemma3(path: str, *, seed: int = 0) -> str:
    """Write a tiny random `Gemma3ForConditionalGeneration` to ``path``: a 2-layer SigLIP
    tower of width 32 over `GEMMA3_IMAGE_SIZE`-pixel images, the projector pooling its
    8 x 8 patches to `GEMMA3_IMAGE_TOKENS` rows, a tiny Gemma 3 text model (a window layer
    of 8 positions, then a global one), its tokenizer (plus boi, the soft token and eoi, as
    `GEMMA3_TOKENS`) and a Gemma 3 image processor config. Returns ``path``."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    make_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    tokenizer.save_pretrained(path)
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in GEMMA3_TOKENS.items()}
    text = tiny_model_config("gemma3", len(tokenizer), sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"],
                             head_dim=16, query_pre_attn_scalar=16)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=GEMMA3_IMAGE_SIZE, patch_size=7, vision_use_head=False)
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS, boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()  # float32
    _randomize_parameters(model, seed, WEIGHT_INIT_STD)
    model.save_pretrained(path, safe_serialization=True)
    Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE}
                            ).save_pretrained(path)
    return path
