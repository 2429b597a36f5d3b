#include "model/random_checkpoint.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
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

bool is_qwen3_5(const RandomModelSpec& s) {
  return s.family != Family::kQwen3Next;
}

// The text model's fields, shared by every family and style.
nlohmann::json text_config(const RandomModelSpec& s) {
  nlohmann::json c;
  c["hidden_act"] = "silu";
  c["hidden_size"] = s.hidden;
  c["num_hidden_layers"] = s.layers;
  c["vocab_size"] = s.vocab;
  c["rms_norm_eps"] = s.rms_norm_eps;
  c["tie_word_embeddings"] = s.tie_word_embeddings;
  c["max_position_embeddings"] = 4096;
  c["eos_token_id"] = s.vocab - 1;
  c["num_attention_heads"] = s.heads;
  c["num_key_value_heads"] = s.kv_heads;
  c["head_dim"] = s.head_dim;
  if (is_qwen3_5(s)) {
    // As the releases write it: rope_parameters (with the multimodal sections) and the factor
    // repeated at the top.
    c["rope_parameters"] = {{"rope_type", "default"},
                            {"rope_theta", s.rope_theta},
                            {"partial_rotary_factor", s.partial_rotary_factor}};
    if (!s.mrope_section.empty()) {
      c["rope_parameters"]["mrope_section"] = s.mrope_section;
      c["rope_parameters"]["mrope_interleaved"] = true;
    }
    c["partial_rotary_factor"] = s.partial_rotary_factor;
  } else if (s.rope_parameters_style) {
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
  switch (s.family) {
    case Family::kQwen3Next:
      c["intermediate_size"] = s.intermediate;
      c["num_experts"] = s.experts;
      c["num_experts_per_tok"] = s.experts_per_tok;
      c["moe_intermediate_size"] = s.moe_intermediate;
      c["shared_expert_intermediate_size"] = s.shared_intermediate;
      c["norm_topk_prob"] = s.norm_topk_prob;
      c["decoder_sparse_step"] = s.decoder_sparse_step;
      c["mlp_only_layers"] = s.mlp_only_layers;
      break;
    case Family::kQwen3_5:
      c["intermediate_size"] = s.intermediate;
      break;
    case Family::kQwen3_5Moe:
      c["num_experts"] = s.experts;
      c["num_experts_per_tok"] = s.experts_per_tok;
      c["moe_intermediate_size"] = s.moe_intermediate;
      c["shared_expert_intermediate_size"] = s.shared_intermediate;
      c["router_aux_loss_coef"] = 0.001;
      // Qwen3-Next's fields mean nothing here: written only as strays to be ignored.
      if (!s.norm_topk_prob) c["norm_topk_prob"] = false;
      if (s.decoder_sparse_step != 1) c["decoder_sparse_step"] = s.decoder_sparse_step;
      if (!s.mlp_only_layers.empty()) c["mlp_only_layers"] = s.mlp_only_layers;
      break;
  }
  if (is_qwen3_5(s)) {
    c["mamba_ssm_dtype"] = "float32";
    c["mtp_num_hidden_layers"] = 1;
    c["attn_output_gate"] = true;
  }
  return c;
}

nlohmann::json make_config(const RandomModelSpec& s) {
  const bool moe = s.family == Family::kQwen3_5Moe;
  nlohmann::json text = text_config(s);
  if (s.family == Family::kQwen3Next) {
    text["architectures"] = {"Qwen3NextForCausalLM"};
    text["model_type"] = "qwen3_next";
    text["torch_dtype"] = torch_dtype_name(s.dtype);
    return text;
  }
  text["model_type"] = moe ? "qwen3_5_moe_text" : "qwen3_5_text";
  if (!s.nested) {
    text["architectures"] = {moe ? "Qwen3_5MoeForCausalLM" : "Qwen3_5ForCausalLM"};
    text["torch_dtype"] = torch_dtype_name(s.dtype);
    return text;
  }
  // The multimodal wrapper: its own model_type, the tie flag and dtype at the top, the vision
  // tower's config and the placeholder token ids as the releases have them.
  nlohmann::json c;
  c["architectures"] = {moe ? "Qwen3_5MoeForConditionalGeneration"
                            : "Qwen3_5ForConditionalGeneration"};
  c["model_type"] = moe ? "qwen3_5_moe" : "qwen3_5";
  text.erase("eos_token_id");
  text["eos_token_id"] = nullptr;
  c["text_config"] = text;
  c["tie_word_embeddings"] = s.tie_word_embeddings;
  c["torch_dtype"] = torch_dtype_name(s.dtype);
  c["eos_token_id"] = s.vocab - 1;
  c["image_token_id"] = 248056;
  c["video_token_id"] = 248057;
  c["vision_start_token_id"] = 248053;
  c["vision_end_token_id"] = 248054;
  c["vision_config"] = {{"model_type", moe ? "qwen3_5_moe_vision" : "qwen3_5_vision"},
                        {"depth", 1},
                        {"hidden_size", 8},
                        {"intermediate_size", 16},
                        {"num_heads", 2},
                        {"in_channels", 3},
                        {"patch_size", 4},
                        {"temporal_patch_size", 2},
                        {"spatial_merge_size", 2},
                        {"out_hidden_size", s.hidden}};
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

std::string text_prefix(const RandomModelSpec& s) {
  return is_qwen3_5(s) && s.nested ? "model.language_model." : "model.";
}

bool spec_layer_is_full_attention(const RandomModelSpec& s, int i) {
  return s.layer_types.empty() ? (i + 1) % s.full_attention_interval == 0
                               : s.layer_types[size_t(i)] == "full_attention";
}

bool spec_layer_is_moe(const RandomModelSpec& s, int i) {
  if (s.experts <= 0 || s.family == Family::kQwen3_5) return false;
  if (s.family == Family::kQwen3_5Moe) return true;
  const bool mlp_only =
      std::find(s.mlp_only_layers.begin(), s.mlp_only_layers.end(), i) != s.mlp_only_layers.end();
  return !mlp_only && (i + 1) % s.decoder_sparse_step == 0;
}

RandomCheckpoint make_random_checkpoint(const RandomModelSpec& s, uint64_t seed) {
  if (s.family == Family::kQwen3_5Moe && (s.experts <= 0 || s.shared_intermediate <= 0)) {
    throw std::runtime_error("a Qwen3.5-MoE spec needs experts and a shared expert");
  }
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
  auto swiglu = [&](const std::string& p, int64_t ff, int64_t d) {
    matrix(p + "gate_proj.weight", ff, d);
    matrix(p + "up_proj.weight", ff, d);
    matrix(p + "down_proj.weight", d, ff);
  };

  const int D = s.hidden;
  const std::string m = text_prefix(s);
  add(m + "embed_tokens.weight", {s.vocab, D}, 0.0, 1.0, dt);
  if (!s.tie_word_embeddings) matrix("lm_head.weight", s.vocab, D);
  norm(m + "norm.weight", D);

  for (int i = 0; i < s.layers; ++i) {
    const std::string p = m + "layers." + std::to_string(i) + ".";
    norm(p + "input_layernorm.weight", D);
    norm(p + "post_attention_layernorm.weight", D);
    if (spec_layer_is_full_attention(s, i)) {
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
      if (is_qwen3_5(s)) {
        matrix(p + "linear_attn.in_proj_qkv.weight", conv_dim, D);
        matrix(p + "linear_attn.in_proj_z.weight", int64_t(hv) * dv, D);
        matrix(p + "linear_attn.in_proj_b.weight", hv, D);
        matrix(p + "linear_attn.in_proj_a.weight", hv, D);
      } else {
        matrix(p + "linear_attn.in_proj_qkvz.weight", int64_t(hk) * (2 * dk + 2 * r * dv), D);
        matrix(p + "linear_attn.in_proj_ba.weight", int64_t(hk) * 2 * r, D);
      }
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
    if (spec_layer_is_moe(s, i)) {
      const int64_t E = s.experts, I = s.moe_intermediate;
      matrix(p + "mlp.gate.weight", E, D);
      if (s.family == Family::kQwen3_5Moe && s.fused_experts) {
        // Each expert's gate rows, then its up rows; down [E, H, I]; no .weight suffix.
        add(p + "mlp.experts.gate_up_proj", {E, 2 * I, D}, 0.0, 1.0 / std::sqrt(double(D)), dt);
        add(p + "mlp.experts.down_proj", {E, D, I}, 0.0, 1.0 / std::sqrt(double(I)), dt);
      } else {
        for (int e = 0; e < s.experts; ++e) {
          swiglu(p + "mlp.experts." + std::to_string(e) + ".", I, D);
        }
      }
      swiglu(p + "mlp.shared_expert.", s.shared_intermediate, D);
      matrix(p + "mlp.shared_expert_gate.weight", 1, D);
    } else {
      swiglu(p + "mlp.", s.intermediate, D);
    }
  }

  if (is_qwen3_5(s)) {
    // What a text engine skips: a sliver of the vision tower (nested only; 5-D patch weights
    // included) and of the multi-token-prediction head, in the same dtype as the rest.
    if (s.nested) {
      add("model.visual.patch_embed.proj.weight", {8, 3, 2, 4, 4}, 0.0, 0.1, dt);
      add("model.visual.blocks.0.attn.qkv.weight", {24, 8}, 0.0, 0.1, dt);
      add("model.visual.blocks.0.attn.qkv.bias", {24}, 0.0, 0.1, dt);
      add("model.visual.merger.linear_fc2.weight", {D, 32}, 0.0, 0.1, dt);
    }
    add("mtp.fc.weight", {D, 2 * D}, 0.0, 0.1, dt);
    add("mtp.norm.weight", {D}, 0.0, 0.1, dt);
    add("mtp.pre_fc_norm_hidden.weight", {D}, 0.0, 0.1, dt);
    add("mtp.layers.0.input_layernorm.weight", {D}, 0.0, 0.1, dt);
    if (s.family == Family::kQwen3_5Moe) {  // the releases keep the head's experts per expert
      add("mtp.layers.0.mlp.experts.0.gate_proj.weight", {s.moe_intermediate, D}, 0.0, 0.1, dt);
      add("mtp.layers.0.mlp.gate.weight", {s.experts, D}, 0.0, 0.1, dt);
    } else {
      add("mtp.layers.0.mlp.gate_proj.weight", {s.intermediate, D}, 0.0, 0.1, dt);
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

namespace {

double decode(const std::string& dtype, const unsigned char* p) {
  auto half_bits = [&] { return uint16_t(p[0] | (p[1] << 8)); };
  if (dtype == "F32") {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  if (dtype == "BF16") {
    const uint32_t bits = uint32_t(half_bits()) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  if (dtype == "F16") {
    const uint16_t h = half_bits();
    const int e = (h >> 10) & 31, m = h & 1023;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 31) return m ? NAN : sign * INFINITY;
    return sign * (e ? std::ldexp(1024.0 + m, e - 25) : std::ldexp(double(m), -24));
  }
  if (dtype == "I64") {
    int64_t v;
    std::memcpy(&v, p, 8);
    return double(v);
  }
  if (dtype == "I32") {
    int32_t v;
    std::memcpy(&v, p, 4);
    return double(v);
  }
  throw std::runtime_error("read_safetensors: dtype " + dtype + " is not supported");
}

size_t dtype_bytes(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  if (dtype == "I64") return 8;
  throw std::runtime_error("read_safetensors: dtype " + dtype + " is not supported");
}

}  // namespace

TensorMap read_safetensors(const std::string& file) {
  std::ifstream f(file, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + file);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  if (bytes.size() < 8) throw std::runtime_error(file + ": too short");
  std::memcpy(&n, bytes.data(), 8);
  if (n > bytes.size() - 8) throw std::runtime_error(file + ": header runs past the end");
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data() + 8 + n);
  const uint64_t data_size = bytes.size() - 8 - n;
  TensorMap out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string dtype = info.at("dtype").get<std::string>();
    StoredTensor t;
    t.shape = info.at("shape").get<std::vector<int64_t>>();
    t.type = dtype == "BF16"  ? StoreType::kBF16
             : dtype == "F16" ? StoreType::kF16
                              : StoreType::kF32;
    const uint64_t begin = info.at("data_offsets")[0].get<uint64_t>();
    const uint64_t end = info.at("data_offsets")[1].get<uint64_t>();
    const size_t es = dtype_bytes(dtype);
    if (begin > end || end > data_size || (end - begin) != uint64_t(numel(t.shape)) * es) {
      throw std::runtime_error(file + ": bad data_offsets for " + name);
    }
    t.values.resize(size_t(numel(t.shape)));
    for (size_t i = 0; i < t.values.size(); ++i) t.values[i] = decode(dtype, data + begin + i * es);
    out[name] = std::move(t);
  }
  return out;
}

TensorMap read_checkpoint_tensors(const std::string& dir) {
  TensorMap all;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    for (auto& [name, t] : read_safetensors(entry.path().string())) {
      if (!all.emplace(name, std::move(t)).second) {
        throw std::runtime_error(dir + ": tensor " + name + " is in two files");
      }
    }
  }
  return all;
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

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  std::vector<int32_t> t;
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int i = 0; i < n; ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;  // xorshift64
    t.push_back(int32_t(s % uint64_t(vocab)));
  }
  return t;
}

}  // namespace recur_test
