// Paged prefill attention for the CPU: the query tokens of every prompt chunk in a step,
// against keys and values read in place from the block-paged cache (written for this
// step's tokens before the call), all chunks in one call.
//
// Layouts:
//   query        [num_tokens, num_heads, head_size]  (rows at any stride, each contiguous)
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_size]   (K then V)
//   block_table  [num_spans, max_blocks] int32
//   query_start, query_len, seq_lens  [num_spans] int32: span s's queries are tokens
//                query_start[s] .. + query_len[s], the last query_len[s] of its seq_lens[s]
//                positions (causal: query i sees keys 0 .. seq_len - query_len + i);
//                non-causal (cross-attention) queries see all seq_lens[s] keys
//   window       causal only: the query at p sees keys (p - window, p] (0: all); chunks of
//                keys wholly before a tile's first window are skipped
//   key_end      causal only, [num_tokens] int32 or empty: the query token t sees keys up to
//                key_end[t] - 1 instead of its own position (a bidirectional media span:
//                the span's end; everyone else p + 1), the window's lower bound unchanged;
//                it must not pass its span's seq_len
//   soft_cap     scores become soft_cap * tanh(score / soft_cap) before the softmax (0: off)
//   out          [num_tokens, num_heads, head_size] contiguous; only the spans' rows are
//                written
//
// A task is one span's tile of up to 16 query tokens times the `group` query heads that
// share one kv head: 16 * group rows, held transposed so that the rows are the vector
// lanes (row r = token * group + head in group). Keys come 16 at a time:
//   scores  S^T[key][rows] = sum_d K[key][d] * Q^T[d][rows]    (a broadcast key element
//           times a vector of rows: no horizontal sums)
//   softmax online, per lane: running max and sum, the output rescaled when the max grows
//   output  O^T[d][rows] += sum_key P^T[key][rows] * V[key][d]
// all in float32. Tiles run longest first (`run_tasks`), since a causal tile near a
// prompt's end reads many more keys than one near its start.
//
// Written in vec.h's 16-lane vectors: one AVX-512 register, or two AVX2 halves where the
// CPU has AVX2, FMA and F16C but not AVX-512 (the same operations lane by lane, so both
// forms give the same bits). Positions are compared as floats (exact below 2^24: longer
// sequences are declined).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "tasks.h"
#include "vec.h"

namespace {

#if defined(VLLM_VEC16)
using namespace vllm_cpu;

constexpr int64_t kTile = 16;   // query tokens per task
constexpr int64_t kChunk = 16;  // keys per step

// n (a multiple of 16) values of the cache's dtype -> float32.
template <typename T>
inline void load_row_f32(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; d += 16) store16(dst + d, load16(src + d));
}

struct Tile {
  int64_t span, kv_head, first;  // first: the tile's first query, within the span
  int64_t keys;                  // keys it reads (its cost)
};

// Per-thread scratch, in floats: Q^T and O^T [head_size][rows], S^T/P^T [kChunk][rows],
// keys and values of one chunk [kChunk][head_size].
struct Scratch {
  std::vector<float> q, o, s, k, v;
  Scratch(int64_t rows, int64_t head_size)
      : q(head_size * rows), o(head_size * rows), s(kChunk * rows),
        k(kChunk * head_size, 0.0f), v(kChunk * head_size, 0.0f) {}
};

// One tile; RV = rows / 16 = the group size (16 tokens of `group` heads each).
template <typename T, int RV>
void attend_tile(const T* query, int64_t q_stride, const T* k_cache, const T* v_cache,
                 const int32_t* blocks, int64_t block_size, int64_t num_kv_heads,
                 int64_t head_size, int64_t kv_head, int64_t q_token, int64_t nq,
                 int64_t pos0, int64_t keys, bool causal, const int32_t* key_end, float scale,
                 int64_t window, float soft_cap, T* out, Scratch& w) {
  constexpr int64_t R = 16 * RV;
  constexpr int64_t group = RV;
  const int64_t D = head_size;
  const int64_t token_stride = num_kv_heads * D;
  // Keys per score pass and head dims per output pass: ~24 accumulators in AVX-512's 32
  // registers; with AVX2's 16 (a 16-lane vector is two) ~8, the rest of the registers for
  // the rows' operands. Sized for AVX-512, an AVX2 pass spilled its accumulators to the
  // stack (RV = 4, Gemma's 4 heads a kv head: 32 registers' worth). Either way each
  // accumulator sums its terms in the same order: the same bits.
#if defined(__AVX512F__)
  constexpr int KU = RV <= 3 ? 8 : (RV <= 6 ? 4 : 2);
  constexpr int DB = RV <= 1 ? 16 : (RV <= 3 ? 8 : (RV <= 6 ? 4 : 2));
#else
  constexpr int KU = RV <= 1 ? 4 : (RV <= 2 ? 2 : 1);
  constexpr int DB = RV <= 1 ? 4 : (RV <= 2 ? 2 : 1);
#endif

  // Q^T, pre-scaled; lanes past the tile's tokens hold zeros.
  float* qt = w.q.data();
  std::fill(w.q.begin(), w.q.end(), 0.0f);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = query + (q_token + i) * q_stride + (kv_head * group + g) * D;
      const int64_t r = i * group + g;
      for (int64_t d = 0; d < D; ++d) qt[d * R + r] = static_cast<float>(src[d]) * scale;
    }
  // Each lane's last key: its query position, or its span's last with `key_end`; lanes
  // past the tile see every key (their rows are zero and never written out), so no
  // lane's running max stays -inf.
  constexpr float kInf = std::numeric_limits<float>::infinity();
  f32x16 pos[RV];
  for (int v = 0; v < RV; ++v) {
    alignas(64) float p[16];
    for (int l = 0; l < 16; ++l) {
      const int64_t i = (16 * v + l) / group;
      p[l] = i >= nq ? kInf
                     : static_cast<float>(key_end != nullptr ? key_end[q_token + i] - 1
                                                             : pos0 + i);
    }
    pos[v] = load16(p);
  }
  // With a window, lane query at p sees keys from p - window + 1 (lanes past the tile:
  // every key); chunks wholly before the tile's first window are skipped.
  f32x16 lo[RV];
  for (int v = 0; v < RV; ++v) {
    alignas(64) float p[16];
    for (int l = 0; l < 16; ++l) {
      const int64_t i = (16 * v + l) / group;
      p[l] = i < nq && window > 0 ? static_cast<float>(pos0 + i - window + 1) : -kInf;
    }
    lo[v] = load16(p);
  }
  const int64_t first_key =
      window > 0 ? std::max<int64_t>(0, pos0 - window + 1) / kChunk * kChunk : 0;
  const bool cap = soft_cap > 0.0f;
  const f32x16 cap_in = set16(cap ? 1.0f / soft_cap : 1.0f);
  const f32x16 cap_out = set16(soft_cap);
  const f32x16 one = set16(1.0f), two = set16(2.0f);
  f32x16 m[RV], l[RV];
  for (int v = 0; v < RV; ++v) {
    m[v] = set16(-kInf);
    l[v] = zero16();
  }
  float* ot = w.o.data();
  std::fill(w.o.begin(), w.o.end(), 0.0f);
  float* st = w.s.data();
  float* kf = w.k.data();
  float* vf = w.v.data();

  for (int64_t c0 = first_key; c0 < keys; c0 += kChunk) {
    const int64_t nk = std::min(kChunk, keys - c0);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t t = c0 + j;
      const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size +
                           t % block_size;
      load_row_f32(k_cache + slot * token_stride + kv_head * D, kf + j * D, D);
      load_row_f32(v_cache + slot * token_stride + kv_head * D, vf + j * D, D);
    }
    if (nk < kChunk) std::fill(kf + nk * D, kf + kChunk * D, 0.0f);

    // Scores, KU keys at a time.
    for (int64_t j0 = 0; j0 < kChunk; j0 += KU) {
      f32x16 acc[KU][RV];
      for (int u = 0; u < KU; ++u)
        for (int v = 0; v < RV; ++v) acc[u][v] = zero16();
      for (int64_t d = 0; d < D; ++d) {
        f32x16 qv[RV];
        for (int v = 0; v < RV; ++v) qv[v] = load16(qt + d * R + 16 * v);
        for (int u = 0; u < KU; ++u) {
          const f32x16 kb = set16(kf[(j0 + u) * D + d]);
          for (int v = 0; v < RV; ++v) acc[u][v] = fmadd16(kb, qv[v], acc[u][v]);
        }
      }
      if (cap)  // cap * tanh(s / cap), tanh(x) = 1 - 2 / (e^(2x) + 1)
        for (int u = 0; u < KU; ++u)
          for (int v = 0; v < RV; ++v) {
            const f32x16 x = mul16(acc[u][v], cap_in);
            const f32x16 e = exp16(add16(x, x));
            acc[u][v] = mul16(cap_out, sub16(one, div16(two, add16(e, one))));
          }
      for (int u = 0; u < KU; ++u)
        for (int v = 0; v < RV; ++v) store16(st + (j0 + u) * R + 16 * v, acc[u][v]);
    }

    // Online softmax per lane; P^T overwrites S^T (masked keys get exact zeros).
    f32x16 corr[RV];
    for (int v = 0; v < RV; ++v) {
      mask16 valid[kChunk];
      f32x16 cmax = set16(-kInf);
      for (int64_t j = 0; j < nk; ++j) {
        const f32x16 key = set16(static_cast<float>(c0 + j));
        valid[j] = causal ? and16(le16(key, pos[v]), le16(lo[v], key)) : le16(lo[v], key);
        cmax = select16(valid[j], max16(cmax, load16(st + j * R + 16 * v)), cmax);
      }
      const f32x16 m_new = max16(m[v], cmax);
      corr[v] = exp16(sub16(m[v], m_new));
      f32x16 sum = zero16();
      for (int64_t j = 0; j < nk; ++j) {
        const f32x16 p = select16(valid[j], exp16(sub16(load16(st + j * R + 16 * v), m_new)),
                                  zero16());
        store16(st + j * R + 16 * v, p);
        sum = add16(sum, p);
      }
      l[v] = fmadd16(l[v], corr[v], sum);
      m[v] = m_new;
    }

    // O^T = O^T * corr + P^T V, DB head dims at a time.
    for (int64_t d0 = 0; d0 < D; d0 += DB) {
      f32x16 acc[DB][RV];
      for (int e = 0; e < DB; ++e)
        for (int v = 0; v < RV; ++v)
          acc[e][v] = mul16(load16(ot + (d0 + e) * R + 16 * v), corr[v]);
      for (int64_t j = 0; j < nk; ++j) {
        f32x16 p[RV];
        for (int v = 0; v < RV; ++v) p[v] = load16(st + j * R + 16 * v);
        for (int e = 0; e < DB; ++e) {
          const f32x16 vb = set16(vf[j * D + d0 + e]);
          for (int v = 0; v < RV; ++v) acc[e][v] = fmadd16(p[v], vb, acc[e][v]);
        }
      }
      for (int e = 0; e < DB; ++e)
        for (int v = 0; v < RV; ++v) store16(ot + (d0 + e) * R + 16 * v, acc[e][v]);
    }
  }

  alignas(64) float inv[R];
  for (int v = 0; v < RV; ++v) store16(inv + 16 * v, div16(set16(1.0f), l[v]));
  const int64_t num_heads = num_kv_heads * group;
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      T* dst = out + ((q_token + i) * num_heads + kv_head * group + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(ot[d * R + r] * inv[r]);
    }
}

template <typename T>
using TileFn = void (*)(const T*, int64_t, const T*, const T*, const int32_t*, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                        const int32_t*, float, int64_t, float, T*, Scratch&);

template <typename T>
TileFn<T> pick_tile_fn(int64_t group) {
  switch (group) {
    case 1: return attend_tile<T, 1>;
    case 2: return attend_tile<T, 2>;
    case 3: return attend_tile<T, 3>;
    case 4: return attend_tile<T, 4>;
    case 5: return attend_tile<T, 5>;
    case 6: return attend_tile<T, 6>;
    case 7: return attend_tile<T, 7>;
    case 8: return attend_tile<T, 8>;
    default: return nullptr;
  }
}

template <typename T>
bool prefill_attention(const torch::Tensor& query, const torch::Tensor& kv_cache,
                       const int32_t* block_table, int64_t max_blocks,
                       const int32_t* query_start, const int32_t* query_len,
                       const int32_t* seq_lens, int64_t num_spans, torch::Tensor& out,
                       float scale, bool causal, const int32_t* key_end, int64_t window,
                       float soft_cap) {
  const int64_t num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const TileFn<T> attend = pick_tile_fn<T>(group);
  if (attend == nullptr || head_size % 16 != 0) return false;

  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_spans; ++s) {
    const int64_t n = query_len[s], past = seq_lens[s] - query_len[s];
    for (int64_t first = 0; first < n; first += kTile) {
      int64_t keys = causal ? past + std::min(first + kTile, n) : seq_lens[s];
      if (key_end != nullptr)  // a bidirectional span reaches past the tile's last query
        for (int64_t i = first; i < std::min(first + kTile, n); ++i)
          keys = std::max<int64_t>(keys, key_end[query_start[s] + i]);
      for (int64_t h = 0; h < num_kv_heads; ++h) tiles.push_back({s, h, first, keys});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.keys > b.keys; });

  const T* q = query.data_ptr<T>();
  const T* k_cache = kv_cache.data_ptr<T>();
  const T* v_cache = k_cache + num_blocks * block_size * num_kv_heads * head_size;
  T* o = out.data_ptr<T>();
  const int64_t q_stride = query.stride(0);
  vllm_cpu::run_tasks(
      static_cast<int64_t>(tiles.size()), [&] { return Scratch(16 * group, head_size); },
      [&](Scratch& w, int64_t i) {
        const Tile& t = tiles[i];
        const int64_t nq = std::min(kTile, static_cast<int64_t>(query_len[t.span]) - t.first);
        const int64_t pos0 = seq_lens[t.span] - query_len[t.span] + t.first;
        attend(q, q_stride, k_cache, v_cache, block_table + t.span * max_blocks, block_size,
               num_kv_heads, head_size, t.kv_head, query_start[t.span] + t.first, nq, pos0,
               t.keys, causal, key_end, scale, window, soft_cap, o, w);
      });
  return true;
}
#endif

}  // namespace

// Writes the spans' rows of `out`; returns false (nothing written) where the kernel has no
// instantiation (neither AVX-512 nor AVX2 with FMA and F16C, a head size not a multiple of
// 16, more than 8 query heads per kv head, a sequence past 2^24 positions): the caller then
// takes its portable path.
bool paged_prefill_attention(torch::Tensor query, torch::Tensor kv_cache,
                             torch::Tensor block_table, torch::Tensor query_start,
                             torch::Tensor query_len, torch::Tensor seq_lens, torch::Tensor out,
                             double scale, bool causal, int64_t window, double soft_cap,
                             torch::Tensor key_end) {
  TORCH_CHECK(window >= 0 && soft_cap >= 0.0, "window and soft_cap must be >= 0");
  TORCH_CHECK(window == 0 || causal, "a sliding window needs causal attention");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && out.dim() == 3, "bad ranks");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query rows must be contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && out.is_contiguous(), "kv_cache/out must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have the query's shape");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == kv_cache.scalar_type(), "dtype mismatch");
  for (const auto& t : {block_table, query_start, query_len, seq_lens})
    TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous(),
                "span metadata must be contiguous int32");
  const int64_t num_spans = query_start.size(0);
  TORCH_CHECK(query_len.size(0) == num_spans && seq_lens.size(0) == num_spans &&
                  block_table.dim() == 2 && block_table.size(0) == num_spans, "bad span shapes");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
              "bad head shapes");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* ql = query_len.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1), block_size = kv_cache.size(2);
  const int32_t* ke = nullptr;
  if (key_end.numel() > 0) {
    TORCH_CHECK(causal, "key_end is for causal attention");
    TORCH_CHECK(key_end.scalar_type() == torch::kInt32 && key_end.is_contiguous() &&
                    key_end.dim() == 1, "key_end must be [num_tokens] int32");
    ke = key_end.data_ptr<int32_t>();
  }
  for (int64_t s = 0; s < num_spans; ++s) {
    TORCH_CHECK(ql[s] >= 1 && sl[s] >= (causal ? ql[s] : 1) && qs[s] >= 0 &&
                    qs[s] + ql[s] <= query.size(0), "span ", s, " out of range");
    TORCH_CHECK((sl[s] + block_size - 1) / block_size <= max_blocks, "span ", s,
                " has more keys than its block table row holds");
    TORCH_CHECK(ke == nullptr || qs[s] + ql[s] <= key_end.size(0), "span ", s,
                " has queries past key_end");
    for (int64_t i = 0; ke != nullptr && i < ql[s]; ++i)
      TORCH_CHECK(ke[qs[s] + i] > sl[s] - ql[s] + i && ke[qs[s] + i] <= sl[s],
                  "key_end of span ", s, " query ", i, " out of range");
  }
#if defined(VLLM_VEC16)
  for (int64_t s = 0; s < num_spans; ++s)
    if (sl[s] > (1 << 24)) return false;  // positions compare as floats (exact below 2^24)
  const float sc = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  const int32_t* table = block_table.data_ptr<int32_t>();
  switch (query.scalar_type()) {
    case torch::kFloat32:
      return prefill_attention<float>(query, kv_cache, table, max_blocks, qs, ql, sl,
                                      num_spans, out, sc, causal, ke, window, cap);
    case torch::kBFloat16:
      return prefill_attention<at::BFloat16>(query, kv_cache, table, max_blocks, qs, ql, sl,
                                             num_spans, out, sc, causal, ke, window, cap);
    case torch::kFloat16:
      return prefill_attention<at::Half>(query, kv_cache, table, max_blocks, qs, ql, sl,
                                         num_spans, out, sc, causal, ke, window, cap);
    default:
      return false;
  }
#else
  return false;
#endif
}
