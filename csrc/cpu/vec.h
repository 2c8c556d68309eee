// Helpers shared by the CPU kernels: 16 floats at a time (`f32x16`: one AVX-512 register,
// or two AVX2 registers where the CPU has AVX2, FMA and F16C but not AVX-512), loads from
// and stores to the tensors' dtypes (stores round to nearest even, as c10's conversions
// do), the arithmetic the elementwise kernels use, and a vectorised exp. VLLM_VEC16 is
// defined where either exists.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define VLLM_VEC16 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace vllm_cpu {

#if defined(__AVX512F__)
using f32x16 = __m512;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  // c10's round_to_nearest_even: add 0x7fff plus the kept part's lowest bit; NaN -> 0x7fc0.
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i top = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}
inline void store16(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
// p a degree-6 Taylor polynomial (relative error ~2e-7); -inf and very negative -> ~0
// (x is clamped at -87: callers that need exact zeros mask them).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 zero16() { return _mm512_setzero_ps(); }
inline __m512 set16(float x) { return _mm512_set1_ps(x); }
inline __m512 add16(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 sub16(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
inline __m512 mul16(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 div16(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
inline __m512 fmadd16(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 fnmadd16(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
inline float reduce_add16(__m512 a) { return _mm512_reduce_add_ps(a); }
inline __m512 max16(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }

// Lane masks: le16(a, b) is a <= b per lane (false where either is NaN); select16(m, a, b)
// takes a where m holds, else b.
using mask16 = __mmask16;
inline mask16 le16(__m512 a, __m512 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline mask16 and16(mask16 a, mask16 b) { return a & b; }
inline __m512 select16(mask16 m, __m512 a, __m512 b) { return _mm512_mask_blend_ps(m, b, a); }

#else  // AVX2, FMA, F16C: two 8-float halves

struct f32x16 {
  __m256 lo, hi;
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <typename T>
inline f32x16 load16(const T* p) { return {load8(p), load8(p + 8)}; }

// The 16 bits c10's round_to_nearest_even keeps of each float (NaN -> 0x7fc0), as int32.
inline __m256i bf16_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}
inline void store16(float* p, f32x16 x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline void store16(c10::BFloat16* p, f32x16 x) {
  // packus interleaves 128-bit lanes (lo0-3 hi0-3 lo4-7 hi4-7); the permute restores order.
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(x.lo), bf16_bits8(x.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
inline void store16(c10::Half* p, f32x16 x) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.lo, kRound));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(x.hi, kRound));
}

// exp(x) as the AVX-512 exp16 computes it; x is clamped to [-87, 88] (2^n built in the
// exponent field needs -126 <= n <= 127), so very large arguments give ~1.6e38, not inf.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline f32x16 exp16(f32x16 x) { return {exp8(x.lo), exp8(x.hi)}; }

inline f32x16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline f32x16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline f32x16 add16(f32x16 a, f32x16 b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
inline f32x16 sub16(f32x16 a, f32x16 b) {
  return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
inline f32x16 mul16(f32x16 a, f32x16 b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
inline f32x16 div16(f32x16 a, f32x16 b) {
  return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
}
inline f32x16 fmadd16(f32x16 a, f32x16 b, f32x16 c) {  // a b + c
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline f32x16 fnmadd16(f32x16 a, f32x16 b, f32x16 c) {  // c - a b
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline float reduce_add8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_add16(f32x16 a) { return reduce_add8(_mm256_add_ps(a.lo, a.hi)); }
inline f32x16 max16(f32x16 a, f32x16 b) {
  return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}

struct mask16 {  // all-ones or all-zero lanes
  __m256 lo, hi;
};
inline mask16 le16(f32x16 a, f32x16 b) {
  return {_mm256_cmp_ps(a.lo, b.lo, _CMP_LE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LE_OQ)};
}
inline mask16 and16(mask16 a, mask16 b) {
  return {_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)};
}
inline f32x16 select16(mask16 m, f32x16 a, f32x16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}
#endif

}  // namespace vllm_cpu
#endif
