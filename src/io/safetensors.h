// safetensors files: an 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte range, then the data. Every range is checked against the mapping.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/mapped_file.h"

namespace recur {

struct SafetensorsEntry {
  DType dtype;
  std::vector<int64_t> shape;
  size_t offset = 0;  // absolute byte offset in the file
  size_t bytes = 0;
};

class SafetensorsFile {
 public:
  static constexpr size_t kMaxHeaderBytes = 100u << 20;

  static Result<SafetensorsFile> open(const std::string& path);
  // Parses a header from memory (used by open and by the fuzz tests).
  static Result<std::map<std::string, SafetensorsEntry>> parse(const uint8_t* data, size_t size,
                                                               const std::string& path);

  const std::string& path() const { return file_.path(); }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // A view of the named tensor as stored (dtype and shape from the header).
  Result<Tensor> tensor(const std::string& name) const;
  // A hash of the file's size and of bytes sampled evenly over it (header and weights): two
  // checkpoints of one shape with other weights differ in it.
  uint64_t fingerprint() const;
  const MappedFile& file() const { return file_; }

 private:
  MappedFile file_;
  std::map<std::string, SafetensorsEntry> entries_;
};

}  // namespace recur
