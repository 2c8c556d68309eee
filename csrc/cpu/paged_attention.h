// Paged decode attention (paged_attention.cpp) for callers in other files: fused_decode.cpp
// runs it inside its own parallel region, where its inner parallel loops run inline.
#pragma once

#include <cstdint>

namespace vllm_cpu {

// One query token per sequence against the block-paged cache (layouts in
// paged_attention.cpp); T is float, c10::BFloat16 or c10::Half. The vectorised kernel where
// it has an instantiation for the head size, else the scalar one. Only the query heads
// [head_begin, head_end) are computed (their rows of `out` written; the others untouched),
// so that callers can split one sequence's heads over threads: each head's result is the
// same whatever the range.
template <typename T>
void paged_decode(const T* query, const T* kv_cache, const int32_t* block_table,
                  const int32_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_size, int64_t num_blocks,
                  int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                  float soft_cap, int64_t head_begin, int64_t head_end);

}  // namespace vllm_cpu
