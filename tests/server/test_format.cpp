// The hand-written JSON string writer of the streaming hot path: valid text round-trips
// through a JSON parser unchanged; invalid UTF-8 becomes U+FFFD, never invalid JSON.
#include <gtest/gtest.h>

#include <random>

#include "server/format.h"

namespace recur::server {
namespace {

std::string parse_back(std::string_view s) {
  std::string lit;
  append_json_string(&lit, s);
  return ojson::parse(lit).get<std::string>();  // throws on invalid JSON
}

TEST(JsonString, EscapesAndKeepsValidText) {
  for (std::string s :
       {std::string(""), std::string("plain"), std::string("q\"b\\n\n\r\t"),
        std::string("\x01\x1f\x7f", 3), std::string("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"),
        std::string("\0x", 2), std::string("</think>")}) {
    EXPECT_EQ(parse_back(s), s);
  }
  std::string lit;
  append_json_string(&lit, "a\"\n");
  EXPECT_EQ(lit, "\"a\\\"\\n\"");
}

TEST(JsonString, InvalidUtf8BecomesReplacement) {
  const std::string fffd = "\xef\xbf\xbd";
  EXPECT_EQ(parse_back("\xff"), fffd);
  EXPECT_EQ(parse_back("a\xc3"), "a" + fffd);                 // truncated sequence
  EXPECT_EQ(parse_back("\xc0\x80"), fffd + fffd);             // overlong
  EXPECT_EQ(parse_back("\xed\xa0\x80"), fffd + fffd + fffd);  // UTF-16 surrogate
  EXPECT_EQ(parse_back("\xf5\x80\x80\x80"), fffd + fffd + fffd + fffd);
  EXPECT_EQ(parse_back("\xf4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // > U+10FFFF
}

TEST(JsonString, RandomBytesAlwaysGiveValidJson) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string s(size_t(rng() % 24), '\0');
    for (auto& ch : s) ch = char(rng() & 0xff);
    std::string lit;
    append_json_string(&lit, s);
    EXPECT_TRUE(ojson::accept(lit)) << lit;
    // Valid input is kept byte for byte.
    ojson j = s;
    std::string dumped;
    try {
      dumped = j.dump();
    } catch (const ojson::exception&) {
      continue;  // s is not valid UTF-8
    }
    EXPECT_EQ(ojson::parse(lit).get<std::string>(), s);
  }
}

}  // namespace
}  // namespace recur::server
