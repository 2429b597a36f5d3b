// Every long-lived buffer comes from an Allocator that counts live buffer objects, live bytes
// and total allocations, so that a leak of objects (not only of bytes) shows in the counters.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/status.h"

namespace recur {

enum class Device : uint8_t { kCpu, kCuda };

struct AllocStats {
  int64_t live_buffers = 0;  // buffer objects allocated and not yet freed
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t allocs_total = 0;  // allocations ever made; flat in steady state
};

class Buffer;

class Allocator {
 public:
  explicit Allocator(Device device) : device_(device) {}
  virtual ~Allocator() = default;
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // `what` names the buffer in the error when the allocation fails.
  Result<Buffer> allocate(size_t bytes, const char* what);
  AllocStats stats() const;
  Device device() const { return device_; }

 protected:
  virtual void* raw_allocate(size_t bytes) = 0;  // nullptr on failure
  virtual void raw_free(void* p, size_t bytes) = 0;

 private:
  friend class Buffer;
  void release(void* p, size_t bytes);

  Device device_;
  std::atomic<int64_t> live_buffers_{0}, live_bytes_{0}, peak_bytes_{0}, allocs_total_{0};
};

// Host memory, 64-byte aligned (one cache line / one AVX-512 register).
Allocator& cpu_allocator();

// An owned allocation; moves, never copies.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return alloc_ ? alloc_->device() : Device::kCpu; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void reset();

 private:
  friend class Allocator;
  Buffer(Allocator* a, void* d, size_t b) : alloc_(a), data_(d), bytes_(b) {}
  Allocator* alloc_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace recur
