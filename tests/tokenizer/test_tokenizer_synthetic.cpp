// A small hand-made tokenizer.json exercising what Qwen's file does not: added-token flags
// (lstrip, rstrip, single_word, normalized), merge ranks, Split behaviours, and errors for
// component types the tokenizer does not support.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8_util.h"

namespace recur {
namespace {

using json = nlohmann::json;

std::string byte_token(uint8_t b) {
  std::string s;
  append_utf8(s, byte_to_unicode(b));
  return s;
}

json added(int id, const std::string& content, bool special, bool normalized, bool lstrip = false,
           bool rstrip = false, bool single_word = false) {
  return {{"id", id},
          {"content", content},
          {"special", special},
          {"normalized", normalized},
          {"lstrip", lstrip},
          {"rstrip", rstrip},
          {"single_word", single_word}};
}

// Vocabulary: byte b has id b; merges are listed in rank order.
json tiny_json() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_token(static_cast<uint8_t>(b))] = b;
  vocab["ab"] = 256;
  vocab["bc"] = 257;
  vocab["abab"] = 258;
  vocab["a-"] = 259;
  vocab["-b"] = 260;
  vocab["--"] = 261;
  json merges =
      json::array({json::array({"b", "c"}), json::array({"a", "b"}), json::array({"ab", "ab"}),
                   json::array({"a", "-"}), json::array({"-", "b"}), json::array({"-", "-"})});
  json added_tokens = json::array({
      added(300, "[L]", true, false, /*lstrip=*/true),
      added(301, "[R]", true, false, false, /*rstrip=*/true),
      added(302, "tok", false, true, false, false, /*single_word=*/true),
      added(303, "e\u0301", false, /*normalized=*/true),  // matched after NFC, as "é"
      added(304, "a b", false, false),
      added(305, "[L]x", true, false),
  });
  return {
      {"version", "1.0"},
      {"added_tokens", added_tokens},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"unk_token", nullptr}}}};
}

Tokenizer make(const json& j) {
  Result<Tokenizer> r = Tokenizer::from_json_text(j.dump(), "tiny");
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  if (!r.ok()) std::abort();
  return std::move(r).value();
}

std::vector<int32_t> enc(const Tokenizer& t, std::string_view text) {
  Result<std::vector<int32_t>> r = t.encode(text);
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  return r.ok() ? *r : std::vector<int32_t>{};
}

using Ids = std::vector<int32_t>;

TEST(TokenizerSynthetic, MergeRanks) {
  Tokenizer t = make(tiny_json());
  EXPECT_EQ(enc(t, "abc"), (Ids{'a', 257}));  // (b,c) outranks (a,b)
  EXPECT_EQ(enc(t, "abab"), (Ids{258}));
  EXPECT_EQ(enc(t, "ababab"), (Ids{258, 256}));  // leftmost pair first among equal ranks
  EXPECT_EQ(t.vocab_size(), 306);
}

TEST(TokenizerSynthetic, LegacyStringMerges) {
  json j = tiny_json();
  json merges = json::array();
  for (const json& m : j["model"]["merges"]) {
    merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
  }
  j["model"]["merges"] = merges;
  Tokenizer t = make(j);
  EXPECT_EQ(enc(t, "abc ababab"), (Ids{'a', 257, ' ', 258, 256}));
}

TEST(TokenizerSynthetic, LstripRstrip) {
  Tokenizer t = make(tiny_json());
  EXPECT_EQ(enc(t, "x  [L]y"), (Ids{'x', 300, 'y'}));
  EXPECT_EQ(enc(t, "x[R] \t y"), (Ids{'x', 301, 'y'}));
  EXPECT_EQ(enc(t, "[L][L]"), (Ids{300, 300}));
  EXPECT_EQ(enc(t, "x\u3000[L]"), (Ids{'x', 300}));  // Unicode white space is stripped too
  // The stripped spaces belong to the token: decoding gives the token only.
  EXPECT_EQ(t.decode(enc(t, "x  [L]y")), "x[L]y");
}

TEST(TokenizerSynthetic, SingleWord) {
  Tokenizer t = make(tiny_json());
  EXPECT_EQ(enc(t, "tok"), (Ids{302}));
  EXPECT_EQ(enc(t, "a tok b"), (Ids{'a', ' ', 302, ' ', 'b'}));
  EXPECT_EQ(enc(t, "atok b"), (Ids{'a', 't', 'o', 'k', ' ', 'b'}));
  EXPECT_EQ(enc(t, "tok_"), (Ids{'t', 'o', 'k', '_'}));
  EXPECT_EQ(enc(t, "tok."), (Ids{302, '.'}));
}

TEST(TokenizerSynthetic, NormalizedTokensMatchAfterNormalization) {
  Tokenizer t = make(tiny_json());
  EXPECT_EQ(enc(t, "\u00e9"), (Ids{303}));
  EXPECT_EQ(enc(t, "e\u0301"), (Ids{303}));
  EXPECT_FALSE(t.is_special(303));
  EXPECT_TRUE(t.is_special(300));
}

TEST(TokenizerSynthetic, LongestMatchAndTokensOutsideTheByteAlphabet) {
  Tokenizer t = make(tiny_json());
  EXPECT_EQ(enc(t, "[L]x"), (Ids{305}));
  EXPECT_EQ(enc(t, "xa by"), (Ids{'x', 304, 'y'}));
  // " " is not in the ByteLevel alphabet, so the token decodes to its text as written.
  EXPECT_EQ(t.decode(Ids{304}), "a b");
  EXPECT_EQ(t.decode(Ids{300, 'q', 305}, /*skip_special_tokens=*/true), "q");
}

TEST(TokenizerSynthetic, AddPrefixSpace) {
  json j = tiny_json();
  j["pre_tokenizer"]["add_prefix_space"] = true;
  Tokenizer t = make(j);
  EXPECT_EQ(enc(t, "hi"), (Ids{' ', 'h', 'i'}));
  EXPECT_EQ(enc(t, " hi"), (Ids{' ', 'h', 'i'}));
}

Ids split_with(const std::string& behavior, bool invert, const std::string& text) {
  json j = tiny_json();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array({{{"type", "Split"},
                     {"pattern", {{"String", "-"}}},
                     {"behavior", behavior},
                     {"invert", invert}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  return enc(make(j), text);
}

TEST(TokenizerSynthetic, SplitBehaviours) {
  // "a-b--c": pieces decide which merges can happen.
  EXPECT_EQ(split_with("Isolated", false, "a-b--c"), (Ids{'a', '-', 'b', '-', '-', 'c'}));
  EXPECT_EQ(split_with("Removed", false, "a-b--c"), (Ids{'a', 'b', 'c'}));
  EXPECT_EQ(split_with("MergedWithPrevious", false, "a-b--c"), (Ids{259, 'b', '-', '-', 'c'}));
  EXPECT_EQ(split_with("MergedWithNext", false, "a-b--c"), (Ids{'a', 260, '-', '-', 'c'}));
  EXPECT_EQ(split_with("Contiguous", false, "a-b--c"), (Ids{'a', '-', 'b', 261, 'c'}));
  EXPECT_EQ(split_with("Removed", true, "a-b--c"), (Ids{'-', '-', '-'}));
}

TEST(TokenizerSynthetic, RegexWhiteSpaceIsUnicode) {
  json j = tiny_json();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array({{{"type", "Split"},
                     {"pattern", {{"Regex", "\\s+"}}},
                     {"behavior", "Removed"},
                     {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  Tokenizer t = make(j);
  EXPECT_EQ(enc(t, "a\u0085b c\td"), (Ids{'a', 'b', 'c', 'd'}));
}

TEST(TokenizerSynthetic, OnigurumaTranslation) {
  EXPECT_EQ(translate_oniguruma_pattern(R"(\s+(?!\S))").value(),
            R"(\p{White_Space}+(?!\P{White_Space}))");
  EXPECT_EQ(translate_oniguruma_pattern(R"([^\s\p{L}])").value(), R"([^\p{White_Space}\p{L}])");
  EXPECT_EQ(translate_oniguruma_pattern(R"(\\s)").value(), R"(\\s)");  // an escaped backslash
  EXPECT_EQ(translate_oniguruma_pattern(R"((?m:.))").value(), R"((?s:.))");
  EXPECT_FALSE(translate_oniguruma_pattern(R"([\W])").ok());
  EXPECT_FALSE(translate_oniguruma_pattern(R"([a-z&&[^c]])").ok());
}

// The pieces of `text` under an Oniguruma pattern, as the Split pre-tokenizer cuts them.
std::vector<std::string> pieces(const std::string& pattern, const std::string& text) {
  auto re = Regex::compile_oniguruma(pattern);
  EXPECT_TRUE(re.ok()) << re.error().to_string();
  std::vector<Regex::Match> m;
  EXPECT_TRUE(re->find_all(text, m).ok());
  std::vector<std::string> out;
  for (const Regex::Match& x : m) out.push_back(text.substr(x.start, x.end - x.start));
  return out;
}

// Qwen3.5's tokenizer.json splits with Qwen3's pattern plus combining marks (\p{M}) in words
// and out of punctuation runs: Thai vowel signs stay inside their word there, and split it under
// Qwen3's pattern.
TEST(TokenizerSynthetic, Qwen3_5SplitKeepsCombiningMarksInWords) {
  const std::string qwen3 = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|)"
                            R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string qwen3_5 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|)"
      R"( ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string thai = "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35 \u0e04\u0e23\u0e31\u0e1a";
  EXPECT_EQ(pieces(qwen3_5, thai), (std::vector<std::string>{"\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35",
                                                             " \u0e04\u0e23\u0e31\u0e1a"}));
  EXPECT_EQ(pieces(qwen3, thai),
            (std::vector<std::string>{"\u0e2a\u0e27", "\u0e31\u0e2a\u0e14", "\u0e35",
                                      " \u0e04\u0e23", "\u0e31\u0e1a"}));
  // Text without marks splits alike under both, digits one by one.
  const std::string plain = "It's 2026, isn't it?\n";
  EXPECT_EQ(pieces(qwen3_5, plain), pieces(qwen3, plain));
  EXPECT_EQ(pieces(qwen3_5, plain), (std::vector<std::string>{"It", "'s", " ", "2", "0", "2", "6",
                                                              ",", " isn", "'t", " it", "?\n"}));
}

void expect_error(json j, ErrorCode code, const std::string& mention) {
  Result<Tokenizer> r = Tokenizer::from_json_text(j.dump(), "tiny");
  ASSERT_FALSE(r.ok()) << mention;
  EXPECT_EQ(r.error().code, code) << r.error().to_string();
  EXPECT_NE(r.error().message.find(mention), std::string::npos) << r.error().to_string();
}

TEST(TokenizerSynthetic, UnsupportedComponentsAreClearErrors) {
  json j = tiny_json();
  j["normalizer"] = {{"type", "Lowercase"}};
  expect_error(j, ErrorCode::kUnsupported, "Lowercase");

  j = tiny_json();
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  expect_error(j, ErrorCode::kUnsupported, "Metaspace");

  j = tiny_json();
  j["model"]["type"] = "WordPiece";
  expect_error(j, ErrorCode::kUnsupported, "WordPiece");

  j = tiny_json();
  j["decoder"] = {{"type", "Metaspace"}};
  expect_error(j, ErrorCode::kUnsupported, "Metaspace");

  j = tiny_json();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array(
           {{{"type", "ByteLevel"}},
            {{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", "Isolated"}}})}};
  expect_error(j, ErrorCode::kUnsupported, "after ByteLevel");

  j = tiny_json();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}};
  expect_error(j, ErrorCode::kCorrupt, "(unclosed");

  j = tiny_json();
  j["model"]["merges"].push_back(json::array({"zz", "q"}));
  expect_error(j, ErrorCode::kCorrupt, "zz");

  Result<Tokenizer> text = Tokenizer::from_json_text("{not json", "tiny");
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.error().code, ErrorCode::kCorrupt);

  Result<Tokenizer> missing = Tokenizer::load("/nonexistent/model/dir");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, ErrorCode::kNotFound);
}

}  // namespace
}  // namespace recur
