// int8_mm's packed weight layout and register tiles (int8_mm.cpp describes them), shared by
// the op and the fused decoder (fused_decode.cpp), which reads `Int8Linear` weights with it.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#define VLLM_INT8_MM 1
#endif

namespace vllm_cpu::int8mm {

constexpr int64_t kCols = 16;  // output columns a tile
constexpr int64_t kStep = 4;   // k values a step (one 32-bit lane)
constexpr int64_t kTileStepBytes = kCols * kStep;
constexpr int64_t kRowChunk = 64;  // rows whose activations stay in L2 (64 x K bytes)

inline int64_t steps_of(int64_t k) { return (k + kStep - 1) / kStep; }
inline int64_t tiles_of(int64_t n) { return (n + kCols - 1) / kCols; }

#if defined(VLLM_INT8_MM)

// Rows [0, MR) of x (row stride ldx, K values) times one packed tile: out's 16 columns (only
// the first `cols` stored).
template <int MR>
void tile_rows(const int8_t* x, int64_t ldx, int64_t k, const int8_t* tile, int32_t* out,
               int64_t ldo, int64_t cols) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int64_t whole = k / kStep, steps = steps_of(k);
  auto step = [&](int64_t s, const int32_t* xv) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + s * kTileStepBytes));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + s * kTileStepBytes + 32));
    const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);  // |w|
    for (int r = 0; r < MR; ++r) {
      const __m256i xb = _mm256_set1_epi32(xv[r]);
      acc[r][0] = _mm256_add_epi32(
          acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones));
      acc[r][1] = _mm256_add_epi32(
          acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones));
    }
  };
  for (int64_t s = 0; s < whole; ++s) {
    int32_t xv[MR];
    for (int r = 0; r < MR; ++r) std::memcpy(&xv[r], x + r * ldx + s * kStep, 4);
    step(s, xv);
  }
  if (steps > whole) {  // the last k values, zeros past K
    int32_t xv[MR] = {};
    for (int r = 0; r < MR; ++r) std::memcpy(&xv[r], x + r * ldx + whole * kStep, k - whole * kStep);
    step(whole, xv);
  }
  for (int r = 0; r < MR; ++r) {
    if (cols == kCols) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), acc[r][0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 8), acc[r][1]);
    } else {
      alignas(32) int32_t lanes[kCols];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), acc[r][1]);
      std::memcpy(out + r * ldo, lanes, cols * sizeof(int32_t));
    }
  }
}

// Rows [r0, r1) of x [*, k] times tile t of the packed weight of n columns, into the tile's
// columns of rows r0..r1 of `out` (row stride ldo; `out` points at the tile's first column
// of row 0), in register tiles of 4 rows and the 1-3 left.
inline void tile_times(const int8_t* x, int64_t k, int64_t r0, int64_t r1, const int8_t* packed,
                       int64_t t, int64_t n, int32_t* out, int64_t ldo) {
  const int8_t* tile = packed + t * steps_of(k) * kTileStepBytes;
  const int64_t cols = std::min(kCols, n - t * kCols);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) tile_rows<4>(x + r * k, k, k, tile, out + r * ldo, ldo, cols);
  switch (r1 - r) {
    case 3: tile_rows<3>(x + r * k, k, k, tile, out + r * ldo, ldo, cols); break;
    case 2: tile_rows<2>(x + r * k, k, k, tile, out + r * ldo, ldo, cols); break;
    case 1: tile_rows<1>(x + r * k, k, k, tile, out + r * ldo, ldo, cols); break;
    default: break;
  }
}

#endif  // VLLM_INT8_MM

}  // namespace vllm_cpu::int8mm
