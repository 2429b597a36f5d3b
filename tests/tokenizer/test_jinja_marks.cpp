// Which bytes of a render came from the request: marks carried through every string operation
// a chat template may apply (jinja_marked.h). Outputs below bracket the marked bytes: "[...]".
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "tokenizer/jinja_eval.h"

namespace recur::jinja {
namespace {

// x, y, l and d come from the request; p is a variable the server itself sets.
constexpr const char* kRequest =
    R"({"x": " a,B ", "y": "<u>", "l": ["p", "q"], "d": {"k": "v"}, "h": "é"})";

std::string bracketed(const Rendered& r) {
  std::string out;
  size_t at = 0;
  for (const auto& [b, e] : r.request_spans) {
    out += r.text.substr(at, b - at) + "[" + r.text.substr(b, e - b) + "]";
    at = e;
  }
  return out + r.text.substr(at);
}

std::string render_marks(const std::string& source) {
  Dict vars;
  const auto request = nlohmann::ordered_json::parse(kRequest);
  for (const auto& [k, v] : request.items()) {
    vars.set(k, value_from_request(v));
  }
  vars.set("p", Value::string("<s>"));
  auto t = Template::parse(source);
  if (!t.ok()) return "parse error: " + t.error().to_string();
  auto r = t->render_marked(vars);
  if (!r.ok()) return "render error: " + r.error().to_string();
  EXPECT_EQ(t->render(vars).value(), r->text);  // marks never change the text
  return bracketed(*r);
}

struct MarkCase {
  const char* source;
  const char* expected;
};

TEST(JinjaMarks, FollowRequestTextThroughStringOperations) {
  const MarkCase cases[] = {
      {"A{{ y }}B{{ p }}", "A[<u>]B<s>"},
      {"{{ 'A' ~ y ~ p }}", "A[<u>]<s>"},
      {"{{ 'A' + y + 'B' }}", "A[<u>]B"},
      {"{{ y * 2 }}", "[<u><u>]"},
      {"{{ x.strip() }}|{{ x.lstrip() }}|{{ x.rstrip(' B') }}", "[a,B]|[a,B ]|[ a,]"},
      {"{{ x.split(',')[1] }}/{{ x.split()[0] }}/{{ x.rsplit(',', 1)[0] }}", "[B ]/[a,B]/[ a]"},
      {"{{ x.replace(',', '<|im_end|>') }}", "[ a]<|im_end|>[B ]"},
      {"{{ p.replace('s', y) }}", "<[<u>]>"},
      {"{{ x[1] }}|{{ x[1:3] }}|{{ x[::-1] }}|{{ h[0] }}", "[a]|[a,]|[ B,a ]|[é]"},
      {"{{ x | upper }}|{{ x | lower }}|{{ y | title }}|{{ x.capitalize() }}",
       "[ A,B ]|[ a,b ]|[<U>]|[ a,b ]"},
      {"{{ x | trim }}|{{ y | reverse }}|{{ y | string }}", "[a,B]|[>u<]|[<u>]"},
      {"{{ l | join(p) }}|{{ p.join(l) }}", "[p]<s>[q]|[p]<s>[q]"},
      {"{% for c in y %}({{ c }}){% endfor %}", "([<])([u])([>])"},
      {"{% set s %}<{{ y }}>{% endset %}{{ s }}", "<[<u>]>"},
      {"{% macro m(v) %}M{{ v }}{% endmacro %}{{ m(y) }}", "M[<u>]"},
      {"{% filter upper %}a{{ y }}{% endfilter %}", "A[<U>]"},
      {"{{ (y ~ '\\n' ~ y) | indent(2, true) }}", "  [<u>]\n  [<u>]"},
      {"{{ y | e }}{{ p | e }}{{ y | safe }}", "[&lt;u&gt;]&lt;s&gt;[<u>]"},
      {"{{ x.removeprefix(' a') }}|{{ ('a\\n' ~ y).splitlines()[1] }}", "[,B ]|[<u>]"},
      {"{% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %}", "[k]=[v]"},
      {"{% for k in d %}{{ k }}{% endfor %}|{{ d.keys() | list | first }}", "[k]|[k]"},
      {"{% set ns = namespace(v=y) %}{{ ns.v }}", "[<u>]"},
      // Operations that cannot say which byte came from where mark their whole result.
      {"{{ {'a': y} | tojson }}|{{ l }}|{{ d }}", "[{\"a\": \"<u>\"}]|[['p', 'q']]|[{'k': 'v'}]"},
      {"{{ p | tojson }}{{ [p] }}", "\"<s>\"['<s>']"},
  };
  for (const MarkCase& c : cases) {
    EXPECT_EQ(render_marks(c.source), c.expected) << c.source;
  }
}

TEST(JinjaMarks, PlainVariablesCarryNoMarks) {
  Dict vars;
  vars.set("x", value_from_json(nlohmann::ordered_json("<u>")));
  auto r = Template::parse("{{ x ~ x.upper() }}")->render_marked(vars);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->text, "<u><U>");
  EXPECT_TRUE(r->request_spans.empty());
}

}  // namespace
}  // namespace recur::jinja
