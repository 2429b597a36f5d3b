// A Jinja template as transformers' apply_chat_template runs it: parsed once, rendered
// any number of times, from any number of threads.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "core/status.h"
#include "tokenizer/jinja_value.h"

namespace recur::jinja {

struct ParsedTemplate;

struct Rendered {
  std::string text;
  UserSpans request_spans;  // bytes of `text` that came from request data
};

class Template {
 public:
  // `name` prefixes error messages ("chat template line 3, column 7: ...").
  static Result<Template> parse(std::string_view source, std::string name = "template");

  // Renders with `globals` as the template's variables. An error from the template's own
  // raise_exception() carries exactly the template's message.
  Result<std::string> render(const Dict& globals) const;
  // The same, saying which output bytes came from request data: strings of values built by
  // value_from_request, carried through every string operation (jinja_marked.h).
  Result<Rendered> render_marked(const Dict& globals) const;

  // Whether some {% for %} iterates a variable, attribute or key called `name` (or .get of it),
  // directly or through a variable {% set %} from one.
  bool has_loop_over(std::string_view name) const;

 private:
  std::shared_ptr<const ParsedTemplate> parsed_;
};

}  // namespace recur::jinja
