// The GGUF block layer shared by `gguf_mm` (dense layers) and `moe_experts` (experts):
// the block types' layouts, their unpacking into one shape, the activations' int8
// quantization and the products over ranges of rows. See gguf_mm.cpp for the scheme.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VLLM_GGUF_MM 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VLLM_GGUF_MM_512 1  // the super-block types' groups in pairs, 512 bits at a time
#endif
#endif

namespace vllm_gguf {


// ggml's type ids.
enum : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23,
};

struct Layout {
  int64_t values;  // weights a block holds
  int64_t bytes;   // bytes a block takes
};

inline Layout layout(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kIQ4_NL: return {32, 18};
    case kQ2_K: return {256, 84};
    case kQ3_K: return {256, 110};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    case kIQ4_XS: return {256, 136};
    default: TORCH_CHECK(false, "gguf_mm: unsupported GGUF block type ", type);
  }
  return {0, 0};
}

inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes (scales 0-3 and mins 0-3 in
// the low 6 bits of bytes 0-7; scales and mins 4-7 in the nibbles of bytes 8-11 with their
// top two bits in the top bits of bytes 0-7).
inline void k4_scales(const uint8_t* s, int sc[8], int mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Q3_K: sixteen 6-bit scales (biased by 32): low nibbles in bytes 0-7 (scales 0-7 low
// halves, 8-15 high halves), the top two bits in bytes 8-11, two bits per scale.
inline void k3_scales(const uint8_t* s, int sc[16]) {
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 0xF : s[i - 8] >> 4;
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = (low | (high << 4)) - 32;
  }
}


#if defined(VLLM_GGUF_MM)

// ---- block unpacking: a block as groups of 32 codes with int16 scales -------------------

struct Unpacked {
  __m256i codes[8];    // group g's 32 codes: unsigned, or signed values (kSigned)
  __m256i scales[8];   // int16: lanes 0-7 scale values 0-15 of the group, lanes 8-15 16-31
  float d;             // the block's float scale
  alignas(32) float mins[16];  // per 16 values, times the activations' sx16, subtracted
};

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 16 bytes of nibbles -> 32 codes: the low nibbles are values 0-15, the high ones 16-31.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
}

// Bit i of `bits` -> byte i: `value` where set, else 0.
inline __m256i spread_bits(uint32_t bits, uint8_t value) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), pick);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask);
  return _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(value)));
}

// Bit `bit` of each of 32 bytes -> `value` where set, else 0.
inline __m256i select_bit(__m256i bytes, int bit, uint8_t value) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(1 << bit));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, m), m),
                          _mm256_set1_epi8(static_cast<char>(value)));
}

// Bits [shift, shift + width) of each of 32 bytes.
inline __m256i bit_field(__m256i bytes, int shift, int width) {
  return _mm256_and_si256(_mm256_srli_epi16(bytes, shift),
                          _mm256_set1_epi8(static_cast<char>((1 << width) - 1)));
}

inline __m256i iq4_lookup(__m256i nibbles) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles);
}

inline __m256i scale_pair(int low, int high) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(high)),
                          _mm_set1_epi16(static_cast<int16_t>(low)));
}

// One struct per type: kValues, kBytes, kSigned, kMins (whether mins[] is used) and
// unpack(). Blocks of 32 fill group 0 and mins[0..1].
template <int64_t TYPE>
struct Block;

template <>
struct Block<kQ4_0> {
  static constexpr int kValues = 32, kBytes = 18;
  static constexpr bool kSigned = false, kMins = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    u.codes[0] = nibbles32(b + 2);
    u.scales[0] = _mm256_set1_epi16(1);
    u.mins[0] = u.mins[1] = 8.f * u.d;
  }
};

template <>
struct Block<kQ4_1> {
  static constexpr int kValues = 32, kBytes = 20;
  static constexpr bool kSigned = false, kMins = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    u.codes[0] = nibbles32(b + 4);
    u.scales[0] = _mm256_set1_epi16(1);
    u.mins[0] = u.mins[1] = -half_at(b + 2);
  }
};

template <>
struct Block<kQ5_0> {
  static constexpr int kValues = 32, kBytes = 22;
  static constexpr bool kSigned = false, kMins = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    u.codes[0] = _mm256_or_si256(nibbles32(b + 6), spread_bits(qh, 0x10));
    u.scales[0] = _mm256_set1_epi16(1);
    u.mins[0] = u.mins[1] = 16.f * u.d;
  }
};

template <>
struct Block<kQ5_1> {
  static constexpr int kValues = 32, kBytes = 24;
  static constexpr bool kSigned = false, kMins = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    u.codes[0] = _mm256_or_si256(nibbles32(b + 8), spread_bits(qh, 0x10));
    u.scales[0] = _mm256_set1_epi16(1);
    u.mins[0] = u.mins[1] = -half_at(b + 2);
  }
};

template <>
struct Block<kQ8_0> {
  static constexpr int kValues = 32, kBytes = 34;
  static constexpr bool kSigned = true, kMins = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    u.codes[0] = load32(b + 2);
    u.scales[0] = _mm256_set1_epi16(1);
  }
};

template <>
struct Block<kIQ4_NL> {
  static constexpr int kValues = 32, kBytes = 18;
  static constexpr bool kSigned = true, kMins = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    u.codes[0] = iq4_lookup(nibbles32(b + 2));
    u.scales[0] = _mm256_set1_epi16(1);
  }
};

template <>
struct Block<kQ2_K> {
  static constexpr int kValues = 256, kBytes = 84;
  static constexpr bool kSigned = false, kMins = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    const uint8_t* sc = b;
    u.d = half_at(b + 80);
    const float dmin = half_at(b + 82);
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = load32(b + 16 + 32 * h);
      for (int j = 0; j < 4; ++j) u.codes[4 * h + j] = bit_field(qs, 2 * j, 2);
    }
    for (int g = 0; g < 8; ++g) u.scales[g] = scale_pair(sc[2 * g] & 0xF, sc[2 * g + 1] & 0xF);
    for (int i = 0; i < 16; ++i) u.mins[i] = dmin * static_cast<float>(sc[i] >> 4);
  }
};

template <>
struct Block<kQ3_K> {
  static constexpr int kValues = 256, kBytes = 110;
  static constexpr bool kSigned = false, kMins = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    int sc[16];
    k3_scales(b + 96, sc);
    u.d = half_at(b + 108);
    const __m256i hm = load32(b);
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = load32(b + 32 + 32 * h);
      for (int j = 0; j < 4; ++j) {
        const int g = 4 * h + j;  // u = q + 4 h: values u - 4
        u.codes[g] = _mm256_or_si256(bit_field(qs, 2 * j, 2), select_bit(hm, g, 4));
      }
    }
    for (int g = 0; g < 8; ++g) u.scales[g] = scale_pair(sc[2 * g], sc[2 * g + 1]);
    for (int i = 0; i < 16; ++i) u.mins[i] = 4.f * u.d * static_cast<float>(sc[i]);
  }
};

template <int64_t TYPE>
struct BlockK45 {
  static constexpr bool kFive = TYPE == kQ5_K;
  static constexpr int kValues = 256, kBytes = kFive ? 176 : 144;
  static constexpr bool kSigned = false, kMins = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    const float dmin = half_at(b + 2);
    int sc[8], mn[8];
    k4_scales(b + 4, sc, mn);
    const uint8_t* qs = b + (kFive ? 48 : 16);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (kFive) qh = load32(b + 16);
    for (int p = 0; p < 4; ++p) {
      const __m256i q = load32(qs + 32 * p);
      for (int half = 0; half < 2; ++half) {
        const int g = 2 * p + half;
        u.codes[g] = bit_field(q, 4 * half, 4);
        if constexpr (kFive) u.codes[g] = _mm256_or_si256(u.codes[g], select_bit(qh, g, 0x10));
      }
    }
    for (int g = 0; g < 8; ++g) {
      u.scales[g] = _mm256_set1_epi16(static_cast<int16_t>(sc[g]));
      u.mins[2 * g] = u.mins[2 * g + 1] = dmin * static_cast<float>(mn[g]);
    }
  }
};
template <>
struct Block<kQ4_K> : BlockK45<kQ4_K> {};
template <>
struct Block<kQ5_K> : BlockK45<kQ5_K> {};

template <>
struct Block<kQ6_K> {
  static constexpr int kValues = 256, kBytes = 210;
  static constexpr bool kSigned = false, kMins = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    u.d = half_at(b + 208);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32);
      const __m256i qh = load32(b + 128 + 32 * h);
      for (int g = 0; g < 4; ++g) {  // u = low 4 | high 2 << 4: values u - 32
        const __m256i low = bit_field(g % 2 ? ql1 : ql0, 4 * (g / 2), 4);
        u.codes[4 * h + g] = _mm256_or_si256(low, _mm256_slli_epi16(bit_field(qh, 2 * g, 2), 4));
      }
    }
    for (int g = 0; g < 8; ++g) u.scales[g] = scale_pair(sc[2 * g], sc[2 * g + 1]);
    for (int i = 0; i < 16; ++i) u.mins[i] = 32.f * u.d * static_cast<float>(sc[i]);
  }
};

template <>
struct Block<kIQ4_XS> {
  static constexpr int kValues = 256, kBytes = 136;
  static constexpr bool kSigned = true, kMins = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    for (int g = 0; g < 8; ++g) {
      const int ls = ((b[4 + g / 2] >> (4 * (g % 2))) & 0xF) | (((sh >> (2 * g)) & 3) << 4);
      u.codes[g] = iq4_lookup(nibbles32(b + 8 + 16 * g));
      u.scales[g] = _mm256_set1_epi16(static_cast<int16_t>(ls - 32));
    }
  }
};

// ---- activations ------------------------------------------------------------------------

// Rows of x quantized per group of 32: qx [M, K] int8, dx [M, K / 32], sx [M, K / 16] (dx
// times the sum of each 16 codes).
struct Activations {
  int64_t k = 0;
  std::vector<int8_t> qx;
  std::vector<float> dx, sx;
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <typename T>
void quantize_activations(const T* x, int64_t rows, int64_t k, Activations* a) {
  a->k = k;
  a->qx.resize(rows * k);
  a->dx.resize(rows * k / 32);
  a->sx.resize(rows * k / 16);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < k / 32; ++g) {
      const T* p = x + r * k + 32 * g;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load8(p + 8 * i);
      __m256 amax = _mm256_and_ps(v[0], abs_mask);
      for (int i = 1; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const float dx = mx / 127.f;
      a->dx[r * (k / 32) + g] = dx;
      a->sx[r * (k / 16) + 2 * g] = dx * static_cast<float>(hsum8(_mm256_add_epi32(q[0], q[1])));
      a->sx[r * (k / 16) + 2 * g + 1] = dx * static_cast<float>(hsum8(_mm256_add_epi32(q[2], q[3])));
      // packs interleave 128-bit lanes; the permute puts the dwords back in order.
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a->qx.data() + r * k + 32 * g),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
  }
}

// ---- the products -----------------------------------------------------------------------

// Activation rows row0..row0+M times weight rows [begin, end): out [rows, n_total] float.
template <int64_t TYPE, int M>
void rows_times(const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t row0,
                float* out, int64_t n_total, int64_t begin, int64_t end) {
  using B = Block<TYPE>;
  constexpr int kGroups = B::kValues / 32;
  const int64_t k = a.k, blocks = k / B::kValues;
#if defined(VLLM_GGUF_MM_512)
  // Super-blocks in 512-bit halves: groups 2p and 2p + 1 side by side, each group's d dx
  // spread over its 8 lanes from one vector of the eight.
  constexpr bool kWide = kGroups == 8;
  __m512i spread[4];
  for (int p = 0; p < 4; ++p) {
    spread[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
  }
#else
  constexpr bool kWide = false;
#endif
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* wn = w + n * row_bytes;
    __m256 acc[M], acc_min[M];
    for (int r = 0; r < M; ++r) acc[r] = acc_min[r] = _mm256_setzero_ps();
#if defined(VLLM_GGUF_MM_512)
    __m512 wide[M];
    for (int r = 0; r < M; ++r) wide[r] = _mm512_setzero_ps();
#endif
    float min_sum[M] = {};
    for (int64_t blk = 0; blk < blocks; ++blk) {
      Unpacked u;
      B::unpack(wn + blk * B::kBytes, u);
      const int64_t col = blk * B::kValues;
      if constexpr (kWide) {
#if defined(VLLM_GGUF_MM_512)
        __m512i codes[4], scales[4], magnitude[4];
        for (int p = 0; p < 4; ++p) {
          codes[p] = _mm512_inserti64x4(_mm512_castsi256_si512(u.codes[2 * p]),
                                        u.codes[2 * p + 1], 1);
          scales[p] = _mm512_inserti64x4(_mm512_castsi256_si512(u.scales[2 * p]),
                                         u.scales[2 * p + 1], 1);
          if constexpr (B::kSigned) magnitude[p] = _mm512_abs_epi8(codes[p]);
        }
        const __m256 d = _mm256_set1_ps(u.d);
        for (int r = 0; r < M; ++r) {
          const int64_t row = row0 + r;
          const int8_t* qx = a.qx.data() + row * k + col;
          const __m512 ddx = _mm512_castps256_ps512(
              _mm256_mul_ps(d, _mm256_loadu_ps(a.dx.data() + row * (k / 32) + col / 32)));
          for (int p = 0; p < 4; ++p) {
            __m512i x = _mm512_loadu_si512(qx + 64 * p);
            __m512i pairs;
            if constexpr (B::kSigned) {  // |w| times x with w's sign (no vpsignb in 512 bits)
              x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(codes[p]), _mm512_setzero_si512(), x);
              pairs = _mm512_maddubs_epi16(magnitude[p], x);
            } else {
              pairs = _mm512_maddubs_epi16(codes[p], x);
            }
            const __m512i dot = _mm512_madd_epi16(pairs, scales[p]);
            wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                      _mm512_permutexvar_ps(spread[p], ddx), wide[r]);
          }
        }
#endif
      } else {
        __m256i magnitude[kGroups];
        if constexpr (B::kSigned) {
          for (int g = 0; g < kGroups; ++g) magnitude[g] = _mm256_sign_epi8(u.codes[g], u.codes[g]);
        }
        for (int r = 0; r < M; ++r) {
          const int64_t row = row0 + r;
          const int8_t* qx = a.qx.data() + row * k + col;
          const float* dx = a.dx.data() + row * (k / 32) + col / 32;
          for (int g = 0; g < kGroups; ++g) {
            const __m256i x = load32(reinterpret_cast<const uint8_t*>(qx + 32 * g));
            __m256i pairs;
            if constexpr (B::kSigned) {
              pairs = _mm256_maddubs_epi16(magnitude[g], _mm256_sign_epi8(x, u.codes[g]));
            } else {
              pairs = _mm256_maddubs_epi16(u.codes[g], x);
            }
            const __m256i dot = _mm256_madd_epi16(pairs, u.scales[g]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(u.d * dx[g]), acc[r]);
          }
        }
      }
      if constexpr (B::kMins) {
        for (int r = 0; r < M; ++r) {
          const float* sx = a.sx.data() + (row0 + r) * (k / 16) + col / 16;
          if constexpr (kGroups == 8) {
            acc_min[r] = _mm256_fmadd_ps(_mm256_load_ps(u.mins), _mm256_loadu_ps(sx), acc_min[r]);
            acc_min[r] = _mm256_fmadd_ps(_mm256_load_ps(u.mins + 8), _mm256_loadu_ps(sx + 8),
                                         acc_min[r]);
          } else {
            min_sum[r] += u.mins[0] * sx[0] + u.mins[1] * sx[1];
          }
        }
      }
    }
    for (int r = 0; r < M; ++r) {
      float sum = hsum8(acc[r]);
#if defined(VLLM_GGUF_MM_512)
      sum += _mm512_reduce_add_ps(wide[r]);
#endif
      out[(row0 + r) * n_total + n] = sum - hsum8(acc_min[r]) - min_sum[r];
    }
  }
}

constexpr int64_t kMaxRows = 8;  // activation rows one pass keeps in registers
constexpr int64_t kTile = 16;    // weight rows a tile: reread from L1 by each later pass

template <int64_t TYPE>
void range_times(const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t first_row,
                 int64_t rows, float* out, int64_t n_total, int64_t begin, int64_t end) {
  // A pass of `count` rows as passes of 8, 4, 2 and 1 (count <= 8).
  auto pass = [&](int64_t row0, int64_t count, int64_t first, int64_t last) {
    for (int64_t done = 0; done < count;) {
      const int64_t left = count - done;
      if (left >= 8) { rows_times<TYPE, 8>(w, row_bytes, a, row0 + done, out, n_total, first, last); done += 8; }
      else if (left >= 4) { rows_times<TYPE, 4>(w, row_bytes, a, row0 + done, out, n_total, first, last); done += 4; }
      else if (left >= 2) { rows_times<TYPE, 2>(w, row_bytes, a, row0 + done, out, n_total, first, last); done += 2; }
      else { rows_times<TYPE, 1>(w, row_bytes, a, row0 + done, out, n_total, first, last); done += 1; }
    }
  };
  if (rows <= kMaxRows) {
    pass(first_row, rows, begin, end);
    return;
  }
  for (int64_t tile = begin; tile < end; tile += kTile) {
    const int64_t tile_end = std::min(end, tile + kTile);
    for (int64_t row0 = 0; row0 < rows; row0 += kMaxRows) {
      pass(first_row + row0, std::min(kMaxRows, rows - row0), tile, tile_end);
    }
  }
}

inline void dispatch(int64_t type, const uint8_t* w, int64_t row_bytes, const Activations& a,
                     int64_t first_row, int64_t rows, float* out, int64_t n_total,
                     int64_t begin, int64_t end) {
  switch (type) {
#define VLLM_GGUF_CASE(T) \
    case T: range_times<T>(w, row_bytes, a, first_row, rows, out, n_total, begin, end); break;
    VLLM_GGUF_CASE(kQ4_0) VLLM_GGUF_CASE(kQ4_1) VLLM_GGUF_CASE(kQ5_0) VLLM_GGUF_CASE(kQ5_1)
    VLLM_GGUF_CASE(kQ8_0) VLLM_GGUF_CASE(kIQ4_NL) VLLM_GGUF_CASE(kQ2_K) VLLM_GGUF_CASE(kQ3_K)
    VLLM_GGUF_CASE(kQ4_K) VLLM_GGUF_CASE(kQ5_K) VLLM_GGUF_CASE(kQ6_K) VLLM_GGUF_CASE(kIQ4_XS)
#undef VLLM_GGUF_CASE
    default: break;  // checked by the caller
  }
}

#endif  // VLLM_GGUF_MM

}  // namespace vllm_gguf
