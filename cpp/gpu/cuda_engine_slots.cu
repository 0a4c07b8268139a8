// cuda_engine_slots.cu — the GPU engine's sequence slots (docs/BATCH_CONTRACT.md §2; cuda_engine.h): many sequences
// in one KV page pool, prefilled one at a time or many at once (the batched prefill through the slots' page
// tables), stepped together (batch_step.h: one graph per bucket of the batch size), sampled together
// (cuda::sample_rows).
//
// Host state per slot: open, its length, whether it has logits and which row of bbuf_.logits holds them, its
// KvSequence (pages from the pool shared with the single sequence). Device state per slot: its page table (a
// row of bbuf_.tables), its history for the penalties (a row of seen_ and counts_).
//
// Logits stay where they are computed: a step's row r (the LM head's output) for the slot stepped in row r, the
// slot's own row (bbuf_.slot_row) after a prefill. The sampler and seq_logits read that row; nothing is
// scattered to slots or gathered back. The one move: a step overwrites rows 0..bucket-1 (padding rows too), so
// a slot whose logits lie in one of them and which is not in that step gets them copied to its own row first
// (run_rows; a scheduler that steps the same slots each time never pays it).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <unordered_map>

#include "../../cuda/batch_rows.cuh"
#include "../../cuda/common.cuh"
#include "../../cuda/sampling.cuh"
#include "../core/engine_checks.h"
#include "../core/errors.h"
#include "cuda_engine.h"

namespace ti {


int64_t CudaEngine::default_pool_pages() const {
  const int P = opt_.kv_page_size;
  const int64_t one = (max_seq_ + P - 1) / P;  // one max_seq_len sequence
  const size_t page_bytes = 2 * sizeof(__half) * (size_t)cfg_.n_layers * cfg_.n_kv_heads * P * cfg_.head_dim;
  size_t free_b = 0, total_b = 0;
  TI_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const int64_t cap = (int64_t)(free_b / 2 / page_bytes);
  return std::max(one, std::min(opt_.max_batch * one, cap));
}

void CudaEngine::allocate_batch() {
  const int B = (int)opt_.max_batch;
  const size_t V = (size_t)cfg_.vocab;
  using Kind = DeviceArena::Kind;
  bbuf_ = BatchBuffers::allocate(cfg_, *weights_, B, max_seq_, *pool_, arena_, stream_);
  batch_ = std::make_unique<BatchStep>(
      cfg_, *weights_, dbuf_, bbuf_, *gemm_, plan_,
      BatchStepOptions{opt_.batch_mma_max, opt_.batch_mma_f16_max, opt_.batch_gemv_f16_max,
                       opt_.batch_gemv_quant_max, opt_.batch_attn_span,
                       opt_.batch_attn_heads, opt_.batch_mma_m_tiles, opt_.batch_mma_f16_qkvo_max,
                       opt_.batch_mma_f16_down_max, opt_.batch_mma_ring,
                       opt_.batch_down_k_slices, opt_.batch_one_row_plan, opt_.batch_act8_fused});
  for (int b = 1; b < B; b *= 2) buckets_.push_back(b);
  buckets_.push_back(B);
  g_batch_.assign(buckets_.size(), nullptr);
  g_draft_.assign(buckets_.size(), nullptr);
  slots_.resize((size_t)B);
  for (Slot& sl : slots_) sl.kv = std::make_unique<KvSequence>(*pool_, max_seq_);
  seen_ = arena_.alloc_n<unsigned char>(B * V, Kind::Scratch);
  counts_ = arena_.alloc_n<int>(B * V, Kind::Scratch);
  TI_CUDA_CHECK(cudaMemsetAsync(seen_, 0, B * V, stream_));
  TI_CUDA_CHECK(cudaMemsetAsync(counts_, 0, B * V * sizeof(int), stream_));
  sample_scratch_ = arena_.alloc_n<float>(B * V, Kind::Scratch);
  // the rows, then up to kMaxLogitBias logit-bias entries a row, then up to one allowed-token mask a row (both
  // packed: only the rows that have them use any)
  const size_t in_bytes = (size_t)B * (sizeof(cuda::RowSampling) + kMaxLogitBias * sizeof(cuda::LogitBias) +
                                       (size_t)mask_words(V) * sizeof(uint32_t));
  d_sample_in_ = arena_.alloc(in_bytes, Kind::Scratch);
  h_sample_in_ = arena_.alloc_pinned(in_bytes);
  TI_CUDA_CHECK(cudaEventCreateWithFlags(&sample_in_read_, cudaEventDisableTiming));
  TI_CUDA_CHECK(cudaEventCreateWithFlags(&sampled_, cudaEventDisableTiming));
  const size_t out_bytes = (size_t)B * (1 + cuda::kMaxTopK) * (sizeof(int) + sizeof(float));
  d_sample_out_ = arena_.alloc(out_bytes, Kind::Scratch);
  h_sample_out_ = arena_.alloc_pinned(out_bytes);
  d_prompt_ = arena_.alloc_n<int>((size_t)max_seq_, Kind::Scratch);
}

void CudaEngine::check_slot(int64_t slot) const {
  check_open_slot(slot, (int64_t)slots_.size(), [&](int64_t i) { return slots_[(size_t)i].open; });
}

int64_t CudaEngine::seq_open() {
  for (size_t i = 0; i < slots_.size(); i++) {
    Slot& sl = slots_[i];
    if (sl.open) continue;
    restart(i, nullptr, 0);
    sl.open = true;
    return (int64_t)i;
  }
  fail(ErrorKind::Request, "all " + std::to_string(slots_.size()) + " sequence slots are open (max_batch)");
}

std::pair<const KvSequence*, int64_t> CudaEngine::held(int64_t id) const {
  const int64_t B = (int64_t)slots_.size();
  check_held(id, B, [&](int64_t s) { return slots_[(size_t)s].open; }, [&](int64_t i) {
    return i - B < (int64_t)parked_.size() && parked_[(size_t)(i - B)].kv != nullptr;
  });
  if (id < B) return {slots_[(size_t)id].kv.get(), slots_[(size_t)id].length};
  const Parked& p = parked_[(size_t)(id - B)];
  return {p.kv.get(), p.length};
}

int64_t CudaEngine::seq_park(int64_t slot) {
  check_slot(slot);
  Slot& sl = slots_[(size_t)slot];
  auto free = std::find_if(parked_.begin(), parked_.end(), [](const Parked& p) { return p.kv == nullptr; });
  if (free == parked_.end()) free = parked_.insert(parked_.end(), Parked{});
  auto fresh = std::make_unique<KvSequence>(*pool_, max_seq_);  // (first: a throw leaves the slot as it was)
  free->length = sl.length;
  free->kv = std::move(sl.kv);  // (its pages stay held; work in flight in them is stream-ordered before any copy)
  sl.kv = std::move(fresh);     // (its device table keeps stale entries: the next grow uploads from entry 0)
  restart(slot, nullptr, 0);
  sl.open = false;
  return (int64_t)slots_.size() + (int64_t)(free - parked_.begin());
}

void CudaEngine::seq_close(int64_t slot) {
  if (slot >= (int64_t)slots_.size()) {  // a parked sequence
    held(slot);
    Parked& p = parked_[(size_t)(slot - (int64_t)slots_.size())];
    p.kv->release(*pool_);
    p.kv.reset();
    p.length = 0;
    return;
  }
  check_slot(slot);
  Slot& sl = slots_[(size_t)slot];
  sl.kv->release(*pool_);  // (its device table keeps stale entries: nothing reads past its length)
  restart(slot, nullptr, 0);
  sl.open = false;
}

int64_t CudaEngine::seq_length(int64_t slot) const { return held(slot).second; }

void CudaEngine::seq_rewind(int64_t slot, const int32_t* tokens, int64_t n) {
  if (slot >= (int64_t)slots_.size()) {  // a parked sequence: never written, so a page it is cut inside stays shared
    held(slot);
    Parked& p = parked_[(size_t)(slot - (int64_t)slots_.size())];
    check_rewind(slot, n, p.length);
    if (n > 0) check_tokens(tokens, n, cfg_.vocab);
    p.kv->shrink(*pool_, n);  // (a copy from it in flight is stream-ordered before whoever takes the pages next)
    p.length = n;
    return;
  }
  check_slot(slot);
  Slot& sl = slots_[(size_t)slot];
  check_rewind(slot, n, sl.length);
  if (n > 0) check_tokens(tokens, n, cfg_.vocab);
  // Cut inside a page others share (a prefix seq_copy gave), the slot's next write would land in it: the page
  // becomes its own first, which takes a free page (after those the cut gives back).
  const int64_t j = n / pool_->page_size();
  const bool unshare = n % pool_->page_size() != 0 && pool_->refs(sl.kv->table()[(size_t)j]) > 1;
  if (unshare && pool_->free_pages() + sl.kv->owned_pages(*pool_, j + 1) < 1)
    fail(ErrorKind::Request, "seq_rewind: position " + std::to_string(n) + "'s KV page is shared and must be "
                             "copied, and none of the " + std::to_string(pool_->n_pages()) + " pages is free");
  // (work in flight in the dropped pages, a step launched ahead, is stream-ordered before whoever takes them next)
  sl.kv->shrink(*pool_, n);
  if (unshare) {
    const int32_t from = sl.kv->unshare(*pool_, j);  // (before the table entry it changes is read)
    copy_page(from, sl.kv->table()[(size_t)j]);
    upload_table(slot, j);
  }
  restart(slot, tokens, n);
}

int64_t CudaEngine::seq_rewind_frees(int64_t slot, int64_t n) const {
  if (slot >= (int64_t)slots_.size()) {  // a parked sequence (no copy of a shared page: see seq_rewind)
    const auto [kv, length] = held(slot);
    check_rewind(slot, n, length);
    return kv->owned_pages(*pool_, pool_->pages_for(n));
  }
  check_slot(slot);
  const Slot& sl = slots_[(size_t)slot];
  check_rewind(slot, n, sl.length);
  const int64_t j = n / pool_->page_size();
  const bool unshare = n % pool_->page_size() != 0 && pool_->refs(sl.kv->table()[(size_t)j]) > 1;
  return sl.kv->owned_pages(*pool_, pool_->pages_for(n)) - (unshare ? 1 : 0);
}

void CudaEngine::seq_copy(int64_t dst, int64_t src, const int32_t* tokens, int64_t n) {
  const auto [s_kv, s_length] = held(src);
  check_slot(dst);
  Slot& d = slots_[(size_t)dst];
  check_copy(dst, src, n, s_length);
  if (n > 0) check_tokens(tokens, n, cfg_.vocab);
  // The whole pages of the prefix are shared (src's, read by both; neither writes below its length), the last
  // one, partly filled, copied: dst writes into it next.
  const int64_t whole = n / pool_->page_size(), part = n % pool_->page_size() != 0;
  if (part > pool_->free_pages() + d.kv->owned_pages(*pool_))
    fail(ErrorKind::Request, "seq_copy: the last page of " + std::to_string(n) + " positions is copied and none of "
                             "the " + std::to_string(pool_->n_pages()) +
                             " KV pages is free (CudaOptions.kv_pool_pages)");
  d.kv->share(*pool_, *s_kv, whole);
  d.kv->grow(*pool_, n);
  upload_table(dst, 0);
  if (part) copy_page(s_kv->table()[(size_t)whole], d.kv->table()[(size_t)whole]);
  restart(dst, tokens, n);
}

// The slot holds tokens[0..n) and nothing else: its history restarts as them, as prompt (the penalty rows
// cleared on the stream; a pageable copy is staged before it returns: no sync), no logits.
void CudaEngine::restart(int64_t slot, const int32_t* tokens, int64_t n) {
  const size_t V = (size_t)cfg_.vocab;
  TI_CUDA_CHECK(cudaMemsetAsync(seen_ + (size_t)slot * V, 0, V, stream_));
  TI_CUDA_CHECK(cudaMemsetAsync(counts_ + (size_t)slot * V, 0, V * sizeof(int), stream_));
  if (n > 0) mark_prompt(slot, tokens, n);
  Slot& sl = slots_[(size_t)slot];
  sl.has_logits = false;
  sl.logits_row = -1;
  sl.length = n;
}

// Every layer's part of a page is one run of page_elems halves, layers kv_layer_elems apart (cuda/kv_layout.cuh):
// one 2D copy (rows = layers) for the keys and one for the values, on the stream (after any work in flight).
void CudaEngine::copy_page(int32_t from, int32_t to) {
  const size_t page_elems = (size_t)cfg_.n_kv_heads * pool_->page_size() * cfg_.head_dim;
  const size_t pitch = dbuf_.kv_layer_elems * sizeof(__half);
  for (__half* base : {dbuf_.k_pages, dbuf_.v_pages})
    TI_CUDA_CHECK(cudaMemcpy2DAsync(base + (size_t)to * page_elems, pitch, base + (size_t)from * page_elems, pitch,
                                    page_elems * sizeof(__half), (size_t)cfg_.n_layers, cudaMemcpyDeviceToDevice,
                                    stream_));
}

int64_t CudaEngine::kv_pages_held_by(const int64_t* slots, int64_t n) const {
  // (the prefix cache asks after the steps that change its caches: a flat count over the pool's pages, no hashing)
  std::vector<int32_t> holds((size_t)pool_->n_pages());  // page -> how many of these sequences' tables hold it
  std::vector<const KvSequence*> seqs;
  std::vector<bool> seen(slots_.size() + parked_.size());
  for (int64_t i = 0; i < n; i++) {
    const KvSequence* kv = held(slots[i]).first;
    if (seen[(size_t)slots[i]]) continue;  // (a sequence listed twice counts once)
    seen[(size_t)slots[i]] = true;
    seqs.push_back(kv);
    for (int32_t p : kv->table()) holds[(size_t)p]++;
  }
  int64_t only = 0;
  for (const KvSequence* kv : seqs)
    for (int32_t p : kv->table())
      if (holds[(size_t)p] > 0) {  // (each page once: at its first holder among them)
        only += holds[(size_t)p] == pool_->refs(p);
        holds[(size_t)p] = 0;
      }
  return only;
}

std::vector<float> CudaEngine::seq_logits(int64_t slot) const {
  check_slot(slot);
  if (!slots_[(size_t)slot].has_logits) return {};  // (as the CPU engine: empty before the first prefill)
  std::vector<float> out((size_t)cfg_.vocab);
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  TI_CUDA_CHECK(cudaMemcpy(out.data(), bbuf_.logits + (size_t)slots_[(size_t)slot].logits_row * bbuf_.ld_v,
                           out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return out;
}

// Pages for positions [0, positions) of the slot; the changed entries of its device table uploaded ahead of the
// work that reads them (stream order). All or nothing (KvSequence::grow).
void CudaEngine::slot_reserve(int64_t slot, int64_t positions) {
  const int64_t first = slots_[(size_t)slot].kv->grow(*pool_, positions);
  upload_table(slot, first);
}

void CudaEngine::upload_table(int64_t slot, int64_t first) {
  const KvSequence& kv = *slots_[(size_t)slot].kv;
  const int64_t n = kv.pages() - first;
  if (n > 0)  // (from pageable memory: staged before the call returns)
    TI_CUDA_CHECK(cudaMemcpyAsync(bbuf_.tables + (size_t)slot * bbuf_.table_stride + first, kv.table().data() + first,
                                  (size_t)n * sizeof(int), cudaMemcpyHostToDevice, stream_));
}

void CudaEngine::seq_prefill(int64_t slot, const int32_t* tokens, int64_t n, float* all_logits) {
  check_slot(slot);
  check_tokens(tokens, n, cfg_.vocab);
  Slot& sl = slots_[(size_t)slot];
  check_room(sl.length, n, max_seq_);
  slot_reserve(slot, sl.length + n);  // (throws before anything is launched)
  if (prefill_) {  // returns once launched, as seq_prefill_many; the marks from each chunk's device tokens
    const PrefillTarget to{bbuf_.tables + (size_t)slot * bbuf_.table_stride, bbuf_.x, bbuf_.slot_row(slot)};
    for (int64_t c0 = 0; c0 < n; c0 += prefill_->rows()) {
      const int T = (int)std::min<int64_t>(prefill_->rows(), n - c0);
      prefill_->run_chunk(tokens + c0, T, (int)(sl.length + c0), all_logits, c0, to);
      cuda::mark_tokens(seen_ + (size_t)slot * cfg_.vocab, pbuf_.tokens, T, stream_);
    }
    sl.logits_row = bbuf_.max_rows + (int)slot;
    if (all_logits) TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (the rows' copies to the host have landed)
  } else {
    prefill_by_token(slot, tokens, n, all_logits);
    mark_prompt(slot, tokens, n);
    TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (d_prompt_ and the caller's tokens are free again)
  }
  sl.length += n;
  sl.has_logits = true;
}

// No batched prefill (CudaOptions, or a head dim it lacks): a token at a time through the batched step. all_logits
// (may be null): each token's logits row copied out behind its step (the caller syncs before reading them).
void CudaEngine::prefill_by_token(int64_t slot, const int32_t* tokens, int64_t n, float* all_logits) {
  const int64_t length = slots_[(size_t)slot].length;
  const size_t V = (size_t)cfg_.vocab;
  for (int64_t i = 0; i < n; i++) {
    const int64_t pos = length + i;
    run_rows(tokens + i, &pos, &slot, 1);
    if (all_logits)
      TI_CUDA_CHECK(cudaMemcpyAsync(all_logits + (size_t)i * V,
                                    bbuf_.logits + (size_t)slots_[(size_t)slot].logits_row * bbuf_.ld_v,
                                    V * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  }
}

// (d_prompt_ may be reused right after: stream order; the pageable copy is staged before it returns.)
void CudaEngine::seq_mark_generated(int64_t slot, const int32_t* tokens, int64_t n) {
  check_slot(slot);
  if (n > max_seq_)
    fail(ErrorKind::Request, "seq_mark_generated: " + std::to_string(n) + " tokens exceed max_seq_len=" +
                                 std::to_string(max_seq_));
  if (n == 0) return;
  check_tokens(tokens, n, cfg_.vocab);
  TI_CUDA_CHECK(cudaMemcpyAsync(d_prompt_, tokens, (size_t)n * sizeof(int), cudaMemcpyHostToDevice, stream_));
  const size_t V = (size_t)cfg_.vocab;
  cuda::count_tokens(seen_ + (size_t)slot * V, counts_ + (size_t)slot * V, d_prompt_, (int)n, stream_);
}

// The prompt joins the slot's repetition-penalty set. (d_prompt_ may be reused right after: stream order.)
void CudaEngine::mark_prompt(int64_t slot, const int32_t* tokens, int64_t n) {
  TI_CUDA_CHECK(cudaMemcpyAsync(d_prompt_, tokens, (size_t)n * sizeof(int), cudaMemcpyHostToDevice, stream_));
  cuda::mark_tokens(seen_ + (size_t)slot * cfg_.vocab, d_prompt_, (int)n, stream_);
}

// Pages a step of these slots takes from the pool (and room for one more position in each).
int64_t CudaEngine::step_pages(const int64_t* slots, int64_t n) const {
  int64_t need = 0;
  for (int64_t i = 0; i < n; i++) {
    const Slot& sl = slots_[(size_t)slots[i]];
    check_room(sl.length, 1, max_seq_);
    need += pool_->pages_for(sl.length + 1) - sl.kv->pages();
  }
  return need;
}

// Pages prompts of lens[i] tokens in slots[i] take from the pool.
int64_t CudaEngine::prompt_pages(const int64_t* slots, const int64_t* lens, int64_t n) const {
  int64_t need = 0;
  for (int64_t i = 0; i < n; i++) {
    const Slot& sl = slots_[(size_t)slots[i]];
    need += pool_->pages_for(sl.length + lens[i]) - sl.kv->pages();
  }
  return need;
}

// A Request error, before anything changed, when the pool lacks `need` pages ("<what> N more pages ...").
void CudaEngine::require_pages(int64_t need, const char* what) const {
  if (need > pool_->free_pages())
    fail(ErrorKind::Request, std::string("KV cache pool exhausted: ") + what + " " + std::to_string(need) +
                                 " more pages and the pool has " + std::to_string(pool_->free_pages()) + " free of " +
                                 std::to_string(pool_->n_pages()) + " (CudaOptions.kv_pool_pages)");
}

// Every prompt's tokens one after the other, cut into passes of prefill_->rows() tokens (a prompt that does not
// fit the rest of a pass continues at the start of the next: a chunk continuation, like a long prompt's). Returns
// once launched, like seq_step (rule 4 of docs/BATCH_CONTRACT.md): the scheduler's next call, the sample, is
// queued behind the passes and launches the next step the moment they end, with no host round trip between.
// The prompts that finish in a pass get their logits from one LM-head GEMM over their last rows (into the
// pass's logits scratch, then each row to its slot's own row), not a GEMV each: one head read per pass (an fp16
// head; a quantized one keeps the GEMV). They join the penalty sets from the pass's own device tokens (no copy
// from the caller's memory).
void CudaEngine::seq_prefill_many(const int64_t* slots, const int32_t* const* tokens, const int64_t* lens,
                                  int64_t n) {
  check_prefill_many(
      slots, tokens, lens, n, (int64_t)slots_.size(), cfg_.vocab, max_seq_,
      [&](int64_t i) { return slots_[(size_t)i].open; }, [&](int64_t i) { return slots_[(size_t)i].length; });
  require_pages(prompt_pages(slots, lens, n), "these prompts need");  // all slots grow, or none
  for (int64_t i = 0; i < n; i++) slot_reserve(slots[i], slots_[(size_t)slots[i]].length + lens[i]);
  if (prefill_) {
    const int rows = prefill_->rows();
    const size_t V = (size_t)cfg_.vocab, ld = (size_t)pbuf_.ld_v;
    std::vector<PrefillSegment> pass;
    std::vector<int64_t> pass_slots;  // per segment
    int used = 0, finished = 0;
    // A quantized head would be dequantized whole for the GEMM on every pass that finishes a prompt: more bytes
    // than a GEMV each for the few prompts a serving pass finishes. fp16: one GEMM.
    const bool gather = weights_->lm_head.fmt == WFormat::F16;
    auto run = [&] {
      prefill_->run_many(pass.data(), (int)pass.size(), bbuf_.tables, pbuf_.logits);
      for (size_t j = 0, row = 0; j < pass.size(); row += (size_t)pass[j].T, j++) {
        cuda::mark_tokens(seen_ + (size_t)pass_slots[j] * V, pbuf_.tokens + row, pass[j].T, stream_);
        if (pass[j].logits_row >= 0)  // its row of the gathered GEMM -> the slot's own row
          TI_CUDA_CHECK(cudaMemcpyAsync(bbuf_.slot_row(pass_slots[j]),
                                        pbuf_.logits + (size_t)pass[j].logits_row * ld, V * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream_));
      }
      pass.clear();
      pass_slots.clear();
      used = finished = 0;
    };
    for (int64_t i = 0; i < n; i++) {
      const int64_t slot = slots[i], length = slots_[(size_t)slot].length;
      for (int64_t off = 0; off < lens[i];) {
        PrefillSegment sg;
        sg.T = (int)std::min<int64_t>(lens[i] - off, rows - used);
        sg.tokens = tokens[i] + off;
        sg.pos0 = (int)(length + off);
        sg.table_offset = slot * bbuf_.table_stride;
        off += sg.T;
        if (off == lens[i]) {  // the prompt's last row: its logits become the slot's
          if (gather && finished < pbuf_.logit_rows) {
            sg.logits_row = finished++;
          } else {  // the GEMV of the decode, as one alone (a quantized head; more than the scratch's rows)
            sg.x = bbuf_.x;
            sg.logits = bbuf_.slot_row(slot);
          }
        }
        pass.push_back(sg);
        pass_slots.push_back(slot);
        used += sg.T;
        if (used == rows) run();
      }
    }
    if (!pass.empty()) run();
    for (int64_t i = 0; i < n; i++) slots_[(size_t)slots[i]].logits_row = bbuf_.max_rows + (int)slots[i];
  } else {
    for (int64_t i = 0; i < n; i++) prefill_by_token(slots[i], tokens[i], lens[i]);
    for (int64_t i = 0; i < n; i++) mark_prompt(slots[i], tokens[i], lens[i]);
    TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (d_prompt_ and the caller's tokens are free again)
  }
  for (int64_t i = 0; i < n; i++) {
    Slot& sl = slots_[(size_t)slots[i]];
    sl.length += lens[i];
    sl.has_logits = true;
  }
}

void CudaEngine::seq_step(const int64_t* slots, const int32_t* tokens, int64_t n) {
  check_batch_slots("seq_step", slots, n, (int64_t)slots_.size(), [&](int64_t i) { return slots_[(size_t)i].open; },
                    [&](int64_t i) { return slots_[(size_t)i].has_logits; });
  check_tokens(tokens, n, cfg_.vocab);
  require_pages(step_pages(slots, n), "this step needs");  // the whole step first: all slots grow, or none
  std::vector<int64_t> pos((size_t)n);
  for (int64_t i = 0; i < n; i++) {
    pos[(size_t)i] = slots_[(size_t)slots[i]].length;
    slot_reserve(slots[i], pos[(size_t)i] + 1);
  }
  run_rows(tokens, pos.data(), slots, n);
  for (int64_t i = 0; i < n; i++) {
    Slot& sl = slots_[(size_t)slots[i]];
    sl.length += 1;
    sl.has_logits = true;
  }
}

void CudaEngine::move_logits_out(int rows, const int64_t* slots, int64_t n) {
  for (size_t s = 0; s < slots_.size(); s++) {
    Slot& sl = slots_[s];
    if (!sl.open || sl.logits_row < 0 || sl.logits_row >= rows) continue;
    if (std::find(slots, slots + n, (int64_t)s) != slots + n) continue;  // in this work: new logits come
    const size_t ld = (size_t)bbuf_.ld_v;
    TI_CUDA_CHECK(cudaMemcpyAsync(bbuf_.slot_row((int64_t)s), bbuf_.logits + (size_t)sl.logits_row * ld,
                                  (size_t)cfg_.vocab * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    sl.logits_row = bbuf_.max_rows + (int)s;
  }
}

// Everything seq_mixed checks before it launches anything (step_tokens null: they are the sampler's, on the device).
void CudaEngine::check_mixed(const int64_t* step_slots, const int32_t* step_tokens, int64_t n_step,
                             const int64_t* slots, const int32_t* const* tokens, const int64_t* lens, int64_t n) const {
  const auto open = [&](int64_t i) { return slots_[(size_t)i].open; };
  check_batch_slots("seq_mixed", step_slots, n_step, (int64_t)slots_.size(), open,
                    [&](int64_t i) { return slots_[(size_t)i].has_logits; });
  if (step_tokens) check_tokens(step_tokens, n_step, cfg_.vocab);
  check_prefill_many(slots, tokens, lens, n, (int64_t)slots_.size(), cfg_.vocab, max_seq_, open,
                     [&](int64_t i) { return slots_[(size_t)i].length; });
  check_mixed_disjoint(step_slots, n_step, slots, n);
  // all slots grow, or none
  require_pages(step_pages(step_slots, n_step) + prompt_pages(slots, lens, n), "this step and these prompts need");
}

void CudaEngine::seq_mixed(const int64_t* step_slots, const int32_t* step_tokens, int64_t n_step,
                           const int64_t* slots, const int32_t* const* tokens, const int64_t* lens, int64_t n) {
  check_mixed(step_slots, step_tokens, n_step, slots, tokens, lens, n);
  if (!prefill_) {
    seq_step(step_slots, step_tokens, n_step);
    seq_prefill_many(slots, tokens, lens, n);
    return;
  }
  launch_mixed(step_slots, step_tokens, nullptr, nullptr, n_step, slots, tokens, lens, n);
}

// The mixed pass, checked already (check_mixed). The decode rows' tokens: step_tokens (host), or when it is null
// dev_tokens[dev_src[i]] for step row i (device: the sampler's output, queued ahead in stream order).
void CudaEngine::launch_mixed(const int64_t* step_slots, const int32_t* step_tokens, const int* dev_tokens,
                              const int* dev_src, int64_t n_step, const int64_t* slots,
                              const int32_t* const* tokens, const int64_t* lens,
                              int64_t n) {
  std::vector<int64_t> all(step_slots, step_slots + n_step);
  all.insert(all.end(), slots, slots + n);
  move_logits_out((int)all.size(), all.data(), (int64_t)all.size());  // (<= max_rows: distinct slots)
  for (int64_t i = 0; i < n_step; i++) slot_reserve(step_slots[i], slots_[(size_t)step_slots[i]].length + 1);
  for (int64_t i = 0; i < n; i++) slot_reserve(slots[i], slots_[(size_t)slots[i]].length + lens[i]);
  const int rows = prefill_->rows();
  const size_t V = (size_t)cfg_.vocab;
  std::vector<PrefillSegment> pass;
  std::vector<int64_t> pass_slots;  // per segment: a prompt's slot, -1 for a decode row
  int used = 0;
  const int32_t placeholder = 0;  // (the upload's value of a device token's row, overwritten before the pass)
  // The prompts join the penalty sets from each pass's own device tokens (no copy from the caller's memory,
  // which could make the driver wait for the stream: this call is meant to queue its pass behind running work).
  auto run = [&] {
    prefill_->run_many(pass.data(), (int)pass.size(), bbuf_.tables, bbuf_.logits, dev_tokens);
    for (size_t j = 0, row = 0; j < pass.size(); row += (size_t)pass[j].T, j++)
      if (pass_slots[j] >= 0)
        cuda::mark_tokens(seen_ + (size_t)pass_slots[j] * V, pbuf_.tokens + row, pass[j].T, stream_);
    pass.clear();
    pass_slots.clear();
    used = 0;
  };
  auto add = [&](int64_t slot, const int32_t* toks, int64_t len, int logits_row, int token_src, bool prompt) {
    const int64_t length = slots_[(size_t)slot].length;
    for (int64_t off = 0; off < len;) {
      PrefillSegment sg;
      sg.T = (int)std::min<int64_t>(len - off, rows - used);
      sg.tokens = toks + off;
      sg.token_src = token_src;
      sg.pos0 = (int)(length + off);
      sg.table_offset = slot * bbuf_.table_stride;
      off += sg.T;
      if (off == len) sg.logits_row = logits_row;
      pass.push_back(sg);
      pass_slots.push_back(prompt ? slot : -1);
      used += sg.T;
      if (used == rows) run();
    }
  };
  for (int64_t i = 0; i < n_step; i++) {
    if (step_tokens) add(step_slots[i], step_tokens + i, 1, (int)i, -1, false);
    else add(step_slots[i], &placeholder, 1, (int)i, dev_src[i], false);
  }
  for (int64_t i = 0; i < n; i++) add(slots[i], tokens[i], lens[i], (int)(n_step + i), -1, true);
  if (!pass.empty()) run();
  // No sync: like seq_step it returns once launched (the scheduler does a step's per-token work meanwhile). The
  // caller's tokens are free already (run_many copies them to pinned staging, which the next pass or step
  // waits for before reusing).
  for (size_t r = 0; r < all.size(); r++) {
    Slot& sl = slots_[(size_t)all[r]];
    sl.length += r < (size_t)n_step ? 1 : lens[r - (size_t)n_step];
    sl.has_logits = true;
    sl.logits_row = (int)r;
  }
}

void CudaEngine::upload_rows(int bucket, const int32_t* tokens, const int64_t* pos, const int64_t* slots,
                             int64_t n) {
  const int R = bbuf_.max_rows;
  int* h = bbuf_.h_rows;
  for (int r = 0; r < bucket; r++) {
    const bool live = r < n;
    h[r] = live ? tokens[r] : 0;
    h[R + r] = live ? (int)pos[r] : -1;
    h[2 * R + r] = live ? (int)slots[r] : 0;
  }
  TI_CUDA_CHECK(cudaMemcpyAsync(bbuf_.rows, h, 3 * (size_t)R * sizeof(int), cudaMemcpyHostToDevice, stream_));
}

void CudaEngine::run_rows(const int32_t* tokens, const int64_t* pos, const int64_t* slots, int64_t n, bool draft) {
  size_t b = 0;
  while (buckets_[b] < n) b++;
  const int bucket = buckets_[b];
  // (pdl_: the device has it and the decode graphs captured it; batch_pdl_ok_: the batch graphs too)
  bool pdl = opt_.batch_pdl && pdl_ && batch_pdl_ok_;
  cudaGraphExec_t& graph = (draft ? g_draft_ : g_batch_)[b];
  move_logits_out(bucket, slots, n);  // (the step overwrites rows 0..bucket-1, padding rows too)
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // bbuf_.h_rows may still be read by the previous copy
  if (opt_.graphs && !graph) {
    // First use of this bucket: one eager pass of padding rows only (it tunes the bucket's cuBLASLt products and
    // touches no KV page and no slot's logits), then the capture.
    upload_rows(bucket, nullptr, nullptr, nullptr, 0);
    batch_->record(bucket, stream_, pdl, draft);
    TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaError_t err = cudaSuccess;
    try {
      err = capture_graph(stream_, [&] { batch_->record(bucket, stream_, pdl, draft); }, &graph);
    } catch (const Error&) {
      if (!pdl) throw;
      err = cudaErrorNotSupported;
    }
    if (err != cudaSuccess && pdl) {
      // A driver that cannot capture these programmatic launches (e.g. behind cuBLASLt's nodes): plain ones, for
      // every bucket from now on (as build_graphs does for the decode graphs).
      cudaGetLastError();
      batch_pdl_ok_ = pdl = false;
      graph = nullptr;
      err = capture_graph(stream_, [&] { batch_->record(bucket, stream_, pdl, draft); }, &graph);
    }
    TI_CUDA_CHECK(err);
  }
  upload_rows(bucket, tokens, pos, slots, n);
  if (opt_.graphs) TI_CUDA_CHECK(cudaGraphLaunch(graph, stream_));
  else batch_->record(bucket, stream_, pdl, draft);
  if (!draft)
    for (int64_t r = 0; r < n; r++) slots_[(size_t)slots[r]].logits_row = (int)r;
}

// Speculative decoding's draft pass on the batched step: the single sequence's page table becomes the draft slot's
// (the tables' last row, no sequence slot's), its rows that slot's positions pos0.. (docs/perf/speculative.md).
void CudaEngine::draft_pass_rows(const int32_t* seq, int64_t m, int64_t pos0, float* host_rows) {
  const size_t stride = (size_t)bbuf_.table_stride, V = (size_t)cfg_.vocab;
  TI_CUDA_CHECK(cudaMemcpyAsync(bbuf_.tables + (size_t)bbuf_.draft_slot() * stride, dbuf_.page_table,
                                stride * sizeof(int), cudaMemcpyDeviceToDevice, stream_));
  std::vector<int64_t> pos((size_t)m), slots((size_t)m, bbuf_.draft_slot());
  for (int64_t i = 0; i < m; i++) pos[(size_t)i] = pos0 + i;
  run_rows(seq, pos.data(), slots.data(), m, /*draft=*/true);
  TI_CUDA_CHECK(cudaMemcpy2DAsync(host_rows, V * sizeof(float), bbuf_.logits, (size_t)bbuf_.ld_v * sizeof(float),
                                  V * sizeof(float), (size_t)m, cudaMemcpyDeviceToHost, stream_));
}

BatchSample CudaEngine::seq_sample(const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps, int64_t n,
                                   int k) {
  check_sample(slots, cfgs, n, k);
  queue_sample(slots, cfgs, steps, n, k);
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return read_sample(n, k);
}

void CudaEngine::check_sample(const int64_t* slots, const SamplingConfig* cfgs, int64_t n, int k) const {
  check_batch_slots("seq_sample", slots, n, (int64_t)slots_.size(), [&](int64_t i) { return slots_[(size_t)i].open; },
                    [&](int64_t i) { return slots_[(size_t)i].has_logits; });
  check_top_logprobs(k);
  for (int64_t i = 0; i < n; i++) validate(cfgs[i], cfg_.vocab);
}

// The sampler and the copy of its output to h_sample_out_, queued (checked already: check_sample).
void CudaEngine::queue_sample(const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps, int64_t n,
                              int k) {
  const int B = (int)opt_.max_batch, V = (int)cfg_.vocab;
  // Queued behind the step it samples (no sync on the stream: the sampler starts when the step ends, not a host
  // round trip later). Only the staging must be free: its last copy has normally run long ago.
  TI_CUDA_CHECK(cudaEventSynchronize(sample_in_read_));
  auto* rows_h = static_cast<cuda::RowSampling*>(h_sample_in_);
  auto* bias_h = reinterpret_cast<cuda::LogitBias*>(rows_h + B);
  auto* mask_h = reinterpret_cast<uint32_t*>(bias_h + (size_t)B * kMaxLogitBias);
  int n_bias = 0, n_mask = 0;  // (entries, words)
  for (int64_t i = 0; i < n; i++) {  // each row read where its slot's logits lie (no gather)
    rows_h[i] = cuda::RowSampling{device_sampling(cfgs[i]), (unsigned long long)steps[i], (int)slots[i],
                                  slots_[(size_t)slots[i]].logits_row, n_bias, n_mask};
    device_bias(cfgs[i], bias_h + n_bias);
    n_bias += (int)cfgs[i].bias_ids.size();
    std::copy(cfgs[i].allowed.begin(), cfgs[i].allowed.end(), mask_h + n_mask);  // (validated: mask_words(V))
    n_mask += (int)cfgs[i].allowed.size();
  }
  auto* rows_d = static_cast<cuda::RowSampling*>(d_sample_in_);
  auto* bias_d = reinterpret_cast<cuda::LogitBias*>(rows_d + B);
  auto* mask_d = reinterpret_cast<uint32_t*>(bias_d + (size_t)B * kMaxLogitBias);
  TI_CUDA_CHECK(cudaMemcpyAsync(rows_d, rows_h, (size_t)n * sizeof(cuda::RowSampling), cudaMemcpyHostToDevice, stream_));
  if (n_bias)
    TI_CUDA_CHECK(cudaMemcpyAsync(bias_d, bias_h, (size_t)n_bias * sizeof(cuda::LogitBias), cudaMemcpyHostToDevice,
                                  stream_));
  if (n_mask)
    TI_CUDA_CHECK(cudaMemcpyAsync(mask_d, mask_h, (size_t)n_mask * sizeof(uint32_t), cudaMemcpyHostToDevice,
                                  stream_));
  TI_CUDA_CHECK(cudaEventRecord(sample_in_read_, stream_));
  int* tok_d = static_cast<int*>(d_sample_out_);
  float* lp_d = reinterpret_cast<float*>(tok_d + B);
  int* top_ids_d = reinterpret_cast<int*>(lp_d + B);
  float* top_lp_d = reinterpret_cast<float*>(top_ids_d + (size_t)B * cuda::kMaxTopK);
  cuda::sample_rows(bbuf_.logits, bbuf_.ld_v, (int)n, V, rows_d, bias_d, mask_d, seen_, counts_, sample_scratch_, k,
                    tok_d, lp_d, k ? top_ids_d : nullptr, k ? top_lp_d : nullptr, stream_);
  const size_t out_bytes = (size_t)B * (1 + cuda::kMaxTopK) * (sizeof(int) + sizeof(float));
  TI_CUDA_CHECK(cudaMemcpyAsync(h_sample_out_, d_sample_out_, out_bytes, cudaMemcpyDeviceToHost, stream_));
}

// What the last queued sample wrote to h_sample_out_ (the caller has waited for its copy).
BatchSample CudaEngine::read_sample(int64_t n, int k) const {
  const int B = (int)opt_.max_batch;
  const int* tok_h = static_cast<const int*>(h_sample_out_);
  const float* lp_h = reinterpret_cast<const float*>(tok_h + B);
  const int* top_ids_h = reinterpret_cast<const int*>(lp_h + B);
  const float* top_lp_h = reinterpret_cast<const float*>(top_ids_h + (size_t)B * cuda::kMaxTopK);
  BatchSample out;
  out.k = k;
  out.tokens.assign(tok_h, tok_h + n);
  out.logprobs.assign(lp_h, lp_h + n);
  out.top_ids.assign(top_ids_h, top_ids_h + n * k);
  out.top_logprobs.assign(top_lp_h, top_lp_h + n * k);
  return out;
}

// The sample, and behind it on the stream (before the tokens reach the host) the mixed pass of the rows that go
// on, their tokens read from the sampler's output on the device, with the prompts: the pass is queued while the
// step being sampled still runs, so neither the host's round trip nor the pass's ~250 launches leave the device
// idle. A row goes on whatever its token (the launch cannot wait to see it): one that drew a stop id has its
// next position computed for nothing, and the caller ends it. A launch refused by check_mixed (a request error:
// pages, length, a bad prompt) launches nothing; the sample stands.
SampleStep CudaEngine::seq_sample_mixed(const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps,
                                        int64_t n, int k, const uint8_t* go_on, const int64_t* p_slots,
                                        const int32_t* const* p_tokens, const int64_t* p_lens, int64_t n_p) {
  check_sample(slots, cfgs, n, k);
  SampleStep out;
  out.stepped.assign((size_t)n, 0);
  std::vector<int64_t> step_slots;
  for (int64_t i = 0; i < n; i++)
    if (go_on[i]) step_slots.push_back(slots[i]);
  bool launch = prefill_ != nullptr;  // (without the batched prefill: the generic path, tokens through the host)
  if (!launch) return sample_then_mixed(*this, slots, cfgs, steps, n, k, go_on, p_slots, p_tokens, p_lens, n_p);
  try {
    check_mixed(step_slots.data(), nullptr, (int64_t)step_slots.size(), p_slots, p_tokens, p_lens, n_p);
  } catch (const Error&) {
    launch = false;
  }
  queue_sample(slots, cfgs, steps, n, k);
  TI_CUDA_CHECK(cudaEventRecord(sampled_, stream_));  // the tokens are on the host once this has run
  if (launch) {
    std::vector<int> src;  // the rows that go on read the sampler's output at their own sampled row
    for (int64_t i = 0; i < n; i++)
      if (go_on[i]) src.push_back((int)i);
    const auto t0 = std::chrono::steady_clock::now();
    launch_mixed(step_slots.data(), nullptr, static_cast<const int*>(d_sample_out_), src.data(),
                 (int64_t)step_slots.size(), p_slots, p_tokens, p_lens, n_p);
    out.launch_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (int64_t i = 0; i < n; i++) out.stepped[(size_t)i] = go_on[i];
    out.prefilled = true;
  }
  TI_CUDA_CHECK(cudaEventSynchronize(sampled_));
  out.sample = read_sample(n, k);
  return out;
}

}  // namespace ti
