// Attention over the paged cache. Each (token, kv head) task splits its context into at most
// kMaxParts parts of whole blocks, a split that depends on the context length alone; a part
// walks its positions in chunks of ~256 (all scores of the chunk, one online-softmax update,
// then the value sums) and leaves a partial softmax state; the parts are merged in order.
// Keys are stored transposed within a block ([kv_heads, hd, block_size]), so scores are vector
// FMAs over positions with no reductions; the query heads sharing a key/value head are
// processed together, reading each block once. When a batch has fewer tasks than threads (one
// long sequence), the parts of a task run on different threads (split-context decoding); the
// arithmetic is the same either way, so results depend neither on the batch nor on threads.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/vector_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace recur {

using namespace cpu;

namespace {

constexpr int kMaxBlock = 256;
constexpr int kMaxGroup = CpuOps::kMaxGroup;
constexpr int kMaxGroupDims = CpuOps::kMaxGroupDims;
constexpr int kChunk = 256;  // positions scored per online-softmax update

// One task's fixed view of the cache: its sequence's block table and its kv head.
struct CacheView {
  const float* k;          // k_cache + kv head offset
  const float* v;          // v_cache + kv head offset
  int64_t k_block, k_dim;  // k strides: per block, per channel (positions are contiguous)
  int64_t v_block, v_row;  // v strides: per block, per position
  int64_t v_dim;          // v stride per channel: 1, or the key cache's (values are keys' channels)
  const int32_t* blocks;  // block table of the sequence
  int64_t bs, hd, dv;     // block size, key and value head sizes
};

// Partial softmax state of G query heads over a range of positions, in scratch memory laid
// out [acc: G·dv][mx: G][den: G].
struct PartialState {
  float* acc;  // [G, dv] Σ e^(s − mx) v, unnormalised
  float* mx;   // [G] largest score seen (−inf before any)
  float* den;  // [G] Σ e^(s − mx)
};

inline PartialState partial_at(float* base, int64_t G, int64_t dv) {
  return {base, base + G * dv, base + G * dv + G};
}

#if defined(__AVX512F__)
inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
}

// sc_g[j] = Σ_d q_g[d]·kt[d·ds + j] for j < len and the TG query heads at q (rows hd apart).
// Two channel chains per head keep independent FMAs in flight.
template <int TG>
inline void score_vectors(const float* q, int64_t hd, const float* kt, int64_t ds, int64_t len,
                          float* sc, int64_t sc_stride) {
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const __mmask16 m = lanes(len - j0);
    __m512 a[TG][2];
    for (int g = 0; g < TG; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 2 <= hd; d += 2) {
      const __m512 k0 = _mm512_maskz_loadu_ps(m, kt + d * ds + j0);
      const __m512 k1 = _mm512_maskz_loadu_ps(m, kt + (d + 1) * ds + j0);
      for (int g = 0; g < TG; ++g) {
        a[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * hd + d]), k0, a[g][0]);
        a[g][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * hd + d + 1]), k1, a[g][1]);
      }
    }
    if (d < hd) {
      const __m512 k0 = _mm512_maskz_loadu_ps(m, kt + d * ds + j0);
      for (int g = 0; g < TG; ++g) {
        a[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * hd + d]), k0, a[g][0]);
      }
    }
    for (int g = 0; g < TG; ++g) {
      _mm512_mask_storeu_ps(sc + g * sc_stride + j0, m, _mm512_add_ps(a[g][0], a[g][1]));
    }
  }
}

// acc_g[d0 .. d0 + 16·NV) (masked to dv) = acc_g·corr_g + Σ_j p_g[j]·v_j over the chunk's
// pieces, for TG heads; two position chains per accumulator.
template <int TG, int NV>
inline void value_tile(const float* p, int64_t p_stride, const float* const* piece_v,
                       const int64_t* piece_len, int n_pieces, int64_t v_row, float* acc,
                       int64_t dv, int64_t d0, const float* corr) {
  __mmask16 m[NV];
  for (int i = 0; i < NV; ++i) m[i] = lanes(dv - d0 - 16 * i);
  __m512 a[2][TG][NV];
  for (int g = 0; g < TG; ++g) {
    for (int i = 0; i < NV; ++i) {
      a[0][g][i] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m[i], acc + g * dv + d0 + 16 * i),
                                 _mm512_set1_ps(corr[g]));
      a[1][g][i] = _mm512_setzero_ps();
    }
  }
  int64_t o = 0;  // position of the piece within the chunk
  for (int pc = 0; pc < n_pieces; ++pc) {
    const float* v = piece_v[pc] + d0;
    const int64_t len = piece_len[pc];
    int64_t j = 0;
    for (; j + 2 <= len; j += 2) {
      for (int u = 0; u < 2; ++u) {
        __m512 vv[NV];
        for (int i = 0; i < NV; ++i)
          vv[i] = _mm512_maskz_loadu_ps(m[i], v + (j + u) * v_row + 16 * i);
        for (int g = 0; g < TG; ++g) {
          const __m512 w = _mm512_set1_ps(p[g * p_stride + o + j + u]);
          for (int i = 0; i < NV; ++i) a[u][g][i] = _mm512_fmadd_ps(w, vv[i], a[u][g][i]);
        }
      }
    }
    if (j < len) {
      __m512 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = _mm512_maskz_loadu_ps(m[i], v + j * v_row + 16 * i);
      for (int g = 0; g < TG; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * p_stride + o + j]);
        for (int i = 0; i < NV; ++i) a[0][g][i] = _mm512_fmadd_ps(w, vv[i], a[0][g][i]);
      }
    }
    o += len;
  }
  for (int g = 0; g < TG; ++g) {
    for (int i = 0; i < NV; ++i) {
      _mm512_mask_storeu_ps(acc + g * dv + d0 + 16 * i, m[i],
                            _mm512_add_ps(a[0][g][i], a[1][g][i]));
    }
  }
}

// Largest of x[0..n).
inline float max_of(const float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(n - i), x + i));
  }
  return hmax16(mx);
}
#endif

// Blocks are scattered in memory and a block's keys or values of one head are only a few
// cache lines, too short a run for the hardware prefetcher: the kernel asks for the keys and
// values of the block kPrefetchBlocks ahead while it scores the current one.
constexpr int64_t kPrefetchBlocks = 4;

inline void prefetch_lines(const float* p, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) prefetch_line(p + i);
}

// Keys and values of the task's head in the block at index `bi` of the sequence's table.
inline void prefetch_block(const CacheView& c, int64_t bi) {
  const int64_t block = c.blocks[bi];
  prefetch_lines(c.k + block * c.k_block, c.k_dim * c.hd);
  if (c.v_dim == 1) prefetch_lines(c.v + block * c.v_block, c.v_row * c.bs);
}

// Scores of the chunk's pieces for all G heads: sc[g·kChunk + o + j].
void chunk_scores(const float* q, int64_t G, int64_t hd, const float* const* piece_k,
                  const int64_t* piece_len, int n_pieces, int64_t k_dim, float* sc,
                  const CacheView& c, const int64_t* piece_block, int64_t last_block) {
  int64_t o = 0;
  for (int pc = 0; pc < n_pieces; ++pc) {
    if (piece_block[pc] + kPrefetchBlocks <= last_block)
      prefetch_block(c, piece_block[pc] + kPrefetchBlocks);
#if defined(__AVX512F__)
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
      score_vectors<2>(q + g * hd, hd, piece_k[pc], k_dim, piece_len[pc], sc + g * kChunk + o,
                       kChunk);
    }
    if (g < G) {
      score_vectors<1>(q + g * hd, hd, piece_k[pc], k_dim, piece_len[pc], sc + g * kChunk + o,
                       kChunk);
    }
#else
    for (int64_t g = 0; g < G; ++g) {
      float* s = sc + g * kChunk + o;
      for (int64_t j = 0; j < piece_len[pc]; ++j) s[j] = 0.0f;
      for (int64_t d = 0; d < hd; ++d) {
        const float qd = q[g * hd + d];
        const float* kt = piece_k[pc] + d * k_dim;
        for (int64_t j = 0; j < piece_len[pc]; ++j) s[j] += qd * kt[j];
      }
    }
#endif
    o += piece_len[pc];
  }
}

void chunk_values(const float* p, int64_t G, int64_t dv, const float* const* piece_v,
                  const int64_t* piece_len, int n_pieces, int64_t v_row, float* acc,
                  const float* corr) {
#if defined(__AVX512F__)
  for (int64_t d0 = 0; d0 < dv; d0 += 32) {
    int64_t g = 0;
    if (dv - d0 > 16) {
      for (; g + 2 <= G; g += 2) {
        value_tile<2, 2>(p + g * kChunk, kChunk, piece_v, piece_len, n_pieces, v_row, acc + g * dv,
                         dv, d0, corr + g);
      }
      if (g < G) {
        value_tile<1, 2>(p + g * kChunk, kChunk, piece_v, piece_len, n_pieces, v_row, acc + g * dv,
                         dv, d0, corr + g);
      }
    } else {
      for (; g + 2 <= G; g += 2) {
        value_tile<2, 1>(p + g * kChunk, kChunk, piece_v, piece_len, n_pieces, v_row, acc + g * dv,
                         dv, d0, corr + g);
      }
      if (g < G) {
        value_tile<1, 1>(p + g * kChunk, kChunk, piece_v, piece_len, n_pieces, v_row, acc + g * dv,
                         dv, d0, corr + g);
      }
    }
  }
#else
  for (int64_t g = 0; g < G; ++g) {
    float* a = acc + g * dv;
    for (int64_t d = 0; d < dv; ++d) a[d] *= corr[g];
    int64_t o = 0;
    for (int pc = 0; pc < n_pieces; ++pc) {
      for (int64_t j = 0; j < piece_len[pc]; ++j) {
        const float w = p[g * kChunk + o + j];
        const float* v = piece_v[pc] + j * v_row;
        for (int64_t d = 0; d < dv; ++d) a[d] += w * v[d];
      }
      o += piece_len[pc];
    }
  }
#endif
}

// chunk_values for values read across channels (a view of the key cache, positions
// contiguous, channels v_dim apart: latent attention): per channel, a dot product over the
// chunk's positions.
void chunk_values_across(const float* p, int64_t G, int64_t dv, const float* const* piece_v,
                         const int64_t* piece_len, int n_pieces, int64_t v_dim, float* acc,
                         const float* corr) {
  for (int64_t g = 0; g < G; ++g) {
    float* a = acc + g * dv;
    const float* pg = p + g * kChunk;
    for (int64_t d = 0; d < dv; ++d) {
      float sum = a[d] * corr[g];
      int64_t o = 0;
      for (int pc = 0; pc < n_pieces; ++pc) {
        const float* v = piece_v[pc] + d * v_dim;
        float part = 0.0f;
        for (int64_t j = 0; j < piece_len[pc]; ++j) part += pg[o + j] * v[j];
        sum += part;
        o += piece_len[pc];
      }
      a[d] = sum;
    }
  }
}

// Positions [p0, p1) of one task into `st` (starting empty). q [G, c.hd] is already scaled.
void attend_part(const CacheView& c, const float* q, int64_t G, int64_t p0, int64_t p1,
                 PartialState st) {
  const int64_t hd = c.hd, dv = c.dv;
  std::fill(st.acc, st.acc + G * dv, 0.0f);
  std::fill(st.mx, st.mx + G, -INFINITY);
  std::fill(st.den, st.den + G, 0.0f);
  alignas(64) float sc[kMaxGroup * kChunk];
  const float* piece_k[kChunk];
  const float* piece_v[kChunk];
  int64_t piece_len[kChunk], piece_block[kChunk];
  const int64_t last_block = (p1 - 1) / c.bs;
  for (int64_t bi = p0 / c.bs; bi <= std::min(last_block, p0 / c.bs + kPrefetchBlocks - 1); ++bi) {
    prefetch_block(c, bi);
  }
  float corr[kMaxGroup];
  const int64_t chunk = std::max<int64_t>(1, kChunk / c.bs) * c.bs;
  for (int64_t c0 = p0; c0 < p1; c0 += chunk) {
    const int64_t c1 = std::min(p1, c0 + chunk);
    int n_pieces = 0;
    for (int64_t pos = c0; pos < c1;) {
      const int64_t block = c.blocks[pos / c.bs], off = pos % c.bs;
      const int64_t len = std::min(c1 - pos, c.bs - off);
      piece_block[n_pieces] = pos / c.bs;
      piece_k[n_pieces] = c.k + block * c.k_block + off;
      piece_v[n_pieces] = c.v + block * c.v_block + off * c.v_row;
      piece_len[n_pieces++] = len;
      pos += len;
    }
    const int64_t L = c1 - c0;
    chunk_scores(q, G, hd, piece_k, piece_len, n_pieces, c.k_dim, sc, c, piece_block, last_block);
    for (int64_t g = 0; g < G; ++g) {
      float* s = sc + g * kChunk;
#if defined(__AVX512F__)
      const float mx = std::max(st.mx[g], max_of(s, L));
#else
      float mx = st.mx[g];
      for (int64_t j = 0; j < L; ++j) mx = std::max(mx, s[j]);
#endif
      corr[g] = std::exp(st.mx[g] - mx);  // 0 before the first chunk
      st.mx[g] = mx;
      st.den[g] = st.den[g] * corr[g] + exp_shifted_sum(s, L, mx);
    }
    if (c.v_dim == 1) {
      chunk_values(sc, G, dv, piece_v, piece_len, n_pieces, c.v_row, st.acc, corr);
    } else {
      chunk_values_across(sc, G, dv, piece_v, piece_len, n_pieces, c.v_dim, st.acc, corr);
    }
  }
}

// Part i of n of a context of n_ctx positions: block-aligned, nearly equal.
inline void part_range(int64_t n_ctx, int64_t bs, int n, int i, int64_t* p0, int64_t* p1) {
  const int64_t blocks = (n_ctx + bs - 1) / bs;
  *p0 = std::min(n_ctx, blocks * i / n * bs);
  *p1 = std::min(n_ctx, blocks * (i + 1) / n * bs);
}

// out_g = Σ_i acc_i,g e^(mx_i,g − M) / Σ_i den_i,g e^(mx_i,g − M), parts merged in order.
void merge_parts(const float* parts, int n, int64_t G, int64_t dv, float* out,
                 int64_t head_stride) {
  const int64_t part_floats = G * dv + 2 * G;
  for (int64_t g = 0; g < G; ++g) {
    float* o = out + g * head_stride;
    if (n == 1 && std::isfinite(parts[G * dv + g])) {
      // The general path below with M = mx, so w = e^0 = 1 exactly: no exp, same bits.
      const float inv = 1.0f / (0.0f + parts[G * dv + G + g]);
      const float* a = parts + g * dv;
      for (int64_t d = 0; d < dv; ++d) o[d] = (0.0f + a[d]) * inv;
      continue;
    }
    float M = -INFINITY;
    for (int i = 0; i < n; ++i) M = std::max(M, parts[i * part_floats + G * dv + g]);
    float den = 0.0f;
    std::fill(o, o + dv, 0.0f);
    for (int i = 0; i < n; ++i) {
      const float* p = parts + i * part_floats;
      const float w = p[G * dv + g] == -INFINITY ? 0.0f : std::exp(p[G * dv + g] - M);
      den += p[G * dv + G + g] * w;
      const float* a = p + g * dv;
      for (int64_t d = 0; d < dv; ++d) o[d] += w * a[d];
    }
    const float inv = 1.0f / den;
    for (int64_t d = 0; d < dv; ++d) o[d] *= inv;
  }
}

}  // namespace

int CpuOps::attention_parts(int64_t n_ctx) {
  return int(std::clamp<int64_t>(n_ctx / kAttentionPartPositions, 1, kAttentionMaxParts));
}

void CpuOps::kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                            const SeqLayout& layout) {
  const int64_t kv_heads = k.shape[1], hd = k.shape[2], dv = v.shape[2];
  RECUR_CHECK(v.shape[1] == kv_heads && k.stride[2] == 1 && v.stride[2] == 1);
  RECUR_CHECK(k_cache.shape[1] == kv_heads && k_cache.shape[2] == hd &&
              k_cache.shape[3] == layout.block_size && v_cache.shape[1] == kv_heads &&
              v_cache.shape[2] == layout.block_size && v_cache.shape[3] == dv);
  for (int s = 0; s < layout.n_seqs; ++s) {
    RECUR_CHECK(layout.seq_len(s) == 0 ||
                (layout.positions[layout.seq_start[s + 1] - 1] / layout.block_size) <
                    layout.block_start[s + 1] - layout.block_start[s]);
    for (int64_t t = layout.seq_start[s]; t < layout.seq_start[s + 1]; ++t) {
      const int64_t pos = layout.positions[t], off = pos % layout.block_size;
      const int32_t block = layout.block_ids[layout.block_start[s] + pos / layout.block_size];
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* kr = k.ptr<float>() + t * k.stride[0] + h * k.stride[1];
        float* kc = k_cache.ptr<float>() + block * k_cache.stride[0] + h * k_cache.stride[1] + off;
        for (int64_t j = 0; j < hd; ++j) kc[j * k_cache.stride[2]] = kr[j];
        // A row of a few vectors: an inline loop, not a memcpy call.
        float* vc = v_cache.ptr<float>() + block * v_cache.stride[0] + h * v_cache.stride[1] +
                    off * v_cache.stride[2];
        const float* vr = v.ptr<float>() + t * v.stride[0] + h * v.stride[1];
        const int64_t vd = v_cache.stride[3];  // 1, or the key cache's channel stride
        for (int64_t j = 0; j < dv; ++j) vc[j * vd] = vr[j];
      }
    }
  }
}

void CpuOps::paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                             const SeqLayout& layout, float scale, Tensor out) {
  const int64_t heads = q.shape[1], hd = q.shape[2], kv_heads = k_cache.shape[1];
  const int64_t dv = v_cache.shape[3], G = heads / kv_heads;
  RECUR_CHECK(heads % kv_heads == 0 && G <= kMaxGroup && G * hd <= kMaxGroupDims &&
              G * dv <= kMaxGroupDims);
  RECUR_CHECK(k_cache.shape[2] == hd && v_cache.shape[1] == kv_heads && out.shape[1] == heads &&
              out.shape[2] == dv);
  RECUR_CHECK(layout.block_size <= kMaxBlock && q.stride[2] == 1 && out.stride[2] == 1);
  const int64_t part_floats = G * dv + 2 * G;
  const int64_t n_tasks = int64_t(layout.n_tokens) * kv_heads;
  int64_t max_ctx = 0;
  for (int t = 0; t < layout.n_tokens; ++t)
    max_ctx = std::max<int64_t>(max_ctx, layout.positions[t] + 1);
  const int max_parts = attention_parts(max_ctx);

  // Sequence of each token, for the block tables.
  auto seq_of = [&](int64_t t) {
    return int(
        std::upper_bound(layout.seq_start + 1, layout.seq_start + layout.n_seqs + 1, int32_t(t)) -
        (layout.seq_start + 1));
  };
  auto view_of = [&](int64_t t, int64_t kvh) {
    return CacheView{k_cache.ptr<float>() + kvh * k_cache.stride[1],
                     v_cache.ptr<float>() + kvh * v_cache.stride[1],
                     k_cache.stride[0],
                     k_cache.stride[2],
                     v_cache.stride[0],
                     v_cache.stride[2],
                     v_cache.stride[3],
                     layout.block_ids + layout.block_start[seq_of(t)],
                     layout.block_size,
                     hd,
                     dv};
  };
  // The task's query heads, scaled, contiguous [G, hd].
  auto load_queries = [&](int64_t t, int64_t kvh, float* qs) {
    for (int64_t g = 0; g < G; ++g) {
      const float* src = q.ptr<float>() + t * q.stride[0] + (kvh * G + g) * q.stride[1];
      for (int64_t d = 0; d < hd; ++d) qs[g * hd + d] = src[d] * scale;
    }
  };
  auto out_of = [&](int64_t t, int64_t kvh) {
    return out.ptr<float>() + t * out.stride[0] + kvh * G * out.stride[1];
  };

  if (pool_.size() == 1 || n_tasks >= pool_.size() || max_parts == 1) {
    // Whole tasks per thread; a task's parts run one after another in its thread's scratch.
    // Tasks per thread: enough context (~4096 positions) to pay for a wake-up.
    int64_t positions = 0;
    for (int t = 0; t < layout.n_tokens; ++t) positions += int64_t(layout.positions[t]) + 1;
    const int64_t min_tasks =
        std::max<int64_t>(1, 4096 * n_tasks / std::max<int64_t>(1, positions * kv_heads));
    pool_.parallel_for_indexed(n_tasks, min_tasks, [&](int64_t b, int64_t e, int thread) {
      float* parts = attention_scratch_.get() + size_t(thread) * kAttentionMaxParts * part_floats;
      alignas(64) float qs[kMaxGroupDims];
      for (int64_t task = b; task < e; ++task) {
        const int64_t t = task / kv_heads, kvh = task % kv_heads;
        const int64_t n_ctx = int64_t(layout.positions[t]) + 1;
        const int n = attention_parts(n_ctx);
        const CacheView c = view_of(t, kvh);
        if (task + 1 < e) {  // the next task's first blocks, while this one runs
          const int64_t t1 = (task + 1) / kv_heads;
          const CacheView c1 = view_of(t1, (task + 1) % kv_heads);
          const int64_t blocks1 = int64_t(layout.positions[t1]) / c1.bs + 1;
          for (int64_t bi = 0; bi < std::min(blocks1, kPrefetchBlocks); ++bi)
            prefetch_block(c1, bi);
        }
        load_queries(t, kvh, qs);
        for (int i = 0; i < n; ++i) {
          int64_t p0, p1;
          part_range(n_ctx, c.bs, n, i, &p0, &p1);
          attend_part(c, qs, G, p0, p1, partial_at(parts + i * part_floats, G, dv));
        }
        merge_parts(parts, n, G, dv, out_of(t, kvh), out.stride[1]);
      }
    });
    return;
  }
  // Fewer tasks than threads: every (task, part) is a work item; then the merges.
  const int64_t n_items = n_tasks * max_parts;
  RECUR_CHECK(n_items <= int64_t(pool_.size()) * kAttentionMaxParts);
  float* parts = attention_scratch_.get();
  pool_.parallel_for(n_items, 1, [&](int64_t b, int64_t e) {
    alignas(64) float qs[kMaxGroupDims];
    for (int64_t item = b; item < e; ++item) {
      const int64_t task = item / max_parts;
      const int i = int(item % max_parts);
      const int64_t t = task / kv_heads, kvh = task % kv_heads;
      const int64_t n_ctx = int64_t(layout.positions[t]) + 1;
      const int n = attention_parts(n_ctx);
      if (i >= n) continue;
      const CacheView c = view_of(t, kvh);
      load_queries(t, kvh, qs);
      int64_t p0, p1;
      part_range(n_ctx, c.bs, n, i, &p0, &p1);
      attend_part(c, qs, G, p0, p1, partial_at(parts + item * part_floats, G, dv));
    }
  });
  pool_.parallel_for(n_tasks, n_tasks, [&](int64_t b, int64_t e) {  // small: inline
    for (int64_t task = b; task < e; ++task) {
      const int64_t t = task / kv_heads, kvh = task % kv_heads;
      const int n = attention_parts(int64_t(layout.positions[t]) + 1);
      merge_parts(parts + task * max_parts * part_floats, n, G, dv, out_of(t, kvh), out.stride[1]);
    }
  });
}

}  // namespace recur
