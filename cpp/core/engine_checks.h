// engine_checks.h — the request checks every engine (CPU, CUDA) makes before it touches its state, so both
// refuse the same requests with the same messages.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "errors.h"
#include "sampling.h"  // kMaxTopLogprobs

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

// rewind(n) of the single sequence, `position` tokens long.
inline void check_single_rewind(int64_t n, int64_t position) {
  if (n < 0 || n > position)
    fail(ErrorKind::Request, "rewind: " + std::to_string(n) + " tokens to keep, the sequence holds " +
                                 std::to_string(position));
}

// ---- the sequence slots (docs/BATCH_CONTRACT.md part 2) ----

constexpr int64_t kMaxBatch = 1024;  // the most sequence slots an engine takes

inline void check_max_batch(int64_t max_batch) {
  if (max_batch < 1 || max_batch > kMaxBatch)
    fail(ErrorKind::Request, "max_batch must be in 1.." + std::to_string(kMaxBatch) + " (got " +
                                 std::to_string(max_batch) + ")");
}

// seq_rewind keeps n of the slot's `length` positions.
inline void check_rewind(int64_t slot, int64_t n, int64_t length) {
  if (n < 0 || n > length)
    fail(ErrorKind::Request, "seq_rewind: slot " + std::to_string(slot) + " holds " + std::to_string(length) +
                                 " positions; cannot keep " + std::to_string(n));
}

// seq_copy gives dst (another slot) the first n of src's `length` positions.
inline void check_copy(int64_t dst, int64_t src, int64_t n, int64_t length) {
  if (dst == src)
    fail(ErrorKind::Request, "seq_copy: source and destination are the same slot (" + std::to_string(src) + ")");
  if (n < 0 || n > length)
    fail(ErrorKind::Request, "seq_copy: slot " + std::to_string(src) + " holds " + std::to_string(length) +
                                 " positions; cannot copy " + std::to_string(n));
}

// seq_sample's top-logprob entries per row.
inline void check_top_logprobs(int64_t k) {
  if (k < 0 || k > kMaxTopLogprobs)
    fail(ErrorKind::Request, "top_logprobs must be in 0.." + std::to_string(kMaxTopLogprobs) + " (got " +
                                 std::to_string(k) + ")");
}

// `slot` must name one of the engine's max_batch slots.
inline void check_slot_index(int64_t slot, int64_t max_batch) {
  if (slot < 0 || slot >= max_batch)
    fail(ErrorKind::Request, "slot " + std::to_string(slot) + " does not exist (slots are 0.." +
                                 std::to_string(max_batch - 1) + ")");
}

// An existing slot that is open (seq_open gave it out and no seq_close took it back).
template <typename IsOpen>
void check_open_slot(int64_t slot, int64_t max_batch, const IsOpen& is_open) {
  check_slot_index(slot, max_batch);
  if (!is_open(slot)) fail(ErrorKind::Request, "slot " + std::to_string(slot) + " is not open");
}

// An open slot or a parked sequence (seq_park's id, max_batch and up): the calls that read a cache without running
// it (seq_copy's source, seq_length, kv_pages_held_by), seq_rewind (which shortens a parked one) and seq_close.
template <typename IsOpen, typename IsParked>
void check_held(int64_t id, int64_t max_batch, const IsOpen& is_open, const IsParked& is_parked) {
  if (id >= max_batch && is_parked(id)) return;
  if (id >= max_batch)
    fail(ErrorKind::Request, "slot " + std::to_string(id) + " does not exist (slots are 0.." +
                                 std::to_string(max_batch - 1) + ") and is not a parked sequence (seq_park)");
  check_open_slot(id, max_batch, is_open);
}

// The slots of one batched call (seq_step / seq_sample): at least one, each open, none twice; and each with
// logits to continue from (a prefill ran in it), since a step or a sample follows a sampled token.
template <typename IsOpen, typename HasLogits>
void check_batch_slots(const char* what, const int64_t* slots, int64_t n, int64_t max_batch, const IsOpen& is_open,
                       const HasLogits& has_logits) {
  if (n < 1) fail(ErrorKind::Request, std::string(what) + ": no slots given");
  std::vector<bool> listed((size_t)max_batch, false);
  for (int64_t i = 0; i < n; i++) {
    check_open_slot(slots[i], max_batch, is_open);
    if (listed[(size_t)slots[i]])
      fail(ErrorKind::Request, std::string(what) + ": slot " + std::to_string(slots[i]) + " is listed twice");
    listed[(size_t)slots[i]] = true;
    if (!has_logits(slots[i]))
      fail(ErrorKind::Request, std::string(what) + ": slot " + std::to_string(slots[i]) +
                                   " has no logits yet (seq_prefill it first)");
  }
}

// seq_prefill_many's request: at least one prompt; each slot open and listed once; each prompt non-empty, its
// ids in the vocabulary, and room for it after the slot's length(slot) positions.
template <typename IsOpen, typename Length>
void check_prefill_many(const int64_t* slots, const int32_t* const* tokens, const int64_t* lens, int64_t n,
                        int64_t max_batch, int64_t vocab, int64_t max_seq, const IsOpen& is_open,
                        const Length& length) {
  if (n < 1) fail(ErrorKind::Request, "seq_prefill_many: no slots given");
  std::vector<bool> listed((size_t)max_batch, false);
  for (int64_t i = 0; i < n; i++) {
    check_open_slot(slots[i], max_batch, is_open);
    if (listed[(size_t)slots[i]])
      fail(ErrorKind::Request, "seq_prefill_many: slot " + std::to_string(slots[i]) + " is listed twice");
    listed[(size_t)slots[i]] = true;
    if (lens[i] < 1)
      fail(ErrorKind::Request, "seq_prefill_many: the prompt for slot " + std::to_string(slots[i]) + " is empty");
    check_tokens(tokens[i], lens[i], vocab);
    check_room(length(slots[i]), lens[i], max_seq);
  }
}

// seq_mixed's two parts name different slots (a slot is either stepped or prefilled in one call).
inline void check_mixed_disjoint(const int64_t* step_slots, int64_t n_step, const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n_step; i++)
    for (int64_t j = 0; j < n; j++)
      if (step_slots[i] == slots[j])
        fail(ErrorKind::Request, "seq_mixed: slot " + std::to_string(slots[j]) + " is both stepped and prefilled");
}

}  // namespace ti
