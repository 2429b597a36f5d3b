// Forced tool calls by constrained decoding (tool_call_grammar.h): the grammar's matcher byte by
// byte (a named call's arguments then the call's close; a required call's name among the
// tools'), the constraint on Qwen's vocabulary (tokens that end the arguments and begin the
// close at once), and the requests of each API that carry it.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "call_matcher_test_util.h"
#include "request_test_util.h"
#include "server/json_constraint.h"
#include "server/output_parser.h"
#include "server/output_test_util.h"
#include "server/request.h"
#include "server/tool_call_grammar.h"

namespace recur::server {
namespace {

const char* const kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": false}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}},
  {"type": "function", "function": {"name": "get_tide"}},
  {"type": "function", "function": {"name": "get_moon", "parameters": {"type": "object",
    "properties": {"day": {"type": "integer", "minimum": 1}}}}}])";

std::shared_ptr<const ToolCallGrammar> grammar(std::string_view name, bool more_calls = false) {
  auto g = json_call_grammar(ojson::parse(kTools), name, more_calls);
  EXPECT_TRUE(g);
  return g;
}

size_t taken(const ToolCallGrammar& g, std::string_view text, bool* whole = nullptr) {
  return bytes_taken<ToolCallMatcher>(g, text, whole);
}

// The ids of `text` (a copy: a loop over encode(...).value() would outlive its result).
std::vector<int32_t> ids_of(const Tokenizer& tok, const std::string& text) {
  return tok.encode(text).value();
}

bool whole_calls(const ToolCallGrammar& g, std::string_view text) {
  return whole_calls_of<ToolCallMatcher>(g, text);
}

TEST(ToolCallGrammar, ANamedCallIsItsArgumentsThenTheClose) {
  const auto g = grammar("get_weather");
  EXPECT_EQ(g->primed, R"({"name": "get_weather", "arguments": {)");
  EXPECT_TRUE(whole_calls(*g, R"("city": "Paris", "days": 3}})"
                              "\n</tool_call>"));
  EXPECT_TRUE(whole_calls(*g, R"( "days": 12 ,"city":"Tokyo" }  })"
                              "\n</tool_call>"));
  // Cut anywhere, a prefix; whole only at the end of the close.
  const std::string text = R"("city": "Paris", "days": 3}})"
                           "\n</tool_call>";
  for (size_t cut = 0; cut < text.size(); ++cut) {
    bool whole = true;
    EXPECT_EQ(taken(*g, text.substr(0, cut), &whole), cut);
    EXPECT_FALSE(whole) << cut;
  }
  // Refused where the schema or the close is broken.
  for (const auto& [bad, at] : {
           std::pair{std::string(R"("city": "Rome")"), 9},      // not in the enum
           std::pair{std::string(R"("city": "Paris"})"), 15},   // "days" missing
           std::pair{std::string(R"("days": 1.5)"), 9},         // an integer
           std::pair{std::string(R"("days": 1, "x": 2)"), 12},  // closed properties
           std::pair{std::string(R"("days": 1, "city": "Paris"}})"
                                 "\n\n"),
                     29},
           std::pair{std::string(R"("days": 1, "city": "Paris"}})"
                                 "\n</tool_call>\n"),
                     41},
           std::pair{std::string(R"("days": 1, "city": "Paris"}] )"), 27},
       }) {
    EXPECT_EQ(taken(*g, bad), size_t(at)) << bad;
  }
}

TEST(ToolCallGrammar, TheCloseTagNeverStandsInsideTheArguments) {
  // The output parser ends a call at the first "</tool_call>": a string may not hold it (its
  // escaped spelling is fine).
  const auto g = grammar("get_time");
  const std::string open = R"("zone": "</tool_call)";
  EXPECT_EQ(taken(*g, open + ">\"}}"), open.size());
  EXPECT_TRUE(whole_calls(*g, R"("zone": "<\/tool_call>"}})"
                              "\n</tool_call>"));
  EXPECT_TRUE(whole_calls(*g, R"("zone": "<</tool_cal"}})"
                              "\n</tool_call>"));
}

TEST(ToolCallGrammar, ARequiredCallNamesOneOfTheTools) {
  const auto g = grammar("");
  EXPECT_EQ(g->primed, "");
  EXPECT_EQ(g->branches.size(), 4u);
  EXPECT_TRUE(whole_calls(*g, R"({"name": "get_time", "arguments": {"zone": "UTC"}})"
                              "\n</tool_call>"));
  // A name that is none of them, or a tool's name with another's arguments.
  EXPECT_EQ(taken(*g, R"({"name": "get_wind")"), 15u);
  EXPECT_EQ(taken(*g, R"({"name": "get_time", "arguments": {"zone": 5}})"), 43u);
  EXPECT_EQ(taken(*g, R"({"name": "get_time", "arguments": 3)"), 34u);   // an object
  EXPECT_EQ(taken(*g, R"({"arguments": {}, "name": "get_time"})"), 2u);  // name first
  // A tool without parameters, or with keywords the compiler refuses ("minimum"), takes any
  // object: the call still parses.
  EXPECT_TRUE(whole_calls(*g, R"({"name": "get_tide", "arguments": {"a": [1, {"b": null}]}})"
                              "\n</tool_call>"));
  EXPECT_TRUE(whole_calls(*g, R"({"name": "get_moon", "arguments": {"day": -4}})"
                              "\n</tool_call>"));
  // One call, unless more may follow (required with parallel calls).
  const std::string two = R"({"name": "get_tide", "arguments": {}})"
                          "\n</tool_call>\n<tool_call>\n"
                          R"({"name": "get_time", "arguments": {"zone": "UTC"}})"
                          "\n</tool_call>";
  EXPECT_EQ(taken(*g, two), 37u + 13u);
  const auto more = grammar("", true);
  EXPECT_TRUE(whole_calls(*more, two));
  bool whole = true;
  EXPECT_EQ(taken(*more, two.substr(0, 52), &whole), 52u);
  EXPECT_FALSE(whole) << "a second call begun must be finished";
  // A named call is one call, whatever parallel_tool_calls says.
  EXPECT_TRUE(grammar("get_time", true)->repeat.empty());
}

// What the grammar accepts is what the output parser reads as that call: the same close tag,
// and arguments that parse.
TEST(ToolCallGrammar, WholeCallsAreTheCallsTheParserReads) {
  for (const char* name : {"get_weather", ""}) {
    const auto g = grammar(name, true);
    OutputOptions o;
    o.parse_tools = true;
    o.forced_prefix = forced_call_prefix(ToolCallFormat::kJson, name);
    const std::string text =
        *name ? R"("days": 2, "city": "Tokyo"} })"
                "\n</tool_call>"
              : R"({"name": "get_weather", "arguments": {"days": 2, "city": "Tokyo"}})"
                "\n</tool_call>\n<tool_call>\n"
                R"({"name": "get_tide", "arguments": {}})"
                "\n</tool_call>";
    ASSERT_TRUE(whole_calls(*g, text)) << text;
    OutputParser p(o);
    std::vector<Segment> out;
    p.push(text, &out);
    p.finish(&out);
    const FlatOutput f = flatten(out);
    ASSERT_EQ(f.calls.size(), *name ? 1u : 2u);
    EXPECT_EQ(f.content, "");
    EXPECT_EQ(f.calls[0].name, "get_weather");
    EXPECT_FALSE(f.calls[0].cut);
    EXPECT_EQ(ojson::parse(f.calls[0].arguments), ojson::parse(R"({"days": 2, "city": "Tokyo"})"));
  }
}

// On Qwen's vocabulary: a token may end the arguments and begin the close ("}}\n"), mask()
// keeps exactly the tokens allows() admits, and the end token only once the call is whole.
TEST(ToolCallConstraint, TokensStraddleTheArgumentsAndTheClose) {
  const ChatFixture& fx = chat_fixture(kRealVocabModel);
  const Tokenizer* tok = &fx.tok;
  const int32_t eos = *tok->token_to_id("<|im_end|>");
  const auto id = [&](const char* text) {
    const auto ids = tok->encode(text).value();
    EXPECT_EQ(ids.size(), 1u) << text;
    return ids[0];
  };
  const auto spec = tool_call_constraint(grammar("get_weather"), fx.vocab, {eos});
  auto con = spec->start();
  for (int32_t t : ids_of(*tok, R"("city": "Paris", "days": 3)")) {
    ASSERT_TRUE(con->allows(t));
    con->accept(t);
  }
  EXPECT_TRUE(con->allows(id("}}\n")));
  EXPECT_TRUE(con->allows(id("}}")));
  EXPECT_TRUE(con->allows(id("}\n"))) << "the arguments' close, then whitespace after them";
  EXPECT_FALSE(con->allows(id("}}\n\n"))) << "the close tag follows the newline";
  EXPECT_FALSE(con->allows(eos));
  con->accept(id("}}\n"));
  EXPECT_FALSE(con->allows(eos));
  EXPECT_FALSE(con->allows(id("}")));
  EXPECT_TRUE(con->allows(id("</tool_call>")));
  con->accept(id("</tool_call>"));
  EXPECT_TRUE(con->allows(eos));
  EXPECT_FALSE(con->allows(id("\n")));
  // Inside a string of the arguments, the close tag's own token is refused though the
  // string's fast path takes every other token free of quotes and backslashes.
  auto in_string = tool_call_constraint(grammar("get_time"), fx.vocab, {eos})->start();
  for (int32_t t : ids_of(*tok, R"("zone": "ab)")) in_string->accept(t);
  const int V = tok->vocab_size() + 64;
  std::vector<float> logits(size_t(V), 1.0f);
  in_string->mask(logits);
  EXPECT_EQ(logits[size_t(id("</tool_call>"))], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(logits[size_t(id("abc"))], 1.0f);
}

TEST(ToolCallConstraint, MaskKeepsExactlyTheTokensAllowsAdmits) {
  const ChatFixture& fx = chat_fixture(kRealVocabModel);
  const Tokenizer* tok = &fx.tok;
  const int32_t eos = *tok->token_to_id("<|im_end|>");
  const int V = tok->vocab_size() + 64;
  std::vector<float> logits(static_cast<size_t>(V));
  struct Case {
    const char* name;
    std::vector<const char*> prefixes;  // after the primed text
  };
  const Case cases[] = {
      {"get_weather",
       {"", R"("city": "Pa)", R"("city": "Paris", "days": 3)", R"("city": "Paris", "days": 3})",
        "\"days\": 3, \"city\": \"Tokyo\"}}\n</"}},
      {"get_time", {R"("zone": "ab)", R"("zone": "ab<)", R"("zone": "</tool_call)"}},
      {"",
       {"", R"({"name": "get_t)", R"({"name": "get_tide", "arguments": {)",
        "{\"name\": \"get_tide\", \"arguments\": {}}\n</tool_call>"}},
  };
  for (const Case& c : cases) {
    const auto spec = tool_call_constraint(grammar(c.name, true), fx.vocab, {eos});
    for (const char* prefix : c.prefixes) {
      const MaskAgreement m =
          mask_agreement(*spec, ids_of(*tok, prefix), tok->vocab_size(), eos, &logits);
      ASSERT_TRUE(m.fed) << prefix;
      EXPECT_EQ(m.differ, 0) << c.name << " after " << prefix;
      EXPECT_GT(m.kept, 0) << prefix;
      const bool whole = std::string(prefix).ends_with("</tool_call>");
      EXPECT_EQ(m.eos_kept, whole) << prefix;
    }
  }
}

// The requests of each API that force a call carry its constraint; formats without a grammar
// and a response format beside a forced call are as before.
TEST(ToolCallConstraint, ForcedCallsOfEachApiCarryTheirConstraint) {
  const ServingContext c = tiny_context(chat_fixture(kRealVocabModel));
  const std::string tools = std::string(R"("tools": )") + kTools;
  const int32_t brace = c.tokenizer->encode("{").value()[0];
  const int32_t quote = c.tokenizer->encode("\"").value()[0];
  const auto chat = [&](const std::string& extra) {
    return parse_chat_request(
        ojson::parse(R"({"messages": [{"role": "user", "content": "hi"}], )" + tools + extra + "}"),
        c);
  };
  auto named = chat(R"(, "tool_choice": {"type": "function", "function": {"name": "get_time"}})");
  ASSERT_TRUE(named.ok()) << named.error().message;
  ASSERT_TRUE(named->engine.constraint);
  EXPECT_TRUE(named->engine.constraint->start()->allows(quote));  // "zone" comes next
  EXPECT_FALSE(named->engine.constraint->start()->allows(brace));
  auto required = chat(R"(, "tool_choice": "required")");
  ASSERT_TRUE(required.ok()) << required.error().message;
  ASSERT_TRUE(required->engine.constraint);
  EXPECT_TRUE(required->engine.constraint->start()->allows(brace));
  EXPECT_FALSE(required->engine.constraint->start()->allows(quote));
  auto automatic = chat("");
  ASSERT_TRUE(automatic.ok());
  EXPECT_FALSE(automatic->engine.constraint);
  auto with_format =
      chat(R"(, "tool_choice": "required", "response_format": {"type": "json_object"})");
  ASSERT_FALSE(with_format.ok());
  EXPECT_EQ(with_format.error().param, "response_format");

  auto anthropic = parse_messages_request(
      J(R"({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object",
              "properties": {"n": {"type": "integer"}}, "required": ["n"]}}],
            "tool_choice": {"type": "tool", "name": "f"}})"),
      c);
  ASSERT_TRUE(anthropic.ok()) << anthropic.error().message;
  ASSERT_TRUE(anthropic->engine.constraint);
  EXPECT_FALSE(anthropic->engine.constraint->start()->allows(brace));
  auto responses = parse_responses_request(
      J(R"({"input": "hi", "tool_choice": "required", "tools": [{"type": "function",
            "name": "f", "parameters": {"type": "object"}}]})"),
      c);
  ASSERT_TRUE(responses.ok()) << responses.error().message;
  ASSERT_TRUE(responses->engine.constraint);
  EXPECT_FALSE(responses->engine.constraint->start()->allows(quote));

  // Kimi's sections where the vocabulary has no marker tokens (no kimi_vocab_bytes): forced by
  // their prefix alone (test_tool_call_kimi.cpp and test_tool_call_xml.cpp have the grammars).
  ServingContext kimi_ctx = c;
  kimi_ctx.tool_format = ToolCallFormat::kKimi;
  auto k = parse_chat_request(ojson::parse(R"({"messages": [{"role": "user", "content": "hi"}], )" +
                                           tools + R"(, "tool_choice": "required"})"),
                              kimi_ctx);
  ASSERT_TRUE(k.ok()) << k.error().message;
  EXPECT_TRUE(k->output.forced_prefix.ends_with("<|tool_call_begin|>functions."));
  EXPECT_FALSE(k->engine.constraint);
}

// A template that leaves the model thinking (Qwen3's thinking models open <think> and write
// JSON calls; the shipped one that opens it is Qwen3.5's, read here with JSON calls): the forced
// prefix closes the reasoning in the prompt, so the call's constraint holds from the first token.
TEST(ToolCallConstraint, AfterAnOpenReasoningTheCallStartsAtOnce) {
  ServingContext c =
      tiny_context(chat_fixture(std::string(RECUR_SOURCE_DIR) + "/tests/data/qwen3_5-chat-tiny"));
  c.tool_format = ToolCallFormat::kJson;
  auto r = parse_chat_request(
      ojson::parse(std::string(R"({"messages": [{"role": "user", "content": "hi"}], "tools": )") +
                   kTools + R"(, "tool_choice": "required"})"),
      c);
  ASSERT_TRUE(r.ok()) << r.error().message;
  ASSERT_TRUE(r->output.start_in_reasoning);
  EXPECT_TRUE(r->output.forced_prefix.starts_with("\n</think>\n\n<tool_call>\n"));
  ASSERT_TRUE(r->engine.constraint);
  auto con = r->engine.constraint->start();
  EXPECT_FALSE(con->allows(c.tokenizer->encode("Sure").value()[0]));
  EXPECT_TRUE(con->allows(c.tokenizer->encode("{").value()[0]));
}

}  // namespace
}  // namespace recur::server
