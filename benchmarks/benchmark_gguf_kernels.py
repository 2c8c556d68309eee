"""The GGUF block kernels of `quantization="gguf"` on the default model's shapes, side by side
in one run: the native `quant_gemv` against torch's CPU int4 kernel and the dense bfloat16
and float32 matmuls for the Q4_1 layers, and against the dense bfloat16 matmul for the Q8_0
vocabulary projection. Past 8 rows quant_gemv runs in passes over cached tiles of the
weight, past 32 in passes of 32 rows; `GGUFLinear` takes it at every step size (no dense
copy), which the float32 column (an AVX2 machine's dtype) is there to check.

Every weight is distinct (30 layers' worth per shape), so that they stream from memory as
in decoding rather than sit in cache. Prints milliseconds per decode step's worth of calls
and the ratio (torch / ours: above 1 means the native kernel is faster).

    python benchmarks/benchmark_gguf_kernels.py [--rows 1 2 4 8 9 16 32] [--layers 30]
        [--full-quads]

`--full-quads` pads every input to whole quads of blocks (576 -> 640 columns, the
activations zero-padded to match), the layout before half quads, for comparison.

`--dense` instead times `gguf_mm`'s two forms for large steps on Gemma 3 270M's layer
shapes, per block type: the integer products (activations quantized per group of 32) and
the weight dequantized a tile at a time into MKL's float32 sgemm; the step size where the
second starts winning is `gguf_mm_dense_rows(type)` (VLLM_CPU_GGUF_DENSE_ROWS), printed last.

    python benchmarks/benchmark_gguf_kernels.py --dense [--rows 16 32 64 128 1024]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np
import torch

from vllm._custom_ops import cpu_ops
from vllm.model_executor.layers.quantization.gguf_blocks import GGUF_MM_TYPES

# SmolLM2-135M: fused q/k/v, o, fused gate/up, down; (out, in).
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
VOCAB_SHAPE = (49152, 576)


def best_ms(fn, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


# Gemma 3 270M's layers as its Q4_K_M file stores them: (type, out, in); its Q5_0 rows as
# the engine keeps them (rearranged at load, `gguf_repack`), its Q8_0 vocabulary projection
# (the LM head) and SmolLM2's.
DENSE_SHAPES = [("Q5_0", 2048, 640), ("Q5_0 rearranged", 2048, 640), ("Q8_0", 256, 640),
                ("Q4_K", 640, 1024), ("Q6_K", 640, 2048), ("Q4_0", 2048, 640),
                ("Q4_1", 2048, 640), ("Q8_0", 262144, 640), ("Q8_0", 49152, 576)]
# Where each type keeps float16 scales (byte offsets in a block): given small finite values.
_HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2],
                 "Q6_K": [208]}


def random_blocks(type_name: str, n: int, k: int) -> tuple[torch.Tensor, int]:
    """Random blocks of a type with small finite scales; "T rearranged": as gguf_repack
    keeps them."""
    if type_name.endswith(" rearranged"):
        blocks, type_id = random_blocks(type_name.split()[0], n, k)
        return cpu_ops().gguf_repack(blocks, type_id)
    type_id, values, size = GGUF_MM_TYPES[type_name]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for offset in _HALF_OFFSETS[type_name]:
        scales = rng.uniform(-0.02, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(n, -1)), type_id


def dense_forms(ops, rows_list: list[int]) -> None:
    """gguf_mm's integer products against its dequantize-and-sgemm form, per type."""
    print(f"{torch.get_num_threads()} threads; per step size: integer ms, dense ms, ratio "
          f"(best of 3; above 1: the dense form is faster); last: gguf_mm_dense_rows(type)")
    print("type            out    x in    " + "".join(f"{rows:>22d}" for rows in rows_list))
    try:
        for type_name, n, k in DENSE_SHAPES:
            w, type_id = random_blocks(type_name, n, k)
            cells = []
            for rows in rows_list:
                x = torch.randn(rows, k)
                times = []
                for setting in (0, 1):  # 0: never dense; 1: dense from one row
                    ops.set_gguf_mm_dense_rows(setting)
                    call = partial(torch.ops.vllm_cpu.gguf_mm, x, w, type_id)
                    times.append(best_ms(call, repeats=3))
                cells.append(f"{times[0]:7.2f} {times[1]:7.2f} {times[0] / times[1]:5.2f}")
            ops.set_gguf_mm_dense_rows(-1)
            print(f"{type_name:15s} {n:6d} x {k:4d} " + "".join(f"{c:>22s}" for c in cells)
                  + f"  {ops.gguf_mm_dense_rows(type_id)}")
    finally:
        ops.set_gguf_mm_dense_rows(-1)  # the defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--full-quads", action="store_true",
                        help="pad inputs to multiples of 128 (no half quads)")
    parser.add_argument("--dense", action="store_true",
                        help="gguf_mm's integer and dequantize-and-sgemm forms, large steps")
    args = parser.parse_args()
    ops = cpu_ops()
    if args.dense:
        if ops is None or not ops.gguf_mm_available():
            raise SystemExit("gguf_mm is not available here (native kernels or AVX2 missing)")
        dense_forms(ops, args.rows or [16, 32, 48, 64, 96, 128, 256, 1024])
        return
    args.rows = args.rows or [1, 2, 4, 8, 9, 16, 32]
    if ops is None or not ops.quant_gemv_available():
        raise SystemExit("quant_gemv is not available here (native kernels or AVX-512 VNNI "
                         "missing)")
    torch.manual_seed(0)

    multiple = 128 if args.full_quads else 64

    def width(k: int) -> int:
        """The activations' width: k, or k padded to whole quads with --full-quads."""
        return -(-k // multiple) * multiple if args.full_quads else k

    def native_weight(u: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
        """Codes padded as `GGUFLinear` lays them out (or to whole quads), random d, m."""
        n, k = u.shape
        padded = torch.zeros(n, -(-k // multiple) * multiple, dtype=torch.uint8)
        padded[:, :k] = u
        blocks = padded.shape[1] // 32
        return (ops.pack_block_codes(padded, bits), torch.rand(n, blocks).half(),
                torch.rand(n, blocks).half())

    ours, theirs, dense_layers, float_layers = [], [], [], []
    for n, k in LAYER_SHAPES:
        for _ in range(args.layers):
            u = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            ours.append((*native_weight(u, 4), width(k)))
            theirs.append((torch._convert_weight_to_int4pack_for_cpu(u.int(), 1),
                           torch.rand(k // 32, n, 2).bfloat16(), k))
            dense_layers.append((torch.randn(n, k, dtype=torch.bfloat16), k))
            float_layers.append((torch.randn(n, k), k))
    n, k = VOCAB_SHAPE
    vocab_q8 = native_weight(torch.randint(0, 256, (n, k), dtype=torch.uint8), 8)
    vocab_bf16 = torch.randn(n, k, dtype=torch.bfloat16)
    print(f"{torch.get_num_threads()} threads; layers: {args.layers} x {LAYER_SHAPES}")
    print("rows | layers Q4_1: quant_gemv  torch int4  ratio  bfloat16  ratio  float32  ratio "
          "| vocabulary: Q8_0 quant_gemv  bfloat16  ratio")
    for rows in args.rows:
        xs = {size: torch.randn(rows, size, dtype=torch.bfloat16) for size in (576, 1536)}
        x = xs[576]
        wide = {width(size): torch.nn.functional.pad(v, (0, width(size) - size))
                for size, v in xs.items()}
        a = best_ms(lambda wide=wide: [torch.ops.vllm_cpu.quant_gemv(wide[k], c, d, m, 4)
                                       for c, d, m, k in ours])
        b = best_ms(lambda xs=xs: [torch._weight_int4pack_mm_for_cpu(xs[k], p, 32, sz)
                                   for p, sz, k in theirs])
        layers_dense = best_ms(lambda xs=xs: [torch.nn.functional.linear(xs[k], w)
                                              for w, k in dense_layers])
        floats = {size: v.float() for size, v in xs.items()}
        layers_float = best_ms(lambda xs=floats: [torch.nn.functional.linear(xs[k], w)
                                                  for w, k in float_layers])
        x_wide = wide[width(576)]
        c = best_ms(lambda x=x_wide: torch.ops.vllm_cpu.quant_gemv(x, *vocab_q8, 8))
        dense = best_ms(lambda x=x: torch.nn.functional.linear(x, vocab_bf16))
        print(f"{rows:4d} | {a:22.2f} {b:11.2f} {b / a:6.2f} {layers_dense:9.2f} "
              f"{layers_dense / a:6.2f} {layers_float:8.2f} {layers_float / a:6.2f} | "
              f"{c:28.2f} {dense:9.2f} {dense / c:6.2f}")


if __name__ == "__main__":
    main()
