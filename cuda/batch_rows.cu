// batch_rows.cu — per-slot row work of the batched decode path (see batch_rows.cuh).
#include "act8.cuh"
#include "batch_rows.cuh"
#include "common.cuh"
#include "rms_row.cuh"

namespace ti::cuda {

__global__ void mark_tokens_kernel(unsigned char* seen, const int* tokens, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) seen[tokens[i]] = 1;
}

void mark_tokens(unsigned char* seen, const int* tokens, int n, cudaStream_t s) {
  if (n < 1) return;
  launch(mark_tokens_kernel, dim3((n + 255) / 256), dim3(256), 0, s, false, seen, tokens, n);
}

__global__ void count_tokens_kernel(unsigned char* seen, int* counts, const int* tokens, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    seen[tokens[i]] = 1;
    atomicAdd(counts + tokens[i], 1);
  }
}

void count_tokens(unsigned char* seen, int* counts, const int* tokens, int n, cudaStream_t s) {
  if (n < 1) return;
  launch(count_tokens_kernel, dim3((n + 255) / 256), dim3(256), 0, s, false, seen, counts, tokens, n);
}

constexpr int kMaxSlices = 8;

// 256 threads a row, V float4 each (H <= 1,024 V). After the PDL wait one round trip: x and every slice's part are
// requested together. The norm is rms_row.cuh's, as rmsnorm_rows' register kernel: that kernel's bits on the same x.
template <int V>
__global__ void __launch_bounds__(256) residual_norm_rows_kernel(const float* parts, int slices, int64_t slice_stride,
                                                                 int ldp, float* x, int ldx, const float* w, float eps,
                                                                 int H, __half* y, int ldy) {
  __shared__ float red[33];
  float4 g[V], v[V];
  rms_row_weights<V>(w, H, g);
  pdl_wait();
  pdl_launch_dependents();
  const int r = blockIdx.x;
  float* xr = x + (size_t)r * ldx;
#pragma unroll
  for (int j = 0; j < V; j++) {
    const int i = (threadIdx.x + j * 256) * 4;
    if (i >= H) continue;
    float4 q[kMaxSlices];  // every slice requested before the first add
#pragma unroll
    for (int s = 0; s < kMaxSlices; s++)
      if (s < slices) q[s] = *reinterpret_cast<const float4*>(parts + s * slice_stride + (size_t)r * ldp + i);
    float4 p = q[0];
#pragma unroll
    for (int s = 1; s < kMaxSlices; s++)
      if (s < slices) p.x += q[s].x, p.y += q[s].y, p.z += q[s].z, p.w += q[s].w;
    const float4 o = *reinterpret_cast<const float4*>(xr + i);
    v[j] = make_float4(o.x + p.x, o.y + p.y, o.z + p.z, o.w + p.w);
    *reinterpret_cast<float4*>(xr + i) = v[j];
  }
  rms_row_write<V>(v, g, H, eps, red, y + (size_t)r * ldy);
}

bool residual_norm_rows_fits(int H, int slices, int64_t slice_stride, int ldp, int ldx, int ldy) {
  return slices >= 1 && slices <= kMaxSlices && H >= 4 && H % 4 == 0 && H <= 8192 && slice_stride % 4 == 0 && ldp % 4 == 0 &&
         ldx % 4 == 0 && ldy % 4 == 0;
}

void residual_norm_rows(const float* parts, int slices, int64_t slice_stride, int ldp, float* x, int ldx,
                        const float* w, float eps, int H, int T, __half* y, int ldy, cudaStream_t s, bool pdl) {
  if (T < 1 || !residual_norm_rows_fits(H, slices, slice_stride, ldp, ldx, ldy) || ldp < H || ldx < H || ldy < H ||
      (slices > 1 && slice_stride < (int64_t)T * ldp))
    fail(ErrorKind::Request, "residual_norm_rows: bad shape H=" + std::to_string(H) + " slices=" +
                                 std::to_string(slices) + " T=" + std::to_string(T));
  const int V = (H + 1023) / 1024;
  auto go = [&](auto kernel) { launch(kernel, dim3(T), dim3(256), 0, s, pdl, parts, slices, slice_stride, ldp, x, ldx, w, eps, H, y, ldy); };
  if (V <= 1) return go(residual_norm_rows_kernel<1>);
  if (V <= 2) return go(residual_norm_rows_kernel<2>);
  if (V <= 4) return go(residual_norm_rows_kernel<4>);
  go(residual_norm_rows_kernel<8>);
}

// A thread per 8 values (one 16-byte word), 4 lanes a group; grid (words / 256 rounded up, T). The trip is one
// word a thread, so a warp's lanes past the row's last word still join the group's shuffles (whole groups: K % 32).
__global__ void __launch_bounds__(256) act8_round_rows_kernel(__half* x, int ldx, int K) {
  pdl_wait();
  pdl_launch_dependents();
  const int i = blockIdx.x * 256 + threadIdx.x;  // the word
  const bool in = i < K / 8;
  uint4* row = reinterpret_cast<uint4*>(x + (size_t)blockIdx.y * ldx);
  float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (in) unpack8(row[i], f);
  act8_round<4>(f);
  if (in) row[i] = pack8(f);
}

void act8_round_rows(__half* x, int ldx, int K, int T, cudaStream_t s, bool pdl) {
  if (K % kAct8Group != 0 || ldx % 8 != 0 || ldx < K || T < 0)
    fail(ErrorKind::Request, "act8_round_rows: needs K % 32 == 0 and ldx >= K, a multiple of 8 (K=" +
                                 std::to_string(K) + " ldx=" + std::to_string(ldx) + ")");
  if (T == 0 || K == 0) return;
  launch(act8_round_rows_kernel, dim3((K / 8 + 255) / 256, T), dim3(256), 0, s, pdl, x, ldx, K);
}

}  // namespace ti::cuda
