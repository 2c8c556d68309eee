// LoRA's low-rank product for the rows of a step, each row through its own adapter slot:
//
//   delta[i, part p's outputs] = B_{p,s} (A_{p,s} x_i),   s = indices[i]  (-1: a zero row)
//
// computed only for the rank columns a row's slot holds (no row multiplies another slot's
// columns, as a masked dense product over all slots does), in two phases: shrink
// (xa[i, p] = A_{p,s} x_i, r values per part) and expand (delta[i] += B_s xa[i, p]). Rows
// are grouped by slot first (a stable counting sort), so that a slot's A and B are read
// once per group of rows and stay in cache while its rows go through them.
//
// Packed layouts (written by vllm/lora/layers.py), S = 2 inputs per 32-bit lane for
// bfloat16 (pairs, the dot-product instruction's operands), 1 for float32; Rp = max_rank
// rounded up to 16 (lanes past a slot's rank hold zeros):
//
//   a  [P, L, K / S, Rp * S]            for each step of S inputs, lane j holds row j of A
//   b  [L, ceil(N / 16), Rp / S, 16 * S] for each block of 16 outputs and step of S ranks,
//                                         lane o holds output o's B values
//
// so one 64-byte vector of `a` times the row's S inputs broadcast gives 16 ranks, and one
// of `b` times S ranks broadcast gives 16 outputs. bfloat16 uses AVX512-BF16's vdpbf16ps
// where the CPU has it (the build's -march=native), else the same sum as two float FMAs;
// xa is rounded to bfloat16 between the phases (as a bfloat16 matmul's output is).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VLLM_LORA_KERNEL 1
#endif

#if defined(VLLM_LORA_KERNEL)
namespace {

using vllm_cpu::store16;

constexpr int64_t kLanes = 16;
constexpr int kShrinkRows = 8;   // rows sharing each A vector load
constexpr int kExpandRows = 4;   // rows x vectors of outputs: 16 accumulators
constexpr int kExpandVecs = 4;

struct Bf16 {
  using T = c10::BFloat16;
  static constexpr int64_t S = 2;
  // acc + the lane-wise dot product of w's and x's bfloat16 pairs.
  static inline __m512 madd(__m512 acc, __m512i w, __m512i x) {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(w), reinterpret_cast<__m512bh>(x));
#else
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                          _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)),
                           _mm512_castsi512_ps(_mm512_and_si512(x, high)), acc);
#endif
  }
};

struct F32 {
  using T = float;
  static constexpr int64_t S = 1;
  static inline __m512 madd(__m512 acc, __m512i w, __m512i x) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
  }
};

// S consecutive inputs (32 bits) broadcast to every lane.
template <typename T>
inline __m512i broadcast(const T* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _mm512_set1_epi32(bits);
}

inline __m512i load_vec(const void* p) { return _mm512_loadu_si512(p); }

// Rows order[begin, end) all have `slot` (-1: no adapter).
struct Segment {
  int64_t slot, begin, end;
};

// Rows grouped by slot in slot order, each group in row order.
// Example: indices [1, -1, 0, 1], 2 slots -> order [1, 2, 0, 3],
// segments (-1, 0, 1), (0, 1, 2), (1, 2, 4).
void group_rows(const int64_t* indices, int64_t n, int64_t num_slots,
                std::vector<int64_t>* order, std::vector<Segment>* segments) {
  std::vector<int64_t> start(num_slots + 2, 0);  // slot s counted at s + 1 (-1 at 0)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = indices[i];
    TORCH_CHECK(s >= -1 && s < num_slots, "lora_delta: row ", i, " has slot ", s,
                ", not in [-1, ", num_slots, ")");
    ++start[s + 2];
  }
  for (int64_t s = 1; s <= num_slots + 1; ++s) start[s] += start[s - 1];
  order->resize(n);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n; ++i) (*order)[next[indices[i] + 1]++] = i;
  for (int64_t s = -1; s < num_slots; ++s)
    if (start[s + 2] > start[s + 1]) segments->push_back({s, start[s + 1], start[s + 2]});
}

struct Shapes {
  int64_t n, parts, slots, steps_in, rp, out, blocks;
};

// xa[row, p, c*16 .. c*16+16) for M rows of one slot: A_{p,s}'s lane chunk c times x.
template <typename K, int M>
void shrink_rows(const typename K::T* x, const typename K::T* a, typename K::T* xa,
                 const int64_t* rows, const Shapes& sh, int64_t in, int64_t p, int64_t c) {
  using T = typename K::T;
  __m512 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t stride = sh.rp * K::S;
  const T* w = a + c * kLanes * K::S;
  const T* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = x + rows[i] * in;
  for (int64_t k = 0; k < sh.steps_in; ++k, w += stride) {
    const __m512i wv = load_vec(w);
    for (int i = 0; i < M; ++i) acc[i] = K::madd(acc[i], wv, broadcast(xr[i] + k * K::S));
  }
  for (int i = 0; i < M; ++i)
    store16(xa + (rows[i] * sh.parts + p) * sh.rp + c * kLanes, acc[i]);
}

template <typename K>
void shrink_dispatch(int m, const typename K::T* x, const typename K::T* a,
                     typename K::T* xa, const int64_t* rows, const Shapes& sh, int64_t in,
                     int64_t p, int64_t c) {
  switch (m) {
    case 1: shrink_rows<K, 1>(x, a, xa, rows, sh, in, p, c); break;
    case 2: shrink_rows<K, 2>(x, a, xa, rows, sh, in, p, c); break;
    case 3: shrink_rows<K, 3>(x, a, xa, rows, sh, in, p, c); break;
    case 4: shrink_rows<K, 4>(x, a, xa, rows, sh, in, p, c); break;
    case 5: shrink_rows<K, 5>(x, a, xa, rows, sh, in, p, c); break;
    case 6: shrink_rows<K, 6>(x, a, xa, rows, sh, in, p, c); break;
    case 7: shrink_rows<K, 7>(x, a, xa, rows, sh, in, p, c); break;
    default: shrink_rows<K, 8>(x, a, xa, rows, sh, in, p, c); break;
  }
}

// Stores 16 outputs at out[first..first+16), only those in [lo, hi).
template <typename T>
inline void store_part(T* out, int64_t first, int64_t lo, int64_t hi, __m512 v) {
  if (first >= lo && first + kLanes <= hi) {
    store16(out + first, v);
    return;
  }
  T tmp[kLanes];
  store16(tmp, v);
  for (int64_t o = std::max(first, lo); o < std::min(first + kLanes, hi); ++o)
    out[o] = tmp[o - first];
}

// delta[row, blocks [block, block + V) of 16 outputs, within part p's [lo, hi)] for M
// rows of one slot: B_s's blocks times xa[row, p] over `steps` steps of S ranks.
template <typename K, int M, int V>
void expand_rows(const typename K::T* xa, const typename K::T* b, typename K::T* out,
                 const int64_t* rows, const Shapes& sh, int64_t p, int64_t block, int64_t steps,
                 int64_t lo, int64_t hi) {
  using T = typename K::T;
  __m512 acc[M][V];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = _mm512_setzero_ps();
  const int64_t block_size = sh.rp * kLanes;  // elements per block of 16 outputs
  const T* w = b + block * block_size;
  const T* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = xa + (rows[i] * sh.parts + p) * sh.rp;
  for (int64_t j = 0; j < steps; ++j) {
    __m512i wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load_vec(w + v * block_size + j * kLanes * K::S);
    for (int i = 0; i < M; ++i) {
      const __m512i xv = broadcast(xr[i] + j * K::S);
      for (int v = 0; v < V; ++v) acc[i][v] = K::madd(acc[i][v], wv[v], xv);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < V; ++v)
      store_part(out + rows[i] * sh.out, (block + v) * kLanes, lo, hi, acc[i][v]);
}

template <typename K, int V>
void expand_rows_v(int m, const typename K::T* xa, const typename K::T* b,
                   typename K::T* out, const int64_t* rows, const Shapes& sh, int64_t p,
                   int64_t block, int64_t steps, int64_t lo, int64_t hi) {
  switch (m) {
    case 1: expand_rows<K, 1, V>(xa, b, out, rows, sh, p, block, steps, lo, hi); break;
    case 2: expand_rows<K, 2, V>(xa, b, out, rows, sh, p, block, steps, lo, hi); break;
    case 3: expand_rows<K, 3, V>(xa, b, out, rows, sh, p, block, steps, lo, hi); break;
    default: expand_rows<K, 4, V>(xa, b, out, rows, sh, p, block, steps, lo, hi); break;
  }
}

template <typename K>
void expand_dispatch(int m, int v, const typename K::T* xa, const typename K::T* b,
                     typename K::T* out, const int64_t* rows, const Shapes& sh, int64_t p,
                     int64_t block, int64_t steps, int64_t lo, int64_t hi) {
  switch (v) {
    case 1: expand_rows_v<K, 1>(m, xa, b, out, rows, sh, p, block, steps, lo, hi); break;
    case 2: expand_rows_v<K, 2>(m, xa, b, out, rows, sh, p, block, steps, lo, hi); break;
    case 3: expand_rows_v<K, 3>(m, xa, b, out, rows, sh, p, block, steps, lo, hi); break;
    default: expand_rows_v<K, 4>(m, xa, b, out, rows, sh, p, block, steps, lo, hi); break;
  }
}

template <typename K>
void lora_delta_impl(const torch::Tensor& x, const int64_t* indices, const int64_t* ranks,
                     const torch::Tensor& a, const torch::Tensor& b,
                     at::IntArrayRef bounds, torch::Tensor& out, const Shapes& sh) {
  using T = typename K::T;
  std::vector<int64_t> order;
  std::vector<Segment> segments;
  group_rows(indices, sh.n, sh.slots, &order, &segments);
  const int64_t in = sh.steps_in * K::S;
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* op = out.data_ptr<T>();

  // Shrink tasks: (part, group of <= 8 rows of one slot, lane chunk).
  struct ShrinkTask {
    int64_t p, begin, m, c, slot;
  };
  std::vector<ShrinkTask> shrink;
  for (const Segment& seg : segments) {
    if (seg.slot < 0) continue;
    const int64_t chunks = (ranks[seg.slot] + kLanes - 1) / kLanes;
    for (int64_t p = 0; p < sh.parts; ++p)
      for (int64_t r = seg.begin; r < seg.end; r += kShrinkRows)
        for (int64_t c = 0; c < chunks; ++c)
          shrink.push_back({p, r, std::min<int64_t>(kShrinkRows, seg.end - r), c, seg.slot});
  }
  auto xa = torch::empty({sh.n, sh.parts, sh.rp}, x.options());  // rows read only where written
  T* xap = xa.data_ptr<T>();
  const int64_t a_slot = sh.steps_in * sh.rp * K::S;  // elements of one (part, slot)
  at::parallel_for(0, static_cast<int64_t>(shrink.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const ShrinkTask& task = shrink[t];
      shrink_dispatch<K>(static_cast<int>(task.m), xp,
                         ap + (task.p * sh.slots + task.slot) * a_slot, xap,
                         order.data() + task.begin, sh, in, task.p, task.c);
    }
  });

  // Expand tasks: (part, <= 4 blocks of 16 outputs touching it), each over every row.
  struct ExpandTask {
    int64_t p, block, v;
  };
  std::vector<ExpandTask> expand;
  for (int64_t p = 0; p < sh.parts; ++p) {
    const int64_t first = bounds[p] / kLanes, last = (bounds[p + 1] + kLanes - 1) / kLanes;
    for (int64_t block = first; block < last; block += kExpandVecs)
      expand.push_back({p, block, std::min<int64_t>(kExpandVecs, last - block)});
  }
  const int64_t b_slot = sh.blocks * sh.rp * kLanes;  // elements of one slot
  at::parallel_for(0, static_cast<int64_t>(expand.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const ExpandTask& task = expand[t];
      const int64_t col_lo = std::max(bounds[task.p], task.block * kLanes);
      const int64_t col_hi = std::min(bounds[task.p + 1], (task.block + task.v) * kLanes);
      for (const Segment& seg : segments) {
        const int64_t rank = seg.slot < 0 ? 0 : ranks[seg.slot];
        if (rank == 0) {  // no adapter (or none in this layer): zero rows
          for (int64_t r = seg.begin; r < seg.end; ++r)
            std::memset(op + order[r] * sh.out + col_lo, 0, (col_hi - col_lo) * sizeof(T));
          continue;
        }
        const int64_t steps = (rank + K::S - 1) / K::S;
        for (int64_t r = seg.begin; r < seg.end; r += kExpandRows)
          expand_dispatch<K>(static_cast<int>(std::min<int64_t>(kExpandRows, seg.end - r)),
                             static_cast<int>(task.v), xap, bp + seg.slot * b_slot, op,
                             order.data() + r, sh, task.p, task.block, steps, col_lo, col_hi);
      }
    }
  });
}

}  // namespace
#endif

bool lora_kernel_available() {
#if defined(VLLM_LORA_KERNEL)
  return true;
#else
  return false;
#endif
}

// x [n, K] (bfloat16 or float32) through each row's slot: delta [n, N] in x's dtype.
// indices [>= n] int64 (the first n read), ranks [L] int64 (each slot's rank in this layer,
// 0: none), a and b packed as above, part_bounds [P + 1] (part p's outputs are
// [bounds[p], bounds[p + 1]), bounds[P] = N).
torch::Tensor lora_delta(torch::Tensor x, torch::Tensor indices, torch::Tensor ranks,
                         torch::Tensor a, torch::Tensor b, at::IntArrayRef part_bounds) {
#if defined(VLLM_LORA_KERNEL)
  TORCH_CHECK(x.dim() == 2 && a.dim() == 4 && b.dim() == 4, "lora_delta: x [n, K], a and b 4-D");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32,
              "lora_delta: x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(),
              "lora_delta: a and b must have x's dtype");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "lora_delta: a and b must be contiguous");
  TORCH_CHECK(indices.scalar_type() == torch::kInt64 && ranks.scalar_type() == torch::kInt64 &&
                  indices.is_contiguous() && ranks.is_contiguous(),
              "lora_delta: indices and ranks must be contiguous int64");
  x = x.contiguous();
  const int64_t s = x.scalar_type() == torch::kBFloat16 ? 2 : 1;
  Shapes sh;
  sh.n = x.size(0);
  sh.parts = a.size(0);
  sh.slots = a.size(1);
  sh.steps_in = a.size(2);
  sh.rp = a.size(3) / s;
  sh.out = part_bounds.empty() ? 0 : part_bounds.back();
  sh.blocks = b.size(1);
  TORCH_CHECK(static_cast<int64_t>(part_bounds.size()) == sh.parts + 1 && part_bounds[0] == 0,
              "lora_delta: part_bounds must hold ", sh.parts + 1, " bounds from 0");
  for (int64_t p = 0; p < sh.parts; ++p)
    TORCH_CHECK(part_bounds[p] <= part_bounds[p + 1], "lora_delta: part_bounds must not fall");
  TORCH_CHECK(sh.rp % kLanes == 0 && a.size(3) == sh.rp * s, "lora_delta: a's last dimension ",
              a.size(3), " is not a multiple of ", kLanes * s);
  TORCH_CHECK(x.size(1) == sh.steps_in * s, "lora_delta: x has ", x.size(1),
              " inputs, a holds ", sh.steps_in * s);
  TORCH_CHECK(b.size(0) == sh.slots && sh.blocks == (sh.out + kLanes - 1) / kLanes &&
                  b.size(2) == sh.rp / s && b.size(3) == kLanes * s,
              "lora_delta: b's shape ", b.sizes(), " does not match a's ", a.sizes(),
              " and ", sh.out, " outputs");
  TORCH_CHECK(indices.numel() >= sh.n && ranks.numel() == sh.slots,
              "lora_delta: ", indices.numel(), " indices for ", sh.n, " rows, ", ranks.numel(),
              " ranks for ", sh.slots, " slots");
  const int64_t* rk = ranks.data_ptr<int64_t>();
  for (int64_t slot = 0; slot < sh.slots; ++slot)
    TORCH_CHECK(rk[slot] >= 0 && rk[slot] <= sh.rp, "lora_delta: slot ", slot, " has rank ",
                rk[slot], ", over ", sh.rp);
  auto out = torch::empty({sh.n, sh.out}, x.options());
  if (x.scalar_type() == torch::kBFloat16)
    lora_delta_impl<Bf16>(x, indices.data_ptr<int64_t>(), rk, a, b, part_bounds, out, sh);
  else
    lora_delta_impl<F32>(x, indices.data_ptr<int64_t>(), rk, a, b, part_bounds, out, sh);
  return out;
#else
  TORCH_CHECK(false, "lora_delta needs AVX-512 (see lora_kernel_available)");
#endif
}
