#include "server/output_parser.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "server/ascii.h"

namespace recur::server {

namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "</parameter>";
constexpr size_t kMaxXmlName = 256;  // a longer <function=…> or <parameter=…> name is not one
// Kimi: a section of calls, each with the model's own id (functions.NAME:INDEX) and JSON.
constexpr std::string_view kSectionOpen = "<|tool_calls_section_begin|>";
constexpr std::string_view kSectionClose = "<|tool_calls_section_end|>";
constexpr std::string_view kKimiCallOpen = "<|tool_call_begin|>";
constexpr std::string_view kKimiArgsOpen = "<|tool_call_argument_begin|>";
constexpr std::string_view kKimiCallClose = "<|tool_call_end|>";
constexpr size_t kMaxKimiId = 512;  // a longer id is not one

// What opens and closes the block of calls, and what the block must start with to be one.
struct CallMarkers {
  std::string_view open, close, first;
};
CallMarkers call_markers(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kXml:
      return {kCallOpen, kCallClose, kFunctionOpen};
    case ToolCallFormat::kKimi:
      return {kSectionOpen, kSectionClose, kKimiCallOpen};
    case ToolCallFormat::kJson:
      break;
  }
  return {kCallOpen, kCallClose, "{"};
}

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

size_t skip_space(std::string_view s, size_t pos) {
  while (pos < s.size() && is_space(s[pos])) ++pos;
  return pos;
}

bool starts_at(std::string_view s, size_t pos, std::string_view prefix) {
  return s.substr(std::min(pos, s.size()), prefix.size()) == prefix;
}

// A search for a marker of `len` bytes that failed on `size` bytes resumes here next time.
size_t resume_at(size_t size, size_t len, size_t from) {
  return std::max(from, size >= len ? size - len + 1 : size_t(0));
}

// Model-written JSON, or nothing when it is not JSON (or nested too deep to handle:
// serializing, templating and the Anthropic input recurse on it).
std::optional<ojson> parse_json(std::string_view s) {
  if (s.empty() || !depth_within(s, kMaxJsonDepth)) return std::nullopt;
  ojson j = ojson::parse(s, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// The name of <function=NAME> / <parameter=NAME> starting at `pos`: up to '>', on one line,
// without '<'. Returns the trimmed name and the position after '>'.
std::optional<std::pair<std::string_view, size_t>> xml_name(std::string_view s, size_t pos) {
  const size_t end = s.find_first_of(">\n<", pos);
  if (end == std::string_view::npos || s[end] != '>' || end - pos > kMaxXmlName) {
    return std::nullopt;
  }
  const std::string_view name = trim(s.substr(pos, end - pos));
  if (name.empty()) return std::nullopt;
  return std::make_pair(name, end + 1);
}

enum TypeBits : unsigned {
  kString = 1,
  kInteger = 2,
  kNumber = 4,
  kBoolean = 8,
  kNull = 16,
  kObject = 32,
  kArray = 64,
};

unsigned type_bit(const ojson& t) {
  if (!t.is_string()) return 0;
  const std::string& s = t.get_ref<const std::string&>();
  if (s == "string") return kString;
  if (s == "integer") return kInteger;
  if (s == "number") return kNumber;
  if (s == "boolean") return kBoolean;
  if (s == "null") return kNull;
  if (s == "object") return kObject;
  if (s == "array") return kArray;
  return 0;
}

// The JSON types a schema allows ("type", a list of them, or anyOf/oneOf alternatives);
// 0 when it does not say (no "type", "$ref", an alternative without one).
unsigned schema_types(const ojson& schema, int depth) {
  if (!schema.is_object() || depth > 8) return 0;
  unsigned bits = 0;
  if (const ojson* t = field(schema, "type")) {
    if (t->is_array()) {
      for (const ojson& x : *t) bits |= type_bit(x);
    } else {
      bits |= type_bit(*t);
    }
  }
  for (const char* key : {"anyOf", "oneOf"}) {
    const ojson* alts = field(schema, key);
    if (!alts || !alts->is_array()) continue;
    for (const ojson& alt : *alts) {
      const unsigned b = schema_types(alt, depth + 1);
      if (b == 0) return 0;
      bits |= b;
    }
  }
  return bits;
}

// The function of a Kimi call id: NAME in functions.NAME:INDEX (the prefix may be missing).
std::optional<std::string_view> kimi_function_name(std::string_view id) {
  const size_t colon = id.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == id.size() || id.size() > kMaxKimiId ||
      id.find_first_not_of("0123456789", colon + 1) != std::string_view::npos) {
    return std::nullopt;
  }
  std::string_view name = id.substr(0, colon);
  if (name.starts_with("functions.")) name.remove_prefix(10);
  if (name.empty() || name.find_first_of(" \t\r\n<>") != std::string_view::npos) {
    return std::nullopt;
  }
  return name;
}

}  // namespace

ojson typed_argument(std::string_view value, const ojson* schema) {
  const unsigned types = schema ? schema_types(*schema, 0) : 0;
  const std::string_view t = trim(value);
  if (types == 0) {
    std::optional<ojson> j = parse_json(t);
    return j ? std::move(*j) : ojson(std::string(value));
  }
  // Other types before string: a union with string still reads "3" as 3, "null" as null.
  if ((types & kNull) && iequals(t, "null")) return nullptr;
  if (types & kBoolean) {
    if (iequals(t, "true")) return true;
    if (iequals(t, "false")) return false;
  }
  if (types & (kInteger | kNumber)) {
    std::optional<ojson> j = parse_json(t);
    if (j && j->is_number()) {
      if ((types & kNumber) || j->is_number_integer()) return std::move(*j);
      const double d = j->get<double>();
      if (std::trunc(d) == d && std::fabs(d) < 9.0e18) return int64_t(d);  // 5.0 is an integer
    }
  }
  if (types & (kObject | kArray)) {
    std::optional<ojson> j = parse_json(t);
    if (j && ((j->is_object() && (types & kObject)) || (j->is_array() && (types & kArray)))) {
      return std::move(*j);
    }
  }
  return std::string(value);  // a string, or what does not parse as the schema's type
}

OutputParser::OutputParser(const OutputOptions& options, std::string id_prefix)
    : options_(options), id_prefix_(std::move(id_prefix)) {
  state_ = options_.parse_reasoning ? State::kThinkStart : State::kContent;
  if (!options_.forced_prefix.empty()) {
    std::vector<Segment> discard;  // the prefix is part of the prompt, not of the output
    push(options_.forced_prefix, &discard);
    forced_open_ = state_ == State::kToolCall;
    forced_rest_ = buf_;
  }
}

void OutputParser::emit_text(Segment::Kind kind, std::string_view text, std::vector<Segment>* out) {
  if (text.empty()) return;
  after_call_ = false;  // text came after the last call: what follows is not between calls
  if (!out->empty() && out->back().kind == kind) {
    out->back().text.append(text);
    return;
  }
  Segment s;
  s.kind = kind;
  s.text = std::string(text);
  out->push_back(std::move(s));
}

void OutputParser::emit_call(std::string name, std::string arguments, std::vector<Segment>* out,
                             std::string id, bool cut) {
  after_call_ = true;
  if (calls_ > 0 && !options_.parallel_tool_calls) return;
  Segment s;
  s.kind = Segment::Kind::kToolCall;
  s.call.id = id.empty() ? random_id(id_prefix_) : std::move(id);
  s.call.name = std::move(name);
  s.call.arguments = std::move(arguments);
  s.call.cut = cut;
  ++calls_;
  out->push_back(std::move(s));
}

void OutputParser::push(std::string_view text, std::vector<Segment>* out) {
  buf_.append(text);
  process(false, out);
}

void OutputParser::finish(std::vector<Segment>* out) {
  process(true, out);
}

const ojson* OutputParser::parameter_schema(std::string_view tool,
                                            std::string_view parameter) const {
  if (!options_.tools || !options_.tools->is_array()) return nullptr;
  for (const ojson& t : *options_.tools) {
    const ojson* fn = t.is_object() ? field(t, "function") : nullptr;
    if (!fn || !fn->is_object()) continue;
    const ojson* name = field(*fn, "name");
    if (!name || !name->is_string() || name->get_ref<const std::string&>() != tool) continue;
    const ojson* params = field(*fn, "parameters");
    const ojson* props = params && params->is_object() ? field(*params, "properties") : nullptr;
    return props && props->is_object() ? field(*props, parameter) : nullptr;
  }
  return nullptr;
}

bool OutputParser::handle_json(std::string_view block, std::vector<Segment>* out) {
  std::optional<ojson> j = parse_json(trim(block));
  const ojson* name = j && j->is_object() ? field(*j, "name") : nullptr;
  if (!name || !name->is_string() || name->get_ref<const std::string&>().empty()) return false;
  const ojson* args = field(*j, "arguments");
  if (!args) args = field(*j, "parameters");
  std::string arguments;
  if (!args) {
    arguments = "{}";
  } else if (args->is_string()) {
    // Arguments written as a JSON text inside a string: clients parse what they get, so a
    // string that holds no JSON makes the call malformed (an empty one means no arguments).
    const std::string_view text = trim(args->get_ref<const std::string&>());
    if (text.empty()) {
      arguments = "{}";
    } else if (parse_json(text)) {
      arguments = args->get<std::string>();
    } else {
      return false;
    }
  } else {
    arguments = dump(*args);
  }
  emit_call(name->get<std::string>(), std::move(arguments), out);
  return true;
}

// <function=NAME> (<parameter=ARG>\nVALUE\n</parameter>)* </function>, one or more times;
// whitespace between the tags. Cut off by the end of output, a call counts only once its
// </function> is in.
// <parameter=NAME>\nVALUE\n</parameter> at `pos` into args (typed by the tool's schema);
// the position after it, or npos when there is none whole.
size_t OutputParser::xml_parameter(std::string_view b, size_t pos, std::string_view tool,
                                   ojson* args) const {
  if (!starts_at(b, pos, kParamOpen)) return std::string_view::npos;
  const auto param = xml_name(b, pos + kParamOpen.size());
  if (!param) return std::string_view::npos;
  const size_t end = b.find(kParamClose, param->second);
  if (end == std::string_view::npos) return std::string_view::npos;
  // The newline after <parameter=…> and the one before </parameter> are markup.
  std::string_view value = b.substr(param->second, end - param->second);
  if (!value.empty() && value.front() == '\n') value.remove_prefix(1);
  if (!value.empty() && value.back() == '\n') value.remove_suffix(1);
  (*args)[std::string(param->first)] = typed_argument(value, parameter_schema(tool, param->first));
  return end + kParamClose.size();
}

bool OutputParser::handle_xml(std::string_view b, bool terminated, std::vector<Segment>* out) {
  std::vector<std::pair<std::string, ojson>> calls;
  size_t pos = skip_space(b, 0);
  while (pos < b.size()) {
    if (!starts_at(b, pos, kFunctionOpen)) return false;
    const auto name = xml_name(b, pos + kFunctionOpen.size());
    if (!name) return false;
    pos = name->second;
    ojson args = ojson::object();
    bool closed = false;
    for (;;) {
      pos = skip_space(b, pos);
      if (starts_at(b, pos, kParamOpen)) {
        pos = xml_parameter(b, pos, name->first, &args);
        if (pos == std::string_view::npos) return false;
      } else if (starts_at(b, pos, kFunctionClose)) {
        pos += kFunctionClose.size();
        closed = true;
        break;
      } else if (pos == b.size()) {
        break;
      } else {
        return false;
      }
    }
    if (!closed && !terminated) return false;
    calls.emplace_back(std::string(name->first), std::move(args));
    pos = skip_space(b, pos);
  }
  if (calls.empty()) return false;
  for (auto& [name, args] : calls) emit_call(std::move(name), dump(args), out);
  return true;
}

// <|tool_call_begin|>ID<|tool_call_argument_begin|>{json}<|tool_call_end|>, one or more times;
// whitespace between them. A call counts only once its <|tool_call_end|> is in. The model's id
// is kept: the chat template writes it back (and its result's "## Return of ID") next turn.
bool OutputParser::handle_kimi(std::string_view b, std::vector<Segment>* out) {
  struct Call {
    std::string id, name, arguments;
  };
  std::vector<Call> calls;
  for (size_t pos = skip_space(b, 0); pos < b.size(); pos = skip_space(b, pos)) {
    if (!starts_at(b, pos, kKimiCallOpen)) return false;
    const size_t id_at = pos + kKimiCallOpen.size();
    const size_t args_at = b.find(kKimiArgsOpen, id_at);
    if (args_at == std::string_view::npos) return false;
    const std::string_view id = trim(b.substr(id_at, args_at - id_at));
    const auto name = kimi_function_name(id);
    if (!name) return false;
    const size_t body = args_at + kKimiArgsOpen.size();
    const size_t end = b.find(kKimiCallClose, body);
    if (end == std::string_view::npos) return false;
    std::optional<ojson> args = parse_json(trim(b.substr(body, end - body)));
    if (!args || !args->is_object()) return false;
    calls.push_back({std::string(id), std::string(*name), dump(*args)});
    pos = end + kKimiCallClose.size();
  }
  if (calls.empty()) return false;
  for (Call& c : calls) emit_call(std::move(c.name), std::move(c.arguments), out, std::move(c.id));
  return true;
}

bool OutputParser::handle_cut(std::string_view b, std::vector<Segment>* out) {
  // The arguments are what the model wrote of them, cut (empty when it wrote none), as OpenAI
  // and vLLM return a call that length ended: never closed into whole JSON it did not write.
  size_t pos = skip_space(b, 0);
  std::string name, id, arguments;
  if (options_.tool_format == ToolCallFormat::kXml) {
    // The parameters that are whole, as the JSON object they begin (left open: it is cut).
    if (!starts_at(b, pos, kFunctionOpen)) return false;
    const auto fn = xml_name(b, pos + kFunctionOpen.size());
    if (!fn) return false;
    ojson args = ojson::object();
    for (pos = fn->second; pos != std::string_view::npos;) {
      pos = xml_parameter(b, skip_space(b, pos), fn->first, &args);
    }
    name = fn->first;
    arguments = dump(args);
    arguments.pop_back();  // its '}'
  } else if (options_.tool_format == ToolCallFormat::kKimi) {
    if (!starts_at(b, pos, kKimiCallOpen)) return false;
    const size_t id_at = pos + kKimiCallOpen.size();
    const size_t args_at = b.find(kKimiArgsOpen, id_at);
    id = std::string(
        trim(b.substr(id_at, args_at == std::string_view::npos ? b.npos : args_at - id_at)));
    if (!id.empty() && id.back() == ':') id += '0';  // cut before the call's index
    const auto fn = kimi_function_name(id);
    if (!fn) return false;
    name = *fn;
    if (args_at != std::string_view::npos) {
      const std::string_view body = b.substr(args_at + kKimiArgsOpen.size());
      arguments = written_json(body.substr(0, body.find(kKimiCallClose)));
    }
  } else {
    // {"name": "NAME", "arguments": {…, as the forced prefix writes it.
    if (!starts_at(b, pos, "{")) return false;
    pos = skip_space(b, pos + 1);
    if (!starts_at(b, pos, "\"name\"")) return false;
    pos = skip_space(b, pos + 6);
    if (!starts_at(b, pos, ":")) return false;
    pos = skip_space(b, pos + 1);
    size_t end = pos + 1;
    while (end < b.size() && b[end] != '"') end += b[end] == '\\' ? 2 : 1;
    const std::optional<ojson> n =
        end < b.size() ? parse_json(b.substr(pos, end + 1 - pos)) : std::nullopt;
    if (!n || !n->is_string() || n->get_ref<const std::string&>().empty()) return false;
    name = n->get<std::string>();
    pos = skip_space(b, end + 1);
    if (starts_at(b, pos, ",")) {
      pos = skip_space(b, pos + 1);
      for (std::string_view key : {"\"arguments\"", "\"parameters\""}) {
        if (!starts_at(b, pos, key)) continue;
        pos = skip_space(b, pos + key.size());
        if (starts_at(b, pos, ":")) arguments = written_json(b.substr(pos + 1));
      }
    }
  }
  emit_call(std::move(name), std::move(arguments), out, std::move(id), /*cut=*/true);
  return true;
}

void OutputParser::handle_block(std::string_view block, bool terminated,
                                std::vector<Segment>* out) {
  const bool forced = forced_open_;
  forced_open_ = false;
  bool call = false;
  switch (options_.tool_format) {
    case ToolCallFormat::kXml:
      call = handle_xml(block, terminated, out);
      break;
    case ToolCallFormat::kKimi:
      call = handle_kimi(block, out);
      break;
    case ToolCallFormat::kJson:
      call = handle_json(block, out);
      break;
  }
  if (call) return;
  const Segment::Kind kind = call_in_think_ ? Segment::Kind::kReasoning : Segment::Kind::kContent;
  if (forced) {
    // A forced call that max_tokens cut (or the model garbled) is still that call, as far as
    // it can be read; the prefix the server forced is never output.
    if (handle_cut(block, out)) return;
    if (block.starts_with(forced_rest_)) block.remove_prefix(forced_rest_.size());
    emit_text(kind, block, out);
    return;
  }
  // Not a call after all: the model's text goes out as it was, where it was written.
  const CallMarkers m = call_markers(options_.tool_format);
  std::string raw(m.open);
  raw.append(block);
  if (terminated) raw.append(m.close);
  emit_text(kind, raw, out);
}

size_t OutputParser::xml_call_end(bool final) {
  // Only </parameter> ends a value: a value may hold "</tool_call>" (code, say).
  for (;;) {
    if (in_value_) {
      const size_t close = buf_.find(kParamClose, scan_);
      if (close == std::string::npos) {
        scan_ = resume_at(buf_.size(), kParamClose.size(), scan_);
        return std::string::npos;
      }
      in_value_ = false;
      scan_ = close + kParamClose.size();
      continue;
    }
    const size_t end = buf_.find(kCallClose, scan_);
    const size_t param = buf_.find(kParamOpen, scan_);
    if (param < end) {
      const size_t name = param + kParamOpen.size();
      const size_t stop = buf_.find_first_of(">\n<", name);
      if (stop == std::string::npos && buf_.size() - name <= kMaxXmlName && !final) {
        scan_ = param;  // the name may still end in '>'
        return std::string::npos;
      }
      if (stop != std::string::npos && buf_[stop] == '>' && stop - name <= kMaxXmlName) {
        in_value_ = true;
        scan_ = stop + 1;
      } else {
        scan_ = stop == std::string::npos ? name : stop;  // not a parameter after all
      }
      continue;
    }
    if (end != std::string::npos) return end;
    scan_ = resume_at(buf_.size(), std::max(kCallClose.size(), kParamOpen.size()), scan_);
    return std::string::npos;
  }
}

void OutputParser::process(bool final, std::vector<Segment>* out) {
  const CallMarkers m = call_markers(options_.tool_format);
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
        // A template that opened <think> itself: the output starts inside the reasoning.
        state_ = options_.start_in_reasoning ? State::kReasoning : State::kContent;
        strip_newlines_ = options_.start_in_reasoning;
        continue;
      }
      case State::kReasoning: {
        if (after_call_) {
          const size_t p = buf_.find_first_not_of(" \t\r\n");
          buf_.erase(0, p == std::string::npos ? buf_.size() : p);
          if (buf_.empty()) return;
          after_call_ = false;
        }
        if (strip_newlines_) {
          const size_t p = buf_.find_first_not_of('\n');
          buf_.erase(0, p == std::string::npos ? buf_.size() : p);
          if (buf_.empty() && !final) return;
          strip_newlines_ = false;
        }
        const size_t end = buf_.find(kThinkClose);
        const size_t open = options_.parse_tools ? buf_.find(m.open) : std::string::npos;
        if (open < end) {
          // A call written while thinking is still a call.
          emit_text(Segment::Kind::kReasoning, std::string_view(buf_).substr(0, open), out);
          buf_.erase(0, open + m.open.size());
          state_ = State::kToolCall;
          call_in_think_ = true;
          continue;
        }
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
          if (options_.parse_tools) hold = std::max(hold, partial_suffix(buf_, m.open));
        }
        while (hold < buf_.size() && buf_[buf_.size() - hold - 1] == '\n') ++hold;
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
        const size_t open = buf_.find(m.open);
        if (open != std::string::npos) {
          std::string_view before(buf_.data(), open);
          emit_text(Segment::Kind::kContent, before, out);
          buf_.erase(0, open + m.open.size());
          state_ = State::kToolCall;
          call_in_think_ = false;
          continue;
        }
        const size_t hold = final ? 0 : partial_suffix(buf_, m.open);
        std::string_view text = std::string_view(buf_).substr(0, buf_.size() - hold);
        emit_text(Segment::Kind::kContent, text, out);
        buf_.erase(0, buf_.size() - hold);
        return;
      }
      case State::kToolCall: {
        const State after = call_in_think_ ? State::kReasoning : State::kContent;
        if (!call_started_) {
          // A call opens with "{", "<function=" or "<|tool_call_begin|>": else the tag was
          // text, and the text goes on at once (not held until a close that may never come).
          const std::string_view opener = m.first;
          const size_t p = buf_.find_first_not_of(" \t\r\n");
          const std::string_view rest =
              p == std::string::npos ? std::string_view() : std::string_view(buf_).substr(p);
          if (rest.size() < opener.size() && rest == opener.substr(0, rest.size()) && !final) {
            return;
          }
          if (!rest.starts_with(opener)) {
            if (forced_open_) {
              // The model did not begin the call forced on it: its text, without the prefix.
              forced_open_ = false;
              if (buf_.starts_with(forced_rest_)) buf_.erase(0, forced_rest_.size());
            } else {
              emit_text(
                  after == State::kReasoning ? Segment::Kind::kReasoning : Segment::Kind::kContent,
                  m.open, out);
            }
            state_ = after;
            continue;
          }
          call_started_ = true;
        }
        size_t close;
        if (options_.tool_format == ToolCallFormat::kXml) {
          close = xml_call_end(final);
        } else {
          close = buf_.find(m.close, scan_);
          if (close == std::string::npos) scan_ = resume_at(buf_.size(), m.close.size(), 0);
        }
        if (close != std::string::npos) {
          handle_block(std::string_view(buf_).substr(0, close), true, out);
          buf_.erase(0, close + m.close.size());
          state_ = after;
          scan_ = 0;
          in_value_ = false;
          call_started_ = false;
          continue;
        }
        if (!final) return;
        handle_block(buf_, false, out);
        buf_.clear();
        state_ = after;
        scan_ = 0;
        in_value_ = false;
        call_started_ = false;
        return;
      }
    }
  }
}

ToolCallFormat detect_tool_call_format(std::string_view chat_template) {
  if (chat_template.find(kSectionOpen) != std::string_view::npos &&
      chat_template.find(kKimiCallOpen) != std::string_view::npos) {
    return ToolCallFormat::kKimi;
  }
  // Both tags: <function=…> alone also appears in other forms (Llama's <function=NAME>{json}).
  const bool xml = chat_template.find(kFunctionOpen) != std::string_view::npos &&
                   chat_template.find(kParamOpen) != std::string_view::npos;
  return xml ? ToolCallFormat::kXml : ToolCallFormat::kJson;
}

std::string forced_call_prefix(ToolCallFormat format, std::string_view name) {
  if (format == ToolCallFormat::kKimi) {
    // The model writes the call's index (and, when no name is given, its function).
    std::string prefix = std::string(kSectionOpen) + std::string(kKimiCallOpen) + "functions.";
    if (!name.empty()) prefix += std::string(name) + ":";
    return prefix;
  }
  std::string prefix(kCallOpen);
  prefix += '\n';
  if (format == ToolCallFormat::kXml) {
    prefix += kFunctionOpen;
    if (!name.empty()) {
      prefix += name;
      prefix += ">\n";
    }
  } else if (!name.empty()) {
    // Arguments are a JSON object (the schema's parameters); the model writes its members.
    prefix += "{\"name\": " + dump(ojson(std::string(name))) + ", \"arguments\": {";
  }
  return prefix;
}

}  // namespace recur::server
