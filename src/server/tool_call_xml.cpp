// Forced XML tool calls as a grammar (tool_call_xml.h): built from the request's tools, and
// followed byte by byte.
#include "server/tool_call_xml.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "server/output_parser.h"
#include "server/tool_call_grammar.h"
#include "tokenizer/utf8_util.h"

namespace recur::server {

namespace {

using Value = XmlCallGrammar::Value;

constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "\n</parameter>\n";
constexpr std::string_view kCallClose = "</function>\n</tool_call>";
constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ull, kFnvPrime = 0x100000001b3ull;

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

// A name the parser reads back whole between `<function=` or `<parameter=` and '>' (it trims
// spaces and stops at '<', '>' or a newline).
bool writable_name(std::string_view n) {
  return !n.empty() && n.size() <= XmlCallMatcher::kMaxName &&
         n.find_first_of("<>\n") == std::string_view::npos && !is_space(n.front()) &&
         !is_space(n.back());
}

// The texts a value of an enum or const schema is written as, when the parser reads each back
// as its value (a string bare, others as JSON) and none holds a newline or the close tag.
std::vector<std::string> choice_texts(const ojson& schema) {
  if (!schema.is_object()) return {};
  const ojson values = allowed_values(schema);  // as structured outputs take them
  std::vector<std::string> texts;
  for (const ojson& v : values) {
    std::string t = v.is_string() ? v.get<std::string>() : dump(v);
    if (t.find('\n') != std::string::npos || t.find("</parameter>") != std::string::npos ||
        typed_argument(t, &schema) != v) {
      return {};
    }
    texts.push_back(std::move(t));
  }
  std::sort(texts.begin(), texts.end());
  texts.erase(std::unique(texts.begin(), texts.end()), texts.end());
  return texts;
}

// The compiled schema of a value written as JSON: when none of the schema's values is a string
// (a string is written bare, so its text is free). Keywords the compiler refuses ("minimum")
// leave the type alone to follow.
std::shared_ptr<const CompiledSchema> json_value_schema(const ojson& schema) {
  auto compiled = compile_json_schema(schema, "tools");
  if (!compiled.ok() && schema.is_object()) {
    const ojson* type = field(schema, "type");
    if (!type) return nullptr;
    compiled = compile_json_schema(ojson{{"type", *type}}, "tools");
  }
  if (!compiled.ok()) return nullptr;
  JsonMatcher m(compiled->get());
  if (m.feed('"')) return nullptr;
  return *compiled;
}

Value value_of(const ojson& schema) {
  Value v;
  if (auto texts = choice_texts(schema); !texts.empty()) {
    v.kind = Value::Kind::kChoice;
    v.choices = std::move(texts);
  } else if (auto compiled = json_value_schema(schema)) {
    v.kind = Value::Kind::kJson;
    v.schema = std::move(compiled);
  } else if (schema.is_object()) {
    for (auto [key, limit] :
         {std::pair{"minLength", &v.min_chars}, std::pair{"maxLength", &v.max_chars}}) {
      const ojson* n = field(schema, key);
      if (auto x = n ? as_int(*n, 0, UINT32_MAX - 1) : std::nullopt) *limit = uint32_t(*x);
    }
  }
  return v;
}

// The parameters a function's schema lists (any name goes when it lists none, or too many).
void describe_parameters(const ojson& function, XmlCallGrammar::Function* f) {
  const ojson* params = field(function, "parameters");
  const ojson* props = params && params->is_object() ? field(*params, "properties") : nullptr;
  f->free_names = !props || !props->is_object();
  if (f->free_names) return;
  for (const auto& [name, schema] : props->items()) {
    if (writable_name(name)) f->params.push_back({name + ">\n", value_of(schema)});
  }
  if (f->params.size() > XmlCallGrammar::kMaxParams) {
    f->params.clear();
    f->free_names = true;
    return;
  }
  std::sort(f->params.begin(), f->params.end(),
            [](const auto& a, const auto& b) { return a.head < b.head; });
  const ojson* required = field(*params, "required");
  if (!required || !required->is_array()) return;
  for (const ojson& r : *required) {
    if (!r.is_string()) continue;
    const std::string head = r.get<std::string>() + ">\n";
    for (size_t i = 0; i < f->params.size(); ++i) {
      if (f->params[i].head == head) f->required |= uint64_t(1) << i;
    }
  }
}

// The run of [lo, hi) of `items` (sorted by key, sharing their first `pos` bytes) whose byte at
// `pos` is b (empty when none is).
template <class T, class Key>
std::pair<uint32_t, uint32_t> narrow(const std::vector<T>& items, Key key, uint32_t pos, uint8_t b,
                                     uint32_t lo, uint32_t hi) {
  const auto byte_at = [&](const T& x) {
    const std::string& s = key(x);
    return pos < s.size() ? int(uint8_t(s[pos])) : -1;
  };
  const auto first = items.begin() + lo, last = items.begin() + hi;
  const auto from =
      std::partition_point(first, last, [&](const T& x) { return byte_at(x) < int(b); });
  const auto to =
      std::partition_point(from, last, [&](const T& x) { return byte_at(x) == int(b); });
  return {uint32_t(from - items.begin()), uint32_t(to - items.begin())};
}

constexpr auto head_of = [](const auto& x) -> const std::string& { return x.head; };
constexpr auto itself = [](const std::string& s) -> const std::string& { return s; };

struct Utf8State {
  uint8_t left, lo, hi;
};
// The UTF-8 state after b, or false when b breaks the encoding; `starts`: b begins a character.
bool utf8_next(uint8_t b, Utf8State* s, bool* starts) {
  *starts = s->left == 0;
  if (s->left > 0) {
    if (b < s->lo || b > s->hi) return false;
    --s->left, s->lo = 0x80, s->hi = 0xBF;
    return true;
  }
  if (b < 0x80) return true;
  Utf8Lead lead;
  if (!utf8_lead(b, &lead)) return false;
  s->left = uint8_t(lead.continuations), s->lo = lead.lo, s->hi = lead.hi;
  return true;
}

}  // namespace

std::shared_ptr<const XmlCallGrammar> xml_call_grammar(const ojson& tools, std::string_view name,
                                                       bool more_calls) {
  auto g = std::make_shared<XmlCallGrammar>();
  // The heads are what the forced prefix writes for a named call, after "<tool_call>\n<function=".
  const std::string open = forced_call_prefix(ToolCallFormat::kXml, {});
  for (const ojson& tool : tools) {
    const std::string* tool_name = nullptr;
    const ojson* function = named_function(tool, &tool_name);
    if (!function) continue;
    const std::string& n = *tool_name;
    if ((!name.empty() && n != name) || !writable_name(n)) continue;
    XmlCallGrammar::Function f;
    f.head = n + ">\n";
    if (forced_call_prefix(ToolCallFormat::kXml, n) != open + f.head) return nullptr;
    describe_parameters(*function, &f);
    g->functions.push_back(std::move(f));
  }
  if (g->functions.empty()) return nullptr;
  sort_heads_keep_first(&g->functions);
  if (!name.empty()) g->primed = g->functions.front().head;
  // Qwen3.5's template writes calls one after another, a newline between.
  if (more_calls && name.empty()) g->repeat = "\n" + open;
  g->idle = any_json_object_schema();
  return g;
}

XmlCallMatcher::XmlCallMatcher(const XmlCallGrammar* grammar)
    : grammar_(grammar), hi_(uint32_t(grammar->functions.size())), value_(grammar->idle.get()) {
  (void)feed(grammar->primed);  // the grammar's own text: taken
}

void XmlCallMatcher::copy_from(const XmlCallMatcher& other) {
  grammar_ = other.grammar_;
  phase_ = other.phase_;
  lo_ = other.lo_, hi_ = other.hi_, pos_ = other.pos_;
  fn_ = other.fn_, given_ = other.given_, value_spec_ = other.value_spec_;
  chars_ = other.chars_, forbidden_at_ = other.forbidden_at_;
  last_nl_ = other.last_nl_, match_nl_ = other.match_nl_, root_number_ = other.root_number_;
  utf8_left_ = other.utf8_left_, utf8_lo_ = other.utf8_lo_, utf8_hi_ = other.utf8_hi_;
  name_hash_ = other.name_hash_;
  n_seen_ = other.n_seen_;
  std::copy_n(other.seen_.begin(), n_seen_, seen_.begin());
  if (phase_ == Phase::kJson) value_.copy_from(other.value_);
}

bool XmlCallMatcher::feed(std::string_view bytes) {
  return feed_each(*this, bytes);
}

bool XmlCallMatcher::param_may_come() const {
  const XmlCallGrammar::Function& f = function();
  if (f.free_names) return n_seen_ < kMaxFreeNames;
  const size_t n = f.params.size();
  return given_ != (n == 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1);
}

bool XmlCallMatcher::close_may_come() const {
  return (given_ & function().required) == function().required;
}

void XmlCallMatcher::begin_value(const Value* value) {
  value_spec_ = value;
  forbidden_at_ = 0;
  if (value && value->kind == Value::Kind::kJson) {
    value_.reset(value->schema.get());
    chars_ = 0, root_number_ = false;
    phase_ = Phase::kJson;
  } else if (value && value->kind == Value::Kind::kChoice) {
    lo_ = 0, hi_ = uint32_t(value->choices.size()), pos_ = 0;
    phase_ = Phase::kChoice;
  } else {
    chars_ = 0, last_nl_ = false, match_nl_ = false, utf8_left_ = 0;
    phase_ = Phase::kText;
  }
}

bool XmlCallMatcher::text_byte(uint8_t b) {
  const std::string& close = grammar_->forbidden;
  Utf8State u{utf8_left_, utf8_lo_, utf8_hi_};
  bool starts = false;
  if (!utf8_next(b, &u, &starts)) return false;
  const uint32_t at = advance_match(close, forbidden_at_, b);
  const uint32_t chars = chars_ + starts;
  const bool match_nl = at == 1 ? last_nl_ : match_nl_;
  if (at == close.size()) {
    // The value ends where the template ends it, after a newline of its own; the value is what
    // comes before that newline.
    if (!match_nl || chars - at - 1 < (value_spec_ ? value_spec_->min_chars : 0)) return false;
    phase_ = Phase::kParamClose;
    pos_ = uint32_t(kParamClose.size() - 1);  // the newline after the tag
    return true;
  }
  // The characters the value holds whatever comes next: not a close that may still come, nor
  // the newline before it.
  const uint32_t held = at > 0 && match_nl ? chars - at - 1 : b == '\n' ? chars - 1 : chars;
  if (value_spec_ && held > value_spec_->max_chars) return false;
  utf8_left_ = u.left, utf8_lo_ = u.lo, utf8_hi_ = u.hi;
  chars_ = chars, forbidden_at_ = at, last_nl_ = b == '\n', match_nl_ = match_nl;
  return true;
}

bool XmlCallMatcher::feed(uint8_t b) {
  const XmlCallGrammar& g = *grammar_;
  switch (phase_) {
    case Phase::kFunction: {
      const auto [from, to] = narrow(g.functions, head_of, pos_, b, lo_, hi_);
      if (from == to) return false;
      if (pos_ + 1 == g.functions[from].head.size()) {  // a whole head: one function
        fn_ = from, given_ = 0, n_seen_ = 0;
        phase_ = Phase::kTag, pos_ = 0;
        return true;
      }
      lo_ = from, hi_ = to, ++pos_;
      return true;
    }
    case Phase::kTag:
      // After a head or a parameter: another parameter or the close, both opening with '<'
      // (one of them may always come: a required parameter missing is one not given).
      if (pos_ == 0) {
        if (b != '<') return false;
        pos_ = 1;
        return true;
      }
      if (b == 'p' && param_may_come()) {
        phase_ = Phase::kKeyword, pos_ = 2;
        return true;
      }
      if (b == '/' && close_may_come()) {
        phase_ = Phase::kClose, pos_ = 2;
        return true;
      }
      return false;
    case Phase::kKeyword:
      if (b != uint8_t(kParamOpen[pos_])) return false;
      if (++pos_ < kParamOpen.size()) return true;
      pos_ = 0;
      if (function().free_names) {
        phase_ = Phase::kFreeName, name_hash_ = kFnvBasis, utf8_left_ = 0;
      } else {
        phase_ = Phase::kName, lo_ = 0, hi_ = uint32_t(function().params.size());
      }
      return true;
    case Phase::kName: {
      const auto& params = function().params;
      const auto [from, to] = narrow(params, head_of, pos_, b, lo_, hi_);
      bool open = false;  // a parameter not given yet begins so
      for (uint32_t i = from; i < to && !open; ++i) open = !(given_ >> i & 1);
      if (!open) return false;
      if (pos_ + 1 == params[from].head.size()) {
        given_ |= uint64_t(1) << from;
        begin_value(&params[from].value);
        return true;
      }
      lo_ = from, hi_ = to, ++pos_;
      return true;
    }
    case Phase::kFreeName: {
      if (b == '>') {
        if (pos_ == 0 || utf8_left_ > 0) return false;
        for (int i = 0; i < n_seen_; ++i) {
          if (seen_[size_t(i)] == name_hash_) return false;  // given already
        }
        phase_ = Phase::kFreeNameNl;
        return true;
      }
      if (b <= ' ' || b == '<' || b == 0x7F || pos_ >= kMaxName) return false;
      Utf8State u{utf8_left_, utf8_lo_, utf8_hi_};
      bool starts = false;
      if (!utf8_next(b, &u, &starts)) return false;
      utf8_left_ = u.left, utf8_lo_ = u.lo, utf8_hi_ = u.hi;
      name_hash_ = (name_hash_ ^ b) * kFnvPrime;
      ++pos_;
      return true;
    }
    case Phase::kFreeNameNl:
      if (b != '\n') return false;
      seen_[size_t(n_seen_++)] = name_hash_;
      begin_value(nullptr);
      return true;
    case Phase::kText:
      return text_byte(b);
    case Phase::kJson: {
      // A newline after a whole value is the template's, before `</parameter>`.
      if (b == '\n' && value_.can_end()) {
        phase_ = Phase::kParamClose, pos_ = 1;
        return true;
      }
      // No space around the value, as the template writes it; a number alone short enough that
      // an integer fits 64 bits (the parser reads a longer one back as text).
      const bool space = b == ' ' || b == '\t' || b == '\r' || b == '\n';
      if ((space && (chars_ == 0 || value_.can_end())) ||
          (root_number_ && chars_ >= kMaxNumberBytes)) {
        return false;
      }
      const uint32_t at = advance_match(g.forbidden, forbidden_at_, b);
      if (at == g.forbidden.size() || !value_.feed(b)) return false;
      if (chars_ == 0) root_number_ = b == '-' || (b >= '0' && b <= '9');
      forbidden_at_ = at, ++chars_;
      return true;
    }
    case Phase::kChoice: {
      const std::vector<std::string>& choices = value_spec_->choices;
      if (b == '\n' && choices[lo_].size() == pos_) {  // the shortest of the run is whole
        phase_ = Phase::kParamClose, pos_ = 1;
        return true;
      }
      const auto [from, to] = narrow(choices, itself, pos_, b, lo_, hi_);
      if (from == to) return false;
      lo_ = from, hi_ = to, ++pos_;
      return true;
    }
    case Phase::kParamClose:
      if (b != uint8_t(kParamClose[pos_])) return false;
      if (++pos_ == kParamClose.size()) phase_ = Phase::kTag, pos_ = 0;
      return true;
    case Phase::kClose:
      if (pos_ >= kCallClose.size() || b != uint8_t(kCallClose[pos_])) return false;
      if (++pos_ == kCallClose.size() && !g.repeat.empty()) phase_ = Phase::kRepeat, pos_ = 0;
      return true;
    case Phase::kRepeat:
      if (b != uint8_t(g.repeat[pos_])) return false;
      if (++pos_ == g.repeat.size()) {  // another call: any function again
        phase_ = Phase::kFunction;
        lo_ = 0, hi_ = uint32_t(g.functions.size()), pos_ = 0;
      }
      return true;
  }
  return false;
}

bool XmlCallMatcher::can_end() const {
  return (phase_ == Phase::kClose && pos_ == kCallClose.size()) ||
         (phase_ == Phase::kRepeat && pos_ == 0);
}

int XmlCallMatcher::free_string_room() const {
  if (phase_ == Phase::kJson) return forbidden_at_ == 0 ? value_.free_string_room() : -1;
  if (phase_ != Phase::kText || forbidden_at_ > 0 || utf8_left_ > 0) return -1;
  // A string-safe token holds no newline: what it adds are characters of the value.
  const uint32_t max = value_spec_ ? value_spec_->max_chars : UINT32_MAX;
  if (max == UINT32_MAX) return INT_MAX;
  return chars_ >= max ? 0 : int(std::min<uint32_t>(max - chars_, INT_MAX));
}

}  // namespace recur::server
