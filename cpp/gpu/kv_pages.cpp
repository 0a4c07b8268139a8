#include "kv_pages.h"

#include <algorithm>
#include <string>

#include "../core/errors.h"
#include "../core/rng.h"

namespace ti {

KvPagePool::KvPagePool(int64_t n_pages, int page_size, uint64_t shuffle_seed)
    : page_size_(page_size), page_shift_(0), n_pages_(n_pages) {
  if (page_size < 1 || (page_size & (page_size - 1)) != 0 || page_size > (1 << 20))
    fail(ErrorKind::Request, "kv_page_size must be a power of two up to 2^20, got " + std::to_string(page_size));
  if (n_pages < 1 || n_pages > INT32_MAX)
    fail(ErrorKind::Request, "kv_pool_pages must be in 1..2^31-1, got " + std::to_string(n_pages));
  while ((1 << page_shift_) < page_size) page_shift_++;
  free_.resize((size_t)n_pages);
  refs_.assign((size_t)n_pages, 0);
  for (int64_t i = 0; i < n_pages; i++) free_[(size_t)i] = (int32_t)(n_pages - 1 - i);  // top of the stack: 0
  if (shuffle_seed != 0)  // Fisher-Yates with the samplers' counter-based generator: the same order everywhere
    for (int64_t i = n_pages - 1; i > 0; i--)
      std::swap(free_[(size_t)i], free_[(size_t)(splitmix64(shuffle_seed ^ (uint64_t)i) % (uint64_t)(i + 1))]);
}

int32_t KvPagePool::take() {
  const int32_t p = free_.back();
  free_.pop_back();
  refs_[(size_t)p] = 1;
  return p;
}

void KvPagePool::give_back(int32_t p) {
  if (--refs_[(size_t)p] == 0) free_.push_back(p);
}

KvSequence::KvSequence(const KvPagePool& pool, int64_t max_positions)
    : max_positions_(max_positions), max_pages_(pool.pages_for(max_positions)) {}

int64_t KvSequence::grow(KvPagePool& pool, int64_t positions) {
  if (positions > max_positions_)
    fail(ErrorKind::Request, "KV cache: " + std::to_string(positions) + " positions exceed max_seq_len=" +
                                 std::to_string(max_positions_));
  const int64_t first = pages(), need = pool.pages_for(positions) - first;
  if (need <= 0) return first;
  if (need > pool.free_pages())
    fail(ErrorKind::Request,
         "KV cache pool exhausted: " + std::to_string(positions) + " positions need " +
             std::to_string(first + need) + " pages of " + std::to_string(pool.page_size()) +
             " positions; the sequence holds " + std::to_string(first) + " and the pool has " +
             std::to_string(pool.free_pages()) + " free of " + std::to_string(pool.n_pages()) +
             " (CudaOptions.kv_pool_pages; 0 sizes the pool for max_batch sequences within free memory)");
  for (int64_t i = 0; i < need; i++) table_.push_back(pool.take());
  return first;
}

void KvSequence::release(KvPagePool& pool) {
  // back in reverse, so that a sequence that grows again after a reset gets the same pages in the same order
  for (auto it = table_.rbegin(); it != table_.rend(); ++it) pool.give_back(*it);
  table_.clear();
}

void KvSequence::shrink(KvPagePool& pool, int64_t positions) {
  const size_t keep = (size_t)pool.pages_for(std::max<int64_t>(positions, 0));
  while (table_.size() > keep) {  // (the last page first, as release)
    pool.give_back(table_.back());
    table_.pop_back();
  }
}

void KvSequence::share(KvPagePool& pool, const KvSequence& src, int64_t pages) {
  if (&src == this) fail(ErrorKind::Request, "KV cache: a sequence cannot share its own pages");
  if (pages < 0 || pages > src.pages() || pages > max_pages_)
    fail(ErrorKind::Request, "KV cache: cannot share " + std::to_string(pages) + " pages of a sequence holding " +
                                 std::to_string(src.pages()) + " (this one may hold " + std::to_string(max_pages_) + ")");
  release(pool);
  table_.assign(src.table_.begin(), src.table_.begin() + pages);
  for (int32_t p : table_) pool.refs_[(size_t)p]++;
}

int32_t KvSequence::unshare(KvPagePool& pool, int64_t j) {
  if (j < 0 || j >= pages())
    fail(ErrorKind::Request, "KV cache: no table entry " + std::to_string(j) + " in a sequence of " +
                                 std::to_string(pages()) + " pages");
  const int32_t old = table_[(size_t)j];
  if (pool.refs(old) == 1) return -1;
  if (pool.free_.empty())
    fail(ErrorKind::Request, "KV cache pool exhausted: a page shared with another sequence must become this one's, "
                             "and none of the " + std::to_string(pool.n_pages()) + " is free");
  table_[(size_t)j] = pool.take();
  pool.give_back(old);  // (others hold it still)
  return old;
}

int64_t KvSequence::owned_pages(const KvPagePool& pool, int64_t from) const {
  int64_t n = 0;
  for (size_t j = (size_t)std::max<int64_t>(from, 0); j < table_.size(); j++) n += pool.refs(table_[j]) == 1;
  return n;
}

}  // namespace ti
