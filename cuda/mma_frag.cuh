// mma_frag.cuh — the tensor-core pieces both attention kernels on mma.sync share (prefill_attention.cu, and
// attention.cu's chunk tile): the m16n8k16 product, ldmatrix loads of 8x8 fp16 tiles, fp16 packing, exp2.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

namespace ti::cuda {

// D += A (16x16, row) * B (16x8, col); fp16 inputs, fp32 accumulators. Fragment layouts: PTX ISA, "Matrix
// fragments for mma.m16n8k16": with g = lane / 4, c = lane % 4: a0 = A[g][2c..2c+1], a1 = A[g+8][2c..],
// a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]; b0 = B[2c..2c+1][g], b1 = B[2c+8..][g]; d0,d1 = D[g][2c..2c+1],
// d2,d3 = D[g+8][2c..2c+1].
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else  // sm_75: the k16 step as two k8 steps (same fragment layout, halves of it)
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(b0));
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}

// Four 8x8 fp16 matrices from shared memory, transposed: lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const __half* p) {
  const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const __half* p) {
  const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 2^x, one MUFU instruction (the softmax's inputs are <= 0 after the max is subtracted; -inf gives 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t lds32(const __half* p) { return *reinterpret_cast<const uint32_t*>(p); }

}  // namespace ti::cuda
