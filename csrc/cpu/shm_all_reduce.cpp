// All-reduce (sum) of the tensor-parallel ranks of one machine through a shared-memory
// segment: one copy in, one barrier on flags, one vectorised sum out. gloo's loopback TCP
// takes ~0.3 ms per call on the 2-core machine, this a few microseconds (see
// benchmarks/benchmark_parallel.py); a tensor-parallel decode step does two per layer.
//
// The segment, created by rank 0 and mapped by every rank (W ranks, S bytes per buffer):
//
//   offset                          contents
//   64 r                            rank r's line: arrived (uint64, its last call's number), pid
//   64 W + (b W + r) S, b = 0, 1    rank r's buffer b: its input to the calls n with n % 2 == b
//
// Call n on rank r: copy x into its buffer n % 2; arrived[r] = n (release); wait until every
// arrived[q] >= n (acquire); sum buffer n % 2 of every rank, in rank order, in float32, into
// a new tensor. Every rank runs the same sum in the same order: identical bits everywhere.
//
// Two buffers and one barrier per call are enough: rank r writes buffer n % 2 again in call
// n + 2, which it starts only after seeing arrived[q] >= n + 1 for every q in call n + 1,
// and q sets arrived[q] = n + 1 only once it has finished reading buffer n % 2 in call n.
#include <torch/extension.h>

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

struct alignas(64) RankLine {
  std::atomic<uint64_t> arrived;  // the number of this rank's last call (0: none yet)
  int64_t pid;                    // written by the rank when it maps the segment
};
static_assert(sizeof(RankLine) == 64, "one cache line per rank");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "atomics must work across processes");

// A rank pinned to its own core answers within microseconds, so a waiting rank first spins;
// ranks sharing a core (oversubscribed) must let the other run: then it yields, then sleeps.
constexpr int64_t kSpins = 4096;   // ~10-50 us of pause instructions
constexpr int64_t kYields = 1024;  // then sched_yield; after that 20 us sleeps
constexpr int64_t kCheckEvery = 256;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

bool process_gone(int64_t pid) {
  return pid > 0 && kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH;
}

// Returns once every rank has arrived at call n; raises if a rank's process is gone or after
// timeout_s of waiting (a peer stuck elsewhere).
void wait_for_ranks(RankLine* lines, int64_t world, uint64_t n, double timeout_s) {
  using Clock = std::chrono::steady_clock;
  for (int64_t q = 0; q < world; ++q) {
    Clock::time_point deadline;
    for (int64_t spins = 0; lines[q].arrived.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < kSpins) {
        cpu_relax();
        continue;
      }
      if (spins == kSpins)
        deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(timeout_s));
      if (spins < kSpins + kYields) {
        sched_yield();
      } else {
        const timespec pause{0, 20000};
        nanosleep(&pause, nullptr);
      }
      if (spins % kCheckEvery == 0) {
        TORCH_CHECK(!process_gone(lines[q].pid), "shm all-reduce: rank ", q, " (pid ",
                    lines[q].pid, ") is gone");
        TORCH_CHECK(Clock::now() < deadline, "shm all-reduce: rank ", q,
                    " did not arrive within ", timeout_s, " s");
      }
    }
  }
}

// out[i] = sum over ranks q (in order) of buffer q's element i, accumulated in float32.
template <typename T>
void sum_ranks(const char* buffers, int64_t buffer_bytes, int64_t world, int64_t n, T* out) {
  auto buffer = [&](int64_t q) { return reinterpret_cast<const T*>(buffers + q * buffer_bytes); };
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m512 acc = vllm_cpu::load16(buffer(0) + i);
    for (int64_t q = 1; q < world; ++q) acc = _mm512_add_ps(acc, vllm_cpu::load16(buffer(q) + i));
    vllm_cpu::store16(out + i, acc);
  }
#endif
  for (; i < n; ++i) {
    float acc = static_cast<float>(buffer(0)[i]);
    for (int64_t q = 1; q < world; ++q) acc += static_cast<float>(buffer(q)[i]);
    out[i] = static_cast<T>(acc);
  }
}

}  // namespace

torch::Tensor shm_all_reduce(torch::Tensor x, torch::Tensor segment, int64_t rank,
                             int64_t world, double timeout_s) {
  TORCH_CHECK(segment.scalar_type() == torch::kUInt8 && segment.dim() == 1 &&
                  segment.is_contiguous(), "segment must be a contiguous uint8 tensor");
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "bad rank ", rank, " of ", world);
  TORCH_CHECK(x.device().is_cpu(), "shm all-reduce: CPU tensors only");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
              "shm all-reduce: unsupported dtype ", dtype);
  x = x.contiguous();
  const int64_t bytes = x.numel() * x.element_size();
  const int64_t buffer_bytes = (segment.numel() - 64 * world) / (2 * world);
  TORCH_CHECK(bytes <= buffer_bytes, "shm all-reduce: ", bytes, " bytes exceed the buffer's ",
              buffer_bytes);
  auto out = torch::empty_like(x);
  char* base = static_cast<char*>(segment.data_ptr());
  auto* lines = reinterpret_cast<RankLine*>(base);
  {
    pybind11::gil_scoped_release no_gil;  // other Python threads run while this one waits
    const uint64_t n = lines[rank].arrived.load(std::memory_order_relaxed) + 1;
    const char* buffers = base + 64 * world + static_cast<int64_t>(n % 2) * world * buffer_bytes;
    std::memcpy(const_cast<char*>(buffers) + rank * buffer_bytes, x.data_ptr(), bytes);
    lines[rank].arrived.store(n, std::memory_order_release);
    wait_for_ranks(lines, world, n, timeout_s);
    switch (dtype) {
      case torch::kFloat32:
        sum_ranks(buffers, buffer_bytes, world, x.numel(), out.data_ptr<float>());
        break;
      case torch::kBFloat16:
        sum_ranks(buffers, buffer_bytes, world, x.numel(), out.data_ptr<at::BFloat16>());
        break;
      default:
        sum_ranks(buffers, buffer_bytes, world, x.numel(), out.data_ptr<at::Half>());
    }
  }
  return out;
}
