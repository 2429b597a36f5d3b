// Forced tool calls in Kimi's call-section form by constrained decoding (tool_call_kimi.h): the
// grammar's matcher byte by byte, each marker its reserved byte (names, the index, arguments of
// the tool's schema that never hold a marker, the call's and the section's close, more calls),
// whole calls against the output parser, the vocabulary that reads marker tokens as those bytes,
// the constraint on Kimi's tokenizer (tests/data/kimi-tokenizer-tiny: mask() against allows(),
// markers only where the grammar has them), and the requests of each API that carry it.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "call_matcher_test_util.h"
#include "request_test_util.h"
#include "server/json_constraint.h"
#include "server/output_parser.h"
#include "server/output_test_util.h"
#include "server/request.h"
#include "server/tool_call_kimi.h"

namespace recur::server {
namespace {

using G = KimiCallGrammar;

const std::string kKimiDir = std::string(RECUR_SOURCE_DIR) + "/tests/data/kimi-tokenizer-tiny";
constexpr float kNone = -std::numeric_limits<float>::infinity();

const char* const kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": false}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}},
  {"type": "function", "function": {"name": "get_tide"}},
  {"type": "function", "function": {"name": "get_moon", "parameters": {"type": "object",
    "properties": {"day": {"type": "integer", "minimum": 1}}}}},
  {"type": "function", "function": {"name": "bad:name"}},
  {"type": "function", "function": {"name": "bad name"}},
  {"type": "function", "function": {"name": "a<b"}}])";

// A marker as the matcher reads it.
std::string M(G::Marker m) {
  return std::string(1, char(G::byte(m)));
}
const std::string kArgs = M(G::kArgsBegin), kEnd = M(G::kCallEnd), kClose = M(G::kSectionEnd);
const std::string kNext = M(G::kCallBegin) + "functions.";

std::shared_ptr<const KimiCallGrammar> grammar(std::string_view name, bool more_calls = false) {
  auto g = kimi_call_grammar(ojson::parse(kTools), name, more_calls);
  EXPECT_TRUE(g);
  return g;
}

size_t taken(const KimiCallGrammar& g, std::string_view text, bool* whole = nullptr) {
  return bytes_taken<KimiCallMatcher>(g, text, whole);
}

bool whole_calls(const KimiCallGrammar& g, std::string_view text) {
  return whole_calls_of<KimiCallMatcher>(g, text);
}

// The text the model's tokens spell: each marker byte its marker.
std::string spelt(std::string_view text) {
  std::string out;
  for (char c : text) {
    const int m = int(uint8_t(c)) - G::kMarkerByte;
    if (m >= 0 && m < int(G::kMarkers.size())) {
      out += G::kMarkers[size_t(m)];
    } else {
      out += c;
    }
  }
  return out;
}

// The ids of `text` (a copy: a loop over encode(...).value() would outlive its result).
std::vector<int32_t> ids_of(const Tokenizer& tok, const std::string& text) {
  return tok.encode(text).value();
}

TEST(KimiCallGrammar, ANamedCallIsItsIndexArgumentsAndTheCloses) {
  const auto g = grammar("get_weather");
  EXPECT_EQ(g->primed, "get_weather:");
  EXPECT_EQ(g->call_lead, "functions.");
  const std::string call = "0" + kArgs + R"({"city": "Paris", "days": 3})" + kEnd + kClose;
  EXPECT_TRUE(whole_calls(*g, call));
  EXPECT_TRUE(
      whole_calls(*g, "17" + kArgs + R"({ "days": 12 ,"city":"Tokyo" }  )" + kEnd + kClose));
  // Cut anywhere, a prefix; whole only after the section's close (not at the call's).
  for (size_t cut = 0; cut < call.size(); ++cut) {
    bool whole = true;
    EXPECT_EQ(taken(*g, call.substr(0, cut), &whole), cut);
    EXPECT_FALSE(whole) << cut;
  }
  // The index: digits, no leading zero, at most kMaxIndexDigits; then the arguments' marker and
  // at once their '{'.
  const std::string args = R"({"city": "Paris", "days": 3})";
  for (const auto& [bad, at] : {
           std::pair{kArgs + args, 0},                           // no index
           std::pair{"01" + kArgs, 1},                           // a leading zero
           std::pair{"1234567" + kArgs, 6},                      // seven digits
           std::pair{"1 " + kArgs, 1},                           // space
           std::pair{"1" + kArgs + " {", 2},                     // space before the object
           std::pair{"1" + kArgs + "[]", 2},                     // not an object
           std::pair{"1:" + kArgs, 1},                           // one index
           std::pair{"1" + kEnd, 1},                             // the arguments' marker first
           std::pair{"3" + kArgs + R"({"city": "Rome")", 12},    // not in the enum
           std::pair{"3" + kArgs + R"({"city": "Paris"})", 18},  // "days" missing
           std::pair{"3" + kArgs + args + kClose, 30},           // the call's close first
           std::pair{"3" + kArgs + args + kEnd + kEnd, 31},
           std::pair{"3" + kArgs + args + kEnd + "\n" + kClose, 31},  // nothing between
           std::pair{"3" + kArgs + args + kEnd + kClose + kClose, 32},
           std::pair{"3" + kArgs + args + kEnd + kClose + " ", 32},
       }) {
    EXPECT_EQ(taken(*g, bad), size_t(at)) << spelt(bad);
  }
  EXPECT_TRUE(whole_calls(*g, "123456" + kArgs + args + kEnd + kClose));
  // A named call is one call, whatever parallel_tool_calls says.
  EXPECT_FALSE(grammar("get_weather", true)->more_calls);
  EXPECT_EQ(taken(*grammar("get_weather", true), "3" + kArgs + args + kEnd + kNext), 31u);
}

// The parser finds markers in the text: a value may not hold any of them, neither as a marker
// token nor spelt out (the markers' common start, "<|tool_call", is refused; escaped it is fine).
TEST(KimiCallGrammar, MarkersNeverStandInsideTheArguments) {
  const auto g = grammar("get_time");
  const std::string open = "0" + kArgs;
  for (const std::string& inside :
       {std::string("{"), std::string(R"({"zo)"), std::string(R"({"zone")"),
        std::string(R"({"zone": )"), std::string(R"({"zone": "ab)"),
        std::string(R"({"zone": "")")}) {
    for (size_t m = 0; m < G::kMarkers.size(); ++m) {
      EXPECT_EQ(taken(*g, open + inside + M(G::Marker(m))), open.size() + inside.size())
          << spelt(inside) << " then marker " << m;
    }
  }
  // A whole value: its call's close, no other marker.
  const std::string whole = open + R"({"zone": "a"})";
  for (size_t m = 0; m < G::kMarkers.size(); ++m) {
    EXPECT_EQ(taken(*g, whole + M(G::Marker(m))), whole.size() + (m == G::kCallEnd)) << m;
  }
  const std::string text = open + R"({"zone": "a<|tool_call)";
  EXPECT_EQ(taken(*g, text), text.size() - 1);
  const std::string section = open + R"({"zone": "<|tool_calls_section_end|>)";
  EXPECT_EQ(taken(*g, section), open.size() + 20);
  EXPECT_TRUE(whole_calls(*g, open + R"({"zone": "<|tool_cal"})" + kEnd + kClose));
  EXPECT_TRUE(whole_calls(*g, open + R"({"zone": "<\u007ctool_call_end|>"})" + kEnd + kClose));
  // Bytes of no UTF-8 text are the markers'; a value takes none of them.
  EXPECT_EQ(taken(*g, open + "{\"zone\": \"\xFF"), open.size() + 10);
}

TEST(KimiCallGrammar, ARequiredCallNamesOneOfTheTools) {
  const auto g = grammar("");
  EXPECT_EQ(g->primed, "");
  // Names the id cannot carry (a ':', a space, '<') are left out.
  ASSERT_EQ(g->branches.size(), 4u);
  EXPECT_EQ(g->branches[0].head, "get_moon:");
  EXPECT_FALSE(kimi_call_grammar(ojson::parse(kTools), "bad:name", false));
  EXPECT_TRUE(whole_calls(*g, "get_time:4" + kArgs + R"({"zone": "UTC"})" + kEnd + kClose));
  EXPECT_EQ(taken(*g, "get_wind"), 5u);
  EXPECT_EQ(taken(*g, "get_time" + kArgs), 8u);  // the index first
  EXPECT_EQ(taken(*g, "bad:name:0"), 0u);
  EXPECT_EQ(taken(*g, "get_time:0" + kArgs + R"({"zone": 5})"), 20u);
  // A tool without parameters, or with keywords the compiler refuses ("minimum"), takes any
  // object: the call still parses.
  EXPECT_TRUE(whole_calls(*g, "get_tide:0" + kArgs + R"({"a": [1, {"b": null}]})" + kEnd + kClose));
  EXPECT_TRUE(whole_calls(*g, "get_moon:0" + kArgs + R"({"day": -4})" + kEnd + kClose));
  // One call, unless more may follow (required with parallel calls).
  const std::string first = "get_tide:0" + kArgs + "{}" + kEnd;
  const std::string two = first + kNext + "get_time:1" + kArgs + R"({"zone": "UTC"})" + kEnd;
  EXPECT_EQ(taken(*g, two + kClose), first.size());
  const auto more = grammar("", true);
  EXPECT_TRUE(whole_calls(*more, two + kClose));
  EXPECT_TRUE(whole_calls(*more, first + kClose));
  for (size_t cut = first.size() + 1; cut < two.size() + 1; ++cut) {
    bool whole = true;
    EXPECT_EQ(taken(*more, (two + kClose).substr(0, cut), &whole), cut);
    EXPECT_FALSE(whole) << "a second call begun must be finished: " << cut;
  }
  // A later call's index is the one before's plus one: no two ids of the turn are equal.
  for (const char* index : {"0", "2", "10", "01"}) {
    const std::string other = first + kNext + "get_time:" + index;
    const size_t at = first.size() + kNext.size() + 9 + (index[0] == '1' ? 1 : 0);
    EXPECT_EQ(taken(*more, other + kArgs), at) << index;
  }
  const std::string late = "get_tide:99" + kArgs + "{}" + kEnd;
  EXPECT_TRUE(whole_calls(*more, late + kNext + "get_tide:100" + kArgs + "{}" + kEnd + kClose));
  const std::string last = "get_tide:999999" + kArgs + "{}" + kEnd;
  EXPECT_TRUE(whole_calls(*more, last + kClose));
  EXPECT_EQ(taken(*more, last + kNext), last.size()) << "no index is left";
  EXPECT_EQ(taken(*more, first + kClose + kNext), first.size() + 1);
  EXPECT_EQ(taken(*more, first + M(G::kCallBegin) + "get_time"), first.size() + 1);
}

// What the grammar accepts, spelt out, is what the output parser reads as those calls, each
// with the model's id.
TEST(KimiCallGrammar, WholeCallsAreTheCallsTheParserReads) {
  for (const char* name : {"get_weather", ""}) {
    const auto g = grammar(name, true);
    OutputOptions o;
    o.parse_tools = true;
    o.tool_format = ToolCallFormat::kKimi;
    o.forced_prefix = forced_call_prefix(ToolCallFormat::kKimi, name);
    const std::string weather = R"({"days": 2, "city": "Tokyo"} )";
    const std::string text = *name
                                 ? "3" + kArgs + weather + kEnd + kClose
                                 : "get_weather:0" + kArgs + weather + kEnd + kNext + "get_tide:1" +
                                       kArgs + R"({"x": "<|tool_cal"})" + kEnd + kClose;
    ASSERT_TRUE(whole_calls(*g, text)) << spelt(text);
    OutputParser p(o);
    std::vector<Segment> out;
    p.push(spelt(text), &out);
    p.finish(&out);
    const FlatOutput f = flatten(out);
    ASSERT_EQ(f.calls.size(), *name ? 1u : 2u);
    EXPECT_EQ(f.content, "");
    EXPECT_EQ(f.calls[0].name, "get_weather");
    EXPECT_EQ(f.calls[0].id, *name ? "functions.get_weather:3" : "functions.get_weather:0");
    EXPECT_FALSE(f.calls[0].cut);
    EXPECT_EQ(ojson::parse(f.calls[0].arguments), ojson::parse(weather));
    if (!*name) {
      EXPECT_EQ(f.calls[1].id, "functions.get_tide:1");
      EXPECT_EQ(ojson::parse(f.calls[1].arguments), ojson::parse(R"({"x": "<|tool_cal"})"));
    }
  }
}

std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Kimi's tiny tokenizer with its config changed by `edit` (markers made special, tokens added).
Tokenizer kimi_tokenizer(const std::function<void(ojson&)>& edit) {
  ojson config = ojson::parse(file_text(kKimiDir + "/tokenizer_config.json"));
  edit(config);
  return Tokenizer::from_tiktoken(file_text(kKimiDir + "/tiktoken.model"), config.dump(), kKimiDir)
      .value();
}

// Each marker's token reads as its byte; a text token that spells markers whole reads them as
// their bytes; a token of a reserved byte is never admitted; the rest is the base vocabulary.
TEST(KimiCallVocabulary, MarkerTokensReadAsTheirBytes) {
  const ChatFixture& fx = chat_fixture(kKimiDir);
  const VocabularyBytes& base = *fx.vocab;
  const auto v = kimi_call_vocabulary(fx.tok, base);
  ASSERT_TRUE(v);
  ASSERT_EQ(v->bytes.size(), base.bytes.size());
  std::vector<int32_t> changed;
  for (size_t m = 0; m < G::kMarkers.size(); ++m) {
    const int32_t id = *fx.tok.token_to_id(G::kMarkers[m]);
    EXPECT_EQ(base.bytes[size_t(id)], G::kMarkers[m]);
    EXPECT_EQ(v->bytes[size_t(id)], M(G::Marker(m)));
    EXPECT_FALSE(v->control[size_t(id)]);
    EXPECT_FALSE(v->string_safe[size_t(id)]) << "a string's fast path must not take it";
    const auto& first = v->by_first[G::byte(G::Marker(m))];
    EXPECT_NE(std::find(first.begin(), first.end(), id), first.end());
    changed.push_back(id);
  }
  for (int b = G::kMarkerByte; b < 256; ++b) {  // o200k's byte tokens
    const auto it = std::find(base.bytes.begin(), base.bytes.end(), std::string(1, char(b)));
    ASSERT_NE(it, base.bytes.end()) << b;
    const size_t id = size_t(it - base.bytes.begin());
    if (b < G::kMarkerByte + int(G::kMarkers.size())) {
      EXPECT_TRUE(v->control[id]) << b;
      changed.push_back(int32_t(id));
    }
  }
  EXPECT_TRUE(v->control[size_t(*fx.tok.token_to_id("<|im_end|>"))]);
  for (size_t id = 0; id < base.bytes.size(); ++id) {
    if (std::find(changed.begin(), changed.end(), int32_t(id)) != changed.end()) continue;
    EXPECT_EQ(v->bytes[id], base.bytes[id]) << id;
    EXPECT_EQ(v->control[id], base.control[id]) << id;
    EXPECT_EQ(v->string_safe[id], base.string_safe[id]) << id;
  }
  // A vocabulary without the markers as tokens (Qwen's) has none: calls stay prefix-forced.
  const ChatFixture& qwen =
      chat_fixture(std::string(RECUR_SOURCE_DIR) + "/tests/data/qwen3_5-chat-tiny");
  EXPECT_FALSE(kimi_call_vocabulary(qwen.tok, *qwen.vocab));

  // Markers that are special tokens are admitted all the same; an added text token holding
  // the rest of a call reads its markers as their bytes.
  const std::string rest = "0<|tool_call_argument_begin|>{}<|tool_call_end|>";
  const Tokenizer tok = kimi_tokenizer([&](ojson& config) {
    for (auto& [key, entry] : config["added_tokens_decoder"].items()) {
      if (entry["content"].get<std::string>().starts_with(G::kMarkerStart)) entry["special"] = true;
    }
    config["added_tokens_decoder"]["1282"] = {{"content", rest}, {"special", false}};
  });
  const auto special = VocabularyBytes::build(tok);
  const int32_t call_end = *tok.token_to_id("<|tool_call_end|>");
  ASSERT_TRUE(special->control[size_t(call_end)]);
  const auto sv = kimi_call_vocabulary(tok, *special);
  ASSERT_TRUE(sv);
  EXPECT_FALSE(sv->control[size_t(call_end)]);
  EXPECT_EQ(sv->bytes[size_t(call_end)], kEnd);
  EXPECT_EQ(sv->bytes[1282], "0" + kArgs + "{}" + kEnd);
  EXPECT_FALSE(sv->string_safe[1282]);
}

// Kimi's tiny tokenizer: the markers are tokens (not special there), each admitted only where
// the grammar has it, and the end token only after the section's close.
TEST(KimiCallConstraint, MarkerTokensComeOnlyWhereTheGrammarHasThem) {
  const ChatFixture& fx = chat_fixture(kKimiDir);
  const Tokenizer& tok = fx.tok;
  const auto vocab = kimi_call_vocabulary(tok, *fx.vocab);
  const int32_t eos = *tok.token_to_id("<|im_end|>");
  const auto id = [&](std::string_view text) { return *tok.token_to_id(text); };
  const int32_t args = id(G::kMarkers[G::kArgsBegin]), end = id(G::kMarkers[G::kCallEnd]);
  const int32_t close = id(G::kMarkers[G::kSectionEnd]), next = id(G::kMarkers[G::kCallBegin]);
  const auto one = [&](const char* text) {
    const auto ids = tok.encode(text).value();
    EXPECT_EQ(ids.size(), 1u) << text;
    return ids[0];
  };
  const int V = tok.vocab_size() + 64;
  std::vector<float> logits(static_cast<size_t>(V));
  // Which of the markers and the end token mask() keeps.
  const auto kept = [&](TokenConstraint& con) {
    std::fill(logits.begin(), logits.end(), 1.0f);
    con.mask(logits);
    std::string k;
    for (int32_t t : {id(G::kMarkers[G::kSectionBegin]), close, next, args, end, eos}) {
      k += logits[size_t(t)] == 1.0f ? '1' : '0';
    }
    return k;
  };
  auto con = kimi_call_constraint(grammar("get_time"), vocab, {eos})->start();
  EXPECT_EQ(kept(*con), "000000");
  EXPECT_TRUE(con->allows(one("0")));
  EXPECT_FALSE(con->allows(args));
  con->accept(one("0"));
  EXPECT_EQ(kept(*con), "000100");
  EXPECT_FALSE(con->allows(one("0")));
  con->accept(args);
  for (int32_t t : ids_of(tok, R"({"zone": "ab)")) {
    EXPECT_EQ(kept(*con), "000000");
    ASSERT_TRUE(con->allows(t));
    con->accept(t);
  }
  // Inside a string: the string's fast path takes text tokens, never a marker's.
  EXPECT_EQ(kept(*con), "000000");
  EXPECT_EQ(logits[size_t(one("a"))], 1.0f);
  for (int32_t t : ids_of(tok, R"("})")) con->accept(t);
  EXPECT_EQ(kept(*con), "000010");
  EXPECT_TRUE(con->allows(end));
  EXPECT_FALSE(con->allows(eos));
  con->accept(end);
  EXPECT_EQ(kept(*con), "010000") << "one call: the section's close only";
  con->accept(close);
  EXPECT_EQ(kept(*con), "000001");
  EXPECT_TRUE(con->allows(eos));
  EXPECT_FALSE(con->allows(one("\n")));

  // Required with parallel calls: after a call, another or the close.
  auto more = kimi_call_constraint(grammar("", true), vocab, {eos})->start();
  EXPECT_FALSE(more->allows(one("0")));
  for (int32_t t : ids_of(tok, "get_tide:0<|tool_call_argument_begin|>{}<|tool_call_end|>")) {
    ASSERT_TRUE(more->allows(t));
    more->accept(t);
  }
  EXPECT_EQ(kept(*more), "011000");
  more->accept(next);
  EXPECT_EQ(kept(*more), "000000");
  EXPECT_TRUE(more->allows(one("f")));
}

TEST(KimiCallConstraint, MaskKeepsExactlyTheTokensAllowsAdmits) {
  const ChatFixture& fx = chat_fixture(kKimiDir);
  const Tokenizer& tok = fx.tok;
  const auto vocab = kimi_call_vocabulary(tok, *fx.vocab);
  const int32_t eos = *tok.token_to_id("<|im_end|>");
  const int V = tok.vocab_size() + 64;
  std::vector<float> logits(static_cast<size_t>(V));
  const std::string a = "<|tool_call_argument_begin|>", e = "<|tool_call_end|>";
  const std::string c = "<|tool_calls_section_end|>", n = "<|tool_call_begin|>functions.";
  struct Case {
    const char* name;
    std::vector<std::string> prefixes;  // after the primed text, spelt
  };
  const Case cases[] = {
      {"get_weather",
       {"", "1", "10", "0", "123456", "1" + a, "1" + a + "{", "1" + a + R"({"city": "Pa)",
        "1" + a + R"({"city": "Paris", "days": 3)", "1" + a + R"({"city": "Paris", "days": 3})",
        "1" + a + R"({"city": "Paris", "days": 3})" + e,
        "1" + a + R"({"city": "Paris", "days": 3})" + e + c}},
      {"get_time",
       {"0" + a + R"({"zone": "ab)", "0" + a + R"({"zone": "ab<|)",
        "0" + a + R"({"zone": "<|tool_cal)", "0" + a + R"({"zone": "é)"}},
      {"",
       {"", "get_t", "get_tide:", "get_tide:0" + a + R"({"k)", "get_tide:0" + a + "{}" + e,
        "get_tide:0" + a + "{}" + e + n, "get_tide:0" + a + "{}" + e + n + "get_",
        "get_tide:0" + a + "{}" + e + n + "get_time:",
        "get_tide:9" + a + "{}" + e + n + "get_time:1", "get_tide:0" + a + "{}" + e + c}},
  };
  for (const Case& cs : cases) {
    const auto spec = kimi_call_constraint(grammar(cs.name, true), vocab, {eos});
    for (const std::string& prefix : cs.prefixes) {
      const MaskAgreement m =
          mask_agreement(*spec, ids_of(tok, prefix), tok.vocab_size(), eos, &logits);
      ASSERT_TRUE(m.fed) << prefix;
      EXPECT_EQ(m.differ, 0) << cs.name << " after " << prefix;
      EXPECT_GT(m.kept, 0) << prefix;
      EXPECT_EQ(m.eos_kept, prefix.ends_with(c)) << prefix;
    }
  }
}

// The requests of each API that force a call in Kimi's form carry its constraint, where the
// vocabulary has the markers as tokens.
TEST(KimiCallConstraint, ForcedCallsOfEachApiCarryTheirConstraint) {
  const ChatFixture& fx = chat_fixture(kKimiDir);
  ServingContext c = tiny_context(fx);
  c.eos_token_ids = {1026};  // <|im_end|>
  c.tool_format = detect_tool_call_format(fx.tmpl.source());
  ASSERT_EQ(c.tool_format, ToolCallFormat::kKimi);
  c.kimi_vocab_bytes = kimi_call_vocabulary(fx.tok, *fx.vocab);
  const auto first = [&](const char* text) { return fx.tok.encode(text).value()[0]; };
  const int32_t args = *fx.tok.token_to_id(G::kMarkers[G::kArgsBegin]);
  // The tools a request may name: the API refuses the names no id can carry (tools[4] on).
  ojson tools = ojson::parse(kTools);
  tools.erase(tools.begin() + 4, tools.end());
  const auto chat = [&](const std::string& extra, const ojson& with = ojson()) {
    ojson body = J((R"({"messages": [{"role": "user", "content": "hi"}])" + extra + "}").c_str());
    body["tools"] = with.is_null() ? tools : with;
    return parse_chat_request(body, c);
  };
  auto named = chat(R"(, "tool_choice": {"type": "function", "function": {"name": "get_time"}})");
  ASSERT_TRUE(named.ok()) << named.error().message;
  EXPECT_TRUE(named->output.forced_prefix.ends_with("functions.get_time:"));
  ASSERT_TRUE(named->engine.constraint);
  EXPECT_TRUE(named->engine.constraint->start()->allows(first("7")));
  EXPECT_FALSE(named->engine.constraint->start()->allows(first("get")));
  EXPECT_FALSE(named->engine.constraint->start()->allows(args));
  auto required = chat(R"(, "tool_choice": "required")");
  ASSERT_TRUE(required.ok()) << required.error().message;
  ASSERT_TRUE(required->engine.constraint);
  EXPECT_TRUE(required->engine.constraint->start()->allows(first("get")));
  EXPECT_FALSE(required->engine.constraint->start()->allows(first("7")));
  EXPECT_FALSE(chat("")->engine.constraint);
  EXPECT_FALSE(chat(R"(, "tool_choice": "none")")->engine.constraint);
  // A tool the id cannot carry never reaches the grammar: its name is refused.
  auto unwritable =
      chat(R"(, "tool_choice": {"type": "function", "function": {"name": "bad:name"}})",
           ojson::parse(kTools));
  ASSERT_FALSE(unwritable.ok());
  EXPECT_EQ(unwritable.error().param, "tools[4].function.name");

  auto anthropic = parse_messages_request(
      J(R"({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object",
              "properties": {"n": {"type": "integer"}}, "required": ["n"]}}],
            "tool_choice": {"type": "tool", "name": "f"}})"),
      c);
  ASSERT_TRUE(anthropic.ok()) << anthropic.error().message;
  ASSERT_TRUE(anthropic->engine.constraint);
  auto con = anthropic->engine.constraint->start();
  for (int32_t t : ids_of(fx.tok, R"(0<|tool_call_argument_begin|>{"n": )")) {
    ASSERT_TRUE(con->allows(t));
    con->accept(t);
  }
  EXPECT_FALSE(con->allows(first("x")));
  EXPECT_TRUE(con->allows(first("7")));
  auto any = parse_messages_request(
      J(R"({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"}})"),
      c);
  ASSERT_TRUE(any.ok()) << any.error().message;
  ASSERT_TRUE(any->engine.constraint);
  EXPECT_TRUE(any->engine.constraint->start()->allows(first("f")));
  EXPECT_FALSE(any->engine.constraint->start()->allows(first("g")));
  auto responses = parse_responses_request(
      J(R"({"input": "hi", "tool_choice": "required", "tools": [{"type": "function",
            "name": "f", "parameters": {"type": "object"}}]})"),
      c);
  ASSERT_TRUE(responses.ok()) << responses.error().message;
  ASSERT_TRUE(responses->engine.constraint);
  EXPECT_TRUE(responses->engine.constraint->start()->allows(first("f")));
  EXPECT_FALSE(responses->engine.constraint->start()->allows(first("g")));

  // Without the markers' vocabulary (a tokenizer without them as tokens): the prefix alone.
  c.kimi_vocab_bytes = nullptr;
  EXPECT_FALSE(chat(R"(, "tool_choice": "required")")->engine.constraint);
}

}  // namespace
}  // namespace recur::server
