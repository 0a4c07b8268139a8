#include "thread_pool.h"

#if defined(__linux__)
#include <sys/resource.h>  // (getrusage: the preemptions; elsewhere not counted)
#endif

#include <algorithm>
#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

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
  for (int i = 1; i < threads; i++) workers_.emplace_back([this, i] { worker(i == 1); });
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

namespace {

using Clock = std::chrono::steady_clock;

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Whether ready() turns true within kSpin.
template <typename Ready>
bool poll(Ready ready) {
  const auto end = Clock::now() + ThreadPool::kSpin;
  do {
    for (int i = 0; i < 64; i++) {
      if (ready()) return true;
      pause();
    }
  } while (Clock::now() < end);
  return ready();
}

// The times the scheduler took this thread off its core while it could run (Linux; elsewhere never counted).
long preemptions() {
#ifdef RUSAGE_THREAD
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_nivcsw;
#else
  return 0;
#endif
}

}  // namespace

void ThreadPool::worker(bool watcher) {
  uint64_t seen = 0;
  int jobs = 0;              // (watcher) jobs in this window, or since polling stopped
  long preempted = preemptions();
  for (;;) {
    if (polling()) poll([&] { return generation_.load(std::memory_order_acquire) != seen; });
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_++;
      wake_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_relaxed) != seen; });
      sleepers_--;
      if (stop_) return;
      seen = generation_.load(std::memory_order_relaxed);
      job = job_;
    }
    work_on(*job);
    if (!watcher) continue;
    jobs++;
    if (polling() && jobs == kWindowJobs) {
      const long now = preemptions();
      if (now - preempted > kMaxPreemptions) polling_.store(false, std::memory_order_relaxed);
      preempted = now;
      jobs = 0;
    } else if (!polling() && jobs == kRetryJobs) {
      polling_.store(true, std::memory_order_relaxed);
      preempted = preemptions();
      jobs = 0;
    }
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
  bool sleeping;
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = job;
    generation_.fetch_add(1, std::memory_order_release);
    sleeping = sleepers_ > 0;
  }
  if (sleeping) wake_.notify_all();  // (a polling worker sees the generation; a sleeping one needs the futex)
  work_on(*job);
  auto all_done = [&] { return job->finished.load(std::memory_order_acquire) == job->chunks; };
  if (polling() && poll(all_done)) return;
  std::unique_lock<std::mutex> lk(job->mu);
  job->done.wait(lk, all_done);
}

}  // namespace ti
