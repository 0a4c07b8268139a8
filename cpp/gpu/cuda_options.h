// cuda_options.h — CudaOptions, the GPU engine's typed options (one line each), and their check at load.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "../core/config.h"
#include "../core/quant.h"
#include "decode_persistent.h"
#include "gemv_plan.h"

namespace ti {

// One line per option; why the defaults are what they are: docs/perf/decode-options.md.
struct CudaOptions {
  bool pdl = true;                     // programmatic dependent launch where the GPU has it (sm_90+)
  // Which of the decode step's kernels let their successor launch at their start (PDL) rather than after their wait:
  // -1 timed at load (each level kept where whole steps are > 1% faster), 0 none, 1 the GEMVs but qkv, 2 those and
  // the attention.
  int early_trigger = -1;
  bool trace = false;                  // per-block timestamps of the decode kernels (-DTINYINFER_TRACE=ON build)
  bool graphs = true;                  // replay captured graphs (false: launch kernel by kernel, for debugging)
  int attn_chunk = 0;                  // positions per split-K attention block; 0: the kernel's choice
  int gemv_rows = 0;                   // 0: time R in {1, 2, 4, 8 = split-K} per shape at load; else only this R
  int gemv_grid = -1;                  // -1: time blocks_per_sm 0 / 1 / 2 per shape; else only this one
  double gemv_resident_margin = 0.05;  // prefer a 2-blocks-per-SM variant within this fraction of the fastest
  bool gemv_small_tiles = true;        // among those, the smallest tiles (qkv, before the attention: the largest)
  bool gemv_step_check = true;         // then whole steps decide, role by role, against the fastest alone
  // The tuner also times R = 16 (kGemvMmaOneRow: the tensor-core product on the one row) for every role where it
  // fits (sm_80+; normed inputs K <= 16,384); off until measured (docs/perf/persistent.md §26-27).
  bool gemv_mma = false;
  // int8 / int4 GEMVs of the graph path on the input quantized to int8 per group (dp4a; docs/perf/decode-options.md);
  // the batched step and the prefill then round those products' inputs to the same numbers (cuda/act8.cuh); the
  // persistent step does not, so it is not built where a role takes int8 inputs. 0 never (default: weights-only
  // quantization, docs/ARCHITECTURE.md); -1 int4 matrices wherever the kernel can, int8 ones never (their fp16-input
  // GEMV is as fast); -2 as -1 but down (its long input quantized again in every block, and its rounding a kernel a
  // layer in the batched step); 1 each quantized role timed with and without at load; 2 every quantized matrix
  // wherever the kernel can.
  int act8 = 0;
  std::vector<GemvPin> gemv_pins;      // variants forced after tuning (A/B runs: bench/tools/ab_decode.py)
  int64_t decode_long_from = -1;       // long-context decode graph: -1 tuned, 0 none, n > 0 from context n
  // The shared-memory carveout of the decode step's kernels (GemvPlan::carveout, cuda/common.cuh): -2 timed at load
  // (whole steps with the driver's choice per kernel against kStepCarveout for every kernel, each with its trigger
  // level and step check settled under it; the driver's choice
  // without graphs, below max_seq_len 89 or with a CUDA toolkit before 12.5); -1 the driver's choice; 0..100 this
  // percent of the SM's maximum shared memory for every kernel (docs/perf/persistent.md §23).
  int smem_carveout = -2;
  bool one_chunk_graph = true;         // steps at pos < attn_chunk: a decode graph without the merge kernel
  bool attn_tensor_cores = true;       // decode attention's chunk (head dim 64 / 128) on mma.sync
  bool batched_prefill = true;         // false: feed prompts one token at a time through the decode graph
  int prefill_chunk = 2048;            // tokens per prefill pass (activation buffers are sized for this at load)
  bool gemm_autotune = true;           // false: cuBLASLt's default algorithm for every GEMM
  bool gemm_tune_cold = true;          // the tuner times each GEMM with its weights out of the L2 (false: A/B runs)
  WFormat weights = WFormat::F16;      // the matrices' format on the device (cpp/core/quant.h), quantized at load
  // Sequence slots (seq_open ..., batch_step.h): the most sequences one seq_step runs; graphs are captured per
  // bucket 1, 2, 4, ... up to max_batch, on first use.
  int64_t max_batch = 64;
  // Speculative decoding's draft pass (CudaEngine::decode_draft): 0 the prefill pass (cuBLASLt GEMMs), 1 the
  // batched decode step's kernels over the draft's rows (one graph per bucket; a pass of more than max_batch rows,
  // the pending token's and the draft's, takes the prefill pass). docs/perf/speculative.md.
  int draft_pass = 0;
  // fp16 batched steps of <= this many rows take the small-N GEMV (6 launches per layer, each weight read once),
  // larger ones cuBLASLt (+ RMSNorm and SwiGLU kernels). 1: cuBLASLt from 2 rows on — on the H200 (TinyLlama,
  // 92e0bc3) cuBLASLt's step at 16 rows (1.43 ms) beat the small-N kernel's at 2 (1.56), see docs/perf/batch.md.
  int batch_gemv_f16_max = 1;
  // int8 / int4 batched steps of <= this many rows take the small-N GEMV; larger ones dequantize each matrix into
  // the fp16 staging (DeviceWeights::fp16_of, as the prefill does) and take cuBLASLt: the small-N kernel costs
  // ~linearly in the rows past 4 (int4 2.97 ms at 8, 5.83 at 32), dequantize + cuBLASLt ~flat (docs/perf/batch.md).
  int batch_gemv_quant_max = 4;
  // The batched step's own kernels (small-N GEMV, tensor-core kernel, attention, RMSNorm) launched with PDL
  // inside its graphs, as the decode graph's, where the engine uses PDL at all (CudaOptions::pdl, sm_90+, a
  // driver that captures it); false: plain launches, for A/B runs and debugging.
  bool batch_pdl = true;
  // int8 / int4 batched products of <= this many rows (at most 64) take the tensor-core small-N kernel
  // (cuda/mma_small_n.cu, RMSNorm as its own kernel) ahead of the choice above; batch_mma_f16_max likewise for
  // fp16 (0: off). Measured on the H200 (TinyLlama, e3a70ff, docs/perf/batch.md): int4 at 8 rows 1.12 ms per
  // step against 2.11 dequantize + cuBLASLt, but 2.07 against 2.24 at 32 and 3.70 against 2.57 at 64; fp16 slower
  // than cuBLASLt at every row count (8 rows: 1.57 against 1.44 ms).
  int batch_mma_max = 16;
  int batch_mma_f16_max = 0;
  // fp16 qkv and o products (the two beside the attention) of <= this many rows take that kernel while the others
  // stay on cuBLASLt: at few rows cuBLASLt streams the large gate/up and down well but splits qkv's K (a reduce
  // kernel) and gives o too few tiles, and after our qkv the attention starts early under PDL (docs/perf/batch.md).
  int batch_mma_f16_qkvo_max = 16;
  // fp16 down products of <= this many rows take that kernel too (0: cuBLASLt; for A/B runs: at TinyLlama's
  // shape the step was slower with it, even where its kernel beat cuBLASLt's split-K pair: docs/perf/batch.md).
  int batch_mma_f16_down_max = 0;
  // fp16 products on that kernel take their weights and inputs through a cp.async ring in shared memory (D chunks
  // a warp in flight, no registers held: cuda/mma_small_n.cu); false: the register ring (A/B runs).
  bool batch_mma_ring = true;
  // A down product on cuBLASLt of <= 16 rows (fp16 at 2-16 rows: where cuBLASLt splits K and reduces in a kernel
  // of its own) in this many K slices (2..8: one strided-batched launch), then one kernel of ours that adds the
  // slices into the residual and writes the next RMSNorm (cuda/batch_rows.cuh); 0 or 1: cuBLASLt's own choice.
  // 2, 4 or 8 (powers of two divide the K of the models we take; a K that S x 8 does not divide is not sliced).
  // 4 measured best on the H200 (TinyLlama fp16 batch 8: 1.023-1.028 ms against 1.045-1.052; docs/perf/batch.md).
  int batch_down_k_slices = 4;
  // Bucket 1 (a lone sequence) runs its products on the single-sequence decode GEMVs of the load-time plan
  // (batch_step.cu, record_one_row) instead of the small-N kernels, whose tiles are mostly dead columns at one row.
  // Its logits then differ from the same sequence's in a larger bucket by the kernels' rounding (not bit for bit);
  // false: bucket 1 on the batched products too (A/B runs; a row bit for bit a larger bucket's where both take the
  // same small-N kernel). On the H200 (TinyLlama) batch 1's step: int4 0.67 -> 0.50 ms, fp16 1.07 -> 0.73.
  // docs/perf/batch.md ("Bucket 1 on the decode plan").
  bool batch_one_row_plan = true;
  // With act8, o's input in the batched step written rounded to int8 numbers by the attention that produces it
  // rather than by act8_round_rows after it: the same bits, a kernel a layer fewer (batch_step.cu). false: the
  // rounding kernel (A/B runs and the tests' reference).
  bool batch_act8_fused = true;
  // 16-row tiles per block of that kernel: 0 (default) two for int4 products of 9..16 rows whose matrix still
  // gives every SM two blocks (each input fragment then meets two tiles' weights: docs/perf/batch.md), else one;
  // 1 or 2 force it (2: products of up to 16 rows) for A/B runs.
  int batch_mma_m_tiles = 0;
  // Positions per block of the batched step's attention (cuda/attention_rows.cu): 0 (default) 256 at head dim 64,
  // 128 up to 128, 64 above — a row that long is one block per KV head, no merge; 64 or 128: more, shorter blocks
  // and an in-kernel merge (smaller spans did not pay on the H200: docs/perf/batch.md).
  int batch_attn_span = 0;
  // Query heads per block of that attention: 1, 2, 4 or 8 (a KV head's group split into slices of that many, each
  // its own block re-reading the K / V tile from L2), 0 (default): the fewest (at least two from two rows) while
  // the busy blocks fit in one wave (cuda/attention_rows.cu). All 8 of a group in one block was latency-bound, one
  // a block lost to two at 2-8 rows (docs/perf/batch.md).
  int batch_attn_heads = 0;
  // The paged KV cache (kv_pages.h), shared by the single sequence and the slots:
  int kv_page_size = 64;               // positions per page: a power of two, >= 64 and >= attn_chunk
  // Pages in the pool. 0: enough for max_batch sequences of max_seq_len, but at most half the device memory
  // free once the weights are in (the other half: activations, cuBLASLt, other processes), and never fewer
  // than one max_seq_len sequence needs (a batch then shares the pool: pages are taken on demand and a slot
  // that cannot get one fails its call with a Request error). kv_cache_bytes() reports the choice.
  int64_t kv_pool_pages = 0;
  uint64_t kv_page_shuffle = 0;        // a seed shuffling the pool's free list (tests); 0: pages in order
  std::string plan_text;               // a saved GEMV plan (plan_cache.h) to take instead of tuning; "": tune
  // Which pass decode() replays: the graph of kernels (the reference), the persistent kernel (issue 16), or Auto
  // (persistent where it can run, else graph). Graph until the persistent step is measured correct and faster.
  DecodePath decode_path = DecodePath::Graph;
  bool persistent_prefetch = true;     // its tasks ask their first weights into L2 before their waits (A/B)
  bool persistent_fused_merge = true;  // no merge phase: a KV head's last attention task merges its chunks (A/B)
  int persistent_blocks_per_sm = 2;    // its grid: min(co-resident, this x SMs); 1 to 4 (A/B)
  int persistent_timeout_ms = 2000;    // a counter wait that has not succeeded by then ends the step with an error
  // The weight ring across task boundaries (persistent_ring_plan.h, docs/perf/persistent.md §7): each block copies
  // its next tasks' weight tiles into shared memory (cp.async.bulk, sm_90) before it waits on a counter. Off: on
  // the H200 it made the step slower (TinyLlama fp16 1,861 against 1,238 µs without it; §7.4).
  bool persistent_ring = false;
  int persistent_ring_slots = 4;       // slots per block: 2 to 8
  int persistent_ring_slot_kib = 32;   // slot size: 1 to 128 KiB (slots x size must fit the block's shared memory)
  bool persistent_kv_stage = true;     // attention tasks copy the earlier positions' keys / values before the wait
};

// Every option in its range (attn_chunk already resolved from 0 to the kernel's choice), else a Request error that
// names it (also where this build cannot do what it asks: a carveout before CUDA 12.5, tracing without TI_TRACE).
void check_options(const CudaOptions& o, const ModelConfig& c);

}  // namespace ti
