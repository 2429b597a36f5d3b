// Which part of every layer a tensor-parallel rank holds: its heads (a key head travels with
// the query or value heads that read it) and its columns of the feed-forward projections.
// Architectures ask these while loading; an even split that cannot be made is an error that
// names the count and the number of ranks.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/status.h"

namespace recur {

// Rank `rank` of `world` tensor-parallel ranks (world 1: the whole model).
struct Shard {
  int rank = 0, world = 1;
};

// Units [first, first + count) of a split.
struct ShardRange {
  int64_t first = 0, count = 0;
};

// The rank's contiguous part of `total` units, as even as they allow (feed-forward columns,
// whose parts may differ by one). An error when a rank would get none.
Result<ShardRange> column_part(const Shard& s, int64_t total, std::string_view what);

// Heads of grouped attention or of a delta rule: `heads` query (or value) heads reading
// `kv_heads` key heads, heads / kv_heads each, in order. The query heads split evenly; the key
// heads split evenly too, or, when there are fewer of them than ranks (world a multiple of
// kv_heads), each is held by the world / kv_heads ranks whose query heads read it.
struct HeadShard {
  ShardRange heads, kv_heads;
};
// what, heads_name, kv_name: for errors ("the attention", "query heads", "kv heads").
Result<HeadShard> split_heads(const Shard& s, int64_t heads, int64_t kv_heads,
                              std::string_view what, std::string_view heads_name,
                              std::string_view kv_name);

}  // namespace recur
