// One mixture-of-experts layer's experts for all of a step's tokens (`moe_experts`): the
// routing (softmax, top-k) stays in the caller's graph; this op takes the chosen experts and
// their weights and does everything after it in one call:
//
//   group   the T*k (token, slot) rows by expert (a counting sort; stable, so one expert's
//           rows keep token order), gathering each row's activations
//   gate/up each active expert's rows times its gate and up rows, over tiles of the
//           intermediate columns spread across threads, SiLU(gate) * up in the same task
//   down    each active expert's activated rows times its down rows, tiles of hidden columns
//   combine each token's k rows scaled by their routing weights and summed, in slot order
//
// so each active expert's weights are read once a step, by one thread a tile. The weights
// come in one of the types the dense layers use, named by ggml's type ids:
//
//   F32 (0), BF16 (30)   dense rows [E, N, K] (strided views allowed: w13's halves): a
//                        decode form (register-blocked dot products: with AVX-512 up to
//                        8 rows of an expert a pass over each weight row; in AVX2 blocks
//                        of 3 weight rows, each read from memory once for passes of up to
//                        4 rows, the next block prefetched) and, for experts
//                        with more than kBatchRows rows, a batched form (at::mm in float32,
//                        one expert after another). With AVX512-BF16, bfloat16 weights take
//                        vdpbf16ps with the activations rounded to bfloat16 instead, at any
//                        row count (passes of 8 rows over tiles of 16 weight rows)
//   GGUF block types     uint8 [E, N, row bytes]: gguf_mm's block layer (gguf_blocks.h),
//                        activations quantized per 32 once per product; its own passes of 8
//                        rows over tiles of 16 weight rows are the batched form
//
// Under tensor parallel the caller passes its rank's slice (intermediate columns) and sums
// the ranks' outputs.
#include "gguf_blocks.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t kF32 = 0, kBF16 = 30;
// Dense experts with more rows take at::mm (float32): 64 experts top-8, hidden 1024,
// intermediate 384, 512 tokens (64 rows an expert), one thread: float32 1.3 s against 1.5 s
// in the decode form's passes.
constexpr int64_t kBatchRows = 32;

bool dense_type(int64_t type) { return type == kF32 || type == kBF16; }

struct Weights {  // one product's expert weights
  const uint8_t* base;
  int64_t type, expert_stride, row_stride;  // strides in bytes
  int64_t row_bytes;                        // GGUF: bytes a row of blocks
  torch::Tensor tensor;                     // [E, N, K] (dense) for the batched form

  const uint8_t* expert(int64_t e) const { return base + e * expert_stride; }
};

Weights weights_of(const torch::Tensor& w, int64_t type, int64_t k, const char* name) {
  TORCH_CHECK(w.dim() == 3, "moe_experts: ", name, " must be [experts, rows, ...]");
  TORCH_CHECK(w.stride(2) == 1, "moe_experts: ", name, "'s rows must be contiguous");
  Weights out{static_cast<const uint8_t*>(w.data_ptr()), type,
              w.stride(0) * static_cast<int64_t>(w.element_size()),
              w.stride(1) * static_cast<int64_t>(w.element_size()), 0, w};
  if (dense_type(type)) {
    TORCH_CHECK(w.scalar_type() == (type == kF32 ? torch::kFloat32 : torch::kBFloat16),
                "moe_experts: ", name, " is ", w.scalar_type(), ", type ", type, " needs ",
                type == kF32 ? "float32" : "bfloat16");
    TORCH_CHECK(w.size(2) == k, "moe_experts: ", name, " has ", w.size(2), " columns, expected ", k);
  } else {
    const vllm_gguf::Layout l = vllm_gguf::layout(type);
    TORCH_CHECK(w.scalar_type() == torch::kUInt8, "moe_experts: ", name, " must be uint8 blocks");
    TORCH_CHECK(k % l.values == 0 && w.size(2) == k / l.values * l.bytes, "moe_experts: ", name,
                "'s rows hold ", w.size(2), " bytes; ", k, " values in type ", type, " take ",
                k / l.values * l.bytes);
    out.row_bytes = w.size(2);
  }
  return out;
}

#if defined(VLLM_VEC16)
using namespace vllm_cpu;

#if defined(__AVX512F__)
constexpr int kDenseRows = 8;  // activation rows a pass keeps in registers

// Activation rows row0..row0+M (x [*, k] float32) times dense weight rows [begin, end).
template <typename W, int M>
void dense_rows(const uint8_t* w, int64_t row_stride, const float* x, int64_t k, int64_t row0,
                float* out, int64_t n_total, int64_t begin, int64_t end) {
  const int64_t body = k - k % 16;
  for (int64_t n = begin; n < end; ++n) {
    const W* wn = reinterpret_cast<const W*>(w + n * row_stride);
    f32x16 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = zero16();
    for (int64_t c = 0; c < body; c += 16) {
      const f32x16 wv = load16(wn + c);
      for (int r = 0; r < M; ++r) acc[r] = fmadd16(wv, load16(x + (row0 + r) * k + c), acc[r]);
    }
    for (int r = 0; r < M; ++r) {
      float sum = reduce_add16(acc[r]);
      for (int64_t c = body; c < k; ++c) {
        sum += static_cast<float>(wn[c]) * x[(row0 + r) * k + c];
      }
      out[(row0 + r) * n_total + n] = sum;
    }
  }
}

template <typename W>
void dense_range(const uint8_t* w, int64_t row_stride, const float* x, int64_t k,
                 int64_t first_row, int64_t rows, float* out, int64_t n_total, int64_t begin,
                 int64_t end) {
  for (int64_t done = 0; done < rows;) {
    const int64_t left = rows - done, row0 = first_row + done;
    if (left >= kDenseRows) {
      dense_rows<W, kDenseRows>(w, row_stride, x, k, row0, out, n_total, begin, end);
      done += kDenseRows;
    } else if (left >= 4) {
      dense_rows<W, 4>(w, row_stride, x, k, row0, out, n_total, begin, end);
      done += 4;
    } else if (left >= 2) {
      dense_rows<W, 2>(w, row_stride, x, k, row0, out, n_total, begin, end);
      done += 2;
    } else {
      dense_rows<W, 1>(w, row_stride, x, k, row0, out, n_total, begin, end);
      done += 1;
    }
  }
}

#else  // AVX2: 16 ymm registers, 8 floats each
// A block of NW weight rows times M activation rows, 8 columns a step in NW x M
// accumulators: NW + M loads for NW * M FMAs (3 x 4: 7 loads for 12, where one weight row
// against 4 rows in two-register halves took 10 loads for 8). The weight block is read
// from memory by the block's first pass and from L1 by the others; `next`, where given,
// is the next block's first row, fetched into the caches during this pass (one line of
// each of its rows per 64 bytes of ours).
constexpr int kBlockRows = 3;  // weight rows a block
constexpr int kPassRows = 4;   // activation rows a pass, at most

template <typename W, int NW, int M>
void dense_block(const uint8_t* w, int64_t row_stride, const float* x, int64_t k, int64_t row0,
                 float* out, int64_t n_total, int64_t n, const uint8_t* next) {
  constexpr int64_t kLine = 64 / sizeof(W);  // values a cache line
  static_assert(kLine % 8 == 0, "a cache line holds whole steps of 8");
  const int64_t lines = k - k % kLine, body = k - k % 8;
  const W* wr[NW];
  for (int i = 0; i < NW; ++i) wr[i] = reinterpret_cast<const W*>(w + (n + i) * row_stride);
  __m256 acc[NW][M];
  for (int i = 0; i < NW; ++i) {
    for (int r = 0; r < M; ++r) acc[i][r] = _mm256_setzero_ps();
  }
  const auto step = [&](int64_t c) {
    __m256 wv[NW];
    for (int i = 0; i < NW; ++i) wv[i] = load8(wr[i] + c);
    for (int r = 0; r < M; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + (row0 + r) * k + c);
      for (int i = 0; i < NW; ++i) acc[i][r] = _mm256_fmadd_ps(wv[i], xv, acc[i][r]);
    }
  };
  int64_t c = 0;
  for (; c < lines; c += kLine) {
    if (next != nullptr) {
      for (int i = 0; i < NW; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(next + i * row_stride) + c * sizeof(W),
                     _MM_HINT_T0);
      }
    }
    for (int64_t h = 0; h < kLine; h += 8) step(c + h);
  }
  for (; c < body; c += 8) step(c);
  for (int i = 0; i < NW; ++i) {
    for (int r = 0; r < M; ++r) {
      float sum = reduce_add8(acc[i][r]);
      for (int64_t t = body; t < k; ++t) {
        sum += static_cast<float>(wr[i][t]) * x[(row0 + r) * k + t];
      }
      out[(row0 + r) * n_total + n + i] = sum;
    }
  }
}

// All `rows` activation rows against weight rows [n, n + NW): passes of at most kPassRows,
// as even as they can be (7 rows: 4 + 3, not 4 + 2 + 1).
template <typename W, int NW>
void dense_passes(const uint8_t* w, int64_t row_stride, const float* x, int64_t k,
                  int64_t first_row, int64_t rows, float* out, int64_t n_total, int64_t n,
                  const uint8_t* next) {
  const int64_t passes = (rows + kPassRows - 1) / kPassRows;
  for (int64_t p = 0, done = 0; p < passes; ++p) {
    const int64_t m = (rows - done) / (passes - p), row0 = first_row + done;
    const uint8_t* fetch = p == 0 ? next : nullptr;
    switch (m) {
      case 4: dense_block<W, NW, 4>(w, row_stride, x, k, row0, out, n_total, n, fetch); break;
      case 3: dense_block<W, NW, 3>(w, row_stride, x, k, row0, out, n_total, n, fetch); break;
      case 2: dense_block<W, NW, 2>(w, row_stride, x, k, row0, out, n_total, n, fetch); break;
      default: dense_block<W, NW, 1>(w, row_stride, x, k, row0, out, n_total, n, fetch); break;
    }
    done += m;
  }
}
static_assert(kPassRows == 4, "dense_passes' cases cover passes of 1 to 4 rows");

// Activation rows [first_row, first_row + rows) times dense weight rows [begin, end).
template <typename W>
void dense_range(const uint8_t* w, int64_t row_stride, const float* x, int64_t k,
                 int64_t first_row, int64_t rows, float* out, int64_t n_total, int64_t begin,
                 int64_t end) {
  int64_t n = begin;
  for (; n + kBlockRows <= end; n += kBlockRows) {
    const bool last = n + 2 * kBlockRows > end;
    dense_passes<W, kBlockRows>(w, row_stride, x, k, first_row, rows, out, n_total, n,
                                last ? nullptr : w + (n + kBlockRows) * row_stride);
  }
  for (; n < end; ++n) {
    dense_passes<W, 1>(w, row_stride, x, k, first_row, rows, out, n_total, n, nullptr);
  }
}
#endif
#endif  // VLLM_VEC16

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define VLLM_MOE_BF16_DOT 1
// bfloat16 weights times bfloat16 activation rows, 32 products a `vdpbf16ps` (two a lane),
// both read along k as they lie: rows row0..row0+M of a [*, k] times weight rows
// [begin, end).
template <int M>
void bf16_rows(const uint8_t* w, int64_t row_stride, const c10::BFloat16* a, int64_t k,
               int64_t row0, float* out, int64_t n_total, int64_t begin, int64_t end) {
  const int64_t body = k - k % 32;
  for (int64_t n = begin; n < end; ++n) {
    const c10::BFloat16* wn = reinterpret_cast<const c10::BFloat16*>(w + n * row_stride);
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < body; c += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wn + c);
      for (int r = 0; r < M; ++r) {
        acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_loadu_si512(a + (row0 + r) * k + c));
      }
    }
    for (int r = 0; r < M; ++r) {
      float sum = _mm512_reduce_add_ps(acc[r]);
      for (int64_t c = body; c < k; ++c) {
        sum += static_cast<float>(wn[c]) * static_cast<float>(a[(row0 + r) * k + c]);
      }
      out[(row0 + r) * n_total + n] = sum;
    }
  }
}

// Any number of rows: passes of up to 8 over tiles of 16 weight rows (reread from L1).
void bf16_range(const uint8_t* w, int64_t row_stride, const c10::BFloat16* a, int64_t k,
                int64_t first_row, int64_t rows, float* out, int64_t n_total, int64_t begin,
                int64_t end) {
  for (int64_t tile = begin; tile < end; tile += 16) {
    const int64_t tile_end = std::min(end, tile + 16);
    for (int64_t done = 0; done < rows;) {
      const int64_t left = rows - done, row0 = first_row + done;
      if (left >= 8) {
        bf16_rows<8>(w, row_stride, a, k, row0, out, n_total, tile, tile_end);
        done += 8;
      } else if (left >= 4) {
        bf16_rows<4>(w, row_stride, a, k, row0, out, n_total, tile, tile_end);
        done += 4;
      } else if (left >= 2) {
        bf16_rows<2>(w, row_stride, a, k, row0, out, n_total, tile, tile_end);
        done += 2;
      } else {
        bf16_rows<1>(w, row_stride, a, k, row0, out, n_total, tile, tile_end);
        done += 1;
      }
    }
  }
}

// float32 rows -> bfloat16 (round to nearest even), 16 at a time.
void to_bf16(const float* x, int64_t n, c10::BFloat16* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  }
  for (; i < n; ++i) y[i] = c10::BFloat16(x[i]);
}
#endif

// bfloat16 weights read with bfloat16 activations (the vdpbf16ps form), where built.
bool bf16_dot(int64_t type) {
#if defined(VLLM_MOE_BF16_DOT)
  return type == kBF16;
#else
  (void)type;
  return false;
#endif
}

// One product over rows [first, first + rows) of one expert, output columns [begin, end).
struct Product {
  const Weights& w;
  const float* x;                       // dense: activations [R, k] float32
  const c10::BFloat16* xb;              // the same rows in bfloat16 (the vdpbf16ps form)
  const vllm_gguf::Activations* a;      // GGUF: the same rows quantized
  int64_t k;
  float* out;
  int64_t n_total;

  void operator()(int64_t expert, int64_t first, int64_t rows, int64_t begin, int64_t end) const {
    const uint8_t* we = w.expert(expert);
#if defined(VLLM_MOE_BF16_DOT)
    if (bf16_dot(w.type)) {
      bf16_range(we, w.row_stride, xb, k, first, rows, out, n_total, begin, end);
      return;
    }
#endif
    switch (w.type) {
#if defined(VLLM_VEC16)
      case kF32:
        dense_range<float>(we, w.row_stride, x, k, first, rows, out, n_total, begin, end);
        return;
      case kBF16:
        dense_range<c10::BFloat16>(we, w.row_stride, x, k, first, rows, out, n_total, begin, end);
        return;
#endif
      default:
#if defined(VLLM_GGUF_MM)
        vllm_gguf::dispatch(w.type, we, w.row_bytes, *a, first, rows, out, n_total, begin, end);
#endif
        return;
    }
  }
};

// The batched form of a dense product: rows [first, first + rows) of x (float32) times
// expert e's weights, by at::mm in float32 (bfloat16 weights widened first: 3 MB for a
// 768 x 1024 expert, against a product of hundreds of MFLOP; a bfloat16 at::mm goes to
// oneDNN, which builds a primitive for every new row count, and each expert has its own).
void batched_product(const Weights& w, const torch::Tensor& x, int64_t expert, int64_t first,
                     int64_t rows, const torch::Tensor& out) {
  const torch::Tensor we = w.tensor.select(0, expert);
  torch::Tensor rows_out = out.narrow(0, first, rows);
  at::mm_out(rows_out, x.narrow(0, first, rows),
             (w.type == kF32 ? we : we.to(torch::kFloat32)).t());
}

struct Task {
  int64_t expert, first, rows, begin, end;
};

// Each active expert's columns [0, n) in tiles: about four tasks a thread, tiles of at
// least 16 columns.
std::vector<Task> tiles(const std::vector<Task>& experts, int64_t n) {
  const int64_t threads = at::get_num_threads();
  const int64_t want = std::max<int64_t>(1, 4 * threads / std::max<int64_t>(1, experts.size()));
  const int64_t tile = std::max<int64_t>(16, (n / want + 15) / 16 * 16);
  std::vector<Task> out;
  for (const Task& e : experts) {
    for (int64_t b = 0; b < n; b += tile) out.push_back({e.expert, e.first, e.rows, b, std::min(n, b + tile)});
  }
  return out;
}

// x (float32, contiguous) as bfloat16 for the vdpbf16ps form where `needed`, else empty.
torch::Tensor bf16_copy(const torch::Tensor& x, bool needed) {
  if (!needed) return torch::Tensor();
  auto y = torch::empty(x.sizes(), x.options().dtype(torch::kBFloat16));
#if defined(VLLM_MOE_BF16_DOT)
  const float* src = x.data_ptr<float>();
  c10::BFloat16* dst = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, x.numel(), 16384, [&](int64_t b, int64_t e) {
    to_bf16(src + b, e - b, dst + b);
  });
#endif
  return y;
}

const c10::BFloat16* bf16_rows_of(const torch::Tensor& x) {
  return x.defined() ? x.data_ptr<c10::BFloat16>() : nullptr;
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

void quantize_rows(const float* x, int64_t rows, int64_t k, vllm_gguf::Activations* a) {
#if defined(VLLM_GGUF_MM)
  vllm_gguf::quantize_activations(x, rows, k, a);
#else
  (void)x, (void)rows, (void)k, (void)a;
#endif
}

}  // namespace

bool moe_experts_available() {
#if defined(VLLM_VEC16) && defined(VLLM_GGUF_MM)
  return true;
#else
  return false;
#endif
}

// x [T, H]; topk_weights [T, k]; topk_ids [T, k] int64; w1 / w3 [E, I, ...] (gate / up),
// w2 [E, H, ...] (down), each in its own type. Returns [T, H] in
// x's dtype: sum_j topk_weights[t, j] * down(SiLU(gate(x_t)) * up(x_t)) of expert ids[t, j].
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor topk_weights, torch::Tensor topk_ids,
                          torch::Tensor w1, torch::Tensor w3, torch::Tensor w2,
                          int64_t w1_type, int64_t w3_type, int64_t w2_type) {
  TORCH_CHECK(x.dim() == 2, "moe_experts: x must be [tokens, hidden]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "moe_experts: topk_weights and topk_ids must be [tokens, k]");
  TORCH_CHECK(topk_ids.scalar_type() == torch::kInt64, "moe_experts: topk_ids must be int64");
  TORCH_CHECK(moe_experts_available(), "moe_experts needs AVX2 with FMA and F16C (built without)");
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1);
  const int64_t experts = w1.size(0), inter = w1.size(1);
  TORCH_CHECK(w3.size(0) == experts && w3.size(1) == inter && w2.size(0) == experts &&
                  w2.size(1) == hidden,
              "moe_experts: w1/w3 must be [E, I, ...] and w2 [E, H, ...] with E = ", experts,
              ", I = ", inter, ", H = ", hidden);
  const Weights g = weights_of(w1, w1_type, hidden, "w1");
  const Weights u = weights_of(w3, w3_type, hidden, "w3");
  const Weights d = weights_of(w2, w2_type, inter, "w2");
  auto out = torch::zeros({tokens, hidden}, x.options().dtype(torch::kFloat32));
  const int64_t rows = tokens * top_k;
  if (rows == 0) return out.to(x.scalar_type());

  // group: counting sort of the (token, slot) rows by expert
  const auto ids = topk_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(experts + 1, 0), order(rows), position(rows);
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < experts, "moe_experts: expert id ", id[i], " is not below ",
                experts);
    ++start[id[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t p = next[id[i]]++;
      order[p] = i;
      position[i] = p;
    }
  }
  std::vector<Task> small, large;  // active experts: decode form / batched (dense) form
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (count == 0) continue;
    const bool batched = dense_type(w1_type) && dense_type(w3_type) && !bf16_dot(w1_type) &&
                         !bf16_dot(w3_type) && count > kBatchRows;
    (batched ? large : small).push_back({e, start[e], count, 0, 0});
  }

  // the rows' activations, gathered in expert order (float32)
  const auto xf = x.to(torch::kFloat32).contiguous();
  auto xs = torch::empty({rows, hidden}, xf.options());
  {
    const float* src = xf.data_ptr<float>();
    float* dst = xs.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p) {
        std::memcpy(dst + p * hidden, src + (order[p] / top_k) * hidden, hidden * sizeof(float));
      }
    });
  }
  static thread_local vllm_gguf::Activations quantized_x, quantized_a;
  vllm_gguf::Activations& qx = quantized_x;  // the workers must see this thread's
  vllm_gguf::Activations& qa = quantized_a;
  if (!dense_type(w1_type) || !dense_type(w3_type)) {
    quantize_rows(xs.data_ptr<float>(), rows, hidden, &qx);
  }

  // gate/up, SiLU(gate) * up
  auto gate = torch::empty({rows, inter}, xf.options());
  auto up = torch::empty({rows, inter}, xf.options());
  auto act = torch::empty({rows, inter}, xf.options());
  float *gp = gate.data_ptr<float>(), *upp = up.data_ptr<float>(), *ap = act.data_ptr<float>();
  auto xs_bf16 = bf16_copy(xs, bf16_dot(w1_type) || bf16_dot(w3_type));
  const Product gate_product{g, xs.data_ptr<float>(), bf16_rows_of(xs_bf16), &qx, hidden, gp,
                             inter};
  const Product up_product{u, xs.data_ptr<float>(), bf16_rows_of(xs_bf16), &qx, hidden, upp,
                           inter};
  const std::vector<Task> tasks1 = tiles(small, inter);
  at::parallel_for(0, static_cast<int64_t>(tasks1.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Task& t = tasks1[i];
      gate_product(t.expert, t.first, t.rows, t.begin, t.end);
      up_product(t.expert, t.first, t.rows, t.begin, t.end);
      for (int64_t r = t.first; r < t.first + t.rows; ++r) {
        for (int64_t c = t.begin; c < t.end; ++c) {
          ap[r * inter + c] = silu(gp[r * inter + c]) * upp[r * inter + c];
        }
      }
    }
  });
  for (const Task& t : large) {
    batched_product(g, xs, t.expert, t.first, t.rows, gate);
    batched_product(u, xs, t.expert, t.first, t.rows, up);
    at::parallel_for(t.first * inter, (t.first + t.rows) * inter, 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) ap[i] = silu(gp[i]) * upp[i];
    });
  }

  // down
  std::vector<Task> small2, large2;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (count == 0) continue;
    const bool batched = dense_type(w2_type) && !bf16_dot(w2_type) && count > kBatchRows;
    (batched ? large2 : small2).push_back({e, start[e], count, 0, 0});
  }
  if (!dense_type(w2_type)) quantize_rows(ap, rows, inter, &qa);
  auto y = torch::empty({rows, hidden}, xf.options());
  float* yp = y.data_ptr<float>();
  auto act_bf16 = bf16_copy(act, bf16_dot(w2_type));
  const Product down_product{d, ap, bf16_rows_of(act_bf16), &qa, inter, yp, hidden};
  const std::vector<Task> tasks2 = tiles(small2, hidden);
  at::parallel_for(0, static_cast<int64_t>(tasks2.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Task& t = tasks2[i];
      down_product(t.expert, t.first, t.rows, t.begin, t.end);
    }
  });
  for (const Task& t : large2) batched_product(d, act, t.expert, t.first, t.rows, y);

  // combine: each token's rows in slot order
  const auto wts = topk_weights.to(torch::kFloat32).contiguous();
  const float* wp = wts.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* o = op + t * hidden;
      for (int64_t j = 0; j < top_k; ++j) {
        const float w = wp[t * top_k + j];
        const float* row = yp + position[t * top_k + j] * hidden;
        for (int64_t c = 0; c < hidden; ++c) o[c] += w * row[c];
      }
    }
  });
  return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
}
