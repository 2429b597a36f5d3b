// Helpers for testing the CUDA ops against scalar references: host tensors of any dtype,
// device copies of them, poisoned outputs (every byte 0xFF, a NaN in f32) so unwritten elements
// fail, a shared CudaOps, ragged batch layouts, and a table of the largest error seen per
// check, printed at the end. Self-contained (the references of new math are in
// cuda_reference.h; the CPU's scalar references in backend/cpu/reference.h).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/reference.h"
#include "backend/cuda/cuda_ops.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace recur::testing {

// Owned host storage for a tensor of any dtype (zeroed, with slack past the end).
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

// max |a − b| / max(floor, max |b|): error relative to the reference's scale.
inline double rel_err(const float* a, const float* b, int64_t n, double floor = 1.0) {
  return max_abs_diff(a, b, n) / std::max(floor, max_abs(b, n));
}

inline int64_t count_nonfinite(const float* a, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += !std::isfinite(a[i]);
  return c;
}

inline bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.bytes.size() == b.bytes.size() &&
         std::memcmp(a.t.data, b.t.data, size_t(a.numel()) * dtype_size(a.t.dtype)) == 0;
}

// Host-side layout of a ragged batch: one slot per sequence (in reverse order of the
// sequences), block tables shuffled.
struct Layout {
  std::vector<int32_t> seq_start{0}, slot, positions, block_start{0}, block_ids;
  SeqLayout l;
  Layout(const std::vector<int>& lens, const std::vector<int>& first_pos, int block_size,
         std::mt19937& rng) {
    int32_t next_block = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      for (int i = 0; i < lens[s]; ++i) positions.push_back(first_pos[s] + i);
      seq_start.push_back(seq_start.back() + lens[s]);
      slot.push_back(int32_t(lens.size() - 1 - s));
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

// Delta-rule inputs as a model makes them: L2-normalised q (scaled) and k, beta in (0, 1), and
// log-decays g ≤ 0 per head [n, Hv] or per key channel [n, Hv, dk], mostly mild with some strong
// ones; `strong` > 0 makes every tenth decay that strong (g = −strong: e^g underflows).
struct DeltaInputs {
  HostTensor q, k, v, g, beta;
  DeltaInputs(int64_t n, int64_t hk, int64_t hv, int64_t dk, int64_t dv, std::mt19937& rng,
              bool per_channel = false, float strong = 0.0f)
      : q(DType::F32, {n, hk, dk}),
        k(DType::F32, {n, hk, dk}),
        v(DType::F32, {n, hv, dv}),
        g(per_channel ? HostTensor(DType::F32, {n, hv, dk}) : HostTensor(DType::F32, {n, hv})),
        beta(DType::F32, {n, hv}) {
    fill_random(q, rng);
    fill_random(k, rng);
    fill_random(v, rng);
    ref::l2_norm(q.t, 1e-6f, 1.0f / std::sqrt(float(dk)));
    ref::l2_norm(k.t, 1e-6f, 1.0f);
    std::uniform_real_distribution<float> gd(-2.0f, 0.0f), bd(0.0f, 1.0f);
    for (int64_t i = 0; i < g.numel(); ++i) {
      g.f()[i] = -gd(rng) * gd(rng) * 0.5f;  // log-decays in [-2, 0]: mostly mild, some strong
      if (strong > 0 && i % 10 == 3) g.f()[i] = -strong;
    }
    for (int64_t i = 0; i < beta.numel(); ++i) beta.f()[i] = bd(rng);
  }
};

#define CUDA_TEST_CHECK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// The one CudaOps of the test program (creating one per test would recreate cuBLAS each time).
inline CudaOps* shared_ops() {
  static std::unique_ptr<CudaOps> ops = [] {
    auto r = CudaOps::create(0);
    if (!r.ok()) {
      std::fprintf(stderr, "CudaOps::create failed: %s\n", r.error().to_string().c_str());
      return std::unique_ptr<CudaOps>();
    }
    return std::move(r.value());
  }();
  return ops.get();
}

// Largest error seen per named check, printed when the program ends.
inline std::map<std::string, double>& error_table() {
  static std::map<std::string, double> t;
  return t;
}
inline void record_error(const std::string& name, double err) {
  double& e = error_table()[name];
  e = std::max(e, err);
}
class ErrorTablePrinter : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("\n%-52s %s\n", "check", "max error");
    for (const auto& [name, err] : error_table()) std::printf("%-52s %.3g\n", name.c_str(), err);
  }
};

// A device buffer holding a copy of a host tensor's bytes, viewed with the same shape.
struct DeviceTensor {
  Buffer buf;
  Tensor t;
  DeviceTensor() = default;
  DeviceTensor(CudaOps& ops, const HostTensor& h) {
    const size_t bytes = h.bytes.size();
    auto r = ops.allocator().allocate(bytes, "test tensor");
    EXPECT_TRUE(r.ok());
    buf = std::move(r.value());
    EXPECT_EQ(cudaMemcpy(buf.data(), h.bytes.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // pageable copies may return before the DMA
    t = h.t;
    t.data = buf.data();
    t.device = Device::kCuda;
  }
  // Every byte 0xFF: f32 NaN, i32 -1.
  void poison() {
    EXPECT_EQ(cudaMemset(buf.data(), 0xFF, buf.bytes()), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // The whole buffer back into a host tensor shaped like `like`.
  HostTensor download(CudaOps& ops, const HostTensor& like) const {
    HostTensor h = like;
    ops.synchronize();
    EXPECT_EQ(cudaMemcpy(h.bytes.data(), buf.data(), h.bytes.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return h;
  }
};

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ops_ = shared_ops();
    if (!ops_) GTEST_SKIP() << "no usable CUDA device";
  }
  CudaOps& ops() { return *ops_; }
  DeviceTensor dev(const HostTensor& h) { return DeviceTensor(*ops_, h); }
  DeviceTensor poisoned(const HostTensor& like) {
    DeviceTensor d(*ops_, like);
    d.poison();
    return d;
  }
  HostTensor host(const DeviceTensor& d, const HostTensor& like) { return d.download(*ops_, like); }
  Tensor weight(const HostTensor& h) { return ops_->adopt_weight(h.t).value(); }
  CudaOps* ops_ = nullptr;
  std::mt19937 rng{2024};
};

}  // namespace recur::testing
