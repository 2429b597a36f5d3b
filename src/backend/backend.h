// Picks the op backend for a device name: "cpu", "cuda" or "cuda:N".
#pragma once

#include <memory>
#include <string>

#include "ops/ops.h"

namespace recur {

// threads: CPU worker threads (0: all cores); ignored by device backends.
Result<std::unique_ptr<Ops>> create_backend(const std::string& device, int threads);

// Whether this build has the CUDA backend.
bool cuda_available();

}  // namespace recur
