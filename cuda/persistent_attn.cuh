// persistent_attn.cuh — the persistent step's attention tasks (cuda/persistent.cu's header comment): a partial
// per (layer, KV head, chunk of positions) — RoPE and the cache write by the chunk that holds pos — and the
// log-sum-exp merge of the chunks, by the last partial to finish (fused_merge) or its own task.
#pragma once

#include <cfloat>

#include "kv_layout.cuh"
#include "persistent_common.cuh"
#include "ring.cuh"
#include "sync.cuh"

namespace ti::cuda::persistent {

// ---- the attention tasks ----

// Query head hq, dimension d: the chunks' partials merged with log-sum-exp into att (fp16).
__device__ __forceinline__ void merge_dim(const PersistentParams& p, int hq, int d, int n_chunks) {
  const int hd = p.head_dim;
  const float* ml = p.part_ml + (size_t)hq * p.max_chunks * 2;
  float M = -FLT_MAX;
  for (int c = 0; c < n_chunks; c++) M = fmaxf(M, ldcg(ml + 2 * c));
  float L = 0.0f;
  for (int c = 0; c < n_chunks; c++) L += ldcg(ml + 2 * c + 1) * __expf(ldcg(ml + 2 * c) - M);
  float o = 0.0f;
  for (int c = 0; c < n_chunks; c++)
    o += ldcg(p.part_o + ((size_t)hq * p.max_chunks + c) * hd + d) * __expf(ldcg(ml + 2 * c) - M);
  p.att[(size_t)hq * hd + d] = __float2half(o / L);
}

// The merge task (ScheduleShape::fused_merge off): query head hq.
__device__ inline void attn_merge(const PersistentParams& p, int hq, int pos) {
  for (int d = threadIdx.x; d < p.head_dim; d += kPersistentThreads) merge_dim(p, hq, d, pos / p.chunk + 1);
}

// Fused merge: after its partials, each attention task of KV head kvh counts itself on the head's arrival word;
// the last of the context's chunks to arrive (they all run in this step) merges the group's heads and zeroes the
// word for the next step. The classic last-block pattern: every block's partial writes, its barrier, a fence,
// then its count; the last block's fence after the count orders its reads of the others' partials (ld.cg).
__device__ inline void merge_if_last(const PersistentParams& p, int l, int kvh, int pos) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    uint32_t* arrived = p.arrivals + (size_t)l * p.n_kv_heads + kvh;
    last = atomicAdd(arrived, 1u) + 1u == (uint32_t)(pos / p.chunk + 1);
    if (last) {
      atomicExch(arrived, 0u);
      __threadfence();
    }
  }
  __syncthreads();
  if (!last) return;
  const int g = p.n_heads / p.n_kv_heads, hd = p.head_dim;
  for (int e = threadIdx.x; e < g * hd; e += kPersistentThreads)
    merge_dim(p, kvh * g + e / hd, e % hd, pos / p.chunk + 1);
}

// (KV head kvh, chunk c) of layer l: RoPE of the group's queries; the chunk holding pos also rotates the new key
// and writes key and value into the cache; scores, softmax and P V over the chunk's positions; the unnormalised
// output and (max, sum) into the partial buffers, merged by the merge task or (fused_merge) by the last of the
// head's chunks to finish (merge_if_last); a context of one chunk (fused_merge) writes att directly.
//
// Latency, not bandwidth, bounds this task (a chunk of TinyLlama's is 8 KiB of K and V; few blocks run it at short
// contexts while the rest wait): so no load waits on another. The chunk's row offsets are resolved through the
// page table once, into shared memory; a warp scores a position for all g heads of the group (one load of the key
// row, lanes over dimension pairs); P V has a thread per (head, dimension pair), its loop over positions unrolled
// so that its value loads are in flight together. The new key and value are read back from the cache after the
// barrier that follows their store (the block's own global writes are visible to it after __syncthreads): the
// same fp16 values attention.cu uses.
// The attention task's shared memory (`work`): the rotated queries, scores, the RoPE row, the chunk's cache rows,
// the softmax sums; with kv_stage the chunk's keys and values (CH x hd halves each) after them.
struct AttnSmem {
  float *q_s, *s_s, *cs, *sn, *lsum;
  int* rows;
  __half *ks, *vs;
  __host__ __device__ AttnSmem(unsigned char* work, int g, int hd, int CH) {
    q_s = reinterpret_cast<float*>(work);  // (g, hd)
    s_s = q_s + g * hd;                    // (g, CH) scores, then probabilities
    cs = s_s + g * CH;                     // (hd / 2) RoPE row of pos
    sn = cs + hd / 2;
    rows = reinterpret_cast<int*>(sn + hd / 2);  // (CH) the chunk's cache rows (elements from the layer's base)
    lsum = reinterpret_cast<float*>(rows + CH);  // (g) the softmax sums
    const size_t at = ((size_t)(reinterpret_cast<unsigned char*>(lsum + g) - work) + 15) / 16 * 16;
    ks = reinterpret_cast<__half*>(work + at);  // (CH, hd) kv_stage only
    vs = ks + (size_t)CH * hd;
  }
  // the bytes the layout above spans (the same arithmetic, from offset 0)
  static size_t bytes(int g, int hd, int CH, bool kv_stage) {
    const size_t head = ((size_t)(g * hd + g * CH + hd + CH + g) * sizeof(float) + 15) / 16 * 16;
    return head + (kv_stage ? 2 * (size_t)CH * hd * sizeof(__half) : 0);
  }
};

// Before the task's wait: the chunk's cache rows, RoPE's cos / sin row of pos, and (kv_stage) the keys and values
// of its positions before pos — written by earlier steps, final — copied into shared memory with cp.async, so that
// after the wait only the new token's q / k / v are on the critical path. The copies complete in attn_partial
// (wait_all + a barrier).
__device__ inline void attn_preload(const PersistentParams& p, int l, int kvh, int c, int pos, unsigned char* work) {
  const int hd = p.head_dim, CH = p.chunk, c0 = c * CH, g = p.n_heads / p.n_kv_heads;
  const int n = min(CH, pos + 1 - c0);
  const AttnSmem a(work, g, hd, CH);
  for (int t = threadIdx.x; t < n; t += kPersistentThreads)
    a.rows[t] = (int)kv_row(p.page_table, c0 + t, kvh, p.n_kv_heads, p.page_shift, hd);
  for (int i = threadIdx.x; i < hd / 2; i += kPersistentThreads) {  // RoPE's row of pos (a table: not produced here)
    a.cs[i] = p.rope_cos[(size_t)pos * (hd / 2) + i];
    a.sn[i] = p.rope_sin[(size_t)pos * (hd / 2) + i];
  }
  if (!p.kv_stage) return;
  const int n_old = min(CH, pos - c0), pieces = hd / 8;  // 16-byte pieces per row
  const size_t layer = (size_t)l * p.kv_layer_elems;
  for (int e = threadIdx.x; e < n_old * pieces; e += kPersistentThreads) {
    const int t = e / pieces, j = e % pieces;
    const size_t at = layer + kv_row(p.page_table, c0 + t, kvh, p.n_kv_heads, p.page_shift, hd) + 8 * j;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(a.ks + t * hd + 8 * j)),
                 "l"(p.k_pages + at) : "memory");
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(a.vs + t * hd + 8 * j)),
                 "l"(p.v_pages + at) : "memory");
#endif
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// The chunk's scores s_s[h * CH + t] = q_h . k_t: a warp per position t, all g heads; lane `lane` holds the key's
// dimension pairs 2 lane + 64 j. The heads go HA at a time so that their warp sums' shuffle chains overlap (one
// head after the other, the chains' latency was most of the task: docs/perf/persistent.md §8.5); each head's sum
// in warp_sum's order.
template <int HA, typename Off>
__device__ __forceinline__ void attn_scores(const float* q_s, const __half* kb, Off off, float* s_s, int n, int g,
                                            int hd, int CH) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kPairs = 4;  // head_dim <= 256 (PersistentDecode::unsupported)
  for (int t = warp; t < n; t += kWarps) {
    const __half2* kr = reinterpret_cast<const __half2*>(kb + off(t));
    float2 kf[kPairs];
#pragma unroll
    for (int j = 0; j < kPairs; j++)
      kf[j] = 2 * lane + 64 * j < hd ? __half22float2(kr[lane + 32 * j]) : make_float2(0.0f, 0.0f);
    for (int h0 = 0; h0 < g; h0 += HA) {
      float s[HA];
#pragma unroll
      for (int u = 0; u < HA; u++) {
        const float* q = q_s + min(h0 + u, g - 1) * hd;  // (heads past g: computed, not written)
        s[u] = 0.0f;
#pragma unroll
        for (int j = 0; j < kPairs; j++) {
          const int d = 2 * lane + 64 * j;
          if (d < hd) s[u] += q[d] * kf[j].x + q[d + 1] * kf[j].y;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int u = 0; u < HA; u++) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
      }
      if (lane == 0) {
#pragma unroll
        for (int u = 0; u < HA; u++)
          if (h0 + u < g) s_s[(h0 + u) * CH + t] = s[u];
      }
    }
  }
}

__device__ inline void attn_partial(const PersistentParams& p, int l, int kvh, int c, int pos, unsigned char* work,
                                    unsigned long long* staged) {
  const int hd = p.head_dim, half_d = hd / 2, CH = p.chunk, c0 = c * CH;
  if (c0 > pos) return;
  const int n = min(CH, pos + 1 - c0), g = p.n_heads / p.n_kv_heads, hq0 = kvh * g;
  const AttnSmem a(work, g, hd, CH);
  float *q_s = a.q_s, *s_s = a.s_s, *cs = a.cs, *sn = a.sn, *lsum = a.lsum;
  const int* rows = a.rows;  // (attn_preload)
  __half* kp = p.k_pages + (size_t)l * p.kv_layer_elems;
  __half* vp = p.v_pages + (size_t)l * p.kv_layer_elems;
  // where position t's key and value are read: the staged tiles (kv_stage) or the cache
  const bool st = p.kv_stage;
  const __half* kb = st ? a.ks : kp;
  const __half* vb = st ? a.vs : vp;
  auto off = [&](int t) { return st ? t * hd : rows[t]; };
  __syncthreads();  // (attn_preload wrote rows, cs, sn before the wait; its barrier orders them already)
  for (int t = threadIdx.x; t < g * half_d; t += kPersistentThreads) {
    const int hh = t / half_d, i = t % half_d;
    const float* q = p.qkv + (size_t)(hq0 + hh) * hd;
    const float x1 = ldcg(q + i), x2 = ldcg(q + i + half_d);
    q_s[hh * hd + i] = (x1 * cs[i] - x2 * sn[i]) * p.scale;
    q_s[hh * hd + i + half_d] = (x2 * cs[i] + x1 * sn[i]) * p.scale;
  }
  if (pos < c0 + CH) {  // this chunk holds pos: the new key (rotated) and value into the cache
    const size_t at = rows[pos - c0];
    const float* k = p.qkv + p.q_dim + (size_t)kvh * hd;
    const float* v = p.qkv + p.q_dim + p.kv_dim + (size_t)kvh * hd;
    for (int i = threadIdx.x; i < half_d; i += kPersistentThreads) {
      const float k1 = ldcg(k + i), k2 = ldcg(k + i + half_d);
      // rounded products, no FMA contraction: exactly what attention.cu (and the CPU engine) write
      const __half r1 = __float2half(__fsub_rn(__fmul_rn(k1, cs[i]), __fmul_rn(k2, sn[i])));
      const __half r2 = __float2half(__fadd_rn(__fmul_rn(k2, cs[i]), __fmul_rn(k1, sn[i])));
      const __half v1 = __float2half(ldcg(v + i)), v2 = __float2half(ldcg(v + i + half_d));
      kp[at + i] = r1;
      kp[at + i + half_d] = r2;
      vp[at + i] = v1;
      vp[at + i + half_d] = v2;
      if (st) {  // the same values into the staged tiles
        __half* kt = a.ks + (pos - c0) * hd;
        __half* vt = a.vs + (pos - c0) * hd;
        kt[i] = r1;
        kt[i + half_d] = r2;
        vt[i] = v1;
        vt[i + half_d] = v2;
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (st) asm volatile("cp.async.wait_all;" ::: "memory");  // attn_preload's copies (this thread's)
#endif
  __syncthreads();
  stamp_at(staged);  // (TI_TRACE) q rotated, the new key / value written, the chunk's keys / values in place
  // scores: a warp per position, all g heads (attn_scores)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (g <= 4) attn_scores<4>(q_s, kb, off, s_s, n, g, hd, CH);
  else attn_scores<8>(q_s, kb, off, s_s, n, g, hd, CH);
  __syncthreads();
  // softmax per head (a warp per head): probabilities in place, (max, sum) to the partial buffer
  for (int hh = warp; hh < g; hh += kWarps) {
    float m = -FLT_MAX, sum = 0.0f;
    for (int t = lane; t < n; t += 32) m = fmaxf(m, s_s[hh * CH + t]);
    m = warp_max(m);
    for (int t = lane; t < n; t += 32) {
      const float e = __expf(s_s[hh * CH + t] - m);
      s_s[hh * CH + t] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      float* ml = p.part_ml + ((size_t)(hq0 + hh) * p.max_chunks + c) * 2;
      ml[0] = m;
      ml[1] = sum;
      lsum[hh] = sum;
    }
  }
  __syncthreads();
  // O = P V: a thread per (head, dimension pair), the positions unrolled so their loads overlap. Fused merge with
  // one chunk in the context: att directly (the merge's o * 1 / (sum * 1), the same bits).
  const bool alone = p.fused_merge && pos < CH;
  for (int e = threadIdx.x; e < g * half_d; e += kPersistentThreads) {
    const int hh = e / half_d, d = 2 * (e % half_d);
    const float* pr = s_s + hh * CH;
    float o0 = 0.0f, o1 = 0.0f;
#pragma unroll 8
    for (int t = 0; t < n; t++) {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(vb + off(t) + d));
      o0 = fmaf(pr[t], v.x, o0);
      o1 = fmaf(pr[t], v.y, o1);
    }
    if (alone) {
      __half* a = p.att + (size_t)(hq0 + hh) * hd + d;
      a[0] = __float2half(o0 / lsum[hh]);
      a[1] = __float2half(o1 / lsum[hh]);
      continue;
    }
    float* out = p.part_o + ((size_t)(hq0 + hh) * p.max_chunks + c) * hd + d;
    out[0] = o0;
    out[1] = o1;
  }
  if (p.fused_merge && !alone) merge_if_last(p, l, kvh, pos);
}

}  // namespace ti::cuda::persistent
