"""`Attention`: the layer that hands q/k/v to the step's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.abstract import AttentionBackend


class Attention(nn.Module):
    def __init__(self, backend: type[AttentionBackend], layer_idx: int, num_heads: int,
                 head_size: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.impl = backend.make_impl(num_heads, head_size, num_kv_heads, scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        return self.impl.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata)
