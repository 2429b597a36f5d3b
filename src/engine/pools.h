// Fixed pools of recurrent-state slots and attention-cache blocks. Sized at start-up; handing
// out and taking back numbers never allocates.
#pragma once

#include <cstdint>
#include <vector>

namespace recur {

// A fixed set of integer ids [0, capacity) on a free list.
class IdPool {
 public:
  explicit IdPool(int capacity);
  int capacity() const { return capacity_; }
  int used() const { return capacity_ - int(free_.size()); }
  int available() const { return int(free_.size()); }
  // Returns -1 when none is free.
  int32_t acquire();
  void release(int32_t id);

 private:
  int capacity_;
  std::vector<int32_t> free_;  // capacity reserved up front
  std::vector<uint8_t> in_use_;
};

}  // namespace recur
