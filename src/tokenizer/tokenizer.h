// Byte-level BPE tokenizer that reproduces Hugging Face `tokenizers` for the models it loads
// (Qwen3 and other GPT-2-style tokenizer.json files) and tiktoken for tiktoken.model
// vocabularies (Kimi's): encode with add_special_tokens=false, and decode, including
// incremental decoding for streaming output.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace recur {

struct TokenizerOptions {
  // Cache piece -> ids; results are identical either way (off only to measure cold speed).
  bool word_cache = true;
};

// Immutable once loaded: copies share the same tables, and every const method may be called
// from many threads at once.
class Tokenizer {
 public:
  // Reads model_dir/tokenizer.json, or else model_dir/tiktoken.model with the added tokens and
  // pre-tokenizer pattern of model_dir/tokenizer_config.json (from_tiktoken). Unsupported
  // component types give kUnsupported.
  static Result<Tokenizer> load(const std::string& model_dir);
  static Result<Tokenizer> load(const std::string& model_dir, const TokenizerOptions& options);
  // The same from the text of a tokenizer.json; `origin` names it in errors.
  static Result<Tokenizer> from_json_text(std::string_view json_text, const std::string& origin,
                                          const TokenizerOptions& options = {});
  // A tiktoken vocabulary: the text of tiktoken.model ("BASE64 RANK" lines; ranks are ids) and
  // of tokenizer_config.json: its added_tokens_decoder, and "pat_str", the pre-tokenizer
  // pattern in tiktoken's Rust regex syntax (else that of the tokenizer class it names, e.g.
  // Kimi's TikTokenTokenizer). Encoding is tiktoken's: added tokens, then per pattern match the
  // token the match is, or byte-pair merges by rank. `origin` (the directory) names errors.
  static Result<Tokenizer> from_tiktoken(std::string_view ranks_text, std::string_view config_text,
                                         const std::string& origin,
                                         const TokenizerOptions& options = {});
  // Whether model_dir has a tokenizer load() reads.
  static bool found_in(const std::string& model_dir);

  // add_special_tokens=false semantics: no BOS/EOS or template, but added tokens written in the
  // text (<|im_start|>, <think>) become their ids. Invalid UTF-8 gives kInvalidArgument.
  Result<std::vector<int32_t>> encode(std::string_view text) const;
  // The same, except that a special token (special: true in tokenizer.json, <|im_start|>)
  // whose match overlaps one of `literal` (sorted, disjoint byte ranges [first, second)) stays
  // the text it spells, as split_special_tokens=True makes it in Hugging Face: for the text of
  // a chat request inside a rendered prompt (RenderedPrompt::literal). Other added tokens
  // (<think>) still match. Outside the ranges the ids are those of encode(text).
  Result<std::vector<int32_t>> encode(std::string_view text,
                                      std::span<const std::pair<size_t, size_t>> literal) const;
  // Unknown ids are skipped; invalid UTF-8 in the bytes becomes U+FFFD.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // One more than the largest id, added tokens included.
  int vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The vocabulary string (ByteLevel-mapped for model tokens); empty for an unknown id.
  std::string_view id_to_token(int32_t id) const;
  // The bytes the id decodes to (possibly a partial UTF-8 character); empty for an unknown id.
  std::string_view id_to_bytes(int32_t id) const;
  bool is_special(int32_t id) const;
  // The most bytes of text one token stands for (its bytes, or an added token's content): a
  // text of N bytes encodes to at least N / max_token_bytes() tokens, as long as every byte of
  // it ends up in a token (true of the byte-level tokenizers, which drop and shorten nothing).
  size_t max_token_bytes() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  // Fills the per-id tables of a freshly built tokenizer.
  static Status index_ids(Impl& im, const std::string& origin);
  std::shared_ptr<const Impl> impl_;
};

// Feeds one id at a time; never emits a partial UTF-8 character; all that push() and flush()
// append equals tokenizer.decode(all ids). They append to the caller's buffer, so a stream
// whose buffer has grown allocates nothing per token.
class StreamingDetokenizer {
 public:
  // Shares `tok`'s tables (a cheap copy), so it may outlive `tok`.
  explicit StreamingDetokenizer(const Tokenizer& tok, bool skip_special_tokens = false);
  void push(int32_t id, std::string* out);
  // Appends whatever is still held back (an unfinished character becomes U+FFFD); then starts
  // afresh.
  void flush(std::string* out);

 private:
  Tokenizer tok_;
  bool skip_special_;
  std::string pending_;  // bytes of an unfinished UTF-8 character
};

}  // namespace recur
