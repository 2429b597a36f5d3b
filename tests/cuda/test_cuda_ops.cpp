// Row-wise, elementwise and matmul CUDA ops against the scalar references, at awkward sizes,
// with poisoned outputs.
//
// Tolerances (error relative to the reference's largest magnitude, floor 1):
//   f32 arithmetic (GEMV, SGEMM, norms, rope, elementwise)  ≤ 1e-5 (rope 2e-5, as on the CPU)
//   bf16/f16 tensor-core matmul (activations split exactly into three 16-bit terms): as f32
#include <cstring>

#include "backend/cpu/reference.h"
#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using namespace testing;

[[maybe_unused]] auto* const kPrinter = ::testing::AddGlobalTestEnvironment(new ErrorTablePrinter);

class CudaBasic : public CudaTest {
 protected:
  // F16 weights [m, k] against n rows at scales 1, 1e6, 2^40 and 2^-40 (every eighth with one
  // value past f16's range), written and accumulated into column slices.
  void f16_rows_of_any_range(int64_t n, int64_t k, int64_t m);
};

TEST_F(CudaBasic, AllocatorCountsBuffersAndBytes) {
  const AllocStats before = ops().allocator().stats();
  {
    auto a = ops().allocator().allocate(1000, "a");
    auto b = ops().allocator().allocate(24, "b");
    ASSERT_TRUE(a.ok() && b.ok());
    const AllocStats mid = ops().allocator().stats();
    EXPECT_EQ(mid.live_buffers, before.live_buffers + 2);
    EXPECT_EQ(mid.live_bytes, before.live_bytes + 1024);
    EXPECT_EQ(mid.allocs_total, before.allocs_total + 2);
    EXPECT_EQ(a.value().device(), Device::kCuda);
  }
  const AllocStats after = ops().allocator().stats();
  EXPECT_EQ(after.live_buffers, before.live_buffers);
  EXPECT_EQ(after.live_bytes, before.live_bytes);
}

TEST_F(CudaBasic, AdoptWeightKeepsDtypeAndCopyToHostRoundTrips) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    HostTensor w(dt, {33, 17});
    fill_random(w, rng);
    auto r = ops().adopt_weight(w.t);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r.value().dtype, dt);
    EXPECT_EQ(r.value().device, Device::kCuda);
    HostTensor back = w;
    std::fill(back.bytes.begin(), back.bytes.end(), 0);
    ops().copy_to_host(r.value(), back.t.data);
    EXPECT_EQ(std::memcmp(back.bytes.data(), w.bytes.data(), size_t(w.numel()) * dtype_size(dt)),
              0);
  }
  // fill_zero, and the forward's own zeroing (tensor-parallel ranks but the first clear h
  // before each block), over more elements than one block of threads takes.
  for (const bool in_forward : {false, true}) {
    HostTensor z(DType::F32, {9, 301});
    fill_random(z, rng);
    DeviceTensor dz = dev(z);
    if (in_forward) {
      ops().zero_in_forward(dz.t);
    } else {
      ops().fill_zero(dz.t);
    }
    EXPECT_EQ(max_abs(host(dz, z).f(), z.numel()), 0.0) << "in forward: " << in_forward;
  }
}

// copy on the device (the prefix cache's snapshots): one row of a pool into another pool's row
// and back, byte for byte, the neighbouring rows untouched.
TEST_F(CudaBasic, CopyMovesOneRowOfAPoolOnTheDevice) {
  HostTensor pool(DType::F32, {3, 5, 33}), snapshots(DType::F32, {2, 5, 33});
  fill_random(pool, rng);
  fill_random(snapshots, rng);
  DeviceTensor dpool = dev(pool), dsnap = dev(snapshots);
  ops().copy(dpool.t.slice_rows(1, 2), dsnap.t.slice_rows(0, 1));
  ops().copy(dsnap.t.slice_rows(1, 2), dpool.t.slice_rows(2, 3));
  const HostTensor s = host(dsnap, snapshots), p = host(dpool, pool);
  const size_t row = 5 * 33;
  EXPECT_EQ(std::memcmp(s.f(), pool.f() + row, row * 4), 0);
  EXPECT_EQ(std::memcmp(s.f() + row, snapshots.f() + row, row * 4), 0);
  EXPECT_EQ(std::memcmp(p.f() + 2 * row, snapshots.f() + row, row * 4), 0);
  EXPECT_EQ(std::memcmp(p.f(), pool.f(), 2 * row * 4), 0);
}

// argmax_rows on the device picks what the host rule (Ops' default) picks: rows of a real
// vocabulary, longer ones (blocks taking several spans) and short ones, with the maximum tied,
// NaN, and rows with nothing above -inf; each shape twice (the split kernel's per-row counts
// must be back at zero), and more rows than the split kernel holds (one block per row).
TEST_F(CudaBasic, ArgmaxRowsEqualsTheHostRule) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::pair<int64_t, int64_t> shapes[] = {{151936, 7}, {151936, 7}, {300001, 7}, {1000, 7},
                                                {5, 7},      {5, 1100},   {4097, 7},   {4097, 7}};
  for (auto [V, n] : shapes) {
    HostTensor x(DType::F32, {n, V});
    fill_random(x, rng, 4.0f);
    float* r = x.f();
    r[0 * V + V - 1] = 50, r[0 * V + V / 2] = 50;  // tie: the lower index
    r[1 * V + 0] = nan;
    r[2 * V + V / 3] = nan, r[2 * V + V - 1] = 60;
    for (int64_t j = 0; j < V; ++j) r[3 * V + j] = -inf;
    for (int64_t j = 0; j < V; ++j) r[4 * V + j] = nan;
    for (int64_t j = 0; j < V; ++j) r[5 * V + j] = j % 3 == 0 ? nan : -inf;
    HostTensor ids(DType::I32, {n}), want = ids;
    DeviceTensor dx = dev(x), dids = poisoned(ids);
    ops().argmax_rows(dx.t, dids.t);
    ops().Ops::argmax_rows(x.t, want.t);
    const HostTensor got = host(dids, ids);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(got.t.ptr<int32_t>()[i], want.t.ptr<int32_t>()[i]) << "V=" << V << " row " << i;
    }
    EXPECT_EQ(want.t.ptr<int32_t>()[0], int32_t(V / 2));
  }
}

// matmul_group: every output equals, bit for bit, what matmul gives for that weight alone
// (one launch for GEMV token counts, one matmul per weight beyond; F16 weights beyond share one
// split of x into terms and one pass scaling its rows back, so rows of x are put at scales
// that need it), and the reference.
TEST_F(CudaBasic, MatmulGroupEqualsOneMatmulPerWeight) {
  for (DType wt : {DType::BF16, DType::F32, DType::F16}) {
    for (int64_t n : {1, 2, 5, 8, 12, 40}) {
      for (int64_t k : {64, 264}) {
        // The second set has more rows than one wave of 4-row blocks holds (8 rows per block
        // for one or two tokens on an H200's 132 SMs): the same sums in either case. At 40
        // tokens its first and last weights leave the GEMV kernel.
        const std::vector<int64_t> ms =
            k == 64 ? std::vector<int64_t>{33, 1, 512, 6} : std::vector<int64_t>{9001, 7, 4100};
        HostTensor x(DType::F32, {n, k});
        fill_random(x, rng);
        const float scale[] = {1.0f, 1e6f, 0x1p40f, 0x1p-40f};
        for (int64_t t = 0; wt == DType::F16 && t < n; ++t) {
          for (int64_t c = 0; c < k; ++c) x.f()[t * k + c] *= scale[t % 4];
        }
        DeviceTensor dx = dev(x);
        std::vector<HostTensor> w, out;
        std::vector<Tensor> dws, douts;
        std::vector<DeviceTensor> dgroup, dalone;
        for (int64_t m : ms) {
          w.push_back(HostTensor(wt, {m, k}));
          fill_random(w.back(), rng, 0.2f);
          auto dw = ops().adopt_weight(w.back().t);
          ASSERT_TRUE(dw.ok());
          dws.push_back(dw.value());
          out.push_back(HostTensor(DType::F32, {n, m}));
        }
        for (size_t i = 0; i < out.size(); ++i) {
          dgroup.push_back(poisoned(out[i]));
          dalone.push_back(poisoned(out[i]));
          douts.push_back(dgroup.back().t);
        }
        ops().matmul_group(dx.t, dws, douts);
        for (size_t i = 0; i < out.size(); ++i) {
          ops().matmul(dx.t, dws[i], dalone[i].t, false);
          HostTensor got = host(dgroup[i], out[i]), alone = host(dalone[i], out[i]), ref = out[i];
          ref::matmul(x.t, w[i].t, ref.t);
          const int64_t cnt = out[i].numel();
          ASSERT_EQ(count_nonfinite(got.f(), cnt), 0);
          EXPECT_EQ(std::memcmp(got.f(), alone.f(), size_t(cnt) * 4), 0)
              << dtype_name(wt) << " n=" << n << " k=" << k << " weight " << i;
          const double err = rel_err(got.f(), ref.f(), cnt);
          record_error(std::string("matmul_group ") + dtype_name(wt), err);
          EXPECT_LE(err, 1e-5);
        }
      }
    }
  }
}

// A token's GEMV row does not depend on the batch: one token (whose blocks load their first
// weight chunks before the wait for the kernel before) equals, bit for bit, the same token as
// row 0 of two- and five-token launches, for matmul and matmul_group (8-row blocks at 9001
// rows), with one to several chunks per thread and row.
TEST_F(CudaBasic, OneTokenGemvEqualsItsRowInABatch) {
  for (DType wt : {DType::BF16, DType::F32}) {
    for (int64_t k : {64, 264, 2048, 4096}) {
      const std::vector<int64_t> ms = {7, 2048, 9001};
      HostTensor x(DType::F32, {5, k});
      fill_random(x, rng);
      DeviceTensor dx = dev(x);
      std::vector<HostTensor> w;
      std::vector<Tensor> dws;
      for (int64_t m : ms) {
        w.push_back(HostTensor(wt, {m, k}));
        fill_random(w.back(), rng, 0.2f);
        dws.push_back(ops().adopt_weight(w.back().t).value());
      }
      for (size_t i = 0; i < ms.size(); ++i) {
        const int64_t m = ms[i];
        HostTensor one(DType::F32, {1, m});
        DeviceTensor d1 = poisoned(one);
        ops().matmul(dx.t.slice_rows(0, 1), dws[i], d1.t, false);
        const HostTensor g1 = host(d1, one);
        for (int64_t n : {2, 5}) {
          HostTensor many(DType::F32, {n, m});
          DeviceTensor dn = poisoned(many);
          ops().matmul(dx.t.slice_rows(0, n), dws[i], dn.t, false);
          const HostTensor gn = host(dn, many);
          EXPECT_EQ(std::memcmp(g1.f(), gn.f(), size_t(m) * 4), 0)
              << dtype_name(wt) << " k=" << k << " m=" << m << " n=" << n;
        }
      }
      // The group of all three weights: one token against two.
      std::vector<HostTensor> o1, o2;
      std::vector<DeviceTensor> d1, d2;
      std::vector<Tensor> t1, t2;
      for (int64_t m : ms) {
        o1.push_back(HostTensor(DType::F32, {1, m}));
        o2.push_back(HostTensor(DType::F32, {2, m}));
        d1.push_back(poisoned(o1.back()));
        d2.push_back(poisoned(o2.back()));
        t1.push_back(d1.back().t);
        t2.push_back(d2.back().t);
      }
      ops().matmul_group(dx.t.slice_rows(0, 1), dws, t1);
      ops().matmul_group(dx.t.slice_rows(0, 2), dws, t2);
      for (size_t i = 0; i < ms.size(); ++i) {
        const HostTensor g1 = host(d1[i], o1[i]), g2 = host(d2[i], o2[i]);
        EXPECT_EQ(std::memcmp(g1.f(), g2.f(), size_t(ms[i]) * 4), 0)
            << "group " << dtype_name(wt) << " k=" << k << " m=" << ms[i];
      }
    }
  }
}

// Decode batches of more than kGemvMaxTokens tokens on small weights (gates, the router) run the
// GEMV kernel in token groups: each token's row equals, bit for bit, the token alone, for
// matmul and matmul_group, wherever the token falls in its group.
TEST_F(CudaBasic, DecodeBatchGemvRowsEqualEachTokenAlone) {
  const int64_t n = 64;
  for (DType wt : {DType::BF16, DType::F32}) {
    for (int64_t k : {64, 2048}) {
      const std::vector<int64_t> ms = {1, 32, 96};
      HostTensor x(DType::F32, {n, k});
      fill_random(x, rng);
      DeviceTensor dx = dev(x);
      std::vector<HostTensor> w, outs;
      std::vector<Tensor> dws, dgroup_t;
      std::vector<DeviceTensor> dgroup;
      for (int64_t m : ms) {
        w.push_back(HostTensor(wt, {m, k}));
        fill_random(w.back(), rng, 0.2f);
        dws.push_back(ops().adopt_weight(w.back().t).value());
        ASSERT_TRUE(ops().matmul_takes_gemv(n, dws.back())) << "m=" << m << " k=" << k;
        outs.push_back(HostTensor(DType::F32, {n, m}));
        dgroup.push_back(poisoned(outs.back()));
        dgroup_t.push_back(dgroup.back().t);
      }
      ops().matmul_group(dx.t, dws, dgroup_t);
      for (size_t i = 0; i < ms.size(); ++i) {
        const int64_t m = ms[i];
        DeviceTensor dbatch = poisoned(outs[i]);
        ops().matmul(dx.t, dws[i], dbatch.t, false);
        const HostTensor batch = host(dbatch, outs[i]), group = host(dgroup[i], outs[i]);
        HostTensor ref = outs[i];
        ref::matmul(x.t, w[i].t, ref.t);
        ASSERT_EQ(count_nonfinite(batch.f(), n * m), 0);
        EXPECT_LE(rel_err(batch.f(), ref.f(), n * m), 1e-5) << dtype_name(wt) << " m=" << m;
        EXPECT_EQ(std::memcmp(batch.f(), group.f(), size_t(n * m) * 4), 0)
            << "group " << dtype_name(wt) << " k=" << k << " m=" << m;
        for (int64_t t : {0, 7, 8, 9, 33, 63}) {
          HostTensor one(DType::F32, {1, m});
          DeviceTensor d1 = poisoned(one);
          ops().matmul(dx.t.slice_rows(t, t + 1), dws[i], d1.t, false);
          const HostTensor g1 = host(d1, one);
          EXPECT_EQ(std::memcmp(g1.f(), batch.f() + t * m, size_t(m) * 4), 0)
              << dtype_name(wt) << " k=" << k << " m=" << m << " token " << t;
        }
      }
    }
  }
}

// GEMV (n ≤ 8, and small weights beyond in token groups), f32 SGEMM and bf16/f16 tensor cores
// (n > 8 on larger weights), every dtype, odd sizes.
TEST_F(CudaBasic, MatmulMatchesReferenceForEveryPathAndDtype) {
  struct Shape {
    int64_t n, k, m;
  };
  std::vector<Shape> shapes;
  for (int64_t n : {1, 2, 3, 5, 8, 9, 33, 70}) {
    for (int64_t k : {31, 32, 33, 256}) {
      for (int64_t m : {1, 17, 33, 100}) shapes.push_back({n, k, m});
    }
  }
  // Weights too large for GEMV token groups at these token counts.
  shapes.push_back({9, 260, 16411});
  shapes.push_back({70, 260, 4099});
  for (DType wt : {DType::F32, DType::BF16, DType::F16}) {
    for (const Shape& sh : shapes) {
      const int64_t n = sh.n, k = sh.k, m = sh.m;
      HostTensor x(DType::F32, {n, k}), w(wt, {m, k}), out(DType::F32, {n, m});
      fill_random(x, rng);
      fill_random(w, rng, 0.2f);
      auto dw = ops().adopt_weight(w.t);
      ASSERT_TRUE(dw.ok());
      DeviceTensor dx = dev(x), dout = poisoned(out);
      ops().matmul(dx.t, dw.value(), dout.t, false);
      HostTensor got = host(dout, out), ref = out;
      ref::matmul(x.t, w.t, ref.t);
      ASSERT_EQ(count_nonfinite(got.f(), n * m), 0);
      const bool gemv = ops().matmul_takes_gemv(n, dw.value());
      const double err = rel_err(got.f(), ref.f(), n * m);
      const std::string path = gemv               ? (n <= 8 ? "gemv" : "gemv token groups")
                               : wt != DType::F32 ? "tensor cores"
                                                  : "sgemm";
      record_error(std::string("matmul ") + path + " " + dtype_name(wt), err);
      ASSERT_LE(err, 1e-5) << dtype_name(wt) << " n=" << n << " k=" << k << " m=" << m;
    }
  }
}

TEST_F(CudaBasic, MatmulAtModelSizes) {
  for (int64_t n : {1, 4, 8, 64}) {
    const int64_t k = 2048, m = 1024;
    HostTensor x(DType::F32, {n, k}), w(DType::BF16, {m, k}), out(DType::F32, {n, m});
    fill_random(x, rng);
    fill_random(w, rng, 0.05f);
    auto dw = ops().adopt_weight(w.t);
    ASSERT_TRUE(dw.ok());
    DeviceTensor dx = dev(x), dout = poisoned(out);
    ops().matmul(dx.t, dw.value(), dout.t);
    HostTensor got = host(dout, out), ref = out;
    ref::matmul(x.t, w.t, ref.t);
    const double err = rel_err(got.f(), ref.f(), n * m);
    record_error(n <= 8 ? "matmul 2048x1024 gemv BF16" : "matmul 2048x1024 tensor cores BF16", err);
    EXPECT_LE(err, 1e-5) << "n=" << n;
  }
}

// Column slices of wider buffers for x and out, accumulating; the other columns stay intact.
// The 9 x 262 x 8,200 weights are too large for GEMV token groups: a decode batch on three
// 16-bit terms (bf16, and f16 whose rows are no multiple of 8), stacked in one GEMM.
TEST_F(CudaBasic, MatmulAccumulatesAndHonoursRowStrides) {
  struct Shape {
    int64_t n, k, m;
  };
  for (DType wt : {DType::BF16, DType::F32, DType::F16}) {
    for (const auto [n, k, m] : {Shape{7, 40, 9}, Shape{20, 40, 9}, Shape{9, 262, 8200}}) {
      HostTensor xbig(DType::F32, {n, k + 5}), w(wt, {m, k}), outbig(DType::F32, {n, m + 3}),
          ref(DType::F32, {n, m});
      fill_random(xbig, rng);
      fill_random(w, rng);
      fill_random(outbig, rng);
      auto dw = ops().adopt_weight(w.t);
      ASSERT_TRUE(dw.ok());
      ASSERT_EQ(ops().matmul_takes_gemv(n, dw.value()), m == 9);
      DeviceTensor dx = dev(xbig), dout = dev(outbig);
      ops().matmul(dx.t.slice_cols(2, 2 + k), dw.value(), dout.t.slice_cols(1, 1 + m), true);
      HostTensor got = host(dout, outbig);
      ref::matmul(xbig.t.slice_cols(2, 2 + k), w.t, ref.t);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t j = 0; j < m + 3; ++j) {
          const float g = got.f()[t * (m + 3) + j], old = outbig.f()[t * (m + 3) + j];
          if (j >= 1 && j < 1 + m) {
            EXPECT_NEAR(g, old + ref.f()[t * m + j - 1], 1e-4);
          } else {
            EXPECT_EQ(g, old) << "column outside the view was written";
          }
        }
      }
    }
  }
}

// F16 weights on tensor cores take each activation row as two f16 terms, unscaled for rows of
// moderate range (random in ±1) and scaled by a power of two for rows far beyond f16's range
// (10^6, 2^40), deep below it (2^-40) or with one value beyond it among moderate ones: all keep
// f32-class results, writing and accumulating into column slices (the columns beside them
// untouched). The split takes a warp a row for many rows or narrow ones (264: a lane's held
// chunks; 2,056 × 2,100 rows: also the chunks past them, read twice), else a block a row (2,568:
// held; 16,400: past them), whose threads must agree on the row's largest value.
TEST_F(CudaBasic, MatmulF16WeightsTakeRowsOfAnyRange) {
  // Too large for the GEMV kernel's token groups.
  for (const auto& [n, k, m] : {std::array<int64_t, 3>{100, 264, 4100},
                                {100, 2568, 600},
                                {100, 16400, 40},
                                {2100, 2056, 24}}) {
    f16_rows_of_any_range(n, k, m);
  }
}

void CudaBasic::f16_rows_of_any_range(int64_t n, int64_t k, int64_t m) {
  HostTensor w(DType::F16, {m, k});
  fill_random(w, rng, 0.2f);
  auto dw = ops().adopt_weight(w.t);
  ASSERT_TRUE(dw.ok());
  ASSERT_FALSE(ops().matmul_takes_gemv(n, dw.value()));
  HostTensor xbig(DType::F32, {n, k + 8}), outbig(DType::F32, {n, m + 3}), ref(DType::F32, {n, m});
  fill_random(xbig, rng);
  const float scale[] = {1.0f, 1e6f, 0x1p40f, 0x1p-40f};
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < k + 8; ++c) xbig.f()[t * (k + 8) + c] *= scale[t % 4];
    // Every other moderate row: one value past f16's range, in a different lane's chunk each.
    if (t % 8 == 0) xbig.f()[t * (k + 8) + 8 + (t * 131 + 5) % k] = 40000.0f;
  }
  ref::matmul(xbig.t.slice_cols(8, 8 + k), w.t, ref.t);
  for (const bool accumulate : {false, true}) {
    fill_random(outbig, rng);
    for (int64_t t = 0; t < n; ++t) {  // what is there to add to: the products' scale
      for (int64_t j = 0; j < m + 3; ++j) outbig.f()[t * (m + 3) + j] *= scale[t % 4];
    }
    DeviceTensor dx = dev(xbig), dout = dev(outbig);
    ops().matmul(dx.t.slice_cols(8, 8 + k), dw.value(), dout.t.slice_cols(1, 1 + m), accumulate);
    HostTensor got = host(dout, outbig);
    ASSERT_EQ(count_nonfinite(got.f(), n * (m + 3)), 0);
    double err = 0.0;
    for (int64_t t = 0; t < n; ++t) {
      std::vector<float> row(static_cast<size_t>(m)), want(static_cast<size_t>(m));
      for (int64_t j = 0; j < m + 3; ++j) {
        const float g = got.f()[t * (m + 3) + j], old = outbig.f()[t * (m + 3) + j];
        if (j < 1 || j >= 1 + m) {
          ASSERT_EQ(g, old) << "column outside the view was written";
          continue;
        }
        row[size_t(j - 1)] = g;
        want[size_t(j - 1)] = ref.f()[t * m + j - 1] + (accumulate ? old : 0.0f);
      }
      err = std::max(err, rel_err(row.data(), want.data(), m, 0.0));
    }
    record_error(
        accumulate ? "matmul f16 rows of any range, accumulating" : "matmul f16 rows of any range",
        err);
    EXPECT_LE(err, 1e-5) << "accumulate " << accumulate << " k=" << k;
  }
}

// A block's BF16 weights re-typed to F16 in place (retype_weights): each value is its f16
// rounded to nearest (weights of scale 0.2 put a few hundred below f16's normal range, where
// rounding matters, and two are set there), one token's matmul (the GEMV kernel, f32
// arithmetic) stays within 1e-6 of before, a prompt's (two f16 terms on cuBLAS) within 1e-5 of
// the reference. A value beyond f16's range in any of them keeps all three BF16, bytes untouched.
TEST_F(CudaBasic, WeightsRetypedToF16KeepTheirValues) {
  const int64_t n = 100, k = 264, m = 4100;
  for (const bool beyond : {false, true}) {
    std::vector<HostTensor> ws;
    std::vector<Tensor> dw;
    for (int i = 0; i < 3; ++i) {
      ws.emplace_back(DType::BF16, std::initializer_list<int64_t>{m, k});
      fill_random(ws.back(), rng, 0.2f);
    }
    ws[0].t.ptr<uint16_t>()[1] = f32_to_bf16(3e-6f);
    ws[0].t.ptr<uint16_t>()[2] = f32_to_bf16(-7.1e-7f);
    if (beyond) ws[2].t.ptr<uint16_t>()[77] = f32_to_bf16(1e5f);
    for (const HostTensor& w : ws) dw.push_back(ops().adopt_weight(w.t).value());
    HostTensor x(DType::F32, {n, k});
    fill_random(x, rng);
    DeviceTensor dx = dev(x);
    auto one_token = [&](const Tensor& w) {
      HostTensor out(DType::F32, {1, m});
      DeviceTensor d = poisoned(out);
      ops().matmul(dx.t.slice_rows(0, 1), w, d.t);
      return host(d, out);
    };
    std::vector<HostTensor> before;
    for (const Tensor& w : dw) before.push_back(one_token(w));
    Tensor* block[] = {&dw[0], &dw[1], &dw[2]};
    ops().retype_weights(block);
    for (size_t i = 0; i < 3; ++i) {
      ASSERT_EQ(dw[i].dtype, beyond ? DType::BF16 : DType::F16);
      HostTensor back(dw[i].dtype, {m, k});
      ops().copy_to_host(dw[i], back.t.data);
      const uint16_t *src = ws[i].t.ptr<uint16_t>(), *got = back.t.ptr<uint16_t>();
      int64_t wrong = 0;
      for (int64_t j = 0; j < m * k; ++j) {
        wrong += got[j] != (beyond ? src[j] : f32_to_f16(bf16_to_f32(src[j])));
      }
      EXPECT_EQ(wrong, 0) << "weight " << i << ", beyond " << beyond;
      EXPECT_LE(rel_err(one_token(dw[i]).f(), before[i].f(), m), 1e-6) << "weight " << i;
      HostTensor out(DType::F32, {n, m});
      DeviceTensor d = poisoned(out);
      ops().matmul(dx.t, dw[i], d.t);
      HostTensor got_out = host(d, out), ref = out;
      ref::matmul(x.t, ws[i].t, ref.t);
      ASSERT_EQ(count_nonfinite(got_out.f(), n * m), 0);
      EXPECT_LE(rel_err(got_out.f(), ref.f(), n * m), 1e-5) << "weight " << i;
    }
  }
}

TEST_F(CudaBasic, NormsMatchReferenceOnStridedViews) {
  for (DType wt : {DType::BF16, DType::F32}) {
    // 1024 and 2051 take the block-per-row kernel.
    for (int64_t d : {15, 16, 33, 256, 1024, 2051}) {
      const int64_t n = 5, heads = 3;
      // x is a [n, heads, d] view into a wider buffer (like the conv output's head views).
      HostTensor big(DType::F32, {n, heads * d + 7}), w(wt, {d}), gate(DType::F32, {n, heads, d});
      fill_random(big, rng);
      fill_random(w, rng, 0.3f);
      fill_random(gate, rng);
      auto view = [&](Tensor t) {
        t = t.slice_cols(3, 3 + heads * d);
        t.ndim = 3, t.shape[1] = heads, t.shape[2] = d, t.stride[1] = d, t.stride[2] = 1;
        return t;
      };
      auto dw = ops().adopt_weight(w.t);
      ASSERT_TRUE(dw.ok());
      DeviceTensor dbig = dev(big), dgate = dev(gate);
      HostTensor out(DType::F32, {n, heads, d}), ref = out;
      DeviceTensor dout = poisoned(out);
      ops().rms_norm(view(dbig.t), dw.value(), 1.0f, 1e-6f, dout.t);
      HostTensor got = host(dout, out);
      ref::rms_norm(view(big.t), w.t, 1.0f, 1e-6f, ref.t);
      double err = rel_err(got.f(), ref.f(), out.numel());
      record_error("rms_norm", err);
      EXPECT_LE(err, 1e-5);
      for (GateActivation act : {GateActivation::kSilu, GateActivation::kSigmoid}) {
        const bool silu = act == GateActivation::kSilu;
        dout.poison();
        ops().rms_norm_gated(view(dbig.t), dgate.t, dw.value(), 1e-6f, act, dout.t);
        got = host(dout, out);
        ref::rms_norm_gated(view(big.t), gate.t, w.t, 1e-6f, act, ref.t);
        err = rel_err(got.f(), ref.f(), out.numel());
        record_error(silu ? "rms_norm_gated silu" : "rms_norm_gated sigmoid", err);
        EXPECT_LE(err, 1e-5) << (silu ? "silu" : "sigmoid") << " d=" << d;
      }
      // In place, as the model does for q/k norms and the final norm.
      DeviceTensor inplace = dev(gate);
      ops().rms_norm(inplace.t, dw.value(), 1.0f, 1e-6f, inplace.t);
      got = host(inplace, gate);
      ref::rms_norm(gate.t, w.t, 1.0f, 1e-6f, ref.t);
      err = rel_err(got.f(), ref.f(), out.numel());
      record_error("rms_norm in place", err);
      EXPECT_LE(err, 1e-5);
      // l2_norm in place on the strided view; the gap columns stay untouched.
      ops().l2_norm(view(dbig.t), 1e-6f, 0.25f);
      HostTensor gotbig = host(dbig, big), refbig = big;
      ref::l2_norm(view(refbig.t), 1e-6f, 0.25f);
      err = max_abs_diff(gotbig.f(), refbig.f(), big.numel());
      record_error("l2_norm", err);
      EXPECT_LE(err, 1e-6);
    }
  }
}

// A row's norm must not depend on how many rows share the launch (decode batches of any
// size give a token the same result): one row alone equals the same row inside a batch.
TEST_F(CudaBasic, RmsNormOfARowDoesNotDependOnTheBatch) {
  for (int64_t d : {256, 2048}) {
    const int64_t n = 7;
    HostTensor x(DType::F32, {n, d}), w(DType::BF16, {d});
    fill_random(x, rng);
    fill_random(w, rng, 0.3f);
    auto dw = ops().adopt_weight(w.t);
    ASSERT_TRUE(dw.ok());
    DeviceTensor dx = dev(x);
    HostTensor all(DType::F32, {n, d}), one(DType::F32, {1, d});
    DeviceTensor dall = poisoned(all), done = poisoned(one);
    ops().rms_norm(dx.t, dw.value(), 1.0f, 1e-6f, dall.t);
    Tensor row = dx.t;
    row.data = static_cast<float*>(dx.t.data) + 3 * d;
    row.shape[0] = 1;
    ops().rms_norm(row, dw.value(), 1.0f, 1e-6f, done.t);
    HostTensor got_all = host(dall, all), got_one = host(done, one);
    for (int64_t j = 0; j < d; ++j) {
      ASSERT_EQ(got_one.f()[j], got_all.f()[3 * d + j]) << "d=" << d << " column " << j;
    }
  }
}

TEST_F(CudaBasic, RopeRotatesOnlyTheRotaryChannels) {
  const int64_t n = 6, heads = 3, hd = 24;
  for (int rot : {6, 12, 24}) {
    HostTensor x(DType::F32, {n, heads, hd});
    fill_random(x, rng);
    const int32_t pos[] = {0, 1, 7, 100, 4095, 1000000};
    DeviceTensor dx = dev(x);
    ops().rope(dx.t, pos, rot, 10000.0);
    HostTensor got = host(dx, x), ref = x;
    ref::rope(ref.t, pos, rot, 10000.0);
    const double err = max_abs_diff(got.f(), ref.f(), x.numel());
    record_error("rope", err);
    EXPECT_LE(err, 2e-5) << "rot=" << rot;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = rot; j < hd; ++j)
          ASSERT_EQ(got.f()[(t * heads + h) * hd + j], x.f()[(t * heads + h) * hd + j]);
  }
}

// The elementwise ops against their definitions in double, on a column slice of a wider
// buffer; the gates against the CPU reference.
TEST_F(CudaBasic, ElementwiseAndGatesMatchTheirDefinitions) {
  const int64_t n = 7, d = 45, hv = 6;
  HostTensor gbig(DType::F32, {n, d + 3}), u(DType::F32, {n, d}), out(DType::F32, {n, d});
  HostTensor x(DType::F32, {n, d}), y(DType::F32, {n, d}), sc(DType::F32, {n, 1});
  for (HostTensor* h : {&gbig, &u, &x, &y, &sc}) fill_random(*h, rng, 2.0f);
  DeviceTensor dg = dev(gbig), du = dev(u), dout = poisoned(out), dx = dev(x), dy = dev(y),
               ds = dev(sc);
  const Tensor gview = dg.t.slice_cols(3, 3 + d), host_gview = gbig.t.slice_cols(3, 3 + d);
  ops().swiglu(gview, du.t, dout.t);
  HostTensor ref = out;
  ref::swiglu(host_gview, u.t, ref.t);
  double err = rel_err(host(dout, out).f(), ref.f(), out.numel());
  record_error("swiglu", err);
  EXPECT_LE(err, 1e-6);

  HostTensor rx = x;
  ops().mul_sigmoid(dx.t, gview);
  ops().add(dx.t, dy.t);
  ops().add_scaled_sigmoid(dx.t, dy.t, ds.t);
  ref::mul_sigmoid(rx.t, host_gview);
  ref::add(rx.t, y.t);
  ref::add_scaled_sigmoid(rx.t, y.t, sc.t);
  err = rel_err(host(dx, x).f(), rx.f(), x.numel());
  record_error("mul_sigmoid + add + add_scaled_sigmoid", err);
  EXPECT_LE(err, 1e-6);

  for (DType wt : {DType::F32, DType::BF16}) {
    HostTensor a(DType::F32, {n, hv}), b = a, a_log(wt, {hv}), dt_bias(wt, {hv}), g = a, beta = a;
    fill_random(a, rng, 2.0f);
    fill_random(b, rng, 2.0f);
    fill_random(a_log, rng, 0.5f);
    fill_random(dt_bias, rng);
    auto dal = ops().adopt_weight(a_log.t);
    auto ddt = ops().adopt_weight(dt_bias.t);
    ASSERT_TRUE(dal.ok() && ddt.ok());
    DeviceTensor da = dev(a), db = dev(b), dgg = poisoned(g), dbeta = poisoned(beta);
    ops().gdn_gates(da.t, db.t, dal.value(), ddt.value(), dgg.t, dbeta.t);
    HostTensor rg = g, rbeta = beta;
    ref::gdn_gates(a.t, b.t, a_log.t, dt_bias.t, rg.t, rbeta.t);
    err = std::max(rel_err(host(dgg, g).f(), rg.f(), g.numel()),
                   rel_err(host(dbeta, beta).f(), rbeta.f(), beta.numel()));
    record_error("gdn_gates", err);
    EXPECT_LE(err, 1e-6);
  }
  // One decay per key channel (Kimi Delta Attention): a, g [n, hv·dk]; odd head counts and dk.
  for (int64_t heads : {1, 3}) {
    for (int64_t dk : {5, 16}) {
      HostTensor a(DType::F32, {n, heads * dk}), g = a, b(DType::F32, {n, heads}), beta = b;
      HostTensor a_log(DType::F32, {heads}), dt_bias(DType::F32, {heads * dk});
      fill_random(a, rng, 2.0f);
      fill_random(b, rng, 2.0f);
      fill_random(a_log, rng, 0.5f);
      fill_random(dt_bias, rng);
      auto dal = ops().adopt_weight(a_log.t);
      auto ddt = ops().adopt_weight(dt_bias.t);
      ASSERT_TRUE(dal.ok() && ddt.ok());
      DeviceTensor da = dev(a), db = dev(b), dbeta = poisoned(beta);
      ops().gdn_gates(da.t, db.t, dal.value(), ddt.value(), da.t, dbeta.t);  // g in place of a
      HostTensor rg = g, rbeta = beta;
      ref::gdn_gates(a.t, b.t, a_log.t, dt_bias.t, rg.t, rbeta.t);
      err = std::max(rel_err(host(da, g).f(), rg.f(), g.numel()),
                     rel_err(host(dbeta, beta).f(), rbeta.f(), beta.numel()));
      record_error("gdn_gates per channel", err);
      EXPECT_LE(err, 1e-6) << "heads=" << heads << " dk=" << dk;
    }
  }
}

// Index arrays through both routes: the begin_forward mirror and the per-op upload.
TEST_F(CudaBasic, EmbeddingAndGatherRowsViaMirrorAndAdHocUploads) {
  const int64_t vocab = 50, d = 33;
  HostTensor table(DType::BF16, {vocab, d});
  fill_random(table, rng);
  auto dtab = ops().adopt_weight(table.t);
  ASSERT_TRUE(dtab.ok());
  const std::vector<int32_t> tokens = {3, 49, 0, 7, 7, 12};
  const std::vector<int32_t> rows = {5, 0, 2};
  std::vector<int32_t> seq_start = {0, 6}, slot = {0}, positions = {0, 1, 2, 3, 4, 5};
  SeqLayout l;
  l.n_seqs = 1, l.n_tokens = 6, l.seq_start = seq_start.data(), l.slot = slot.data();
  l.positions = positions.data();
  for (bool mirrored : {true, false}) {
    if (mirrored) ops().begin_forward(l, tokens, rows);
    HostTensor out(DType::F32, {6, d}), picked(DType::F32, {3, d});
    DeviceTensor dout = poisoned(out), dpicked = poisoned(picked);
    ops().embedding(tokens.data(), 6, dtab.value(), dout.t);
    ops().gather_rows(dout.t, rows.data(), 3, dpicked.t);
    HostTensor got = host(dout, out), gp = host(dpicked, picked), want = out, want_picked = picked;
    ref::embedding(tokens.data(), 6, table.t, want.t);
    ref::gather_rows(want.t, rows.data(), 3, want_picked.t);
    ASSERT_EQ(std::memcmp(got.f(), want.f(), sizeof(float) * size_t(6 * d)), 0);
    ASSERT_EQ(std::memcmp(gp.f(), want_picked.f(), sizeof(float) * size_t(3 * d)), 0);
  }
}

// The embedding with the first layer's norm in one kernel equals embedding then rms_norm bit
// for bit: rows narrower than a block norm's width (a warp per row) and wider (a block per row).
TEST_F(CudaBasic, EmbeddingRmsNormEqualsTheTwoOps) {
  const std::vector<int32_t> tokens = {3, 49, 0, 7, 7};
  for (DType dt : {DType::BF16, DType::F32}) {
    for (int64_t d : {64, 2048}) {
      HostTensor table(dt, {50, d}), w(dt, {d});
      fill_random(table, rng);
      fill_random(w, rng, 0.2f);
      const Tensor dtab = ops().adopt_weight(table.t).value(), dw = ops().adopt_weight(w.t).value();
      HostTensor h(DType::F32, {5, d});
      HostTensor got_h[2] = {h, h}, got_x[2] = {h, h};
      for (int path = 0; path < 2; ++path) {  // the backend's op, then the default's two ops
        DeviceTensor dh = poisoned(h), dx = poisoned(h);
        if (path == 0) {
          ops().embedding_rms_norm(tokens.data(), 5, dtab, dh.t, dw, 1.0f, 1e-6f, dx.t);
        } else {
          ops().Ops::embedding_rms_norm(tokens.data(), 5, dtab, dh.t, dw, 1.0f, 1e-6f, dx.t);
        }
        got_h[path] = host(dh, h), got_x[path] = host(dx, h);
      }
      ASSERT_EQ(count_nonfinite(got_x[0].f(), h.numel()), 0);
      EXPECT_EQ(std::memcmp(got_h[0].f(), got_h[1].f(), size_t(h.numel()) * 4), 0) << d;
      EXPECT_EQ(std::memcmp(got_x[0].f(), got_x[1].f(), size_t(h.numel()) * 4), 0) << d;
    }
  }
}

}  // namespace
}  // namespace recur
