"""Architecture name (config.json `architectures`) -> model class, imported on first use:
a family's module (and its imports) loads only when a checkpoint of it does."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from vllm.model_executor.models.interfaces import VllmModel
from vllm.v1.attention.backends.abstract import AttentionBackend

# Each takes (hf_config, backend, max_model_len, dtype) and loads checkpoint tensors with
# `load_weights(weights) -> names loaded`: a `VllmModel` and an `nn.Module`.
ModelClass = Callable[[Any, type[AttentionBackend], int, torch.dtype], VllmModel]

# architecture -> (module under vllm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "BartForConditionalGeneration": ("bart", "BartForConditionalGeneration"),
    "WhisperForConditionalGeneration": ("whisper", "WhisperForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Qwen2AudioForConditionalGeneration": ("qwen2_audio", "Qwen2AudioForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
}

# Architectures whose encoder input is audio -> log-mel frames per encoder position (the
# stride of the model's convolution stem; `whisper.FRAMES_PER_ENCODER_TOKEN`). Read by the
# front end (`ModelConfig.audio_frames_per_encoder_token`) without importing the model.
_AUDIO_MODELS: dict[str, int] = {
    "WhisperForConditionalGeneration": 2,
}


class MediaPrompts(NamedTuple):
    """What a multimodal architecture's prompts take, for the front end."""

    modalities: tuple[str, ...]  # "image", "audio"
    # Its prompt processor (placeholders to runs, media to `MediaInput`s): (module under
    # vllm.multimodal, class name), built with (model_config, tokenizer).
    processor: tuple[str, str]


# Architectures whose prompts take media (`multi_modal_data={"image": ...}`), read by the
# front end without importing the model.
_MULTIMODAL_MODELS: dict[str, MediaPrompts] = {
    "LlavaForConditionalGeneration": MediaPrompts(("image",),
                                                  ("processing", "ImagePromptProcessor")),
    "Gemma3ForConditionalGeneration": MediaPrompts(("image",),
                                                   ("gemma3", "Gemma3PromptProcessor")),
    "Qwen2AudioForConditionalGeneration": MediaPrompts(("audio",),
                                                       ("processing", "AudioPromptProcessor")),
    "Qwen2VLForConditionalGeneration": MediaPrompts(("image",),
                                                    ("qwen2_vl", "Qwen2VLPromptProcessor")),
    "Qwen2_5_VLForConditionalGeneration": MediaPrompts(("image",),
                                                       ("qwen2_vl", "Qwen2VLPromptProcessor")),
}

# Multimodal architectures whose media attend bidirectionally: the positions of one item (an
# image's run) see each other both ways, everything else stays causal. The front end gives
# such requests their items' spans; the scheduler never splits a span across steps nor
# ends a prefix hit inside one; the attention backend widens the causal mask over them.
_BIDIRECTIONAL_MEDIA: tuple[str, ...] = ("Gemma3ForConditionalGeneration",)

if TYPE_CHECKING:  # the type checker holds every registered class to `ModelClass`
    from vllm.model_executor.models.bart import BartForConditionalGeneration
    from vllm.model_executor.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
    from vllm.model_executor.models.gemma3_mm import Gemma3ForConditionalGeneration
    from vllm.model_executor.models.granite import GraniteForCausalLM
    from vllm.model_executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
    from vllm.model_executor.models.llava import LlavaForConditionalGeneration
    from vllm.model_executor.models.mixtral import MixtralForCausalLM
    from vllm.model_executor.models.olmo2 import Olmo2ForCausalLM
    from vllm.model_executor.models.olmoe import OlmoeForCausalLM
    from vllm.model_executor.models.phi3 import Phi3ForCausalLM
    from vllm.model_executor.models.qwen2_audio import Qwen2AudioForConditionalGeneration
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
    from vllm.model_executor.models.qwen2_vl import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration

    _CHECKED: list[ModelClass] = [
        LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM,
        Olmo2ForCausalLM, GraniteForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM,
        Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM,
        BartForConditionalGeneration, WhisperForConditionalGeneration,
        LlavaForConditionalGeneration, Qwen2AudioForConditionalGeneration,
        Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration,
        Gemma3ForConditionalGeneration]


def get_supported_archs() -> list[str]:
    return list(_MODELS)


def audio_frames_per_encoder_token(architecture: str) -> int | None:
    """Mel frames per encoder position of an audio model; None for a model of text."""
    return _AUDIO_MODELS.get(architecture)


def input_modalities(architecture: str) -> tuple[str, ...]:
    """The media a model's prompts take ("image", "audio"); () for a model of text."""
    media = _MULTIMODAL_MODELS.get(architecture)
    return () if media is None else media.modalities


def resolve_prompt_processor_cls(architecture: str) -> type | None:
    """A multimodal model's prompt processor class (imported on first use); None for a
    model of text."""
    media = _MULTIMODAL_MODELS.get(architecture)
    if media is None:
        return None
    module, name = media.processor
    return getattr(importlib.import_module(f"vllm.multimodal.{module}"), name)


def bidirectional_media(architecture: str) -> bool:
    """Whether the positions of one media item attend to each other both ways."""
    return architecture in _BIDIRECTIONAL_MEDIA


def resolve_model_cls(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"Model architecture {architecture!r} is not supported. "
                         f"Supported architectures: {', '.join(_MODELS)}.")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
