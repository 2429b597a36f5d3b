// Counts the heap allocations of this test program (operator new is replaced in
// alloc_counter.cpp): between start() and the count() that ends the window, on any thread.
#pragma once

#include <cstdint>

namespace recur::testing {

void start_counting_allocs();
int64_t stop_counting_allocs();  // allocations since start

}  // namespace recur::testing
