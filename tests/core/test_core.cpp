// Counted allocator, tensors and the thread pool.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include "core/allocator.h"
#include "core/tensor.h"
#include "core/threads.h"

namespace recur {
namespace {

TEST(Allocator, CountsLiveObjectsBytesAndTotals) {
  Allocator& a = cpu_allocator();
  const AllocStats before = a.stats();
  {
    auto b1 = a.allocate(100, "test");
    auto b2 = a.allocate(1000, "test");
    ASSERT_TRUE(b1.ok() && b2.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b1->data()) % 64, 0u);
    const AllocStats during = a.stats();
    EXPECT_EQ(during.live_buffers - before.live_buffers, 2);
    EXPECT_EQ(during.live_bytes - before.live_bytes, 1100);
    EXPECT_EQ(during.allocs_total - before.allocs_total, 2);
    Buffer moved = std::move(*b1);  // a move is not a new object
    EXPECT_EQ(a.stats().live_buffers - before.live_buffers, 2);
  }
  const AllocStats after = a.stats();
  EXPECT_EQ(after.live_buffers, before.live_buffers);
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.allocs_total - before.allocs_total, 2);
}

// In a sanitized build (cmake --preset asan) a failed allocation returns null, as it does
// without the sanitizer, instead of ending the program: the test below needs one.
extern "C" const char* __asan_default_options() {
  return "allocator_may_return_null=1";
}

TEST(Allocator, FailureIsAnErrorNamingTheBuffer) {
  auto r = cpu_allocator().allocate(size_t(1) << 62, "giant table");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("giant table"), std::string::npos);
}

TEST(Tensor, ViewsShareMemoryWithStrides) {
  std::vector<float> data(24);
  std::iota(data.begin(), data.end(), 0.0f);
  Tensor t = Tensor::contiguous(data.data(), DType::F32, {4, 6});
  Tensor cols = t.slice_cols(2, 5);
  EXPECT_EQ(cols.shape[1], 3);
  EXPECT_EQ(cols.row<float>(1)[0], 8.0f);
  EXPECT_FALSE(cols.is_contiguous());
  Tensor rows = t.slice_rows(1, 3).reshaped({2, 2, 3});
  EXPECT_EQ(rows.ptr<float>()[0], 6.0f);
  EXPECT_EQ(rows.shape_string(), "[2, 2, 3]");
}

TEST(ThreadPool, CoversTheRangeExactlyOnceWithDistinctParts) {
  ThreadPool pool(3);
  for (int64_t n : {1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    std::atomic<int> max_part{0};
    pool.parallel_for_indexed(n, 1, [&](int64_t b, int64_t e, int part) {
      for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
      int m = max_part.load();
      while (part > m && !max_part.compare_exchange_weak(m, part)) {
      }
    });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
    EXPECT_LT(max_part.load(), 3);
  }
  // Small work runs inline on the caller.
  int calls = 0;
  pool.parallel_for(10, 100, [&](int64_t b, int64_t e) { calls += int(e - b); });
  EXPECT_EQ(calls, 10);
}

// Chunks taken dynamically: each exactly once, on at most max_parts threads, and a thread that
// stalls leaves its share to the others; loops posted back to back (workers still spinning, or
// asleep after a pause) all complete.
TEST(ThreadPool, ParallelChunksRunsEveryChunkOnce) {
  ThreadPool pool(3);
  for (int rep = 0; rep < 200; ++rep) {
    for (int max_parts : {1, 2, 3}) {
      const int64_t n = rep % 7 == 0 ? 1 : 40 + rep % 5;
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      std::mutex mu;
      std::set<std::thread::id> threads;
      pool.parallel_chunks(n, max_parts, [&](int64_t c) {
        hits[size_t(c)]++;
        std::lock_guard<std::mutex> lk(mu);
        threads.insert(std::this_thread::get_id());
      });
      for (auto& h : hits) ASSERT_EQ(h.load(), 1);
      EXPECT_LE(int(threads.size()), max_parts);
    }
    if (rep == 100) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // One chunk that blocks until every other chunk is done: the other threads take them all.
  std::atomic<int> done{0};
  pool.parallel_chunks(30, 3, [&](int64_t c) {
    if (c == 0) {
      while (done.load() < 29) std::this_thread::yield();
    } else {
      done++;
    }
  });
  EXPECT_EQ(done.load(), 29);
}

}  // namespace
}  // namespace recur
