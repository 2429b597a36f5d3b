// Random checkpoints of the Qwen hybrid family (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) for tests: a
// Hugging Face model directory (config.json + model.safetensors) whose shapes and layout are
// chosen by the test, so that recur can be checked on shapes no shipped checkpoint has. Written
// without recur's io code, so that a bug shared by recur's reader and a writer built on it
// cannot hide.
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

enum class Family {
  kQwen3Next,  // qwen3_next: in_proj_qkvz / in_proj_ba interleaved by key head
  kQwen3_5,    // qwen3_5: in_proj_qkv, _z, _b, _a; a dense SwiGLU in every layer
  kQwen3_5Moe  // qwen3_5_moe: as qwen3_5 with MoE (σ-gated shared expert) in every layer
};

// The shapes of a tiny model and the config.json style that describes them.
struct RandomModelSpec {
  Family family = Family::kQwen3Next;
  // Qwen3.5 only. Nested: the published multimodal layout (Qwen3_5[Moe]ForConditionalGeneration,
  // the text config in `text_config`, weights under model.language_model., lm_head at the top, a
  // few model.visual.* tensors). Flat: the text-only one (Qwen3_5[Moe]ForCausalLM, weights under
  // model.). Both carry a few mtp.* tensors.
  bool nested = true;
  // Qwen3.5-MoE only: experts fused as the bf16 releases store them (gate_up_proj [E, 2I, H],
  // down_proj [E, H, I]) or one tensor per expert.
  bool fused_experts = true;
  // Qwen3.5 only: rope_parameters.mrope_section (three sizes, summing to rotary_dim / 2 in a valid
  // config), written with mrope_interleaved; empty: none. Qwen3.5 always writes rope_parameters.
  std::vector<int> mrope_section;

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
  bool rope_parameters_style = false;  // Qwen3-Next: rope_parameters vs top-level fields

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
  // Qwen3-Next only: the router's renormalisation and which layers are MoE. Qwen3.5-MoE always
  // renormalises and has MoE everywhere; there these are written only when they differ from
  // that (norm_topk_prob false, decoder_sparse_step > 1, mlp_only_layers), as stray fields that
  // transformers ignores for the family, and must be ignored.
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

// Where the text model's weights live: "model.language_model." (nested Qwen3.5) or "model.".
std::string text_prefix(const RandomModelSpec& spec);

// Whether layer i is full attention / has a MoE feed-forward, as the spec describes it.
bool spec_layer_is_full_attention(const RandomModelSpec& spec, int layer);
bool spec_layer_is_moe(const RandomModelSpec& spec, int layer);

// Builds config.json and random weights: matrices N(0, 1/fan_in), embeddings N(0, 1),
// zero-centred norm weights N(0, 0.2²), the gated norm 1 + N(0, 0.2²), A_log = log U(1, 16),
// dt_bias 1 + N(0, 0.2²); for Qwen3.5 also a few vision-tower and multi-token-prediction tensors
// (drawn last, so the text weights of a spec do not depend on them). Deterministic for a given
// seed on every platform.
RandomCheckpoint make_random_checkpoint(const RandomModelSpec& spec, uint64_t seed);

// n token ids in [0, vocab) from a xorshift64 stream: the same for a seed on every platform.
std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed);

// Writes dir/config.json and dir/model.safetensors; throws std::runtime_error on failure.
void write_checkpoint(const std::string& dir, const RandomCheckpoint& checkpoint);

// The tensors of one .safetensors file (F32, BF16, F16, I64, I32 decoded exactly to doubles), or
// of every *.safetensors file in a directory; read without recur's io code, for the oracle.
// Throws std::runtime_error on a malformed file.
TensorMap read_safetensors(const std::string& file);
TensorMap read_checkpoint_tensors(const std::string& dir);

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
