// sample_step.h — seq_sample, then at once the next decode step of the rows sure to go on (docs/BATCH_CONTRACT.md
// part 2, seq_sample_step), for any engine with the sequence slots (CpuEngine, CudaEngine).
//
// Why one call: the scheduler launches the next step as soon as it has the sampled tokens (its "overlap"). Done
// from Python, the device idles from the sampler's end until the launch reaches it: the tokens come back, the
// interpreter takes the GIL back (behind a busy event loop in a server), builds the rows and calls seq_step —
// 0.1-0.2 ms of a 1.5 ms batch-64 step on an H200. Here the launch follows the tokens in C++, without the GIL.
// Which rows go on is decided exactly as the scheduler would: go_on[i] (what the host knew before: not cancelled,
// tokens left, pages for the next position) and the sampled token not one of the row's stop ids.
#pragma once
#include <chrono>
#include <cstdint>
#include <vector>

#include "batch_sample.h"
#include "errors.h"
#include "sampling.h"

namespace ti {

struct SampleStep {
  BatchSample sample;
  std::vector<uint8_t> stepped;  // (n) 1: row i's token was run by the step launched here
  double launch_s = 0;           // host seconds the step's launch took (0 when none was launched)
};

// stop_ids[i] (n_stop[i] of them): the ids that end row i. A step that fails with an engine error (ti::Error: a
// Request error — the pool short of pages, ... — is checked before anything is launched) leaves every row
// un-stepped and the sample stands: the caller meets the error again at its own seq_step, as it did when it
// launched the step itself. Anything else propagates (the sample is lost with the call).
template <typename E>
SampleStep seq_sample_step(E& e, const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps, int64_t n,
                           int k, const uint8_t* go_on, const int32_t* const* stop_ids, const int64_t* n_stop) {
  SampleStep out;
  out.sample = e.seq_sample(slots, cfgs, steps, n, k);
  out.stepped.assign((size_t)n, 0);
  std::vector<int64_t> rows, step_slots;
  std::vector<int32_t> step_tokens;
  for (int64_t i = 0; i < n; i++) {
    if (!go_on[i]) continue;
    const int32_t tok = out.sample.tokens[(size_t)i];
    bool stop = false;
    for (int64_t j = 0; j < n_stop[i] && !stop; j++) stop = stop_ids[i][j] == tok;
    if (stop) continue;
    rows.push_back(i);
    step_slots.push_back(slots[i]);
    step_tokens.push_back(tok);
  }
  if (step_slots.empty()) return out;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    e.seq_step(step_slots.data(), step_tokens.data(), (int64_t)step_slots.size());
  } catch (const Error&) {
    return out;
  }
  out.launch_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int64_t i : rows) out.stepped[(size_t)i] = 1;
  return out;
}

}  // namespace ti
