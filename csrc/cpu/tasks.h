// Tasks of uneven cost (a sequence's keys, a prompt tile's) spread over the threads: handed
// out one at a time from a shared counter, in the caller's order (longest first keeps the
// last thread from finishing alone), to no more workers than there are tasks, so that a
// single task runs inline instead of waking a sleeping thread that would find no work.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace vllm_cpu {

// Calls fn(scratch, i) once for every i < num_tasks; each worker makes its own scratch
// with make_scratch().
template <typename MakeScratch, typename Fn>
void run_tasks(int64_t num_tasks, MakeScratch make_scratch, Fn fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto scratch = make_scratch();
    for (int64_t i = next++; i < num_tasks; i = next++) fn(scratch, i);
  });
}

}  // namespace vllm_cpu
