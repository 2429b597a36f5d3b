// The output parser's segments joined by kind: the form in which its tests (and the fuzzer)
// compare a whole parse with a streamed one.
#pragma once

#include <string>
#include <vector>

#include "server/output_parser.h"

namespace recur::server {

struct FlatOutput {
  std::string content, reasoning;
  std::vector<ToolCall> calls;
};

inline FlatOutput flatten(const std::vector<Segment>& segments) {
  FlatOutput f;
  for (const Segment& s : segments) {
    if (s.kind == Segment::Kind::kContent) f.content += s.text;
    if (s.kind == Segment::Kind::kReasoning) f.reasoning += s.text;
    if (s.kind == Segment::Kind::kToolCall) f.calls.push_back(s.call);
  }
  return f;
}

}  // namespace recur::server
