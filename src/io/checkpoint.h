// A Hugging Face model directory: config.json, generation_config.json and the weights in
// model.safetensors or in shards listed by model.safetensors.index.json. Weights stay mapped.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace recur {

class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& config() const { return config_; }
  // Empty object when the directory has no generation_config.json.
  const nlohmann::json& generation_config() const { return generation_config_; }

  bool has(const std::string& name) const { return where_.count(name) != 0; }
  // The named tensor, checked against the expected shape; errors name the file and tensor.
  // Weights are F32, BF16 or F16, and F8_E4M3 too when allow_fp8 (block-FP8 checkpoints).
  Result<Tensor> get(const std::string& name, const std::vector<int64_t>& shape,
                     bool allow_fp8 = false);
  // Tensors never fetched by get(), except those under an ignored prefix (e.g. "mtp.").
  std::vector<std::string> unused(const std::vector<std::string>& ignored_prefixes) const;
  // Drops the pages of a view get() gave (or a slice of one) from this process's resident
  // memory, once a backend holds its own copy; the view stays readable (MappedFile::release).
  void release(const Tensor& view) const;
  // The checkpoint's identity: a hash of config.json and of every weight file's fingerprint
  // (what the prefix cache's files are kept for).
  uint64_t fingerprint() const;

 private:
  std::string dir_;
  nlohmann::json config_;
  nlohmann::json generation_config_ = nlohmann::json::object();
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index in files_
  std::set<std::string> used_;
};

// Parses a JSON file; errors name the file and the position of a syntax error.
Result<nlohmann::json> read_json_file(const std::string& path);

}  // namespace recur
