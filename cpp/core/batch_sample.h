// batch_sample.h — what one seq_sample call returns (BATCH_CONTRACT.md part 2): the next token of each of n
// slots, its logprob and the top-k of each row, as flat row-major arrays (the bindings hand them to numpy).
// Shared by the CPU and CUDA engines.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace ti {

struct BatchSample {
  int64_t n = 0, k = 0;             // rows, top entries per row
  std::vector<int32_t> tokens;      // (n)
  std::vector<float> logprob;       // (n) log_softmax(raw logits)[token]
  std::vector<int32_t> top_ids;     // (n, k) descending logprob, ties: lower id; -1 past the vocabulary's size
  std::vector<float> top_lp;        // (n, k); -inf past the vocabulary's size

  BatchSample() = default;
  BatchSample(int64_t rows, int64_t top)
      : n(rows), k(top), tokens((size_t)rows), logprob((size_t)rows), top_ids((size_t)(rows * top), -1),
        top_lp((size_t)(rows * top), -INFINITY) {}
};

}  // namespace ti
