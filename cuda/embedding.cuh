// embedding.cuh — token embedding lookup and random weight fill (see embedding.cu).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "sampling.cuh"

namespace ti::cuda {

// x[0..H) = float(E[st->token, 0..H)); E is (vocab, ld) fp16.
void embed_token(const __half* E, int ld, int H, const DecodeState* st, float* x, cudaStream_t stream, bool pdl);

// p[i] = uniform(-scale, scale) from (seed, i): random weights at real shapes for benchmarks.
void fill_random_f16(__half* p, size_t n, uint64_t seed, float scale, cudaStream_t stream);
void fill_f32(float* p, size_t n, float value, cudaStream_t stream);

}  // namespace ti::cuda
