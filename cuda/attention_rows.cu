// attention_rows.cu — the batched decode step's attention (decode_attention_rows, cpp/gpu/batch_step.cu): n
// rows, each the new token of its own sequence at its own position, attending through its own page table.
//
// Latency, not bandwidth: at a few hundred positions one row's K and V of a layer are ~100 KB; what the step
// paid (docs/perf/batch.md: ~11 us per layer at batch 8) was the chain of dependent steps per layer and a second
// launch (the merge). So ONE launch per layer, and as few blocks per row as the work allows:
//   grid (x: splits, y: KV head, z: row x ceil(group / G)). A block serves one KV head of one row and up to G
//   query heads of its group (each K and V read once per block: G = 1, 2, 4 or 8, launch_rows: the fewest heads
//   per block while the busy blocks fit in one wave; CudaOptions::batch_attn_heads) over one split of `span`
//   positions (by default attn_rows_span: 256 at head dim 64, 128 up to 128, 64 above: the same span x head_dim
//   multiply-adds per head at every head dim; 64 or 128 by CudaOptions::batch_attn_span). A row no longer than the
//   span is one block per KV head (per slice), which writes the output itself: no partials, no merge. A longer
//   row: each split's block writes its unnormalised (O, max, sum); the last of the row's splits to finish (an
//   atomic ticket per (row, KV head, z), reset to zero by that block, so graph replays find it zero) merges them,
//   log-sum-exp, in split order —
//   the result depends neither on which block came last nor on the other rows or the bucket. The grid's x is
//   sized for the bucket (graph-safe): a block loops over splits x, x + gridDim.x, ... below its row's count;
//   blocks past their row's length and padding rows (position < 0) exit at once.
//   1. Before the PDL wait: the row's position and slot, its RoPE row and the split's cached keys and values
//      (positions < pos, written by earlier steps: complete by the two-back rule, common.cuh), 16-byte cp.async
//      copies through the page table (a table entry per position, from L1: any power-of-two page size) into
//      shared memory, all of a thread's copies in flight at once (one round trip), none held in registers.
//   2. After it: RoPE on the queries; the split owning pos rotates k and writes rope(k), v into the cache and its
//      own tile (attention_common.cuh, shared with the single sequence's kernel). Nothing else reads that row in
//      this launch; the next step's read is two kernels back. (With p.appended, speculative decoding's draft pass,
//      append_kv_rows wrote every row's key and value before a plain launch of this kernel: rows of one slot at
//      consecutive positions read each other's from the cache, and nothing is written.)
//   3. Scores: warp w takes positions w * span / 8 .. of the split (32, 16, 8 per warp), a position per 1, 2, 4
//      lanes (each lane every 1st, 2nd, 4th 16-byte word of it: K from the padded tile, conflict-free; the q
//      words broadcast), all g heads per position; softmax per head within the warp by shuffles; the
//      probabilities to shared memory.
//   4. O = P V: a lane per hd / 32 dims, each V row read once for all g heads, the probabilities read 4
//      positions at a time as broadcast float4s (shuffles would be 8 per position). The 8 warps' (max, sum, O)
//      meet in shared memory (over the K / V tiles, done with by then), combined by a thread per (head, dim).
// Where the time goes (docs/perf/batch.md): with all 8 heads of a group in one block, 8 rows of ~200 positions
// took ~13.6 us per layer: Nsight Compute showed each warp issuing ~3,000 instructions at one per ~8.4 cycles
// (two warps per scheduler, latency-bound: the block's serial work, not memory) on 32 of 132 SMs. Slicing the
// group (G < 8) divides the scores' and P V's work per block by 8 / G and multiplies the blocks by as much; the
// K / V tiles are then read once per slice (from L2 after the first).
#include <algorithm>
#include <cfloat>

#include "act8.cuh"
#include "attention.cuh"
#include "attention_common.cuh"
#include "common.cuh"
#include "kv_layout.cuh"

namespace ti::cuda {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kPad = 8;        // halves of padding per shared K / V row: 16-byte reads of consecutive rows
constexpr int kMaxWords = 8;   // 16-byte K words per lane: words / lanes per position <= 8 for every span
constexpr int kMaxDpl = 8;     // V dims per lane: hd <= 256

// An output value as fp16, or (act8) as the o product's int8 input fp16(d xq) — the rule on the fp16 value, as
// act8_round_rows applies it to the stored output. The callers' lanes hold consecutive dims of one head, a warp
// one group of 32 (head_dim % 32 == 0, the launcher checks), and every lane of the warp calls it (the shuffles).
__device__ __forceinline__ __half out_value(float v, bool act8) {
  float f[1] = {__half2float(__float2half(v))};
  if (act8) act8_round<32, 1>(f);
  return __float2half(f[0]);
}

// dot of 8 fp16 keys with 8 fp32 query values from shared memory (two 16-byte reads).
__device__ __forceinline__ float dot8_shared(const uint4& k, const float* q) {
  float kf[8];
  unpack8(k, kf);
  const float4 q0 = *reinterpret_cast<const float4*>(q), q1 = *reinterpret_cast<const float4*>(q + 4);
  const float a = fmaf(q0.x, kf[0], fmaf(q0.y, kf[1], fmaf(q0.z, kf[2], q0.w * kf[3])));
  return fmaf(q1.x, kf[4], fmaf(q1.y, kf[5], fmaf(q1.z, kf[6], fmaf(q1.w, kf[7], a))));
}

__host__ __device__ constexpr size_t rows_smem_floats(int hd, int G) {  // q_s, p_s, RoPE row (the tiles follow)
  return (size_t)G * hd + (size_t)kWarps * G * 32 + hd;
}

size_t rows_smem(int hd, int span, int G) {
  return sizeof(float) * rows_smem_floats(hd, G) + 2 * sizeof(__half) * (size_t)span * (hd + kPad);
}

// HD, SPAN: the head dim and the span as compile-time constants (the instantiations the engine's shapes take),
// or 0: from p at run time. G: query heads per block (attn_rows_heads).
template <int HD, int SPAN, int G>
__global__ void __launch_bounds__(kThreads, HD == 64 ? 2 : 1) decode_attn_rows_kernel(DecodeAttnParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int s_last;
  const int hd = HD ? HD : p.head_dim, half_d = hd / 2, words = hd / 8, row = hd + kPad;
  const int span = SPAN ? SPAN : p.rows_span ? p.rows_span : attn_rows_span(hd);
  const int ppw = span / kWarps, lpp = 32 / ppw;  // positions per warp, lanes per position
  const int group = p.n_heads / p.n_kv_heads, nz = (group + G - 1) / G;
  const int rr = blockIdx.z / nz, zs = blockIdx.z - rr * nz, kvh = blockIdx.y;
  const int hq0 = kvh * group + zs * G, g = min(G, group - zs * G);
  const int max_splits = attn_rows_max_splits(p.max_seq);
  float* q_s = reinterpret_cast<float*>(smem_raw);  // (G, hd) rope(q) / sqrt(hd)
  float* p_s = q_s + G * hd;                        // (kWarps, G, 32) probabilities
  float* cs = p_s + kWarps * G * 32;                // (half_d) the position's RoPE row
  float* sn = cs + half_d;
  __half* k_s = reinterpret_cast<__half*>(q_s + rows_smem_floats(hd, G));  // (span, row)
  __half* v_s = k_s + (size_t)span * row;                                  // (span, row)
  float* part = reinterpret_cast<float*>(k_s);       // (kWarps, g, hd + 2) after P V: the warps' O, max, sum

  const int pos = p.row_pos[rr];  // final before the wait, like the table (the host writes both before a step)
  const int* table = p.page_table + (size_t)p.row_slot[rr] * p.table_stride;
  if (pos < 0) return;  // a padding row (an exiting block counts as having waited and triggered)
  const int n_splits = pos / span + 1;
  const float* qkv = p.qkv + (size_t)rr * p.ld_qkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tt = lane / lpp, j = lane % lpp;
  const int dpl = (hd + 31) / 32;  // dims per lane in P V: lane * dpl + u < hd

  for (int sp = blockIdx.x; sp < n_splits; sp += gridDim.x) {
    // the split holding pos writes it (every z-slice the same: harmless), unless the cache holds it (appended)
    const bool owner = sp == n_splits - 1 && !p.appended;
    const int c0 = sp * span, n = min(span, pos + 1 - c0), cached = n - owner;
    const size_t at_new = kv_row(table, pos, kvh, p.n_kv_heads, p.page_shift, hd);

    // ---- 1. before the wait: the RoPE row and the split's cached keys and values ----
    for (int i = threadIdx.x; i < half_d; i += kThreads) {
      cs[i] = p.rope_cos[(size_t)pos * half_d + i];
      sn[i] = p.rope_sin[(size_t)pos * half_d + i];
    }
    const int total = cached * words;
    for (int i = threadIdx.x; i < total; i += kThreads) {
      const int r = i / words, w = i - r * words;
      const size_t at = kv_row(table, c0 + r, kvh, p.n_kv_heads, p.page_shift, hd) + w * 8;
      cp_async16(k_s + (size_t)r * row + w * 8, p.k_pages + at);  // (staged in registers, they set the peak)
      cp_async16(v_s + (size_t)r * row + w * 8, p.v_pages + at);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // (cs, sn, the tiles)
    pdl_wait();
    pdl_launch_dependents();  // the O product after this kernel reads only weights before its own wait

    // ---- 2. RoPE; the owner of pos writes rope(k) and v into the cache and its tile ----
    rope_new_token<HD>(qkv, p.n_heads, p.n_kv_heads, hd, kvh, hq0, g, cs, sn, p.scale, q_s, hd, owner, p.k_pages,
                       p.v_pages, at_new, k_s + (size_t)(pos - c0) * row, v_s + (size_t)(pos - c0) * row);
    __syncthreads();

    // ---- 3. scores of this lane's position (its words j, j + lpp, ...) for the g heads; softmax per head ----
    const int r = warp * ppw + tt;
    const bool valid = r < n;
    const int wpl = (words + lpp - 1) / lpp;
    uint4 kw[kMaxWords];
#pragma unroll
    for (int u = 0; u < kMaxWords; u++)
      if (u < wpl && valid && j + u * lpp < words)
        kw[u] = *reinterpret_cast<const uint4*>(k_s + (size_t)r * row + (j + u * lpp) * 8);
    // The g heads side by side, each step for every head before the next step: 8 independent chains the warp
    // scheduler overlaps (head after head, each with its own 5-shuffle reductions, was one long dependent chain).
    // Per head the same operations in the same order: the same bits either way.
    float x[G], m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; h++) x[h] = 0.0f;
#pragma unroll
    for (int u = 0; u < kMaxWords; u++) {
      if (u < wpl && valid && j + u * lpp < words) {
        const float* qw = q_s + (j + u * lpp) * 8;
#pragma unroll
        for (int h = 0; h < G; h++)
          if (h < g) x[h] += dot8_shared(kw[u], qw + h * hd);
      }
    }
    for (int o = 1; o < lpp; o <<= 1)  // the position's lanes' parts
#pragma unroll
      for (int h = 0; h < G; h++)
        if (h < g) x[h] += __shfl_xor_sync(0xffffffffu, x[h], o);
#pragma unroll
    for (int h = 0; h < G; h++) {
      x[h] = valid ? x[h] : -FLT_MAX;
      m[h] = x[h];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)  // max over the warp's positions (warp_max, the heads interleaved)
#pragma unroll
      for (int h = 0; h < G; h++)
        if (h < g) m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], o));
#pragma unroll
    for (int h = 0; h < G; h++) {
      x[h] = valid && h < g ? __expf(x[h] - m[h]) : 0.0f;  // (a warp without positions: m = -FLT_MAX, l = 0, O = 0)
      l[h] = j == 0 ? x[h] : 0.0f;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)  // sum over them (warp_sum, likewise)
#pragma unroll
      for (int h = 0; h < G; h++)
        if (h < g) l[h] += __shfl_xor_sync(0xffffffffu, l[h], o);
#pragma unroll
    for (int h = 0; h < G; h++)
      if (h < g && j == 0) p_s[(warp * G + h) * 32 + tt] = x[h];
    __syncwarp();

    // ---- 4. O = P V over the warp's positions, 4 at a time ----
    const int cnt = max(0, min(ppw, n - warp * ppw));
    const __half* vb = v_s + (size_t)warp * ppw * row + lane * dpl;
    const float* pw = p_s + warp * G * 32;
    float o[G][kMaxDpl];
#pragma unroll
    for (int h = 0; h < G; h++)
#pragma unroll
      for (int u = 0; u < kMaxDpl; u++) o[h][u] = 0.0f;
    for (int t0 = 0; t0 < cnt; t0 += 4) {
      float4 p4[G];
#pragma unroll
      for (int h = 0; h < G; h++)
        if (h < g) p4[h] = *reinterpret_cast<const float4*>(pw + h * 32 + t0);
#pragma unroll
      for (int q = 0; q < 4; q++) {
        if (t0 + q >= cnt) break;  // (uniform)
        float vf[kMaxDpl];
        const __half* vr = vb + (size_t)(t0 + q) * row;
        if constexpr (HD != 0 && HD % 64 == 0) {  // dpl even: half2 reads
#pragma unroll
          for (int u = 0; u < HD / 32; u += 2) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(vr + u));
            vf[u] = f.x;
            vf[u + 1] = f.y;
          }
        } else {
#pragma unroll
          for (int u = 0; u < kMaxDpl; u++) vf[u] = u < dpl && lane * dpl + u < hd ? __half2float(vr[u]) : 0.0f;
        }
#pragma unroll
        for (int h = 0; h < G; h++) {
          if (h >= g) continue;  // (uniform; not break: the heads' FMAs stay free to interleave)
          const float pq = q == 0 ? p4[h].x : q == 1 ? p4[h].y : q == 2 ? p4[h].z : p4[h].w;
#pragma unroll
          for (int u = 0; u < kMaxDpl; u++)
            if (u < dpl) o[h][u] = fmaf(pq, vf[u], o[h][u]);
        }
      }
    }

    // ---- the warps' (max, sum, O) -> the output, or this split's partial (+ the merge by the last split) ----
    __syncthreads();  // every warp is done with the K and V tiles: `part` lies over them
#pragma unroll
    for (int h = 0; h < G; h++) {
      if (h >= g) break;
      float* ws = part + (size_t)(warp * g + h) * (hd + 2);
#pragma unroll
      for (int u = 0; u < kMaxDpl; u++)
        if (u < dpl && lane * dpl + u < hd) ws[lane * dpl + u] = o[h][u];
      if (lane == 0) {
        ws[hd] = m[h];
        ws[hd + 1] = l[h];
      }
    }
    __syncthreads();
    __half* out = p.out + (size_t)rr * p.ld_out;
    for (int i = threadIdx.x; i < g * hd; i += kThreads) {
      const int h = i / hd, d = i - h * hd;
      float M = -FLT_MAX;
      for (int w = 0; w < kWarps; w++) M = fmaxf(M, part[(size_t)(w * g + h) * (hd + 2) + hd]);
      float O = 0.0f, L = 0.0f;
      for (int w = 0; w < kWarps; w++) {
        const float* ws = part + (size_t)(w * g + h) * (hd + 2);
        const float e = __expf(ws[hd] - M);
        O = fmaf(e, ws[d], O);
        L = fmaf(e, ws[hd + 1], L);
      }
      if (n_splits == 1) {
        out[(size_t)(hq0 + h) * hd + d] = out_value(O / L, p.act8_out);
      } else {
        const size_t slot = ((size_t)rr * p.n_heads + hq0 + h) * max_splits + sp;
        p.part_o[slot * hd + d] = O;
        if (d == 0) *reinterpret_cast<float2*>(p.part_ml + slot * 2) = make_float2(M, L);
      }
    }
    if (n_splits > 1) {
      __threadfence();  // this split's partial is visible device-wide before its ticket
      __syncthreads();
      if (threadIdx.x == 0) {
        unsigned* ticket = p.tickets + ((size_t)rr * p.n_kv_heads + kvh) * nz + zs;
        s_last = atomicAdd(ticket, 1u) == (unsigned)(n_splits - 1);
        if (s_last) atomicExch(ticket, 0u);  // every split has counted: zero again for the next launch
      }
      __syncthreads();
      if (s_last) {  // the last split to finish merges all of them, in split order (__ldcg: from L2)
        __threadfence();
        for (int i = threadIdx.x; i < g * hd; i += kThreads) {
          const int h = i / hd, d = i - h * hd;
          const size_t base = ((size_t)rr * p.n_heads + hq0 + h) * max_splits;
          const float2* ml = reinterpret_cast<const float2*>(p.part_ml) + base;
          float M = -FLT_MAX;
          for (int s = 0; s < n_splits; s++) M = fmaxf(M, __ldcg(&ml[s].x));
          float O = 0.0f, L = 0.0f;
          for (int s = 0; s < n_splits; s++) {
            const float2 v = __ldcg(&ml[s]);
            const float e = __expf(v.x - M);
            O = fmaf(e, __ldcg(p.part_o + (base + s) * hd + d), O);
            L = fmaf(e, v.y, L);
          }
          out[(size_t)(hq0 + h) * hd + d] = out_value(O / L, p.act8_out);
        }
      }
    }
    __syncthreads();  // the tiles, s_last and the RoPE row are the next split's
  }
}

// Splits per block row: about 4 blocks per SM over all rows and heads, each looping over its row's splits.
int rows_grid_x(int splits, int blocks_per_split) {
  return std::max(1, std::min(splits, (4 * sm_count() + blocks_per_split - 1) / blocks_per_split));
}

// Blocks of this instantiation one SM holds at `smem` bytes (its registers and shared memory decide).
template <int HD, int SPAN, int G>
int resident(size_t smem) {
  auto k = decode_attn_rows_kernel<HD, SPAN, G>;
  if (smem > 48 * 1024)
    TI_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  int b = 0;
  TI_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, k, kThreads, smem));
  return b;
}

// G (p.rows_heads, or auto: the fewest heads per block — the shortest serial work per block, the most blocks —
// while the busy blocks, n_rows x KV heads x slices, fit in one wave at the kernel's residency; at least two from
// two rows where the group has two), then the launch. Past one wave the slices cost more than their shorter
// blocks save; one head a block re-reads each K / V tile from L2 once per query head, which lost to two a block
// at 2-8 rows and won only at one (the A/B: docs/perf/batch.md).
template <int HD, int SPAN>
void launch_rows(const DecodeAttnParams& p, int n_rows, int span, cudaStream_t s, bool pdl) {
  const int group = p.n_heads / p.n_kv_heads, hd = p.head_dim;
  const int64_t sms = sm_count();
  auto busy = [&](int G) { return (int64_t)n_rows * p.n_kv_heads * ((group + G - 1) / G); };
  int G = p.rows_heads;
  if (G == 0)
    G = (n_rows == 1 || group == 1) && busy(1) <= sms * resident<HD, SPAN, 1>(rows_smem(hd, span, 1)) ? 1
        : busy(2) <= sms * resident<HD, SPAN, 2>(rows_smem(hd, span, 2)) ? 2
        : busy(4) <= sms * resident<HD, SPAN, 4>(rows_smem(hd, span, 4)) ? 4
                                                                          : 8;
  const int nz = n_rows * ((group + G - 1) / G);
  const dim3 grid(p.grid_x > 0 ? p.grid_x : rows_grid_x((p.max_seq + span - 1) / span, p.n_kv_heads * nz),
                  p.n_kv_heads, nz);
  const size_t smem = rows_smem(hd, span, G);
  if (G == 1) launch_attention<decode_attn_rows_kernel<HD, SPAN, 1>>(p, grid, dim3(kThreads), smem, s, pdl);
  else if (G == 2) launch_attention<decode_attn_rows_kernel<HD, SPAN, 2>>(p, grid, dim3(kThreads), smem, s, pdl);
  else if (G == 4) launch_attention<decode_attn_rows_kernel<HD, SPAN, 4>>(p, grid, dim3(kThreads), smem, s, pdl);
  else launch_attention<decode_attn_rows_kernel<HD, SPAN, 8>>(p, grid, dim3(kThreads), smem, s, pdl);
}

// A block per (row, KV head), a thread per pair of dims: the key rotated as rope_new_token rotates it
// (rope_key_pair), so the cache holds what the kernel above would have written.
__global__ void append_kv_rows_kernel(DecodeAttnParams p) {
  const int rr = blockIdx.x, kvh = blockIdx.y, i = threadIdx.x, hd = p.head_dim, half_d = hd / 2;
  const int pos = p.row_pos[rr];
  if (pos < 0 || i >= half_d) return;
  const int* table = p.page_table + (size_t)p.row_slot[rr] * p.table_stride;
  const float* qkv = p.qkv + (size_t)rr * p.ld_qkv;
  const int q_dim = p.n_heads * hd, kv_dim = p.n_kv_heads * hd;
  const float* k = qkv + q_dim + (size_t)kvh * hd;
  const float* v = qkv + q_dim + kv_dim + (size_t)kvh * hd;
  const float c = p.rope_cos[(size_t)pos * half_d + i], sn = p.rope_sin[(size_t)pos * half_d + i];
  const float k1 = k[i], k2 = k[i + half_d];
  const size_t at = kv_row(table, pos, kvh, p.n_kv_heads, p.page_shift, hd);
  rope_key_pair(k1, k2, c, sn, p.k_pages[at + i], p.k_pages[at + i + half_d]);
  p.v_pages[at + i] = __float2half(v[i]);
  p.v_pages[at + i + half_d] = __float2half(v[i + half_d]);
}

}  // namespace

int attn_rows_span_of(const DecodeAttnParams& p) {
  const int span = p.rows_span ? p.rows_span : attn_rows_span(p.head_dim);
  if ((span != 64 && span != 128 && span != 256) || span > attn_rows_span(p.head_dim))
    fail(ErrorKind::Request, "batch_attn_span " + std::to_string(span) + " must be 64, 128 or 256 and at most " +
                                 std::to_string(attn_rows_span(p.head_dim)) + " at head dim " +
                                 std::to_string(p.head_dim) + " (0: that)");
  return span;
}

void check_attn_rows_heads(const DecodeAttnParams& p) {
  if (p.rows_heads != 0 && p.rows_heads != 1 && p.rows_heads != 2 && p.rows_heads != 4 && p.rows_heads != 8)
    fail(ErrorKind::Request,
         "batch_attn_heads " + std::to_string(p.rows_heads) + " must be 0 (auto), 1, 2, 4 or 8");
}

void append_kv_rows(const DecodeAttnParams& p, int n_rows, cudaStream_t s) {
  check_decode_attn(p);
  if (n_rows < 1 || !p.row_pos || !p.row_slot || p.table_stride < 1)
    fail(ErrorKind::Request, "append_kv_rows: needs rows, row_pos, row_slot and table_stride");
  append_kv_rows_kernel<<<dim3((unsigned)n_rows, (unsigned)p.n_kv_heads), (unsigned)(p.head_dim / 2), 0, s>>>(p);
  TI_CUDA_CHECK(cudaGetLastError());
}

void decode_attention_rows(const DecodeAttnParams& p, int n_rows, cudaStream_t s, bool pdl) {
  check_decode_attn(p);
  check_attn_rows_heads(p);
  const int per_row = p.n_heads / p.n_kv_heads, nz = n_rows * per_row;  // (at most: a head a block)
  if (n_rows < 1 || nz > 65535 || !p.row_pos || !p.row_slot || !p.tickets || p.table_stride < 1)
    fail(ErrorKind::Request, "decode_attention_rows: needs 1.." + std::to_string(65535 / per_row) +
                                 " rows, row_pos, row_slot, tickets and table_stride");
  if (p.appended && pdl)  // (its loads before the wait would race the append)
    fail(ErrorKind::Request, "decode_attention_rows: appended rows need a launch without PDL");
  if (p.act8_out && p.head_dim % kAct8Group != 0)
    fail(ErrorKind::Request, "decode_attention_rows: act8_out needs head_dim % 32 == 0 (head_dim " +
                                 std::to_string(p.head_dim) + ")");
  const int span = attn_rows_span_of(p), hd = p.head_dim;
  if (hd == 64 && span == 256) launch_rows<64, 256>(p, n_rows, span, s, pdl);
  else if (hd == 64 && span == 128) launch_rows<64, 128>(p, n_rows, span, s, pdl);
  else if (hd == 64) launch_rows<64, 64>(p, n_rows, span, s, pdl);
  else if (hd == 128 && span == 128) launch_rows<128, 128>(p, n_rows, span, s, pdl);
  else if (hd == 128) launch_rows<128, 64>(p, n_rows, span, s, pdl);
  else launch_rows<0, 0>(p, n_rows, span, s, pdl);
}

}  // namespace ti::cuda
