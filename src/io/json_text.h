// JSON text from a model directory's files, parsed with errors that name where it came from.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/status.h"

namespace recur {

// Parses `text`; an error names `origin` (a file) and says what is wrong: a syntax error's
// byte, or a number too large for a double (1e999), which nlohmann reports apart.
Result<nlohmann::json> parse_json(std::string_view text, const std::string& origin);

}  // namespace recur
