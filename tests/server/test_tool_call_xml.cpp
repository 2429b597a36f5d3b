// Forced tool calls in Qwen3.5's XML form by constrained decoding (tool_call_xml.h): the
// grammar's matcher byte by byte (function and parameter names, required parameters, typed and
// free values, the close tags, more calls), whole calls against the output parser, the
// constraint on Qwen's vocabulary (tokens across tags; mask() against allows()), and the
// requests of each API that carry it.
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
#include "server/tool_call_xml.h"
#include "tokenizer/utf8_util.h"

namespace recur::server {
namespace {

const char* const kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Par"]},
      "days": {"type": "integer", "minimum": 1}, "note": {"type": "string", "maxLength": 5},
      "units": {"type": "object", "properties": {"temp": {"enum": ["C", "F"]}},
                "required": ["temp"], "additionalProperties": false},
      "hourly": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
      "bad>name": {"type": "string"}},
    "required": ["city", "days", "bad>name"]}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
    "properties": {"zone": {"type": "string", "minLength": 1}}, "required": ["zone"]}}},
  {"type": "function", "function": {"name": "log", "parameters": {"type": "object"}}},
  {"type": "function", "function": {"name": "ping",
    "parameters": {"type": "object", "properties": {}}}},
  {"type": "function", "function": {"name": "bad name "}}])";

const std::string kClose = "</function>\n</tool_call>";

std::shared_ptr<const XmlCallGrammar> grammar(std::string_view name, bool more_calls = false) {
  auto g = xml_call_grammar(ojson::parse(kTools), name, more_calls);
  EXPECT_TRUE(g);
  return g;
}

// `<parameter=NAME>\nVALUE\n</parameter>\n`, as the template writes it.
std::string param(std::string_view name, std::string_view value) {
  return "<parameter=" + std::string(name) + ">\n" + std::string(value) + "\n</parameter>\n";
}

size_t taken(const XmlCallGrammar& g, std::string_view text, bool* whole = nullptr) {
  return bytes_taken<XmlCallMatcher>(g, text, whole);
}

bool whole_calls(const XmlCallGrammar& g, std::string_view text) {
  return whole_calls_of<XmlCallMatcher>(g, text);
}

// Whether `good` is taken and the first byte of `bad` after it refused.
::testing::AssertionResult refused_after(const XmlCallGrammar& g, const std::string& good,
                                         const std::string& bad) {
  const size_t n = taken(g, good + bad);
  if (n == good.size()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "took " << n << " bytes of " << good.size() << "+" << bad.size() << ": " << good + bad;
}

TEST(XmlCallGrammar, ToolsAndPropertiesTheFormCannotCarryAreLeftOut) {
  const auto g = grammar("");
  std::vector<std::string> heads;
  for (const auto& f : g->functions) heads.push_back(f.head);
  EXPECT_EQ(heads,
            (std::vector<std::string>{"get_time>\n", "get_weather>\n", "log>\n", "ping>\n"}));
  EXPECT_FALSE(xml_call_grammar(ojson::parse(kTools), "bad name ", false));
  const XmlCallGrammar::Function& w = g->functions[1];
  std::vector<std::string> params;
  for (const auto& p : w.params) params.push_back(p.head);
  EXPECT_EQ(params, (std::vector<std::string>{"city>\n", "days>\n", "hourly>\n", "note>\n",
                                              "tags>\n", "units>\n"}));
  EXPECT_EQ(w.required, 0b11u) << "city and days; bad>name cannot be written";
  using Kind = XmlCallGrammar::Value::Kind;
  EXPECT_EQ(w.params[0].value.kind, Kind::kChoice);
  EXPECT_EQ(w.params[0].value.choices, (std::vector<std::string>{"Par", "Paris", "Tokyo"}));
  EXPECT_EQ(w.params[1].value.kind, Kind::kJson) << "an integer, whatever its minimum";
  EXPECT_EQ(w.params[2].value.kind, Kind::kJson);
  EXPECT_EQ(w.params[3].value.kind, Kind::kText);
  EXPECT_EQ(w.params[3].value.max_chars, 5u);
  EXPECT_EQ(w.params[4].value.kind, Kind::kJson);
  EXPECT_EQ(w.params[5].value.kind, Kind::kJson);
  EXPECT_TRUE(g->functions[2].free_names);
  EXPECT_FALSE(g->functions[3].free_names);
  EXPECT_TRUE(g->functions[3].params.empty());
  // An enum the parser would read back otherwise ("1" as a number) is free text.
  const auto odd = xml_call_grammar(ojson::parse(R"([{"type": "function", "function": {"name":
      "f", "parameters": {"properties": {"a": {"enum": ["1", "x"]}, "b": {"const": 5},
      "c": {"type": ["integer", "string"]}}}}}])"),
                                    "f", false);
  ASSERT_TRUE(odd);
  const auto& p = odd->functions[0].params;
  EXPECT_EQ(p[0].value.kind, Kind::kText);
  EXPECT_EQ(p[1].value.kind, Kind::kChoice);
  EXPECT_EQ(p[1].value.choices, std::vector<std::string>{"5"});
  EXPECT_EQ(p[2].value.kind, Kind::kText) << "a string is written bare";
  // The choices are the values structured outputs allow: of the type, and only const's.
  const auto typed = xml_call_grammar(ojson::parse(R"([{"type": "function", "function": {"name":
      "f", "parameters": {"properties": {"a": {"type": "string", "enum": [1, "x", "y"]},
      "b": {"enum": ["p", "q"], "const": "q"}}}}}])"),
                                      "f", false);
  ASSERT_TRUE(typed);
  const auto& t = typed->functions[0].params;
  EXPECT_EQ(t[0].value.kind, Kind::kChoice);
  EXPECT_EQ(t[0].value.choices, (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(t[1].value.kind, Kind::kChoice);
  EXPECT_EQ(t[1].value.choices, std::vector<std::string>{"q"});
}

TEST(XmlCallGrammar, ANamedCallIsItsParametersThenTheClose) {
  const auto g = grammar("get_weather");
  EXPECT_EQ(g->primed, "get_weather>\n");
  const std::string call = param("city", "Paris") + param("days", "3") + kClose;
  EXPECT_TRUE(whole_calls(*g, call));
  EXPECT_TRUE(whole_calls(*g, param("days", "12") + param("hourly", "false") +
                                  param("units", R"({"temp": "F"})") + param("city", "Par") +
                                  param("note", "héllo") + param("tags", "[]") + kClose));
  // Cut anywhere, a prefix; whole only at the end of the close.
  for (size_t cut = 0; cut < call.size(); ++cut) {
    bool whole = true;
    EXPECT_EQ(taken(*g, call.substr(0, cut), &whole), cut);
    EXPECT_FALSE(whole) << cut;
  }
  const std::string city = param("city", "Tokyo");
  EXPECT_TRUE(refused_after(*g, "<parameter=", "wind>"));
  EXPECT_TRUE(refused_after(*g, "<parameter=", "bad>name>"));
  EXPECT_TRUE(refused_after(*g, city + "<parameter=", "city>")) << "a parameter given twice";
  EXPECT_TRUE(refused_after(*g, city + "<", "/function>")) << "days is required";
  EXPECT_TRUE(refused_after(*g, "<", "/function>"));
  EXPECT_TRUE(refused_after(*g, "<parameter=city>\n", "Rome"));
  EXPECT_TRUE(refused_after(*g, "<parameter=city>\nPari", "\n")) << "neither Par nor Paris";
  EXPECT_TRUE(refused_after(*g, "<parameter=days>\n1", ".5")) << "an integer";
  EXPECT_TRUE(refused_after(*g, "<parameter=days>\n", "\n</parameter>")) << "a value";
  EXPECT_TRUE(refused_after(*g, "<parameter=hourly>\n", "True")) << "JSON's spelling";
  // No space around a JSON value; an integer that the parser reads back as one (64 bits).
  EXPECT_TRUE(refused_after(*g, "<parameter=days>\n", " 1"));
  EXPECT_TRUE(refused_after(*g, "<parameter=days>\n1", " "));
  EXPECT_TRUE(refused_after(*g, "<parameter=units>\n{\"temp\": \"C\"}", " "));
  EXPECT_TRUE(whole_calls(*g, param("units", "{ \"temp\" :\n\"C\" }") + city +
                                  param("days", "-999999999999999999") + kClose));
  EXPECT_TRUE(refused_after(*g, "<parameter=days>\n9999999999999999999", "9"));
  EXPECT_TRUE(refused_after(*g, "<parameter=days>\n-999999999999999999", "9"));
  EXPECT_TRUE(refused_after(*g, "<parameter=units>\n", R"("C")"));
  EXPECT_TRUE(refused_after(*g, "<parameter=units>\n{", "}")) << "temp is required";
  EXPECT_TRUE(refused_after(*g, "<parameter=note>\nabcde", "f"));
  EXPECT_TRUE(refused_after(*g, "<parameter=note>\nabcde\n", "\n")) << "6 characters";
  EXPECT_TRUE(whole_calls(*g, param("note", "ééééé") + city + param("days", "1") + kClose));
  // The template's newlines and nothing else between the tags.
  EXPECT_TRUE(refused_after(*g, city, "\n"));
  EXPECT_TRUE(refused_after(*g, "<parameter=city>\nTokyo\n</parameter>", " "));
  EXPECT_TRUE(refused_after(*g, "<parameter=city>", "Tokyo"));
  EXPECT_TRUE(refused_after(*g, city + param("days", "1") + "</function>", "</tool_call>"));
  EXPECT_TRUE(refused_after(*g, call, "\n")) << "one call";
}

TEST(XmlCallGrammar, ParametersComeInAnyOrderEachOnce) {
  const auto g = grammar("get_weather");
  const std::vector<std::string> all = {
      param("city", "Paris"), param("days", "3"),       param("hourly", "true"),
      param("note", "hi"),    param("tags", "[\"a\"]"), param("units", "{\"temp\":\"C\"}")};
  for (size_t shift = 0; shift < all.size(); ++shift) {
    std::string text;
    for (size_t i = 0; i < all.size(); ++i) text += all[(i + shift) % all.size()];
    EXPECT_TRUE(whole_calls(*g, text + kClose)) << text;
    // Every parameter given: only the close may come.
    EXPECT_TRUE(refused_after(*g, text + "<", "p"));
  }
  EXPECT_TRUE(
      refused_after(*g, param("days", "3") + param("city", "Par") + "<parameter=", "days>"));
  EXPECT_TRUE(whole_calls(*g, param("days", "3") + param("city", "Par") + kClose));
}

TEST(XmlCallGrammar, ValuesNeverHoldTheCloseTag) {
  // The output parser ends a value at the first "</parameter>": a value may hold all but that
  // (other tags included), and the tag closes it only after the template's newline.
  const auto g = grammar("get_time");
  EXPECT_TRUE(refused_after(*g, "<parameter=zone>\nUTC</parameter", ">"));
  EXPECT_TRUE(refused_after(*g, "<parameter=zone>\n</parameter", ">"));
  EXPECT_TRUE(
      whole_calls(*g, param("zone", "a\n</parameterx </tool_call> <parameter=b>") + kClose));
  EXPECT_TRUE(whole_calls(*g, param("zone", "a\n\n<</parameter") + kClose));
  EXPECT_TRUE(refused_after(*g, "<parameter=zone>\n\n</parameter", ">")) << "minLength 1";
  EXPECT_TRUE(refused_after(*g, "<parameter=zone>\n", "\xff")) << "UTF-8";
  EXPECT_TRUE(refused_after(*g, "<parameter=zone>\n\xc3", "(")) << "UTF-8";
  // Inside JSON, only in its strings: escaped there, it is fine.
  const auto w = grammar("get_weather");
  EXPECT_TRUE(refused_after(*w, "<parameter=tags>\n[\"</parameter", ">"));
  EXPECT_TRUE(whole_calls(*w, param("tags", R"(["<\/parameter>", "</parameter"])") +
                                  param("city", "Par") + param("days", "1") + kClose));
}

TEST(XmlCallGrammar, ARequiredCallNamesOneOfTheTools) {
  const auto g = grammar("");
  EXPECT_EQ(g->primed, "");
  EXPECT_TRUE(whole_calls(*g, "get_time>\n" + param("zone", "UTC") + kClose));
  EXPECT_TRUE(whole_calls(*g, "ping>\n" + kClose));
  EXPECT_TRUE(refused_after(*g, "get_w", "ind"));
  EXPECT_TRUE(refused_after(*g, "get_time", "\n"));
  EXPECT_TRUE(refused_after(*g, "", "bad name >"));
  EXPECT_TRUE(refused_after(*g, "ping>\n<", "p")) << "no parameters";
  EXPECT_TRUE(refused_after(*g, "get_time>\n" + param("zone", "5") + "<", "parameter=city>"));
  // A tool whose schema lists no properties takes any names, each once.
  EXPECT_TRUE(whole_calls(*g, "log>\n" + param("a.b", "x") + param("ä", "{\"k\": 1}") + kClose));
  EXPECT_TRUE(refused_after(*g, "log>\n" + param("a.b", "x") + "<parameter=a.b", ">"));
  EXPECT_TRUE(refused_after(*g, "log>\n<parameter=", ">"));
  EXPECT_TRUE(refused_after(*g, "log>\n<parameter=a", " b>"));
  EXPECT_TRUE(refused_after(*g, "log>\n<parameter=a", "\n"));
  EXPECT_TRUE(refused_after(*g, "log>\n<parameter=a>", "x"));
  std::string many = "log>\n";
  for (int i = 0; i < XmlCallMatcher::kMaxFreeNames; ++i) many += param(std::to_string(i), "");
  EXPECT_TRUE(whole_calls(*g, many + kClose));
  EXPECT_TRUE(refused_after(*g, many + "<", "p"));
  // One call, unless more may follow (required with parallel calls).
  const std::string one = "ping>\n" + kClose;
  const std::string two =
      one + "\n<tool_call>\n<function=get_time>\n" + param("zone", "CET") + kClose;
  EXPECT_TRUE(refused_after(*g, one, "\n"));
  const auto more = grammar("", true);
  EXPECT_EQ(more->repeat, "\n<tool_call>\n<function=");
  EXPECT_TRUE(whole_calls(*more, two));
  bool whole = true;
  EXPECT_EQ(taken(*more, two.substr(0, one.size() + 25), &whole), one.size() + 25);
  EXPECT_FALSE(whole) << "a second call begun must be finished";
  EXPECT_TRUE(refused_after(*more, one + "\n", "\n"));
  // A named call is one call, whatever parallel_tool_calls says.
  EXPECT_TRUE(grammar("get_time", true)->repeat.empty());
}

// What the grammar accepts is what the output parser reads as those calls, typed as the schema
// says.
TEST(XmlCallGrammar, WholeCallsAreTheCallsTheParserReads) {
  OutputOptions o;
  o.parse_tools = true;
  o.tool_format = ToolCallFormat::kXml;
  o.tools = std::make_shared<const ojson>(ojson::parse(kTools));
  const std::string weather = param("days", "4") + param("city", "Par") + param("hourly", "false") +
                              param("units", "{\"temp\": \"C\"}") + param("note", "é <b>") +
                              param("tags", "[\"x\"]") + kClose;
  const ojson weather_args = ojson::parse(
      R"({"days": 4, "city": "Par", "hourly": false, "units": {"temp": "C"}, "note": "é <b>",
          "tags": ["x"]})");
  for (const char* name : {"get_weather", ""}) {
    const auto g = grammar(name, true);
    o.forced_prefix = forced_call_prefix(ToolCallFormat::kXml, name);
    const std::string text = *name
                                 ? weather
                                 : "get_weather>\n" + weather + "\n<tool_call>\n<function=log>\n" +
                                       param("n", "\n2\n") + param("s", "") + kClose;
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
    EXPECT_EQ(ojson::parse(f.calls[0].arguments), weather_args);
    if (!*name) {
      EXPECT_EQ(f.calls[1].name, "log");
      EXPECT_EQ(ojson::parse(f.calls[1].arguments), ojson::parse(R"({"n": 2, "s": ""})"));
    }
  }
}

// Qwen's vocabulary, with tokens that hold the close tag added (string-safe ones, which a text
// value's fast path would take unchecked but for the recheck list).
std::shared_ptr<const VocabularyBytes> vocab_with(const VocabularyBytes& base,
                                                  const std::vector<std::string>& extra) {
  auto v = std::make_shared<VocabularyBytes>(base);
  for (const std::string& t : extra) {
    const int32_t id = int32_t(v->bytes.size());
    bool safe = !find_invalid_utf8(t).has_value();
    for (char c : t) safe = safe && uint8_t(c) >= 0x20 && c != '"' && c != '\\';
    size_t chars = 0;
    for (char c : t) chars += (uint8_t(c) & 0xC0) != 0x80;
    v->bytes.push_back(t);
    v->control.push_back(0);
    v->string_safe.push_back(safe);
    v->chars.push_back(safe ? uint16_t(chars) : 0);
    v->by_first[uint8_t(t[0])].push_back(id);
  }
  return v;
}

const std::vector<std::string> kCloseTokens = {"</parameter>", "ab</parameter>", "</parameter>x",
                                               "\n</parameter>\n"};

std::vector<int32_t> ids_of(const Tokenizer& tok, const std::string& text) {
  return tok.encode(text).value();
}

// On Qwen's vocabulary: tokens that end a value and begin a tag, or end a tag and begin the
// next; the close tag's own tokens in a text value; the end token only once the call is whole.
TEST(XmlCallConstraint, TokensStraddleValuesAndTags) {
  const ChatFixture& fx = chat_fixture(kRealVocabModel);
  const Tokenizer* tok = &fx.tok;
  const int32_t eos = *tok->token_to_id("<|im_end|>");
  const auto vocab = vocab_with(*fx.vocab, kCloseTokens);
  const int32_t base = int32_t(fx.vocab->bytes.size());
  const auto id = [&](const char* text) {
    const auto ids = tok->encode(text).value();
    EXPECT_EQ(ids.size(), 1u) << text;
    return ids[0];
  };
  auto con = xml_call_constraint(grammar("get_weather"), vocab, {eos})->start();
  for (int32_t t : ids_of(*tok, "<parameter=days>\n3")) {
    ASSERT_TRUE(con->allows(t));
    con->accept(t);
  }
  EXPECT_TRUE(con->allows(id("\n")));
  EXPECT_TRUE(con->allows(id("0")));
  EXPECT_FALSE(con->allows(id("\n\n")));
  EXPECT_TRUE(con->allows(base + 3)) << "the value's close, whole";
  con->accept(id("\n"));
  EXPECT_TRUE(con->allows(id("</")));
  EXPECT_FALSE(con->allows(id("3")));
  for (int32_t t : ids_of(*tok, "</parameter")) con->accept(t);
  EXPECT_TRUE(con->allows(id(">\n")));
  EXPECT_FALSE(con->allows(id(">\n\n")));
  EXPECT_FALSE(con->allows(eos));
  for (int32_t t : ids_of(*tok, ">\n" + param("city", "Paris") + "</function>\n")) {
    ASSERT_TRUE(con->allows(t));
    con->accept(t);
  }
  EXPECT_FALSE(con->allows(eos));
  EXPECT_TRUE(con->allows(id("</tool_call>")));
  con->accept(id("</tool_call>"));
  EXPECT_TRUE(con->allows(eos));
  EXPECT_FALSE(con->allows(id("\n")));

  // A text value: the string-safe close token is admitted only after the template's newline,
  // and whole (nothing before it or after it on the token).
  const int V = int(vocab->bytes.size()) + 64;
  std::vector<float> logits(static_cast<size_t>(V));
  for (const char* value : {"ab", "ab\n"}) {
    auto in_text = xml_call_constraint(grammar("get_time"), vocab, {eos})->start();
    for (int32_t t : ids_of(*tok, std::string("<parameter=zone>\n") + value)) in_text->accept(t);
    std::fill(logits.begin(), logits.end(), 1.0f);
    in_text->mask(logits);
    const bool after_newline = std::string(value).ends_with('\n');
    EXPECT_EQ(logits[size_t(base)] == 1.0f, after_newline) << value;
    EXPECT_EQ(in_text->allows(base), after_newline) << value;
    EXPECT_EQ(logits[size_t(base + 1)], -std::numeric_limits<float>::infinity()) << value;
    EXPECT_EQ(logits[size_t(base + 2)], -std::numeric_limits<float>::infinity()) << value;
    EXPECT_EQ(logits[size_t(id("abc"))], 1.0f);
    EXPECT_EQ(logits[size_t(id("\""))], 1.0f) << "quotes are text here";
  }
}

TEST(XmlCallConstraint, MaskKeepsExactlyTheTokensAllowsAdmits) {
  const ChatFixture& fx = chat_fixture(kRealVocabModel);
  const Tokenizer* tok = &fx.tok;
  const int32_t eos = *tok->token_to_id("<|im_end|>");
  const auto vocab = vocab_with(*fx.vocab, kCloseTokens);
  const int V = int(vocab->bytes.size()) + 64;
  std::vector<float> logits(static_cast<size_t>(V));
  struct Case {
    const char* name;
    std::vector<std::string> prefixes;  // after the primed text
  };
  const Case cases[] = {
      {"get_weather",
       {"", "<parameter=", "<parameter=ci", "<parameter=city>\nPa", "<parameter=city>\nPar",
        "<parameter=note>\nab", "<parameter=note>\nabcd", "<parameter=note>\nabcde",
        "<parameter=note>\nabc\n</param",
        "<parameter=units>\n{\"temp\": ", "<parameter=tags>\n[\"a</param", "<parameter=days>\n12",
        param("days", "1") + param("city", "Tokyo"),
        param("days", "1") + param("city", "Tokyo") + "</function>\n"}},
      {"get_time",
       {"<parameter=zone>\n", "<parameter=zone>\nx\n", "<parameter=zone>\n\"é",
        "<parameter=zone>\nx\n</parameter", "<parameter=zone>\nab</param"}},
      {"",
       {"", "get_t", "log>\n<parameter=a", "log>\n<parameter=a>\nb", "ping>\n" + kClose,
        "ping>\n" + kClose + "\n<tool_call>\n<function="}},
  };
  for (const Case& c : cases) {
    const auto spec = xml_call_constraint(grammar(c.name, true), vocab, {eos});
    for (const std::string& prefix : c.prefixes) {
      const MaskAgreement m =
          mask_agreement(*spec, ids_of(*tok, prefix), int(vocab->bytes.size()), eos, &logits);
      ASSERT_TRUE(m.fed) << prefix;
      EXPECT_EQ(m.differ, 0) << c.name << " after " << prefix;
      EXPECT_GT(m.kept, 0) << prefix;
      EXPECT_EQ(m.eos_kept, prefix.ends_with(kClose)) << prefix;
    }
  }
}

// The requests of each API that force a call in the XML form carry its constraint.
TEST(XmlCallConstraint, ForcedCallsOfEachApiCarryTheirConstraint) {
  ServingContext c =
      tiny_context(chat_fixture(std::string(RECUR_SOURCE_DIR) + "/tests/data/qwen3_5-chat-tiny"));
  c.tool_format = ToolCallFormat::kXml;
  const Tokenizer& tok = *c.tokenizer;
  const auto first = [&](const char* text) { return tok.encode(text).value()[0]; };
  // The tools a request may name: the API refuses "bad name " (tools[4]).
  ojson tools = ojson::parse(kTools);
  tools.erase(tools.begin() + 4);
  const auto chat = [&](const std::string& extra) {
    ojson body = J((R"({"messages": [{"role": "user", "content": "hi"}])" + extra + "}").c_str());
    body["tools"] = tools;
    return parse_chat_request(body, c);
  };
  auto named = chat(R"(, "tool_choice": {"type": "function", "function": {"name": "get_time"}})");
  ASSERT_TRUE(named.ok()) << named.error().message;
  EXPECT_TRUE(named->output.forced_prefix.ends_with("<function=get_time>\n"));
  ASSERT_TRUE(named->engine.constraint);
  EXPECT_TRUE(named->engine.constraint->start()->allows(first("<")));
  EXPECT_FALSE(named->engine.constraint->start()->allows(first("get")));
  auto required = chat(R"(, "tool_choice": "required")");
  ASSERT_TRUE(required.ok()) << required.error().message;
  ASSERT_TRUE(required->engine.constraint);
  EXPECT_TRUE(required->engine.constraint->start()->allows(first("get")));
  EXPECT_FALSE(required->engine.constraint->start()->allows(first("<")));
  EXPECT_FALSE(chat("")->engine.constraint);
  EXPECT_FALSE(chat(R"(, "tool_choice": "none")")->engine.constraint);

  auto anthropic = parse_messages_request(
      J(R"({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object",
              "properties": {"n": {"type": "integer"}}, "required": ["n"]}}],
            "tool_choice": {"type": "tool", "name": "f"}})"),
      c);
  ASSERT_TRUE(anthropic.ok()) << anthropic.error().message;
  ASSERT_TRUE(anthropic->engine.constraint);
  auto con = anthropic->engine.constraint->start();
  for (int32_t t : ids_of(tok, "<parameter=n>\n")) {
    ASSERT_TRUE(con->allows(t));
    con->accept(t);
  }
  EXPECT_FALSE(con->allows(first("x")));
  EXPECT_TRUE(con->allows(first("7")));
  auto responses = parse_responses_request(
      J(R"({"input": "hi", "tool_choice": "required", "tools": [{"type": "function",
            "name": "f", "parameters": {"type": "object"}}]})"),
      c);
  ASSERT_TRUE(responses.ok()) << responses.error().message;
  ASSERT_TRUE(responses->engine.constraint);
  EXPECT_TRUE(responses->engine.constraint->start()->allows(first("f")));
  EXPECT_FALSE(responses->engine.constraint->start()->allows(first("g")));
}

}  // namespace
}  // namespace recur::server
