// decode_step.cu — THE decode pass (see decode_step.h), PyTorch in the comments:
//   x = embed[token]
//   per layer: qkv = [Wq; Wk; Wv] @ rmsnorm(x)          GEMV, RMSNorm in its prologue
//              att = attention(rope(q), cache)           RoPE + cache write + split-K flash decoding (+ merge)
//              x += Wo @ att                             GEMV, residual add in its epilogue
//              h = silu(Wg @ rmsnorm(x)) * (Wu @ ...)    GEMV, SwiGLU in its epilogue
//              x += Wd @ h                               GEMV, residual add
//   logits = lm_head @ rmsnorm(x); token = sample(logits)
// Each GEMV runs the variant the load-time plan chose for its role (gemv_plan.h).
#include "decode_step.h"

#include <cmath>

#include "../../cuda/common.cuh"
#include "../../cuda/embedding.cuh"
#include "../core/rope.h"

namespace ti {

using cuda::GemvIn;
using cuda::GemvOut;

void DecodeStep::record_token_logits(cudaStream_t s, bool pdl, bool one_chunk) {
  const cuda::CarveoutScope carveout(plan_.carveout);  // one SM configuration for the step's kernels (common.cuh)
  const float eps = (float)c_.rms_eps;
  trace_names_.clear();
  auto gemv = [&](MatrixRole role, cuda::GemvParams p, GemvIn in, GemvOut out) {
    p.trace = next_trace(role_name(role));
    launch_gemv(plan_, role, p, in, out, s, pdl);
  };
  // Only qkv always triggers late (after its wait): the attention after it reads pos and the cache before its own
  // wait (common.cuh, the two-back rule). The others may trigger at their start (GemvPlan::early_trigger).
  const bool early = plan_.early_trigger >= 1;
  cuda::embed_token(w_.embedding, w_.ld_h, (int)c_.hidden, b_.state, b_.x, s, pdl);  // x = embed[token]
  for (int64_t l = 0; l < c_.n_layers; l++) {
    const DeviceLayer& L = w_.layers[(size_t)l];
    gemv(MatrixRole::Qkv, gemv_args(L.qkv, b_.x, b_.qkv, L.attn_norm, eps, false), GemvIn::F32Norm, GemvOut::F32);
    cuda::DecodeAttnParams a = attn_params(l);
    a.trace = next_trace("attention");
    cuda::decode_attention(a, s, pdl, !one_chunk);
    gemv(MatrixRole::O, gemv_args(L.o, b_.att, b_.x, nullptr, eps, early), GemvIn::F16, GemvOut::AddF32);
    gemv(MatrixRole::GateUp, gemv_args(L.gate_up, b_.x, b_.h, L.mlp_norm, eps, early), GemvIn::F32Norm,
         GemvOut::Swiglu);
    gemv(MatrixRole::Down, gemv_args(L.down, b_.h, b_.x, nullptr, eps, early), GemvIn::F16, GemvOut::AddF32);
  }
  gemv(MatrixRole::LmHead, gemv_args(w_.lm_head, b_.x, b_.logits, w_.final_norm, eps, early), GemvIn::F32Norm,
       GemvOut::F32);
}

void DecodeStep::record(cudaStream_t s, bool pdl, bool one_chunk) {
  const cuda::CarveoutScope carveout(plan_.carveout);
  record_token_logits(s, pdl, one_chunk);
  cuda::sample_token(b_.logits, (int)c_.vocab, b_.sampling, b_.bias, b_.mask, b_.seen, b_.counts, b_.probs, b_.state,
                     b_.out, s, pdl);
}

cuda::DecodeAttnParams DecodeStep::attn_params(int64_t layer) const {
  cuda::DecodeAttnParams a;
  a.qkv = b_.qkv;
  a.k_pages = b_.k_pages + layer * b_.kv_layer_elems;
  a.v_pages = b_.v_pages + layer * b_.kv_layer_elems;
  a.page_table = b_.page_table;
  a.page_shift = b_.page_shift;
  a.rope_cos = b_.rope_cos;
  a.rope_sin = b_.rope_sin;
  a.pos = &b_.state->pos;
  a.part_o = b_.part_o;
  a.part_ml = b_.part_ml;
  a.out = b_.att;
  a.n_heads = (int)c_.n_heads;
  a.n_kv_heads = (int)c_.n_kv_heads;
  a.head_dim = (int)c_.head_dim;
  a.max_seq = (int)b_.max_seq;
  a.chunk = b_.attn_chunk;
  a.scale = 1.0f / std::sqrt((float)c_.head_dim);
  a.tensor_cores = attn_tensor_cores_;
  a.early_trigger = plan_.early_trigger >= 2;
  return a;
}

unsigned long long* DecodeStep::next_trace(const char* name) {
  if (!b_.trace) return nullptr;
  trace_names_.push_back(name);
  return b_.trace + (trace_names_.size() - 1) * cuda::kTraceBlocks * cuda::kTraceWords;
}

// ---- the buffers ----

DecodeBuffers DecodeBuffers::allocate(const ModelConfig& c, const DeviceWeights& w, int64_t max_seq, int attn_chunk,
                                      const KvPagePool& pages, bool trace, DeviceArena& arena, cudaStream_t s) {
  using Kind = DeviceArena::Kind;
  DecodeBuffers b;
  b.max_seq = max_seq;
  b.attn_chunk = attn_chunk;
  b.kv_layer_elems = (size_t)pages.n_pages() * c.n_kv_heads * pages.page_size() * c.head_dim;
  b.page_shift = pages.page_shift();
  const size_t kv = (size_t)c.n_layers * b.kv_layer_elems;
  b.k_pages = arena.alloc_n<__half>(kv, Kind::KvCache);
  b.v_pages = arena.alloc_n<__half>(kv, Kind::KvCache);
  TI_CUDA_CHECK(cudaMemsetAsync(b.k_pages, 0, kv * sizeof(__half), s));
  TI_CUDA_CHECK(cudaMemsetAsync(b.v_pages, 0, kv * sizeof(__half), s));
  const size_t max_pages = (size_t)pages.pages_for(max_seq);
  b.page_table = arena.alloc_n<int>(max_pages, Kind::Scratch);
  TI_CUDA_CHECK(cudaMemsetAsync(b.page_table, 0xFF, max_pages * sizeof(int), s));  // -1: no page yet

  const int64_t max_chunks = (max_seq + attn_chunk - 1) / attn_chunk;
  b.x = arena.alloc_n<float>((size_t)c.hidden, Kind::Scratch);
  b.qkv = arena.alloc_n<float>((size_t)(c.q_dim + 2 * c.kv_dim), Kind::Scratch);
  b.att = arena.alloc_n<__half>((size_t)w.ld_q, Kind::Scratch);
  b.h = arena.alloc_n<__half>((size_t)w.ld_i, Kind::Scratch);
  b.logits = arena.alloc_n<float>((size_t)c.vocab, Kind::Scratch);
  b.part_o = arena.alloc_n<float>((size_t)(c.n_heads * max_chunks * c.head_dim), Kind::Scratch);
  b.part_ml = arena.alloc_n<float>((size_t)(c.n_heads * max_chunks * 2), Kind::Scratch);
  const size_t rope_n = (size_t)max_seq * (c.head_dim / 2);
  b.rope_cos = arena.alloc_n<float>(rope_n, Kind::Scratch);
  b.rope_sin = arena.alloc_n<float>(rope_n, Kind::Scratch);
  RopeTable rt = rope_table(c, max_seq);  // the CPU engine's own table: identical angles
  TI_CUDA_CHECK(cudaMemcpy(b.rope_cos, rt.cos.data(), rope_n * sizeof(float), cudaMemcpyHostToDevice));
  TI_CUDA_CHECK(cudaMemcpy(b.rope_sin, rt.sin.data(), rope_n * sizeof(float), cudaMemcpyHostToDevice));

  b.sampling = arena.alloc_n<cuda::DeviceSampling>(1, Kind::Scratch);
  b.bias = arena.alloc_n<cuda::LogitBias>((size_t)kMaxLogitBias, Kind::Scratch);
  b.mask = arena.alloc_n<unsigned>((size_t)mask_words(c.vocab), Kind::Scratch);
  b.state = arena.alloc_n<cuda::DecodeState>(1, Kind::Scratch);
  b.seen = arena.alloc_n<unsigned char>((size_t)c.vocab, Kind::Scratch);
  b.counts = arena.alloc_n<int>((size_t)c.vocab, Kind::Scratch);
  b.probs = arena.alloc_n<float>((size_t)c.vocab, Kind::Scratch);
  b.out = arena.alloc_n<int>((size_t)max_seq, Kind::Scratch);
  if (trace) {  // 5 kernels per layer + the head
    b.trace_words = (size_t)(5 * c.n_layers + 1) * cuda::kTraceBlocks * cuda::kTraceWords;
    b.trace = arena.alloc_n<unsigned long long>(b.trace_words, Kind::Scratch);
  }
  TI_CUDA_CHECK(cudaMemsetAsync(b.seen, 0, c.vocab, s));
  TI_CUDA_CHECK(cudaMemsetAsync(b.counts, 0, c.vocab * sizeof(int), s));
  return b;
}

}  // namespace ti
