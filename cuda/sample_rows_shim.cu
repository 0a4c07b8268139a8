// sample_rows_shim.cu — TEMPORARY greedy stand-in for the contract's sample_rows (see sample_rows_shim.cuh).
// A block per row: argmax of the penalised logits, log-sum-exp of the raw ones, then top_k passes of a block
// argmax that skips the ids already taken (k <= 20: fine for a stand-in).
#include <cfloat>
#include <cstdint>

#include "common.cuh"
#include "sample_rows_shim.cuh"

namespace ti::cuda {

constexpr int kShimThreads = 512;

// Block argmax of f(i) over i < vocab, lowest id on ties; every thread gets (value, id).
template <typename F>
__device__ void block_argmax(int vocab, F f, float* sv, int* si, float& best, int& best_i) {
  float b = -FLT_MAX;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += kShimThreads) {
    const float v = f(i);
    if (v > b) { b = v; bi = i; }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, b, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > b || (ov == b && oi < bi)) { b = ov; bi = oi; }
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = b; si[threadIdx.x >> 5] = bi; }
  __syncthreads();
  b = sv[0];
  bi = si[0];
  for (int w = 1; w < kShimThreads / 32; w++)
    if (sv[w] > b || (sv[w] == b && si[w] < bi)) { b = sv[w]; bi = si[w]; }
  best = b;
  best_i = bi;
}

__global__ void __launch_bounds__(kShimThreads)
    sample_rows_shim_kernel(const float* logits, int64_t ld, int vocab, const RowSampling* rows, unsigned char* seen,
                            int* counts, int top_k, int* out_tokens, float* out_logprob, int* top_ids, float* top_lp) {
  __shared__ float sv[32], red[33];
  __shared__ int si[32], taken[32];
  const int r = blockIdx.x;
  const float* z = logits + (size_t)r * ld;
  const RowSampling rs = rows[r];
  unsigned char* sn = seen + (size_t)rs.slot * vocab;
  const float pen = rs.s.repetition_penalty;
  float best, mx;
  int tok, mx_i;
  block_argmax(vocab, [&](int i) {
    const float l = z[i];
    return pen == 1.0f || !sn[i] ? l : (l > 0.0f ? l / pen : l * pen);
  }, sv, si, best, tok);
  block_argmax(vocab, [&](int i) { return z[i]; }, sv, si, mx, mx_i);
  float e = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += kShimThreads) e += __expf(z[i] - mx);
  const float lse = mx + __logf(block_sum(e, red));
  for (int j = 0; j < top_k; j++) {
    float v;
    int id;
    block_argmax(vocab, [&](int i) {
      for (int t = 0; t < j; t++)
        if (taken[t] == i) return -FLT_MAX;
      return z[i];
    }, sv, si, v, id);
    __syncthreads();
    if (threadIdx.x == 0) {
      taken[j] = id;
      top_ids[(size_t)r * top_k + j] = id;
      top_lp[(size_t)r * top_k + j] = v - lse;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out_tokens[r] = tok;
    out_logprob[r] = z[tok] - lse;
    sn[tok] = 1;
    counts[(size_t)rs.slot * vocab + tok] += 1;
  }
}

void sample_rows(const float* logits, int64_t ld, int n_rows, int vocab, const RowSampling* rows,
                 unsigned char* seen, int* counts, float* scratch, int top_k, int* out_tokens, float* out_logprob,
                 int* top_ids, float* top_lp, cudaStream_t stream) {
  (void)scratch;
  if (n_rows < 1) return;
  if (top_k < 0 || top_k > 20) fail(ErrorKind::Request, "sample_rows: top_k must be 0..20");
  launch(sample_rows_shim_kernel, dim3(n_rows), dim3(kShimThreads), 0, stream, false, logits, ld, vocab, rows, seen,
         counts, top_k, out_tokens, out_logprob, top_ids, top_lp);
}

}  // namespace ti::cuda
