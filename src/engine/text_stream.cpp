#include "engine/text_stream.h"

#include <algorithm>

namespace recur {

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                       bool skip_special_tokens)
    : detok_(tokenizer, skip_special_tokens), stops_(std::move(stop_strings)) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
}

bool TextStream::push(int32_t id, std::string* out) {
  detok_.push(id, &pending_);
  // The earliest stop string wins.
  size_t best = std::string::npos;
  for (const std::string& s : stops_) best = std::min(best, pending_.find(s));
  if (best != std::string::npos) {
    out->append(pending_, 0, best);
    pending_.clear();
    return true;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t len = std::min(s.size() - 1, pending_.size()); len > hold; --len) {
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  out->append(pending_, 0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return false;
}

void TextStream::finish(std::string* out) {
  detok_.flush(&pending_);
  out->append(pending_);
  pending_.clear();
}

}  // namespace recur
