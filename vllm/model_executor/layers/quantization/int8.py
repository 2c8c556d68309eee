"""`quantization="int8"`: int8 weights per output channel, activations quantized per token
on the fly, multiplied by torch's int8 GEMM (`torch._int_mm`, VNNI on x86).

    x [M, K] float  --per-row absmax-->  x_q [M, K] int8, x_scale [M, 1]
    w [N, K] float  --per-row absmax-->  w_q^T [K, N] int8, w_scale [N]   (once, at load)
    y = _int_mm(x_q, w_q^T) [M, N] int32 * x_scale * w_scale (+ bias), in the model dtype

Why this kernel (2-core AVX-512 VNNI CPU, torch 2.13, one thread, the default model's 30
layers of qkv/o/gate_up/down with distinct weights so that they stream from memory; median
of 7; other jobs were running, so read the ratios):

    rows  fp32     bf16     fbgemm dynamic   _int_mm per-token   int8 weight-only  int4 (Q4_1)
    1     75 ms    53 ms    15 ms            29 ms               25 ms (bf16 x)    6.7 ms
    64    351 ms   162 ms   105 ms           120 ms              393 ms            330 ms

fbgemm's dynamic linear (`torch.ops.quantized.linear_dynamic`) is a little faster but
quantizes the activations per tensor: one scale for the whole batch, so a request's output
would depend on the other requests in its step; its API is also deprecated in torch 2.13.
`_int_mm` with our own per-token scales is per token as asked, and batch-independent. The
weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) dequantize to
bfloat16 and lose at 64 rows. The quantize/dequantize around `_int_mm` are a handful of
elementwise ops, the part a compiled graph fuses.

Without VNNI (an AVX2 processor), `_int_mm` is a reference loop: one request of the default
model ran at half float32's speed and 64 requests for minutes. There the product is the
native `int8_mm` (csrc/cpu/int8_mm.cpp: `vpmaddubsw` + `vpmaddwd` over weights packed in
tiles of 16 columns at load), whose int32 sums equal `_int_mm`'s exactly, so a model gives
the same bits with either. `VLLM_CPU_INT8_FORM=q8_0` takes GGUF Q8_0 blocks instead (int8
per 32 weights with a float16 scale, multiplied by `gguf_mm`; `int8_form`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "gguf")
# `quantization="none"`: every tensor widened to the model dtype at load (a GGUF file's
# blocks included, which otherwise stay in their types).
NO_QUANTIZATION = "none"

# "q8_0" or "int_mm": the int8 kernel regardless of the processor (`int8_kernel`).
FORM_ENV = "VLLM_CPU_INT8_FORM"
# Flags under which torch's int8 GEMM has integer dot-product instructions to run on.
_INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def int8_form(in_features: int) -> str:
    """Which int8 kernel a layer takes: "int_mm" (`Int8Linear`: torch's `_int_mm` where the
    processor has int8 dot products, else the native `int8_mm`), or "q8_0" (Q8_0 blocks
    through `gguf_mm`) where `VLLM_CPU_INT8_FORM` asks for it and the inputs are whole
    blocks of 32.

    A row-parallel shard (`in_features` its slice) chooses alike. `int_mm`'s int32 sums
    over the ranks are one rank's exactly; Q8_0's blocks are the whole row's blocks (the
    slice is whole blocks of 32), and only the float sum over the ranks differs."""
    from vllm.model_executor.layers.quantization.gguf_blocks import gguf_mm_available

    forced = os.environ.get(FORM_ENV)
    if forced not in (None, "", "q8_0", "int_mm"):
        raise ValueError(f"{FORM_ENV}={forced!r}: expected 'q8_0' or 'int_mm'")
    if forced == "q8_0" and in_features % 32 == 0 and gguf_mm_available():
        return "q8_0"
    return "int_mm"


def has_int8_dot(flags: frozenset[str] | None = None) -> bool:
    """Whether the processor (`flags`: /proc/cpuinfo's, by default) has integer dot-product
    instructions for torch's int8 GEMM to run on; without them `_int_mm` is a reference loop."""
    if flags is None:
        from vllm.platforms.cpu import read_cpu_flags

        flags = read_cpu_flags()
    return any(f in flags for f in _INT8_DOT_FLAGS)


class Int8Weights(NamedTuple):
    """One `Int8Linear` weight as the fused CPU decoder reads it: `int8_mm`'s packed tiles,
    the rows' float32 scales [N] and the input width K."""

    packed: torch.Tensor
    scale: torch.Tensor
    in_features: int


@functools.cache
def native_int8_mm() -> Any:
    """The native kernels' module where `Int8Linear` multiplies by its `int8_mm` (the
    processor has no int8 dot products for `_int_mm`, and the kernel was built), else None."""
    if has_int8_dot():
        return None
    from vllm._custom_ops import cpu_ops

    ops = cpu_ops()
    return ops if ops is not None and ops.int8_mm_available() else None


def int8_kernel(linear, weight_absmax: Callable[[], torch.Tensor | None] = lambda: None
                ) -> tuple[nn.Module, str]:
    """The int8 kernel of `linear` (anything with `nn.Linear`'s weight, bias and sizes) and
    its name (see `int8_form`). `weight_absmax`: a row-parallel shard's whole rows' absmax,
    which the `_int_mm` form scales by; called only for that form (it all-reduces over the
    ranks, which all take the same form), since a Q8_0 shard's blocks are its whole rows'."""
    if int8_form(linear.in_features) == "q8_0":
        from vllm.model_executor.layers.quantization.gguf_blocks import (
            GGUFBlockLinear,
            GGUFBlocks,
            quantize_q8_0,
        )

        blocks = GGUFBlocks(quantize_q8_0(linear.weight).numpy(), "Q8_0", linear.in_features)
        return GGUFBlockLinear([blocks], linear.bias), "int8 as Q8_0"
    return Int8Linear(linear, weight_absmax()), "int8"


def quantize_per_channel(weight: torch.Tensor, absmax: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: weight [N, K] -> (int8 [N, K], float32 scale [N]).
    `absmax` [N] overrides the rows' own (a row-parallel shard uses its whole row's).

    Example: row [0.5, -1.0, 0.25] -> scale 1/127, values [64, -127, 32].
    """
    if absmax is None:
        absmax = weight.float().abs().amax(dim=1)
    scale = absmax.clamp(min=1e-8) / 127.0
    q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_per_token(x: torch.Tensor, absmax: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of activations: x [M, K] -> (int8 [M, K], float32 [M, 1]).
    `absmax` [M, 1] overrides the rows' own (a row-parallel shard uses its whole row's)."""
    x = x.float()
    if absmax is None:
        absmax = x.abs().amax(dim=-1, keepdim=True)
    scale = absmax.clamp(min=1e-8) / 127.0
    return torch.round(x / scale).to(torch.int8), scale


def dequantize_output(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """int32 accumulators [M, N] -> the model dtype, scaled per token and per channel."""
    return (acc.float() * (x_scale * weight_scale)).to(dtype)


class _Fused:
    """`fn` compiled with a dynamic row count, made at its first eager call.

    Steps that run eagerly (`enforce_eager`, models without graph support) would otherwise
    pay ~5 separate passes over the activations to quantize and ~3 to dequantize; compiled,
    each is one fused loop. Inside a captured graph, dynamo inlines `fn` into the graph
    being compiled. Compiling at the first call, not at import, keeps `torch._dynamo` (about
    a second of imports) out of every process that never runs int8 layers."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.compiled: Callable | None = None

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
        return self.compiled(*args)


_quantize_fused = _Fused(quantize_per_token)
_dequantize_fused = _Fused(dequantize_output)


class Int8Linear(nn.Module):
    """int8 weights per output channel: a linear layer's kernel under `quantization="int8"`
    (every layer but the vocabulary projection, which stays in the model dtype: see the
    README's drift table). Built from anything with `nn.Linear`'s weight, bias and sizes.
    The weight is `weight_t` [K, N] for `_int_mm`, or `int8_mm`'s packed tiles
    (`weight_packed`) where that native kernel replaces torch's reference loop."""

    weight_t: torch.Tensor  # [K, N] int8 buffer, for `_int_mm`
    weight_packed: torch.Tensor  # int8_mm's tiles (`pack_int8_weight`), for the native kernel
    weight_scale: torch.Tensor  # [N] float32 buffer

    def __init__(self, linear, weight_absmax: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_per_channel(linear.weight.data, weight_absmax)
        ops = native_int8_mm()
        self.native = ops is not None
        if ops is not None:
            self.register_buffer("weight_packed", ops.pack_int8_weight(q))
        else:
            self.register_buffer("weight_t", q.t().contiguous())  # [K, N] int8
        self.register_buffer("weight_scale", scale)  # [N] float32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data,
                                                                  requires_grad=False)

    def _int32_product(self, x_q: torch.Tensor) -> torch.Tensor:
        """x_q [M, K] int8 times the weight: int32 [M, N], the same on either kernel."""
        if self.native:
            return torch.ops.vllm_cpu.int8_mm(x_q, self.weight_packed, self.out_features)
        # torch exports `_int_mm` at run time; its stubs do not list it.
        return torch._int_mm(x_q, self.weight_t)  # pyright: ignore[reportPrivateImportUsage]

    def fused_decode_weights(self) -> Int8Weights | None:
        """The weight as the fused decoder reads it: `int8_mm`'s tiles (the native kernel
        only; with VNNI the decoder is left to the graphs' `_int_mm`)."""
        if not self.native:
            return None
        return Int8Weights(self.weight_packed, self.weight_scale, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        x_q, x_scale = _quantize_fused(x2)
        y = _dequantize_fused(self._int32_product(x_q), x_scale, self.weight_scale, x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def forward_sharded(self, x: torch.Tensor, group) -> torch.Tensor:
        """A row-parallel shard's product summed over `group` (a `GroupCoordinator`),
        equal to one rank's: each token is quantized with its whole row's absmax (one
        max-reduce), and the int32 accumulators are summed exactly before scaling. The
        weight was quantized with its whole rows' absmax (`weight_absmax`)."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        absmax = group.all_reduce_max(x2.float().abs().amax(dim=-1, keepdim=True))
        x_q, x_scale = _quantize_fused(x2, absmax)
        acc = group.all_reduce(self._int32_product(x_q))
        y = _dequantize_fused(acc, x_scale, self.weight_scale, x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
