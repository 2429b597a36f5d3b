// Set-up shared by the request parsing tests: a model directory's tokenizer and chat template,
// loaded once per program, and the ServingContext of the tiny models (Qwen's real vocabulary)
// that requests are parsed against.
#pragma once

#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "server/request.h"

namespace recur::server {

// The shipped tiny model with the real Qwen vocabulary and chat template.
inline const std::string kRealVocabModel =
    std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";

struct ChatFixture {
  Tokenizer tok;
  ChatTemplate tmpl;
  std::shared_ptr<const VocabularyBytes> vocab;  // for structured outputs
};

// The tokenizer and chat template of model_dir, loaded on first use and kept for the program.
// Aborts when they do not load: every test of the program depends on the repository's data.
inline const ChatFixture& chat_fixture(const std::string& model_dir) {
  static std::map<std::string, std::unique_ptr<const ChatFixture>> loaded;
  std::unique_ptr<const ChatFixture>& f = loaded[model_dir];
  if (!f) {
    auto tok = Tokenizer::load(model_dir);
    auto tmpl = ChatTemplate::load(model_dir);
    if (!tok.ok() || !tmpl.ok()) std::abort();
    auto vocab = VocabularyBytes::build(*tok);
    f = std::make_unique<const ChatFixture>(
        ChatFixture{std::move(*tok), std::move(*tmpl), std::move(vocab)});
  }
  return *f;
}

// A context for the tiny models: named "tiny", Qwen's vocabulary and end-of-turn ids, and f's
// tokenizer and chat template.
inline ServingContext tiny_context(const ChatFixture& f, int max_context = 4096) {
  ServingContext c;
  c.model_name = "tiny";
  c.vocab_size = 151936;
  c.max_context = max_context;
  c.eos_token_ids = {151645, 151643};
  c.tokenizer = &f.tok;
  c.chat_template = &f.tmpl;
  c.vocab_bytes = f.vocab;
  return c;
}

inline ojson J(const char* s) {
  return ojson::parse(s);
}

}  // namespace recur::server
