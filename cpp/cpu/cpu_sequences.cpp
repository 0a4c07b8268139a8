// cpu_sequences.cpp — the CPU engine's sequence slots (docs/BATCH_CONTRACT.md part 2): open / close, prefill chunks,
// one batched decode step, sampling. The forward pass is the single sequence's (cpu_engine.cpp run()), with each
// row naming its slot's cache, so a slot's numbers are those it would have alone.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "../core/engine_checks.h"
#include "../core/errors.h"
#include "cpu_engine.h"

namespace ti {

const CpuEngine::Slot& CpuEngine::open_slot(int64_t slot) const {
  check_open_slot(slot, max_batch(), [&](int64_t s) { return is_open(s); });
  return *slots_[(size_t)slot];
}

CpuEngine::Slot& CpuEngine::open_slot(int64_t slot) {
  return const_cast<Slot&>(static_cast<const CpuEngine*>(this)->open_slot(slot));
}

const CpuEngine::Slot& CpuEngine::held(int64_t id) const {
  check_held(id, max_batch(), [&](int64_t s) { return is_open(s); }, [&](int64_t i) { return is_parked(i); });
  return id < max_batch() ? *slots_[(size_t)id] : *parked_[(size_t)(id - max_batch())];
}

void CpuEngine::check_batch(const char* what, const int64_t* slots, int64_t n) const {
  check_batch_slots(
      what, slots, n, max_batch(), [&](int64_t s) { return is_open(s); },
      [&](int64_t s) { return !slots_[(size_t)s]->logits.empty(); });
}

int64_t CpuEngine::seq_open() {
  auto free = std::find(slots_.begin(), slots_.end(), nullptr);
  if (free == slots_.end())
    fail(ErrorKind::Request, "all " + std::to_string(max_batch()) + " sequence slots are open (max_batch)");
  *free = std::make_unique<Slot>(cfg_);
  return (int64_t)(free - slots_.begin());
}

void CpuEngine::seq_close(int64_t slot) {
  slot_pages_ -= held(slot).kv.owned();  // (pages another slot shares stay held)
  // its cache, logits and history go with it
  (slot < max_batch() ? slots_[(size_t)slot] : parked_[(size_t)(slot - max_batch())]).reset();
}

int64_t CpuEngine::seq_length(int64_t slot) const { return (int64_t)held(slot).tokens.size(); }

int64_t CpuEngine::seq_park(int64_t slot) {
  open_slot(slot);
  auto free = std::find(parked_.begin(), parked_.end(), nullptr);
  if (free == parked_.end()) free = parked_.insert(parked_.end(), nullptr);
  *free = std::move(slots_[(size_t)slot]);  // (its pages stay counted: still held)
  std::vector<float>().swap((*free)->logits);  // (nothing runs in it: only its cache and tokens are read)
  return max_batch() + (int64_t)(free - parked_.begin());
}

void CpuEngine::seq_rewind(int64_t slot, const int32_t* tokens, int64_t n) {
  Slot& s = const_cast<Slot&>(held(slot));  // (an open slot or a parked sequence)
  const bool parked = slot >= max_batch();
  check_rewind(slot, n, (int64_t)s.tokens.size());
  if (!std::equal(tokens, tokens + n, s.tokens.begin()))
    fail(ErrorKind::Request, "seq_rewind: slot " + std::to_string(slot) + " does not hold those " +
                                 std::to_string(n) + " tokens");
  const int64_t keep = KVCache::pages_for(n);
  // Cut inside a page others share, an open slot's next write would land in it: copied first. A parked sequence is
  // never written, so it keeps sharing that page.
  const bool unshare = !parked && n % kCpuKvPageSize != 0 && s.kv.shared(keep - 1);
  if (unshare && kv_pages_free() + s.kv.owned(keep) < 1)
    fail(ErrorKind::Request, "seq_rewind: position " + std::to_string(n) + "'s KV page is shared and must be "
                             "copied, and none of the " + std::to_string(kv_pages_total()) + " pages is free");
  s.tokens.resize((size_t)n);
  slot_pages_ -= s.kv.owned(keep);
  s.kv.k_pages.resize((size_t)keep);
  s.kv.v_pages.resize((size_t)keep);
  if (unshare && s.kv.unshare(keep - 1)) slot_pages_++;  // (its next write lands in that page)
  if (parked) return;  // (no logits and no history: a copy from it starts its own)
  s.logits.clear();
  s.history.clear();
  for (int64_t t = 0; t < n; t++) s.history.add_prompt(tokens[t]);
}

int64_t CpuEngine::seq_rewind_frees(int64_t slot, int64_t n) const {
  const Slot& s = held(slot);
  check_rewind(slot, n, (int64_t)s.tokens.size());
  const int64_t keep = KVCache::pages_for(n);
  const bool unshare = slot < max_batch() && n % kCpuKvPageSize != 0 && s.kv.shared(keep - 1);
  return s.kv.owned(keep) - (unshare ? 1 : 0);
}

void CpuEngine::seq_copy(int64_t dst, int64_t src, const int32_t* tokens, int64_t n) {
  const Slot& s = held(src);
  Slot& d = open_slot(dst);
  check_copy(dst, src, n, (int64_t)s.tokens.size());
  if (!std::equal(tokens, tokens + n, s.tokens.begin()))
    fail(ErrorKind::Request, "seq_copy: sequence " + std::to_string(src) + " does not hold those " + std::to_string(n) +
                                 " tokens");
  // The whole pages below n shared (neither slot writes below its length), the last, partly filled one copied
  const int64_t pages = KVCache::pages_for(n);
  if (n % kCpuKvPageSize != 0 && kv_pages_free() + d.kv.owned() < 1)
    fail(ErrorKind::Request, "seq_copy: the last page of " + std::to_string(n) + " positions is copied and none of "
                             "the " + std::to_string(kv_pages_total()) + " KV pages is free");
  slot_pages_ -= d.kv.owned();
  d.kv.k_pages.assign(s.kv.k_pages.begin(), s.kv.k_pages.begin() + pages);
  d.kv.v_pages.assign(s.kv.v_pages.begin(), s.kv.v_pages.begin() + pages);
  if (n % kCpuKvPageSize != 0 && d.kv.unshare(pages - 1)) slot_pages_++;
  d.tokens.assign(tokens, tokens + n);
  d.logits.clear();
  d.history.clear();
  for (int64_t t = 0; t < n; t++) d.history.add_prompt(tokens[t]);
}

void CpuEngine::seq_mark_generated(int64_t slot, const int32_t* tokens, int64_t n) {
  Slot& s = open_slot(slot);
  if (n > 0) check_tokens(tokens, n, cfg_.vocab);
  for (int64_t i = 0; i < n; i++) s.history.add_generated(tokens[i]);
}

int64_t CpuEngine::kv_pages_held_by(const int64_t* slots, int64_t n) const {
  std::vector<int64_t> distinct;  // (a slot listed twice counts once)
  for (int64_t i = 0; i < n; i++) {
    held(slots[i]);  // (checked: an open slot or a parked sequence)
    if (std::find(distinct.begin(), distinct.end(), slots[i]) == distinct.end()) distinct.push_back(slots[i]);
  }
  std::unordered_map<const void*, int64_t> holds;  // page -> how many of these slots hold it
  for (int64_t s : distinct)
    for (const KVCache::Page& p : held(s).kv.k_pages) holds[p.get()]++;
  int64_t only = 0;
  for (int64_t s : distinct)  // (each page counted once: at its first holder among them, then forgotten)
    for (const KVCache::Page& p : held(s).kv.k_pages) {
      auto it = holds.find(p.get());
      if (it == holds.end()) continue;
      only += it->second == p.use_count();
      holds.erase(it);
    }
  return only;
}

void CpuEngine::seq_prefill(int64_t slot, const int32_t* tokens, int64_t n, float* all_logits) {
  Slot& s = open_slot(slot);
  check_tokens(tokens, n, cfg_.vocab);
  const int64_t pos0 = (int64_t)s.tokens.size();
  check_room(pos0, n, max_seq_);
  require_pages("seq_prefill", nullptr, 0, &slot, &n, 1);

  slot_pages_ += s.kv.reserve(pos0 + n);
  rows_.resize((size_t)n);
  for (int64_t t = 0; t < n; t++) rows_[t] = {&s.kv, pos0 + t};
  run(tokens, rows_.data(), n, all_logits ? 0 : n - 1, all_logits);
  const int64_t last = all_logits ? (n - 1) * cfg_.vocab : 0;  // (the last row of what run() computed)
  s.logits.assign(logits_buf_.begin() + last, logits_buf_.begin() + last + cfg_.vocab);
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
  for (int64_t t = 0; t < n; t++) s.history.add_prompt(tokens[t]);
}

void CpuEngine::seq_prefill_many(const int64_t* slots, const int32_t* const* tokens, const int64_t* lens,
                                 int64_t n) {
  check_prefill_many(
      slots, tokens, lens, n, max_batch(), cfg_.vocab, max_seq_, [&](int64_t s) { return is_open(s); },
      [&](int64_t s) { return (int64_t)slots_[(size_t)s]->tokens.size(); });
  require_pages("seq_prefill_many", nullptr, 0, slots, lens, n);
  for (int64_t i = 0; i < n; i++) seq_prefill(slots[i], tokens[i], lens[i]);
}

void CpuEngine::require_pages(const char* what, const int64_t* step_slots, int64_t n_step, const int64_t* slots,
                              const int64_t* lens, int64_t n) const {
  int64_t need = 0;
  for (int64_t i = 0; i < n_step + n; i++) {
    const Slot& s = *slots_[(size_t)(i < n_step ? step_slots[i] : slots[i - n_step])];
    const int64_t grown = (int64_t)s.tokens.size() + (i < n_step ? 1 : lens[i - n_step]);
    need += std::max<int64_t>(KVCache::pages_for(grown) - s.kv.pages(), 0);
  }
  if (need > kv_pages_free())
    fail(ErrorKind::Request, std::string("KV pages exhausted: ") + what + " needs " + std::to_string(need) +
                                 " more pages and " + std::to_string(kv_pages_free()) + " of " +
                                 std::to_string(kv_pages_total()) + " are free (parked sequences hold the rest: "
                                 "seq_close them)");
}

void CpuEngine::check_step(const char* what, const int64_t* slots, const int32_t* tokens, int64_t n) const {
  check_batch(what, slots, n);
  check_tokens(tokens, n, cfg_.vocab);
  for (int64_t i = 0; i < n; i++) {
    const int64_t len = (int64_t)slots_[(size_t)slots[i]]->tokens.size();
    if (len + 1 > max_seq_)
      fail(ErrorKind::Request, std::string(what) + ": slot " + std::to_string(slots[i]) + " holds " +
                                   std::to_string(len) + " tokens, max_seq_len=" + std::to_string(max_seq_));
  }
}

void CpuEngine::seq_mixed(const int64_t* step_slots, const int32_t* step_tokens, int64_t n_step, const int64_t* slots,
                          const int32_t* const* tokens, const int64_t* lens, int64_t n) {
  check_step("seq_mixed", step_slots, step_tokens, n_step);
  check_prefill_many(
      slots, tokens, lens, n, max_batch(), cfg_.vocab, max_seq_, [&](int64_t s) { return is_open(s); },
      [&](int64_t s) { return (int64_t)slots_[(size_t)s]->tokens.size(); });
  check_mixed_disjoint(step_slots, n_step, slots, n);
  require_pages("seq_mixed", step_slots, n_step, slots, lens, n);
  seq_step(step_slots, step_tokens, n_step);
  seq_prefill_many(slots, tokens, lens, n);
}

void CpuEngine::seq_step(const int64_t* slots, const int32_t* tokens, int64_t n) {
  check_step("seq_step", slots, tokens, n);
  require_pages("seq_step", slots, n, nullptr, nullptr, 0);

  // All n tokens in one forward pass (the matrices read once per step), each row in its own slot's cache.
  rows_.resize((size_t)n);
  for (int64_t i = 0; i < n; i++) {
    Slot& s = *slots_[(size_t)slots[i]];
    const int64_t pos = (int64_t)s.tokens.size();
    slot_pages_ += s.kv.reserve(pos + 1);
    rows_[i] = {&s.kv, pos};
  }
  run(tokens, rows_.data(), n, 0, nullptr);
  for (int64_t i = 0; i < n; i++) {
    Slot& s = *slots_[(size_t)slots[i]];
    std::memcpy(s.logits.data(), &logits_buf_[(size_t)(i * cfg_.vocab)], (size_t)cfg_.vocab * sizeof(float));
    s.tokens.push_back(tokens[i]);
  }
}

BatchSample CpuEngine::seq_sample(const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps,
                                  int64_t n, int k) {
  check_batch("seq_sample", slots, n);
  check_top_logprobs(k);
  for (int64_t i = 0; i < n; i++) validate(cfgs[i], cfg_.vocab);

  BatchSample out;
  out.k = k;
  out.tokens.resize((size_t)n);
  out.logprobs.resize((size_t)n);
  // Rows shorter than k (a vocabulary smaller than k) padded with id -1, logprob -inf.
  out.top_ids.assign((size_t)(n * k), -1);
  out.top_logprobs.assign((size_t)(n * k), -INFINITY);
  for (int64_t i = 0; i < n; i++) {
    Slot& s = *slots_[(size_t)slots[i]];
    const SampleResult r = sample_row(s.logits.data(), cfg_.vocab, cfgs[i], steps[i], s.history, k, scratch_,
                                      scratch_ids_);
    s.history.add_generated(r.token);
    out.tokens[i] = r.token;
    out.logprobs[i] = r.logprob;
    const size_t got = std::min(r.top_ids.size(), (size_t)k);
    std::copy_n(r.top_ids.begin(), got, out.top_ids.begin() + i * k);
    std::copy_n(r.top_logprobs.begin(), got, out.top_logprobs.begin() + i * k);
  }
  return out;
}

}  // namespace ti
