// engine_checks.h — the request checks every engine (CPU, CUDA) makes before it touches its state, so both
// refuse the same requests with the same messages.
#pragma once
#include <cstdint>
#include <string>

#include "errors.h"

namespace ti {

// Token ids must be in the vocabulary; at least one.
inline void check_tokens(const int32_t* tokens, int64_t n, int64_t vocab) {
  if (n < 1) fail(ErrorKind::Request, "no tokens given");
  for (int64_t t = 0; t < n; t++)
    if (tokens[t] < 0 || tokens[t] >= vocab)
      fail(ErrorKind::Request, "token id " + std::to_string(tokens[t]) + " at index " + std::to_string(t) +
                                   " is out of range for a vocabulary of " + std::to_string(vocab));
}

// `position` tokens already in the sequence plus `n` new ones must fit the KV cache.
inline void check_room(int64_t position, int64_t n, int64_t max_seq) {
  if (position + n > max_seq)
    fail(ErrorKind::Request, std::to_string(position) + " tokens in the sequence + " + std::to_string(n) +
                                 " new ones exceed max_seq_len=" + std::to_string(max_seq));
}

}  // namespace ti
