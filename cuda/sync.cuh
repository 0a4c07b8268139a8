// sync.cuh — how the blocks of a persistent kernel wait for each other: counters in global memory.
//
// The persistent decode step (docs/ARCHITECTURE.md) is one grid of co-resident blocks running a schedule of tasks; a
// task may need what other blocks' tasks wrote (the QKV rows of a head before its attention, every slice of the
// residual before the next RMSNorm). Kernel boundaries no longer order them: counters do.
//
// Protocol (the one CUTLASS's GenericBarrier and Hazy Research's megakernel use):
//   producer block: writes its output to global memory with ordinary stores, then block_signal(counter):
//     __syncthreads()                           every thread's writes precede thread 0's next operation (CTA
//                                               barrier), and a release is cumulative: it covers them too;
//     thread 0: red.release.gpu.add(counter)    publishes them at GPU scope.
//   consumer block: block_wait(counter, target):
//     thread 0 spins on ld.acquire.gpu until the counter has reached `target` (wrap-safe compare, below);
//     __syncthreads()                           the barrier extends thread 0's acquire to the whole block.
//   In the PTX memory model the release (an atomic in the counter's release sequence) synchronises with an acquire
//   that reads its value or a later one, so everything written before any of the counted signals is visible to
//   the consumer's later loads.
// Consumers read data produced inside the kernel with ld.global (load_produced: .cg, L2 only); never through the
// read-only path (__ldg / ld.global.nc), whose coherence with writes made during the kernel the model does not give.
// Weights (never written during a step) may use any load.
//
// Epochs instead of resets: counters only grow. A counter that P producers signal once per step reaches
// epoch * P at the end of step `epoch` (1, 2, ...), so step e waits for epoch_target(e, P) and nothing is zeroed
// between steps (a reset would itself need a grid-wide barrier). Comparisons are wrap-safe (int32 difference), so
// a counter may wrap around 2^32 as long as a waiter is never more than 2^31 behind.
//
// Waiting: tight polling first (a hand-off is ~1 us, an L2 round trip ~0.5 us: sleeping costs latency), then
// __nanosleep with exponential backoff up to WaitPolicy::max_sleep_ns (0: never sleep). A wait that has not
// succeeded after timeout_ns (the global timer) records the counter's index and value in `error` and gives up,
// and once `error` is set every later wait gives up at once: a broken schedule or a grid that is not co-resident
// ends the kernel with an error the host reports, instead of hanging the GPU.
//
// Counters sit kCounterStride words apart (one 128-byte line each), so blocks polling one counter do not contend
// with atomics on its neighbours.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ti::cuda::sync {

constexpr int kCounterStride = 32;  // uint32 words between two counters: a 128-byte L2 line each

struct WaitPolicy {
  uint32_t max_sleep_ns = 0;              // backoff ceiling after the tight polls; 0: never sleep
  unsigned long long timeout_ns = 2000000000ull;  // give up (and record an error) after this long
};

// What a failed wait leaves in the error words (3 uint32: flag, counter index, value seen; the flag first).
constexpr uint32_t kWaitTimedOut = 1;

__host__ __device__ constexpr uint32_t epoch_target(uint32_t epoch, uint32_t producers) { return epoch * producers; }

// value has reached target, modulo 2^32 (valid while they are less than 2^31 apart).
__host__ __device__ constexpr bool reached(uint32_t value, uint32_t target) { return (int32_t)(value - target) >= 0; }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "sync.cuh needs sm_70+ (ld.acquire / red.release)"
#endif

__device__ __forceinline__ void release_add(uint32_t* counter, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* counter) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A 16-byte load of data another block produced during this kernel (after a wait): L2, not the read-only path.
__device__ __forceinline__ uint4 load_produced(const uint4* p) { return __ldcg(p); }

// One thread waits until *counter has reached target. Returns false on a timeout or an error already recorded.
// `index` only names the counter in the error record. error: 3 words (kWaitTimedOut, index, last value).
__device__ __forceinline__ bool thread_wait(const uint32_t* counter, uint32_t target, const WaitPolicy& policy,
                                            uint32_t* error, uint32_t index) {
  uint32_t v = load_acquire(counter);
  if (reached(v, target)) return true;
  constexpr int kTightPolls = 64;
  for (int i = 0; i < kTightPolls; i++) {
    v = load_acquire(counter);
    if (reached(v, target)) return true;
  }
  const unsigned long long t0 = global_ns();
  uint32_t sleep = 32;
  for (;;) {
    if (policy.max_sleep_ns) {
      __nanosleep(sleep < policy.max_sleep_ns ? sleep : policy.max_sleep_ns);
      sleep *= 2;
    }
    v = load_acquire(counter);
    if (reached(v, target)) return true;
    if (*reinterpret_cast<volatile uint32_t*>(error) != 0) return false;  // another wait failed: stop
    if (global_ns() - t0 > policy.timeout_ns) {
      if (atomicCAS(error, 0u, kWaitTimedOut) == 0u) {
        error[1] = index;
        error[2] = v;
      }
      return false;
    }
  }
}

// Every thread of the block calls it after writing its part of the output.
__device__ __forceinline__ void block_signal(uint32_t* counter, uint32_t v = 1) {
  __syncthreads();
  if (threadIdx.x == 0) release_add(counter, v);
}

// Every thread of the block calls it; returns (the same for every thread) whether the counter was reached. The
// barrier inside (__syncthreads_or) also orders the whole block's later loads after thread 0's acquire.
__device__ __forceinline__ bool block_wait(const uint32_t* counter, uint32_t target, const WaitPolicy& policy,
                                           uint32_t* error, uint32_t index) {
  int failed = 0;
  if (threadIdx.x == 0) failed = !thread_wait(counter, target, policy, error, index);
  return !__syncthreads_or(failed);
}

// block_wait that also adds the nanoseconds thread 0 spent waiting to *waited_ns (for the probes).
__device__ __forceinline__ bool block_wait_timed(const uint32_t* counter, uint32_t target, const WaitPolicy& policy,
                                                 uint32_t* error, uint32_t index, unsigned long long* waited_ns) {
  int failed = 0;
  if (threadIdx.x == 0) {
    const unsigned long long t0 = global_ns();
    failed = !thread_wait(counter, target, policy, error, index);
    *waited_ns += global_ns() - t0;
  }
  return !__syncthreads_or(failed);
}

}  // namespace ti::cuda::sync
