#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

namespace recur {

namespace {

// A descriptor open on a regular file and the size fstat gave it: the one checked way in, for
// the mapping and the text reader alike.
class RegularFile {
 public:
  static Result<RegularFile> open(const std::string& path) {
    // O_NONBLOCK: opening a FIFO for reading would wait for a writer; fstat then refuses it.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      return make_error(errno == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIo,
                        "cannot open {}: {}", path, std::strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return make_error(ErrorCode::kIo, "{} is not a regular file", path);
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // reads block as usual from here
    return RegularFile(fd, size_t(st.st_size));
  }
  RegularFile(RegularFile&& o) noexcept : fd_(std::exchange(o.fd_, -1)), size_(o.size_) {}
  RegularFile& operator=(RegularFile&&) = delete;
  ~RegularFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  int fd() const { return fd_; }
  size_t size() const { return size_; }

 private:
  RegularFile(int fd, size_t size) : fd_(fd), size_(size) {}
  int fd_;
  size_t size_;
};

}  // namespace

Result<MappedFile> MappedFile::open(const std::string& path) {
  RECUR_ASSIGN_OR_RETURN(RegularFile file, RegularFile::open(path));
  MappedFile f;
  f.path_ = path;
  f.size_ = file.size();
  if (f.size_ > 0) {
    void* p = mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE, file.fd(), 0);
    if (p == MAP_FAILED) {
      return make_error(ErrorCode::kIo, "cannot map {}: {}", path, std::strerror(errno));
    }
    f.data_ = static_cast<const uint8_t*>(p);
  }
  return f;
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_) munmap(const_cast<uint8_t*>(data_), size_);
    path_ = std::move(o.path_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void MappedFile::release(const void* p, size_t bytes) const {
  if (!contains(p)) return;
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const uintptr_t base = reinterpret_cast<uintptr_t>(data_);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  const uintptr_t hi = std::min(lo + bytes, base + size_);
  const uintptr_t first = (lo + page - 1) / page * page, last = hi / page * page;
  if (first < last) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<uint8_t*>(data_), size_);
}

Result<std::string> read_text_file(const std::string& path, size_t max_bytes) {
  // Checked before reading: a directory or a huge file gives an error, not an endless read.
  RECUR_ASSIGN_OR_RETURN(RegularFile file, RegularFile::open(path));
  if (file.size() > max_bytes) {
    return make_error(ErrorCode::kOutOfResources, "{} has {} bytes; text files over {} are refused",
                      path, file.size(), max_bytes);
  }
  // No further than the size checked: of a file that grows meanwhile, that many bytes.
  std::string text(file.size(), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(file.fd(), text.data() + got, text.size() - got);
    if (n > 0) {
      got += size_t(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0) {
      return make_error(ErrorCode::kIo, "cannot read {}: {}", path, std::strerror(errno));
    } else {
      break;  // shrunk meanwhile: what is there
    }
  }
  text.resize(got);
  return text;
}

}  // namespace recur
