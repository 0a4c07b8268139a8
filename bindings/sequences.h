// sequences.h — the sequence slots' Python surface (docs/BATCH_CONTRACT.md part 2), the same for every engine class
// that has them (CpuEngine, CudaEngine): bind_sequences<E>(cls). Type conversion and argument checks only.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <string>
#include <vector>

#include "../cpp/core/batch_sample.h"
#include "../cpp/core/engine_checks.h"
#include "../cpp/core/sample_step.h"
#include "../cpp/core/sampling.h"
#include "common.h"

namespace tinyinfer_bindings {

// Many prompts as the engines take them: each as int32 ids, a pointer and a length.
struct PromptIds {
  std::vector<std::vector<int32_t>> ids;
  std::vector<const int32_t*> ptrs;
  std::vector<int64_t> lens;
  explicit PromptIds(const std::vector<std::vector<int64_t>>& prompts) {
    ids.reserve(prompts.size());  // (the pointers below stay valid)
    for (const std::vector<int64_t>& p : prompts) {
      ids.push_back(to_ids(p));
      ptrs.push_back(ids.back().data());
      lens.push_back((int64_t)p.size());
    }
  }
};

// A slot call taking token ids (slot, tokens, n), from Python's (slot, list of ids): the ids as int32.
template <typename E, void (E::*F)(int64_t, const int32_t*, int64_t)>
void slot_tokens_call(E& e, int64_t slot, const std::vector<int64_t>& tokens) {
  std::vector<int32_t> ids = to_ids(tokens);
  (e.*F)(slot, ids.data(), (int64_t)ids.size());
}

// The sequence slots (docs/BATCH_CONTRACT.md part 2): the same Python surface for every engine class that has them.
template <typename E, typename Cls>
inline void bind_sequences(Cls& cls) {
  using namespace nb::literals;
  cls.def_prop_ro("max_batch", &E::max_batch, "How many sequence slots the engine has.")
      .def_prop_ro("kv_page_size", &E::kv_page_size, "Positions per KV page.")
      .def_prop_ro("kv_pages_total", &E::kv_pages_total, "KV pages the slots may hold in all.")
      .def_prop_ro("kv_pages_free", &E::kv_pages_free, "KV pages the slots do not hold now.")
      .def("seq_open", &E::seq_open, "A free, empty slot (its number); an error when all are taken.")
      .def("seq_close", &E::seq_close, "slot"_a,
           "Free a slot: its KV pages, logits and history; or drop a parked sequence (seq_park): its pages.")
      .def("seq_length", &E::seq_length, "slot"_a, "Positions in the slot's (or parked sequence's) cache.")
      .def("seq_park", &E::seq_park, "slot"_a,
           "Keep the slot's cache without its slot: its KV pages and positions become a parked sequence (the id "
           "returned, max_batch and up) and the slot closes. seq_copy copies from the id, seq_length, "
           "kv_pages_held_by and seq_rewind(_frees) take it, seq_close drops it. The scheduler's prefix cache: "
           "ended requests' caches hold pages, not slots.")
      .def(
          "seq_rewind", &slot_tokens_call<E, &E::seq_rewind>, "slot"_a, "tokens"_a,
          "Keep the slot's first len(tokens) positions, which hold `tokens` (the CPU engine checks; the GPU's "
          "does not keep them), and forget the rest: their pages, the logits (a seq_prefill must follow) and the "
          "history, which restarts as `tokens`, as prompt. The scheduler's prefix cache: a new request in the slot "
          "of an ended one whose tokens its prompt starts with. Cut inside a KV page another slot shares (seq_copy), "
          "that page is copied into one of the slot's own first. A parked sequence (seq_park) is shortened the "
          "same way (the prefix cache's eviction, tail pages first); it is never written, so a shared page it is "
          "cut inside stays shared.")
      .def("seq_rewind_frees", &E::seq_rewind_frees, "slot"_a, "n"_a,
           "How many KV pages seq_rewind(slot, n tokens) would free: those past n no other slot shares, less one "
           "where position n's page is shared and must be copied (an open slot's; the scheduler's page accounting).")
      .def(
          "seq_copy",
          [](E& e, int64_t dst, int64_t src, const std::vector<int64_t>& tokens) {
            std::vector<int32_t> ids = to_ids(tokens);
            e.seq_copy(dst, src, ids.data(), (int64_t)ids.size());
          },
          "dst"_a, "src"_a, "tokens"_a,
          "Slot dst (open, not src) drops what it held and takes the first len(tokens) positions of src (an open "
          "slot or a parked sequence), which hold "
          "`tokens` (the CPU engine checks): the KV pages wholly below len(tokens) shared with src (read by both, "
          "written by neither), the last, partly filled one copied into a page of its own; no logits (a "
          "seq_prefill must follow), its history `tokens` as prompt. The scheduler's prefix cache: a request "
          "sharing a prefix with one still running or with a parked one.")
      .def(
          "kv_pages_held_by",
          [](const E& e, const std::vector<int64_t>& slots) {
            return e.kv_pages_held_by(slots.data(), (int64_t)slots.size());
          },
          "slots"_a, "The KV pages only these slots or parked sequences hold (closing them all would free them).")
      .def(
          "seq_mark_generated", &slot_tokens_call<E, &E::seq_mark_generated>, "slot"_a, "tokens"_a,
          "`tokens` join the slot's history as generated (counted by the presence / frequency penalties, as the "
          "sampler adds each token it draws): a preempted request's answer so far, prefilled again as prompt.")
      .def(
          "seq_prefill",
          [](E& e, int64_t slot, const std::vector<int64_t>& tokens, bool all_logits) -> nb::object {
            std::vector<int32_t> ids = to_ids(tokens);
            if (!all_logits) {
              nb::gil_scoped_release release;
              e.seq_prefill(slot, ids.data(), (int64_t)ids.size());
              return nb::none();
            }
            float* out = nullptr;
            F32Out arr = new_f32_array(std::max<size_t>(ids.size(), 1), (size_t)e.config().vocab, &out);
            {
              nb::gil_scoped_release release;
              e.seq_prefill(slot, ids.data(), (int64_t)ids.size(), out);
            }
            return nb::cast(arr);
          },
          "slot"_a, "tokens"_a, "all_logits"_a = false,
          "A prompt chunk at seq_length(slot): fills the cache, keeps the last token's logits, adds the tokens to "
          "the slot's history as prompt. all_logits: returns every token's logits, (len(tokens), vocab) float32 "
          "(prompt logprobs; on the GPU the call then waits for them).")
      .def(
          "seq_prefill_many",
          [](E& e, const std::vector<int64_t>& slots, const std::vector<std::vector<int64_t>>& prompts) {
            if (slots.size() != prompts.size())
              ti::fail(ti::ErrorKind::Request, "seq_prefill_many: " + std::to_string(slots.size()) + " slots but " +
                                                   std::to_string(prompts.size()) + " prompts");
            const PromptIds p(prompts);
            nb::gil_scoped_release release;
            e.seq_prefill_many(slots.data(), p.ptrs.data(), p.lens.data(), (int64_t)slots.size());
          },
          "slots"_a, "prompts"_a,
          "seq_prefill of many slots at once: prompts[i] at seq_length(slots[i]) in slots[i] (distinct). On the "
          "GPU their tokens share batched passes; each slot ends as seq_prefill would leave it. All checked first: "
          "an error changes nothing.")
      .def(
          "seq_mixed",
          [](E& e, const std::vector<int64_t>& step_slots, const std::vector<int64_t>& step_tokens,
             const std::vector<int64_t>& slots, const std::vector<std::vector<int64_t>>& prompts) {
            if (step_slots.size() != step_tokens.size() || slots.size() != prompts.size())
              ti::fail(ti::ErrorKind::Request, "seq_mixed: " + std::to_string(step_slots.size()) + " step slots, " +
                                                   std::to_string(step_tokens.size()) + " tokens, " +
                                                   std::to_string(slots.size()) + " prompt slots and " +
                                                   std::to_string(prompts.size()) + " prompts");
            const std::vector<int32_t> step_ids = to_ids(step_tokens);
            const PromptIds p(prompts);
            nb::gil_scoped_release release;
            e.seq_mixed(step_slots.data(), step_ids.data(), (int64_t)step_ids.size(), slots.data(), p.ptrs.data(),
                        p.lens.data(), (int64_t)slots.size());
          },
          "step_slots"_a, "step_tokens"_a, "slots"_a, "prompts"_a,
          "seq_step(step_slots, step_tokens) and seq_prefill_many(slots, prompts) in one call (all slots distinct). "
          "On the GPU one pass for both: the decode rows ride in the prompts' products, every weight read once. "
          "Each slot ends as the two calls would leave it. All checked first: an error changes nothing.")
      .def(
          "seq_step",
          [](E& e, const std::vector<int64_t>& slots, const std::vector<int64_t>& tokens) {
            if (slots.size() != tokens.size())
              ti::fail(ti::ErrorKind::Request, "seq_step: " + std::to_string(slots.size()) + " slots but " +
                                                   std::to_string(tokens.size()) + " tokens");
            std::vector<int32_t> ids = to_ids(tokens);
            nb::gil_scoped_release release;
            e.seq_step(slots.data(), ids.data(), (int64_t)ids.size());
          },
          "slots"_a, "tokens"_a,
          "One decode step: tokens[i] runs at seq_length(slots[i]) in slots[i] (distinct slots); their logits "
          "become the new ones.")
      .def(
          "seq_sample",
          [](E& e, const std::vector<int64_t>& slots, const std::vector<ti::SamplingConfig>& cfgs,
             const std::vector<int64_t>& steps, int64_t top_logprobs) {
            if (cfgs.size() != slots.size() || steps.size() != slots.size())
              ti::fail(ti::ErrorKind::Request, "seq_sample: " + std::to_string(slots.size()) + " slots, " +
                                                   std::to_string(cfgs.size()) + " configs and " +
                                                   std::to_string(steps.size()) + " steps");
            ti::check_top_logprobs(top_logprobs);
            const std::vector<uint64_t> counters = to_steps(steps);
            ti::BatchSample r;
            {
              nb::gil_scoped_release release;
              r = e.seq_sample(slots.data(), cfgs.data(), counters.data(), (int64_t)slots.size(),
                               (int)top_logprobs);
            }
            const size_t n = r.tokens.size(), k = (size_t)r.k;
            return std::make_tuple(numpy_copy(r.tokens, n), numpy_copy(r.logprobs, n), numpy_copy(r.top_ids, n, k),
                                   numpy_copy(r.top_logprobs, n, k));
          },
          "slots"_a, "cfgs"_a, "steps"_a, "top_logprobs"_a = 0,
          "The next token of each slot from its logits, added to its history as generated. steps[i]: the RNG "
          "counter (tokens that request generated so far). Returns (tokens int32[n], logprob float32[n], "
          "top_ids int32[n, k], top_lp float32[n, k]); logprobs are log_softmax of the raw logits.")
      .def(
          "seq_sample_step",
          [](E& e, const std::vector<int64_t>& slots, const std::vector<ti::SamplingConfig>& cfgs,
             const std::vector<int64_t>& steps, int64_t top_logprobs, const std::vector<bool>& go_on,
             const std::vector<std::vector<int64_t>>& stop_ids) {
            const size_t n = slots.size();
            if (cfgs.size() != n || steps.size() != n || go_on.size() != n || stop_ids.size() != n)
              ti::fail(ti::ErrorKind::Request, "seq_sample_step: " + std::to_string(n) + " slots, " +
                                                   std::to_string(cfgs.size()) + " configs, " +
                                                   std::to_string(steps.size()) + " steps, " +
                                                   std::to_string(go_on.size()) + " go_on and " +
                                                   std::to_string(stop_ids.size()) + " stop id lists");
            ti::check_top_logprobs(top_logprobs);
            const std::vector<uint64_t> counters = to_steps(steps);
            const std::vector<uint8_t> go(go_on.begin(), go_on.end());
            std::vector<std::vector<int32_t>> stops;
            std::vector<const int32_t*> stop_ptrs;
            std::vector<int64_t> n_stop;
            stops.reserve(n);  // (the pointers below stay valid)
            for (const std::vector<int64_t>& s : stop_ids) {
              stops.emplace_back();
              for (int64_t id : s)  // (an id outside int32 matches no token: it is left out, not narrowed)
                if (id >= 0 && id <= INT32_MAX) stops.back().push_back((int32_t)id);
              stop_ptrs.push_back(stops.back().data());
              n_stop.push_back((int64_t)stops.back().size());
            }
            ti::SampleStep r;
            {
              nb::gil_scoped_release release;
              r = ti::seq_sample_step(e, slots.data(), cfgs.data(), counters.data(), (int64_t)n, (int)top_logprobs,
                                      go.data(), stop_ptrs.data(), n_stop.data());
            }
            const size_t k = (size_t)r.sample.k;
            return std::make_tuple(numpy_copy(r.sample.tokens, n), numpy_copy(r.sample.logprobs, n),
                                   numpy_copy(r.sample.top_ids, n, k), numpy_copy(r.sample.top_logprobs, n, k),
                                   numpy_copy(r.stepped, n), r.launch_s);
          },
          "slots"_a, "cfgs"_a, "steps"_a, "top_logprobs"_a, "go_on"_a, "stop_ids"_a,
          "seq_sample, then at once seq_step of the rows i with go_on[i] whose token is not in stop_ids[i], with "
          "those tokens (the scheduler's launch ahead without a return to Python between). A step that fails "
          "with an engine error (a request error: pages, length) leaves every row un-stepped; the sample stands. "
          "Stop ids outside int32 match no token. Returns seq_sample's "
          "four arrays, stepped (uint8[n], 1: the row's token ran in the launched step) and the launch's host "
          "seconds.")
      .def(
          "seq_sample_mixed",
          [](E& e, const std::vector<int64_t>& slots, const std::vector<ti::SamplingConfig>& cfgs,
             const std::vector<int64_t>& steps, int64_t top_logprobs, const std::vector<bool>& go_on,
             const std::vector<int64_t>& prompt_slots, const std::vector<std::vector<int64_t>>& prompts) {
            const size_t n = slots.size();
            if (cfgs.size() != n || steps.size() != n || go_on.size() != n || prompt_slots.size() != prompts.size())
              ti::fail(ti::ErrorKind::Request, "seq_sample_mixed: " + std::to_string(n) + " slots, " +
                                                   std::to_string(cfgs.size()) + " configs, " +
                                                   std::to_string(steps.size()) + " steps, " +
                                                   std::to_string(go_on.size()) + " go_on, " +
                                                   std::to_string(prompt_slots.size()) + " prompt slots and " +
                                                   std::to_string(prompts.size()) + " prompts");
            ti::check_top_logprobs(top_logprobs);
            const std::vector<uint64_t> counters = to_steps(steps);
            const std::vector<uint8_t> go(go_on.begin(), go_on.end());
            const PromptIds p(prompts);
            ti::SampleStep r;
            {
              nb::gil_scoped_release release;
              r = ti::seq_sample_mixed(e, slots.data(), cfgs.data(), counters.data(), (int64_t)n, (int)top_logprobs,
                                       go.data(), prompt_slots.data(), p.ptrs.data(), p.lens.data(),
                                       (int64_t)prompt_slots.size());
            }
            const size_t k = (size_t)r.sample.k;
            return std::make_tuple(numpy_copy(r.sample.tokens, n), numpy_copy(r.sample.logprobs, n),
                                   numpy_copy(r.sample.top_ids, n, k), numpy_copy(r.sample.top_logprobs, n, k),
                                   numpy_copy(r.stepped, n), r.launch_s, r.prefilled);
          },
          "slots"_a, "cfgs"_a, "steps"_a, "top_logprobs"_a, "go_on"_a, "prompt_slots"_a, "prompts"_a,
          "seq_sample, then seq_mixed of the rows i with go_on[i] (their sampled tokens) and prompts[j] in "
          "prompt_slots[j] (the scheduler's launch ahead while prompts wait). Every row with go_on steps, whatever "
          "its token: on the GPU the pass is queued behind the sampler before the tokens reach the host. A launch "
          "the engine refuses (a request error) launches nothing and the sample stands. Returns seq_sample's four "
          "arrays, stepped (uint8[n]), the launch's host seconds and prefilled (the prompts ran).");
}

}  // namespace tinyinfer_bindings
