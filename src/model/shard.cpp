#include "model/shard.h"

namespace recur {

Result<ShardRange> column_part(const Shard& s, int64_t total, std::string_view what) {
  if (total < s.world) {
    return make_error(ErrorCode::kInvalidArgument,
                      "tensor parallelism over {} ranks: {} has only {} columns", s.world, what,
                      total);
  }
  const int64_t first = total * s.rank / s.world, end = total * (s.rank + 1) / s.world;
  return ShardRange{first, end - first};
}

Result<HeadShard> split_heads(const Shard& s, int64_t heads, int64_t kv_heads,
                              std::string_view what, std::string_view heads_name,
                              std::string_view kv_name) {
  if (heads % s.world != 0 || kv_heads < 1 || heads % kv_heads != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "tensor parallelism over {} ranks: {} has {} {}, which do not divide "
                      "among {} ranks",
                      s.world, what, heads, heads_name, s.world);
  }
  HeadShard out;
  out.heads = {heads / s.world * s.rank, heads / s.world};
  if (kv_heads % s.world == 0) {
    out.kv_heads = {kv_heads / s.world * s.rank, kv_heads / s.world};
  } else if (s.world % kv_heads == 0) {  // each key head shared by world / kv_heads ranks
    out.kv_heads = {out.heads.first / (heads / kv_heads), 1};
  } else {
    return make_error(ErrorCode::kInvalidArgument,
                      "tensor parallelism over {} ranks: {} has {} {}, which neither divide "
                      "among {} ranks nor evenly share them",
                      s.world, what, kv_heads, kv_name, s.world);
  }
  return out;
}

}  // namespace recur
