// prefill_attention.cu — tiled causal attention for the prefill (FlashAttention-2 style, tensor cores).
//
// What: out[t, h] = softmax_j<=pos0+t (q[t,h] . K[j] * scale) V[j] for T new tokens whose keys and values are
// already in the cache (rope_rows wrote them), so a prompt can be prefilled in chunks and after earlier turns.
// The cache is paged (kv_layout.cuh): each key tile is one run of a page, found by one table load.
//
// GQA packing. A block owns one KV head and 64 "packed rows": row r is (token r / group, query head
// kvh * group + r % group), so the `group` query heads that share a KV head share every K/V tile the block
// loads (FlashInfer's trick). 4 warps x 16 rows; grid (ceil(T * group / 64), n_kv_heads), heaviest (last)
// tiles first so the causal triangle's long rows do not end up in the tail.
//
// Per KV tile of BC keys: K and V rows into shared memory (16-byte loads, rows padded by 8 halves so that the
// fragment loads below are bank-conflict free), S = Q K^T (K fragments by ldmatrix) with mma.sync m16n8k16 (fp16 in, fp32 accumulate;
// two m16n8k8 on sm_75), scale and causal mask (only on tiles that cross the diagonal), online softmax in
// registers (running max m and sum l per row; exp2 with the scale folded into log2 e), then O += P V with P
// reused straight from the S accumulators as the A operand (the accumulator layout of two n8 tiles is the A
// layout of one k16 step) and V fragments by ldmatrix.trans. No T x T matrix exists anywhere; O stays in
// registers (HDMAX / 8 x 4 floats per thread) until the final 1 / l.
//
// Varlen (many sequences in one pass, PrefillAttnParams::seqs / tiles): the rows of K prompts lie one after the
// other in q and out; a block still serves 64 packed rows of ONE sequence (a tile never straddles two, so its
// keys come through one page table and its causal limits are that sequence's), named by a host-made tile list
// that also orders the blocks heaviest first across all sequences. Nothing else changes: one launch attends
// every sequence to its own cache pages and its own earlier tokens.
//
// Variants (HDMAX, BC, STAGES): (64, 64) for head_dim <= 64, (128, 64) for <= 128, (256, 32) for <= 256, with
// two K/V stages (cp.async, sm_80+: the next tile streams in while this one is computed); one stage where the
// GPU lacks cp.async or the shared memory (sm_75: 64 KB per block), and (256, 16, 1) below 67 KB.
#include <algorithm>
#include <cfloat>
#include <utility>
#include <vector>

#include "common.cuh"
#include "kv_layout.cuh"
#include "mma_frag.cuh"
#include "prefill_attention.cuh"

namespace ti::cuda {

constexpr int kBr = 64, kThreads = 128, kRowPad = 8;

template <int HDMAX, int BC, int STAGES>
__global__ void __launch_bounds__(kThreads) prefill_attn_kernel(PrefillAttnParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int hd = p.head_dim, LD = hd + kRowPad, words = hd / 8;
  __half* Qs = reinterpret_cast<__half*>(smem_raw);  // (kBr, LD)
  __half* KVs = Qs + kBr * LD;                        // STAGES x [K (BC, LD), V (BC, LD)]

  const int group = p.n_heads / p.n_kv_heads, kvh = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int q_dim = p.n_heads * hd;
  // The block's sequence: the one of the params, or (varlen) the one its tile names.
  int T = p.T, pos0 = p.pos0, r0 = (gridDim.x - 1 - blockIdx.x) * kBr;  // heaviest tiles first
  const __half* qs = p.q;
  __half* outs = p.out;
  const int* table = p.page_table;
  if (p.tiles) {
    const int2 tile = p.tiles[blockIdx.x];
    const int4 sq = p.seqs[tile.x];
    T = sq.y;
    pos0 = sq.z;
    r0 = tile.y;
    qs += (size_t)sq.x * q_dim;
    outs += (size_t)sq.x * p.ldo;
    table += sq.w;
  }
  const int rows = T * group;

  // ---- the block's 64 packed query rows into shared memory (zeros past the last row) ----
  for (int i = threadIdx.x; i < kBr * words; i += kThreads) {
    const int r = i / words, w = i % words, pr = r0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (pr < rows) {
      const int t = pr / group, h = kvh * group + pr % group;
      v = *reinterpret_cast<const uint4*>(qs + (size_t)t * q_dim + (size_t)h * hd + w * 8);
    }
    *reinterpret_cast<uint4*>(Qs + r * LD + w * 8) = v;
  }

  // This thread's two rows (of the warp's 16): ra and rb = ra + 8; the last key position each may see.
  const int ra = r0 + warp * 16 + g, rb = ra + 8;
  const int lim_a = pos0 + min(ra, rows - 1) / group, lim_b = pos0 + min(rb, rows - 1) / group;
  const int kv_len = pos0 + min(r0 + kBr - 1, rows - 1) / group + 1;  // keys the block needs
  const int kv_all = pos0 + r0 / group + 1;  // keys [0, kv_all) are visible to every row of the block
  const float scale_log2 = p.scale * 1.4426950408889634f;

  // Q's A fragments: loaded from shared memory once and kept in registers when head_dim <= 128 (<= 32
  // registers); for 256 they would not fit beside O, so they are re-read per tile.
  constexpr bool kQInRegs = HDMAX <= 128;
  uint32_t qf[kQInRegs ? HDMAX / 16 : 1][4];
  auto load_q = [&](int ks, uint32_t* a) {
    const __half* qa = Qs + (warp * 16 + g) * LD + ks * 16 + 2 * c;
    a[0] = lds32(qa);
    a[1] = lds32(qa + 8 * LD);
    a[2] = lds32(qa + 8);
    a[3] = lds32(qa + 8 * LD + 8);
  };

  float o[HDMAX / 8][4];
#pragma unroll
  for (int dn = 0; dn < HDMAX / 8; dn++) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
  float m_a = -1e30f, m_b = -1e30f, l_a = 0.0f, l_b = 0.0f;  // finite start: a fully masked tile gives exp2(-inf)=0

  // K and V rows kv0.. of tile `stage` (rows past kv_len: zeros, since 0 * garbage could be NaN). The tile's BC
  // rows lie in one page (BC <= 64 <= page_size, both powers of two, kv0 a multiple of BC): one table load, for
  // the page of kv0 < kv_len (assigned).
  auto load_tile = [&](int stage, int kv0) {
    __half* Kd = KVs + (size_t)stage * 2 * BC * LD;
    __half* Vd = Kd + BC * LD;
    const size_t base = kv_row(table, kv0, kvh, p.n_kv_heads, p.page_shift, hd);
    for (int i = threadIdx.x; i < BC * words; i += kThreads) {
      const int r = i / words, w = i % words;
      const bool ok = kv0 + r < kv_len;
      const size_t at = base + (size_t)(ok ? r : 0) * hd + w * 8;
      cp_async16_or_zero(Kd + r * LD + w * 8, p.k_pages + at, ok);
      cp_async16_or_zero(Vd + r * LD + w * 8, p.v_pages + at, ok);
    }
    cp_async_commit();
  };
  // Two stages: tile i+1 streams in while tile i is computed. One stage (where shared memory is short): load,
  // wait, compute.
  if (STAGES == 2) load_tile(0, 0);
  for (int kv0 = 0, it = 0; kv0 < kv_len; kv0 += BC, it++) {
    if (STAGES == 2) {
      if (kv0 + BC < kv_len) load_tile((it + 1) & 1, kv0 + BC);
      else cp_async_commit();  // an empty group keeps the count uniform
      cp_async_wait<1>();      // tile `it` has landed (only the newest group may be in flight)
    } else {
      load_tile(0, kv0);
      cp_async_wait<0>();
    }
    __syncthreads();  // every thread's part of the tile (and, on the first pass, of Q) is visible
    const __half* Ks = KVs + (size_t)(STAGES == 2 ? (it & 1) : 0) * 2 * BC * LD;
    const __half* Vs = Ks + BC * LD;

    // ---- S = Q K^T: (16 rows) x (BC keys) per warp. K fragments by ldmatrix.x4: matrices 0, 1 are keys
    //      j*8.. at dims ks*16 and ks*16 + 8 (b0, b1 of key tile j), matrices 2, 3 the same for tile j + 1 ----
    if (kQInRegs && it == 0) {
#pragma unroll
      for (int ks = 0; ks < HDMAX / 16; ks++)
        if (ks < hd / 16) load_q(ks, qf[ks]);
    }
    float s[BC / 8][4];
#pragma unroll
    for (int j = 0; j < BC / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    const __half* krow = Ks + ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < HDMAX / 16; ks++) {
      if (ks < hd / 16) {
        uint32_t a_mem[4];
        if (!kQInRegs) load_q(ks, a_mem);
        const uint32_t* a = kQInRegs ? qf[kQInRegs ? ks : 0] : a_mem;
#pragma unroll
        for (int j = 0; j < BC / 8; j += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, krow + j * 8 * LD + ks * 16);
          mma_16816(s[j], a, b[0], b[1]);
          mma_16816(s[j + 1], a, b[2], b[3]);
        }
      }
    }

    // ---- scale, causal mask, online softmax ----
    const bool diagonal = kv0 + BC > kv_all;
    float mx_a = m_a, mx_b = m_b;
#pragma unroll
    for (int j = 0; j < BC / 8; j++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int col = kv0 + j * 8 + 2 * c + (e & 1);
        float v = s[j][e] * scale_log2;
        if (diagonal && col > (e < 2 ? lim_a : lim_b)) v = -INFINITY;
        s[j][e] = v;
      }
      mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
    }
    // a row's 4 threads (same g) hold its BC columns between them
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    const float alpha_a = fast_exp2(m_a - mx_a), alpha_b = fast_exp2(m_b - mx_b);
    m_a = mx_a;
    m_b = mx_b;
    l_a *= alpha_a;  // l stays a per-thread partial sum (its own columns); the quad sums it once at the end
    l_b *= alpha_b;
#pragma unroll
    for (int dn = 0; dn < HDMAX / 8; dn++) {
      o[dn][0] *= alpha_a;
      o[dn][1] *= alpha_a;
      o[dn][2] *= alpha_b;
      o[dn][3] *= alpha_b;
    }
#pragma unroll
    for (int j = 0; j < BC / 8; j++) {
      s[j][0] = fast_exp2(s[j][0] - m_a);
      s[j][1] = fast_exp2(s[j][1] - m_a);
      s[j][2] = fast_exp2(s[j][2] - m_b);
      s[j][3] = fast_exp2(s[j][3] - m_b);
      l_a += s[j][0] + s[j][1];
      l_b += s[j][2] + s[j][3];
    }

    // ---- O += P V: P from the S accumulators (two n8 tiles = one k16 A fragment), V by ldmatrix.trans ----
#pragma unroll
    for (int kk = 0; kk < BC / 16; kk++) {
      const uint32_t a[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]), pack_half2(s[2 * kk][2], s[2 * kk][3]),
                             pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const __half* vrow = Vs + (kk * 16 + (lane & 15)) * LD + (lane >> 4) * 8;
#pragma unroll
      for (int dn = 0; dn < HDMAX / 8; dn += 2) {
        if (dn < hd / 8) {
          uint32_t b[4];  // b[0], b[1]: dims dn*8..; b[2], b[3]: dims (dn+1)*8..
          ldmatrix_x4_trans(b, vrow + dn * 8);
          mma_16816(o[dn], a, b[0], b[1]);
          mma_16816(o[dn + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the tile is consumed before a later load_tile overwrites its stage
  }

  // ---- normalise and store ----
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
  __half* out_a = ra < rows ? outs + (size_t)(ra / group) * p.ldo + (size_t)(kvh * group + ra % group) * hd : nullptr;
  __half* out_b = rb < rows ? outs + (size_t)(rb / group) * p.ldo + (size_t)(kvh * group + rb % group) * hd : nullptr;
#pragma unroll
  for (int dn = 0; dn < HDMAX / 8; dn++) {
    if (dn < hd / 8) {
      const int col = dn * 8 + 2 * c;
      if (out_a) *reinterpret_cast<__half2*>(out_a + col) = __floats2half2_rn(o[dn][0] * inv_a, o[dn][1] * inv_a);
      if (out_b) *reinterpret_cast<__half2*>(out_b + col) = __floats2half2_rn(o[dn][2] * inv_b, o[dn][3] * inv_b);
    }
  }
}

// Varlen blocks. A tile's work grows with the keys its last row sees (pos0 + its last token + 1): sorted by that,
// largest first, so the long rows of long sequences start first and short tiles fill the tail.
void prefill_attention_tiles(const int* seq_T, const int* seq_pos0, int n_seqs, int group, int2* out, int* n_out) {
  std::vector<std::pair<int, int2>> tiles;  // (keys, tile)
  for (int s = 0; s < n_seqs; s++) {
    const int rows = seq_T[s] * group;
    for (int r0 = 0; r0 < rows; r0 += kBr)
      tiles.push_back({seq_pos0[s] + (std::min(r0 + kBr, rows) - 1) / group + 1, make_int2(s, r0)});
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = 0; i < tiles.size(); i++) out[i] = tiles[i].second;
  *n_out = (int)tiles.size();
}

int prefill_attention_max_tiles(int total_T, int n_seqs, int group) {
  return (int)(((int64_t)total_T * group) / kBr + n_seqs);  // sum of ceil(T_s g / 64) <= sum (T_s g / 64 + 1)
}

bool prefill_attention_supported(int head_dim) { return head_dim % 16 == 0 && head_dim >= 16 && head_dim <= 256; }

template <int HDMAX, int BC, int STAGES>
static void launch_prefill_attn(const PrefillAttnParams& p, dim3 grid, size_t smem, cudaStream_t s) {
  // A property of the CUDA function (process-wide), raised to the largest request so far: one variant serves
  // several head dims (96 and 128 share HDMAX 128), so the first call's size is not the last word.
  static size_t raised_to = 48 * 1024;
  if (smem > raised_to) {
    TI_CUDA_CHECK(cudaFuncSetAttribute(prefill_attn_kernel<HDMAX, BC, STAGES>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    raised_to = smem;
  }
  prefill_attn_kernel<HDMAX, BC, STAGES><<<grid, kThreads, smem, s>>>(p);
  TI_CUDA_CHECK(cudaGetLastError());
}

void prefill_attention(const PrefillAttnParams& p, cudaStream_t s) {
  if (!prefill_attention_supported(p.head_dim))
    fail(ErrorKind::Request, "prefill_attention: head_dim must be a multiple of 16 in 16..256, got " +
                                 std::to_string(p.head_dim));
  if (p.n_kv_heads < 1 || p.n_heads % p.n_kv_heads != 0)
    fail(ErrorKind::Request, "prefill_attention: n_heads must be a multiple of n_kv_heads");
  if (p.page_shift < 6 || p.page_shift > 20)
    fail(ErrorKind::Request, "prefill_attention: page size must be a power of two >= 64, got 2^" +
                                 std::to_string(p.page_shift));
  const int group = p.n_heads / p.n_kv_heads;
  dim3 grid;
  if (p.tiles) {  // (the sequences' ranges were checked where the tiles were made: they live on the device)
    if (!p.seqs) fail(ErrorKind::Request, "prefill_attention: varlen tiles without sequences");
    if (p.n_tiles < 1) return;
    grid = dim3((unsigned)p.n_tiles, (unsigned)p.n_kv_heads);
  } else {
    if (p.T < 1) return;
    if (p.pos0 < 0 || p.pos0 + p.T > p.max_seq) fail(ErrorKind::Request, "prefill_attention: positions out of range");
    grid = dim3((unsigned)(((int64_t)p.T * group + kBr - 1) / kBr), (unsigned)p.n_kv_heads);
  }
  int dev = 0, optin = 0, major = 0;
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  auto smem = [&](int bc, int stages) {
    return (size_t)(kBr + 2 * stages * bc) * (p.head_dim + kRowPad) * sizeof(__half);
  };
  const bool two = p.stages ? p.stages == 2 : major >= 8;  // cp.async; and the shared memory for two stages
  if (p.head_dim <= 64) {
    if (two && (size_t)optin >= smem(64, 2)) return launch_prefill_attn<64, 64, 2>(p, grid, smem(64, 2), s);
    return launch_prefill_attn<64, 64, 1>(p, grid, smem(64, 1), s);
  }
  if (p.head_dim <= 128) {
    if (two && (size_t)optin >= smem(64, 2)) return launch_prefill_attn<128, 64, 2>(p, grid, smem(64, 2), s);
    return launch_prefill_attn<128, 64, 1>(p, grid, smem(64, 1), s);
  }
  if (two && (size_t)optin >= smem(32, 2)) return launch_prefill_attn<256, 32, 2>(p, grid, smem(32, 2), s);
  if ((size_t)optin >= smem(32, 1)) return launch_prefill_attn<256, 32, 1>(p, grid, smem(32, 1), s);
  return launch_prefill_attn<256, 16, 1>(p, grid, smem(16, 1), s);
}

}  // namespace ti::cuda
