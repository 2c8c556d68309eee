"""What the multimodal models (an encoder for images or audio, a projector, and any
registered decoder as the language model: LLaVA, Qwen2-Audio) share: the language model built
from the config's `text_config`, the runner's calls forwarded to it (media reach it as
prompt-embeds rows, so its forward is the plain decoder's), and checkpoint names routed to
the parts. Both layouts transformers writes:

    <part>.X / model.<part>.X                       -> <part>.X   (the encoder, the projector)
    language_model.model.X / model.language_model.X -> language_model.X
    language_model.lm_head.X / lm_head.X            -> language_model.lm_head.X
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.model_loader.weight_utils import PackedModulesMapping
from vllm.model_executor.models.interfaces import FusedDecodeSpec, VllmModel
from vllm.v1.attention.backends.abstract import AttentionBackend

# The language model's class, from its `model_type` (a text_config carries no architecture).
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    # with M-RoPE: `rotary_embedding` reads it from the config
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def text_architecture(text_config: Any) -> str:
    archs = getattr(text_config, "architectures", None)
    if archs:
        return archs[0]
    model_type = getattr(text_config, "model_type", None)
    if model_type not in TEXT_ARCHITECTURES:
        raise ValueError(f"The language model type {model_type!r} is not supported in a "
                         f"multimodal model ({', '.join(TEXT_ARCHITECTURES)}).")
    return TEXT_ARCHITECTURES[model_type]


class MultiModalLanguageModel(nn.Module):
    """The language model half of a multimodal model: `self.language_model`, and every call
    the runner and graph capture make, forwarded to it. A subclass adds its encoder and
    projector (built before or after calling this `__init__`) and `embed_media`."""

    supports_graph_capture = True
    # The language model fuses its own projections (its `load_weights`); none fused here.
    packed_modules_mapping: ClassVar[PackedModulesMapping] = {}

    def __init__(self, config, backend: type[AttentionBackend], max_model_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        from vllm.model_executor.models.registry import resolve_model_cls

        text_cls = resolve_model_cls(text_architecture(config.text_config))
        self.language_model: Any = text_cls(config.text_config, backend, max_model_len, dtype)

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.get_input_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    def prepare(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.language_model.prepare(input_ids, positions, inputs_embeds)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.language_model.finish(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def row_switch_tokens(self) -> int:
        return self.language_model.row_switch_tokens()

    def fused_decode_spec(self) -> FusedDecodeSpec | str:
        spec = getattr(self.language_model, "fused_decode_spec", None)
        return spec() if spec is not None else "the language model has no fused decoder"


def split_checkpoint_name(name: str, parts: tuple[str, ...], model: str) -> tuple[str, str]:
    """(part, name inside it) of a checkpoint tensor's name; `parts`: the model's parts
    besides the language model, `model`: its name for the error.

    Example (parts ("audio_tower", "multi_modal_projector")):
        "model.audio_tower.conv1.weight" -> ("audio_tower", "conv1.weight")
        "language_model.model.norm.weight" -> ("language_model", "model.norm.weight")
        "lm_head.weight" -> ("language_model", "lm_head.weight")
    """
    name = name.removeprefix("model.")
    for part in parts:
        if name.startswith(part + "."):
            return part, name.removeprefix(part + ".")
    if name.startswith("lm_head."):
        return "language_model", name
    if name.startswith("language_model."):
        return "language_model", name.removeprefix("language_model.")
    raise ValueError(f"Checkpoint tensor {name!r} has no place in {model} "
                     f"({', '.join(parts + ('language_model',))}).")


def load_module_exactly(module: nn.Module, weights: list[tuple[str, torch.Tensor]],
                        where: str) -> set[str]:
    """Copies each tensor into `module`'s parameter of that name (a small unfused part such
    as a projector); an unknown name or a shape that differs is an error naming `where`."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name not in params or params[name].shape != tensor.shape:
            raise ValueError(f"Checkpoint tensor {where}.{name!r} does not fit the "
                             f"{where} part.")
        with torch.no_grad():
            params[name].copy_(tensor)
        loaded.add(f"{where}.{name}")
    return loaded


# An encoder's loader: its tensors (names inside it) -> the names it loaded.
EncoderLoader = Callable[[list[tuple[str, torch.Tensor]]], Iterable[str]]


def load_multimodal_weights(model: Any, weights: Iterable[tuple[str, torch.Tensor]],
                            encoder: str, load_encoder: EncoderLoader, what: str) -> set[str]:
    """The loader of a model of an encoder (the attribute `encoder`: "vision_tower",
    "audio_tower"), `multi_modal_projector` and `language_model` (LLaVA, Gemma 3,
    Qwen2-Audio): each tensor routed by `split_checkpoint_name`, the encoder's loaded by
    `load_encoder`, the projector's exactly, the language model's by its own loader; `what`
    names the model in errors. Returns the names loaded, each under its part."""
    parts: dict[str, list[tuple[str, torch.Tensor]]] = {
        encoder: [], "multi_modal_projector": [], "language_model": []}
    for name, tensor in weights:
        part, rest = split_checkpoint_name(name, (encoder, "multi_modal_projector"), what)
        parts[part].append((rest, tensor))
    loaded = {f"{encoder}.{n}" for n in load_encoder(parts[encoder])}
    loaded |= load_module_exactly(model.multi_modal_projector,
                                  parts["multi_modal_projector"], "multi_modal_projector")
    language_model: VllmModel = model.language_model
    loaded |= {f"language_model.{n}"
               for n in language_model.load_weights(iter(parts["language_model"]))}
    return loaded
