// libFuzzer's entry point for one target, chosen at build time (RECUR_FUZZ_TARGET).
#include "fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return recur::fuzz::RECUR_FUZZ_TARGET(data, size);
}
