// Paged decode attention for the CPU: one query token per request, keys and values read
// straight from the block-paged KV cache (no gather copy, no padding to the longest
// sequence).
//
// Layouts (contiguous):
//   query        [num_seqs, num_heads, head_size]
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_size]   (K then V)
//   block_table  [num_seqs, max_blocks] int32
//   seq_lens     [num_seqs] int32
//   window       keys a query sees, itself included (0: all): keys [len - window, len)
//   soft_cap     scores become soft_cap * tanh(score / soft_cap) before the softmax (0: off)
//   out          [num_seqs, num_heads, head_size]
//
// Work is split over (sequence, kv head) pairs; each pair handles the `group` query heads
// that share its kv head. Two passes over the sequence: scores (then one softmax), then
// the probability-weighted sum of values, all in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "paged_attention.h"
#include "tasks.h"
#include "vec.h"

namespace {

#if defined(__AVX512F__)
using vllm_cpu::exp16;
using vllm_cpu::load16;
#endif

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
                      int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                      float soft_cap, int64_t head_begin, int64_t head_end) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_size;
  const T* value_cache = kv_cache + num_blocks * block_size * token_stride;
  const int64_t kv_begin = head_begin / group, kv_end = (head_end + group - 1) / group;
  const int64_t kv_count = kv_end - kv_begin;
  at::parallel_for(0, num_seqs * kv_count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_size), acc(group * head_size), row(head_size);
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / kv_count, kv_head = kv_begin + task % kv_count;
      const int64_t len = seq_lens[seq];
      const int32_t* blocks = block_table + seq * max_blocks;
      // This kv head's query heads in the range: group members [g_begin, g_end).
      const int64_t g_begin = std::max<int64_t>(0, head_begin - kv_head * group);
      const int64_t g_end = std::min<int64_t>(group, head_end - kv_head * group);
      for (int64_t g = g_begin; g < g_end; ++g) {
        const T* src = query + (seq * num_heads + kv_head * group + g) * head_size;
        load_row(src, q.data() + g * head_size, head_size);
      }
      // Keys before the window score -inf (their blocks may be the null block).
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.assign(group * len, -std::numeric_limits<float>::infinity());
      for (int64_t t = start; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size +
                             t % block_size;
        load_row(kv_cache + slot * token_stride + kv_head * head_size, row.data(), head_size);
        for (int64_t g = g_begin; g < g_end; ++g) {
          const float* qg = q.data() + g * head_size;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < head_size; ++j) dot += qg[j] * row[j];
          const float x = dot * scale;
          scores[g * len + t] = soft_cap > 0.0f ? soft_cap * std::tanh(x / soft_cap) : x;
        }
      }
      for (int64_t g = g_begin; g < g_end; ++g) softmax_in_place(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = start; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size +
                             t % block_size;
        load_row(value_cache + slot * token_stride + kv_head * head_size, row.data(),
                 head_size);
        for (int64_t g = g_begin; g < g_end; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_size;
#pragma omp simd
          for (int64_t j = 0; j < head_size; ++j) a[j] += p * row[j];
        }
      }
      for (int64_t g = g_begin; g < g_end; ++g) {
        T* dst = out + (seq * num_heads + kv_head * group + g) * head_size;
        store_row(acc.data() + g * head_size, dst, head_size);
      }
    }
  });
}

#if defined(VLLM_VEC16)
// The vector forms below (AVX-512, and AVX2 with FMA) share the task split and the merge.
#define VLLM_PARTITIONED_DECODE 1
constexpr int64_t kPartition = 512;  // keys per task

// Prefetches `bytes` contiguous bytes from `first` into L1 (T0) or L2 (T1).
template <int kHint, typename T>
inline void prefetch_bytes(const T* first, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(first);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, static_cast<_mm_hint>(kHint));
}

// Prefetches the kv heads [kv_begin, kv_end) of n cache rows from `rows` (every kv head
// of a row contiguous, `token_stride` elements a row): whole rows where the range is every
// head, else each row's slice (a task over some heads leaves the others to other threads).
template <int kHint, typename T>
inline void prefetch_heads(const T* rows, int64_t n, int64_t token_stride, int64_t head_size,
                           int64_t kv_begin, int64_t kv_end) {
  const int64_t slice = (kv_end - kv_begin) * head_size;
  if (slice == token_stride) {
    prefetch_bytes<kHint>(rows, n * token_stride * static_cast<int64_t>(sizeof(T)));
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    prefetch_bytes<kHint>(rows + i * token_stride + kv_begin * head_size,
                          slice * static_cast<int64_t>(sizeof(T)));
}

// One task of a form (attend_partition below): query, K and V caches, the partition's
// block ids, its length, block size, kv heads, group, the query heads [begin, end) it
// computes (a multiple of the form's tile each), scale, soft cap, keys skipped, scratch
// (num_heads * (kPartition + head_size) floats), and per head the max score, sum of exps
// and unnormalised output it writes.
template <typename T>
using PartitionFn = void (*)(const T*, const T*, const T*, const int32_t*, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, float, float, int64_t, float*,
                             float*, float*, float*);
#endif

#if defined(__AVX512F__)
// The same computation with 16-wide float vectors, shaped for memory bandwidth:
//  - the head size (C vectors of 16) and a tile of GT query heads are compile-time
//    constants, so the queries and accumulators live in registers (a runtime-shaped
//    array of vectors is kept in memory, and on some cores a 512-bit store feeding the
//    next token's load stalls every accumulation);
//  - blocks are walked in order (a block's keys are contiguous rows of the cache), with no
//    per-token division, and the next block's rows are prefetched while this one is used;
//  - scores are computed several keys at a time, their dot products reduced together; on
//    cores with AVX512-BF16, bfloat16 keys are multiplied as they are stored (vdpbf16ps:
//    exact products, float32 sums), without widening them first;
//  - softmax uses a vectorised exp;
//  - a sequence is split into partitions of kPartition keys, each its own task with a
//    local max, sum and unnormalised output, merged at the end (flash-decoding), so that
//    one long sequence still spreads over every thread when the batch is small.
// A group of query heads sharing a kv head larger than the tile runs tile by tile over the
// same keys (the second pass reads them from cache).
// The sums of four vectors' lanes, as one 4-float vector [sum a, sum b, sum c, sum d].
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // Per 128-bit lane: [a, b, c, d] partial sums.
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                        _mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// Scores of GT query heads (q: [GT, 16 * C]) against the n keys of one block row range
// (k: the first key's row of this kv head; rows `token_stride` apart), into
// scores[g * kPartition + i] (unscaled). Keys are taken several at a time, their dot
// products reduced together.
template <typename T, int GT, int C>
inline void block_scores(const T* q_src, const T* k, int64_t n, int64_t token_stride,
                         float* scores) {
  constexpr int64_t D = 16 * C;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16> && C % 2 == 0) {
    // bfloat16 pairs straight from the cache: C / 2 dot-product instructions per key.
    constexpr int P = C / 2;
    __m512bh q[GT][P];
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < P; ++c)
        q[g][c] = (__m512bh)_mm512_loadu_si512(q_src + g * D + 32 * c);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      __m512bh kv[4][P];
      for (int u = 0; u < 4; ++u)
        for (int c = 0; c < P; ++c)
          kv[u][c] = (__m512bh)_mm512_loadu_si512(k + (i + u) * token_stride + 32 * c);
      for (int g = 0; g < GT; ++g) {
        __m512 d[4];
        for (int u = 0; u < 4; ++u) {
          d[u] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], kv[u][0]);
          for (int c = 1; c < P; ++c) d[u] = _mm512_dpbf16_ps(d[u], q[g][c], kv[u][c]);
        }
        _mm_storeu_ps(scores + g * kPartition + i, reduce4(d[0], d[1], d[2], d[3]));
      }
    }
    for (; i < n; ++i) {
      for (int g = 0; g < GT; ++g) {
        __m512 d = _mm512_setzero_ps();
        for (int c = 0; c < P; ++c)
          d = _mm512_dpbf16_ps(d, q[g][c],
                               (__m512bh)_mm512_loadu_si512(k + i * token_stride + 32 * c));
        scores[g * kPartition + i] = _mm512_reduce_add_ps(d);
      }
    }
    return;
  }
#endif
  constexpr int U = C <= 4 ? 4 : 2;  // keys per reduction: U * C key vectors in registers
  __m512 q[GT][C];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < C; ++c) q[g][c] = load16(q_src + g * D + 16 * c);
  int64_t i = 0;
  for (; i + U <= n; i += U) {
    __m512 kv[U][C];
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < C; ++c) kv[u][c] = load16(k + (i + u) * token_stride + 16 * c);
    for (int g = 0; g < GT; ++g) {
      __m512 d[4];
      for (int u = 0; u < U; ++u) {
        d[u] = _mm512_mul_ps(q[g][0], kv[u][0]);
        for (int c = 1; c < C; ++c) d[u] = _mm512_fmadd_ps(q[g][c], kv[u][c], d[u]);
      }
      float* dst = scores + g * kPartition + i;
      if constexpr (U == 4) {
        _mm_storeu_ps(dst, reduce4(d[0], d[1], d[2], d[3]));
      } else {
        const __m512 zero = _mm512_setzero_ps();
        _mm_storel_pi(reinterpret_cast<__m64*>(dst), reduce4(d[0], d[1], zero, zero));
      }
    }
  }
  for (; i < n; ++i) {
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load16(k + i * token_stride + 16 * c);
    for (int g = 0; g < GT; ++g) {
      __m512 d = _mm512_mul_ps(q[g][0], kv[0]);
      for (int c = 1; c < C; ++c) d = _mm512_fmadd_ps(q[g][c], kv[c], d);
      scores[g * kPartition + i] = _mm512_reduce_add_ps(d);
    }
  }
}

// tanh(x) = 1 - 2 / (e^(2x) + 1), saturating to +-1 as e^(2x) overflows or vanishes.
inline __m512 tanh16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp16(_mm512_add_ps(x, x));
  return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
}

// For soft-capped or windowed rows, before exp_scores (which then scales by 1):
// s[t] <- scale * s[t], soft-capped to cap * tanh(scale * s[t] / cap) when cap > 0, and
// -inf for the `skip` first keys (before the window, within its first block).
inline __m512 scaled_score(__m512 x, __m512 in, __m512 out, bool cap) {
  x = _mm512_mul_ps(x, in);
  return cap ? _mm512_mul_ps(out, tanh16(x)) : x;
}

inline void cap_and_skip(float* s, int64_t len, float scale, float soft_cap, int64_t skip) {
  const bool cap = soft_cap > 0.0f;
  const __m512 in = _mm512_set1_ps(cap ? scale / soft_cap : scale);
  const __m512 out = _mm512_set1_ps(soft_cap);
  int64_t t = 0;
  for (; t + 16 <= len; t += 16)
    _mm512_storeu_ps(s + t, scaled_score(_mm512_loadu_ps(s + t), in, out, cap));
  if (t < len) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
    _mm512_mask_storeu_ps(s + t, tail,
                          scaled_score(_mm512_maskz_loadu_ps(tail, s + t), in, out, cap));
  }
  std::fill(s, s + std::min(skip, len), -std::numeric_limits<float>::infinity());
}

// scores[t] <- exp(scale * scores[t] - max) for t < len; returns (max, sum of the exps).
inline std::pair<float, float> exp_scores(float* s, int64_t len, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + t), vscale);
    _mm512_storeu_ps(s + t, x);
    vmax = _mm512_max_ps(vmax, x);
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - t)) - 1);
  if (t < len) {
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + t), vscale);
    _mm512_mask_storeu_ps(s + t, tail, x);
    vmax = _mm512_mask_max_ps(vmax, tail, vmax, x);
  }
  const float m = _mm512_reduce_max_ps(vmax);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= len; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t < len) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), vm));
    _mm512_mask_storeu_ps(s + t, tail, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, e));
  }
  return {m, _mm512_reduce_add_ps(vsum)};
}

// One task: every query head of one sequence over one partition of its keys (len <=
// kPartition, starting at `blocks`). Keys are read a block at a time, whole rows (all kv
// heads, contiguous), for every head while the block is in L1, with the next block
// prefetched and this block's values brought into L2 for the second pass; values are then
// summed per tile of GT heads. Writes each head's max score, sum of exps and unnormalised
// output. `scores` holds num_heads * kPartition floats.
template <typename T, int GT, int C>
void attend_partition(const T* q_seq, const T* k_cache, const T* v_cache,
                      const int32_t* blocks, int64_t len, int64_t block_size,
                      int64_t num_kv_heads, int64_t group, int64_t head_begin,
                      int64_t head_end, float scale, float soft_cap, int64_t skip,
                      float* scores, float* out_max, float* out_sum, float* out) {
  constexpr int64_t D = 16 * C;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t kv_begin = head_begin / group, kv_end = (head_end + group - 1) / group;
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t n = std::min(block_size, len - t0);
    const int64_t offset = static_cast<int64_t>(blocks[t0 / block_size]) * block_size *
                           token_stride;
    // The next block's keys into L1, the one after into L2, this block's values into L2.
    if (t0 + block_size < len)
      prefetch_heads<_MM_HINT_T0>(k_cache + static_cast<int64_t>(blocks[t0 / block_size + 1]) *
                                                block_size * token_stride,
                                  block_size, token_stride, D, kv_begin, kv_end);
    if (t0 + 2 * block_size < len)
      prefetch_heads<_MM_HINT_T1>(k_cache + static_cast<int64_t>(blocks[t0 / block_size + 2]) *
                                                block_size * token_stride,
                                  block_size, token_stride, D, kv_begin, kv_end);
    prefetch_heads<_MM_HINT_T1>(v_cache + offset, n, token_stride, D, kv_begin, kv_end);
    for (int64_t head = head_begin; head < head_end; head += GT)
      block_scores<T, GT, C>(q_seq + head * D, k_cache + offset + head / group * D, n,
                             token_stride, scores + head * kPartition + t0);
  }
  const bool plain = soft_cap <= 0.0f && skip == 0;
  for (int64_t head = head_begin; head < head_end; ++head) {
    if (!plain) cap_and_skip(scores + head * kPartition, len, scale, soft_cap, skip);
    const auto [m, sum] = exp_scores(scores + head * kPartition, len, plain ? scale : 1.0f);
    out_max[head] = m;
    out_sum[head] = sum;
  }
  for (int64_t head = head_begin; head < head_end; head += GT) {
    const int64_t kv_head = head / group;
    const float* p = scores + head * kPartition;
    __m512 acc[GT][C];
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
      const int64_t n = std::min(block_size, len - t0);
      const T* vb = v_cache + static_cast<int64_t>(blocks[t0 / block_size]) * block_size *
                                  token_stride + kv_head * D;
      for (int64_t i = 0; i < n; ++i) {
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = load16(vb + i * token_stride + 16 * c);
        for (int g = 0; g < GT; ++g) {
          const __m512 w = _mm512_set1_ps(p[g * kPartition + t0 + i]);
          for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
      }
    }
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (head + g) * D + 16 * c, acc[g][c]);
  }
}

// The instantiation for head_size 16 * C and the largest tile (<= 4 heads, at most 16
// accumulator vectors) dividing the group.
template <typename T, int C>
PartitionFn<T> pick_tile(int64_t group) {
  if constexpr (4 * C <= 16) {
    if (group % 4 == 0) return attend_partition<T, 4, C>;
  }
  if constexpr (3 * C <= 16) {
    if (group % 3 == 0) return attend_partition<T, 3, C>;
  }
  if constexpr (2 * C <= 16) {
    if (group % 2 == 0) return attend_partition<T, 2, C>;
  }
  return attend_partition<T, 1, C>;
}

// nullptr for head sizes without an instantiation (the scalar kernel runs).
template <typename T>
PartitionFn<T> pick_partition_fn(int64_t head_size, int64_t group) {
  switch (head_size) {
    case 16: return pick_tile<T, 1>(group);
    case 32: return pick_tile<T, 2>(group);
    case 64: return pick_tile<T, 4>(group);
    case 128: return pick_tile<T, 8>(group);
    case 256: return pick_tile<T, 16>(group);  // Gemma's heads: tiles of one head
    default: return nullptr;
  }
}

#elif defined(VLLM_VEC16)
// AVX2 with FMA: the AVX-512 form's task split, block order and prefetches, with the
// products tiled for 16 registers of 8 floats. A head of D = 8 * C floats does not fit in
// registers, so the loops run the other way round:
//  - scores: 4 keys against a tile of GT <= 3 query heads in 4 * GT accumulators, column
//    vector by column vector (4 key loads and GT query loads for 4 * GT FMAs); the queries
//    are widened to float32 once per task, into the scratch after the scores;
//  - values: GT heads times CC column vectors of accumulators per pass over the keys
//    (each pass reads other cache lines of the same rows, so the rows still come from
//    memory once).
using vllm_cpu::exp8;
using vllm_cpu::load8;
using vllm_cpu::reduce_add8;

// [sum a, sum b, sum c, sum d] of four 8-float vectors.
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline float reduce_max8(__m256 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Scores of GT float32 query heads (q: [GT, 8 * C]) against n keys (k: the first key's row
// of this kv head; rows `token_stride` apart), into scores[g * kPartition + i] (unscaled).
template <typename T, int GT, int C>
inline void block_scores(const float* q, const T* k, int64_t n, int64_t token_stride,
                         float* scores) {
  constexpr int64_t D = 8 * C;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const T* k0 = k + i * token_stride;
    __m256 d[GT][4];
    for (int g = 0; g < GT; ++g)
      for (int u = 0; u < 4; ++u) d[g][u] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) {
      __m256 kv[4];
      for (int u = 0; u < 4; ++u) kv[u] = load8(k0 + u * token_stride + 8 * c);
      for (int g = 0; g < GT; ++g) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + 8 * c);
        for (int u = 0; u < 4; ++u) d[g][u] = _mm256_fmadd_ps(qv, kv[u], d[g][u]);
      }
    }
    for (int g = 0; g < GT; ++g)
      _mm_storeu_ps(scores + g * kPartition + i, reduce4(d[g][0], d[g][1], d[g][2], d[g][3]));
  }
  for (; i < n; ++i) {
    __m256 d[GT];
    for (int g = 0; g < GT; ++g) d[g] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) {
      const __m256 kv = load8(k + i * token_stride + 8 * c);
      for (int g = 0; g < GT; ++g)
        d[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * c), kv, d[g]);
    }
    for (int g = 0; g < GT; ++g) scores[g * kPartition + i] = reduce_add8(d[g]);
  }
}

// tanh(x) = 1 - 2 / (e^(2x) + 1); exp8 clamps its argument, so this saturates to +-1.
inline __m256 tanh8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp8(_mm256_add_ps(x, x));
  return _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
}

// As the AVX-512 cap_and_skip: scale (and soft-cap) a soft-capped or windowed row, then -inf
// for the `skip` first keys.
inline void cap_and_skip(float* s, int64_t len, float scale, float soft_cap, int64_t skip) {
  const bool cap = soft_cap > 0.0f;
  const float in = cap ? scale / soft_cap : scale;
  const __m256 vin = _mm256_set1_ps(in), vout = _mm256_set1_ps(soft_cap);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + t), vin);
    _mm256_storeu_ps(s + t, cap ? _mm256_mul_ps(vout, tanh8(x)) : x);
  }
  for (; t < len; ++t) s[t] = cap ? soft_cap * std::tanh(s[t] * in) : s[t] * in;
  std::fill(s, s + std::min(skip, len), -std::numeric_limits<float>::infinity());
}

// scores[t] <- exp(scale * scores[t] - max) for t < len; returns (max, sum of the exps).
inline std::pair<float, float> exp_scores(float* s, int64_t len, float scale) {
  const __m256 vscale = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + t), vscale);
    _mm256_storeu_ps(s + t, x);
    vmax = _mm256_max_ps(vmax, x);
  }
  float m = reduce_max8(vmax);
  for (int64_t r = t; r < len; ++r) {
    s[r] *= scale;
    m = std::max(m, s[r]);
  }
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = reduce_add8(vsum);
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return {m, sum};
}

// The probability-weighted sum of one kv head's values for GT heads (p: their rows of
// scores, kPartition apart) into out ([GT, 8 * C]), CC column vectors a pass.
template <typename T, int GT, int C>
inline void sum_values(const float* p, const T* v_head, const int32_t* blocks, int64_t len,
                       int64_t block_size, int64_t token_stride, float* out) {
  constexpr int64_t D = 8 * C;
  constexpr int CC = std::min(C, GT == 1 ? 8 : 4);
  static_assert(C % CC == 0, "column passes must tile the head");
  for (int c0 = 0; c0 < C; c0 += CC) {
    __m256 acc[GT][CC];
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < CC; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
      const int64_t n = std::min(block_size, len - t0);
      const T* vb = v_head + static_cast<int64_t>(blocks[t0 / block_size]) * block_size *
                                 token_stride + 8 * c0;
      for (int64_t i = 0; i < n; ++i) {
        __m256 w[GT];
        for (int g = 0; g < GT; ++g) w[g] = _mm256_broadcast_ss(p + g * kPartition + t0 + i);
        for (int c = 0; c < CC; ++c) {
          const __m256 v = load8(vb + i * token_stride + 8 * c);
          for (int g = 0; g < GT; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], v, acc[g][c]);
        }
      }
    }
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < CC; ++c) _mm256_storeu_ps(out + g * D + 8 * (c0 + c), acc[g][c]);
  }
}

// One task, as the AVX-512 attend_partition: keys block by block for every head while the
// block is in L1 (the next block prefetched, this block's values brought into L2), one
// softmax per head, then the values tile by tile. `scratch` holds num_heads * kPartition
// scores, then the sequence's queries in float32.
template <typename T, int GT, int C>
void attend_partition(const T* q_seq, const T* k_cache, const T* v_cache,
                      const int32_t* blocks, int64_t len, int64_t block_size,
                      int64_t num_kv_heads, int64_t group, int64_t head_begin,
                      int64_t head_end, float scale, float soft_cap, int64_t skip,
                      float* scratch, float* out_max, float* out_sum, float* out) {
  constexpr int64_t D = 8 * C;
  const int64_t token_stride = num_kv_heads * D;
  const int64_t num_heads = num_kv_heads * group;
  const int64_t kv_begin = head_begin / group, kv_end = (head_end + group - 1) / group;
  float* scores = scratch;
  float* q = scratch + num_heads * kPartition;
  for (int64_t h = head_begin; h < head_end; ++h) load_row(q_seq + h * D, q + h * D, D);
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t n = std::min(block_size, len - t0);
    const int64_t offset = static_cast<int64_t>(blocks[t0 / block_size]) * block_size *
                           token_stride;
    if (t0 + block_size < len)
      prefetch_heads<_MM_HINT_T0>(k_cache + static_cast<int64_t>(blocks[t0 / block_size + 1]) *
                                                block_size * token_stride,
                                  block_size, token_stride, D, kv_begin, kv_end);
    if (t0 + 2 * block_size < len)
      prefetch_heads<_MM_HINT_T1>(k_cache + static_cast<int64_t>(blocks[t0 / block_size + 2]) *
                                                block_size * token_stride,
                                  block_size, token_stride, D, kv_begin, kv_end);
    prefetch_heads<_MM_HINT_T1>(v_cache + offset, n, token_stride, D, kv_begin, kv_end);
    for (int64_t head = head_begin; head < head_end; head += GT)
      block_scores<T, GT, C>(q + head * D, k_cache + offset + head / group * D, n, token_stride,
                             scores + head * kPartition + t0);
  }
  const bool plain = soft_cap <= 0.0f && skip == 0;
  for (int64_t head = head_begin; head < head_end; ++head) {
    if (!plain) cap_and_skip(scores + head * kPartition, len, scale, soft_cap, skip);
    const auto [m, sum] = exp_scores(scores + head * kPartition, len, plain ? scale : 1.0f);
    out_max[head] = m;
    out_sum[head] = sum;
  }
  for (int64_t head = head_begin; head < head_end; head += GT)
    sum_values<T, GT, C>(scores + head * kPartition, v_cache + head / group * D, blocks, len,
                         block_size, token_stride, out + head * D);
}

// The largest tile of query heads (<= 3: 12 score accumulators) dividing the group.
template <typename T, int C>
PartitionFn<T> pick_tile(int64_t group) {
  if (group % 3 == 0) return attend_partition<T, 3, C>;
  if (group % 2 == 0) return attend_partition<T, 2, C>;
  return attend_partition<T, 1, C>;
}

// nullptr for head sizes without an instantiation (the scalar kernel runs).
template <typename T>
PartitionFn<T> pick_partition_fn(int64_t head_size, int64_t group) {
  switch (head_size) {
    case 16: return pick_tile<T, 2>(group);
    case 32: return pick_tile<T, 4>(group);
    case 64: return pick_tile<T, 8>(group);
    case 128: return pick_tile<T, 16>(group);
    case 256: return pick_tile<T, 32>(group);
    default: return nullptr;
  }
}
#endif

#if defined(VLLM_PARTITIONED_DECODE)
template <typename T>
bool decode_attention_partitioned(const T* query, const T* kv_cache, const int32_t* block_table,
                             const int32_t* seq_lens, T* out, int64_t num_seqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                             int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                             float scale, int64_t window, float soft_cap, int64_t head_begin,
                             int64_t head_end) {
  const int64_t group = num_heads / num_kv_heads;
  // The tile: the largest form dividing the group and both ends of the range (a tile of
  // heads never crosses a kv head or the range). A head's result is the same in any tile.
  const PartitionFn<T> attend =
      pick_partition_fn<T>(head_size, std::gcd(std::gcd(group, head_begin), head_end));
  if (attend == nullptr || kPartition % block_size != 0) return false;
  const int64_t token_stride = num_kv_heads * head_size;
  const T* value_cache = kv_cache + num_blocks * block_size * token_stride;
  // With a window, a sequence's keys start at the block holding its window's first key
  // (blocks before it are skipped); the keys before the window in that block are masked.
  // e.g. len 40, window 10, block 16: keys from 30, partitions from 16, skip 14.
  std::vector<int64_t> key_start(num_seqs, 0);
  if (window > 0)
    for (int64_t s = 0; s < num_seqs; ++s)
      key_start[s] = std::max<int64_t>(0, seq_lens[s] - window) / block_size * block_size;
  // Tasks: (sequence, partition). part_start[s] is sequence s's first partition.
  std::vector<int64_t> part_start(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s)
    part_start[s + 1] = part_start[s] + std::max<int64_t>(
        1, (seq_lens[s] - key_start[s] + kPartition - 1) / kPartition);
  const int64_t num_parts = part_start[num_seqs];
  // Per (partition, kv head, group member): max score, sum of exps, unnormalised output.
  std::vector<float> part_max(num_parts * num_heads), part_sum(num_parts * num_heads);
  std::vector<float> part_out(num_parts * num_heads * head_size);
  std::vector<int64_t> part_seq(num_parts);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t p = part_start[s]; p < part_start[s + 1]; ++p) part_seq[p] = s;

  // Partitions longest first (an even split of the sequences left one thread waiting
  // for the other on batches of mixed lengths).
  std::vector<int64_t> order(num_parts);
  for (int64_t p = 0; p < num_parts; ++p) order[p] = p;
  auto part_len = [&](int64_t p) {
    const int64_t s = part_seq[p];
    return std::min<int64_t>(seq_lens[s] - key_start[s] - (p - part_start[s]) * kPartition,
                             kPartition);
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return part_len(a) > part_len(b); });
  vllm_cpu::run_tasks(
      num_parts, [&] { return std::vector<float>(num_heads * (kPartition + head_size)); },
      [&](std::vector<float>& scores, int64_t i) {
        const int64_t part = order[i];
        const int64_t seq = part_seq[part];
        const int64_t first = key_start[seq] + (part - part_start[seq]) * kPartition;
        const int64_t len = std::min<int64_t>(seq_lens[seq] - first, kPartition);
        const int64_t skip = window > 0 ? std::max<int64_t>(0, seq_lens[seq] - window) - first
                                        : 0;
        const int64_t h = part * num_heads;
        attend(query + seq * num_heads * head_size, kv_cache, value_cache,
               block_table + seq * max_blocks + first / block_size, len, block_size,
               num_kv_heads, group, head_begin, head_end, scale, soft_cap,
               std::max<int64_t>(0, skip), scores.data(), part_max.data() + h,
               part_sum.data() + h, part_out.data() + h * head_size);
      });
  // Merge each sequence's partitions: out = sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) l_p.
  const int64_t range = head_end - head_begin;
  at::parallel_for(0, num_seqs * range, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / range, head = head_begin + task % range;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t p = part_start[seq]; p < part_start[seq + 1]; ++p)
        m = std::max(m, part_max[p * num_heads + head]);
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t p = part_start[seq]; p < part_start[seq + 1]; ++p) {
        const float w = std::exp(part_max[p * num_heads + head] - m);
        total += w * part_sum[p * num_heads + head];
        const float* o = part_out.data() + (p * num_heads + head) * head_size;
        for (int64_t j = 0; j < head_size; ++j) merged[j] += w * o[j];
      }
      const float inv = 1.0f / total;
      for (int64_t j = 0; j < head_size; ++j) merged[j] *= inv;
      store_row(merged.data(), out + (seq * num_heads + head) * head_size, head_size);
    }
  });
  return true;
}
#endif

}  // namespace

namespace vllm_cpu {

template <typename T>
void paged_decode(const T* query, const T* kv_cache, const int32_t* block_table,
                  const int32_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_size, int64_t num_blocks,
                  int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                  float soft_cap, int64_t head_begin, int64_t head_end) {
  TORCH_CHECK(0 <= head_begin && head_begin < head_end && head_end <= num_heads,
              "paged_decode: heads [", head_begin, ", ", head_end, ") of ", num_heads);
#if defined(VLLM_PARTITIONED_DECODE)
  if (decode_attention_partitioned<T>(query, kv_cache, block_table, seq_lens, out, num_seqs,
                                 num_heads, num_kv_heads, head_size, num_blocks, block_size,
                                 max_blocks, scale, window, soft_cap, head_begin, head_end))
    return;
#endif
  decode_attention<T>(query, kv_cache, block_table, seq_lens, out, num_seqs, num_heads,
                      num_kv_heads, head_size, num_blocks, block_size, max_blocks, scale,
                      window, soft_cap, head_begin, head_end);
}

#define VLLM_PAGED_DECODE(T)                                                                  \
  template void paged_decode<T>(const T*, const T*, const int32_t*, const int32_t*, T*,      \
                                int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,        \
                                int64_t, float, int64_t, float, int64_t, int64_t);
VLLM_PAGED_DECODE(float)
VLLM_PAGED_DECODE(at::BFloat16)
VLLM_PAGED_DECODE(at::Half)
#undef VLLM_PAGED_DECODE

}  // namespace vllm_cpu

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens,
                                     double scale, int64_t window, double soft_cap,
                                     int64_t head_begin, int64_t head_end) {
  TORCH_CHECK(window >= 0 && soft_cap >= 0.0, "window and soft_cap must be >= 0");
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
  if (head_end < 0) head_end = num_heads;
  TORCH_CHECK(0 <= head_begin && head_begin < head_end && head_end <= num_heads,
              "paged_decode_attention: heads [", head_begin, ", ", head_end, ") of ", num_heads);
  const bool all_heads = head_begin == 0 && head_end == num_heads;
  auto out = all_heads ? torch::empty_like(query) : torch::zeros_like(query);
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    vllm_cpu::paged_decode<T>(query.data_ptr<T>(), kv_cache.data_ptr<T>(),
                              block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                              out.data_ptr<T>(), num_seqs, num_heads, num_kv_heads, head_size,
                              num_blocks, block_size, block_table.size(1),
                              static_cast<float>(scale), window, static_cast<float>(soft_cap),
                              head_begin, head_end);
  };
  switch (query.scalar_type()) {
    case torch::kFloat32: run(static_cast<float*>(nullptr)); break;
    case torch::kBFloat16: run(static_cast<at::BFloat16*>(nullptr)); break;
    case torch::kFloat16: run(static_cast<at::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", query.scalar_type());
  }
  return out;
}

// Stores one step's keys and values at their cache slots: row t of `key` / `value`
// ([num_tokens >= n, num_kv_heads, head_size], rows at any stride, each row contiguous)
// goes to flat slot slot_mapping[t] of kv_cache[0] / kv_cache[1], for t < n =
// slot_mapping.size(0). One memcpy per row and tensor, instead of index_copy_'s
// per-call setup on views.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache: contiguous, 5-D");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value: [tokens, heads, size]");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(), "dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const int64_t n = slot_mapping.size(0);
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);
  TORCH_CHECK(key.size(1) * key.size(2) == row && key.size(0) >= n, "key/value shape ",
              key.sizes(), " does not fit the cache");
  for (const auto& t : {key, value}) {
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "key/value rows must be contiguous");
  }
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t bytes = row * kv_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + num_slots * bytes;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
    std::memcpy(k_cache + slots[t] * bytes, k + t * k_stride, bytes);
    std::memcpy(v_cache + slots[t] * bytes, v + t * v_stride, bytes);
  }
}
