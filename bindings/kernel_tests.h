// kernel_tests.h — host-side drivers that run one kernel on host arrays (upload, launch, download), for the
// kernel tests and benchmarks in Python (tinyinfer._core.ops). Outputs are poisoned (NaN) before each launch so
// an element the kernel failed to write shows.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "../cuda/gemm.cuh"
#include "../cuda/gemv.cuh"
#include "../cuda/quant.cuh"
#include "../cuda/sampling.cuh"

namespace ti::cuda {

// W: (rows, K) fp16 bits; x: float[K] (rounded to fp16 for GemvIn::F16); y_init: float[rows] for AddF32.
// Returns y: rows floats (Swiglu: rows / 2, widened from fp16). blocks_per_sm: GemvParams' (< 0: exactly -n
// blocks, so that a small matrix too makes each block loop over several tiles).
std::vector<float> run_gemv(const uint16_t* W, int rows, int K, const float* x, const float* norm_w, float eps,
                            const float* y_init, int R, GemvIn in, GemvOut out, int blocks_per_sm = 0);

// A paged KV cache of one layer on the host, as the test ops pass it (cuda/kv_layout.cuh): pools of fp16 bits
// (n_pages, n_kv_heads, page_size, head_dim) and a page table of table_len entries (positions up to
// table_len * page_size). The drivers copy the pools back after the call (kernels that write the cache).
struct HostPages {
  uint16_t* k = nullptr;
  uint16_t* v = nullptr;
  const int32_t* table = nullptr;
  int table_len = 0, n_pages = 0, n_kv_heads = 0, page_size = 0, head_dim = 0;
  size_t elems() const { return (size_t)n_pages * n_kv_heads * page_size * head_dim; }
  int page_shift() const;  // log2(page_size)
};

// One decode-attention call. qkv: float[q_dim + 2 kv_dim]; the cache is updated in place (the kernel writes
// rope(k), v at pos); cos/sin: (max_seq, head_dim / 2); tensor_cores: DecodeAttnParams::tensor_cores. Returns
// float[q_dim].
std::vector<float> run_decode_attention(const float* qkv, HostPages cache, const float* cos, const float* sin,
                                        int pos, int n_heads, int max_seq, int chunk, bool tensor_cores);

// One decode_attention_rows call (cuda/attention_rows.cu), twice (the output poisoned in between: the second
// launch must find the merge tickets as the first left them, zero). qkv: (n_rows, q_dim + 2 kv_dim) floats;
// cache.table: (n_slots, table_stride) page tables, row r using row_slot[r]'s at row_pos[r] (< 0: padding, its
// output left NaN). grid_x, span, heads, act8_out: DecodeAttnParams::grid_x, rows_span, rows_heads (0: the
// engine's), act8_out. Returns (n_rows, q_dim).
std::vector<float> run_decode_attention_rows(const float* qkv, HostPages cache, int table_stride, const float* cos,
                                             const float* sin, const int* row_pos, const int* row_slot, int n_rows,
                                             int n_heads, int max_seq, int grid_x, int span, int heads,
                                             bool act8_out = false);

// One rope_rows call (cuda/prefill.cu, the prefill's cache write) for T tokens at pos0..: qkv (T, q_dim + 2 kv_dim)
// floats; writes rope(k), v into the cache (updated in place); returns rope(q) (T, q_dim) floats (from fp16).
// cos/sin: (max_seq, head_dim / 2).
std::vector<float> run_rope_rows(const float* qkv, HostPages cache, const float* cos, const float* sin, int T,
                                 int pos0, int n_heads);

// One sampling call over logits[vocab]; returns the chosen token. seen: vocab bytes (repetition penalty).
int run_sample(const float* logits, int vocab, float temperature, int top_k, float top_p, float min_p,
               float repetition_penalty, unsigned long long seed, int step, const unsigned char* seen);

// One sample_rows call (cuda/sampling.cu): n_rows rows of logits at logits + r * ld (vocab <= ld used), row r
// with rows[r] (its parameters, step, history slot, logit-bias entries in bias[n_bias] and allowed-token mask in
// masks[n_mask words]). seen / counts: the
// (n_slots, vocab) histories, updated in place (the sampler marks the tokens it picks). Outputs are poisoned first
// (tokens -7, logprobs NaN).
struct SampleRowsOut {
  std::vector<int> tokens;        // (n_rows)
  std::vector<float> logprob;     // (n_rows)
  std::vector<int> top_ids;       // (n_rows, top_k)
  std::vector<float> top_lp;      // (n_rows, top_k)
  std::vector<float> logits;      // (n_rows, ld) the device's logits after the call (the bias taken off again)
};
SampleRowsOut run_sample_rows(const float* logits, int64_t ld, int n_rows, int vocab, const RowSampling* rows,
                              const LogitBias* bias, int n_bias, const unsigned* masks, int n_mask,
                              unsigned char* seen, int* counts, int n_slots, int top_k);

// The device quantizer on W (rows, K) fp32 (rounded to fp16 first, as in the engine): q bytes (rows, ld) and the
// scales' fp16 bits (rows, scale_halves(fmt, K)), as the reference packer lays them out (cpp/core/quant.h).
struct QuantBytes {
  std::vector<uint8_t> q;
  std::vector<uint16_t> scales;
  int64_t ld = 0;
};
QuantBytes run_quantize(const float* W, int rows, int K, WFormat fmt);
// quantize on the device, then dequantize to fp16 rows: (rows, K) floats.
std::vector<float> run_dequantize(const float* W, int rows, int K, WFormat fmt);
// One GEMV over W quantized on the device (as run_gemv otherwise; in/out: the pairs quantized GEMVs have).
std::vector<float> run_gemv_quant(const float* W, int rows, int K, WFormat fmt, const float* x, const float* norm_w,
                                  float eps, const float* y_init, int R, GemvIn in, GemvOut out,
                                  int blocks_per_sm = 0, bool act8 = false);

// One small-N GEMV (cuda/gemv_batch.cu, the batched decode step's products) over n input rows: W (rows, K) fp32
// (rounded to fp16, then quantized on the device unless fmt is F16); X (n, K) floats (F16 input: rounded to
// fp16; F32Norm: RMS-normed by the kernel with norm_w); Y_init (n, rows) for AddF32. Returns (n, rows) floats, or
// (n, rows / 2) for Swiglu (widened from fp16). mma: the tensor-core kernel (cuda/mma_small_n.cu) instead, its
// F32Norm input RMS-normed first by rmsnorm_rows (prefill.cuh) as the batched step does; m_tiles its 16-row
// tiles per block (GemvBatchArgs::m_tiles), smem_ring its fp16 path (GemvBatchArgs::smem_ring); one_row (mma,
// n = 1): the decode step's one-row kernel (cuda/mma_one_row.cu), an F32Norm row normed in its own prologue.
// act8: the inputs rounded to fp16(d xq) as the batched step rounds them for an act8 role (cuda/act8.cuh): F16 by
// act8_round_rows first; F32Norm in gemv_batch's prologue, or by rmsnorm_rows before the tensor-core kernel.
std::vector<float> run_gemv_batch(const float* W, int rows, int K, WFormat fmt, const float* X, int n,
                                  const float* norm_w, float eps, const float* Y_init, GemvIn in, GemvOut out,
                                  bool mma = false, int m_tiles = 0, bool smem_ring = true, bool one_row = false,
                                  bool act8 = false);
// act8_round_rows (cuda/batch_rows.cuh) over X (T, K) rounded to fp16 first; returns (T, K) floats.
std::vector<float> run_act8_round_rows(const float* X, int T, int K);

// A down product as the batched step takes it in K slices (GemmArgs::k_slices, cuBLASLt, W fp16 bits (M, K)),
// then residual_norm_rows: x = x_init + X @ W.T and xn = fp16(rmsnorm(x) * norm_w). Returns (x, xn widened).
std::pair<std::vector<float>, std::vector<float>> run_sliced_residual_norm(const uint16_t* W, const float* X,
                                                                           const float* x_init, const float* norm_w,
                                                                           float eps, int M, int N, int K, int slices,
                                                                           bool autotune);

// The device's SM count (the kernels' one-wave rules depend on it: tests size their shapes by it).
int device_sm_count();

// rmsnorm_rows (prefill.cu) over T rows of H floats X with weight w: (T, H) floats (widened from fp16); the rows'
// strides are not packed (ldx = H + 4, ldy = H + 8 rounded to 4). in_registers as rmsnorm_rows'.
std::vector<float> run_rmsnorm_rows(const float* X, int T, int H, const float* w, float eps, bool in_registers,
                                    bool act8 = false);

// One GEMM (cuBLASLt, gemm.cu) Y = X W^T (+ Y_init for AddF32). W: (M, K) fp16 bits; X: (N, K) floats (rounded
// to fp16); Y_init: (N, M). Returns Y (N, M) floats (widened from fp16 for GemmOut::F16). autotune: time the
// candidates first (else cuBLASLt's default).
std::vector<float> run_gemm(const uint16_t* W, const float* X, const float* Y_init, int M, int N, int K, GemmOut out,
                            bool autotune);

// One prefill-attention call over T tokens at pos0..pos0+T-1. q: (T, n_heads * head_dim) floats (rounded to
// fp16); the cache holds positions 0..pos0+T-1. Returns (T, n_heads * head_dim) floats.
std::vector<float> run_prefill_attention(const float* q, HostPages cache, int T, int pos0, int n_heads, int stages);
// The same for many sequences in one launch (varlen): sequence s's seq_T[s] query rows follow the previous
// ones in q, sit at positions seq_pos0[s].. and read through table row s (cache.table: n_seqs rows of row_len).
std::vector<float> run_prefill_attention_varlen(const float* q, HostPages cache, int row_len, const int* seq_T,
                                                const int* seq_pos0, int n_seqs, int n_heads, int stages);

}  // namespace ti::cuda
