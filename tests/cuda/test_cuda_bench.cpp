// Timings of the main kernels at Qwen3-Next-80B sizes (hidden 2048, 512 experts of 512, top-10,
// GDN 16 key / 32 value heads of 128, attention 16 heads / 2 kv heads of 256). Buffers hold a
// constant non-zero byte pattern (timing only; correctness is the other tests' job). Each
// figure is the mean over repeated calls after a warm-up, host-timed around synchronize(), so
// launch overheads are included. Prints only; never fails.
#include <chrono>

#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using namespace testing;

class CudaBench : public CudaTest {
 protected:
  // A device tensor filled with `byte` (0x3C: bf16 ≈ 0.0115, f32 ≈ 0.0115; 0xBC: negative).
  Tensor make(DType dt, std::initializer_list<int64_t> shape, uint8_t byte = 0x3C) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    auto r = ops().allocator().allocate(size_t(n) * dtype_size(dt), "bench");
    EXPECT_TRUE(r.ok());
    EXPECT_EQ(cudaMemset(r.value().data(), byte, r.value().bytes()), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    Tensor t = Tensor::contiguous(r.value().data(), dt, shape, Device::kCuda);
    bufs_.push_back(std::move(r.value()));
    return t;
  }
  template <typename F>
  double time_us(F&& f, int iters) {
    f();
    ops().synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) f();
    ops().synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
  }
  std::vector<Buffer> bufs_;
};

TEST_F(CudaBench, Matmul) {
  const int64_t k = 2048, m = 65536;  // 256 MiB of bf16 weights: far beyond L2
  Tensor w = make(DType::BF16, {m, k});
  Tensor x = make(DType::F32, {4096, k}), out = make(DType::F32, {4096, m});
  for (int64_t n : {1, 2, 4, 8}) {
    const double us =
        time_us([&] { ops().matmul(x.slice_rows(0, n), w, out.slice_rows(0, n)); }, 20);
    std::printf("bench matmul gemv n=%ld %ldx%ld bf16: %.1f us, %.0f GB/s of weights\n", long(n),
                long(m), long(k), us, double(m * k * 2) / us * 1e-3);
  }
  Tensor w2 = make(DType::BF16, {4096, k});
  for (int64_t n : {64, 512, 4096}) {
    const double us = time_us(
        [&] { ops().matmul(x.slice_rows(0, n), w2, out.slice_rows(0, n).slice_cols(0, 4096)); },
        10);
    std::printf("bench matmul cublas n=%ld 4096x%ld bf16: %.1f us, %.0f TFLOP/s\n", long(n),
                long(k), us, 2.0 * double(n * 4096 * k) / us * 1e-6);
  }
  // The prompt shapes of Qwen3-Next-80B's projections at prompt sizes around one forward's.
  for (int64_t rows : {2048, 4096, 8192, 12288}) {
    Tensor wr = make(DType::BF16, {rows, k});
    for (int64_t n : {1024, 2048, 2500, 3072, 4096}) {
      const double us = time_us(
          [&] { ops().matmul(x.slice_rows(0, n), wr, out.slice_rows(0, n).slice_cols(0, rows)); },
          10);
      std::printf("bench matmul cublas n=%ld %ldx%ld bf16: %.1f us, %.0f TFLOP/s\n", long(n),
                  long(rows), long(k), us, 2.0 * double(n * rows * k) / us * 1e-6);
    }
  }
}

TEST_F(CudaBench, DeltaRule) {
  const int64_t hk = 16, hv = 32, dk = 128, dv = 128;
  for (int n_seqs : {1, 32}) {
    std::mt19937 rng(1);
    Layout lay(std::vector<int>(size_t(n_seqs), 1), std::vector<int>(size_t(n_seqs), 100), 16, rng);
    Tensor q = make(DType::F32, {n_seqs, hk, dk}), k = make(DType::F32, {n_seqs, hk, dk});
    Tensor v = make(DType::F32, {n_seqs, hv, dv}), g = make(DType::F32, {n_seqs, hv}, 0xBC);
    Tensor beta = make(DType::F32, {n_seqs, hv}), out = make(DType::F32, {n_seqs, hv, dv});
    Tensor state = make(DType::F32, {n_seqs, hv, dk, dv});
    ops().begin_forward(lay.l, {}, {});
    const double us =
        time_us([&] { ops().gated_delta_rule(q, k, v, g, beta, state, lay.l, out, Tensor{}); }, 50);
    std::printf("bench delta rule decode %d seqs: %.1f us, %.0f GB/s of state\n", n_seqs, us,
                double(n_seqs * hv * dk * dv * 8) / us * 1e-3);
  }
  for (bool per_channel : {false, true}) {
    const int len = 4096;
    std::mt19937 rng(1);
    Layout lay({len}, {0}, 16, rng);
    Tensor q = make(DType::F32, {len, hk, dk}), k = make(DType::F32, {len, hk, dk});
    Tensor v = make(DType::F32, {len, hv, dv}), beta = make(DType::F32, {len, hv});
    Tensor g =
        per_channel ? make(DType::F32, {len, hv, dk}, 0xBC) : make(DType::F32, {len, hv}, 0xBC);
    Tensor out = make(DType::F32, {len, hv, dv}), state = make(DType::F32, {1, hv, dk, dv});
    ops().begin_forward(lay.l, {}, {});
    const double us =
        time_us([&] { ops().gated_delta_rule(q, k, v, g, beta, state, lay.l, out, Tensor{}); }, 3);
    std::printf("bench delta rule chunked prompt of %d, decay %s: %.0f us\n", len,
                per_channel ? "per key channel" : "per head", us);
  }
  for (int len : {512}) {
    std::mt19937 rng(1);
    Layout lay({len}, {0}, 16, rng);
    Tensor q = make(DType::F32, {len, hk, dk}), k = make(DType::F32, {len, hk, dk});
    Tensor v = make(DType::F32, {len, hv, dv}), g = make(DType::F32, {len, hv}, 0xBC);
    Tensor beta = make(DType::F32, {len, hv}), out = make(DType::F32, {len, hv, dv});
    Tensor state = make(DType::F32, {1, hv, dk, dv});
    ops().begin_forward(lay.l, {}, {});
    const double us =
        time_us([&] { ops().gated_delta_rule(q, k, v, g, beta, state, lay.l, out, Tensor{}); }, 3);
    std::printf("bench delta rule chunked prompt of %d: %.0f us\n", len, us);
  }
}

TEST_F(CudaBench, PagedAttention) {
  const int64_t heads = 16, kv = 2, hd = 256;
  const int bs = 16;
  struct Case {
    std::vector<int> lens, first;
    const char* what;
  };
  const Case cases[] = {
      {{1}, {32767}, "decode 1 seq at 32k"},
      {std::vector<int>(32, 1), std::vector<int>(32, 4095), "decode 32 seqs at 4k"},
      {{4096}, {0}, "prompt of 4096"}};
  for (const Case& c : cases) {
    std::mt19937 rng(1);
    Layout lay(c.lens, c.first, bs, rng);
    const int64_t n = lay.l.n_tokens;
    Tensor kc = make(DType::F32, {lay.n_blocks(), kv, hd, bs}),
           vc = make(DType::F32, {lay.n_blocks(), kv, bs, hd});
    Tensor q = make(DType::F32, {n, heads, hd}), out = make(DType::F32, {n, heads, hd});
    ops().begin_forward(lay.l, {}, {});
    const double us = time_us([&] { ops().paged_attention(q, kc, vc, lay.l, 0.0625f, out); }, 5);
    std::printf("bench paged attention %s: %.0f us\n", c.what, us);
  }
}

TEST_F(CudaBench, MoeExperts) {
  const int64_t E = 512, topk = 10, d = 2048, ff = 512;
  std::vector<ExpertWeights> experts;
  Tensor all = make(DType::BF16, {E * 3, ff, d});  // 3 GiB of experts
  for (int64_t e = 0; e < E; ++e) {
    auto mat = [&](int64_t i, int64_t rows, int64_t cols) {
      Tensor t = Tensor::contiguous(static_cast<uint16_t*>(all.data) + (e * 3 + i) * ff * d,
                                    DType::BF16, {rows, cols}, Device::kCuda);
      return t;
    };
    experts.push_back({mat(0, ff, d), mat(1, ff, d), mat(2, d, ff)});
  }
  for (int64_t n : {1, 8, 512, 4096}) {
    Tensor x = make(DType::F32, {n, d}), out = make(DType::F32, {n, d});
    Tensor logits = make(DType::F32, {n, E});
    Tensor ids = make(DType::I32, {n, topk}), routed = make(DType::I32, {n, topk});
    Tensor w = make(DType::F32, {n, topk});
    // Spread the tokens over experts: a logits pattern would route every token alike.
    std::vector<int32_t> host_ids(size_t(n * topk));
    for (size_t i = 0; i < host_ids.size(); ++i) host_ids[i] = int32_t((i * 7919) % E);
    ASSERT_EQ(cudaMemcpy(ids.data, host_ids.data(), host_ids.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    Tensor scratch = make(
        DType::U8, {int64_t(ops().moe_experts_scratch_bytes(int(n), int(topk), int(E), int(d),
                                                            int(ff), experts.front().gate.dtype))});
    MoeRouting routing;
    routing.k = int(topk);
    const double route = time_us([&] { ops().moe_route(logits, routing, routed, w); }, 10);
    const double us =
        time_us([&] { ops().moe_experts(x, experts, ids, w, out, scratch); }, n >= 512 ? 3 : 20);
    const int64_t active = std::min<int64_t>(E, n * topk);
    std::printf(
        "bench moe n=%ld: route %.1f us, experts %.0f us (%.0f GB/s if %ld experts read once, %.0f "
        "TFLOP/s)\n",
        long(n), route, us, double(active * 3 * ff * d * 2) / us * 1e-3, long(active),
        2.0 * 3 * double(n * topk * ff * d) / us * 1e-6);
  }
}

}  // namespace
}  // namespace recur
