// device_weights.h — the model's weights on the GPU: allocation, random weights for benchmarks, fp16 views of
// quantized matrices; and DeviceArena, the engine's device memory. The load (file -> device) is weight_stream.h.
//
// Layout (docs/ARCHITECTURE.md): every matrix row-major [out, in] in the engine's format (cuda::QMat: fp16 rows padded
// to 8 halves, or the I8 / I4 layouts of cpp/core/quant.h with their scales); q | k | v fused into one matrix,
// gate | up fused with rows interleaved (gate_0, up_0, gate_1, ...) so that one GEMV's epilogue sees both.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../../cuda/quant.cuh"
#include "../core/config.h"
#include "../core/weights.h"

namespace ti {

// Every device allocation of one engine, freed together (release, or the destructor), with the bytes counted
// by kind for the engine's report and for the out-of-memory message.
class DeviceArena {
 public:
  enum class Kind { Weights, KvCache, Scratch };
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() { release(); }
  // Throws ti::Error(Device) saying how much was asked for and how much is free.
  void* alloc(size_t bytes, Kind kind);
  template <typename T>
  T* alloc_n(size_t n, Kind kind) { return static_cast<T*>(alloc(n * sizeof(T), kind)); }
  void* alloc_pinned(size_t bytes);      // page-locked host memory (staging for asynchronous copies)
  template <typename T>
  T* alloc_pinned_n(size_t n) { return static_cast<T*>(alloc_pinned(n * sizeof(T))); }
  void count(Kind kind, size_t bytes);  // memory taken elsewhere (a library's workspace)
  void release();
  size_t weight_bytes() const { return weight_bytes_; }
  size_t kv_bytes() const { return kv_bytes_; }
  size_t scratch_bytes() const { return scratch_bytes_; }

 private:
  std::vector<void*> blocks_, pinned_;
  size_t weight_bytes_ = 0, kv_bytes_ = 0, scratch_bytes_ = 0;
};

// One layer's weights on the device.
struct DeviceLayer {
  cuda::QMat qkv;      // (q_dim + 2 kv_dim, hidden): q | k | v rows
  cuda::QMat o;        // (hidden, q_dim)
  cuda::QMat gate_up;  // (2 intermediate, hidden): rows interleaved gate_0, up_0, gate_1, ...
  cuda::QMat down;     // (hidden, intermediate)
  float* attn_norm = nullptr;  // (hidden)
  float* mlp_norm = nullptr;   // (hidden)
};

class DeviceWeights {
 public:
  // Allocates every matrix in `format` (int4: refused before any allocation unless the widths allow it).
  DeviceWeights(const ModelConfig& c, WFormat format, DeviceArena& arena, cudaStream_t stream);
  void randomize(uint64_t seed);      // random values at the real shapes (benchmarks: speed ignores values)
  // The matrix as fp16 rows (stride pad8(K)): itself, or (quantized) dequantized into one shared staging buffer,
  // valid until the next call.
  const __half* fp16_of(const cuda::QMat& m);

  WFormat format;
  int ld_h = 0, ld_q = 0, ld_i = 0;  // padded widths: hidden, q_dim, intermediate
  std::vector<DeviceLayer> layers;
  __half* embedding = nullptr;       // (vocab, ld_h) fp16 whatever the format (a token reads one row)
  cuda::QMat lm_head;                // (vocab, hidden) in head_format(format); fp16 and tied: the embedding itself
  float* final_norm = nullptr;       // (hidden)

 private:
  cuda::QMat alloc_matrix(int rows, int K, WFormat fmt);
  void random_matrix(const cuda::QMat& m, uint64_t seed, float scale);

  ModelConfig cfg_;
  DeviceArena& arena_;
  cudaStream_t stream_;
  __half* staging_ = nullptr;  // quantized formats: fp16 rows of the largest matrix (random weights, prefill GEMMs)
};

}  // namespace ti
