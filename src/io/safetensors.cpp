#include "io/safetensors.h"

#include <cstring>
#include <nlohmann/json.hpp>

namespace recur {

using json = nlohmann::json;

Result<std::map<std::string, SafetensorsEntry>> SafetensorsFile::parse(const uint8_t* data,
                                                                       size_t size,
                                                                       const std::string& path) {
  if (size < 8) {
    return make_error(ErrorCode::kCorrupt, "{}: truncated: {} bytes, too short for a header",
                      path, size);
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | data[i];
  if (header_len > kMaxHeaderBytes) {
    return make_error(ErrorCode::kCorrupt, "{}: header length {} exceeds the {} byte limit", path,
                      header_len, kMaxHeaderBytes);
  }
  if (header_len > size - 8) {
    return make_error(ErrorCode::kCorrupt,
                      "{}: truncated: header length {} runs past the end of the {}-byte file",
                      path, header_len, size);
  }
  json header = json::parse(data + 8, data + 8 + header_len, nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    return make_error(ErrorCode::kCorrupt, "{}: header is not a JSON object", path);
  }
  const size_t data_begin = 8 + size_t(header_len);
  const size_t data_size = size - data_begin;
  std::map<std::string, SafetensorsEntry> entries;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets") || !v["dtype"].is_string() || !v["shape"].is_array() ||
        !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: tensor '{}': header entry needs dtype, shape and data_offsets", path,
                        name);
    }
    SafetensorsEntry e;
    std::string dtype_str = v["dtype"].get<std::string>();
    auto dt = dtype_from_safetensors(dtype_str);
    if (!dt) {
      return make_error(ErrorCode::kUnsupported, "{}: tensor '{}': unknown dtype '{}'", path, name,
                        dtype_str);
    }
    e.dtype = *dt;
    uint64_t numel = 1;
    for (auto& d : v["shape"]) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0)) {
        return make_error(ErrorCode::kCorrupt, "{}: tensor '{}': bad shape {}", path, name,
                          v["shape"].dump());
      }
      uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > (uint64_t(1) << 62) / dim) {
        return make_error(ErrorCode::kCorrupt, "{}: tensor '{}': shape {} overflows", path, name,
                          v["shape"].dump());
      }
      numel *= dim;
      e.shape.push_back(int64_t(dim));
    }
    auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return make_error(ErrorCode::kCorrupt, "{}: tensor '{}': bad data_offsets {}", path, name,
                        off.dump());
    }
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (b > en || en > data_size) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: tensor '{}': data_offsets [{}, {}] outside the {} data bytes "
                        "(truncated file?)",
                        path, name, b, en, data_size);
    }
    if (en - b != numel * dtype_size(e.dtype)) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: tensor '{}': {} bytes stored but shape {} of {} needs {}", path, name,
                        en - b, v["shape"].dump(), dtype_str, numel * dtype_size(e.dtype));
    }
    e.offset = data_begin + size_t(b);
    e.bytes = size_t(en - b);
    entries.emplace(name, std::move(e));
  }
  return entries;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  RECUR_ASSIGN_OR_RETURN(MappedFile mf, MappedFile::open(path));
  RECUR_ASSIGN_OR_RETURN(auto entries, parse(mf.data(), mf.size(), path));
  SafetensorsFile f;
  f.file_ = std::move(mf);
  f.entries_ = std::move(entries);
  return f;
}

Result<Tensor> SafetensorsFile::tensor(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return make_error(ErrorCode::kNotFound, "{}: no tensor '{}'", path(), name);
  }
  const SafetensorsEntry& e = it->second;
  if (e.shape.size() > size_t(kMaxDims)) {
    return make_error(ErrorCode::kUnsupported, "{}: tensor '{}' has {} dimensions", path(), name,
                      e.shape.size());
  }
  Tensor t;
  t.data = const_cast<uint8_t*>(file_.data()) + e.offset;
  t.dtype = e.dtype;
  t.ndim = int(e.shape.size());
  int64_t st = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = e.shape[size_t(d)];
    t.stride[d] = st;
    st *= t.shape[d];
  }
  return t;
}

}  // namespace recur
