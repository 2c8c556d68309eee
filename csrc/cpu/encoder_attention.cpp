// Bidirectional encoder self-attention in bfloat16 on AVX512-BF16 (`vdpbf16ps`): each input
// (a Whisper window: 1500 tokens) attends to its own keys, no cache, no mask.
//
// Layouts:
//   query, key, value  [num_tokens, num_heads, head_size] bfloat16 (rows at any stride, each
//                      head's row contiguous: the views of a fused qkv projection)
//   starts             [num_inputs + 1]: input i is tokens starts[i] .. starts[i + 1]
//   out                [num_tokens, num_heads * head_size] bfloat16, contiguous
//
// A task is one (input, head, run of query tokens). It first repacks the head's keys and
// values into the pair layouts `vdpbf16ps` multiplies (two bfloat16 products summed into one
// float32 lane), zero-padded to the key block:
//   Kp[d/2][key]  = (K[key][d], K[key][d + 1])        a lane per key
//   Vp[key/2][d]  = (V[key][d], V[key + 1][d])        a lane per head dimension
// then takes the queries 12 at a time, with every score row in cache (12 x 1504 floats):
//   S[r][keys]  = Q[r] . Kp                 12 rows x 32 keys per pass: 24 accumulators,
//                                           each Q pair a 32-bit broadcast
//   P[r][keys]  = exp(scale * (S - max_r))  float32, rounded to bfloat16 (as SDPA's flash
//                                           kernel rounds its probabilities); sums in float32
//   O[r][d]     = sum over key pairs P[r] . Vp / sum_r     (24 / (head_size / 16) rows at a
//                                           time x head_size / 16 vectors)
// The whole score row fits, so the softmax is exact two-pass (no online rescaling).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "tasks.h"
#include "vec.h"

namespace {

#if defined(__AVX512BF16__)
using vllm_cpu::exp16;
using vllm_cpu::load16;

constexpr int64_t kRows = 12;     // queries per block
constexpr int64_t kKeyBlock = 32; // keys per score pass (2 vectors)

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

struct Scratch {
  std::vector<uint32_t> kp, vp;  // pairs of bfloat16
  std::vector<float> s;          // [kRows][padded]
  std::vector<c10::BFloat16> p;  // [kRows][padded]
  std::vector<float> sum;        // [kRows]
  Scratch(int64_t padded, int64_t head_size)
      : kp(head_size / 2 * padded, 0), vp(padded / 2 * head_size, 0), s(kRows * padded),
        p(kRows * padded, c10::BFloat16(0.0f)), sum(kRows) {}
};

struct Task {
  int64_t input, head, first, count;  // queries first .. first + count of the input
};

// The head's keys and values of one input (len rows from k/v at row stride `stride`) in the
// pair layouts; keys len .. padded stay zero (set once by Scratch, never written).
void pack_kv(const c10::BFloat16* k, const c10::BFloat16* v, int64_t stride, int64_t len,
             int64_t padded, int64_t head_size, Scratch& w) {
  const int64_t pairs = head_size / 2;
  for (int64_t key = 0; key < len; ++key) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(k + key * stride);
    for (int64_t dp = 0; dp < pairs; ++dp) w.kp[dp * padded + key] = row[dp];
  }
  for (int64_t key = 0; key < len; key += 2) {
    const uint16_t* a = reinterpret_cast<const uint16_t*>(v + key * stride);
    const uint16_t* b = key + 1 < len ? reinterpret_cast<const uint16_t*>(v + (key + 1) * stride)
                                      : nullptr;
    uint32_t* dst = w.vp.data() + key / 2 * head_size;
    for (int64_t d = 0; d < head_size; ++d)
      dst[d] = static_cast<uint32_t>(a[d]) | (b ? static_cast<uint32_t>(b[d]) << 16 : 0u);
  }
}

// Scores of up to kRows queries (row pointers; absent rows point at zeros) against every
// padded key: S[r][key].
void scores(const c10::BFloat16* const* q, int64_t padded, int64_t head_size, Scratch& w) {
  const int64_t pairs = head_size / 2;
  for (int64_t key0 = 0; key0 < padded; key0 += kKeyBlock) {
    __m512 acc[kRows][2];
    for (int64_t r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t* kp = w.kp.data() + key0;
    for (int64_t dp = 0; dp < pairs; ++dp) {
      const __m512bh k0 = as_bh(_mm512_loadu_si512(kp + dp * padded));
      const __m512bh k1 = as_bh(_mm512_loadu_si512(kp + dp * padded + 16));
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512bh qr = as_bh(bcast32(q[r] + 2 * dp));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qr);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qr);
      }
    }
    for (int64_t r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(w.s.data() + r * padded + key0, acc[r][0]);
      _mm512_storeu_ps(w.s.data() + r * padded + key0 + 16, acc[r][1]);
    }
  }
}

// Row r's probabilities over keys 0 .. len (bfloat16, into P) and their float32 sum.
void softmax_row(int64_t r, int64_t len, int64_t padded, float scale, Scratch& w) {
  const float* s = w.s.data() + r * padded;
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t key = 0;
  for (; key + 16 <= len; key += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + key));
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - key)) - 1);
  if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + key));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale);
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 total = _mm512_setzero_ps();
  c10::BFloat16* p = w.p.data() + r * padded;
  for (key = 0; key + 16 <= len; key += 16) {
    const __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + key), sc, m));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + key), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (tail) {
    const __m512 e = _mm512_maskz_mov_ps(
        tail, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, s + key), sc, m)));
    total = _mm512_add_ps(total, e);
    _mm256_mask_storeu_epi16(p + key, tail, (__m256i)_mm512_cvtneps_pbh(e));
  }
  w.sum[r] = _mm512_reduce_add_ps(total);
}

// O[r] = P[r] . V / sum[r] for `rows` rows starting at row r0, DV = head_size / 16.
template <int DV, int RP>
void weighted_values(int64_t r0, int64_t rows, int64_t padded, c10::BFloat16* const* out,
                     Scratch& w) {
  constexpr int64_t D = DV * 16;
  __m512 acc[RP][DV];
  for (int r = 0; r < RP; ++r)
    for (int j = 0; j < DV; ++j) acc[r][j] = _mm512_setzero_ps();
  const c10::BFloat16* p = w.p.data() + r0 * padded;
  for (int64_t kp = 0; kp < padded / 2; ++kp) {
    const uint32_t* vp = w.vp.data() + kp * D;
    __m512bh v[DV];
    for (int j = 0; j < DV; ++j) v[j] = as_bh(_mm512_loadu_si512(vp + 16 * j));
    for (int r = 0; r < RP; ++r) {
      const __m512bh pr = as_bh(bcast32(p + r * padded + 2 * kp));
      for (int j = 0; j < DV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], v[j], pr);
    }
  }
  for (int r = 0; r < RP && r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / w.sum[r0 + r]);
    for (int j = 0; j < DV; ++j)
      vllm_cpu::store16(out[r0 + r] + 16 * j, _mm512_mul_ps(acc[r][j], inv));
  }
}

template <int DV>
void attend(const Task& t, const c10::BFloat16* q, const c10::BFloat16* k,
            const c10::BFloat16* v, int64_t stride, const int64_t* starts, int64_t num_heads,
            int64_t padded, float scale, c10::BFloat16* out, const c10::BFloat16* zeros,
            Scratch& w) {
  constexpr int64_t D = DV * 16;
  constexpr int RP = 24 / DV;  // rows per value pass: 24 accumulators
  static_assert(kRows % RP == 0, "value passes must tile the query block");
  const int64_t start = starts[t.input], len = starts[t.input + 1] - start;
  const int64_t head_offset = t.head * D;
  pack_kv(k + start * stride + head_offset, v + start * stride + head_offset, stride, len,
          padded, D, w);
  // Keys len .. padded get probability 0 (a scratch can hold a longer input's rows there).
  for (int64_t r = 0; r < kRows; ++r)
    std::fill(w.p.begin() + r * padded + len, w.p.begin() + (r + 1) * padded,
              c10::BFloat16(0.0f));
  const c10::BFloat16* rows[kRows];
  c10::BFloat16* dst[kRows];
  for (int64_t first = t.first; first < t.first + t.count; first += kRows) {
    const int64_t n = std::min(kRows, t.first + t.count - first);
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t token = start + first + r;
      rows[r] = r < n ? q + token * stride + head_offset : zeros;
      dst[r] = r < n ? out + token * num_heads * D + head_offset : nullptr;
    }
    scores(rows, padded, D, w);
    for (int64_t r = 0; r < n; ++r) softmax_row(r, len, padded, scale, w);
    for (int64_t r0 = 0; r0 < n; r0 += RP)
      weighted_values<DV, RP>(r0, n - r0, padded, dst, w);
  }
}

using AttendFn = void (*)(const Task&, const c10::BFloat16*, const c10::BFloat16*,
                          const c10::BFloat16*, int64_t, const int64_t*, int64_t, int64_t, float,
                          c10::BFloat16*, const c10::BFloat16*, Scratch&);

AttendFn pick(int64_t head_size) {
  switch (head_size) {
    case 32: return attend<2>;
    case 64: return attend<4>;
    case 96: return attend<6>;
    case 128: return attend<8>;
    default: return nullptr;
  }
}
#endif

}  // namespace

// Writes `out`; returns false (nothing written) where the kernel does not run: built
// without AVX512-BF16 (the build is -march=native, so: a CPU without it), a dtype other than
// bfloat16, a head size other than 32, 64, 96 or 128. The caller then takes torch's SDPA.
bool encoder_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                       const std::vector<int64_t>& starts, torch::Tensor out, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.sizes() == query.sizes() &&
                  value.sizes() == query.sizes(), "query/key/value must be [tokens, heads, d]");
  TORCH_CHECK(query.stride(0) == key.stride(0) && query.stride(0) == value.stride(0),
              "query/key/value must share a row stride");
  for (const auto& t : {query, key, value})
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "head rows must be contiguous");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == num_tokens &&
                  out.size(1) == num_heads * head_size, "out must be [tokens, heads * d]");
  TORCH_CHECK(starts.size() >= 2 && starts.front() == 0 && starts.back() == num_tokens,
              "starts must run from 0 to the token count");
  int64_t max_len = 0;
  for (size_t i = 1; i < starts.size(); ++i) {
    TORCH_CHECK(starts[i] > starts[i - 1], "every input needs at least one token");
    max_len = std::max(max_len, starts[i] - starts[i - 1]);
  }
#if defined(__AVX512BF16__)
  if (query.scalar_type() != torch::kBFloat16 || key.scalar_type() != torch::kBFloat16 ||
      value.scalar_type() != torch::kBFloat16 || out.scalar_type() != torch::kBFloat16)
    return false;
  const AttendFn fn = pick(head_size);
  if (fn == nullptr) return false;
  const int64_t num_inputs = static_cast<int64_t>(starts.size()) - 1;
  const int64_t padded = (max_len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  // At least ~4 tasks per thread; each run of queries a whole number of blocks.
  const int64_t want = 4 * at::get_num_threads();
  const int64_t pieces = std::max<int64_t>(1, (want + num_inputs * num_heads - 1) /
                                                  (num_inputs * num_heads));
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_inputs; ++i) {
    const int64_t len = starts[i + 1] - starts[i];
    const int64_t blocks = (len + kRows - 1) / kRows;
    const int64_t per = (blocks + pieces - 1) / pieces * kRows;
    for (int64_t h = 0; h < num_heads; ++h)
      for (int64_t first = 0; first < len; first += per)
        tasks.push_back({i, h, first, std::min(per, len - first)});
  }
  const std::vector<c10::BFloat16> zeros(head_size, c10::BFloat16(0.0f));
  const auto* q = query.data_ptr<c10::BFloat16>();
  const auto* k = key.data_ptr<c10::BFloat16>();
  const auto* v = value.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const int64_t stride = query.stride(0);
  const float sc = static_cast<float>(scale);
  vllm_cpu::run_tasks(
      static_cast<int64_t>(tasks.size()), [&] { return Scratch(padded, head_size); },
      [&](Scratch& w, int64_t i) {
        fn(tasks[i], q, k, v, stride, starts.data(), num_heads, padded, sc, o, zeros.data(),
           w);
      });
  return true;
#else
  (void)scale;
  return false;
#endif
}
