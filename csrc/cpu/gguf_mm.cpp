// GGUF weights multiplied in the block types the file stores (`gguf_mm`), in the file's
// bytes: read in place, except Q5_0, whose rows `gguf_repack` rearranges at load into
// super-blocks of 8 blocks (the same bytes and values), so a layer's resident bytes are
// the file's bytes.
//
// Every type is read as groups of 32 weights with unsigned codes u (or, for the types whose
// values are not evenly spaced, signed int8 values) and integer scales per 16 weights:
//
//   w = d * s16 * u - min16            (d: the block's or super-block's float scale)
//
// Q4_0 is d (u - 8): s16 = 1, min16 = 8 d; Q4_1 is d u + m: min16 = -m; the K-quants keep
// per-sub-block scales s (and mins) under one super-block d: Q4_K is d s u - dmin m, Q6_K is
// d s (u - 32): min16 = 32 d s. Q8_0, IQ4_NL and IQ4_XS are signed values (IQ4's from the
// 16-entry table, looked up with one byte shuffle) with no min.
//
// The activations are quantized per row and group of 32 to int8 (dx = absmax / 127, ties to
// even), with sx16 = dx * (sum of each 16 codes), so that a group's product is integer work:
//
//   sum_j w_j x_j ~= d dx sum_j s16 u_j qx_j - sum_16 min16 sx16
//
// which is w . dequant(qx) exactly (the min term uses the quantized sums). Per group:
// vpmaddubsw (u times qx, pairs in int16: at most 2 * 63 * 127), vpmaddwd by the int16
// scales (two per group), one int32 -> float conversion and one FMA by d dx. Signed values
// take vpmaddubsw's usual form |w| * (qx with w's sign).
//
// Forms: AVX2 (FMA, F16C); with AVX-512 BW the super-block types (8 groups a block) take
// their groups in pairs in 512-bit registers (`gguf_mm_form()` names the build's form).
// Without AVX2 the op is not built and `gguf_mm_available()` says so (the layer then keeps
// dense weights).
// Rows: a weight row's super-blocks are unpacked once per pass over up to 8 activation rows
// (register accumulators); more rows go in passes over tiles of 16 weight rows, which the
// later passes reread from L1. From `gguf_mm_dense_rows(type)` rows (48-128 by type) a
// step instead dequantizes the weight a tile at a time to float32 (gguf_dequantize's
// values, gguf-py's bit for bit) and multiplies by MKL's sgemm, x unquantized: there the
// FMAs outrun the integer form's unpacking.
//
// Reference dequantization: dequantize_block below, gguf-py's arithmetic, is the portable
// form of gguf_dequantize; with AVX2 the same values come from the unpacked blocks
// (gguf_blocks.h's dequantize_rows).
#include "gguf_blocks.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using namespace vllm_gguf;

// ---- reference dequantization (every weight of a block, as gguf-py computes it) -------

// No contraction into FMAs, so the float32 results are gguf-py's bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off", "no-fast-math")

[[maybe_unused]] void dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: {
      const bool has_m = type == kQ4_1 || type == kQ5_1, five = type == kQ5_0 || type == kQ5_1;
      const float d = half_at(b), m = has_m ? half_at(b + 2) : 0.f;
      uint32_t qh = 0;
      if (five) std::memcpy(&qh, b + (has_m ? 4 : 2), 4);
      const uint8_t* qs = b + (has_m ? 4 : 2) + (five ? 4 : 0);
      for (int j = 0; j < 32; ++j) {
        int q = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
        if (five) q |= ((qh >> j) & 1) << 4;
        if (has_m) y[j] = d * static_cast<float>(q) + m;
        else y[j] = d * static_cast<float>(q - (five ? 16 : 8));
      }
      return;
    }
    case kQ8_0: {
      const float d = half_at(b);
      for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
      return;
    }
    case kIQ4_NL: {
      const float d = half_at(b);
      for (int j = 0; j < 32; ++j) {
        const int q = j < 16 ? b[2 + j] & 0xF : b[2 + j - 16] >> 4;
        y[j] = d * static_cast<float>(kIQ4Values[q]);
      }
      return;
    }
    case kQ2_K: {  // scales[16], qs[64], d, dmin
      const uint8_t *sc = b, *qs = b + 16;
      const float d = half_at(b + 80), dmin = half_at(b + 82);
      for (int i = 0; i < 256; ++i) {
        const int g = i / 32, l = i % 32, s = sc[2 * g + l / 16];
        const int q = (qs[32 * (g / 4) + l] >> (2 * (g % 4))) & 3;
        const float dl = d * static_cast<float>(s & 0xF), ml = dmin * static_cast<float>(s >> 4);
        y[i] = dl * static_cast<float>(q) - ml;
      }
      return;
    }
    case kQ3_K: {  // hmask[32], qs[64], scales[12], d
      const uint8_t *hm = b, *qs = b + 32;
      int sc[16];
      k3_scales(b + 96, sc);
      const float d = half_at(b + 108);
      for (int i = 0; i < 256; ++i) {
        const int g = i / 32, l = i % 32;
        const int q = ((qs[32 * (g / 4) + l] >> (2 * (g % 4))) & 3) - (((hm[l] >> g) & 1) ? 0 : 4);
        y[i] = (d * static_cast<float>(sc[2 * g + l / 16])) * static_cast<float>(q);
      }
      return;
    }
    case kQ4_K: case kQ5_K: {  // d, dmin, scales[12], (qh[32]), qs[128]
      const float d = half_at(b), dmin = half_at(b + 2);
      int sc[8], mn[8];
      k4_scales(b + 4, sc, mn);
      const bool five = type == kQ5_K;
      const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
      for (int i = 0; i < 256; ++i) {
        const int g = i / 32, l = i % 32;
        int q = (qs[32 * (g / 2) + l] >> (4 * (g % 2))) & 0xF;
        if (five) q |= ((qh[l] >> g) & 1) << 4;
        const float dl = d * static_cast<float>(sc[g]), ml = dmin * static_cast<float>(mn[g]);
        y[i] = dl * static_cast<float>(q) - ml;
      }
      return;
    }
    case kQ6_K: {  // ql[128], qh[64], scales[16] (int8), d
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int i = 0; i < 256; ++i) {
        const int h = i / 128, g = (i / 32) % 4, l = i % 32;
        const int low = (ql[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0xF;
        const int high = (qh[32 * h + l] >> (2 * g)) & 3;
        y[i] = (d * static_cast<float>(sc[i / 16])) * static_cast<float>((low | (high << 4)) - 32);
      }
      return;
    }
    case kIQ4_XS: {  // d, scales_h (u16), scales_l[4], qs[128]
      const float d = half_at(b);
      uint16_t sh;
      std::memcpy(&sh, b + 2, 2);
      const uint8_t *sl = b + 4, *qs = b + 8;
      for (int g = 0; g < 8; ++g) {
        const int ls = ((sl[g / 2] >> (4 * (g % 2))) & 0xF) | (((sh >> (2 * g)) & 3) << 4);
        const float dl = d * static_cast<float>(ls - 32);
        for (int j = 0; j < 32; ++j) {
          const int q = j < 16 ? qs[16 * g + j] & 0xF : qs[16 * g + j - 16] >> 4;
          y[32 * g + j] = dl * static_cast<float>(kIQ4Values[q]);
        }
      }
      return;
    }
    default: TORCH_CHECK(false, "gguf_dequantize: unsupported GGUF block type ", type);
  }
}

#pragma GCC pop_options


}  // namespace


#if defined(VLLM_GGUF_MM)
namespace {

// Steps of at least this many rows multiply by the weight dequantized to float32 (a tile of
// rows at a time) with MKL's sgemm instead of the integer products: past it the sgemm's
// FMAs outrun vpmaddubsw's unpacking (`benchmark_gguf_kernels.py --dense` on the AVX2 Zen 3,
// Gemma 3's shapes: the blocks of 32 from ~32-48 rows, Q5_0 rearranged into super-blocks from
// ~48, the other super-blocks, whose integer form unpacks a block once for 8 rows, from
// ~96; Q8_0, whose integer form has nothing to unpack, from ~128, its vocabulary-sized
// weights level with the dense form from 64). VLLM_CPU_GGUF_DENSE_ROWS sets one value for
// every type at start-up (0: never), set_gguf_mm_dense_rows later (-1: these defaults).
constexpr int64_t kDenseRows32 = 48, kDenseRowsQ8_0 = 128, kDenseRowsQ5_0R8 = 48,
                  kDenseRowsSuper = 96;

std::atomic<int64_t>& dense_rows_setting() {
  static std::atomic<int64_t> rows{[] {
    const char* env = std::getenv("VLLM_CPU_GGUF_DENSE_ROWS");
    return env != nullptr && *env != '\0' ? std::atoll(env) : int64_t{-1};
  }()};
  return rows;
}

// Steps of at least this many rows share each tile between the threads (multithreaded
// sgemm); below it each thread takes whole tiles of its own. With many rows a thread's
// one-thread sgemm repacks a large x for every small tile, and sharing measured faster
// (`benchmark_gguf_kernels.py --dense`: at 1,024 rows 1.2-1.6x; at 64-256 rows the tiles
// of its own were 1.1-2.3x faster, most for the smaller weights).
constexpr int64_t kSharedTileRows = 512;

// This thread's buffer of at least `floats` float32 values, kept between calls (a fresh
// one would fault in its pages every call). Not a torch tensor: it carries no inference
// mode of whichever call made it.
float* kept_buffer(int64_t floats) {
  static thread_local std::vector<float> kept;
  if (kept.size() < static_cast<size_t>(floats)) kept.resize(floats);
  return kept.data();
}

// out [M, N] float32 = x [M, K] float32 times w's rows, dequantized to float32 a tile at a
// time into kept buffers.
void dense_mm(const torch::Tensor& x, const torch::Tensor& w, int64_t type, torch::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), row_bytes = w.size(1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (m >= kSharedTileRows) {
    // ~1 MB tiles, dequantized by both threads, then one multithreaded sgemm each.
    const int64_t tile = std::min(n, std::max<int64_t>(16, (int64_t{1} << 18) / k / 16 * 16));
    float* bp = kept_buffer(tile * k);
    for (int64_t n0 = 0; n0 < n; n0 += tile) {
      const int64_t rows = std::min(tile, n - n0);
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        dequantize_rows(type, wp, row_bytes, k, n0 + begin, n0 + end, bp + begin * k);
      });
      auto slice = out.narrow(1, n0, rows);
      at::mm_out(slice, x, torch::from_blob(bp, {rows, k}, x.options()).t());
    }
    return;
  }
  // Each thread dequantizes whole tiles (up to ~256 KB, its own L2) into its kept buffer
  // and multiplies each by one-thread sgemm: no barrier between the two. The tiles
  // come in a multiple of the threads, so that every thread gets as many.
  const int64_t threads = at::get_num_threads();
  const int64_t most = std::max<int64_t>(16, (int64_t{1} << 16) / k / 16 * 16);
  const int64_t count = (n + most - 1) / most;
  const int64_t tiles = (count + threads - 1) / threads * threads;
  const int64_t tile = (n + tiles - 1) / tiles;
  // The workers do not inherit the caller's inference mode; `out` may be an inference
  // tensor, which only inference mode may write through torch.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    c10::InferenceMode mode(inference);
    float* bp = kept_buffer(tile * k);
    for (int64_t t = first; t < last; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, n - n0);
      if (rows <= 0) break;
      dequantize_rows(type, wp, row_bytes, k, n0, n0 + rows, bp);
      auto slice = out.narrow(1, n0, rows);
      at::mm_out(slice, x, torch::from_blob(bp, {rows, k}, x.options()).t());
    }
  });
}

}  // namespace

// The step size from which gguf_mm multiplies weights of `type` by their dequantized
// float32 values (0: never).
int64_t gguf_mm_dense_rows(int64_t type) {
  const int64_t setting = dense_rows_setting().load(std::memory_order_relaxed);
  if (setting >= 0) return setting;
  if (type == kQ8_0) return kDenseRowsQ8_0;
  if (type == kQ5_0R8) return kDenseRowsQ5_0R8;
  return layout(type).values == 32 ? kDenseRows32 : kDenseRowsSuper;
}

void set_gguf_mm_dense_rows(int64_t rows) {
  TORCH_CHECK(rows >= -1, "set_gguf_mm_dense_rows: rows must be >= -1, got ", rows);
  dense_rows_setting().store(rows, std::memory_order_relaxed);
}
#else
int64_t gguf_mm_dense_rows(int64_t) { return 0; }
void set_gguf_mm_dense_rows(int64_t) {}
#endif

// The instruction-set form this build of gguf_mm runs: "avx512" (AVX2 for the 32-value
// types, 512-bit pairs for the super-block ones), "avx2", or "" (not built).
std::string gguf_mm_form() {
#if defined(VLLM_GGUF_MM_512)
  return "avx512";
#elif defined(VLLM_GGUF_MM)
  return "avx2";
#else
  return "";
#endif
}

bool gguf_mm_available() {
#if defined(VLLM_GGUF_MM)
  return true;
#else
  return false;
#endif
}

// Rows of a GGUF tensor (`blocks` uint8 [R, row bytes]) as float32 [R, K].
torch::Tensor gguf_dequantize(torch::Tensor blocks, int64_t type) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8,
              "gguf_dequantize: blocks must be uint8 [rows, bytes per row]");
  const Layout l = layout(type);
  TORCH_CHECK(blocks.size(1) % l.bytes == 0, "gguf_dequantize: ", blocks.size(1),
              " bytes per row is not a whole number of blocks of ", l.bytes);
  blocks = blocks.contiguous();
  const int64_t rows = blocks.size(0), per_row = blocks.size(1) / l.bytes;
  auto out = torch::empty({rows, per_row * l.values}, torch::kFloat32);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
#if defined(VLLM_GGUF_MM)
  const int64_t k = per_row * l.values;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / k), [&](int64_t begin, int64_t end) {
    dequantize_rows(type, src, blocks.size(1), k, begin, end, dst + begin * k);
  });
#else
  at::parallel_for(0, rows * per_row, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_block(type, src + i * l.bytes, dst + i * l.values);
  });
#endif
  return out;
}


// Rows of Q5_0 blocks (`src` uint8 [rows, K / 32 * 22]) as Block<kQ5_0R8>'s super-blocks
// (the row's last K % 256 values copied as they are).
static void repack_q5_0_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t k) {
  const int64_t row_bytes = k / 32 * 22, supers = k / 256;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* in = src + r * row_bytes;
      uint8_t* out = dst + r * row_bytes;
      for (int64_t s = 0; s < supers; ++s) {
        uint8_t* o = out + s * 176;
        std::memset(o, 0, 176);
        for (int g = 0; g < 8; ++g) {
          const uint8_t* blk = in + (8 * s + g) * 22;  // d, qh (4 bytes), qs (16 bytes)
          std::memcpy(o + 2 * g, blk, 2);
          uint32_t qh;
          std::memcpy(&qh, blk + 2, 4);
          for (int j = 0; j < 32; ++j) {
            const uint8_t low = j < 16 ? blk[6 + j] & 0x0F : blk[6 + j - 16] >> 4;
            o[16 + j] |= static_cast<uint8_t>(((qh >> j) & 1) << g);
            o[48 + 32 * (g / 2) + j] |= static_cast<uint8_t>(low << (4 * (g % 2)));
          }
        }
      }
      std::memcpy(out + supers * 176, in + supers * 8 * 22, row_bytes - supers * 176);
    }
  });
}

// A weight's rows in the form gguf_mm reads fastest, and that form's type: Q5_0 rows of at
// least 256 values as kQ5_0R8 (the same bytes); any other weight as it is.
std::tuple<torch::Tensor, int64_t> gguf_repack(torch::Tensor blocks, int64_t type) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8,
              "gguf_repack: blocks must be uint8 [rows, bytes per row]");
#if defined(VLLM_GGUF_MM)
  const int64_t k = blocks.size(1) / 22 * 32;
  if (type == kQ5_0 && blocks.size(1) % 22 == 0 && k >= 256) {
    blocks = blocks.contiguous();
    auto out = torch::empty_like(blocks);
    repack_q5_0_rows(blocks.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), blocks.size(0), k);
    return {out, kQ5_0R8};
  }
#endif
  return {blocks, type};
}

// x [M, K] times the GGUF weight `w` (uint8 [N, row bytes], rows in the file's block type
// `type`): out [M, N] in x's dtype.
torch::Tensor gguf_mm(torch::Tensor x, torch::Tensor w, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "gguf_mm: x and w must be 2-D");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8, "gguf_mm: w must be uint8 blocks");
  const Layout l = layout(type);
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % l.values == 0 && w.size(1) == k / l.values * l.bytes, "gguf_mm: x has ", k,
              " columns; w's rows hold ", w.size(1), " bytes (blocks of ", l.values, " values in ",
              l.bytes, " bytes)");
  auto out = torch::empty({rows, n}, x.options().dtype(torch::kFloat32));
  if (rows == 0 || n == 0) return out.to(x.scalar_type());
#if defined(VLLM_GGUF_MM)
  x = x.contiguous();
  w = w.contiguous();
  const int64_t dense_rows = gguf_mm_dense_rows(type);
  if (dense_rows > 0 && rows >= dense_rows) {
    dense_mm(x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32), w, type, out);
    return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
  }
  static thread_local Activations quantized;  // kept between calls: no allocation per call
  Activations& a = quantized;  // (the workers below must see this thread's, not their own)
  switch (x.scalar_type()) {
    case torch::kFloat32: quantize_activations(x.data_ptr<float>(), rows, k, &a); break;
    case torch::kBFloat16: quantize_activations(x.data_ptr<at::BFloat16>(), rows, k, &a); break;
    case torch::kFloat16: quantize_activations(x.data_ptr<at::Half>(), rows, k, &a); break;
    default: TORCH_CHECK(false, "gguf_mm: unsupported dtype ", x.scalar_type());
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  // Output rows in chunks, each thread walking its weights in order; fewer rows a chunk
  // when the step has many activation rows (each chunk then costs more).
  const int64_t grain = rows <= kMaxRows ? 64 : kTile;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    dispatch(type, wp, row_bytes, a, 0, rows, op, n, begin, end);
  });
#else
  TORCH_CHECK(false, "gguf_mm needs AVX2 with FMA and F16C (built without them)");
#endif
  return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
}
