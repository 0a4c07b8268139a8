#include "thread_pool.h"

#include <algorithm>
#include <atomic>

namespace ti {

struct ThreadPool::Job {
  const std::function<void(int64_t, int64_t)>* fn;  // valid while chunks remain unfinished
  int64_t n, grain, chunks;
  std::atomic<int64_t> next{0};      // the next chunk to claim
  std::atomic<int64_t> finished{0};  // chunks done
  std::mutex mu;
  std::condition_variable done;      // the caller: all chunks finished
};

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; i++) workers_.emplace_back([this] { worker(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int64_t ThreadPool::grain_for(int64_t n, int64_t min_grain) const {
  const int64_t chunks = 8 * (int64_t)threads();
  return std::max<int64_t>(min_grain, (n + chunks - 1) / chunks);
}

// Claims and runs chunks until none is left. fn is touched only for a claimed chunk, and the caller does not
// return before every claimed chunk has finished, so fn is alive whenever it is called.
void ThreadPool::work_on(Job& job) {
  for (;;) {
    const int64_t c = job.next.fetch_add(1, std::memory_order_relaxed);
    if (c >= job.chunks) return;
    const int64_t begin = c * job.grain;
    (*job.fn)(begin, std::min(job.n, begin + job.grain));
    if (job.finished.fetch_add(1, std::memory_order_acq_rel) + 1 == job.chunks) {
      std::lock_guard<std::mutex> lk(job.mu);  // (under the lock: the caller cannot miss the notification)
      job.done.notify_one();
    }
  }
}

void ThreadPool::worker() {
  uint64_t seen = 0;
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    work_on(*job);
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (workers_.empty() || n <= grain) {
    fn(0, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  job->grain = grain;
  job->chunks = (n + grain - 1) / grain;
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = job;
    generation_++;
  }
  wake_.notify_all();
  work_on(*job);
  std::unique_lock<std::mutex> lk(job->mu);
  job->done.wait(lk, [&] { return job->finished.load(std::memory_order_acquire) == job->chunks; });
}

}  // namespace ti
