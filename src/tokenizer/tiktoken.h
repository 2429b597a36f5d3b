// tiktoken-format vocabularies, as Kimi ships them: tiktoken.model holds one "BASE64 RANK" line
// per token (the rank is the id), tokenizer_config.json the added tokens, and the pre-tokenizer
// is a pattern in the Rust regex syntax tiktoken compiles, given by configuration.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pretokenizer.h"

namespace recur {

// The lines of a tiktoken.model file, in file order. Malformed lines (bad base64, a rank that
// is not a non-negative integer below 2^31, a repeated token or rank) are kCorrupt errors that
// name `origin` and the line.
Result<std::vector<RankedToken>> parse_tiktoken_ranks(std::string_view text,
                                                      std::string_view origin);

// Rewrites a pattern in the Rust regex syntax tiktoken compiles (fancy-regex) into PCRE2 syntax
// with the same meaning: \s, \d and \w are Rust's Unicode classes, a script name (\p{Han})
// means the Script property (PCRE2 alone would use Script_Extensions), class intersection
// [A&&B] becomes a lookahead, '.' excludes only \n, and ^ / $ anchor the whole text.
Result<std::string> translate_tiktoken_pattern(std::string_view pattern);

// Whether tokenizer_config.json names Kimi's tokenizer class (tokenization_kimi.TikTokenTokenizer
// in auto_map, or tokenizer_class TikTokenTokenizer).
bool names_kimi_tokenizer(const nlohmann::json& config);

// Kimi's tokenizer hands tiktoken its text in chunks: every `chars` characters, each cut again
// where a run of white space (Python's str.isspace) or of other characters would pass `run`
// characters. Zero: no such cut.
struct ChunkLimits {
  size_t chars = 0;
  size_t run = 0;
};
// Calls `fn` on each chunk of `text` (valid UTF-8), in order; empty chunks are skipped.
Status for_each_chunk(std::string_view text, const ChunkLimits& limits,
                      FunctionRef<Status(std::string_view)> fn);

// What tokenizer_config.json adds to the ranks.
struct TiktokenConfig {
  std::string pattern;          // Rust regex syntax
  nlohmann::json added_tokens;  // tokenizer.json's "added_tokens" form, for AddedVocabulary
  ChunkLimits chunks;           // the tokenizer class's
};

// The pre-tokenizer pattern is "pat_str" when the config has one, else that of the tokenizer
// class the config names (auto_map / tokenizer_class; Kimi's TikTokenTokenizer), else an error.
// Added tokens are the added_tokens_decoder entries, plus the special-token ids that the class
// reserves after the `base_tokens` ranks (Kimi names the unlisted ones <|reserved_token_ID|>).
Result<TiktokenConfig> read_tiktoken_config(const nlohmann::json& config, size_t base_tokens,
                                            std::string_view origin);

}  // namespace recur
