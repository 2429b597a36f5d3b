// Typed, range-checked access to the fields of a request body. An absent or null field gives
// nullopt; a field of the wrong type or out of range gives a 400 naming the field.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "server/api_error.h"

namespace recur::server {

using ojson = nlohmann::ordered_json;

inline constexpr int kMaxJsonDepth = 64;

// Whether JSON text nests brackets (outside strings) at most `limit` deep: the parser, the
// serializer and the template engine recurse on nesting, so deeper text is refused before them.
bool depth_within(std::string_view s, int limit);

// Parses JSON text from a client (a body, or a string field holding JSON): valid UTF-8, nested
// at most kMaxJsonDepth deep, no key twice in one object, in time linear in its size. On
// failure *error says what is wrong and where, as a predicate ("is not valid JSON: ...", "has
// the key "a" twice in one object") for the caller to name the text.
std::optional<ojson> parse_json_text(std::string_view text, std::string* error);

// Parses a request body: valid UTF-8 JSON, nested at most kMaxJsonDepth deep, an object.
ApiResult<ojson> parse_body(std::string_view body);

// `where` prefixes the field name in errors (e.g. "messages[2].").
const ojson* field(const ojson& obj, std::string_view key);  // nullptr when absent or null
ApiResult<std::optional<bool>> get_bool(const ojson& obj, std::string_view key,
                                        std::string_view where = "");
ApiResult<std::optional<int64_t>> get_int(const ojson& obj, std::string_view key, int64_t lo,
                                          int64_t hi, std::string_view where = "");
ApiResult<std::optional<double>> get_number(const ojson& obj, std::string_view key, double lo,
                                            double hi, std::string_view where = "");
ApiResult<std::optional<std::string>> get_string(const ojson& obj, std::string_view key,
                                                 std::string_view where = "");

// A tool definition's name (required): 1 to 128 characters of A-Z, a-z, 0-9, '_', '.', '-', as
// OpenAI and Anthropic have it; other bytes would be written into the template's call markup.
ApiResult<std::string> get_tool_name(const ojson& obj, std::string_view key,
                                     std::string_view where);

// A JSON number that is an integer (5 or 5.0) in [lo, hi].
std::optional<int64_t> as_int(const ojson& v, int64_t lo, int64_t hi);

// Random identifiers for responses and tool calls ("chatcmpl-…", "call_…").
std::string random_id(std::string_view prefix, int chars = 24);

// Serialises for the wire: invalid UTF-8 becomes U+FFFD instead of throwing.
std::string dump(const ojson& j);

}  // namespace recur::server
