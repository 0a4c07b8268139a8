// batch_step.cu — THE batched decode pass (see batch_step.h), PyTorch in the comments, X: (n, hidden), row r
// one token of slot slot[r] at position pos[r]:
//   x = embed[tokens]
//   per layer: qkv = rmsnorm(x) @ [Wq; Wk; Wv].T                      every weight read once for the n rows
//              att[r] = attention(rope(q[r]), cache of slot[r])          RoPE + cache write + split-K, per row
//              x += att @ Wo.T
//              h = silu(rmsnorm(x) @ Wg.T) * (rmsnorm(x) @ Wu.T)
//              x += h @ Wd.T
//   logits[r] = rmsnorm(x[r]) @ lm_head.T                              (the sampler reads row r for slot[r])
// The products: normed / residual (below), each one launch on the small-N path. With PDL (record's pdl) our
// kernels (the products, the attention, the RMSNorm) start while their predecessor drains (each waits before it
// reads anything it did not get from weights or from two kernels back); cuBLASLt's and the SwiGLU kernels are
// launched plainly (they do not wait), which orders them fully behind their predecessor.
#include "batch_step.h"

#include <algorithm>
#include <cmath>

#include "../../cuda/act8.cuh"
#include "../../cuda/batch_rows.cuh"
#include "../../cuda/common.cuh"
#include "../../cuda/gemv_batch.cuh"
#include "../../cuda/mma_small_n.cuh"
#include "../../cuda/prefill.cuh"

namespace ti {

using cuda::GemmOut;
using cuda::GemvIn;
using cuda::GemvOut;

void BatchStep::record(int n, cudaStream_t s, bool pdl, bool draft) {
  pdl_ = pdl;
  xn_norm_ = nullptr;
  if (n == 1 && o_.one_row_plan && !draft) return record_one_row(s);
  const ModelConfig& c = c_;
  cuda::embed_tokens(w_.embedding, w_.ld_h, (int)c.hidden, b_.tokens, n, b_.x, w_.ld_h, s);  // x = embed[tokens]
  for (int64_t l = 0; l < c.n_layers; l++) {
    const DeviceLayer& L = w_.layers[(size_t)l];
    const float* next_norm = l + 1 < c.n_layers ? w_.layers[(size_t)l + 1].attn_norm : w_.final_norm;
    normed(L.qkv, L.attn_norm, b_.qkv, b_.ld_qkv, GemvOut::F32, n, s, MatrixRole::Qkv);  // qkv = rmsnorm(x) @ Wqkv.T
    cuda::DecodeAttnParams att = attn_params(l);                        // att[r] over slot[r]'s cache
    att.act8_out = o_.act8_fused && act8(L.o, MatrixRole::O) && c.head_dim % cuda::kAct8Group == 0;
    if (draft) cuda::append_kv_rows(att, n, s);  // (then the attention reads every row's from the cache, unwaited)
    att.appended = draft;
    cuda::decode_attention_rows(att, n, s, pdl_ && !draft);
    residual(L.o, b_.att, w_.ld_q, n, s, MatrixRole::O, L.mlp_norm, att.act8_out);  // x += att @ Wo.T
    normed(L.gate_up, L.mlp_norm, b_.h, w_.ld_i, GemvOut::Swiglu, n, s, MatrixRole::GateUp);  // h = silu(gate) * up
    residual(L.down, b_.h, w_.ld_i, n, s, MatrixRole::Down, next_norm);  // x += h @ Wd.T
  }
  normed(w_.lm_head, w_.final_norm, b_.logits, b_.ld_v, GemvOut::F32, n, s, MatrixRole::LmHead);  // rmsnorm(x) @ head.T
}

// Bucket 1: one row, a lone sequence (a server's light load). There the small-N kernels' column tiles hold one
// live column of eight (the other seven paid for nothing; on the tensor-core kernel an RMSNorm kernel before each
// normed product too), while the decode GEMVs were timed at load for exactly this shape, RMSNorm, SwiGLU and the
// residual in their prologues and epilogues. So the products are decode_step.cu's, under its carveout and with its
// triggers: qkv's late (the attention after it reads the rows' positions before its wait), the others' at the
// plan's level (their successors read only weights before their waits). The attention stays this step's, each row
// through its slot's page table. docs/perf/batch.md ("Bucket 1 on the decode plan").
void BatchStep::record_one_row(cudaStream_t s) {
  const cuda::CarveoutScope carveout(plan_.carveout);
  const float eps = (float)c_.rms_eps;
  const bool early = plan_.early_trigger >= 1;
  auto gemv = [&](MatrixRole role, const cuda::QMat& W, const void* x, void* y, const float* norm_w, bool trig) {
    launch_gemv(plan_, role, gemv_args(W, x, y, norm_w, eps, trig), role_in(role), role_out(role), s, pdl_);
  };
  cuda::embed_tokens(w_.embedding, w_.ld_h, (int)c_.hidden, b_.tokens, 1, b_.x, w_.ld_h, s);
  for (int64_t l = 0; l < c_.n_layers; l++) {
    const DeviceLayer& L = w_.layers[(size_t)l];
    gemv(MatrixRole::Qkv, L.qkv, b_.x, b_.qkv, L.attn_norm, false);
    cuda::decode_attention_rows(attn_params(l), 1, s, pdl_);
    gemv(MatrixRole::O, L.o, b_.att, b_.x, nullptr, early);
    gemv(MatrixRole::GateUp, L.gate_up, b_.x, b_.h, L.mlp_norm, early);
    gemv(MatrixRole::Down, L.down, b_.h, b_.x, nullptr, early);
  }
  gemv(MatrixRole::LmHead, w_.lm_head, b_.x, b_.logits, w_.final_norm, early);
}

// The products, the first path that takes them: the tensor-core small-N kernel up to mma_max (int8 / int4) or
// mma_f16_max (fp16) rows; the small-N
// GEMV (cuda/gemv_batch.cuh: each weight read once per 8 rows and dequantized once, RMSNorm and SwiGLU fused as
// in the decode GEMV) up to f16_max (fp16) / quant_max (int8, int4) rows; beyond
// that cuBLASLt through the engine's Gemm (tuned per shape and bucket of n on the eager warm-up before a bucket's
// graph is captured), with the RMSNorm and SwiGLU as their own kernels (cuda/prefill.cuh); a quantized matrix is
// dequantized into the fp16 staging right before its product (the staging is one matrix: each product consumes
// it before the next dequantization, stream order), so the step reads int8/int4 bytes + writes and re-reads
// fp16 ones, most of the latter from L2 for all but the largest matrices (docs/perf/batch.md).
// Where the decode GEMV of a product's role takes int8 inputs (CudaOptions::act8; off by default), every path here
// takes its input rounded to those numbers, fp16(d xq) per group of 32: the RMSNorm (rmsnorm_rows, gemv_batch's
// prologue) writes it so; o's fp16 input is written so by the attention (DecodeAttnParams::act8_out: its warps hold
// whole groups); down's is rounded in place first (act8_round_rows), since gate/up's blocks each hold a quarter of
// a group and rounding it there through a counter cost more than the kernel (docs/perf/persistent.md §38).
bool BatchStep::mma(const cuda::QMat& W, int n, MatrixRole p) const {
  const int own = p == MatrixRole::Qkv || p == MatrixRole::O ? o_.mma_f16_qkvo_max
                  : p == MatrixRole::Down                    ? o_.mma_f16_down_max
                                                          : 0;
  const int most = W.fmt != WFormat::F16 ? o_.mma_max : std::max(o_.mma_f16_max, own);
  return n <= most && cuda::mma_small_n_fits(W, n);
}

// The tensor-core small-N product (cuda/mma_small_n.cuh: each weight read and dequantized once for all n rows,
// fp16 inputs; the RMSNorm before it as its own kernel).
void BatchStep::mma_product(const cuda::QMat& W, const __half* X, int ldx, void* y, int ldy, GemvOut out, int n,
                            cudaStream_t s) {
  cuda::GemvBatchArgs a;
  a.W = W;
  a.x = X;
  a.ldx = ldx;
  a.y = y;
  a.ldy = ldy;
  a.n = n;
  a.m_tiles = o_.mma_m_tiles == 2 && n > 16 ? 1 : o_.mma_m_tiles;  // (2 serves up to 16 rows)
  a.smem_ring = o_.mma_ring;
  cuda::mma_small_n(a, out, s, pdl_);
}

bool BatchStep::act8(const cuda::QMat& W, MatrixRole p) const {
  return plan_act8(plan_, p, W);
}

bool BatchStep::small_n(const cuda::QMat& W, int n, GemvIn in) const {
  return n <= (W.fmt == WFormat::F16 ? o_.f16_max : o_.quant_max) && cuda::gemv_batch_fits(W, n, in);
}

// y = rmsnorm(x) @ W.T (out F32), or silu(gate) * up of it (out Swiglu: W's rows interleaved gate/up).
void BatchStep::normed(const cuda::QMat& W, const float* norm_w, void* y, int ldy, GemvOut out, int n,
                       cudaStream_t s, MatrixRole p) {
  const float eps = (float)c_.rms_eps;
  const bool a8 = act8(W, p);
  if (!mma(W, n, p) && small_n(W, n, GemvIn::F32Norm)) {
    cuda::GemvBatchArgs a;
    a.W = W;
    a.x = b_.x;
    a.ldx = w_.ld_h;
    a.norm_w = norm_w;
    a.eps = eps;
    a.y = y;
    a.ldy = ldy;
    a.n = n;
    a.act8 = a8;
    cuda::gemv_batch(a, GemvIn::F32Norm, out, s, pdl_);
    return;
  }
  if (xn_norm_ != norm_w || a8)  // (else the down product before wrote it, not rounded)
    cuda::rmsnorm_rows(b_.x, w_.ld_h, norm_w, eps, (int)c_.hidden, n, b_.xn, w_.ld_h, s, pdl_, nullptr, true, a8);
  xn_norm_ = nullptr;
  if (mma(W, n, p)) return mma_product(W, b_.xn, w_.ld_h, y, ldy, out, n, s);
  if (out == GemvOut::Swiglu) {
    gemm(W, b_.xn, w_.ld_h, b_.gu, b_.ld_gu, n, GemmOut::F16, s);
    cuda::swiglu_rows(b_.gu, b_.ld_gu, (int)c_.intermediate, n, static_cast<__half*>(y), ldy, s);
  } else {
    gemm(W, b_.xn, w_.ld_h, y, ldy, n, GemmOut::F32, s);
  }
}

// x += X @ W.T (the residual adds of the O and down projections). A down product on cuBLASLt of few rows
// (down_k_slices): its K in slices, one strided-batched launch (cuBLASLt's own split-K reduces in a kernel of
// its own), then one kernel adds the slices into x and writes the next RMSNorm (next_norm) into b_.xn: the
// reduce and the norm's dependent launch become one.
void BatchStep::residual(const cuda::QMat& W, __half* X, int ldx, int n, cudaStream_t s, MatrixRole p,
                         const float* next_norm, bool rounded) {
  xn_norm_ = nullptr;
  if (act8(W, p) && !rounded) cuda::act8_round_rows(X, ldx, W.K, n, s, pdl_);
  if (mma(W, n, p)) return mma_product(W, X, ldx, b_.x, w_.ld_h, GemvOut::AddF32, n, s);
  const int S = o_.down_k_slices;
  const int64_t stride = (int64_t)kDownSlicesRows * w_.ld_h;
  if (p == MatrixRole::Down && S > 1 && S <= kDownSlicesMax && n <= kDownSlicesRows && W.K % (8 * S) == 0 &&
      !small_n(W, n, GemvIn::F16) &&
      cuda::residual_norm_rows_fits((int)c_.hidden, S, stride, w_.ld_h, w_.ld_h, w_.ld_h)) {
    cuda::GemmArgs a = gemm_args(W, X, ldx, b_.down_parts, w_.ld_h, n, GemmOut::F32);
    a.k_slices = S;
    a.slice_stride = stride;
    gemm_.run(a, s);
    cuda::residual_norm_rows(b_.down_parts, S, stride, w_.ld_h, b_.x, w_.ld_h, next_norm, (float)c_.rms_eps,
                             (int)c_.hidden, n, b_.xn, w_.ld_h, s, pdl_);
    xn_norm_ = next_norm;
    return;
  }
  if (small_n(W, n, GemvIn::F16)) {
    cuda::GemvBatchArgs a;
    a.W = W;
    a.x = X;
    a.ldx = ldx;
    a.y = b_.x;
    a.ldy = w_.ld_h;
    a.n = n;
    cuda::gemv_batch(a, GemvIn::F16, GemvOut::AddF32, s, pdl_);
    return;
  }
  gemm(W, X, ldx, b_.x, w_.ld_h, n, GemmOut::AddF32, s);
}

void BatchStep::gemm(const cuda::QMat& W, const __half* X, int ldx, void* Y, int ldy, int n, GemmOut out,
                     cudaStream_t s) {
  gemm_.run(gemm_args(W, X, ldx, Y, ldy, n, out), s);
}

cuda::GemmArgs BatchStep::gemm_args(const cuda::QMat& W, const __half* X, int ldx, void* Y, int ldy, int n,
                                    GemmOut out) const {
  cuda::GemmArgs a;
  a.W = w_.fp16_of(W);  // (quantized: dequantized into the shared staging first; only where small_n refuses)
  a.X = X;
  a.Y = Y;
  a.M = W.rows;
  a.N = n;
  a.K = W.K;
  a.ldw = W.fmt == WFormat::F16 ? W.ld : (int)cuda::pad8(W.K);  // (fp16_of's rows: pad8(K))
  a.ldx = ldx;
  a.ldy = ldy;
  a.out = out;
  return a;
}

cuda::DecodeAttnParams BatchStep::attn_params(int64_t layer) const {
  cuda::DecodeAttnParams a;
  a.qkv = b_.qkv;
  a.k_pages = d_.k_pages + layer * d_.kv_layer_elems;
  a.v_pages = d_.v_pages + layer * d_.kv_layer_elems;
  a.page_table = b_.tables;
  a.page_shift = d_.page_shift;
  a.rope_cos = d_.rope_cos;
  a.rope_sin = d_.rope_sin;
  a.part_o = b_.part_o;
  a.part_ml = b_.part_ml;
  a.out = b_.att;
  a.n_heads = (int)c_.n_heads;
  a.n_kv_heads = (int)c_.n_kv_heads;
  a.head_dim = (int)c_.head_dim;
  a.max_seq = (int)d_.max_seq;
  a.chunk = d_.attn_chunk;
  a.scale = 1.0f / std::sqrt((float)c_.head_dim);
  a.row_pos = b_.pos;
  a.row_slot = b_.slot;
  a.tickets = b_.attn_tickets;
  a.rows_span = o_.attn_span;
  a.rows_heads = o_.attn_heads;
  a.table_stride = b_.table_stride;
  a.ld_qkv = b_.ld_qkv;
  a.ld_out = w_.ld_q;
  return a;
}

// ---- the buffers ----

BatchBuffers BatchBuffers::allocate(const ModelConfig& c, const DeviceWeights& w, int max_rows, int64_t max_seq,
                                    const KvPagePool& pages, DeviceArena& arena, cudaStream_t s) {
  using Kind = DeviceArena::Kind;
  BatchBuffers b;
  const size_t R = (size_t)max_rows;
  b.max_rows = max_rows;
  b.ld_qkv = (int)cuda::pad8(c.q_dim + 2 * c.kv_dim);
  b.ld_gu = (int)cuda::pad8(2 * c.intermediate);
  b.ld_v = (int)cuda::pad8(c.vocab);
  b.table_stride = (int)pages.pages_for(max_seq);
  const size_t splits = (size_t)cuda::attn_rows_max_splits((int)max_seq);
  // Zeroed: a padding row computes on whatever its rows hold (never NaN from uninitialised memory, so no
  // floating-point trap or NaN propagation can ever surprise a reader of those rows).
  auto zeroed = [&](size_t bytes) {
    void* p = arena.alloc(bytes, Kind::Scratch);
    TI_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s));
    return p;
  };
  b.rows = static_cast<int*>(zeroed(3 * R * sizeof(int)));
  b.h_rows = arena.alloc_pinned_n<int>(3 * R);
  b.tokens = b.rows;
  b.pos = b.rows + R;
  b.slot = b.rows + 2 * R;
  b.x = static_cast<float*>(zeroed(R * w.ld_h * sizeof(float)));
  b.xn = static_cast<__half*>(zeroed(R * w.ld_h * sizeof(__half)));
  b.qkv = static_cast<float*>(zeroed(R * b.ld_qkv * sizeof(float)));
  b.att = static_cast<__half*>(zeroed(R * w.ld_q * sizeof(__half)));
  b.gu = static_cast<__half*>(zeroed(R * b.ld_gu * sizeof(__half)));
  b.h = static_cast<__half*>(zeroed(R * w.ld_i * sizeof(__half)));
  b.logits = static_cast<float*>(zeroed(2 * R * b.ld_v * sizeof(float)));
  b.part_o = arena.alloc_n<float>(R * c.n_heads * splits * c.head_dim, Kind::Scratch);
  b.part_ml = arena.alloc_n<float>(R * c.n_heads * splits * 2, Kind::Scratch);
  b.down_parts = arena.alloc_n<float>((size_t)kDownSlicesMax * kDownSlicesRows * w.ld_h, Kind::Scratch);
  b.attn_tickets = static_cast<unsigned*>(
      zeroed(cuda::attn_rows_tickets(max_rows, (int)c.n_heads, (int)c.n_kv_heads) * sizeof(unsigned)));
  b.tables = arena.alloc_n<int>((R + 1) * b.table_stride, Kind::Scratch);  // (+ the draft pass's)
  TI_CUDA_CHECK(cudaMemsetAsync(b.tables, 0xFF, (R + 1) * b.table_stride * sizeof(int), s));  // -1: no page yet
  return b;
}

}  // namespace ti
