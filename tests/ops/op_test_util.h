// Helpers for comparing kernels with their scalar references on random data.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/tensor.h"

namespace recur::testing {

// Owned host storage for a tensor of any dtype.
struct HostTensor {
  std::vector<uint8_t> bytes;
  Tensor t;
  HostTensor(DType dt, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    bytes.assign(size_t(n) * dtype_size(dt) + 64, 0);
    t = Tensor::contiguous(bytes.data(), dt, shape);
  }
  HostTensor(const HostTensor& o) : bytes(o.bytes), t(o.t) { t.data = bytes.data(); }
  HostTensor& operator=(const HostTensor& o) {
    bytes = o.bytes;
    t = o.t;
    t.data = bytes.data();
    return *this;
  }
  float* f() const { return t.ptr<float>(); }
  int64_t numel() const { return t.numel(); }
};

inline void fill_random(HostTensor& h, std::mt19937& rng, float scale = 1.0f, float offset = 0) {
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < h.numel(); ++i) {
    const float v = dist(rng) + offset;
    switch (h.t.dtype) {
      case DType::F32: h.t.ptr<float>()[i] = v; break;
      case DType::BF16: h.t.ptr<uint16_t>()[i] = f32_to_bf16(v); break;
      case DType::F16: h.t.ptr<uint16_t>()[i] = f32_to_f16(v); break;
      default: FAIL() << "fill_random: unsupported dtype";
    }
  }
}

// Largest |a - b| over the first n floats; NaN counts as infinite.
inline double max_abs_diff(const float* a, const float* b, int64_t n) {
  double d = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = std::fabs(double(a[i]) - double(b[i]));
    if (std::isnan(e)) return INFINITY;
    d = std::max(d, e);
  }
  return d;
}

inline double max_abs(const float* a, int64_t n) {
  double d = 0;
  for (int64_t i = 0; i < n; ++i) d = std::max(d, std::fabs(double(a[i])));
  return d;
}

}  // namespace recur::testing
