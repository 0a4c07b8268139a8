// convert.cuh — the load's device-side conversions: rows of a source tensor (fp32 / fp16 / bf16, or raw bytes
// of an already-quantized row) written to their rows of a destination matrix (see convert.cu).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../cpp/core/weights.h"

namespace ti::cuda {

// Where source row i of a tensor lands in its (fused) destination matrix: offset + step * perm(i). perm is the
// identity unless rope_heads > 0: then the tensor is a GGUF attn_q / attn_k whose rows llama.cpp permuted per
// head (pairs (j, j + d/2) interleaved), and perm undoes it (the same map as loaders/gguf.py reverse_rope_permute).
struct RowMap {
  int64_t offset = 0, step = 1;
  int rope_heads = 0;
  int64_t rows = 0;  // the tensor's rows (rope_heads > 0: n_heads * head_dim)
};

// n rows (K elements each, contiguous) of a `src_type` tensor, the tensor's rows row0 .. row0 + n - 1, into
// fp16 rows of dst (stride ld >= K halves; columns K .. ld - 1 zeroed), at row offset + step * perm(row0 + i).
// fp32 rounds to nearest even, as the host's float_to_half.
void convert_rows(const void* src, DType src_type, int64_t n, int K, int64_t row0, __half* dst, int ld,
                  const RowMap& map, cudaStream_t stream);
// n rows of row_bytes bytes each (rows row0 .. of the tensor) into dst rows of the same size, placed as above.
void scatter_rows(const uint8_t* src, int64_t n, int row_bytes, int64_t row0, uint8_t* dst, const RowMap& map,
                  cudaStream_t stream);

// GGUF Q4_0 / Q4_1 blocks -> our int4 layout, block for block (cpp/core/quant.h; the host twin is
// loaders/gguf.py q4_blocks_to_int4): n rows of K / 32 blocks (18 bytes: fp16 d, 16 bytes of nibbles; Q4_1: 20
// bytes, fp16 d and m first), rows row0 .. of the tensor, into their mapped rows of q (K / 2 bytes per row) and
// sm (K / 32 (scale, min) pairs per row). Q4_0's w = d (q - 8) is ours with (d, -8 d): exact unless -8 d
// overflows fp16, which the caller rules out.
void q4_blocks_to_i4(const uint8_t* blocks, bool q4_1, int64_t n, int K, int64_t row0, uint8_t* q, __half2* sm,
                     const RowMap& map, cudaStream_t stream);

}  // namespace ti::cuda
