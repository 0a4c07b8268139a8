// sampling.cu — choosing the next token on the GPU, so the whole decode step stays in one graph.
//
// One block of 1024 threads per row of logits; one device function (sample_block) serves the single-sequence
// sampler (sample_token, in the decode graph) and the batched one (sample_rows), so the same logits and history
// give the same token alone and in a batch. Order as the CPU reference (cpp/core/sampling.*): logit bias ->
// repetition penalty -> presence / frequency penalties (cpp/core/penalty.h, shared with the CPU: bit-identical
// penalised logits) -> temperature -> top-k -> top-p -> min-p -> draw with uniform(seed, step) (cpp/core/rng.h).
//   greedy (temperature 0): argmax, lowest id on ties — the same token the CPU picks from the same logits.
//   sampling: p_i = exp((z_i - max) / T) in scratch; the cut-offs are found as thresholds on p by a bitwise
//   search over the float bits (31 block reductions each: positive floats order like their bit patterns):
//   top-k keeps the tokens with p >= the k-th largest p (ties at the threshold kept), top-p the largest
//   threshold whose kept mass is >= top_p, min-p p >= min_p (max p is 1). The draw walks the kept tokens in
//   id order (a block scan), not in probability order as the CPU does: the same distribution, not the same
//   token for a given seed.
// An allowed-token mask (structured outputs) is read where the logits are: a token whose bit is 0 reads as -inf in
// every pass that chooses (never in the log-probabilities). The logit bias is added to the logits in place, one
// entry a thread (its ids are distinct), and taken off again when the token is chosen: every pass over the
// logits, the vectorized greedy one included, sees it for free.
// Log-probabilities (sample_rows only) are of the RAW logits: one online-softmax pass (per-thread running max
// and sum) gives log-sum-exp. The top entries: the k-th largest of the 1024 per-thread maxima is a threshold
// with at least k logits at or above it; those (usually few) are gathered into shared memory and k rounds of a
// block argmax over them, each excluding what the rounds before took, give the entries in order (value
// descending, lower id first). If too many logits tie at the threshold to gather, the rounds run over the whole
// row instead (slower, same result).
#include <cfloat>
#include <climits>
#include <cstdint>

#include "../cpp/core/penalty.h"
#include "../cpp/core/rng.h"
#include "common.cuh"
#include "sampling.cuh"

namespace ti::cuda {

constexpr int kSampleThreads = 1024;
constexpr int kCandidates = 2048;  // gathered top-entry candidates (shared memory)
constexpr int kLogitVec = 8;        // 16-byte logit loads in flight a thread (1,024 threads: 64 registers each)
static_assert(kMaxLogitBias <= kSampleThreads, "one logit-bias entry a thread");

struct SampleShared {
  float red[33];
  float part[kSampleThreads];
  float wv[32];
  int wi[32];
  float best_v;
  int best_i;
  int chosen;
  int n_cand;
  float cand_v[kCandidates];
  int cand_i[kCandidates];
};

// The order of tokens: larger value first, then lower id. (INT_MAX ids are "none": after every real token.)
__device__ __forceinline__ bool before(float av, int ai, float bv, int bi) {
  return av > bv || (av == bv && ai < bi);
}

// The first (value, id) in that order over the block's candidates, one per thread; every thread gets it.
__device__ __forceinline__ void block_first(float v, int i, SampleShared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (before(ov, oi, v, i)) { v = ov; i = oi; }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sh.wv[warp] = v; sh.wi[warp] = i; }
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? sh.wv[lane] : -INFINITY;
    i = lane < (int)(blockDim.x >> 5) ? sh.wi[lane] : INT_MAX;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (before(ov, oi, v, i)) { v = ov; i = oi; }
    }
    if (lane == 0) { sh.best_v = v; sh.best_i = i; }
  }
  // Callers read best_v / best_i right after: the next call rewrites them only after its first barrier, which
  // every thread reaches after its read (and warp 0 read wv before the barrier above).
  __syncthreads();
}

struct Penalties {
  const unsigned char* seen;
  const int* counts;
  const unsigned* allowed;  // null: every token
  float rep, presence, frequency;
  bool on_seen, on_counts;
  __device__ Penalties(const DeviceSampling& sp, const unsigned char* s, const int* c, const unsigned* mask)
      : seen(s), counts(c), allowed(sp.has_mask ? mask : nullptr), rep(sp.repetition_penalty),
        presence(sp.presence_penalty), frequency(sp.frequency_penalty), on_seen(sp.repetition_penalty != 1.0f),
        on_counts(sp.presence_penalty != 0.0f || sp.frequency_penalty != 0.0f) {}
  __device__ bool plain() const { return !on_seen && !on_counts && !allowed; }
  // The penalised logit of token i (the history is read only when its penalty is on, as the CPU does); -inf where
  // the mask does not allow it (the CPU's order: the mask first, and -inf stays -inf through the rest).
  __device__ __forceinline__ float operator()(const float* logits, int i) const {
    if (allowed && !((__ldg(allowed + (i >> 5)) >> (i & 31)) & 1u)) return -INFINITY;
    const float l = logits[i];
    if (!on_seen && !on_counts) return l;
    return penalise_logit(l, on_seen && seen[i], on_counts ? counts[i] : 0, rep, presence, frequency);
  }
};

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

// The token of one row (every thread gets it). p: float[vocab] scratch.
__device__ __forceinline__ int sample_block(const float* logits, int vocab, const DeviceSampling& sp,
                                            unsigned long long step, const unsigned char* seen, const int* counts,
                                            const unsigned* mask, float* p, SampleShared& sh) {
  const int tid = threadIdx.x;
  const Penalties pen(sp, seen, counts, mask);

  // ---- max of the penalised logits (and its lowest index: the greedy choice) ----
  float best = -INFINITY;
  int best_i = INT_MAX;
  if (pen.plain() && vocab % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0) {
    // Without penalties: 16-byte loads, kLogitVec a thread issued before any compare (32,000 logits: one round
    // trip, where the scalar loop below took two and more). `before` is a total order on (value, id) that never
    // takes a NaN, so the block's first is the same whichever thread saw which logit.
    const float4* l4 = reinterpret_cast<const float4*>(logits);
    const int n4 = vocab / 4;
    for (int j0 = 0; j0 < n4; j0 += kLogitVec * kSampleThreads) {
      float4 v[kLogitVec];
#pragma unroll
      for (int u = 0; u < kLogitVec; u++) {
        const int j = j0 + u * kSampleThreads + tid;
        if (j < n4) v[u] = l4[j];
      }
#pragma unroll
      for (int u = 0; u < kLogitVec; u++) {
        const int j = j0 + u * kSampleThreads + tid;
        if (j >= n4) break;
        const float e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int k = 0; k < 4; k++)
          if (before(e[k], 4 * j + k, best, best_i)) { best = e[k]; best_i = 4 * j + k; }
      }
    }
  } else {
    for (int i = tid; i < vocab; i += kSampleThreads) {
      const float v = pen(logits, i);
      if (before(v, i, best, best_i)) { best = v; best_i = i; }
    }
  }
  block_first(best, best_i, sh);
  const float mx = sh.best_v;
  const int greedy = sh.best_i == INT_MAX ? 0 : sh.best_i;  // (INT_MAX: only NaN logits)
  if (!(sp.temperature > 0.0f)) return greedy;

  float* red = sh.red;
  float* part = sh.part;
  const float inv_t = 1.0f / sp.temperature;
  float z = 0.0f;
  for (int i = tid; i < vocab; i += kSampleThreads) {
    const float v = __expf((pen(logits, i) - mx) * inv_t);
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
  const float u = uniform_from_counter(sp.seed, step) * red[0];
  __syncthreads();
  if (tid == 0) sh.chosen = -1;
  __syncthreads();
  if (u >= part[tid] && u < part[tid] + s) {
    float acc = part[tid];
    int last = -1;
    for (int i = lo; i < hi; i++) {
      if (__float_as_uint(p[i]) < t || p[i] == 0.0f) continue;  // (0: a banned token, never drawn)
      last = i;
      acc += p[i];
      if (u < acc) break;
    }
    atomicMax(&sh.chosen, last);  // rounding at a boundary could land in two threads: take one
  }
  __syncthreads();
  const int tok = sh.chosen < 0 ? greedy : sh.chosen;  // (< 0 cannot happen unless the sums are NaN)
  __syncthreads();  // (sh.chosen is read by every thread before anyone reuses it)
  return tok;
}

// Log-probabilities of the raw logits: out_lp (thread 0 writes) = log_softmax[tok]; the top k entries into
// top_ids / top_lp (k may be 0).
__device__ __forceinline__ void row_logprobs(const float* logits, int vocab, int tok, int k, float* out_lp,
                                             int* top_ids, float* top_lp, SampleShared& sh) {
  const int tid = threadIdx.x;
  // online softmax over this thread's logits: m = their max, s = sum exp(l - m)
  float m = -INFINITY, s = 0.0f;
  for (int i = tid; i < vocab; i += kSampleThreads) {
    const float l = logits[i];
    if (l > m) {
      s = s * expf(m - l) + 1.0f;  // (expf(-inf) = 0 on the first one)
      m = l;
    } else if (l > -INFINITY) {
      s += expf(l - m);
    }
  }
  block_first(m, tid, sh);
  const float M = sh.best_v;
  const float S = block_sum(m > -INFINITY ? s * expf(m - M) : 0.0f, sh.red);
  const float lse = M + logf(S);
  if (out_lp && tid == 0) *out_lp = logits[tok] - lse;
  if (k <= 0) return;

  // threshold: the k-th of the per-thread maxima in the order (value desc, thread asc)
  float pv = INFINITY;
  int pi = -1;  // the previous round's pick: this round takes the first strictly after it
  for (int j = 0; j < k; j++) {
    const bool open = before(pv, pi, m, tid);
    block_first(open ? m : -INFINITY, open ? tid : INT_MAX, sh);
    pv = sh.best_v;
    pi = sh.best_i;
  }
  const float thr = pv;  // >= k logits are >= thr; every top-k logit is >= thr
  if (tid == 0) sh.n_cand = 0;
  __syncthreads();
  for (int i = tid; i < vocab; i += kSampleThreads) {
    const float l = logits[i];
    if (l >= thr) {
      const int c = atomicAdd(&sh.n_cand, 1);
      if (c < kCandidates) { sh.cand_v[c] = l; sh.cand_i[c] = i; }
    }
  }
  __syncthreads();
  const int n = sh.n_cand;
  const bool gathered = n <= kCandidates;
  pv = INFINITY;
  pi = -1;
  for (int j = 0; j < k; j++) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    if (gathered) {
      for (int c = tid; c < n; c += kSampleThreads) {
        const float v = sh.cand_v[c];
        const int i = sh.cand_i[c];
        if (before(pv, pi, v, i) && before(v, i, bv, bi)) { bv = v; bi = i; }
      }
    } else {  // too many ties at the threshold: over the whole row
      for (int i = tid; i < vocab; i += kSampleThreads) {
        const float v = logits[i];
        if (before(pv, pi, v, i) && before(v, i, bv, bi)) { bv = v; bi = i; }
      }
    }
    block_first(bv, bi, sh);
    pv = sh.best_v;
    pi = sh.best_i;
    if (tid == 0) {
      top_ids[j] = pi == INT_MAX ? -1 : pi;
      top_lp[j] = pi == INT_MAX ? -INFINITY : pv - lse;
    }
  }
}

// Thread j < n: logits[bias[j].id] += bias[j].value (the one add the CPU does: __fadd_rn, never contracted);
// returns the raw logit for bias_off. The barrier orders the writes before any thread's reads.
__device__ __forceinline__ float bias_on(float* logits, const LogitBias* bias, int n) {
  float raw = 0.0f;
  if (n <= 0) return raw;
  if ((int)threadIdx.x < n) {
    const LogitBias b = bias[threadIdx.x];
    raw = logits[b.id];
    logits[b.id] = __fadd_rn(raw, b.value);
  }
  __syncthreads();
  return raw;
}

// The raw logits back (after every thread's last read of the biased ones).
__device__ __forceinline__ void bias_off(float* logits, const LogitBias* bias, int n, float raw) {
  if (n <= 0) return;
  __syncthreads();
  if ((int)threadIdx.x < n) logits[bias[threadIdx.x].id] = raw;
  __syncthreads();
}

// Thread 0: the picked token joins the history.
__device__ __forceinline__ void add_generated(unsigned char* seen, int* counts, int tok) {
  if (threadIdx.x == 0) {
    seen[tok] = 1;
    atomicAdd(counts + tok, 1);  // a reduction the kernel does not wait for, where += waited for the load
  }
}

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(float* logits, int vocab, const DeviceSampling* spp, const LogitBias* bias, const unsigned* mask,
                  unsigned char* seen, int* counts, float* p, DecodeState* st, int* out_tokens) {
  __shared__ SampleShared sh;
  // Before the wait: the sampling parameters (the host's, uploaded before the step) and the state (written by the
  // previous step's sampler, the only writer): their round trips overlap the LM head instead of following it.
  const DeviceSampling sp = *spp;
  const DecodeState s0 = *st;
  pdl_wait();
  pdl_launch_dependents();
  const float raw = bias_on(logits, bias, sp.n_bias);
  const int tok = sample_block(logits, vocab, sp, (unsigned long long)s0.step, seen, counts, mask, p, sh);
  bias_off(logits, bias, sp.n_bias, raw);
  __syncthreads();  // every thread's reads of the history are done before it changes
  add_generated(seen, counts, tok);
  if (threadIdx.x == 0) {
    out_tokens[s0.step - s0.step_base] = tok;
    *st = DecodeState{tok, s0.pos + 1, s0.step + 1, s0.step_base};
  }
}

__global__ void __launch_bounds__(kSampleThreads)
    sample_rows_kernel(float* logits, int64_t ld, int vocab, const RowSampling* rows, const LogitBias* bias,
                       const unsigned* masks, unsigned char* seen, int* counts, float* scratch, int top_k,
                       int* out_tokens, float* out_logprob, int* top_ids, float* top_lp) {
  __shared__ SampleShared sh;
  pdl_wait();
  pdl_launch_dependents();
  const int r = blockIdx.x;
  const RowSampling row = rows[r];
  float* lg = logits + (int64_t)row.logits_row * ld;
  unsigned char* sn = seen + (int64_t)row.slot * vocab;
  int* cn = counts + (int64_t)row.slot * vocab;
  const LogitBias* rb = bias + row.bias_off;
  const float raw = bias_on(lg, rb, row.s.n_bias);
  const int tok = sample_block(lg, vocab, row.s, row.step, sn, cn, row.s.has_mask ? masks + row.mask_off : nullptr,
                               scratch + (int64_t)r * vocab, sh);
  bias_off(lg, rb, row.s.n_bias, raw);
  if (out_logprob || top_k > 0)
    row_logprobs(lg, vocab, tok, top_k, out_logprob ? out_logprob + r : nullptr,
                 top_k > 0 ? top_ids + (int64_t)r * top_k : nullptr,
                 top_k > 0 ? top_lp + (int64_t)r * top_k : nullptr, sh);
  __syncthreads();  // every thread's reads of the history are done before it changes
  add_generated(sn, cn, tok);
  if (threadIdx.x == 0) out_tokens[r] = tok;
}

void sample_token(float* logits, int vocab, const DeviceSampling* sp, const LogitBias* bias, const unsigned* mask,
                  unsigned char* seen, int* counts, float* scratch, DecodeState* st, int* out_tokens,
                  cudaStream_t stream, bool pdl) {
  launch(sample_kernel, dim3(1), dim3(kSampleThreads), 0, stream, pdl, logits, vocab, sp, bias, mask, seen, counts,
         scratch, st, out_tokens);
}

void sample_rows(float* logits, int64_t ld, int n_rows, int vocab, const RowSampling* rows, const LogitBias* bias,
                 const unsigned* masks, unsigned char* seen, int* counts, float* scratch, int top_k, int* out_tokens,
                 float* out_logprob, int* top_ids, float* top_lp, cudaStream_t stream, bool pdl) {
  if (top_k < 0 || top_k > kMaxTopK)
    fail(ErrorKind::Request, "sample_rows: top_k must be in 0.." + std::to_string(kMaxTopK) + " (got " +
                                 std::to_string(top_k) + ")");
  if (n_rows <= 0) return;
  launch(sample_rows_kernel, dim3((unsigned)n_rows), dim3(kSampleThreads), 0, stream, pdl, logits, ld, vocab, rows,
         bias, masks, seen, counts, scratch, top_k, out_tokens, out_logprob, top_ids, top_lp);
}

}  // namespace ti::cuda
