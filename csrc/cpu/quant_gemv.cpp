// Block-quantized weights times a few rows of activations (decode steps), on AVX-512 VNNI.
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
//   x      [M, K] float32 / bfloat16 / float16, M <= 8;  out [M, N] in x's dtype
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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#include <immintrin.h>
#define VLLM_QUANT_GEMV 1
#endif

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kQuad = 128;  // weights per quad of blocks
constexpr int64_t kHalf = 64;   // weights per half quad

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

// The activation rows quantized: qx in the quad layout, per-lane scales (dx0 dx1 dx2 dx3
// dx0 ...) per quad, and sx = dx * sum(qx) per block.
struct QuantizedRows {
  int64_t quads;           // whole quads
  bool half;               // and a half quad after them
  int64_t blocks;          // Kp / 32
  std::vector<int8_t> qx;  // [M, quads + half, 128] (a half quad: its first 64)
  std::vector<float> dx;   // [M, quads + half, 16] (a half quad: its first 8)
  std::vector<float> sx;   // [M, blocks]
};

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

template <int M, int BITS, typename T>
void gemv_rows(const uint8_t* codes, const at::Half* d, const at::Half* m,
               const QuantizedRows& q, T* out, int64_t n_total, int64_t begin, int64_t end) {
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
        const int8_t* qx = q.qx.data() + (r * slots + g) * kQuad;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v0, _mm512_loadu_si512(qx));
        dot = _mm512_dpbusd_epi32(dot, v1, _mm512_loadu_si512(qx + 64));
        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot),
                                            _mm512_loadu_ps(q.dx.data() + (r * slots + g) * 16));
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
        const int8_t* qx = q.qx.data() + (r * slots + quads) * kQuad;
        __m256i dot = _mm256_dpbusd_epi32(
            _mm256_setzero_si256(), v0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx)));
        dot = _mm256_dpbusd_epi32(dot, v1,
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 32)));
        const __m256 scaled = _mm256_mul_ps(
            _mm256_cvtepi32_ps(dot), _mm256_loadu_ps(q.dx.data() + (r * slots + quads) * 16));
        acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(_mm256_mul_ps(scaled, dw)));
      }
    }
    // Offsets: sum_b m[b] sx[b], sixteen blocks at a time.
    for (int64_t b = 0; b < blocks; b += 16) {
      const __mmask16 mask = tail_mask(blocks - b);
      const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mn + b));
      for (int r = 0; r < M; ++r) {
        acc[r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, q.sx.data() + r * blocks + b),
                                 acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) out[r * n_total + n] = static_cast<T>(_mm512_reduce_add_ps(acc[r]));
  }
}

template <int M, int BITS, typename T>
void gemv(const uint8_t* codes, const at::Half* d, const at::Half* m, const QuantizedRows& q,
          T* out, int64_t n) {
  // Rows in chunks of at least 64, each thread walking its weights in order.
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    gemv_rows<M, BITS, T>(codes, d, m, q, out, n, begin, end);
  });
}

template <int BITS, typename T>
void gemv_dispatch(int64_t rows, const uint8_t* codes, const at::Half* d, const at::Half* m,
                   const QuantizedRows& q, T* out, int64_t n) {
  switch (rows) {
    case 1: gemv<1, BITS, T>(codes, d, m, q, out, n); break;
    case 2: gemv<2, BITS, T>(codes, d, m, q, out, n); break;
    case 3: gemv<3, BITS, T>(codes, d, m, q, out, n); break;
    case 4: gemv<4, BITS, T>(codes, d, m, q, out, n); break;
    case 5: gemv<5, BITS, T>(codes, d, m, q, out, n); break;
    case 6: gemv<6, BITS, T>(codes, d, m, q, out, n); break;
    case 7: gemv<7, BITS, T>(codes, d, m, q, out, n); break;
    case 8: gemv<8, BITS, T>(codes, d, m, q, out, n); break;
    default: TORCH_CHECK(false, "quant_gemv takes 1 to ", kMaxRows, " rows, got ", rows);
  }
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

// x [M, K] times the block-quantized weight [N, K]: out [M, N] in x's dtype.
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
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "quant_gemv takes 1 to ", kMaxRows, " rows");
  x = x.contiguous();
  codes = codes.contiguous();
  d = d.contiguous();
  m = m.contiguous();
  auto out = torch::empty({rows, n}, x.options());
#if defined(VLLM_QUANT_GEMV)
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    static thread_local QuantizedRows q;  // kept between calls: no allocation per call
    quantize_rows<T>(x.data_ptr<T>(), rows, k, kp, &q);
    const auto* dp = d.data_ptr<at::Half>();
    const auto* mp = m.data_ptr<at::Half>();
    if (bits == 4) {
      gemv_dispatch<4, T>(rows, codes.data_ptr<uint8_t>(), dp, mp, q, out.data_ptr<T>(), n);
    } else {
      gemv_dispatch<8, T>(rows, codes.data_ptr<uint8_t>(), dp, mp, q, out.data_ptr<T>(), n);
    }
  };
  switch (x.scalar_type()) {
    case torch::kFloat32: run(static_cast<float*>(nullptr)); break;
    case torch::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case torch::kFloat16: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "quant_gemv: unsupported dtype ", x.scalar_type());
  }
#else
  TORCH_CHECK(false, "quant_gemv needs AVX-512 VNNI (built without it)");
#endif
  return out;
}
