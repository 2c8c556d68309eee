"""Rotary position embedding with a precomputed cos/sin table indexed by position."""

from __future__ import annotations

import torch
from torch import nn


def _inv_freq_and_scaling(config) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of the config's rope type (default, linear, llama3, ...),
    taken from transformers so that every rope variant matches the reference exactly."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(config)
    return rope.inv_freq.float(), float(rope.attention_scaling)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # [max_positions, head_dim] buffer, scaled, model dtype
    sin: torch.Tensor  # [max_positions, head_dim] buffer, scaled, model dtype

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq_and_scaling(config)
        assert inv_freq.numel() * 2 == head_dim, "partial rotary is not supported"
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of the step's positions, [num_tokens, 1, d]; computed once per
        step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [num_tokens, heads, d], k [num_tokens, kv_heads, d] -> rotated copies."""
    cos, sin = cos_sin
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
