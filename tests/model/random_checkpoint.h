// Random Qwen3-Next checkpoints for tests: a Hugging Face model directory (config.json +
// model.safetensors) whose shapes are chosen by the test, so that recur can be checked on
// shapes no shipped checkpoint has. Written without recur's io code, so that a bug shared by
// recur's reader and a writer built on it cannot hide.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace recur_test {

enum class StoreType { kF32, kBF16, kF16 };

const char* store_type_name(StoreType t);  // safetensors' spelling: "F32", "BF16", "F16"

// The nearest value the stored dtype holds (round to nearest even), as a double.
double round_to_store(StoreType t, double x);

// One tensor as written. Values are already rounded to what `type` holds, so a reference that
// reads them sees exactly the weights recur reads from the file.
struct StoredTensor {
  std::vector<int64_t> shape;
  StoreType type = StoreType::kF32;
  std::vector<double> values;  // row-major, numel(shape) values
};
using TensorMap = std::map<std::string, StoredTensor>;

// The shapes of a tiny model and the config.json style that describes them.
struct RandomModelSpec {
  int hidden = 32;
  int layers = 4;
  int vocab = 128;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;

  int heads = 4;
  int kv_heads = 2;
  int head_dim = 16;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 0.25;
  bool rope_parameters_style = false;  // nested rope_parameters vs top-level fields

  // Empty: full_attention_interval decides which layers are full attention.
  std::vector<std::string> layer_types;
  int full_attention_interval = 4;

  int linear_key_heads = 2;
  int linear_value_heads = 4;
  int linear_key_dim = 8;
  int linear_value_dim = 8;
  int conv_kernel = 4;

  int intermediate = 48;  // dense MLP layers
  int experts = 4;        // 0: every layer dense
  int experts_per_tok = 2;
  int moe_intermediate = 16;
  int shared_intermediate = 24;
  bool norm_topk_prob = true;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;

  StoreType dtype = StoreType::kF32;
  // Keep A_log and dt_bias in F32 while the rest uses `dtype`, as released checkpoints do.
  bool gate_params_f32 = false;
};

struct RandomCheckpoint {
  nlohmann::json config;
  TensorMap tensors;
};

// Builds config.json and random weights: matrices N(0, 1/fan_in), embeddings N(0, 1),
// zero-centred norm weights N(0, 0.2²), the gated norm 1 + N(0, 0.2²), A_log = log U(1, 16),
// dt_bias 1 + N(0, 0.2²). Deterministic for a given seed on every platform.
RandomCheckpoint make_random_checkpoint(const RandomModelSpec& spec, uint64_t seed);

// Writes dir/config.json and dir/model.safetensors; throws std::runtime_error on failure.
void write_checkpoint(const std::string& dir, const RandomCheckpoint& checkpoint);

// A fresh directory under the system temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace recur_test
