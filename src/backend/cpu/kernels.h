// Building blocks shared by the CPU kernels: dtype-generic loads and vectorisable row loops.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/tensor.h"

namespace recur::cpu {

inline float to_f32(float v) {
  return v;
}
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
inline float to_f32(Bf16 v) {
  uint32_t b = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline float to_f32(F16 v) {
  return f16_to_f32(v.bits);
}

// Element i of a contiguous 1-D weight, widened to f32.
inline float weight_at(const Tensor& w, int64_t i) {
  switch (w.dtype) {
    case DType::F32:
      return w.ptr<float>()[i];
    case DType::BF16:
      return to_f32(w.ptr<Bf16>()[i]);
    case DType::F16:
      return to_f32(w.ptr<F16>()[i]);
    default:
      return 0.0f;
  }
}

// Calls fn.template operator()<T>() with T the C++ type of a weight dtype.
template <typename Fn>
void dispatch_weight(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::F32:
      fn(static_cast<const float*>(nullptr));
      break;
    case DType::BF16:
      fn(static_cast<const Bf16*>(nullptr));
      break;
    case DType::F16:
      fn(static_cast<const F16*>(nullptr));
      break;
    default:
      RECUR_CHECK(false && "weight dtype must be F32, BF16 or F16");
  }
}

inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}
inline float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}
inline float softplus(float x) {
  return x > 20.0f ? x : std::log1p(std::exp(x));
}

// Rows of a tensor [..., d] with a contiguous last dimension: 2-D or 3-D, any outer strides.
struct RowView {
  float* base;
  int64_t n_rows, d, inner_rows, stride0, stride1;
  explicit RowView(const Tensor& t) : base(t.ptr<float>()) {
    RECUR_CHECK(t.dtype == DType::F32 && t.ndim >= 2 && t.ndim <= 3 && t.stride[t.ndim - 1] == 1);
    d = t.shape[t.ndim - 1];
    if (t.ndim == 2) {
      n_rows = t.shape[0];
      inner_rows = 1;
      stride0 = t.stride[0];
      stride1 = 0;
    } else {
      n_rows = t.shape[0] * t.shape[1];
      inner_rows = t.shape[1];
      stride0 = t.stride[0];
      stride1 = t.stride[1];
    }
  }
  float* row(int64_t r) const {
    return base + (r / inner_rows) * stride0 + (r % inner_rows) * stride1;
  }
};

// Asks for the cache line holding p. A volatile asm on x86: GCC deletes loops of
// __builtin_prefetch whose trip count it cannot bound, as side-effect free.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

inline float dot_f32(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

}  // namespace recur::cpu
