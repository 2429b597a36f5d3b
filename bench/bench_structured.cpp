// Structured outputs: the time to mask a step's logits against a JSON schema
// (server/json_constraint.h) at Qwen's vocabulary; the description in main() is what --help
// prints.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "server/json_constraint.h"

using namespace recur;
using namespace recur::server;

int main(int argc, char** argv) {
  std::string dir = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";
  CLI::App app{
      "Structured outputs: the time to mask a step's logits against a JSON schema at Qwen's\n"
      "vocabulary, in ten states that cover the matcher's paths: between values, inside keys and\n"
      "strings (free and length-limited), in numbers and enums; with the tokens each mask keeps.\n"
      "One thread; the median of 21 masks per state."};
  app.option_defaults()->always_capture_default();
  app.add_option("model_dir", dir, "model directory holding the tokenizer");
  CLI11_PARSE(app, argc, argv);
  auto tok = Tokenizer::load(dir);
  if (!tok.ok()) {
    fmt::print(stderr, "{}\n", tok.error().to_string());
    return 1;
  }
  const auto vocab = VocabularyBytes::build(*tok);
  const int V = tok->vocab_size();
  const char* object = R"({"type": "object"})";
  const char* records = R"({"type": "array", "items": {"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 30}, "value": {"type": "number"}},
      "required": ["name", "value"], "additionalProperties": false}})";
  struct Case {
    const char* what;
    const char* schema;
    const char* prefix;
  } cases[] = {
      {"before the value", object, ""},
      {"after '{'", object, "{"},
      {"in a free key", object, "{\"ke"},
      {"before a value of any type", object, "{\"key\": "},
      {"in a free string", object, "{\"key\": \"val"},
      {"in a number", object, "{\"key\": 12"},
      {"in a closed key", records, "[{\"na"},
      {"in a string of at most 30", records, "[{\"name\": \"ab"},
      {"after ',' in a closed object", records, "[{\"name\": \"ab\", "},
      {"in an enum", R"({"enum": ["alpha", "beta", "gamma"]})", "\"al"},
  };
  fmt::print("mask of {} tokens (Qwen's vocabulary from {}), one thread, median of 21\n", V, dir);
  fmt::print("{:>9}  {:>8}  state\n", "ms", "kept");
  std::vector<float> logits(static_cast<size_t>(V));
  for (const Case& c : cases) {
    auto schema = compile_json_schema(ojson::parse(c.schema), "bench");
    if (!schema.ok()) return 1;
    auto con = json_constraint(*schema, vocab, {*tok->token_to_id("<|im_end|>")}, "")->start();
    const std::vector<int32_t> ids = tok->encode(c.prefix).value();
    for (int32_t id : ids) con->accept(id);
    std::vector<double> ms;
    int kept = 0;
    for (int r = 0; r < 21; ++r) {
      std::fill(logits.begin(), logits.end(), 0.0f);
      const auto t0 = std::chrono::steady_clock::now();
      con->mask(logits);
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      kept = int(std::count(logits.begin(), logits.end(), 0.0f));
    }
    std::nth_element(ms.begin(), ms.begin() + 10, ms.end());
    fmt::print("{:9.3f}  {:8}  {} ({})\n", ms[10], kept, c.what, c.prefix);
  }
  return 0;
}
