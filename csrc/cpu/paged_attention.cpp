// Paged decode attention for the CPU: one query token per request, keys and values read
// straight from the block-paged KV cache (no gather copy, no padding to the longest
// sequence).
//
// Layouts (contiguous):
//   query        [num_seqs, num_heads, head_size]
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_size]   (K then V)
//   block_table  [num_seqs, max_blocks] int32
//   seq_lens     [num_seqs] int32
//   out          [num_seqs, num_heads, head_size]
//
// Work is split over (sequence, kv head) pairs; each pair handles the `group` query heads
// that share its kv head. Two passes over the sequence: scores (then one softmax), then
// the probability-weighted sum of values, all in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

inline void load_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<uint32_t>(raw[j]) << 16;
}

inline void load_row(const at::Half* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

// Softmax of one row of scores, in place.
inline void softmax_in_place(float* s, int64_t len) {
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < len; ++t) max_score = std::max(max_score, s[t]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - max_score);
    sum += s[t];
  }
  const float inv = 1.0f / sum;
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

inline void store_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<at::BFloat16>(src[j]);
}

inline void store_row(const float* src, at::Half* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<at::Half>(src[j]);
}

template <typename T>
void decode_attention(const T* query, const T* kv_cache, const int32_t* block_table,
                      const int32_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_size, int64_t num_blocks,
                      int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_size;
  const T* value_cache = kv_cache + num_blocks * block_size * token_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_size), acc(group * head_size), row(head_size);
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t len = seq_lens[seq];
      const int32_t* blocks = block_table + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = query + (seq * num_heads + kv_head * group + g) * head_size;
        load_row(src, q.data() + g * head_size, head_size);
      }
      scores.assign(group * len, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size +
                             t % block_size;
        load_row(kv_cache + slot * token_stride + kv_head * head_size, row.data(), head_size);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_size;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < head_size; ++j) dot += qg[j] * row[j];
          scores[g * len + t] = dot * scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax_in_place(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size +
                             t % block_size;
        load_row(value_cache + slot * token_stride + kv_head * head_size, row.data(),
                 head_size);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_size;
#pragma omp simd
          for (int64_t j = 0; j < head_size; ++j) a[j] += p * row[j];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out + (seq * num_heads + kv_head * group + g) * head_size;
        store_row(acc.data() + g * head_size, dst, head_size);
      }
    }
  });
}

#if defined(__AVX512F__)
// The same computation with 16-wide float vectors: a head is head_size / 16 vectors; the
// group's queries and accumulators stay in vector registers (or L1) across the sequence.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

constexpr int64_t kMaxVecs = 64;  // group * head_size / 16

template <typename T>
bool decode_attention_avx512(const T* query, const T* kv_cache, const int32_t* block_table,
                             const int32_t* seq_lens, T* out, int64_t num_seqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                             int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                             float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t chunks = head_size / 16;
  if (head_size % 16 != 0 || group * chunks > kMaxVecs) return false;
  const int64_t token_stride = num_kv_heads * head_size;
  const T* value_cache = kv_cache + num_blocks * block_size * token_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    __m512 q[kMaxVecs], acc[kMaxVecs], row[kMaxVecs];
    std::vector<float> scores, tmp(head_size);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t len = seq_lens[seq];
      const int32_t* blocks = block_table + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = query + (seq * num_heads + kv_head * group + g) * head_size;
        for (int64_t c = 0; c < chunks; ++c) q[g * chunks + c] = _mm512_mul_ps(load16(src + 16 * c), vscale);
      }
      scores.resize(group * len);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
        const T* k = kv_cache + slot * token_stride + kv_head * head_size;
        for (int64_t c = 0; c < chunks; ++c) row[c] = load16(k + 16 * c);
        for (int64_t g = 0; g < group; ++g) {
          __m512 dot = _mm512_mul_ps(q[g * chunks], row[0]);
          for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(q[g * chunks + c], row[c], dot);
          scores[g * len + t] = _mm512_reduce_add_ps(dot);
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax_in_place(scores.data() + g * len, len);
      for (int64_t i = 0; i < group * chunks; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
        const T* v = value_cache + slot * token_stride + kv_head * head_size;
        for (int64_t c = 0; c < chunks; ++c) row[c] = load16(v + 16 * c);
        for (int64_t g = 0; g < group; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * len + t]);
          for (int64_t c = 0; c < chunks; ++c)
            acc[g * chunks + c] = _mm512_fmadd_ps(p, row[c], acc[g * chunks + c]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(tmp.data() + 16 * c, acc[g * chunks + c]);
        store_row(tmp.data(), out + (seq * num_heads + kv_head * group + g) * head_size, head_size);
      }
    }
  });
  return true;
}
#endif

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens,
                                     double scale) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5, "bad ranks");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.is_contiguous(),
              "block_table must be contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "dtype mismatch");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_size && num_heads % num_kv_heads == 0, "bad shapes");
  auto out = torch::empty_like(query);
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
#if defined(__AVX512F__)
    if (decode_attention_avx512<T>(query.data_ptr<T>(), kv_cache.data_ptr<T>(),
                                   block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                                   out.data_ptr<T>(), num_seqs, num_heads, num_kv_heads,
                                   head_size, num_blocks, block_size, block_table.size(1),
                                   static_cast<float>(scale)))
      return;
#endif
    decode_attention<T>(query.data_ptr<T>(), kv_cache.data_ptr<T>(),
                        block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                        out.data_ptr<T>(), num_seqs, num_heads, num_kv_heads, head_size,
                        num_blocks, block_size, block_table.size(1), static_cast<float>(scale));
  };
  switch (query.scalar_type()) {
    case torch::kFloat32: run(static_cast<float*>(nullptr)); break;
    case torch::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case torch::kFloat16: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", query.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a block-paged KV cache (CPU)");
}
