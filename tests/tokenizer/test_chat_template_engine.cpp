// The Jinja engine against Jinja itself: every expected string below is what Jinja 3.1 renders
// for the same template and variables in the environment transformers builds for chat
// templates (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, json.dumps tojson).
#include <gtest/gtest.h>

#include <chrono>

#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tokenizer/jinja_eval.h"

namespace recur::jinja {
namespace {

// The variables every table case renders with.
constexpr const char* kVars =
    R"({"s": "Hello World", "n": 5, "f": 2.5, "l": [3, 1, 2], "e": "", "z": null, "t": true, "u8": "héllo ✓", "d": {"b": 1, "a": [1, 2.0, null, true], "c": "x\"y\n"}, "msgs": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "r"}]})";

Dict vars_from(const char* json) {
  Dict d;
  const auto parsed = nlohmann::ordered_json::parse(json);
  for (const auto& [k, v] : parsed.items()) {
    d.set(k, value_from_json(v));
  }
  return d;
}

Result<std::string> try_render(std::string_view source, const char* vars = kVars) {
  auto tmpl = Template::parse(source);
  if (!tmpl.ok()) return tmpl.error();
  return tmpl->render(vars_from(vars));
}

std::string render(std::string_view source, const char* vars = kVars) {
  auto out = try_render(source, vars);
  if (!out.ok()) {
    ADD_FAILURE() << "rendering failed: " << out.error().to_string() << "\n" << source;
    return "";
  }
  return out.value();
}

Error render_error(std::string_view source, const char* vars = kVars) {
  auto out = try_render(source, vars);
  if (out.ok()) {
    ADD_FAILURE() << "expected an error, rendered: " << out.value();
    return Error{};
  }
  return out.error();
}

struct EngineCase {
  const char* name;
  const char* source;
  const char* expected;
};

// ---- Statements ----
const EngineCase kStatementsCases[] = {
    {"for loop variables",
     R"({% for x in l %}{{ loop.index0 }}{{ loop.index }}{{ loop.revindex0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %})",
     R"(0123TrueFalse3;1212FalseFalse3;2301FalseTrue3;)"},
    {"for previtem nextitem",
     R"({% for x in l %}[{{ loop.previtem }}|{{ loop.nextitem }}]{% endfor %})",
     R"([|1][3|2][1|])"},
    {"for else", R"({% for x in [] %}body{% else %}empty{% endfor %})", R"(empty)"},
    {"for with filter", R"({% for x in l if x > 1 %}{{ x }}/{{ loop.length }} {% endfor %})",
     R"(3/2 2/2 )"},
    {"for break continue",
     R"({% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %})",
     R"(13)"},
    {"for over dict and items",
     R"({% for k in d %}{{ k }}{% endfor %} {% for k, v in d|items %}{{ k }}={{ v }};{% endfor %})",
     R"(bac b=1;a=[1, 2.0, None, True];c=x"y
;)"},
    {"for over string", R"({% for c in u8 %}{{ c }}.{% endfor %})", R"(h.é.l.l.o. .✓.)"},
    {"for reversed slice", R"({% for m in msgs[::-1] %}{{ m.role }}{{ loop.index0 }} {% endfor %})",
     R"(tool0 user1 )"},
    {"nested loops keep outer loop",
     R"({% for a in [1, 2] %}{% set outer = loop %}{% for b in [1, 2] %}{{ outer.index }}{{ loop.index }} {% endfor %}{% endfor %})",
     R"(11 12 21 22 )"},
    {"loop cycle", R"({% for x in l %}{{ loop.cycle('odd', 'even') }} {% endfor %})",
     R"(odd even odd )"},
    {"set inside loop does not leak",
     R"({% set x = 0 %}{% for i in l %}{{ x }}{% set x = i %}{% endfor %}|{{ x }})", R"(000|0)"},
    {"namespace carries state out of loop",
     R"({% set ns = namespace(total=0, seen='') %}{% for i in l %}{% set ns.total = ns.total + i %}{% set ns.seen = ns.seen ~ i %}{% endfor %}{{ ns.total }} {{ ns.seen }})",
     R"(6 312)"},
    {"if elif else",
     R"({% for x in [0, 1, 5] %}{% if x > 3 %}big{% elif x %}small{% else %}zero{% endif %} {% endfor %})",
     R"(zero small big )"},
    {"set tuple unpacking", R"({% set a, b = [1, 'two'] %}{{ a }} {{ b }})", R"(1 two)"},
    {"set block capture and filter",
     R"({% set x %}n={{ n }}{% endset %}{% set y | upper %}abc{% endset %}[{{ x }}][{{ y }}])",
     R"([n=5][ABC])"},
    {"macro defaults and keywords",
     R"({% macro m(a, b=2, c='x') %}[{{ a }}{{ b }}{{ c }}]{% endmacro %}{{ m(1) }}{{ m(1, 3) }}{{ m(1, c='y') }}{{ m(b=5, a=0) }})",
     R"([12x][13x][12y][05x])"},
    {"macro varargs kwargs",
     R"({% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k='v') }})",
     R"(1(2, 3){'k': 'v'})"},
    {"macro recursion",
     R"({% macro count(n) %}{% if n > 0 %}{{ n }}{{ count(n - 1) }}{% endif %}{% endmacro %}{{ count(3) }})",
     R"(321)"},
    {"macro sees namespace and template variables",
     R"({% set ns = namespace(calls=0) %}{% set greeting = 'hi' %}{% macro m() %}{% set ns.calls = ns.calls + 1 %}{{ greeting }}{% endmacro %}{{ m() }}{{ m() }}{{ ns.calls }})",
     R"(hihi2)"},
    {"macro result is a string",
     R"({% macro m() %}  x  {% endmacro %}[{{ m()|trim }}]{{ m()|length }})", R"([x]5)"},
    {"with block", R"({% with a = 1, b = n %}{{ a + b }}{% endwith %}[{{ a }}])", R"(6[])"},
    {"filter block", R"({% filter upper %}hello {{ s }}{% endfilter %})", R"(HELLO HELLO WORLD)"},
    {"raw block", R"({% raw %}{{ not evaluated }}{% if %}{% endraw %})",
     R"({{ not evaluated }}{% if %})"},
    {"generation block renders body", R"({% generation %}said {{ n }}{% endgeneration %})",
     R"(said 5)"},
    {"comments", R"(a{# a comment #}b{#- trimmed -#}  c)", R"(abc)"},
    {"macro defined in a loop sees the loop",
     R"({% for i in [1, 2] %}{% macro m() %}{{ i }}{{ loop.index }}{% endmacro %}{{ m() }} {% endfor %})",
     R"(11 22 )"},
    {"nested macro sees the outer arguments",
     R"({% macro outer(x) %}{% macro inner() %}<{{ x }}>{% endmacro %}{{ inner() }}{% endmacro %}{{ outer(3) }})",
     R"(<3>)"},
};

// ---- Expressions ----
const EngineCase kExpressionsCases[] = {
    {"integer and float arithmetic",
     R"({{ 1 + 2 * 3 }} {{ 7 / 2 }} {{ 4 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ f * 2 }} {{ n - 7 }})",
     R"(7 3.5 2.0 3 -4 2 1024 0.5 5.0 -2)"},
    {"float printing like python repr",
     R"({{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 1.5e-7 }} {{ -0.0 }} {{ 3.0 }} {{ 123456789.123 }})",
     R"(0.30000000000000004 1e+16 1000000000000000.0 0.0001 1e-05 1.5e-07 -0.0 3.0 123456789.123)"},
    {"string concatenation",
     R"({{ 'a' ~ 1 ~ none ~ true ~ missing ~ 2.5 }} {{ 'a' + 'b' }} {{ 'ab' * 2 }} {{ [1] + [2] }})",
     R"(a1NoneTrue2.5 ab abab [1, 2])"},
    {"comparisons",
     R"({{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ l == [3, 1, 2] }} {{ missing == missing }} {{ z == none }} {{ 1 != 2 }} {{ 2 >= 2 }} {{ 2 <= 1 }})",
     R"(True False True True True True True True True True True False)"},
    {"membership",
     R"({{ 'World' in s }} {{ 'x' not in s }} {{ 1 in l }} {{ 'a' in d }} {{ 'q' in d }} {{ 'a' in missing }})",
     R"(True True True True False False)"},
    {"boolean operators return operands",
     R"({{ 0 or 'x' }} {{ 1 and 'y' }} {{ '' or [] }} {{ not t }} {{ not (1 and 0) }} {{ none or 'default' }})",
     R"(x y [] False True default)"},
    {"ternary",
     R"({{ 'yes' if t else 'no' }} {{ 'yes' if z else 'no' }} [{{ 'only' if z }}] {{ 1 if false else 2 if false else 3 }})",
     R"(yes no [] 3)"},
    {"indexing",
     R"({{ l[0] }} {{ l[-1] }} [{{ l[10] }}] {{ s[0] }} {{ s[-1] }} {{ u8[1] }} {{ d['b'] }} {{ d.b }} [{{ d.missing }}] {{ msgs[1].role }} {{ l.0 }})",
     R"(3 2 [] H d é 1 1 [] tool 3)"},
    {"slicing",
     R"({{ s[::-1] }} {{ s[1:3] }} {{ s[-3:] }} {{ s[:-3] }} {{ s[::2] }} {{ l[::-1] }} {{ l[1:] }} {{ l[5:] }} {{ u8[::-1] }} {{ u8[1:3] }})",
     R"(dlroW olleH el rld Hello Wo HloWrd [2, 1, 3] [1, 2] [] ✓ olléh él)"},
    {"literals",
     R"({{ [1, 'a', none, true, 2.5] }} {{ {'k': [1, {'n': none}]} }} {{ (1, 2) }} {{ (1,) }} {{ () }} {{ 'a' 'b' }})",
     R"([1, 'a', None, True, 2.5] {'k': [1, {'n': None}]} (1, 2) (1,) () ab)"},
    {"string escapes",
     R"({{ 'tab\there' }}|{{ 'q\'s' }}|{{ "d\"q" }}|{{ '\x41\u00e9' }}|{{ 'back\\slash' }}|{{ 'keep\d' }})",
     "tab\there|q's|d\"q|Aé|back\\slash|keep\\d"},
    {"python str of values",
     R"({{ z }} {{ t }} {{ d }} {{ ['it\'s', 'say "hi"', "both ' \""] }} {{ ['\n\t\x00'] }})",
     R"(None True {'b': 1, 'a': [1, 2.0, None, True], 'c': 'x"y\n'} ["it's", 'say "hi"', 'both \' "'] ['\n\t\x00'])"},
    {"undefined prints empty",
     R"([{{ missing }}][{{ missing|default('dflt') }}][{{ missing|length }}][{% for x in missing %}x{% endfor %}][{{ missing is defined }}])",
     R"([][dflt][0][][False])"},
    {"attribute of none is undefined", R"([{{ z.anything }}][{{ d.missing is defined }}])",
     R"([][False])"},
};

// ---- Tests ----
const EngineCase kTestsCases[] = {
    {"defined none string mapping",
     R"({{ n is defined }} {{ missing is defined }} {{ missing is undefined }} {{ z is none }} {{ s is string }} {{ n is string }} {{ d is mapping }} {{ l is mapping }})",
     R"(True False True True True False True False)"},
    {"iterable and sequence",
     R"({{ l is iterable }} {{ s is iterable }} {{ d is iterable }} {{ n is iterable }} {{ l is sequence }} {{ s is sequence }} {{ d is sequence }} {{ n is sequence }} {{ missing is iterable }})",
     R"(True True True False True True True False True)"},
    {"number kinds",
     R"({{ n is number }} {{ f is number }} {{ t is number }} {{ s is number }} {{ n is integer }} {{ t is integer }} {{ f is float }} {{ t is boolean }} {{ n is boolean }})",
     R"(True True True False True False True True False)"},
    {"true false",
     R"({{ t is true }} {{ 1 is true }} {{ false is false }} {{ 0 is false }} {{ z is false }})",
     R"(True False True False False)"},
    {"negated tests",
     R"({{ z is not none }} {{ s is not string }} {{ not missing is defined }} {{ l is not mapping }})",
     R"(False False True True)"},
    {"tests with arguments",
     R"({{ n is odd }} {{ n is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(2) }} {{ 3 is eq 3 }} {{ 3 is ne 3 }} {{ 3 is lt 4 }} {{ 3 is gt 4 }} {{ 3 is le 3 }} {{ 3 is ge 4 }} {{ 1 is in l }} {{ z is sameas none }})",
     R"(True False True False True False True False True False True True)"},
    {"string case tests", R"({{ 'abc' is lower }} {{ 'Abc' is lower }} {{ 'ABC' is upper }})",
     R"(True False True)"},
};

// ---- Filters ----
const EngineCase kFiltersCases[] = {
    {"tojson matches json.dumps",
     R"({{ d|tojson }}|{{ l|tojson }}|{{ u8|tojson }}|{{ 'ctl\x01\x7f'|tojson }}|{{ [1.0, 1e16, 0.00001, -0.5]|tojson }}|{{ {}|tojson }}|{{ none|tojson }})",
     "{\"b\": 1, \"a\": [1, 2.0, null, true], \"c\": \"x\\\"y\\n\"}|[3, 1, 2]|\"héllo "
     "✓\"|\"ctl\\u0001\x7f"
     "\"|[1.0, 1e+16, 1e-05, -0.5]|{}|null"},
    {"tojson options",
     R"({{ d|tojson(indent=2) }}|{{ d|tojson(sort_keys=true) }}|{{ u8|tojson(ensure_ascii=true) }}|{{ l|tojson(separators=[',', ':']) }}|{{ {'a': []}|tojson(indent=0) }})",
     R"({
  "b": 1,
  "a": [
    1,
    2.0,
    null,
    true
  ],
  "c": "x\"y\n"
}|{"a": [1, 2.0, null, true], "b": 1, "c": "x\"y\n"}|"h\u00e9llo \u2713"|[3,1,2]|{
"a": []
})"},
    {"tojson of emoji with ensure_ascii", R"({{ '\U0001F600'|tojson(ensure_ascii=true) }})",
     R"("\ud83d\ude00")"},
    {"trim",
     R"([{{ '  x  '|trim }}][{{ 'xxhixx'|trim('x') }}][{{ '\n\t hi \u3000'|trim }}][{{ missing|trim }}])",
     R"([x][hi][hi][])"},
    {"length count",
     R"({{ s|length }} {{ u8|length }} {{ l|length }} {{ d|length }} {{ s|count }})",
     R"(11 7 3 3 11)"},
    {"first last",
     R"({{ l|first }} {{ l|last }} {{ s|first }} {{ s|last }} {{ d|first }} [{{ []|first }}])",
     R"(3 2 H d b [])"},
    {"join",
     R"({{ l|join(', ') }} {{ l|join }} {{ s|join('-') }} {{ [1, none, 'x']|join('/') }} {{ msgs|join(',', attribute='role') }})",
     R"(3, 1, 2 312 H-e-l-l-o- -W-o-r-l-d 1/None/x user,tool)"},
    {"case filters",
     R"({{ s|upper }} {{ s|lower }} {{ u8|upper }} {{ 'hELLO wORLD'|capitalize }} {{ 'hello big-world (x)'|title }})",
     R"(HELLO WORLD hello world HÉLLO ✓ Hello world Hello Big-World (X))"},
    {"default",
     R"({{ missing|default('dflt') }} {{ z|default('dflt') }} [{{ e|default('dflt') }}] {{ e|default('dflt', true) }} {{ e|d('x', boolean=true) }} [{{ missing|default }}])",
     R"(dflt None [] dflt x [])"},
    {"string list items",
     R"({{ n|string }} {{ l|string }} {{ z|string }} {{ s|list }} {{ d|list }} {{ d|items|list }})",
     R"(5 [3, 1, 2] None ['H', 'e', 'l', 'l', 'o', ' ', 'W', 'o', 'r', 'l', 'd'] ['b', 'a', 'c'] [('b', 1), ('a', [1, 2.0, None, True]), ('c', 'x"y\n')])"},
    {"replace",
     R"({{ s|replace('o', '0') }} {{ s|replace('o', '0', 1) }} {{ 'ab'|replace('', '-') }})",
     R"(Hell0 W0rld Hell0 World -a-b-)"},
    {"int float",
     R"({{ '42'|int }} {{ ' 7 '|int }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(-1) }} {{ 4.9|int }} {{ -4.9|int }} {{ '0x1A'|int(0, 16) }} {{ '4.5'|float }} {{ 'x'|float }} {{ 3|float }})",
     R"(42 7 4 0 -1 4 -4 26 4.5 0.0 3.0)"},
    {"safe marks markup and plus escapes",
     R"({{ s|safe }} {{ ('<b>'|safe) + '<i>' }} {{ '<i>' + ('<b>'|safe) }} {{ ('<b>'|safe) ~ '<i>' }} {{ '<b>'|e }})",
     R"(Hello World <b>&lt;i&gt; &lt;i&gt;<b> <b><i> &lt;b&gt;)"},
    {"map select reject",
     R"({{ msgs|map(attribute='role')|list }} {{ msgs|selectattr('role', 'equalto', 'tool')|map(attribute='content')|join }} {{ msgs|rejectattr('role', 'eq', 'tool')|list|length }} {{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3, 4]|reject('odd')|list }} {{ ['a', 'b']|map('upper')|join }})",
     R"(['user', 'tool'] r 1 [1, 3] [2, 4] AB)"},
    {"sort unique min max sum",
     R"({{ l|sort }} {{ l|sort(reverse=true) }} {{ ['b', 'A', 'c']|sort }} {{ [3, 1, 3]|unique|list }} {{ l|min }} {{ l|max }} {{ l|sum }} {{ l|reverse|list }} {{ s|reverse }})",
     R"([1, 2, 3] [3, 2, 1] ['A', 'b', 'c'] [3, 1] 1 3 6 [2, 1, 3] dlroW olleH)"},
    {"abs round indent dictsort",
     R"({{ -3|abs }} {{ 2.5|round }} {{ 2.675|round(2) }} {{ 2.1|round(0, 'ceil') }} [{{ 'a\nb'|indent(2) }}] {{ {'b': 1, 'a': 2}|dictsort }})",
     R"(3 2.0 2.67 3.0 [a
  b] [('a', 2), ('b', 1)])"},
};

// ---- Methods ----
const EngineCase kMethodsCases[] = {
    {"startswith endswith",
     R"({{ s.startswith('Hell') }} {{ s.endswith('ld') }} {{ s.startswith(('x', 'H')) }} {{ s.startswith('ello', 1) }})",
     R"(True True True True)"},
    {"split",
     R"({{ s.split() }} {{ s.split('o') }} {{ 'a,b,c'.split(',', 1) }} {{ 'a,b,c'.rsplit(',', 1) }} {{ '  a  b '.split() }} {{ '<think>x</think>y'.split('</think>')[-1] }})",
     R"(['Hello', 'World'] ['Hell', ' W', 'rld'] ['a', 'b,c'] ['a,b', 'c'] ['a', 'b'] y)"},
    {"strip family",
     R"([{{ ' a '.strip() }}][{{ 'xya'.lstrip('xy') }}][{{ 'ayx'.rstrip('xy') }}][{{ '\n\nab\n'.strip('\n') }}][{{ '\nab'.lstrip('\n') }}])",
     R"([a][a][a][ab][ab])"},
    {"case and search",
     R"({{ s.upper() }} {{ s.lower() }} {{ "they're bill's".title() }} {{ s.find('o') }} {{ s.rfind('o') }} {{ s.find('zz') }} {{ u8.find('✓') }} {{ s.count('l') }} {{ s.replace('l', 'L', 2) }})",
     R"(HELLO WORLD hello world They'Re Bill'S 4 7 -1 6 3 HeLLo World)"},
    {"join and predicates",
     R"({{ ', '.join(['a', 'b']) }} {{ '123'.isdigit() }} {{ 'abc'.isalpha() }} {{ '  '.isspace() }} {{ 'a\nb'.splitlines() }})",
     R"(a, b True True True ['a', 'b'])"},
    {"dict methods",
     R"({{ d.items()|list }} {{ d.keys()|list }} {{ d.values()|list|length }} {{ d.get('b') }} {{ d.get('q') }} {{ d.get('q', 5) }} {% for k, v in d.items() %}{{ k }}{% endfor %})",
     R"([('b', 1), ('a', [1, 2.0, None, True]), ('c', 'x"y\n')] ['b', 'a', 'c'] 3 1 None 5 bac)"},
    {"list methods", R"({{ l.index(1) }} {{ l.count(3) }})", R"(1 1)"},
};

// ---- Whitespace ----
const EngineCase kWhitespaceCases[] = {
    {"trim_blocks removes newline after block",
     R"(a
{% if true %}
b
{% endif %}
c)",
     R"(a
b
c)"},
    {"lstrip_blocks removes indentation before block",
     R"(a
    {% if true %}
    b
    {% endif %}
c)",
     R"(a
    b
c)"},
    {"variable tags keep surrounding whitespace",
     R"(  {{ n }}  
  {{ n }}
)",
     R"(  5  
  5)"},
    {"minus strips all whitespace",
     R"(a  
 {%- if true -%} 
 b 
 {%- endif -%}  
 c)",
     R"(abc)"},
    {"minus on variables", R"(a  {{- n -}}  b)", R"(a5b)"},
    {"plus disables lstrip and trim",
     R"(a
  {%+ if true +%}
b{% endif %})",
     R"(a
  
b)"},
    {"lstrip only at line start", R"(a  {% if true %}  b  {% endif %}  c)", R"(a    b    c)"},
    {"comments follow block rules",
     R"(a
  {# note #}
b)",
     R"(a
b)"},
    {"crlf newlines and one trailing newline dropped", "x\r\n{% if true %}\r\ny\r\n{% endif %}\r\n",
     R"(x
y
)"},
    {"qwen style dash blocks",
     R"({%- for x in l %}
    {%- if x == 1 %}
        {{- 'one' }}
    {%- else %}
        {{- x }}
    {%- endif %}
{%- endfor %}
)",
     R"(3one2)"},
};

void check_cases(const EngineCase* cases, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    SCOPED_TRACE(cases[i].name);
    EXPECT_EQ(render(cases[i].source), cases[i].expected);
  }
}

TEST(JinjaEngine, Statements) {
  check_cases(kStatementsCases, std::size(kStatementsCases));
}
TEST(JinjaEngine, Expressions) {
  check_cases(kExpressionsCases, std::size(kExpressionsCases));
}
TEST(JinjaEngine, Tests) {
  check_cases(kTestsCases, std::size(kTestsCases));
}
TEST(JinjaEngine, Filters) {
  check_cases(kFiltersCases, std::size(kFiltersCases));
}
TEST(JinjaEngine, Methods) {
  check_cases(kMethodsCases, std::size(kMethodsCases));
}
TEST(JinjaEngine, Whitespace) {
  check_cases(kWhitespaceCases, std::size(kWhitespaceCases));
}

// Parse-time rejections name the construct and where it is.
TEST(JinjaEngine, UnsupportedConstructsNamePosition) {
  struct Bad {
    const char* source;
    ErrorCode code;
    const char* needle;
  };
  const Bad cases[] = {
      {"line one\n{{ x|frobnicate }}", ErrorCode::kUnsupported,
       "line 2, column 6: the filter 'frobnicate' is not supported"},
      {"{{ x is frob }}", ErrorCode::kUnsupported,
       "line 1, column 9: the test 'frob' is not supported"},
      {"ab\n  {% include 'other.jinja' %}", ErrorCode::kUnsupported,
       "line 2, column 6: the '{% include %}' tag is not supported"},
      {"{% call m() %}x{% endcall %}", ErrorCode::kUnsupported,
       "'{% call %}' tag is not supported"},
      {"{% extends 'base' %}", ErrorCode::kUnsupported, "'{% extends %}' tag is not supported"},
      {"{% for x in l recursive %}{% endfor %}", ErrorCode::kUnsupported,
       "line 1, column 15: a recursive for loop is not supported"},
      {"{{ f(*args) }}", ErrorCode::kUnsupported,
       "'*args' / '**kwargs' in a call is not supported"},
      {"{% frobnicate %}", ErrorCode::kInvalidArgument,
       "line 1, column 4: unknown tag 'frobnicate'"},
      {"{% if x %}never closed", ErrorCode::kInvalidArgument, "expected '{% endif %}'"},
      {"text {% endfor %}", ErrorCode::kInvalidArgument,
       "line 1, column 9: unexpected '{% endfor %}'"},
      {"{% break %}", ErrorCode::kInvalidArgument, "'break' outside of a loop"},
      {"{{ 1 + }}", ErrorCode::kInvalidArgument, "line 1, column 8: unexpected '}}'"},
      {"{{ 'open }}", ErrorCode::kInvalidArgument, "line 1, column 4: unterminated string literal"},
      {"{# never closed", ErrorCode::kInvalidArgument, "line 1, column 1: unclosed comment"},
      {"{{ x", ErrorCode::kInvalidArgument, "unclosed tag '{{'"},
      {"{% macro m(a=1, b) %}{% endmacro %}", ErrorCode::kInvalidArgument,
       "non-default argument follows default argument"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.source);
    auto tmpl = Template::parse(bad.source);
    ASSERT_FALSE(tmpl.ok());
    EXPECT_EQ(tmpl.error().code, bad.code) << tmpl.error().to_string();
    EXPECT_NE(tmpl.error().message.find(bad.needle), std::string::npos) << tmpl.error().message;
  }
}

// Errors Jinja raises while rendering are errors here too, never a guess at the output.
TEST(JinjaEngine, RenderErrorsNamePosition) {
  struct Bad {
    const char* source;
    ErrorCode code;
    const char* needle;
  };
  const Bad cases[] = {
      {"ok\n  {{ missing.attr }}", ErrorCode::kInvalidArgument,
       "line 2, column 13: 'missing' is undefined"},
      {"{{ d.nope.x }}", ErrorCode::kInvalidArgument, "'dict object' has no attribute 'nope'"},
      {"{{ missing() }}", ErrorCode::kInvalidArgument, "'missing' is undefined"},
      {"{{ missing + 1 }}", ErrorCode::kInvalidArgument, "'missing' is undefined"},
      {"{{ missing < 1 }}", ErrorCode::kInvalidArgument, "'missing' is undefined"},
      {"{{ 'a' + 1 }}", ErrorCode::kInvalidArgument,
       "unsupported operand type(s) for +: 'str' and 'int'"},
      {"{{ n / 0 }}", ErrorCode::kInvalidArgument, "division by zero"},
      {"{% set s.x = 1 %}", ErrorCode::kInvalidArgument,
       "cannot assign attribute on non-namespace object"},
      {"{{ l.append(4) }}", ErrorCode::kInvalidArgument,
       "access to attribute 'append' of 'list' object is unsafe"},
      {"{{ d.update({}) }}", ErrorCode::kInvalidArgument, "of 'dict' object is unsafe"},
      {"{{ missing|tojson }}", ErrorCode::kInvalidArgument,
       "Object of type Undefined is not JSON serializable"},
      {"{% for x in z %}{% endfor %}", ErrorCode::kInvalidArgument,
       "'NoneType' object is not iterable"},
      {"{% set a, b = [1, 2, 3] %}", ErrorCode::kInvalidArgument,
       "too many values to unpack (expected 2)"},
      {"{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", ErrorCode::kInvalidArgument,
       "macro 'm' takes not more than 1 argument(s)"},
      {"{% macro m(a) %}{% endmacro %}{{ m(b=1) }}", ErrorCode::kInvalidArgument,
       "macro 'm' takes no keyword argument 'b'"},
      {"{{ 'x'.split('') }}", ErrorCode::kInvalidArgument, "empty separator"},
      {"{{ z[1:] }}", ErrorCode::kInvalidArgument, "'NoneType' object is not subscriptable"},
      {"{{ range(200000)|length }}", ErrorCode::kInvalidArgument, "Range too big"},
      {"{{ l|map('string')|length }}", ErrorCode::kInvalidArgument,
       "object of type 'generator' has no len()"},
      // Jinja would print an object address or a Python big integer; neither is reproduced.
      {"{{ l|map('string') }}", ErrorCode::kUnsupported, "printing a generator"},
      {"{{ s.zfill }}", ErrorCode::kUnsupported, "printing the function 'zfill'"},
      {"{{ s.zfill(9) }}", ErrorCode::kUnsupported, "the str method 'zfill'"},
      {"{{ '{}'.format(1) }}", ErrorCode::kUnsupported, "the str method 'format'"},
      {"{{ '%s' % n }}", ErrorCode::kUnsupported, "printf-style string formatting"},
      {"{{ 2 ** 64 }}", ErrorCode::kUnsupported, "integer overflow"},
      {"{{ cycler(1, 2) }}", ErrorCode::kUnsupported,
       "the global function 'cycler' is not supported"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.source);
    Error err = render_error(bad.source);
    EXPECT_EQ(err.code, bad.code) << err.to_string();
    EXPECT_NE(err.message.find(bad.needle), std::string::npos) << err.message;
  }
}

// Nested loops each within the sandbox's range limit (10^10 iterations) and macros that call
// each other in wide trees end with an error after a bounded amount of work, instead of running
// for hours on the worker that renders them.
TEST(JinjaEngine, RunawayLoopsAndMacroCallsAreCutOff) {
  for (const char* source :
       {"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for i in range(100000) if i > 0 %}{% for j in range(100000) if j %}{% endfor %}"
        "{% endfor %}",
        "{% macro m(d) %}{% if d > 0 %}{{ m(d - 1) }}{{ m(d - 1) }}{% endif %}{% endmacro %}"
        "{{ m(40) }}",
        // Few iterations, each a large amount of work in filters, globals and operators.
        "{% for i in range(100000) %}{% set x = range(100000)|sum %}{% endfor %}",
        "{% for i in range(100000) %}{% set x = ('x' * 60000000)|length %}{% endfor %}"}) {
    SCOPED_TRACE(source);
    const auto t0 = std::chrono::steady_clock::now();
    const Error err = render_error(source);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(err.message.find("steps of work (loop iterations, macro calls"), std::string::npos)
        << err.message;
    EXPECT_LT(secs, 60.0);
  }
  // A long chat's worth of iterations renders.
  EXPECT_EQ(render("{% for i in range(99999) %}{% endfor %}{{ 'done' }}"), "done");
}

TEST(JinjaEngine, DeepNestingIsAnErrorNotACrash) {
  const std::string deep_expr =
      "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  EXPECT_NE(render_error(deep_expr).message.find("template nested too deeply"), std::string::npos);
  std::string deep_blocks;
  for (int i = 0; i < 1000; ++i) deep_blocks += "{% if true %}";
  EXPECT_NE(render_error(deep_blocks).message.find("template nested too deeply"),
            std::string::npos);
  // A namespace lets a template build a deep value; printing it stops at a limit.
  Error err = render_error(
      "{% set ns = namespace(v=1) %}{% for i in range(2000) %}{% set ns.v = [ns.v] %}{% endfor %}"
      "{{ ns.v }}");
  EXPECT_EQ(err.code, ErrorCode::kUnsupported);
}

TEST(JinjaEngine, RaiseExceptionCarriesTheTemplateMessage) {
  Error err = render_error(
      "{% for m in msgs %}{% if m.role not in ['user', 'assistant'] %}"
      "{{ raise_exception('Unexpected role: ' ~ m.role) }}{% endif %}{% endfor %}");
  EXPECT_EQ(err.code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(err.message, "Unexpected role: tool");
}

TEST(JinjaEngine, InvalidUtf8TemplateIsRejected) {
  auto tmpl = Template::parse("bad \xff byte");
  ASSERT_FALSE(tmpl.ok());
  EXPECT_NE(tmpl.error().message.find("not valid UTF-8"), std::string::npos);
}

TEST(JinjaEngine, ErrorsCarryTheTemplateName) {
  auto tmpl = Template::parse("{{ x|frob }}", "chat template");
  ASSERT_FALSE(tmpl.ok());
  EXPECT_EQ(tmpl.error().message.rfind("chat template line 1, column 6: ", 0), 0u)
      << tmpl.error().message;
}

TEST(JinjaEngine, HasLoopOver) {
  auto by_name = Template::parse("{% for p in content %}{% endfor %}");
  auto by_attr = Template::parse("{% if x %}{% for p in message.content %}{% endfor %}{% endif %}");
  auto by_key =
      Template::parse("{% macro m() %}{% for p in m['content'] %}{% endfor %}{% endmacro %}");
  auto none = Template::parse("{% for m in messages %}{{ m.content }}{% endfor %}");
  ASSERT_TRUE(by_name.ok() && by_attr.ok() && by_key.ok() && none.ok());
  EXPECT_TRUE(by_name->has_loop_over("content"));
  EXPECT_TRUE(by_attr->has_loop_over("content"));
  EXPECT_TRUE(by_key->has_loop_over("content"));
  EXPECT_FALSE(none->has_loop_over("content"));
}

// One parsed template rendered from several threads at once gives the same text everywhere.
TEST(JinjaEngine, ConcurrentRendersAgree) {
  auto tmpl = Template::parse(
      "{% set ns = namespace(n=0) %}{% macro m(x) %}<{{ x|upper }}>{% endmacro %}"
      "{% for i in range(50) %}{% set ns.n = ns.n + i %}{{ m(s) }}{{ d|tojson }}{% endfor %}"
      "{{ ns.n }}");
  ASSERT_TRUE(tmpl.ok());
  const Dict vars = vars_from(kVars);
  auto expected = tmpl->render(vars);
  ASSERT_TRUE(expected.ok());
  std::vector<std::string> results(4);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < results.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        auto out = tmpl->render(vars);
        results[t] = out.ok() ? out.value() : "error";
        if (results[t] != expected.value()) return;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& r : results) EXPECT_EQ(r, expected.value());
}

}  // namespace
}  // namespace recur::jinja
