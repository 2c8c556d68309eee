"""Rotary position embedding with a precomputed cos/sin table indexed by position, and the
rope scalings checkpoints use (`rope_parameters["rope_type"]`):

    default   inv_freq[i] = theta ** (-2i / d)
    linear    inv_freq / factor
    dynamic   NTK: theta grown with the sequence length past `max_position_embeddings`
    yarn      interpolated low frequencies, extrapolated high ones, a linear ramp between
              (`beta_fast` / `beta_slow` rotations); cos/sin scaled by the attention factor
    llama3    long wavelengths / factor, short ones kept, smoothed between
    longrope  per-frequency `short_factor` / `long_factor`; cos/sin scaled by the attention
              factor (`su` is its older name)

The two length-dependent scalings (dynamic, longrope) are computed per position, as
transformers computes them for a sequence whose newest token sits there: position p uses
the frequencies of length p + 1. A position's rotation thus never depends on the batch
around it (prefix caching, chunked prefill and recompute after preemption see the same
keys), and a prompt within `max_position_embeddings` (dynamic) / the original length
(longrope) followed by decoding matches transformers' `generate` exactly. (transformers
rotates a longer prompt's earlier tokens with the whole prompt's frequencies.)

`partial_rotary_factor` < 1 rotates only the first `rotary_dim` channels of each head.

M-RoPE (Qwen2-VL, `mrope_section` in the rope parameters): each token has three positions
(temporal, height, width; `vllm/multimodal/qwen2_vl.py`) and the channel pairs are cut into
three sections, each rotated by its own position: `MRotaryEmbedding`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_parameters_of(config) -> dict[str, Any]:
    """The config's rope parameters as one dict with `rope_type` and `rope_theta`
    (transformers' `rope_parameters`, or the older `rope_scaling` + `rope_theta`)."""
    params = dict(getattr(config, "rope_parameters", None)
                  or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)
    return params


def _theta_pow(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    """theta ** (2i / dim) for i < dim / 2 (each pair's wavelength / 2 pi); theta a number
    or a [P, 1] tensor (one theta per position)."""
    return theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    return 1.0 / _theta_pow(theta, dim)


def _require(params: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_type {params['rope_type']!r} needs {', '.join(missing)} in "
                         f"the config's rope parameters")


def _yarn(params: dict[str, Any], dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    theta, factor = params["rope_theta"], params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    # The channel pair that turns `rotations` times over the original length:
    # d * ln(L / (2 pi r)) / (2 ln theta); pairs below `low` extrapolate, above `high`
    # interpolate (/ factor), a linear ramp between.
    def channel(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(params.get("beta_fast") or 32), channel(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the extrapolated share
    wavelengths = _theta_pow(theta, dim)
    inv_freq = 1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept
    return inv_freq, float(attention)


def _llama3(params: dict[str, Any], dim: int) -> torch.Tensor:
    _require(params, "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings")
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def _longrope_attention(params: dict[str, Any], max_positions: int) -> float:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / original
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_table_freqs(params: dict[str, Any], head_dim: int, max_position_embeddings: int,
                     num_positions: int) -> tuple[torch.Tensor, float]:
    """(angles [num_positions, rotary_dim / 2] float32, the cos/sin scale) of rope
    `params` (`rope_parameters_of`): angle[p, i] = p * inv_freq_p[i]."""
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: "
                         f"{', '.join(ROPE_TYPES)}.")
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    theta = params["rope_theta"]
    positions = torch.arange(num_positions, dtype=torch.float32)[:, None]
    scale = 1.0
    if rope_type == "default":
        inv_freq = _base_inv_freq(theta, dim)
    elif rope_type == "linear":
        _require(params, "factor")
        inv_freq = _base_inv_freq(theta, dim) / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(params, dim)
    elif rope_type == "yarn":
        _require(params, "original_max_position_embeddings")
        inv_freq, scale = _yarn(params, dim, max_position_embeddings)
    elif rope_type == "dynamic":
        # Position p as the newest of p + 1 tokens: theta * (f (p+1) / L - (f - 1)) **
        # (d / (d - 2)), with p + 1 raised to at least L (shorter sequences: theta itself).
        _require(params, "factor")
        factor = params["factor"]
        lengths = (positions + 1).clamp(min=max_position_embeddings)
        ratio = (factor * lengths / max_position_embeddings) - (factor - 1)
        # The power in float64, rounded once: transformers takes it of one float32 scalar
        # (correctly rounded), where a vectorised float32 power may be an ulp off.
        grown = theta * (ratio.double() ** (dim / (dim - 2))).float()
        inv_freq = _base_inv_freq(grown, dim)  # [P, dim / 2]
    else:  # longrope: the long factors from the position past the original length on
        _require(params, "short_factor", "long_factor", "original_max_position_embeddings")
        original = params["original_max_position_embeddings"]
        wavelengths = _theta_pow(theta, dim)
        short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * wavelengths)
        long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * wavelengths)
        inv_freq = torch.where(positions + 1 > original, long, short)
        scale = _longrope_attention(params, max_position_embeddings)
    return positions * inv_freq, scale


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # [max_positions, rotary_dim] buffer, scaled, model dtype
    sin: torch.Tensor  # [max_positions, rotary_dim] buffer, scaled, model dtype

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype,
                 rope_parameters: dict[str, Any] | None = None) -> None:
        """`rope_parameters` (already in `rope_parameters_of`'s form) overrides the
        config's: a family whose layers rotate differently builds one table per kind."""
        super().__init__()
        params = rope_parameters or rope_parameters_of(config)
        max_embeddings = getattr(config, "max_position_embeddings", None) or max_positions
        freqs, scale = rope_table_freqs(params, head_dim, max_embeddings, max_positions)
        self.rotary_dim = freqs.shape[1] * 2
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows of the step's positions, [num_tokens, 1, rotary_dim];
        computed once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def mrope_section_of(config) -> list[int] | None:
    """The M-RoPE sections (channel pairs rotated by the temporal, height and width
    positions, in that order) of a config's rope parameters; None for a 1-D rotary."""
    section = rope_parameters_of(config).get("mrope_section")
    return list(section) if section else None


class MRotaryEmbedding(RotaryEmbedding):
    """The same table, read with three positions per token: channel pair i of section s
    (s = 0, 1, 2 cycling over `mrope_section`) takes its angle from position row s.

    Example: section [2, 3, 3] over 16 channels (8 pairs): pairs 0-1 follow the temporal
    row, 2-4 the height row, 5-7 the width row; channel c and c + 8 share pair c's angle.
    """

    section_rows: torch.Tensor  # [rotary_dim] int64: the position row of each channel

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype,
                 section: list[int]) -> None:
        super().__init__(config, head_dim, max_positions, dtype)
        if sum(section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {section} must add up to half the rotary "
                             f"dimension ({self.rotary_dim // 2}).")
        rows = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
        self.register_buffer("section_rows", torch.cat((rows, rows)), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, num_tokens] -> cos and sin rows [num_tokens, 1, rotary_dim]."""
        index = self.section_rows.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index)[0]
        sin = self.sin[positions].gather(0, index)[0]
        return cos.unsqueeze(1), sin.unsqueeze(1)


def rotary_embedding(config, head_dim: int, max_positions: int,
                     dtype: torch.dtype) -> RotaryEmbedding:
    """The config's rotary: M-RoPE where its rope parameters have `mrope_section`."""
    section = mrope_section_of(config)
    if section is None:
        return RotaryEmbedding(config, head_dim, max_positions, dtype)
    return MRotaryEmbedding(config, head_dim, max_positions, dtype, section)


def apply_rotary(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [num_tokens, heads, d], k [num_tokens, kv_heads, d] -> rotated copies (only the
    first rotary_dim channels where the table is narrower than the heads)."""
    cos, sin = cos_sin
    rotary_dim = cos.shape[-1]
    if rotary_dim < q.shape[-1]:
        q_rot, k_rot = apply_rotary(cos_sin, q[..., :rotary_dim], k[..., :rotary_dim])
        return (torch.cat((q_rot, q[..., rotary_dim:]), dim=-1),
                torch.cat((k_rot, k[..., rotary_dim:]), dim=-1))
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
