// Attention over the paged cache. Each (token, kv head) task splits its context into at most
// CpuOps::kAttentionMaxParts parts of whole blocks, a split that depends on the context length
// alone; a part walks its positions in chunks of ~256 (all scores of the chunk, one online-softmax
// update, then the value sums) and leaves a partial softmax state; the parts are merged in order.
// Keys are stored transposed within a block ([kv_heads, hd, block_size]), so scores are vector
// FMAs over positions with no reductions; the query heads sharing a key/value head are
// processed together, reading each block once. When a batch has fewer tasks than threads (one
// long sequence), the parts of a task run on different threads (split-context decoding); the
// arithmetic is the same either way, so results depend neither on the batch nor on threads.
// A BF16, F16 or F8_E4M3 cache is widened to f32 a chunk at a time (keys [hd][chunk], values
// [chunk][dv]) in a per-thread buffer, which the f32 loops then read as they read an f32 cache.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/vector_math.h"
#include "core/dtype.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace recur {

using namespace cpu;

namespace {

constexpr int kMaxBlock = 256;
constexpr int kMaxGroup = CpuOps::kMaxGroup;
constexpr int kChunk = 256;  // positions scored per online-softmax update

// One task's fixed view of the cache: its sequence's block table and its kv head. k and v
// point at elements of `dtype` (F32, BF16, F16 or F8_E4M3); strides count elements.
struct CacheView {
  const void* k;  // k_cache + kv head offset: per block [hd, bs] (k_dim, then positions)
  const void* v;  // v_cache + kv head offset: per block [bs, dv] (v_row, v_dim)
  DType dtype;
  int64_t elem;            // bytes per element
  int64_t k_block, k_dim;  // k strides: per block, per channel (positions are contiguous)
  int64_t v_block, v_row;  // v strides: per block, per position
  int64_t v_dim;          // v stride per channel: 1, or the key cache's (values are keys' channels)
  const int32_t* blocks;  // [ceil(context / bs)] the sequence's block table
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

inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_line(static_cast<const char*>(p) + i);
}

// Element i of a cache view's array, as bytes.
inline const char* elem_at(const void* base, int64_t i, int64_t elem) {
  return static_cast<const char*>(base) + i * elem;
}

// Keys and values of the task's head in the block at index `bi` of the sequence's table.
inline void prefetch_block(const CacheView& c, int64_t bi) {
  const int64_t block = c.blocks[bi];
  prefetch_lines(elem_at(c.k, block * c.k_block, c.elem), c.k_dim * c.hd * c.elem);
  if (c.v_dim == 1)
    prefetch_lines(elem_at(c.v, block * c.v_block, c.elem), c.v_row * c.bs * c.elem);
}

// The f32 value of each F8_E4M3 code.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = f8_e4m3_to_f32(uint8_t(i));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

// dst[j] = src[j] widened to f32 for j < n; src of `dtype` (BF16, F16 or F8_E4M3).
inline void widen(const char* src, DType dtype, int64_t n, float* dst) {
  if (dtype == DType::BF16) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_f32(s[j]);
  } else if (dtype == DType::F16) {
    // The hardware conversion is exact (subnormals too), as f16_to_f32 is for the rest.
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + j));
      _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(h));
    }
#elif defined(__F16C__)
    for (; j + 8 <= n; j += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + j));
      _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
    }
#endif
    for (; j < n; ++j) dst[j] = f16_to_f32(s[j]);
  } else {
    const float* lut = fp8_table().v;
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
    for (int64_t j = 0; j < n; ++j) dst[j] = lut[s[j]];
  }
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
  // A narrow cache's chunk widened to f32: keys [hd][kChunk], values [kChunk][dv] (a latent
  // cache's values are the widened keys' first channels). Grown once per thread.
  const bool widened = c.dtype != DType::F32;
  thread_local std::vector<float> wide;
  if (widened && wide.size() < size_t((hd + dv) * kChunk)) wide.resize(size_t((hd + dv) * kChunk));
  float* wide_k = widened ? wide.data() : nullptr;  // (no offset from an empty vector's null)
  float* wide_v = widened ? wide.data() + hd * kChunk : nullptr;
  const int64_t k_dim = widened ? kChunk : c.k_dim;
  const int64_t v_row = widened ? dv : c.v_row;
  const int64_t v_dim = widened && c.v_dim != 1 ? kChunk : c.v_dim;
  for (int64_t c0 = p0; c0 < p1; c0 += chunk) {
    const int64_t c1 = std::min(p1, c0 + chunk);
    int n_pieces = 0;
    for (int64_t pos = c0; pos < c1;) {
      const int64_t block = c.blocks[pos / c.bs], off = pos % c.bs;
      const int64_t len = std::min(c1 - pos, c.bs - off);
      piece_block[n_pieces] = pos / c.bs;
      if (!widened) {
        piece_k[n_pieces] = static_cast<const float*>(c.k) + block * c.k_block + off;
        piece_v[n_pieces] = static_cast<const float*>(c.v) + block * c.v_block + off * c.v_row;
      } else {
        const int64_t o = pos - c0;
        const char* kb = elem_at(c.k, block * c.k_block + off, c.elem);
        for (int64_t d = 0; d < hd; ++d)
          widen(kb + d * c.k_dim * c.elem, c.dtype, len, wide_k + d * kChunk + o);
        piece_k[n_pieces] = wide_k + o;
        if (c.v_dim == 1) {
          const char* vb = elem_at(c.v, block * c.v_block + off * c.v_row, c.elem);
          for (int64_t j = 0; j < len; ++j)
            widen(vb + j * c.v_row * c.elem, c.dtype, dv, wide_v + (o + j) * dv);
          piece_v[n_pieces] = wide_v + o * dv;
        } else {
          piece_v[n_pieces] = wide_k + o;  // channel d at wide_k[d·kChunk + position]
        }
      }
      piece_len[n_pieces++] = len;
      pos += len;
    }
    const int64_t L = c1 - c0;
    chunk_scores(q, G, hd, piece_k, piece_len, n_pieces, k_dim, sc, c, piece_block, last_block);
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
    if (v_dim == 1) {
      chunk_values(sc, G, dv, piece_v, piece_len, n_pieces, v_row, st.acc, corr);
    } else {
      chunk_values_across(sc, G, dv, piece_v, piece_len, n_pieces, v_dim, st.acc, corr);
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

namespace {

// What a cache of element type kType holds per element: float, or the bits of BF16 and F16
// (16) or F8_E4M3 (8).
template <DType kType>
using CacheElem =
    std::conditional_t<kType == DType::F32, float,
                       std::conditional_t<kType == DType::F8_E4M3, uint8_t, uint16_t>>;

// dst[j·stride] = src[j] for j < n, rounded to the cache's element type kType (to nearest even;
// F16 saturates at ±65504, F8_E4M3 at ±448).
template <DType kType>
void store_row(const float* src, int64_t n, CacheElem<kType>* dst, int64_t stride) {
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (kType == DType::F32) {
      dst[j * stride] = src[j];
    } else if constexpr (kType == DType::BF16) {
      dst[j * stride] = f32_to_bf16(src[j]);
    } else if constexpr (kType == DType::F16) {
      dst[j * stride] = f32_to_f16_saturating(src[j]);
    } else {
      static_assert(kType == DType::F8_E4M3);
      dst[j * stride] = f32_to_f8_e4m3(src[j]);
    }
  }
}

template <DType kType>
void write_cache(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                 const SeqLayout& layout) {
  using T = CacheElem<kType>;
  const int64_t kv_heads = k.shape[1], hd = k.shape[2], dv = v.shape[2];
  for (int s = 0; s < layout.n_seqs; ++s) {
    for (int64_t t = layout.seq_start[s]; t < layout.seq_start[s + 1]; ++t) {
      const int64_t pos = layout.positions[t], off = pos % layout.block_size;
      const int32_t block = layout.block_ids[layout.block_start[s] + pos / layout.block_size];
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* kr = k.ptr<float>() + t * k.stride[0] + h * k.stride[1];
        T* kc =
            static_cast<T*>(k_cache.data) + block * k_cache.stride[0] + h * k_cache.stride[1] + off;
        store_row<kType>(kr, hd, kc, k_cache.stride[2]);
        T* vc = static_cast<T*>(v_cache.data) + block * v_cache.stride[0] + h * v_cache.stride[1] +
                off * v_cache.stride[2];
        const float* vr = v.ptr<float>() + t * v.stride[0] + h * v.stride[1];
        store_row<kType>(vr, dv, vc, v_cache.stride[3]);  // stride 1, or the key cache's channels'
      }
    }
  }
}

}  // namespace

void CpuOps::kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                            const SeqLayout& layout) {
  const int64_t kv_heads = k.shape[1], hd = k.shape[2], dv = v.shape[2];
  RECUR_CHECK(v.shape[1] == kv_heads && k.stride[2] == 1 && v.stride[2] == 1);
  RECUR_CHECK(k_cache.dtype == v_cache.dtype);
  RECUR_CHECK(k_cache.shape[1] == kv_heads && k_cache.shape[2] == hd &&
              k_cache.shape[3] == layout.block_size && v_cache.shape[1] == kv_heads &&
              v_cache.shape[2] == layout.block_size && v_cache.shape[3] == dv);
  for (int s = 0; s < layout.n_seqs; ++s) {
    RECUR_CHECK(layout.seq_len(s) == 0 ||
                (layout.positions[layout.seq_start[s + 1] - 1] / layout.block_size) <
                    layout.block_start[s + 1] - layout.block_start[s]);
  }
  switch (k_cache.dtype) {
    case DType::F32:
      write_cache<DType::F32>(k, v, k_cache, v_cache, layout);
      break;
    case DType::BF16:
      write_cache<DType::BF16>(k, v, k_cache, v_cache, layout);
      break;
    case DType::F16:
      write_cache<DType::F16>(k, v, k_cache, v_cache, layout);
      break;
    case DType::F8_E4M3:
      write_cache<DType::F8_E4M3>(k, v, k_cache, v_cache, layout);
      break;
    default:
      RECUR_CHECK(false && "attention cache of F32, BF16, F16 or F8_E4M3");
  }
}

void CpuOps::paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                             const SeqLayout& layout, float scale, Tensor out) {
  const int64_t heads = q.shape[1], hd = q.shape[2], kv_heads = k_cache.shape[1];
  const int64_t dv = v_cache.shape[3], G = heads / kv_heads;
  RECUR_CHECK(heads % kv_heads == 0 && G <= kMaxGroup && G * hd <= CpuOps::kMaxGroupDims &&
              G * dv <= CpuOps::kMaxGroupDims);
  RECUR_CHECK(k_cache.shape[2] == hd && v_cache.shape[1] == kv_heads && out.shape[1] == heads &&
              out.shape[2] == dv);
  RECUR_CHECK(layout.block_size <= kMaxBlock && q.stride[2] == 1 && out.stride[2] == 1);
  RECUR_CHECK(k_cache.dtype == v_cache.dtype &&
              (k_cache.dtype == DType::F32 || k_cache.dtype == DType::BF16 ||
               k_cache.dtype == DType::F16 || k_cache.dtype == DType::F8_E4M3));
  const int64_t elem = int64_t(dtype_size(k_cache.dtype));
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
    return CacheView{elem_at(k_cache.data, kvh * k_cache.stride[1], elem),
                     elem_at(v_cache.data, kvh * v_cache.stride[1], elem),
                     k_cache.dtype,
                     elem,
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
      alignas(64) float qs[CpuOps::kMaxGroupDims];
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
    alignas(64) float qs[CpuOps::kMaxGroupDims];
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
