"""Loading a model's Hugging Face config from a local directory, a GGUF file or a CTranslate2
Whisper directory."""

from __future__ import annotations

import os

from transformers import AutoConfig, PretrainedConfig, WhisperConfig


def resolve_model_path(model: str | None) -> str:
    """The local path to load: `model` itself, or the default model's GGUF file."""
    if model is None:
        from vllm.transformers_utils.default_model import default_model_path

        return default_model_path()
    if not os.path.exists(model):
        raise ValueError(
            f"Model path {model!r} does not exist. Models load from a local Hugging Face "
            "directory (config.json, *.safetensors, tokenizer files) or a .gguf file; "
            "nothing is downloaded.")
    return model


def is_encoder_decoder_config(config) -> bool:
    """Whether the config is an encoder/decoder model's (Whisper, BART): the one place that
    reads `is_encoder_decoder`; read through `ModelConfig.is_encoder_decoder` where one is
    at hand."""
    return bool(getattr(config, "is_encoder_decoder", False))


def head_dim_of(config) -> int:
    """A decoder's `head_dim` where the config sets it (it may differ from hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config) -> int:
    """A decoder's KV heads (`num_key_value_heads`; all heads where the config has none)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_sliding_windows(hf_config, num_layers: int) -> list[int | None]:
    """Each layer's window from a transformers config: `layer_types` where the config
    has them (Gemma 2/3, Qwen2 with `use_sliding_window`), else `sliding_window` for every
    layer (Mistral), else none."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"The config's layer_types has {len(layer_types)} entries for "
                             f"{num_layers} layers.")
        unknown = sorted({t for t in layer_types}
                         - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(f"Unsupported layer types {unknown} in the config's layer_types.")
        if window is None and "sliding_attention" in layer_types:
            raise ValueError("The config has sliding_attention layers but no sliding_window.")
        return [window if t == "sliding_attention" else None for t in layer_types]
    if window is not None and window <= 0:
        raise ValueError(f"sliding_window must be positive, got {window}.")
    return [window] * num_layers


def get_config(model: str) -> PretrainedConfig:
    if model.endswith(".gguf"):
        from vllm.model_executor.model_loader.gguf_loader import load_gguf_config

        config_dict = dict(load_gguf_config(model))
        model_type = config_dict.pop("model_type")
        return AutoConfig.for_model(model_type, **config_dict)
    from vllm.model_executor.model_loader.ct2_loader import is_ct2_model_dir, load_ct2_config

    if is_ct2_model_dir(model):
        return WhisperConfig(**load_ct2_config(model))
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"No config.json in model directory {model!r}.")
    return AutoConfig.from_pretrained(model, local_files_only=True)


# generation_config.json keys that become default sampling parameters (same names).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def get_generation_defaults(model: str, generation_config: str) -> dict[str, float | int]:
    """The default sampling parameters a model ships (vLLM's `--generation-config`):
    "auto" reads `generation_config.json` in the model's directory, a folder path reads
    the one there, "vllm" none. Only the keys of `GENERATION_DEFAULT_KEYS` present in the
    file count; a request's own values win over them."""
    import json

    if generation_config == "vllm":
        return {}
    folder = model if generation_config == "auto" else generation_config
    if generation_config != "auto" and not os.path.isdir(folder):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                         f"generation_config.json, got {generation_config!r}.")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    return {key: data[key] for key in GENERATION_DEFAULT_KEYS if data.get(key) is not None}
