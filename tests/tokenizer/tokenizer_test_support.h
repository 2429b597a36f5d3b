// Shared by the tokenizer tests: the Qwen3 tokenizer (loaded once) and the golden cases.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace recur::testing_support {

inline std::string qwen_model_dir() {
  return std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";
}

inline const Tokenizer& qwen_tokenizer() {
  static const Tokenizer* tok = [] {
    Result<Tokenizer> r = Tokenizer::load(qwen_model_dir());
    if (!r.ok()) {
      std::fprintf(stderr, "cannot load tokenizer: %s\n", r.error().to_string().c_str());
      std::abort();
    }
    return new Tokenizer(std::move(r).value());
  }();
  return *tok;
}

struct GoldenCase {
  size_t line;
  std::string kind, text, decoded;
  std::vector<int32_t> ids;
};

inline const std::vector<GoldenCase>& golden_cases() {
  static const std::vector<GoldenCase> cases = [] {
    std::vector<GoldenCase> out;
    std::ifstream in(std::string(RECUR_SOURCE_DIR) + "/tests/data/tokenizer-qwen3/encode.jsonl");
    std::string line;
    size_t n = 0;
    while (std::getline(in, line)) {
      ++n;
      if (line.empty()) continue;
      auto j = nlohmann::json::parse(line);
      out.push_back({n, j["kind"].get<std::string>(), j["text"].get<std::string>(),
                     j["decoded"].get<std::string>(), j["ids"].get<std::vector<int32_t>>()});
    }
    return out;
  }();
  return cases;
}

}  // namespace recur::testing_support
