// What a model directory holds, corrupted: safetensors headers alone; a config.json or a
// checkpoint header that no longer matches the other (as bytes, or as edits of the valid files:
// fields set to edge values, tensors with other shapes, types, ranges or names), loaded and run
// for one forward on the CPU; tiktoken vocabularies with their tokenizer_config.json. A load
// either fails with an error that says so, or gives a model whose forward runs.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "fuzz_targets.h"
#include "io/safetensors.h"
#include "json_edits.h"
#include "model/registry.h"
#include "tokenizer/tokenizer.h"

namespace recur::fuzz {

namespace {

namespace fs = std::filesystem;

// Tiny models of each architecture and layout (Qwen3-Next, block-FP8, Qwen3.5 dense and MoE in
// two shards, Kimi-Linear).
const char* kModels[] = {"qwen3next-tiny", "qwen3next-fp8-tiny", "qwen3_5-tiny", "qwen3_5-moe-tiny",
                         "kimi-linear-tiny"};
constexpr size_t kMaxCheckpointBytes = 8 << 20;

fs::path model_dir(int which) {
  return fs::path(RECUR_SOURCE_DIR) / "models" / kModels[which];
}

// A scratch model directory of this process, removed at exit.
struct ScratchDir {
  fs::path path = fs::temp_directory_path() / ("recur-fuzz-" + std::to_string(::getpid()));
  ScratchDir() { fs::create_directories(path); }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

const fs::path& scratch() {
  static const ScratchDir dir;
  return dir.path;
}

void write_file(const fs::path& path, std::span<const uint8_t> bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// Empties the scratch directory, then links the model's checkpoint files (shards and their
// index too) into it.
void link_checkpoint(int which) {
  const fs::path& d = scratch();
  for (const auto& e : fs::directory_iterator(d)) fs::remove(e.path());
  for (const auto& e : fs::directory_iterator(model_dir(which))) {
    const std::string name = e.path().filename().string();
    if (name.find(".safetensors") != std::string::npos) fs::create_symlink(e.path(), d / name);
  }
}

// Loads the scratch directory on the CPU and runs one forward of a short prompt.
void load_and_run() {
  static std::unique_ptr<Ops> ops = [] {
    auto o = create_backend("cpu", 1);
    if (!o.ok()) std::abort();
    return std::move(*o);
  }();
  LoadOptions options;
  options.max_batch_tokens = 8;
  options.state.n_slots = 1;
  options.state.n_blocks = 4;
  options.state.block_size = 8;
  options.max_context = 32;
  auto m = load_model(scratch().string(), *ops, options);
  if (!m.ok()) {
    FUZZ_CHECK(!m.error().message.empty());
    return;
  }
  Model& model = **m;
  const int vocab = model.info().vocab_size;
  FUZZ_CHECK(vocab > 0);
  auto buf = ops->allocator().allocate(size_t(vocab) * 4, "fuzz logits");
  if (!buf.ok()) return;
  Tensor logits = Tensor::contiguous(buf->data(), DType::F32, {1, vocab}, buf->device());
  const std::vector<int32_t> tokens = {0, 1 % vocab, 2 % vocab}, blocks = {0};
  Batch batch;
  model.reset_slot(0);
  batch.add_sequence(0, 0, tokens, blocks, Batch::Logits::kLast);
  (void)model.forward(batch, logits);
}

void fuzz_config(std::span<const uint8_t> config, int which) {
  link_checkpoint(which);
  write_file(scratch() / "config.json", config);
  load_and_run();
}

// Writes a safetensors file of this header and data into the scratch directory, with the
// model's config, and loads it.
void load_checkpoint_file(std::span<const uint8_t> header, std::span<const uint8_t> data,
                          int which) {
  std::vector<uint8_t> file(8 + header.size());
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) file[size_t(i)] = uint8_t(n >> (8 * i));
  std::copy(header.begin(), header.end(), file.begin() + 8);
  file.insert(file.end(), data.begin(), data.end());
  const fs::path& d = scratch();
  for (const auto& e : fs::directory_iterator(d)) fs::remove(e.path());
  write_file(d / "model.safetensors", file);
  fs::copy_file(model_dir(which) / "config.json", d / "config.json");
  load_and_run();
}

// The header, with zeros for data as far as its largest offset reaches.
void fuzz_header(std::span<const uint8_t> header, int which) {
  (void)SafetensorsFile::parse(header.data(), header.size(), "fuzz");
  const auto parsed = nlohmann::json::parse(header.begin(), header.end(), nullptr, false);
  size_t data_bytes = 0;
  if (parsed.is_object()) {
    for (const auto& [name, e] : parsed.items()) {
      const nlohmann::json* offsets =
          e.is_object() && e.contains("data_offsets") ? &e["data_offsets"] : nullptr;
      if (offsets && offsets->is_array() && offsets->size() == 2 && (*offsets)[1].is_number()) {
        const double end = (*offsets)[1].get<double>();
        if (end > 0) data_bytes = std::max(data_bytes, size_t(std::min(end, 1e12)));
      }
    }
  }
  if (data_bytes > kMaxCheckpointBytes) return;
  load_checkpoint_file(header, std::vector<uint8_t>(data_bytes, 0), which);
}

// Edits of valid files, for inputs that reach past the JSON parser: each 3 bytes of input
// pick a place (a config field, a tensor), what to do there and a value.
void fuzz_config_edits(std::span<const uint8_t> edits, int which) {
  static std::map<int, ojson> configs;  // read once
  if (!configs.count(which)) {
    std::ifstream f(model_dir(which) / "config.json");
    configs[which] = ojson::parse(f);
  }
  // Fields a config may have: added where they were not.
  static const char* kFields[] = {"num_hidden_layers",      "head_dim",    "num_key_value_heads",
                                  "linear_num_value_heads", "num_experts", "kv_lora_rank",
                                  "quantization_config",    "text_config", "rope_scaling"};
  ojson config = configs[which];
  apply_edits(config, edits, kFields);
  const std::string text = config.dump();
  fuzz_config(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()), which);
}

void fuzz_header_edits(std::span<const uint8_t> edits, int which) {
  if (!fs::exists(model_dir(which) / "model.safetensors")) return;  // sharded
  static std::map<int, std::vector<uint8_t>> files;                 // read once
  std::vector<uint8_t>& file = files[which];
  if (file.empty()) {
    std::ifstream f(model_dir(which) / "model.safetensors", std::ios::binary);
    file.assign(std::istreambuf_iterator<char>(f), {});
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(file[size_t(i)]) << (8 * i);
  ojson header = ojson::parse(file.begin() + 8, file.begin() + 8 + int64_t(n));
  std::vector<std::string> names;
  for (const auto& [name, e] : header.items()) {
    if (name != "__metadata__") names.push_back(name);
  }
  static const char* kDtypes[] = {"F32", "BF16", "F16", "F8_E4M3", "I32", "U8", "BOOL", "F64"};
  for (size_t i = 0; i + 3 <= edits.size(); i += 3) {
    const std::string& name = names[edits[i] % names.size()];
    const uint8_t v = edits[i + 2];
    if (!header.contains(name) || !header[name].is_object()) continue;
    ojson& e = header[name];
    if (!e["shape"].is_array() || e["shape"].empty()) e["shape"] = ojson::array({1});
    try {
      switch (edits[i + 1] % 8) {
        case 0:  // one dimension off
          e["shape"][v % e["shape"].size()] =
              e["shape"][v % e["shape"].size()].get<int64_t>() + (v & 0x80 ? -1 : 1) * (1 + v % 3);
          break;
        case 1:
          e["shape"].erase(e["shape"].size() - 1);
          break;
        case 2:
          e["shape"].push_back(1 + v % 4);
          break;
        case 3:
          e["dtype"] = kDtypes[v % std::size(kDtypes)];
          break;
        case 4:
          e["data_offsets"][v & 1] = e["data_offsets"][v & 1].get<int64_t>() + int8_t(v);
          break;
        case 5:
          std::swap(e, header[names[v % names.size()]]);
          break;  // two tensors' places
        case 6:
          header.erase(name);
          break;
        default:
          header[name + "_extra"] = e;
          break;
      }
    } catch (const ojson::exception&) {
    }
  }
  const std::string text = header.dump();
  load_checkpoint_file(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()),
                       std::span(file).subspan(8 + n), which);
}

void fuzz_tiktoken(std::span<const uint8_t> rest) {
  auto as_view = [](std::span<const uint8_t> s) {
    return std::string_view(reinterpret_cast<const char*>(s.data()), s.size());
  };
  const auto ranks = as_view(take_piece(&rest, 0));
  const auto config = as_view(take_piece(&rest, 0));
  auto tok = Tokenizer::from_tiktoken(ranks, config, "fuzz");
  if (!tok.ok()) {
    FUZZ_CHECK(!tok.error().message.empty());
    return;
  }
  auto ids = tok->encode(as_view(rest));
  if (ids.ok()) (void)tok->decode(*ids);
  std::vector<int32_t> all(size_t(std::min(tok->vocab_size(), 4096)));
  for (size_t i = 0; i < all.size(); ++i) all[i] = int32_t(i);
  (void)tok->decode(all);
}

}  // namespace

int fuzz_checkpoint(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t selector = data[0];
  const std::span<const uint8_t> rest(data + 1, size - 1);
  const int which = (selector >> 3) % int(std::size(kModels));
  switch (selector & 7) {
    case 0:
      (void)SafetensorsFile::parse(rest.data(), rest.size(), "fuzz");
      return 0;
    case 1:
      fuzz_config(rest, which);
      return 0;
    case 2:
      fuzz_header(rest, which);
      return 0;
    case 3:
      fuzz_tiktoken(rest);
      return 0;
    case 4:
    case 5:
      fuzz_config_edits(rest, which);
      return 0;
    default:
      fuzz_header_edits(rest, which);
      return 0;
  }
}

}  // namespace recur::fuzz
