// int8_mm: int8 activations times int8 weights with int32 sums, the products of
// `quantization="int8"` on processors without integer dot-product instructions (AVX2 with no
// VNNI, where torch's `_int_mm` is a reference loop). Its result equals
// `torch._int_mm(x, w.t())` exactly: integer sums have no rounding to differ in.
//
// The weight is packed once at load (`pack_int8_weight`): output columns in tiles of 16, and
// inside a tile, k in steps of 4, two 32-byte vectors a step, vector j holding columns 8j..8j+7
// with each 32-bit lane one column's four weights:
//
//   packed [tiles, steps, 2, 32]   byte 4i + b of vector j, step s, tile t = w[16t + 8j + i, 4s + b]
//
// (columns past N and k past K are zeros). A step broadcasts a row's four activations to the
// eight lanes, so `vpmaddubsw` + `vpmaddwd` give each lane its column's four products summed
// in int32. `vpmaddubsw` multiplies unsigned by signed bytes, so the weights enter as |w| and
// their signs move onto the activations (`vpsignb`): |w| x sign(w) x, at most 2 x 128 x 127 a
// pair, within int16. The activations must lie in [-127, 127] (`quantize_per_token`'s range):
// -128 has no negation in int8.
//
// Register tile: 4 rows x 16 columns (8 accumulators; int8_mm.h, shared with the fused
// decoder). Threads take tiles of columns; a tile's weights (16 x K bytes) stay in L1 while
// the row blocks of a chunk of 64 rows (whose activations stay in L2) pass over them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "int8_mm.h"

using namespace vllm_cpu::int8mm;

bool int8_mm_available() {
#if defined(VLLM_INT8_MM)
  return true;
#else
  return false;
#endif
}

// w [N, K] int8 -> the packed tiles above, int8 [ceil(N / 16), ceil(K / 4) * 64].
torch::Tensor pack_int8_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8, "pack_int8_weight: int8 [N, K]");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t tiles = tiles_of(n), steps = steps_of(k);
  torch::Tensor packed = torch::zeros({tiles, steps * kTileStepBytes}, torch::kInt8);
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  for (int64_t c = 0; c < n; ++c) {
    const int64_t t = c / kCols, j = (c % kCols) / 8, i = c % 8;
    for (int64_t kk = 0; kk < k; ++kk) {
      const int64_t s = kk / kStep, b = kk % kStep;
      dst[t * steps * kTileStepBytes + s * kTileStepBytes + j * 32 + 4 * i + b] = src[c * k + kk];
    }
  }
  return packed;
}

// x [M, K] int8 (values in [-127, 127]) times the packed weight of N columns: int32 [M, N],
// equal to torch._int_mm(x, w.t()).
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kInt8, "int8_mm: x must be int8 [M, K]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kInt8,
              "int8_mm: the weight must be pack_int8_weight's");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t tiles = tiles_of(n), steps = steps_of(k);
  TORCH_CHECK(packed.size(0) == tiles && packed.size(1) == steps * kTileStepBytes,
              "int8_mm: a packed weight of ", packed.size(0), " x ", packed.size(1),
              " is not ", n, " columns of ", k, " inputs");
  torch::Tensor out = torch::empty({m, n}, torch::kInt32);
#if defined(VLLM_INT8_MM)
  x = x.contiguous();
  const int8_t* xs = x.data_ptr<int8_t>();
  const int8_t* ws = packed.data_ptr<int8_t>();
  int32_t* os = out.data_ptr<int32_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // Rows in chunks whose activations stay in L2 while this thread's tiles pass over them.
    for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
      const int64_t r1 = std::min(m, r0 + kRowChunk);
      for (int64_t t = begin; t < end; ++t) tile_times(xs, k, r0, r1, ws, t, n, os + t * kCols, n);
    }
  });
#else
  TORCH_CHECK(false, "int8_mm: not built for this processor (needs AVX2)");
#endif
  return out;
}
