// The BPE `model` section of tokenizer.json: vocabulary, merges by rank, and a thread-safe cache
// of piece -> ids.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"

namespace recur {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// (left id, right id) -> rank, with the merged id looked up by rank. Each slot packs the pair
// and the rank into 64 bits so the table stays small enough to live in cache: lookups are
// the hottest loop of encoding.
class MergeTable {
 public:
  static constexpr int kIdBits = 20;    // vocabularies up to 1M tokens
  static constexpr int kRankBits = 24;  // up to 16M merges
  struct Merge {
    int32_t left, right, rank, merged_id;
  };
  // A repeated pair keeps its last rank, like a map built in file order.
  Status build(const std::vector<Merge>& merges);
  // Rank of merging the pair, or -1.
  int32_t rank(int32_t left, int32_t right) const {
    uint64_t k = (static_cast<uint64_t>(left) << kIdBits) | static_cast<uint64_t>(right);
    for (size_t i = slot_of(k);; i = (i + 1) & mask_) {
      uint64_t s = slots_[i];
      if ((s >> kRankBits) == k) return static_cast<int32_t>(s & ((1u << kRankBits) - 1));
      if (s == kEmpty) return -1;
    }
  }
  int32_t merged_id(int32_t rank) const { return merged_by_rank_[rank]; }

 private:
  static constexpr uint64_t kEmpty = ~0ull;  // its key part exceeds every real pair
  size_t slot_of(uint64_t k) const { return (k * 0x9E3779B97F4A7C15ull) >> shift_; }
  std::vector<uint64_t> slots_{kEmpty};
  std::vector<int32_t> merged_by_rank_;
  size_t mask_ = 0;
  int shift_ = 63;
};

class WordCache;

// One token of a tiktoken vocabulary: its bytes and its rank, which is also its id.
struct RankedToken {
  std::string bytes;
  int32_t rank;
};

// Tables indexed by token id are as long as the largest id, so a tokenizer.json may leave only
// this many ids below it unused (real vocabularies are dense; one id of 2^31 - 1 would cost
// gigabytes). `distinct_ids`: how many ids are in use; `origin` and `what` name them in errors.
constexpr int64_t kMaxUnusedIds = int64_t(1) << 16;
Status check_id_range(int64_t max_id, int64_t distinct_ids, std::string_view origin,
                      std::string_view what);

class BpeModel {
 public:
  // `byte_level_input`: pieces arrive as raw bytes that ByteLevel maps to one symbol each.
  static Result<BpeModel> from_json(const nlohmann::json& model, bool byte_level_input,
                                    bool use_cache);
  // A tiktoken vocabulary: a piece that is a token is that token; else, from its bytes, the
  // adjacent pair whose concatenation has the lowest rank merges first (leftmost on ties).
  // Every single byte must be a token. Tokens are spelled ByteLevel-mapped, as above.
  static Result<BpeModel> from_ranks(const std::vector<RankedToken>& tokens,
                                     std::string_view origin, bool use_cache);
  BpeModel(BpeModel&&) noexcept;
  BpeModel& operator=(BpeModel&&) noexcept;
  ~BpeModel();

  // One more than the largest id in the vocabulary.
  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }
  // Number of tokens (ids in use) in the vocabulary.
  int64_t token_count() const { return static_cast<int64_t>(vocab_.size()); }
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // Empty for an id the vocabulary lacks.
  std::string_view id_to_token(int32_t id) const;

  // Appends the ids of one pre-tokenized piece. Thread-safe.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  // The two merge strategies, exposed so tests can check they agree on any symbol sequence.
  void merge_small(std::vector<int32_t>& symbols) const;
  void merge_heap(std::vector<int32_t>& symbols) const;

 private:
  BpeModel();
  void initial_symbols(std::string_view piece, std::vector<int32_t>& symbols) const;
  void merge(std::vector<int32_t>& symbols) const;

  TokenIdMap vocab_;
  TokenIdMap raw_vocab_;  // tiktoken: raw bytes -> id, for whole-piece lookups
  std::vector<std::string> id_to_token_;
  MergeTable merges_;
  bool byte_level_input_ = false;
  // Symbol id of each byte in byte-level mode; all valid means the fast path applies.
  std::array<int32_t, 256> byte_symbol_{};
  bool byte_symbols_complete_ = false;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::unique_ptr<WordCache> cache_;
};

}  // namespace recur
