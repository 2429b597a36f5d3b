// Generated ids to text, with stop strings matched across token boundaries. Text that could
// still turn out to begin a stop string is held back until it cannot.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace recur {

class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
             bool skip_special_tokens);
  // Appends the text that can be released to *out. Returns true when a stop string appeared:
  // the text before it is released, the stop string and anything after it dropped.
  bool push(int32_t id, std::string* out);
  // At the end of generation: releases what was held back.
  void finish(std::string* out);

 private:
  StreamingDetokenizer detok_;
  std::vector<std::string> stops_;
  std::string pending_;
};

}  // namespace recur
