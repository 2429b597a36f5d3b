// A fixed pool of worker threads for data-parallel loops. Workers are created once; a
// parallel_for neither allocates nor creates threads, and runs inline when the work is small.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace recur {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);  // n_threads total, the caller included
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // How many ranges parallel_for_indexed(n, min_per_thread, ...) splits [0, n) into.
  int parts_for(int64_t n, int64_t min_per_thread) const {
    int parts = n_threads_;
    if (min_per_thread > 0) {
      int64_t max_parts = n / min_per_thread;
      if (max_parts < parts) parts = int(max_parts < 1 ? 1 : max_parts);
    }
    return parts;
  }

  // Calls fn(begin, end, part) over a split of [0, n) into at most size() contiguous ranges;
  // `part` < size() is unique among concurrent calls (an index for per-thread scratch).
  // Runs inline when n < 2 * min_per_thread or the pool has one thread.
  template <typename Fn>
  void parallel_for_indexed(int64_t n, int64_t min_per_thread, Fn&& fn) {
    if (n <= 0) return;
    const int parts = parts_for(n, min_per_thread);
    if (parts <= 1) {
      fn(int64_t(0), n, 0);
      return;
    }
    using F = std::remove_reference_t<Fn>;
    run(
        n, parts, [](void* ctx, int64_t b, int64_t e, int p) { (*static_cast<F*>(ctx))(b, e, p); },
        &fn);
  }

  // Calls fn(c) once for each c in [0, n_chunks) on up to max_parts threads, each taking the
  // next chunk as it finishes one: a thread the system delays, or one slowed by its sibling's
  // memory traffic, does less of the work instead of holding the others at the join.
  template <typename Fn>
  void parallel_chunks(int64_t n_chunks, int max_parts, Fn&& fn) {
    if (n_chunks <= 0) return;
    std::atomic<int64_t> next{0};
    parallel_for_indexed(std::min<int64_t>(n_chunks, max_parts), 1, [&](int64_t, int64_t, int) {
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;) fn(c);
    });
  }

  // As parallel_for_indexed, for bodies fn(begin, end) that need no scratch.
  template <typename Fn>
  void parallel_for(int64_t n, int64_t min_per_thread, Fn&& fn) {
    parallel_for_indexed(n, min_per_thread, [&](int64_t b, int64_t e, int) { fn(b, e); });
  }

 private:
  void stop_workers();  // wakes and joins every worker
  using Trampoline = void (*)(void*, int64_t, int64_t, int);
  void run(int64_t n, int parts, Trampoline t, void* ctx);
  void worker(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  static constexpr std::chrono::microseconds kSpinBeforeSleep{200};
  // Moves (under mu_) when a job is posted; workers spin on it before sleeping on cv_.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};  // workers waiting on cv_ (or about to)
  bool stop_ = false;
  // The job being run; written under mu_ before generation_ moves.
  Trampoline job_fn_ = nullptr;
  void* job_ctx_ = nullptr;
  int64_t job_n_ = 0;
  int job_parts_ = 0;
  std::atomic<int> pending_{0};
};

// Number of threads to use by default: the hardware count.
int default_thread_count();

}  // namespace recur
