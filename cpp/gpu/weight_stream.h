// weight_stream.h — WeightStream: the GPU engine's load, file to device once (docs/ARCHITECTURE.md).
//
// The caller hands tensors over one at a time in their stored form, usually views over the memory-mapped file:
// float rows (fp32 / fp16 / bf16, a whole tensor or a range of its rows) or rows already in one of the engine's
// quantized layouts (GGUF Q4_0 / Q4_1 converted block for block). Each call copies its bytes through a small
// ring of pinned staging buffers (the host copy of chunk i+1 overlaps the DMA and conversion of chunk i) into a
// device chunk buffer, from which a kernel (cuda/convert.cu) writes the rows where they belong: into the fused
// fp16 matrix (q | k | v; gate / up interleaved), or, for a quantized format, into an fp16 staging matrix that
// is quantized on the device once all its parts have arrived. Imported quantized rows go to their rows of the
// destination as they are. No whole-model host copy exists at any time; host memory beyond the mapped file is
// the ring (kSlots x kChunkBytes pinned) and the caller's current tensor.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "../../cuda/convert.cuh"
#include "device_weights.h"

namespace ti {

class WeightStream {
 public:
  WeightStream(DeviceWeights& w, const ModelConfig& c, cudaStream_t stream);
  ~WeightStream();  // frees the ring and any staging matrix still pending (a load that failed half way)
  WeightStream(const WeightStream&) = delete;
  WeightStream& operator=(const WeightStream&) = delete;

  // Rows row0 .. row0 + n - 1 of tensor `name` (HuggingFace name), whose full shape is (total_rows, K) (norms:
  // (K), row0 = 0, n = total_rows = 1), as n * K contiguous elements of type t at `data`. rope_heads > 0: a
  // GGUF attn_q / attn_k with llama.cpp's row permutation, undone here. `data` may be freed on return.
  void load_rows(const std::string& name, DType t, const void* data, int64_t row0, int64_t n, int64_t total_rows,
                 int64_t K, int rope_heads);
  // A whole matrix already in the layout of format f (cpp/core/quant.h): q (rows, q_row_bytes) and scales
  // (rows, scale_row_bytes), taken as they are. f must be the destination matrix's format.
  void load_quantized(const std::string& name, WFormat f, const uint8_t* q, int64_t q_row_bytes,
                      const uint8_t* scales, int64_t scale_row_bytes, int64_t rows, int64_t K, int rope_heads);
  // A whole GGUF Q4_0 / Q4_1 matrix as stored (rows of K / 32 blocks), converted to int4 on the device block for
  // block (cuda/convert.cuh q4_blocks_to_i4); the destination matrix must be int4.
  void load_q4_blocks(const std::string& name, bool q4_1, const uint8_t* blocks, int64_t row_bytes, int64_t rows,
                      int64_t K, int rope_heads);
  // Throws naming the first tensor that did not arrive (or arrived in part); waits for the device.
  void finish();
  size_t bytes_in() const { return bytes_in_; }  // host bytes taken so far

  // Bytes per row of the scales of a (rows, K) matrix in a quantized format (the layouts of cpp/core/quant.h).
  static int64_t scale_row_bytes(WFormat f, int64_t K);

 private:
  // One destination matrix and what has arrived of it.
  struct Matrix {
    cuda::QMat m;
    int parts = 0, parts_done = 0;
    bool any_imported = false;
    __half* stage = nullptr;  // quantized formats: fp16 rows (stride pad8(K)) of the float parts, until quantized
    std::vector<cuda::RowMap> float_parts;  // the parts whose rows came as floats (to be quantized)
  };
  // One tensor name the model needs.
  struct Target {
    enum Kind { MatrixPart, Vector, Embedding } kind;
    int matrix = -1;  // MatrixPart: index into matrices_
    cuda::RowMap map;
    int64_t rows = 0, K = 0;  // Vector: rows = 1
    float* vec = nullptr;
    int64_t rows_done = 0;
    bool imported = false;
  };

  void add_matrix(const cuda::QMat& m, const std::vector<std::pair<std::string, cuda::RowMap>>& parts);
  Target& target(const std::string& name, int64_t total_rows, int64_t K);
  Matrix& import_target(Target& t, const std::string& name, WFormat f, int rope_heads);
  template <typename Launch>
  void stream_bytes(const uint8_t* src, int64_t n_rows, int64_t row_bytes, const Launch& launch);
  void part_done(Target& t);
  void release() noexcept;
  void finalize(Matrix& M);

  DeviceWeights& w_;
  ModelConfig cfg_;
  cudaStream_t stream_;
  std::unordered_map<std::string, Target> targets_;
  std::vector<std::string> order_;  // the required names in a fixed order (the error names the first missing)
  std::vector<Matrix> matrices_;
  static constexpr int kSlots = 3;
  static constexpr size_t kChunkBytes = 16u << 20;
  uint8_t* pinned_[kSlots] = {};
  uint8_t* device_[kSlots] = {};
  cudaEvent_t done_[kSlots] = {};
  int next_slot_ = 0;
  size_t bytes_in_ = 0;
};

}  // namespace ti
