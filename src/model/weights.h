// Where a model's weights come from: a checkpoint (names resolved, layouts re-packed into what the
// kernels want, each weight handed to the backend once) or random values made in the backend's
// memory for benchmarks. Architectures ask for weights by checkpoint name and get them in the
// layout the ops want; the loader keeps the tally of bytes that ModelInfo reports.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/checkpoint.h"
#include "model/shard.h"
#include "ops/ops.h"

namespace recur {

// How a weight is used, for the backend (matmul weights may take a layout of the backend's own)
// and for the tally (what one decode step reads).
enum class WeightUse {
  kMatrix,     // matmul's w [m, k]
  kVector,     // norms, biases, conv taps, gate parameters
  kEmbedding,  // the token table (rows gathered, not multiplied)
  kExpert,     // a routed expert's matrix (read only for the tokens routed to it)
  kHeads,      // matmul_heads' w [H, m, k]: as stored (no backend layout, not quantized)
};

// Rows [first, first + count) of a stored tensor viewed as 2-D (all dims but the last flattened):
// a weight the kernels want is the concatenation of such pieces, in order.
struct RowPiece {
  std::string name;
  std::vector<int64_t> stored_shape;  // the tensor's full shape in the file (checked)
  int64_t first = 0, count = 0;
  // Only columns [col_first, col_first + col_count) of those rows (a tensor-parallel rank's
  // slice of a projection's input columns, or of a 1-D vector: its one row); 0: all columns.
  int64_t col_first = 0, col_count = 0;
};

// Weights quantized at load (--quantize): matmul weights of F32/BF16/F16 checkpoints become
// block-FP8 (128×128 blocks, as the FP8 releases), or Q8_32 / Q4_32 (groups of 32, f16 scales).
enum class Quantize { kNone, kFp8, kInt8, kQ4 };
const char* quantize_name(Quantize q);  // "none", "fp8", "int8", "q4"

// A checkpoint's quantization_config: only block-FP8 (quant_method fp8, fmt e4m3) is taken.
struct Fp8BlockConfig {
  bool present = false;
  int block_rows = 128, block_cols = 128;  // weight_block_size
};
// Reads config.json's (or its text_config's) quantization_config; errors name the field.
Result<Fp8BlockConfig> read_quantization_config(const nlohmann::json& config,
                                                const std::string& dir);

struct WeightTally {
  int64_t bytes = 0;        // every weight as stored
  int64_t dense_bytes = 0;  // read by every decode step (all but embedding and routed experts)
  int64_t dense_matrix_params = 0;
};

class WeightLoader {
 public:
  virtual ~WeightLoader() = default;
  // The named tensor, with its stored shape checked, as the backend keeps it.
  Result<Tensor> load(const std::string& name, const std::vector<int64_t>& shape, WeightUse use);
  // A weight of `shape` made of the rows of `pieces` (re-packed at load; one piece covering a whole
  // tensor, or a contiguous slice of one, is used in place).
  virtual Result<Tensor> load_rows(std::span<const RowPiece> pieces,
                                   const std::vector<int64_t>& shape, WeightUse use) = 0;
  // The transposes of the pieces' rows [count, cols], in order: a weight of `shape` (numel the
  // pieces' total) re-packed at load, e.g. [P, cols, count] for P pieces of one count (latent
  // attention folds one matrix per head into the query this way).
  virtual Result<Tensor> load_transposed(std::span<const RowPiece> pieces,
                                         const std::vector<int64_t>& shape, WeightUse use) = 0;
  // A vector parameter of `size` values in f32 whatever its stored dtype (F32, BF16 or F16) and
  // shape (stored_shape, of that many elements; {size} when empty): for ops that read one in
  // f32 (a router's selection bias, Kimi's A_log and dt_bias). Only its values [first, first +
  // count) when count > 0 (a tensor-parallel rank's heads).
  virtual Result<Tensor> load_vector_f32(const std::string& name, int64_t size,
                                         std::vector<int64_t> stored_shape, int64_t first = 0,
                                         int64_t count = 0) = 0;
  virtual bool has(const std::string& name) const = 0;
  const WeightTally& tally() const { return tally_; }
  // Which part of the model the weights are for (tensor parallelism; model/shard.h).
  const Shard& shard() const { return shard_; }
  void set_shard(Shard shard) { shard_ = shard; }
  // Buffers of weights the loader made (re-packed or random); the model keeps them.
  std::vector<Buffer>& owned() { return owned_; }

 protected:
  void count(const Tensor& t, WeightUse use);
  std::vector<Buffer> owned_;
  WeightTally tally_;
  Shard shard_;
};

// Weights from a Hugging Face checkpoint, mapped; the backend adopts each one.
class CheckpointWeights final : public WeightLoader {
 public:
  CheckpointWeights(Checkpoint& checkpoint, Ops& ops, Fp8BlockConfig fp8 = {},
                    Quantize quantize = Quantize::kNone)
      : ckpt_(checkpoint), ops_(ops), fp8_(fp8), quantize_(quantize) {}
  Result<Tensor> load_rows(std::span<const RowPiece> pieces, const std::vector<int64_t>& shape,
                           WeightUse use) override;
  Result<Tensor> load_transposed(std::span<const RowPiece> pieces,
                                 const std::vector<int64_t>& shape, WeightUse use) override;
  Result<Tensor> load_vector_f32(const std::string& name, int64_t size,
                                 std::vector<int64_t> stored_shape, int64_t first = 0,
                                 int64_t count = 0) override;
  bool has(const std::string& name) const override { return ckpt_.has(name); }

 private:
  Result<Tensor> adopt(const Tensor& host, WeightUse use, const std::string& name);
  // F8_E4M3 pieces with their `<name>_scale_inv` block scales, re-packed like any weight.
  Result<Tensor> load_fp8(std::span<const RowPiece> pieces, std::span<const Tensor> views,
                          const Tensor& host, WeightUse use);
  Checkpoint& ckpt_;
  Ops& ops_;
  Fp8BlockConfig fp8_;
  Quantize quantize_;
};

// Random weights made in the backend's memory, in the requested layout, with ranges by role so a
// deep random network stays finite (benchmarks of published configurations).
class RandomWeights final : public WeightLoader {
 public:
  RandomWeights(Ops& ops, DType matrix_dtype, uint64_t seed, int n_layers,
                Quantize quantize = Quantize::kNone)
      : ops_(ops), dtype_(matrix_dtype), seed_(seed), n_layers_(n_layers), quantize_(quantize) {}
  Result<Tensor> load_rows(std::span<const RowPiece> pieces, const std::vector<int64_t>& shape,
                           WeightUse use) override;
  Result<Tensor> load_transposed(std::span<const RowPiece> pieces,
                                 const std::vector<int64_t>& shape, WeightUse use) override;
  Result<Tensor> load_vector_f32(const std::string& name, int64_t size, std::vector<int64_t>,
                                 int64_t first = 0, int64_t count = 0) override {
    return load(name, {count > 0 ? count : size}, WeightUse::kVector);  // 1-D random: f32
  }
  bool has(const std::string& name) const override { return false; }
  // Where the random norm weights centre: 0 for norms that scale by (1 + w), 1 for plain w.
  void set_norm_center(float center) { norm_center_ = center; }

 private:
  float norm_center_ = 0.0f;
  Ops& ops_;
  DType dtype_;
  uint64_t seed_;
  int n_layers_;
  Quantize quantize_;
  uint64_t index_ = 0;
  Buffer staging_;  // --quantize: the tensor being made, before quantizing
};

}  // namespace recur
