"""The GGUF block kernels of `quantization="gguf"` on the default model's shapes, side by side
in one run: the native `quant_gemv` against torch's CPU int4 kernel and the dense bfloat16
matmul for the Q4_1 layers, and against the dense bfloat16 matmul for the Q8_0 vocabulary
projection. Past 8 rows quant_gemv runs in passes over cached tiles of the weight; the rows
where it stops beating the dense matmul are where `gguf_blocks.MAX_ROWS` belongs.

Every weight is distinct (30 layers' worth per shape), so that they stream from memory as
in decoding rather than sit in cache. Prints milliseconds per decode step's worth of calls
and the ratio (torch / ours: above 1 means the native kernel is faster).

    python benchmarks/benchmark_gguf_kernels.py [--rows 1 2 4 8 9 16 32] [--layers 30]
        [--full-quads]

`--full-quads` pads every input to whole quads of blocks (576 -> 640 columns, the
activations zero-padded to match), the layout before half quads, for comparison.
"""

from __future__ import annotations

import argparse
import time

import torch

from vllm._custom_ops import cpu_ops

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 9, 16, 32])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--full-quads", action="store_true",
                        help="pad inputs to multiples of 128 (no half quads)")
    args = parser.parse_args()
    ops = cpu_ops()
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

    ours, theirs, dense_layers = [], [], []
    for n, k in LAYER_SHAPES:
        for _ in range(args.layers):
            u = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            ours.append((*native_weight(u, 4), width(k)))
            theirs.append((torch._convert_weight_to_int4pack_for_cpu(u.int(), 1),
                           torch.rand(k // 32, n, 2).bfloat16(), k))
            dense_layers.append((torch.randn(n, k, dtype=torch.bfloat16), k))
    n, k = VOCAB_SHAPE
    vocab_q8 = native_weight(torch.randint(0, 256, (n, k), dtype=torch.uint8), 8)
    vocab_bf16 = torch.randn(n, k, dtype=torch.bfloat16)
    print(f"{torch.get_num_threads()} threads; layers: {args.layers} x {LAYER_SHAPES}")
    print("rows | layers Q4_1: quant_gemv  torch int4  ratio  bfloat16  ratio | vocabulary: "
          "Q8_0 quant_gemv  bfloat16  ratio")
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
        x_wide = wide[width(576)]
        c = best_ms(lambda x=x_wide: torch.ops.vllm_cpu.quant_gemv(x, *vocab_q8, 8))
        dense = best_ms(lambda x=x: torch.nn.functional.linear(x, vocab_bf16))
        print(f"{rows:4d} | {a:22.2f} {b:11.2f} {b / a:6.2f} {layers_dense:9.2f} "
              f"{layers_dense / a:6.2f} | {c:28.2f} {dense:9.2f} {dense / c:6.2f}")


if __name__ == "__main__":
    main()
