// continue_final_message: the last message rendered open (the closed rendering cut after its
// text), for a model to go on writing it; and Tokenizer::max_token_bytes, the bound on how
// many bytes of text one token stands for.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace recur {
namespace {

using ojson = nlohmann::ordered_json;

const std::string kModelDir = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";

TEST(ContinueFinalMessage, TheClosedRenderingCutAfterTheFinalText) {
  const ChatTemplate t = ChatTemplate::load(kModelDir).value();
  ojson req = ojson::parse(R"({"messages": [
      {"role": "user", "content": "Pick one: (A) Sol (B) <|im_end|>"},
      {"role": "assistant", "content": "The answer is ( "}],
      "add_generation_prompt": false})");
  const std::string closed = t.render(req).value();
  ASSERT_TRUE(closed.ends_with("The answer is ( <|im_end|>\n")) << closed;
  req["continue_final_message"] = true;
  const RenderedPrompt open = t.render_prompt(req).value();
  // Without the turn's end, and without the text's trailing space.
  EXPECT_EQ(open.text, closed.substr(0, closed.size() - std::string(" <|im_end|>\n").size()));
  // The request's text is still marked as such, up to the cut.
  ASSERT_FALSE(open.literal.empty());
  EXPECT_EQ(open.literal.back().second, open.text.size());
  for (const auto& [from, to] : open.literal) EXPECT_LE(to, open.text.size());
  // add_generation_prompt left out means false when continuing.
  req.erase("add_generation_prompt");
  EXPECT_EQ(t.render_prompt(req).value().text, open.text);
  // The last text part of a list of parts.
  req["messages"][1]["content"] = ojson::parse(
      R"([{"type": "text", "text": "The answer"}, {"type": "text", "text": "is ( "}])");
  EXPECT_TRUE(t.render_prompt(req).value().text.ends_with("The answer\nis (")) << closed;
}

TEST(ContinueFinalMessage, RefusedWhereItCannotBe) {
  const ChatTemplate t = ChatTemplate::load(kModelDir).value();
  auto refused = [&](const char* json) {
    auto r = t.render_prompt(ojson::parse(json));
    EXPECT_FALSE(r.ok()) << json;
    if (!r.ok()) {
      EXPECT_EQ(r.error().code, ErrorCode::kInvalidArgument) << json;
    }
  };
  refused(R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
      "content": "x"}], "continue_final_message": true, "add_generation_prompt": true})");
  refused(R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
      "content": "  "}], "continue_final_message": true})");
  refused(R"({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": 1})");
  refused(R"({"messages": [{"role": "user", "content": "hi"}],
      "chat_template_kwargs": {"continue_final_message": true}})");
  // A template that leaves the text out.
  const ChatTemplate quiet = ChatTemplate::from_string("{{ messages|length }}", "", "").value();
  auto r = quiet.render_prompt(ojson::parse(
      R"({"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": true})"));
  EXPECT_FALSE(r.ok());
}

TEST(MaxTokenBytes, TheLongestTokenOrAddedTokenContent) {
  const Tokenizer tok = Tokenizer::load(kModelDir).value();
  size_t longest = 0;
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    longest = std::max(longest, tok.id_to_bytes(id).size());
  }
  EXPECT_GE(tok.max_token_bytes(), longest);
  EXPECT_GE(tok.max_token_bytes(), std::string("<|im_start|>").size());
  // The bound holds: no text makes fewer tokens than its bytes over it.
  for (const std::string& text :
       {std::string(5000, ' '), std::string(3000, '='), std::string("<|im_end|>") + "x",
        std::string(2000, 'a') + "\xe6\x9f\xb1"}) {
    const size_t n = tok.encode(text).value().size();
    EXPECT_GE(n * tok.max_token_bytes(), text.size());
  }
  // An added token is matched on its content, which may be longer than what it decodes to:
  // "Ġ" is two bytes of text, and a space (one byte) decoded.
  const std::string json = R"({"version": "1.0", "normalizer": null,
      "added_tokens": [{"id": 2, "content": "ĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ", "special": false,
        "normalized": false, "lstrip": false, "rstrip": false, "single_word": false}],
      "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
      "decoder": {"type": "ByteLevel"},
      "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [], "unk_token": null}})";
  const Tokenizer small = Tokenizer::from_json_text(json, "test").value();
  EXPECT_EQ(small.id_to_bytes(2), std::string(16, ' '));
  EXPECT_EQ(small.max_token_bytes(), std::string("ĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ").size());
  EXPECT_EQ(small.encode("ĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ").value(), std::vector<int32_t>{2});
  // Normalization may shorten a text before it is split (NFC composes 9 bytes of Hangul jamo
  // into one 3-byte syllable), so a normalizing tokenizer's bound allows for it.
  std::string nfc = json;
  nfc.replace(nfc.find(R"("normalizer": null)"), 18, R"("normalizer": {"type": "NFC"})");
  const Tokenizer composing = Tokenizer::from_json_text(nfc, "test").value();
  EXPECT_EQ(composing.max_token_bytes(), 4 * std::string("ĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ").size());
}

}  // namespace
}  // namespace recur
