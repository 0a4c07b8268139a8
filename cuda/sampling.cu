// sampling.cu — choosing the next token on the GPU, so the whole decode step stays in one graph.
//
// One block of 1024 threads over the vocabulary. Order as the CPU reference (cpp/core/sampling.*): repetition
// penalty -> temperature -> top-k -> top-p -> min-p -> draw with uniform(seed, step) (cpp/core/rng.h).
//   greedy (temperature 0): argmax, lowest id on ties — the same token the CPU picks from the same logits.
//   sampling: p_i = exp((z_i - max) / T) in scratch; the cut-offs are found as thresholds on p by a bitwise
//   search over the float bits (31 block reductions each: positive floats order like their bit patterns):
//   top-k keeps the tokens with p >= the k-th largest p (ties at the threshold kept), top-p the largest
//   threshold whose kept mass is >= top_p, min-p p >= min_p (max p is 1). The draw walks the kept tokens in
//   id order (a block scan), not in probability order as the CPU does: the same distribution, not the same
//   token for a given seed.
#include <cfloat>

#include "../cpp/core/rng.h"
#include "common.cuh"
#include "sampling.cuh"

namespace ti::cuda {

constexpr int kSampleThreads = 1024;

__device__ __forceinline__ float penalised(const float* logits, const unsigned char* seen, float pen, int i) {
  const float l = logits[i];
  if (pen == 1.0f || !seen[i]) return l;
  return l > 0.0f ? l / pen : l * pen;
}

// Sum (or count) over the kept tokens p >= t, given as bit patterns.
__device__ float kept_sum(const float* p, int vocab, unsigned t, bool count, float* red) {
  float s = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += kSampleThreads) {
    const float v = p[i];
    if (__float_as_uint(v) >= t) s += count ? 1.0f : v;
  }
  return block_sum(s, red);
}

// Largest threshold (bit pattern) t with kept_sum(t) >= target.
__device__ unsigned search_threshold(const float* p, int vocab, float target, bool count, float* red) {
  unsigned t = 0;
  for (int bit = 30; bit >= 0; bit--) {
    const unsigned cand = t | (1u << bit);
    if (kept_sum(p, vocab, cand, count, red) >= target) t = cand;
  }
  return t;
}

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* logits, int vocab, const DeviceSampling* spp, unsigned char* seen, float* p,
                  DecodeState* st, int* out_tokens) {
  __shared__ float red[33];
  __shared__ float part[kSampleThreads];
  __shared__ int chosen;
  pdl_wait();
  pdl_launch_dependents();
  const DeviceSampling sp = *spp;
  const int tid = threadIdx.x;

  // ---- max of the penalised logits (and its lowest index: the greedy choice) ----
  float best = -FLT_MAX;
  int best_i = 0x7fffffff;
  for (int i = tid; i < vocab; i += kSampleThreads) {
    const float v = penalised(logits, seen, sp.repetition_penalty, i);
    if (v > best) { best = v; best_i = i; }  // strided: the first hit per thread has the lowest id
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
  }
  __shared__ float wbest[32];
  __shared__ int wbest_i[32];
  if ((tid & 31) == 0) { wbest[tid >> 5] = best; wbest_i[tid >> 5] = best_i; }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kSampleThreads / 32; w++)
      if (wbest[w] > wbest[0] || (wbest[w] == wbest[0] && wbest_i[w] < wbest_i[0])) {
        wbest[0] = wbest[w];
        wbest_i[0] = wbest_i[w];
      }
    chosen = wbest_i[0];
  }
  __syncthreads();

  if (sp.temperature > 0.0f) {
    const float mx = wbest[0], inv_t = 1.0f / sp.temperature;
    float z = 0.0f;
    for (int i = tid; i < vocab; i += kSampleThreads) {
      const float v = __expf((penalised(logits, seen, sp.repetition_penalty, i) - mx) * inv_t);
      p[i] = v;
      z += v;
    }
    z = block_sum(z, red);  // also orders the writes of p before the reads below
    unsigned t = 0;
    if (sp.top_k > 0 && sp.top_k < vocab) t = max(t, search_threshold(p, vocab, (float)sp.top_k, true, red));
    if (sp.top_p < 1.0f) t = max(t, search_threshold(p, vocab, sp.top_p * z, false, red));
    if (sp.min_p > 0.0f) t = max(t, __float_as_uint(sp.min_p));  // the max p is exp(0) = 1
    // draw: u in [0, kept mass); the kept token where the id-ordered prefix sum passes u
    const int per = (vocab + kSampleThreads - 1) / kSampleThreads, lo = tid * per, hi = min(lo + per, vocab);
    float s = 0.0f;
    for (int i = lo; i < hi; i++)
      if (__float_as_uint(p[i]) >= t) s += p[i];
    part[tid] = s;
    __syncthreads();
    if (tid == 0) {  // serial scan over 1024 partial sums: ~1 µs, once per token
      float acc = 0.0f;
      for (int i = 0; i < kSampleThreads; i++) { const float v = part[i]; part[i] = acc; acc += v; }
      red[0] = acc;
    }
    __syncthreads();
    const float u = uniform_from_counter(sp.seed, (unsigned long long)st->step) * red[0];
    __syncthreads();
    if (tid == 0) chosen = -1;
    __syncthreads();
    if (u >= part[tid] && u < part[tid] + s) {
      float acc = part[tid];
      int last = -1;
      for (int i = lo; i < hi; i++) {
        if (__float_as_uint(p[i]) < t) continue;
        last = i;
        acc += p[i];
        if (u < acc) break;
      }
      atomicMax(&chosen, last);  // rounding at a boundary could land in two threads: take one
    }
    __syncthreads();
    if (tid == 0 && chosen < 0) chosen = wbest_i[0];  // (cannot happen unless the sums are NaN)
    __syncthreads();
  }

  if (tid == 0) {
    const int tok = chosen;
    out_tokens[st->step - st->step_base] = tok;
    st->token = tok;
    st->pos += 1;
    st->step += 1;
    seen[tok] = 1;
  }
}

void sample_token(const float* logits, int vocab, const DeviceSampling* sp, unsigned char* seen, float* scratch,
                  DecodeState* st, int* out_tokens, cudaStream_t stream, bool pdl) {
  launch(sample_kernel, dim3(1), dim3(kSampleThreads), 0, stream, pdl, logits, vocab, sp, seen, scratch, st,
         out_tokens);
}

}  // namespace ti::cuda
