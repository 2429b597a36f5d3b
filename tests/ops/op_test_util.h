// Helpers for comparing kernels with their scalar references on random data.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "core/tensor.h"
#include "ops/ops.h"

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
      case DType::F32:
        h.t.ptr<float>()[i] = v;
        break;
      case DType::BF16:
        h.t.ptr<uint16_t>()[i] = f32_to_bf16(v);
        break;
      case DType::F16:
        h.t.ptr<uint16_t>()[i] = f32_to_f16(v);
        break;
      default:
        FAIL() << "fill_random: unsupported dtype";
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

// Host-side layout of a ragged batch: one slot per sequence, block tables shuffled.
struct Layout {
  std::vector<int32_t> seq_start{0}, slot, positions, block_start{0}, block_ids;
  SeqLayout l;
  Layout(const std::vector<int>& lens, const std::vector<int>& first_pos, int block_size,
         std::mt19937& rng) {
    int32_t next_block = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      for (int i = 0; i < lens[s]; ++i) positions.push_back(first_pos[s] + i);
      seq_start.push_back(seq_start.back() + lens[s]);
      slot.push_back(int32_t(lens.size() - 1 - s));  // slots in reverse order of sequences
      const int n_blocks = (first_pos[s] + lens[s] + block_size - 1) / block_size;
      for (int b = 0; b < n_blocks; ++b) block_ids.push_back(next_block++);
      block_start.push_back(int32_t(block_ids.size()));
    }
    std::shuffle(block_ids.begin(), block_ids.end(), rng);  // non-contiguous physical blocks
    l.n_seqs = int(lens.size());
    l.n_tokens = seq_start.back();
    l.seq_start = seq_start.data();
    l.slot = slot.data();
    l.positions = positions.data();
    l.block_start = block_start.data();
    l.block_ids = block_ids.data();
    l.block_size = block_size;
  }
  Layout(const Layout&) = delete;  // l points into this object's vectors
  int n_blocks() const { return int(block_ids.size()); }
};

// Delta-rule inputs as the model makes them: l2-normalised q (scaled) and k, log-decays g, beta.
struct DeltaInputs {
  HostTensor q, k, v, g, beta;
  DeltaInputs(int64_t n, int64_t hk, int64_t hv, int64_t dk, int64_t dv, std::mt19937& rng)
      : q(DType::F32, {n, hk, dk}),
        k(DType::F32, {n, hk, dk}),
        v(DType::F32, {n, hv, dv}),
        g(DType::F32, {n, hv}),
        beta(DType::F32, {n, hv}) {
    fill_random(q, rng);
    fill_random(k, rng);
    fill_random(v, rng);
    CpuOps ops(1);
    ops.l2_norm(q.t, 1e-6f, 1.0f / std::sqrt(float(dk)));
    ops.l2_norm(k.t, 1e-6f, 1.0f);
    std::uniform_real_distribution<float> gd(-2.0f, 0.0f), bd(0.0f, 1.0f);
    for (int64_t i = 0; i < g.numel(); ++i) {
      g.f()[i] = -gd(rng) * gd(rng) * 0.5f;  // log-decays in [-2, 0]: mostly mild, some strong
      beta.f()[i] = bd(rng);
    }
  }
};

}  // namespace recur::testing
