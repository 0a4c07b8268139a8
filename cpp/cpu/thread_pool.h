// thread_pool.h — the CPU engine's threads: a small pool that degrades gracefully on a busy machine.
//
// Why not OpenMP: its parallel loops end in a barrier that spin-waits, and a static split gives each thread a
// fixed share. When another process takes a core, one thread is descheduled holding its share and the others
// spin until it comes back: decode fell from 38 tok/s (one thread) to 0.6 tok/s with two compile jobs running.
// Here a job is cut into many more chunks than threads, claimed one at a time from an atomic counter, so a
// descheduled thread merely takes fewer chunks; the calling thread works too, and waiting threads sleep on a
// condition variable. The caller waits only for chunks already claimed, never for a worker to wake up. Which
// thread runs a chunk never changes what it computes.
//
// Before sleeping, a worker polls for the next job for up to kSpin (and the caller for the last chunks): a decode
// step hands out ~240 jobs a token, 50-100 us apart, and a futex sleep and wake-up each time cost more than the
// poll. On a machine whose cores other processes want, polling takes their share instead, so the first worker
// watches for that: where the scheduler took it off its core more than kMaxPreemptions times over a window of
// kWindowJobs jobs, polling stops; it is tried again after kRetryJobs jobs (measurements: docs/perf/cpu-engine.md).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ti {

class ThreadPool {
 public:
  // threads: 1 = everything on the caller (no workers); n > 1: n - 1 workers + the caller.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return (int)workers_.size() + 1; }
  // Calls fn(begin, end) over [0, n) in chunks of at most `grain` items (the last may be shorter) and returns
  // when all are done. One job at a time (the engine is single-threaded above this).
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
  // A grain that cuts n items into about 8 chunks per thread (at least min_grain items each).
  int64_t grain_for(int64_t n, int64_t min_grain) const;
  // Whether the threads poll before sleeping now (see above).
  bool polling() const { return polling_.load(std::memory_order_relaxed); }

  static constexpr std::chrono::microseconds kSpin{50};
  static constexpr int kWindowJobs = 256;   // ~1 decode token
  static constexpr int kMaxPreemptions = 3;
  static constexpr int kRetryJobs = 4096;

 private:
  struct Job;
  void worker(bool watcher);
  static void work_on(Job& job);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_;   // workers: a new job (or stop)
  std::shared_ptr<Job> job_;       // the current job; workers keep a reference while they look at it
  std::atomic<uint64_t> generation_{0};  // bumped under mu_ for each job; polled by the workers
  std::atomic<bool> polling_{true};       // set by the first worker (the watcher), read by every thread
  int sleepers_ = 0;                      // workers waiting on wake_ (under mu_)
  bool stop_ = false;
};

}  // namespace ti
