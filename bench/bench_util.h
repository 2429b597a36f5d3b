// Measurement helpers shared by the benchmark programs.
#pragma once

#include <sys/resource.h>

namespace recur::bench {

// User plus system CPU time of the whole process so far, in seconds: on a shared machine tokens
// per CPU-second is a steadier figure than wall-clock throughput.
inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

}  // namespace recur::bench
