// The Qwen3 tokenizer against ids and decodings produced by Hugging Face `tokenizers`.
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>

#include "tokenizer/tokenizer_test_support.h"
#include "tokenizer/utf8_util.h"

namespace recur {
namespace {

using testing_support::golden_cases;
using testing_support::qwen_tokenizer;

std::string describe(const testing_support::GoldenCase& c) {
  return fmt::format("line {} kind {}: {:?}", c.line, c.kind, c.text.substr(0, 80));
}

TEST(TokenizerGolden, HasCases) {
  ASSERT_GE(golden_cases().size(), 100u);
  std::set<std::string> kinds;
  for (const auto& c : golden_cases()) kinds.insert(c.kind);
  EXPECT_TRUE(kinds.count("license-en"));
  EXPECT_TRUE(kinds.count("code"));
  EXPECT_TRUE(kinds.count("edge"));
}

TEST(TokenizerGolden, EncodeGivesExactIds) {
  const Tokenizer& tok = qwen_tokenizer();
  for (const auto& c : golden_cases()) {
    Result<std::vector<int32_t>> ids = tok.encode(c.text);
    ASSERT_TRUE(ids.ok()) << describe(c) << ": " << ids.error().to_string();
    EXPECT_EQ(*ids, c.ids) << describe(c);
  }
}

TEST(TokenizerGolden, DecodeGivesExactText) {
  const Tokenizer& tok = qwen_tokenizer();
  for (const auto& c : golden_cases()) {
    EXPECT_EQ(tok.decode(c.ids), c.decoded) << describe(c);
  }
}

TEST(TokenizerGolden, StreamingDecodeEqualsWholeDecode) {
  const Tokenizer& tok = qwen_tokenizer();
  for (bool skip : {false, true}) {
    for (const auto& c : golden_cases()) {
      StreamingDetokenizer stream(tok, skip);
      std::string joined;
      for (int32_t id : c.ids) {
        std::string part;
        stream.push(id, &part);
        // Never a partial character: each piece is valid UTF-8 on its own.
        EXPECT_FALSE(find_invalid_utf8(part).has_value()) << describe(c) << " partial character";
        joined += part;
      }
      stream.flush(&joined);
      EXPECT_EQ(joined, tok.decode(c.ids, skip)) << describe(c) << " skip=" << skip;
    }
  }
}

TEST(TokenizerGolden, WithoutWordCacheSameIds) {
  TokenizerOptions opts;
  opts.word_cache = false;
  Result<Tokenizer> cold = Tokenizer::load(testing_support::qwen_model_dir(), opts);
  ASSERT_TRUE(cold.ok()) << cold.error().to_string();
  for (const auto& c : golden_cases()) {
    Result<std::vector<int32_t>> ids = cold->encode(c.text);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*ids, c.ids) << describe(c);
  }
}

TEST(TokenizerGolden, ConcurrentEncodeSharesOneTokenizer) {
  const Tokenizer& tok = qwen_tokenizer();
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        const auto& cases = golden_cases();
        for (size_t i = 0; i < cases.size(); ++i) {
          const auto& c = cases[(i + static_cast<size_t>(t) * 17) % cases.size()];
          Result<std::vector<int32_t>> ids = tok.encode(c.text);
          if (!ids.ok() || *ids != c.ids) ++mismatches;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(TokenizerGolden, CopiesShareTables) {
  Tokenizer copy = qwen_tokenizer();
  Tokenizer moved = std::move(copy);
  const auto& c = golden_cases().front();
  Result<std::vector<int32_t>> ids = moved.encode(c.text);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, c.ids);
}

}  // namespace
}  // namespace recur
