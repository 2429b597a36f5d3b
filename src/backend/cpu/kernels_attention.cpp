// Attention over the paged cache, one cache block at a time with an online softmax (no score
// buffer beyond a block, any context length). Keys are stored transposed within a block
// ([kv_heads, hd, block_size]), so a block's scores are hd vector FMAs with no reductions; the
// query heads sharing a key/value head are processed together, reading each block once.
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
constexpr int kMaxGroupDims = 8192;  // query heads per kv head × head_dim, on the stack
constexpr int kMaxBlock = 256;
constexpr int kMaxGroup = 64;

inline int32_t block_of(const SeqLayout& l, int seq, int64_t pos) {
  return l.block_ids[l.block_start[seq] + pos / l.block_size];
}

// sc[j] = scale · Σ_d q[d]·kt[d][j] for j < len; kt rows are d_stride apart.
inline void block_scores(const float* q, const float* kt, int64_t d_stride, int64_t hd,
                         int64_t len, float scale, float* sc) {
#if defined(__AVX512F__)
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const __mmask16 m = len - j0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - j0)) - 1);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();  // two chains hide FMA latency
    int64_t d = 0;
    for (; d + 2 <= hd; d += 2) {
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), _mm512_maskz_loadu_ps(m, kt + d * d_stride + j0), a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(q[d + 1]),
                           _mm512_maskz_loadu_ps(m, kt + (d + 1) * d_stride + j0), a1);
    }
    if (d < hd) a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), _mm512_maskz_loadu_ps(m, kt + d * d_stride + j0), a0);
    _mm512_mask_storeu_ps(sc + j0, m, _mm512_mul_ps(_mm512_add_ps(a0, a1), _mm512_set1_ps(scale)));
  }
#else
  std::fill(sc, sc + len, 0.0f);
  for (int64_t d = 0; d < hd; ++d)
    for (int64_t j = 0; j < len; ++j) sc[j] += q[d] * kt[d * d_stride + j];
  for (int64_t j = 0; j < len; ++j) sc[j] *= scale;
#endif
}

// acc[d] += Σ_j w[j]·v[j][d]; v rows are row_stride apart.
inline void block_values(const float* w, const float* v, int64_t row_stride, int64_t len,
                         int64_t hd, float* acc) {
#if defined(__AVX512F__)
  for (int64_t d0 = 0; d0 < hd; d0 += 16) {
    const __mmask16 m = hd - d0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (hd - d0)) - 1);
    __m512 a = _mm512_maskz_loadu_ps(m, acc + d0);
    for (int64_t j = 0; j < len; ++j) {
      a = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_maskz_loadu_ps(m, v + j * row_stride + d0), a);
    }
    _mm512_mask_storeu_ps(acc + d0, m, a);
  }
#else
  for (int64_t j = 0; j < len; ++j)
    for (int64_t d = 0; d < hd; ++d) acc[d] += w[j] * v[j * row_stride + d];
#endif
}
}  // namespace

void CpuOps::kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                            const SeqLayout& layout) {
  const int64_t kv_heads = k.shape[1], hd = k.shape[2];
  RECUR_CHECK(k_cache.shape[1] == kv_heads && k_cache.shape[2] == hd &&
              k_cache.shape[3] == layout.block_size && v_cache.shape[2] == layout.block_size);
  for (int s = 0; s < layout.n_seqs; ++s) {
    RECUR_CHECK(layout.seq_len(s) == 0 ||
                (layout.positions[layout.seq_start[s + 1] - 1] / layout.block_size) <
                    layout.block_start[s + 1] - layout.block_start[s]);
    for (int64_t t = layout.seq_start[s]; t < layout.seq_start[s + 1]; ++t) {
      const int64_t pos = layout.positions[t], off = pos % layout.block_size;
      const int32_t block = block_of(layout, s, pos);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* kr = k.ptr<float>() + t * k.stride[0] + h * k.stride[1];
        float* kc = k_cache.ptr<float>() + block * k_cache.stride[0] + h * k_cache.stride[1] + off;
        for (int64_t j = 0; j < hd; ++j) kc[j * k_cache.stride[2]] = kr[j];
        std::memcpy(v_cache.ptr<float>() + block * v_cache.stride[0] + h * v_cache.stride[1] +
                        off * v_cache.stride[2],
                    v.ptr<float>() + t * v.stride[0] + h * v.stride[1], size_t(hd) * 4);
      }
    }
  }
}

void CpuOps::paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                             const SeqLayout& layout, float scale, Tensor out) {
  const int64_t heads = q.shape[1], hd = q.shape[2], kv_heads = k_cache.shape[1];
  const int64_t group = heads / kv_heads;
  RECUR_CHECK(heads % kv_heads == 0 && group * hd <= kMaxGroupDims && group <= kMaxGroup);
  RECUR_CHECK(layout.block_size <= kMaxBlock);
  const int64_t bs = layout.block_size;
  const int64_t k_dim_stride = k_cache.stride[2], v_row = v_cache.stride[2];
  // Tasks are (token, kv head) pairs over the whole batch.
  const int64_t n_tasks = int64_t(layout.n_tokens) * kv_heads;
  pool_.parallel_for(n_tasks, 2, [&](int64_t b, int64_t e) {
    alignas(64) float acc[kMaxGroupDims];
    alignas(64) float scores[kMaxGroup][kMaxBlock];
    float running_max[kMaxGroup], denom[kMaxGroup];
    int seq = 0;
    for (int64_t task = b; task < e; ++task) {
      const int64_t t = task / kv_heads, kvh = task % kv_heads;
      while (layout.seq_start[seq + 1] <= t) ++seq;
      const float* qs[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) {
        qs[g] = q.ptr<float>() + t * q.stride[0] + (kvh * group + g) * q.stride[1];
        running_max[g] = -INFINITY;
        denom[g] = 0.0f;
      }
      std::fill(acc, acc + group * hd, 0.0f);
      const int64_t n_ctx = int64_t(layout.positions[t]) + 1;
      for (int64_t p0 = 0; p0 < n_ctx; p0 += bs) {
        const int64_t len = std::min<int64_t>(bs, n_ctx - p0);
        const int32_t block = block_of(layout, seq, p0);
        const float* kb = k_cache.ptr<float>() + block * k_cache.stride[0] + kvh * k_cache.stride[1];
        const float* vb = v_cache.ptr<float>() + block * v_cache.stride[0] + kvh * v_cache.stride[1];
        for (int64_t g = 0; g < group; ++g) {
          float* sc = scores[g];
          block_scores(qs[g], kb, k_dim_stride, hd, len, scale, sc);
          float mx = running_max[g];
          for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sc[j]);
          const float correction = std::exp(running_max[g] - mx);  // 0 on the first block
          running_max[g] = mx;
          for (int64_t j = 0; j < len; ++j) sc[j] -= mx;
          exp_inplace(sc, len);
          float sum = 0.0f;
          for (int64_t j = 0; j < len; ++j) sum += sc[j];
          denom[g] = denom[g] * correction + sum;
          if (correction != 1.0f) {
            float* a = acc + g * hd;
            for (int64_t d = 0; d < hd; ++d) a[d] *= correction;
          }
        }
        for (int64_t g = 0; g < group; ++g) block_values(scores[g], vb, v_row, len, hd, acc + g * hd);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out.ptr<float>() + t * out.stride[0] + (kvh * group + g) * out.stride[1];
        const float inv = 1.0f / denom[g];
        for (int64_t d = 0; d < hd; ++d) o[d] = acc[g * hd + d] * inv;
      }
    }
  });
}

}  // namespace recur
