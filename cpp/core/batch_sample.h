// batch_sample.h — what seq_sample returns (docs/BATCH_CONTRACT.md §2), the same for every engine: per sampled slot
// the token, its logprob (log_softmax of the raw logits) and the top-k entries of the same distribution.
#pragma once
#include <cstdint>
#include <vector>

namespace ti {

struct BatchSample {
  std::vector<int32_t> tokens;        // (n)
  std::vector<float> logprobs;        // (n)
  std::vector<int32_t> top_ids;       // (n, k) row-major, descending logprob, ties: lower id
  std::vector<float> top_logprobs;    // (n, k)
  int64_t k = 0;
};

}  // namespace ti
