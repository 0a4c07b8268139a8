// attention.cu — decode attention: one new token attends to positions 0..pos of the KV cache.
//
// Split-K flash-decoding. Kernel 1 grid (max_chunks, n_kv_heads, ceil(group / 8)): a block owns
// one KV head and one chunk of `chunk` positions (64; 32 for head_dim > 128 to fit shared memory on sm_75) and
// serves up to 8 query heads of its group, so each key and value is read from memory once per group. The grid is
// sized for max_seq (graph-safe); blocks whose chunk starts past pos exit at once.
//   1. Before the PDL wait: `pos`, its RoPE row, the chunk's page ids and its cached keys and values (positions
//      < pos; the paged cache, kv_layout.cuh: pages hold >= chunk positions, so the chunk is one or two contiguous
//      runs: 16-byte coalesced loads into shared memory, rows padded by 16 bytes so the 16-byte reads of
//      consecutive rows hit distinct banks). All final by then: the page table is written by the host before a
//      decode chunk is launched, and the qkv GEMV before this kernel triggers after its own wait, so every
//      earlier kernel, the previous step's included, has completed (common.cuh, the two-back rule). Only q, k, v
//      of the new token are left for after the wait.
//   2. RoPE fused: the block rotates its query heads (pre-scaled by 1/sqrt(d)) into shared memory; the block
//      whose chunk holds `pos` also rotates the new key and writes key and value into the cache (fp16) and into
//      its own tile.
//   3. Scores S[h][p], softmax, O[h][d] = sum_p P[h][p] V[p][d]. At head dims 64 / 128 with chunks of 64 (the
//      Llama family's; DecodeAttnParams::tensor_cores) on the tensor cores (chunk_attention_mma: mma.sync, two
//      barriers, fp16 queries and probabilities); otherwise with no block barrier: a warp per (head, slice of the
//      positions), lanes over positions for the scores and over dims for P V (details there).
//   4. While pos < chunk the single block writes the output directly (the decode graph for those positions
//      launches no merge kernel at all: decode_attention's `merge`). Otherwise the chunk's unnormalised O and
//      (max, sum) go to a partial buffer and kernel 2 (decode_attn_merge, a block per query head, launched with
//      PDL) merges chunks 0..pos/chunk with log-sum-exp. (An earlier version merged in the last chunk block to
//      finish, saving a launch; ncu showed that serial tail leaving half the SMs idle at long contexts.)
#include <algorithm>
#include <cfloat>

#include "attention.cuh"
#include "attention_common.cuh"
#include "common.cuh"
#include "kv_layout.cuh"
#include "mma_frag.cuh"

namespace ti::cuda {

constexpr int kAttnThreads = 256, kMaxGroup = 8, kPad = 8;  // kPad: halves of padding per shared K/V row
constexpr int kQPad = 8;  // floats of padding per query row in shared memory (the mma tile's fp32 pair reads)
// The merge kernel's threads per head dim (a power of two: a dim's threads are adjacent lanes of one warp), so
// that a block has 160-256 threads at the head dims we take (64-256; check_decode_attn).
__host__ __device__ constexpr int merge_threads_per_dim(int hd) { return hd <= 64 ? 4 : hd <= 128 ? 2 : 1; }

// Step 3 on the tensor cores, for a chunk of 64 positions at head dim HD = 64 / 128 (mma.sync m16n8k16, fp16
// in, fp32 sums; the A operand's 16 rows are the block's <= 8 query heads and 8 zero rows). Each step is a few
// instructions deep, where the lane-per-position form (below) is a chain of hundreds:
//   S: warp w takes positions 8w .. 8w + 7: HD / 16 mma k-steps (two chains of alternate steps), the queries
//      rounded to fp16 from q_s, the keys by ldmatrix from the K tile (its row = a position's dims, the B layout).
//   softmax: a head's row max over the warp's 8 positions by two quad shuffles, over the chunk through `red`
//      (one barrier); P = exp(S - max) rounded to fp16 into p_s (8 heads x 64 positions) and the row sums (fp32)
//      into `red` (a second barrier).
//   O = P V: warp w takes dims 8w (HD 64) or 16w (HD 128) .. over the chunk's positions in k-steps of 16, P by
//      32-bit loads from p_s, V by ldmatrix.trans; positions past n carry P = 0 and zero V rows (the kernel zeroes
//      the tile's rows n .. 63 before its wait: 0 x stale shared memory could be NaN).
// emit(h, d, O[d], O[d + 1], max, sum) gets each live head's unnormalised output, two dims at a time.
// scratch: the kernel's (8 warps, HD + 2) floats of slice partials, which this form does not otherwise use:
// red (2 x 64 floats), then p_s (8 heads x kPLd halves).
template <int HD, typename Emit>
__device__ __forceinline__ void chunk_attention_mma(const float* q_s, int q_ld, const __half* k_s, const __half* v_s,
                                                    int ld, int n, int g, float* scratch, Emit emit) {
  constexpr int kPLd = 64 + 8;  // p_s row: 64 positions + 8 halves of padding (conflict-free 32-bit reads)
  static_assert(128 * sizeof(float) + 8 * kPLd * sizeof(__half) <= 8 * (HD + 2) * sizeof(float), "scratch");
  float* red = scratch;
  __half* p_s = reinterpret_cast<__half*>(scratch + 128);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
  const bool live = r < g;
  // ---- S = Q K^T for positions 8 warp .. + 7 ----
  float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const float* qr = q_s + r * q_ld + 2 * c;
  const __half* krow = k_s + (warp * 8 + (lane & 7)) * ld + (lane >> 3) * 8;
  auto qpair = [&](int d) {
    const float2 x = *reinterpret_cast<const float2*>(qr + d);
    return live ? pack_half2(x.x, x.y) : 0u;
  };
#pragma unroll
  for (int kk = 0; kk < HD / 32; kk++) {  // dims 32 kk .. + 31: two k-steps, one ldmatrix.x4 of keys
    uint32_t b[4];
    ldmatrix_x4(b, krow + kk * 32);
    const uint32_t a0[4] = {qpair(kk * 32), 0u, qpair(kk * 32 + 8), 0u};
    const uint32_t a1[4] = {qpair(kk * 32 + 16), 0u, qpair(kk * 32 + 24), 0u};
    mma_16816(sa, a0, b[0], b[1]);
    mma_16816(sb, a1, b[2], b[3]);
  }
  // ---- softmax over the chunk: this thread holds head r at positions t, t + 1 ----
  const int t = warp * 8 + 2 * c;
  const float s0 = t < n ? sa[0] + sb[0] : -INFINITY, s1 = t + 1 < n ? sa[1] + sb[1] : -INFINITY;
  float mx = fmaxf(s0, s1);
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  float* red_m = red;       // (8 warps, 8 heads)
  float* red_l = red + 64;  // (8 warps, 8 heads)
  if (c == 0) red_m[warp * 8 + r] = mx;
  __syncthreads();
  float M = red_m[r];
#pragma unroll
  for (int w = 1; w < 8; w++) M = fmaxf(M, red_m[w * 8 + r]);  // finite: position 0 of the chunk is live
  const float p0 = t < n ? __expf(s0 - M) : 0.0f, p1 = t + 1 < n ? __expf(s1 - M) : 0.0f;
  *reinterpret_cast<__half2*>(p_s + r * kPLd + t) = __floats2half2_rn(p0, p1);
  float l = p0 + p1;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (c == 0) red_l[warp * 8 + r] = l;
  __syncthreads();
  // ---- O = P V for dims d0 .. d0 + 8 NT - 1 ----
  constexpr int NT = HD / 64;  // n-tiles of 8 dims per warp
  const int d0 = warp * 8 * NT, ksteps = (n + 15) / 16;
  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  const __half* prow = p_s + r * kPLd + 2 * c;
  if constexpr (NT == 1) {
#pragma unroll
    for (int kk = 0; kk < 4; kk += 2) {  // an ldmatrix.x4.trans of 32 positions (two k-steps) x the 8 dims
      if (kk < ksteps) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_s + (kk * 16 + lane) * ld + d0);
        const uint32_t a0[4] = {lds32(prow + kk * 16), 0u, lds32(prow + kk * 16 + 8), 0u};
        mma_16816(o[0], a0, b[0], b[1]);
        if (kk + 1 < ksteps) {
          const uint32_t a1[4] = {lds32(prow + kk * 16 + 16), 0u, lds32(prow + kk * 16 + 24), 0u};
          mma_16816(o[0], a1, b[2], b[3]);
        }
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {  // an ldmatrix.x4.trans of 16 positions x 16 dims (two n-tiles)
      if (kk < ksteps) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_s + (kk * 16 + (lane & 15)) * ld + d0 + (lane >> 4) * 8);
        const uint32_t a[4] = {lds32(prow + kk * 16), 0u, lds32(prow + kk * 16 + 8), 0u};
        mma_16816(o[0], a, b[0], b[1]);
        mma_16816(o[1], a, b[2], b[3]);
      }
    }
  }
  float L = 0.0f;
#pragma unroll
  for (int w = 0; w < 8; w++) L += red_l[w * 8 + r];
  if (live) {
#pragma unroll
    for (int j = 0; j < NT; j++) emit(r, d0 + 8 * j + 2 * c, o[j][0], o[j][1], M, L);
  }
}

// HD: the head dim as a compile-time constant (64, 128: the Llama family's), or 0: p.head_dim at run time. A
// constant turns the index arithmetic's divisions (~20 dependent instructions each at run time) into shifts and
// unrolls the shuffle loops: at short contexts this kernel is a chain of dependent instructions, not a stream.
// (The batched form, many rows at their own positions, is attention_rows.cu: a different shape of work.)
template <int HD>
__global__ void __launch_bounds__(kAttnThreads) decode_attn_kernel(DecodeAttnParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int hd = HD ? HD : p.head_dim, half_d = hd / 2, CH = p.chunk, row = hd + kPad;
  const int q_ld = hd + kQPad;
  float* q_s = reinterpret_cast<float*>(smem_raw);              // (kMaxGroup, q_ld)
  float* s_s = q_s + kMaxGroup * q_ld;                          // (8 warps, hd + 2) slices' partials
  __half* k_s = reinterpret_cast<__half*>(s_s + (kAttnThreads / 32) * (hd + 2));  // (CH, row)
  __half* v_s = k_s + (size_t)CH * row;                         // (CH, row)

  trace_point(p.trace, 0);
  if (p.early_trigger) pdl_launch_dependents();  // (DecodeAttnParams::early_trigger)
  // The chunk's pages: a chunk of CH <= page_size positions spans at most two, the page of c0 and the page of its
  // last position (clamped to max_seq - 1). Their ids depend on the block alone, so they are loaded beside pos,
  // not after it: paging adds no link to the chain of dependent loads before the K/V fetch. (A block past the
  // sequence, or one that never reaches the second page, loads an unassigned entry and does not use it.)
  const int chunk = blockIdx.x, c0 = chunk * CH, zs = blockIdx.z;
  const int page_a = p.page_table[c0 >> p.page_shift];
  const int page_b = p.page_table[min(c0 + CH - 1, p.max_seq - 1) >> p.page_shift];
  const int pos = *p.pos;  // final before the wait, like the table: see the header's PDL paragraph
  if (c0 > pos) return;   // (an exiting block counts as having waited and triggered)
  const int n = min(CH, pos + 1 - c0);  // positions in this chunk
  const int kvh = blockIdx.y, group = p.n_heads / p.n_kv_heads;
  const int hq0 = kvh * group + zs * kMaxGroup;
  const int g = min(kMaxGroup, group - zs * kMaxGroup);
  float* cs = reinterpret_cast<float*>(v_s + (size_t)CH * row);  // (half_d) this position's RoPE row
  float* sn = cs + half_d;
  // Rows c0 .. c0 + n - 1 (positions <= pos: assigned pages): those before `split` in page_a from its row
  // c0 & (page_size - 1), the rest (a chunk crossing a page edge) in page_b from row 0.
  const int page_size = 1 << p.page_shift;
  const int split = min(n, page_size - (c0 & (page_size - 1)));
  const size_t off_a = kv_page_base(page_a, kvh, p.n_kv_heads, p.page_shift, hd) + (size_t)(c0 & (page_size - 1)) * hd;
  const size_t off_b = kv_page_base(page_b, kvh, p.n_kv_heads, p.page_shift, hd);
  auto row_off = [&](int r) { return r < split ? off_a + (size_t)r * hd : off_b + (size_t)(r - split) * hd; };

  // ---- 1. before the wait: the RoPE row and the chunk's cached keys and values at positions < pos ----
  for (int i = threadIdx.x; i < half_d; i += kAttnThreads) {
    cs[i] = p.rope_cos[(size_t)pos * half_d + i];
    sn[i] = p.rope_sin[(size_t)pos * half_d + i];
  }
  const int words = hd / 8;  // 16-byte words per row
  const int cached = min(n, pos - c0);  // rows already in the cache (the new one, pos, comes from qkv below)
  for (int i = threadIdx.x; i < cached * words; i += kAttnThreads) {
    const int r = i / words, w = i % words;
    const size_t at = row_off(r) + w * 8;
    *reinterpret_cast<uint4*>(k_s + (size_t)r * row + w * 8) = *reinterpret_cast<const uint4*>(p.k_pages + at);
    *reinterpret_cast<uint4*>(v_s + (size_t)r * row + w * 8) = *reinterpret_cast<const uint4*>(p.v_pages + at);
  }
  const bool use_mma = (HD == 64 || HD == 128) && CH == 64 && p.tensor_cores;  // (block-uniform)
  if (use_mma) {  // V rows n .. 63: zero (the tile's P V reads whole k-steps of 16 or 32 positions)
    for (int i = threadIdx.x; i < (CH - n) * words; i += kAttnThreads)
      *reinterpret_cast<uint4*>(v_s + (size_t)(n + i / words) * row + (i % words) * 8) = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();  // (cs, sn, the zeroed rows)

  pdl_wait();
  if (!p.early_trigger) pdl_launch_dependents();
  trace_point(p.trace, 1);

  // ---- 2. rotate the query heads; the owner of pos writes rope(k) and v into the cache and its tile ----
  const bool owner = pos < c0 + CH;  // every z-slice of this chunk writes the same values: harmless
  rope_new_token<HD>(p.qkv, p.n_heads, p.n_kv_heads, hd, kvh, hq0, g, cs, sn, p.scale, q_s, q_ld, owner, p.k_pages,
                     p.v_pages, row_off(pos - c0), k_s + (size_t)(pos - c0) * row, v_s + (size_t)(pos - c0) * row);
  __syncthreads();
  trace_point(p.trace, 2);

  const int max_chunks = (p.max_seq + CH - 1) / CH;
  const int n_chunks = pos / CH + 1;
  if constexpr (HD == 64 || HD == 128) {
    if (use_mma) {  // ---- 3-4 on the tensor cores: the output, or the chunk's partial ----
      chunk_attention_mma<HD>(q_s, q_ld, k_s, v_s, row, n, g, s_s,
                              [&](int hh, int d, float O0, float O1, float M, float L) {
        if (n_chunks == 1) {
          const float inv = 1.0f / L;
          *reinterpret_cast<__half2*>(p.out + (size_t)(hq0 + hh) * hd + d) = __floats2half2_rn(O0 * inv, O1 * inv);
          return;
        }
        const size_t slot = (size_t)(hq0 + hh) * max_chunks + chunk;
        *reinterpret_cast<float2*>(p.part_o + slot * hd + d) = make_float2(O0, O1);
        if (d == 0) {
          p.part_ml[slot * 2] = M;
          p.part_ml[slot * 2 + 1] = L;
        }
      });
      trace_point(p.trace, 3);
      return;
    }
  }

  // ---- 3. the chunk's attention, without block barriers: a warp per (head h, slice ps of the chunk's
  //      positions) — with g heads the 8 warps make nps = 8 / g slices per head. Scores: a lane per position
  //      (t = ps * 32 + lane + 32 nps j), each a whole dot product (16-byte reads of its K row: the padded rows
  //      put 8 lanes on 8 distinct bank groups; q broadcast from shared memory). Softmax within the warp by
  //      shuffles. O = P V: a lane per hd / 32 dims, the probabilities passed round by shuffles, V read as
  //      consecutive halves. With one slice per head the warp writes its head's output (or the chunk's partial)
  //      itself; with more, the slices' (max, sum, O) meet in shared memory, combined log-sum-exp style. (The
  //      previous lanes-over-(position, word) layout reduced every score across lanes and passed scores and
  //      probabilities through shared memory between 4 barriers; bench/tools/trace_decode.py, TinyLlama ctx 16: this
  //      phase took 3.0 us, now 2.3: still a latency-bound chain of dependent instructions.) ----
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nps = max(1, (kAttnThreads / 32) / g);
  const int h = warp / nps, ps = warp % nps;
  constexpr int kMaxJ = 4;            // positions per lane: CH <= 128
  constexpr int kMaxDpl = 8;          // dims per lane: hd <= 256
  const int dpl = (hd + 31) / 32;
  float m = -FLT_MAX, l = 0.0f, o[kMaxDpl];
#pragma unroll
  for (int u = 0; u < kMaxDpl; u++) o[u] = 0.0f;
  if (h < g) {
    const float* qh = q_s + h * q_ld;
    float pr[kMaxJ];
#pragma unroll
    for (int j = 0; j < kMaxJ; j++) {
      const int t = ps * 32 + lane + 32 * nps * j;
      pr[j] = -FLT_MAX;
      if (t < n) {
        const __half* kr = k_s + (size_t)t * row;
        float a0 = 0.0f, a1 = 0.0f;
#pragma unroll 8
        for (int w = 0; w < hd / 8; w++) {
          float kf[8];
          unpack8(*reinterpret_cast<const uint4*>(kr + 8 * w), kf);
          const float4 q0 = *reinterpret_cast<const float4*>(qh + 8 * w);
          const float4 q1 = *reinterpret_cast<const float4*>(qh + 8 * w + 4);
          a0 = fmaf(q0.x, kf[0], fmaf(q0.y, kf[1], fmaf(q0.z, kf[2], fmaf(q0.w, kf[3], a0))));
          a1 = fmaf(q1.x, kf[4], fmaf(q1.y, kf[5], fmaf(q1.z, kf[6], fmaf(q1.w, kf[7], a1))));
        }
        pr[j] = a0 + a1;
      }
      m = fmaxf(m, pr[j]);
    }
    m = warp_max(m);
#pragma unroll
    for (int j = 0; j < kMaxJ; j++) {
      const int t = ps * 32 + lane + 32 * nps * j;
      pr[j] = t < n ? __expf(pr[j] - m) : 0.0f;  // (m is finite wherever the slice has a position)
      l += pr[j];
    }
    l = warp_sum(l);
#pragma unroll
    for (int j = 0; j < kMaxJ; j++) {
      const int t0 = ps * 32 + 32 * nps * j;
      if (t0 >= n) break;  // uniform
      const int cnt = min(32, n - t0);
#pragma unroll 4
      for (int src = 0; src < cnt; src++) {
        const float pt = __shfl_sync(0xffffffffu, pr[j], src);
        const __half* vr = v_s + (size_t)(t0 + src) * row + lane * dpl;
#pragma unroll
        for (int u = 0; u < kMaxDpl; u++)
          if (u < dpl && lane * dpl + u < hd) o[u] = fmaf(pt, __half2float(vr[u]), o[u]);
      }
    }
  }
  // the warp's (m, l, O) -> the output, the chunk's partial, or (several slices) shared memory to be combined
  auto emit = [&](int hh, int d, float O, float M, float L) {
    if (n_chunks == 1) {
      p.out[(size_t)(hq0 + hh) * hd + d] = __float2half(O / L);
      return;
    }
    const size_t slot = (size_t)(hq0 + hh) * max_chunks + chunk;
    p.part_o[slot * hd + d] = O;
    if (d == 0) {
      p.part_ml[slot * 2] = M;
      p.part_ml[slot * 2 + 1] = L;
    }
  };
  if (nps == 1) {
    if (h < g) {
#pragma unroll
      for (int u = 0; u < kMaxDpl; u++)
        if (u < dpl && lane * dpl + u < hd) emit(h, lane * dpl + u, o[u], m, l);
    }
  } else {
    float* part = s_s;  // (8 warps, hd + 2): O, then (m, l)
    if (h < g) {
#pragma unroll
      for (int u = 0; u < kMaxDpl; u++)
        if (u < dpl && lane * dpl + u < hd) part[warp * (hd + 2) + lane * dpl + u] = o[u];
      if (lane == 0) {
        part[warp * (hd + 2) + hd] = m;
        part[warp * (hd + 2) + hd + 1] = l;
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < g * hd; i += kAttnThreads) {
      const int hh = i / hd, d = i % hd;
      float M = -FLT_MAX;
      for (int sl = 0; sl < nps; sl++) M = fmaxf(M, part[(hh * nps + sl) * (hd + 2) + hd]);
      float O = 0.0f, L = 0.0f;
      for (int sl = 0; sl < nps; sl++) {
        const float* ws = part + (hh * nps + sl) * (hd + 2);
        const float e = __expf(ws[hd] - M);  // a slice without positions: m = -FLT_MAX, l = 0, O = 0
        O = fmaf(e, ws[d], O);
        L = fmaf(e, ws[hd + 1], L);
      }
      emit(hh, d, O, M, L);
    }
  }
  trace_point(p.trace, 3);
}

// Kernel 2's fold: thread j of a dim takes the chunks c = j, j + T, ..., U chunks' loads in flight before their
// math, keeping the running (max m, sum L, output O[d]) rescaled to its max.
template <int U>
__device__ __forceinline__ void merge_fold(const float2* ml, const float* po, int hd, int n_chunks, int j, int T,
                                           bool live, float& m, float& L, float& O) {
  for (int c0 = j; c0 < n_chunks; c0 += U * T) {
    float2 v[U];
    float o[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + u * T;
      const bool in = live && c < n_chunks;
      v[u] = in ? ml[c] : make_float2(-FLT_MAX, 0.0f);
      o[u] = in ? po[(size_t)c * hd] : 0.0f;
    }
    float mb = m;
#pragma unroll
    for (int u = 0; u < U; u++) mb = fmaxf(mb, v[u].x);
    const float r = __expf(m - mb);
    O *= r;
    L *= r;
#pragma unroll
    for (int u = 0; u < U; u++) {
      const float w = __expf(v[u].x - mb);
      O = fmaf(w, o[u], O);
      L = fmaf(w, v[u].y, L);
    }
    m = mb;
  }
}

// Kernel 2: one block per query head; T = merge_threads_per_dim(head_dim) threads per dim, thread (d, j) folds
// the chunks j, j + T, ... (merge_fold: 8 chunks' loads in flight, 16 past 8T chunks — 2,048 positions at head
// dim 64 — so that the fold stays one round trip of loads up to 4,096) and the T threads of a dim (adjacent
// lanes) meet by xor shuffles: out[d] = sum_c e^(m_c - M) O_c[d] / sum_c e^(m_c - M) l_c. No barrier and no
// shared memory. Does nothing while pos < chunk (the chunk kernel wrote the output itself). Launched with PDL
// behind the chunk kernel, a block per query head: no serial tail on one SM.
__global__ void decode_attn_merge(DecodeAttnParams p) {
  pdl_launch_dependents();  // the O GEMV after it reads only weights before its wait
  const int CH = p.chunk, hd = p.head_dim, h = blockIdx.x;
  const int T = merge_threads_per_dim(hd), d = threadIdx.x / T, j = threadIdx.x % T;
  const bool live = d < hd;  // (the block is rounded up to whole warps for the shuffles)
  const int max_chunks = (p.max_seq + CH - 1) / CH;
  const int pos = *p.pos;  // final: the two-back rule
  pdl_wait();  // (also when there is nothing to merge: the O GEMV's wait must cover the attention kernel)
  const int n_chunks = pos / CH + 1;
  if (n_chunks == 1) return;
  const float2* ml = reinterpret_cast<const float2*>(p.part_ml) + (size_t)h * max_chunks;
  const float* po = p.part_o + (size_t)h * max_chunks * hd + (live ? d : 0);
  float m = -FLT_MAX, L = 0.0f, O = 0.0f;  // a thread without chunks keeps these: weight e^(-FLT_MAX - M) = 0
  if (n_chunks > 8 * T) merge_fold<16>(ml, po, hd, n_chunks, j, T, live, m, L, O);  // (block-uniform)
  else merge_fold<8>(ml, po, hd, n_chunks, j, T, live, m, L, O);
  for (int x = 1; x < T; x <<= 1) {  // (lane j == 0's sums are written; its partner's may differ in the last bits)
    const float m2 = __shfl_xor_sync(0xffffffffu, m, x), O2 = __shfl_xor_sync(0xffffffffu, O, x),
                L2 = __shfl_xor_sync(0xffffffffu, L, x);
    const float M = fmaxf(m, m2), a = __expf(m - M), b = __expf(m2 - M);
    O = O * a + O2 * b;
    L = L * a + L2 * b;
    m = M;
  }
  if (live && j == 0) p.out[(size_t)h * hd + d] = __float2half(O / L);
}

size_t decode_attention_smem(const DecodeAttnParams& p) {
  return sizeof(float) *
             ((size_t)kMaxGroup * (p.head_dim + kQPad) + (size_t)(kAttnThreads / 32) * (p.head_dim + 2)) +
         2 * sizeof(__half) * (size_t)p.chunk * (p.head_dim + kPad) + sizeof(float) * p.head_dim;  // + RoPE row
}

void check_decode_attn(const DecodeAttnParams& p) {
  if (p.head_dim % 8 != 0 || p.head_dim > 256 || p.head_dim < 64 || p.n_heads % p.n_kv_heads != 0)
    fail(ErrorKind::Request, "decode_attention: unsupported head_dim " + std::to_string(p.head_dim));
  if (p.page_shift < 0 || p.page_shift > 20)
    fail(ErrorKind::Request, "decode_attention: page size 2^" + std::to_string(p.page_shift) + " out of range");
}

void decode_attention(const DecodeAttnParams& p, cudaStream_t s, bool pdl, bool merge) {
  check_decode_attn(p);
  if (p.act8_out) fail(ErrorKind::Request, "decode_attention: act8_out is decode_attention_rows' (the batched step's)");
  if (p.chunk < 1 || p.chunk > 128) fail(ErrorKind::Request, "decode_attention: chunk must be 1..128");
  if ((1 << p.page_shift) < p.chunk)
    fail(ErrorKind::Request, "decode_attention: page size " + std::to_string(1 << p.page_shift) +
                                 " must be >= the chunk of " + std::to_string(p.chunk) + " positions");
  const size_t smem = decode_attention_smem(p);
  const int group = p.n_heads / p.n_kv_heads, nz = (group + kMaxGroup - 1) / kMaxGroup;
  const dim3 grid(attn_max_chunks(p), p.n_kv_heads, nz);
  const dim3 block(kAttnThreads);
  if (p.head_dim == 64) launch_attention<decode_attn_kernel<64>>(p, grid, block, smem, s, pdl);
  else if (p.head_dim == 128) launch_attention<decode_attn_kernel<128>>(p, grid, block, smem, s, pdl);
  else launch_attention<decode_attn_kernel<0>>(p, grid, block, smem, s, pdl);
  if (!merge) return;
  const int merge_threads = (p.head_dim * merge_threads_per_dim(p.head_dim) + 31) / 32 * 32;
  launch(decode_attn_merge, dim3(p.n_heads), dim3(merge_threads), 0, s, pdl, p);
}

}  // namespace ti::cuda
