#include "core/tensor.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

namespace recur {

Tensor Tensor::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                          Device device) {
  Tensor t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  RECUR_CHECK(shape.size() <= size_t(kMaxDims));
  t.ndim = int(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t st = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = st;
    st *= t.shape[d];
  }
  return t;
}

int64_t Tensor::numel() const {
  if (ndim == 0) return data ? 1 : 0;
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t st = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != st) return false;
    st *= shape[d];
  }
  return true;
}

int64_t Tensor::row_size() const {
  int64_t n = 1;
  int64_t st = 1;
  for (int d = ndim - 1; d >= 1; --d) {
    RECUR_CHECK(shape[d] == 1 || stride[d] == st);
    st *= shape[d];
    n *= shape[d];
  }
  return n;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  RECUR_CHECK(ndim >= 1 && begin >= 0 && begin <= end && end <= shape[0]);
  Tensor t = *this;
  t.data = static_cast<char*>(data) + begin * stride[0] * int64_t(dtype_size(dtype));
  t.shape[0] = end - begin;
  return t;
}

Tensor Tensor::slice_cols(int64_t begin, int64_t end) const {
  RECUR_CHECK(ndim == 2 && begin >= 0 && begin <= end && end <= shape[1]);
  Tensor t = *this;
  t.data = static_cast<char*>(data) + begin * stride[1] * int64_t(dtype_size(dtype));
  t.shape[1] = end - begin;
  return t;
}

Tensor Tensor::col_heads(int64_t col, int64_t heads, int64_t d) const {
  return col_heads(col, heads, d, d);
}

Tensor Tensor::col_heads(int64_t col, int64_t heads, int64_t d, int64_t head_stride) const {
  RECUR_CHECK(stride[1] == 1 && heads >= 1 && head_stride >= 0);
  Tensor t = slice_cols(col, col + (heads - 1) * head_stride + d);
  t.ndim = 3;
  t.shape[1] = heads, t.shape[2] = d;
  t.stride[1] = head_stride, t.stride[2] = 1;
  return t;
}

Tensor Tensor::reshaped(std::initializer_list<int64_t> new_shape) const {
  RECUR_CHECK(is_contiguous());
  Tensor t = contiguous(data, dtype, new_shape, device);
  RECUR_CHECK(t.numel() == numel());
  return t;
}

std::string Tensor::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += fmt::format("{}{}", i ? ", " : "", shape[i]);
  return s + "]";
}

float element_f32(const Tensor& t, int64_t i) {
  const char* p = static_cast<const char*>(t.data);
  switch (t.dtype) {
    case DType::F32: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case DType::BF16:
    case DType::F16: {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      return t.dtype == DType::BF16 ? bf16_to_f32(v) : f16_to_f32(v);
    }
    default:
      return std::nanf("");
  }
}

}  // namespace recur
