// Attention over the paged cache: writes of new keys and values, then causal attention with
// an online softmax (one pass over the cache, no score buffer, any context length).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels.h"

namespace recur {

using namespace cpu;

namespace {
// Row of the cache [n_blocks, block_size, kv_heads, hd] holding `pos` of a sequence.
inline float* cache_row(const Tensor& cache, const SeqLayout& layout, int seq, int64_t pos,
                        int64_t kv_head) {
  const int32_t block = layout.block_ids[layout.block_start[seq] + pos / layout.block_size];
  return cache.ptr<float>() + int64_t(block) * cache.stride[0] +
         (pos % layout.block_size) * cache.stride[1] + kv_head * cache.stride[2];
}
}  // namespace

void CpuOps::kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                            const SeqLayout& layout) {
  const int64_t kv_heads = k.shape[1], hd = k.shape[2];
  RECUR_CHECK(k_cache.shape[1] == layout.block_size && k_cache.shape[2] == kv_heads &&
              k_cache.shape[3] == hd);
  for (int s = 0; s < layout.n_seqs; ++s) {
    RECUR_CHECK(layout.seq_len(s) == 0 ||
                (layout.positions[layout.seq_start[s + 1] - 1] / layout.block_size) <
                    layout.block_start[s + 1] - layout.block_start[s]);
    for (int64_t t = layout.seq_start[s]; t < layout.seq_start[s + 1]; ++t) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(cache_row(k_cache, layout, s, layout.positions[t], h),
                    k.ptr<float>() + t * k.stride[0] + h * k.stride[1], size_t(hd) * 4);
        std::memcpy(cache_row(v_cache, layout, s, layout.positions[t], h),
                    v.ptr<float>() + t * v.stride[0] + h * v.stride[1], size_t(hd) * 4);
      }
    }
  }
}

void CpuOps::paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                             const SeqLayout& layout, float scale, Tensor out) {
  const int64_t heads = q.shape[1], hd = q.shape[2], kv_heads = k_cache.shape[2];
  RECUR_CHECK(heads % kv_heads == 0 && hd <= 1024);
  const int64_t group = heads / kv_heads;
  // Tasks are (sequence-local token, head) pairs over the whole batch.
  const int64_t n_tasks = int64_t(layout.n_tokens) * heads;
  pool_.parallel_for(n_tasks, 4, [&](int64_t b, int64_t e) {
    float acc[1024];
    int seq = 0;
    for (int64_t task = b; task < e; ++task) {
      const int64_t t = task / heads, h = task % heads, kvh = h / group;
      while (layout.seq_start[seq + 1] <= t) ++seq;
      const float* qr = q.ptr<float>() + t * q.stride[0] + h * q.stride[1];
      float* o = out.ptr<float>() + t * out.stride[0] + h * out.stride[1];
      float running_max = -INFINITY, denom = 0.0f;
      std::fill(acc, acc + hd, 0.0f);
      const int64_t last = layout.positions[t];
      for (int64_t p = 0; p <= last; ++p) {
        const float score = dot_f32(qr, cache_row(k_cache, layout, seq, p, kvh), hd) * scale;
        const float* vr = cache_row(v_cache, layout, seq, p, kvh);
        if (score > running_max) {
          const float correction = std::exp(running_max - score);
          denom *= correction;
          for (int64_t j = 0; j < hd; ++j) acc[j] *= correction;
          running_max = score;
        }
        const float w = std::exp(score - running_max);
        denom += w;
#pragma omp simd
        for (int64_t j = 0; j < hd; ++j) acc[j] += w * vr[j];
      }
      const float inv = 1.0f / denom;
      for (int64_t j = 0; j < hd; ++j) o[j] = acc[j] * inv;
    }
  });
}

}  // namespace recur
