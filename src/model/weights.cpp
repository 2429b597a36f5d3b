#include "model/weights.h"

#include <cmath>
#include <cstring>

namespace recur {

namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Tensor with_shape(Tensor t, const std::vector<int64_t>& shape) {
  t.ndim = int(shape.size());
  int64_t st = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[size_t(d)];
    t.stride[d] = st;
    st *= shape[size_t(d)];
  }
  return t;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", shape[i]);
  return s + "]";
}

}  // namespace

Result<Tensor> WeightLoader::load(const std::string& name, const std::vector<int64_t>& shape,
                                  WeightUse use) {
  const int64_t rows = shape.size() > 1 ? numel_of(shape) / shape.back() : 1;
  const RowPiece piece{name, shape, 0, shape.size() > 1 ? rows : 1};
  return load_rows({&piece, 1}, shape, use);
}

void WeightLoader::count(const Tensor& t, WeightUse use) {
  const int64_t bytes = t.numel() * int64_t(dtype_size(t.dtype));
  tally_.bytes += bytes;
  if (use == WeightUse::kMatrix || use == WeightUse::kVector) tally_.dense_bytes += bytes;
  if (use == WeightUse::kMatrix) tally_.dense_matrix_params += t.numel();
}

Result<Tensor> CheckpointWeights::adopt(const Tensor& host, WeightUse use) {
  if (use == WeightUse::kMatrix || use == WeightUse::kExpert) {
    return ops_.adopt_matmul_weight(host, &owned_);
  }
  return ops_.adopt_weight(host);
}

Result<Tensor> CheckpointWeights::load_rows(std::span<const RowPiece> pieces,
                                            const std::vector<int64_t>& shape, WeightUse use) {
  RECUR_CHECK(!pieces.empty());
  const int64_t cols = shape.size() > 1 ? shape.back() : numel_of(shape);
  std::vector<Tensor> views;
  int64_t rows = 0;
  for (const RowPiece& p : pieces) {
    RECUR_ASSIGN_OR_RETURN(Tensor t, ckpt_.get(p.name, p.stored_shape));
    const int64_t stored_cols = p.stored_shape.size() > 1 ? p.stored_shape.back() : t.numel();
    const int64_t stored_rows = t.numel() / std::max<int64_t>(stored_cols, 1);
    RECUR_CHECK(stored_cols == cols && p.first >= 0 && p.first + p.count <= stored_rows);
    Tensor flat = t.reshaped({stored_rows, stored_cols});
    views.push_back(flat.slice_rows(p.first, p.first + p.count));
    rows += p.count;
  }
  if (rows * cols != numel_of(shape)) {
    return make_error(ErrorCode::kInternal, "weight '{}': pieces give {} x {}, expected {}",
                      pieces[0].name, rows, cols, shape_text(shape));
  }
  for (const Tensor& v : views) {
    if (v.dtype != views[0].dtype) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: tensors '{}' and '{}' form one weight but are {} and {}", ckpt_.dir(),
                        pieces[0].name, pieces.back().name, dtype_name(views[0].dtype),
                        dtype_name(v.dtype));
    }
  }
  Tensor host;
  Buffer repacked;
  if (views.size() == 1) {  // used in place: a whole tensor or a contiguous slice of one
    host = with_shape(views[0], shape);
  } else {
    const size_t es = dtype_size(views[0].dtype), row_bytes = size_t(cols) * es;
    RECUR_ASSIGN_OR_RETURN(repacked,
                           cpu_allocator().allocate(size_t(rows) * row_bytes, "re-packed weight"));
    char* dst = static_cast<char*>(repacked.data());
    for (const Tensor& v : views) {
      std::memcpy(dst, v.data, size_t(v.shape[0]) * row_bytes);
      dst += size_t(v.shape[0]) * row_bytes;
    }
    host = with_shape(Tensor::contiguous(repacked.data(), views[0].dtype, {rows * cols}), shape);
  }
  RECUR_ASSIGN_OR_RETURN(Tensor adopted, adopt(host, use));
  // A backend that used the host copy in place needs it for as long as the model lives.
  if (repacked.data() && adopted.data == host.data) owned_.push_back(std::move(repacked));
  count(adopted, use);
  return adopted;
}

Result<Tensor> CheckpointWeights::load_transposed(const RowPiece& piece, WeightUse use) {
  RECUR_ASSIGN_OR_RETURN(Tensor t, ckpt_.get(piece.name, piece.stored_shape));
  const int64_t cols = piece.stored_shape.size() > 1 ? piece.stored_shape.back() : t.numel();
  const int64_t stored_rows = t.numel() / std::max<int64_t>(cols, 1);
  RECUR_CHECK(piece.first >= 0 && piece.first + piece.count <= stored_rows);
  const int64_t rows = piece.count;
  const size_t es = dtype_size(t.dtype);
  RECUR_ASSIGN_OR_RETURN(Buffer buf,
                         cpu_allocator().allocate(size_t(rows * cols) * es, "transposed weight"));
  const char* src = static_cast<const char*>(t.data) + size_t(piece.first * cols) * es;
  char* dst = static_cast<char*>(buf.data());
  for (int64_t r = 0; r < rows; ++r) {  // element (r, c) to (c, r), whatever its dtype
    for (int64_t c = 0; c < cols; ++c) {
      std::memcpy(dst + size_t(c * rows + r) * es, src + size_t(r * cols + c) * es, es);
    }
  }
  const Tensor host = Tensor::contiguous(buf.data(), t.dtype, {cols, rows});
  RECUR_ASSIGN_OR_RETURN(Tensor adopted, adopt(host, use));
  if (adopted.data == host.data) owned_.push_back(std::move(buf));
  count(adopted, use);
  return adopted;
}

Result<Tensor> CheckpointWeights::load_vector_f32(const std::string& name, int64_t size) {
  RECUR_ASSIGN_OR_RETURN(Tensor t, ckpt_.get(name, {size}));
  if (t.dtype == DType::F32) return load(name, {size}, WeightUse::kVector);
  if (t.dtype != DType::BF16 && t.dtype != DType::F16) {
    return make_error(ErrorCode::kCorrupt, "{}: tensor '{}' is {}, expected a float type",
                      ckpt_.dir(), name, dtype_name(t.dtype));
  }
  RECUR_ASSIGN_OR_RETURN(Buffer buf, cpu_allocator().allocate(size_t(size) * 4, name.c_str()));
  float* out = static_cast<float*>(buf.data());
  const uint16_t* in = static_cast<const uint16_t*>(t.data);
  for (int64_t i = 0; i < size; ++i) {
    out[i] = t.dtype == DType::BF16 ? bf16_to_f32(in[i]) : f16_to_f32(in[i]);
  }
  const Tensor host = Tensor::contiguous(buf.data(), DType::F32, {size});
  RECUR_ASSIGN_OR_RETURN(Tensor adopted, adopt(host, WeightUse::kVector));
  if (adopted.data == host.data) owned_.push_back(std::move(buf));
  count(adopted, WeightUse::kVector);
  return adopted;
}

namespace {
// Uniform ranges by role, so that a deep random network stays finite and roughly as well
// conditioned as a trained one.
std::pair<float, float> random_range(const std::string& name, const std::vector<int64_t>& shape,
                                     int n_layers, float norm_center) {
  if (name.ends_with("linear_attn.norm.weight")) return {0.9f, 1.1f};
  if (name.ends_with("norm.weight") || name.ends_with("layernorm.weight")) {
    return {norm_center - 0.1f, norm_center + 0.1f};
  }
  if (name.ends_with("A_log")) return {0.0f, 2.77f};
  if (name.ends_with("dt_bias")) return {0.5f, 1.5f};
  if (name.ends_with("embed_tokens.weight")) return {-1.7f, 1.7f};
  float a = std::sqrt(3.0f / float(shape.back()));
  if (name.ends_with("o_proj.weight") || name.ends_with("out_proj.weight") ||
      name.ends_with("down_proj.weight") || name.ends_with("experts.down_proj")) {
    a /= std::sqrt(2.0f * float(n_layers));
  }
  return {-a, a};
}
}  // namespace

Result<Tensor> RandomWeights::load_rows(std::span<const RowPiece> pieces,
                                        const std::vector<int64_t>& shape, WeightUse use) {
  const int64_t n = numel_of(shape);
  // 1-D parameters stay f32, as checkpoints often keep them.
  const DType dt = shape.size() == 1 ? DType::F32 : dtype_;
  const std::string& name = pieces.front().name;
  RECUR_ASSIGN_OR_RETURN(Buffer buf,
                         ops_.allocator().allocate(size_t(n) * dtype_size(dt), name.c_str()));
  Tensor t = Tensor::contiguous(buf.data(), dt, {n}, buf.device());
  const auto [lo, hi] = random_range(name, shape, n_layers_, norm_center_);
  ops_.fill_random_uniform(t, seed_ + 0x1000 * ++index_, lo, hi);
  t = with_shape(t, shape);
  owned_.push_back(std::move(buf));
  count(t, use);
  return t;
}

}  // namespace recur

namespace recur {

Result<Tensor> RandomWeights::load_transposed(const RowPiece& piece, WeightUse use) {
  const int64_t cols = piece.stored_shape.empty() ? 1 : piece.stored_shape.back();
  return load_rows({&piece, 1}, {cols, piece.count}, use);
}

}  // namespace recur
