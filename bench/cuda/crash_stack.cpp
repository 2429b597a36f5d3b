// crash_stack: a preloadable library that prints the stack when a program dies of SIGSEGV,
// SIGBUS or SIGABRT, as each frame's module and offset (the device machine has no debugger).
// Resolve the offsets here against the unstripped binary of the same build:
//   addr2line -f -C -e build-cuda/tests/test_cuda 0xOFFSET
// Built with the CUDA preset (bench/CMakeLists.txt) and packed by pack_for_device.sh; there:
//   LD_PRELOAD=$B/lib/libcrash_stack.so $B/test_cuda --gtest_filter=...
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>

namespace {

void print_stack(int sig, siginfo_t* info, void*) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  // stdout: a test binary may have stderr captured (gtest's CaptureStderr).
  std::fprintf(stdout, "crash_stack: signal %d at address %p\n", sig, info->si_addr);
  for (int i = 0; i < n; ++i) {
    Dl_info where;
    if (dladdr(frames[i], &where) && where.dli_fname) {
      std::fprintf(stdout, "  #%d %s +0x%lx %s\n", i, where.dli_fname,
                   static_cast<unsigned long>(reinterpret_cast<uintptr_t>(frames[i]) -
                                              reinterpret_cast<uintptr_t>(where.dli_fbase)),
                   where.dli_sname ? where.dli_sname : "");
    } else {
      std::fprintf(stdout, "  #%d %p\n", i, frames[i]);
    }
  }
  std::fflush(stdout);
  _exit(128 + sig);
}

__attribute__((constructor)) void install() {
  struct sigaction action = {};
  action.sa_sigaction = print_stack;
  action.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &action, nullptr);
  sigaction(SIGBUS, &action, nullptr);
  sigaction(SIGABRT, &action, nullptr);
}

}  // namespace
