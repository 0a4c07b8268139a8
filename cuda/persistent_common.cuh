// persistent_common.cuh — what the persistent decode step's task files share (cuda/persistent.cu, the kernel and
// its interpreter; persistent_gemv.cuh, persistent_attn.cuh, the task bodies): the block's shared-memory areas and
// the L2 load of data produced during the kernel. Included by persistent.cu only.
#pragma once

#include "common.cuh"
#include "gemv_dot.cuh"
#include "persistent.cuh"
#include "sync.cuh"

namespace ti::cuda::persistent {

constexpr int kWarps = kPersistentThreads / 32;
constexpr int kRedFloats = 64;  // block_sum's 33 floats, padded to 256 bytes

struct Smem {
  float* red;
  unsigned char* work;  // the task's own area (the staged input, or the attention's tiles)
  float* xsum;          // I4: the staged input's group sums (after the widest staged input)
  float4* keep;         // the RMSNorm's input as read by its first pass (hidden floats, after xsum)
  unsigned long long* staged = nullptr;  // TI_TRACE: the task's "after staging" stamp (persistent.cu, task_stamp)
};

// Thread 0 stamps the global timer at *at (TI_TRACE builds, at != nullptr; else nothing).
__device__ __forceinline__ void stamp_at(unsigned long long* at) {
#ifdef TI_TRACE
  if (at != nullptr && threadIdx.x == 0) *at = sync::global_ns();
#else
  (void)at;
#endif
}

// Bytes of the GEMV tasks' area before `keep`: the widest staged input, then (I4) its group sums; 16-aligned.
__host__ __device__ inline size_t gemv_stage_bytes(int stage_max) {
  const size_t b = (size_t)stage_max * sizeof(__half) + (size_t)(stage_max / kI4Group + 1) * sizeof(float);
  return (b + 15) / 16 * 16;
}

__device__ __forceinline__ float ldcg(const float* p) { return __ldcg(p); }


}  // namespace ti::cuda::persistent
