#include "core/status.h"

#include <cstdio>
#include <cstdlib>

namespace recur {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kNotFound:
      return "not found";
    case ErrorCode::kCorrupt:
      return "corrupt";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kOutOfResources:
      return "out of resources";
    case ErrorCode::kIo:
      return "io error";
    case ErrorCode::kInternal:
      return "internal error";
  }
  return "error";
}

void check_failed(const char* cond, const char* file, int line) {
  std::fprintf(stderr, "recur: internal invariant failed: %s at %s:%d\n", cond, file, line);
  std::abort();
}

}  // namespace recur
