// attention.cu — decode attention: one new token attends to positions 0..pos of the KV cache.
//
// Split-K flash-decoding. Kernel 1 (decode_attn_chunk): grid (max_chunks, n_kv_heads, ceil(group / 8)); a block
// owns one KV head and one chunk of `chunk` positions and serves up to 8 query heads of its group, so each key
// and value is read from memory once per group, not once per query head. Blocks whose chunk starts past pos
// exit at once: the grid is sized for max_seq, so one captured graph serves every position.
//   - RoPE is fused here: each block rotates its query heads (and pre-scales them by 1/sqrt(d)); the block
//     whose chunk holds `pos` also rotates the new key and writes key and value into the cache (fp16), then
//     attends to them like any other position.
//   - Inside a block, lanes are grouped LPK per key (LPK = 8, 16 or 32 lanes: 8 fp16 dims each, head_dim up to
//     256); each group is an independent online-softmax stream over positions c0 + s, c0 + s + n_streams, ...,
//     two positions per step in flight; at the end the streams are merged through shared memory.
//   - Output: the chunk's unnormalised o and its (max, sum) per query head.
// Kernel 2 (decode_attn_merge): one block per query head combines the chunks 0..pos/chunk (log-sum-exp) and
// writes the fp16 output the O projection reads.
#include <cfloat>

#include "attention.cuh"
#include "common.cuh"

namespace ti::cuda {

constexpr int kAttnThreads = 128, kMaxGroup = 8;

template <int LPK>
__global__ void __launch_bounds__(kAttnThreads) decode_attn_chunk(DecodeAttnParams p) {
  constexpr int kStreams = kAttnThreads / LPK;
  extern __shared__ __align__(16) float smem[];
  const int hd = p.head_dim, half_d = hd / 2;
  float* q_s = smem;                          // (kMaxGroup, hd)
  float* st_o = q_s + kMaxGroup * hd;         // (kStreams, kMaxGroup, hd)
  float* st_m = st_o + kStreams * kMaxGroup * hd;  // (kStreams, kMaxGroup)
  float* st_l = st_m + kStreams * kMaxGroup;       // (kStreams, kMaxGroup)

  pdl_wait();
  pdl_launch_dependents();
  const int pos = *p.pos, len = pos + 1;
  const int c0 = blockIdx.x * p.chunk;
  if (c0 >= len) return;
  const int c1 = min(c0 + p.chunk, len);
  const int kvh = blockIdx.y, group = p.n_heads / p.n_kv_heads;
  const int hq0 = kvh * group + blockIdx.z * kMaxGroup;
  const int g = min(kMaxGroup, group - (int)blockIdx.z * kMaxGroup);
  const int q_dim = p.n_heads * hd, kv_dim = p.n_kv_heads * hd;
  const float* cs = p.rope_cos + (size_t)pos * half_d;
  const float* sn = p.rope_sin + (size_t)pos * half_d;

  // ---- rotate (and scale) the query heads; the owner of `pos` writes the new key / value ----
  for (int t = threadIdx.x; t < g * half_d; t += kAttnThreads) {
    const int h = t / half_d, i = t % half_d;
    const float* q = p.qkv + (size_t)(hq0 + h) * hd;
    const float x1 = q[i], x2 = q[i + half_d];
    q_s[h * hd + i] = (x1 * cs[i] - x2 * sn[i]) * p.scale;
    q_s[h * hd + i + half_d] = (x2 * cs[i] + x1 * sn[i]) * p.scale;
  }
  __half* kc = p.k_cache + (size_t)kvh * p.max_seq * hd;
  __half* vc = p.v_cache + (size_t)kvh * p.max_seq * hd;
  if (pos < c1 && pos >= c0) {  // every z-slice of this chunk writes the same values: harmless, keeps it simple
    const float* k = p.qkv + q_dim + (size_t)kvh * hd;
    const float* v = p.qkv + q_dim + kv_dim + (size_t)kvh * hd;
    for (int i = threadIdx.x; i < half_d; i += kAttnThreads) {
      const float x1 = k[i], x2 = k[i + half_d];
      kc[(size_t)pos * hd + i] = __float2half(x1 * cs[i] - x2 * sn[i]);
      kc[(size_t)pos * hd + i + half_d] = __float2half(x2 * cs[i] + x1 * sn[i]);
    }
    for (int i = threadIdx.x; i < hd; i += kAttnThreads) vc[(size_t)pos * hd + i] = __float2half(v[i]);
  }
  __syncthreads();

  // ---- online softmax streams ----
  const int stream = threadIdx.x / LPK, j = threadIdx.x % LPK;  // lane j owns dims 8j..8j+7
  const bool active = j * 8 < hd;
  float m[kMaxGroup], l[kMaxGroup], o[kMaxGroup][8], qf[kMaxGroup][8];
#pragma unroll
  for (int h = 0; h < kMaxGroup; h++) {
    m[h] = -FLT_MAX;
    l[h] = 0.0f;
#pragma unroll
    for (int d = 0; d < 8; d++) {
      o[h][d] = 0.0f;
      qf[h][d] = (active && h < g) ? q_s[h * hd + j * 8 + d] : 0.0f;
    }
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // The loop runs warp-uniformly (the shuffles need every lane); a stream past the chunk's end only skips updates.
  for (int base = c0; base < c1; base += 2 * kStreams) {
    const int t1 = base + stream, t2 = t1 + kStreams;
    const bool ok1 = t1 < c1, ok2 = t2 < c1;
    const uint4 k1 = (active && ok1) ? *reinterpret_cast<const uint4*>(kc + (size_t)t1 * hd + j * 8) : zero;
    const uint4 v1 = (active && ok1) ? *reinterpret_cast<const uint4*>(vc + (size_t)t1 * hd + j * 8) : zero;
    const uint4 k2 = (active && ok2) ? *reinterpret_cast<const uint4*>(kc + (size_t)t2 * hd + j * 8) : zero;
    const uint4 v2 = (active && ok2) ? *reinterpret_cast<const uint4*>(vc + (size_t)t2 * hd + j * 8) : zero;
#pragma unroll
    for (int step = 0; step < 2; step++) {
      const bool ok = step ? ok2 : ok1;
      float kf[8], vf[8];
      unpack8(step ? k2 : k1, kf);
      unpack8(step ? v2 : v1, vf);
#pragma unroll
      for (int h = 0; h < kMaxGroup; h++) {
        if (h >= g) break;  // g is uniform across the block
        float s = 0.0f;
#pragma unroll
        for (int d = 0; d < 8; d++) s = fmaf(qf[h][d], kf[d], s);
#pragma unroll
        for (int off = LPK / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (!ok) continue;
        const float m_new = fmaxf(m[h], s);
        const float corr = __expf(m[h] - m_new), e = __expf(s - m_new);
        l[h] = l[h] * corr + e;
#pragma unroll
        for (int d = 0; d < 8; d++) o[h][d] = fmaf(o[h][d], corr, e * vf[d]);
        m[h] = m_new;
      }
    }
  }

  // ---- merge the streams of this block, write the chunk's partial result ----
  for (int h = 0; h < g; h++) {
    if (active)
#pragma unroll
      for (int d = 0; d < 8; d++) st_o[(stream * kMaxGroup + h) * hd + j * 8 + d] = o[h][d];
    if (j == 0) {
      st_m[stream * kMaxGroup + h] = m[h];
      st_l[stream * kMaxGroup + h] = l[h];
    }
  }
  __syncthreads();
  const int max_chunks = (p.max_seq + p.chunk - 1) / p.chunk;
  for (int t = threadIdx.x; t < g * hd; t += kAttnThreads) {
    const int h = t / hd, d = t % hd;
    float M = -FLT_MAX;
    for (int s = 0; s < kStreams; s++) M = fmaxf(M, st_m[s * kMaxGroup + h]);
    float L = 0.0f, O = 0.0f;
    for (int s = 0; s < kStreams; s++) {
      const float w = st_l[s * kMaxGroup + h] > 0.0f ? __expf(st_m[s * kMaxGroup + h] - M) : 0.0f;
      L += st_l[s * kMaxGroup + h] * w;
      O += st_o[(s * kMaxGroup + h) * hd + d] * w;
    }
    const size_t slot = (size_t)(hq0 + h) * max_chunks + blockIdx.x;
    p.part_o[slot * hd + d] = O;
    if (d == 0) {
      p.part_ml[slot * 2] = M;
      p.part_ml[slot * 2 + 1] = L;
    }
  }
}

__global__ void decode_attn_merge(DecodeAttnParams p) {
  pdl_wait();
  pdl_launch_dependents();
  const int h = blockIdx.x, hd = p.head_dim;
  const int n = *p.pos / p.chunk + 1;  // chunks holding positions 0..pos
  const int max_chunks = (p.max_seq + p.chunk - 1) / p.chunk;
  const float* ml = p.part_ml + (size_t)h * max_chunks * 2;
  float M = -FLT_MAX;
  for (int c = 0; c < n; c++) M = fmaxf(M, ml[2 * c]);
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float L = 0.0f, O = 0.0f;
    for (int c = 0; c < n; c++) {
      const float w = __expf(ml[2 * c] - M);
      L += ml[2 * c + 1] * w;
      O += p.part_o[((size_t)h * max_chunks + c) * hd + d] * w;
    }
    p.out[(size_t)h * hd + d] = __float2half(O / L);
  }
}

template <int LPK>
static void launch_chunk(const DecodeAttnParams& p, cudaStream_t s, bool pdl) {
  constexpr int kStreams = kAttnThreads / LPK;
  const size_t smem = sizeof(float) * ((size_t)kMaxGroup * p.head_dim * (1 + kStreams) + 2 * kStreams * kMaxGroup);
  static bool raised = false;  // a property of the CUDA function (process-wide), set once
  if (smem > 48 * 1024 && !raised) {
    TI_CUDA_CHECK(cudaFuncSetAttribute(decode_attn_chunk<LPK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       100 * 1024));
    raised = true;
  }
  const int group = p.n_heads / p.n_kv_heads;
  dim3 grid(attn_max_chunks(p), p.n_kv_heads, (group + kMaxGroup - 1) / kMaxGroup);
  launch(decode_attn_chunk<LPK>, grid, dim3(kAttnThreads), smem, s, pdl, p);
}

void decode_attention(const DecodeAttnParams& p, cudaStream_t s, bool pdl) {
  if (p.head_dim % 8 != 0 || p.head_dim > 256 || p.head_dim < 16 || p.n_heads % p.n_kv_heads != 0)
    fail(ErrorKind::Request, "decode_attention: unsupported head_dim " + std::to_string(p.head_dim));
  const int words = p.head_dim / 8;  // 16-byte words per key
  if (words <= 8) launch_chunk<8>(p, s, pdl);
  else if (words <= 16) launch_chunk<16>(p, s, pdl);
  else launch_chunk<32>(p, s, pdl);
  launch(decode_attn_merge, dim3(p.n_heads), dim3(p.head_dim <= 128 ? 128 : 256), 0, s, pdl, p);
}

}  // namespace ti::cuda
