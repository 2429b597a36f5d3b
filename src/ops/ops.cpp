// Default implementations shared by backends whose memory the host can address.
#include "ops/ops.h"

#include <chrono>
#include <cstring>
#include <vector>

namespace recur {

void Ops::copy_from_host(Tensor dst, const void* src) {
  RECUR_CHECK(dst.is_contiguous());
  std::memcpy(dst.data, src, size_t(dst.numel()) * dtype_size(dst.dtype));
}

namespace {
// splitmix64 of (seed, index): a counter-based generator any backend can reproduce.
inline uint64_t mix(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

void Ops::fill_random_uniform(Tensor t, uint64_t seed, float lo, float hi) {
  RECUR_CHECK(t.is_contiguous());
  const int64_t n = t.numel();
  const size_t es = dtype_size(t.dtype);
  // Generated on the host in slices and copied in, so device backends reuse this as is.
  constexpr int64_t kSlice = 1 << 20;
  std::vector<uint8_t> host(size_t(std::min(n, kSlice)) * es);
  for (int64_t b = 0; b < n; b += kSlice) {
    const int64_t len = std::min(kSlice, n - b);
    for (int64_t i = 0; i < len; ++i) {
      const float u = float(mix(seed, uint64_t(b + i)) >> 40) * (1.0f / float(1 << 24));
      const float v = lo + (hi - lo) * u;
      switch (t.dtype) {
        case DType::F32:
          std::memcpy(&host[size_t(i) * 4], &v, 4);
          break;
        case DType::BF16: {
          const uint16_t h = f32_to_bf16(v);
          std::memcpy(&host[size_t(i) * 2], &h, 2);
          break;
        }
        case DType::F16: {
          const uint16_t h = f32_to_f16(v);
          std::memcpy(&host[size_t(i) * 2], &h, 2);
          break;
        }
        default:
          RECUR_CHECK(false && "fill_random_uniform: F32, BF16 or F16 only");
      }
    }
    Tensor slice =
        Tensor::contiguous(static_cast<char*>(t.data) + size_t(b) * es, t.dtype, {len}, t.device);
    copy_from_host(slice, host.data());
  }
}

void Ops::matmul_group(const Tensor& x, std::span<const Tensor> ws, std::span<const Tensor> outs) {
  RECUR_CHECK(ws.size() == outs.size() && ws.size() <= kMaxMatmulGroup);
  for (size_t i = 0; i < ws.size(); ++i) matmul(x, ws[i], outs[i]);
}

void Ops::add_rms_norm(Tensor x, const Tensor& y, const Tensor& w, float weight_offset, float eps,
                       Tensor out) {
  add(x, y);
  rms_norm(x, w, weight_offset, eps, out);
}

double Ops::measure_copy_bandwidth(size_t bytes) {
  std::vector<uint8_t> a(bytes, 1), b(bytes, 2);
  std::memcpy(b.data(), a.data(), bytes);  // warm
  const int reps = 5;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    std::memcpy(r % 2 ? a.data() : b.data(), r % 2 ? b.data() : a.data(), bytes);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * double(bytes) * reps / s;
}

}  // namespace recur
