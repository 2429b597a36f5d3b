// Turns Jinja tokens into a syntax tree. Constructs the engine does not implement (include,
// call blocks, recursive loops, unknown filters or tests) fail here, naming line and column,
// so a template that loads never renders half-supported syntax.
#pragma once

#include <string_view>
#include <vector>

#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_lexer.h"

namespace recur::jinja {

// Throws TemplateError.
Body parse_tokens(const std::vector<Token>& tokens);

}  // namespace recur::jinja
