// ring.cuh — the weight ring of the persistent kernel: a block streams global memory through S shared-memory
// slots of B bytes, the copies of the next S-1 chunks in flight while it works on (or waits before) the current
// one. This is what keeps the weight stream going while a block waits for its input (docs/ARCHITECTURE.md): the chunks
// of its next task were issued before the wait.
//
// Use (every thread of the block, uniformly):
//   WeightRing<C, S> ring(smem, B);
//   for (i < S-1) ring.issue(src_i);                      // prologue: S-1 chunks in flight
//   for each chunk i: ring.issue(src_{i+S-1} or nullptr);  // one issue (nullptr: none left) before each acquire
//                     const uint8_t* p = ring.acquire();   // chunk i is in shared memory, visible to all threads
//                     ... read p[0, B) ...
//                     ring.release();                      // every thread is done with its slot
// The strict issue/acquire alternation is what lets the cp.async variant count groups at compile time.
//
// Variants (RingCopy):
//   CpAsync: every thread copies B/16/threads 16-byte words with cp.async.cg (sm_80+; below, plain loads and
//            stores: correct, not asynchronous); one commit group per chunk, acquire = wait_group<S-1> + barrier.
//   Bulk:    thread 0 issues one cp.async.bulk (the TMA engine's linear copy, sm_90) of B bytes that completes on
//            the slot's mbarrier (expect_tx); acquire = every thread waits for the slot's phase. Fewer
//            instructions and no registers held per copy; the block's threads stay free for compute.
// Shared memory: ring_smem_bytes(S, B) = 128 bytes of mbarriers (Bulk) + S * B. Addresses and B: multiples of 16.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#include "common.cuh"  // smem_addr
#endif

namespace ti::cuda {

enum class RingCopy : int { CpAsync = 0, Bulk = 1 };

constexpr int kRingMaxStages = 8;
constexpr size_t kRingHeader = 128;  // the Bulk variant's mbarriers, one per slot (8 bytes each)
inline size_t ring_smem_bytes(int stages, size_t slot_bytes) { return kRingHeader + (size_t)stages * slot_bytes; }

#ifdef __CUDACC__  // the device code (the bindings include this header for RingCopy)

template <RingCopy C, int S>
struct WeightRing {
  static_assert(S >= 2 && S <= kRingMaxStages, "ring stages");
  uint8_t* slots;
  uint64_t* full;  // Bulk: one mbarrier per slot
  uint32_t slot_bytes;
  uint32_t issued = 0, consumed = 0;
  uint32_t issuer = 0;  // Bulk: the thread that issues the copies

  // smem: ring_smem_bytes(S, slot_bytes) bytes, 128-byte aligned. Contains a barrier: call it uniformly.
  __device__ WeightRing(uint8_t* smem, uint32_t bytes)
      : slots(smem + kRingHeader), full(reinterpret_cast<uint64_t*>(smem)), slot_bytes(bytes) {
    if constexpr (C == RingCopy::Bulk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(full + s)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      }
#endif
    }
    __syncthreads();
  }

  // Starts copying slot_bytes from src (16-byte aligned) into the next slot; nullptr: nothing (the tail).
  __device__ __forceinline__ void issue(const uint8_t* src) {
    const uint32_t slot = issued % S;
    uint8_t* dst = slots + (size_t)slot * slot_bytes;
    if constexpr (C == RingCopy::CpAsync) {
      if (src != nullptr) {
        for (uint32_t o = threadIdx.x * 16; o < slot_bytes; o += blockDim.x * 16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst + o)), "l"(src + o) : "memory");
#else
          *reinterpret_cast<uint4*>(dst + o) = __ldcs(reinterpret_cast<const uint4*>(src + o));
#endif
        }
      }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      asm volatile("cp.async.commit_group;" ::: "memory");  // an empty group too: acquire counts groups
#endif
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (src != nullptr && threadIdx.x == issuer) {
        const uint32_t bar = smem_addr(full + slot);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(slot_bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_addr(dst)), "l"(src), "r"(slot_bytes), "r"(bar) : "memory");
      }
#else
      __trap();  // the host refuses the Bulk variant below sm_90
#endif
    }
    issued++;
  }

  // Waits for the oldest chunk not yet acquired; returns its slot, readable by every thread.
  __device__ __forceinline__ const uint8_t* acquire() {
    const uint32_t slot = consumed % S;
    if constexpr (C == RingCopy::CpAsync) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory");  // issued - consumed == S at this point
#endif
      __syncthreads();  // the other threads' copies of this chunk
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      const uint32_t bar = smem_addr(full + slot), parity = (consumed / S) & 1;
      uint32_t done = 0;
      do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
      } while (!done);
#endif
    }
    return slots + (size_t)slot * slot_bytes;
  }

  // Every thread is done reading the slot acquire() returned: it may be refilled by the next issue().
  __device__ __forceinline__ void release() {
    __syncthreads();
    consumed++;
  }
};

// The persistent kernel's ring (cuda/persistent.cu): the Bulk variant with the slot count chosen at launch
// (CudaOptions::persistent_ring_slots) and a copy of up to two pieces per slot (a tile's weight rows and their
// scales), and no fixed issue/acquire alternation: the caller issues whenever a slot is free (free_slots()),
// typically several tiles of its next tasks before it waits on a counter, and acquires in issue order.
// issued / consumed are kept by every thread alike (call everything uniformly); thread 0 alone issues the copies.
struct BulkRing {
  uint8_t* slots;
  uint64_t* full;
  uint32_t slot_bytes, n_slots;
  uint32_t issued = 0, consumed = 0;

  // smem: ring_smem_bytes(n, bytes), 128-byte aligned; n <= kRingMaxStages. Contains a barrier.
  __device__ BulkRing(uint8_t* smem, uint32_t n, uint32_t bytes)
      : slots(smem + kRingHeader), full(reinterpret_cast<uint64_t*>(smem)), slot_bytes(bytes), n_slots(n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
      for (uint32_t s = 0; s < n; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(full + s)));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#endif
    __syncthreads();
  }
  __device__ __forceinline__ uint32_t free_slots() const { return n_slots - (issued - consumed); }

  // Copies a (na bytes) then b (nb bytes, may be 0) into the next free slot, b right after a. Sources and sizes:
  // multiples of 16; na + nb <= slot_bytes. Only thread 0's arguments are used.
  __device__ __forceinline__ void issue(const void* a, uint32_t na, const void* b, uint32_t nb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
      const uint32_t slot = issued % n_slots;
      const uint32_t bar = smem_addr(full + slot), dst = smem_addr(slots + (size_t)slot * slot_bytes);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(na + nb) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(dst), "l"(a), "r"(na), "r"(bar) : "memory");
      if (nb)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(dst + na), "l"(b), "r"(nb), "r"(bar) : "memory");
    }
#else
    (void)a, (void)na, (void)b, (void)nb;
    __trap();  // the host builds no ring below sm_90
#endif
    issued++;
  }

  // Whether the oldest tile not yet acquired has landed (one mbarrier try_wait: it may suspend briefly).
  __device__ __forceinline__ bool ready() const {
    uint32_t done = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = smem_addr(full + consumed % n_slots), parity = (consumed / n_slots) & 1;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
#endif
    return done != 0;
  }
  // The oldest tile's slot (after ready()), readable by every thread that saw it ready.
  __device__ __forceinline__ const uint8_t* oldest() const { return slots + (size_t)(consumed % n_slots) * slot_bytes; }
  // Waits for the oldest tile not yet acquired; returns its slot, readable by every thread.
  __device__ __forceinline__ const uint8_t* acquire() const {
    while (!ready()) {
    }
    return oldest();
  }

  // Every thread is done reading the slot acquire() returned: it may be refilled.
  __device__ __forceinline__ void release() {
    __syncthreads();
    consumed++;
  }

};
#endif  // __CUDACC__

}  // namespace ti::cuda
