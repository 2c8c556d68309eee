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
