"""`quantization="gguf"`: a GGUF file's 4-bit tensors (Q4_0, Q4_1) served as 4-bit weights
instead of dequantized at load, through torch's CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`: groups of 32 along the input, bfloat16 activations).

GGUF block layouts (32 weights each, along the input dimension):

    Q4_0: fp16 d, 16 bytes of nibbles            w = d * (q - 8)
    Q4_1: fp16 d, fp16 m, 16 bytes of nibbles    w = d * q + m
    nibbles: value j < 16 is byte j's low half, value 16 + j its high half

torch's kernel computes w = (q - 8) * scale + zero per group, so Q4_0 is scale d, zero 0,
and Q4_1 is scale d, zero m + 8d (the only rounding: scale and zero are bfloat16).

Why only for small steps: one decode token streams every weight once, and 4 bits per
weight (plus a scale and zero per 32) read a quarter of the bytes of bfloat16, so a
single request runs several times faster (`benchmarks/benchmark_throughput.py --single`).
A step of many tokens is compute-bound, where the dense bfloat16 matmul is faster, so
`Int4Linear` keeps both: rows <= `INT4_MAX_ROWS` take the int4 kernel, larger steps the
dense weight dequantized at load (vLLM's GGUF path switches kernels by batch size the same
way). A request's numerics may therefore differ slightly between small and large steps.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

GROUP = 32
INT4_MAX_ROWS = 8  # steps of at most this many tokens use the int4 kernel


class Int4Codes:
    """One weight's 4-bit codes `q` [N, K] (uint8 0..15) with per-group `scale` and `zero`
    [N, K / 32] (float32) such that w = (q - 8) * scale + zero."""

    def __init__(self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> None:
        self.q, self.scale, self.zero = q, scale, zero

    def permute_rows(self, rows: np.ndarray) -> Int4Codes:
        return Int4Codes(self.q[rows], self.scale[rows], self.zero[rows])

    @staticmethod
    def concat(parts: list[Int4Codes]) -> Int4Codes:
        return Int4Codes(*(np.concatenate([getattr(p, a) for p in parts])
                           for a in ("q", "scale", "zero")))


def read_q4_codes(data: np.ndarray, type_name: str, k: int) -> Int4Codes:
    """Codes of a GGUF Q4_0 / Q4_1 tensor from its raw bytes `data` [N, bytes per row]."""
    block_bytes = {"Q4_0": 18, "Q4_1": 20}[type_name]
    rows = data.reshape(data.shape[0], k // GROUP, block_bytes)
    d = np.ascontiguousarray(rows[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    nibbles = rows[..., block_bytes - 16:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(data.shape[0], k)
    if type_name == "Q4_0":
        zero = np.zeros_like(d)
    else:
        m = np.ascontiguousarray(rows[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    return Int4Codes(q, d, zero)


class Int4Linear(nn.Module):
    """A `nn.Linear` whose weight also lives as int4 codes: small steps take the int4
    kernel, large ones the dense weight."""

    def __init__(self, linear: nn.Linear, codes: Int4Codes) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        n, k = codes.q.shape
        if (n, k) != (self.out_features, self.in_features) or k % GROUP or n % 16:
            raise ValueError(f"int4 codes of shape {(n, k)} do not fit a linear layer of "
                             f"{(self.out_features, self.in_features)} (the kernel needs "
                             "in % 32 == 0 and out % 16 == 0).")
        self.dense = linear  # large steps (may become a `PackedLinear` at load)
        q = torch.from_numpy(codes.q.astype(np.int32))
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        scale_zero = np.stack([codes.scale.T, codes.zero.T], axis=-1)  # [K/32, N, 2]
        self.register_buffer("scale_zero", torch.from_numpy(
            np.ascontiguousarray(scale_zero)).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT4_MAX_ROWS:
            return self.dense(x)
        y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP,
                                              self.scale_zero).to(x.dtype)
        return y if self.dense.bias is None else y + self.dense.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 up to {INT4_MAX_ROWS} rows")


def apply_int4_codes(model: nn.Module, codes: dict[str, Int4Codes]) -> int:
    """Swaps each linear layer whose full weight has codes (`codes` keyed by parameter
    name, fused layers already concatenated) for an `Int4Linear`; returns the count."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or f"{name}.weight" not in codes:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int4Linear(module, codes[f"{name}.weight"]))
        swapped += 1
    logger.info("GGUF 4-bit weights kept for %d linear layers (int4 kernel up to %d rows "
                "per step, dense bfloat16 above).", swapped, INT4_MAX_ROWS)
    return swapped
