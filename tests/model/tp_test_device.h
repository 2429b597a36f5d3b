// The backends of the tensor-parallel tests: the CPU's, or with RECUR_TEST_DEVICE=cuda (the
// device machine) the GPU's, rank r on the device after rank r-1's; with
// RECUR_TEST_SHARED_GPU=1 as well, every rank on device 0 (a machine with one GPU).
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include "backend/backend.h"

namespace recur_test {

// The --device string for a model over `world` ranks (1: the whole model).
inline std::string tp_test_device(int world) {
  const char* d = std::getenv("RECUR_TEST_DEVICE");
  const std::string device = d && *d ? d : "cpu";
  const char* shared = std::getenv("RECUR_TEST_SHARED_GPU");
  if (device == "cpu" || !shared || std::string(shared) != "1") return device;
  std::string list = "cuda:0";
  for (int r = 1; r < world; ++r) list += ",0";
  return list;
}

// Rank r's backend of a model over `world` ranks, one CPU thread each. GPU prompts over block-FP8
// weights on f16 terms: e4m3 activations are quantized in groups of a rank's own columns, so
// only f32-class products give the whole model's logits within the tests' bounds.
inline recur::Result<std::unique_ptr<recur::Ops>> tp_test_backend(int rank, int world) {
  recur::BackendOptions options;
  options.fp8_activations = recur::Fp8Activations::kF16;
  return recur::create_backend(tp_test_device(world), 1, rank, world, options);
}

}  // namespace recur_test
