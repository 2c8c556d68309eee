"""What the model runner needs of a model class, as protocols the type checker holds every
model in the registry to, and the checks that tell which optional parts a model has."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from vllm.model_executor.models.encoder_decoder import CrossAttention
    from vllm.v1.messages import EncoderInput


class VllmModel(Protocol):
    """Every model: built as `cls(hf_config, attention backend, max_model_len, dtype)`,
    then loaded with `load_weights`."""

    def __call__(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of the scheduled tokens, [num_tokens, hidden_size]: from
        `input_ids`, or from `inputs_embeds` rows when given."""
        ...

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads checkpoint tensors; returns the names of the parameters it set."""
        ...


class EncoderDecoderModel(VllmModel, Protocol):
    """An encoder/decoder model (BART, Whisper): the runner's encoder pass encodes a step's
    new encoder inputs and writes every layer's cross-attention K/V into the cross blocks."""

    def encode(self, inputs: list[EncoderInput]) -> torch.Tensor:
        """Encoder outputs of the inputs, concatenated: [sum of lengths, d_model]."""
        ...

    def cross_attention_layers(self) -> list[CrossAttention]: ...


class GraphModel(VllmModel, Protocol):
    """A model whose forward graph capture may compile (`supports_graph_capture = True`):
    the same forward as pieces along its seams, `prepare` -> each of `layers` -> `finish`,
    which the CPU graphs compile one by one."""

    layers: nn.ModuleList

    def prepare(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]: ...

    def finish(self, h: torch.Tensor) -> torch.Tensor: ...


def is_encoder_decoder(model: VllmModel) -> TypeGuard[EncoderDecoderModel]:
    return callable(getattr(model, "encode", None)) and callable(
        getattr(model, "cross_attention_layers", None))


def supports_graph_capture(model: VllmModel) -> TypeGuard[GraphModel]:
    return bool(getattr(model, "supports_graph_capture", False))
