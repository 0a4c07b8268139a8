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
#include <type_traits>
#include <vector>

#include "batch_sample.h"
#include "errors.h"
#include "sampling.h"

namespace ti {

struct SampleStep {
  BatchSample sample;
  std::vector<uint8_t> stepped;  // (n) 1: row i's token was run by the step launched here
  double launch_s = 0;           // host seconds the step's launch took (0 when none was launched)
  bool prefilled = false;        // seq_sample_mixed: the prompts ran in the launched pass
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

// seq_sample_mixed: seq_sample, then seq_mixed of the rows with go_on[i] (with their sampled tokens) and the
// prompts p_tokens[j] (p_lens[j] tokens) in slots p_slots[j]: the scheduler's launch ahead when prompts wait
// (mixed steps). Unlike seq_sample_step every row with go_on steps, whatever its token: an engine may queue the
// pass before the tokens reach the host (CudaEngine does, reading them from the sampler's output on the
// device), so a row that drew a stop id has its next position computed for nothing and the caller ends it. A
// launch the engine refuses (a request error: pages, length, a bad prompt) launches nothing: no row stepped,
// prefilled false; the sample stands. This is the engine-independent form (sample, then the pass from the host);
// an engine with a member seq_sample_mixed has its own.
template <typename E>
SampleStep sample_then_mixed(E& e, const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps, int64_t n,
                             int k, const uint8_t* go_on, const int64_t* p_slots, const int32_t* const* p_tokens,
                             const int64_t* p_lens, int64_t n_p) {
  SampleStep out;
  out.sample = e.seq_sample(slots, cfgs, steps, n, k);
  out.stepped.assign((size_t)n, 0);
  std::vector<int64_t> step_slots;
  std::vector<int32_t> step_tokens;
  for (int64_t i = 0; i < n; i++) {
    if (!go_on[i]) continue;
    step_slots.push_back(slots[i]);
    step_tokens.push_back(out.sample.tokens[(size_t)i]);
  }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    e.seq_mixed(step_slots.data(), step_tokens.data(), (int64_t)step_slots.size(), p_slots, p_tokens, p_lens, n_p);
  } catch (const Error&) {
    return out;
  }
  out.launch_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int64_t i = 0; i < n; i++) out.stepped[(size_t)i] = go_on[i];
  out.prefilled = true;
  return out;
}

template <typename E, typename = void>
struct has_sample_mixed : std::false_type {};
template <typename E>
struct has_sample_mixed<E, std::void_t<decltype(&E::seq_sample_mixed)>> : std::true_type {};

template <typename E>
SampleStep seq_sample_mixed(E& e, const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps, int64_t n,
                            int k, const uint8_t* go_on, const int64_t* p_slots, const int32_t* const* p_tokens,
                            const int64_t* p_lens, int64_t n_p) {
  if constexpr (has_sample_mixed<E>::value)
    return e.seq_sample_mixed(slots, cfgs, steps, n, k, go_on, p_slots, p_tokens, p_lens, n_p);
  else
    return sample_then_mixed(e, slots, cfgs, steps, n, k, go_on, p_slots, p_tokens, p_lens, n_p);
}

}  // namespace ti
