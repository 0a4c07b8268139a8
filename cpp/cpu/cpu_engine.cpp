#include "cpu_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#if defined(__SSE2__)
#include <emmintrin.h>  // (dot4)
#endif

#include "../core/draft.h"
#include "../core/engine_checks.h"
#include "../core/errors.h"
#include "../core/quant.h"
#include "row_dot.h"

namespace ti {

// ---- operations ----

static float dot(const float* a, const float* b, int64_t n) {
  // Eight partial sums: lets the compiler vectorise without -ffast-math; still plain fp32 accumulation.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

// dot(a_k, b, n) for four inputs a_0..a_3 at once: each weight loaded once for the four, and four independent
// chains of adds where a loop of dot() has one. Each output takes exactly dot()'s operations in dot()'s order (a
// rounded product, then a rounded add, per lane; no fused multiply-add in this file), so the same bits. SSE2
// intrinsics (every x86-64 has them): GCC vectorises the four-input form of dot()'s loop badly (3x slower than
// dot() itself); elsewhere four dot() calls.
static void dot4(const float* a0, const float* a1, const float* a2, const float* a3, const float* b, int64_t n,
                 float out[4]) {
  const float* a[4] = {a0, a1, a2, a3};
#if defined(__SSE2__)
  __m128 lo[4], hi[4];
  for (int k = 0; k < 4; k++) lo[k] = hi[k] = _mm_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128 wl = _mm_loadu_ps(b + i), wh = _mm_loadu_ps(b + i + 4);
    for (int k = 0; k < 4; k++) {
      lo[k] = _mm_add_ps(lo[k], _mm_mul_ps(_mm_loadu_ps(a[k] + i), wl));
      hi[k] = _mm_add_ps(hi[k], _mm_mul_ps(_mm_loadu_ps(a[k] + i + 4), wh));
    }
  }
  for (int k = 0; k < 4; k++) {
    float c[8];
    _mm_storeu_ps(c, lo[k]);
    _mm_storeu_ps(c + 4, hi[k]);
    float s = ((c[0] + c[1]) + (c[2] + c[3])) + ((c[4] + c[5]) + (c[6] + c[7]));
    for (int64_t r = i; r < n; r++) s += a[k][r] * b[r];
    out[k] = s;
  }
#else
  for (int k = 0; k < 4; k++) out[k] = dot(a[k], b, n);
#endif
}

// y[t * ld + r] = dot(x_t, w_r) for the n inputs of one weight row: eight at a time where the CPU has AVX2
// (row_dots8), then four at a time.
static void row_times_inputs(float* y, int64_t ld, const float* x, const float* wr, int64_t n, int64_t cols) {
  int64_t t = 0;
  float out8[8];
  for (; t + 8 <= n && row_dots8(wr, x + t * cols, cols, out8); t += 8)
    for (int k = 0; k < 8; k++) y[(t + k) * ld] = out8[k];
  for (; t + 4 <= n; t += 4) {
    float out[4];
    dot4(x + t * cols, x + (t + 1) * cols, x + (t + 2) * cols, x + (t + 3) * cols, wr, cols, out);
    for (int k = 0; k < 4; k++) y[(t + k) * ld] = out[k];
  }
  for (; t < n; t++) y[t * ld] = dot(x + t * cols, wr, cols);
}

void matmul(float* y, const float* x, const float* W, int64_t n, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r++) {
    const float* wr = W + r * cols;
    for (int64_t t = 0; t < n; t++) y[t * rows + r] = dot(x + t * cols, wr, cols);
  }
}

// Rows [r0, r1) of y (n, rows) = x (n, cols) @ W^T by row_dots() (straight from the stored format), a block of
// rows at a time for all n inputs so the block stays in cache between them. False, with nothing written, where
// row_dots does not take W (it decides by format and width alone, so on its first call).
static bool matmul_direct(float* y, const float* x, const HostTensor& W, int64_t n, int64_t r0, int64_t r1) {
  constexpr int64_t kBlock = 16;
  const int64_t rows = W.rows();
  for (int64_t b0 = r0; b0 < r1; b0 += kBlock) {
    const int64_t b1 = std::min(b0 + kBlock, r1);
    if (!row_dots(W, x, n, y + b0, rows, b0, b1)) return false;
  }
  return true;
}

// y (n, rows) = x (n, cols) @ W^T with W in its stored precision: every output is the same dot() over the same
// fp32 numbers as a whole-matrix fp32 copy would give, whichever thread computes it and whatever n is (so a
// token's numbers do not depend on the other rows of its batch or chunk). Straight from the format where row_dots
// takes it, at any n (unpacking a row again for every eight inputs costs less than one widening pass into memory:
// docs/perf/cpu-engine.md); else each row is widened to fp32 once (into a per-thread row buffer) and dotted with
// the n inputs.
static void matmul(float* y, const float* x, const HostTensor& W, int64_t n, ThreadPool& pool) {
  const int64_t rows = W.rows(), cols = W.cols();
  pool.parallel_for(rows, pool.grain_for(rows, 4), [&](int64_t r0, int64_t r1) {
    if (matmul_direct(y, x, W, n, r0, r1)) return;
    thread_local std::vector<float> row;
    if (W.held != Held::F32 && (int64_t)row.size() < cols) row.resize((size_t)cols);
    for (int64_t r = r0; r < r1; r++) {
      const float* wr = W.held == Held::F32 ? &W.f32[(size_t)(r * cols)] : row.data();
      if (W.held != Held::F32) W.widen_row(r, row.data());
      row_times_inputs(y + r, rows, x, wr, n, cols);
    }
  });
}

void rmsnorm(float* y, const float* x, const float* weight, int64_t n, int64_t d, float eps) {
  for (int64_t t = 0; t < n; t++) {
    const float* xr = x + t * d;
    double ss = 0;
    for (int64_t i = 0; i < d; i++) ss += (double)xr[i] * xr[i];
    const float inv = (float)(1.0 / std::sqrt(ss / (double)d + (double)eps));
    for (int64_t i = 0; i < d; i++) y[t * d + i] = weight[i] * (xr[i] * inv);
  }
}

void swiglu(float* gate, const float* up, int64_t count) {
  for (int64_t i = 0; i < count; i++) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

// ---- engine ----

int default_threads() { return std::max(1, (int)std::thread::hardware_concurrency()); }

static int checked_threads(int64_t threads) {
  if (threads < 0 || threads > kMaxThreads)
    fail(ErrorKind::Request, "threads must be in 1.." + std::to_string(kMaxThreads) +
                                 " (or 0: the cores available), got " + std::to_string(threads));
  return threads == 0 ? default_threads() : (int)threads;
}

CpuEngine::CpuEngine(std::shared_ptr<const WeightStore> weights, int64_t max_seq_len, int64_t threads,
                     int64_t max_batch, int act8)
    : w_(std::move(weights)), cfg_(w_->config()), max_seq_(max_seq_len), act8_(act8) {
  if (!w_->finished()) fail(ErrorKind::Request, "CpuEngine: the WeightStore is not finished");
  if (act8 != 0 && act8 != -1 && act8 != -2 && act8 != 2)
    fail(ErrorKind::Request, "act8 must be 0 (off), -1 (int4 matrices), -2 (int4 matrices but down) or 2 (every "
                             "quantized matrix) on the CPU (got " + std::to_string(act8) + ")");
  if (max_seq_len < 1) fail(ErrorKind::Request, "max_seq_len must be >= 1 (got " + std::to_string(max_seq_len) + ")");
  check_max_batch(max_batch);
  pool_ = std::make_unique<ThreadPool>(checked_threads(threads));
  kv_ = KVCache(cfg_.n_layers, cfg_.n_kv_heads, cfg_.head_dim);
  slots_.resize((size_t)max_batch);
  rope_ = rope_table(cfg_, max_seq_len);
  last_logits_.resize((size_t)cfg_.vocab);
  history_ = TokenHistory(cfg_.vocab);
}

void CpuEngine::reset() {
  tokens_.clear();
  history_.clear();
  has_last_ = pending_ = false;
}

// Attention of token t (at row.pos in row.kv) in head h over that cache's positions 0..row.pos.
void CpuEngine::attend(int64_t l, int64_t t, int64_t h, const RowSlot& row) {
  const ModelConfig& c = cfg_;
  const int64_t hd = c.head_dim;
  const float scale = 1.0f / std::sqrt((float)hd);
  const int64_t kvh = h / c.group, len = row.pos + 1;  // causal: positions 0..row.pos
  KVCache& kv = *row.kv;
  const float* q = &q_[t * c.q_dim + h * hd];
  std::vector<float> score((size_t)len);
  float mx = -INFINITY;
  int64_t p = 0;
  for (; p + 4 <= len; p += 4) {  // (four keys a dot4: dot()'s bits, four chains at once)
    float s4[4];
    dot4(kv.key(l, kvh, p), kv.key(l, kvh, p + 1), kv.key(l, kvh, p + 2), kv.key(l, kvh, p + 3), q, hd, s4);
    for (int k = 0; k < 4; k++) score[p + k] = s4[k] * scale;
  }
  for (; p < len; p++) score[p] = dot(q, kv.key(l, kvh, p), hd) * scale;
  for (p = 0; p < len; p++) mx = std::max(mx, score[p]);
  double sum = 0;
  for (int64_t p = 0; p < len; p++) sum += (score[p] = std::exp(score[p] - mx));
  float* out = &att_[t * c.q_dim + h * hd];
  std::fill(out, out + hd, 0.0f);
  for (int64_t p = 0; p < len; p++) score[p] = (float)(score[p] / sum);  // the weights
  // Each page's values are consecutive rows: out += weight * value row by row, in position order.
  for (int64_t p0 = 0; p0 < len; p0 += kCpuKvPageSize) {
    const int64_t rows = std::min(kCpuKvPageSize, len - p0);
    const float* v = kv.value(l, kvh, p0);
    if (add_weighted_rows(out, v, &score[p0], rows, hd)) continue;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t i = 0; i < hd; i++) out[i] += score[p0 + r] * v[r * hd + i];
  }
}

void CpuEngine::act8_inputs(float* x, int64_t n, int64_t K, WFormat f, bool normed, bool down) const {
  const bool on = act8_ == 2 ? f != WFormat::F16 : (act8_ == -1 || (act8_ == -2 && !down)) && f == WFormat::I4;
  if (!on || K % 32 != 0 || (normed && K > 8192)) return;  // (where the GPU's kernels keep fp16 inputs too)
  for (int64_t t = 0; t < n; t++) act8_round(x + t * K, K);
}

void CpuEngine::run_layer(int64_t l, const RowSlot* rows, int64_t n) {
  const ModelConfig& c = cfg_;
  const LayerWeights L = w_->layer(l);
  const int64_t H = c.hidden, hd = c.head_dim, I = c.intermediate;
  const float eps = (float)c.rms_eps;

  // ---- attention block: x += o_proj(attn(rope(q), rope(k), v)) ----
  const WFormat f = w_->format();  // (the layers' matrices; the GPU fuses q | k | v, gate | up in it)
  rmsnorm(xn_.data(), x_.data(), L.attn_norm, n, H, eps);
  act8_inputs(xn_.data(), n, H, f, true);
  matmul(q_.data(), xn_.data(), *L.wq, n, *pool_);
  matmul(k_.data(), xn_.data(), *L.wk, n, *pool_);
  matmul(v_.data(), xn_.data(), *L.wv, n, *pool_);
  // Every row's key and value go into its cache before any row attends: a prefill chunk's later rows read
  // the earlier ones'.
  for (int64_t t = 0; t < n; t++) {
    const RowSlot& r = rows[t];
    rope_apply(&q_[t * c.q_dim], c.n_heads, hd, rope_, r.pos);
    rope_apply(&k_[t * c.kv_dim], c.n_kv_heads, hd, rope_, r.pos);
    for (int64_t h = 0; h < c.n_kv_heads; h++) {
      std::memcpy(r.kv->key(l, h, r.pos), &k_[t * c.kv_dim + h * hd], hd * sizeof(float));
      std::memcpy(r.kv->value(l, h, r.pos), &v_[t * c.kv_dim + h * hd], hd * sizeof(float));
    }
  }
  // One task per (token, head).
  pool_->parallel_for(n * c.n_heads, 1, [&](int64_t th0, int64_t th1) {
    for (int64_t th = th0; th < th1; th++) attend(l, th / c.n_heads, th % c.n_heads, rows[th / c.n_heads]);
  });
  act8_inputs(att_.data(), n, c.q_dim, f, false);
  matmul(tmp_.data(), att_.data(), *L.wo, n, *pool_);
  for (int64_t i = 0; i < n * H; i++) x_[i] += tmp_[i];

  // ---- MLP block: x += down(silu(gate(xn)) * up(xn)) ----
  rmsnorm(xn_.data(), x_.data(), L.mlp_norm, n, H, eps);
  act8_inputs(xn_.data(), n, H, f, true);
  matmul(gate_.data(), xn_.data(), *L.w_gate, n, *pool_);
  matmul(up_.data(), xn_.data(), *L.w_up, n, *pool_);
  swiglu(gate_.data(), up_.data(), n * I);
  act8_inputs(gate_.data(), n, I, f, false, true);
  matmul(tmp_.data(), gate_.data(), *L.w_down, n, *pool_);
  for (int64_t i = 0; i < n * H; i++) x_[i] += tmp_[i];
}

void CpuEngine::run(const int32_t* tokens, const RowSlot* rows, int64_t m, int64_t first_logit_row, float* logits) {
  const ModelConfig& c = cfg_;
  const int64_t H = c.hidden;
  for (auto* buf : {&x_, &xn_, &tmp_}) buf->resize((size_t)(m * H));
  for (auto* buf : {&q_, &att_}) buf->resize((size_t)(m * c.q_dim));
  for (auto* buf : {&k_, &v_}) buf->resize((size_t)(m * c.kv_dim));
  for (auto* buf : {&gate_, &up_}) buf->resize((size_t)(m * c.intermediate));

  for (int64_t t = 0; t < m; t++)  // embedding lookup
    w_->embedding().widen_row(tokens[t], &x_[t * H]);
  for (int64_t l = 0; l < c.n_layers; l++) run_layer(l, rows, m);

  // Final norm and LM head only for the rows whose logits are wanted; the last row always (for decode).
  const int64_t n_out = m - first_logit_row;
  rmsnorm(xn_.data(), &x_[first_logit_row * H], w_->final_norm(), n_out, H, (float)c.rms_eps);
  const Held head = w_->lm_head().held;
  const WFormat head_f = head == Held::I8 ? WFormat::I8 : head == Held::I4 ? WFormat::I4 : WFormat::F16;
  act8_inputs(xn_.data(), n_out, H, head_f, true);
  std::vector<float>& out = logits_buf_;
  out.resize((size_t)(n_out * c.vocab));
  matmul(out.data(), xn_.data(), w_->lm_head(), n_out, *pool_);
  if (logits) std::memcpy(logits, out.data(), (size_t)(n_out * c.vocab) * sizeof(float));
}

void CpuEngine::run_single(const int32_t* tokens, int64_t m, int64_t pos0, int64_t first_logit_row, float* logits) {
  kv_.reserve(pos0 + m);
  rows_.resize((size_t)m);
  for (int64_t t = 0; t < m; t++) rows_[t] = {&kv_, pos0 + t};
  run(tokens, rows_.data(), m, first_logit_row, logits);
  const int64_t n_rows = m - first_logit_row;
  std::memcpy(last_logits_.data(), &logits_buf_[(n_rows - 1) * cfg_.vocab], (size_t)cfg_.vocab * sizeof(float));
  has_last_ = true;
}

void CpuEngine::forward(const int32_t* tokens, int64_t n, bool all_logits, float* logits) {
  check_tokens(tokens, n, cfg_.vocab);
  check_room(position(), n, max_seq_);
  // A sampled-but-not-fed token goes through the model first, in the same pass.
  std::vector<int32_t> seq;
  if (pending_) seq.push_back(tokens_.back());
  seq.insert(seq.end(), tokens, tokens + n);
  const int64_t m = (int64_t)seq.size(), pos0 = position() - (pending_ ? 1 : 0);
  const int64_t first = all_logits ? m - n : m - 1;
  run_single(seq.data(), m, pos0, first, logits);
  tokens_.insert(tokens_.end(), tokens, tokens + n);
  for (int64_t i = 0; i < n; i++) history_.add_prompt(tokens[i]);
  pending_ = false;
}

std::vector<int32_t> CpuEngine::decode(int64_t max_steps, const SamplingConfig& s,
                                       const std::vector<int32_t>& stop_ids, uint64_t step0) {
  validate(s, cfg_.vocab);
  if (!has_last_) fail(ErrorKind::Request, "decode: run a prompt through forward() first");
  std::vector<int32_t> out;
  for (int64_t i = 0; i < max_steps; i++) {
    if (pending_) {
      run_single(&tokens_.back(), 1, position() - 1, 0, nullptr);
      pending_ = false;
    }
    if (position() >= max_seq_)
      fail(ErrorKind::Request, "the sequence reached max_seq_len=" + std::to_string(max_seq_));
    const int32_t tok =  // (the token alone: sample_row's log-probability pass, ~0.2 ms at 49,152 tokens, unused)
        sample_row_token(last_logits_.data(), cfg_.vocab, s, step0 + (uint64_t)i, history_, scratch_, scratch_ids_);
    tokens_.push_back(tok);
    history_.add_generated(tok);
    pending_ = true;
    out.push_back(tok);
    if (std::find(stop_ids.begin(), stop_ids.end(), tok) != stop_ids.end()) break;
  }
  return out;
}

std::vector<int32_t> CpuEngine::decode_draft(const int32_t* draft, int64_t k, const SamplingConfig& s,
                                             const std::vector<int32_t>& stop_ids, uint64_t step0) {
  check_draft(s, cfg_.vocab, has_last_, draft, k, position(), max_seq_);
  const std::vector<int32_t> seq = draft_pass_tokens(tokens_, pending_, draft, k);
  const int64_t m = (int64_t)seq.size(), V = cfg_.vocab;
  std::vector<float> logits((size_t)(m + 1) * V);  // row 0: the logits before the pass (used without a pending token)
  std::memcpy(logits.data(), last_logits_.data(), (size_t)V * sizeof(float));
  run_single(seq.data(), m, position() - (pending_ ? 1 : 0), 0, logits.data() + V);
  const std::vector<const float*> rows = draft_rows(logits.data(), V, k, pending_);
  std::vector<int32_t> out =
      accept_draft(rows.data(), V, s, draft, k, stop_ids, step0, history_, scratch_, scratch_ids_);
  // the positions past the kept tokens hold the rejected draft's keys and values: never read (attention stops at
  // the row's position), overwritten as the sequence grows
  std::memcpy(last_logits_.data(), rows[out.size() - 1], (size_t)V * sizeof(float));
  tokens_.insert(tokens_.end(), out.begin(), out.end());
  pending_ = true;
  return out;
}

void CpuEngine::rewind(int64_t n) {
  check_single_rewind(n, position());
  if (n == position()) return;
  tokens_.resize((size_t)n);  // (the last kept one was run: only the last of all could be pending)
  history_.restart(tokens_);
  has_last_ = pending_ = false;
}

}  // namespace ti
