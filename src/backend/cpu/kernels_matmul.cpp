// out[n, m] = x[n, k] · w[m, k]^T with w in its stored dtype. Each weight row is widened once
// per tile of 4 tokens; threads split the weight rows, so each weight byte is read by one core.
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels.h"

namespace recur {

using namespace cpu;

namespace {

constexpr int64_t kTokenTile = 64;  // x rows kept hot in cache while sweeping the weight rows

template <typename W>
void matmul_block(const float* x, int64_t x_stride, const W* w, int64_t k, float* out,
                  int64_t out_stride, int64_t n, int64_t m0, int64_t m1, bool accumulate) {
  for (int64_t t0 = 0; t0 < n; t0 += kTokenTile) {
    const int64_t t1 = std::min(n, t0 + kTokenTile);
    for (int64_t m = m0; m < m1; ++m) {
      const W* wr = w + m * k;
      int64_t t = t0;
      for (; t + 4 <= t1; t += 4) {
        const float* x0 = x + t * x_stride;
        const float* x1 = x0 + x_stride;
        const float* x2 = x1 + x_stride;
        const float* x3 = x2 + x_stride;
        float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t i = 0; i < k; ++i) {
          const float wv = to_f32(wr[i]);
          a0 += wv * x0[i];
          a1 += wv * x1[i];
          a2 += wv * x2[i];
          a3 += wv * x3[i];
        }
        float* o = out + t * out_stride + m;
        if (accumulate) {
          o[0] += a0, o[out_stride] += a1, o[2 * out_stride] += a2, o[3 * out_stride] += a3;
        } else {
          o[0] = a0, o[out_stride] = a1, o[2 * out_stride] = a2, o[3 * out_stride] = a3;
        }
      }
      for (; t < t1; ++t) {
        const float* xr = x + t * x_stride;
        float a = 0;
#pragma omp simd reduction(+ : a)
        for (int64_t i = 0; i < k; ++i) a += to_f32(wr[i]) * xr[i];
        float* o = out + t * out_stride + m;
        *o = accumulate ? *o + a : a;
      }
    }
  }
}

}  // namespace

void CpuOps::matmul(const Tensor& x, const Tensor& w, Tensor out, bool accumulate) {
  RECUR_CHECK(w.ndim == 2 && w.is_contiguous());
  const int64_t n = x.shape[0], k = w.shape[1], m = w.shape[0];
  RECUR_CHECK(x.row_size() == k && out.shape[0] == n && out.row_size() == m);
  RECUR_CHECK(x.stride[x.ndim - 1] == 1 && out.stride[out.ndim - 1] == 1);
  if (n == 0) return;
  // Enough rows per thread that a split pays for the wake-up (~tens of microseconds of work).
  const int64_t min_rows = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, k * n));
  dispatch_weight(w.dtype, [&](auto tag) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    pool_.parallel_for(m, min_rows, [&](int64_t m0, int64_t m1) {
      matmul_block<W>(x.ptr<float>(), x.stride[0], w.ptr<W>(), k, out.ptr<float>(), out.stride[0],
                      n, m0, m1, accumulate);
    });
  });
}

}  // namespace recur
