// Row-wise and elementwise CPU kernels. Matmul, Gated DeltaNet, attention and MoE kernels live
// in their own files.
#include "backend/cpu/cpu_ops.h"

#include <cstdlib>
#include <cstring>

#include "backend/cpu/kernels.h"
#include "backend/cpu/vector_math.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace recur {

using namespace cpu;

namespace {

// Host memory as cpu_allocator() gives it, except that large buffers are 2 MiB aligned and
// advised onto transparent huge pages (a hint: without THP they are ordinary pages).
class HugePageAllocator final : public Allocator {
 public:
  HugePageAllocator() : Allocator(Device::kCpu) {}

 protected:
  static constexpr size_t kHugePage = size_t(2) << 20;

  void* raw_allocate(size_t bytes) override {
    if (bytes < kHugePage) return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = std::aligned_alloc(kHugePage, rounded);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (p != nullptr) madvise(p, rounded, MADV_HUGEPAGE);
#endif
    if (p != nullptr && CpuOps::prefault_large_buffers()) {
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
      if (madvise(p, rounded, MADV_POPULATE_WRITE) == 0) return p;
#endif
      // One write per 4 KiB page: the page is mapped (and zeroed by the kernel) now.
      for (size_t off = 0; off < rounded; off += 4096) static_cast<volatile char*>(p)[off] = 0;
    }
    return p;
  }
  void raw_free(void* p, size_t) override {
    std::free(p);
  }
};

}  // namespace

std::atomic<bool> CpuOps::prefault_large_buffers_{false};

void CpuOps::set_prefault_large_buffers(bool on) {
  prefault_large_buffers_.store(on, std::memory_order_relaxed);
}

bool CpuOps::prefault_large_buffers() {
  return prefault_large_buffers_.load(std::memory_order_relaxed);
}

Allocator& CpuOps::allocator() {
  static HugePageAllocator allocator;
  return allocator;
}

CpuOps::CpuOps(int n_threads)
    : pool_(n_threads),
      attention_scratch_(
          new float[size_t(pool_.size()) * kAttentionMaxParts * (kMaxGroupDims + 2 * kMaxGroup)]) {}

void CpuOps::copy_to_host(const Tensor& src, void* dst) {
  RECUR_CHECK(src.is_contiguous());
  std::memcpy(dst, src.data, size_t(src.numel()) * dtype_size(src.dtype));
}

void CpuOps::fill_zero(Tensor t) {
  RECUR_CHECK(t.is_contiguous());
  std::memset(t.data, 0, size_t(t.numel()) * dtype_size(t.dtype));
}

void CpuOps::embedding(const int32_t* ids, int n, const Tensor& table, Tensor out) {
  const int64_t d = table.shape[1];
  RECUR_CHECK(out.shape[0] == n && out.shape[1] == d);
  dispatch_weight(table.dtype, [&](auto tag) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    for (int i = 0; i < n; ++i) {
      RECUR_CHECK(ids[i] >= 0 && ids[i] < table.shape[0]);
      const W* src = table.ptr<W>() + int64_t(ids[i]) * d;
      float* dst = out.row<float>(i);
      for (int64_t j = 0; j < d; ++j) dst[j] = to_f32(src[j]);
    }
  });
}

void CpuOps::gather_rows(const Tensor& x, const int32_t* rows, int n, Tensor out) {
  const int64_t d = x.row_size();
  for (int i = 0; i < n; ++i) {
    std::memcpy(out.row<float>(i), x.row<float>(rows[i]), size_t(d) * sizeof(float));
  }
}

namespace {
// out_row = x_row / rms(x_row) · (w + weight_offset).
template <typename W>
inline void rms_norm_row(const float* xr, const W* wp, float weight_offset, float eps, int64_t d,
                         float* orow) {
  const float ss = dot_f32(xr, xr, d);
  const float inv = 1.0f / std::sqrt(ss / float(d) + eps);
  for (int64_t j = 0; j < d; ++j) orow[j] = xr[j] * inv * (to_f32(wp[j]) + weight_offset);
}
}  // namespace

void CpuOps::rms_norm(const Tensor& x, const Tensor& w, float weight_offset, float eps,
                      Tensor out) {
  RowView xs(x), os(out);
  const int64_t d = xs.d;
  RECUR_CHECK(w.numel() == d && os.n_rows == xs.n_rows);
  dispatch_weight(w.dtype, [&](auto tag) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    const W* wp = w.ptr<W>();
    pool_.parallel_for(xs.n_rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        rms_norm_row(xs.row(r), wp, weight_offset, eps, d, os.row(r));
    });
  });
}

namespace {
template <GateActivation A>
inline float gate_act(float g) {
  return A == GateActivation::kSilu ? silu(g) : sigmoid(g);
}
#if defined(__AVX512F__)
template <GateActivation A>
inline __m512 gate_act16(__m512 g) {
  return A == GateActivation::kSilu ? silu16(g) : sigmoid16(g);
}
#endif

// Rows [r0, r1) of rms_norm_gated with the gate activation A.
template <GateActivation A, typename W>
void rms_norm_gated_rows(const RowView& xs, const RowView& gs, const RowView& os, const W* wp,
                         float eps, int64_t r0, int64_t r1) {
  const int64_t d = xs.d;
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = xs.row(r);
    const float* gr = gs.row(r);
    float* orow = os.row(r);
    float ss = dot_f32(xr, xr, d);
    float inv = 1.0f / std::sqrt(ss / float(d) + eps);
#if defined(__AVX512F__)
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t j = 0; j < d; j += 16) {
      const __mmask16 m = tail_mask(d - j);
      __m512 wv = _mm512_setzero_ps();
      if constexpr (std::is_same_v<W, float>) {
        wv = _mm512_maskz_loadu_ps(m, wp + j);
      } else {
        alignas(64) float wtmp[16];
        for (int64_t i = 0; i < 16; ++i) wtmp[i] = j + i < d ? to_f32(wp[j + i]) : 0.0f;
        wv = _mm512_load_ps(wtmp);
      }
      const __m512 res =
          _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + j), vinv), wv),
                        gate_act16<A>(_mm512_maskz_loadu_ps(m, gr + j)));
      _mm512_mask_storeu_ps(orow + j, m, res);
    }
#else
    for (int64_t j = 0; j < d; ++j) orow[j] = xr[j] * inv * to_f32(wp[j]) * gate_act<A>(gr[j]);
#endif
  }
}
}  // namespace

void CpuOps::rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& w, float eps,
                            GateActivation act, Tensor out) {
  RowView xs(x), gs(gate), os(out);
  RECUR_CHECK(w.numel() == xs.d && gs.d == xs.d && os.d == xs.d && gs.n_rows == xs.n_rows &&
              os.n_rows == xs.n_rows);
  dispatch_weight(w.dtype, [&](auto tag) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    const W* wp = w.ptr<W>();
    pool_.parallel_for(xs.n_rows, 64, [&](int64_t r0, int64_t r1) {
      if (act == GateActivation::kSilu) {
        rms_norm_gated_rows<GateActivation::kSilu>(xs, gs, os, wp, eps, r0, r1);
      } else {
        rms_norm_gated_rows<GateActivation::kSigmoid>(xs, gs, os, wp, eps, r0, r1);
      }
    });
  });
}

void CpuOps::l2_norm(Tensor x, float eps, float scale) {
  RowView xs(x);
  pool_.parallel_for(xs.n_rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = xs.row(r);
      float inv = scale / std::sqrt(dot_f32(xr, xr, xs.d) + eps);
      for (int64_t j = 0; j < xs.d; ++j) xr[j] *= inv;
    }
  });
}

void CpuOps::rope(Tensor x, const int32_t* positions, int rot_dim, double theta) {
  RECUR_CHECK(x.ndim == 3 && x.stride[2] == 1 && rot_dim % 2 == 0 && rot_dim <= x.shape[2]);
  const int half = rot_dim / 2;
  RECUR_CHECK(half <= 512);
  const int64_t n = x.shape[0], heads = x.shape[1];
  double inv_freq[512];
  for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -2.0 * i / rot_dim);
  // Angles in double: positions reach millions, where f32 angles lose the phase.
  auto angles = [&](int64_t t, float* cos_t, float* sin_t) {
    for (int i = 0; i < half; ++i) {
      const double angle = double(positions[t]) * inv_freq[i];
      cos_t[i] = float(std::cos(angle));
      sin_t[i] = float(std::sin(angle));
    }
  };
  auto rotate = [&](int64_t t, const float* cos_t, const float* sin_t) {
    for (int64_t h = 0; h < heads; ++h) {
      float* xr = x.ptr<float>() + t * x.stride[0] + h * x.stride[1];
      for (int i = 0; i < half; ++i) {
        float a = xr[i], b = xr[i + half];
        xr[i] = a * cos_t[i] - b * sin_t[i];
        xr[i + half] = b * cos_t[i] + a * sin_t[i];
      }
    }
  };
  // Every attention layer of a forward rotates q and k at the same positions: the table of
  // the last call is reused while positions, rot_dim and theta repeat.
  RopeCache& c = rope_cache_;
  std::unique_lock<std::mutex> lk(c.mu, std::try_to_lock);
  if (lk.owns_lock() && n <= kRopeCacheTokens && half <= kRopeCacheHalf) {
    if (c.n != n || c.rot_dim != rot_dim || c.theta != theta ||
        std::memcmp(c.positions.get(), positions, size_t(n) * sizeof(int32_t)) != 0) {
      for (int64_t t = 0; t < n; ++t) {
        angles(t, c.cos.get() + t * kRopeCacheHalf, c.sin.get() + t * kRopeCacheHalf);
      }
      std::memcpy(c.positions.get(), positions, size_t(n) * sizeof(int32_t));
      c.n = int(n);
      c.rot_dim = rot_dim;
      c.theta = theta;
    }
    pool_.parallel_for(n, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        rotate(t, c.cos.get() + t * kRopeCacheHalf, c.sin.get() + t * kRopeCacheHalf);
      }
    });
    return;
  }
  pool_.parallel_for(n, 16, [&](int64_t t0, int64_t t1) {
    float cos_t[512], sin_t[512];
    for (int64_t t = t0; t < t1; ++t) {
      angles(t, cos_t, sin_t);
      rotate(t, cos_t, sin_t);
    }
  });
}

void CpuOps::swiglu(const Tensor& gate, const Tensor& up, Tensor out) {
  RowView gs(gate), us(up), os(out);
  for (int64_t r = 0; r < gs.n_rows; ++r) {
    const float* g = gs.row(r);
    const float* u = us.row(r);
    float* o = os.row(r);
    silu_mul(g, u, o, gs.d);
  }
}

void CpuOps::mul_sigmoid(Tensor x, const Tensor& gate) {
  RowView xs(x), gs(gate);
  for (int64_t r = 0; r < xs.n_rows; ++r) {
    float* xr = xs.row(r);
    const float* g = gs.row(r);
    sigmoid_mul(xr, g, xs.d);
  }
}

void CpuOps::add(Tensor x, const Tensor& y) {
  RowView xs(x), ys(y);
  for (int64_t r = 0; r < xs.n_rows; ++r) {
    float* xr = xs.row(r);
    const float* yr = ys.row(r);
    for (int64_t j = 0; j < xs.d; ++j) xr[j] += yr[j];
  }
}

void CpuOps::add_scaled_sigmoid(Tensor x, const Tensor& y, const Tensor& s) {
  RowView xs(x), ys(y);
  for (int64_t r = 0; r < xs.n_rows; ++r) {
    float* xr = xs.row(r);
    const float* yr = ys.row(r);
    const float sc = sigmoid(*s.row<float>(r));
    for (int64_t j = 0; j < xs.d; ++j) xr[j] += sc * yr[j];
  }
}

// a, g [n, channels]; b, beta [n, Hv]; a_log [Hv]; dt_bias [channels]. channels = Hv: a decay
// per head (Gated DeltaNet); channels = Hv·dk: one per key channel (Kimi Delta Attention), each
// channel with its head's a_log. The same arithmetic per element either way.
void CpuOps::gdn_gates(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
                       Tensor g, Tensor beta) {
  constexpr int64_t kMaxChannels = 8192;
  const int64_t n = a.shape[0], hv = b.shape[1], channels = a.shape[1];
  RECUR_CHECK(hv > 0 && channels % hv == 0 && channels <= kMaxChannels && a_log.numel() == hv &&
              dt_bias.numel() == channels && g.shape[1] == channels && beta.shape[1] == hv);
  const int64_t dk = channels / hv;
  // Per channel, once per call: -exp(a_log) of its head and its dt_bias.
  alignas(64) float neg_a[kMaxChannels], bias[kMaxChannels];
  for (int64_t j = 0; j < channels; ++j) {
    neg_a[j] = -std::exp(weight_at(a_log, j / dk));
    bias[j] = weight_at(dt_bias, j);
  }
#if defined(__AVX512F__)
  // Few heads (16 a multiple of hv), a decay per head and packed rows: all n·hv gates as one
  // flat array, 16 at a time, with the per-head constants tiled across the lanes.
  if (dk == 1 && 16 % hv == 0 && a.stride[0] == hv && b.stride[0] == hv && g.stride[0] == hv &&
      beta.stride[0] == hv) {
    alignas(64) float neg_a16[16], bias16[16];
    for (int i = 0; i < 16; ++i) {
      neg_a16[i] = neg_a[i % hv];
      bias16[i] = bias[i % hv];
    }
    const __m512 na = _mm512_load_ps(neg_a16), bi = _mm512_load_ps(bias16);
    const float* ap = a.ptr<float>();
    const float* bp = b.ptr<float>();
    float* gp = g.ptr<float>();
    float* betap = beta.ptr<float>();
    const int64_t total = n * hv;
    for (int64_t i = 0; i < total; i += 16) {
      const __mmask16 m = tail_mask(total - i);
      const __m512 x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, ap + i), bi);
      _mm512_mask_storeu_ps(gp + i, m, _mm512_mul_ps(na, softplus16(x)));
      _mm512_mask_storeu_ps(betap + i, m, sigmoid16(_mm512_maskz_loadu_ps(m, bp + i)));
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float* ar = a.row<float>(t);
    const float* br = b.row<float>(t);
    float* gr = g.row<float>(t);
    float* betar = beta.row<float>(t);
#if defined(__AVX512F__)
    for (int64_t j = 0; j < channels; j += 16) {
      const __mmask16 m = tail_mask(channels - j);
      const __m512 x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, ar + j), _mm512_load_ps(bias + j));
      _mm512_mask_storeu_ps(gr + j, m, _mm512_mul_ps(_mm512_load_ps(neg_a + j), softplus16(x)));
    }
    for (int64_t h = 0; h < hv; h += 16) {
      const __mmask16 m = tail_mask(hv - h);
      _mm512_mask_storeu_ps(betar + h, m, sigmoid16(_mm512_maskz_loadu_ps(m, br + h)));
    }
#else
    for (int64_t j = 0; j < channels; ++j) gr[j] = neg_a[j] * softplus(ar[j] + bias[j]);
    for (int64_t h = 0; h < hv; ++h) betar[h] = sigmoid(br[h]);
#endif
  }
}

}  // namespace recur
