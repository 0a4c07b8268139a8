// mma_small_n.cu — y = W x for up to 64 fp16 input rows on the tensor cores (mma.sync m16n8k16, fp16 in, fp32
// sums), see mma_small_n.cuh. The batched decode step is memory-bound at every n <= 64 only if each weight is
// read and dequantized once for all n and the arithmetic per weight stays small: one mma per 16 x 16 weight tile
// per 8 inputs does that (the CUDA-core gemv_batch.cu spends ~13 instructions per weight pair per 8 inputs).
//
// A block of 8 warps owns 16 weight rows (M; or 32, two tiles, see mm_rows) and splits K over its warps; each warp covers the block's n inputs
// (NT tiles of 8: the mma's N). Weights go from global memory into A fragments (int8 / int4: straight into
// registers; fp16: through a per-lane ring in shared memory, mma_small_n_ring_kernel below):
// lane (g = lane / 4, t = lane % 4) loads the 16-byte word t of a "chunk" (4 words: 32 fp16, 64 I8 or 128 I4
// weights) of rows g and g + 8, dequantizes it to fp16 pairs (quant_words.cuh), and that word feeds E / 4
// mma k-steps. The k order inside a k-step is permuted: in step s the lane's A halves (2t, 2t + 1) and
// (2t + 8, 2t + 9) are the physical columns E t + 4 s + (0, 1) and (2, 3) of the chunk (E: weights per word);
// the B fragment (the inputs, column n = g of the tile) takes the same physical columns, so each lane reads E
// contiguous fp16 inputs per word — the sum over k is the same sum. Inputs come from global memory (n x K fp16:
// L1 / L2 hits, read once per block). Past K (the row's last word) both the weights and the inputs are zeroed.
// The 8 warps' fp32 partial sums meet in shared memory in warp order (deterministic), then the epilogue.
#include <algorithm>

#include "common.cuh"
#include "mma_small_n.cuh"
#include "quant_words.cuh"

namespace ti::cuda {

constexpr int kMmWarps = 8, kMmThreads = kMmWarps * 32, kMmRows = 16;
// Chunks in flight per warp (the ring's slots, U): 2 U 16-byte words of weights per lane (fp16 / I8: 4; I4,
// whose dequantized words fill the most registers: 2). With one 8-warp block per SM (o and down: 128 blocks of 16
// rows) that is 32 KB in flight.
template <WFormat WF> constexpr int kMmUnroll = WF == WFormat::I4 ? 2 : 4;
// A product of at most one block per SM (the residual products o and down at a 2,048-wide model: 128 tiles of 16
// rows) has only its one block's bytes in flight per SM: at down's K = 5,632 (int4: 5.5 chunks a warp) U = 2
// cost three dependent round trips to DRAM. There a warp keeps up to kMmUnrollDeep chunks in flight (all of
// down's at int4, before the PDL wait) — 156-184 registers at int4 (one block per SM), so only where the grid is
// one wave anyway: a grid of two waves at that residency lost more than it gained (docs/perf/batch.md).
template <WFormat WF> constexpr int kMmUnrollDeep = WF == WFormat::I4 ? 6 : 8;


// d += A (16 x 16, rows g / g + 8, halves as above) * B (16 x 8)
__device__ __forceinline__ void mm_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // (never launched below sm_80: mma_small_n_fits refuses)
#endif
}

// The E inputs of column row x (fp16) at the word k as E / 2 pairs; zero past K or for a column past n. PRE: the
// word's E / 8 16-byte input words are already loaded into pre (the rings below; used only where the word lies wholly
// below K). A dead lane (live false: a column past n, or a word past the row's last) takes a branch of zeros of its
// own: a partial column tile (every n but 8, 16, 32, 64) has dead lanes in every warp, and when they shared the row's
// last word's per-element path (E / 2 compare-select-load steps), each warp ran that path beside the live lanes'
// loads for every word (persistent.md §27).
template <int E, bool PRE>
__device__ __forceinline__ void mm_inputs(const __half* x, int k, int K, bool live, const uint4* pre, __half2* b) {
  const __half z = __float2half(0.0f);
  if (live && (k + 1) * E <= K) {
#pragma unroll
    for (int c = 0; c < E / 8; c++) {
      const uint4 v = PRE ? pre[c] : __ldg(reinterpret_cast<const uint4*>(x + (size_t)k * E) + c);
      b[4 * c] = gb_h2(v.x), b[4 * c + 1] = gb_h2(v.y), b[4 * c + 2] = gb_h2(v.z), b[4 * c + 3] = gb_h2(v.w);
    }
  } else if (live) {
#pragma unroll
    for (int i = 0; i < E / 2; i++) {
      const int c = k * E + 2 * i;
      const __half lo = c < K ? x[c] : z, hi = c + 1 < K ? x[c + 1] : z;
      b[i] = __halves2half2(lo, hi);
    }
  } else {
#pragma unroll
    for (int i = 0; i < E / 2; i++) b[i] = __halves2half2(z, z);
  }
}

// One weight word of a 16-row tile (rows g / g + 8: wa2 / wb2, E / 2 fp16 pairs each) against the NT column tiles'
// inputs at that word: acc[j] += A B_j, E / 4 k-steps each (both kernels: the same operations in the same order).
template <int E, int NT>
__device__ __forceinline__ void mm_word(float (&acc)[NT][4], const __half2 (&wa2)[E / 2],
                                        const __half2 (&wb2)[E / 2], const __half2 (&x2)[NT][E / 2]) {
#pragma unroll
  for (int j = 0; j < NT; j++)
#pragma unroll
    for (int s = 0; s < E / 4; s++)
      mm_mma(acc[j], gb_u32(wa2[2 * s]), gb_u32(wb2[2 * s]), gb_u32(wa2[2 * s + 1]), gb_u32(wb2[2 * s + 1]),
             gb_u32(x2[j][2 * s]), gb_u32(x2[j][2 * s + 1]));
}

// The epilogue of both kernels: the 8 warps' sums (acc[m][j] = (row 16 m + g, cols 2t, 2t + 1), (row 16 m + g +
// 8, ...)) meet in shared memory `red` (kMmWarps x BR x NC floats) in warp order, then the output.
template <int NT, int MT, GemvOut OUT>
__device__ __forceinline__ void mm_epilogue(const float (&acc)[MT][NT][4], float* red, const GemvBatchArgs& a,
                                            int row0) {
  constexpr int NC = NT * 8, BR = kMmRows * MT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const QMat& W = a.W;
  float* mine = red + (size_t)warp * BR * NC;
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int j = 0; j < NT; j++) {
      const int col = j * 8 + 2 * t, r = kMmRows * m + g;
      mine[r * NC + col] = acc[m][j][0];
      mine[r * NC + col + 1] = acc[m][j][1];
      mine[(r + 8) * NC + col] = acc[m][j][2];
      mine[(r + 8) * NC + col + 1] = acc[m][j][3];
    }
  __syncthreads();
  auto total = [&](int r, int col) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmWarps; w++) s += red[((size_t)w * BR + r) * NC + col];
    return s;
  };
  if constexpr (OUT == GemvOut::Swiglu) {  // rows 2i (gate), 2i + 1 (up): BR / 2 pairs per block
    for (int i = threadIdx.x; i < (BR / 2) * NC; i += kMmThreads) {
      const int p = i % (BR / 2), col = i / (BR / 2), row = row0 + 2 * p;
      if (col >= a.n || row + 1 >= W.rows) continue;
      const float gt = total(2 * p, col), up = total(2 * p + 1, col);
      static_cast<__half*>(a.y)[(size_t)col * a.ldy + row / 2] = __float2half(gt / (1.0f + __expf(-gt)) * up);
    }
  } else {
    for (int i = threadIdx.x; i < BR * NC; i += kMmThreads) {
      const int r = i % BR, col = i / BR, row = row0 + r;
      if (col >= a.n || row >= W.rows) continue;
      float* y = static_cast<float*>(a.y) + (size_t)col * a.ldy + row;
      const float v = total(r, col);
      *y = OUT == GemvOut::AddF32 ? *y + v : v;
    }
  }
}

// MT 16-row M tiles per block (1 or 2; mma_small_n picks): with 2, each input fragment, read once per chunk from
// L1 / L2, meets two tiles' weights — at int4 a 16-byte word of 32 weights meets 64 bytes of inputs per column, so
// the inputs' traffic, not the weights', sets the pace of a one-tile block; two tiles halve it.
template <WFormat WF, int NT, int MT, GemvOut OUT, int U>
__global__ void __launch_bounds__(kMmThreads, MT == 2 && WF == WFormat::I4 ? 2 : 1) mma_small_n_kernel(GemvBatchArgs a) {
  constexpr int E = kWordElems<WF>, BR = kMmRows * MT;
  extern __shared__ __align__(16) float red[];  // (kMmWarps, BR, NT x 8) the warps' partial sums
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const QMat& W = a.W;
  const int row0 = blockIdx.x * BR, K = W.K;
  int ra[MT], rb[MT];
  const uint4* wa[MT];
  const uint4* wb[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) {
    ra[m] = min(row0 + kMmRows * m + g, W.rows - 1);  // past the end: computed, stored nowhere
    rb[m] = min(row0 + kMmRows * m + g + 8, W.rows - 1);
    wa[m] = gb_row<WF>(W, ra[m]);
    wb[m] = gb_row<WF>(W, rb[m]);
  }
  const int words = gb_words(W, E), chunks = (words + 3) / 4;
  const __half* xcol[NT];
  bool live[NT];
#pragma unroll
  for (int j = 0; j < NT; j++) {
    const int col = j * 8 + g;
    live[j] = col < a.n;
    xcol[j] = static_cast<const __half*>(a.x) + (size_t)(live[j] ? col : 0) * a.ldx;
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;

  // A ring of U register slots a lane: slot u holds the weights (and, see PX, the inputs) of the warp's chunks u,
  // u + U, u + 2 U, ... (each kMmWarps apart), and a slot is refilled with its next chunk as soon as it is
  // consumed, so U chunks stay in flight while the warp computes; refilling all U only once all U were used left a
  // DRAM round trip exposed per pass, and at one block per SM nothing else hides it. Inputs read at a chunk's use
  // cost the warp a dependent L2 round trip per chunk; PX loads them with their weights instead — only at fp16 /
  // int8 from two 8-column tiles and while they fit in 8 words a lane: at int4 (4 input words a column per weight
  // word) the registers cost multi-wave grids their second block per SM, at one tile the step did not gain
  // (docs/perf/batch.md).
  constexpr int XW = E / 8;  // 16-byte input words a column per weight word
  constexpr bool PX = WF != WFormat::I4 && MT == 1 && NT >= 2 && U * NT * XW <= 8;
  uint4 va[MT][U], vb[MT][U], xv[PX ? U : 1][NT][XW];
  float2 sa[MT][U], sb[MT][U];
  auto load_weights = [&](int u, int c) {  // chunk c (of this warp) into slot u: 2 MT words a lane
    const int k = c * 4 + t;
    const bool ok = c < chunks && k < words;
#pragma unroll
    for (int m = 0; m < MT; m++) {
      va[m][u] = ok ? load_stream(wa[m] + k) : make_uint4(0, 0, 0, 0);
      vb[m][u] = ok ? load_stream(wb[m] + k) : make_uint4(0, 0, 0, 0);
      sa[m][u] = gb_scale<WF>(W, ra[m], ok ? k : 0);
      sb[m][u] = gb_scale<WF>(W, rb[m], ok ? k : 0);
    }
  };
  auto load_inputs = [&](int u, int c) {  // its inputs, where the word lies wholly below K (else mm_inputs reads)
    if constexpr (PX) {
      const int k = c * 4 + t;
      const bool full = c < chunks && (k + 1) * E <= K;
#pragma unroll
      for (int j = 0; j < NT; j++)
#pragma unroll
        for (int q = 0; q < XW; q++)
          xv[u][j][q] = full && live[j] ? __ldg(reinterpret_cast<const uint4*>(xcol[j] + (size_t)k * E) + q)
                                        : make_uint4(0, 0, 0, 0);
    }
  };
  // PDL (common.cuh): the first chunks' weights (and scales) are requested before the wait — weights never
  // depend on the previous kernel, so their latency hides behind its tail (at K = 2048 int4 that is all of a
  // warp's weights); the inputs are read after it, and the trigger follows it.
#pragma unroll
  for (int u = 0; u < U; u++) load_weights(u, warp + u * kMmWarps);
  pdl_wait();
  pdl_launch_dependents();
#pragma unroll
  for (int u = 0; u < U; u++) load_inputs(u, warp + u * kMmWarps);

  for (int c0 = warp; c0 < chunks; c0 += kMmWarps * U) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + u * kMmWarps;
      if (c >= chunks) break;
      const int k = c * 4 + t;
      const bool ok = k < words;
      __half2 x2[NT][E / 2];
#pragma unroll
      for (int j = 0; j < NT; j++) mm_inputs<E, PX>(xcol[j], k, K, live[j] && ok, xv[PX ? u : 0][j], x2[j]);
#pragma unroll
      for (int m = 0; m < MT; m++) {
        __half2 wa2[E / 2], wb2[E / 2];
        gb_word_h2<WF>(va[m][u], sa[m][u], k, K, ok, wa2);
        gb_word_h2<WF>(vb[m][u], sb[m][u], k, K, ok, wb2);
        mm_word<E, NT>(acc[m], wa2, wb2, x2);
      }
      if (c + kMmWarps * U < chunks) {  // the slot's next chunk
        load_weights(u, c + kMmWarps * U);
        load_inputs(u, c + kMmWarps * U);
      }
    }
  }

  mm_epilogue<NT, MT, OUT>(acc, red, a, row0);
}

// ---- fp16: the weights and inputs through a ring in shared memory (cp.async) ----
// The register ring above holds what it has in flight in registers: U = 4 chunks a warp (32 KB a block), 8 where
// one wave of blocks can afford 103 registers. cp.async copies global -> shared memory with no register held
// while in flight, so a warp keeps D chunks (weights and the inputs of its column tiles) requested at once, D
// from a shared-memory budget: two blocks per SM where the grid has several waves, one deep block per SM where
// the tiles fit one wave (the residual products). Each lane copies exactly the words it later reads (word t of
// rows g and g + 8 per tile, input word t of column g per column tile), so its own cp.async.wait_group makes
// them visible: no barrier inside the loop. One commit group per chunk (an empty one past the warp's last), so
// "all but the newest D - 1 groups complete" is always the chunk about to be used.
// 16-byte words a lane per chunk: a weight word of rows g and g + 8 per tile, an input word per column tile
__host__ __device__ constexpr int mm_ring_words(int NT, int MT) { return 2 * MT + NT; }
// 4 KB a block per word of a chunk: 24 words (96 KB, two blocks per SM) or, deep, 48 (192 KB, one).
constexpr int mm_ring_depth(int NT, int MT, bool deep) {
  const int d = (deep ? 48 : 24) / mm_ring_words(NT, MT);
  return d < 2 ? 2 : d > 16 ? 16 : d;
}
constexpr size_t mm_ring_smem(int NT, int MT, bool deep) {
  return (size_t)kMmThreads * 16 * mm_ring_depth(NT, MT, deep) * mm_ring_words(NT, MT);
}

// The same product and the same arithmetic in the same order as mma_small_n_kernel<F16, NT, MT, OUT, *> (the same
// bits); only the path of the words differs.
template <int NT, int MT, GemvOut OUT, int D>
__global__ void __launch_bounds__(kMmThreads) mma_small_n_ring_kernel(GemvBatchArgs a) {
  constexpr int E = kWordElems<WFormat::F16>, BR = kMmRows * MT, S = mm_ring_words(NT, MT);
  extern __shared__ __align__(16) uint4 ring[];  // (kMmWarps, D, S, 32); after the loop the warps' partial sums
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const QMat& W = a.W;
  const int row0 = blockIdx.x * BR, K = W.K;
  const uint4* wa[MT];
  const uint4* wb[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) {
    wa[m] = gb_row<WFormat::F16>(W, min(row0 + kMmRows * m + g, W.rows - 1));  // past the end: stored nowhere
    wb[m] = gb_row<WFormat::F16>(W, min(row0 + kMmRows * m + g + 8, W.rows - 1));
  }
  const int words = gb_words(W, E), chunks = (words + 3) / 4;
  const __half* xcol[NT];
  bool live[NT];
#pragma unroll
  for (int j = 0; j < NT; j++) {
    const int col = j * 8 + g;
    live[j] = col < a.n;
    xcol[j] = static_cast<const __half*>(a.x) + (size_t)(live[j] ? col : 0) * a.ldx;
  }
  uint4* mine = ring + (size_t)warp * D * S * 32 + lane;  // slot u, word w: mine[(u * S + w) * 32]
  const uint64_t policy = l2_evict_first();
  // A lane past the row's last word (k >= words) copies nothing: its fragments are zeroed at use instead.
  auto copy_weights = [&](int u, int c) {
    const int k = c * 4 + t;
    if (c < chunks && k < words)
#pragma unroll
      for (int m = 0; m < MT; m++) {
        cp_async16(mine + (u * S + 2 * m) * 32, wa[m] + k, policy);
        cp_async16(mine + (u * S + 2 * m + 1) * 32, wb[m] + k, policy);
      }
  };
  auto copy_inputs = [&](int u, int c) {
    const int k = c * 4 + t;
    if (c < chunks && k < words)
#pragma unroll
      for (int j = 0; j < NT; j++)
        if (live[j]) cp_async16(mine + (u * S + 2 * MT + j) * 32, xcol[j] + (size_t)k * E);
  };
  // PDL: the first D chunks' weights before the wait (a group each), their inputs after it (a group each).
#pragma unroll
  for (int u = 0; u < D; u++) {
    copy_weights(u, warp + u * kMmWarps);
    cp_async_commit();
  }
  pdl_wait();
  pdl_launch_dependents();
#pragma unroll
  for (int u = 0; u < D; u++) {
    copy_inputs(u, warp + u * kMmWarps);
    cp_async_commit();
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int m = 0; m < MT; m++)
#pragma unroll
    for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;

  for (int c0 = warp; c0 < chunks; c0 += kMmWarps * D) {
#pragma unroll
    for (int u = 0; u < D; u++) {
      const int c = c0 + u * kMmWarps;
      if (c >= chunks) break;
      cp_async_wait<D - 1>();
      const int k = c * 4 + t;
      const bool ok = k < words;
      __half2 x2[NT][E / 2];
#pragma unroll
      for (int j = 0; j < NT; j++) {
        const uint4 v = mine[(u * S + 2 * MT + j) * 32];  // (used only where live and wholly below K)
        mm_inputs<E, true>(xcol[j], k, K, live[j] && ok, &v, x2[j]);
      }
#pragma unroll
      for (int m = 0; m < MT; m++) {
        __half2 wa2[E / 2], wb2[E / 2];
        gb_word_h2<WFormat::F16>(mine[(u * S + 2 * m) * 32], float2{}, k, K, ok, wa2);
        gb_word_h2<WFormat::F16>(mine[(u * S + 2 * m + 1) * 32], float2{}, k, K, ok, wb2);
        mm_word<E, NT>(acc[m], wa2, wb2, x2);
      }
      copy_weights(u, c + kMmWarps * D);  // the slot's next chunk (nothing past the warp's last: an empty group)
      copy_inputs(u, c + kMmWarps * D);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring: the partial sums lie over it
  mm_epilogue<NT, MT, OUT>(acc, reinterpret_cast<float*>(ring), a, row0);
}

static bool mm_arch_ok() {
  static bool ok = [] {
    int dev = 0, major = 0;
    TI_CUDA_CHECK(cudaGetDevice(&dev));
    TI_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    return major >= 8;
  }();
  return ok;
}

bool mma_small_n_fits(const QMat& W, int n) {
  return n >= 1 && n <= kMmaMaxN && (W.fmt != WFormat::I4 || W.K % kI4Group == 0) && mm_arch_ok();
}

template <WFormat WF, int NT, int MT, GemvOut OUT, int U = kMmUnroll<WF>>
static void launch_mm(const GemvBatchArgs& a, cudaStream_t s, bool pdl) {
  const size_t smem = (size_t)kMmWarps * kMmRows * MT * NT * 8 * sizeof(float);  // <= 32 KB: no opt-in
  launch(mma_small_n_kernel<WF, NT, MT, OUT, U>, dim3((a.W.rows + kMmRows * MT - 1) / (kMmRows * MT)), dim3(kMmThreads),
         smem, s, pdl, a);
}

// Two M tiles a block for int4 products of 9..16 inputs where the matrix still gives every SM two blocks (gate/up,
// the LM head at TinyLlama's shape), or as a.m_tiles says (tests, A/B): only there did halving the inputs' traffic
// pay; at 8 inputs it did not, and int8's two-tile block (166 registers, one block per SM) lost (docs/perf/batch.md).
template <int NT, int MT, GemvOut OUT, bool DEEP>
static void launch_ring(const GemvBatchArgs& a, cudaStream_t s, bool pdl) {
  constexpr int D = mm_ring_depth(NT, MT, DEEP);
  constexpr size_t smem = mm_ring_smem(NT, MT, DEEP);
  auto kernel = mma_small_n_ring_kernel<NT, MT, OUT, D>;
  // (idempotent: set at every launch, graph capture included, rather than behind a once-flag)
  if (smem > 48 * 1024)
    TI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  launch(kernel, dim3((a.W.rows + kMmRows * MT - 1) / (kMmRows * MT)), dim3(kMmThreads), smem, s, pdl, a);
}

// fp16 through the shared-memory ring: one 16-row tile a block unless a.m_tiles says 2; deep where the tiles fit
// one wave of one block per SM.
template <int NT, GemvOut OUT>
static void mm_ring_rows(const GemvBatchArgs& a, cudaStream_t s, bool pdl) {
  if constexpr (NT <= 2) {
    if (a.m_tiles == 2) {
      if ((a.W.rows + 2 * kMmRows - 1) / (2 * kMmRows) <= sm_count()) return launch_ring<NT, 2, OUT, true>(a, s, pdl);
      return launch_ring<NT, 2, OUT, false>(a, s, pdl);
    }
  }
  if ((a.W.rows + kMmRows - 1) / kMmRows <= sm_count()) return launch_ring<NT, 1, OUT, true>(a, s, pdl);
  launch_ring<NT, 1, OUT, false>(a, s, pdl);
}

template <WFormat WF, int NT, GemvOut OUT>
static void mm_rows(const GemvBatchArgs& a, cudaStream_t s, bool pdl) {
  if constexpr (WF == WFormat::F16)
    if (a.smem_ring) return mm_ring_rows<NT, OUT>(a, s, pdl);
  if constexpr (NT <= 2) {
    const bool two = WF == WFormat::I4 && NT == 2 && a.W.rows / (2 * kMmRows) >= 2 * sm_count();
    const int mt = a.m_tiles > 0 ? a.m_tiles : two ? 2 : 1;
    if (mt == 2) return launch_mm<WF, NT, 2, OUT>(a, s, pdl);
    if constexpr (OUT == GemvOut::AddF32)  // (the residual products: where one wave of 16-row tiles is common)
      if ((a.W.rows + kMmRows - 1) / kMmRows <= sm_count()) return launch_mm<WF, NT, 1, OUT, kMmUnrollDeep<WF>>(a, s, pdl);
  }
  launch_mm<WF, NT, 1, OUT>(a, s, pdl);
}

template <WFormat WF, int NT>
static void mm_modes(const GemvBatchArgs& a, GemvOut out, cudaStream_t s, bool pdl) {
  if (out == GemvOut::F32) return mm_rows<WF, NT, GemvOut::F32>(a, s, pdl);
  if (out == GemvOut::AddF32) return mm_rows<WF, NT, GemvOut::AddF32>(a, s, pdl);
  return mm_rows<WF, NT, GemvOut::Swiglu>(a, s, pdl);
}

template <WFormat WF>
static void mm_tiles(const GemvBatchArgs& a, GemvOut out, cudaStream_t s, bool pdl) {
  const int nt = (a.n + 7) / 8;  // N padded to 8, 16, 32 or 64
  if (nt <= 1) return mm_modes<WF, 1>(a, out, s, pdl);
  if (nt <= 2) return mm_modes<WF, 2>(a, out, s, pdl);
  if (nt <= 4) return mm_modes<WF, 4>(a, out, s, pdl);
  return mm_modes<WF, 8>(a, out, s, pdl);
}

void mma_small_n(const GemvBatchArgs& a, GemvOut out, cudaStream_t s, bool pdl) {
  const QMat& W = a.W;
  if (a.n < 1 || a.n > kMmaMaxN || a.ldx % 8 != 0 || a.ldx < W.K || W.rows < 1 || W.K < 1 ||
      a.ldy < (out == GemvOut::Swiglu ? W.rows / 2 : W.rows) || (out == GemvOut::Swiglu && W.rows % 2 != 0))
    fail(ErrorKind::Request, "mma_small_n: bad shape n=" + std::to_string(a.n) + " K=" + std::to_string(W.K) +
                                 " ldx=" + std::to_string(a.ldx) + " rows=" + std::to_string(W.rows) +
                                 " ldy=" + std::to_string(a.ldy));
  if (out != GemvOut::F32 && out != GemvOut::AddF32 && out != GemvOut::Swiglu)
    fail(ErrorKind::Request, "mma_small_n: out must be f32, add or swiglu");
  if (a.m_tiles < 0 || a.m_tiles > 2 || (a.m_tiles == 2 && a.n > 16))
    fail(ErrorKind::Request, "mma_small_n: m_tiles " + std::to_string(a.m_tiles) + " must be 0 (auto), 1 or 2 (2: n <= 16)");
  if (!mma_small_n_fits(W, a.n))
    fail(ErrorKind::Request, "mma_small_n: needs sm_80+ and (int4) K % 32 == 0");
  if (W.fmt == WFormat::F16) mm_tiles<WFormat::F16>(a, out, s, pdl);
  else if (W.fmt == WFormat::I8) mm_tiles<WFormat::I8>(a, out, s, pdl);
  else mm_tiles<WFormat::I4>(a, out, s, pdl);
}

}  // namespace ti::cuda
