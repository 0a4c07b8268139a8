// gemv.cu — fp16 matrix-vector products for batch-1 decode: y = W x, fp32 accumulation.
//
// Layout: W row-major (rows, ld) fp16, ld a multiple of 8 so every row starts 16-byte aligned; columns past K
// are zero. A block of 8 warps; a tile is 8 warps x R consecutive rows (R = 1, 2, 4: more rows per warp = more
// independent 16-byte loads in flight per lane but fewer warps). The grid is one block per tile or 1-2 blocks
// per SM looping over tiles (GemvParams::blocks_per_sm); R and the grid are timed per shape at load, from graph
// replays. Each lane reads 16 bytes (a word: 8 fp16 weights) per row per step: fp16 and int8 weights
// (gemv_pipe_kernel) in chunks of 8 / R steps, the next chunk's loads issued before this chunk's dot products;
// int4 weights (gemv_kernel) in rounds of 4 steps (4R loads in flight per lane, issued before the round's dot
// products, none while they are computed); the input vector is staged once per block
// in shared memory as fp16 (16-byte reads laid out so that a warp's reads are contiguous: no bank conflicts),
// then each row's dot is reduced across the warp with shuffles. (Not in split-K with fp16 weights and an fp16
// input: there each warp reads its own eighth of the input straight from global memory.)
//
// Fusions (chosen by the launcher's in/out modes, never in the forward pass):
//   in  F32Norm: RMSNorm of the fp32 residual stream in the prologue (every block recomputes the sum of
//                squares: H floats from L2, cheaper than a kernel launch; the norm weight is in shared memory)
//   out AddF32:  y += W x (the residual add of the O and down projections)
//   out Swiglu:  rows interleaved gate/up at load (row 2i = gate_i, 2i+1 = up_i): y_i = silu(g_i) * u_i
// PDL: the first 8/R 16-byte words of each of the warp's rows (8 per lane), their block scales (I8 d, I4 scale
// and min) and the RMSNorm weight are loaded before pdl_wait() (weights do not depend on the previous kernel), so
// the memory pipe is busy while the previous kernel drains; after the wait come the input (and, for AddF32, the
// old y, read at once so that its latency hides behind the staging).
//
// Quantized weights (cpp/quant.h; template parameter WF): the same kernel templates (int8 on gemv_pipe_kernel,
// int4 on gemv_kernel), a 16-byte word now holding 16 (I8) or 32 (I4) weights, dequantized in registers
// (gemv_dot.cuh: the per-format word, its scales and dot product).
#include <algorithm>

#include "act8.cuh"
#include "common.cuh"
#include "gemv.cuh"
#include "gemv_dot.cuh"
#include "gemv_stage.cuh"

namespace ti::cuda {

// The input staged, the old y read and the rows written: gemv_stage.cuh.

// A warp's R rows of one tile, and the first P 16-byte words of each per lane (with their I4 scales), loaded
// ahead: before the dependency wait for a block's first tile, during the previous tile's reduction for the rest.
template <WFormat WF, int R, int P>
struct TileHead {
  int row0 = 0;
  const uint4* wrow[R];
  QCtx ctx[R];
  uint4 pre[P][R];
  ScaleRun<WF, P> pre_s[R];
};

template <WFormat WF, int R, int P>
__device__ __forceinline__ void load_head(const GemvParams& p, int tile, int ld8, const float* xsum,
                                          TileHead<WF, R, P>& h) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  h.row0 = (tile * kGemvWarps + warp) * R;
#pragma unroll
  for (int r = 0; r < R; r++) {
    const int row = min(h.row0 + r, p.rows - 1);  // rows past the end re-read the last row; never stored
    h.wrow[r] = row_words<WF>(p, row);
    h.ctx[r] = row_ctx<WF>(p, row, xsum);
  }
#pragma unroll
  for (int u = 0; u < P; u++)
#pragma unroll
    for (int r = 0; r < R; r++) {
      const bool in = lane + u * 32 < ld8;
      h.pre[u][r] = in ? load_stream(h.wrow[r] + lane + u * 32) : make_uint4(0, 0, 0, 0);
      load_run_step<WF, P, true>(h.ctx[r], 0, u, ld8, h.pre_s[r]);
    }
}

// One round of 4 steps from word kb (uniform) of the warp's rows: lane word k = kb + lane + 32 u at step u, all
// loads issued first (4R words in flight per lane).
template <WFormat WF, int R, int P>
__device__ __forceinline__ void round4(const TileHead<WF, R, P>& h, const __half* xs, int ld8, int kb, int k,
                                       XFrag<WF>& xf, float* acc) {
  uint4 w[4][R];
  ScaleRun<WF, 4> ws[R];
#pragma unroll
  for (int u = 0; u < 4; u++)
#pragma unroll
    for (int r = 0; r < R; r++) {
      w[u][r] = load_stream(h.wrow[r] + k + u * 32);
      load_run_step<WF, 4, false>(h.ctx[r], kb, u, ld8, ws[r]);
    }
#pragma unroll
  for (int u = 0; u < 4; u++) {
    load_x<WF>(xs, ld8, k + u * 32, xf);
#pragma unroll
    for (int r = 0; r < R; r++)
      acc[r] += dot_word<WF>(w[u][r], run_scale<WF, 4>(ws[r], u), xf, h.ctx[r], k + u * 32);
  }
}

// Tiles: a tile is the block's 8 warps x R rows. The grid is sized by the launcher (GemvParams::blocks_per_sm):
// either one block per tile, or a few blocks per SM that loop over tiles — then the input is staged once per
// block, not once per tile, the next tile's first words are in flight while a tile is reduced and stored, and
// the kernel leaves room on each SM for the next kernel's blocks to start (PDL) and fetch their weights.
// (No minimum of blocks per SM: an explicit 1 changes ptxas' choices for every variant.) fp16 and int8 weights,
// on either input, take gemv_pipe_kernel below instead (kGemvPipelined).
template <WFormat WF, int R, GemvIn IN, GemvOut OUT>
__global__ void __launch_bounds__(kGemvThreads) gemv_kernel(GemvParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);  // the staged input (ld halves)
  float* nws = reinterpret_cast<float*>(xs + p.ld);    // F32Norm: the RMSNorm weight (K floats)
  float* xsum = nws + (IN == GemvIn::F32Norm ? p.K : 0);  // I4 only: (K / 32)
  __shared__ __align__(16) float red[33];
  trace_point(p.trace, 0);
  if (p.early_trigger) pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int n_tiles = (p.rows + kGemvWarps * R - 1) / (kGemvWarps * R);
  const int ld8 = words_per_row<WF>(p);  // 16-byte words per row
  constexpr int P = 8 / R;   // words per row loaded ahead: 8 per lane in flight
  int tile = blockIdx.x;
  TileHead<WF, R, P> h;
  load_head<WF, R, P>(p, tile, ld8, xsum, h);
  prefetch_norm<IN>(p, nws);

  pdl_wait();
  if (!p.early_trigger) pdl_launch_dependents();
  trace_point(p.trace, 1);
  float yold[R];  // AddF32: the tile's y before the add, read now so that its latency hides behind the staging
  load_y<OUT, R>(p, h.row0, yold);

  stage_input<WF, IN>(p, ld8, nws, xs, xsum, red);
  trace_point(p.trace, 2);

  for (;;) {
    float acc[R];
    XFrag<WF> xf;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
#pragma unroll
    for (int u = 0; u < P; u++) {
      WScale<WF> s[R];  // (I8: a shuffle, so outside the branch)
#pragma unroll
      for (int r = 0; r < R; r++) s[r] = run_scale<WF, P>(h.pre_s[r], u);
      if (lane + u * 32 < ld8) {
        load_x<WF>(xs, ld8, lane + u * 32, xf);
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] += dot_word<WF>(h.pre[u][r], s[r], xf, h.ctx[r], lane + u * 32);
      }
    }
    if (tile == (int)blockIdx.x) trace_point_after(p.trace, 4, acc[0]);
    // 4 steps at a time: per lane (a lane does one more round when its last word is in the row), or for I8
    // (its scales are shuffled across the warp) warp-uniformly, whole rounds only. Either way each lane sums
    // its words in the same order.
    int k = lane + P * 32;  // in 16-byte words
    if constexpr (kIsI8<WF>) {
      for (int kb = P * 32; kb + 4 * 32 <= ld8; kb += 4 * 32, k += 4 * 32)
        round4<WF, R>(h, xs, ld8, kb, k, xf, acc);
    } else {
      for (; k + 3 * 32 < ld8; k += 4 * 32) round4<WF, R>(h, xs, ld8, k - lane, k, xf, acc);
    }
    for (; k < ld8; k += 32) {
      load_x<WF>(xs, ld8, k, xf);
#pragma unroll
      for (int r = 0; r < R; r++)
        acc[r] += dot_word<WF>(load_stream(h.wrow[r] + k), load_scale<WF>(h.ctx[r], k), xf, h.ctx[r], k);
    }
    const int row0 = h.row0;
    float yo[R];
#pragma unroll
    for (int r = 0; r < R; r++) yo[r] = yold[r];
    tile += gridDim.x;
    if (tile < n_tiles) {  // in flight during what follows
      load_head<WF, R, P>(p, tile, ld8, xsum, h);
      load_y<OUT, R>(p, h.row0, yold);
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);

    if (lane == 0) store_rows<OUT, R>(p, row0, acc, yo);
    if (tile >= n_tiles) break;
  }
  trace_point(p.trace, 3);
}

// The software-pipelined kernel (fp16 and int8 weights): the same tiles, grid and order of sums as gemv_kernel,
// but a row is streamed in chunks of P = 8 / R steps (8 words a lane, as gemv_kernel's head) and chunk i + 1's
// loads — or, after a tile's last chunk, the next tile's first chunk — are issued before chunk i's dot products,
// so a lane keeps 8 words in flight while it computes (gemv_kernel: 4R at a round's start, none while it
// computes). Why not int4: its word loop is bound by its instruction issue, not by loads in flight, and the
// chunk's copies and guards made its step slower, on int8 inputs (act8) too, and even without the copies
// (docs/perf/persistent.md §20, §49). int8 weights on int8 inputs (kI8A8) gain from it where rows are short
// (§49); int4 keeps gemv_kernel.
template <WFormat WF> constexpr bool kGemvPipelined = WF == WFormat::F16 || kIsI8<WF>;
// Whether a chunk's steps past the row are skipped warp-uniformly (else each lane's guard predicates them): on
// for int8, measured so (without it the compiler predicated the dot products of the steps past a short row);
// fp16 was measured without it.
template <WFormat WF> constexpr bool kStopAtRowEnd = WF != WFormat::F16;
template <WFormat WF, int R, int P>
struct Chunk {
  uint4 w[P][R];
  ScaleRun<WF, P> s[R];
};
template <WFormat WF, int R>
struct TileRows {
  int row0 = 0;
  const uint4* wrow[R];
  QCtx ctx[R];
};
template <WFormat WF, int R>
__device__ __forceinline__ void tile_rows(const GemvParams& p, int tile, const float* xsum, TileRows<WF, R>& t) {
  t.row0 = (tile * kGemvWarps + (threadIdx.x >> 5)) * R;
#pragma unroll
  for (int r = 0; r < R; r++) {
    const int row = min(t.row0 + r, p.rows - 1);  // rows past the end re-read the last row; never stored
    t.wrow[r] = row_words<WF>(p, row);
    t.ctx[r] = row_ctx<WF>(p, row, xsum);
  }
}
// The chunk at word base kb (uniform): lane word k = kb + lane + 32 u at step u; words past the row read as zero,
// except that with kStopAtRowEnd the steps wholly past the row are not loaded at all (dot_chunk stops at the
// same step, so nothing unloaded is read).
template <WFormat WF, int R, int P>
__device__ __forceinline__ void load_chunk(const TileRows<WF, R>& t, int kb, int ld8, Chunk<WF, R, P>& c) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < P; u++) {
    if (kStopAtRowEnd<WF> && kb + u * 32 >= ld8) break;  // uniform (dot_chunk stops at the same step)
#pragma unroll
    for (int r = 0; r < R; r++) {
      const bool in = kb + lane + u * 32 < ld8;
      c.w[u][r] = in ? load_stream(t.wrow[r] + kb + lane + u * 32) : make_uint4(0, 0, 0, 0);
      load_run_step<WF, P, true>(t.ctx[r], kb, u, ld8, c.s[r]);
    }
  }
}
template <WFormat WF, int R, int P>
__device__ __forceinline__ void dot_chunk(const TileRows<WF, R>& t, const Chunk<WF, R, P>& c, const __half* xs,
                                          int kb, int ld8, float* acc) {
  const int lane = threadIdx.x & 31;
  XFrag<WF> xf;
#pragma unroll
  for (int u = 0; u < P; u++) {
    if (kStopAtRowEnd<WF> && kb + u * 32 >= ld8) break;  // uniform: no lane has a word in the row from here
    WScale<WF> s[R];  // (I8: a shuffle, so outside the branch)
#pragma unroll
    for (int r = 0; r < R; r++) s[r] = run_scale<WF, P>(c.s[r], u);
    const int k = kb + lane + u * 32;
    if (k < ld8) {
      load_x<WF>(xs, ld8, k, xf);
#pragma unroll
      for (int r = 0; r < R; r++) acc[r] += dot_word<WF>(c.w[u][r], s[r], xf, t.ctx[r], k);
    }
  }
}

// Held to 2 blocks per SM (128 registers): two chunks of registers a lane. fp16 fits at every R (94-128) and int8
// at R <= 2 (112-126: R = 1 loses the third block per SM the round kernel had at 80); int8 at R = 4 spills 36-172
// bytes, kI8A8 at R = 4 0-64 (ptxas, CUDA 13), which the tuner weighs like any other cost of a variant.
template <WFormat WF, int R, GemvIn IN, GemvOut OUT>
__global__ void __launch_bounds__(kGemvThreads, 2) gemv_pipe_kernel(GemvParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* nws = reinterpret_cast<float*>(xs + p.ld);
  float* xsum = nws + (IN == GemvIn::F32Norm ? p.K : 0);
  __shared__ __align__(16) float red[33];
  trace_point(p.trace, 0);
  if (p.early_trigger) pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int n_tiles = (p.rows + kGemvWarps * R - 1) / (kGemvWarps * R);
  const int ld8 = words_per_row<WF>(p);
  constexpr int P = 8 / R;  // steps a chunk: 8 words per lane
  int tile = blockIdx.x;
  TileRows<WF, R> t;
  tile_rows<WF, R>(p, tile, xsum, t);
  Chunk<WF, R, P> cur;
  load_chunk<WF, R, P>(t, 0, ld8, cur);
  prefetch_norm<IN>(p, nws);

  pdl_wait();
  if (!p.early_trigger) pdl_launch_dependents();
  trace_point(p.trace, 1);
  float yold[R];
  load_y<OUT, R>(p, t.row0, yold);
  stage_input<WF, IN>(p, ld8, nws, xs, xsum, red);
  trace_point(p.trace, 2);

  for (;;) {
    const int next = tile + gridDim.x;
    TileRows<WF, R> tn;
    float yn[R];
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    for (int kb = 0;; kb += P * 32) {  // uniform
      const bool more = kb + P * 32 < ld8;
      Chunk<WF, R, P> nxt;  // this row's next chunk, else the next tile's first
      if (more) {
        load_chunk<WF, R, P>(t, kb + P * 32, ld8, nxt);
      } else if (next < n_tiles) {
        tile_rows<WF, R>(p, next, xsum, tn);
        load_chunk<WF, R, P>(tn, 0, ld8, nxt);
        load_y<OUT, R>(p, tn.row0, yn);
      }
      dot_chunk<WF, R, P>(t, cur, xs, kb, ld8, acc);
      if (kb == 0 && tile == (int)blockIdx.x) trace_point_after(p.trace, 4, acc[0]);
      cur = nxt;
      if (!more) break;
    }
    const int row0 = t.row0;
    float yo[R];
#pragma unroll
    for (int r = 0; r < R; r++) yo[r] = yold[r];
    tile = next;
    if (tile < n_tiles) {
      t = tn;
#pragma unroll
      for (int r = 0; r < R; r++) yold[r] = yn[r];
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);

    if (lane == 0) store_rows<OUT, R>(p, row0, acc, yo);
    if (tile >= n_tiles) break;
  }
  trace_point(p.trace, 3);
}

// Split-K with fp16 weights and an fp16 input (o, down): input word k (8 elements) read from global memory where
// it is used. Words past K read as zero (the launcher asks K % 8 == 0, so no word straddles K).
__device__ __forceinline__ void load_x_global(const GemvParams& p, int k, XFrag<WFormat::F16>& x) {
  unpack8(k < p.K / 8 ? reinterpret_cast<const uint4*>(p.x)[k] : make_uint4(0, 0, 0, 0), x.v);
}

// The split-K variant (R == kGemvSplitK): a tile is 8 rows and each warp owns one eighth of K for all 8 of them,
// so a lane has one 16-byte load per row in flight per step (8 per step) and a long row is streamed by 8 warps
// at once; the 8 partial sums of each row meet in shared memory. Wins where rows are few and K is long. Tiles
// and grid as in gemv_kernel.
// US (unstaged; fp16 weights and input only): each warp reads only its own eighth of the input, so staging it
// for the block buys no reuse; reading it from global memory next to the weights drops the staging's round trip
// and barrier from the critical path after the dependency wait (measured: docs/perf/persistent.md §33). Same
// order of sums as staged: bit-identical.
template <WFormat WF, GemvIn IN, GemvOut OUT, bool US = false>
__global__ void __launch_bounds__(kGemvThreads) gemv_splitk_kernel(GemvParams p) {
  static_assert(!US || (WF == WFormat::F16 && IN == GemvIn::F16), "unstaged: fp16 weights and input only");
  constexpr int RB = 8;  // rows per tile
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);  // the staged input (ld halves)
  float* nws = reinterpret_cast<float*>(xs + p.ld);    // F32Norm: the RMSNorm weight (K floats)
  float* xsum = nws + (IN == GemvIn::F32Norm ? p.K : 0);  // I4 only: (K / 32)
  __shared__ __align__(16) float red[33];
  __shared__ float part[kGemvWarps][RB];
  trace_point(p.trace, 0);
  if (p.early_trigger) pdl_launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_tiles = (p.rows + RB - 1) / RB;
  const int ld8 = words_per_row<WF>(p), span = (ld8 + kGemvWarps - 1) / kGemvWarps;
  const int k_begin = warp * span, k_end = min(ld8, k_begin + span);
  const bool has_first = k_begin + lane < k_end;
  int tile = blockIdx.x;
  const uint4* wrow[RB];
  QCtx ctx[RB];
  uint4 pre[RB];
  WScale<WF> pre_s[RB];
  auto load_tile = [&](int t) {
#pragma unroll
    for (int r = 0; r < RB; r++) {
      const int row = min(t * RB + r, p.rows - 1);
      wrow[r] = row_words<WF>(p, row);
      ctx[r] = row_ctx<WF>(p, row, xsum);
      pre[r] = has_first ? load_stream(wrow[r] + k_begin + lane) : make_uint4(0, 0, 0, 0);
      pre_s[r] = load_scale<WF>(ctx[r], has_first ? k_begin + lane : 0);
    }
  };
  load_tile(tile);
  prefetch_norm<IN>(p, nws);

  pdl_wait();
  if (!p.early_trigger) pdl_launch_dependents();
  trace_point(p.trace, 1);
  float yold = 0.0f;  // AddF32: thread r < 8 holds row r's y before the add (read now, used in the epilogue)
  if (threadIdx.x < RB) load_y<OUT, 1>(p, tile * RB + threadIdx.x, &yold);
  if constexpr (!US) stage_input<WF, IN>(p, ld8, nws, xs, xsum, red);
  trace_point(p.trace, 2);
  auto input_word = [&](int k, XFrag<WF>& xf) {
    if constexpr (US) load_x_global(p, k, xf);
    else load_x<WF>(xs, ld8, k, xf);
  };

  for (;;) {
    float acc[RB];
    XFrag<WF> xf;
#pragma unroll
    for (int r = 0; r < RB; r++) acc[r] = 0.0f;
    if (has_first) {
      input_word(k_begin + lane, xf);
#pragma unroll
      for (int r = 0; r < RB; r++) acc[r] += dot_word<WF>(pre[r], pre_s[r], xf, ctx[r], k_begin + lane);
    }
    if (tile == (int)blockIdx.x) trace_point_after(p.trace, 4, acc[0]);
    for (int k = k_begin + lane + 32; k < k_end; k += 32) {
      uint4 w[RB];
      WScale<WF> ws[RB];
#pragma unroll
      for (int r = 0; r < RB; r++) {
        w[r] = load_stream(wrow[r] + k);
        ws[r] = load_scale<WF>(ctx[r], k);
      }
      input_word(k, xf);
#pragma unroll
      for (int r = 0; r < RB; r++) acc[r] += dot_word<WF>(w[r], ws[r], xf, ctx[r], k);
    }
    const int row0 = tile * RB;
    const float yo = yold;
    tile += gridDim.x;
    if (tile < n_tiles) {  // in flight during the reduction
      load_tile(tile);
      if (threadIdx.x < RB) load_y<OUT, 1>(p, tile * RB + threadIdx.x, &yold);
    }
#pragma unroll
    for (int r = 0; r < RB; r++) {
      const float v = warp_sum(acc[r]);
      if (lane == 0) part[warp][r] = v;
    }
    __syncthreads();
    if (threadIdx.x < RB) {
      const int r = threadIdx.x, row = row0 + r;
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; w++) v += part[w][r];
      if (row < p.rows) {
        if constexpr (OUT == GemvOut::Swiglu) {
          if (r % 2 == 0 && row + 1 < p.rows) {
            float u = 0.0f;
#pragma unroll
            for (int w = 0; w < kGemvWarps; w++) u += part[w][r + 1];
            static_cast<__half*>(p.y)[row / 2] = __float2half(v / (1.0f + __expf(-v)) * u);
          }
        } else if constexpr (OUT == GemvOut::AddF32) {
          static_cast<float*>(p.y)[row] = yo + v;
        } else {
          static_cast<float*>(p.y)[row] = v;
        }
      }
    }
    if (tile >= n_tiles) break;
    __syncthreads();  // part is reused by the next tile
  }
  trace_point(p.trace, 3);
}

bool gemv_act8_ok(int K, GemvIn in) {
  return K % 32 == 0 && (in != GemvIn::F32Norm || K <= kMaxVec * 4 * kGemvThreads);
}

static void require_act8(int K, GemvIn in) {
  if (!gemv_act8_ok(K, in))
    fail(ErrorKind::Unsupported, "gemv: int8 activations need K % 32 == 0 and, normed, K <= " +
                                     std::to_string(kMaxVec * 4 * kGemvThreads) + " (K=" + std::to_string(K) + ")");
}

bool gemv_variant_ok(int R, GemvOut out) {
  if (R == kGemvSplitK) return true;
  if (R != 1 && R != 2 && R != 4) return false;
  return out != GemvOut::Swiglu || R >= 2;
}

// Shared memory: the staged input (ld halves), for F32Norm the RMSNorm weight, for I4 the per-group input sums,
// for an int8 input (act8) each group's (d, sum(xq)).
static size_t gemv_smem(const GemvParams& p, GemvIn in) {
  const size_t groups = (size_t)p.ld / 32;
  return (size_t)p.ld * sizeof(__half) + (in == GemvIn::F32Norm ? (size_t)p.K * sizeof(float) : 0) +
         (p.act8 ? groups * sizeof(float2) : p.fmt == WFormat::I4 ? groups * sizeof(float) : 0);
}

template <typename Kernel>
static void raise_smem(Kernel kernel, size_t smem) {
  allow_dynamic_smem(kernel, smem);  // (no once-flag: a once-flag with the first size was a bug elsewhere)
}

// Blocks for `tiles` tiles: one per tile (blocks_per_sm == 0), or at most blocks_per_sm per SM, spread so that
// every block loops over the same number of tiles (no block does one more tile than the rest).
static int gemv_grid(int tiles, int blocks_per_sm) {
  const int sms = sm_count();
  if (blocks_per_sm == 0) return tiles;
  if (blocks_per_sm < 0) return std::min(tiles, -blocks_per_sm);  // exactly n blocks (tests: uneven loops)
  const int cap = sms * blocks_per_sm, per_block = (tiles + cap - 1) / cap;
  return (tiles + per_block - 1) / per_block;
}

template <WFormat WF, int R, GemvIn IN, GemvOut OUT>
static void launch_gemv(const GemvParams& p, cudaStream_t stream, bool pdl) {
  const size_t smem = gemv_smem(p, IN);
  const int rows_per_tile = kGemvWarps * R;
  const dim3 grid(gemv_grid((p.rows + rows_per_tile - 1) / rows_per_tile, p.blocks_per_sm));
  if constexpr (kGemvPipelined<WF>) {
    raise_smem(gemv_pipe_kernel<WF, R, IN, OUT>, smem);
    launch(gemv_pipe_kernel<WF, R, IN, OUT>, grid, dim3(kGemvThreads), smem, stream, pdl, p);
  } else {
    raise_smem(gemv_kernel<WF, R, IN, OUT>, smem);
    launch(gemv_kernel<WF, R, IN, OUT>, grid, dim3(kGemvThreads), smem, stream, pdl, p);
  }
}

template <WFormat WF, GemvIn IN, GemvOut OUT>
static void launch_splitk(const GemvParams& p, cudaStream_t stream, bool pdl) {
  const dim3 grid(gemv_grid((p.rows + 7) / 8, p.blocks_per_sm));
  if constexpr (WF == WFormat::F16 && IN == GemvIn::F16) {
    if (p.K % 8 == 0) {  // unstaged: no shared input
      launch(gemv_splitk_kernel<WF, IN, OUT, true>, grid, dim3(kGemvThreads), 0, stream, pdl, p);
      return;
    }
  }
  const size_t smem = gemv_smem(p, IN);
  raise_smem(gemv_splitk_kernel<WF, IN, OUT>, smem);
  launch(gemv_splitk_kernel<WF, IN, OUT>, grid, dim3(kGemvThreads), smem, stream, pdl, p);
}

template <WFormat WF, GemvIn IN, GemvOut OUT>
static void dispatch_r(const GemvParams& p, int R, cudaStream_t s, bool pdl) {
  switch (R) {
    case kGemvSplitK: launch_splitk<WF, IN, OUT>(p, s, pdl); return;
    case 1:
      if constexpr (OUT != GemvOut::Swiglu) { launch_gemv<WF, 1, IN, OUT>(p, s, pdl); return; }
      break;
    case 2: launch_gemv<WF, 2, IN, OUT>(p, s, pdl); return;
    case 4: launch_gemv<WF, 4, IN, OUT>(p, s, pdl); return;
  }
  fail(ErrorKind::Request, "gemv: no variant with R=" + std::to_string(R) + " for this output mode");
}

// The quantized formats come in the three (in, out) pairs a decode step uses (fewer kernels to compile).
template <WFormat WF>
static void dispatch_quantized(const GemvParams& p, int R, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  if (in == GemvIn::F32Norm && out == GemvOut::F32) return dispatch_r<WF, GemvIn::F32Norm, GemvOut::F32>(p, R, s, pdl);
  if (in == GemvIn::F16 && out == GemvOut::AddF32) return dispatch_r<WF, GemvIn::F16, GemvOut::AddF32>(p, R, s, pdl);
  if (in == GemvIn::F32Norm && out == GemvOut::Swiglu)
    return dispatch_r<WF, GemvIn::F32Norm, GemvOut::Swiglu>(p, R, s, pdl);
  fail(ErrorKind::Request, "gemv: quantized weights come with (f32norm, f32), (f16, add) or (f32norm, swiglu)");
}

void gemv(const GemvParams& p, int R, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  if (p.ld % 8 != 0 || p.ld < p.K || p.rows < 1 || p.K < 1)
    fail(ErrorKind::Request, "gemv: bad shape rows=" + std::to_string(p.rows) + " K=" + std::to_string(p.K) +
                                 " ld=" + std::to_string(p.ld));
  if (out == GemvOut::Swiglu && p.rows % 2 != 0) fail(ErrorKind::Request, "gemv: Swiglu needs an even row count");
  if (p.fmt == WFormat::I8) {
    if (p.ldq != i8_ld(p.K) || p.ld != p.ldq || !p.q || !p.scales)
      fail(ErrorKind::Request, "gemv: int8 weights need ldq = ld = K rounded up to 32, q and scales");
    if (p.act8) {
      require_act8(p.K, in);
      return dispatch_quantized<kI8A8>(p, R, in, out, s, pdl);
    }
    return dispatch_quantized<WFormat::I8>(p, R, in, out, s, pdl);
  }
  if (p.fmt == WFormat::I4) {
    if (p.K % kI4Group != 0 || p.ldq != i4_ld(p.K) || p.ld != p.K || !p.q || !p.scales)
      fail(ErrorKind::Request, "gemv: int4 weights need K % 32 == 0, ldq = K / 2, ld = K, q and scales");
    if (p.act8) {
      require_act8(p.K, in);
      return dispatch_quantized<kI4A8>(p, R, in, out, s, pdl);
    }
    return dispatch_quantized<WFormat::I4>(p, R, in, out, s, pdl);
  }
  if (in == GemvIn::F32Norm) {
    if (out == GemvOut::F32) dispatch_r<WFormat::F16, GemvIn::F32Norm, GemvOut::F32>(p, R, s, pdl);
    else if (out == GemvOut::AddF32) dispatch_r<WFormat::F16, GemvIn::F32Norm, GemvOut::AddF32>(p, R, s, pdl);
    else dispatch_r<WFormat::F16, GemvIn::F32Norm, GemvOut::Swiglu>(p, R, s, pdl);
  } else {
    if (out == GemvOut::F32) dispatch_r<WFormat::F16, GemvIn::F16, GemvOut::F32>(p, R, s, pdl);
    else if (out == GemvOut::AddF32) dispatch_r<WFormat::F16, GemvIn::F16, GemvOut::AddF32>(p, R, s, pdl);
    else dispatch_r<WFormat::F16, GemvIn::F16, GemvOut::Swiglu>(p, R, s, pdl);
  }
}

}  // namespace ti::cuda
