// Helpers for testing the CUDA ops against scalar references: device copies of the host tensors
// of ops/op_test_util.h (which holds the host side: tensors, error measures, ragged layouts,
// the inputs of the larger ops), poisoned outputs (every byte 0xFF, a NaN in f32) so unwritten
// elements fail, a shared CudaOps, and a table of the largest error seen per check, printed at
// the end. The scalar references are the CPU's (backend/cpu/reference.h) and, for the math
// they do not cover, cuda_reference.h's.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "core/tensor.h"
#include "ops/op_test_util.h"
#include "ops/ops.h"

namespace recur::testing {

#define CUDA_TEST_CHECK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// The one CudaOps of the test program (creating one per test would recreate cuBLAS each time).
// Block-FP8 prompts on f16 terms: the tests hold every path but the e4m3 one (which makes its
// own, profile_table) to f32-class bounds.
inline CudaOps* shared_ops() {
  static std::unique_ptr<CudaOps> ops = [] {
    BackendOptions f16_terms;
    f16_terms.fp8_activations = Fp8Activations::kF16;
    auto r = CudaOps::create(0, f16_terms);
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
  // Case c's attention input stage on device copies of its tensors, twice: [0] by the fused
  // attention_inputs, [1] by the default's ops (Ops::attention_inputs).
  struct AttentionInputRun {
    DeviceTensor q, k, v, kc, vc;
  };
  std::array<AttentionInputRun, 2> fused_and_default_attention_inputs(const AttentionInputCase& c,
                                                                      const SeqLayout& l) {
    const Tensor dqn = weight(c.q_norm), dkn = weight(c.k_norm);
    std::array<AttentionInputRun, 2> runs;
    for (AttentionInputRun& r : runs)
      r.q = dev(c.q), r.k = dev(c.k), r.v = dev(c.v), r.kc = dev(c.kc), r.vc = dev(c.vc);
    auto args = [&](AttentionInputRun& r) {
      AttentionInputArgs a = c.args();
      a.q_norm = dqn, a.k_norm = dkn;
      a.q = r.q.t, a.k = r.k.t, a.v = r.v.t, a.k_cache = r.kc.t, a.v_cache = r.vc.t;
      return a;
    };
    ops_->begin_forward(l, {}, {});
    ops_->attention_inputs(args(runs[0]), l);
    ops_->Ops::attention_inputs(args(runs[1]), l);
    return runs;
  }
  CudaOps* ops_ = nullptr;
  std::mt19937 rng{2024};
};

// The count column of `label`'s row in RECUR_CUDA_PROFILE's table (-1 when the row is missing).
inline long long profile_count(const std::string& table, const std::string& label) {
  size_t at = table.find(label);
  if (at == std::string::npos) return -1;
  double ms = 0;
  long long count = -1;
  if (std::sscanf(table.c_str() + at + label.size(), "%lf %lld", &ms, &count) != 2) return -1;
  return count;
}

// An environment variable set for a scope (a backend reads its switches when created), then
// put back as it was: a run that set it for the whole program keeps it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* v = std::getenv(name)) prev_ = v;
    setenv(name, value, 1);
  }
  ~ScopedEnv() { prev_ ? setenv(name_, prev_->c_str(), 1) : unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> prev_;
};

// Whether backends on device 0 take the build's sm_90a paths (wgmma, e4m3 tiles): the
// backend's own rule (RECUR_CUDA_PORTABLE=1 turns them off); false without a usable device.
inline bool device_is_sm90a() {
  return CudaOps::takes_sm90a_paths(0);
}

// The RECUR_CUDA_PROFILE table (printed as the backend goes away) of the launches fn(ops)
// makes on a backend of its own, created with `options`; *ok false, and nothing run, without a
// usable device.
template <typename Fn>
std::string profile_table(Fn&& fn, bool* ok, const BackendOptions& options) {
  auto created = [&options] {
    const ScopedEnv profile("RECUR_CUDA_PROFILE", "1");
    return CudaOps::create(0, options);
  }();
  *ok = created.ok();
  if (!*ok) return {};
  ::testing::internal::CaptureStderr();
  {
    std::unique_ptr<CudaOps> ops = std::move(created.value());
    fn(*ops);
    ops->synchronize();
  }
  return ::testing::internal::GetCapturedStderr();
}
// The same with fp8 for block-FP8 prompts (f16 terms unless told), the rest as default.
template <typename Fn>
std::string profile_table(Fn&& fn, bool* ok, Fp8Activations fp8 = Fp8Activations::kF16) {
  BackendOptions options;
  options.fp8_activations = fp8;
  return profile_table(std::forward<Fn>(fn), ok, options);
}

// An expert set on the host (h, views of host's tensors) and as the backend adopted it (d).
struct Experts {
  std::vector<HostTensor> host;
  std::vector<ExpertWeights> h, d;
};

// Random weights, or with one_hot (16-bit dtypes) each row a single 1 at a column that depends on
// the expert, the matrix and the row: every product is then one activation, exactly.
inline Experts make_experts(CudaOps& ops, int64_t E, int64_t d, int64_t ff, DType dt,
                            std::mt19937& rng, bool one_hot = false) {
  Experts x;
  x.host.reserve(size_t(E) * 3);
  for (int64_t e = 0; e < E; ++e) {
    x.host.emplace_back(dt, std::initializer_list<int64_t>{ff, d});
    x.host.emplace_back(dt, std::initializer_list<int64_t>{ff, d});
    x.host.emplace_back(dt, std::initializer_list<int64_t>{d, ff});
    const size_t b = x.host.size() - 3;
    for (size_t j = b; j < x.host.size(); ++j) {
      if (!one_hot) {
        fill_random(x.host[j], rng, 0.3f);
        continue;
      }
      const int64_t rows = x.host[j].t.shape[0], cols = x.host[j].t.shape[1];
      const uint16_t one = dt == DType::BF16 ? f32_to_bf16(1.0f) : f32_to_f16(1.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t c = (r * int64_t(j - b + 1) + 5 * e + int64_t(j - b)) % cols;
        x.host[j].t.ptr<uint16_t>()[r * cols + c] = one;
      }
    }
    x.h.push_back({x.host[b].t, x.host[b + 1].t, x.host[b + 2].t});
    // As the model adopts them (the backend checks bf16 weights' range there).
    auto adopt = [&](size_t j) { return ops.adopt_matmul_weight(x.host[j].t, nullptr).value(); };
    x.d.push_back({adopt(b), adopt(b + 1), adopt(b + 2)});
  }
  return x;
}

// The experts (ids, weights [n, k]) as a backend that rounds its activations computes them: x's
// rows, and each (token, expert) pair's SwiGLU row (f32 first, as the kernels store it), go
// through round (rows [r, c] -> rows of the same shape), the products in double. Weights F32,
// BF16 or F16. out [n, d].
template <typename Round>
HostTensor experts_with_rounded_rows(const HostTensor& x, std::span<const ExpertWeights> ex,
                                     const HostTensor& ids, const HostTensor& w, Round&& round) {
  const int64_t n = x.t.shape[0], d = x.t.shape[1], k = ids.t.shape[1];
  const HostTensor xr = round(x);
  HostTensor out(DType::F32, {n, d});
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> acc(size_t(d), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const ExpertWeights& e = ex[size_t(ids.t.ptr<int32_t>()[t * k + j])];
      const int64_t f = e.gate.shape[0];
      HostTensor h(DType::F32, {1, f});
      for (int64_t i = 0; i < f; ++i) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < d; ++c) {
          g += double(element_f32(e.gate, i * d + c)) * xr.f()[t * d + c];
          u += double(element_f32(e.up, i * d + c)) * xr.f()[t * d + c];
        }
        h.f()[i] = float(g / (1.0 + std::exp(-g)) * u);
      }
      const HostTensor hr = round(h);
      for (int64_t c = 0; c < d; ++c) {
        double y = 0;
        for (int64_t i = 0; i < f; ++i) y += double(element_f32(e.down, c * f + i)) * hr.f()[i];
        acc[size_t(c)] += double(w.f()[t * k + j]) * y;
      }
    }
    for (int64_t c = 0; c < d; ++c) out.f()[t * d + c] = float(acc[size_t(c)]);
  }
  return out;
}

// A forward of `decode` one-token sequences (first) and a prompt of `prompt` tokens, through a
// matmul by w ([m, d]) and routed experts (k of E; ff their width), with random x and router
// logits; then a forward of the decode sequences alone. Checks that the decode rows come out
// bit for bit as alone (their products must not depend on the prompt beside them) and returns
// x [decode + prompt, d] and the whole forward's matmul rows [decode + prompt, m].
struct DecodeBesidePrompt {
  HostTensor x, matmul;
};
inline DecodeBesidePrompt decode_rows_beside_a_prompt(CudaOps& ops, const Tensor& w,
                                                      std::span<const ExpertWeights> experts,
                                                      int64_t ff, int64_t k, int decode,
                                                      int64_t prompt, std::mt19937& rng) {
  const int64_t d = w.shape[1], m = w.shape[0], E = int64_t(experts.size()), n = decode + prompt;
  HostTensor x(DType::F32, {n, d}), logits(DType::F32, {n, E});
  fill_random(x, rng, 0.5f);
  fill_random(logits, rng, 2.0f);
  std::vector<int> lens(size_t(decode), 1), starts(size_t(decode) + 1, 5);
  lens.push_back(int(prompt));
  // The forward's matmul and experts over its first `rows` rows.
  auto run = [&](const std::vector<int>& ls, int64_t rows) {
    Layout lay(ls, std::vector<int>(starts.begin(), starts.begin() + ptrdiff_t(ls.size())), 16,
               rng);
    ops.begin_forward(lay.l, {}, {});
    HostTensor xr(DType::F32, {rows, d}), lr(DType::F32, {rows, E});
    std::copy_n(x.f(), rows * d, xr.f());
    std::copy_n(logits.f(), rows * E, lr.f());
    HostTensor mo(DType::F32, {rows, m}), eo(DType::F32, {rows, d});
    HostTensor ids(DType::I32, {rows, k}), wts(DType::F32, {rows, k});
    DeviceTensor dx(ops, xr), dl(ops, lr), dmo(ops, mo), deo(ops, eo), dids(ops, ids), dw(ops, wts);
    HostTensor scratch_h(
        DType::U8, {int64_t(ops.moe_experts_scratch_bytes(int(rows), int(k), int(E), int(d),
                                                          int(ff), experts.front().gate.dtype))});
    DeviceTensor scratch(ops, scratch_h);
    ops.matmul(dx.t, w, dmo.t);
    MoeRouting routing;
    routing.k = int(k);
    ops.moe_route(dl.t, routing, dids.t, dw.t);
    ops.moe_experts(dx.t, experts, dids.t, dw.t, deo.t, scratch.t);
    return std::pair{dmo.download(ops, mo), deo.download(ops, eo)};
  };
  auto [whole_mm, whole_ex] = run(lens, n);
  const auto [alone_mm, alone_ex] = run(std::vector<int>(lens.begin(), lens.end() - 1), decode);
  EXPECT_EQ(std::memcmp(whole_mm.f(), alone_mm.f(), size_t(decode * m) * 4), 0)
      << "matmul, " << decode << " decode rows";
  EXPECT_EQ(std::memcmp(whole_ex.f(), alone_ex.f(), size_t(decode * d) * 4), 0)
      << "experts, " << decode << " decode rows";
  return {std::move(x), std::move(whole_mm)};
}

}  // namespace recur::testing
