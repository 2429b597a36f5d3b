#include "io/checkpoint.h"

#include <filesystem>

#include "io/json_text.h"
#include "io/mapped_file.h"

namespace recur {

namespace fs = std::filesystem;
using json = nlohmann::json;

Result<json> read_json_file(const std::string& path) {
  RECUR_ASSIGN_OR_RETURN(std::string text, read_text_file(path));
  return parse_json(text, path);
}

Result<Checkpoint> Checkpoint::open(const std::string& dir) {
  Checkpoint c;
  c.dir_ = dir;
  if (!fs::is_directory(dir)) {
    return make_error(ErrorCode::kNotFound, "model directory {} does not exist", dir);
  }
  RECUR_ASSIGN_OR_RETURN(c.config_, read_json_file((fs::path(dir) / "config.json").string()));
  if (!c.config_.is_object()) {
    return make_error(ErrorCode::kCorrupt, "{}/config.json is not a JSON object", dir);
  }
  fs::path gen = fs::path(dir) / "generation_config.json";
  if (fs::exists(gen)) {
    RECUR_ASSIGN_OR_RETURN(c.generation_config_, read_json_file(gen.string()));
    if (!c.generation_config_.is_object()) {
      return make_error(ErrorCode::kCorrupt, "{} is not a JSON object", gen.string());
    }
  }

  std::vector<std::string> shard_names;
  std::vector<std::pair<std::string, std::string>> index_entries;  // tensor, shard it names
  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    RECUR_ASSIGN_OR_RETURN(json idx, read_json_file(index.string()));
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object()) {
      return make_error(ErrorCode::kCorrupt, "{}: no weight_map object", index.string());
    }
    std::set<std::string> seen;
    for (auto& [name, file] : idx["weight_map"].items()) {
      if (!file.is_string()) {
        return make_error(ErrorCode::kCorrupt, "{}: weight_map['{}'] is not a file name",
                          index.string(), name);
      }
      std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f.find("..") != std::string::npos) {
        return make_error(ErrorCode::kCorrupt, "{}: shard name '{}' leaves the directory",
                          index.string(), f);
      }
      if (seen.insert(f).second) shard_names.push_back(f);
      index_entries.emplace_back(name, f);
    }
  } else if (fs::exists(fs::path(dir) / "model.safetensors")) {
    shard_names.push_back("model.safetensors");
  } else {
    return make_error(ErrorCode::kNotFound,
                      "{}: neither model.safetensors nor model.safetensors.index.json", dir);
  }
  for (const std::string& name : shard_names) {
    RECUR_ASSIGN_OR_RETURN(SafetensorsFile f,
                           SafetensorsFile::open((fs::path(dir) / name).string()));
    size_t file_index = c.files_.size();
    for (auto& [tname, e] : f.entries()) {
      auto [it, inserted] = c.where_.emplace(tname, file_index);
      if (!inserted) {
        return make_error(ErrorCode::kCorrupt, "tensor '{}' appears in both {} and {}", tname,
                          c.files_[it->second]->path(), f.path());
      }
    }
    c.files_.push_back(std::make_unique<SafetensorsFile>(std::move(f)));
  }
  // The index and the shards must agree: a mismatch means files of different downloads or
  // revisions were mixed, and a tensor would silently come from the wrong one.
  for (const auto& [tname, shard] : index_entries) {
    auto it = c.where_.find(tname);
    if (it == c.where_.end()) {
      return make_error(ErrorCode::kCorrupt, "{}: weight_map puts '{}' in {}, but no shard has it",
                        index.string(), tname, shard);
    }
    const std::string& actual = c.files_[it->second]->path();
    if (fs::path(actual).filename() != shard) {
      return make_error(ErrorCode::kCorrupt, "{}: weight_map puts '{}' in {}, but it is in {}",
                        index.string(), tname, shard, actual);
    }
  }
  return c;
}

Result<Tensor> Checkpoint::get(const std::string& name, const std::vector<int64_t>& shape,
                               bool allow_fp8) {
  auto it = where_.find(name);
  if (it == where_.end()) {
    return make_error(ErrorCode::kNotFound, "{}: missing tensor '{}'", dir_, name);
  }
  const SafetensorsFile& f = *files_[it->second];
  RECUR_ASSIGN_OR_RETURN(Tensor t, f.tensor(name));
  bool same = t.ndim == int(shape.size());
  for (int i = 0; same && i < t.ndim; ++i) same = t.shape[i] == shape[size_t(i)];
  if (!same) {
    std::string want = "[";
    for (size_t i = 0; i < shape.size(); ++i) want += fmt::format("{}{}", i ? ", " : "", shape[i]);
    want += "]";
    return make_error(ErrorCode::kCorrupt, "{}: tensor '{}' has shape {}, expected {}", f.path(),
                      name, t.shape_string(), want);
  }
  if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16 &&
      !(allow_fp8 && t.dtype == DType::F8_E4M3)) {
    return make_error(
        ErrorCode::kUnsupported, "{}: tensor '{}' has dtype {}; weights must be F32, BF16 or F16{}",
        f.path(), name, dtype_name(t.dtype), allow_fp8 ? " (or F8_E4M3 as matmul weights)" : "");
  }
  used_.insert(name);
  return t;
}

std::vector<std::string> Checkpoint::unused(const std::vector<std::string>& ignored) const {
  std::vector<std::string> out;
  for (auto& [name, idx] : where_) {
    if (used_.count(name)) continue;
    bool skip = false;
    for (auto& p : ignored) skip = skip || name.rfind(p, 0) == 0;
    if (!skip) out.push_back(name);
  }
  return out;
}

uint64_t Checkpoint::fingerprint() const {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (char c : config_.dump()) h = (h ^ uint8_t(c)) * 0x100000001b3ull;
  for (const auto& f : files_) h = (h ^ f->fingerprint()) * 0x100000001b3ull;
  return h;
}

void Checkpoint::release(const Tensor& view) const {
  for (const auto& f : files_) {
    if (f->file().contains(view.data)) {
      f->file().release(view.data, weight_bytes(view.dtype, view.numel()));
      return;
    }
  }
}

}  // namespace recur
