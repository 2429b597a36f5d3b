// Picks the op backend for a device name: "cpu", "cuda", "cuda:N" or "cuda:N,M,...".
#pragma once

#include <memory>
#include <string>

#include "ops/ops.h"

namespace recur {

// threads: CPU worker threads (0: all cores); ignored by device backends. rank of world:
// which tensor-parallel rank the backend is for: on "cuda:N" rank r takes device N + r; a
// list "cuda:N,M,..." names one device per rank (a device may repeat: ranks that share one).
// options: what a device backend is created with (ops.h).
Result<std::unique_ptr<Ops>> create_backend(const std::string& device, int threads, int rank = 0,
                                            int world = 1, const BackendOptions& options = {});

}  // namespace recur
