// cuda_prefill.cu — the GPU engine's prefill path: a whole prompt per pass (chunks of up to prefill_chunk
// tokens), as opposed to the decode step (cuda_engine.cu) that feeds one token through a captured graph.
//
// Per chunk of T tokens at positions pos0..pos0+T-1, top to bottom (PyTorch in the comments, X: (T, hidden)):
//   x = embed[tokens]; for each layer: qkv = rmsnorm(x) @ Wqkv.T; rope + KV-cache write; att = causal
//   attention over the cache; x += att @ Wo.T; gu = rmsnorm(x) @ Wgu.T; x += swiglu(gu) @ Wd.T.
// Then the last row becomes the decode state (x_, logits_ via the decode GEMV), and only when the caller asks
// for every position's logits (Engine.logits) does the LM head run as a GEMM over the chunk's rows.
// The five products go through cuda::Gemm (cuBLASLt, tuned per shape on first use); the residual adds ride in
// the O and down GEMMs (beta = 1). Quantized weights are dequantized to fp16 rows (one scratch matrix, fp16_of)
// right before each GEMM: ~2 bytes written per weight per chunk, small next to the GEMMs of a long prompt. No graph: ~10 launches per layer are cheap next to GEMMs over many tokens.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../cuda/common.cuh"
#include "../cuda/prefill.cuh"
#include "../cuda/prefill_attention.cuh"
#include "cuda_engine.h"
#include "errors.h"

namespace ti {

using cuda::GemmArgs;
using cuda::GemmOut;

bool CudaEngine::batched_prefill() const { return gemm_ != nullptr && prefill_rows_ > 0; }

static GemmArgs gemm_args(const __half* W, int M, int ldw, const __half* X, int ldx, void* Y, int ldy, int N, int K,
                          GemmOut out) {
  GemmArgs a;
  a.W = W;
  a.X = X;
  a.Y = Y;
  a.M = M;
  a.N = N;
  a.K = K;
  a.ldw = ldw;
  a.ldx = ldx;
  a.ldy = ldy;
  a.out = out;
  return a;
}

void CudaEngine::prefill_layer(const Layer& L, int64_t layer, int T, int pos0) {
  const ModelConfig& c = cfg_;
  const int H = (int)c.hidden, I = (int)c.intermediate, q_dim = (int)c.q_dim;
  const int qkv_rows = (int)(c.q_dim + 2 * c.kv_dim);
  const float eps = (float)c.rms_eps;
  cudaStream_t s = stream_;

  // qkv = rmsnorm(x) @ [Wq; Wk; Wv].T
  cuda::rmsnorm_rows(px_, ld_h_, L.attn_norm, eps, H, T, pxn_, ld_h_, s);
  gemm_->run(gemm_args(fp16_of(L.qkv), qkv_rows, ld_h_, pxn_, ld_h_, pqkv_, ld_qkv_, T, H, GemmOut::F32), s);
  // q = rope(q); cache[pos0 + t] = rope(k), v
  cuda::RopeRowsParams r;
  r.qkv = pqkv_;
  r.ldqkv = ld_qkv_;
  r.cos = rope_cos_;
  r.sin = rope_sin_;
  r.q = pq_;
  r.k_pages = k_pages_ + layer * kv_layer_elems_;
  r.v_pages = v_pages_ + layer * kv_layer_elems_;
  r.page_table = d_page_table_;
  r.page_shift = kv_pool_->page_shift();
  r.T = T;
  r.pos0 = pos0;
  r.n_heads = (int)c.n_heads;
  r.n_kv_heads = (int)c.n_kv_heads;
  r.head_dim = (int)c.head_dim;
  cuda::rope_rows(r, s);
  // att = softmax(q K^T / sqrt(d), causal) V over positions 0..pos0+t
  cuda::PrefillAttnParams a;
  a.q = pq_;
  a.k_pages = r.k_pages;
  a.v_pages = r.v_pages;
  a.page_table = r.page_table;
  a.page_shift = r.page_shift;
  a.out = patt_;
  a.ldo = ld_q_;
  a.T = T;
  a.pos0 = pos0;
  a.n_heads = r.n_heads;
  a.n_kv_heads = r.n_kv_heads;
  a.head_dim = r.head_dim;
  a.max_seq = (int)max_seq_;
  a.scale = 1.0f / std::sqrt((float)c.head_dim);
  cuda::prefill_attention(a, s);
  // x += att @ Wo.T
  gemm_->run(gemm_args(fp16_of(L.o), H, ld_q_, patt_, ld_q_, px_, ld_h_, T, q_dim, GemmOut::AddF32), s);
  // h = silu(rmsnorm(x) @ Wg.T) * (rmsnorm(x) @ Wu.T)   (gate and up rows interleaved: one GEMM)
  cuda::rmsnorm_rows(px_, ld_h_, L.mlp_norm, eps, H, T, pxn_, ld_h_, s);
  gemm_->run(gemm_args(fp16_of(L.gate_up), 2 * I, ld_h_, pxn_, ld_h_, pgu_, ld_gu_, T, H, GemmOut::F16), s);
  cuda::swiglu_rows(pgu_, ld_gu_, I, T, ph_, ld_i_, s);
  // x += h @ Wd.T
  gemm_->run(gemm_args(fp16_of(L.down), H, ld_i_, ph_, ld_i_, px_, ld_h_, T, I, GemmOut::AddF32), s);
}

// Every row's logits (rows from max(0, -host_row0)) into host_logits rows host_row0 + row, a slice of
// logit_rows_ rows at a time: logits = rmsnorm(x) @ lm_head.T.
void CudaEngine::chunk_logits(int T, float* host_logits, int64_t host_row0) {
  const ModelConfig& c = cfg_;
  const int H = (int)c.hidden, V = (int)c.vocab;
  const __half* head = fp16_of(lm_head_);  // (quantized: dequantized once for all slices)
  for (int r = (int)std::max<int64_t>(0, -host_row0); r < T; r += logit_rows_) {
    const int n = std::min(logit_rows_, T - r);
    cuda::rmsnorm_rows(px_ + (size_t)r * ld_h_, ld_h_, final_norm_, (float)c.rms_eps, H, n, pxn_, ld_h_, stream_);
    gemm_->run(gemm_args(head, V, ld_h_, pxn_, ld_h_, plogits_, ld_v_, n, H, GemmOut::F32), stream_);
    TI_CUDA_CHECK(cudaMemcpy2DAsync(host_logits + (host_row0 + r) * V, (size_t)V * sizeof(float), plogits_,
                                    (size_t)ld_v_ * sizeof(float), (size_t)V * sizeof(float), (size_t)n,
                                    cudaMemcpyDeviceToHost, stream_));
  }
}

// One chunk: T tokens at pos0.. (T <= prefill_rows_). Leaves the last row's residual in x_ and its logits in
// logits_ (what decode() samples from first). host_logits: every row's logits as well (see chunk_logits).
void CudaEngine::prefill_chunk(const int32_t* tokens, int T, int pos0, float* host_logits, int64_t host_row0) {
  const ModelConfig& c = cfg_;
  const int H = (int)c.hidden;
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // h_tokens_ may still be read by the previous chunk's copy
  std::memcpy(h_tokens_, tokens, (size_t)T * sizeof(int32_t));
  TI_CUDA_CHECK(cudaMemcpyAsync(d_tokens_, h_tokens_, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, stream_));

  cuda::embed_tokens(embedding_, ld_h_, H, d_tokens_, T, px_, ld_h_, stream_);  // x = embed[tokens]
  for (int64_t l = 0; l < c.n_layers; l++) prefill_layer(layers_[(size_t)l], l, T, pos0);

  // logits of the last position = lm_head @ rmsnorm(x[T-1]): the decode GEMV, as a decode step would
  TI_CUDA_CHECK(cudaMemcpyAsync(x_, px_ + (size_t)(T - 1) * ld_h_, (size_t)H * sizeof(float),
                                cudaMemcpyDeviceToDevice, stream_));
  cuda::gemv(tuned("lm_head", gemv_params(lm_head_, x_, logits_, final_norm_)), choice("lm_head"),
             cuda::GemvIn::F32Norm, cuda::GemvOut::F32, stream_, false);
  if (host_logits) chunk_logits(T, host_logits, host_row0);
}

double CudaEngine::time_prefill(int64_t n_tokens, int reps) {
  if (!batched_prefill()) fail(ErrorKind::Request, "time_prefill: this engine has no batched prefill");
  if (n_tokens < 1 || n_tokens > max_seq_)
    fail(ErrorKind::Request, "time_prefill: n_tokens must be in 1..max_seq_len=" + std::to_string(max_seq_));
  if (reps < 1) fail(ErrorKind::Request, "time_prefill: reps must be >= 1");
  std::vector<int32_t> toks((size_t)n_tokens);
  for (int64_t i = 0; i < n_tokens; i++) toks[(size_t)i] = (int32_t)((i * 7919 + 13) % cfg_.vocab);
  auto run = [&] {
    for (int64_t c0 = 0; c0 < n_tokens; c0 += prefill_rows_)
      prefill_chunk(toks.data() + c0, (int)std::min<int64_t>(prefill_rows_, n_tokens - c0), (int)c0, nullptr, 0);
  };
  reset();
  kv_reserve(n_tokens);
  run();  // warm-up: tunes this length's GEMM shapes
  const float ms = gpu_ms([&] {
    for (int i = 0; i < reps; i++) run();
  });
  reset();
  return ms / reps;
}

std::vector<std::pair<std::string, cuda::GemmTuning>> CudaEngine::gemm_table() const {
  std::vector<std::pair<std::string, cuda::GemmTuning>> out;
  if (!gemm_) return out;
  const ModelConfig& c = cfg_;
  for (const cuda::GemmTuning& t : gemm_->table()) {
    std::string name = "?";
    if (t.M == c.q_dim + 2 * c.kv_dim && t.K == c.hidden) name = "qkv";
    else if (t.M == c.hidden && t.K == c.q_dim) name = "o";
    else if (t.M == 2 * c.intermediate && t.K == c.hidden) name = "gate_up";
    else if (t.M == c.hidden && t.K == c.intermediate) name = "down";
    else if (t.M == c.vocab && t.K == c.hidden) name = "lm_head";
    out.emplace_back(name, t);
  }
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second.N < b.second.N; });
  return out;
}

}  // namespace ti
