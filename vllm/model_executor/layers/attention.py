"""`Attention`: the layer that hands q/k/v to the step's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.abstract import AttentionBackend, AttentionType


class Attention(nn.Module):
    """One attention computation of a model; `layer_idx` names its KV cache tensor.

    DECODER layers write and read their layer's cache; ENCODER_DECODER (cross) layers read
    the same tensor through the cross-attention blocks (their K/V are written once, by the
    encoder pass, through `write_cross_kv`); ENCODER layers use no cache.
    """

    def __init__(self, backend: type[AttentionBackend], layer_idx: int, num_heads: int,
                 head_size: int, num_kv_heads: int, scale: float,
                 attn_type: AttentionType = AttentionType.DECODER) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_type = attn_type
        self.impl = backend.make_impl(num_heads, head_size, num_kv_heads, scale, attn_type)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None,
                v: torch.Tensor | None = None) -> torch.Tensor:
        ctx = get_forward_context()
        if self.attn_type == AttentionType.ENCODER:
            return self.impl.forward(q, k, v, None, ctx.encoder_attn_metadata)
        metadata = (ctx.attn_metadata if self.attn_type == AttentionType.DECODER
                    else ctx.cross_attn_metadata)
        return self.impl.forward(q, k, v, ctx.kv_caches[self.layer_idx], metadata)

    def write_cross_kv(self, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        """Stores an encoder output's cross-attention K/V at the cross slots."""
        ctx = get_forward_context()
        self.impl.write_kv(k, v, ctx.kv_caches[self.layer_idx], slot_mapping)
