#include "server/output_parser.h"

#include <algorithm>

namespace recur::server {

namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";

// Length of the longest suffix of `s` that is a proper prefix of `marker`.
size_t partial_suffix(std::string_view s, std::string_view marker) {
  for (size_t len = std::min(s.size(), marker.size() - 1); len > 0; --len) {
    if (s.substr(s.size() - len) == marker.substr(0, len)) return len;
  }
  return 0;
}

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace

OutputParser::OutputParser(const OutputOptions& options, std::string id_prefix)
    : options_(options), id_prefix_(std::move(id_prefix)) {
  if (options_.parse_reasoning) {
    state_ = options_.start_in_reasoning ? State::kReasoning : State::kThinkStart;
    strip_newlines_ = options_.start_in_reasoning;
  } else {
    state_ = State::kContent;
  }
  if (!options_.forced_prefix.empty()) {
    std::vector<Segment> discard;  // the prefix is part of the prompt, not of the output
    push(options_.forced_prefix, &discard);
  }
}

void OutputParser::emit_text(Segment::Kind kind, std::string_view text, std::vector<Segment>* out) {
  if (text.empty()) return;
  if (!out->empty() && out->back().kind == kind) {
    out->back().text.append(text);
    return;
  }
  Segment s;
  s.kind = kind;
  s.text = std::string(text);
  out->push_back(std::move(s));
}

void OutputParser::push(std::string_view text, std::vector<Segment>* out) {
  buf_.append(text);
  process(false, out);
}

void OutputParser::finish(std::vector<Segment>* out) {
  process(true, out);
}

void OutputParser::handle_block(std::string_view block, bool terminated,
                                std::vector<Segment>* out) {
  ojson j = ojson::parse(trim(block), nullptr, false);
  const ojson* name = j.is_object() ? field(j, "name") : nullptr;
  if (!name || !name->is_string() || name->get_ref<const std::string&>().empty()) {
    // Not a call after all: the model's text goes out as content.
    std::string raw(kCallOpen);
    raw.append(block);
    if (terminated) raw.append(kCallClose);
    emit_text(Segment::Kind::kContent, raw, out);
    return;
  }
  if (calls_ > 0 && !options_.parallel_tool_calls) return;
  Segment s;
  s.kind = Segment::Kind::kToolCall;
  s.call.id = random_id(id_prefix_);
  s.call.name = name->get<std::string>();
  const ojson* args = field(j, "arguments");
  if (!args) args = field(j, "parameters");
  if (!args) {
    s.call.arguments = "{}";
  } else if (args->is_string()) {
    s.call.arguments = args->get<std::string>();
  } else {
    s.call.arguments = dump(*args);
  }
  ++calls_;
  out->push_back(std::move(s));
}

void OutputParser::process(bool final, std::vector<Segment>* out) {
  for (;;) {
    switch (state_) {
      case State::kThinkStart: {
        const size_t p = buf_.find_first_not_of(" \t\r\n");
        if (p == std::string::npos && !final) return;
        if (p != std::string::npos && buf_.compare(p, kThinkOpen.size(), kThinkOpen) == 0) {
          buf_.erase(0, p + kThinkOpen.size());
          state_ = State::kReasoning;
          strip_newlines_ = true;
          continue;
        }
        if (p != std::string::npos && !final &&
            std::string_view(kThinkOpen).substr(0, buf_.size() - p) ==
                std::string_view(buf_).substr(p)) {
          return;  // "<thi" so far
        }
        state_ = State::kContent;
        continue;
      }
      case State::kReasoning: {
        if (strip_newlines_) {
          const size_t p = buf_.find_first_not_of('\n');
          buf_.erase(0, p == std::string::npos ? buf_.size() : p);
          if (buf_.empty() && !final) return;
          strip_newlines_ = false;
        }
        const size_t end = buf_.find(kThinkClose);
        if (end != std::string::npos) {
          std::string_view r(buf_.data(), end);
          while (!r.empty() && r.back() == '\n') r.remove_suffix(1);
          emit_text(Segment::Kind::kReasoning, r, out);
          buf_.erase(0, end + kThinkClose.size());
          state_ = State::kContent;
          strip_newlines_ = true;
          continue;
        }
        size_t hold = 0;
        if (!final) {
          hold = partial_suffix(buf_, kThinkClose);
          while (hold < buf_.size() && buf_[buf_.size() - hold - 1] == '\n') ++hold;
        } else {
          while (hold < buf_.size() && buf_[buf_.size() - hold - 1] == '\n') ++hold;
        }
        emit_text(Segment::Kind::kReasoning, std::string_view(buf_).substr(0, buf_.size() - hold),
                  out);
        buf_.erase(0, buf_.size() - hold);
        if (final) buf_.clear();
        return;
      }
      case State::kContent: {
        if (strip_newlines_ || after_call_) {
          const size_t p =
              after_call_ ? buf_.find_first_not_of(" \t\r\n") : buf_.find_first_not_of('\n');
          buf_.erase(0, p == std::string::npos ? buf_.size() : p);
          if (buf_.empty()) return;
          strip_newlines_ = false;
        }
        if (!options_.parse_tools) {
          emit_text(Segment::Kind::kContent, buf_, out);
          buf_.clear();
          return;
        }
        const size_t open = buf_.find(kCallOpen);
        if (open != std::string::npos) {
          std::string_view before(buf_.data(), open);
          emit_text(Segment::Kind::kContent, before, out);
          buf_.erase(0, open + kCallOpen.size());
          state_ = State::kToolCall;
          continue;
        }
        const size_t hold = final ? 0 : partial_suffix(buf_, kCallOpen);
        std::string_view text = std::string_view(buf_).substr(0, buf_.size() - hold);
        if (!text.empty()) after_call_ = false;
        emit_text(Segment::Kind::kContent, text, out);
        buf_.erase(0, buf_.size() - hold);
        return;
      }
      case State::kToolCall: {
        const size_t close = buf_.find(kCallClose);
        if (close != std::string::npos) {
          handle_block(std::string_view(buf_).substr(0, close), true, out);
          buf_.erase(0, close + kCallClose.size());
          state_ = State::kContent;
          after_call_ = true;
          continue;
        }
        if (!final) return;
        handle_block(buf_, false, out);
        buf_.clear();
        state_ = State::kContent;
        return;
      }
    }
  }
}

std::string matched_stop(std::string_view text, const std::vector<std::string>& stops) {
  size_t best_end = std::string::npos, best_start = std::string::npos;
  std::string best;
  for (const std::string& s : stops) {
    if (s.empty()) continue;
    const size_t pos = text.find(s);
    if (pos == std::string::npos) continue;
    const size_t end = pos + s.size();
    if (end < best_end || (end == best_end && pos < best_start)) {
      best_end = end;
      best_start = pos;
      best = s;
    }
  }
  return best;
}

}  // namespace recur::server
