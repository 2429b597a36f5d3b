// Forced JSON tool calls as a grammar (tool_call_grammar.h): built from the request's tools, and
// followed byte by byte.
#include "server/tool_call_grammar.h"

#include <algorithm>

#include "server/output_parser.h"

namespace recur::server {

std::shared_ptr<const CompiledSchema> arguments_schema(const ojson& function) {
  if (const ojson* params = field(function, "parameters"); params && params->is_object()) {
    auto compiled = compile_json_schema(*params, "tools");
    if (compiled.ok()) {
      JsonMatcher m(compiled->get());
      if (m.feed('{')) return *compiled;
    }
  }
  return any_json_object_schema();
}

uint32_t advance_match(std::string_view text, uint32_t at, uint8_t b) {
  for (;;) {
    if (at < text.size() && uint8_t(text[at]) == b) return at + 1;
    if (at == 0) return 0;
    // The next shorter prefix of text that its first `at` bytes end with.
    uint32_t k = at - 1;
    while (k > 0 && text.substr(0, k) != text.substr(at - k, k)) --k;
    at = k;
  }
}

const ojson* named_function(const ojson& tool, const std::string** name) {
  const ojson* function = tool.is_object() ? field(tool, "function") : nullptr;
  const ojson* n = function && function->is_object() ? field(*function, "name") : nullptr;
  if (!n || !n->is_string()) return nullptr;
  *name = &n->get_ref<const std::string&>();
  return function;
}

std::shared_ptr<const ToolCallGrammar> json_call_grammar(const ojson& tools, std::string_view name,
                                                         bool more_calls) {
  auto g = std::make_shared<ToolCallGrammar>();
  // The heads are what the forced prefix writes for a named call, after "<tool_call>\n".
  const std::string open = forced_call_prefix(ToolCallFormat::kJson, {});
  for (const ojson& tool : tools) {
    const std::string* tool_name = nullptr;
    const ojson* function = named_function(tool, &tool_name);
    if (!function) continue;
    const std::string& n = *tool_name;
    if (!name.empty() && n != name) continue;
    std::string head = forced_call_prefix(ToolCallFormat::kJson, n).substr(open.size());
    if (head.empty() || head.back() != '{') return nullptr;  // not the form this grammar knows
    g->branches.push_back({std::move(head), arguments_schema(*function)});
  }
  if (g->branches.empty()) return nullptr;
  sort_heads_keep_first(&g->branches);
  if (!name.empty()) g->primed = g->branches.front().head;
  g->tail = "}\n</tool_call>";
  g->forbidden = "</tool_call>";
  // Qwen's template writes calls one after another, a newline between.
  if (more_calls && name.empty()) g->repeat = "\n" + open;
  return g;
}

ToolCallMatcher::ToolCallMatcher(const ToolCallGrammar* grammar)
    : grammar_(grammar),
      hi_(uint32_t(grammar->branches.size())),
      value_(grammar->branches.front().schema.get()) {
  (void)feed(grammar->primed);  // the grammar's own text: taken
}

void ToolCallMatcher::copy_from(const ToolCallMatcher& other) {
  grammar_ = other.grammar_;
  phase_ = other.phase_;
  lo_ = other.lo_, hi_ = other.hi_, pos_ = other.pos_;
  forbidden_at_ = other.forbidden_at_;
  if (phase_ == Phase::kValue) value_.copy_from(other.value_);
}

bool ToolCallMatcher::feed(std::string_view bytes) {
  return feed_each(*this, bytes);
}

bool ToolCallMatcher::feed(uint8_t b) {
  const ToolCallGrammar& g = *grammar_;
  switch (phase_) {
    case Phase::kHead: {
      // The branches in [lo_, hi_) share their first pos_ bytes; those going on with b are a run.
      const auto first = g.branches.begin() + lo_, last = g.branches.begin() + hi_;
      const auto byte_at = [&](const ToolCallGrammar::Branch& br) {
        return pos_ < br.head.size() ? int(uint8_t(br.head[pos_])) : -1;
      };
      const auto from =
          std::partition_point(first, last, [&](const auto& br) { return byte_at(br) < int(b); });
      const auto to =
          std::partition_point(from, last, [&](const auto& br) { return byte_at(br) == int(b); });
      if (from == to) return false;
      const ToolCallGrammar::Branch& br = *from;
      if (pos_ + 1 == br.head.size()) {  // a whole head: one branch, whose arguments begin
        value_.reset(br.schema.get());
        if (!value_.feed(b)) return false;  // json_call_grammar's schemas take '{'
        phase_ = Phase::kValue;
        forbidden_at_ = 0;
        return true;
      }
      lo_ = uint32_t(from - g.branches.begin()), hi_ = uint32_t(to - g.branches.begin());
      ++pos_;
      return true;
    }
    case Phase::kValue: {
      const uint32_t at = advance_match(g.forbidden, forbidden_at_, b);
      if ((g.forbidden.empty() || at < g.forbidden.size()) && value_.feed(b)) {
        forbidden_at_ = at;
        return true;
      }
      // A byte the value does not take may begin the tail once the value is whole.
      if (g.tail.empty() || b != uint8_t(g.tail[0]) || !value_.can_end()) return false;
      phase_ = Phase::kTail;
      pos_ = 1;
      break;
    }
    case Phase::kTail:
      if (pos_ >= g.tail.size() || b != uint8_t(g.tail[pos_])) return false;
      ++pos_;
      break;
    case Phase::kRepeat:
      if (b != uint8_t(g.repeat[pos_])) return false;
      if (++pos_ == g.repeat.size()) {  // another call: any branch again
        phase_ = Phase::kHead;
        lo_ = 0, hi_ = uint32_t(g.branches.size()), pos_ = 0;
      }
      return true;
  }
  if (pos_ == g.tail.size() && !g.repeat.empty()) phase_ = Phase::kRepeat, pos_ = 0;
  return true;
}

bool ToolCallMatcher::can_end() const {
  return (phase_ == Phase::kTail && pos_ == grammar_->tail.size()) ||
         (phase_ == Phase::kRepeat && pos_ == 0);
}

int ToolCallMatcher::free_string_room() const {
  if (phase_ != Phase::kValue || forbidden_at_ > 0) return -1;
  return value_.free_string_room();
}

}  // namespace recur::server
