// prefill_step.cu — the batched prefill pass (see prefill_step.h).
//
// Per chunk of T tokens at positions pos0..pos0+T-1, top to bottom (PyTorch in the comments, X: (T, hidden)):
//   x = embed[tokens]; for each layer: qkv = rmsnorm(x) @ Wqkv.T; rope + KV-cache write; att = causal
//   attention over the cache; x += att @ Wo.T; gu = rmsnorm(x) @ Wgu.T; x += swiglu(gu) @ Wd.T.
// Many sequences (run_many): the same pass over their concatenated tokens; only RoPE + cache write (a position
// and a page table per token) and the attention (varlen: a tile list, each block in one sequence) know where
// one sequence ends.
// Then the last row becomes the decode state (x, logits via the decode GEMV), and only when the caller asks
// for every position's logits (Engine.logits) does the LM head run as a GEMM over the chunk's rows.
// The five products go through cuda::Gemm (cuBLASLt, tuned per shape on first use); the residual adds ride in
// the O and down GEMMs (beta = 1). Quantized weights are dequantized to fp16 rows (one scratch matrix, fp16_of)
// right before each GEMM: ~2 bytes written per weight per chunk, small next to the GEMMs of a long prompt. Where the
// decode GEMV of a product takes int8 inputs (CudaOptions::act8; off by default), its input here is rounded to the same
// numbers (rmsnorm_rows' act8, act8_round_rows before o and down), so a prompt's tokens meet what a decode step's
// meet. No graph: ~10 launches per layer are cheap next to GEMMs over many tokens.
#include "prefill_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../../cuda/batch_rows.cuh"
#include "../../cuda/common.cuh"
#include "../../cuda/prefill.cuh"
#include "../../cuda/prefill_attention.cuh"
#include "../core/errors.h"

namespace ti {

using cuda::GemmArgs;
using cuda::GemmOut;

PrefillBuffers PrefillBuffers::allocate(const ModelConfig& c, const DeviceWeights& w, int T, DeviceArena& arena) {
  using Kind = DeviceArena::Kind;
  PrefillBuffers b;
  b.ld_qkv = (int)cuda::pad8(c.q_dim + 2 * c.kv_dim);
  b.ld_gu = (int)cuda::pad8(2 * c.intermediate);
  b.ld_v = (int)cuda::pad8(c.vocab);
  // Engine.logits over a long prompt: the LM head's output a slice of rows at a time (<= 64 MB; the rows go
  // to host memory anyway, so a bigger slice buys nothing).
  b.logit_rows = (int)std::clamp<int64_t>((64 << 20) / ((int64_t)b.ld_v * 4), 1, T);
  auto f32 = [&](size_t n) { return arena.alloc_n<float>(n, Kind::Scratch); };
  auto f16 = [&](size_t n) { return arena.alloc_n<__half>(n, Kind::Scratch); };
  b.tokens = arena.alloc_n<int>((size_t)T, Kind::Scratch);
  b.h_tokens = arena.alloc_pinned_n<int>((size_t)T);
  b.x = f32((size_t)T * w.ld_h);
  b.xn = f16((size_t)T * w.ld_h);
  b.qkv = f32((size_t)T * b.ld_qkv);
  b.q = f16((size_t)T * c.q_dim);
  b.att = f16((size_t)T * w.ld_q);
  b.gu = f16((size_t)T * b.ld_gu);
  b.h = f16((size_t)T * w.ld_i);
  b.logits = f32((size_t)b.logit_rows * b.ld_v);
  b.rows = T;
  b.max_tiles = cuda::prefill_attention_max_tiles(T, T, (int)(c.n_heads / c.n_kv_heads));
  b.varlen = arena.alloc_n<int>((size_t)b.varlen_ints(), Kind::Scratch);
  b.h_varlen = arena.alloc_pinned_n<int>((size_t)b.varlen_ints());
  return b;
}

PrefillStep::PrefillStep(const ModelConfig& c, DeviceWeights& w, const DecodeBuffers& d, const PrefillBuffers& b,
                         const GemvPlan& plan, cuda::Gemm& gemm, cudaStream_t s)
    : c_(c), w_(w), d_(d), b_(b), plan_(plan), gemm_(gemm), s_(s) {
  TI_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
}

PrefillStep::~PrefillStep() {
  if (staged_) cudaEventDestroy(staged_);
}

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

void PrefillStep::layer(const DeviceLayer& L, int64_t layer, const PrefillRows& rows) {
  const ModelConfig& c = c_;
  const int T = rows.T;
  const int H = (int)c.hidden, I = (int)c.intermediate, q_dim = (int)c.q_dim;
  const int qkv_rows = (int)(c.q_dim + 2 * c.kv_dim);
  const float eps = (float)c.rms_eps;
  cudaStream_t s = s_;

  // qkv = rmsnorm(x) @ [Wq; Wk; Wv].T
  // (act8: each product's input rounded as its decode GEMV's int8 input, plan_act8 in gemv_plan.h)
  cuda::rmsnorm_rows(b_.x, w_.ld_h, L.attn_norm, eps, H, T, b_.xn, w_.ld_h, s, false, nullptr, true,
                     plan_act8(plan_, MatrixRole::Qkv, L.qkv));
  gemm_.run(gemm_args(w_.fp16_of(L.qkv), qkv_rows, w_.ld_h, b_.xn, w_.ld_h, b_.qkv, b_.ld_qkv, T, H, GemmOut::F32), s);
  // q = rope(q); cache[pos0 + t] = rope(k), v
  cuda::RopeRowsParams r;
  r.qkv = b_.qkv;
  r.ldqkv = b_.ld_qkv;
  r.cos = d_.rope_cos;
  r.sin = d_.rope_sin;
  r.q = b_.q;
  r.k_pages = d_.k_pages + layer * d_.kv_layer_elems;
  r.v_pages = d_.v_pages + layer * d_.kv_layer_elems;
  r.page_table = rows.page_table;
  r.page_shift = d_.page_shift;
  r.T = T;
  r.pos0 = rows.pos0;
  r.tok_pos = rows.tok_pos;
  r.tok_table = rows.tok_table;
  r.n_heads = (int)c.n_heads;
  r.n_kv_heads = (int)c.n_kv_heads;
  r.head_dim = (int)c.head_dim;
  cuda::rope_rows(r, s);
  // att = softmax(q K^T / sqrt(d), causal) V over positions 0..pos0+t
  cuda::PrefillAttnParams a;
  a.q = b_.q;
  a.k_pages = r.k_pages;
  a.v_pages = r.v_pages;
  a.page_table = r.page_table;
  a.page_shift = r.page_shift;
  a.out = b_.att;
  a.ldo = w_.ld_q;
  a.T = T;
  a.pos0 = rows.pos0;
  a.seqs = rows.seqs;
  a.tiles = rows.tiles;
  a.n_tiles = rows.n_tiles;
  a.n_heads = r.n_heads;
  a.n_kv_heads = r.n_kv_heads;
  a.head_dim = r.head_dim;
  a.max_seq = (int)d_.max_seq;
  a.scale = 1.0f / std::sqrt((float)c.head_dim);
  cuda::prefill_attention(a, s);
  // x += att @ Wo.T
  if (plan_act8(plan_, MatrixRole::O, L.o)) cuda::act8_round_rows(b_.att, w_.ld_q, q_dim, T, s, false);
  gemm_.run(gemm_args(w_.fp16_of(L.o), H, w_.ld_q, b_.att, w_.ld_q, b_.x, w_.ld_h, T, q_dim, GemmOut::AddF32), s);
  // h = silu(rmsnorm(x) @ Wg.T) * (rmsnorm(x) @ Wu.T)   (gate and up rows interleaved: one GEMM)
  cuda::rmsnorm_rows(b_.x, w_.ld_h, L.mlp_norm, eps, H, T, b_.xn, w_.ld_h, s, false, nullptr, true,
                     plan_act8(plan_, MatrixRole::GateUp, L.gate_up));
  gemm_.run(gemm_args(w_.fp16_of(L.gate_up), 2 * I, w_.ld_h, b_.xn, w_.ld_h, b_.gu, b_.ld_gu, T, H, GemmOut::F16), s);
  cuda::swiglu_rows(b_.gu, b_.ld_gu, I, T, b_.h, w_.ld_i, s);
  // x += h @ Wd.T
  if (plan_act8(plan_, MatrixRole::Down, L.down)) cuda::act8_round_rows(b_.h, w_.ld_i, I, T, s, false);
  gemm_.run(gemm_args(w_.fp16_of(L.down), H, w_.ld_i, b_.h, w_.ld_i, b_.x, w_.ld_h, T, I, GemmOut::AddF32), s);
}

// Every row's logits (rows from max(0, -host_row0)) into host_logits rows host_row0 + row, a slice of
// b_.logit_rows rows at a time: logits = rmsnorm(x) @ lm_head.T.
void PrefillStep::chunk_logits(int T, float* host_logits, int64_t host_row0) {
  const ModelConfig& c = c_;
  const int H = (int)c.hidden, V = (int)c.vocab;
  const __half* head = w_.fp16_of(w_.lm_head);  // (quantized: dequantized once for all slices)
  for (int r = (int)std::max<int64_t>(0, -host_row0); r < T; r += b_.logit_rows) {
    const int n = std::min(b_.logit_rows, T - r);
    cuda::rmsnorm_rows(b_.x + (size_t)r * w_.ld_h, w_.ld_h, w_.final_norm, (float)c.rms_eps, H, n, b_.xn, w_.ld_h, s_,
                       false, nullptr, true, plan_act8(plan_, MatrixRole::LmHead, w_.lm_head));
    gemm_.run(gemm_args(head, V, w_.ld_h, b_.xn, w_.ld_h, b_.logits, b_.ld_v, n, H, GemmOut::F32), s_);
    TI_CUDA_CHECK(cudaMemcpy2DAsync(host_logits + (host_row0 + r) * V, (size_t)V * sizeof(float), b_.logits,
                                    (size_t)b_.ld_v * sizeof(float), (size_t)V * sizeof(float), (size_t)n,
                                    cudaMemcpyDeviceToHost, s_));
  }
}

// One chunk: T tokens at pos0.. (T <= rows()) through to.page_table. Leaves the last row's residual in to.x and
// its logits in to.logits (the single sequence: what decode() samples from first). host_logits: every row's
// logits as well (see chunk_logits).
void PrefillStep::run_chunk(const int32_t* tokens, int T, int pos0, float* host_logits, int64_t host_row0,
                            const PrefillTarget& to) {
  const ModelConfig& c = c_;
  const int H = (int)c.hidden;
  TI_CUDA_CHECK(cudaEventSynchronize(staged_));  // b_.h_tokens may still be read by the previous upload
  std::memcpy(b_.h_tokens, tokens, (size_t)T * sizeof(int32_t));
  TI_CUDA_CHECK(cudaMemcpyAsync(b_.tokens, b_.h_tokens, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, s_));
  TI_CUDA_CHECK(cudaEventRecord(staged_, s_));

  cuda::embed_tokens(w_.embedding, w_.ld_h, H, b_.tokens, T, b_.x, w_.ld_h, s_);  // x = embed[tokens]
  PrefillRows rows;
  rows.T = T;
  rows.pos0 = pos0;
  rows.page_table = to.page_table;
  for (int64_t l = 0; l < c.n_layers; l++) layer(w_.layers[(size_t)l], l, rows);
  last_row_logits(T - 1, to.x, to.logits);
  if (host_logits) chunk_logits(T, host_logits, host_row0);
}

// logits of a sequence's last position = lm_head @ rmsnorm(x[row]): the decode GEMV, as a decode step would
// (seq_prefill and the single sequence; seq_prefill_many and seq_mixed gather their finished rows into one GEMM
// instead, which agrees within the batched path's tolerance).
void PrefillStep::last_row_logits(int row, float* x, float* logits) {
  TI_CUDA_CHECK(cudaMemcpyAsync(x, b_.x + (size_t)row * w_.ld_h, (size_t)c_.hidden * sizeof(float),
                                cudaMemcpyDeviceToDevice, s_));
  launch_gemv(plan_, MatrixRole::LmHead, gemv_args(w_.lm_head, x, logits, w_.final_norm, (float)c_.rms_eps, false),
              cuda::GemvIn::F32Norm, cuda::GemvOut::F32, s_, false);
}

// Many sequences: their tokens concatenated into one pass. The layout (per-token positions and tables, the
// sequences, the attention's tiles) is built on the host and uploaded with the tokens, once for all layers.
// Each finished prompt's logits come from its own LM-head GEMV (K reads of the head; see docs/perf/serve.md), or,
// for segments with a logits_row (the mixed step's decode rows and prompts), from one GEMM over their gathered
// last rows.
void PrefillStep::run_many(const PrefillSegment* segs, int n, const int* tables, float* gathered,
                           const int* dev_tokens) {
  const ModelConfig& c = c_;
  int T = 0;
  for (int i = 0; i < n; i++) T += segs[i].T;
  if (n < 1 || T < 1 || T > b_.rows)
    fail(ErrorKind::Request, "prefill: " + std::to_string(n) + " sequences of " + std::to_string(T) +
                                 " tokens in all do not fit one pass of " + std::to_string(b_.rows) + " rows");
  const int group = (int)(c.n_heads / c.n_kv_heads);
  // The pinned staging may still be read by the previous pass's upload (queued behind a step launched ahead):
  // wait for that upload alone, so this pass is queued while the step runs, not after it (no idle device between).
  TI_CUDA_CHECK(cudaEventSynchronize(staged_));
  int4* seqs = reinterpret_cast<int4*>(b_.h_varlen);
  int2* tiles = reinterpret_cast<int2*>(b_.h_varlen + b_.tiles_at());
  int* tok_pos = b_.h_varlen + b_.tok_pos_at();
  int* tok_table = b_.h_varlen + b_.tok_table_at();
  std::vector<int> seq_T((size_t)n), seq_pos0((size_t)n);
  for (int i = 0, row = 0; i < n; row += segs[i].T, i++) {
    const PrefillSegment& sg = segs[i];
    std::memcpy(b_.h_tokens + row, sg.tokens, (size_t)sg.T * sizeof(int32_t));
    for (int t = 0; t < sg.T; t++) {
      tok_pos[row + t] = sg.pos0 + t;
      tok_table[row + t] = (int)sg.table_offset;
    }
    seqs[i] = make_int4(row, sg.T, sg.pos0, (int)sg.table_offset);
    seq_T[(size_t)i] = sg.T;
    seq_pos0[(size_t)i] = sg.pos0;
  }
  int* logit_src = b_.h_varlen + b_.logit_src_at();
  int n_gathered = 0, first_row = -1;
  for (int i = 0, row = 0; i < n; i++) {
    row += segs[i].T;
    if (segs[i].logits_row < 0) continue;
    if (first_row < 0) first_row = segs[i].logits_row;
    if (segs[i].logits_row != first_row + n_gathered || !gathered)
      fail(ErrorKind::Request, "prefill: a pass's gathered logits rows must ascend by one");
    logit_src[n_gathered++] = row - 1;
  }
  int n_tiles = 0;
  cuda::prefill_attention_tiles(seq_T.data(), seq_pos0.data(), n, group, tiles, &n_tiles);
  TI_CUDA_CHECK(cudaMemcpyAsync(b_.tokens, b_.h_tokens, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, s_));
  TI_CUDA_CHECK(cudaMemcpyAsync(b_.varlen, b_.h_varlen, (size_t)b_.varlen_ints() * sizeof(int),
                                cudaMemcpyHostToDevice, s_));
  TI_CUDA_CHECK(cudaEventRecord(staged_, s_));
  // Tokens that live on the device (a sampler's output): over the uploaded placeholders, one copy per run of
  // consecutive sources (the rows that go on are most often all of the sampled ones: one copy).
  for (int i = 0, row = 0; i < n;) {
    if (segs[i].token_src < 0) {
      row += segs[i].T;
      i++;
      continue;
    }
    if (!dev_tokens || segs[i].T != 1) fail(ErrorKind::Request, "prefill: a device token needs dev_tokens and T = 1");
    int j = i + 1;
    while (j < n && segs[j].T == 1 && segs[j].token_src == segs[i].token_src + (j - i)) j++;
    TI_CUDA_CHECK(cudaMemcpyAsync(b_.tokens + row, dev_tokens + segs[i].token_src, (size_t)(j - i) * sizeof(int),
                                  cudaMemcpyDeviceToDevice, s_));
    row += j - i;
    i = j;
  }

  cuda::embed_tokens(w_.embedding, w_.ld_h, (int)c.hidden, b_.tokens, T, b_.x, w_.ld_h, s_);  // x = embed[tokens]
  PrefillRows rows;
  rows.T = T;
  rows.page_table = tables;
  rows.tok_pos = b_.varlen + b_.tok_pos_at();
  rows.tok_table = b_.varlen + b_.tok_table_at();
  rows.seqs = reinterpret_cast<const int4*>(b_.varlen);
  rows.tiles = reinterpret_cast<const int2*>(b_.varlen + b_.tiles_at());
  rows.n_tiles = n_tiles;
  for (int64_t l = 0; l < c.n_layers; l++) layer(w_.layers[(size_t)l], l, rows);
  for (int i = 0, row = 0; i < n; i++) {
    row += segs[i].T;
    if (segs[i].logits) last_row_logits(row - 1, segs[i].x, segs[i].logits);
  }
  if (n_gathered > 0) {  // logits = rmsnorm(x[last rows]) @ lm_head.T, one weight read for all of them
    const int H = (int)c.hidden;
    cuda::rmsnorm_rows(b_.x, w_.ld_h, w_.final_norm, (float)c.rms_eps, H, n_gathered, b_.xn, w_.ld_h, s_, false,
                       b_.varlen + b_.logit_src_at(), true, plan_act8(plan_, MatrixRole::LmHead, w_.lm_head));
    gemm_.run(gemm_args(w_.fp16_of(w_.lm_head), (int)c.vocab, w_.ld_h, b_.xn, w_.ld_h,
                        gathered + (size_t)first_row * b_.ld_v, b_.ld_v, n_gathered, H, GemmOut::F32),
              s_);
  }
}

std::vector<std::pair<std::string, cuda::GemmTuning>> named_gemm_table(const cuda::Gemm& gemm, const ModelConfig& c) {
  std::vector<std::pair<std::string, cuda::GemmTuning>> out;
  for (const cuda::GemmTuning& t : gemm.table()) {
    std::string name = "?";
    if (t.M == c.q_dim + 2 * c.kv_dim && t.K == c.hidden) name = role_name(MatrixRole::Qkv);
    else if (t.M == c.hidden && t.K == c.q_dim) name = role_name(MatrixRole::O);
    else if (t.M == 2 * c.intermediate && t.K == c.hidden) name = role_name(MatrixRole::GateUp);
    else if (t.M == c.hidden && t.K == c.intermediate) name = role_name(MatrixRole::Down);
    else if (t.M == c.vocab && t.K == c.hidden) name = role_name(MatrixRole::LmHead);
    out.emplace_back(name, t);
  }
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second.N < b.second.N; });
  return out;
}

}  // namespace ti
