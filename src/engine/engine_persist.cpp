// The prefix cache on disk: every entry (its block's tokens and attention keys and values, and
// its snapshot when it holds one), parents first, so that a restarted server or a later
// `recur generate` starts from what an earlier run computed. The format:
//   "RECURPFX", u32 version, u32 block size, u64 weights' fingerprint, u64 model seed,
//   u64 block bytes, u64 snapshot bytes, u64 entries; per entry: i32 parent (its index in
//   the file, -1 for a first block), u8 has snapshot, i32 tokens[block size], the block's
//   bytes, the snapshot's bytes when it has one; u64 FNV-1a of every byte before it.
// Little-endian, as the machines that run this engine are. A file written for other weights,
// another block size or version, or damaged, is ignored and the reason noted; it is written to
// a temporary name and renamed, so a crash while saving leaves the previous file.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/engine.h"
#include "engine/pools.h"
#include "engine/prefix_cache.h"
#include "engine/sequence.h"

namespace recur {

namespace {

constexpr char kMagic[8] = {'R', 'E', 'C', 'U', 'R', 'P', 'F', 'X'};
constexpr uint32_t kVersion = 1;

struct Header {
  uint32_t version = kVersion;
  uint32_t block_size = 0;
  uint64_t fingerprint = 0, seed = 0, block_bytes = 0, snapshot_bytes = 0, entries = 0;
};

// Reads or writes through one FNV-1a checksum of every byte passed.
class Checksummed {
 public:
  void add(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) sum_ = (sum_ ^ b[i]) * 0x100000001b3ull;
  }
  uint64_t sum() const { return sum_; }

 private:
  uint64_t sum_ = 0xcbf29ce484222325ull;
};

class Writer : public Checksummed {
 public:
  explicit Writer(std::ofstream& f) : f_(f) {}
  template <typename T>
  void put(const T& v) {
    bytes(&v, sizeof(T));
  }
  void bytes(const void* p, size_t n) {
    add(p, n);
    f_.write(static_cast<const char*>(p), std::streamsize(n));
  }

 private:
  std::ofstream& f_;
};

class Reader : public Checksummed {
 public:
  explicit Reader(std::ifstream& f) : f_(f) {}
  template <typename T>
  bool get(T* v) {
    return bytes(v, sizeof(T));
  }
  bool bytes(void* p, size_t n) {
    f_.read(static_cast<char*>(p), std::streamsize(n));
    if (!f_) return false;
    add(p, n);
    return true;
  }

 private:
  std::ifstream& f_;
};

// An existing file at a prefix cache's path must be one (it starts with the magic) or empty (a
// save cut short by a crash before its data reached the disk): anything else is refused rather
// than overwritten at exit. The type is checked before opening: a FIFO would wait for a writer.
Status check_prefix_cache_file(const std::string& path) {
  std::error_code ec;
  const bool regular = std::filesystem::is_regular_file(path, ec);
  if (regular && std::filesystem::file_size(path, ec) == 0 && !ec) return Status();
  std::ifstream f;
  if (regular) f.open(path, std::ios::binary);
  char magic[sizeof(kMagic)];
  if (regular && f && f.read(magic, sizeof(magic)) &&
      std::memcmp(magic, kMagic, sizeof(magic)) == 0) {
    return Status();
  }
  return make_error(ErrorCode::kInvalidArgument,
                    "{} exists and is not a prefix-cache file; recur writes its prefix cache "
                    "there at exit, so it refuses the path rather than overwrite the file: name "
                    "another",
                    path);
}

Status sync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0)
    return make_error(ErrorCode::kIo, "{}: cannot open to sync: {}", path, std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return make_error(ErrorCode::kIo, "{}: fsync failed: {}", path, std::strerror(err));
  return Status();
}

}  // namespace

Status Engine::load_prefix_cache() {
  const std::string& path = config_.prefix_cache_file;
  const ModelInfo& info = model_->info();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    notes_.push_back(fmt::format("prefix cache: no file {} yet", path));
    return Status();
  }
  RECUR_RETURN_IF_ERROR(check_prefix_cache_file(path));
  std::ifstream f(path, std::ios::binary);
  auto ignore = [&](std::string_view why) {
    notes_.push_back(fmt::format("prefix cache: {} ignored: {}", path, why));
    return Status();
  };
  if (info.fingerprint == 0) return ignore("the model's weights have no fingerprint");
  Reader in(f);
  char magic[8];
  Header h;
  if (!in.bytes(magic, sizeof(magic)) || !in.get(&h.version)) return ignore("cut short");
  if (h.version != kVersion)
    return ignore(fmt::format("format version {}, not {}", h.version, kVersion));
  if (!in.get(&h.block_size) || !in.get(&h.fingerprint) || !in.get(&h.seed) ||
      !in.get(&h.block_bytes) || !in.get(&h.snapshot_bytes) || !in.get(&h.entries)) {
    return ignore("cut short");
  }
  if (h.fingerprint != info.fingerprint || h.seed != cache_seed_ ||
      h.block_bytes != uint64_t(info.cache_bytes_per_block) ||
      h.snapshot_bytes != uint64_t(info.state_bytes_per_slot)) {
    return ignore("written for other weights");
  }
  if (h.block_size != uint32_t(config_.block_size)) {
    return ignore(
        fmt::format("written for blocks of {} tokens, not {}", h.block_size, config_.block_size));
  }
  const int bs = config_.block_size;
  std::vector<uint8_t> block(h.block_bytes), snapshot(h.snapshot_bytes);
  std::vector<int32_t> tokens(static_cast<size_t>(bs));
  std::vector<int32_t> entry_of;  // file index -> entry, -1: not loaded
  int loaded = 0, snapshots = 0;
  bool whole = true;
  for (uint64_t i = 0; i < h.entries && whole; ++i) {
    int32_t parent = -1;
    uint8_t has_snapshot = 0;
    whole = in.get(&parent) && in.get(&has_snapshot) &&
            in.bytes(tokens.data(), tokens.size() * sizeof(int32_t)) &&
            in.bytes(block.data(), block.size()) &&
            (!has_snapshot || in.bytes(snapshot.data(), snapshot.size()));
    whole = whole && parent >= -1 && int64_t(parent) < int64_t(i);
    if (!whole) break;
    const int32_t parent_entry = parent >= 0 ? entry_of[size_t(parent)] : -1;
    bool valid = parent < 0 || parent_entry >= 0;  // its parent was loaded
    for (int32_t t : tokens) valid = valid && t >= 0 && t < info.vocab_size;
    const int32_t b = valid ? blocks_->acquire() : -1;  // the cache is empty: no eviction
    if (b < 0) {
      entry_of.push_back(-1);
      continue;
    }
    const uint64_t previous = parent_entry >= 0 ? cache_->hash(parent_entry) : cache_seed_;
    const int32_t id =
        cache_->publish(parent_entry, prefix_block_hash(previous, tokens), tokens, b);
    if (cache_->block(id) != b) {
      blocks_->release(b);  // the same block twice in the file: the first stays
    } else if (!model_->write_block(b, block).ok()) {
      whole = false;
    }
    cache_->release(id);
    entry_of.push_back(id);
    ++loaded;
    if (has_snapshot) {
      const int32_t s = cache_->add_snapshot(id);
      if (s >= 0) whole = whole && model_->write_snapshot(s, snapshot).ok();
      snapshots += s >= 0 ? 1 : 0;
    }
  }
  const uint64_t computed = in.sum();
  uint64_t stored = 0;
  whole = whole && f.read(reinterpret_cast<char*>(&stored), sizeof(stored)) && stored == computed;
  if (!whole) {
    // Nothing else holds entries yet: they all go.
    for (int32_t b; (b = cache_->evict_block()) >= 0;) blocks_->release(b);
    return ignore("damaged or cut short (its checksum or its contents do not add up)");
  }
  notes_.push_back(
      fmt::format("prefix cache: read {} (blocks: {}, snapshots: {})", path, loaded, snapshots));
  std::lock_guard<std::mutex> lk(mu_);
  publish_gauges();
  return Status();
}

Status Engine::save_prefix_cache() {
  shut_down();
  const std::string& path = config_.prefix_cache_file;
  const ModelInfo& info = model_->info();
  if (path.empty() || !cache_) {
    return make_error(ErrorCode::kInvalidArgument, "no prefix cache or no file to save it to");
  }
  if (info.fingerprint == 0) {
    return make_error(ErrorCode::kUnsupported,
                      "the model's weights have no fingerprint to key a prefix-cache file by");
  }
  // Never over a file that is not a prefix cache (a path mistyped for the weights', say).
  if (std::error_code ec; std::filesystem::exists(path, ec)) {
    RECUR_RETURN_IF_ERROR(check_prefix_cache_file(path));
  }
  const std::string tmp = path + ".tmp";
  std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
  if (!f) return make_error(ErrorCode::kIo, "{}: cannot write", tmp);
  Writer out(f);
  const std::vector<int32_t> ids = cache_->entries_parents_first();
  std::vector<int32_t> index_of(size_t(config_.kv_blocks), -1);  // entry -> file index
  out.bytes(kMagic, sizeof(kMagic));
  Header h;
  h.block_size = uint32_t(config_.block_size);
  h.fingerprint = info.fingerprint;
  h.seed = cache_seed_;
  h.block_bytes = uint64_t(info.cache_bytes_per_block);
  h.snapshot_bytes = uint64_t(info.state_bytes_per_slot);
  h.entries = ids.size();
  out.put(h.version);
  out.put(h.block_size);
  for (uint64_t v : {h.fingerprint, h.seed, h.block_bytes, h.snapshot_bytes, h.entries}) {
    out.put(v);
  }
  std::vector<uint8_t> block(h.block_bytes), snapshot(h.snapshot_bytes);
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    index_of[size_t(id)] = int32_t(i);
    const int32_t parent = cache_->parent(id) >= 0 ? index_of[size_t(cache_->parent(id))] : -1;
    const int32_t s = cache_->snapshot(id);
    out.put(parent);
    out.put(uint8_t(s >= 0 ? 1 : 0));
    const std::span<const int32_t> tokens = cache_->tokens(id);
    out.bytes(tokens.data(), tokens.size_bytes());
    RECUR_RETURN_IF_ERROR(model_->read_block(cache_->block(id), block));
    out.bytes(block.data(), block.size());
    if (s >= 0) {
      RECUR_RETURN_IF_ERROR(model_->read_snapshot(s, snapshot));
      out.bytes(snapshot.data(), snapshot.size());
    }
  }
  const uint64_t sum = out.sum();
  f.write(reinterpret_cast<const char*>(&sum), sizeof(sum));
  f.close();
  if (!f) return make_error(ErrorCode::kIo, "{}: write failed", tmp);
  // On the disk before the rename, and the rename after it: a power loss leaves the old file or
  // the new one, never a name without its data.
  RECUR_RETURN_IF_ERROR(sync_path(tmp, O_RDONLY));
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return make_error(ErrorCode::kIo, "{}: {}", path, ec.message());
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  return sync_path(dir.empty() ? "." : dir.string(), O_RDONLY | O_DIRECTORY);
}

}  // namespace recur
