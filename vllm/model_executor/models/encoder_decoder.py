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

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.abstract import AttentionBackend, AttentionType


class SelfAttention(nn.Module):
    """q/k/v projections fused into one matmul (checkpoint names are split on load);
    `k_bias=False` keeps the k part of the fused bias at zero (Whisper has no k bias)."""

    def __init__(self, d_model: int, num_heads: int, backend: type[AttentionBackend],
                 layer_idx: int, attn_type: AttentionType) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.d_model = d_model
        self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        nn.init.zeros_(self.qkv_proj.bias)
        self.out_proj = nn.Linear(d_model, d_model)
        self.attn = Attention(backend, layer_idx, num_heads, self.head_dim, num_heads,
                              self.head_dim**-0.5, attn_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        return self.out_proj(self.attn(q, k, v))


class CrossAttention(nn.Module):
    """Decoder queries over the encoder output's K/V, read from the cross blocks."""

    def __init__(self, d_model: int, num_heads: int, backend: type[AttentionBackend],
                 layer_idx: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)
        nn.init.zeros_(self.kv_proj.bias)
        self.out_proj = nn.Linear(d_model, d_model)
        self.attn = Attention(backend, layer_idx, num_heads, self.head_dim, num_heads,
                              self.head_dim**-0.5, AttentionType.ENCODER_DECODER)

    def project_kv(self, encoder_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of encoder rows [n, d_model] -> two [n, num_heads, head_dim]."""
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

# checkpoint (module, projection) -> (fused parameter, index of the part)
_FUSED = {
    ("self_attn", "q_proj"): ("qkv_proj", 0),
    ("self_attn", "k_proj"): ("qkv_proj", 1),
    ("self_attn", "v_proj"): ("qkv_proj", 2),
    ("encoder_attn", "k_proj"): ("kv_proj", 0),
    ("encoder_attn", "v_proj"): ("kv_proj", 1),
}


def load_fused_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       rename: dict[str, str | None]) -> set[str]:
    """Copies checkpoint tensors in, splitting q/k/v (and cross k/v) into the fused rows.

    Args:
        rename: checkpoint name -> parameter name, or None to skip the tensor (tied
            copies); applied after the `model.` prefix is stripped.

    Returns:
        The names of the parameters and buffers that were loaded.
    """
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update(model.named_buffers())
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name in rename:
            name = rename[name]
            if name is None:
                continue
        parts = name.split(".")
        offset = None
        if len(parts) >= 3 and (parts[-3], parts[-2]) in _FUSED:
            fused, index = _FUSED[(parts[-3], parts[-2])]
            name = ".".join([*parts[:-2], fused, parts[-1]])
            offset = index * tensor.shape[0]
        if name not in targets:
            raise ValueError(f"Checkpoint tensor {name!r} has no place in the model.")
        target = targets[name]
        with torch.no_grad():
            rows = target if offset is None else target[offset:offset + tensor.shape[0]]
            if rows.shape != tensor.shape:
                raise ValueError(f"Shape of {name!r} is {tuple(tensor.shape)}, expected "
                                 f"{tuple(rows.shape)}.")
            rows.copy_(tensor)
        loaded.add(name)
    return loaded
