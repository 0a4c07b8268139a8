#include <cmath>
#include <memory>
#include <limits>

#include "../cuda/attention.cuh"
#include "../cuda/batch_rows.cuh"
#include "../cuda/common.cuh"
#include "../cuda/gemv_batch.cuh"
#include "../cuda/mma_one_row.cuh"
#include "../cuda/mma_small_n.cuh"
#include "kernel_tests.h"
#include "../cuda/prefill.cuh"
#include "../cuda/prefill_attention.cuh"
#include "../cuda/sampling.cuh"

namespace ti::cuda {

namespace {

// A device buffer freed on scope exit (test drivers only; the engine owns its memory differently).
struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { TI_CUDA_CHECK(cudaMalloc(&p, bytes < 16 ? 16 : bytes)); }
  ~Buf() { cudaFree(p); }
  template <typename T>
  T* as() { return static_cast<T*>(p); }
};

void put(void* dst, const void* src, size_t bytes) { TI_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice)); }
void get(void* dst, const void* src, size_t bytes) { TI_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost)); }
// rows x cols fp16 values at row stride ld on the device, as packed floats on the host.
std::vector<float> get_half_rows(const void* src, int rows, int cols, int ld) {
  std::vector<__half> h((size_t)rows * ld);
  get(h.data(), src, h.size() * 2);
  std::vector<float> out((size_t)rows * cols);
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < cols; c++) out[(size_t)r * cols + c] = __half2float(h[(size_t)r * ld + c]);
  return out;
}

// The vectors of one GEMV call on the device: input x (fp16, zero padded to the staged width ld, or fp32 for
// F32Norm), norm weight, output y (y_init for AddF32, else NaN-poisoned); result() reads y back as floats.
struct GemvIO {
  Buf dx, dn, dy;
  int rows, n_out;
  GemvOut out;
  GemvIO(int ld, int K, int rows_, const float* x, const float* norm_w, const float* y_init, GemvIn in, GemvOut out_)
      : dx((size_t)ld * 4), dn((size_t)K * 4), dy((size_t)rows_ * 4), rows(rows_),
        n_out(out_ == GemvOut::Swiglu ? rows_ / 2 : rows_), out(out_) {
    if (in == GemvIn::F16) {
      std::vector<__half> xh((size_t)ld, __float2half(0.0f));
      for (int k = 0; k < K; k++) xh[k] = __float2half(x[k]);
      put(dx.p, xh.data(), (size_t)ld * 2);
    } else {
      put(dx.p, x, (size_t)K * 4);
      put(dn.p, norm_w, (size_t)K * 4);
    }
    if (out == GemvOut::AddF32) put(dy.p, y_init, (size_t)rows * 4);
    else TI_CUDA_CHECK(cudaMemset(dy.p, 0xFF, (size_t)rows * 4));  // NaN in fp32 and fp16: poison
  }
  // Launches the GEMV of p (its weights set by the caller) over these vectors and returns y.
  std::vector<float> run(GemvParams p, int K, int ld, float eps, int R, GemvIn in, int blocks_per_sm) {
    p.rows = rows;
    p.K = K;
    p.ld = ld;
    p.eps = eps;
    p.blocks_per_sm = blocks_per_sm;
    p.x = dx.p;
    p.norm_w = dn.as<float>();
    p.y = dy.p;
    gemv(p, R, in, out, 0, false);
    TI_CUDA_CHECK(cudaDeviceSynchronize());
    return result();
  }
  std::vector<float> result() {
    std::vector<float> y((size_t)n_out);
    if (out == GemvOut::Swiglu) {
      std::vector<__half> yh((size_t)n_out);
      get(yh.data(), dy.p, (size_t)n_out * 2);
      for (int i = 0; i < n_out; i++) y[i] = __half2float(yh[i]);
    } else {
      get(y.data(), dy.p, (size_t)n_out * 4);
    }
    return y;
  }
};

// A HostPages cache on the device: the pools and the table uploaded; back() copies the pools to the host.
struct DevicePages {
  HostPages h;
  Buf k, v, table;
  explicit DevicePages(const HostPages& hp)
      : h(hp), k(hp.elems() * 2), v(hp.elems() * 2), table((size_t)hp.table_len * 4) {
    put(k.p, h.k, h.elems() * 2);
    put(v.p, h.v, h.elems() * 2);
    put(table.p, h.table, (size_t)h.table_len * 4);
  }
  void back() {
    get(h.k, k.p, h.elems() * 2);
    get(h.v, v.p, h.elems() * 2);
  }
};

}  // namespace

int HostPages::page_shift() const {
  int s = 0;
  while ((1 << s) < page_size) s++;
  return s;
}

std::vector<float> run_gemv(const uint16_t* W, int rows, int K, const float* x, const float* norm_w, float eps,
                            const float* y_init, int R, GemvIn in, GemvOut out, int blocks_per_sm) {
  const int ld = (int)pad8(K);
  std::vector<uint16_t> wp((size_t)rows * ld, 0);
  for (int r = 0; r < rows; r++)
    for (int k = 0; k < K; k++) wp[(size_t)r * ld + k] = W[(size_t)r * K + k];
  Buf dW(wp.size() * 2);
  put(dW.p, wp.data(), wp.size() * 2);
  GemvIO io(ld, K, rows, x, norm_w, y_init, in, out);
  GemvParams p;
  p.W = dW.as<__half>();
  return io.run(p, K, ld, eps, R, in, blocks_per_sm);
}

namespace {

// The device buffers of a decode-attention call and its parameters (the fields both forms share).
struct AttnCall {
  DevicePages dc;
  Buf dqkv, dcos, dsin, dpo, dpml, dout;
  size_t out_elems;
  DecodeAttnParams a;
  AttnCall(const float* qkv, size_t qkv_elems, const HostPages& cache, const float* cos, const float* sin,
           size_t parts, size_t out_elems_, int n_heads, int max_seq)
      : dc(cache), dqkv(qkv_elems * 4), dcos(rope_bytes(cache, max_seq)), dsin(rope_bytes(cache, max_seq)),
        dpo(parts * cache.head_dim * 4), dpml(parts * 2 * 4), dout(out_elems_ * 2), out_elems(out_elems_) {
    const size_t rope = rope_bytes(cache, max_seq);
    put(dqkv.p, qkv, qkv_elems * 4);
    put(dcos.p, cos, rope);
    put(dsin.p, sin, rope);
    TI_CUDA_CHECK(cudaMemset(dpo.p, 0xFF, parts * cache.head_dim * 4));
    TI_CUDA_CHECK(cudaMemset(dpml.p, 0xFF, parts * 2 * 4));
    poison();
    a.qkv = dqkv.as<float>();
    a.k_pages = dc.k.as<__half>();
    a.v_pages = dc.v.as<__half>();
    a.page_table = dc.table.as<int>();
    a.page_shift = cache.page_shift();
    a.rope_cos = dcos.as<float>();
    a.rope_sin = dsin.as<float>();
    a.part_o = dpo.as<float>();
    a.part_ml = dpml.as<float>();
    a.out = dout.as<__half>();
    a.n_heads = n_heads;
    a.n_kv_heads = cache.n_kv_heads;
    a.head_dim = cache.head_dim;
    a.max_seq = max_seq;
    a.scale = 1.0f / std::sqrt((float)cache.head_dim);
  }
  static size_t rope_bytes(const HostPages& c, int max_seq) { return (size_t)max_seq * c.head_dim / 2 * 4; }
  void poison() { TI_CUDA_CHECK(cudaMemset(dout.p, 0xFF, out_elems * 2)); }
  // The output (fp16 -> float) after the launches; the pools copied back to the host.
  std::vector<float> result() {
    TI_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<__half> oh(out_elems);
    get(oh.data(), dout.p, out_elems * 2);
    dc.back();
    std::vector<float> o(out_elems);
    for (size_t i = 0; i < out_elems; i++) o[i] = __half2float(oh[i]);
    return o;
  }
};

}  // namespace

std::vector<float> run_decode_attention(const float* qkv, HostPages cache, const float* cos, const float* sin,
                                        int pos, int n_heads, int max_seq, int chunk, bool tensor_cores) {
  const int hd = cache.head_dim, q_dim = n_heads * hd, kv_dim = cache.n_kv_heads * hd;
  const int max_chunks = (max_seq + chunk - 1) / chunk;
  AttnCall c(qkv, (size_t)(q_dim + 2 * kv_dim), cache, cos, sin, (size_t)n_heads * max_chunks, (size_t)q_dim, n_heads,
             max_seq);
  Buf dpos(4);
  put(dpos.p, &pos, 4);
  c.a.pos = dpos.as<int>();
  c.a.chunk = chunk;
  c.a.tensor_cores = tensor_cores;
  decode_attention(c.a, 0, false);
  // Twice, the output poisoned in between: a second call must work from the state the first one left
  // (the second call rewrites the same rope(k), v at pos).
  c.poison();
  decode_attention(c.a, 0, false);
  return c.result();
}

std::vector<float> run_decode_attention_rows(const float* qkv, HostPages cache, int table_stride, const float* cos,
                                             const float* sin, const int* row_pos, const int* row_slot, int n_rows,
                                             int n_heads, int max_seq, int grid_x, int span, int heads,
                                             bool act8_out) {
  const int hd = cache.head_dim, q_dim = n_heads * hd, ld = q_dim + 2 * cache.n_kv_heads * hd;
  const size_t parts = (size_t)n_rows * n_heads * attn_rows_max_splits(max_seq);
  const int n_tickets = attn_rows_tickets(n_rows, n_heads, cache.n_kv_heads);
  AttnCall c(qkv, (size_t)n_rows * ld, cache, cos, sin, parts, (size_t)n_rows * q_dim, n_heads, max_seq);
  Buf drows((size_t)n_rows * 8), dtickets((size_t)n_tickets * 4);
  put(drows.p, row_pos, (size_t)n_rows * 4);
  put(drows.as<int>() + n_rows, row_slot, (size_t)n_rows * 4);
  TI_CUDA_CHECK(cudaMemset(dtickets.p, 0, (size_t)n_tickets * 4));
  c.a.row_pos = drows.as<int>();
  c.a.row_slot = drows.as<int>() + n_rows;
  c.a.tickets = dtickets.as<unsigned>();
  c.a.table_stride = table_stride;
  c.a.ld_qkv = ld;
  c.a.ld_out = q_dim;
  c.a.grid_x = grid_x;
  c.a.rows_span = span;
  c.a.rows_heads = heads;
  c.a.act8_out = act8_out;
  decode_attention_rows(c.a, n_rows, 0, false);
  c.poison();  // (as above; and the second launch must find every merge ticket zero again)
  decode_attention_rows(c.a, n_rows, 0, false);
  std::vector<float> o = c.result();
  std::vector<unsigned> tickets((size_t)n_tickets);
  get(tickets.data(), dtickets.p, (size_t)n_tickets * 4);
  for (unsigned t : tickets)
    if (t != 0) fail(ErrorKind::Device, "decode_attention_rows left a merge ticket at " + std::to_string(t));
  return o;
}

std::vector<float> run_rope_rows(const float* qkv, HostPages cache, const float* cos, const float* sin, int T,
                                 int pos0, int n_heads) {
  const int hd = cache.head_dim, q_dim = n_heads * hd, ld = q_dim + 2 * cache.n_kv_heads * hd;
  const size_t rope = (size_t)(pos0 + T) * hd / 2, nq = (size_t)T * q_dim;
  DevicePages dc(cache);
  Buf dqkv((size_t)T * ld * 4), dcos(rope * 4), dsin(rope * 4), dq(nq * 2);
  put(dqkv.p, qkv, (size_t)T * ld * 4);
  put(dcos.p, cos, rope * 4);
  put(dsin.p, sin, rope * 4);
  TI_CUDA_CHECK(cudaMemset(dq.p, 0xFF, nq * 2));
  RopeRowsParams r;
  r.qkv = dqkv.as<float>();
  r.ldqkv = ld;
  r.cos = dcos.as<float>();
  r.sin = dsin.as<float>();
  r.q = dq.as<__half>();
  r.k_pages = dc.k.as<__half>();
  r.v_pages = dc.v.as<__half>();
  r.page_table = dc.table.as<int>();
  r.page_shift = cache.page_shift();
  r.T = T;
  r.pos0 = pos0;
  r.n_heads = n_heads;
  r.n_kv_heads = cache.n_kv_heads;
  r.head_dim = hd;
  rope_rows(r, 0);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  dc.back();
  std::vector<__half> qh(nq);
  get(qh.data(), dq.p, nq * 2);
  std::vector<float> q(nq);
  for (size_t i = 0; i < nq; i++) q[i] = __half2float(qh[i]);
  return q;
}

int run_sample(const float* logits, int vocab, float temperature, int top_k, float top_p, float min_p,
               float repetition_penalty, unsigned long long seed, int step, const unsigned char* seen) {
  Buf dl((size_t)vocab * 4), dsp(sizeof(DeviceSampling)), dseen((size_t)vocab), dcounts((size_t)vocab * 4),
      dp((size_t)vocab * 4), dst(sizeof(DecodeState)), dout(4);
  put(dl.p, logits, (size_t)vocab * 4);
  DeviceSampling sp{temperature, top_k, top_p, min_p, repetition_penalty, seed};
  put(dsp.p, &sp, sizeof(sp));
  put(dseen.p, seen, (size_t)vocab);
  TI_CUDA_CHECK(cudaMemset(dcounts.p, 0, (size_t)vocab * 4));
  DecodeState st{0, 0, step, step};
  put(dst.p, &st, sizeof(st));
  sample_token(dl.as<float>(), vocab, dsp.as<DeviceSampling>(), nullptr, nullptr, dseen.as<unsigned char>(),
               dcounts.as<int>(), dp.as<float>(), dst.as<DecodeState>(), dout.as<int>(), 0, false);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  int tok = -1;
  get(&tok, dout.p, 4);
  return tok;
}

SampleRowsOut run_sample_rows(const float* logits, int64_t ld, int n_rows, int vocab, const RowSampling* rows,
                              const LogitBias* bias, int n_bias, const unsigned* masks, int n_mask,
                              unsigned char* seen, int* counts, int n_slots, int top_k) {
  const size_t hist = (size_t)n_slots * vocab, rk = (size_t)n_rows * top_k;
  Buf dl((size_t)n_rows * ld * 4), drows(sizeof(RowSampling) * n_rows), dbias(sizeof(LogitBias) * (n_bias + 1)),
      dmask(sizeof(unsigned) * (n_mask + 1)),
      dseen(hist), dcounts(hist * 4),
      dscratch((size_t)n_rows * vocab * 4), dtok((size_t)n_rows * 4), dlp((size_t)n_rows * 4), dids(rk * 4),
      dtlp(rk * 4);
  put(dl.p, logits, (size_t)n_rows * ld * 4);
  put(drows.p, rows, sizeof(RowSampling) * n_rows);
  if (n_bias) put(dbias.p, bias, sizeof(LogitBias) * n_bias);
  if (n_mask) put(dmask.p, masks, sizeof(unsigned) * n_mask);
  put(dseen.p, seen, hist);
  put(dcounts.p, counts, hist * 4);
  SampleRowsOut o{std::vector<int>((size_t)n_rows, -7), std::vector<float>((size_t)n_rows, NAN),
                  std::vector<int>(rk, -7), std::vector<float>(rk, NAN), std::vector<float>((size_t)n_rows * ld)};
  put(dtok.p, o.tokens.data(), (size_t)n_rows * 4);
  put(dlp.p, o.logprob.data(), (size_t)n_rows * 4);
  put(dids.p, o.top_ids.data(), rk * 4);
  put(dtlp.p, o.top_lp.data(), rk * 4);
  sample_rows(dl.as<float>(), ld, n_rows, vocab, drows.as<RowSampling>(), dbias.as<LogitBias>(),
              dmask.as<unsigned>(), dseen.as<unsigned char>(), dcounts.as<int>(), dscratch.as<float>(), top_k,
              dtok.as<int>(), dlp.as<float>(), top_k > 0 ? dids.as<int>() : nullptr,
              top_k > 0 ? dtlp.as<float>() : nullptr, 0);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  get(o.tokens.data(), dtok.p, (size_t)n_rows * 4);
  get(o.logprob.data(), dlp.p, (size_t)n_rows * 4);
  get(o.top_ids.data(), dids.p, rk * 4);
  get(o.top_lp.data(), dtlp.p, rk * 4);
  get(o.logits.data(), dl.p, (size_t)n_rows * ld * 4);
  get(seen, dseen.p, hist);
  get(counts, dcounts.p, hist * 4);
  return o;
}

namespace {
// A GEMM's fp16 inputs on the device at row stride pad8(K), the padding columns NaN (the product must never read
// past K), and the arguments pointing at them (Y, its stride and the output left to the caller).
struct GemmInputs {
  Buf W, X;
  GemmArgs a;
  GemmInputs(const uint16_t* w, const float* x, int M, int N, int K)
      : W((size_t)M * pad8(K) * 2), X((size_t)N * pad8(K) * 2) {
    const int ldk = (int)pad8(K);
    std::vector<uint16_t> wp((size_t)M * ldk, 0x7E00), xp((size_t)N * ldk, 0x7E00);
    for (int m = 0; m < M; m++)
      for (int k = 0; k < K; k++) wp[(size_t)m * ldk + k] = w[(size_t)m * K + k];
    for (int n = 0; n < N; n++)
      for (int k = 0; k < K; k++) {
        const __half h = __float2half(x[(size_t)n * K + k]);
        xp[(size_t)n * ldk + k] = *reinterpret_cast<const uint16_t*>(&h);
      }
    put(W.p, wp.data(), wp.size() * 2);
    put(X.p, xp.data(), xp.size() * 2);
    a.W = W.as<__half>();
    a.X = X.as<__half>();
    a.M = M;
    a.N = N;
    a.K = K;
    a.ldw = a.ldx = ldk;
  }
};
}  // namespace

std::vector<float> run_gemm(const uint16_t* W, const float* X, const float* Y_init, int M, int N, int K, GemmOut out,
                            bool autotune) {
  const int ldy = (int)pad8(M);  // (nothing past M may be written)
  GemmInputs in(W, X, M, N, K);
  const size_t y_elt = out == GemmOut::F16 ? 2 : 4;
  Buf dY((size_t)N * ldy * y_elt);
  if (out == GemmOut::AddF32) {
    std::vector<float> yp((size_t)N * ldy, 0.0f);
    for (int n = 0; n < N; n++)
      for (int m = 0; m < M; m++) yp[(size_t)n * ldy + m] = Y_init[(size_t)n * M + m];
    put(dY.p, yp.data(), yp.size() * 4);
  } else {
    TI_CUDA_CHECK(cudaMemset(dY.p, 0xFF, (size_t)N * ldy * y_elt));  // poison
  }
  Gemm gemm;
  gemm.autotune = autotune;
  GemmArgs a = in.a;
  a.Y = dY.p;
  a.ldy = ldy;
  a.out = out;
  gemm.run(a, 0);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> y((size_t)N * M);
  if (out == GemmOut::F16) {
    std::vector<__half> yh((size_t)N * ldy);
    get(yh.data(), dY.p, yh.size() * 2);
    for (int n = 0; n < N; n++)
      for (int m = 0; m < M; m++) y[(size_t)n * M + m] = __half2float(yh[(size_t)n * ldy + m]);
  } else {
    std::vector<float> yf((size_t)N * ldy);
    get(yf.data(), dY.p, yf.size() * 4);
    for (int n = 0; n < N; n++)
      for (int m = 0; m < M; m++) y[(size_t)n * M + m] = yf[(size_t)n * ldy + m];
  }
  return y;
}

std::pair<std::vector<float>, std::vector<float>> run_sliced_residual_norm(const uint16_t* W, const float* X,
                                                                           const float* x_init, const float* norm_w,
                                                                           float eps, int M, int N, int K, int slices,
                                                                           bool autotune) {
  const int ld = (int)pad8(M + 4);  // (rows wider than the width on purpose)
  const int64_t stride = (int64_t)N * ld + 8;
  GemmInputs in(W, X, M, N, K);
  std::vector<float> xr((size_t)N * ld, 0.0f);
  for (int n = 0; n < N; n++)
    for (int m = 0; m < M; m++) xr[(size_t)n * ld + m] = x_init[(size_t)n * M + m];
  Buf dP((size_t)slices * stride * 4), dx(xr.size() * 4), dn((size_t)M * 4), dy((size_t)N * ld * 2);
  put(dx.p, xr.data(), xr.size() * 4);
  put(dn.p, norm_w, (size_t)M * 4);
  TI_CUDA_CHECK(cudaMemset(dP.p, 0xFF, (size_t)slices * stride * 4));  // NaN: every part written
  TI_CUDA_CHECK(cudaMemset(dy.p, 0xFF, (size_t)N * ld * 2));
  Gemm gemm;
  gemm.autotune = autotune;
  GemmArgs a = in.a;
  a.Y = dP.p;
  a.ldy = ld;
  a.out = GemmOut::F32;
  a.k_slices = slices;
  a.slice_stride = stride;
  gemm.run(a, 0);
  residual_norm_rows(dP.as<float>(), slices, stride, ld, dx.as<float>(), ld, dn.as<float>(), eps, M, N,
                     dy.as<__half>(), ld, 0, false);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  get(xr.data(), dx.p, xr.size() * 4);
  std::vector<uint16_t> yb((size_t)N * ld);
  get(yb.data(), dy.p, yb.size() * 2);
  std::vector<float> x((size_t)N * M);
  for (int n = 0; n < N; n++) {
    for (int m = 0; m < M; m++) x[(size_t)n * M + m] = xr[(size_t)n * ld + m];
    for (int m = M; m < ld; m++)  // past the width: x as it was (0), xn the poison
      if (xr[(size_t)n * ld + m] != 0.0f || yb[(size_t)n * ld + m] != 0xFFFF)
        fail(ErrorKind::Device, "residual_norm_rows wrote past the row's width at column " + std::to_string(m));
  }
  return {x, get_half_rows(dy.p, N, M, ld)};
}

// One prefill_attention launch over T query rows; `set` fills in where the rows sit (one sequence or many).
template <typename Set>
static std::vector<float> prefill_attention_call(const float* q, HostPages cache, int T, int n_heads, int stages,
                                                 const Set& set) {
  const int hd = cache.head_dim, q_dim = n_heads * hd;
  const size_t nq = (size_t)T * q_dim;
  std::vector<__half> qh(nq);
  for (size_t i = 0; i < nq; i++) qh[i] = __float2half(q[i]);
  DevicePages dc(cache);
  Buf dq(nq * 2), dout(nq * 2);
  put(dq.p, qh.data(), nq * 2);
  TI_CUDA_CHECK(cudaMemset(dout.p, 0xFF, nq * 2));
  PrefillAttnParams a;
  a.q = dq.as<__half>();
  a.k_pages = dc.k.as<__half>();
  a.v_pages = dc.v.as<__half>();
  a.page_table = dc.table.as<int>();
  a.page_shift = cache.page_shift();
  a.out = dout.as<__half>();
  a.ldo = q_dim;
  a.T = T;
  a.n_heads = n_heads;
  a.n_kv_heads = cache.n_kv_heads;
  a.head_dim = hd;
  a.max_seq = cache.table_len * cache.page_size;
  a.scale = 1.0f / std::sqrt((float)hd);
  a.stages = stages;
  set(a);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<__half> oh(nq);
  get(oh.data(), dout.p, nq * 2);
  std::vector<float> o(nq);
  for (size_t i = 0; i < nq; i++) o[i] = __half2float(oh[i]);
  return o;
}

std::vector<float> run_prefill_attention(const float* q, HostPages cache, int T, int pos0, int n_heads, int stages) {
  return prefill_attention_call(q, cache, T, n_heads, stages, [&](PrefillAttnParams& a) {
    a.pos0 = pos0;
    prefill_attention(a, 0);
  });
}

std::vector<float> run_prefill_attention_varlen(const float* q, HostPages cache, int row_len, const int* seq_T,
                                                const int* seq_pos0, int n_seqs, int n_heads, int stages) {
  int T = 0;
  std::vector<int4> seqs((size_t)n_seqs);
  for (int s = 0; s < n_seqs; s++) {
    seqs[(size_t)s] = make_int4(T, seq_T[s], seq_pos0[s], s * row_len);
    T += seq_T[s];
  }
  const int group = n_heads / cache.n_kv_heads;
  std::vector<int2> tiles((size_t)prefill_attention_max_tiles(T, n_seqs, group));
  int n_tiles = 0;
  prefill_attention_tiles(seq_T, seq_pos0, n_seqs, group, tiles.data(), &n_tiles);
  Buf dseqs(seqs.size() * sizeof(int4)), dtiles(tiles.size() * sizeof(int2));
  put(dseqs.p, seqs.data(), seqs.size() * sizeof(int4));
  put(dtiles.p, tiles.data(), tiles.size() * sizeof(int2));
  return prefill_attention_call(q, cache, T, n_heads, stages, [&](PrefillAttnParams& a) {
    a.max_seq = row_len * cache.page_size;
    a.seqs = dseqs.as<int4>();
    a.tiles = dtiles.as<int2>();
    a.n_tiles = n_tiles;
    prefill_attention(a, 0);
  });
}

namespace {

// W (rows, K) fp32 -> fp16 rows padded to 8 on the device, and an allocated QMat of the format quantized from it.
struct DeviceQuant {
  Buf w16, q, sc;
  QMat m;
  DeviceQuant(const float* W, int rows, int K, WFormat fmt)
      : w16((size_t)rows * pad8(K) * 2),
        q((size_t)(rows * quant_ld(fmt, K))),
        sc((size_t)(rows * scale_halves(fmt, K) * 2)) {
    const int ldh = (int)pad8(K);
    std::vector<__half> h((size_t)rows * ldh, __float2half(0.0f));
    for (int r = 0; r < rows; r++)
      for (int k = 0; k < K; k++) h[(size_t)r * ldh + k] = __float2half(W[(size_t)r * K + k]);
    put(w16.p, h.data(), h.size() * 2);
    m.fmt = fmt;
    m.q = q.p;
    m.scales = sc.p;
    m.rows = rows;
    m.K = K;
    m.ld = (int)quant_ld(fmt, K);
    quantize_matrix(w16.as<__half>(), ldh, m, 0);
    TI_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

void check_quant_shape(int K, WFormat fmt) {
  if (fmt == WFormat::F16) fail(ErrorKind::Request, "quantized op: format must be int8 or int4");
  if (fmt == WFormat::I4 && K % kI4Group != 0)
    fail(ErrorKind::Unsupported, "int4 weights need K to be a multiple of 32, got " + std::to_string(K));
}

}  // namespace

QuantBytes run_quantize(const float* W, int rows, int K, WFormat fmt) {
  check_quant_shape(K, fmt);
  DeviceQuant d(W, rows, K, fmt);
  QuantBytes out;
  out.ld = d.m.ld;
  out.q.resize((size_t)rows * d.m.ld);
  out.scales.resize((size_t)(rows * scale_halves(fmt, K)));
  get(out.q.data(), d.q.p, out.q.size());
  get(out.scales.data(), d.sc.p, out.scales.size() * 2);
  return out;
}

std::vector<float> run_dequantize(const float* W, int rows, int K, WFormat fmt) {
  check_quant_shape(K, fmt);
  DeviceQuant d(W, rows, K, fmt);
  const int ldo = (int)pad8(K);
  Buf out((size_t)rows * ldo * 2);
  dequantize_matrix(d.m, out.as<__half>(), ldo, 0);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  return get_half_rows(out.p, rows, K, ldo);
}

std::vector<float> run_gemv_quant(const float* W, int rows, int K, WFormat fmt, const float* x, const float* norm_w,
                                  float eps, const float* y_init, int R, GemvIn in, GemvOut out,
                                  int blocks_per_sm, bool act8) {
  check_quant_shape(K, fmt);
  DeviceQuant d(W, rows, K, fmt);
  const int ld = fmt == WFormat::I8 ? (int)i8_ld(K) : K;  // the staged input width
  GemvIO io(ld, K, rows, x, norm_w, y_init, in, out);
  GemvParams p;
  p.fmt = fmt;
  p.q = static_cast<const uint8_t*>(d.m.q);
  p.scales = d.m.scales;
  p.ldq = d.m.ld;
  p.act8 = act8;
  return io.run(p, K, ld, eps, R, in, blocks_per_sm);
}

std::vector<float> run_gemv_batch(const float* W, int rows, int K, WFormat fmt, const float* X, int n,
                                  const float* norm_w, float eps, const float* Y_init, GemvIn in, GemvOut out,
                                  bool mma, int m_tiles, bool smem_ring, bool one_row, bool act8) {
  if (fmt != WFormat::F16) check_quant_shape(K, fmt);
  if (one_row && !mma) fail(ErrorKind::Request, "gemv_batch: one_row is a tensor-core kernel (mma)");
  if (one_row && act8) fail(ErrorKind::Request, "gemv_batch: act8 is the batched products' rounding, not one_row's");
  if (one_row && m_tiles != 0) fail(ErrorKind::Request, "gemv_batch: one_row takes no m_tiles (one 16-row tile a block)");
  const int ldx = (int)pad8(K), n_out = out == GemvOut::Swiglu ? rows / 2 : rows, ldy = n_out + 3;  // (ldy: odd on purpose)
  std::unique_ptr<DeviceQuant> dq;
  std::unique_ptr<Buf> w16;
  QMat m;
  if (fmt == WFormat::F16) {
    w16 = std::make_unique<Buf>((size_t)rows * ldx * 2);
    std::vector<__half> h((size_t)rows * ldx, __float2half(0.0f));
    for (int r = 0; r < rows; r++)
      for (int k = 0; k < K; k++) h[(size_t)r * ldx + k] = __float2half(W[(size_t)r * K + k]);
    put(w16->p, h.data(), h.size() * 2);
    m.fmt = WFormat::F16;
    m.q = w16->p;
    m.rows = rows;
    m.K = K;
    m.ld = ldx;
  } else {
    dq = std::make_unique<DeviceQuant>(W, rows, K, fmt);
    m = dq->m;
  }
  Buf dx((size_t)n * ldx * 4), dn((size_t)K * 4), dy((size_t)n * ldy * 4);
  if (in == GemvIn::F16) {  // padding columns NaN: the kernel must never read past K
    std::vector<__half> xh((size_t)n * ldx, __float2half(std::numeric_limits<float>::quiet_NaN()));
    for (int j = 0; j < n; j++)
      for (int k = 0; k < K; k++) xh[(size_t)j * ldx + k] = __float2half(X[(size_t)j * K + k]);
    put(dx.p, xh.data(), xh.size() * 2);
  } else {
    std::vector<float> xf((size_t)n * ldx, std::numeric_limits<float>::quiet_NaN());
    for (int j = 0; j < n; j++)
      for (int k = 0; k < K; k++) xf[(size_t)j * ldx + k] = X[(size_t)j * K + k];
    put(dx.p, xf.data(), xf.size() * 4);
    put(dn.p, norm_w, (size_t)K * 4);
  }
  std::vector<float> yf((size_t)n * ldy);
  if (out == GemvOut::AddF32) {
    for (int j = 0; j < n; j++)
      for (int r = 0; r < ldy; r++) yf[(size_t)j * ldy + r] = r < rows ? Y_init[(size_t)j * rows + r] : 0.0f;
    put(dy.p, yf.data(), yf.size() * 4);
  } else {
    TI_CUDA_CHECK(cudaMemset(dy.p, 0xFF, yf.size() * 4));  // NaN in fp32 and fp16: poison
  }
  GemvBatchArgs a;
  a.W = m;
  a.x = dx.p;
  a.ldx = ldx;
  a.norm_w = dn.as<float>();
  a.eps = eps;
  a.y = dy.p;
  a.ldy = ldy;
  a.n = n;
  a.m_tiles = m_tiles;
  a.smem_ring = smem_ring;
  a.act8 = act8 && in == GemvIn::F32Norm && !mma;
  if (act8 && in == GemvIn::F16) act8_round_rows(dx.as<__half>(), ldx, K, n, 0, false);
  Buf xn((size_t)n * ldx * 2);
  if (!mma) {
    gemv_batch(a, in, out, 0);
  } else if (one_row) {
    mma_one_row(a, in, out, 0);  // (F32Norm: a.x the fp32 row, normed in the kernel; n must be 1)
  } else {
    if (in == GemvIn::F32Norm) {  // padding columns NaN, as the F16 input's
      TI_CUDA_CHECK(cudaMemset(xn.p, 0xFF, (size_t)n * ldx * 2));
      rmsnorm_rows(dx.as<float>(), ldx, dn.as<float>(), eps, K, n, xn.as<__half>(), ldx, 0, false, nullptr, true, act8);
      a.x = xn.p;
    }
    mma_small_n(a, out, 0);
  }
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> res((size_t)n * n_out);
  if (out == GemvOut::Swiglu) {
    res = get_half_rows(dy.p, n, n_out, ldy);
  } else {
    get(yf.data(), dy.p, yf.size() * 4);
    for (int j = 0; j < n; j++)
      for (int i = 0; i < n_out; i++) res[(size_t)j * n_out + i] = yf[(size_t)j * ldy + i];
  }
  return res;
}

std::vector<float> run_act8_round_rows(const float* X, int T, int K) {
  const int ldx = (int)pad8(K) + 8;  // (a stride past the row: the kernel must leave it alone)
  std::vector<__half> xh((size_t)T * ldx, __float2half(7.0f));
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) xh[(size_t)t * ldx + k] = __float2half(X[(size_t)t * K + k]);
  Buf dx(xh.size() * 2);
  put(dx.p, xh.data(), xh.size() * 2);
  act8_round_rows(dx.as<__half>(), ldx, K, T, 0, false);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> all = get_half_rows(dx.p, T, ldx, ldx), out((size_t)T * K);
  for (int t = 0; t < T; t++) {
    for (int k = K; k < ldx; k++)
      if (all[(size_t)t * ldx + k] != 7.0f) fail(ErrorKind::Device, "act8_round_rows wrote past K");
    for (int k = 0; k < K; k++) out[(size_t)t * K + k] = all[(size_t)t * ldx + k];
  }
  return out;
}

std::vector<float> run_rmsnorm_rows(const float* X, int T, int H, const float* w, float eps, bool in_registers,
                                    bool act8) {
  const int ldx = (H + 4 + 3) / 4 * 4, ldy = (H + 8 + 3) / 4 * 4;
  std::vector<float> xf((size_t)T * ldx, std::numeric_limits<float>::quiet_NaN());  // padding never read
  for (int t = 0; t < T; t++)
    for (int i = 0; i < H; i++) xf[(size_t)t * ldx + i] = X[(size_t)t * H + i];
  Buf dx(xf.size() * 4), dw((size_t)H * 4), dy((size_t)T * ldy * 2);
  put(dx.p, xf.data(), xf.size() * 4);
  put(dw.p, w, (size_t)H * 4);
  TI_CUDA_CHECK(cudaMemset(dy.p, 0xFF, (size_t)T * ldy * 2));
  rmsnorm_rows(dx.as<float>(), ldx, dw.as<float>(), eps, H, T, dy.as<__half>(), ldy, 0, false, nullptr, in_registers,
               act8);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  return get_half_rows(dy.p, T, H, ldy);
}

int device_sm_count() { return sm_count(); }

}  // namespace ti::cuda
