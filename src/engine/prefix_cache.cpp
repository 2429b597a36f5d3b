#include "engine/prefix_cache.h"

#include <algorithm>

#include "core/status.h"

namespace recur {

namespace {

inline uint64_t mix(uint64_t h, uint64_t v) {  // splitmix64 of the pair
  uint64_t z = h + 0x9e3779b97f4a7c15ull + v * 0xd6e8feb86659fd93ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t prefix_block_hash(uint64_t previous, std::span<const int32_t> block) {
  uint64_t h = previous;
  for (int32_t t : block) h = mix(h, uint64_t(uint32_t(t)));
  return h;
}

void prefix_block_hashes(std::span<const int32_t> prompt, int block_size, uint64_t seed,
                         std::vector<uint64_t>* hashes) {
  uint64_t h = seed;
  const size_t full = prompt.size() / size_t(block_size);
  for (size_t j = 0; j < full; ++j) {
    h = prefix_block_hash(h, prompt.subspan(j * size_t(block_size), size_t(block_size)));
    hashes->push_back(h);
  }
}

std::vector<int32_t> PrefixCache::entries_parents_first() const {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].block >= 0) ids.push_back(int32_t(i));
  }
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return entries_[size_t(a)].depth < entries_[size_t(b)].depth;
  });
  return ids;
}

PrefixCache::PrefixCache(int block_size, int max_entries, int n_snapshots)
    : block_size_(block_size), n_snapshots_(n_snapshots) {
  entries_.resize(size_t(max_entries));
  tokens_.resize(size_t(max_entries) * size_t(block_size));
  free_entries_.reserve(size_t(max_entries));
  for (int i = max_entries - 1; i >= 0; --i) free_entries_.push_back(i);
  free_snapshots_.reserve(size_t(n_snapshots));
  for (int i = n_snapshots - 1; i >= 0; --i) free_snapshots_.push_back(i);
  size_t cap = 16;
  while (cap < 2 * size_t(max_entries)) cap *= 2;  // load factor at most 1/2
  table_.assign(cap, -1);
}

int32_t PrefixCache::find(int32_t parent, uint64_t hash, std::span<const int32_t> tokens) const {
  for (size_t i = home(hash);; i = (i + 1) & (table_.size() - 1)) {
    const int32_t id = table_[i];
    if (id < 0) return -1;
    const Entry& e = entries_[size_t(id)];
    // The tokens are compared too: a hash collision never shares a block.
    if (e.hash == hash && e.parent == parent &&
        std::equal(tokens.begin(), tokens.end(),
                   tokens_.begin() + std::ptrdiff_t(id) * block_size_)) {
      return id;
    }
  }
}

void PrefixCache::table_insert(int32_t id) {
  size_t i = home(entries_[size_t(id)].hash);
  while (table_[i] >= 0) i = (i + 1) & (table_.size() - 1);
  table_[i] = id;
}

void PrefixCache::table_erase(int32_t id) {
  const size_t mask = table_.size() - 1;
  size_t i = home(entries_[size_t(id)].hash);
  while (table_[i] != id) i = (i + 1) & mask;
  // Backward-shift deletion: later entries of the probe run move up so lookups never stop at
  // the hole before reaching them.
  for (size_t j = (i + 1) & mask; table_[j] >= 0; j = (j + 1) & mask) {
    const size_t h = home(entries_[size_t(table_[j])].hash);
    // table_[j] may fill the hole at i when its home is not within (i, j].
    const bool movable = i <= j ? (h <= i || h > j) : (h <= i && h > j);
    if (movable) {
      table_[i] = table_[j];
      i = j;
    }
  }
  table_[i] = -1;
}

int32_t PrefixCache::match(std::span<const uint64_t> hashes, std::span<const int32_t> prompt,
                           int max_tokens, std::vector<int32_t>* chain) const {
  chain->clear();
  int32_t parent = -1, snapshot = -1;
  size_t best = 0;
  const size_t usable = std::min(hashes.size(), size_t(std::max(0, max_tokens)) / block_size_);
  for (size_t j = 0; j < usable; ++j) {
    const int32_t id =
        find(parent, hashes[j], prompt.subspan(j * size_t(block_size_), size_t(block_size_)));
    if (id < 0) break;
    chain->push_back(id);
    if (entries_[size_t(id)].snapshot >= 0) {
      best = j + 1;
      snapshot = entries_[size_t(id)].snapshot;
    }
    parent = id;
  }
  chain->resize(best);
  return snapshot;
}

int PrefixCache::unreferenced_in(std::span<const int32_t> chain) const {
  int n = 0;
  for (int32_t id : chain) n += entries_[size_t(id)].refs == 0 ? 1 : 0;
  return n;
}

void PrefixCache::acquire(int32_t id) {
  Entry& e = entries_[size_t(id)];
  RECUR_CHECK(e.block >= 0);
  if (evictable(e)) unlink_evictable(id);
  if (e.refs++ == 0) --unreferenced_;
  e.stamp = ++clock_;
}

void PrefixCache::release(int32_t id) {
  Entry& e = entries_[size_t(id)];
  RECUR_CHECK(e.block >= 0 && e.refs > 0);
  e.stamp = ++clock_;
  if (--e.refs == 0) {
    ++unreferenced_;
    if (e.children == 0) link_evictable(id);
  }
}

void PrefixCache::touch_snapshot(int32_t id) {
  if (entries_[size_t(id)].snapshot < 0) return;
  unlink_snapshot(id);
  push_snapshot(id);
}

int32_t PrefixCache::publish(int32_t parent, uint64_t hash, std::span<const int32_t> tokens,
                             int32_t block) {
  RECUR_CHECK(int(tokens.size()) == block_size_);
  const int32_t found = find(parent, hash, tokens);
  if (found >= 0) {
    acquire(found);
    return found;
  }
  RECUR_CHECK(!free_entries_.empty());  // one entry per block: never more than the blocks
  const int32_t id = free_entries_.back();
  free_entries_.pop_back();
  Entry& e = entries_[size_t(id)];
  e = Entry{};
  e.hash = hash;
  e.parent = parent;
  e.block = block;
  e.refs = 1;
  e.stamp = ++clock_;
  std::copy(tokens.begin(), tokens.end(), tokens_.begin() + std::ptrdiff_t(id) * block_size_);
  if (parent >= 0) {
    Entry& p = entries_[size_t(parent)];
    if (evictable(p)) unlink_evictable(parent);
    ++p.children;
    e.depth = p.depth + 1;
  }
  table_insert(id);
  ++live_entries_;
  return id;
}

int32_t PrefixCache::add_snapshot(int32_t id) {
  Entry& e = entries_[size_t(id)];
  if (e.snapshot >= 0 || n_snapshots_ == 0) {
    touch_snapshot(id);
    return -1;
  }
  if (free_snapshots_.empty()) {
    const int32_t old = snapshot_lru_.head;
    unlink_snapshot(old);
    free_snapshots_.push_back(entries_[size_t(old)].snapshot);
    entries_[size_t(old)].snapshot = -1;
    ++snapshot_evictions_;
  }
  e.snapshot = free_snapshots_.back();
  free_snapshots_.pop_back();
  push_snapshot(id);
  return e.snapshot;
}

int32_t PrefixCache::evict_block() {
  const int32_t id = evictable_.head;
  if (id < 0) return -1;
  unlink_evictable(id);
  Entry& e = entries_[size_t(id)];
  if (e.snapshot >= 0) {
    unlink_snapshot(id);
    free_snapshots_.push_back(e.snapshot);
  }
  table_erase(id);
  if (e.parent >= 0) {
    Entry& p = entries_[size_t(e.parent)];
    if (--p.children == 0 && p.refs == 0) link_evictable(e.parent);
  }
  const int32_t block = e.block;
  e = Entry{};
  free_entries_.push_back(id);
  --live_entries_;
  --unreferenced_;
  ++evictions_;
  return block;
}

void PrefixCache::link_evictable(int32_t id) {
  // Usually the newest (a release) or older than every other (a parent whose last child was
  // the oldest): the walk from the oldest end is short either way.
  const uint64_t stamp = entries_[size_t(id)].stamp;
  int32_t after = evictable_.tail, before = -1;
  if (after >= 0 && entries_[size_t(after)].stamp > stamp) {
    after = -1;
    before = evictable_.head;
    while (before >= 0 && entries_[size_t(before)].stamp <= stamp) {
      after = before;
      before = entries_[size_t(before)].next;
    }
  }
  Entry& e = entries_[size_t(id)];
  e.prev = after;
  e.next = before;
  (after >= 0 ? entries_[size_t(after)].next : evictable_.head) = id;
  (before >= 0 ? entries_[size_t(before)].prev : evictable_.tail) = id;
}

void PrefixCache::unlink_evictable(int32_t id) {
  Entry& e = entries_[size_t(id)];
  (e.prev >= 0 ? entries_[size_t(e.prev)].next : evictable_.head) = e.next;
  (e.next >= 0 ? entries_[size_t(e.next)].prev : evictable_.tail) = e.prev;
  e.prev = e.next = -1;
}

void PrefixCache::push_snapshot(int32_t id) {
  Entry& e = entries_[size_t(id)];
  e.snap_prev = snapshot_lru_.tail;
  e.snap_next = -1;
  (snapshot_lru_.tail >= 0 ? entries_[size_t(snapshot_lru_.tail)].snap_next : snapshot_lru_.head) =
      id;
  snapshot_lru_.tail = id;
}

void PrefixCache::unlink_snapshot(int32_t id) {
  Entry& e = entries_[size_t(id)];
  (e.snap_prev >= 0 ? entries_[size_t(e.snap_prev)].snap_next : snapshot_lru_.head) = e.snap_next;
  (e.snap_next >= 0 ? entries_[size_t(e.snap_next)].snap_prev : snapshot_lru_.tail) = e.snap_prev;
  e.snap_prev = e.snap_next = -1;
}

}  // namespace recur
