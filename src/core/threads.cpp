#include "core/threads.h"

#include <chrono>
#include <cstdlib>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace recur {

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  try {
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
  } catch (...) {  // the threads made so far must be joined before the error leaves
    stop_workers();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  stop_workers();
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    generation_.store(generation_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

static inline void part_range(int64_t n, int parts, int i, int64_t* b, int64_t* e) {
  *b = n * i / parts;
  *e = n * (i + 1) / parts;
}

void ThreadPool::run(int64_t n, int parts, Trampoline t, void* ctx) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_fn_ = t;
    job_ctx_ = ctx;
    job_n_ = n;
    job_parts_ = parts;
    pending_.store(parts - 1, std::memory_order_relaxed);
    generation_.store(generation_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }
  if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
  int64_t b, e;
  part_range(n, parts, 0, &b, &e);
  t(ctx, b, e, 0);
  // Workers finish within microseconds; spin briefly, then yield.
  int spins = 0;
  while (pending_.load(std::memory_order_acquire) > 0) {
    if (++spins > 2000) std::this_thread::yield();
  }
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    // A decode step runs hundreds of parallel loops a few microseconds apart: wait for the next
    // one awake for a while, since waking a sleeping thread costs more than most loops' work.
    const auto spin_until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
    for (int i = 1; generation_.load(std::memory_order_acquire) == seen; ++i) {
#if defined(__x86_64__)
      _mm_pause();
#endif
      if (i % 256 == 0 && std::chrono::steady_clock::now() > spin_until) break;
    }
    Trampoline fn;
    void* ctx;
    int64_t n;
    int parts;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (generation_.load(std::memory_order_relaxed) == seen) {
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lk, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      }
      seen = generation_.load(std::memory_order_relaxed);
      if (stop_) return;
      fn = job_fn_;
      ctx = job_ctx_;
      n = job_n_;
      parts = job_parts_;
    }
    if (index < parts) {
      int64_t b, e;
      part_range(n, parts, index, &b, &e);
      fn(ctx, b, e, index);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
}

int default_thread_count() {
  unsigned hw = std::thread::hardware_concurrency();
  return hw ? int(hw) : 1;
}

}  // namespace recur
