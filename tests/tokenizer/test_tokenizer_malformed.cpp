// tokenizer.json files with ids that would size the per-id tables absurdly (one id of 2^31 - 1)
// or make them ambiguous (two tokens, one id): a clear error, before anything is allocated
// from them.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8_util.h"

namespace recur {
namespace {

using json = nlohmann::json;

// Bytes as ids 0..255, "ab" as 256, one merge; `edit` changes it before it is loaded.
json base_json() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(s, byte_to_unicode(static_cast<uint8_t>(b)));
    vocab[s] = b;
  }
  vocab["ab"] = 256;
  return {
      {"added_tokens", json::array({{{"id", 257}, {"content", "<|end|>"}, {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({json::array({"a", "b"})})}}}};
}

int64_t peak_rss_bytes() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return int64_t(ru.ru_maxrss) * 1024;
}

// Loads `j`, expecting an error that contains `expect`, and that the attempt did not grow the
// process by more than the file itself could explain. (ctest runs each test in its own
// process, so the peak before is this test's own.)
void expect_refused(const json& j, const std::string& expect) {
  const std::string text = j.dump();
  const int64_t before = peak_rss_bytes();
  Result<Tokenizer> t = Tokenizer::from_json_text(text, "tokenizer.json");
  const int64_t grown = peak_rss_bytes() - before;
  ASSERT_FALSE(t.ok()) << "loaded a tokenizer.json that should be refused (" << expect << ")";
  EXPECT_NE(t.error().message.find(expect), std::string::npos) << t.error().message;
  EXPECT_EQ(t.error().code, ErrorCode::kCorrupt) << t.error().to_string();
  EXPECT_LT(grown, int64_t(64) << 20) << "loading grew the peak memory by " << grown << " bytes";
}

TEST(TokenizerMalformed, TheBaseFileLoads) {
  Result<Tokenizer> t = Tokenizer::from_json_text(base_json().dump(), "tokenizer.json");
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  EXPECT_EQ(t->vocab_size(), 258);
  EXPECT_EQ(t->encode("ab<|end|>").value(), (std::vector<int32_t>{256, 257}));
}

TEST(TokenizerMalformed, RefusesAHugeVocabId) {
  for (int64_t id : {int64_t(INT32_MAX), int64_t(1) << 26, int64_t(1) << 24}) {
    json j = base_json();
    j["model"]["vocab"]["huge"] = id;
    expect_refused(j, "the largest is " + std::to_string(id));
  }
}

TEST(TokenizerMalformed, RefusesAHugeAddedTokenId) {
  for (int64_t id : {int64_t(INT32_MAX), int64_t(1) << 26, int64_t(1) << 24}) {
    json j = base_json();
    j["added_tokens"].push_back({{"id", id}, {"content", "<|huge|>"}, {"special", true}});
    expect_refused(j, "the largest is " + std::to_string(id));
  }
}

TEST(TokenizerMalformed, AcceptsAFewUnusedIds) {
  // Reserved ids that nothing uses (Qwen's vocabulary pads to a round size) are fine.
  json j = base_json();
  j["added_tokens"].push_back({{"id", 1000}, {"content", "<|later|>"}, {"special", true}});
  Result<Tokenizer> t = Tokenizer::from_json_text(j.dump(), "tokenizer.json");
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  EXPECT_EQ(t->vocab_size(), 1001);
  EXPECT_EQ(t->id_to_token(500), "");
}

TEST(TokenizerMalformed, RefusesNegativeAndNonIntegerIds) {
  json j = base_json();
  j["model"]["vocab"]["neg"] = -1;
  expect_refused(j, "vocab entry \"neg\" has id -1");
  j = base_json();
  j["model"]["vocab"]["big"] = int64_t(1) << 32;
  expect_refused(j, "vocab entry \"big\" has id 4294967296");
  j = base_json();
  j["model"]["vocab"]["half"] = 3.5;
  expect_refused(j, "vocab entry \"half\" has id 3.5");
  j = base_json();
  j["added_tokens"].push_back({{"id", -5}, {"content", "<|neg|>"}, {"special", true}});
  expect_refused(j, "added token \"<|neg|>\" has id -5");
}

TEST(TokenizerMalformed, RefusesDuplicateIds) {
  json j = base_json();
  j["model"]["vocab"]["twin"] = 256;  // "ab" has it
  expect_refused(j, "both have id 256");
  j = base_json();
  j["added_tokens"].push_back({{"id", 257}, {"content", "<|other|>"}, {"special", true}});
  expect_refused(j, "added tokens \"<|end|>\" and \"<|other|>\" both have id 257");
  // The same token listed twice is harmless, and an added token may restate a vocab entry.
  j = base_json();
  j["added_tokens"].push_back({{"id", 257}, {"content", "<|end|>"}, {"special", true}});
  j["added_tokens"].push_back({{"id", 256}, {"content", "ab"}, {"special", false}});
  EXPECT_TRUE(Tokenizer::from_json_text(j.dump(), "tokenizer.json").ok());
}

}  // namespace
}  // namespace recur
