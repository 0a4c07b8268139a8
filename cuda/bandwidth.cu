// bandwidth.cu — the streaming-read kernel: the measured memory roofline of this GPU (bench/results/README.md).
//
// Computes: XOR of every 32-bit word of a buffer, reduced per block into sink[block]. What matters is only
// that every byte is read once with 16-byte loads, as the weight-streaming GEMVs read their matrices, so
// bytes / time is the best read bandwidth a decode kernel can hope for. Layout: a flat array of uint4.
// Variants: one grid-stride kernel, 4 independent 16-byte loads per thread per iteration in flight; the
// grid is a few waves of the SM count (enough blocks to saturate HBM, no tail effects worth measuring).
#include <algorithm>
#include <chrono>
#include <vector>

#include "bandwidth.cuh"
#include "common.cuh"

namespace ti::cuda {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// clk (optional): block 0's SM cycles and nanoseconds over its whole pass, so (cycles / ns) is that SM's clock
// while the memory streams at full rate (a GPU held by its power limit under memory traffic clocks down, and the
// quantized GEMVs, bound partly by their instruction issue, slow with it: docs/perf/persistent.md §49).
__global__ void stream_read_kernel(const uint4* __restrict__ data, size_t n_vec, uint32_t* __restrict__ sink,
                                   unsigned long long* __restrict__ clk) {
  const bool timer = clk && blockIdx.x == 0 && threadIdx.x == 0;
  unsigned long long c0 = 0, t0 = 0;
  if (timer) c0 = clock64(), t0 = global_ns();
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (kUnroll - 1) * stride < n_vec; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) v[u] = load_stream(data + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n_vec; i += stride) {
    const uint4 v = load_stream(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ uint32_t warp_acc[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t r = 0;
    for (int w = 0; w < kThreads / 32; w++) r ^= warp_acc[w];
    sink[blockIdx.x] = r;
  }
  if (timer) clk[0] = clock64() - c0, clk[1] = global_ns() - t0;
}

void launch_stream_read(const uint4* data, size_t n_vec, uint32_t* sink, int blocks, cudaStream_t stream,
                        unsigned long long* clk) {
  stream_read_kernel<<<blocks, kThreads, 0, stream>>>(data, n_vec, sink, clk);
  TI_CUDA_CHECK(cudaGetLastError());
}

BandwidthResult measure_read_bandwidth(size_t bytes, int iters) {
  const int sms = sm_count();  // (held to part of the GPU: that part's SMs, sm_partition.cuh)
  const size_t n_vec = std::max<size_t>(bytes / 16, 1);
  BandwidthResult r;
  r.blocks = sms * 8;
  r.bytes = (double)n_vec * 16.0;
  uint4* data = nullptr;
  uint32_t* sink = nullptr;  // the blocks' words, then the clock's two counters (cycles, ns)
  cudaEvent_t start = nullptr, stop = nullptr;
  TI_CUDA_CHECK(cudaMalloc(&data, n_vec * 16));
  try {
    const size_t sink_words = ((size_t)r.blocks + 1) / 2 * 2;  // 8-byte aligned counters after the words
    TI_CUDA_CHECK(cudaMalloc(&sink, sink_words * sizeof(uint32_t) + 2 * sizeof(unsigned long long)));
    unsigned long long* clk = reinterpret_cast<unsigned long long*>(sink + sink_words);
    TI_CUDA_CHECK(cudaMemset(data, 1, n_vec * 16));
    TI_CUDA_CHECK(cudaEventCreate(&start));
    TI_CUDA_CHECK(cudaEventCreate(&stop));
    for (int w = 0; w < 3; w++) launch_stream_read(data, n_vec, sink, r.blocks, 0);
    float best = 1e30f;
    for (int it = 0; it < std::max(iters, 1); it++) {
      TI_CUDA_CHECK(cudaEventRecord(start, 0));
      launch_stream_read(data, n_vec, sink, r.blocks, 0, clk);
      TI_CUDA_CHECK(cudaEventRecord(stop, 0));
      TI_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      TI_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (ms < best) {
        unsigned long long c[2] = {0, 0};
        TI_CUDA_CHECK(cudaMemcpy(c, clk, sizeof(c), cudaMemcpyDeviceToHost));
        r.sm_mhz = c[1] ? 1e3 * (double)c[0] / (double)c[1] : 0.0;
      }
      best = std::min(best, ms);
    }
    r.best_ms = best;
    r.gb_per_s = r.bytes / (best * 1e-3) / 1e9;
  } catch (...) {
    cudaFree(data);
    cudaFree(sink);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    throw;
  }
  cudaFree(data);
  cudaFree(sink);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return r;
}

double warm_memory(double ms) {
  using clock = std::chrono::steady_clock;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const size_t bytes = std::min<size_t>((size_t)1 << 30, free_b / 4);
  if (bytes < ((size_t)64 << 20)) return 0;  // too little to make traffic of
  double best = 0;
  const clock::time_point t0 = clock::now();
  try {
    while (std::chrono::duration<double, std::milli>(clock::now() - t0).count() < ms)
      best = std::max(best, measure_read_bandwidth(bytes, 4).gb_per_s);
  } catch (const Error&) {  // (the memory taken meanwhile: the load goes on without the rest of the warm-up)
  }
  return best;
}

uint32_t stream_read_xor(const void* host, size_t bytes, int blocks) {
  const size_t n_vec = (bytes + 15) / 16;
  uint4* data = nullptr;
  uint32_t* sink = nullptr;
  std::vector<uint32_t> out((size_t)blocks);
  TI_CUDA_CHECK(cudaMalloc(&data, std::max<size_t>(n_vec, 1) * 16));
  cudaError_t err = cudaMalloc(&sink, (size_t)blocks * sizeof(uint32_t));
  if (err == cudaSuccess) err = cudaMemset(data, 0, n_vec * 16);
  if (err == cudaSuccess) err = cudaMemcpy(data, host, bytes, cudaMemcpyHostToDevice);
  if (err == cudaSuccess) err = cudaMemset(sink, 0xAB, (size_t)blocks * sizeof(uint32_t));  // poison
  if (err == cudaSuccess) {
    stream_read_kernel<<<blocks, kThreads>>>(data, n_vec, sink, nullptr);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpy(out.data(), sink, out.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(data);
  cudaFree(sink);
  TI_CUDA_CHECK(err);
  uint32_t r = 0;
  for (uint32_t v : out) r ^= v;
  return r;
}

// ---- the other ceiling of a decode step: the cost of a kernel boundary ----
// A chain of `kernels` dependent kernels of `blocks` x 256 threads, replayed from a CUDA graph: each waits for the
// previous one (PDL), block 0 reads the counter the previous kernel wrote and writes it + 1 (a real data
// dependency through L2). Its time per kernel is the floor a decode step pays per kernel whatever the bytes.
__global__ void chain_kernel(uint32_t* counter, int early) {
  if (early) pdl_launch_dependents();
  pdl_wait();
  if (!early) pdl_launch_dependents();
  if (blockIdx.x == 0 && threadIdx.x == 0) counter[0] = counter[0] + 1;
}

double kernel_chain_us(int kernels, int blocks, bool pdl, bool early) {
  if (kernels < 1 || blocks < 1) fail(ErrorKind::Request, "kernel_chain_us: kernels and blocks must be >= 1");
  cudaStream_t s = nullptr;
  uint32_t* counter = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  float best = 1e30f;
  auto cleanup = [&] {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (counter) cudaFree(counter);
    if (s) cudaStreamDestroy(s);
  };
  try {
    TI_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    TI_CUDA_CHECK(cudaMalloc(&counter, sizeof(uint32_t)));
    TI_CUDA_CHECK(cudaMemset(counter, 0, sizeof(uint32_t)));
    TI_CUDA_CHECK(cudaEventCreate(&e0));
    TI_CUDA_CHECK(cudaEventCreate(&e1));
    TI_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int k = 0; k < kernels; k++) launch(chain_kernel, dim3(blocks), dim3(256), 0, s, pdl, counter, (int)early);
    TI_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    TI_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int it = 0; it < 8; it++) {
      TI_CUDA_CHECK(cudaEventRecord(e0, s));
      TI_CUDA_CHECK(cudaGraphLaunch(exec, s));
      TI_CUDA_CHECK(cudaEventRecord(e1, s));
      TI_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      TI_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (it > 0) best = std::min(best, ms);
    }
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  return best * 1e3 / kernels;
}

}  // namespace ti::cuda
