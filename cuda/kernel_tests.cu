#include <cmath>
#include <limits>

#include "attention.cuh"
#include "common.cuh"
#include "kernel_tests.cuh"
#include "sampling.cuh"

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

}  // namespace

std::vector<float> run_gemv(const uint16_t* W, int rows, int K, const float* x, const float* norm_w, float eps,
                            const float* y_init, int R, GemvIn in, GemvOut out) {
  const int ld = (int)pad8(K);
  std::vector<uint16_t> wp((size_t)rows * ld, 0);
  for (int r = 0; r < rows; r++)
    for (int k = 0; k < K; k++) wp[(size_t)r * ld + k] = W[(size_t)r * K + k];
  Buf dW(wp.size() * 2), dx((size_t)ld * 4), dn((size_t)K * 4), dy((size_t)rows * 4);
  put(dW.p, wp.data(), wp.size() * 2);
  if (in == GemvIn::F16) {
    std::vector<__half> xh(K);
    for (int k = 0; k < K; k++) xh[k] = __float2half(x[k]);
    put(dx.p, xh.data(), (size_t)K * 2);
  } else {
    put(dx.p, x, (size_t)K * 4);
    put(dn.p, norm_w, (size_t)K * 4);
  }
  const int n_out = out == GemvOut::Swiglu ? rows / 2 : rows;
  if (out == GemvOut::AddF32) {
    put(dy.p, y_init, (size_t)rows * 4);
  } else {
    TI_CUDA_CHECK(cudaMemset(dy.p, 0xFF, (size_t)rows * 4));  // NaN in fp32 and fp16: poison
  }
  GemvParams p;
  p.W = dW.as<__half>();
  p.rows = rows;
  p.K = K;
  p.ld = ld;
  p.x = dx.p;
  p.norm_w = dn.as<float>();
  p.eps = eps;
  p.y = dy.p;
  gemv(p, R, in, out, 0, false);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
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

std::vector<float> run_decode_attention(const float* qkv, uint16_t* k_cache, uint16_t* v_cache, const float* cos,
                                        const float* sin, int pos, int n_heads, int n_kv_heads, int head_dim,
                                        int max_seq, int chunk) {
  const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
  const size_t cache = (size_t)n_kv_heads * max_seq * head_dim, table = (size_t)max_seq * head_dim / 2;
  const int max_chunks = (max_seq + chunk - 1) / chunk;
  Buf dqkv((size_t)(q_dim + 2 * kv_dim) * 4), dk(cache * 2), dv(cache * 2), dc(table * 4), ds(table * 4),
      dpos(4), dpo((size_t)n_heads * max_chunks * head_dim * 4), dpml((size_t)n_heads * max_chunks * 2 * 4),
      dout((size_t)q_dim * 2);
  put(dqkv.p, qkv, (size_t)(q_dim + 2 * kv_dim) * 4);
  put(dk.p, k_cache, cache * 2);
  put(dv.p, v_cache, cache * 2);
  put(dc.p, cos, table * 4);
  put(ds.p, sin, table * 4);
  put(dpos.p, &pos, 4);
  TI_CUDA_CHECK(cudaMemset(dpo.p, 0xFF, (size_t)n_heads * max_chunks * head_dim * 4));
  TI_CUDA_CHECK(cudaMemset(dpml.p, 0xFF, (size_t)n_heads * max_chunks * 2 * 4));
  TI_CUDA_CHECK(cudaMemset(dout.p, 0xFF, (size_t)q_dim * 2));
  DecodeAttnParams a;
  a.qkv = dqkv.as<float>();
  a.k_cache = dk.as<__half>();
  a.v_cache = dv.as<__half>();
  a.rope_cos = dc.as<float>();
  a.rope_sin = ds.as<float>();
  a.pos = dpos.as<int>();
  a.part_o = dpo.as<float>();
  a.part_ml = dpml.as<float>();
  a.out = dout.as<__half>();
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.head_dim = head_dim;
  a.max_seq = max_seq;
  a.chunk = chunk;
  a.scale = 1.0f / std::sqrt((float)head_dim);
  decode_attention(a, 0, false);
  // Twice, the output poisoned in between: a second call must work from the state the first one left
  // (the second call rewrites the same rope(k), v at pos).
  TI_CUDA_CHECK(cudaMemset(dout.p, 0xFF, (size_t)q_dim * 2));
  decode_attention(a, 0, false);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<__half> oh((size_t)q_dim);
  get(oh.data(), dout.p, (size_t)q_dim * 2);
  get(k_cache, dk.p, cache * 2);
  get(v_cache, dv.p, cache * 2);
  std::vector<float> o((size_t)q_dim);
  for (int i = 0; i < q_dim; i++) o[i] = __half2float(oh[i]);
  return o;
}

int run_sample(const float* logits, int vocab, float temperature, int top_k, float top_p, float min_p,
               float repetition_penalty, unsigned long long seed, int step, const unsigned char* seen) {
  Buf dl((size_t)vocab * 4), dsp(sizeof(DeviceSampling)), dseen((size_t)vocab), dp((size_t)vocab * 4),
      dst(sizeof(DecodeState)), dout(4);
  put(dl.p, logits, (size_t)vocab * 4);
  DeviceSampling sp{temperature, top_k, top_p, min_p, repetition_penalty, seed};
  put(dsp.p, &sp, sizeof(sp));
  put(dseen.p, seen, (size_t)vocab);
  DecodeState st{0, 0, step, step};
  put(dst.p, &st, sizeof(st));
  sample_token(dl.as<float>(), vocab, dsp.as<DeviceSampling>(), dseen.as<unsigned char>(), dp.as<float>(),
               dst.as<DecodeState>(), dout.as<int>(), 0, false);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  int tok = -1;
  get(&tok, dout.p, 4);
  return tok;
}

}  // namespace ti::cuda
