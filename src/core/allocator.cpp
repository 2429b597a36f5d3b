#include "core/allocator.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace recur {

Result<Buffer> Allocator::allocate(size_t bytes, const char* what) {
  size_t n = bytes == 0 ? 1 : bytes;
  void* p = raw_allocate(n);
  if (!p) {
    return make_error(ErrorCode::kOutOfResources, "cannot allocate {} bytes for {}", bytes, what);
  }
  allocs_total_.fetch_add(1, std::memory_order_relaxed);
  live_buffers_.fetch_add(1, std::memory_order_relaxed);
  int64_t now = live_bytes_.fetch_add(int64_t(n), std::memory_order_relaxed) + int64_t(n);
  int64_t peak = peak_bytes_.load(std::memory_order_relaxed);
  while (now > peak && !peak_bytes_.compare_exchange_weak(peak, now)) {
  }
  return Buffer(this, p, n);
}

void Allocator::release(void* p, size_t bytes) {
  raw_free(p, bytes);
  live_buffers_.fetch_sub(1, std::memory_order_relaxed);
  live_bytes_.fetch_sub(int64_t(bytes), std::memory_order_relaxed);
}

AllocStats Allocator::stats() const {
  AllocStats s;
  s.live_buffers = live_buffers_.load(std::memory_order_relaxed);
  s.live_bytes = live_bytes_.load(std::memory_order_relaxed);
  s.peak_bytes = peak_bytes_.load(std::memory_order_relaxed);
  s.allocs_total = allocs_total_.load(std::memory_order_relaxed);
  return s;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    alloc_ = o.alloc_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.alloc_ = nullptr;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void Buffer::reset() {
  if (alloc_ && data_) alloc_->release(data_, bytes_);
  alloc_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

namespace {
class CpuAllocator final : public Allocator {
 public:
  CpuAllocator() : Allocator(Device::kCpu) {}

 protected:
  void* raw_allocate(size_t bytes) override {
    size_t rounded = (bytes + 63) / 64 * 64;
    return std::aligned_alloc(64, rounded);
  }
  void raw_free(void* p, size_t) override { std::free(p); }
};
}  // namespace

Allocator& cpu_allocator() {
  static CpuAllocator a;
  return a;
}

}  // namespace recur
