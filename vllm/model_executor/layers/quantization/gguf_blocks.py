"""`quantization="gguf"`: a GGUF file's block-quantized tensors served quantized instead of
dequantized at load.

Two kernels:

- `gguf_mm` (`csrc/cpu/gguf_mm.cpp`, `GGUFBlockLinear`) reads every block type of
  `GGUF_MM_TYPES` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and the K-quants Q2_K..Q6_K, IQ4_XS)
  in place, as the file stores it, at every step size: the layer keeps no dense copy, so
  its resident bytes are the file's (Q5_0 rows are rearranged at load in the same bytes:
  `GGUFBlockLinear`'s `repack`). A fused layer whose parts differ in type (a Q4_K_M
  file's Q5_0 q and k with a Q8_0 v) keeps each part in its own type.
- `quant_gemv` (`GGUFLinear`) reads Q4_0, Q4_1 and Q8_0 repacked (below), and the fused
  decoder reads the same buffers. Only the decoder layers of a model that decoder may run,
  where a layer's parts are all of one of those types (the default model's), take it;
  every other layer, the LM head and embedding tables take `gguf_mm` (`gguf_dequantize` for
  looked-up rows).

Neither keeps a dense copy. `gguf_mm` multiplies steps of `gguf_mm_dense_rows` rows or
more (64 for blocks of 32, 128 for super-blocks) by the weight dequantized a tile at a time
with MKL's sgemm, the activations unquantized, where that outruns its integer products (a
request's numerics may therefore differ slightly between small and large steps);
quant_gemv's integer products ran ahead of or level with float32 sgemm at every step size
measured (1 to 1,024 rows), so it takes every step, in passes of 32 rows.

`BlockCodes` (quant_gemv's reading of the three 32-weight types):

    Q4_0: fp16 d, 16 bytes of nibbles            w = d * (q - 8)
    Q4_1: fp16 d, fp16 m, 16 bytes of nibbles    w = d * q + m
    Q8_0: fp16 d, 32 int8                        w = d * q
    nibbles: value j < 16 is byte j's low half, value 16 + j its high half

All three read as unsigned codes `u` with w = d * u + m per block: Q4_0 has m = -8d, Q8_0
stores u = q + 128 with m = -128d, all exact in float16. quant_gemv quantizes the
activations to int8 per row and block of 32, as llama.cpp does, and takes integer dot
products against the codes (AVX-512 VNNI or AVX2); measured against torch's int4 kernel
(`benchmarks/benchmark_gguf_kernels.py`): 1.1-1.55x at 1-8 rows. Without it, torch's CPU
int4 kernel (`_weight_int4pack_mm_for_cpu`) takes the 4-bit types (scale d, zero m + 8d,
both rounded to bfloat16) for steps of up to `MAX_ROWS` tokens and a dense copy the larger
ones; 8-bit codes stay dense there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Union

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:  # int8.py imports this module (lazily): a name for annotations only
    from vllm.model_executor.layers.quantization.int8 import Int8Weights

logger = logging.getLogger(__name__)

GROUP = 32
# Steps of at most this many tokens (decode steps, a speculative verification step's k + 1)
# are the fused decoder's, and without the native kernel torch's int4 kernel's (larger ones
# take the dense weight there). quant_gemv keeps 8 rows in registers and runs more in
# passes over cached tiles of the weight, and past 32 rows in passes of 32.
MAX_ROWS = 16
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BLOCK_TYPES = tuple(_BLOCK_BYTES)  # the types `BlockCodes` (quant_gemv) reads
_BLOCK_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}

# The types `gguf_mm` reads in place: name -> (ggml type id, values a block, bytes a block).
GGUF_MM_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34), "IQ4_NL": (20, 32, 18), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
    "IQ4_XS": (23, 256, 136),
}
_LAYOUT_BY_ID = {type_id: (values, size) for type_id, values, size in GGUF_MM_TYPES.values()}


def block_layout(type_id: int) -> tuple[int, int]:
    """(values, bytes) of one block of the ggml type `type_id`."""
    return _LAYOUT_BY_ID[type_id]


class GGUFBlocks:
    """One GGUF tensor's rows as the file stores them: `data` uint8 [N, bytes per row] of
    block type `type_name`, `k` inputs a row (rows in HF order)."""

    def __init__(self, data: np.ndarray, type_name: str, k: int) -> None:
        if type_name not in GGUF_MM_TYPES:
            raise ValueError(f"no kernel reads GGUF {type_name} blocks")
        _, values, size = GGUF_MM_TYPES[type_name]
        if k % values or data.ndim != 2 or data.shape[1] != k // values * size:
            raise ValueError(f"{type_name} rows of {data.shape[-1]} bytes do not hold {k} "
                             f"values (blocks of {values} in {size} bytes)")
        self.data, self.type_name, self.k = data, type_name, k

    @property
    def type_id(self) -> int:
        return GGUF_MM_TYPES[self.type_name][0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.k

    @property
    def legacy_bits(self) -> int | None:
        """The bits of this type's `BlockCodes` where `quant_gemv` reads it, else None."""
        return _BLOCK_BITS.get(self.type_name)

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks:
        """Rows (dim 0) or columns (dim 1, whole blocks only) [start, start + length), as
        a tensor-parallel rank keeps them."""
        if dim == 0:
            return GGUFBlocks(self.data[start:start + length], self.type_name, self.k)
        _, values, size = GGUF_MM_TYPES[self.type_name]
        if start % values or length % values:
            raise ValueError(f"columns {start}..{start + length} split a {self.type_name} "
                             f"block of {values}")
        first = start // values * size
        return GGUFBlocks(self.data[:, first:first + length // values * size],
                          self.type_name, length)

    def permute_rows(self, rows: np.ndarray) -> GGUFBlocks:
        return GGUFBlocks(self.data[rows], self.type_name, self.k)

    def pad_rows(self, num_rows: int) -> GGUFBlocks:
        """Zero rows (all-zero blocks: weights 0 in every type) up to `num_rows`."""
        extra = num_rows - self.data.shape[0]
        return GGUFBlocks(np.pad(self.data, ((0, extra), (0, 0))), self.type_name, self.k)

    def to_block_codes(self) -> BlockCodes:
        """The `BlockCodes` `quant_gemv` reads (a `BLOCK_TYPES` type only)."""
        return read_block_codes(self.data, self.type_name, self.k)

    def dequantize(self) -> np.ndarray:
        import gguf

        kind = gguf.GGMLQuantizationType[self.type_name]
        return np.asarray(gguf.quants.dequantize(self.data, kind), np.float32).reshape(
            self.shape)


class BlockCodes:
    """One weight's codes `u` [N, K] (uint8; 0..15 for 4 bits) with per-block `d` and `m`
    [N, K / 32] (float32): w = d * u + m."""

    def __init__(self, u: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int) -> None:
        self.u, self.d, self.m, self.bits = u, d, m, bits

    def permute_rows(self, rows: np.ndarray) -> BlockCodes:
        return BlockCodes(self.u[rows], self.d[rows], self.m[rows], self.bits)

    @property
    def shape(self) -> tuple[int, int]:
        return self.u.shape  # type: ignore[return-value]

    def narrow(self, dim: int, start: int, length: int) -> BlockCodes:
        """Rows (dim 0) or columns (dim 1, whole blocks only) [start, start + length), as
        a tensor-parallel rank keeps them."""
        if dim == 0:
            rows = slice(start, start + length)
            return BlockCodes(self.u[rows], self.d[rows], self.m[rows], self.bits)
        if start % GROUP or length % GROUP:
            raise ValueError(f"columns {start}..{start + length} split a block of {GROUP}")
        blocks = slice(start // GROUP, (start + length) // GROUP)
        return BlockCodes(self.u[:, start:start + length], self.d[:, blocks],
                          self.m[:, blocks], self.bits)

    def pad_rows(self, num_rows: int) -> BlockCodes:
        """Zero rows (d = m = 0: weights 0) up to `num_rows` (a padded vocabulary)."""
        extra = num_rows - self.u.shape[0]
        u, d, m = (np.pad(a, ((0, extra), (0, 0))) for a in (self.u, self.d, self.m))
        return BlockCodes(u, d, m, self.bits)

    @staticmethod
    def concat(parts: list[BlockCodes]) -> BlockCodes | None:
        """The row-wise concatenation, or None when the parts differ in bits."""
        if len({p.bits for p in parts}) != 1:
            return None
        u, d, m = (np.concatenate([getattr(p, a) for p in parts]) for a in ("u", "d", "m"))
        return BlockCodes(u, d, m, parts[0].bits)

    def dequantize(self) -> np.ndarray:
        n, k = self.u.shape
        blocks = self.u.reshape(n, k // GROUP, GROUP).astype(np.float32)
        return (blocks * self.d[..., None] + self.m[..., None]).reshape(n, k)


def read_block_codes(data: np.ndarray, type_name: str, k: int) -> BlockCodes:
    """Codes of a GGUF Q4_0 / Q4_1 / Q8_0 tensor from its raw bytes `data` [N, bytes per
    row]."""
    block_bytes = _BLOCK_BYTES[type_name]
    rows = data.reshape(data.shape[0], k // GROUP, block_bytes)
    d = np.ascontiguousarray(rows[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        q = np.ascontiguousarray(rows[..., 2:]).view(np.int8).reshape(data.shape[0], k)
        return BlockCodes((q.astype(np.int16) + 128).astype(np.uint8), d, -128 * d, 8)
    nibbles = rows[..., block_bytes - 16:]
    u = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(data.shape[0], k)
    if type_name == "Q4_0":
        return BlockCodes(u, d, -8 * d, 4)
    m = np.ascontiguousarray(rows[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    return BlockCodes(u, d, m, 4)


def _native_kernel():
    """The `quant_gemv` op where the native CPU kernels were built with it, else None."""
    from vllm._custom_ops import cpu_ops

    ops = cpu_ops()
    return ops if ops is not None and ops.quant_gemv_available() else None


class QuantGemvWeights(NamedTuple):
    """One weight as `quant_gemv` reads it (the buffers of a "quant_gemv" `GGUFLinear`)."""

    codes: torch.Tensor  # packed block codes (`pack_block_codes`)
    d: torch.Tensor  # [out_features, padded blocks] float16 scales
    m: torch.Tensor  # [out_features, padded blocks] float16 offsets
    bits: int  # 4 or 8


class GGUFBlockWeights(NamedTuple):
    """One weight as `gguf_mm` reads it (a `GGUFBlockLinear`'s): consecutive row parts,
    each uint8 [rows, row bytes] in its ggml block type."""

    parts: list[torch.Tensor]
    types: list[int]


# A weight as the fused CPU decoder reads it (`Int8Weights`: an `Int8Linear`'s, int8.py).
FusedWeights = Union[QuantGemvWeights, GGUFBlockWeights, "Int8Weights"]


def row_switch_tokens(module: nn.Module) -> int:
    """The most tokens at which a layer of `module` picks its kernel by row count:
    `MAX_ROWS` where it holds a `GGUFLinear`, else 0."""
    return MAX_ROWS if any(isinstance(m, GGUFLinear) for m in module.modules()) else 0


class GGUFLinear(nn.Module):
    """A `nn.Linear` whose weight lives as GGUF block codes: `quant_gemv` at every step size
    (no dense copy), or without the native kernel torch's int4 kernel up to `MAX_ROWS`
    tokens and the dense weight above."""

    # Buffers of the "quant_gemv" kernel: packed `codes`, float16 scales `d` and `m`.
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    # Buffers of the "int4pack" kernel: `packed` codes, `scale_zero` [K/32, N, 2] bfloat16.
    packed: torch.Tensor
    scale_zero: torch.Tensor

    def __init__(self, linear, codes: BlockCodes, native: bool = True,
                 dense: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        n, k = codes.u.shape
        if (n, k) != (self.out_features, self.in_features) or k % GROUP:
            raise ValueError(f"block codes of shape {(n, k)} do not fit a linear layer of "
                             f"{(self.out_features, self.in_features)} (in % 32 must be 0).")
        self.bias = linear.bias
        self.bits = codes.bits
        # Large steps of the int4 kernel: `dense()` (a parallel layer builds its dense
        # kernel), else `linear`; None where quant_gemv takes every step.
        self.dense: nn.Module | None = None
        ops = _native_kernel() if native else None
        if ops is not None:
            self.kernel = "quant_gemv"
            # Whole quads of blocks and at most one half quad; padding blocks: d = m = 0.
            padded = -(-k // 64) * 64
            u = np.zeros((n, padded), np.uint8)
            u[:, :k] = codes.u
            d, m = (np.pad(a, ((0, 0), (0, (padded - k) // GROUP))).astype(np.float16)
                    for a in (codes.d, codes.m))
            if not (np.isfinite(d).all() and np.isfinite(m).all()):
                raise ValueError("block scales overflow float16")
            self.register_buffer("codes", ops.pack_block_codes(torch.from_numpy(u),
                                                               codes.bits))
            self.register_buffer("d", torch.from_numpy(d))
            self.register_buffer("m", torch.from_numpy(m))
        elif codes.bits == 4 and n % 16 == 0:
            self.kernel = "int4pack"
            q = torch.from_numpy(codes.u.astype(np.int32))
            # The aten op behind `torch._convert_weight_to_int4pack_for_cpu`, which torch's
            # stubs do not export.
            self.register_buffer("packed",
                                 torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            scale_zero = np.stack([codes.d.T, (codes.m + 8 * codes.d).T], axis=-1)  # [K/32, N, 2]
            self.register_buffer("scale_zero", torch.from_numpy(
                np.ascontiguousarray(scale_zero)).to(torch.bfloat16))
            self.dense = dense() if dense is not None else linear
        else:
            raise ValueError(f"no kernel for {codes.bits}-bit block codes of shape {(n, k)} "
                             "on this machine")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "quant_gemv":
            y = torch.ops.vllm_cpu.quant_gemv(x, self.codes, self.d, self.m, self.bits)
        elif x.shape[0] > MAX_ROWS:
            assert self.dense is not None
            return self.dense(x)
        else:
            # torch exports this private op at run time; its stubs do not list it.
            y = torch._weight_int4pack_mm_for_cpu(  # pyright: ignore[reportPrivateImportUsage]
                x.to(torch.bfloat16), self.packed, GROUP, self.scale_zero).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def quant_gemv_weights(self) -> QuantGemvWeights | None:
        """The block codes `quant_gemv` reads, where this layer runs that kernel."""
        if self.kernel != "quant_gemv":
            return None
        return QuantGemvWeights(self.codes, self.d, self.m, self.bits)

    def extra_repr(self) -> str:
        steps = "every step" if self.dense is None else f"up to {MAX_ROWS} rows"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.bits}-bit {self.kernel} {steps}")


def gguf_mm_available() -> bool:
    """Whether the native `gguf_mm` kernel was built on this machine."""
    from vllm._custom_ops import cpu_ops

    ops = cpu_ops()
    return ops is not None and ops.gguf_mm_available()


class GGUFBlockLinear(nn.Module):
    """A linear layer multiplying by GGUF blocks as the file stores them (`gguf_mm`) at
    every step size, with no dense copy. Its parts are consecutive output rows, each in its
    own block type (a fused q/k/v whose v is Q8_0 and q, k Q5_0).

    `repack`: parts of a type `gguf_mm` reads faster rearranged take that form, in the same
    bytes and with the same values (`gguf_repack`: Q5_0 rows of at least 256 values as
    super-blocks of 8 blocks, type id 1006; the one-row product over Gemma 3 270M's Q5_0
    gate/up shapes 18 -> 24 GB/s on 2 Zen 3 cores). Off where the blocks are shared with a
    reader of the file's layout (a tied LM head's embedding lookup)."""

    def __init__(self, parts: list[GGUFBlocks], bias: torch.Tensor | None,
                 repack: bool = True) -> None:
        super().__init__()
        if len({p.k for p in parts}) != 1:
            raise ValueError("the parts of a fused GGUF weight differ in inputs")
        self.in_features = parts[0].k
        self.out_features = sum(p.shape[0] for p in parts)
        self.types = [p.type_id for p in parts]
        self.type_names = [p.type_name for p in parts]
        # Copies: the file's pages are a read-only map (a row-permuted part is a copy anyway).
        self.weights = [torch.from_numpy(np.array(p.data, order="C")) for p in parts]
        if repack and gguf_mm_available():
            from vllm._custom_ops import cpu_ops

            ops = cpu_ops()
            assert ops is not None
            for i, (w, t) in enumerate(zip(self.weights, self.types)):
                self.weights[i], self.types[i] = ops.gguf_repack(w, t)
        for i, w in enumerate(self.weights):
            self.register_buffer(f"blocks{i}", w, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = [torch.ops.vllm_cpu.gguf_mm(x, w, t) for w, t in zip(self.weights, self.types)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if self.bias is None else y + self.bias

    def fused_decode_weights(self) -> GGUFBlockWeights:
        """The blocks (the fused decoder adds the layer's bias itself)."""
        return GGUFBlockWeights(self.weights, self.types)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{'+'.join(self.type_names)} gguf_mm")


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Rows [..., K] (K a multiple of 32) as GGUF Q8_0 blocks, uint8 [..., K / 32 * 34]:
    each 32 values' scale d = absmax / 127 (float16) and the values round(w / d) as int8.

    Example: a block whose largest magnitude is 2.54 gets d = 0.02; 1.0 -> code 50.
    """
    *lead, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 values, got {k}")
    w = weight.float().reshape(-1, k // 32, 32)
    d = w.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.round(w / torch.where(d == 0, 1, d)).to(torch.int8)
    blocks = torch.cat([d.half().view(torch.uint8), codes.view(torch.uint8)], dim=-1)
    return blocks.reshape(*lead, k // 32 * 34)
