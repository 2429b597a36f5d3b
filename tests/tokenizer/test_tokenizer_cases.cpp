// Cases the golden file lacks, with expectations derived from the Qwen pre-tokenizer regex:
// whitespace runs, added tokens inside text, emoji, CJK, code, normalization, invalid bytes.
#include <gtest/gtest.h>

#include <utf8proc.h>

#include <cstdlib>
#include <random>

#include "io/checkpoint.h"
#include "tokenizer/bpe.h"
#include "tokenizer/tokenizer_test_support.h"
#include "tokenizer/utf8_util.h"

namespace recur {
namespace {

using testing_support::qwen_tokenizer;

constexpr int32_t kEndOfText = 151643;
constexpr int32_t kImStart = 151644;
constexpr int32_t kImEnd = 151645;
constexpr int32_t kThink = 151667;
constexpr int32_t kThinkEnd = 151668;

std::vector<int32_t> encode(std::string_view text) {
  Result<std::vector<int32_t>> r = qwen_tokenizer().encode(text);
  EXPECT_TRUE(r.ok()) << r.error().to_string();
  return r.ok() ? *r : std::vector<int32_t>{};
}

int32_t id(std::string_view token) {
  std::optional<int32_t> i = qwen_tokenizer().token_to_id(token);
  EXPECT_TRUE(i.has_value()) << "token not in vocabulary: " << token;
  return i.value_or(-1);
}

// Ids of vocabulary tokens spelled in the ByteLevel alphabet ("Ġb" is " b").
std::vector<int32_t> ids(std::initializer_list<std::string_view> tokens) {
  std::vector<int32_t> out;
  for (std::string_view t : tokens) out.push_back(id(t));
  return out;
}

// BPE is applied per pre-tokenized piece, so a text whose pieces are known encodes as the
// concatenation of its pieces encoded alone.
std::vector<int32_t> concat_encodings(std::initializer_list<std::string_view> pieces) {
  std::vector<int32_t> out;
  for (std::string_view p : pieces) {
    std::vector<int32_t> e = encode(p);
    out.insert(out.end(), e.begin(), e.end());
  }
  return out;
}

// The token spelling of raw bytes.
std::string byte_token(std::string_view bytes) {
  std::string s;
  for (char c : bytes) append_utf8(s, byte_to_unicode(static_cast<uint8_t>(c)));
  return s;
}

// What one push appends (the stream appends to a caller's buffer).
std::string pushed(StreamingDetokenizer& s, int32_t id) {
  std::string out;
  s.push(id, &out);
  return out;
}
std::string flushed(StreamingDetokenizer& s) {
  std::string out;
  s.flush(&out);
  return out;
}

std::string nfc(std::string_view text) {
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &out,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  EXPECT_GE(n, 0);
  std::string s(reinterpret_cast<const char*>(out), n < 0 ? 0 : static_cast<size_t>(n));
  std::free(out);
  return s;
}

void expect_round_trip(std::string_view text) {
  std::vector<int32_t> e = encode(text);
  EXPECT_EQ(qwen_tokenizer().decode(e), std::string(text));
  for (int32_t i : e) EXPECT_LT(i, kEndOfText) << "plain text produced an added token";
}

TEST(TokenizerCases, VocabularyBasics) {
  const Tokenizer& tok = qwen_tokenizer();
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.token_to_id("<|im_start|>"), kImStart);
  EXPECT_EQ(tok.id_to_token(kImStart), "<|im_start|>");
  EXPECT_EQ(tok.id_to_token(9707), "Hello");
  EXPECT_EQ(tok.id_to_token(220), "Ġ");
  EXPECT_EQ(tok.id_to_token(-1), "");
  EXPECT_EQ(tok.id_to_token(10'000'000), "");
  EXPECT_FALSE(tok.token_to_id("no such token at all").has_value());
  EXPECT_TRUE(tok.is_special(kEndOfText));
  EXPECT_TRUE(tok.is_special(kImStart));
  EXPECT_FALSE(tok.is_special(kThink));  // added but not special in Qwen3
  EXPECT_FALSE(tok.is_special(9707));
  EXPECT_FALSE(tok.is_special(-5));
}

TEST(TokenizerCases, WhitespaceRuns) {
  // \s+(?!\S) leaves the last space of a run to prefix the next word.
  EXPECT_EQ(encode("a  b"), ids({"a", "Ġ", "Ġb"}));
  // \s*[\r\n]+ takes the newlines; the spaces after them split the same way.
  EXPECT_EQ(encode("x\n\n  y"), ids({"x", "ĊĊ", "Ġ", "Ġy"}));
  // At the end of the text the whole run is one piece.
  EXPECT_EQ(encode("hi   "), ids({"hi", "ĠĠĠ"}));
  EXPECT_EQ(encode("\t\tx"), concat_encodings({"\t", "\tx"}));
  EXPECT_EQ(encode("\t\tx").front(), id("ĉ"));
  EXPECT_EQ(encode(" \r\n"), concat_encodings({" \r\n"}));
  for (std::string_view s : {" ", "  ", "\n", "\r", "\r\n\r\n", " \t \n ", "\v\f", "a \n b"}) {
    expect_round_trip(s);
  }
}

TEST(TokenizerCases, UnicodeWhiteSpaceFollowsOniguruma) {
  // NEL (U+0085) is White_Space for Oniguruma's \s: runs split like spaces.
  EXPECT_EQ(encode("a\u0085\u0085b"), concat_encodings({"a", "\u0085", "\u0085b"}));
  // U+180E stopped being a space in Unicode 6.3 (PCRE2's own \s still counts it): it is
  // punctuation-like here, so both separators form one piece.
  EXPECT_EQ(encode("a\u180E\u180Eb"), concat_encodings({"a", "\u180E\u180E", "b"}));
  // Ideographic space U+3000 is White_Space.
  EXPECT_EQ(encode("x\u3000\u3000y"), concat_encodings({"x", "\u3000", "\u3000y"}));
}

TEST(TokenizerCases, AddedTokensInsideText) {
  EXPECT_EQ(encode("<|im_start|>user\nhi<|im_end|>"),
            (std::vector<int32_t>{kImStart, id("user"), id("Ċ"), id("hi"), kImEnd}));
  EXPECT_EQ(encode("a <think> b"), (std::vector<int32_t>{id("a"), id("Ġ"), kThink, id("Ġb")}));
  EXPECT_EQ(encode("<|im_end|><|im_start|>"), (std::vector<int32_t>{kImEnd, kImStart}));
  EXPECT_EQ(encode("<think></think>"), (std::vector<int32_t>{kThink, kThinkEnd}));
  EXPECT_EQ(encode("<<|im_start|>>"), (std::vector<int32_t>{id("<"), kImStart, id(">")}));
  EXPECT_EQ(encode("x<|endoftext|>y"), (std::vector<int32_t>{id("x"), kEndOfText, id("y")}));
  // Near misses stay text.
  for (std::string_view s : {"<|im_start|", "<|IM_START|>", "< think>", "<thinking>", "<|"}) {
    expect_round_trip(s);
  }
  // Text after a token is normalized on its own: a lone combining mark stays as it is.
  std::string s = "<|im_start|>\u0301x";
  EXPECT_EQ(qwen_tokenizer().decode(encode(s)), s);
  EXPECT_EQ(encode(s).front(), kImStart);
}

TEST(TokenizerCases, EmojiAndZwjSequences) {
  std::string text = "👩‍💻 and 🏳️‍🌈";
  EXPECT_EQ(encode(text), concat_encodings({"👩‍💻", " and", " 🏳️‍🌈"}));
  expect_round_trip(text);
  expect_round_trip("👨‍👩‍👧‍👦👍🏽🇯🇵");
}

TEST(TokenizerCases, CjkAndScripts) {
  EXPECT_EQ(encode("我爱北京天安门。"), concat_encodings({"我爱北京天安门", "。"}));
  expect_round_trip("我爱北京天安门。");
  expect_round_trip("東京都 とうきょうと トウキョウ");
  expect_round_trip("한국어 텍스트입니다");
  expect_round_trip("ภาษาไทย हिन्दी עברית");
}

TEST(TokenizerCases, Code) {
  std::string code = "if (x) {\n\treturn y;\n}";
  EXPECT_EQ(encode(code),
            concat_encodings({"if", " (", "x", ")", " {\n", "\treturn", " y", ";\n", "}"}));
  expect_round_trip(code);
  expect_round_trip("#include <vector>\nint main() { return a->b[3] <= 0x1F ? 1 : 2; }\n");
  expect_round_trip("    def f(self):\n        return {'k': [1, 2]}  # 注释\n");
}

TEST(TokenizerCases, ContractionsAndNumbers) {
  EXPECT_EQ(encode("I'm"), ids({"I", "'m"}));
  EXPECT_EQ(encode("WE'RE"), concat_encodings({"WE", "'RE"}));
  // A curly apostrophe is not a contraction: it prefixes the letters.
  EXPECT_EQ(encode("it\u2019s"), concat_encodings({"it", "\u2019s"}));
  // Digits are split one by one.
  EXPECT_EQ(encode("2024"), ids({"2", "0", "2", "4"}));
  EXPECT_EQ(encode("x12"), ids({"x", "1", "2"}));
}

TEST(TokenizerCases, NfcNormalization) {
  EXPECT_EQ(encode("e\u0301"), encode("\u00e9"));
  EXPECT_EQ(qwen_tokenizer().decode(encode("e\u0301")), "\u00e9");
  EXPECT_EQ(encode("\u212b"), encode("\u00c5"));        // ANGSTROM SIGN -> A WITH RING
  EXPECT_EQ(encode("\u1100\u1161"), encode("\uac00"));  // Hangul jamo compose
  // NFC keeps compatibility characters (that would be NFKC).
  EXPECT_EQ(qwen_tokenizer().decode(encode("ﬁ½")), "ﬁ½");
  EXPECT_EQ(qwen_tokenizer().decode(encode(std::string("nul\0mid", 7))),
            std::string("nul\0mid", 7));
}

TEST(TokenizerCases, LongPiecesUseTheHeapMergeConsistently) {
  std::string letters(20000, 'a');
  expect_round_trip(letters);
  expect_round_trip(std::string(20000, ' '));
  std::string ab;
  for (int i = 0; i < 10000; ++i) ab += "ab";
  expect_round_trip(ab);
  std::string accents;
  for (int i = 0; i < 3000; ++i) accents += "é";
  expect_round_trip(accents);
}

TEST(TokenizerCases, InvalidUtf8IsAnErrorNamingTheOffset) {
  struct Bad {
    std::string text;
    size_t offset;
  };
  std::vector<Bad> cases = {
      {"\xff", 0},
      {"abc\xC3", 3},             // truncated two-byte character
      {"ok \xED\xA0\x80", 3},     // UTF-16 surrogate
      {"\xC0\xAF", 0},            // overlong '/'
      {"xy\xF4\x90\x80\x80", 2},  // above U+10FFFF
      {"\xE4\xB8", 0},            // truncated three-byte character
      {"a\x80", 1},               // lone continuation byte
  };
  for (const Bad& b : cases) {
    Result<std::vector<int32_t>> r = qwen_tokenizer().encode(b.text);
    ASSERT_FALSE(r.ok()) << b.offset;
    EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(r.error().message.find(fmt::format("offset {}", b.offset)), std::string::npos)
        << r.error().message;
  }
}

TEST(TokenizerCases, DecodeReplacesInvalidBytesLikeFromUtf8Lossy) {
  const Tokenizer& tok = qwen_tokenizer();
  int32_t e4 = id(byte_token("\xE4")), b8 = id(byte_token("\xB8")), ad = id(byte_token("\xAD"));
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(tok.decode(std::vector<int32_t>{e4, b8, ad}), "中");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{e4}), fffd);  // truncated at end
  EXPECT_EQ(tok.decode(std::vector<int32_t>{e4, e4}), fffd + fffd);
  EXPECT_EQ(tok.decode(std::vector<int32_t>{e4, b8, id("a")}), fffd + "a");  // one maximal part
  EXPECT_EQ(tok.decode(std::vector<int32_t>{ad, id("a")}), fffd + "a");      // stray continuation
  int32_t ed = id(byte_token("\xED")), a0 = id(byte_token("\xA0")), x80 = id(byte_token("\x80"));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{ed, a0, x80}), fffd + fffd + fffd);  // surrogate
  // Unknown ids are skipped.
  EXPECT_EQ(tok.decode(std::vector<int32_t>{-1, 99'999'999, id("a")}), "a");
}

TEST(TokenizerCases, StreamingHoldsBackPartialCharacters) {
  const Tokenizer& tok = qwen_tokenizer();
  int32_t e4 = id(byte_token("\xE4")), b8 = id(byte_token("\xB8")), ad = id(byte_token("\xAD"));
  StreamingDetokenizer s(tok);
  EXPECT_EQ(pushed(s, id("a")), "a");
  EXPECT_EQ(pushed(s, e4), "");
  EXPECT_EQ(pushed(s, b8), "");
  EXPECT_EQ(pushed(s, ad), "中");
  EXPECT_EQ(pushed(s, e4), "");
  EXPECT_EQ(pushed(s, id("b")),
            "\xEF\xBF\xBD"
            "b");  // the held byte turned out invalid
  EXPECT_EQ(pushed(s, e4), "");
  EXPECT_EQ(flushed(s), "\xEF\xBF\xBD");
  EXPECT_EQ(flushed(s), "");

  StreamingDetokenizer skip(tok, /*skip_special_tokens=*/true);
  std::string out;
  for (int32_t i : encode("<|im_start|>hi <think>x</think><|im_end|>")) out += pushed(skip, i);
  out += flushed(skip);
  EXPECT_EQ(out, "hi <think>x</think>");
}

TEST(TokenizerCases, SkipSpecialTokens) {
  const Tokenizer& tok = qwen_tokenizer();
  std::vector<int32_t> v = {kImStart, id("hi"), kImEnd, kThink};
  EXPECT_EQ(tok.decode(v, false), "<|im_start|>hi<|im_end|><think>");
  EXPECT_EQ(tok.decode(v, true), "hi<think>");
}

TEST(TokenizerCases, RandomTextRoundTripsThroughNfc) {
  // Random code points from several blocks: decode(encode(x)) must equal NFC(x), and streaming
  // must equal whole decoding.
  std::mt19937 rng(1234);
  const std::vector<std::pair<int32_t, int32_t>> ranges = {
      {0x20, 0x7E},     {0x09, 0x0D},     {0xA0, 0x17F},      {0x300, 0x36F},   {0x400, 0x4FF},
      {0x4E00, 0x4FFF}, {0xAC00, 0xAD00}, {0x1F300, 0x1F64F}, {0x2000, 0x206F}, {0x3000, 0x303F}};
  for (int round = 0; round < 200; ++round) {
    std::string text;
    int len = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i) {
      auto [lo, hi] = ranges[rng() % ranges.size()];
      append_utf8(text, lo + static_cast<int32_t>(rng() % static_cast<uint32_t>(hi - lo + 1)));
    }
    std::vector<int32_t> e = encode(text);
    std::string decoded = qwen_tokenizer().decode(e);
    EXPECT_EQ(decoded, nfc(text));
    EXPECT_EQ(encode(decoded), e) << text;
    StreamingDetokenizer s(qwen_tokenizer());
    std::string streamed;
    for (int32_t i : e) streamed += pushed(s, i);
    streamed += flushed(s);
    EXPECT_EQ(streamed, decoded);
  }
}

TEST(TokenizerCases, HeapAndScanMergesAgree) {
  Result<nlohmann::json> j = read_json_file(testing_support::qwen_model_dir() + "/tokenizer.json");
  ASSERT_TRUE(j.ok());
  Result<BpeModel> model = BpeModel::from_json((*j)["model"], /*byte_level_input=*/true, false);
  ASSERT_TRUE(model.ok()) << model.error().to_string();
  std::mt19937 rng(7);
  const std::string alphabet = "aabcdeeilnorst  ";
  for (int round = 0; round < 300; ++round) {
    std::string word;
    int len = 2 + static_cast<int>(rng() % 120);
    for (int i = 0; i < len; ++i) word += alphabet[rng() % alphabet.size()];
    std::vector<int32_t> symbols;
    for (char c : word) symbols.push_back(*model->token_to_id(byte_token(std::string(1, c))));
    std::vector<int32_t> a = symbols, b = symbols;
    model->merge_small(a);
    model->merge_heap(b);
    EXPECT_EQ(a, b) << word;
  }
}

}  // namespace
}  // namespace recur
