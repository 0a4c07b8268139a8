// smalln_stream.cu — which way of reading the weights lets a small-N product (y = W x for n <= 8 fp16 inputs)
// stream at the decode GEMV's bandwidth? A standalone micro-benchmark (not part of the engine):
//
//   nvcc -std=c++17 -O3 -arch=sm_90 bench/tools/smalln_stream.cu -o /tmp/smalln && /tmp/smalln
//
// The weights: TinyLlama's 22 layers (qkv 2560 x 2048, o 2048 x 2048, gate_up 11264 x 2048, down 2048 x 5632,
// fp16, 1.94 GB: far past L2), one kernel per matrix, the 88 launches captured in a graph and replayed. Every
// variant reads every weight once; what differs is the access pattern and the arithmetic:
//   read/contig   a warp instruction reads 512 contiguous bytes of one row (the decode GEMV's pattern)
//   read/frag     a warp instruction reads 64 bytes of each of 8 rows (lane (g, t): row g, word t — the layout
//                 of an mma.sync A fragment loaded straight from global memory)
//   mma/frag      read/frag + mma.sync m16n8k16 against 8 inputs staged in shared memory
//   mma/frag-gx   the same, the inputs read from global memory per chunk (mma_small_n.cu on main)
//   fma/contig    read/contig + fp32 FMAs on the CUDA cores for 8 inputs (2 rows per warp, whole K)
// The read and mma variants: a warp's unit is 16 rows x 512 bytes (16 16-byte loads per lane), two units in
// flight (double-buffered registers), persistent grid; partial sums leave by atomicAdd (fine for timing).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ck.cuh"

constexpr int NB = 8;  // inputs
constexpr int XPAD = 32;  // halfs of padding per staged input row: lane (g, t)'s 16-byte reads hit distinct banks

struct Args {
  const __half* W;
  int rows, K;
  const __half* x;  // (NB, K)
  float* y;         // (NB, rows)
  unsigned* sink;
};

__device__ __forceinline__ uint4 ldcs(const void* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ void mma16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

enum Mode { ReadContig, ReadFrag, MmaFrag, MmaFragGx };

// Unit u of a matrix: row tile u / kparts (16 rows), k part u % kparts (256 columns = 512 bytes a row).
template <Mode M>
__device__ __forceinline__ void load_unit(const Args& a, int u, int kparts, uint4* v) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tile = u / kparts, kp = u - tile * kparts;
  const size_t k0 = (size_t)kp * 256;
#pragma unroll
  for (int w = 0; w < 16; w++) {
    int row;
    size_t col;
    if constexpr (M == ReadContig) {
      row = tile * 16 + w, col = k0 + lane * 8;
    } else {
      row = tile * 16 + g + (w & 1) * 8, col = k0 + (w >> 1) * 32 + t * 8;
    }
    row = min(row, a.rows - 1);
    v[w] = col < (size_t)a.K ? ldcs(a.W + (size_t)row * a.K + col) : make_uint4(0, 0, 0, 0);
  }
}

template <Mode M>
__device__ __forceinline__ void use_unit(const Args& a, int u, int kparts, const uint4* v, const __half* xs,
                                         unsigned& sink) {
  if constexpr (M == ReadContig || M == ReadFrag) {
#pragma unroll
    for (int w = 0; w < 16; w++) sink ^= v[w].x ^ v[w].y ^ v[w].z ^ v[w].w;
  } else {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = u / kparts, kp = u - tile * kparts;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const int col = kp * 256 + j * 32 + t * 8;
      uint4 b;
      if constexpr (M == MmaFrag) {
        b = *reinterpret_cast<const uint4*>(xs + (size_t)g * (a.K + XPAD) + col);
      } else {
        b = col < a.K ? __ldg(reinterpret_cast<const uint4*>(a.x + (size_t)g * a.K + col)) : make_uint4(0, 0, 0, 0);
      }
      const uint4 ra = v[2 * j], rb = v[2 * j + 1];
      mma16816(acc, ra.x, rb.x, ra.y, rb.y, b.x, b.y);
      mma16816(acc, ra.z, rb.z, ra.w, rb.w, b.z, b.w);
    }
    const int r0 = tile * 16 + g, c = 2 * t;
    if (r0 < a.rows) {
      atomicAdd(a.y + (size_t)c * a.rows + r0, acc[0]);
      atomicAdd(a.y + (size_t)(c + 1) * a.rows + r0, acc[1]);
    }
    if (r0 + 8 < a.rows) {
      atomicAdd(a.y + (size_t)c * a.rows + r0 + 8, acc[2]);
      atomicAdd(a.y + (size_t)(c + 1) * a.rows + r0 + 8, acc[3]);
    }
  }
}

template <Mode M>
__global__ void __launch_bounds__(128) unit_kernel(Args a) {
  extern __shared__ __align__(16) __half xs[];
  if constexpr (M == MmaFrag) {
    const int ld = a.K + XPAD;
    for (int i = threadIdx.x; i < NB * a.K / 8; i += blockDim.x) {
      const int j = i / (a.K / 8), c = (i - j * (a.K / 8)) * 8;
      *reinterpret_cast<uint4*>(xs + (size_t)j * ld + c) = *reinterpret_cast<const uint4*>(a.x + (size_t)j * a.K + c);
    }
    __syncthreads();
  }
  const int kparts = (a.K + 255) / 256, units = (a.rows + 15) / 16 * kparts;
  const int warps = gridDim.x * (blockDim.x / 32), wid = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  unsigned sink = 0;
  uint4 va[16], vb[16];
  int u = wid;
  if (u < units) load_unit<M>(a, u, kparts, va);
  for (; u < units; u += 2 * warps) {
    const int u2 = u + warps;
    if (u2 < units) load_unit<M>(a, u2, kparts, vb);
    use_unit<M>(a, u, kparts, va, xs, sink);
    if (u2 >= units) break;
    const int u3 = u2 + warps;
    if (u3 < units) load_unit<M>(a, u3, kparts, va);
    use_unit<M>(a, u2, kparts, vb, xs, sink);
  }
  if (sink == 0x12345678u) a.sink[0] = sink;
}

// fp32 FMAs on the CUDA cores, the decode GEMV's pattern: a warp owns 2 rows for all of K; a lane reads 16 bytes
// of each row per step, 8 steps (4 KB of each row) in flight; the 8 inputs staged in shared memory.
__global__ void __launch_bounds__(128) fma_kernel(Args a) {
  extern __shared__ __align__(16) __half xs[];
  for (int i = threadIdx.x; i < NB * a.K / 8; i += blockDim.x)
    reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(a.x)[i];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * (blockDim.x / 32), wid = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  const int pairs = (a.rows + 1) / 2, steps = a.K / 256;
  for (int p = wid; p < pairs; p += warps) {
    const int r0 = 2 * p, r1 = min(2 * p + 1, a.rows - 1);
    float acc[2][NB];
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
      for (int j = 0; j < NB; j++) acc[r][j] = 0.f;
    for (int s0 = 0; s0 < steps; s0 += 8) {
      uint4 w[2][8];
#pragma unroll
      for (int s = 0; s < 8; s++) {
        const size_t col = (size_t)(s0 + s) * 256 + lane * 8;
        const bool ok = s0 + s < steps;
        w[0][s] = ok ? ldcs(a.W + (size_t)r0 * a.K + col) : make_uint4(0, 0, 0, 0);
        w[1][s] = ok ? ldcs(a.W + (size_t)r1 * a.K + col) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int s = 0; s < 8; s++) {
        if (s0 + s >= steps) break;
        const int col = (s0 + s) * 256 + lane * 8;
        float wf[2][8];
#pragma unroll
        for (int r = 0; r < 2; r++) {
          const __half2* h = reinterpret_cast<const __half2*>(&w[r][s]);
#pragma unroll
          for (int q = 0; q < 4; q++) {
            const float2 f = __half22float2(h[q]);
            wf[r][2 * q] = f.x, wf[r][2 * q + 1] = f.y;
          }
        }
#pragma unroll
        for (int j = 0; j < NB; j++) {
          const uint4 xv = *reinterpret_cast<const uint4*>(xs + (size_t)j * a.K + col);
          const __half2* xh = reinterpret_cast<const __half2*>(&xv);
#pragma unroll
          for (int q = 0; q < 4; q++) {
            const float2 xf = __half22float2(xh[q]);
#pragma unroll
            for (int r = 0; r < 2; r++) {
              acc[r][j] = fmaf(wf[r][2 * q], xf.x, acc[r][j]);
              acc[r][j] = fmaf(wf[r][2 * q + 1], xf.y, acc[r][j]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
      for (int j = 0; j < NB; j++) {
        float v = acc[r][j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        acc[r][j] = v;
      }
    if (lane < NB) {
      float v0 = 0.f, v1 = 0.f;
#pragma unroll
      for (int j = 0; j < NB; j++)
        if (j == lane) v0 = acc[0][j], v1 = acc[1][j];
      a.y[(size_t)lane * a.rows + r0] = v0;
      if (2 * p + 1 < a.rows) a.y[(size_t)lane * a.rows + r0 + 1] = v1;
    }
  }
}

struct Mat {
  __half* W;
  int rows, K;
};

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int layers = 22, shapes[4][2] = {{2560, 2048}, {2048, 2048}, {11264, 2048}, {2048, 5632}};
  std::vector<Mat> mats;
  size_t bytes = 0;
  for (int l = 0; l < layers; l++)
    for (auto& s : shapes) {
      Mat m{nullptr, s[0], s[1]};
      const size_t n = (size_t)m.rows * m.K;
      CK(cudaMalloc(&m.W, n * 2));
      CK(cudaMemset(m.W, 0x11, n * 2));  // fp16 0x1111: small finite values
      bytes += n * 2;
      mats.push_back(m);
    }
  __half* x;
  float* y;
  unsigned* sink;
  CK(cudaMalloc(&x, (size_t)NB * 5632 * 2));
  CK(cudaMemset(x, 0x11, (size_t)NB * 5632 * 2));
  CK(cudaMalloc(&y, (size_t)NB * 11264 * 4));
  CK(cudaMalloc(&sink, 4));
  const size_t xs_max = (size_t)NB * (5632 + XPAD) * 2;
  CK(cudaFuncSetAttribute(unit_kernel<MmaFrag>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)xs_max));
  CK(cudaFuncSetAttribute(fma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)xs_max));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

  struct Variant {
    const char* name;
    int mode;  // 0..3: unit_kernel modes, 4: fma
  };
  const Variant vars[] = {{"read/contig", 0}, {"read/frag", 1}, {"mma/frag", 2}, {"mma/frag-gx", 3}, {"fma/contig", 4}};
  for (int bps : {2, 3, 4}) {
    for (const Variant& v : vars) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (const Mat& m : mats) {
        Args a{m.W, m.rows, m.K, x, y, sink};
        const dim3 grid(sms * bps), block(128);
        const size_t xs = v.mode == 2 ? (size_t)NB * (m.K + XPAD) * 2 : v.mode == 4 ? (size_t)NB * m.K * 2 : 0;
        if (v.mode == 0) unit_kernel<ReadContig><<<grid, block, xs, st>>>(a);
        if (v.mode == 1) unit_kernel<ReadFrag><<<grid, block, xs, st>>>(a);
        if (v.mode == 2) unit_kernel<MmaFrag><<<grid, block, xs, st>>>(a);
        if (v.mode == 3) unit_kernel<MmaFragGx><<<grid, block, xs, st>>>(a);
        if (v.mode == 4) fma_kernel<<<grid, block, xs, st>>>(a);
      }
      CK(cudaStreamEndCapture(st, &graph));
      CK(cudaGraphInstantiate(&exec, graph, 0));
      for (int i = 0; i < 3; i++) CK(cudaGraphLaunch(exec, st));
      cudaEvent_t e0, e1;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      const int reps = 20;
      CK(cudaEventRecord(e0, st));
      for (int i = 0; i < reps; i++) CK(cudaGraphLaunch(exec, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      const double us = ms * 1000.0 / reps;
      std::printf("%-12s blocks/SM %d: %8.1f us per 88 products, %.2f TB/s\n", v.name, bps, us, bytes / us / 1e6);
      CK(cudaGraphExecDestroy(exec));
      CK(cudaGraphDestroy(graph));
    }
  }
  return 0;
}
