// The prefix cache's bookkeeping over plain numbers: which attention-cache blocks and
// recurrent-state snapshots hold which prompt prefixes. Its entries form a trie over full
// blocks of prompt tokens: an entry is one block, keyed by the hash chain of every token up to
// the block's end (seeded with the model's identity), and may hold a snapshot of the recurrent
// state after its last token. The engine owns the block and snapshot memory; this class says
// which ids are shared, referenced or free to evict. Sized at construction; nothing here
// allocates afterwards.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace recur {

// The hash of a block of tokens after the block whose hash is `previous` (the model's seed
// for a prompt's first block).
uint64_t prefix_block_hash(uint64_t previous, std::span<const int32_t> block);
// The hash chain of a prompt's full blocks: hashes[j] covers tokens [0, (j + 1)·block_size).
// Appends to *hashes (which the caller sizes).
void prefix_block_hashes(std::span<const int32_t> prompt, int block_size, uint64_t seed,
                         std::vector<uint64_t>* hashes);

class PrefixCache {
 public:
  // At most max_entries blocks (the attention cache's) and n_snapshots snapshots.
  PrefixCache(int block_size, int max_entries, int n_snapshots);

  int block_size() const { return block_size_; }
  int entries() const { return live_entries_; }
  int unreferenced() const { return unreferenced_; }  // entries evict_block() can free
  int snapshots() const { return n_snapshots_ - int(free_snapshots_.size()); }

  // The longest prefix of a prompt (its block hashes and tokens) that a sequence can start
  // from: a chain of entries whose last holds a snapshot, of at most max_tokens tokens. Writes
  // the chain's entries to *chain (cleared first) and returns its snapshot (-1: no match).
  // Changes nothing: acquire() each entry to use them.
  int32_t match(std::span<const uint64_t> hashes, std::span<const int32_t> prompt, int max_tokens,
                std::vector<int32_t>* chain) const;
  // Entries of `chain` nobody references yet: what acquiring them takes from unreferenced().
  int unreferenced_in(std::span<const int32_t> chain) const;

  void acquire(int32_t entry);  // one more sequence reads the entry's block
  void release(int32_t entry);  // one fewer; unreferenced entries stay until evicted
  int32_t block(int32_t entry) const { return entries_[size_t(entry)].block; }
  int32_t parent(int32_t entry) const { return entries_[size_t(entry)].parent; }
  uint64_t hash(int32_t entry) const { return entries_[size_t(entry)].hash; }
  std::span<const int32_t> tokens(int32_t entry) const {
    return std::span(tokens_).subspan(size_t(entry) * size_t(block_size_), size_t(block_size_));
  }
  // Every entry, each after its parent (for saving the cache; allocates).
  std::vector<int32_t> entries_parents_first() const;
  int32_t snapshot(int32_t entry) const { return entries_[size_t(entry)].snapshot; }
  int refs(int32_t entry) const { return entries_[size_t(entry)].refs; }
  // A snapshot was restored from: it becomes the most recently used.
  void touch_snapshot(int32_t entry);

  // A sequence has written the full block `tokens` (hash `hash`) after the entry `parent`
  // (-1: the first block) into its block `block`. Returns the entry for it, acquired: an
  // existing one (whose block the sequence should read instead of its own) or a new one
  // holding `block`.
  int32_t publish(int32_t parent, uint64_t hash, std::span<const int32_t> tokens, int32_t block);

  // A snapshot slot for the state after the entry's block: a free one or the least recently
  // used one taken from its entry. -1 when the entry has one already (or there are none).
  // The caller then copies the state into it.
  int32_t add_snapshot(int32_t entry);

  // Drops the least recently used unreferenced entry that no other entry extends (its
  // snapshot with it) and returns its block for reuse; -1 when every entry is referenced.
  int32_t evict_block();

  int64_t evictions() const { return evictions_; }
  int64_t snapshot_evictions() const { return snapshot_evictions_; }

 private:
  struct Entry {
    uint64_t hash = 0;
    uint64_t stamp = 0;   // last use, for eviction
    int32_t parent = -1;  // the entry of the previous block; -1 for the first
    int32_t block = -1;   // attention-cache block; -1: the entry is free
    int32_t snapshot = -1;
    int32_t refs = 0;                        // sequences reading the block
    int32_t children = 0;                    // entries extending this one
    int32_t depth = 0;                       // blocks before this one
    int32_t prev = -1, next = -1;            // list of evictable entries, oldest first
    int32_t snap_prev = -1, snap_next = -1;  // list of entries with snapshots, oldest first
  };
  struct List {
    int32_t head = -1, tail = -1;
  };
  bool evictable(const Entry& e) const { return e.block >= 0 && e.refs == 0 && e.children == 0; }
  void link_evictable(int32_t id);  // in stamp order
  void unlink_evictable(int32_t id);
  void push_snapshot(int32_t id);
  void unlink_snapshot(int32_t id);
  int32_t find(int32_t parent, uint64_t hash, std::span<const int32_t> tokens) const;
  void table_insert(int32_t id);
  void table_erase(int32_t id);
  size_t home(uint64_t hash) const { return size_t(hash) & (table_.size() - 1); }

  int block_size_;
  int n_snapshots_;
  std::vector<Entry> entries_;
  std::vector<int32_t> tokens_;  // [max_entries, block_size]: each entry's block of tokens
  std::vector<int32_t> free_entries_, free_snapshots_;
  std::vector<int32_t> table_;  // open addressing by hash, linear probing; -1 empty
  List evictable_, snapshot_lru_;
  int live_entries_ = 0, unreferenced_ = 0;
  uint64_t clock_ = 0;
  int64_t evictions_ = 0, snapshot_evictions_ = 0;
};

}  // namespace recur
