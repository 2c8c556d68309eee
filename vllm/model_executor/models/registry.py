"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

from vllm.model_executor.models.bart import BartForConditionalGeneration
from vllm.model_executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.olmoe import OlmoeForCausalLM
from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm.model_executor.models.whisper import WhisperForConditionalGeneration

# Each takes (hf_config, backend, max_model_len, dtype) and loads checkpoint tensors with
# `load_weights(weights) -> names loaded`.
ModelClass = type[LlamaForCausalLM | BartForConditionalGeneration
                  | WhisperForConditionalGeneration]

_MODELS: dict[str, ModelClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "BartForConditionalGeneration": BartForConditionalGeneration,
    "WhisperForConditionalGeneration": WhisperForConditionalGeneration,
}


def get_supported_archs() -> list[str]:
    return list(_MODELS)


def resolve_model_cls(architecture: str) -> ModelClass:
    if architecture not in _MODELS:
        raise ValueError(f"Model architecture {architecture!r} is not supported. "
                         f"Supported architectures: {', '.join(_MODELS)}.")
    return _MODELS[architecture]
