// stream_chain.cu — the floor of the graph path's structure: what a decode step's GEMVs would cost if each were a
// perfect stream (no dot products, no reduction; with `dep`, the GEMV's input dependency kept), one kernel per
// matrix, chained as in the step.
// A standalone micro-benchmark (not part of the engine):
//
//   nvcc -std=c++17 -O3 -arch=sm_90 bench/tools/stream_chain.cu -o /tmp/chain && /tmp/chain [NAME-PART]
//   (NAME-PART: only the models whose name contains it, e.g. "tinyllama-1.1b"; ~20 s for all on the H200)
//
// Why: a TinyLlama fp16 layer's four GEMVs take ~27 µs in the step for ~19.5 µs of bytes at the read bandwidth,
// and the fp16 target leaves the layer ~26 µs (docs/perf/persistent.md §21, §29). If four plain streams of the
// same sizes, chained the same way, cannot go below the target's budget either, no GEMV body can, and the gap is
// the chain's; if they can, the GEMVs' own work holds the difference.
//
// Each model's layers as stored (qkv, o, gate_up, down; the bytes of its format), every matrix its own buffer
// (the whole set far past the L2), one kernel per matrix captured in a graph and replayed. A kernel's blocks each
// stream a contiguous share of its matrix, 256 threads, U 16-byte loads per thread in flight (the next round's
// issued before the current one is consumed). Variants:
//   pdl 0  plain stream order (each kernel starts when the previous has ended)
//   pdl 1  programmatic dependent launch as in the decode step: a kernel's blocks launch when the previous kernel
//          has triggered, issue their first round of loads, then wait (griddepcontrol.wait) for it to complete;
//          they trigger their own dependents right after the wait
//   pdl 2  the same, triggering at the kernel's start (`early_trigger`)
//   dep 0  a pure stream: nothing flows from one kernel to the next
//   dep 1  the GEMV's data dependency without its arithmetic: after the wait every block stages the previous
//          kernel's output (the matrix's input vector: fp32 for qkv and gate_up, fp16 for o and down) in shared
//          memory and passes a barrier before it consumes a weight; each round mixes a word of it in; at the end
//          each block writes its share of the output vector (the next kernel's input)
//   dep 2  dep 1 plus, for the normed inputs (qkv, gate_up), a block-wide sum of squares of the staged input (the
//          RMSNorm's statistic: a second barrier)
//   dep 3  dep 2 with the next round of weights issued right after the wait, before the staging (so the block has
//          loads in flight while it waits for its input)
//   dep 4  dep 2 with that round's lines asked into the L2 instead (prefetch.global.L2: no registers held)
//   dep 5  dep 2 with the input staged by one bulk copy (cp.async.bulk global -> shared, issued by one thread,
//          completion on an mbarrier) instead of every thread's L2 loads and shared stores: the copy engine's
//          path, not behind the weights the block's threads asked for before the wait (sm_90)
//   dep 6  dep 1 with no staging at all: each round reads its input word from the L2 where it uses it (no
//          barrier; the normed inputs' statistic is not computed: compare with dep 1)
//   dep 7  dep 6 plus, for the normed inputs, each warp's own sum of squares over the whole input (read from the
//          L2 by the warp, reduced by shuffles: no block barrier; compare with dep 2)
//   dep 8  dep 7 with the input read at a GEMV's rate: U / 2 words a round through the L1 (a row-per-warp GEMV at
//          R = 2 meets a 16-byte input word per two weight words)
//   dep 9  dep 6 plus, for the normed inputs, the statistic from the producer: every block of the kernel before
//          (o, down: the residual stream's writers) sums its share's squares (a block barrier at its end) and
//          stores one partial; after the wait each warp of the consumer reads the producer's partials and sums
//          them after its weights (a GEMV needs the statistic only to scale its row sums at the end; no block
//          barrier; compare with dep 2 and dep 7)
//   dep 10 dep 1 (staged) with dep 9's partials for the normed inputs: the block still stages its input, but
//          the statistic's reads go out with the staging's and no second barrier follows (compare with dep 2)
//   room   0: the driver's carveout; 1: no room on an SM for the next kernel's blocks; 2: 1's control (see
//          fill_smem)
//   mlp    (second argument `mlp`: only these) 0: the four kernels above; 1-3: three kernels a layer, gate_up and
//          down as one kernel split over the intermediate dimension (each block streams its share of gate_up's
//          rows and of down stored transposed, and adds a partial of the whole hidden vector into the next
//          input): 1 by fp32 vector atomics (float4), 2 by 64-bit integer atomics on a fixed-point copy (the
//          deterministic form: integer addition does not depend on the order; the next kernel stages twice the
//          words), 3 no atomics (the block writes its share as a GEMV block does: the floor of the merge alone)
// and the grid: 1, 2 or 4 blocks per SM. Printed: µs a layer (the best of 20 replays), against the layer's bytes
// at the best rate any chain reached in this run (the read bandwidth).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ck.cuh"

constexpr int kThreads = 256;
constexpr int kMaxIn = 2048;  // 16-byte words of a staged input (Llama-2-7B's fixed-point hidden: 2,048)

struct Args {
  const uint4* w;
  size_t n_vec;      // the matrix, 16-byte words
  const uint4* in;   // the previous kernel's output
  uint4* out;
  int in_vec, out_vec;
  int pdl, dep;      // see the header
  int norm;          // 1: the input is a normed one (dep >= 2 sums its squares after staging it)
  float* part_out;        // dep 9: this kernel's per-block partial sums of squares (when the next input is normed)
  const float* part_in;   // the previous kernel's
  int part_n;             // how many it wrote (its grid)
  int atomic;             // mlp 1 / 2: every block adds a whole vector of `red_n` values into `out`
  int red_n;
};

template <int U>
__device__ __forceinline__ void load_round(const uint4* w, size_t i, size_t end, uint4 (&v)[U]) {
#pragma unroll
  for (int u = 0; u < U; u++) {
    const size_t j = i + (size_t)u * kThreads;
    v[u] = j < end ? __ldcs(w + j) : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int U, int DEP>  // 0: dep 0; 1: dep 1 and 2; 3-10: dep 3-10 (each its own instance: its own registers)
__global__ void __launch_bounds__(kThreads) chain_stream(Args a) {
  __shared__ __align__(16) uint4 xs[DEP && (DEP < 6 || DEP == 10) ? kMaxIn : 1];
  __shared__ float red[kThreads / 32];
  __shared__ __align__(8) unsigned long long bar;  // dep 5: the bulk copy's completion
  if (a.pdl == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const size_t share = (a.n_vec + gridDim.x - 1) / gridDim.x;
  const size_t begin = min(a.n_vec, (size_t)blockIdx.x * share), end = min(a.n_vec, begin + share);
  constexpr size_t kRound = (size_t)U * kThreads;
  size_t i = begin + threadIdx.x;
  uint4 cur[U], nxt[U];
  load_round<U>(a.w, i, end, cur);  // before the wait: weights do not depend on the previous kernel
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (DEP == 5) {  // before the wait: the barrier does not depend on the previous kernel
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar)));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
  }
#endif
  if (a.pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (a.pdl == 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  uint32_t acc = 0;
  bool issued = false;
  if constexpr (DEP == 3) {  // the next round in flight during the staging
    load_round<U>(a.w, i + kRound, end, nxt);
    issued = true;
  } else if constexpr (DEP == 4) {  // its lines asked into the L2 instead (no registers held)
#pragma unroll
    for (int u = 0; u < U; u++) {
      const size_t j = i + kRound + (size_t)u * kThreads;
      if (j < end) asm volatile("prefetch.global.L2 [%0];" ::"l"(a.w + j));
    }
  }
  if constexpr (DEP >= 7) {  // the warp's own statistic of a normed input: no block barrier
    if (a.norm) {
      float ss = 0.0f;
      for (int k = threadIdx.x & 31; k < a.in_vec; k += 32) {
        const uint4 v = __ldcg(a.in + k);
        const float4 f = *reinterpret_cast<const float4*>(&v);
        ss += f.x * f.x + f.y * f.y + f.z * f.z + f.w * f.w;
      }
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      acc ^= __float_as_uint(rsqrtf(ss + 1.0f));
    }
  }
  float stat = 0.0f;  // dep 9: the statistic is used at the end (a GEMV scales its row sums by it), so its reads
  if constexpr (DEP == 9 || DEP == 10) {  // are issued here and waited for only after the weights (dep 10:
    if (a.norm)                           // after the staging's loads): one read a lane per 32, plain
      for (int k = threadIdx.x & 31; k < a.part_n; k += 32) stat += a.part_in[k];  // (the L1 serves the warps)
  }
  if (DEP == 10) {  // staged as dep 1; the statistic from the partials before the one barrier
#pragma unroll 2
    for (int k = threadIdx.x; k < a.in_vec; k += kThreads) xs[k] = __ldcg(a.in + k);
    if (a.norm) {
      for (int o = 16; o > 0; o >>= 1) stat += __shfl_xor_sync(0xffffffffu, stat, o);
      acc ^= __float_as_uint(rsqrtf(stat + 1.0f));
    }
    __syncthreads();
  }
  if (DEP && DEP < 6) {
    // The input: read with L2 loads (produced data; not the read-only path) into shared memory, then, for the
    // normed inputs at dep 2, the block's sum of squares, as the GEMV's prologue does before it consumes a weight.
    if constexpr (DEP == 5) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      const uint32_t b = smem_u32(&bar), bytes = (uint32_t)a.in_vec * 16u;
      if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_u32(xs)), "l"(a.in), "r"(bytes), "r"(b) : "memory");
      }
      uint32_t done = 0;
      do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done) : "r"(b), "r"(0u) : "memory");
      } while (!done);
#endif
    } else {
#pragma unroll 2
      for (int k = threadIdx.x; k < a.in_vec; k += kThreads) xs[k] = __ldcg(a.in + k);
      __syncthreads();
    }
    if (a.dep >= 2 && a.norm) {
      float ss = 0.0f;
      for (int k = threadIdx.x; k < a.in_vec; k += kThreads) {
        const float4 f = *reinterpret_cast<const float4*>(&xs[k]);
        ss += f.x * f.x + f.y * f.y + f.z * f.z + f.w * f.w;
      }
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
      __syncthreads();
      float tot = 0.0f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; w++) tot += red[w];
      acc ^= __float_as_uint(rsqrtf(tot + 1.0f));
    }
  }
  int r = 0;
  for (; i < end; i += kRound, r++) {
    if (!issued) load_round<U>(a.w, i + kRound, end, nxt);
    issued = false;
    if (DEP == 6 || DEP == 7 || DEP == 9) {
      acc ^= __ldcg(&a.in[(threadIdx.x + r) % a.in_vec].x);
    } else if (DEP == 8) {
#pragma unroll
      for (int u = 0; u < U / 2; u++) {
        const uint4 v = a.in[(threadIdx.x + (r * U / 2 + u) * kThreads) % a.in_vec];  // plain loads: the L1
        acc ^= v.x ^ v.w;
      }
    } else if (DEP) {  // dep 1-5, 10: the staged input
      acc ^= xs[(threadIdx.x + r) % a.in_vec].x;
    }
#pragma unroll
    for (int u = 0; u < U; u++) acc ^= cur[u].x ^ cur[u].y ^ cur[u].z ^ cur[u].w;
#pragma unroll
    for (int u = 0; u < U; u++) cur[u] = nxt[u];
  }
  if (DEP == 9 && a.norm) {
    for (int o = 16; o > 0; o >>= 1) stat += __shfl_xor_sync(0xffffffffu, stat, o);
    acc ^= __float_as_uint(rsqrtf(stat + 1.0f));
  }
  if (DEP && a.atomic == 1) {  // the split MLP: a partial of every hidden value, fp32 vector atomics
    float4* o4 = reinterpret_cast<float4*>(a.out);
    const float f = __uint_as_float(acc & 0x3f800000u);
    for (int k = threadIdx.x; k < a.red_n / 4; k += kThreads) atomicAdd(o4 + k, make_float4(f, f, f, f));
  } else if (DEP && a.atomic == 2) {  // the same on a fixed-point copy: deterministic
    unsigned long long* o8 = reinterpret_cast<unsigned long long*>(a.out);
    for (int k = threadIdx.x; k < a.red_n; k += kThreads) atomicAdd(o8 + k, (unsigned long long)(acc & 0xffffu));
  } else if (DEP) {  // this block's share of the output vector (as a GEMV block stores its rows)
    const int os = (a.out_vec + gridDim.x - 1) / gridDim.x;
    for (int k = blockIdx.x * os + threadIdx.x; k < min(a.out_vec, (int)(blockIdx.x + 1) * os); k += kThreads)
      a.out[k] = make_uint4(acc & 0x3f800000u, 0x3f800000u, 0x3f800000u, 0x3f800000u);  // finite floats / halves
    if ((DEP == 9 || DEP == 10) && !a.norm) {  // o, down: the block's partial of the next (normed) input's statistic
      float ss = __uint_as_float(acc & 0x3f800000u);
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
      __syncthreads();
      if (threadIdx.x == 0) {
        float tot = 0.0f;
#pragma unroll
        for (int w = 0; w < kThreads / 32; w++) tot += red[w];
        a.part_out[blockIdx.x] = tot;
      }
    }
  } else if (acc == 0x9e3779b9u) {
    a.out[blockIdx.x] = make_uint4(acc, 0, 0, 0);  // never in practice; keeps the loads
  }
}

using KernelFn = void (*)(Args);
template <int U>
KernelFn kernel_for_u(int dep) {
  if (dep == 0) return chain_stream<U, 0>;
  switch (dep) {
    case 3: return chain_stream<U, 3>;
    case 4: return chain_stream<U, 4>;
    case 5: return chain_stream<U, 5>;
    case 6: return chain_stream<U, 6>;
    case 7: return chain_stream<U, 7>;
    case 8: return chain_stream<U, 8>;
    case 9: return chain_stream<U, 9>;
    case 10: return chain_stream<U, 10>;
  }
  return chain_stream<U, 1>;  // dep 1 and 2: one kernel, the sum of squares chosen at run time
}
KernelFn kernel_for(int U, int dep) {
  return U == 4 ? kernel_for_u<4>(dep) : U == 8 ? kernel_for_u<8>(dep) : kernel_for_u<16>(dep);
}

void launch(KernelFn fn, int blocks, int smem, bool max_shared, const Args& a, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (a.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (max_shared) {
    attr[n].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
    attr[n++].val.sharedMemCarveout = 100;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  CK(cudaLaunchKernelEx(&cfg, fn, a));
}

// room 1: the largest dynamic shared memory at which `bps` blocks still fit an SM, so that no block of the next
// kernel can start before one of this kernel's leaves (as with the GEMVs' ~100 registers a thread at 2 a SM).
// Filling the shared memory also shrinks the L1 (one 256 KB array), which holds the loads in flight, so room 2 is
// the control: the same all-shared carveout, no dynamic shared memory (room for the next kernel's blocks).
int fill_smem(KernelFn fn, int bps) {
  CK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  int found = 0;
  for (int kb = 200; kb > 0 && !found; kb--) {  // (room runs 2 a SM: far below the 227 KB a block may take)
    CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kb * 1024));
    int n = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, kThreads, kb * 1024));
    if (n >= bps) found = kb * 1024;
  }
  CK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, -1));
  return found;
}

// A layer's four matrices: qkv (Q x H, normed fp32 input), o (H x H, fp16 input), gate_up (2I x H, normed),
// down (H x I, fp16 input); `per32` the bytes of 32 weights in the format (fp16 64, int8 34, int4 20:
// cpp/core/quant.h); `only` >= 0: that matrix alone, 4 x layers times (each size's own floor a kernel).
struct Model {
  const char* name;
  int layers, H, Q, I, per32, only;
};
struct Mat {
  size_t n_vec;
  int in_vec, out_vec, norm;
};
std::vector<Mat> layer_of(const Model& m, int mlp = 0) {
  auto words = [&](double rows, double k) { return ((size_t)(rows * k / 32 * m.per32) + 255) / 256 * 16; };
  std::vector<Mat> all = {{words(m.Q, m.H), m.H / 4, m.Q / 4, 1},
                          {words(m.H, m.H), m.H / 8, m.H / 4, 0},
                          {words(2 * m.I, m.H), m.H / 4, m.I / 8, 1},
                          {words(m.H, m.I), m.I / 8, m.H / 4, 0}};
  if (mlp) {  // gate_up and down as one kernel; its output (and qkv's input) the hidden vector, fixed-point at 2
    const int hid = mlp == 2 ? m.H / 2 : m.H / 4;
    return {{words(m.Q, m.H), hid, m.Q / 4, 1},
            {words(m.H, m.H), m.H / 8, m.H / 4, 0},
            {words(2 * m.I, m.H) + words(m.H, m.I), m.H / 4, hid, 1}};
  }
  if (m.only < 0) return all;
  return std::vector<Mat>(4, all[m.only]);
}

int main(int argc, char** argv) {
  const char* only = argc > 1 && argv[1][0] ? argv[1] : nullptr;  // the models whose name contains this
  const bool mlp_only = argc > 2 && !std::strcmp(argv[2], "mlp");      // the mlp comparison alone
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::vector<Model> models = {
      {"tinyllama-1.1b fp16", 22, 2048, 2560, 5632, 64, -1},
      {"tinyllama-1.1b int8", 22, 2048, 2560, 5632, 34, -1},
      {"tinyllama-1.1b int4", 22, 2048, 2560, 5632, 20, -1},
      {"smollm2-135m fp16", 30, 576, 960, 1536, 64, -1},
      {"smollm2-360m fp16", 32, 960, 1600, 2560, 64, -1},
      {"llama2-7b fp16", 32, 4096, 12288, 11008, 64, -1},
      {"llama2-7b int4", 32, 4096, 12288, 11008, 20, -1},
      {"tinyllama qkv alone", 22, 2048, 2560, 5632, 64, 0},
      {"tinyllama o alone", 22, 2048, 2560, 5632, 64, 1},
      {"tinyllama gate_up alone", 22, 2048, 2560, 5632, 64, 2},
      {"tinyllama down alone", 22, 2048, 2560, 5632, 64, 3},
  };
  size_t max_total = 0;
  for (auto& m : models) {
    size_t t = 0;
    for (const Mat& x : layer_of(m)) t += x.n_vec;
    max_total = std::max(max_total, t * m.layers * 16);
  }
  uint4 *buf = nullptr, *vec = nullptr;
  CK(cudaMalloc(&buf, max_total));
  CK(cudaMemset(buf, 1, max_total));
  CK(cudaMalloc(&vec, 2 * kMaxIn * 4 * 16));  // the ping-pong input / output vectors
  CK(cudaMemset(vec, 0, 2 * kMaxIn * 4 * 16));
  constexpr int kMaxPart = 4 * 256;  // dep 9's partials: a grid's worth (<= 4 blocks a SM), ping-pong
  float* part = nullptr;
  CK(cudaMalloc(&part, 2 * kMaxPart * sizeof(float)));
  CK(cudaMemset(part, 0, 2 * kMaxPart * sizeof(float)));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  struct Row {
    const Model* m;
    double mb;
    int pdl, dep, bps, U, room, mlp;
    double us;
  };
  std::vector<Row> rows;
  double best_gbs = 0;
  for (auto& m : models) {
    if (only && !std::strstr(m.name, only)) continue;
    for (int mlp : {0, 1, 2, 3})
    for (int pdl : {0, 1, 2})
      for (int dep : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10})
        for (int bps : {1, 2, 4})
          for (int U : {4, 8, 16})
            for (int room : {0, 1, 2}) {
            if (pdl == 0 && dep > 0) continue;  // without PDL a dependency costs nothing extra to measure
            if ((mlp || mlp_only) && (pdl == 0 || (dep != 2 && dep != 7) || room || U == 4)) continue;
            if (mlp && (!mlp_only || m.only >= 0)) continue;
            const std::vector<Mat> layer = layer_of(m, mlp);
            double mb = 0;
            for (const Mat& x : layer) mb += x.n_vec * 16 / 1e6;
            if (pdl == 2 && bps == 4) continue;  // early triggers need room on the SM for the next kernel's blocks
            if (room && (pdl == 0 || bps != 2 || U == 4 || dep == 1 || dep >= 3)) continue;
            const int smem = room == 1 ? fill_smem(kernel_for(U, dep), bps) : 0;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            size_t off = 0;
            int k = 0;
            for (int l = 0; l < m.layers; l++)
              for (const Mat& x : layer) {
                Args a{buf + off, x.n_vec, vec + (k % 2) * kMaxIn * 4, vec + ((k + 1) % 2) * kMaxIn * 4,
                       x.in_vec, x.out_vec, pdl, dep, x.norm, part + (k + 1) % 2 * kMaxPart,
                       part + k % 2 * kMaxPart, sms * bps, 0, 0};
                if (mlp && mlp < 3 && &x == &layer.back()) {  // the split MLP adds into the next input
                  a.atomic = mlp;
                  a.red_n = m.H;
                }
                launch(kernel_for(U, dep), sms * bps, smem, room > 0, a, s);
                off += x.n_vec;
                k++;
              }
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            float t = 1e30f;
            for (int it = 0; it < 23; it++) {
              CK(cudaEventRecord(e0, s));
              CK(cudaGraphLaunch(ge, s));
              CK(cudaEventRecord(e1, s));
              CK(cudaEventSynchronize(e1));
              float ms = 0;
              CK(cudaEventElapsedTime(&ms, e0, e1));
              if (it >= 3) t = std::min(t, ms);
            }
            rows.push_back({&m, mb, pdl, dep, bps, U, room, mlp, t * 1e3 / m.layers});
            best_gbs = std::max(best_gbs, mb * 1e6 / (t * 1e3 / m.layers * 1e-6) / 1e9);
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
            }
  }
  std::printf("read bandwidth (the best chain's rate) %.0f GB/s, %d SMs; registers a thread (U 4 / 8 / 16 at", best_gbs,
              sms);
  for (int dep : {0, 1, 3, 4, 5, 6, 7, 8, 9, 10})
    for (int U : {4, 8, 16}) {
      cudaFuncAttributes fa;
      CK(cudaFuncGetAttributes(&fa, kernel_for(U, dep)));
      std::printf(" %d", fa.numRegs);
    }
  std::printf(" (dep 0, dep 1-2, dep 3-10)\n");
  std::printf("%-24s %6s %3s %3s %3s %3s %4s %3s %9s %9s %7s\n", "model", "MB", "pdl", "dep", "bps", "U", "room",
              "mlp", "us/layer", "bytes us", "x bytes");
  for (const Row& r : rows) {
    const double bytes_us = r.mb * 1e6 / (best_gbs * 1e9) * 1e6;
    std::printf("%-24s %6.1f %3d %3d %3d %3d %4d %3d %9.2f %9.2f %7.3f\n", r.m->name, r.mb, r.pdl, r.dep, r.bps, r.U,
                r.room, r.mlp, r.us, bytes_us, r.us / bytes_us);
  }
  std::printf("(MB: a layer's four matrices; us/layer: the chain's replay / layers, best of 20)\n");
  return 0;
}
