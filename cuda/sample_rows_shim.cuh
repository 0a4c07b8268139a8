// sample_rows_shim.cuh — TEMPORARY (issue 17 merge): the contract's cuda::sample_rows (BATCH_CONTRACT.md §1) as
// a greedy-only stand-in until helper `sampler`'s cuda/sampling.{cu,cuh} lands. At the merge: delete this file
// and sample_rows_shim.cu, include "sampling.cuh" where this is included, and drop the greedy-only check in
// CudaEngine::seq_sample (cuda_engine.cu, "shim"). The declarations below are the contract's, verbatim.
#pragma once
#include <cuda_runtime.h>

#include "sampling.cuh"

namespace ti::cuda {

struct RowSampling {             // device memory, one per row
  DeviceSampling s;
  unsigned long long step;       // RNG counter of the token being sampled
  int slot;                      // which history row (counts / seen) this row uses
};

// logits: row r at logits + r * ld. seen: (slots, vocab) u8; counts: (slots, vocab) int32 — marks seen and
// increments counts[slot][token] for the token it picks. out_tokens[r], out_logprob[r] (log_softmax of the raw
// logits); top_ids/top_lp: (n_rows, top_k) when top_k > 0. The shim: greedy (argmax of the repetition-penalised
// logits, lowest id on ties) whatever the temperature; scratch unused.
void sample_rows(const float* logits, int64_t ld, int n_rows, int vocab, const RowSampling* rows,
                 unsigned char* seen, int* counts, float* scratch, int top_k, int* out_tokens,
                 float* out_logprob, int* top_ids, float* top_lp, cudaStream_t stream);

}  // namespace ti::cuda
