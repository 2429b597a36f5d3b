// tiktoken.model vocabularies: tiktoken's encoding rules on small vocabularies built here,
// Kimi's directory layout (tests/data/kimi-tokenizer-tiny), the Rust-regex pattern translation,
// and a clear error for every way the files can be wrong. (The ids of real vocabularies are
// checked against tiktoken itself by tests/server/tiktoken.test.mjs.)
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/pretokenizer.h"
#include "tokenizer/tiktoken.h"
#include "tokenizer/tokenizer.h"

namespace recur {
namespace {

using json = nlohmann::json;

const std::string kKimiDir = std::string(RECUR_SOURCE_DIR) + "/tests/data/kimi-tokenizer-tiny";

std::string base64(std::string_view bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = uint8_t(bytes[i]) << 16 | uint8_t(bytes[i + 1]) << 8 | uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (i + 1 == bytes.size()) {
    const uint32_t v = uint8_t(bytes[i]) << 16;
    out += std::string{kAlphabet[v >> 18], kAlphabet[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == bytes.size()) {
    const uint32_t v = uint8_t(bytes[i]) << 16 | uint8_t(bytes[i + 1]) << 8;
    out +=
        std::string{kAlphabet[v >> 18], kAlphabet[(v >> 12) & 63], kAlphabet[(v >> 6) & 63], '='};
  }
  return out;
}

// The 256 bytes as ranks 0..255, then `extra` tokens as 256, 257, ...
std::string ranks_text(const std::vector<std::string>& extra) {
  std::string text;
  for (int b = 0; b < 256; ++b) {
    text += base64(std::string(1, char(b))) + " " + std::to_string(b) + "\n";
  }
  for (size_t k = 0; k < extra.size(); ++k) {
    text += base64(extra[k]) + " " + std::to_string(256 + k) + "\n";
  }
  return text;
}

const std::string kPlainConfig = R"({"pat_str": "[a-z]+|\\s+|[^a-z\\s]+"})";

Tokenizer load(const std::string& ranks, const std::string& config = kPlainConfig) {
  auto t = Tokenizer::from_tiktoken(ranks, config, "test");
  EXPECT_TRUE(t.ok()) << t.error().to_string();
  return std::move(t).value();
}

std::vector<int32_t> ids(const Tokenizer& t, std::string_view text) {
  auto r = t.encode(text);
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  return r.ok() ? *r : std::vector<int32_t>();
}

TEST(Tiktoken, LowestRankedConcatenationMergesFirst) {
  // "bc" (257) ranks below "ab" (258): a|b|c merges b+c first, and "abc" (259) then a+bc.
  Tokenizer t = load(ranks_text({"xy", "bc", "ab", "abc"}));
  EXPECT_EQ(ids(t, "abc"), (std::vector<int32_t>{259}));
  EXPECT_EQ(ids(t, "abd"), (std::vector<int32_t>{258, 'd'}));
  EXPECT_EQ(ids(t, "bcab"), (std::vector<int32_t>{257, 258}));
  // Ties (one token, two places) go to the leftmost pair: aaa is aa + a.
  Tokenizer aa = load(ranks_text({"aa"}));
  EXPECT_EQ(ids(aa, "aaa"), (std::vector<int32_t>{256, 'a'}));
}

TEST(Tiktoken, APieceThatIsATokenIsThatTokenEvenWithoutMerges) {
  // No pair of "abc" is a token, so merging never reaches it; tiktoken looks the piece up first.
  Tokenizer t = load(ranks_text({"abc"}));
  EXPECT_EQ(ids(t, "abc"), (std::vector<int32_t>{256}));
  EXPECT_EQ(ids(t, "abcd"), (std::vector<int32_t>{'a', 'b', 'c', 'd'}));
}

TEST(Tiktoken, TextNoPatternMatchCoversIsDropped) {
  // tiktoken encodes only what the pattern matches.
  Tokenizer t = load(ranks_text({}), R"({"pat_str": "[a-z]+"})");
  EXPECT_EQ(ids(t, "ab, c!"), (std::vector<int32_t>{'a', 'b', 'c'}));
}

TEST(Tiktoken, AddedTokensMatchAndDecode) {
  const std::string config = R"({"pat_str": "[a-z]+|\\s+|[^a-z\\s]+", "added_tokens_decoder": {
      "300": {"content": "<|end|>", "special": true},
      "301": {"content": "<call>", "special": false}}})";
  Tokenizer t = load(ranks_text({"ab"}), config);
  EXPECT_EQ(ids(t, "ab<|end|><call>x"), (std::vector<int32_t>{256, 300, 301, 'x'}));
  EXPECT_EQ(t.vocab_size(), 302);
  EXPECT_TRUE(t.is_special(300));
  EXPECT_FALSE(t.is_special(301));
  EXPECT_EQ(t.decode(std::vector<int32_t>{256, 300, 301}), "ab<|end|><call>");
  EXPECT_EQ(t.decode(std::vector<int32_t>{256, 300, 301}, /*skip_special_tokens=*/true),
            "ab<call>");
  // Tokens are spelled byte-level, as Kimi's tokenizer and tokenizer.json spell them.
  EXPECT_EQ(t.id_to_token(' '), "\xC4\xA0");  // Ġ
  EXPECT_EQ(t.token_to_id("ab"), 256);
  // Bytes that are not UTF-8 decode to U+FFFD; a split character streams whole.
  EXPECT_EQ(t.decode(std::vector<int32_t>{0xE4, 'a'}),
            "\xEF\xBF\xBD"
            "a");
  StreamingDetokenizer d(t);
  std::string out;
  d.push(0xE4, &out);
  d.push(0xB8, &out);
  EXPECT_EQ(out, "");
  d.push(0xAD, &out);
  EXPECT_EQ(out, "\xE4\xB8\xAD");  // 中
}

TEST(Tiktoken, InvalidUtf8TextIsRefused) {
  Tokenizer t = load(ranks_text({}));
  auto r = t.encode("ab\xFF");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(r.error().message.find("not valid UTF-8"), std::string::npos);
}

TEST(Tiktoken, KimiDirectoryLoadsWithItsClassPatternAndReservedTokens) {
  auto t = Tokenizer::load(kKimiDir);
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  EXPECT_TRUE(Tokenizer::found_in(kKimiDir));
  // 1,024 ranks, then Kimi's 258 special ids.
  EXPECT_EQ(t->vocab_size(), 1024 + 258);
  EXPECT_EQ(t->token_to_id("<|im_end|>"), 1026);
  EXPECT_EQ(t->token_to_id("<|tool_calls_section_begin|>"), 1035);
  EXPECT_EQ(t->token_to_id("<|reserved_token_1100|>"), 1100);
  EXPECT_TRUE(t->is_special(1026));
  EXPECT_FALSE(t->is_special(1035));  // tool-call markers survive skip_special_tokens
  EXPECT_TRUE(t->is_special(1100));
  auto r = t->encode("<|im_user|>user<|im_middle|>Hi<|reserved_token_1100|><|im_end|>");
  ASSERT_TRUE(r.ok());
  ASSERT_GE(r->size(), 5u);
  EXPECT_EQ(r->front(), 1027);
  EXPECT_EQ(r->back(), 1026);
  EXPECT_EQ((*r)[r->size() - 2], 1100);
  const std::string text = "Kimi's tokenizer: 中文 and 12345 numbers.\n\n  end";
  auto round = t->encode(text);
  ASSERT_TRUE(round.ok());
  EXPECT_EQ(t->decode(*round), text);
}

TEST(Tiktoken, KimiCutsLongRunsAndLongTextsAsItsTokenizerDoes) {
  const std::string kimi_class =
      R"({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}})";
  Tokenizer t = load(ranks_text({"ab"}), kimi_class);
  // A run of 25,000 letters is whole; one of 25,001 is cut before its last letter.
  std::vector<int32_t> want(24998, 'a');
  want.push_back(256);
  EXPECT_EQ(ids(t, std::string(24999, 'a') + "b"), want);
  want.assign(25000, 'a');
  want.push_back('b');
  EXPECT_EQ(ids(t, std::string(25000, 'a') + "b"), want);
  // Text is encoded 400,000 characters at a time: here the cut falls inside the last "aab".
  std::string text = "xx";
  for (int k = 0; k < 100000; ++k) text += "aab ";
  const std::vector<int32_t> got = ids(t, text);
  ASSERT_GE(got.size(), 5u);
  EXPECT_EQ(std::vector<int32_t>(got.end() - 5, got.end()),
            (std::vector<int32_t>{' ', 'a', 'a', 'b', ' '}));
  EXPECT_EQ(std::vector<int32_t>(got.begin(), got.begin() + 7),
            (std::vector<int32_t>{'x', 'x', 'a', 256, ' ', 'a', 256}));
  // Characters, not bytes: 399,999 two-byte letters and then "ab" cut between a and b.
  std::string wide;
  for (int k = 0; k < 399999; ++k) wide += "\xC3\xA9";  // é
  const std::vector<int32_t> w = ids(t, wide + "ab");
  ASSERT_GE(w.size(), 2u);
  EXPECT_EQ(std::vector<int32_t>(w.end() - 2, w.end()), (std::vector<int32_t>{'a', 'b'}));
  // Without Kimi's class there is no cut.
  Tokenizer plain = load(ranks_text({"ab"}));
  EXPECT_EQ(ids(plain, std::string(25000, 'a') + "b").back(), 256);
}

TEST(Tiktoken, RustPatternsBecomePcre2WithTheSameMeaning) {
  auto tr = [](std::string_view p) {
    auto r = translate_tiktoken_pattern(p);
    EXPECT_TRUE(r.ok()) << p;
    return r.ok() ? *r : std::string();
  };
  EXPECT_EQ(tr(R"(\s+(?!\S)|\d|\p{L}+)"), R"(\p{White_Space}+(?!\P{White_Space})|\p{Nd}|\p{L}+)");
  EXPECT_EQ(tr(R"([^\s\p{L}]?)"), R"([^\p{White_Space}\p{L}]?)");
  // Script names mean the Script property in Rust; PCRE2's bare \p{Han} is Script_Extensions.
  EXPECT_EQ(tr(R"([\p{Han}]+)"), R"([\p{sc:Han}]+)");
  EXPECT_EQ(tr(R"([\p{Lu}\p{M}&&[^\p{Han}]]*)"), R"((?:(?=[^\p{sc:Han}])[\p{Lu}\p{M}])*)");
  EXPECT_EQ(tr(R"(^a.$)"), R"(\Aa[^\n]\z)");
  EXPECT_EQ(tr(R"((?iu:'s))"), R"((?i:'s))");
  // And they split alike: Han runs apart from other letters, ideographic punctuation not Han.
  auto regex = Regex::compile(tr(R"([\p{Han}]+|[\p{L}&&[^\p{Han}]]+|\s+|[^\s\p{L}]+)"));
  ASSERT_TRUE(regex.ok());
  std::vector<Regex::Match> m;
  const std::string text = "abc中文。def";
  ASSERT_TRUE(regex->find_all(text, m).ok());
  std::vector<std::string> pieces;
  for (const auto& x : m) pieces.push_back(text.substr(x.start, x.end - x.start));
  EXPECT_EQ(pieces, (std::vector<std::string>{"abc", "中文", "。", "def"}));
  for (const char* bad : {"[a-z", R"(\)", "(?m:^a)", R"([\q])"}) {
    auto r = translate_tiktoken_pattern(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().code, ErrorCode::kUnsupported) << bad;
  }
}

struct BadFiles {
  const char* what;
  std::string ranks, config;
  ErrorCode code;
  const char* message;
};

TEST(Tiktoken, CorruptFilesGetClearErrors) {
  const std::string good = ranks_text({"ab"});
  const std::vector<BadFiles> cases = {
      {"not base64", good + "a$b= 300\n", kPlainConfig, ErrorCode::kCorrupt,
       "test/tiktoken.model: line 258: \"a$b=\" is not base64"},
      {"bad padding", good + "YQ= 300\n", kPlainConfig, ErrorCode::kCorrupt, "is not base64"},
      {"rank not a number", good + "eHk= 3x\n", kPlainConfig, ErrorCode::kCorrupt,
       "line 258: rank \"3x\" is not an integer"},
      {"rank too large", good + "eHk= 99999999999\n", kPlainConfig, ErrorCode::kCorrupt,
       "is not an integer in [0, 2^31)"},
      {"one field", good + "eHk=\n", kPlainConfig, ErrorCode::kCorrupt, "line 258: not two fields"},
      {"three fields", good + "eHk= 300 1\n", kPlainConfig, ErrorCode::kCorrupt, "not two fields"},
      {"repeated rank", good + "eHk= 256\n", kPlainConfig, ErrorCode::kCorrupt,
       "line 258: rank 256 appears twice"},
      {"repeated token", good + "YWI= 300\n", kPlainConfig, ErrorCode::kCorrupt,
       "token YWI= appears twice"},
      {"empty", "\n\n", kPlainConfig, ErrorCode::kCorrupt, "test/tiktoken.model: no tokens"},
      {"a byte missing", "YQ== 0\nYg== 1\n", kPlainConfig, ErrorCode::kCorrupt,
       "byte 0x00 is not a token"},
      {"sparse ranks", good + "eHk= 2000000000\n", kPlainConfig, ErrorCode::kCorrupt,
       "ids are sparse"},
      {"config not JSON", good, "{", ErrorCode::kCorrupt,
       "test/tokenizer_config.json: invalid JSON"},
      {"no pattern", good, "{}", ErrorCode::kUnsupported, "no pre-tokenizer pattern"},
      {"pattern not a string", good, R"({"pat_str": 3})", ErrorCode::kCorrupt,
       "\"pat_str\" is not a non-empty string"},
      {"pattern does not compile", good, R"({"pat_str": "(a"})", ErrorCode::kCorrupt,
       "pre-tokenizer pattern /(a/"},
      {"added token key", good, R"({"pat_str": "a", "added_tokens_decoder": {"x": {}}})",
       ErrorCode::kCorrupt, "added_tokens_decoder entry \"x\" needs an id"},
      {"added token content", good,
       R"({"pat_str": "a", "added_tokens_decoder": {"300": {"content": 1}}})", ErrorCode::kCorrupt,
       "needs an id in [0, 2^31) as its key and a string \"content\""},
      {"added token flag not a bool", good,
       R"({"pat_str": "a", "added_tokens_decoder": {"256": {"content": "<x>"},
           "300": {"content": "<y>", "special": "yes"}}})",
       ErrorCode::kCorrupt,
       "test/tokenizer_config.json: added token field \"special\" is not a bool"},
  };
  for (const BadFiles& c : cases) {
    auto t = Tokenizer::from_tiktoken(c.ranks, c.config, "test");
    ASSERT_FALSE(t.ok()) << c.what;
    EXPECT_EQ(t.error().code, c.code) << c.what << ": " << t.error().to_string();
    EXPECT_NE(t.error().message.find(c.message), std::string::npos)
        << c.what << ": " << t.error().message;
  }
}

TEST(Tiktoken, DirectoryWithoutItsConfigOrAnyTokenizerIsNamed) {
  auto none = Tokenizer::load(std::string(RECUR_SOURCE_DIR) + "/tests/data");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, ErrorCode::kNotFound);
  EXPECT_NE(none.error().message.find("neither tokenizer.json nor tiktoken.model"),
            std::string::npos);
  EXPECT_FALSE(Tokenizer::found_in(std::string(RECUR_SOURCE_DIR) + "/tests/data"));
}

}  // namespace
}  // namespace recur
