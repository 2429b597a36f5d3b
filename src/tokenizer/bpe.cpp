#include "tokenizer/bpe.h"

#include <fmt/format.h>

#include <climits>
#include <mutex>
#include <queue>

#include "tokenizer/utf8_util.h"

namespace recur {

using json = nlohmann::json;

Status MergeTable::build(const std::vector<Merge>& merges) {
  size_t capacity = 16;
  while (capacity * 6 < merges.size() * 10) capacity *= 2;  // load factor <= 0.6
  slots_.assign(capacity, kEmpty);
  mask_ = capacity - 1;
  shift_ = 64 - __builtin_ctzll(capacity);
  int32_t max_rank = -1;
  for (const Merge& m : merges) max_rank = std::max(max_rank, m.rank);
  if (max_rank >= (1 << kRankBits) - 1) {
    return make_error(ErrorCode::kUnsupported, "BPE with merge ranks >= 2^{}", kRankBits);
  }
  merged_by_rank_.assign(size_t(max_rank + 1), -1);
  for (const Merge& m : merges) {
    // The all-ones key is reserved for empty slots.
    if (m.left >= (1 << kIdBits) - 1 || m.right >= (1 << kIdBits) - 1 ||
        m.rank >= (1 << kRankBits) - 1) {
      return make_error(ErrorCode::kUnsupported,
                        "tokenizer.json: BPE with ids >= 2^{} or more than 2^{} merges", kIdBits,
                        kRankBits);
    }
    uint64_t k = (static_cast<uint64_t>(m.left) << kIdBits) | static_cast<uint64_t>(m.right);
    size_t i = slot_of(k);
    while (slots_[i] != kEmpty && (slots_[i] >> kRankBits) != k) i = (i + 1) & mask_;
    slots_[i] = (k << kRankBits) | static_cast<uint64_t>(m.rank);
    merged_by_rank_[m.rank] = m.merged_id;
  }
  return {};
}

// Sharded so threads encoding at once rarely wait on each other. Once full it stops growing, so
// memory stays bounded and hits stay correct.
class WordCache {
 public:
  static constexpr size_t kMaxKeyBytes = 256;

  bool find(std::string_view word, std::vector<int32_t>& out) const {
    size_t h = StringHash{}(word);
    Shard& s = shards_[h % kShards];
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.map.find(word);
    if (it == s.map.end()) return false;
    out.insert(out.end(), it->second.begin(), it->second.end());
    return true;
  }

  void insert(std::string_view word, const int32_t* ids, size_t count) const {
    size_t h = StringHash{}(word);
    Shard& s = shards_[h % kShards];
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.map.size() >= kEntriesPerShard) return;
    s.map.emplace(std::string(word), std::vector<int32_t>(ids, ids + count));
  }

 private:
  static constexpr size_t kShards = 32;
  static constexpr size_t kEntriesPerShard = 4096;
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
  };
  mutable std::array<Shard, kShards> shards_;
};

Status check_id_range(int64_t max_id, int64_t distinct_ids, std::string_view origin,
                      std::string_view what) {
  const int64_t unused = max_id + 1 - distinct_ids;
  if (unused > kMaxUnusedIds) {
    return make_error(ErrorCode::kCorrupt,
                      "{}: {} ids are sparse: the largest is {} but only {} ids are used ({} "
                      "unused; at most {} may be)",
                      origin, what, max_id, distinct_ids, unused, kMaxUnusedIds);
  }
  return {};
}

BpeModel::BpeModel() = default;
BpeModel::BpeModel(BpeModel&&) noexcept = default;
BpeModel& BpeModel::operator=(BpeModel&&) noexcept = default;
BpeModel::~BpeModel() = default;

Result<BpeModel> BpeModel::from_json(const json& m, bool byte_level_input, bool use_cache) {
  if (!m.is_object() || m.value("type", std::string("BPE")) != "BPE") {
    std::string type = m.is_object() ? m.value("type", std::string("?")) : "?";
    return make_error(ErrorCode::kUnsupported,
                      "tokenizer.json: model type \"{}\" is not supported (only BPE)", type);
  }
  if (!m.contains("vocab") || !m["vocab"].is_object()) {
    return make_error(ErrorCode::kCorrupt, "tokenizer.json: BPE model without a vocab object");
  }
  if (!m.contains("merges") || !m["merges"].is_array()) {
    return make_error(ErrorCode::kCorrupt, "tokenizer.json: BPE model without a merges array");
  }
  auto string_field = [&](const char* name) -> std::string {
    return m.contains(name) && m[name].is_string() ? m[name].get<std::string>() : std::string();
  };
  if (!string_field("continuing_subword_prefix").empty() ||
      !string_field("end_of_word_suffix").empty()) {
    return make_error(ErrorCode::kUnsupported,
                      "tokenizer.json: BPE continuing_subword_prefix / end_of_word_suffix");
  }
  if (m.contains("dropout") && m["dropout"].is_number() && m["dropout"].get<double>() > 0.0) {
    return make_error(ErrorCode::kUnsupported, "tokenizer.json: BPE dropout");
  }

  BpeModel b;
  b.byte_level_input_ = byte_level_input;
  b.fuse_unk_ = m.value("fuse_unk", false);
  b.byte_fallback_ = m.value("byte_fallback", false);
  b.ignore_merges_ = m.value("ignore_merges", false);

  const json& vocab = m["vocab"];
  b.vocab_.reserve(vocab.size());
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > INT32_MAX) {
      return make_error(ErrorCode::kCorrupt,
                        "tokenizer.json: vocab entry \"{}\" has id {}; ids are integers in [0, "
                        "2^31)",
                        it.key(), it.value().dump());
    }
    int64_t id = it.value().get<int64_t>();
    b.vocab_[it.key()] = static_cast<int32_t>(id);
    max_id = std::max(max_id, id);
  }
  // Tables per id are sized by the largest id: checked against the number of tokens first.
  RECUR_RETURN_IF_ERROR(
      check_id_range(max_id, static_cast<int64_t>(b.vocab_.size()), "tokenizer.json", "vocab"));
  b.id_to_token_.resize(static_cast<size_t>(max_id + 1));
  std::vector<bool> taken(b.id_to_token_.size(), false);
  for (const auto& [token, id] : b.vocab_) {
    if (taken[id]) {
      return make_error(ErrorCode::kCorrupt,
                        "tokenizer.json: vocab entries \"{}\" and \"{}\" both have id {}",
                        b.id_to_token_[id], token, id);
    }
    taken[id] = true;
    b.id_to_token_[id] = token;
  }

  std::string unk = string_field("unk_token");
  if (!unk.empty()) {
    auto it = b.vocab_.find(unk);
    if (it == b.vocab_.end()) {
      return make_error(ErrorCode::kCorrupt, "tokenizer.json: unk_token \"{}\" not in vocab", unk);
    }
    b.unk_id_ = it->second;
  }

  const json& merges = m["merges"];
  std::vector<MergeTable::Merge> entries;
  entries.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& mj = merges[rank];
    std::string left, right;
    if (mj.is_string()) {  // older files: "left right"
      std::string s = mj.get<std::string>();
      size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return make_error(ErrorCode::kCorrupt, "tokenizer.json: merge {} \"{}\" is not a pair",
                          rank, s);
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (mj.is_array() && mj.size() == 2 && mj[0].is_string() && mj[1].is_string()) {
      left = mj[0].get<std::string>();
      right = mj[1].get<std::string>();
    } else {
      return make_error(ErrorCode::kCorrupt, "tokenizer.json: merge {} is not a pair", rank);
    }
    auto l = b.vocab_.find(left), r = b.vocab_.find(right), merged = b.vocab_.find(left + right);
    if (l == b.vocab_.end() || r == b.vocab_.end() || merged == b.vocab_.end()) {
      return make_error(ErrorCode::kCorrupt,
                        "tokenizer.json: merge {} (\"{}\", \"{}\") uses a token not in vocab", rank,
                        left, right);
    }
    entries.push_back({l->second, r->second, static_cast<int32_t>(rank), merged->second});
  }
  RECUR_RETURN_IF_ERROR(b.merges_.build(entries));

  if (byte_level_input) {
    b.byte_symbols_complete_ = true;
    for (int byte = 0; byte < 256; ++byte) {
      std::string symbol;
      append_utf8(symbol, byte_to_unicode(static_cast<uint8_t>(byte)));
      auto it = b.vocab_.find(symbol);
      b.byte_symbol_[byte] = it == b.vocab_.end() ? -1 : it->second;
      if (it == b.vocab_.end()) b.byte_symbols_complete_ = false;
    }
  }
  if (use_cache) b.cache_ = std::make_unique<WordCache>();
  return b;
}

Result<BpeModel> BpeModel::from_ranks(const std::vector<RankedToken>& tokens,
                                      std::string_view origin, bool use_cache) {
  BpeModel b;
  b.byte_level_input_ = true;
  b.ignore_merges_ = true;  // tiktoken looks a whole piece up before merging
  int64_t max_id = -1;
  for (const RankedToken& t : tokens) max_id = std::max<int64_t>(max_id, t.rank);
  RECUR_RETURN_IF_ERROR(
      check_id_range(max_id, static_cast<int64_t>(tokens.size()), origin, "tiktoken rank"));
  b.id_to_token_.resize(static_cast<size_t>(max_id + 1));
  b.vocab_.reserve(tokens.size());
  b.raw_vocab_.reserve(tokens.size());
  for (const RankedToken& t : tokens) {
    if (t.bytes.empty()) {
      return make_error(ErrorCode::kCorrupt, "{}: rank {} is an empty token", origin, t.rank);
    }
    std::string mapped;
    for (char c : t.bytes) append_utf8(mapped, byte_to_unicode(static_cast<uint8_t>(c)));
    b.vocab_.emplace(mapped, t.rank);
    b.id_to_token_[t.rank] = std::move(mapped);
    b.raw_vocab_.emplace(t.bytes, t.rank);
  }
  for (int byte = 0; byte < 256; ++byte) {
    const char ch = static_cast<char>(byte);
    auto it = b.raw_vocab_.find(std::string_view(&ch, 1));
    if (it == b.raw_vocab_.end()) {
      return make_error(ErrorCode::kCorrupt,
                        "{}: byte 0x{:02X} is not a token; a tiktoken vocabulary has every single "
                        "byte",
                        origin, byte);
    }
    b.byte_symbol_[byte] = it->second;
  }
  b.byte_symbols_complete_ = true;
  // Merging the pair (a, b) makes the token a + b, at that token's rank: every split of every
  // token into two tokens is a merge.
  std::vector<MergeTable::Merge> merges;
  merges.reserve(tokens.size() * 2);
  for (const RankedToken& t : tokens) {
    const std::string_view bytes = t.bytes;
    for (size_t k = 1; k < bytes.size(); ++k) {
      auto l = b.raw_vocab_.find(bytes.substr(0, k));
      if (l == b.raw_vocab_.end()) continue;
      auto r = b.raw_vocab_.find(bytes.substr(k));
      if (r == b.raw_vocab_.end()) continue;
      merges.push_back({l->second, r->second, t.rank, t.rank});
    }
  }
  RECUR_RETURN_IF_ERROR(b.merges_.build(merges));
  if (use_cache) b.cache_ = std::make_unique<WordCache>();
  return b;
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

std::string_view BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) return {};
  return id_to_token_[id];
}

void BpeModel::initial_symbols(std::string_view piece, std::vector<int32_t>& symbols) const {
  if (byte_level_input_ && byte_symbols_complete_) {
    for (char c : piece) symbols.push_back(byte_symbol_[static_cast<uint8_t>(c)]);
    return;
  }
  std::string mapped;  // byte-level text as the vocabulary spells it
  if (byte_level_input_) {
    for (char c : piece) append_utf8(mapped, byte_to_unicode(static_cast<uint8_t>(c)));
    piece = mapped;
  }
  // Same rules as Hugging Face for a character missing from the vocabulary: byte fallback
  // tokens if all exist, else the unknown token (fused if asked), else the character is dropped.
  const auto* p = reinterpret_cast<const uint8_t*>(piece.data());
  bool last_was_unk = false;
  for (size_t i = 0; i < piece.size();) {
    Utf8Step step = utf8_step(p + i, piece.size() - i);
    std::string_view ch = piece.substr(i, step.length);
    i += step.length;
    if (auto it = vocab_.find(ch); it != vocab_.end()) {
      symbols.push_back(it->second);
      last_was_unk = false;
      continue;
    }
    if (byte_fallback_) {
      std::vector<int32_t> bytes;
      for (char c : ch) {
        auto it = vocab_.find(fmt::format("<0x{:02X}>", static_cast<uint8_t>(c)));
        if (it == vocab_.end()) break;
        bytes.push_back(it->second);
      }
      if (bytes.size() == ch.size()) {
        symbols.insert(symbols.end(), bytes.begin(), bytes.end());
        last_was_unk = false;
        continue;
      }
    }
    if (unk_id_) {
      if (!(fuse_unk_ && last_was_unk)) symbols.push_back(*unk_id_);
      last_was_unk = true;
    }
  }
}

void BpeModel::merge_small(std::vector<int32_t>& symbols) const {
  // ranks[i]: rank of merging symbols[i] and symbols[i + 1] (INT32_MAX: none). Repeatedly merge
  // the lowest rank, leftmost first; the same order as the heap version.
  size_t n = symbols.size();
  if (n < 2) return;
  constexpr size_t kStack = 64;
  int32_t stack_ranks[kStack];
  std::vector<int32_t> heap_ranks;
  int32_t* ranks = stack_ranks;
  if (n - 1 > kStack) {
    heap_ranks.resize(n - 1);
    ranks = heap_ranks.data();
  }
  int32_t* sym = symbols.data();
  auto look = [&](size_t i) {
    int32_t r = merges_.rank(sym[i], sym[i + 1]);
    ranks[i] = r < 0 ? INT32_MAX : r;
  };
  for (size_t i = 0; i + 1 < n; ++i) look(i);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i) {
      if (ranks[i] < ranks[best]) best = i;
    }
    if (ranks[best] == INT32_MAX) break;
    sym[best] = merges_.merged_id(ranks[best]);
    for (size_t i = best + 1; i + 1 < n; ++i) sym[i] = sym[i + 1];
    for (size_t i = best; i + 2 < n; ++i) ranks[i] = ranks[i + 1];
    --n;
    if (best > 0) look(best - 1);
    if (best + 1 < n) look(best);
  }
  symbols.resize(n);
}

void BpeModel::merge_heap(std::vector<int32_t>& symbols) const {
  // Doubly linked symbols plus a min-heap of candidate merges keyed by (rank, position); stale
  // candidates are recognised when popped. O(n log n) for long pieces.
  size_t n = symbols.size();
  if (n < 2) return;
  std::vector<int32_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
  struct Candidate {
    int32_t rank, pos;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[pos] < 0) return;
    int32_t r = merges_.rank(symbols[pos], symbols[next[pos]]);
    if (r >= 0) heap.push({r, pos});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    if (!alive[c.pos] || next[c.pos] < 0) continue;
    int32_t right = next[c.pos];
    // Stale if either symbol changed since the candidate was queued.
    if (merges_.rank(symbols[c.pos], symbols[right]) != c.rank) continue;
    symbols[c.pos] = merges_.merged_id(c.rank);
    alive[right] = false;
    next[c.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  size_t out = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) symbols[out++] = symbols[i];
  symbols.resize(out);
}

void BpeModel::merge(std::vector<int32_t>& symbols) const {
  // Quadratic but allocation-light scanning wins for the short pieces that dominate text.
  if (symbols.size() <= 48) {
    merge_small(symbols);
  } else {
    merge_heap(symbols);
  }
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (byte_level_input_ && byte_symbols_complete_ && piece.size() == 1) {
    out.push_back(byte_symbol_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (ignore_merges_ && !raw_vocab_.empty()) {
    if (auto it = raw_vocab_.find(piece); it != raw_vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  } else if (ignore_merges_) {
    std::string mapped;
    if (byte_level_input_) {
      for (char c : piece) append_utf8(mapped, byte_to_unicode(static_cast<uint8_t>(c)));
    }
    if (auto it = vocab_.find(byte_level_input_ ? std::string_view(mapped) : piece);
        it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  bool cacheable = cache_ && piece.size() <= WordCache::kMaxKeyBytes;
  if (cacheable && cache_->find(piece, out)) return;
  thread_local std::vector<int32_t> symbols;
  symbols.clear();
  initial_symbols(piece, symbols);
  merge(symbols);
  out.insert(out.end(), symbols.begin(), symbols.end());
  if (cacheable) cache_->insert(piece, symbols.data(), symbols.size());
  if (symbols.capacity() > (1u << 20)) std::vector<int32_t>().swap(symbols);  // after a huge piece
}

}  // namespace recur
