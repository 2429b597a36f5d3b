#include "tokenizer/normalizer.h"

#include <utf8proc.h>

#include <cstdlib>

namespace recur {

namespace {

Status append_forms(const nlohmann::json& j, std::vector<Normalizer::Form>& forms) {
  if (j.is_null()) return {};
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    return make_error(ErrorCode::kCorrupt, "tokenizer.json: normalizer without a \"type\"");
  }
  std::string type = j["type"].get<std::string>();
  if (type == "Sequence") {
    if (!j.contains("normalizers") || !j["normalizers"].is_array()) {
      return make_error(ErrorCode::kCorrupt,
                        "tokenizer.json: Sequence normalizer without a \"normalizers\" array");
    }
    for (const auto& n : j["normalizers"]) RECUR_RETURN_IF_ERROR(append_forms(n, forms));
    return {};
  }
  if (type == "NFC") {
    forms.push_back(Normalizer::Form::kNFC);
  } else if (type == "NFD") {
    forms.push_back(Normalizer::Form::kNFD);
  } else if (type == "NFKC") {
    forms.push_back(Normalizer::Form::kNFKC);
  } else if (type == "NFKD") {
    forms.push_back(Normalizer::Form::kNFKD);
  } else {
    return make_error(ErrorCode::kUnsupported,
                      "tokenizer.json: normalizer type \"{}\" is not supported (supported: "
                      "NFC, NFD, NFKC, NFKD, Sequence)",
                      type);
  }
  return {};
}

utf8proc_option_t options_for(Normalizer::Form form) {
  switch (form) {
    case Normalizer::Form::kNFC:
      return static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    case Normalizer::Form::kNFD:
      return static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
    case Normalizer::Form::kNFKC:
      return static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
    case Normalizer::Form::kNFKD:
      return static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  }
  return UTF8PROC_STABLE;
}

bool is_ascii(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

}  // namespace

Result<Normalizer> Normalizer::from_json(const nlohmann::json& j) {
  Normalizer n;
  RECUR_RETURN_IF_ERROR(append_forms(j, n.forms_));
  return n;
}

Result<std::string_view> Normalizer::normalize(std::string_view text, std::string& storage) const {
  // ASCII text is unchanged by every normalization form; most input takes this path.
  if (forms_.empty() || is_ascii(text)) return text;
  std::string& out = storage;
  out.assign(text);
  for (Form form : forms_) {
    utf8proc_uint8_t* mapped = nullptr;
    // Explicit length (no NULLTERM) so embedded NUL characters survive.
    utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(out.data()),
                     static_cast<utf8proc_ssize_t>(out.size()), &mapped, options_for(form));
    if (n < 0) {
      return make_error(ErrorCode::kInvalidArgument, "Unicode normalization failed: {}",
                        utf8proc_errmsg(n));
    }
    out.assign(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
    std::free(mapped);
  }
  return std::string_view(out);
}

}  // namespace recur
