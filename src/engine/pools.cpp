#include "engine/pools.h"

#include "core/status.h"

namespace recur {

IdPool::IdPool(int capacity) : capacity_(capacity), in_use_(size_t(capacity), 0) {
  free_.reserve(size_t(capacity));
  // Lowest ids first: acquire() pops from the back.
  for (int i = capacity - 1; i >= 0; --i) free_.push_back(i);
}

int32_t IdPool::acquire() {
  if (free_.empty()) return -1;
  const int32_t id = free_.back();
  free_.pop_back();
  in_use_[size_t(id)] = 1;
  return id;
}

void IdPool::release(int32_t id) {
  RECUR_CHECK(id >= 0 && id < capacity_ && in_use_[size_t(id)]);
  in_use_[size_t(id)] = 0;
  free_.push_back(id);
}

}  // namespace recur
