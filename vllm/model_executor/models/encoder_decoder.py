"""Building blocks shared by the encoder/decoder models (BART, Whisper).

The decoder runs over flat token batches like the decoder-only models. Each decoder layer's
self-attention and cross-attention share that layer's KV cache tensor: self-attention
through the request's self blocks, cross-attention through its cross blocks. The encoder
runs once per encoder input (the runner's encoder pass); its output only feeds
`CrossAttention.project_kv`, whose K/V the pass writes into the cross blocks.

An encoder/decoder model class provides, besides `forward` / `compute_logits`:
    encode(inputs: list[EncoderInput]) -> Tensor   # [sum of encoder lengths, d_model]
    cross_attention_layers() -> list[CrossAttention]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.v1.attention.backends.abstract import AttentionBackend, AttentionType


class SelfAttention(nn.Module):
    """q/k/v projections fused into one matmul (checkpoint names are split on load), heads
    split across tensor-parallel ranks; a part the checkpoint lacks keeps a zero bias
    (Whisper has no k bias)."""

    def __init__(self, d_model: int, num_heads: int, backend: type[AttentionBackend],
                 layer_idx: int, attn_type: AttentionType) -> None:
        super().__init__()
        self.head_dim = d_model // num_heads
        self.qkv_proj = QKVParallelLinear(d_model, self.head_dim, num_heads, num_heads)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(d_model, d_model)
        self.attn = Attention(backend, layer_idx, self.num_heads, self.head_dim,
                              self.num_heads, self.head_dim**-0.5, attn_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        return self.out_proj(self.attn(q, k, v))


class CrossAttention(nn.Module):
    """Decoder queries over the encoder output's K/V, read from the cross blocks."""

    def __init__(self, d_model: int, num_heads: int, backend: type[AttentionBackend],
                 layer_idx: int) -> None:
        super().__init__()
        self.head_dim = d_model // num_heads
        self.q_proj = ColumnParallelLinear(d_model, d_model)
        self.kv_proj = MergedColumnParallelLinear(d_model, [d_model, d_model])
        self.num_heads = self.q_proj.out_features // self.head_dim  # this rank's
        self.out_proj = RowParallelLinear(d_model, d_model)
        self.attn = Attention(backend, layer_idx, self.num_heads, self.head_dim,
                              self.num_heads, self.head_dim**-0.5, AttentionType.ENCODER_DECODER)

    def project_kv(self, encoder_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of encoder rows [n, d_model] -> two [n, num_heads, head_dim] (this
        rank's heads)."""
        n = encoder_out.shape[0]
        k, v = self.kv_proj(encoder_out).view(n, 2, self.num_heads, self.head_dim).unbind(1)
        return k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)
        return self.out_proj(self.attn(q))


def activation_fn(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"Unsupported activation_function {name!r}; supported: "
                         f"{', '.join(_ACTIVATIONS)}.")
    return _ACTIVATIONS[name]


_ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}

# checkpoint projections -> the fused layer holding them (see `weight_utils.load_weights`)
PACKED_MODULES_MAPPING = {
    "self_attn.qkv_proj": [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"),
                           ("self_attn.v_proj", "v")],
    "encoder_attn.kv_proj": [("encoder_attn.k_proj", 0), ("encoder_attn.v_proj", 1)],
}
