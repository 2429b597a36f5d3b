#include "model/weights.h"

#include <cmath>
#include <cstring>
#include <numeric>

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

// Which matmul weights --quantize converts, and to what: the projections and experts; the LM
// head in 8 bits (int8 also under q4; kept as stored under fp8, as the FP8 releases keep it);
// not the routers, the shared-expert gate or the Gated DeltaNet's b / a projections (a few
// rows each, and the FP8 releases keep them too). Q8_32 / Q4_32 need k a multiple of 32.
std::optional<DType> quantized_dtype(Quantize q, const std::string& name, int64_t k) {
  if (q == Quantize::kNone) return std::nullopt;
  for (const char* kept : {"mlp.gate.weight", "shared_expert_gate.weight", "in_proj_ba.weight",
                           "in_proj_b.weight", "in_proj_a.weight"}) {
    if (name.ends_with(kept)) return std::nullopt;
  }
  const bool lm_head = name == "lm_head.weight";
  if (q == Quantize::kFp8) return lm_head ? std::nullopt : std::optional(DType::F8_E4M3);
  if (k % 32 != 0) return std::nullopt;
  return q == Quantize::kQ4 && !lm_head ? DType::Q4_32 : DType::Q8_32;
}

// host [m, k] (F32/BF16/F16, contiguous) quantized to `dtype` and handed to the backend. A
// device backend quantizes to fp8 itself (the same 128×128 blocks and values).
Result<Tensor> quantize_matmul(Ops& ops, const Tensor& host, DType dtype,
                               std::vector<Buffer>* owned) {
  if (dtype != DType::F8_E4M3 || ops.device() != Device::kCpu) {
    return ops.quantize_matmul_weight(host, dtype, owned);
  }
  // Block-FP8 made here, the same for every backend: 128×128 blocks scaled so that each
  // block's largest magnitude becomes 448, e4m3's largest.
  constexpr int kBlock = 128;
  const int64_t m = host.shape[0], k = host.shape[1];
  const int64_t mb = (m + kBlock - 1) / kBlock, kb = (k + kBlock - 1) / kBlock;
  RECUR_ASSIGN_OR_RETURN(Buffer bytes, cpu_allocator().allocate(size_t(m * k), "fp8 weight"));
  RECUR_ASSIGN_OR_RETURN(Buffer scales,
                         cpu_allocator().allocate(size_t(mb * kb) * 4, "fp8 weight scales"));
  auto* q8 = static_cast<uint8_t*>(bytes.data());
  auto* sc = static_cast<float*>(scales.data());
  for (int64_t bi = 0; bi < mb; ++bi) {
    for (int64_t bj = 0; bj < kb; ++bj) {
      const int64_t r1 = std::min(m, (bi + 1) * kBlock), c1 = std::min(k, (bj + 1) * kBlock);
      float amax = 0.0f;
      for (int64_t r = bi * kBlock; r < r1; ++r) {
        for (int64_t c = bj * kBlock; c < c1; ++c)
          amax = std::max(amax, std::fabs(element_f32(host, r * k + c)));
      }
      const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      sc[bi * kb + bj] = scale;
      for (int64_t r = bi * kBlock; r < r1; ++r) {
        for (int64_t c = bj * kBlock; c < c1; ++c)
          q8[r * k + c] = f32_to_f8_e4m3(element_f32(host, r * k + c) / scale);
      }
    }
  }
  const Tensor w = Tensor::contiguous(bytes.data(), DType::F8_E4M3, {m, k});
  const Tensor s = Tensor::contiguous(scales.data(), DType::F32, {mb, kb});
  RECUR_ASSIGN_OR_RETURN(Tensor adopted, ops.adopt_block_fp8_weight(w, s, kBlock, kBlock, owned));
  if (adopted.data == bytes.data()) owned->push_back(std::move(bytes));
  owned->push_back(std::move(scales));  // a backend may keep pointing at them
  return adopted;
}

}  // namespace

const char* quantize_name(Quantize q) {
  switch (q) {
    case Quantize::kNone:
      return "none";
    case Quantize::kFp8:
      return "fp8";
    case Quantize::kInt8:
      return "int8";
    case Quantize::kQ4:
      return "q4";
  }
  return "?";
}

Result<Fp8BlockConfig> read_quantization_config(const nlohmann::json& config,
                                                const std::string& dir) {
  const nlohmann::json* q = nullptr;
  if (config.contains("quantization_config")) {
    q = &config["quantization_config"];
  } else if (config.contains("text_config") && config["text_config"].is_object() &&
             config["text_config"].contains("quantization_config")) {
    q = &config["text_config"]["quantization_config"];
  }
  Fp8BlockConfig out;
  if (q == nullptr || q->is_null()) return out;
  const std::string where = dir + "/config.json: quantization_config";
  if (!q->is_object()) return make_error(ErrorCode::kCorrupt, "{} is not an object", where);
  const std::string method =
      q->contains("quant_method") && (*q)["quant_method"].is_string() ? (*q)["quant_method"] : "";
  if (method != "fp8") {
    return make_error(
        ErrorCode::kUnsupported,
        "{}: quant_method '{}' is not supported (supported: fp8, block-FP8 e4m3)", where,
        method.empty() ? (*q).value("quant_method", nlohmann::json()).dump() : method);
  }
  if (q->contains("fmt") && !((*q)["fmt"].is_string() && (*q)["fmt"] == "e4m3")) {
    return make_error(ErrorCode::kUnsupported, "{}: fmt {} is not supported (supported: e4m3)",
                      where, (*q)["fmt"].dump());
  }
  if (q->contains("activation_scheme") &&
      !((*q)["activation_scheme"].is_string() && (*q)["activation_scheme"] == "dynamic")) {
    return make_error(ErrorCode::kUnsupported,
                      "{}: activation_scheme {} is not supported (supported: dynamic)", where,
                      (*q)["activation_scheme"].dump());
  }
  const nlohmann::json& bs = q->value("weight_block_size", nlohmann::json());
  if (!bs.is_array() || bs.size() != 2 || !bs[0].is_number_integer() ||
      !bs[1].is_number_integer() || bs[0].get<int64_t>() < 1 || bs[1].get<int64_t>() < 1 ||
      bs[0].get<int64_t>() > 65536 || bs[1].get<int64_t>() > 65536) {
    return make_error(ErrorCode::kUnsupported,
                      "{}: weight_block_size {} is not two positive integers (per-tensor FP8 "
                      "scales are not supported)",
                      where, bs.dump());
  }
  out.present = true;
  out.block_rows = bs[0].get<int>();
  out.block_cols = bs[1].get<int>();
  return out;
}

Result<Tensor> WeightLoader::load(const std::string& name, const std::vector<int64_t>& shape,
                                  WeightUse use) {
  const int64_t rows = shape.size() > 1 ? numel_of(shape) / shape.back() : 1;
  const RowPiece piece{name, shape, 0, shape.size() > 1 ? rows : 1};
  return load_rows({&piece, 1}, shape, use);
}

void WeightLoader::count(const Tensor& t, WeightUse use) {
  const int64_t bytes = weight_bytes(t.dtype, t.numel());
  tally_.bytes += bytes;
  const bool matrix = use == WeightUse::kMatrix || use == WeightUse::kHeads;
  if (matrix || use == WeightUse::kVector) tally_.dense_bytes += bytes;
  if (matrix) tally_.dense_matrix_params += t.numel();
}

Result<Tensor> CheckpointWeights::adopt(const Tensor& host, WeightUse use,
                                        const std::string& name) {
  if (use != WeightUse::kMatrix && use != WeightUse::kExpert) return ops_.adopt_weight(host);
  const std::optional<DType> q =
      host.ndim == 2 ? quantized_dtype(quantize_, name, host.shape[1]) : std::nullopt;
  if (!q) return ops_.adopt_matmul_weight(host, &owned_);
  return quantize_matmul(ops_, host, *q, &owned_);
}

Result<Tensor> CheckpointWeights::load_rows(std::span<const RowPiece> pieces,
                                            const std::vector<int64_t>& shape, WeightUse use) {
  RECUR_CHECK(!pieces.empty());
  const int64_t cols = shape.size() > 1 ? shape.back() : numel_of(shape);
  std::vector<Tensor> views;
  int64_t rows = 0;
  for (const RowPiece& p : pieces) {
    RECUR_ASSIGN_OR_RETURN(Tensor t, ckpt_.get(p.name, p.stored_shape, /*allow_fp8=*/true));
    if (t.dtype == DType::F8_E4M3 && use != WeightUse::kMatrix && use != WeightUse::kExpert) {
      return make_error(ErrorCode::kUnsupported,
                        "{}: tensor '{}' is F8_E4M3, but it is {}: only matmul weights may be "
                        "block-FP8 (F32, BF16 or F16 here)",
                        ckpt_.dir(), p.name,
                        use == WeightUse::kEmbedding ? "the embedding table"
                        : use == WeightUse::kHeads   ? "a per-head weight (matmul_heads)"
                                                     : "a vector weight");
    }
    const int64_t stored_cols = p.stored_shape.size() > 1 ? p.stored_shape.back() : t.numel();
    const int64_t stored_rows = t.numel() / std::max<int64_t>(stored_cols, 1);
    const int64_t col_count = p.col_count > 0 ? p.col_count : stored_cols;
    RECUR_CHECK(col_count == cols && p.col_first >= 0 && p.col_first + col_count <= stored_cols &&
                p.first >= 0 && p.first + p.count <= stored_rows);
    Tensor flat = t.reshaped({stored_rows, stored_cols});
    views.push_back(
        flat.slice_rows(p.first, p.first + p.count).slice_cols(p.col_first, p.col_first + cols));
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
  // safetensors packs tensors without padding: one that starts off its type's alignment (after
  // a tensor of an odd byte count) is copied, so no kernel reads a misaligned element.
  const bool aligned = reinterpret_cast<uintptr_t>(views[0].data) % dtype_size(views[0].dtype) == 0;
  const bool in_place = views.size() == 1 && views[0].is_contiguous() && aligned;
  if (in_place) {  // a whole tensor or a contiguous slice of one
    host = with_shape(views[0], shape);
  } else {
    const size_t es = dtype_size(views[0].dtype), row_bytes = size_t(cols) * es;
    RECUR_ASSIGN_OR_RETURN(repacked,
                           cpu_allocator().allocate(size_t(rows) * row_bytes, "re-packed weight"));
    char* dst = static_cast<char*>(repacked.data());
    for (const Tensor& v : views) {
      if (v.is_contiguous()) {
        std::memcpy(dst, v.data, size_t(v.shape[0]) * row_bytes);
        dst += size_t(v.shape[0]) * row_bytes;
        continue;
      }
      for (int64_t r = 0; r < v.shape[0]; ++r, dst += row_bytes) {  // a column slice, by row
        std::memcpy(dst, static_cast<const char*>(v.data) + size_t(r * v.stride[0]) * es,
                    row_bytes);
      }
    }
    host = with_shape(Tensor::contiguous(repacked.data(), views[0].dtype, {rows * cols}), shape);
  }
  Tensor adopted;
  if (host.dtype == DType::F8_E4M3) {
    RECUR_ASSIGN_OR_RETURN(adopted, load_fp8(pieces, views, host, use));
  } else {
    RECUR_ASSIGN_OR_RETURN(adopted, adopt(host, use, pieces[0].name));
  }
  // A backend that used the host copy in place needs it for as long as the model lives.
  if (repacked.data() && adopted.data == host.data) owned_.push_back(std::move(repacked));
  // Otherwise, or when the pieces were copied here, the mapped bytes were copied (re-packed,
  // re-laid out, quantized, or sent to a device): they stop counting as resident instead of
  // doubling the model's memory.
  if (adopted.data != host.data || !in_place) {
    for (const Tensor& v : views) {
      if (v.is_contiguous()) ckpt_.release(v);  // a column slice shares its pages with others
    }
  }
  count(adopted, use);
  return adopted;
}

Result<Tensor> CheckpointWeights::load_fp8(std::span<const RowPiece> pieces,
                                           std::span<const Tensor> views, const Tensor& host,
                                           WeightUse use) {
  const std::string& dir = ckpt_.dir();
  if (!fp8_.present) {
    return make_error(ErrorCode::kCorrupt,
                      "{}: tensor '{}' is F8_E4M3, but config.json has no block-FP8 "
                      "quantization_config (quant_method fp8, weight_block_size)",
                      dir, pieces[0].name);
  }
  if (host.ndim != 2) {
    return make_error(ErrorCode::kUnsupported, "{}: F8_E4M3 tensor '{}' is not a matrix", dir,
                      pieces[0].name);
  }
  // The two NaN codes (S.1111.111) are no weight: a corrupt file, named here rather than
  // left to turn every logit NaN (the vector kernels do not decode them).
  for (size_t i = 0; i < views.size(); ++i) {
    const int64_t rows = views[i].shape[0], cols = views[i].shape[1];
    for (int64_t r = 0; r < rows; ++r) {
      const auto* b = views[i].ptr<uint8_t>() + r * views[i].stride[0];
      for (int64_t j = 0; j < cols; ++j) {
        if ((b[j] & 0x7f) == 0x7f) {
          return make_error(ErrorCode::kCorrupt,
                            "{}: F8_E4M3 tensor '{}' holds NaN at row {}, column {}", dir,
                            pieces[i].name, pieces[i].first + r, pieces[i].col_first + j);
        }
      }
    }
  }
  const int64_t br = fp8_.block_rows, bc = fp8_.block_cols;
  // Columns per scale of the result: the stored blocks', or finer when a column slice (a
  // tensor-parallel rank's) starts inside one, so that no block of the result straddles two.
  int64_t out_cols = bc;
  for (const RowPiece& p : pieces) out_cols = std::gcd(out_cols, p.col_first);
  const int64_t m = host.shape[0], k = host.shape[1], kb = (k + out_cols - 1) / out_cols;
  // Each piece's scales, [E·ceil(R / br), kb] over a stored [E, R, k] (E = 1 for a matrix).
  struct PieceScales {
    Tensor scales;
    int64_t rows_per_expert, blocks_per_expert, out_start;
    int64_t stored_kb;  // scale columns of the stored tensor
  };
  std::vector<PieceScales> ps;
  int64_t out_block = br;  // rows per scale row of the result: divides every piece boundary
  int64_t out = 0;
  for (const RowPiece& p : pieces) {
    const std::string scale_name = p.name + "_scale_inv";
    const int64_t R = p.stored_shape.size() > 1 ? p.stored_shape[p.stored_shape.size() - 2] : 1;
    const int64_t stored_kb = (p.stored_shape.back() + bc - 1) / bc;
    std::vector<int64_t> want(p.stored_shape.begin(), p.stored_shape.end());
    if (want.size() < 2) want.insert(want.begin(), 1);
    want[want.size() - 2] = (R + br - 1) / br;
    want.back() = stored_kb;
    if (!ckpt_.has(scale_name)) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: F8_E4M3 tensor '{}' has no block scales: tensor '{}' is missing", dir,
                        p.name, scale_name);
    }
    RECUR_ASSIGN_OR_RETURN(Tensor s, ckpt_.get(scale_name, want));
    ps.push_back({s, R, (R + br - 1) / br, out, stored_kb});
    out_block = std::gcd(out_block, out);
    out_block = std::gcd(out_block, p.first % R);
    if (p.first % R + p.count > R) out_block = std::gcd(out_block, R);
    out += p.count;
  }
  const int64_t mb = (m + out_block - 1) / out_block;
  RECUR_ASSIGN_OR_RETURN(Buffer scales,
                         cpu_allocator().allocate(size_t(mb * kb) * 4, "fp8 weight scales"));
  auto* sc = static_cast<float*>(scales.data());
  size_t pi = 0;
  for (int64_t b = 0; b < mb; ++b) {
    const int64_t q = b * out_block;  // first result row of the block
    while (pi + 1 < pieces.size() && ps[pi + 1].out_start <= q) ++pi;
    const PieceScales& p = ps[pi];
    const int64_t r = pieces[pi].first + (q - p.out_start);  // stored row, flattened
    const int64_t srow =
        (r / p.rows_per_expert) * p.blocks_per_expert + (r % p.rows_per_expert) / br;
    for (int64_t j = 0; j < kb; ++j) {
      const int64_t scol = (pieces[pi].col_first + j * out_cols) / bc;  // stored scale column
      sc[b * kb + j] = element_f32(p.scales, srow * p.stored_kb + scol);
    }
  }
  const Tensor s = Tensor::contiguous(scales.data(), DType::F32, {mb, kb});
  RECUR_ASSIGN_OR_RETURN(
      Tensor adopted, ops_.adopt_block_fp8_weight(host, s, int(out_block), int(out_cols), &owned_));
  owned_.push_back(std::move(scales));  // a backend may keep pointing at them
  tally_.bytes += mb * kb * 4;
  if (use == WeightUse::kMatrix) tally_.dense_bytes += mb * kb * 4;
  return adopted;
}

Result<Tensor> CheckpointWeights::load_transposed(std::span<const RowPiece> pieces,
                                                  const std::vector<int64_t>& shape,
                                                  WeightUse use) {
  RECUR_CHECK(!pieces.empty());
  std::vector<Tensor> stored;
  int64_t total = 0;
  for (const RowPiece& p : pieces) {
    RECUR_ASSIGN_OR_RETURN(Tensor t, ckpt_.get(p.name, p.stored_shape));
    const int64_t cols = p.stored_shape.size() > 1 ? p.stored_shape.back() : t.numel();
    RECUR_CHECK(p.first >= 0 && p.first + p.count <= t.numel() / std::max<int64_t>(cols, 1));
    if (!stored.empty() && t.dtype != stored[0].dtype) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: tensors '{}' and '{}' form one weight but are {} and {}", ckpt_.dir(),
                        pieces[0].name, p.name, dtype_name(stored[0].dtype), dtype_name(t.dtype));
    }
    stored.push_back(t);
    total += p.count * cols;
  }
  if (total != numel_of(shape)) {
    return make_error(ErrorCode::kInternal, "weight '{}': pieces give {} values, expected {}",
                      pieces[0].name, total, shape_text(shape));
  }
  const size_t es = dtype_size(stored[0].dtype);
  RECUR_ASSIGN_OR_RETURN(Buffer buf,
                         cpu_allocator().allocate(size_t(total) * es, "transposed weight"));
  char* dst = static_cast<char*>(buf.data());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const RowPiece& p = pieces[i];
    const int64_t cols = p.stored_shape.size() > 1 ? p.stored_shape.back() : stored[i].numel();
    const int64_t rows = p.count;
    const char* src = static_cast<const char*>(stored[i].data) + size_t(p.first * cols) * es;
    for (int64_t r = 0; r < rows; ++r) {  // element (r, c) to (c, r), whatever its dtype
      for (int64_t c = 0; c < cols; ++c) {
        std::memcpy(dst + size_t(c * rows + r) * es, src + size_t(r * cols + c) * es, es);
      }
    }
    dst += size_t(rows * cols) * es;
  }
  const Tensor host = with_shape(Tensor::contiguous(buf.data(), stored[0].dtype, {total}), shape);
  RECUR_ASSIGN_OR_RETURN(Tensor adopted, adopt(host, use, pieces[0].name));
  if (adopted.data == host.data) owned_.push_back(std::move(buf));
  count(adopted, use);
  return adopted;
}

Result<Tensor> CheckpointWeights::load_vector_f32(const std::string& name, int64_t size,
                                                  std::vector<int64_t> stored_shape, int64_t first,
                                                  int64_t n) {
  if (stored_shape.empty()) stored_shape = {size};
  RECUR_CHECK(numel_of(stored_shape) == size);
  if (n <= 0) first = 0, n = size;
  RECUR_CHECK(first >= 0 && first + n <= size);
  RECUR_ASSIGN_OR_RETURN(Tensor t, ckpt_.get(name, stored_shape));
  if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16) {
    return make_error(ErrorCode::kCorrupt, "{}: tensor '{}' is {}, expected a float type",
                      ckpt_.dir(), name, dtype_name(t.dtype));
  }
  RECUR_ASSIGN_OR_RETURN(Buffer buf, cpu_allocator().allocate(size_t(n) * 4, name.c_str()));
  float* out = static_cast<float*>(buf.data());
  if (t.dtype == DType::F32) {
    std::memcpy(out, t.ptr<float>() + first, size_t(n) * 4);
  } else {
    const uint16_t* in = static_cast<const uint16_t*>(t.data) + first;
    for (int64_t i = 0; i < n; ++i) {
      out[i] = t.dtype == DType::BF16 ? bf16_to_f32(in[i]) : f16_to_f32(in[i]);
    }
  }
  const Tensor host = Tensor::contiguous(buf.data(), DType::F32, {n});
  RECUR_ASSIGN_OR_RETURN(Tensor adopted, adopt(host, WeightUse::kVector, name));
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
  const std::optional<DType> q =
      (use == WeightUse::kMatrix || use == WeightUse::kExpert) && shape.size() == 2
          ? quantized_dtype(quantize_, name, shape[1])
          : std::nullopt;
  if (q) {
    // Made in the backend's memory in `dt`, one tensor at a time in a staging buffer kept for
    // the next, then quantized as a checkpoint's would be (the model never exists in `dt`).
    if (ops_.device() != Device::kCpu && *q != DType::F8_E4M3) {
      return make_error(ErrorCode::kUnsupported,
                        "weights quantized to {} at load run on the CPU only (fp8 runs on both)",
                        quantize_name(quantize_));
    }
    const size_t bytes = size_t(n) * dtype_size(dt);
    if (staging_.bytes() < bytes) {
      staging_.reset();
      RECUR_ASSIGN_OR_RETURN(staging_, ops_.allocator().allocate(bytes, "weight staging"));
    }
    Tensor t = Tensor::contiguous(staging_.data(), dt, {n}, staging_.device());
    const auto [lo, hi] = random_range(name, shape, n_layers_, norm_center_);
    ops_.fill_random_uniform(t, seed_ + 0x1000 * ++index_, lo, hi);
    RECUR_ASSIGN_OR_RETURN(Tensor adopted,
                           quantize_matmul(ops_, with_shape(t, shape), *q, &owned_));
    count(adopted, use);
    return adopted;
  }
  RECUR_ASSIGN_OR_RETURN(Buffer buf,
                         ops_.allocator().allocate(size_t(n) * dtype_size(dt), name.c_str()));
  Tensor t = Tensor::contiguous(buf.data(), dt, {n}, buf.device());
  const auto [lo, hi] = random_range(name, shape, n_layers_, norm_center_);
  ops_.fill_random_uniform(t, seed_ + 0x1000 * ++index_, lo, hi);
  t = with_shape(t, shape);
  // Matmul weights in the backend's matmul layout, as a checkpoint's are (the CPU's k-major
  // copy; the row-major tensor is then dropped).
  if ((use == WeightUse::kMatrix || use == WeightUse::kExpert) && shape.size() == 2) {
    RECUR_ASSIGN_OR_RETURN(t, ops_.adopt_matmul_weight(t, &owned_));
  }
  if (t.data == buf.data()) owned_.push_back(std::move(buf));
  count(t, use);
  return t;
}

}  // namespace recur

namespace recur {

Result<Tensor> RandomWeights::load_transposed(std::span<const RowPiece> pieces,
                                              const std::vector<int64_t>& shape, WeightUse use) {
  return load_rows(pieces, shape, use);  // random values: any layout is as good
}

}  // namespace recur
