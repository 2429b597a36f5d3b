// Structured fuzzing of JSON documents (request bodies, config.json): fuzz bytes read as edits
// of a valid document, so that inputs reach the checks behind the JSON parser.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

namespace recur::fuzz {

using ojson = nlohmann::ordered_json;

// A value at the edges of what a field may take, chosen by `action`; `v` varies it.
inline ojson edge_value(uint8_t action, uint8_t v) {
  const ojson values[] = {0,
                          1,
                          -1,
                          v,
                          int64_t(v) * 100000,
                          int64_t(1) << 31,
                          int64_t(1) << 53,
                          std::numeric_limits<int64_t>::min(),
                          0.5 * v,
                          1e300,
                          "",
                          std::string(v, 'a'),
                          "<|im_start|>",
                          nullptr,
                          true,
                          ojson::array(),
                          ojson::object(),
                          ojson::array({v, "x"}),
                          ojson::object({{"type", "text"}, {"text", "t"}})};
  return values[action % std::size(values)];
}

// Each 3 bytes of `edits`: a place in `doc` (any value, or any container above one), what to do
// there (set an edge value, remove it, or add one of `fields` beside it) and a byte for the value.
inline void apply_edits(ojson& doc, std::span<const uint8_t> edits,
                        std::span<const char* const> fields) {
  std::vector<std::string> places;
  const ojson leaves = doc.flatten();
  for (const auto& [path, value] : leaves.items()) {
    for (size_t at = path.size(); at > 0; at = path.rfind('/', at - 1)) {
      places.push_back(path.substr(0, at));  // the leaf and every container above it
    }
  }
  if (places.empty()) return;
  for (size_t i = 0; i + 3 <= edits.size(); i += 3) {
    const ojson::json_pointer at(places[edits[i] % places.size()]);
    const uint8_t action = edits[i + 1], v = edits[i + 2];
    try {
      if (action % 8 == 6) {
        doc.at(at.parent_pointer()).erase(at.back());
      } else if (action % 8 == 7) {
        ojson& parent = doc.at(at.parent_pointer());
        if (parent.is_object() && !fields.empty()) {
          parent[fields[v % fields.size()]] = edge_value(action / 8, v);
        }
      } else {
        doc.at(at) = edge_value(action / 8, v);
      }
    } catch (const ojson::exception&) {  // the place went with an earlier edit
    }
  }
}

}  // namespace recur::fuzz
