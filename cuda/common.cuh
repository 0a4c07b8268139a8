// common.cuh — helpers shared by the kernel files: error checks, vector loads, fp16 dot products, warp and
// block reductions, and programmatic dependent launch (PDL).
//
// PDL (sm_90+): a kernel launched with the programmatic-serialization attribute may start while the previous
// kernel still runs: as soon as every block of the previous kernel has called pdl_launch_dependents() (the
// trigger) or exited. Every kernel calls pdl_wait() — which returns once the previous kernel has completed and
// its writes are visible — before it reads what the previous kernel wrote or writes anything; every kernel
// waits, so completion stays ordered transitively. Before its wait a kernel may read:
//   - weights (nobody writes them during a step), always;
//   - data written two or more kernels earlier (the two-back rule), if the kernel before it triggers only
//     after its own wait: then that kernel had passed its wait, so everything before it had completed. In
//     general: data written before the nearest earlier kernel that triggers only after its wait.
// A kernel triggers at its start only where the next kernel reads nothing but weights, or data that old, before
// its wait (GemvParams::early_trigger, DecodeAttnParams::early_trigger, the attention merge). Below sm_90 both are
// no-ops and launches are ordinary stream-ordered ones.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../cpp/core/errors.h"

namespace ti::cuda {

// Throws ti::Error(Device) naming the call, the file and the line.
#define TI_CUDA_CHECK(expr)                                                                                  \
  do {                                                                                                       \
    cudaError_t err_ = (expr);                                                                               \
    if (err_ != cudaSuccess)                                                                                 \
      ::ti::fail(::ti::ErrorKind::Device, std::string("CUDA error: ") + cudaGetErrorString(err_) + " in " + \
                                              #expr + " at " + __FILE__ + ":" + std::to_string(__LINE__));   \
  } while (0)

// Multiprocessors of the current device, asked once per process (the engine uses one device): grid sizing.
// A benchmark that held the process to part of the GPU (sm_partition.cuh) sets the override first.
extern int g_sm_count_override;
inline int sm_count() {
  if (g_sm_count_override > 0) return g_sm_count_override;
  static const int n = [] {
    int dev = 0, v = 0;
    TI_CUDA_CHECK(cudaGetDevice(&dev));
    TI_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

// 16-byte load that skips L1 (streamed data is read once).
__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }

// A shared-memory pointer as the 32-bit address PTX's shared-memory operands take.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// cp.async (sm_80+): 16 bytes global -> shared memory, no register held while in flight (below sm_80: a plain
// load and store, complete at once). A thread's copies complete in commit groups; each thread waits for its own.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
// The same, or 16 zero bytes where !valid (src is then not read).
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
#else
  *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}
// An L2 policy for data read once (weights): evict it first, as load_stream's loads do.
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t p = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
#endif
  return p;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, uint64_t l2_policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(
                   (uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src), "l"(l2_policy)
               : "memory");
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {  // all but this thread's newest N commit groups complete
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Decode-step tracing (built with -DTINYINFER_TRACE=ON, which defines TI_TRACE; CudaOptions::trace,
// bench/tools/trace_decode.py): kernels given a trace buffer have thread 0 of each of their first kTraceBlocks blocks
// write the global timer (ns) at kTracePoints points: start, after the PDL wait, after the prologue (input
// staged / new token read), end, and (GEMVs; 0 elsewhere) once the first tile's first words have been multiplied,
// i.e. when its first weights were there; with the start, the SM the block runs on (which blocks end late, and
// where: trace_decode.py --sm). kTraceWords words a block. Without TI_TRACE the calls compile to nothing (the
// stores and the branch cost ~1% of a TinyLlama int4 step: measured).
constexpr int kTraceBlocks = 1024, kTracePoints = 5, kTraceWords = kTracePoints + 1;
__device__ __forceinline__ void trace_point(unsigned long long* trace, int point) {
#ifdef TI_TRACE
  if (trace == nullptr || threadIdx.x != 0) return;
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (block >= (unsigned)kTraceBlocks) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  trace[block * kTraceWords + point] = t;
  if (point == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    trace[block * kTraceWords + kTracePoints] = sm;
  }
#endif
}

// trace_point once v has been computed: the empty asm takes v, so the timer (asm volatile, kept in order) is read
// after the loads v waited for had returned.
__device__ __forceinline__ void trace_point_after(unsigned long long* trace, int point, float v) {
#ifdef TI_TRACE
  asm volatile("" ::"f"(v));
  trace_point(trace, point);
#endif
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result. `red` holds 33 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be in use by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < nw ? red[lane] : 0.0f;
    s = warp_sum(s);
    if (lane == 0) red[32] = s;
  }
  __syncthreads();
  return red[32];
}

// The block's sum of v (8 warps: 256 threads) where `red` (8 floats) is used for nothing else in flight: one barrier,
// after which every thread adds the 8 warps' sums itself, in the order block_sum above adds them (its warp 0 lanes
// 0-7 by xor shuffles 4, 2, 1; the shuffles 16 and 8 add zeros), so the result is the same to the bit; block_sum
// would spend two more barriers and warp 0's shuffle chain on a prologue's critical path (the decode GEMVs' and the
// one-row tensor-core product's RMSNorm).
__device__ __forceinline__ float block_sum_once(float v, float* red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  const float4 a = reinterpret_cast<const float4*>(red)[0], b = reinterpret_cast<const float4*>(red)[1];
  return ((a.x + b.x) + (a.z + b.z)) + ((a.y + b.y) + (a.w + b.w));
}

// dot of 8 fp16 weights with 8 fp32 inputs, accumulated in fp32.
__device__ __forceinline__ float dot8(const uint4& w, const float* x) {
  const __half2* h = reinterpret_cast<const __half2*>(&w);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 f = __half22float2(h[i]);
    s = fmaf(f.x, x[2 * i], s);
    s = fmaf(f.y, x[2 * i + 1], s);
  }
  return s;
}

__device__ __forceinline__ void unpack8(const uint4& v, float* out) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float* in) {  // unpack8's inverse, rounding to nearest
  uint4 v;
  __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; i++) h[i] = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
  return v;
}

// The shared-memory carveout (percent of the SM's maximum shared memory, rounded up by the driver to a size the SM
// offers: 50% of the H200's 228 KiB is 132 KiB, the rest of the 256 KiB staying L1) that launch() asks for on this
// thread; -1: none asked, the driver picks per kernel. An SM holds blocks of one configuration at a time, and
// under PDL a decode step's kernels overlap on the SMs, so kernels left to the driver's choice can run on SMs
// configured for another kernel; at Llama-2-7B's shapes a few SMs per GEMV then stream slower and end late
// (docs/perf/persistent.md §23). One preference for every kernel of a step avoids it; the decode step sets it for
// its launches (GemvPlan::carveout) with CarveoutScope.
// The launch attribute came with CUDA 12.5; older toolkits build without it (the driver's choice always).
constexpr bool kLaunchCarveout = CUDART_VERSION >= 12050;
inline int& launch_carveout() {
  thread_local int carveout = -1;
  return carveout;
}
struct CarveoutScope {
  explicit CarveoutScope(int carveout) : saved_(launch_carveout()) { launch_carveout() = carveout; }
  ~CarveoutScope() { launch_carveout() = saved_; }
  CarveoutScope(const CarveoutScope&) = delete;
  CarveoutScope& operator=(const CarveoutScope&) = delete;

 private:
  int saved_;
};

// Launch `kernel` on `stream`, with programmatic dependent launch when `pdl` (the device is sm_90+) and the
// thread's launch_carveout() where one is set (a launch attribute: graph capture keeps it per kernel node).
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
            Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
#if CUDART_VERSION >= 12050
  if (launch_carveout() >= 0) {
    attr[n].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
    attr[n++].val.sharedMemCarveout = (unsigned)launch_carveout();
  }
#endif
  cfg.attrs = attr;
  cfg.numAttrs = n;
  TI_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Opts `kernel` into `smem` bytes of dynamic shared memory where it needs that: past the default limit, 48 KB minus
// the kernel's static shared memory (a kernel with static arrays reaches it below 48 KB of dynamic memory: the
// F32Norm GEMV at K = 8,192, whose 48 KB of staging with its 132 static bytes would not launch). Idempotent, so
// called at every launch, graph captures included, rather than behind a once-flag.
template <typename Kernel>
inline void allow_dynamic_smem(Kernel kernel, size_t smem) {
  if (smem == 0) return;
  cudaFuncAttributes fa{};
  TI_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
  if (smem + fa.sharedSizeBytes > 48 * 1024)
    TI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
}

inline int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }

}  // namespace ti::cuda
