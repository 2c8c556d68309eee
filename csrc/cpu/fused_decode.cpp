// Whole decode steps of a Llama-family decoder whose linear layers are quant_gemv block
// codes (GGUF), every layer in one call and one OpenMP parallel region:
//
//   for each layer:  x = RMSNorm(h) -> int8 rows -> qkv (quant_gemv rows split over the
//   threads) -> rotary on q, k -> k, v into the paged cache -> paged decode attention ->
//   o_proj -> h += o -> RMSNorm -> gate_up -> SiLU(gate) * up -> down -> h += down
//   then the final RMSNorm.
//
// A one-token step of a small model spends most of its time outside weight streaming when
// each of these is its own operator (dispatch, a compiled graph per layer, a fork and join
// of the thread team per kernel); here one parallel region runs the whole step, and every
// buffer is allocated once.
//
// Threads: each keeps its own copy of the residual stream and computes the elementwise
// stages and each projection's int8 input itself, then its share of the projection's output
// rows (and of attention's sequences); one barrier after each of the five stages whose output
// every thread reads.
//
// Numerics follow the operator-by-operator path: every tensor that path stores in the
// model's dtype (normed rows, q/k/v, the rotated q and k, attention's output, each
// projection, the residual stream, SiLU(gate) * up) is rounded to it here at the same
// point; sums and the norm's statistics are float32. The kernels are those of the
// operators: quant_gemv's inner loops (quant_gemv.h) and paged decode attention
// (paged_attention.h).
//
// Rows: a step's tokens, up to kMaxChunkedRows (32): one token of each decoding request, or
// several tokens of one sequence (a verification step's k + 1, a short prompt chunk). Every
// row attends to its own sequence length through its own block-table row, as a decode
// query does; where rows share a sequence, every row's K/V is written before any row
// attends (one more barrier), so a row sees the rows before it, as causal attention does.
// Past 8 rows the projections take quant_gemv's passes over L1-resident tiles.
//
// Layouts: h [rows, hidden] in the model dtype T (float32, bfloat16 or float16);
// the KV caches are the attention backend's [2, num_blocks, block_size, kv_heads,
// head_size]; cos / sin [max_positions, head_size] (the rotary table, full width,
// rotate-half form); norm weights [hidden] in T.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "paged_attention.h"
#include "quant_gemv.h"
#include "vec.h"

#if defined(VLLM_QUANT_GEMV)
namespace {

using vllm_cpu::f32x16;
using vllm_cpu::load16;
using vllm_cpu::store16;
using vllm_cpu::add16;
using vllm_cpu::mul16;
using vllm_cpu::qgemv::QuantizedRows;

// x rounded to T and back (the operator path stores the value in T).
template <typename T>
inline f32x16 round16(f32x16 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    alignas(64) T tmp[16];
    store16(tmp, x);
    return load16(tmp);
  }
}

// One block-quantized weight: quant_gemv's packed codes and float16 scales.
struct QuantWeight {
  torch::Tensor codes, d, m;  // kept alive
  int64_t bits = 0, n = 0, kp = 0;
};

// out = weight * rnd(x / rms(x)), rounded: RMSNorm's `weight * h.to(dtype)`.
template <typename T>
void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t size,
              float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * size;
    f32x16 ss = vllm_cpu::zero16();
    for (int64_t j = 0; j < size; j += 16) {
      const f32x16 v = load16(xr + j);
      ss = vllm_cpu::fmadd16(v, v, ss);
    }
    const float inv =
        1.0f / std::sqrt(vllm_cpu::reduce_add16(ss) / static_cast<float>(size) + eps);
    const f32x16 vinv = vllm_cpu::set16(inv);
    for (int64_t j = 0; j < size; j += 16) {
      const f32x16 normed = round16<T>(mul16(load16(xr + j), vinv));
      store16(out + r * size + j, round16<T>(mul16(load16(weight + j), normed)));
    }
  }
}

// h = rnd(h + rnd(y)): a residual add of a projection stored in T.
template <typename T>
void add_residual(float* h, const float* y, int64_t count) {
  for (int64_t j = 0; j < count; j += 16) {
    const f32x16 sum = add16(load16(h + j), round16<T>(load16(y + j)));
    store16(h + j, round16<T>(sum));
  }
}

}  // namespace

class FusedDecoder {
 public:
  FusedDecoder(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> codes,
               std::vector<torch::Tensor> d, std::vector<torch::Tensor> m,
               std::vector<int64_t> bits, std::vector<torch::Tensor> kv_caches,
               torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_size, double eps, double scale)
      : kv_caches_(std::move(kv_caches)), cos_(std::move(cos)), sin_(std::move(sin)),
        num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_size_(head_size),
        eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
    layers_ = static_cast<int64_t>(kv_caches_.size());
    TORCH_CHECK(layers_ > 0, "FusedDecoder: no layers");
    TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers_ + 1,
                "FusedDecoder: 2 norms per layer and the final one expected");
    TORCH_CHECK(static_cast<int64_t>(codes.size()) == 4 * layers_ && d.size() == codes.size() &&
                    m.size() == codes.size() && bits.size() == codes.size(),
                "FusedDecoder: 4 weights (qkv, o, gate_up, down) per layer expected");
    dtype_ = cos_.scalar_type();
    hidden_ = norms[0].numel();
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                "FusedDecoder: bad head counts");
    TORCH_CHECK(head_size % 32 == 0 && hidden_ % 16 == 0, "FusedDecoder: head size ",
                head_size, " (a multiple of 32) or hidden size ", hidden_,
                " (a multiple of 16) unsupported");
    TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) == head_size && sin_.sizes() == cos_.sizes() &&
                    cos_.is_contiguous() && sin_.is_contiguous() &&
                    sin_.scalar_type() == dtype_,
                "FusedDecoder: cos / sin must be contiguous [positions, head_size]");
    for (const auto& w : norms) {
      TORCH_CHECK(w.numel() == hidden_ && w.scalar_type() == dtype_, "FusedDecoder: norm shape");
      norms_.push_back(w.to(torch::kFloat32).contiguous());
    }
    const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
    for (size_t i = 0; i < codes.size(); ++i) {
      QuantWeight w{codes[i].contiguous(), d[i].contiguous(), m[i].contiguous(), bits[i],
                    codes[i].size(0), d[i].size(1) * 32};
      TORCH_CHECK(w.bits == 4 || w.bits == 8, "FusedDecoder: bits must be 4 or 8");
      TORCH_CHECK(w.codes.scalar_type() == torch::kUInt8 && w.d.scalar_type() == torch::kHalf &&
                      w.m.scalar_type() == torch::kHalf && w.codes.size(1) == w.kp * w.bits / 8,
                  "FusedDecoder: weight ", i, " is not quant_gemv's layout");
      weights_.push_back(std::move(w));
    }
    intermediate_ = weights_[2].n / 2;
    TORCH_CHECK(intermediate_ % 16 == 0, "FusedDecoder: intermediate size must be a multiple "
                "of 16");
    for (int64_t l = 0; l < layers_; ++l) {
      const int64_t in[4] = {hidden_, q_size, hidden_, intermediate_};
      const int64_t out[4] = {q_size + 2 * kv_size, hidden_, 2 * intermediate_, hidden_};
      for (int j = 0; j < 4; ++j) {
        const QuantWeight& w = weights_[4 * l + j];
        TORCH_CHECK(w.n == out[j] && w.kp >= in[j] && w.kp - in[j] < vllm_cpu::qgemv::kHalf,
                    "FusedDecoder: layer ", l, " weight ", j, " has shape [", w.n, ", ", w.kp,
                    "], expected [", out[j], ", ", in[j], "]");
      }
      const auto& kv = kv_caches_[l];
      TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.size(3) == num_kv_heads &&
                      kv.size(4) == head_size && kv.is_contiguous() &&
                      kv.scalar_type() == dtype_,
                  "FusedDecoder: KV cache ", l, " is not [2, blocks, block_size, ", num_kv_heads,
                  ", ", head_size, "] in the model dtype");
    }
    const int64_t rows = vllm_cpu::qgemv::kMaxChunkedRows;
    const int64_t widths[4] = {q_size + 2 * kv_size, hidden_, 2 * intermediate_, hidden_};
    for (int j = 0; j < 4; ++j) y_[j].resize(rows * widths[j]);
    // Attention's query and output in T (at most 4 bytes an element).
    q_.resize(rows * q_size);
    attn_.resize(rows * q_size);
  }

  int64_t num_layers() const { return layers_; }

  // One step: h [rows, hidden] (the embeddings); row r is a token at positions[r], written
  // at cache slot slot_mapping[r], attending to seq_lens[r] keys through block_table[r].
  // `shared_sequences`: some rows belong to one sequence (every K/V is written before any
  // row attends). Returns the final-normed hidden states.
  torch::Tensor forward(torch::Tensor h, torch::Tensor positions, torch::Tensor block_table,
                        torch::Tensor seq_lens, torch::Tensor slot_mapping,
                        bool shared_sequences) {
    TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden_ && h.scalar_type() == dtype_,
                "FusedDecoder: h must be [rows, ", hidden_, "] in the model dtype");
    const int64_t rows = h.size(0);
    TORCH_CHECK(rows >= 1 && rows <= vllm_cpu::qgemv::kMaxChunkedRows, "FusedDecoder: 1 to ",
                vllm_cpu::qgemv::kMaxChunkedRows, " rows, got ", rows);
    TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == rows &&
                    slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() >= rows,
                "FusedDecoder: positions / slot_mapping must be int64, one per row");
    TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.dim() == 2 &&
                    block_table.size(0) == rows && seq_lens.scalar_type() == torch::kInt32 &&
                    seq_lens.numel() == rows,
                "FusedDecoder: block_table [rows, blocks] / seq_lens [rows] must be int32");
    h = h.contiguous();
    positions = positions.contiguous();
    slot_mapping = slot_mapping.contiguous();
    block_table = block_table.contiguous();
    seq_lens = seq_lens.contiguous();
    const int64_t num_slots = kv_caches_[0].size(1) * kv_caches_[0].size(2);
    const int64_t block_size = kv_caches_[0].size(2);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = positions.data_ptr<int64_t>()[r];
      const int64_t s = slot_mapping.data_ptr<int64_t>()[r];
      const int64_t len = seq_lens.data_ptr<int32_t>()[r];
      TORCH_CHECK(p >= 0 && p < cos_.size(0), "FusedDecoder: position ", p, " out of range");
      TORCH_CHECK(s >= 0 && s < num_slots, "FusedDecoder: slot ", s, " out of range");
      TORCH_CHECK(len >= 1 && len <= block_table.size(1) * block_size,
                  "FusedDecoder: sequence length ", len, " does not fit the block table");
    }
    auto out = torch::empty_like(h);
    switch (dtype_) {
      case torch::kFloat32:
        run<float>(h, positions, block_table, seq_lens, slot_mapping, shared_sequences, out);
        break;
      case torch::kBFloat16:
        run<at::BFloat16>(h, positions, block_table, seq_lens, slot_mapping, shared_sequences,
                          out);
        break;
      case torch::kFloat16:
        run<at::Half>(h, positions, block_table, seq_lens, slot_mapping, shared_sequences, out);
        break;
      default: TORCH_CHECK(false, "FusedDecoder: unsupported dtype ", dtype_);
    }
    return out;
  }

 private:
  // Rows [begin, end) of this thread's share of an n-row projection (chunks of 16).
  static void share(int64_t n, int tid, int threads, int64_t* begin, int64_t* end) {
    const int64_t chunk = ((n + threads - 1) / threads + 15) / 16 * 16;
    *begin = std::min(n, tid * chunk);
    *end = std::min(n, *begin + chunk);
  }

  template <typename T>
  void run(const torch::Tensor& h_in, const torch::Tensor& positions,
           const torch::Tensor& block_table, const torch::Tensor& seq_lens,
           const torch::Tensor& slot_mapping, bool shared_sequences, torch::Tensor& out) {
    const int64_t rows = h_in.size(0), hidden = hidden_, inter = intermediate_;
    const int64_t D = head_size_, half = D / 2;
    const int64_t q_size = num_heads_ * D, kv_size = num_kv_heads_ * D;
    const int64_t qkv_n = q_size + 2 * kv_size;
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int32_t* table = block_table.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const T* cos = cos_.data_ptr<T>();
    const T* sin = sin_.data_ptr<T>();
    T* q = reinterpret_cast<T*>(q_.data());
    T* attn = reinterpret_cast<T*>(attn_.data());
    float* y_qkv = y_[0].data();
    float* y_o = y_[1].data();
    float* y_gu = y_[2].data();
    float* y_down = y_[3].data();
    const int threads = at::get_num_threads();
    if (static_cast<int>(private_.size()) < threads) private_.resize(threads);
    const T* hin = h_in.data_ptr<T>();
    for (auto& p : private_) {
      p.h.resize(vllm_cpu::qgemv::kMaxChunkedRows * hidden);
      p.x.resize(vllm_cpu::qgemv::kMaxChunkedRows * std::max(hidden, inter));
      for (int64_t i = 0; i < rows * hidden; i += 16)
        store16(p.h.data() + i, load16(hin + i));
    }
    auto weight = [&](int64_t layer, int j) -> const QuantWeight& {
      return weights_[4 * layer + j];
    };
    // This thread's rows of projection j of `layer`, from its quantized rows, into out.
    auto project = [&](int64_t layer, int j, int tid, int nt, const QuantizedRows& qr,
                       float* out_rows) {
      const QuantWeight& w = weight(layer, j);
      int64_t begin, end;
      share(w.n, tid, nt, &begin, &end);
      if (begin < end)
        vllm_cpu::qgemv::gemv_range<float>(rows, w.bits, w.codes.data_ptr<uint8_t>(),
                                           w.d.data_ptr<at::Half>(), w.m.data_ptr<at::Half>(),
                                           qr, out_rows, w.n, begin, end);
    };
    // Every thread keeps its own copy of the residual stream and does the elementwise work
    // and the int8 quantization of each projection's input itself (the same values on
    // every thread), so that the only synchronisation is one barrier after each stage whose
    // output every thread reads: the four projections and attention. Each stage writes its
    // own buffer, so a thread running ahead never overwrites what another still reads.
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      Private& mine = private_[tid];
      float* h = mine.h.data();
      float* x = mine.x.data();
      QuantizedRows& qr = mine.quantized;
      for (int64_t l = 0; l < layers_; ++l) {
        if (l > 0) add_residual<T>(h, y_down, rows * hidden);  // the previous layer's down
        rms_norm<T>(h, norms_[2 * l].data_ptr<float>(), x, rows, hidden, eps_);
        vllm_cpu::qgemv::quantize_rows<float>(x, rows, hidden, weight(l, 0).kp, &qr);
        project(l, 0, tid, nt, qr, y_qkv);
#pragma omp barrier
        {  // each thread its share of the rows; one row: the first thread
          const int64_t first = rows * tid / nt, last = rows * (tid + 1) / nt;
          if (first < last) rotate_and_store<T>(l, first, last, y_qkv, qkv_n, pos, slots, cos,
                                                sin, q, half);
          if (shared_sequences) {
#pragma omp barrier
          }
          if (first < last) attend<T>(l, first, last, table, lens, block_table.size(1), q, attn);
        }
#pragma omp barrier
        vllm_cpu::qgemv::quantize_rows<T>(attn, rows, q_size, weight(l, 1).kp, &qr);
        project(l, 1, tid, nt, qr, y_o);
#pragma omp barrier
        add_residual<T>(h, y_o, rows * hidden);
        rms_norm<T>(h, norms_[2 * l + 1].data_ptr<float>(), x, rows, hidden, eps_);
        vllm_cpu::qgemv::quantize_rows<float>(x, rows, hidden, weight(l, 2).kp, &qr);
        project(l, 2, tid, nt, qr, y_gu);
#pragma omp barrier
        silu_mul<T>(y_gu, x, rows, inter);
        vllm_cpu::qgemv::quantize_rows<float>(x, rows, inter, weight(l, 3).kp, &qr);
        project(l, 3, tid, nt, qr, y_down);
#pragma omp barrier
      }
    }
    float* h = private_[0].h.data();
    float* x = private_[0].x.data();
    add_residual<T>(h, y_down, rows * hidden);
    rms_norm<T>(h, norms_[2 * layers_].data_ptr<float>(), x, rows, hidden, eps_);
    T* o = out.data_ptr<T>();
    for (int64_t i = 0; i < rows * hidden; i += 16) store16(o + i, load16(x + i));
  }

  // Rows [first, last): rotary on q and k (rotate-half form), q into `q`, k and v into the
  // layer's cache at the rows' slots.
  template <typename T>
  void rotate_and_store(int64_t layer, int64_t first, int64_t last, const float* qkv,
                        int64_t qkv_n, const int64_t* pos, const int64_t* slots, const T* cos,
                        const T* sin, T* q, int64_t half) const {
    const int64_t D = head_size_;
    const int64_t q_size = num_heads_ * D, kv_size = num_kv_heads_ * D;
    const torch::Tensor& kv = kv_caches_[layer];
    T* k_cache = kv.data_ptr<T>();
    const int64_t num_slots = kv.size(1) * kv.size(2);
    T* v_cache = k_cache + num_slots * kv_size;
    for (int64_t r = first; r < last; ++r) {
      const float* src = qkv + r * qkv_n;
      const T* c = cos + pos[r] * D;
      const T* s = sin + pos[r] * D;
      // Heads 0..num_heads-1 are q (into q), then the kv heads' k (into the cache).
      for (int64_t head = 0; head < num_heads_ + num_kv_heads_; ++head) {
        const float* in = src + head * D;
        T* dst = head < num_heads_ ? q + r * q_size + head * D
                                   : k_cache + slots[r] * kv_size + (head - num_heads_) * D;
        for (int64_t j = 0; j < half; j += 16) {
          const f32x16 lo = round16<T>(load16(in + j));
          const f32x16 hi = round16<T>(load16(in + half + j));
          // out[j] = lo c[j] - hi s[j];  out[half + j] = hi c[half + j] + lo s[half + j]
          store16(dst + j, vllm_cpu::fnmadd16(hi, load16(s + j), mul16(lo, load16(c + j))));
          store16(dst + half + j, vllm_cpu::fmadd16(lo, load16(s + half + j),
                                                    mul16(hi, load16(c + half + j))));
        }
      }
      const float* v = src + q_size + kv_size;
      T* v_dst = v_cache + slots[r] * kv_size;
      for (int64_t j = 0; j < kv_size; j += 16) store16(v_dst + j, load16(v + j));
    }
  }

  // Rows [first, last): paged decode attention of their queries into `attn`.
  template <typename T>
  void attend(int64_t layer, int64_t first, int64_t last, const int32_t* table,
              const int32_t* lens, int64_t max_blocks, const T* q, T* attn) const {
    const int64_t q_size = num_heads_ * head_size_;
    const torch::Tensor& kv = kv_caches_[layer];
    vllm_cpu::paged_decode<T>(q + first * q_size, kv.data_ptr<T>(), table + first * max_blocks,
                              lens + first, attn + first * q_size, last - first, num_heads_,
                              num_kv_heads_, head_size_, kv.size(1), kv.size(2), max_blocks,
                              scale_, 0, 0.0f);
  }

  // out = rnd(SiLU(gate) * up) for gate_up rows [gate | up] of width 2 * inter.
  template <typename T>
  static void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
    const f32x16 one = vllm_cpu::set16(1.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = gate_up + r * 2 * inter;
      for (int64_t j = 0; j < inter; j += 16) {
        const f32x16 gv = round16<T>(load16(g + j));
        const f32x16 uv = round16<T>(load16(g + inter + j));
        // SiLU(g) = g / (1 + e^-g); exp16 clamps its argument below at -87 (e^87 is finite).
        const f32x16 e = vllm_cpu::exp16(vllm_cpu::sub16(vllm_cpu::zero16(), gv));
        const f32x16 silu = vllm_cpu::div16(gv, add16(one, e));
        store16(out + r * inter + j, round16<T>(mul16(silu, uv)));
      }
    }
  }

  std::vector<torch::Tensor> norms_;  // float32 copies: input, post per layer, final
  std::vector<QuantWeight> weights_;  // qkv, o, gate_up, down per layer
  std::vector<torch::Tensor> kv_caches_;
  torch::Tensor cos_, sin_;
  int64_t layers_ = 0, hidden_ = 0, intermediate_ = 0;
  int64_t num_heads_, num_kv_heads_, head_size_;
  float eps_, scale_;
  at::ScalarType dtype_;
  // Scratch, allocated once: each projection's output (qkv, o, gate_up, down),
  // attention's query and output (T in float-sized slots), and per thread its copy of the
  // residual stream, a normed / activated input and its int8 quantization.
  struct Private {
    std::vector<float> h, x;
    QuantizedRows quantized;
  };
  std::vector<float> y_[4], q_, attn_;
  std::vector<Private> private_;
};

void bind_fused_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<FusedDecoder>(m, "FusedDecoder",
                           "Whole decode steps of a Llama-family decoder on quant_gemv weights")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<int64_t>, std::vector<torch::Tensor>, torch::Tensor,
                    torch::Tensor, int64_t, int64_t, int64_t, double, double>(),
           py::arg("norms"), py::arg("codes"), py::arg("d"), py::arg("m"), py::arg("bits"),
           py::arg("kv_caches"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_size"), py::arg("eps"), py::arg("scale"))
      .def("forward", &FusedDecoder::forward, py::arg("h"), py::arg("positions"),
           py::arg("block_table"), py::arg("seq_lens"), py::arg("slot_mapping"),
           py::arg("shared_sequences") = false)
      .def_property_readonly("num_layers", &FusedDecoder::num_layers);
}
#else
void bind_fused_decoder(pybind11::module&) {}  // no quant_gemv: no fused decoder
#endif
