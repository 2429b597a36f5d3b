// A read-only memory mapping of a whole file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/status.h"

namespace recur {

class MappedFile {
 public:
  static Result<MappedFile> open(const std::string& path);
  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept { *this = std::move(o); }
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  bool contains(const void* p) const {
    return data_ && p >= data_ && static_cast<const uint8_t*>(p) < data_ + size_;
  }
  // Drops this process's pages wholly inside [p, p + bytes) (clipped to the mapping): bytes a
  // backend has copied elsewhere stop counting as resident. Still readable: the pages are
  // clean, and a later read maps them again from the file.
  void release(const void* p, size_t bytes) const;

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Whole file as a string (for text files: JSON configs, tokenizer.json, chat templates).
// Larger files are refused before anything is read.
constexpr size_t kMaxTextFileBytes = size_t(256) << 20;
Result<std::string> read_text_file(const std::string& path, size_t max_bytes = kMaxTextFileBytes);

}  // namespace recur
