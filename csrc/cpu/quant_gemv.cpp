// Block-quantized weights times a few rows of activations (decode steps), on AVX-512 VNNI
// or AVX2 (quant_gemv.h has both forms of the inner loops).
//
// A weight row is cut into blocks of 32 along the input; block b of output row n holds
// unsigned codes u (4 or 8 bits) with w = d[n, b] * u + m[n, b] (d, m float16). This one
// form covers GGUF's Q4_1 (m from the file), Q4_0 (m = -8 d) and Q8_0 (u = q + 128,
// m = -128 d). The activations are quantized per row and block of 32 to int8 (scale
// dx = absmax / 127), as llama.cpp does, so that a block's dot product is integer work:
//
//   sum_j w_j x_j ~= d dx sum_j u_j qx_j + m sx,     sx = dx sum_j qx_j
//
// which is exactly w . dequant(qx): the offset term uses the quantized sum, so the only
// error is the activations' rounding (relative ~1/254 per block, never amplified by m).
//
// Layouts (contiguous), Kp = the input size rounded up to 64 (padding blocks: d = m = 0):
//   codes  uint8 [N, Kp / 2] (4 bits) or [N, Kp] (8 bits), in quads of blocks (below),
//          the last two blocks a half quad where Kp % 128 == 64
//   d, m   float16 [N, Kp / 32]
//   x      [M, K] float32 / bfloat16 / float16;  out [M, N] in x's dtype
//
// Quad layout: blocks 4g..4g+3 fill two 64-byte vectors V0, V1 whose 32-bit lane L holds
// four consecutive codes of block 4g + L % 4, from index 4 (L / 4) in V0 and 16 + 4 (L / 4)
// in V1. Every lane of both vectors belongs to the same block, so the two vpdpbusd of a
// quad accumulate into one int32 vector, and one broadcast of the quad's four scales
// (d0 d1 d2 d3 d0 ...) scales it. 8-bit codes are stored as V0 then V1; 4-bit codes store
// byte s of a quad as V0[s] | V1[s] << 4, so one 64-byte load split into its low and high
// nibbles gives both vectors.
//
// Half quad (Kp % 128 == 64: the default model's 576 inputs are 4.5 quads; padding them to
// 5 made every step read 11% more of those weights): blocks 4g, 4g+1 fill two 32-byte
// vectors whose lane L (0..7) holds four codes of block 4g + L % 2, from index 4 (L / 2) in
// V0 and 16 + 4 (L / 2) in V1, stored as the quad's are; 256-bit vpdpbusd.
//
// AVX2 reads each 64-byte vector as two 32-byte halves: lane L's block is still L % 4 in
// both (L % 2 in a half quad), so the same layouts serve vpmaddubsw + vpmaddwd there.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_gemv.h"

using vllm_cpu::qgemv::kHalf;
using vllm_cpu::qgemv::kMaxChunkedRows;
using vllm_cpu::qgemv::kQuad;

namespace {

// Position P (0..63, or 0..31 in a half quad of `blocks` 2) of vector j (0/1) of a quad
// -> (block of the quad 0..3, index in it).
inline void quad_position(int64_t j, int64_t pos, int64_t* block, int64_t* index,
                          int64_t blocks = 4) {
  const int64_t lane = pos / 4;
  *block = lane % blocks;
  *index = 16 * j + (lane / blocks) * 4 + pos % 4;
}

}  // namespace

// Codes [N, Kp] (one uint8 code per weight, natural order, Kp % 64 == 0) -> the quad
// layout of `bits` (4: two codes a byte; 8: one), a half quad last where Kp % 128 == 64.
torch::Tensor pack_block_codes(torch::Tensor codes, int64_t bits) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8, "codes: uint8 [N, Kp]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  codes = codes.contiguous();
  const int64_t n = codes.size(0), kp = codes.size(1);
  TORCH_CHECK(kp % kHalf == 0, "padded input size must be a multiple of ", kHalf);
  auto out = torch::empty({n, kp * bits / 8}, codes.options());
  const uint8_t* src = codes.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t start = 0; start < kp; start += kQuad) {
      const int64_t size = std::min(kQuad, kp - start);  // a quad, or the last half quad
      const int64_t width = size / 2;                    // bytes per vector
      const uint8_t* in = src + r * kp + start;
      uint8_t vec[2][64];
      for (int64_t j = 0; j < 2; ++j) {
        for (int64_t pos = 0; pos < width; ++pos) {
          int64_t block, index;
          quad_position(j, pos, &block, &index, size / 32);
          vec[j][pos] = in[block * 32 + index];
        }
      }
      if (bits == 8) {
        std::memcpy(dst + r * kp + start, vec[0], width);
        std::memcpy(dst + r * kp + start + width, vec[1], width);
      } else {
        uint8_t* o = dst + r * (kp / 2) + start / 2;
        for (int64_t s = 0; s < width; ++s) {
          TORCH_CHECK(vec[0][s] < 16 && vec[1][s] < 16, "4-bit codes must be < 16");
          o[s] = static_cast<uint8_t>(vec[0][s] | (vec[1][s] << 4));
        }
      }
    }
  }
  return out;
}

#if defined(VLLM_QUANT_GEMV)
namespace {

using vllm_cpu::qgemv::QuantizedRows;
using vllm_cpu::qgemv::quantize_rows;

// x's rows times the weight, output rows in chunks of at least 64 per thread, each thread
// walking its weights in order.
template <typename T>
void gemv(int64_t rows, int64_t bits, const uint8_t* codes, const at::Half* d,
          const at::Half* m, const QuantizedRows& q, T* out, int64_t n) {
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    vllm_cpu::qgemv::gemv_range<T>(rows, bits, codes, d, m, q, out, n, begin, end);
  });
}

}  // namespace
#endif

bool quant_gemv_available() {
#if defined(VLLM_QUANT_GEMV)
  return true;
#else
  return false;
#endif
}

// x [M, K] times the block-quantized weight [N, K]: out [M, N] in x's dtype, in passes of
// up to 32 rows. No dense form for large steps (gguf_mm's): on the AVX2 Zen 3 these integer
// products ran level with or ahead of MKL's float32 sgemm at 32 to 1,024 rows (the default
// model's layer shapes, `benchmark_gguf_kernels.py --rows 64 256 1024`, float32 column).
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                         int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && d.dim() == 2 && m.dim() == 2, "bad ranks");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8, "codes must be uint8");
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && m.scalar_type() == torch::kFloat16,
              "d and m must be float16");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0);
  const int64_t kp = d.size(1) * 32;
  TORCH_CHECK(kp % kHalf == 0 && k <= kp && kp - k < kHalf, "input size ", k,
              " does not fit weights of ", kp, " padded columns");
  TORCH_CHECK(codes.size(1) == kp * bits / 8 && d.size(0) == n && m.sizes() == d.sizes(),
              "codes, d and m disagree in shape");
  TORCH_CHECK(rows >= 1, "quant_gemv takes at least one row");
  x = x.contiguous();
  codes = codes.contiguous();
  d = d.contiguous();
  m = m.contiguous();
  auto out = torch::empty({rows, n}, x.options());
#if defined(VLLM_QUANT_GEMV)
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    static thread_local QuantizedRows q;  // kept between calls: no allocation per call
    const auto* dp = d.data_ptr<at::Half>();
    const auto* mp = m.data_ptr<at::Half>();
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxChunkedRows) {  // passes of at most 32 rows
      const int64_t chunk = std::min(kMaxChunkedRows, rows - r0);
      quantize_rows<T>(x.data_ptr<T>() + r0 * k, chunk, k, kp, &q);
      gemv<T>(chunk, bits, codes.data_ptr<uint8_t>(), dp, mp, q, out.data_ptr<T>() + r0 * n, n);
    }
  };
  switch (x.scalar_type()) {
    case torch::kFloat32: run(static_cast<float*>(nullptr)); break;
    case torch::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case torch::kFloat16: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "quant_gemv: unsupported dtype ", x.scalar_type());
  }
#else
  TORCH_CHECK(false, "quant_gemv needs AVX-512 VNNI or AVX2 with FMA and F16C (built without them)");
#endif
  return out;
}
