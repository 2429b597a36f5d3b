// Tensor: a non-owning, strided view of memory owned by a Buffer or a mapped file.
// Shapes are outermost first; strides count elements, not bytes.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/allocator.h"
#include "core/dtype.h"
#include "core/status.h"

namespace recur {

constexpr int kMaxDims = 4;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::kCpu;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t stride[kMaxDims] = {0, 0, 0, 0};

  // A contiguous view over `data` with the given shape.
  static Tensor contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                           Device device = Device::kCpu);

  bool empty() const { return data == nullptr; }
  int64_t numel() const;
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  bool is_contiguous() const;
  // Rows of a 2-D (or higher, flattened after dim 0) view with a contiguous inner part.
  int64_t rows() const { return shape[0]; }
  int64_t row_stride() const { return stride[0]; }
  int64_t row_size() const;  // elements per row when dims after 0 are contiguous

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  template <typename T>
  T* row(int64_t r) const {
    return static_cast<T*>(data) + r * stride[0];
  }

  // Views sharing the same memory.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  Tensor slice_cols(int64_t begin, int64_t end) const;  // last dimension of a 2-D view
  // Columns [col, col + heads·d) of a 2-D view with unit column stride, as [rows, heads, d].
  Tensor col_heads(int64_t col, int64_t heads, int64_t d) const;
  // As col_heads with head h at column col + h·head_stride (0: every head the same columns).
  Tensor col_heads(int64_t col, int64_t heads, int64_t d, int64_t head_stride) const;
  Tensor reshaped(std::initializer_list<int64_t> shape) const;  // contiguous views only

  std::string shape_string() const;  // "[3, 4]"
};

// Element i (counted in elements from data, strides ignored) of an F32, BF16 or F16 tensor in
// host memory, as f32; NaN for other types. Read byte-wise: safetensors packs tensors without
// padding, so a mapped tensor may start at any byte.
float element_f32(const Tensor& t, int64_t i);

// Tensor view over a buffer.
inline Tensor view(const Buffer& b, DType dtype, std::initializer_list<int64_t> shape) {
  return Tensor::contiguous(b.data(), dtype, shape, b.device());
}

}  // namespace recur
