// Test-only global allocation counter: counts while a window is open, otherwise a plain malloc
// pass-through, so the rest of the test binary is unaffected. GCC cannot tell that the replaced
// new/delete pair is malloc/free, hence the silenced warning.
#include "alloc_counter.h"

#include <execinfo.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>

#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
namespace {
std::atomic<bool> g_count_allocs{false};
std::atomic<int64_t> g_allocs{0};
// RECUR_ALLOC_TRACE=N: the call stacks of the first N counted allocations go to stderr (as
// addresses in their binaries, for addr2line), to find where a window allocates.
std::atomic<int> g_traces_left{0};
thread_local bool t_tracing = false;
void note_alloc() {
  if (!g_count_allocs.load(std::memory_order_relaxed)) return;
  g_allocs.fetch_add(1);
  if (t_tracing || g_traces_left.load(std::memory_order_relaxed) <= 0) return;
  if (g_traces_left.fetch_sub(1) <= 0) return;
  t_tracing = true;  // backtrace may allocate on its first call
  void* frames[24];
  const int n = backtrace(frames, 24);
  backtrace_symbols_fd(frames, n, 2);
  static const char kEnd[] = "--\n";
  (void)!write(2, kEnd, sizeof kEnd - 1);
  t_tracing = false;
}
}  // namespace

namespace recur::testing {

void start_counting_allocs() {
  static const int traces = [] {
    const char* v = std::getenv("RECUR_ALLOC_TRACE");
    return v ? std::atoi(v) : 0;
  }();
  g_traces_left = traces;
  g_allocs = 0;
  g_count_allocs = true;
}

int64_t stop_counting_allocs() {
  g_count_allocs = false;
  return g_allocs.load();
}

}  // namespace recur::testing

void* operator new(std::size_t n) {
  note_alloc();
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t al) {
  note_alloc();
  const size_t a = size_t(al);
  if (void* p = std::aligned_alloc(a, (std::max<size_t>(n, 1) + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
// The nothrow forms too: left to the runtime, their blocks would come back to the delete
// above from another allocator (AddressSanitizer reports the mismatch), uncounted.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  note_alloc();
  return std::malloc(n ? n : 1);
}
void* operator new(std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  note_alloc();
  const size_t a = size_t(al);
  return std::aligned_alloc(a, (std::max<size_t>(n, 1) + a - 1) / a * a);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
