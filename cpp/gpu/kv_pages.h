// kv_pages.h — the paged KV cache's bookkeeping on the host: a pool of page ids and each sequence's page table.
// Where a page's keys and values live on the device, and how the kernels address through a table, is
// cuda/kv_layout.cuh; the GPU engine owns the pages' memory and keeps a device copy of each table.
//
// Pages are taken on demand: before work that writes positions [0, n) of a sequence (a prefill chunk, a decode
// chunk of graph replays), grow(n) assigns the missing table entries from the free list, all or nothing, and
// the caller uploads the entries that changed before it launches the work (a captured decode step reads its
// table from device memory). release() gives a sequence's pages back (the engine's reset(), a scheduler's
// seq_close), shrink() those past a prefix (seq_rewind). The pool runs out with a Request error naming the numbers; nothing
// is taken then, and nothing on the device is touched, so the engine stays usable. Plain C++ (no CUDA): the
// logic is tested on any machine (tests/test_kv_pages.py).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ti {

class KvPagePool {
 public:
  // n_pages pages of page_size positions (a power of two). shuffle_seed != 0: the free list in a pseudo-random
  // order (tests: a sequence's pages scattered over the pool); 0: pages handed out as 0, 1, 2, ...
  KvPagePool(int64_t n_pages, int page_size, uint64_t shuffle_seed = 0);
  int page_size() const { return page_size_; }
  int page_shift() const { return page_shift_; }
  int64_t n_pages() const { return n_pages_; }
  int64_t free_pages() const { return (int64_t)free_.size(); }
  int64_t pages_for(int64_t positions) const { return (positions + page_size_ - 1) >> page_shift_; }
  int32_t refs(int32_t page) const { return refs_[(size_t)page]; }  // the sequences holding it (0: free)

 private:
  friend class KvSequence;
  int32_t take();             // the next free page, held once
  void give_back(int32_t p);  // one holder fewer; free when none is left
  int page_size_, page_shift_;
  int64_t n_pages_;
  std::vector<int32_t> free_;  // a stack: the last page given back is the next taken
  std::vector<int32_t> refs_;  // per page: how many sequences' tables hold it
};

// One sequence's page table: table()[j] holds positions j * page_size .. (j + 1) * page_size - 1.
class KvSequence {
 public:
  // max_positions: the longest the sequence may grow (max_seq_len); its table never exceeds that many pages.
  KvSequence(const KvPagePool& pool, int64_t max_positions);
  // Covers positions [0, positions) with pages from `pool`; returns the first table index that changed (the
  // caller uploads entries [first, pages())). Throws a Request error, taking nothing, when the positions exceed
  // max_positions or the pool lacks the pages.
  int64_t grow(KvPagePool& pool, int64_t positions);
  void release(KvPagePool& pool);  // every page back to the pool; the table empties
  // Keeps the pages of positions [0, positions) and gives the rest back (a slot rewound to a shared prefix: the
  // scheduler's prefix cache). The kept entries do not change, so the device table needs no upload.
  void shrink(KvPagePool& pool, int64_t positions);
  // Its own pages given back, then src's first `pages` pages shared (held once more each; nothing is copied).
  void share(KvPagePool& pool, const KvSequence& src, int64_t pages);
  // Table entry j made this sequence's own page where others hold it too: returns the page it held (whose keys and
  // values the caller copies into table()[j]), or -1 where it was its own already. Throws a Request error, changing
  // nothing, when no page is free.
  int32_t unshare(KvPagePool& pool, int64_t j);
  // Of its pages from table entry `from` on, those no other sequence holds: what release() / shrink() give back.
  int64_t owned_pages(const KvPagePool& pool, int64_t from = 0) const;
  const std::vector<int32_t>& table() const { return table_; }
  int64_t pages() const { return (int64_t)table_.size(); }
  int64_t max_pages() const { return max_pages_; }

 private:
  int64_t max_positions_, max_pages_;
  std::vector<int32_t> table_;
};

}  // namespace ti
