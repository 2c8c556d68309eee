"""Granite: the Llama decoder with four multipliers from the config: the embeddings times
`embedding_multiplier` (prompt embeds too, as transformers does), each residual branch
times `residual_multiplier`, `attention_multiplier` as the softmax scale, and the logits
divided by `logits_scaling`."""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.v1.attention.backends.abstract import AttentionBackend


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int, backend: type[AttentionBackend]) -> None:
        super().__init__(config, layer_idx, backend, False,
                         scale=config.attention_multiplier)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        m = self.residual_multiplier
        h = h + self.self_attn(cos_sin, self.input_layernorm(h)) * m
        return h + self.mlp(self.post_attention_layernorm(h)) * m


class GraniteForCausalLM(LlamaForCausalLM):
    def make_layer(self, config, layer_idx: int, backend: type[AttentionBackend]) -> nn.Module:
        return GraniteDecoderLayer(config, layer_idx, backend)

    def prepare(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h, cos_sin = super().prepare(input_ids, positions, inputs_embeds)
        return h * self.config.embedding_multiplier, cos_sin

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.config.logits_scaling
