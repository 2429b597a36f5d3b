// matmul_heads on the device (one launch over all heads for decode token counts, one matmul per
// head beyond) against the scalar reference and against the default (one CUDA matmul per
// head): odd shapes, every weight dtype, heads with gaps between them, one input shared by
// every head (head stride 0), the published Kimi-Linear's latent-attention shapes.
//
// Tolerance: error relative to the reference's largest magnitude (floor 1) ≤ 1e-5, as matmul.
#include "backend/cpu/reference.h"
#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using namespace testing;

class CudaMatmulHeads : public CudaTest {};

struct Shape {
  int64_t n, H, m, k, x_gap, out_gap;  // x_gap -1: one input for every head
};

TEST_F(CudaMatmulHeads, EqualsReferenceAndOneMatmulPerHead) {
  std::vector<Shape> shapes;
  for (int64_t n : {1, 2, 3, 5, 8, 9, 16, 64}) {
    shapes.push_back({n, 3, 17, 33, 0, 0});      // odd k: element loads
    shapes.push_back({n, 5, 9, 40, 4, 3});       // 16-byte loads, gaps
    shapes.push_back({n, 2, 33, 264, -1, 1});    // long rows, shared input
    shapes.push_back({n, 4, 100, 12, 8, 0});     // rows shorter than a lane group's loads
    shapes.push_back({n, 32, 512, 128, 0, 64});  // published: the query absorbs W_uk
    shapes.push_back({n, 32, 128, 512, 0, 0});   // published: the output absorbs W_uv
  }
  shapes.push_back({1, 32, 64, 2304, -1, 512});  // published: q_pe from x into q_lat
  shapes.push_back({4, 32, 64, 2304, -1, 512});
  shapes.push_back({600, 2, 512, 128, 0, 0});  // past GEMV token groups: one matmul per head
  shapes.push_back({70, 3, 40, 200, 5, 2});
  for (DType wt : {DType::BF16, DType::F32, DType::F16}) {
    for (const Shape& sh : shapes) {
      if (wt != DType::BF16 && sh.H == 32 && sh.n > 4) continue;  // the large ones in bf16 only
      const int64_t n = sh.n, H = sh.H, m = sh.m, k = sh.k;
      const int64_t xs = sh.x_gap < 0 ? 0 : k + sh.x_gap, os = m + sh.out_gap;
      const int64_t xcols = 2 + (H - 1) * xs + k, ocols = 1 + H * os;
      HostTensor xbuf(DType::F32, {n, xcols}), w(wt, {H, m, k});
      HostTensor obuf(DType::F32, {n, ocols}), ref(DType::F32, {n, H, m});
      fill_random(xbuf, rng);
      fill_random(w, rng, 0.2f);
      fill_random(obuf, rng);
      const Tensor dw = weight(w);
      DeviceTensor dx = dev(xbuf), dout = dev(obuf), ddef = dev(obuf);
      const Tensor x = dx.t.col_heads(2, H, k, xs);
      ops().matmul_heads(x, dw, dout.t.col_heads(1, H, m, os));
      ops().Ops::matmul_heads(x, dw, ddef.t.col_heads(1, H, m, os));
      const HostTensor got = host(dout, obuf), def = host(ddef, obuf);
      ref::matmul_heads(xbuf.t.col_heads(2, H, k, xs), w.t, ref.t);
      // The heads' outputs, gathered [n, H, m]; the gaps must hold what they held.
      HostTensor g(DType::F32, {n, H, m}), d(DType::F32, {n, H, m});
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t c = 0; c < ocols; ++c) {
          const int64_t h = (c - 1) / os, j = (c - 1) % os;
          if (c >= 1 && j < m) {
            g.f()[(t * H + h) * m + j] = got.f()[t * ocols + c];
            d.f()[(t * H + h) * m + j] = def.f()[t * ocols + c];
          } else {
            ASSERT_EQ(got.f()[t * ocols + c], obuf.f()[t * ocols + c])
                << "column outside the heads was written: n=" << n << " H=" << H;
          }
        }
      }
      ASSERT_EQ(count_nonfinite(g.f(), n * H * m), 0);
      const double err = rel_err(g.f(), ref.f(), n * H * m);
      const double vs_default = rel_err(g.f(), d.f(), n * H * m);
      const std::string path =
          ops().matmul_takes_gemv(n, Tensor::contiguous(dw.data, wt, {m, k}, dw.device))
              ? "one launch"
              : "per head";
      record_error(std::string("matmul_heads ") + path + " " + dtype_name(wt), err);
      record_error(std::string("matmul_heads vs default ") + path + " " + dtype_name(wt),
                   vs_default);
      const std::string where = std::string(dtype_name(wt)) + " n=" + std::to_string(n) +
                                " H=" + std::to_string(H) + " m=" + std::to_string(m) +
                                " k=" + std::to_string(k);
      ASSERT_LE(err, 1e-5) << where;
      ASSERT_LE(vs_default, 1e-5) << where;
    }
  }
}

}  // namespace
}  // namespace recur
