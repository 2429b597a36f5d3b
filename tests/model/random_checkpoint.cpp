#include "model/random_checkpoint.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace recur_test {

namespace {

// splitmix64 and Box-Muller rather than <random>'s distributions, whose output differs between
// standard libraries: a failure seen on one machine must reproduce on another.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (double(next() >> 11) + 0.5) / 9007199254740992.0; }  // (0, 1)
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = uniform(), u2 = uniform();
    double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2 * M_PI * u2);
    has_spare_ = true;
    return r * std::cos(2 * M_PI * u2);
  }

 private:
  uint64_t s_;
  bool has_spare_ = false;
  double spare_ = 0;
};

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Encodes a value that the dtype holds exactly (the output of round_to_store).
void encode(StoreType t, double v, std::string* out) {
  if (t == StoreType::kF32) {
    float f = float(v);
    out->append(reinterpret_cast<const char*>(&f), 4);
    return;
  }
  uint16_t h = 0;
  if (t == StoreType::kBF16) {
    float f = float(v);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    h = uint16_t(bits >> 16);  // exact: the low 16 bits are zero after rounding
  } else {
    uint16_t sign = std::signbit(v) ? 0x8000 : 0;
    double a = std::fabs(v);
    if (a == 0) {
      h = sign;
    } else if (a < std::ldexp(1.0, -14)) {  // subnormal: a = m · 2^-24
      h = uint16_t(sign | uint16_t(a / std::ldexp(1.0, -24)));
    } else {
      int e = std::ilogb(a);
      uint16_t mant = uint16_t(a / std::ldexp(1.0, e - 10) - 1024);
      h = uint16_t(sign | uint16_t((e + 15) << 10) | mant);
    }
  }
  out->append(reinterpret_cast<const char*>(&h), 2);
}

const char* torch_dtype_name(StoreType t) {
  switch (t) {
    case StoreType::kF32:
      return "float32";
    case StoreType::kBF16:
      return "bfloat16";
    case StoreType::kF16:
      return "float16";
  }
  return "?";
}

nlohmann::json make_config(const RandomModelSpec& s) {
  nlohmann::json c;
  c["architectures"] = {"Qwen3NextForCausalLM"};
  c["model_type"] = "qwen3_next";
  c["hidden_act"] = "silu";
  c["hidden_size"] = s.hidden;
  c["num_hidden_layers"] = s.layers;
  c["vocab_size"] = s.vocab;
  c["rms_norm_eps"] = s.rms_norm_eps;
  c["tie_word_embeddings"] = s.tie_word_embeddings;
  c["max_position_embeddings"] = 4096;
  c["torch_dtype"] = torch_dtype_name(s.dtype);
  c["eos_token_id"] = s.vocab - 1;
  c["num_attention_heads"] = s.heads;
  c["num_key_value_heads"] = s.kv_heads;
  c["head_dim"] = s.head_dim;
  if (s.rope_parameters_style) {
    c["rope_parameters"] = {{"rope_type", "default"},
                            {"rope_theta", s.rope_theta},
                            {"partial_rotary_factor", s.partial_rotary_factor}};
  } else {
    c["rope_theta"] = s.rope_theta;
    c["partial_rotary_factor"] = s.partial_rotary_factor;
  }
  if (!s.layer_types.empty()) {
    c["layer_types"] = s.layer_types;
  } else {
    c["full_attention_interval"] = s.full_attention_interval;
  }
  c["linear_num_key_heads"] = s.linear_key_heads;
  c["linear_num_value_heads"] = s.linear_value_heads;
  c["linear_key_head_dim"] = s.linear_key_dim;
  c["linear_value_head_dim"] = s.linear_value_dim;
  c["linear_conv_kernel_dim"] = s.conv_kernel;
  c["intermediate_size"] = s.intermediate;
  c["num_experts"] = s.experts;
  c["num_experts_per_tok"] = s.experts_per_tok;
  c["moe_intermediate_size"] = s.moe_intermediate;
  c["shared_expert_intermediate_size"] = s.shared_intermediate;
  c["norm_topk_prob"] = s.norm_topk_prob;
  c["decoder_sparse_step"] = s.decoder_sparse_step;
  c["mlp_only_layers"] = s.mlp_only_layers;
  return c;
}

}  // namespace

const char* store_type_name(StoreType t) {
  switch (t) {
    case StoreType::kF32:
      return "F32";
    case StoreType::kBF16:
      return "BF16";
    case StoreType::kF16:
      return "F16";
  }
  return "?";
}

double round_to_store(StoreType t, double x) {
  // Weights are drawn in f32 first, as a torch model initialised in f32 and then cast would be.
  const double f = double(float(x));
  if (t == StoreType::kF32 || f == 0) return f;
  const int mant_bits = t == StoreType::kBF16 ? 7 : 10;
  int e = std::ilogb(f);
  if (t == StoreType::kF16 && e < -14) e = -14;  // subnormals share the smallest exponent
  const double quantum = std::ldexp(1.0, e - mant_bits);
  const double r = std::nearbyint(f / quantum) * quantum;  // ties to even (default rounding)
  if (t == StoreType::kF16 && std::fabs(r) > 65504) {
    throw std::runtime_error("random weight out of F16 range");
  }
  return r;
}

RandomCheckpoint make_random_checkpoint(const RandomModelSpec& s, uint64_t seed) {
  RandomCheckpoint ck;
  ck.config = make_config(s);
  Rng rng(seed);

  auto add = [&](const std::string& name, std::vector<int64_t> shape, double mean, double sd,
                 StoreType type) {
    StoredTensor t;
    t.shape = std::move(shape);
    t.type = type;
    t.values.resize(size_t(numel(t.shape)));
    for (double& v : t.values) v = round_to_store(type, mean + sd * rng.normal());
    ck.tensors[name] = std::move(t);
  };
  const StoreType dt = s.dtype;
  // Matrices [out, in] with variance 1/fan_in keep activations O(1) through every layer.
  auto matrix = [&](const std::string& name, int64_t out, int64_t in) {
    add(name, {out, in}, 0.0, 1.0 / std::sqrt(double(in)), dt);
  };
  auto norm = [&](const std::string& name, int64_t n) { add(name, {n}, 0.0, 0.2, dt); };

  const int D = s.hidden;
  add("model.embed_tokens.weight", {s.vocab, D}, 0.0, 1.0, dt);
  if (!s.tie_word_embeddings) matrix("lm_head.weight", s.vocab, D);
  norm("model.norm.weight", D);

  for (int i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    norm(p + "input_layernorm.weight", D);
    norm(p + "post_attention_layernorm.weight", D);
    const bool full = s.layer_types.empty() ? (i + 1) % s.full_attention_interval == 0
                                            : s.layer_types[size_t(i)] == "full_attention";
    if (full) {
      const int hd = s.head_dim;
      matrix(p + "self_attn.q_proj.weight", int64_t(s.heads) * 2 * hd, D);
      matrix(p + "self_attn.k_proj.weight", int64_t(s.kv_heads) * hd, D);
      matrix(p + "self_attn.v_proj.weight", int64_t(s.kv_heads) * hd, D);
      matrix(p + "self_attn.o_proj.weight", D, int64_t(s.heads) * hd);
      norm(p + "self_attn.q_norm.weight", hd);
      norm(p + "self_attn.k_norm.weight", hd);
    } else {
      const int hk = s.linear_key_heads, hv = s.linear_value_heads;
      const int dk = s.linear_key_dim, dv = s.linear_value_dim, r = hv / hk;
      const int conv_dim = 2 * hk * dk + hv * dv;
      matrix(p + "linear_attn.in_proj_qkvz.weight", int64_t(hk) * (2 * dk + 2 * r * dv), D);
      matrix(p + "linear_attn.in_proj_ba.weight", int64_t(hk) * 2 * r, D);
      add(p + "linear_attn.conv1d.weight", {conv_dim, 1, s.conv_kernel}, 0.0,
          1.0 / std::sqrt(double(s.conv_kernel)), dt);
      const StoreType gt = s.gate_params_f32 ? StoreType::kF32 : dt;
      add(p + "linear_attn.dt_bias", {hv}, 1.0, 0.2, gt);
      StoredTensor a_log{{hv}, gt, {}};
      for (int h = 0; h < hv; ++h) {
        a_log.values.push_back(round_to_store(gt, std::log(1.0 + 15.0 * rng.uniform())));
      }
      ck.tensors[p + "linear_attn.A_log"] = std::move(a_log);
      add(p + "linear_attn.norm.weight", {dv}, 1.0, 0.2, dt);
      matrix(p + "linear_attn.out_proj.weight", D, int64_t(hv) * dv);
    }
    const bool mlp_only =
        std::find(s.mlp_only_layers.begin(), s.mlp_only_layers.end(), i) != s.mlp_only_layers.end();
    if (!mlp_only && s.experts > 0 && (i + 1) % s.decoder_sparse_step == 0) {
      matrix(p + "mlp.gate.weight", s.experts, D);
      for (int e = 0; e < s.experts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        matrix(x + "gate_proj.weight", s.moe_intermediate, D);
        matrix(x + "up_proj.weight", s.moe_intermediate, D);
        matrix(x + "down_proj.weight", D, s.moe_intermediate);
      }
      matrix(p + "mlp.shared_expert.gate_proj.weight", s.shared_intermediate, D);
      matrix(p + "mlp.shared_expert.up_proj.weight", s.shared_intermediate, D);
      matrix(p + "mlp.shared_expert.down_proj.weight", D, s.shared_intermediate);
      matrix(p + "mlp.shared_expert_gate.weight", 1, D);
    } else {
      matrix(p + "mlp.gate_proj.weight", s.intermediate, D);
      matrix(p + "mlp.up_proj.weight", s.intermediate, D);
      matrix(p + "mlp.down_proj.weight", D, s.intermediate);
    }
  }
  return ck;
}

void write_checkpoint(const std::string& dir, const RandomCheckpoint& ck) {
  {
    std::ofstream f(dir + "/config.json");
    f << ck.config.dump(2) << "\n";
    if (!f) throw std::runtime_error("cannot write " + dir + "/config.json");
  }
  std::string data;
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}};
  for (const auto& [name, t] : ck.tensors) {
    if (int64_t(t.values.size()) != numel(t.shape)) {
      throw std::runtime_error("tensor " + name + " has the wrong number of values");
    }
    const size_t begin = data.size();
    for (double v : t.values) encode(t.type, v, &data);
    header[name] = {{"dtype", store_type_name(t.type)},
                    {"shape", t.shape},
                    {"data_offsets", {begin, data.size()}}};
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keep the data 8-byte aligned, as torch writes it
  const uint64_t n = h.size();
  std::ofstream f(dir + "/model.safetensors", std::ios::binary);
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(h.data(), std::streamsize(h.size()));
  f.write(data.data(), std::streamsize(data.size()));
  if (!f) throw std::runtime_error("cannot write " + dir + "/model.safetensors");
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "recur-test-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace recur_test
