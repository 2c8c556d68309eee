// The GGUF block layer shared by `gguf_mm` (dense layers) and `moe_experts` (experts):
// the block types' layouts, their unpacking into one shape, the activations' int8
// quantization and the products over ranges of rows. See gguf_mm.cpp for the scheme.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif
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

// This project's ids (not ggml's) for a type's rows repacked at load (gguf_mm.cpp's
// gguf_repack): Q5_0 with each 8 blocks of a row as one super-block (Block<kQ5_0R8>), in
// the same bytes. Its values are Q5_0's; only the arrangement differs.
enum : int64_t { kQ5_0R8 = 1006 };

struct Layout {
  int64_t values;  // weights a block holds
  int64_t bytes;   // bytes a block takes
};

inline Layout layout(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: case kQ5_0R8: return {32, 22};
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
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
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


// Rows of x quantized per group of 32: qx [M, K] int8, dx [M, K / 32], sx [M, K / 16] (dx
// times the sum of each 16 codes) and s32 [M, K / 32] (dx times the sum of each 32). Declared
// in every build (moe.cpp names it on paths a processor without AVX2 never takes).
struct Activations {
  int64_t k = 0;
  std::vector<int8_t> qx;
  std::vector<float> dx, sx, s32;
};

#if defined(VLLM_GGUF_MM)

// ---- block unpacking: a block as groups of 32 codes and their scales -------------------
//
// A block of 32 values (Q4_0 ... Q8_0, IQ4_NL) is codes[0], its float scale `d` and, where
// the type has one, the float `min` subtracted per 32 (times the activations' s32).
// A super-block of 256 is codes[0..7] and either
//   - one scale per group (Q4_K, Q5_K, IQ4_XS): `scale` lane g = d * s_g as a float, and
//     the mins per group in `mins[0]` (lane g, times s32); or
//   - integer scales per 16 values (Q2_K, Q3_K, Q6_K, `kScales16`): `sc16` (int16 lanes in
//     order), `scale` = d in every lane, and the mins per 16 in `mins[0..1]` (times sx).
// Every field is built in registers (no scalar stores read back as vectors).

struct Unpacked {
  __m256i codes[8];   // group g's 32 codes: unsigned, or signed values (kSigned)
  __m256i sc16;       // kScales16: the 16 scales as int16
  __m256 scale;       // super-blocks: each group's float factor (see above)
  __m256 mins[2];     // super-blocks with mins: per group (mins[0]) or per 16 (kScales16)
  float d = 0.f, min = 0.f;  // blocks of 32
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

// Eight bytes (the low 64 bits of `v`), unsigned or signed, as eight floats.
inline __m256 bytes_to_floats(__m128i v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}
inline __m256 signed_bytes_to_floats(__m128i v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

// Sixteen signed scales (bytes) of a kScales16 type: sc16, and mins = factor * scale.
inline void scales16(__m128i sc, float factor, Unpacked& u) {
  u.sc16 = _mm256_cvtepi8_epi16(sc);
  const __m256 f = _mm256_set1_ps(factor);
  u.mins[0] = _mm256_mul_ps(f, signed_bytes_to_floats(sc));
  u.mins[1] = _mm256_mul_ps(f, signed_bytes_to_floats(_mm_srli_si128(sc, 8)));
}

// One struct per type: kValues, kBytes, kSigned, kMins (whether it subtracts mins),
// kScales16 and unpack().
template <int64_t TYPE>
struct Block;

template <>
struct Block<kQ4_0> {
  static constexpr int kValues = 32, kBytes = 18;
  static constexpr bool kSigned = false, kMins = true, kScales16 = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    u.codes[0] = nibbles32(b + 2);
    u.min = 8.f * u.d;
  }
};

template <>
struct Block<kQ4_1> {
  static constexpr int kValues = 32, kBytes = 20;
  static constexpr bool kSigned = false, kMins = true, kScales16 = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    u.codes[0] = nibbles32(b + 4);
    u.min = -half_at(b + 2);
  }
};

template <>
struct Block<kQ5_0> {
  static constexpr int kValues = 32, kBytes = 22;
  static constexpr bool kSigned = false, kMins = true, kScales16 = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    u.codes[0] = _mm256_or_si256(nibbles32(b + 6), spread_bits(qh, 0x10));
    u.min = 16.f * u.d;
  }
};

// Q5_0 repacked, eight blocks of a row as one super-block of 176 bytes (the same bytes):
//   d[8] (float16, block g's scale) | hb[32]: bit g of byte j is block g's fifth bit of
//   value j | qs[4][32]: byte j of chunk c holds block 2c's value j (low nibble) and block
//   2c + 1's (high nibble).
// Unpacked as a super-block: block g is group g, with factor d_g and min 16 d_g, so that
// the products take the super-blocks' path (one conversion per 8 groups, group_sums); a
// group's fifth bits cost a shift and a mask, where spreading a block's 32 bits took six
// operations. The last K % 256 values of a row stay Q5_0 blocks (kTail).
template <>
struct Block<kQ5_0R8> {
  static constexpr int kValues = 256, kBytes = 176;
  static constexpr bool kSigned = false, kMins = true, kScales16 = false;
  static constexpr int64_t kTail = kQ5_0;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    u.mins[0] = _mm256_mul_ps(u.scale, _mm256_set1_ps(16.f));
    const __m256i hb = load32(b + 16), bit4 = _mm256_set1_epi8(0x10);
    for (int c = 0; c < 4; ++c) {
      const __m256i q = load32(b + 48 + 32 * c);
      u.codes[2 * c] = bit_field(q, 0, 4);
      u.codes[2 * c + 1] = bit_field(q, 4, 4);
    }
    // Bit g of each byte to bit 4 (16-bit shifts: no bit crosses into a neighbour's bit 4).
    u.codes[0] = _mm256_or_si256(u.codes[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
    u.codes[1] = _mm256_or_si256(u.codes[1], _mm256_and_si256(_mm256_slli_epi16(hb, 3), bit4));
    u.codes[2] = _mm256_or_si256(u.codes[2], _mm256_and_si256(_mm256_slli_epi16(hb, 2), bit4));
    u.codes[3] = _mm256_or_si256(u.codes[3], _mm256_and_si256(_mm256_slli_epi16(hb, 1), bit4));
    u.codes[4] = _mm256_or_si256(u.codes[4], _mm256_and_si256(hb, bit4));
    u.codes[5] = _mm256_or_si256(u.codes[5], _mm256_and_si256(_mm256_srli_epi16(hb, 1), bit4));
    u.codes[6] = _mm256_or_si256(u.codes[6], _mm256_and_si256(_mm256_srli_epi16(hb, 2), bit4));
    u.codes[7] = _mm256_or_si256(u.codes[7], _mm256_and_si256(_mm256_srli_epi16(hb, 3), bit4));
  }
};

// The type of the 32-value blocks a repacked row ends with (Block<T>::kTail), or 0.
template <typename B, typename = void>
struct TailOf {
  static constexpr int64_t type = 0;
};
template <typename B>
struct TailOf<B, std::void_t<decltype(B::kTail)>> {
  static constexpr int64_t type = B::kTail;
};

template <>
struct Block<kQ5_1> {
  static constexpr int kValues = 32, kBytes = 24;
  static constexpr bool kSigned = false, kMins = true, kScales16 = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    u.codes[0] = _mm256_or_si256(nibbles32(b + 8), spread_bits(qh, 0x10));
    u.min = -half_at(b + 2);
  }
};

template <>
struct Block<kQ8_0> {
  static constexpr int kValues = 32, kBytes = 34;
  static constexpr bool kSigned = true, kMins = false, kScales16 = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    u.codes[0] = load32(b + 2);
  }
};

template <>
struct Block<kIQ4_NL> {
  static constexpr int kValues = 32, kBytes = 18;
  static constexpr bool kSigned = true, kMins = false, kScales16 = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    u.d = half_at(b);
    u.codes[0] = iq4_lookup(nibbles32(b + 2));
  }
};

template <>
struct Block<kQ2_K> {
  static constexpr int kValues = 256, kBytes = 84;
  static constexpr bool kSigned = false, kMins = true, kScales16 = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    // 16 bytes: each 16 values' scale in the low nibble, its min in the high one.
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = load32(b + 16 + 32 * h);
      for (int j = 0; j < 4; ++j) u.codes[4 * h + j] = bit_field(qs, 2 * j, 2);
    }
    u.sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s, low4));
    u.scale = _mm256_set1_ps(d);
    const __m128i mins = _mm_and_si128(_mm_srli_epi16(s, 4), low4);
    u.mins[0] = _mm256_mul_ps(_mm256_set1_ps(dmin), bytes_to_floats(mins));
    u.mins[1] = _mm256_mul_ps(_mm256_set1_ps(dmin), bytes_to_floats(_mm_srli_si128(mins, 8)));
  }
};

template <>
struct Block<kQ3_K> {
  static constexpr int kValues = 256, kBytes = 110;
  static constexpr bool kSigned = false, kMins = true, kScales16 = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    const float d = half_at(b + 108);
    const __m256i hm = load32(b);
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = load32(b + 32 + 32 * h);
      for (int j = 0; j < 4; ++j) {
        const int g = 4 * h + j;  // u = q + 4 h: values u - 4
        u.codes[g] = _mm256_or_si256(bit_field(qs, 2 * j, 2), select_bit(hm, g, 4));
      }
    }
    // The sixteen 6-bit scales (k3_scales's layout): low nibbles from bytes 0-7 (low
    // halves, then high halves), two high bits each from bytes 8-11 (scale i: byte i % 4,
    // bits 2 (i / 4)), biased by 32.
    const uint8_t* s = b + 96;
    const __m128i lo8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
    const __m128i lows = _mm_and_si128(_mm_unpacklo_epi64(lo8, _mm_srli_epi16(lo8, 4)),
                                       _mm_set1_epi8(0x0F));
    uint32_t hb;
    std::memcpy(&hb, s + 8, 4);
    const __m128i highs = _mm_and_si128(
        _mm_srlv_epi32(_mm_set1_epi32(static_cast<int32_t>(hb)), _mm_setr_epi32(0, 2, 4, 6)),
        _mm_set1_epi8(3));
    const __m128i sc = _mm_sub_epi8(_mm_or_si128(lows, _mm_slli_epi16(highs, 4)),
                                    _mm_set1_epi8(32));
    scales16(sc, 4.f * d, u);
    u.scale = _mm256_set1_ps(d);
  }
};

// Q4_K / Q5_K's twelve bytes of 6-bit scales and mins (k4_scales's layout) as eight
// scale bytes and eight min bytes, with 32-bit word operations.
inline void k4_scale_bytes(const uint8_t* s, uint64_t* scales, uint64_t* mins) {
  uint32_t a, b, c;  // bytes 0-3 (scales 0-3, top bits of 4-7), 4-7 (mins), 8-11
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t six = 0x3F3F3F3Fu, nib = 0x0F0F0F0Fu, top = 0x30303030u;
  *scales = (a & six) | static_cast<uint64_t>((c & nib) | ((a >> 2) & top)) << 32;
  *mins = (b & six) | static_cast<uint64_t>(((c >> 4) & nib) | ((b >> 2) & top)) << 32;
}

template <int64_t TYPE>
struct BlockK45 {
  static constexpr bool kFive = TYPE == kQ5_K;
  static constexpr int kValues = 256, kBytes = kFive ? 176 : 144;
  static constexpr bool kSigned = false, kMins = true, kScales16 = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    const float d = half_at(b), dmin = half_at(b + 2);
    uint64_t sc, mn;
    k4_scale_bytes(b + 4, &sc, &mn);
    u.scale = _mm256_mul_ps(_mm256_set1_ps(d), bytes_to_floats(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
    u.mins[0] = _mm256_mul_ps(_mm256_set1_ps(dmin), bytes_to_floats(_mm_cvtsi64_si128(static_cast<int64_t>(mn))));
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
  }
};
template <>
struct Block<kQ4_K> : BlockK45<kQ4_K> {};
template <>
struct Block<kQ5_K> : BlockK45<kQ5_K> {};

template <>
struct Block<kQ6_K> {
  static constexpr int kValues = 256, kBytes = 210;
  static constexpr bool kSigned = false, kMins = true, kScales16 = true;
  static void unpack(const uint8_t* b, Unpacked& u) {
    const float d = half_at(b + 208);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(b + 64 * h), ql1 = load32(b + 64 * h + 32);
      const __m256i qh = load32(b + 128 + 32 * h);
      for (int g = 0; g < 4; ++g) {  // u = low 4 | high 2 << 4: values u - 32
        const __m256i low = bit_field(g % 2 ? ql1 : ql0, 4 * (g / 2), 4);
        u.codes[4 * h + g] = _mm256_or_si256(low, _mm256_slli_epi16(bit_field(qh, 2 * g, 2), 4));
      }
    }
    scales16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)), 32.f * d, u);
    u.scale = _mm256_set1_ps(d);
  }
};

template <>
struct Block<kIQ4_XS> {
  static constexpr int kValues = 256, kBytes = 136;
  static constexpr bool kSigned = true, kMins = false, kScales16 = false;
  static void unpack(const uint8_t* b, Unpacked& u) {
    const float d = half_at(b);
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    int ls[8];
    for (int g = 0; g < 8; ++g) {
      ls[g] = (((b[4 + g / 2] >> (4 * (g % 2))) & 0xF) | (((sh >> (2 * g)) & 3) << 4)) - 32;
      u.codes[g] = iq4_lookup(nibbles32(b + 8 + 16 * g));
    }
    u.scale = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_setr_epi32(
        ls[0], ls[1], ls[2], ls[3], ls[4], ls[5], ls[6], ls[7])));
  }
};

// ---- dequantization ---------------------------------------------------------------------

// A block's weights as float32, the reference's bits (gguf_mm.cpp's dequantize_block, which
// is gguf-py's arithmetic): w = F * (u - offset) - min, F the float factor of each 16
// values (d, d * s, or the K-quants' d * s), each product rounded before the subtraction.
// The offset is the reference's integer one (Q4_0's 8, Q5_0's 16, Q3_K's 4, Q6_K's 32); a
// min is subtracted where the reference subtracts one (Q4_1 / Q5_1's -m, Q2_K, Q4_K, Q5_K).
constexpr int dequant_offset(int64_t type) {
  return type == kQ4_0                      ? 8
         : type == kQ5_0 || type == kQ5_0R8   ? 16
         : type == kQ3_K                      ? 4
         : type == kQ6_K                      ? 32
                                              : 0;
}
constexpr bool dequant_min(int64_t type) {
  return type == kQ4_1 || type == kQ5_1 || type == kQ2_K || type == kQ4_K || type == kQ5_K;
}

template <int64_t TYPE>
inline void dequantize_block_fast(const uint8_t* b, float* y) {
  using B = Block<TYPE>;
  constexpr int kOffset = dequant_offset(TYPE);
  constexpr bool kMin = dequant_min(TYPE);
  Unpacked u;
  B::unpack(b, u);
  alignas(32) float factor[16], mins[16];
  if constexpr (B::kValues == 32) {
    factor[0] = factor[1] = u.d;
    mins[0] = mins[1] = u.min;
  } else if constexpr (B::kScales16) {
    alignas(32) int16_t sc[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sc), u.sc16);
    const float d = _mm256_cvtss_f32(u.scale);
    for (int i = 0; i < 16; ++i) factor[i] = d * static_cast<float>(sc[i]);
    if constexpr (kMin) {
      _mm256_store_ps(mins, u.mins[0]);
      _mm256_store_ps(mins + 8, u.mins[1]);
    }
  } else {
    alignas(32) float s[8], m[8];
    _mm256_store_ps(s, u.scale);
    if constexpr (kMin) _mm256_store_ps(m, u.mins[0]);
    for (int g = 0; g < 8; ++g) {
      factor[2 * g] = factor[2 * g + 1] = s[g];
      if constexpr (kMin) mins[2 * g] = mins[2 * g + 1] = m[g];
    }
  }
  for (int g = 0; g < B::kValues / 32; ++g) {
    for (int q = 0; q < 4; ++q) {  // values 32 g + 8 q ... + 7
      const __m128i half = q < 2 ? _mm256_castsi256_si128(u.codes[g])
                                 : _mm256_extracti128_si256(u.codes[g], 1);
      const __m128i eight = q % 2 ? _mm_srli_si128(half, 8) : half;
      __m256i v = B::kSigned ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
      if constexpr (kOffset != 0) v = _mm256_sub_epi32(v, _mm256_set1_epi32(kOffset));
      const int i = 2 * g + q / 2;
      __m256 f = _mm256_set1_ps(factor[i]);
      asm("" : "+x"(f));  // the factor as computed (no reassociation into the product)
      __m256 w = _mm256_mul_ps(f, _mm256_cvtepi32_ps(v));
      if constexpr (kMin) {
        asm("" : "+x"(w));  // rounded before the subtraction (no FMA)
        w = _mm256_sub_ps(w, _mm256_set1_ps(mins[i]));
      }
      _mm256_storeu_ps(y + 32 * g + 8 * q, w);
    }
  }
}

// Weight rows [begin, end) of `w` (uint8 [N, row_bytes] blocks of `type`) as float32 rows of
// k values at `out` (row begin first).
template <int64_t TYPE>
void dequantize_rows_of(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t begin,
                        int64_t end, float* out) {
  using B = Block<TYPE>;
  constexpr int64_t kTail = TailOf<B>::type;
  const int64_t blocks = k / B::kValues;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float* y = out + (n - begin) * k;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      dequantize_block_fast<TYPE>(row + blk * B::kBytes, y + blk * B::kValues);
    }
    if constexpr (kTail != 0) {
      for (int64_t t = 0; t < k % B::kValues / 32; ++t)
        dequantize_block_fast<kTail>(row + blocks * B::kBytes + t * Block<kTail>::kBytes,
                                     y + blocks * B::kValues + 32 * t);
    }
  }
}

inline void dequantize_rows(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t k,
                            int64_t begin, int64_t end, float* out) {
  switch (type) {
#define VLLM_GGUF_CASE(T) case T: dequantize_rows_of<T>(w, row_bytes, k, begin, end, out); break;
    VLLM_GGUF_CASE(kQ4_0) VLLM_GGUF_CASE(kQ4_1) VLLM_GGUF_CASE(kQ5_0) VLLM_GGUF_CASE(kQ5_1)
    VLLM_GGUF_CASE(kQ8_0) VLLM_GGUF_CASE(kIQ4_NL) VLLM_GGUF_CASE(kQ2_K) VLLM_GGUF_CASE(kQ3_K)
    VLLM_GGUF_CASE(kQ4_K) VLLM_GGUF_CASE(kQ5_K) VLLM_GGUF_CASE(kQ6_K) VLLM_GGUF_CASE(kIQ4_XS)
    VLLM_GGUF_CASE(kQ5_0R8)
#undef VLLM_GGUF_CASE
    default: break;  // checked by the caller
  }
}

// ---- activations ------------------------------------------------------------------------

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
  a->s32.resize(rows * k / 32);
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
      const int32_t low = hsum8(_mm256_add_epi32(q[0], q[1]));
      const int32_t high = hsum8(_mm256_add_epi32(q[2], q[3]));
      a->sx[r * (k / 16) + 2 * g] = dx * static_cast<float>(low);
      a->sx[r * (k / 16) + 2 * g + 1] = dx * static_cast<float>(high);
      a->s32[r * (k / 32) + g] = dx * static_cast<float>(low + high);
      // packs interleave 128-bit lanes; the permute puts the dwords back in order.
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a->qx.data() + r * k + 32 * g),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
  }
}

// ---- the products -----------------------------------------------------------------------

// A super-block's sums accumulate in two partial registers per row and block, added to the
// row's accumulator once a block, so one row's dependency chain is one add a block.
// kept_whole: each block's partial sum passes an empty asm statement, so that -ffast-math's
// reassociation cannot fold its terms into the accumulator in an order that depends on how
// many rows the pass unrolls: a row's result is the same bits in every pass (and alone).

// kScales16, AVX2: group g's int16 scales (lanes 0-7 scale 2g, lanes 8-15 scale 2g + 1).
inline __m256i group_scales(__m256i sc16, int g) {
  const __m128i half = g < 4 ? _mm256_castsi256_si128(sc16) : _mm256_extracti128_si256(sc16, 1);
  const int j = 2 * (g % 4);  // the int16 index of scale 2g in its half
  const auto pick = [](int i) { return static_cast<int16_t>((2 * i) | ((2 * i + 1) << 8)); };
  const __m256i shuffle = _mm256_set_m128i(_mm_set1_epi16(pick(j + 1)), _mm_set1_epi16(pick(j)));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(half), shuffle);
}

// Eight groups' integer dot products (eight int32 lanes each) as one vector of their
// eight sums, group g in lane g: one conversion and one product with the groups' factors a
// super-block and row, where converting and scaling each group's lanes took three
// instructions a group (the one-row Q4_K product: 23.0 -> 27.2 GB/s on 2 Zen 3 cores).
inline __m256i group_sums(const __m256i (&dots)[8]) {
  // hadd(hadd(d0, d1), hadd(d2, d3)): groups 0-3's sums over lanes 0-3 in the low half,
  // over lanes 4-7 in the high half.
  const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]),
                                        _mm256_hadd_epi32(dots[2], dots[3]));
  const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[4], dots[5]),
                                         _mm256_hadd_epi32(dots[6], dots[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                          _mm256_permute2x128_si256(low, high, 0x31));
}

// Weights a few KB ahead of the block being read are asked for now (every 64-byte line
// once or more): with the hardware prefetchers alone, one-row products stalled on memory
// they could have overlapped (Gemma 3's Q8_0 vocabulary projection, 2 threads on AVX2
// Zen 3: 25.7 -> 31.1 GB/s; docs/speed.md). Types bound by their unpacking (Q5_0) gain
// nothing. A prefetch past the end of the weight is harmless (it never faults). Measured on
// AVX2 only; the AVX-512 form takes the same distance.
constexpr int64_t kPrefetchAhead = 4096;

template <int BYTES>
inline void prefetch_ahead(const uint8_t* block) {
  for (int line = 0; line < (BYTES + 63) / 64; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchAhead + 64 * line), _MM_HINT_T0);
}

// Blocks [first, last) of a weight row of 32-value blocks (`wn`: block `first`) times
// activation rows row0..row0+M: each block's product into acc[r], its min term into
// min_sum[r].
template <int64_t TYPE, int M>
inline void blocks32_times(const uint8_t* wn, int64_t first, int64_t last, const Activations& a,
                           int64_t row0, __m256 (&acc)[M], float (&min_sum)[M]) {
  using B = Block<TYPE>;
  static_assert(B::kValues == 32);
  const int64_t k = a.k, groups = k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t blk = first; blk < last; ++blk) {
    const uint8_t* b = wn + (blk - first) * B::kBytes;
    prefetch_ahead<B::kBytes>(b);
    Unpacked u;
    B::unpack(b, u);
    __m256i magnitude = u.codes[0];
    if constexpr (B::kSigned) magnitude = _mm256_sign_epi8(u.codes[0], u.codes[0]);
    for (int r = 0; r < M; ++r) {
      const int64_t row = row0 + r;
      const __m256i x = load32(reinterpret_cast<const uint8_t*>(a.qx.data() + row * k + 32 * blk));
      const __m256i pairs = B::kSigned
          ? _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, u.codes[0]))
          : _mm256_maddubs_epi16(u.codes[0], x);
      const __m256i dot = _mm256_madd_epi16(pairs, ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_set1_ps(u.d * a.dx[row * groups + blk]), acc[r]);
      if constexpr (B::kMins) min_sum[r] += u.min * a.s32[row * groups + blk];
    }
  }
}

// Activation rows row0..row0+M times weight rows [begin, end): out [rows, n_total] float.
template <int64_t TYPE, int M>
void rows_times(const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t row0,
                float* out, int64_t n_total, int64_t begin, int64_t end) {
  using B = Block<TYPE>;
  constexpr int kGroups = B::kValues / 32;
  constexpr int64_t kTail = TailOf<B>::type;  // a repacked row's last blocks of 32
  const int64_t k = a.k, blocks = k / B::kValues, groups = k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
#if defined(VLLM_GGUF_MM_512)
  // Super-blocks in 512-bit halves: groups 2p and 2p + 1 side by side, each group's
  // factor spread over its 8 lanes from one vector of the eight.
  __m512i spread[4], pair_scales[4];
  for (int p = 0; p < 4; ++p) {
    spread[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
    // kScales16: lanes 8i..8i+7 of pair p take scale 4p + i.
    pair_scales[p] = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(4 * p + 1)),
                                                _mm_set1_epi16(static_cast<int16_t>(4 * p)))),
        _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(4 * p + 3)),
                         _mm_set1_epi16(static_cast<int16_t>(4 * p + 2))), 1);
  }
  const __m512i ones512 = _mm512_set1_epi16(1);
#endif
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* wn = w + n * row_bytes;
    if constexpr (kGroups == 1) {
      __m256 acc[M];
      float min_sum[M] = {};
      for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
      blocks32_times<TYPE, M>(wn, 0, blocks, a, row0, acc, min_sum);
      for (int r = 0; r < M; ++r) out[(row0 + r) * n_total + n] = hsum8(acc[r]) - min_sum[r];
    } else {
#if defined(VLLM_GGUF_MM_512)
      __m512 acc[M];
      for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
#else
      __m256 acc[M];
      for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
#endif
      __m256 acc_min[M];
      for (int r = 0; r < M; ++r) acc_min[r] = _mm256_setzero_ps();
      for (int64_t blk = 0; blk < blocks; ++blk) {
        prefetch_ahead<B::kBytes>(wn + blk * B::kBytes);
        Unpacked u;
        B::unpack(wn + blk * B::kBytes, u);
        // The block's factors as computed (kept_whole): a factor used by one row only could
        // otherwise be reassociated into that row's products, a different rounding.
        asm("" : "+x"(u.scale), "+x"(u.mins[0]), "+x"(u.mins[1]));
        const int64_t group0 = blk * 8;
#if defined(VLLM_GGUF_MM_512)
        __m512i codes[4], scales[4], magnitude[4];
        for (int p = 0; p < 4; ++p) {
          codes[p] = _mm512_inserti64x4(_mm512_castsi256_si512(u.codes[2 * p]), u.codes[2 * p + 1], 1);
          if constexpr (B::kSigned) magnitude[p] = _mm512_abs_epi8(codes[p]);
          if constexpr (B::kScales16) {
            scales[p] = _mm512_permutexvar_epi16(pair_scales[p], _mm512_castsi256_si512(u.sc16));
          } else {
            scales[p] = ones512;
          }
        }
        for (int r = 0; r < M; ++r) {
          const int64_t row = row0 + r;
          const int8_t* qx = a.qx.data() + row * k + 32 * group0;
          const __m512 factor = _mm512_castps256_ps512(
              _mm256_mul_ps(u.scale, _mm256_loadu_ps(a.dx.data() + row * groups + group0)));
          __m512 part[2];
          for (int p = 0; p < 4; ++p) {
            __m512i x = _mm512_loadu_si512(qx + 64 * p);
            __m512i pairs;
            if constexpr (B::kSigned) {  // |w| times x with w's sign (no vpsignb in 512 bits)
              x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(codes[p]), _mm512_setzero_si512(), x);
              pairs = _mm512_maddubs_epi16(magnitude[p], x);
            } else {
              pairs = _mm512_maddubs_epi16(codes[p], x);
            }
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_madd_epi16(pairs, scales[p]));
            const __m512 f = _mm512_permutexvar_ps(spread[p], factor);
            part[p % 2] = p < 2 ? _mm512_mul_ps(dot, f) : _mm512_fmadd_ps(dot, f, part[p % 2]);
          }
          __m512 sum = _mm512_add_ps(part[0], part[1]);
          asm("" : "+v"(sum));  // the block's sum stays one term (see kept_whole)
          acc[r] = _mm512_add_ps(acc[r], sum);
        }
#else
        __m256i scales[8], magnitude[8];
        for (int g = 0; g < 8; ++g) {
          if constexpr (B::kSigned) magnitude[g] = _mm256_sign_epi8(u.codes[g], u.codes[g]);
          if constexpr (B::kScales16) {
            scales[g] = group_scales(u.sc16, g);
          } else {
            scales[g] = ones;
          }
        }
        for (int r = 0; r < M; ++r) {
          const int64_t row = row0 + r;
          const int8_t* qx = a.qx.data() + row * k + 32 * group0;
          const __m256 factor = _mm256_mul_ps(u.scale, _mm256_loadu_ps(a.dx.data() + row * groups + group0));
          __m256i dots[8];
          for (int g = 0; g < 8; ++g) {
            const __m256i x = load32(reinterpret_cast<const uint8_t*>(qx + 32 * g));
            const __m256i pairs = B::kSigned
                ? _mm256_maddubs_epi16(magnitude[g], _mm256_sign_epi8(x, u.codes[g]))
                : _mm256_maddubs_epi16(u.codes[g], x);
            dots[g] = _mm256_madd_epi16(pairs, scales[g]);
          }
          __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(group_sums(dots)), factor);
          asm("" : "+x"(sum));  // the block's sum stays one term (see kept_whole)
          acc[r] = _mm256_add_ps(acc[r], sum);
        }
#endif
        if constexpr (B::kMins) {
          for (int r = 0; r < M; ++r) {
            const int64_t row = row0 + r;
            if constexpr (B::kScales16) {
              const float* sx = a.sx.data() + row * (k / 16) + 2 * group0;
              __m256 m = _mm256_fmadd_ps(u.mins[1], _mm256_loadu_ps(sx + 8),
                                         _mm256_mul_ps(u.mins[0], _mm256_loadu_ps(sx)));
              asm("" : "+x"(m));
              acc_min[r] = _mm256_add_ps(acc_min[r], m);
            } else {
              acc_min[r] = _mm256_fmadd_ps(u.mins[0], _mm256_loadu_ps(a.s32.data() + row * groups + group0),
                                           acc_min[r]);
            }
          }
        }
      }
      // A repacked row's last blocks of 32: their own sums, added whole.
      __m256 tail_acc[M];
      float tail_min[M] = {};
      if constexpr (kTail != 0) {
        for (int r = 0; r < M; ++r) tail_acc[r] = _mm256_setzero_ps();
        blocks32_times<kTail, M>(wn + blocks * B::kBytes, blocks * kGroups, groups, a, row0,
                                 tail_acc, tail_min);
      }
      for (int r = 0; r < M; ++r) {
#if defined(VLLM_GGUF_MM_512)
        float sum = _mm512_reduce_add_ps(acc[r]);
#else
        float sum = hsum8(acc[r]);
#endif
        float mins = hsum8(acc_min[r]);
        if constexpr (kTail != 0) {
          float tail = hsum8(tail_acc[r]), tail_mins = tail_min[r];
          asm("" : "+x"(sum), "+x"(mins), "+x"(tail), "+x"(tail_mins));
          sum += tail;
          mins += tail_mins;
        }
        asm("" : "+x"(sum), "+x"(mins));  // two whole sums (kept_whole)
        out[(row0 + r) * n_total + n] = sum - mins;
      }
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
    VLLM_GGUF_CASE(kQ5_0R8)
#undef VLLM_GGUF_CASE
    default: break;  // checked by the caller
  }
}

#endif  // VLLM_GGUF_MM

}  // namespace vllm_gguf
