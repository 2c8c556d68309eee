// Whole decode steps of a decoder whose linear layers are GGUF weights, every layer in one
// call and one OpenMP parallel region:
//
//   for each layer:  x = norm(h) -> int8 rows -> qkv (rows split over the threads)
//   -> (q/k norms per head) -> rotary on q, k -> k, v into the paged cache -> paged decode
//   attention (the layer's window, the soft-cap) -> o_proj -> (post-attention norm) -> h += o
//   -> norm -> gate_up -> act(gate) * up -> down -> (post-feedforward norm) -> h += down
//   then the final norm, and where the model's description gives them, the rows looked up
//   by token id in its GGUF embedding table before the first layer (`set_embedding`) and the
//   LM head's logits after the final norm (`set_head`), in the same parallel region.
//
// The forms it computes, from the model's description (`FusedDecodeSpec`):
//   - Llama family: pre-norm layers (input and post-attention norms), RMSNorm as
//     `weight * rnd(x / rms(x))`, SiLU; Qwen3's q/k norms per head; Mistral's window.
//   - Gemma 2 / 3 ("sandwich" norms): four norms a layer (input, after attention's output,
//     before and after the feed-forward), RMSNorm as `rnd(x / rms(x) * (1 + w))` in float32,
//     tanh GELU; Gemma 3's q/k norms and its local rotary table on window layers, Gemma 2's
//     attention soft-cap.
// Weights (`FusedWeight`): quant_gemv's repacked Q4_0 / Q4_1 / Q8_0 codes (quant_gemv.h),
// GGUF blocks read in place in the file's types, a weight's rows in consecutive parts each
// in its own type (gguf_blocks.h: a Gemma q/k/v of Q5_0 q and k and a Q8_0 v), or
// `quantization="int8"`'s int8 rows with one scale each in int8_mm's tiles (int8_mm.h),
// whose activations are quantized per row as `quantize_per_token` does.
//
// A one-token step of a small model spends most of its time outside weight streaming when
// each of these is its own operator (dispatch, a compiled graph per layer, a fork and join
// of the thread team per kernel); here one parallel region runs the whole step, and every
// buffer is allocated once.
//
// Threads: each keeps its own copy of the residual stream and computes the elementwise
// stages and each projection's int8 input itself, then pieces of the projection's output
// rows as it comes free (a slower core takes fewer), and its share of attention's sequences
// (with fewer sequences than threads, of their heads: whole kv heads where there are as
// many as threads, else query heads, with a barrier between storing the keys and
// attending); one barrier after each of the five stages whose output every thread reads.
//
// Numerics follow the operator-by-operator path: every tensor that path stores in the
// model's dtype (normed rows, q/k/v, the normed and rotated q and k, attention's output,
// each projection, the residual stream, act(gate), act(gate) * up) is rounded to it here at
// the same point; sums and the norm's statistics are float32. The kernels are those of the
// operators: quant_gemv's and gguf_mm's inner loops and paged decode attention
// (paged_attention.h).
//
// Rows: a step's tokens, up to kMaxChunkedRows (32): one token of each decoding request, or
// several tokens of one sequence (a verification step's k + 1, a short prompt chunk). Every
// row attends to its own sequence length through its own block-table row (of its layer's KV
// cache group), as a decode query does; where rows share a sequence, every row's K/V is
// written before any row attends (one more barrier), so a row sees the rows before it, as
// causal attention does.
//
// Layouts: h [rows, hidden] in the model dtype T (float32, bfloat16 or float16);
// the KV caches are the attention backend's [2, num_blocks, block_size, kv_heads,
// head_size]; each rotary table's cos / sin [max_positions, head_size] (full width,
// rotate-half form); norm weights [hidden] (q/k norms [head_size]) in T.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "int8_mm.h"
#include "paged_attention.h"
#include "quant_gemv.h"
#include "vec.h"

#if defined(VLLM_QUANT_GEMV) && defined(VLLM_GGUF_MM)
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

// Rows of `size` values normed: `in` rounded to T first where `round_in` (a projection's
// float output, which the operator path stored in T). `one_plus`: Gemma's
// rnd(x / rms(x) * w) with w = 1 + weight in float32; else RMSNorm's
// rnd(weight * rnd(x / rms(x))). `out` may be `in`.
template <typename T>
void rms_norm(const float* in, bool round_in, const float* weight, float* out, int64_t rows,
              int64_t size, float eps, bool one_plus) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = in + r * size;
    auto value = [&](int64_t j) {
      const f32x16 v = load16(xr + j);
      return round_in ? round16<T>(v) : v;
    };
    f32x16 ss = vllm_cpu::zero16();
    for (int64_t j = 0; j < size; j += 16) {
      const f32x16 v = value(j);
      ss = vllm_cpu::fmadd16(v, v, ss);
    }
    const float inv =
        1.0f / std::sqrt(vllm_cpu::reduce_add16(ss) / static_cast<float>(size) + eps);
    const f32x16 vinv = vllm_cpu::set16(inv);
    for (int64_t j = 0; j < size; j += 16) {
      const f32x16 normed = mul16(value(j), vinv);
      store16(out + r * size + j,
              one_plus ? round16<T>(mul16(normed, load16(weight + j)))
                       : round16<T>(mul16(load16(weight + j), round16<T>(normed))));
    }
  }
}

// h = rnd(h + rnd(y)): a residual add of a value stored in T.
template <typename T>
void add_residual(float* h, const float* y, int64_t count) {
  for (int64_t j = 0; j < count; j += 16) {
    const f32x16 sum = add16(load16(h + j), round16<T>(load16(y + j)));
    store16(h + j, round16<T>(sum));
  }
}

}  // namespace

// Activation rows as `Int8Linear` quantizes them (`quantize_per_token`): per row, scale =
// max(absmax, 1e-8) / 127 and q = round-half-even(x / scale), int8 [rows, k].
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> scale;
};

// a / b as the division it is (-ffast-math would take b's reciprocal; torch divides).
inline __m256 divide8(__m256 a, __m256 b) {
  __m256 r;
  asm("vdivps %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
  return r;
}

template <typename X>
void quantize_int8_rows(const X* x, int64_t rows, int64_t k, Int8Rows* out) {
  out->q.resize(rows * k);
  out->scale.resize(rows);
  alignas(32) float row[8];
  for (int64_t r = 0; r < rows; ++r) {
    const X* xr = x + r * k;
    float absmax = 0.f;
    for (int64_t j = 0; j < k; ++j) absmax = std::max(absmax, std::abs(static_cast<float>(xr[j])));
    _mm256_store_ps(row, divide8(_mm256_set1_ps(std::max(absmax, 1e-8f)), _mm256_set1_ps(127.f)));
    const float scale = row[0];
    out->scale[r] = scale;
    const __m256 vs = _mm256_set1_ps(scale);
    int8_t* q = out->q.data() + r * k;
    for (int64_t j = 0; j < k; j += 8) {
      const int64_t n = std::min<int64_t>(8, k - j);
      for (int64_t i = 0; i < 8; ++i) row[i] = i < n ? static_cast<float>(xr[j + i]) : 0.f;
      const __m256 v = _mm256_round_ps(divide8(_mm256_load_ps(row), vs),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_cvtps_epi32(v));
      for (int64_t i = 0; i < n; ++i) q[j + i] = static_cast<int8_t>(lanes[i]);
    }
  }
}

// One projection's weight, [n, k]: quant_gemv's repacked block codes and float16 scales,
// GGUF blocks as the file stores them, in parts of consecutive rows, or int8 rows in
// int8_mm's tiles with a float32 scale per row.
class FusedWeight {
 public:
  static FusedWeight quant_gemv(torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                                int64_t bits, std::optional<torch::Tensor> bias) {
    FusedWeight w;
    w.codes_ = codes.contiguous();
    w.d_ = d.contiguous();
    w.m_ = m.contiguous();
    w.bits_ = bits;
    TORCH_CHECK(bits == 4 || bits == 8, "FusedWeight: quant_gemv bits must be 4 or 8");
    TORCH_CHECK(w.codes_.scalar_type() == torch::kUInt8 && w.d_.scalar_type() == torch::kHalf &&
                    w.m_.scalar_type() == torch::kHalf && w.d_.dim() == 2,
                "FusedWeight: not quant_gemv's layout");
    w.n_ = w.codes_.size(0);
    w.k_ = w.d_.size(1) * 32;  // padded to whole half quads
    TORCH_CHECK(w.codes_.size(1) == w.k_ * bits / 8, "FusedWeight: not quant_gemv's layout");
    w.set_bias(bias);
    return w;
  }

  static FusedWeight gguf(std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                          std::optional<torch::Tensor> bias) {
    TORCH_CHECK(!parts.empty() && parts.size() == types.size(),
                "FusedWeight: one GGUF type per part");
    FusedWeight w;
    w.bits_ = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto l = vllm_gguf::layout(types[i]);
      TORCH_CHECK(parts[i].dim() == 2 && parts[i].scalar_type() == torch::kUInt8 &&
                      parts[i].size(1) % l.bytes == 0,
                  "FusedWeight: part ", i, " is not uint8 [rows, whole blocks]");
      const int64_t k = parts[i].size(1) / l.bytes * l.values;
      TORCH_CHECK(i == 0 || k == w.k_, "FusedWeight: the parts differ in inputs");
      w.k_ = k;
      w.offsets_.push_back(w.n_);
      w.n_ += parts[i].size(0);
      w.parts_.push_back(parts[i].contiguous());
      w.types_.push_back(types[i]);
    }
    w.set_bias(bias);
    return w;
  }

  // int8 rows (int8_mm's `pack_int8_weight` tiles) with float32 scales [n], k inputs.
  static FusedWeight int8(torch::Tensor packed, torch::Tensor scale, int64_t k,
                          std::optional<torch::Tensor> bias) {
    FusedWeight w;
    w.bits_ = kInt8Rows;
    w.n_ = scale.numel();
    w.k_ = k;
    TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.dim() == 2 &&
                    packed.size(0) == vllm_cpu::int8mm::tiles_of(w.n_) &&
                    packed.size(1) == vllm_cpu::int8mm::steps_of(k) * vllm_cpu::int8mm::kTileStepBytes,
                "FusedWeight: not int8_mm's tiles of ", w.n_, " rows of ", k, " inputs");
    TORCH_CHECK(scale.scalar_type() == torch::kFloat32, "FusedWeight: int8 scales are float32");
    w.codes_ = packed.contiguous();
    w.d_ = scale.contiguous();
    w.set_bias(bias);
    return w;
  }

  bool is_gguf() const { return bits_ == 0; }
  bool is_int8() const { return bits_ == kInt8Rows; }
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }

  // Whether it multiplies `in` inputs: GGUF blocks and int8 rows exactly; quant_gemv's rows
  // padded to whole half quads.
  bool takes(int64_t in) const {
    return is_gguf() || is_int8() ? k_ == in : k_ >= in && k_ - in < vllm_cpu::qgemv::kHalf;
  }

  // This thread's output rows [begin, end) of `rows` activation rows, quantized as this
  // weight's kernel reads them (`qr` or `acts`), into out [rows, n]; with a bias,
  // rnd(rnd(y) + bias) as the layer adds it to its output in T.
  template <typename T>
  void rows_range(int64_t rows, const QuantizedRows& qr, const vllm_gguf::Activations& acts,
                  const Int8Rows& q8, float* out, int64_t begin, int64_t end) const {
    if (is_int8()) {
      int8_range(rows, q8, out, begin, end);
    } else if (!is_gguf()) {
      vllm_cpu::qgemv::gemv_range<float>(rows, bits_, codes_.data_ptr<uint8_t>(),
                                         d_.data_ptr<at::Half>(), m_.data_ptr<at::Half>(), qr,
                                         out, n_, begin, end);
    } else {
      for (size_t i = 0; i < parts_.size(); ++i) {
        const int64_t first = offsets_[i], last = first + parts_[i].size(0);
        const int64_t b = std::max(begin, first), e = std::min(end, last);
        if (b < e)
          vllm_gguf::dispatch(types_[i], parts_[i].data_ptr<uint8_t>(), parts_[i].size(1),
                              acts, 0, rows, out + first, n_, b - first, e - first);
      }
    }
    if (!bias_.defined()) return;
    const float* bias = bias_.data_ptr<float>();
    auto rnd = [](float v) { return static_cast<float>(static_cast<T>(v)); };
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = begin; j < end; ++j) out[r * n_ + j] = rnd(rnd(out[r * n_ + j]) + bias[j]);
  }

  // The activation rows x [rows, in] quantized as this weight's kernel reads them.
  template <typename X>
  void quantize(const X* x, int64_t rows, int64_t in, QuantizedRows* qr,
                vllm_gguf::Activations* acts, Int8Rows* q8) const {
    if (is_int8()) quantize_int8_rows<X>(x, rows, in, q8);
    else if (is_gguf()) vllm_gguf::quantize_activations<X>(x, rows, in, acts);
    else vllm_cpu::qgemv::quantize_rows<X>(x, rows, in, k_, qr);
  }

 private:
  static constexpr int64_t kInt8Rows = -1;  // bits_ of int8 rows

  // Output rows [begin, end) (begin a multiple of int8_mm's 16-row tiles) of int8 rows:
  // float(acc) * (x_scale * w_scale) as `dequantize_output` computes it, the scales' product
  // first (kept whole against -ffast-math's reassociation); the stages that read it round
  // it to T, as that function's result is.
  void int8_range(int64_t rows, const Int8Rows& q8, float* out, int64_t begin,
                  int64_t end) const {
    using namespace vllm_cpu::int8mm;
    const int8_t* packed = codes_.data_ptr<int8_t>();
    const float* w_scale = d_.data_ptr<float>();
    alignas(32) int32_t acc[vllm_cpu::qgemv::kMaxChunkedRows * kCols];
    for (int64_t t = begin / kCols; t * kCols < end; ++t) {
      const int64_t col0 = t * kCols, cols = std::min(kCols, n_ - col0);
      tile_times(q8.q.data(), k_, 0, rows, packed, t, n_, acc, kCols);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          float factor = q8.scale[r] * w_scale[col0 + c];
          asm("" : "+x"(factor));
          out[r * n_ + col0 + c] = static_cast<float>(acc[r * kCols + c]) * factor;
        }
    }
  }

  void set_bias(const std::optional<torch::Tensor>& bias) {
    if (!bias.has_value()) return;
    TORCH_CHECK(bias->numel() == n_, "FusedWeight: a bias of ", bias->numel(), " values for ",
                n_, " rows");
    bias_ = bias->to(torch::kFloat32).contiguous();  // T's values
  }

  torch::Tensor bias_;           // float32 [n], or undefined: none
  torch::Tensor codes_, d_, m_;  // quant_gemv's
  int64_t bits_ = 0;             // quant_gemv's 4 or 8; 0: GGUF blocks; kInt8Rows
  // (int8 rows: codes_ the packed tiles, d_ the float32 scales)
  std::vector<torch::Tensor> parts_;  // GGUF's: each part's blocks, type and first row
  std::vector<int64_t> types_, offsets_;
  int64_t n_ = 0, k_ = 0;
};

// A layer's feed-forward block: a gated MLP (gate_up [2 I, H], down [H, I]), or a mixture
// of experts as `moe_experts` computes it (moe.cpp): a dense router [E, H] (logits in T,
// softmax in float32, the top k, renormalised where asked, weights rounded to T), each
// chosen expert's SiLU(gate) * up and down in float32 from GGUF blocks gate / up [E, I, row
// bytes] and down [E, H, row bytes], the token's rows summed by their weights in slot order
// and rounded to T once. (The SiLU's exp is the dense MLP's polynomial, vllm_cpu::exp16,
// where moe.cpp calls std::exp: the last bits of an activation may differ.)
class FusedMLP {
 public:
  static FusedMLP dense(FusedWeight gate_up, FusedWeight down) {
    FusedMLP m;
    m.gate_up_ = std::move(gate_up);
    m.down_ = std::move(down);
    m.inter_ = m.gate_up_.n() / 2;
    return m;
  }

  static FusedMLP experts(torch::Tensor router, torch::Tensor w1, torch::Tensor w3,
                          torch::Tensor w2, std::vector<int64_t> types, int64_t top_k,
                          bool renormalize) {
    FusedMLP m;
    m.experts_ = true;
    TORCH_CHECK(router.dim() == 2 && w1.dim() == 3 && w3.dim() == 3 && w2.dim() == 3 &&
                    w3.size(0) == w1.size(0) && w3.size(1) == w1.size(1) &&
                    w1.scalar_type() == torch::kUInt8 && w3.scalar_type() == torch::kUInt8 &&
                    w2.scalar_type() == torch::kUInt8 && types.size() == 3,
                "FusedMLP: experts need a router [E, H] and GGUF blocks gate / up [E, I, bytes], "
                "down [E, H, bytes] with their three types");
    m.num_experts_ = router.size(0);
    m.router_dtype_ = router.scalar_type();
    m.router_ = router.to(torch::kFloat32).contiguous();
    m.w_[0] = w1.contiguous();
    m.w_[1] = w3.contiguous();
    m.w_[2] = w2.contiguous();
    m.inter_ = w1.size(1);
    const int64_t hidden = router.size(1);
    const int64_t ins[3] = {hidden, hidden, m.inter_};
    for (int j = 0; j < 3; ++j) {
      const auto l = vllm_gguf::layout(types[j]);
      TORCH_CHECK(m.w_[j].size(0) == m.num_experts_ && ins[j] % l.values == 0 &&
                      m.w_[j].size(2) == ins[j] / l.values * l.bytes,
                  "FusedMLP: expert weight ", j, " does not hold [", m.num_experts_,
                  ", rows, ", ins[j], "] values of type ", types[j]);
      m.types_[j] = types[j];
    }
    TORCH_CHECK(w2.size(1) == hidden, "FusedMLP: down has ", w2.size(1), " rows, expected ",
                hidden);
    TORCH_CHECK(top_k >= 1 && top_k <= m.num_experts_, "FusedMLP: top_k ", top_k);
    m.top_k_ = top_k;
    m.renormalize_ = renormalize;
    return m;
  }

  // The experts' block with a shared expert behind a sigmoid gate (Qwen2-MoE):
  // out = experts + rnd(rnd(sigmoid(rnd(gate . x))) * shared(x)), in T as the block adds it.
  FusedMLP with_shared(FusedWeight gate_up, FusedWeight down, torch::Tensor gate) const {
    TORCH_CHECK(experts_, "FusedMLP: a shared expert belongs to an experts block");
    TORCH_CHECK(gate.numel() == router_.size(1) && gate.scalar_type() == router_dtype_,
                "FusedMLP: the shared expert's gate must be [1, hidden] in the model dtype");
    FusedMLP m = *this;
    m.gate_up_ = std::move(gate_up);
    m.down_ = std::move(down);
    m.shared_gate_ = gate.reshape({-1}).to(torch::kFloat32).contiguous();
    return m;
  }

  bool is_experts() const { return experts_; }
  bool has_shared() const { return shared_gate_.defined(); }
  int64_t shared_intermediate() const { return has_shared() ? gate_up_.n() / 2 : 0; }
  int64_t intermediate() const { return inter_; }

  FusedWeight gate_up_, down_;  // the gated MLP's, or the shared expert's
  torch::Tensor shared_gate_;   // float32 [H] (T's values): the shared expert's gate
  bool experts_ = false;
  // the experts'
  torch::Tensor router_, w_[3];  // router float32 [E, H] (T's values); gate, up, down
  at::ScalarType router_dtype_ = at::kFloat;
  int64_t types_[3] = {0, 0, 0};
  int64_t num_experts_ = 0, inter_ = 0, top_k_ = 0;
  bool renormalize_ = false;
};

class FusedDecoder {
 public:
  // Per layer: `norms_per_layer` norms (2: input and post-attention; 4: input, attention
  // output, pre- and post-feedforward) in `norms`, then the final one; two attention weights
  // (qkv, o) and its feed-forward block (`mlps`); its KV cache, KV cache group (the block table it reads) and rotary
  // table (an index into cos / sin); its window (0: none); two q/k norms per layer in
  // `qk_norms`, or none. `activation`: "silu" or "gelu_tanh".
  FusedDecoder(std::vector<torch::Tensor> norms, int64_t norms_per_layer, bool one_plus_norms,
               std::vector<FusedWeight> weights, std::vector<FusedMLP> mlps,
               std::vector<torch::Tensor> kv_caches,
               std::vector<int64_t> kv_groups, std::vector<torch::Tensor> qk_norms,
               std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin,
               std::vector<int64_t> rope_index, std::vector<int64_t> windows,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double eps,
               double scale, double soft_cap, std::string activation)
      : weights_(std::move(weights)), mlps_(std::move(mlps)), kv_caches_(std::move(kv_caches)),
        kv_groups_(std::move(kv_groups)), cos_(std::move(cos)), sin_(std::move(sin)),
        rope_index_(std::move(rope_index)), windows_(std::move(windows)),
        norms_per_layer_(norms_per_layer), one_plus_(one_plus_norms), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_size_(head_size), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)), soft_cap_(static_cast<float>(soft_cap)) {
    layers_ = static_cast<int64_t>(kv_caches_.size());
    TORCH_CHECK(layers_ > 0, "FusedDecoder: no layers");
    TORCH_CHECK(norms_per_layer == 2 || norms_per_layer == 4,
                "FusedDecoder: 2 or 4 norms per layer");
    TORCH_CHECK(static_cast<int64_t>(norms.size()) == norms_per_layer * layers_ + 1,
                "FusedDecoder: ", norms_per_layer, " norms per layer and the final one expected");
    TORCH_CHECK(static_cast<int64_t>(weights_.size()) == 2 * layers_ &&
                    static_cast<int64_t>(mlps_.size()) == layers_,
                "FusedDecoder: 2 attention weights (qkv, o) and a feed-forward block per layer "
                "expected");
    TORCH_CHECK(static_cast<int64_t>(kv_groups_.size()) == layers_ &&
                    static_cast<int64_t>(rope_index_.size()) == layers_ &&
                    static_cast<int64_t>(windows_.size()) == layers_,
                "FusedDecoder: a KV cache group, rotary table and window per layer expected");
    TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers_,
                "FusedDecoder: q/k norms: two per layer or none");
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh",
                "FusedDecoder: activation must be silu or gelu_tanh, got ", activation);
    gelu_ = activation == "gelu_tanh";
    TORCH_CHECK(!cos_.empty() && cos_.size() == sin_.size(), "FusedDecoder: rotary tables");
    dtype_ = cos_[0].scalar_type();
    hidden_ = norms[0].numel();
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                "FusedDecoder: bad head counts");
    TORCH_CHECK(head_size % 32 == 0 && hidden_ % 32 == 0, "FusedDecoder: head size ",
                head_size, " or hidden size ", hidden_, " is not a multiple of 32");
    max_positions_ = cos_[0].size(0);
    for (size_t t = 0; t < cos_.size(); ++t) {
      TORCH_CHECK(cos_[t].dim() == 2 && cos_[t].size(1) == head_size &&
                      sin_[t].sizes() == cos_[t].sizes() && cos_[t].is_contiguous() &&
                      sin_[t].is_contiguous() && cos_[t].scalar_type() == dtype_ &&
                      sin_[t].scalar_type() == dtype_,
                  "FusedDecoder: cos / sin must be contiguous [positions, head_size] in the "
                  "model dtype");
      max_positions_ = std::min(max_positions_, cos_[t].size(0));
    }
    auto float_norm = [&](const torch::Tensor& w, int64_t size) {
      TORCH_CHECK(w.numel() == size && (one_plus_ || w.scalar_type() == dtype_),
                  "FusedDecoder: norm weights must be [", size, "] in the model dtype");
      // Gemma's weights as the (1 + w) the norm multiplies by, in float32.
      return one_plus_ ? (w.to(torch::kFloat32) + 1.0f).contiguous()
                       : w.to(torch::kFloat32).contiguous();
    };
    for (const auto& w : norms) norms_.push_back(float_norm(w, hidden_));
    for (const auto& w : qk_norms) qk_norms_.push_back(float_norm(w, head_size));
    const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
    num_groups_ = 0;
    int64_t expert_rows = 0, expert_inter = 0;  // the experts' scratch: rows x slots, width
    for (int64_t l = 0; l < layers_; ++l) {
      const FusedMLP& mlp = mlps_[l];
      const int64_t inter = mlp.intermediate();
      TORCH_CHECK(inter % 32 == 0, "FusedDecoder: layer ", l, "'s intermediate size ", inter,
                  " is not a multiple of 32");
      intermediate_ = std::max(intermediate_, inter);
      std::vector<const FusedWeight*> ws = {&weights_[2 * l], &weights_[2 * l + 1]};
      std::vector<int64_t> in = {hidden_, q_size}, out = {q_size + 2 * kv_size, hidden_};
      if (mlp.is_experts()) {
        TORCH_CHECK(mlp.router_.size(1) == hidden_ && mlp.router_dtype_ == dtype_,
                    "FusedDecoder: layer ", l, "'s router is not [experts, ", hidden_,
                    "] in the model dtype");
        expert_rows = std::max(expert_rows, mlp.top_k_ * vllm_cpu::qgemv::kMaxChunkedRows);
        router_logits_.resize(std::max<size_t>(
            router_logits_.size(), mlp.num_experts_ * vllm_cpu::qgemv::kMaxChunkedRows));
        expert_inter = std::max(expert_inter, inter);
        if (mlp.has_shared()) {
          const int64_t shared = mlp.shared_intermediate();
          TORCH_CHECK(shared % 32 == 0, "FusedDecoder: layer ", l, "'s shared expert width");
          intermediate_ = std::max(intermediate_, shared);
          ws.push_back(&mlp.gate_up_);
          ws.push_back(&mlp.down_);
          in.insert(in.end(), {hidden_, shared});
          out.insert(out.end(), {2 * shared, hidden_});
        }
      } else {
        ws.push_back(&mlp.gate_up_);
        ws.push_back(&mlp.down_);
        in.insert(in.end(), {hidden_, inter});
        out.insert(out.end(), {2 * inter, hidden_});
      }
      for (size_t j = 0; j < ws.size(); ++j) {
        TORCH_CHECK(ws[j]->n() == out[j] && ws[j]->takes(in[j]), "FusedDecoder: layer ", l,
                    " weight ", j, " has shape [", ws[j]->n(), ", ", ws[j]->k(), "], expected [",
                    out[j], ", ", in[j], "]");
      }
      const auto& kv = kv_caches_[l];
      TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.size(3) == num_kv_heads &&
                      kv.size(4) == head_size && kv.is_contiguous() &&
                      kv.scalar_type() == dtype_ && kv.sizes() == kv_caches_[0].sizes(),
                  "FusedDecoder: KV cache ", l, " is not [2, blocks, block_size, ", num_kv_heads,
                  ", ", head_size, "] in the model dtype");
      TORCH_CHECK(kv_groups_[l] >= 0 && rope_index_[l] >= 0 &&
                      rope_index_[l] < static_cast<int64_t>(cos_.size()) && windows_[l] >= 0,
                  "FusedDecoder: layer ", l, "'s KV cache group, rotary table or window");
      num_groups_ = std::max(num_groups_, kv_groups_[l] + 1);
    }
    const int64_t rows = vllm_cpu::qgemv::kMaxChunkedRows;
    const int64_t widths[4] = {q_size + 2 * kv_size, hidden_, 2 * intermediate_, hidden_};
    for (int j = 0; j < 4; ++j) y_[j].resize(rows * widths[j]);
    for (int j = 0; j < 3; ++j) expert_y_[j].resize(expert_rows * expert_inter);
    expert_y_[3].resize(expert_rows * hidden_);
    counters_.reset(new std::atomic<int64_t>[layers_ * kStages + 1]);  // + the LM head's
    // Attention's query and output in T (at most 4 bytes an element).
    q_.resize(rows * q_size);
    attn_.resize(rows * q_size);
  }

  int64_t num_layers() const { return layers_; }
  int64_t num_kv_cache_groups() const { return num_groups_; }
  bool has_embedding() const { return table_.defined(); }
  bool has_head() const { return head_.has_value(); }

  // Token ids given to `forward` are looked up here: GGUF blocks uint8 [vocab, row bytes] of
  // `type` (gguf_dequantize's values), rounded to T, then times `scale` in T where it is
  // not 0 (Gemma's embedding normalizer), as the model's embedding computes them.
  void set_embedding(torch::Tensor blocks, int64_t type, double scale) {
    const vllm_gguf::Layout l = vllm_gguf::layout(type);
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 &&
                    blocks.is_contiguous() && hidden_ % l.values == 0 &&
                    blocks.size(1) == hidden_ / l.values * l.bytes,
                "FusedDecoder: the embedding table is not uint8 [vocab, ", hidden_ / l.values * l.bytes,
                "] blocks of type ", type);
    table_ = blocks;
    table_type_ = type;
    table_scale_ = static_cast<float>(scale);
  }

  // The LM head: `forward(..., with_logits=true)` also returns the logits of the final-
  // normed rows, [rows, vocab] in T, as the head's linear layer computes them (its first
  // `vocab` output rows: the rest are padding).
  void set_head(FusedWeight head, int64_t vocab) {
    TORCH_CHECK(head.takes(hidden_) && vocab >= 1 && vocab <= head.n(),
                "FusedDecoder: an LM head of shape [", head.n(), ", ", head.k(),
                "] for hidden size ", hidden_, " and ", vocab, " logits");
    head_ = std::move(head);
    vocab_ = vocab;
  }

  // One step: h [rows, hidden] (the embeddings); row r is a token at positions[r], written
  // at cache slot slot_mappings[g][r] of each KV cache group g, attending to seq_lens[r]
  // keys through block_tables[g][r]. `shared_sequences`: some rows belong to one sequence
  // (every K/V is written before any row attends). `h` may instead be the rows' token ids
  // (int64 [rows]) where an embedding table is set. Returns the final-normed hidden states,
  // and with `with_logits` (an LM head set) their logits after them.
  std::vector<torch::Tensor> forward(torch::Tensor h, torch::Tensor positions,
                                     std::vector<torch::Tensor> block_tables,
                                     torch::Tensor seq_lens,
                                     std::vector<torch::Tensor> slot_mappings,
                                     bool shared_sequences, bool with_logits) {
    TORCH_CHECK(!with_logits || head_.has_value(), "FusedDecoder: logits asked, no LM head set");
    if (h.scalar_type() == torch::kInt64) h = embed(h);
    TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden_ && h.scalar_type() == dtype_,
                "FusedDecoder: h must be [rows, ", hidden_, "] in the model dtype");
    const int64_t rows = h.size(0);
    TORCH_CHECK(rows >= 1 && rows <= vllm_cpu::qgemv::kMaxChunkedRows, "FusedDecoder: 1 to ",
                vllm_cpu::qgemv::kMaxChunkedRows, " rows, got ", rows);
    TORCH_CHECK(static_cast<int64_t>(block_tables.size()) == num_groups_ &&
                    static_cast<int64_t>(slot_mappings.size()) == num_groups_,
                "FusedDecoder: one block table and slot mapping per KV cache group (",
                num_groups_, ")");
    TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == rows &&
                    seq_lens.scalar_type() == torch::kInt32 && seq_lens.numel() == rows,
                "FusedDecoder: positions (int64) and seq_lens (int32), one per row");
    h = h.contiguous();
    positions = positions.contiguous();
    seq_lens = seq_lens.contiguous();
    const int64_t num_slots = kv_caches_[0].size(1) * kv_caches_[0].size(2);
    const int64_t block_size = kv_caches_[0].size(2);
    for (int64_t g = 0; g < num_groups_; ++g) {
      auto& table = block_tables[g];
      auto& slots = slot_mappings[g];
      TORCH_CHECK(table.scalar_type() == torch::kInt32 && table.dim() == 2 &&
                      table.size(0) == rows && table.size(1) == block_tables[0].size(1) &&
                      slots.scalar_type() == torch::kInt64 && slots.numel() >= rows,
                  "FusedDecoder: block tables [rows, blocks] (int32, one width) and slot "
                  "mappings (int64, one per row)");
      table = table.contiguous();
      slots = slots.contiguous();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = slots.data_ptr<int64_t>()[r];
        TORCH_CHECK(s >= 0 && s < num_slots, "FusedDecoder: slot ", s, " out of range");
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = positions.data_ptr<int64_t>()[r];
      const int64_t len = seq_lens.data_ptr<int32_t>()[r];
      TORCH_CHECK(p >= 0 && p < max_positions_, "FusedDecoder: position ", p, " out of range");
      TORCH_CHECK(len >= 1 && len <= block_tables[0].size(1) * block_size,
                  "FusedDecoder: sequence length ", len, " does not fit the block table");
    }
    Step step{positions.data_ptr<int64_t>(), seq_lens.data_ptr<int32_t>(), {}, {},
              block_tables[0].size(1), shared_sequences};
    for (int64_t g = 0; g < num_groups_; ++g) {
      step.tables.push_back(block_tables[g].data_ptr<int32_t>());
      step.slots.push_back(slot_mappings[g].data_ptr<int64_t>());
    }
    auto out = torch::empty_like(h);
    torch::Tensor logits;
    float* logits_out = nullptr;
    if (with_logits) {
      logits = torch::empty({rows, head_->n()}, h.options().dtype(torch::kFloat32));
      logits_out = logits.data_ptr<float>();
    }
    switch (dtype_) {
      case torch::kFloat32: run<float>(h, step, out, logits_out); break;
      case torch::kBFloat16: run<at::BFloat16>(h, step, out, logits_out); break;
      case torch::kFloat16: run<at::Half>(h, step, out, logits_out); break;
      default: TORCH_CHECK(false, "FusedDecoder: unsupported dtype ", dtype_);
    }
    if (!with_logits) return {out};
    // As the head's layer returns them: its float32 products in T, the padding rows cut.
    return {out, logits.to(dtype_).narrow(1, 0, vocab_)};
  }

 private:
  // Per thread: its copy of the residual stream, a normed / activated input and its int8
  // quantization (in the layout of each kernel); for experts, the routing, the (row, slot)
  // pairs' order by expert, their inputs and the block's output.
  struct Private {
    std::vector<float> h, x;
    QuantizedRows quantized;
    vllm_gguf::Activations activations;
    Int8Rows int8;
    std::vector<float> probs, weights, gathered, moe;
    std::vector<int64_t> ids, start, next, order, position, active;
  };

  // Token ids [rows] -> their rows of the embedding table in T (see set_embedding).
  torch::Tensor embed(torch::Tensor ids) const {
    TORCH_CHECK(table_.defined(), "FusedDecoder: token ids given, no embedding table set");
    TORCH_CHECK(ids.dim() == 1, "FusedDecoder: token ids must be int64 [rows]");
    ids = ids.contiguous();
    const int64_t rows = ids.size(0), vocab = table_.size(0);
    auto dense = torch::empty({rows, hidden_}, ids.options().dtype(torch::kFloat32));
    float* d = dense.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t id = ids.data_ptr<int64_t>()[r];
      TORCH_CHECK(id >= 0 && id < vocab, "FusedDecoder: token id ", id, " out of range [0, ",
                  vocab, ")");
      vllm_gguf::dequantize_rows(table_type_, table_.data_ptr<uint8_t>(), table_.size(1),
                                 hidden_, id, id + 1, d + r * hidden_);
    }
    auto h = dense.to(dtype_);
    if (table_scale_ != 0.f) h.mul_(static_cast<double>(table_scale_));
    return h;
  }

  // A step's rows: positions, lengths, and per KV cache group the block table rows and
  // slots.
  struct Step {
    const int64_t* pos;
    const int32_t* lens;
    std::vector<const int32_t*> tables;
    std::vector<const int64_t*> slots;
    int64_t max_blocks;
    bool shared;
  };

  // A stage's work is shared out dynamically: `count` pieces, each taken by the next thread
  // that asks (`next`: the stage's counter, zero at the step's start), so that a thread
  // slowed down (by its core's other work, or its share of memory) takes fewer. Which
  // thread computes a piece changes no value.
  template <typename F>
  static void take_pieces(std::atomic<int64_t>& next, int64_t count, F&& piece) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
         i = next.fetch_add(1, std::memory_order_relaxed))
      piece(i);
  }

  // Weight w's output rows for the inputs `in` [rows, k], which every thread quantizes
  // itself (the same values), into out [rows, n]. Pieces of whole 16-row tiles: first one
  // a thread of three quarters of its share, then the rest in pieces of a sixteenth. Long
  // runs stream best: the kernels prefetch 4 KB ahead within a run, so each run's first
  // rows come cold (pieces of an eighth throughout had the default model's decode slower).
  template <typename T, typename X>
  void project_share(const FusedWeight& w, const X* in, int64_t rows, int64_t k, float* out,
                     int nt, Private& mine, std::atomic<int64_t>& next) const {
    w.quantize(in, rows, k, &mine.quantized, &mine.activations, &mine.int8);
    const int64_t n = w.n();
    const int64_t big = 3 * n / (4 * nt) / 16 * 16;
    const int64_t small = std::max<int64_t>(16, (n / (16 * nt) + 15) / 16 * 16);
    const int64_t first_small = nt * big;
    take_pieces(next, nt + (n - first_small + small - 1) / small, [&](int64_t i) {
      const int64_t begin = i < nt ? i * big : first_small + (i - nt) * small;
      const int64_t end = i < nt ? begin + big : std::min(n, begin + small);
      if (begin < end)
        w.rows_range<T>(rows, mine.quantized, mine.activations, mine.int8, out, begin, end);
    });
  }

  // A step's counters for take_pieces: kStages a layer (qkv, o, the feed-forward's two
  // products, a shared expert's two), zeroed before each step.
  static constexpr int64_t kStages = 6;
  std::atomic<int64_t>& counter(int64_t layer, int64_t stage) const {
    return counters_[layer * kStages + stage];
  }

  // x [n] . w [n] in float32 (n a multiple of 16).
  static float dot(const float* x, const float* w, int64_t n) {
    f32x16 acc = vllm_cpu::zero16();
    for (int64_t j = 0; j < n; j += 16) acc = vllm_cpu::fmadd16(load16(x + j), load16(w + j), acc);
    return vllm_cpu::reduce_add16(acc);
  }

  const float* norm(int64_t layer, int i) const {
    return norms_[norms_per_layer_ * layer + i].data_ptr<float>();
  }

  template <typename T>
  void run(const torch::Tensor& h_in, const Step& step, torch::Tensor& out, float* logits) {
    const int64_t rows = h_in.size(0), hidden = hidden_;
    const int64_t q_size = num_heads_ * head_size_;
    T* q = reinterpret_cast<T*>(q_.data());
    T* attn = reinterpret_cast<T*>(attn_.data());
    float* y_qkv = y_[0].data();
    float* y_o = y_[1].data();
    float* y_gu = y_[2].data();
    float* y_down = y_[3].data();
    const int threads = at::get_num_threads();
    if (static_cast<int>(private_.size()) < threads) private_.resize(threads);
    for (int64_t i = 0; i < layers_ * kStages + 1; ++i)
      counters_[i].store(0, std::memory_order_relaxed);
    const T* hin = h_in.data_ptr<T>();
    for (auto& p : private_) {
      p.h.resize(vllm_cpu::qgemv::kMaxChunkedRows * hidden);
      p.x.resize(vllm_cpu::qgemv::kMaxChunkedRows * std::max(hidden, intermediate_));
      for (int64_t i = 0; i < rows * hidden; i += 16)
        store16(p.h.data() + i, load16(hin + i));
    }
    const bool sandwich = norms_per_layer_ == 4;
    // h += (the post-norm of) a projection's output y, which every thread reads whole.
    auto add = [&](float* h, float* x, const float* y, int64_t layer, int post_norm) {
      if (sandwich) {
        rms_norm<T>(y, true, norm(layer, post_norm), x, rows, hidden, eps_, one_plus_);
        add_residual<T>(h, x, rows * hidden);
      } else {
        add_residual<T>(h, y, rows * hidden);
      }
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
      auto project = [&](const FusedWeight& w, const auto* in, int64_t k, float* out_rows,
                         std::atomic<int64_t>& next) {
        project_share<T>(w, in, rows, k, out_rows, nt, mine, next);
      };
      const float* down = y_down;  // the feed-forward block's output: shared, or this thread's
      for (int64_t l = 0; l < layers_; ++l) {
        if (l > 0) add(h, x, down, l - 1, 3);  // the previous layer's feed-forward
        rms_norm<T>(h, false, norm(l, 0), x, rows, hidden, eps_, one_plus_);
        project(weights_[2 * l], x, hidden, y_qkv, counter(l, 0));
#pragma omp barrier
        if (rows >= nt) {  // each thread its share of the rows, every head
          const int64_t first = rows * tid / nt, last = rows * (tid + 1) / nt;
          const Heads all{0, num_heads_, 0, num_kv_heads_};
          if (first < last) rotate_and_store<T>(l, first, last, all, y_qkv, step, q, x);
          if (step.shared) {
#pragma omp barrier
          }
          if (first < last) attend<T>(l, first, last, all, step, q, attn);
        } else {  // every row, each thread its share of the heads
          const Heads mine_heads = head_share(tid, nt);
          if (mine_heads.q_begin < mine_heads.q_end || mine_heads.kv_begin < mine_heads.kv_end)
            rotate_and_store<T>(l, 0, rows, mine_heads, y_qkv, step, q, x);
          if (step.shared || !whole_kv_heads(nt)) {  // keys another thread stored
#pragma omp barrier
          }
          if (mine_heads.q_begin < mine_heads.q_end)
            attend<T>(l, 0, rows, mine_heads, step, q, attn);
        }
#pragma omp barrier
        project(weights_[2 * l + 1], attn, q_size, y_o, counter(l, 1));
#pragma omp barrier
        add(h, x, y_o, l, 1);
        rms_norm<T>(h, false, norm(l, sandwich ? 2 : 1), x, rows, hidden, eps_, one_plus_);
        const FusedMLP& mlp = mlps_[l];
        if (mlp.is_experts()) {
          experts<T>(mlp, l, rows, x, tid, nt, mine);
          down = mine.moe.data();
        } else {
          project(mlp.gate_up_, x, hidden, y_gu, counter(l, 2));
#pragma omp barrier
          act_mul<T>(y_gu, x, rows, mlp.intermediate());
          project(mlp.down_, x, mlp.intermediate(), y_down, counter(l, 3));
#pragma omp barrier
          down = y_down;
        }
      }
      // Every thread the last feed-forward's residual and the final norm (its own copy, the
      // same values), thread 0 the output; then each its pieces of the LM head, if asked.
      add(h, x, down, layers_ - 1, 3);
      rms_norm<T>(h, false, norms_.back().data_ptr<float>(), x, rows, hidden, eps_, one_plus_);
      if (tid == 0) {
        T* o = out.data_ptr<T>();
        for (int64_t i = 0; i < rows * hidden; i += 16) store16(o + i, load16(x + i));
      }
      if (logits != nullptr) project(*head_, x, hidden, logits, counters_[layers_ * kStages]);
    }
  }

  // Query heads [q_begin, q_end) and the kv heads [kv_begin, kv_end) a thread rotates and
  // stores; it attends its query heads.
  struct Heads {
    int64_t q_begin, q_end, kv_begin, kv_end;
  };

  // With fewer rows than threads, thread tid's share of the heads: whole kv heads (their
  // query heads with them) where there are at least as many kv heads as threads, else
  // query heads, each kv head stored by the thread holding its first query head.
  Heads head_share(int tid, int nt) const {
    const int64_t group = num_heads_ / num_kv_heads_;
    const int64_t unit = whole_kv_heads(nt) ? group : 1;
    const int64_t units = num_heads_ / unit;
    const int64_t q_begin = units * tid / nt * unit, q_end = units * (tid + 1) / nt * unit;
    return {q_begin, q_end, (q_begin + group - 1) / group, (q_end + group - 1) / group};
  }

  // Whether head_share splits by whole kv heads (each thread attends only keys it stored).
  bool whole_kv_heads(int nt) const { return num_kv_heads_ >= nt; }

  // Rows [first, last): q and k (normed per head where the model has q/k norms) rotated
  // (rotate-half form) by the layer's table, q into `q`, k and v into the layer's cache at
  // the rows' slots of its group; of the heads `heads`. `scratch`: this thread's, at least
  // a head.
  template <typename T>
  void rotate_and_store(int64_t layer, int64_t first, int64_t last, const Heads& heads,
                        const float* qkv, const Step& step, T* q, float* scratch) const {
    const int64_t D = head_size_, half = D / 2;
    const int64_t q_size = num_heads_ * D, kv_size = num_kv_heads_ * D;
    const int64_t qkv_n = q_size + 2 * kv_size;
    const torch::Tensor& kv = kv_caches_[layer];
    T* k_cache = kv.data_ptr<T>();
    const int64_t num_slots = kv.size(1) * kv.size(2);
    T* v_cache = k_cache + num_slots * kv_size;
    const T* cos = cos_[rope_index_[layer]].data_ptr<T>();
    const T* sin = sin_[rope_index_[layer]].data_ptr<T>();
    const int64_t* slots = step.slots[kv_groups_[layer]];
    const bool qk_norm = !qk_norms_.empty();
    for (int64_t r = first; r < last; ++r) {
      const float* src = qkv + r * qkv_n;
      const T* c = cos + step.pos[r] * D;
      const T* s = sin + step.pos[r] * D;
      // Heads 0..num_heads-1 are q (into q), then the kv heads' k (into the cache).
      for (int64_t head = 0; head < num_heads_ + num_kv_heads_; ++head) {
        const bool is_mine = head < num_heads_
                                 ? heads.q_begin <= head && head < heads.q_end
                                 : heads.kv_begin <= head - num_heads_ &&
                                       head - num_heads_ < heads.kv_end;
        if (!is_mine) continue;
        const float* in = src + head * D;
        if (qk_norm) {  // the head normed, as the operator path stores it in T
          const bool is_q = head < num_heads_;
          rms_norm<T>(in, true, qk_norms_[2 * layer + (is_q ? 0 : 1)].data_ptr<float>(),
                      scratch, 1, D, eps_, one_plus_);
          in = scratch;
        }
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
      for (int64_t j = heads.kv_begin * D; j < heads.kv_end * D; j += 16)
        store16(v_dst + j, load16(v + j));
    }
  }

  // Rows [first, last): paged decode attention of their queries (the query heads of
  // `heads`) into `attn`, through the block tables of the layer's group, with its window
  // and the soft-cap.
  template <typename T>
  void attend(int64_t layer, int64_t first, int64_t last, const Heads& heads, const Step& step,
              const T* q, T* attn) const {
    const int64_t q_size = num_heads_ * head_size_;
    const torch::Tensor& kv = kv_caches_[layer];
    const int32_t* table = step.tables[kv_groups_[layer]];
    vllm_cpu::paged_decode<T>(q + first * q_size, kv.data_ptr<T>(),
                              table + first * step.max_blocks, step.lens + first,
                              attn + first * q_size, last - first, num_heads_, num_kv_heads_,
                              head_size_, kv.size(1), kv.size(2), step.max_blocks, scale_,
                              windows_[layer], soft_cap_, heads.q_begin, heads.q_end);
  }

  // A mixture-of-experts block on rows x [rows, hidden] (normed, T's values) into this
  // thread's `moe` [rows, hidden], as `moe_experts` computes it (see FusedMLP). The threads
  // share out the router's logits (a barrier), then every thread routes every row and
  // quantizes every expert row itself; the products are tasks
  // (an expert's rows times a tile of its weight rows) taken by the threads as they come
  // free (take_pieces), with a barrier after the gate / up products and one after the down
  // products.
  template <typename T>
  void experts(const FusedMLP& m, int64_t layer, int64_t rows, const float* x, int tid,
               int nt, Private& mine) {
    const int64_t H = hidden_, E = m.num_experts_, k = m.top_k_, I = m.inter_;
    const int64_t n = rows * k;  // (row, slot) pairs
    mine.weights.resize(n);
    mine.ids.resize(n);
    mine.probs.resize(E);
    // The router's logits in T, each thread its share of the experts (the router is read
    // once a step, not once a thread), then every thread routes every row from all of them.
    const float* router = m.router_.data_ptr<float>();
    float* logits = router_logits_.data();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = E * tid / nt; e < E * (tid + 1) / nt; ++e)
        logits[r * E + e] = static_cast<float>(static_cast<T>(dot(x + r * H, router + e * H, H)));
#pragma omp barrier
    for (int64_t r = 0; r < rows; ++r) {
      float* p = mine.probs.data();
      float top = -INFINITY;
      for (int64_t e = 0; e < E; ++e) {
        p[e] = logits[r * E + e];
        top = std::max(top, p[e]);
      }
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - top));
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      float chosen = 0.f;
      for (int64_t j = 0; j < k; ++j) {  // the top k, largest first (ties: the lower id)
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
        mine.ids[r * k + j] = best;
        mine.weights[r * k + j] = p[best];
        chosen += p[best];
        p[best] = -1.f;
      }
      for (int64_t j = 0; j < k; ++j) {
        float& w = mine.weights[r * k + j];
        w = static_cast<float>(static_cast<T>(m.renormalize_ ? w / chosen : w));
      }
    }
    // The (row, slot) pairs by expert, stable (a counting sort), and their inputs.
    std::vector<int64_t>& start = mine.start;
    start.assign(E + 1, 0);
    mine.order.resize(n);
    mine.position.resize(n);
    for (int64_t i = 0; i < n; ++i) ++start[mine.ids[i] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    mine.next.assign(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = mine.next[mine.ids[i]]++;
      mine.order[p] = i;
      mine.position[i] = p;
    }
    mine.gathered.resize(n * std::max(H, I));
    float* xs = mine.gathered.data();
    for (int64_t p = 0; p < n; ++p)
      std::memcpy(xs + p * H, x + (mine.order[p] / k) * H, H * sizeof(float));
    vllm_gguf::quantize_activations<float>(xs, n, H, &mine.activations);
    // Tasks: each active expert's weight rows in tiles, about eight tasks a thread.
    std::vector<int64_t>& active = mine.active;
    active.clear();
    for (int64_t e = 0; e < E; ++e)
      if (start[e + 1] > start[e]) active.push_back(e);
    const int64_t num_active = static_cast<int64_t>(active.size());
    auto for_my_tasks = [&](int64_t width, std::atomic<int64_t>& next, auto&& task) {
      const int64_t want = std::max<int64_t>(1, 8 * nt / std::max<int64_t>(1, num_active));
      const int64_t tile = std::max<int64_t>(16, (width / want + 15) / 16 * 16);
      const int64_t tiles = (width + tile - 1) / tile;
      take_pieces(next, num_active * tiles, [&](int64_t i) {
        const int64_t e = active[i / tiles], b = i % tiles * tile;
        task(e, start[e], start[e + 1] - start[e], b, std::min(width, b + tile));
      });
    };
    float *gate = expert_y_[0].data(), *up = expert_y_[1].data(), *act = expert_y_[2].data();
    float* y = expert_y_[3].data();
    auto expert_rows = [&](int j, int64_t e) {
      const torch::Tensor& w = m.w_[j];
      return w.data_ptr<uint8_t>() + e * w.stride(0);
    };
    for_my_tasks(I, counter(layer, 2), [&](int64_t e, int64_t first, int64_t count, int64_t b,
                                          int64_t end) {
      vllm_gguf::dispatch(m.types_[0], expert_rows(0, e), m.w_[0].size(2), mine.activations,
                          first, count, gate, I, b, end);
      vllm_gguf::dispatch(m.types_[1], expert_rows(1, e), m.w_[1].size(2), mine.activations,
                          first, count, up, I, b, end);
      const f32x16 one = vllm_cpu::set16(1.0f);
      for (int64_t r = first; r < first + count; ++r)
        for (int64_t c = b; c < end; c += 16) {  // SiLU(gate) * up, the dense MLP's exp
          const f32x16 g = load16(gate + r * I + c);
          const f32x16 silu = vllm_cpu::div16(
              g, add16(one, vllm_cpu::exp16(vllm_cpu::sub16(vllm_cpu::zero16(), g))));
          store16(act + r * I + c, mul16(silu, load16(up + r * I + c)));
        }
    });
#pragma omp barrier
    vllm_gguf::quantize_activations<float>(act, n, I, &mine.activations);
    for_my_tasks(H, counter(layer, 3), [&](int64_t e, int64_t first, int64_t count, int64_t b,
                                          int64_t end) {
      vllm_gguf::dispatch(m.types_[2], expert_rows(2, e), m.w_[2].size(2), mine.activations,
                          first, count, y, H, b, end);
    });
#pragma omp barrier
    mine.moe.assign(rows * H, 0.f);
    for (int64_t r = 0; r < rows; ++r) {  // each row's slots in order, rounded to T once
      float* o = mine.moe.data() + r * H;
      for (int64_t j = 0; j < k; ++j) {
        const float w = mine.weights[r * k + j];
        const float* row = y + mine.position[r * k + j] * H;
        for (int64_t c = 0; c < H; ++c) o[c] += w * row[c];
      }
      for (int64_t c = 0; c < H; c += 16) store16(o + c, round16<T>(load16(o + c)));
    }
    if (m.has_shared()) shared_expert<T>(m, layer, rows, x, nt, mine);
  }

  // The shared expert of an experts block added to this thread's `moe` (see
  // FusedMLP::with_shared): its gate's sigmoid per row (every thread), its gated MLP's
  // projections split over the threads as a dense layer's, with a barrier after each.
  template <typename T>
  void shared_expert(const FusedMLP& m, int64_t layer, int64_t rows, const float* x, int nt,
                     Private& mine) {
    const int64_t H = hidden_, I = m.shared_intermediate();
    auto rnd = [](float v) { return static_cast<float>(static_cast<T>(v)); };
    mine.probs.resize(rows);
    const float* gate = m.shared_gate_.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      mine.probs[r] = rnd(1.f / (1.f + std::exp(-rnd(dot(x + r * H, gate, H)))));
    float* gate_up = y_[2].data();
    float* down = y_[3].data();
    project_share<T>(m.gate_up_, x, rows, H, gate_up, nt, mine, counter(layer, 4));
#pragma omp barrier
    mine.gathered.resize(std::max<int64_t>(mine.gathered.size(), rows * I));
    act_mul<T>(gate_up, mine.gathered.data(), rows, I);
    project_share<T>(m.down_, mine.gathered.data(), rows, I, down, nt, mine, counter(layer, 5));
#pragma omp barrier
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < H; ++c) {
        float& o = mine.moe[r * H + c];
        o = rnd(o + rnd(mine.probs[r] * rnd(down[r * H + c])));
      }
  }

  // out = rnd(rnd(act(gate)) * up) for gate_up rows [gate | up] of width 2 * inter, each
  // stored in T first: act SiLU, g / (1 + e^-g), or tanh GELU,
  // g / 2 (1 + tanh(y)) = g / (1 + e^-2y) with y = sqrt(2 / pi) (g + 0.044715 g^3).
  // exp16 clamps its argument below at -87 (e^87 is finite).
  template <typename T>
  void act_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) const {
    const f32x16 one = vllm_cpu::set16(1.0f);
    const f32x16 minus_2c = vllm_cpu::set16(-2.0f * 0.7978845608028654f);
    const f32x16 cubic = vllm_cpu::set16(0.044715f);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = gate_up + r * 2 * inter;
      for (int64_t j = 0; j < inter; j += 16) {
        const f32x16 gv = round16<T>(load16(g + j));
        const f32x16 uv = round16<T>(load16(g + inter + j));
        f32x16 arg;
        if (gelu_) {
          const f32x16 inner = vllm_cpu::fmadd16(mul16(cubic, gv), mul16(gv, gv), gv);
          arg = mul16(minus_2c, inner);
        } else {
          arg = vllm_cpu::sub16(vllm_cpu::zero16(), gv);
        }
        const f32x16 act = round16<T>(vllm_cpu::div16(gv, add16(one, vllm_cpu::exp16(arg))));
        store16(out + r * inter + j, round16<T>(mul16(act, uv)));
      }
    }
  }

  std::vector<torch::Tensor> norms_;     // float32: per layer's, then the final one
  std::vector<torch::Tensor> qk_norms_;  // float32: q and k per layer, or none
  std::vector<FusedWeight> weights_;     // qkv, o per layer
  std::vector<FusedMLP> mlps_;
  std::vector<torch::Tensor> kv_caches_;
  std::vector<int64_t> kv_groups_;
  std::vector<torch::Tensor> cos_, sin_;
  std::vector<int64_t> rope_index_, windows_;
  int64_t layers_ = 0, hidden_ = 0, intermediate_ = 0, max_positions_ = 0, num_groups_ = 0;
  int64_t norms_per_layer_;
  bool one_plus_, gelu_ = false;
  int64_t num_heads_, num_kv_heads_, head_size_;
  float eps_, scale_, soft_cap_;
  at::ScalarType dtype_;
  // Scratch, allocated once: each projection's output (qkv, o, gate_up, down),
  // attention's query and output (T in float-sized slots) and the experts' (`Private`:
  // each thread's).
  std::vector<float> y_[4], q_, attn_;
  std::vector<float> expert_y_[4];  // the experts' gate, up, act [pairs, I] and down [pairs, H]
  std::vector<float> router_logits_;  // [rows, experts]: each thread its share of the experts
  torch::Tensor table_;            // the embedding's GGUF blocks (set_embedding), or none
  int64_t table_type_ = 0;
  float table_scale_ = 0.f;        // 0: none
  std::optional<FusedWeight> head_;  // the LM head (set_head), or none
  int64_t vocab_ = 0;
  std::vector<Private> private_;
  // take_pieces' per stage: layers_ * kStages, then the LM head's
  std::unique_ptr<std::atomic<int64_t>[]> counters_;
};

void bind_fused_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<FusedWeight>(m, "FusedWeight",
                          "One weight of the fused decoder: quant_gemv codes or GGUF blocks")
      .def_static("quant_gemv", &FusedWeight::quant_gemv, py::arg("codes"), py::arg("d"),
                  py::arg("m"), py::arg("bits"), py::arg("bias") = py::none())
      .def_static("gguf", &FusedWeight::gguf, py::arg("parts"), py::arg("types"),
                  py::arg("bias") = py::none())
      .def_static("int8", &FusedWeight::int8, py::arg("packed"), py::arg("scale"), py::arg("k"),
                  py::arg("bias") = py::none())
      .def_property_readonly("shape", [](const FusedWeight& w) {
        return py::make_tuple(w.n(), w.k());
      });
  py::class_<FusedMLP>(m, "FusedMLP", "A layer's feed-forward block in the fused decoder")
      .def_static("dense", &FusedMLP::dense, py::arg("gate_up"), py::arg("down"))
      .def_static("experts", &FusedMLP::experts, py::arg("router"), py::arg("w1"),
                  py::arg("w3"), py::arg("w2"), py::arg("types"), py::arg("top_k"),
                  py::arg("renormalize"))
      .def("with_shared", &FusedMLP::with_shared, py::arg("gate_up"), py::arg("down"),
           py::arg("gate"));
  py::class_<FusedDecoder>(m, "FusedDecoder",
                           "Whole decode steps of a decoder on GGUF weights")
      .def(py::init<std::vector<torch::Tensor>, int64_t, bool, std::vector<FusedWeight>,
                    std::vector<FusedMLP>, std::vector<torch::Tensor>, std::vector<int64_t>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                    int64_t, int64_t, int64_t, double, double, double, std::string>(),
           py::arg("norms"), py::arg("norms_per_layer"), py::arg("one_plus_norms"),
           py::arg("weights"), py::arg("mlps"), py::arg("kv_caches"), py::arg("kv_groups"),
           py::arg("qk_norms"), py::arg("cos"), py::arg("sin"), py::arg("rope_index"),
           py::arg("windows"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_size"), py::arg("eps"), py::arg("scale"), py::arg("soft_cap"),
           py::arg("activation"))
      .def("forward", &FusedDecoder::forward, py::arg("h"), py::arg("positions"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("slot_mappings"),
           py::arg("shared_sequences") = false, py::arg("with_logits") = false)
      .def("set_embedding", &FusedDecoder::set_embedding, py::arg("blocks"), py::arg("type"),
           py::arg("scale") = 0.0)
      .def("set_head", &FusedDecoder::set_head, py::arg("head"), py::arg("vocab"))
      .def_property_readonly("has_embedding", &FusedDecoder::has_embedding)
      .def_property_readonly("has_head", &FusedDecoder::has_head)
      .def_property_readonly("num_layers", &FusedDecoder::num_layers)
      .def_property_readonly("num_kv_cache_groups", &FusedDecoder::num_kv_cache_groups);
}
#else
void bind_fused_decoder(pybind11::module&) {}  // no quant_gemv or gguf_mm: no fused decoder
#endif
