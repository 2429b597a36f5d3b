#include "io/json_text.h"

namespace recur {

Result<nlohmann::json> parse_json(std::string_view text, const std::string& origin) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    return make_error(ErrorCode::kCorrupt, "{}: invalid JSON at byte {}: {}", origin, e.byte,
                      e.what());
  } catch (const nlohmann::json::exception& e) {
    return make_error(ErrorCode::kCorrupt, "{}: invalid JSON: {}", origin, e.what());
  }
}

}  // namespace recur
