// Structured outputs: JSON schemas compiled and matched byte by byte, against texts a schema
// accepts, texts it refuses, and every prefix of them.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/engine.h"
#include "request_test_util.h"
#include "server/json_constraint.h"
#include "server/json_schema.h"
#include "server/request.h"
#include "tokenizer/tokenizer.h"

namespace recur::server {
namespace {

std::shared_ptr<const CompiledSchema> compile(const std::string& schema) {
  auto c = compile_json_schema(ojson::parse(schema), "response_format");
  EXPECT_TRUE(c.ok()) << (c.ok() ? "" : c.error().message);
  return c.ok() ? *c : nullptr;
}

// Whether the whole text is a value the schema accepts; checks that every prefix of an
// accepted text is taken.
bool accepts(const CompiledSchema& schema, const std::string& text) {
  JsonMatcher m(&schema);
  for (size_t i = 0; i < text.size(); ++i) {
    if (!m.feed(uint8_t(text[i]))) return false;
  }
  return m.can_end();
}

// The bytes the matcher refuses first (text.size() when none): where a generation would stop.
size_t first_refused(const CompiledSchema& schema, const std::string& text) {
  JsonMatcher m(&schema);
  for (size_t i = 0; i < text.size(); ++i) {
    if (!m.feed(uint8_t(text[i]))) return i;
  }
  return text.size();
}

TEST(JsonSchema, ObjectsWithRequiredAndClosedProperties) {
  const auto s = compile(R"({"type": "object", "properties": {"name": {"type": "string"},
      "age": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["name", "age"],
      "additionalProperties": false})");
  EXPECT_TRUE(accepts(*s, R"({"name": "Ada", "age": 36})"));
  EXPECT_TRUE(accepts(*s, "{\n  \"age\": -1,\n  \"name\": \"\",\n  \"ok\": false\n}\n"));
  EXPECT_FALSE(accepts(*s, R"({"name": "Ada"})")) << "age is required";
  EXPECT_FALSE(accepts(*s, R"({"name": "Ada", "age": 3.5})")) << "an integer";
  EXPECT_FALSE(accepts(*s, R"({"name": "Ada", "age": 3, "x": 1})")) << "closed";
  EXPECT_FALSE(accepts(*s, R"({"name": "A", "name": "B", "age": 1})")) << "no repeated key";
  EXPECT_FALSE(accepts(*s, R"({"name": "Ada", "age": 36,})")) << "no trailing comma";
  EXPECT_EQ(first_refused(*s, R"({"nam": 1})"), 5u) << "a key no property starts with";
  EXPECT_EQ(first_refused(*s, R"({"age": 1})"), 9u) << "'}' before name";
  EXPECT_FALSE(accepts(*s, R"({"name": "Ada", "age": 36)")) << "not whole";
}

// A union of literals (zod's z.union of z.literal, TypeScript's string unions) is an anyOf of
// consts whose options all start with '"': more of them than the matcher keeps open at once
// must all stay writable.
TEST(JsonSchema, UnionsOfManyLiteralsKeepEveryValue) {
  std::string options;
  for (int i = 0; i < 20; ++i) {
    options += fmt::format("{}{{\"type\": \"string\", \"const\": \"v{}\"}}", i ? ", " : "", i);
  }
  options += R"(, {"enum": [1, 2, "v3"]}, {"type": "integer"})";
  const auto s = compile(R"({"anyOf": [)" + options + "]}");
  ASSERT_NE(s, nullptr);
  for (int i = 0; i < 20; ++i) EXPECT_TRUE(accepts(*s, fmt::format("\"v{}\"", i))) << i;
  EXPECT_TRUE(accepts(*s, "1"));
  EXPECT_TRUE(accepts(*s, "17"));
  EXPECT_FALSE(accepts(*s, "\"v20\""));
  EXPECT_FALSE(accepts(*s, "\"v\""));
}

// A discriminated union (pydantic's, zod's) of many object shapes: every shape starts with '{',
// so all of them are open at once until the discriminator is written; each must stay writable.
TEST(JsonSchema, UnionsOfManyObjectShapesKeepEveryShape) {
  std::string options;
  for (int i = 0; i < 24; ++i) {
    options += fmt::format(
        "{}{{\"type\": \"object\", \"properties\": {{\"kind\": {{\"const\": \"k{}\"}}, "
        "\"v{}\": {{\"type\": \"integer\"}}}}, \"required\": [\"kind\", \"v{}\"], "
        "\"additionalProperties\": false}}",
        i ? ", " : "", i, i, i);
  }
  const auto s = compile(R"({"anyOf": [)" + options + "]}");
  ASSERT_NE(s, nullptr);
  for (int i = 0; i < 24; ++i) {
    EXPECT_TRUE(accepts(*s, fmt::format(R"({{"kind": "k{}", "v{}": 7}})", i, i))) << i;
  }
  EXPECT_FALSE(accepts(*s, R"({"kind": "k3", "v4": 7})"));
}

TEST(JsonSchema, OpenObjectsTakeOtherNamesWithTheirSchema) {
  const auto s = compile(R"({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": {"type": "string"}})");
  EXPECT_TRUE(accepts(*s, R"({"a": 1, "b": "x", "ab": "y"})"));
  EXPECT_FALSE(accepts(*s, R"({"b": 2})")) << "other names take strings";
  EXPECT_FALSE(accepts(*s, R"({"a": 1, "a": 2})"));
  const auto any = compile(R"({"type": "object"})");
  EXPECT_TRUE(accepts(*any, R"({"x": [1, {"y": null}, "z\n\u00e9"], "w": {}})"));
  EXPECT_FALSE(accepts(*any, "[1]"));
}

TEST(JsonSchema, StringsEscapesUtf8AndLengths) {
  const auto s = compile(R"({"type": "string", "minLength": 2, "maxLength": 4})");
  EXPECT_TRUE(accepts(*s, R"("ab")"));
  EXPECT_TRUE(accepts(*s, R"("\n\"\u00e9x")")) << "an escape is one character";
  EXPECT_TRUE(accepts(*s, "\"\xc3\xa9\xe2\x82\xac\"")) << "UTF-8 characters count once";
  EXPECT_FALSE(accepts(*s, R"("a")"));
  EXPECT_FALSE(accepts(*s, R"("abcde")"));
  EXPECT_FALSE(accepts(*s, "\"a\x01\"")) << "no control characters";
  EXPECT_FALSE(accepts(*s, R"("\x")")) << "no unknown escapes";
  EXPECT_FALSE(accepts(*s, "\"a\xc3(\"")) << "no broken UTF-8";
  EXPECT_FALSE(accepts(*s, "\"a\xed\xa0\x80\"")) << "no surrogates";
  EXPECT_TRUE(accepts(*s, R"("\ud83d\ude00")")) << "an escaped surrogate pair";
  EXPECT_FALSE(accepts(*s, R"("a\udddd")")) << "no lone low surrogate";
  EXPECT_FALSE(accepts(*s, R"("a\ud83dx")")) << "no lone high surrogate";
  EXPECT_FALSE(accepts(*s, R"("a\ud83d\n")"));
}

TEST(JsonSchema, NumbersFollowJsonsGrammar) {
  const auto n = compile(R"({"type": "number"})");
  for (const char* ok : {"0", "-0", "12", "1.5", "-0.25e+3", "1E9", " 7 ", "1e-99"}) {
    EXPECT_TRUE(accepts(*n, ok)) << ok;
  }
  for (const char* bad : {"01", "1.", ".5", "-", "1e", "+1", "1.5.2", "NaN", "1e999", "1e-100"}) {
    EXPECT_FALSE(accepts(*n, bad)) << bad;
  }
  const auto i = compile(R"({"type": "integer"})");
  EXPECT_TRUE(accepts(*i, "-42"));
  EXPECT_FALSE(accepts(*i, "4.0"));
  EXPECT_FALSE(accepts(*i, "4e2"));
}

TEST(JsonSchema, ArraysCountTheirItems) {
  const auto s = compile(R"({"type": "array", "items": {"type": "integer"}, "minItems": 1,
      "maxItems": 2})");
  EXPECT_TRUE(accepts(*s, "[1]"));
  EXPECT_TRUE(accepts(*s, "[1, 2]"));
  EXPECT_FALSE(accepts(*s, "[]"));
  EXPECT_FALSE(accepts(*s, "[1, 2, 3]"));
  EXPECT_FALSE(accepts(*s, "[1,]"));
  EXPECT_FALSE(accepts(*s, R"(["1"])"));
}

TEST(JsonSchema, EnumsConstsAnyOfTypeListsAndRefs) {
  const auto e = compile(R"({"enum": ["red", 1, 12, null, {"a": [true]}]})");
  for (const char* ok : {R"("red")", "1", "12", "null", R"({"a":[true]})"}) {
    EXPECT_TRUE(accepts(*e, ok)) << ok;
  }
  for (const char* bad : {R"("re")", "2", "123", R"({"a": [true]})"}) {
    EXPECT_FALSE(accepts(*e, bad)) << bad;
  }
  const auto c = compile(R"({"const": null})");
  EXPECT_TRUE(accepts(*c, "null"));
  EXPECT_FALSE(accepts(*c, "0"));
  // Every keyword applies: a type beside enum or const keeps only the values of that type, and
  // enum with const only the const.
  const auto typed_enum = compile(R"({"type": "string", "enum": [1, "a", null, "b"]})");
  EXPECT_TRUE(accepts(*typed_enum, R"("a")"));
  EXPECT_TRUE(accepts(*typed_enum, R"("b")"));
  EXPECT_FALSE(accepts(*typed_enum, "1"));
  EXPECT_FALSE(accepts(*typed_enum, "null"));
  const auto ints = compile(R"({"type": ["integer", "null"], "enum": [1.0, 1.5, "2", null]})");
  EXPECT_TRUE(accepts(*ints, "1.0"));
  EXPECT_TRUE(accepts(*ints, "null"));
  EXPECT_FALSE(accepts(*ints, "1.5"));
  EXPECT_FALSE(accepts(*ints, R"("2")"));
  const auto both = compile(R"({"enum": ["x", "y"], "const": "y"})");
  EXPECT_TRUE(accepts(*both, R"("y")"));
  EXPECT_FALSE(accepts(*both, R"("x")"));
  for (const char* none :
       {R"({"type": "integer", "const": "x"})", R"({"type": "object", "const": [1]})",
        R"({"type": "string", "enum": [1, 2]})", R"({"enum": [1], "const": 2})"}) {
    const auto r = compile_json_schema(ojson::parse(none), "f");
    ASSERT_FALSE(r.ok()) << none;
    EXPECT_NE(r.error().message.find("accepts nothing"), std::string::npos) << r.error().message;
  }
  const auto opt = compile(R"({"anyOf": [{"type": "string"}, {"type": "null"}]})");
  EXPECT_TRUE(accepts(*opt, R"("x")"));
  EXPECT_TRUE(accepts(*opt, "null"));
  EXPECT_FALSE(accepts(*opt, "1"));
  const auto types = compile(R"({"type": ["integer", "boolean"]})");
  EXPECT_TRUE(accepts(*types, "true"));
  EXPECT_TRUE(accepts(*types, "5"));
  EXPECT_FALSE(accepts(*types, R"("5")"));
  // Two object options sharing a key stay open until their keys part.
  const auto objs = compile(R"({"anyOf": [
      {"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}},
       "required": ["k", "x"], "additionalProperties": false},
      {"type": "object", "properties": {"k": {"const": "b"}, "y": {"type": "string"}},
       "required": ["k", "y"], "additionalProperties": false}]})");
  EXPECT_TRUE(accepts(*objs, R"({"k": "a", "x": 1})"));
  EXPECT_TRUE(accepts(*objs, R"({"k": "b", "y": "z"})"));
  EXPECT_FALSE(accepts(*objs, R"({"k": "a", "y": "z"})"));
  // A recursive definition (pydantic writes $defs).
  const auto tree = compile(R"({"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object",
      "properties": {"v": {"type": "integer"}, "kids": {"type": "array",
      "items": {"$ref": "#/$defs/Node"}}}, "required": ["v"], "additionalProperties": false}}})");
  EXPECT_TRUE(accepts(*tree, R"({"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]})"));
  EXPECT_FALSE(accepts(*tree, R"({"v": 1, "kids": [{"w": 2}]})"));
}

TEST(JsonSchema, WhitespaceIsBoundedAndNothingFollowsTheValue) {
  const auto s = compile(R"({"type": "boolean"})");
  EXPECT_TRUE(accepts(*s, std::string(JsonMatcher::kMaxGap, ' ') + "true" +
                              std::string(JsonMatcher::kMaxGap, '\n')));
  EXPECT_FALSE(accepts(*s, std::string(JsonMatcher::kMaxGap + 1, ' ') + "true"));
  EXPECT_FALSE(accepts(*s, "true false"));
  std::string deep;
  for (int i = 0; i < JsonMatcher::kMaxDepth + 1; ++i) deep += "[";
  const auto any = compile("{}");
  EXPECT_EQ(first_refused(*any, deep), size_t(JsonMatcher::kMaxDepth)) << "nesting is bounded";
}

TEST(JsonSchema, UnsupportedKeywordsAreRefusedByName) {
  for (const char* bad :
       {R"({"type": "string", "pattern": "^a"})", R"({"type": "integer", "minimum": 0})",
        R"({"allOf": [{"type": "string"}]})", R"({"type": "decimal"})",
        R"({"$ref": "#/$defs/missing"})", "false", R"({"type": "object", "required": ["x"]})",
        R"({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})",
        R"({"anyOf": [{"$ref": "#"}, {"type": "null"}]})"}) {
    auto c = compile_json_schema(ojson::parse(bad), "response_format");
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.error().status, 400);
    EXPECT_NE(c.error().message.find("response_format"), std::string::npos) << bad;
  }
  auto c = compile_json_schema(ojson::parse(R"({"type": "string", "pattern": "x"})"), "f");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("'pattern'"), std::string::npos);
}

// A chain of anyOfs whose two options both refer to the next level: 2^40 ways to the one
// integer, which the matcher once walked at every value's first byte.
TEST(JsonSchema, NestedAnyOfsForkOncePerOption) {
  ojson defs = ojson::object();
  const int k = 40;
  for (int i = 0; i < k; ++i) {
    const ojson next = {{"$ref", fmt::format("#/$defs/d{}", i + 1)}};
    defs[fmt::format("d{}", i)] = {{"anyOf", ojson::array({next, next})}};
  }
  defs[fmt::format("d{}", k)] = {{"type", "integer"}};
  auto chain = compile_json_schema(ojson{{"$defs", defs}, {"$ref", "#/$defs/d0"}}, "f");
  ASSERT_TRUE(chain.ok()) << chain.error().message;
  EXPECT_TRUE(accepts(**chain, "123"));
  EXPECT_FALSE(accepts(**chain, "[-4]"));
  EXPECT_FALSE(accepts(**chain, "1.5"));
}

// Past the bound on a value's options, counted through nested anyOfs, a schema is refused.
TEST(JsonSchema, ValuesOfTooManyOptionsAreRefused) {
  ojson wide = ojson::array();
  for (int i = 0; i < kMaxSchemaAlternatives; ++i) wide.push_back({{"const", i}});
  const ojson inner = {{"anyOf", wide}};
  auto at_bound = compile_json_schema(ojson{{"anyOf", ojson::array({inner})}}, "f");
  ASSERT_TRUE(at_bound.ok()) << at_bound.error().message;
  EXPECT_TRUE(accepts(**at_bound, "0"));
  auto past = compile_json_schema(ojson{{"anyOf", ojson::array({inner, {{"type", "string"}}})}},
                                  "response_format");
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.error().status, 400);
  EXPECT_NE(past.error().message.find(
                fmt::format("response_format.anyOf: more than {}", kMaxSchemaAlternatives)),
            std::string::npos)
      << past.error().message;
}

// `depth` arrays of at least one item around an integer, and the text of the least of them.
std::pair<ojson, std::string> nested_arrays(int depth) {
  ojson schema = {{"type", "integer"}};
  std::string text = "7";
  for (int i = 0; i < depth; ++i) {
    schema = {{"type", "array"}, {"minItems", 1}, {"items", schema}};
    text = "[" + text + "]";
  }
  return {schema, text};
}

TEST(JsonSchema, ValuesThatMustNestPastTheMatchersDepthAreRefused) {
  const auto [deepest, text] = nested_arrays(JsonMatcher::kMaxDepth);
  auto ok = compile_json_schema(deepest, "response_format");
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  EXPECT_TRUE(accepts(**ok, text));
  EXPECT_FALSE(accepts(**ok, text.substr(1, text.size() - 2))) << "one level short";

  auto too_deep =
      compile_json_schema(nested_arrays(JsonMatcher::kMaxDepth + 1).first, "response_format");
  ASSERT_FALSE(too_deep.ok());
  EXPECT_EQ(too_deep.error().status, 400);
  EXPECT_NE(too_deep.error().message.find("response_format"), std::string::npos);
  EXPECT_NE(
      too_deep.error().message.find(fmt::format("deeper than {} levels", JsonMatcher::kMaxDepth)),
      std::string::npos)
      << too_deep.error().message;

  // Required properties nest too; optional ones need not be written.
  ojson required = {{"type", "integer"}}, optional = required;
  for (int i = 0; i <= JsonMatcher::kMaxDepth; ++i) {
    required = {{"type", "object"}, {"properties", {{"a", required}}}, {"required", {"a"}}};
    optional = {{"type", "object"}, {"properties", {{"a", optional}}}};
  }
  EXPECT_FALSE(compile_json_schema(required, "f").ok());
  EXPECT_TRUE(compile_json_schema(optional, "f").ok());

  // A definition that always holds another of itself has no finite value.
  auto endless = compile_json_schema(ojson::parse(R"({"$ref": "#/$defs/a", "$defs": {"a":
      {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}}}})"),
                                     "response_format");
  ASSERT_FALSE(endless.ok());
  EXPECT_NE(endless.error().message.find("without end"), std::string::npos)
      << endless.error().message;
}

// A recursive schema may nest, but a property is offered only where its value still fits in
// the levels left: generation never starts what it could not finish.
TEST(JsonSchema, PropertiesStartOnlyWhereTheirValueFits) {
  const auto s = compile(R"({"$ref": "#/$defs/n", "$defs": {"n": {"type": "object",
      "properties": {"kid": {"$ref": "#/$defs/n"}, "deep": {"type": "array", "minItems": 1,
      "items": {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
      "items": {"type": "integer"}}}}}, "additionalProperties": false}}})");
  // `levels` objects, the innermost with the three arrays of "deep" in it.
  auto text = [](int levels) {
    std::string t;
    for (int i = 1; i < levels; ++i) t += R"({"kid": )";
    t += R"({"deep": [[[1]]]})";
    return t + std::string(size_t(levels - 1), '}');
  };
  const int fits = JsonMatcher::kMaxDepth - 3;
  EXPECT_TRUE(accepts(*s, text(fits)));
  const std::string too_deep = text(fits + 1);
  EXPECT_EQ(first_refused(*s, too_deep), too_deep.find("deep"))
      << "\"deep\" is no key where its arrays would not fit";
  EXPECT_TRUE(accepts(*s, text(fits + 1).substr(0, too_deep.find("deep") - 1) + "}" +
                              std::string(size_t(fits), '}')))
      << "the object there may still close";
}

}  // namespace
}  // namespace recur::server

namespace recur::server {
namespace {

// The constraint on Qwen's vocabulary: after each prefix, mask() keeps exactly the tokens
// allows() admits (its fast paths agree with running every token), and nothing else.
TEST(JsonConstraint, MaskKeepsExactlyTheTokensAllowsAdmits) {
  const ChatFixture& fx = chat_fixture(kRealVocabModel);  // Qwen's tokenizer and its bytes
  const Tokenizer* tok = &fx.tok;
  const auto& vocab = fx.vocab;
  const int32_t eos = *tok->token_to_id("<|im_end|>");
  const int V = tok->vocab_size() + 64;  // a model's padded rows are never text
  struct Case {
    const char* schema;
    std::vector<const char*> prefixes;
  };
  const Case cases[] = {
      {R"({"type": "object"})", {"", " {", "{\"ke", "{\"k\": \"v", "{\"k\": 1", "{\"k\": [tr"}},
      {R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
          "n": {"type": "integer"}}, "required": ["name", "n"], "additionalProperties": false})",
       {"{\"na", "{\"name\": \"ab", "{\"name\": \"abcdef", "{\"name\": \"x\",",
        "{\"n\": 3, \"name\": \"\"}"}},
      {R"({"enum": ["alpha", "beta"]})", {"\"al", "\"beta\""}},
  };
  std::vector<float> logits(static_cast<size_t>(V));
  for (const Case& c : cases) {
    auto schema = compile_json_schema(ojson::parse(c.schema), "f");
    ASSERT_TRUE(schema.ok());
    const auto spec = json_constraint(*schema, vocab, {eos}, "");
    for (const char* prefix : c.prefixes) {
      auto con = spec->start();
      auto ids = tok->encode(prefix);
      ASSERT_TRUE(ids.ok());
      for (int32_t id : *ids) {
        ASSERT_TRUE(con->allows(id)) << prefix;
        con->accept(id);
      }
      std::fill(logits.begin(), logits.end(), 1.0f);
      con->mask(logits);
      int kept = 0, differ = 0;
      for (int id = 0; id < V; ++id) {
        const bool masked_in = logits[size_t(id)] == 1.0f;
        kept += masked_in;
        if (masked_in != (id < tok->vocab_size() && con->allows(id))) ++differ;
      }
      EXPECT_EQ(differ, 0) << c.schema << " after " << prefix;
      EXPECT_GT(kept, 0) << prefix;
      const bool whole =
          std::string(prefix) == "{\"n\": 3, \"name\": \"\"}" || std::string(prefix) == "\"beta\"";
      EXPECT_EQ(logits[size_t(eos)] == 1.0f, whole) << "the end token only after a whole value";
    }
  }
}

// With `active_after`, tokens are free until the marker has been generated (the model's
// reasoning), then the schema holds, the marker's token's tail included.
TEST(JsonConstraint, StartsAfterTheReasoningMarker) {
  const ChatFixture& fx = chat_fixture(kRealVocabModel);  // Qwen's tokenizer and its bytes
  const Tokenizer* tok = &fx.tok;
  const auto& vocab = fx.vocab;
  auto schema = compile_json_schema(ojson::parse(R"({"type": "boolean"})"), "f");
  ASSERT_TRUE(schema.ok());
  auto con = json_constraint(*schema, vocab, {}, "</think>")->start();
  auto ids = tok->encode("Let me think. 1 < 2, so </thi");
  ASSERT_TRUE(ids.ok());
  for (int32_t id : *ids) {
    ASSERT_TRUE(con->allows(id));
    con->accept(id);
  }
  const int32_t letter = tok->encode("x").value()[0];
  EXPECT_TRUE(con->allows(letter)) << "still reasoning";
  auto rest = tok->encode("nk>\n\n");
  for (int32_t id : *rest) con->accept(id);
  EXPECT_FALSE(con->allows(letter)) << "the JSON has begun";
  EXPECT_TRUE(con->allows(tok->encode("true").value()[0]));
}

}  // namespace
}  // namespace recur::server

namespace recur::server {
namespace {

// Through the engine on the real-vocabulary tiny model (random weights, so it writes nothing
// like JSON unprompted): greedy, temperature and top-p sampling each end with a value the
// schema accepts, every prefix on the way a prefix the matcher takes.
TEST(JsonConstraint, EngineOutputsFollowTheSchema) {
  const ChatFixture& fx = chat_fixture(kRealVocabModel);
  const Tokenizer* tok = &fx.tok;
  auto ops = create_backend("cpu", 2);
  ASSERT_TRUE(ops.ok());
  EngineConfig cfg;
  cfg.max_batch = 3;
  auto engine = Engine::create(kRealVocabModel, **ops, cfg, tok);
  ASSERT_TRUE(engine.ok()) << engine.error().to_string();
  Engine& e = **engine;
  auto schema = compile_json_schema(ojson::parse(R"({"type": "object", "properties": {
      "ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
      "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
      "required": ["ok", "color", "tags"], "additionalProperties": false})"),
                                    "f");
  ASSERT_TRUE(schema.ok());
  const auto spec = json_constraint(*schema, fx.vocab, e.model_info().eos_token_ids, "");
  struct Run {
    std::vector<int32_t> ids;
    FinishReason reason = FinishReason::kError;
  };
  std::vector<Run> runs(4);
  for (int i = 0; i < 4; ++i) {
    Request r;
    r.prompt = tok->encode("Describe it as JSON.").value();
    r.max_tokens = 300;
    r.sampling.temperature = i == 0 ? 0.0f : 1.0f;
    r.sampling.top_p = i == 2 ? 0.9f : 1.0f;
    r.sampling.top_k = i == 3 ? 50 : 0;
    r.sampling.seed = uint64_t(i);
    r.constraint = spec;
    Run* run = &runs[size_t(i)];
    ASSERT_TRUE(e.submit(r, [run](const Event& ev) {
                   if (ev.kind == Event::Kind::kToken) run->ids.push_back(ev.token);
                   if (ev.kind == Event::Kind::kFinish) run->reason = ev.reason;
                 }).ok());
  }
  e.run_until_idle();
  const auto& eos = e.model_info().eos_token_ids;
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& run = runs[i];
    ASSERT_EQ(run.reason, FinishReason::kStop) << "run " << i;
    ASSERT_FALSE(run.ids.empty());
    EXPECT_NE(std::find(eos.begin(), eos.end(), run.ids.back()), eos.end());
    JsonMatcher m(schema->get());
    std::string text;
    for (size_t j = 0; j + 1 < run.ids.size(); ++j) {
      const std::string_view b = tok->id_to_bytes(run.ids[j]);
      ASSERT_TRUE(m.feed(b)) << "run " << i << " token " << j << " after " << text;
      text += b;
    }
    ASSERT_TRUE(m.can_end()) << text;
    const ojson v = ojson::parse(text);
    EXPECT_TRUE(v.at("ok").is_boolean()) << text;
    EXPECT_TRUE(v.at("color") == "red" || v.at("color") == "green") << text;
    EXPECT_LE(v.at("tags").size(), 2u) << text;
    EXPECT_EQ(v.size(), 3u) << text;
  }
}

}  // namespace
}  // namespace recur::server

namespace recur::server {
namespace {

// The first token of `text` in the context's vocabulary.
int32_t first_token(const ServingContext& c, const char* text) {
  return c.tokenizer->encode(text).value()[0];
}

TEST(StructuredOutputs, RequestsOfEachApiCarryTheirConstraint) {
  const ServingContext c = tiny_context(chat_fixture(kRealVocabModel));
  const char* schema =
      R"({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})";
  const std::string chat = std::string(R"({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "t", "strict": true,
      "schema": )") + schema +
                           "}}}";
  auto r = parse_chat_request(ojson::parse(chat), c);
  ASSERT_TRUE(r.ok()) << r.error().message;
  ASSERT_TRUE(r->engine.constraint);
  auto con = r->engine.constraint->start();
  EXPECT_TRUE(con->allows(first_token(c, "{")));
  EXPECT_FALSE(con->allows(first_token(c, "Sure")));
  auto completion = parse_completion_request(
      J(R"({"prompt": "x", "response_format": {"type": "json_object"}})"), c);
  ASSERT_TRUE(completion.ok()) << completion.error().message;
  ASSERT_TRUE(completion->engine.constraint);
  EXPECT_FALSE(completion->engine.constraint->start()->allows(first_token(c, "[")));
  auto text =
      parse_completion_request(J(R"({"prompt": "x", "response_format": {"type": "text"}})"), c);
  ASSERT_TRUE(text.ok());
  EXPECT_FALSE(text->engine.constraint);
  const std::string responses = std::string(R"({"input": "hi", "text": {"format":
      {"type": "json_schema", "name": "t", "schema": )") +
                                schema + "}}}";
  auto resp = parse_responses_request(ojson::parse(responses), c);
  ASSERT_TRUE(resp.ok()) << resp.error().message;
  ASSERT_TRUE(resp->engine.constraint);
  EXPECT_EQ(resp->response_echo["text"]["format"]["type"], "json_schema");
  EXPECT_EQ(resp->response_echo["text"]["format"]["name"], "t");
  // One structured-output field a request, whichever spelling each takes.
  auto twice =
      parse_responses_request(J(R"({"input": "hi", "response_format": {"type": "json_object"},
            "text": {"format": {"type": "json_object"}}})"),
                              c);
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.error().status, 400);
  EXPECT_NE(twice.error().message.find("'response_format'"), std::string::npos);
  EXPECT_NE(twice.error().message.find("'text.format'"), std::string::npos);
  // Anthropic's output_config.format, and the beta's output_format; not both.
  for (const char* key : {R"("output_config": {"format": )", R"("output_format": )"}) {
    const std::string messages =
        std::string(
            R"({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], )") +
        key + R"({"type": "json_schema", "schema": )" + schema + "}" +
        (std::string(key).find("config") != std::string::npos ? "}" : "") + "}";
    auto m = parse_messages_request(ojson::parse(messages), c);
    ASSERT_TRUE(m.ok()) << m.error().message;
    ASSERT_TRUE(m->engine.constraint) << key;
    EXPECT_FALSE(m->engine.constraint->start()->allows(first_token(c, "Sure")));
  }
  auto both = parse_messages_request(
      J(R"({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"format": {"type": "json_object"}},
            "output_format": {"type": "json_object"}})"),
      c);
  ASSERT_FALSE(both.ok());
  EXPECT_EQ(both.error().param, "output_format");
}

// vLLM's and llama.cpp's spellings of the same constraint; one of them at a time.
TEST(StructuredOutputs, OtherServersFieldsGiveTheSameConstraint) {
  const ServingContext c = tiny_context(chat_fixture(kRealVocabModel));
  const int32_t brace = first_token(c, "{"), bracket = first_token(c, "[");
  for (const char* extra :
       {R"("guided_json": {"type": "array"})", R"("guided_json": "{\"type\": \"array\"}")",
        R"("json_schema": {"type": "array"})",
        R"("structured_outputs": {"json": {"type": "array"}})"}) {
    auto r =
        parse_completion_request(ojson::parse(std::string(R"({"prompt": "x", )") + extra + "}"), c);
    ASSERT_TRUE(r.ok()) << extra << ": " << r.error().message;
    ASSERT_TRUE(r->engine.constraint) << extra;
    auto con = r->engine.constraint->start();
    EXPECT_TRUE(con->allows(bracket)) << extra;
    EXPECT_FALSE(con->allows(brace)) << extra;
  }
  for (const auto& [extra, param] :
       {std::pair{R"("guided_json": "not json")", "guided_json"},
        std::pair{R"("guided_json": {}, "response_format": {"type": "json_object"})",
                  "guided_json"},
        std::pair{R"("structured_outputs": {"choice": ["a"]})", "structured_outputs.choice"},
        std::pair{R"("json_schema": {"type": "string", "pattern": "x"})", "json_schema"}}) {
    auto r =
        parse_completion_request(ojson::parse(std::string(R"({"prompt": "x", )") + extra + "}"), c);
    ASSERT_FALSE(r.ok()) << extra;
    EXPECT_EQ(r.error().param, param) << r.error().message;
  }
}

TEST(StructuredOutputs, ToolsTheModelMayCallAreRefusedBesideASchema) {
  const ServingContext c = tiny_context(chat_fixture(kRealVocabModel));
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object"}}}])";
  auto body = [&](const std::string& choice) {
    return ojson::parse(R"({"messages": [{"role": "user", "content": "hi"}], )" + tools + choice +
                        R"(, "response_format": {"type": "json_object"}})");
  };
  auto refused = parse_chat_request(body(""), c);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().param, "response_format");
  EXPECT_NE(refused.error().message.find("tool_choice"), std::string::npos);
  auto none = parse_chat_request(body(R"(, "tool_choice": "none")"), c);
  ASSERT_TRUE(none.ok()) << none.error().message;
  EXPECT_TRUE(none->engine.constraint);
}

// A template that opens <think> for the model (Qwen3.5's): the schema holds after </think>.
TEST(StructuredOutputs, ThinkingModelsWriteTheJsonAfterTheirReasoning) {
  const ServingContext c =
      tiny_context(chat_fixture(std::string(RECUR_SOURCE_DIR) + "/tests/data/qwen3_5-chat-tiny"));
  auto r = parse_chat_request(J(R"({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_object"}})"),
                              c);
  ASSERT_TRUE(r.ok()) << r.error().message;
  ASSERT_TRUE(r->output.start_in_reasoning);
  auto con = r->engine.constraint->start();
  const int32_t word = first_token(c, "Sure");
  EXPECT_TRUE(con->allows(word));
  const std::vector<int32_t> reasoning = c.tokenizer->encode("Sure. </think>\n\n").value();
  for (int32_t id : reasoning) con->accept(id);
  EXPECT_FALSE(con->allows(word));
  EXPECT_TRUE(con->allows(first_token(c, "{")));
}

}  // namespace
}  // namespace recur::server
