// quant_gemv's inner loops, shared by quant_gemv.cpp (the op) and fused_decode.cpp (whole
// decode layers): the activations' int8 quantization and a range of output rows. The
// layouts are described in quant_gemv.cpp.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// Two forms of the same layouts: AVX-512 VNNI (vpdpbusd over 64-byte vectors), and AVX2
// with FMA and F16C (vpmaddubsw + vpmaddwd over 32-byte halves; CPUs without AVX-512, such
// as AMD's before Zen 4). VLLM_QUANT_GEMV is defined where either is built.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>
#define VLLM_QUANT_GEMV 1
#define VLLM_QUANT_GEMV_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "vec.h"
#define VLLM_QUANT_GEMV 1
#endif

namespace vllm_cpu::qgemv {

constexpr int64_t kMaxRows = 8;         // rows one pass of gemv_rows keeps in registers
constexpr int64_t kMaxChunkedRows = 32; // rows gemv_range takes, in passes of kMaxRows
constexpr int64_t kTile = 16;           // weight rows a tile: reread from L1 by each pass
constexpr int64_t kQuad = 128;  // weights per quad of blocks
constexpr int64_t kHalf = 64;   // weights per half quad

#if defined(VLLM_QUANT_GEMV)
// The activation rows quantized: qx in the quad layout, per-lane scales (dx0 dx1 dx2 dx3
// dx0 ...) per quad, and sx = dx * sum(qx) per block.
struct QuantizedRows {
  int64_t quads;           // whole quads
  bool half;               // and a half quad after them
  int64_t blocks;          // Kp / 32
  std::vector<int8_t> qx;  // [M, quads + half, 128] (a half quad: its first 64)
  std::vector<float> dx;   // [M, quads + half, 16] (a half quad: its first 8)
  // sx = dx * sum(qx) per block: [M, blocks] (AVX-512); AVX2 spreads it over each quad's
  // 8 lanes as dx is, divided by the lanes a block has (2, or 4 in a half quad): [M, quads
  // + half, 8], so that one product per quad adds the offsets.
  std::vector<float> sx;
};

#if defined(VLLM_QUANT_GEMV_AVX512)
// Sixteen values from `p` (those of `mask`, zeros elsewhere) as float32.
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 mask) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
inline __m512 load16(const at::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? 0xFFFF
                         : remaining <= 0 ? 0 : static_cast<__mmask16>((1u << remaining) - 1);
}


// One block of 32 values (x[0..k_left) real, zeros past) as 16 dwords of int8 codes: dword
// i < 8 holds codes 4i..4i+3 (the upper 8 dwords are don't-care). Returns the scale; the
// codes round to nearest, ties to even.
template <typename T>
inline __m512i quantize_block(const T* x, int64_t k_left, float* scale, int32_t* sum) {
  const __m512 a = load16(x, tail_mask(k_left)), b = load16(x + 16, tail_mask(k_left - 16));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  *scale = amax / 127.f;
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  const __m256i codes = _mm256_set_m128i(_mm512_cvtepi32_epi8(qb), _mm512_cvtepi32_epi8(qa));
  return _mm512_castsi256_si512(codes);
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t kp, QuantizedRows* q) {
  const int64_t quads = kp / kQuad, slots = (kp + kQuad - 1) / kQuad, nblocks = kp / 32;
  q->quads = quads;
  q->half = slots > quads;
  q->blocks = nblocks;
  q->qx.resize(rows * slots * kQuad);
  q->dx.resize(rows * slots * 16);
  q->sx.resize(rows * nblocks);
  // From [block 0 | block 1] (a) and [block 2 | block 3] (c), eight dwords each: lane L of
  // V0 takes dword L / 4 of block L % 4, of V1 dword 4 + L / 4.
  alignas(64) int32_t idx0[16], idx1[16];
  for (int lane = 0; lane < 16; ++lane) {
    const int block = lane % 4, dword = lane / 4;
    idx0[lane] = block * 8 + dword;
    idx1[lane] = block * 8 + dword + 4;
  }
  const __m512i perm0 = _mm512_load_si512(idx0), perm1 = _mm512_load_si512(idx1);
  // A half quad from [block 0 | block 1]: lane L of V0 takes dword L / 2 of block L % 2,
  // of V1 dword 4 + L / 2 (lanes 8..15 unused).
  alignas(64) int32_t half0[16], half1[16];
  for (int lane = 0; lane < 16; ++lane) {
    const int block = lane % 2, dword = (lane / 2) % 4;
    half0[lane] = block * 8 + dword;
    half1[lane] = block * 8 + dword + 4;
  }
  const __m512i hperm0 = _mm512_load_si512(half0), hperm1 = _mm512_load_si512(half1);
  for (int64_t r = 0; r < rows; ++r) {
    if (q->half) {
      float s[2];
      int32_t sum[2];
      __m512i blocks2[2];
      for (int b = 0; b < 2; ++b) {
        const int64_t col = quads * kQuad + b * 32;
        blocks2[b] = quantize_block(x + r * k + col, k - col, &s[b], &sum[b]);
      }
      const __m512i a = _mm512_inserti64x4(blocks2[0], _mm512_castsi512_si256(blocks2[1]), 1);
      int8_t* out = q->qx.data() + (r * slots + quads) * kQuad;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm512_castsi512_si256(_mm512_permutexvar_epi32(hperm0, a)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32),
                          _mm512_castsi512_si256(_mm512_permutexvar_epi32(hperm1, a)));
      float* lanes = q->dx.data() + (r * slots + quads) * 16;
      for (int l = 0; l < 8; ++l) lanes[l] = s[l % 2];
      for (int b = 0; b < 2; ++b) {
        q->sx[r * nblocks + 4 * quads + b] = s[b] * static_cast<float>(sum[b]);
      }
    }
    for (int64_t g = 0; g < quads; ++g) {
      float s[4];
      int32_t sum[4];
      __m512i blocks[4];
      for (int b = 0; b < 4; ++b) {
        const int64_t col = g * kQuad + b * 32;
        blocks[b] = quantize_block(x + r * k + col, k - col, &s[b], &sum[b]);
      }
      const __m512i a = _mm512_inserti64x4(blocks[0], _mm512_castsi512_si256(blocks[1]), 1);
      const __m512i c = _mm512_inserti64x4(blocks[2], _mm512_castsi512_si256(blocks[3]), 1);
      int8_t* out = q->qx.data() + (r * slots + g) * kQuad;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi32(a, perm0, c));
      _mm512_storeu_si512(out + 64, _mm512_permutex2var_epi32(a, perm1, c));
      float* lanes = q->dx.data() + (r * slots + g) * 16;
      for (int l = 0; l < 16; ++l) lanes[l] = s[l % 4];
      for (int b = 0; b < 4; ++b) {
        q->sx[r * nblocks + 4 * g + b] = s[b] * static_cast<float>(sum[b]);
      }
    }
  }
}

// Rows row0..row0+M of x (quantized in q) times weight rows [begin, end): out's same rows.
template <int M, int BITS, typename T>
void gemv_rows(const uint8_t* codes, const at::Half* d, const at::Half* m,
               const QuantizedRows& q, int64_t row0, T* out, int64_t n_total, int64_t begin,
               int64_t end) {
  const int64_t quads = q.quads, blocks = q.blocks, slots = quads + (q.half ? 1 : 0);
  const int64_t row_bytes = blocks * 32 * BITS / 8;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* c = codes + n * row_bytes;
    const at::Half* dn = d + n * blocks;
    const at::Half* mn = m + n * blocks;
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < quads; ++g) {
      __m512i v0, v1;
      if constexpr (BITS == 4) {
        const __m512i packed = _mm512_loadu_si512(c + g * 64);
        v0 = _mm512_and_si512(packed, low4);
        v1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      } else {
        v0 = _mm512_loadu_si512(c + g * kQuad);
        v1 = _mm512_loadu_si512(c + g * kQuad + 64);
      }
      int64_t dquad;
      std::memcpy(&dquad, dn + 4 * g, 8);
      const __m512 dw = _mm512_cvtph_ps(_mm256_set1_epi64x(dquad));  // d0 d1 d2 d3 d0 ...
      for (int r = 0; r < M; ++r) {
        const int8_t* qx = q.qx.data() + ((row0 + r) * slots + g) * kQuad;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v0, _mm512_loadu_si512(qx));
        dot = _mm512_dpbusd_epi32(dot, v1, _mm512_loadu_si512(qx + 64));
        const float* dx = q.dx.data() + ((row0 + r) * slots + g) * 16;
        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(dx));
        acc[r] = _mm512_fmadd_ps(scaled, dw, acc[r]);
      }
    }
    if (q.half) {  // the last two blocks, in 256-bit halves (upper lanes add zeros)
      __m256i v0, v1;
      if constexpr (BITS == 4) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + quads * 64));
        v0 = _mm256_and_si256(packed, _mm512_castsi512_si256(low4));
        v1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm512_castsi512_si256(low4));
      } else {
        v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + quads * kQuad));
        v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + quads * kQuad + 32));
      }
      int32_t dpair;
      std::memcpy(&dpair, dn + 4 * quads, 4);
      const __m256 dw = _mm256_cvtph_ps(_mm_set1_epi32(dpair));  // d0 d1 d0 d1 ...
      for (int r = 0; r < M; ++r) {
        const int8_t* qx = q.qx.data() + ((row0 + r) * slots + quads) * kQuad;
        __m256i dot = _mm256_dpbusd_epi32(
            _mm256_setzero_si256(), v0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx)));
        dot = _mm256_dpbusd_epi32(dot, v1,
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32)));
        const float* dx = q.dx.data() + ((row0 + r) * slots + quads) * 16;
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_loadu_ps(dx));
        acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(_mm256_mul_ps(scaled, dw)));
      }
    }
    // Offsets: sum_b m[b] sx[b], sixteen blocks at a time.
    for (int64_t b = 0; b < blocks; b += 16) {
      const __mmask16 mask = tail_mask(blocks - b);
      const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mn + b));
      for (int r = 0; r < M; ++r) {
        const float* sx = q.sx.data() + (row0 + r) * blocks + b;
        acc[r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, sx), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) {
      out[(row0 + r) * n_total + n] = static_cast<T>(_mm512_reduce_add_ps(acc[r]));
    }
  }
}

#else  // AVX2: the same layouts in 32-byte halves

// One block of 32 values (x[0..k_left) real, zeros past) as int8 codes in natural order,
// rounded to nearest (ties to even) as the AVX-512 form does. Returns the scale and the
// codes' sum.
template <typename T>
inline void quantize_block(const T* x, int64_t k_left, int8_t* codes, float* scale,
                           int32_t* sum) {
  __m256 v[4];
  if (k_left >= 32) {
    for (int i = 0; i < 4; ++i) v[i] = vllm_cpu::load8(x + 8 * i);
  } else {
    alignas(32) float tmp[32];
    for (int64_t j = 0; j < 32; ++j) tmp[j] = j < k_left ? static_cast<float>(x[j]) : 0.f;
    for (int i = 0; i < 4; ++i) v[i] = _mm256_load_ps(tmp + 8 * i);
  }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax8 = _mm256_and_ps(v[0], abs_mask);
  for (int i = 1; i < 4; ++i) amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], abs_mask));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  *scale = amax / 127.f;
  const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  *sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
  // The packs work within 128-bit lanes: dwords come out as q0[0..3] q1[0..3] q2[0..3]
  // q3[0..3] q0[4..7] ..., which the permute puts back in order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                            _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t kp, QuantizedRows* q) {
  const int64_t quads = kp / kQuad, slots = (kp + kQuad - 1) / kQuad, nblocks = kp / 32;
  q->quads = quads;
  q->half = slots > quads;
  q->blocks = nblocks;
  q->qx.resize(rows * slots * kQuad);
  q->dx.resize(rows * slots * 16);
  q->sx.resize(rows * slots * 8);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < slots; ++g) {
      const int nb = g < quads ? 4 : 2;  // blocks in this quad (a half quad: 2)
      alignas(32) int32_t codes[4][8];  // each block's 32 codes as 8 dwords
      float s[4], sx[4];
      for (int b = 0; b < nb; ++b) {
        const int64_t col = g * kQuad + b * 32;
        int32_t sum;
        quantize_block(x + r * k + col, k - col, reinterpret_cast<int8_t*>(codes[b]), &s[b],
                       &sum);
        sx[b] = s[b] * static_cast<float>(sum);
      }
      float* sx_lanes = q->sx.data() + (r * slots + g) * 8;
      for (int l = 0; l < 8; ++l) sx_lanes[l] = sx[l % nb] * (nb / 8.f);  // exact: 1/2, 1/4
      // Lane L of V0 holds dword L / nb of block L % nb, of V1 dword 4 + L / nb; the
      // vectors are 16 lanes (8 in a half quad), V1 stored after V0.
      int32_t* out = reinterpret_cast<int32_t*>(q->qx.data() + (r * slots + g) * kQuad);
      const int lanes = 4 * nb;
      for (int lane = 0; lane < lanes; ++lane) {
        out[lane] = codes[lane % nb][lane / nb];
        out[lanes + lane] = codes[lane % nb][4 + lane / nb];
      }
      float* dx = q->dx.data() + (r * slots + g) * 16;
      for (int l = 0; l < 16; ++l) dx[l] = s[l % nb];
    }
  }
}

// sum over the 32-bit lanes' four byte products u * x: u unsigned 4-bit codes (pair sums
// of vpmaddubsw stay far below int16's limit, so four of them add as int16), or 8-bit
// codes taken as signed q = u - 128 (|q| times x with q's sign: at most 2 * 128 * 127 a
// pair; the missing 128 * sum(x) goes into the offsets, see gemv_rows).
template <int BITS>
inline __m256i dot4(const __m256i (&w)[4], const int8_t* qx) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto x = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32 * i)); };
  if constexpr (BITS == 4) {
    __m256i p = _mm256_maddubs_epi16(w[0], x(0));
    for (int i = 1; i < 4; ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[i], x(i)));
    return _mm256_madd_epi16(p, ones);
  } else {
    __m256i acc = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w[i], w[i]),
                                             _mm256_sign_epi8(x(i), w[i]));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
    return acc;
  }
}

template <int BITS>
inline __m256i dot2(const __m256i (&w)[2], const int8_t* qx) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto x = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32 * i)); };
  if constexpr (BITS == 4) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(w[0], x(0)),
                                              _mm256_maddubs_epi16(w[1], x(1))), ones);
  } else {
    __m256i acc = _mm256_setzero_si256();
    for (int i = 0; i < 2; ++i) {
      const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w[i], w[i]),
                                             _mm256_sign_epi8(x(i), w[i]));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
    return acc;
  }
}

// A quad's codes and (every eighth quad: a 64-byte line of them) its scales a few KB ahead
// asked for now: the hardware prefetchers alone leave one-row products short of the memory
// bandwidth (gguf_blocks.h's prefetch_ahead). Past the end of a weight it never faults.
template <int BITS>
inline void prefetch_quad(const uint8_t* quad, const at::Half* d, const at::Half* m, int64_t g) {
  constexpr int64_t kAhead = 4096, kScalesAhead = kAhead * 4 / (kQuad * BITS / 8) * 2;
  for (int line = 0; line < BITS / 4; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(quad + kAhead + 64 * line), _MM_HINT_T0);
  if (g % 8 == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(d) + kScalesAhead, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m) + kScalesAhead, _MM_HINT_T0);
  }
}

// Rows row0..row0+M of x (quantized in q) times weight rows [begin, end): out's same rows.
// A quad's 128 codes are four 32-byte vectors lined up with qx's four (4-bit: the low
// nibbles of its 64 bytes, then the high ones; 8-bit: in order); in every 32-bit lane of
// all four the block is lane % 4, so one int32 vector and one broadcast of d0 d1 d2 d3
// d0 ... serve the quad, and one of m0 m1 m2 m3 m0 ... times the lane-spread sx adds its
// offsets. 8-bit codes are summed as u - 128 and their offsets use m + 128 d:
// sum_j (d u_j + m) x_j = d sum_j (u_j - 128) x_j + (m + 128 d) sum_j x_j.
template <int M, int BITS, typename T>
void gemv_rows(const uint8_t* codes, const at::Half* d, const at::Half* m,
               const QuantizedRows& q, int64_t row0, T* out, int64_t n_total, int64_t begin,
               int64_t end) {
  const int64_t quads = q.quads, blocks = q.blocks, slots = quads + (q.half ? 1 : 0);
  const int64_t row_bytes = blocks * 32 * BITS / 8;
  // The lanes' offset scales: m, or m + 128 d for 8-bit codes summed as u - 128.
  auto offsets = [](__m256 dw, __m256 mw) {
    return BITS == 8 ? _mm256_fmadd_ps(dw, _mm256_set1_ps(128.f), mw) : mw;
  };
  const __m256i low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  auto load = [](const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* c = codes + n * row_bytes;
    const at::Half* dn = d + n * blocks;
    const at::Half* mn = m + n * blocks;
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < quads; ++g) {
      prefetch_quad<BITS>(c + g * kQuad * BITS / 8, dn + 4 * g, mn + 4 * g, g);
      __m256i w[4];
      if constexpr (BITS == 4) {
        const __m256i p0 = load(c + g * 64), p1 = load(c + g * 64 + 32);
        w[0] = _mm256_and_si256(p0, low4);
        w[1] = _mm256_and_si256(p1, low4);
        w[2] = _mm256_and_si256(_mm256_srli_epi16(p0, 4), low4);
        w[3] = _mm256_and_si256(_mm256_srli_epi16(p1, 4), low4);
      } else {
        for (int i = 0; i < 4; ++i) w[i] = _mm256_xor_si256(load(c + g * kQuad + 32 * i), flip);
      }
      int64_t dquad, mquad;
      std::memcpy(&dquad, dn + 4 * g, 8);
      std::memcpy(&mquad, mn + 4 * g, 8);
      const __m256 dw = _mm256_cvtph_ps(_mm_set1_epi64x(dquad));  // d0 d1 d2 d3 d0 ...
      const __m256 mw = offsets(dw, _mm256_cvtph_ps(_mm_set1_epi64x(mquad)));
      for (int r = 0; r < M; ++r) {
        const int64_t slot = (row0 + r) * slots + g;
        const __m256i dot = dot4<BITS>(w, q.qx.data() + slot * kQuad);
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot),
                                            _mm256_loadu_ps(q.dx.data() + slot * 16));
        acc[r] = _mm256_fmadd_ps(scaled, dw, acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(q.sx.data() + slot * 8), acc[r]);
      }
    }
    if (q.half) {  // the last two blocks: lanes alternate between them
      __m256i w[2];
      if constexpr (BITS == 4) {
        const __m256i p0 = load(c + quads * 64);
        w[0] = _mm256_and_si256(p0, low4);
        w[1] = _mm256_and_si256(_mm256_srli_epi16(p0, 4), low4);
      } else {
        for (int i = 0; i < 2; ++i) w[i] = _mm256_xor_si256(load(c + quads * kQuad + 32 * i), flip);
      }
      int32_t dpair, mpair;
      std::memcpy(&dpair, dn + 4 * quads, 4);
      std::memcpy(&mpair, mn + 4 * quads, 4);
      const __m256 dw = _mm256_cvtph_ps(_mm_set1_epi32(dpair));  // d0 d1 d0 d1 ...
      const __m256 mw = offsets(dw, _mm256_cvtph_ps(_mm_set1_epi32(mpair)));
      for (int r = 0; r < M; ++r) {
        const int64_t slot = (row0 + r) * slots + quads;
        const __m256i dot = dot2<BITS>(w, q.qx.data() + slot * kQuad);
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot),
                                            _mm256_loadu_ps(q.dx.data() + slot * 16));
        acc[r] = _mm256_fmadd_ps(scaled, dw, acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(q.sx.data() + slot * 8), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) {
      out[(row0 + r) * n_total + n] = static_cast<T>(vllm_cpu::reduce_add8(acc[r]));
    }
  }
}
#endif

// Output rows [begin, end) of x (`rows` rows, quantized in `q`) times the weight, out [rows,
// n_total]. Past kMaxRows rows, the range goes in tiles of kTile weight rows, each tile in
// passes of at most kMaxRows activation rows: the weights stream from memory once and the
// later passes reread the tile from L1 (a verification step of k + 1 tokens costs about
// what a one-token step does).
template <typename T>
void gemv_range(int64_t rows, int64_t bits, const uint8_t* codes, const at::Half* d,
                const at::Half* m, const QuantizedRows& q, T* out, int64_t n_total,
                int64_t begin, int64_t end) {
  // Callers check 1 <= rows <= kMaxChunkedRows (this runs inside parallel regions).
  auto pass = [&](auto bits_tag, int64_t row0, int64_t count, int64_t first, int64_t last) {
    constexpr int B = decltype(bits_tag)::value;
    switch (count) {
      case 1: gemv_rows<1, B, T>(codes, d, m, q, row0, out, n_total, first, last); break;
      case 2: gemv_rows<2, B, T>(codes, d, m, q, row0, out, n_total, first, last); break;
      case 3: gemv_rows<3, B, T>(codes, d, m, q, row0, out, n_total, first, last); break;
      case 4: gemv_rows<4, B, T>(codes, d, m, q, row0, out, n_total, first, last); break;
      case 5: gemv_rows<5, B, T>(codes, d, m, q, row0, out, n_total, first, last); break;
      case 6: gemv_rows<6, B, T>(codes, d, m, q, row0, out, n_total, first, last); break;
      case 7: gemv_rows<7, B, T>(codes, d, m, q, row0, out, n_total, first, last); break;
      default: gemv_rows<8, B, T>(codes, d, m, q, row0, out, n_total, first, last); break;
    }
  };
  auto run = [&](auto bits_tag) {
    if (rows <= kMaxRows) {
      pass(bits_tag, 0, rows, begin, end);
      return;
    }
    // Passes of equal size (9 rows: 5 + 4), so no pass is a nearly empty one.
    const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
    for (int64_t tile = begin; tile < end; tile += kTile) {
      const int64_t tile_end = std::min(end, tile + kTile);
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t row0 = rows * p / passes, row1 = rows * (p + 1) / passes;
        pass(bits_tag, row0, row1 - row0, tile, tile_end);
      }
    }
  };
  if (bits == 4) run(std::integral_constant<int, 4>{});
  else run(std::integral_constant<int, 8>{});
}
#endif

}  // namespace vllm_cpu::qgemv
