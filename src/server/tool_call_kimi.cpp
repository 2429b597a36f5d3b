// Forced Kimi tool calls as a grammar (tool_call_kimi.h): built from the request's tools, and
// followed byte by byte, each marker one reserved byte.
#include "server/tool_call_kimi.h"

#include <algorithm>

#include "server/output_parser.h"
#include "server/tool_call_grammar.h"

namespace recur::server {

namespace {

// A name the parser reads back whole from functions.NAME:INDEX (it takes the text before the
// last ':' and refuses spaces, '<' and '>'); control bytes and ':' left out too, so that no
// head is a prefix of another.
bool writable_name(std::string_view n) {
  if (n.empty() || n.size() > KimiCallMatcher::kMaxName) return false;
  for (char c : n) {
    if (uint8_t(c) <= ' ' || c == ':' || c == '<' || c == '>') return false;
  }
  return true;
}

}  // namespace

std::shared_ptr<const KimiCallGrammar> kimi_call_grammar(const ojson& tools, std::string_view name,
                                                         bool more_calls) {
  using G = KimiCallGrammar;
  auto g = std::make_shared<G>();
  // The forced prefix opens the section and the first call; what follows the call's marker
  // there is what follows it in every later call.
  const std::string open = forced_call_prefix(ToolCallFormat::kKimi, {});
  const std::string markers =
      std::string(G::kMarkers[G::kSectionBegin]) + std::string(G::kMarkers[G::kCallBegin]);
  if (!open.starts_with(markers)) return nullptr;  // not the form this grammar knows
  g->call_lead = open.substr(markers.size());
  for (const ojson& tool : tools) {
    const std::string* tool_name = nullptr;
    const ojson* function = named_function(tool, &tool_name);
    if (!function) continue;
    const std::string& n = *tool_name;
    if ((!name.empty() && n != name) || !writable_name(n)) continue;
    std::string head = forced_call_prefix(ToolCallFormat::kKimi, n).substr(open.size());
    if (head != n + ":") return nullptr;
    g->branches.push_back({std::move(head), arguments_schema(*function)});
  }
  if (g->branches.empty()) return nullptr;
  sort_heads_keep_first(&g->branches);
  if (!name.empty()) g->primed = g->branches.front().head;
  g->more_calls = more_calls && name.empty();
  return g;
}

KimiCallMatcher::KimiCallMatcher(const KimiCallGrammar* grammar)
    : grammar_(grammar),
      hi_(uint32_t(grammar->branches.size())),
      value_(grammar->branches.front().schema.get()) {
  (void)feed(grammar->primed);  // the grammar's own text: taken
}

void KimiCallMatcher::copy_from(const KimiCallMatcher& other) {
  grammar_ = other.grammar_;
  phase_ = other.phase_;
  lo_ = other.lo_, hi_ = other.hi_, pos_ = other.pos_, fn_ = other.fn_;
  zero_ = other.zero_;
  index_ = other.index_, want_ = other.want_, want_len_ = other.want_len_;
  forbidden_at_ = other.forbidden_at_;
  if (phase_ == Phase::kValue) value_.copy_from(other.value_);
}

bool KimiCallMatcher::feed(std::string_view bytes) {
  return feed_each(*this, bytes);
}

bool KimiCallMatcher::feed(uint8_t b) {
  using G = KimiCallGrammar;
  const G& g = *grammar_;
  switch (phase_) {
    case Phase::kHead: {
      // The branches in [lo_, hi_) share their first pos_ bytes; those going on with b are a run.
      const auto first = g.branches.begin() + lo_, last = g.branches.begin() + hi_;
      const auto byte_at = [&](const G::Branch& br) {
        return pos_ < br.head.size() ? int(uint8_t(br.head[pos_])) : -1;
      };
      const auto from =
          std::partition_point(first, last, [&](const auto& br) { return byte_at(br) < int(b); });
      const auto to =
          std::partition_point(from, last, [&](const auto& br) { return byte_at(br) == int(b); });
      if (from == to) return false;
      if (pos_ + 1 == from->head.size()) {  // a whole head (no other is longer): its index next
        fn_ = uint32_t(from - g.branches.begin());
        phase_ = Phase::kIndex;
        pos_ = 0, index_ = 0;
        zero_ = false;
        return true;
      }
      lo_ = uint32_t(from - g.branches.begin()), hi_ = uint32_t(to - g.branches.begin());
      ++pos_;
      return true;
    }
    case Phase::kIndex:
      if (b >= '0' && b <= '9') {
        if (zero_ || pos_ == kMaxIndexDigits) return false;
        if (want_len_ > 0 && (pos_ == want_len_ || b != uint8_t(want_[pos_]))) return false;
        zero_ = pos_ == 0 && b == '0';
        index_ = index_ * 10 + (b - '0');
        ++pos_;
        return true;
      }
      if (b != G::byte(G::kArgsBegin) || pos_ == 0 || pos_ < want_len_) return false;
      phase_ = Phase::kArgsOpen;
      return true;
    case Phase::kArgsOpen:
      if (b != '{') return false;
      value_.reset(g.branches[fn_].schema.get());
      if (!value_.feed(b)) return false;  // arguments_schema's schemas take '{'
      phase_ = Phase::kValue;
      forbidden_at_ = 0;
      return true;
    case Phase::kValue: {
      // The value refuses the marker bytes itself (no UTF-8 holds them); the call's end marker
      // ends it once it is whole.
      const uint32_t at = advance_match(g.forbidden, forbidden_at_, b);
      if (at < g.forbidden.size() && value_.feed(b)) {
        forbidden_at_ = at;
        return true;
      }
      if (b != G::byte(G::kCallEnd) || !value_.can_end()) return false;
      phase_ = Phase::kAfterCall;
      return true;
    }
    case Phase::kAfterCall:
      if (b == G::byte(G::kSectionEnd)) {
        phase_ = Phase::kDone;
        return true;
      }
      if (b != G::byte(G::kCallBegin) || !g.more_calls) return false;
      if (!next_index()) return false;  // no index left within kMaxIndexDigits
      phase_ = Phase::kLead;
      pos_ = 0;
      if (!g.call_lead.empty()) return true;
      break;
    case Phase::kLead:
      if (b != uint8_t(g.call_lead[pos_])) return false;
      if (++pos_ < g.call_lead.size()) return true;
      break;
    case Phase::kDone:
      return false;
  }
  // The lead is whole: another call, of any branch.
  phase_ = Phase::kHead;
  lo_ = 0, hi_ = uint32_t(g.branches.size()), pos_ = 0;
  return true;
}

bool KimiCallMatcher::next_index() {
  uint32_t next = index_ + 1, len = 0;
  std::array<char, kMaxIndexDigits> digits{};
  for (; next > 0; next /= 10) {
    if (len == kMaxIndexDigits) return false;
    digits[len++] = char('0' + next % 10);
  }
  for (uint32_t i = 0; i < len; ++i) want_[i] = digits[len - 1 - i];
  want_len_ = len;
  return true;
}

bool KimiCallMatcher::can_end() const {
  return phase_ == Phase::kDone;
}

int KimiCallMatcher::free_string_room() const {
  if (phase_ != Phase::kValue || forbidden_at_ > 0) return -1;
  return value_.free_string_room();
}

}  // namespace recur::server
