#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/json_text.h"

namespace recur {

using json = nlohmann::json;

namespace {

// As the safetensors format requires, the tensors tile the data exactly: no two share a byte
// and no byte lies outside every tensor (a hole could hide a second payload in the file).
Status check_tiling(const std::map<std::string, SafetensorsEntry>& entries, size_t data_begin,
                    size_t data_size, const std::string& path) {
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> by_offset;
  by_offset.reserve(entries.size());
  for (const auto& [name, e] : entries) by_offset.emplace_back(&name, &e);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto& a, const auto& b) {
    return std::pair(a.second->offset, a.second->bytes) <
           std::pair(b.second->offset, b.second->bytes);
  });
  size_t covered = 0;  // data bytes [0, covered) belong to the tensors seen so far
  const std::string* previous = nullptr;
  for (const auto& [name, e] : by_offset) {
    const size_t begin = e->offset - data_begin, end = begin + e->bytes;
    if (begin < covered) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: tensors '{}' and '{}' overlap: '{}' starts at data byte {}, before "
                        "'{}' ends at {}",
                        path, *previous, *name, *name, begin, *previous, covered);
    }
    if (begin > covered) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: data bytes [{}, {}) belong to no tensor (a gap before '{}')", path,
                        covered, begin, *name);
    }
    covered = end;
    previous = name;
  }
  if (covered != data_size) {
    return make_error(ErrorCode::kCorrupt,
                      "{}: data bytes [{}, {}) after the last tensor belong to no tensor", path,
                      covered, data_size);
  }
  return {};
}

}  // namespace

Result<std::map<std::string, SafetensorsEntry>> SafetensorsFile::parse(const uint8_t* data,
                                                                       size_t size,
                                                                       const std::string& path) {
  if (size < 8) {
    return make_error(ErrorCode::kCorrupt, "{}: truncated: {} bytes, too short for a header", path,
                      size);
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | data[i];
  if (header_len > kMaxHeaderBytes) {
    return make_error(ErrorCode::kCorrupt, "{}: header length {} exceeds the {} byte limit", path,
                      header_len, kMaxHeaderBytes);
  }
  if (header_len > size - 8) {
    return make_error(ErrorCode::kCorrupt,
                      "{}: truncated: header length {} runs past the end of the {}-byte file", path,
                      header_len, size);
  }
  RECUR_ASSIGN_OR_RETURN(
      json header, parse_json(std::string_view(reinterpret_cast<const char*>(data) + 8, header_len),
                              path + " (its header)"));
  if (!header.is_object()) {
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
    if (b > en) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: tensor '{}': data_offsets [{}, {}] end before they begin", path, name,
                        b, en);
    }
    if (en > data_size) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: tensor '{}': data_offsets [{}, {}] outside the {} data bytes "
                        "(truncated file?)",
                        path, name, b, en, data_size);
    }
    // numel * element size may not fit in 64 bits; compare without multiplying first.
    const uint64_t element = dtype_size(e.dtype);
    if (numel > (en - b) / element || numel * element != en - b) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: tensor '{}': {} bytes stored but shape {} of {} needs {}", path, name,
                        en - b, v["shape"].dump(), dtype_str,
                        numel > data_size / element ? "more than the whole file"
                                                    : std::to_string(numel * element));
    }
    e.offset = data_begin + size_t(b);
    e.bytes = size_t(en - b);
    entries.emplace(name, std::move(e));
  }
  RECUR_RETURN_IF_ERROR(check_tiling(entries, data_begin, data_size, path));
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

uint64_t SafetensorsFile::fingerprint() const {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  auto add = [&](const uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  };
  const size_t size = file_.size();
  add(reinterpret_cast<const uint8_t*>(&size), sizeof(size));
  constexpr size_t kSamples = 256, kBytes = 16;  // a page read per sample at most
  if (size >= kBytes) {
    for (size_t i = 0; i < kSamples; ++i)
      add(file_.data() + (size - kBytes) / (kSamples - 1) * i, kBytes);
  }
  return h;
}

}  // namespace recur
