// A step's grammar bitmask applied to its logits in place, read in its packed form: bit
// t % 32 of word t // 32 set = token t allowed; every cleared bit's logit becomes -inf.
// Unpacking the words to one bool per token first (np.unpackbits, then masked_fill) writes
// and reads a [rows, vocab] byte array besides the logits; here each word is one or two
// masked vector stores of -inf (AVX-512), and a word of all ones is skipped.
//
// Rows: mask row i masks logits row rows[i] (any order, a subset of the logits' rows).
// The last word may be partial: with a 40-token vocabulary, word 1 holds tokens 32..39 in
// its bits 0..7 and its bits 8..31 are ignored.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Writes -inf where `forbidden` (a 32-bit set: bit b = token 32w + b) has a bit set;
// `row` points at token 32w.
template <typename T>
inline void forbid_word(T* row, uint32_t forbidden, T neg_inf) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) {
    const __m512 v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    _mm512_mask_storeu_ps(reinterpret_cast<float*>(row), static_cast<__mmask16>(forbidden), v);
    _mm512_mask_storeu_ps(reinterpret_cast<float*>(row) + 16,
                          static_cast<__mmask16>(forbidden >> 16), v);
    return;
  }
#if defined(__AVX512BW__)
  if constexpr (sizeof(T) == 2) {
    uint16_t bits;
    std::memcpy(&bits, &neg_inf, 2);
    _mm512_mask_storeu_epi16(row, static_cast<__mmask32>(forbidden), _mm512_set1_epi16(bits));
    return;
  }
#endif
#endif
  for (; forbidden; forbidden &= forbidden - 1) row[__builtin_ctz(forbidden)] = neg_inf;
}

template <typename T>
void apply_impl(torch::Tensor& logits, const torch::Tensor& bitmask, const int64_t* rows) {
  const int64_t num_rows = bitmask.size(0), words = bitmask.size(1);
  const int64_t vocab = logits.size(1), stride = logits.stride(0);
  const int64_t full_words = vocab / 32, tail = vocab % 32;  // tail: tokens in a last word
  const int32_t* masks = bitmask.data_ptr<int32_t>();
  T* data = logits.data_ptr<T>();
  const T neg_inf = static_cast<T>(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = data + rows[i] * stride;
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(masks + i * words);
      for (int64_t w = 0; w < full_words; ++w) {
        if (mask[w] != 0xffffffffu) forbid_word(row + 32 * w, ~mask[w], neg_inf);
      }
      if (tail) {
        const uint32_t forbidden = ~mask[full_words] & ((1u << tail) - 1);
        T* last = row + 32 * full_words;
        for (uint32_t f = forbidden; f; f &= f - 1) last[__builtin_ctz(f)] = neg_inf;
      }
    }
  });
}

}  // namespace

void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 &&
                  bitmask.is_contiguous(),
              "bitmask must be a contiguous [rows, words] int32 tensor");
  TORCH_CHECK(bitmask.size(1) == (logits.size(1) + 31) / 32, "bitmask has ", bitmask.size(1),
              " words per row; logits of width ", logits.size(1), " need ",
              (logits.size(1) + 31) / 32);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous() &&
                  rows.size(0) == bitmask.size(0),
              "rows must be a contiguous int64 vector, one per bitmask row");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "row ", row_ids[i],
                " is outside the logits' ", logits.size(0), " rows");
  switch (logits.scalar_type()) {
    case torch::kFloat32: apply_impl<float>(logits, bitmask, row_ids); break;
    case torch::kBFloat16: apply_impl<at::BFloat16>(logits, bitmask, row_ids); break;
    case torch::kFloat16: apply_impl<at::Half>(logits, bitmask, row_ids); break;
    default: TORCH_CHECK(false, "apply_token_bitmask: unsupported dtype ", logits.scalar_type());
  }
}
