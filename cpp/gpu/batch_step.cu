// batch_step.cu — THE batched decode pass (see batch_step.h), PyTorch in the comments, X: (n, hidden), row r
// one token of slot slot[r] at position pos[r]:
//   x = embed[tokens]
//   per layer: qkv = rmsnorm(x) @ [Wq; Wk; Wv].T                      every weight read once for the n rows
//              att[r] = attention(rope(q[r]), cache of slot[r])          RoPE + cache write + split-K, per row
//              x += att @ Wo.T
//              h = silu(rmsnorm(x) @ Wg.T) * (rmsnorm(x) @ Wu.T)
//              x += h @ Wd.T
//   logits[slot[r]] = rmsnorm(x[r]) @ lm_head.T
// The products: matmul (below). The element-wise kernels are the prefill's (cuda/prefill.cuh), a row per token.
#include "batch_step.h"

#include <cmath>

#include "../../cuda/batch_rows.cuh"
#include "../../cuda/common.cuh"
#include "../../cuda/gemv_batch.cuh"
#include "../../cuda/prefill.cuh"

namespace ti {

using cuda::GemmOut;

void BatchStep::record(int n, cudaStream_t s) {
  const ModelConfig& c = c_;
  const int H = (int)c.hidden, I = (int)c.intermediate;
  const float eps = (float)c.rms_eps;
  cuda::embed_tokens(w_.embedding, w_.ld_h, H, b_.tokens, n, b_.x, w_.ld_h, s);  // x = embed[tokens]
  for (int64_t l = 0; l < c.n_layers; l++) {
    const DeviceLayer& L = w_.layers[(size_t)l];
    cuda::rmsnorm_rows(b_.x, w_.ld_h, L.attn_norm, eps, H, n, b_.xn, w_.ld_h, s);
    matmul(L.qkv, b_.xn, w_.ld_h, b_.qkv, b_.ld_qkv, n, GemmOut::F32, s);  // qkv = rmsnorm(x) @ Wqkv.T
    cuda::decode_attention_rows(attn_params(l), n, s, false);             // att[r] over slot[r]'s cache
    matmul(L.o, b_.att, w_.ld_q, b_.x, w_.ld_h, n, GemmOut::AddF32, s);   // x += att @ Wo.T
    cuda::rmsnorm_rows(b_.x, w_.ld_h, L.mlp_norm, eps, H, n, b_.xn, w_.ld_h, s);
    matmul(L.gate_up, b_.xn, w_.ld_h, b_.gu, b_.ld_gu, n, GemmOut::F16, s);  // gate | up interleaved
    cuda::swiglu_rows(b_.gu, b_.ld_gu, I, n, b_.h, w_.ld_i, s);             // h = silu(gate) * up
    matmul(L.down, b_.h, w_.ld_i, b_.x, w_.ld_h, n, GemmOut::AddF32, s);    // x += h @ Wd.T
  }
  cuda::rmsnorm_rows(b_.x, w_.ld_h, w_.final_norm, eps, H, n, b_.xn, w_.ld_h, s);
  matmul(w_.lm_head, b_.xn, w_.ld_h, b_.logits, b_.ld_v, n, GemmOut::F32, s);  // logits = rmsnorm(x) @ head.T
  cuda::scatter_rows(b_.logits, b_.ld_v, b_.slot_logits, (int)c.vocab, b_.slot, b_.pos, n, (int)c.vocab, s);
}

// Small n, or quantized weights at any n: the small-N GEMV (cuda/gemv_batch.cuh), which dequantizes each weight
// once in registers and multiplies it by every row. fp16 beyond its reach: cuBLASLt through the engine's Gemm
// (tuned per shape and bucket of n on the eager warm-up before a bucket's graph is captured).
void BatchStep::matmul(const cuda::QMat& W, const __half* X, int ldx, void* Y, int ldy, int n, GemmOut out,
                       cudaStream_t s) {
  if (cuda::gemv_batch_supported(W, n, f16_max_)) {
    cuda::gemv_batch(W, X, ldx, Y, ldy, n, out, s);
    return;
  }
  cuda::GemmArgs a;
  a.W = w_.fp16_of(W);  // (quantized without a small-N kernel: dequantized into the shared staging first)
  a.X = X;
  a.Y = Y;
  a.M = W.rows;
  a.N = n;
  a.K = W.K;
  a.ldw = W.fmt == WFormat::F16 ? W.ld : (int)cuda::pad8(W.K);  // (fp16_of's rows: pad8(K))
  a.ldx = ldx;
  a.ldy = ldy;
  a.out = out;
  gemm_.run(a, s);
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
  a.table_stride = b_.table_stride;
  a.ld_qkv = b_.ld_qkv;
  a.ld_out = w_.ld_q;
  return a;
}

// ---- the buffers ----

BatchBuffers BatchBuffers::allocate(const ModelConfig& c, const DeviceWeights& w, int max_rows, int64_t max_seq,
                                    int attn_chunk, const KvPagePool& pages, DeviceArena& arena, cudaStream_t s) {
  using Kind = DeviceArena::Kind;
  BatchBuffers b;
  const size_t R = (size_t)max_rows;
  b.max_rows = max_rows;
  b.ld_qkv = (int)cuda::pad8(c.q_dim + 2 * c.kv_dim);
  b.ld_gu = (int)cuda::pad8(2 * c.intermediate);
  b.ld_v = (int)cuda::pad8(c.vocab);
  b.table_stride = (int)pages.pages_for(max_seq);
  const size_t max_chunks = (size_t)((max_seq + attn_chunk - 1) / attn_chunk);
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
  b.logits = static_cast<float*>(zeroed(R * b.ld_v * sizeof(float)));
  b.part_o = arena.alloc_n<float>(R * c.n_heads * max_chunks * c.head_dim, Kind::Scratch);
  b.part_ml = arena.alloc_n<float>(R * c.n_heads * max_chunks * 2, Kind::Scratch);
  b.tables = arena.alloc_n<int>(R * b.table_stride, Kind::Scratch);
  TI_CUDA_CHECK(cudaMemsetAsync(b.tables, 0xFF, R * b.table_stride * sizeof(int), s));  // -1: no page yet
  b.slot_logits = static_cast<float*>(zeroed(R * c.vocab * sizeof(float)));
  return b;
}

}  // namespace ti
