// out[n, m] = x[n, k] · w[m, k]^T with w in its stored dtype, in one of two layouts:
//  - k-major in panels of 64 columns (w.stride = {1, ld}, from adopt_matmul_weight): output
//    columns are vector lanes; a register tile of up to 4 vectors × 6 tokens broadcasts x[t][i]
//    against row i of a panel, so each weight load serves many tokens and no horizontal sums
//    are needed;
//  - row-major (w.stride = {k, 1}): dot products over k in tiles of 4 rows × 4 tokens.
// Threads split the output columns, so each weight byte is read by one core. Every output is
// a fixed sequence of operations over i whatever its place in a tile, so results do not depend
// on batch composition.
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/kernels_quant.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace recur {

using namespace cpu;

namespace {

constexpr int64_t kTokenTile = 64;  // x rows kept hot in cache while sweeping the weight rows
// Columns per panel of a k-major weight: a panel's rows are consecutive in memory, so a thread
// streams its columns' weights in order (one stream per panel) instead of reading 128 bytes
// per row of a [k, ld] matrix, a page apart for wide weights.
constexpr int64_t kPanelCols = 64;
// Chunks per thread of a split matmul, taken dynamically (ThreadPool::parallel_chunks).
constexpr int64_t kChunksPerThread = 8;

// Cache lines to ask for one at a time from inside a compute loop: [next, end).
struct LineStream {
  const char* next = nullptr;
  const char* end = nullptr;
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
inline __m512 load16(const Bf16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const F16* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// The four horizontal sums of a, b, c, d in one vector: interleave and add within 128-bit
// lanes, then fold the four lanes.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d.
  const __m512 abcd = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  // Per 128-bit lane: [a, b, c, d] partial sums; fold the four lanes.
  const __m256 half =
      _mm256_add_ps(_mm512_castps512_ps256(abcd),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// NR weight rows against NT tokens: acc[r][t] = Σ_i w_r[i]·x_t[i]. Independent accumulators
// keep the FMA pipes busy; each (row, token) pair sees the same operations in any tile shape.
template <int NR, int NT, typename W>
__attribute__((always_inline)) inline void dot_tile(const W* const* w, const float* const* x,
                                                    int64_t k, float* result) {
  // Accumulators stay in registers: indices are compile-time constants after unrolling, and
  // no pointer to them is taken.
  __m512 acc[NR * NT];
#pragma GCC unroll 16
  for (int i = 0; i < NR * NT; ++i) acc[i] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 xv[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_loadu_ps(x[t] + i);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = load16(w[r] + i, 0xffff);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) acc[r * NT + t] = _mm512_fmadd_ps(wv, xv[t], acc[r * NT + t]);
    }
  }
  if (i < k) {
    const __mmask16 m = __mmask16((1u << (k - i)) - 1);
    __m512 xv[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) xv[t] = load16(x[t] + i, m);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = load16(w[r] + i, m);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) acc[r * NT + t] = _mm512_fmadd_ps(wv, xv[t], acc[r * NT + t]);
    }
  }
  // Horizontal sums, four accumulators at a time where the tile allows.
  constexpr int kQuads = (NR * NT) / 4;
#pragma GCC unroll 4
  for (int q = 0; q < kQuads; ++q) {
    _mm_storeu_ps(result + 4 * q,
                  reduce4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]));
  }
#pragma GCC unroll 4
  for (int j = 4 * kQuads; j < NR * NT; ++j) result[j] = _mm512_reduce_add_ps(acc[j]);
}
#else
template <int NR, int NT, typename W>
inline void dot_tile(const W* const* w, const float* const* x, int64_t k, float* result) {
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      float acc = 0.0f;
      for (int64_t i = 0; i < k; ++i) acc += to_f32(w[r][i]) * x[t][i];
      result[r * NT + t] = acc;
    }
  }
}
#endif

template <int NR, typename W>
void row_tile(const W* const* wr, const float* x, int64_t x_stride, int64_t k, float* out,
              int64_t out_stride, int64_t m, int64_t t0, int64_t t1, bool accumulate) {
  for (int64_t t = t0; t < t1;) {
    const float* xs[4];
    float r[NR * 4];
    const int nt = int(std::min<int64_t>(4, t1 - t));
    for (int j = 0; j < nt; ++j) xs[j] = x + (t + j) * x_stride;
    switch (nt) {
      case 4:
        dot_tile<NR, 4>(wr, xs, k, r);
        break;
      case 3:
        dot_tile<NR, 3>(wr, xs, k, r);
        break;
      case 2:
        dot_tile<NR, 2>(wr, xs, k, r);
        break;
      default:
        dot_tile<NR, 1>(wr, xs, k, r);
        break;
    }
    for (int row = 0; row < NR; ++row) {
      for (int j = 0; j < nt; ++j) {
        float* o = out + (t + j) * out_stride + m + row;
        *o = accumulate ? *o + r[row * nt + j] : r[row * nt + j];
      }
    }
    t += nt;
  }
}

template <typename W>
void matmul_block(const float* x, int64_t x_stride, const W* w, int64_t k, float* out,
                  int64_t out_stride, int64_t n, int64_t m0, int64_t m1, bool accumulate) {
  for (int64_t t0 = 0; t0 < n; t0 += kTokenTile) {
    const int64_t t1 = std::min(n, t0 + kTokenTile);
    int64_t m = m0;
    const int64_t tile_bytes = 4 * k * int64_t(sizeof(W));
    for (; m + 4 <= m1; m += 4) {
      const W* wr[4] = {w + m * k, w + (m + 1) * k, w + (m + 2) * k, w + (m + 3) * k};
      // Weights stream from L3 or memory once per step: ask for the tile after next now, since
      // short rows leave the hardware prefetcher too little run-up.
      if (t0 == 0 && m + 12 <= m1) {
        const char* ahead = reinterpret_cast<const char*>(w + (m + 8) * k);
        for (int64_t off = 0; off < tile_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
      }
      row_tile<4>(wr, x, x_stride, k, out, out_stride, m, t0, t1, accumulate);
    }
    for (; m < m1; ++m) {
      const W* wr[1] = {w + m * k};
      row_tile<1>(wr, x, x_stride, k, out, out_stride, m, t0, t1, accumulate);
    }
  }
}

// ---- k-major ----

#if defined(__AVX512F__)
inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
inline __m512 load16(const Bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// out[t][c0 + 16v + j] (+)= Σ_i x[t][i]·w[i·ld + c0 + 16v + j] for NT tokens and NV vectors of
// columns; each sum runs i = 0..k-1 as one FMA chain. The last vector is stored under
// `last` (columns past m); padding columns of w are zero.
template <int NV, int NT, bool kPrefetch, typename W>
__attribute__((noinline)) void kmajor_tile(const W* w, int64_t ld, int64_t k, const float* x,
                                           int64_t x_stride, float* out, int64_t out_stride,
                                           __mmask16 last, bool accumulate, int64_t ahead,
                                           LineStream* stream) {
  __m512 acc[NT][NV];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < k; ++i) {
    if constexpr (kPrefetch) {
      if (i + ahead < k) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) prefetch_line(w + (i + ahead) * ld + 16 * v);
      }
    } else {
      // Tiles after the first find this weight in cache: meanwhile, one line of the weight
      // predicted to come next per iteration, spread thin so the loads never queue up.
      if (stream->next < stream->end) {
        prefetch_line(stream->next);
        stream->next += 64;
      }
    }
    __m512 wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = load16(w + i * ld + 16 * v);
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
      const __m512 xb = _mm512_set1_ps(x[t * x_stride + i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_fmadd_ps(wv[v], xb, acc[t][v]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < NT; ++t) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? last : __mmask16(0xffff);
      float* o = out + t * out_stride + 16 * v;
      __m512 r = acc[t][v];
      if (accumulate) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, o));
      _mm512_mask_storeu_ps(o, m, r);
    }
  }
}

// A tile of `nt` (1..NT) tokens: the template instance for that count.
template <int NV, int NT, typename W>
__attribute__((always_inline)) inline void kmajor_tile_n(int nt, bool prefetch, const W* w,
                                                         int64_t ld, int64_t k, const float* x,
                                                         int64_t x_stride, float* out,
                                                         int64_t out_stride, __mmask16 last,
                                                         bool accumulate, int64_t ahead,
                                                         LineStream* stream) {
  if constexpr (NT > 1) {
    if (nt < NT) {
      kmajor_tile_n<NV, NT - 1>(nt, prefetch, w, ld, k, x, x_stride, out, out_stride, last,
                                accumulate, ahead, stream);
      return;
    }
  }
  if (prefetch) {
    kmajor_tile<NV, NT, true>(w, ld, k, x, x_stride, out, out_stride, last, accumulate, ahead,
                              stream);
  } else {
    kmajor_tile<NV, NT, false>(w, ld, k, x, x_stride, out, out_stride, last, accumulate, 0, stream);
  }
}

// Tokens [0, n) against NV column vectors: tiles of NT tokens; a short remainder (under NT/2)
// is balanced with the last full tile (e.g. 7 = 4 + 3, not 6 + 1): tiles of one or two tokens
// leave too few independent FMA chains to cover the latency. The first tile streams the
// weights from memory, asking for rows `ahead` in advance; later tiles find them in cache.
template <int NV, int NT, typename W>
void kmajor_tokens(const W* w, int64_t ld, int64_t k, const float* x, int64_t x_stride, int64_t n,
                   float* out, int64_t out_stride, __mmask16 last, bool accumulate, int64_t ahead,
                   LineStream* stream) {
  int64_t full = n / NT, rest = n % NT;
  int64_t split = 0;  // tokens of the last full tile and the remainder, shared as two tiles
  if (rest > 0 && rest < NT / 2 && full > 0) {
    --full;
    split = NT + rest;
  }
  int64_t t = 0;
  auto tile = [&](int nt) {
    kmajor_tile_n<NV, NT>(nt, t == 0, w, ld, k, x + t * x_stride, x_stride, out + t * out_stride,
                          out_stride, last, accumulate, ahead, stream);
    t += nt;
  };
  for (int64_t i = 0; i < full; ++i) tile(NT);
  if (split > 0) {
    tile(int((split + 1) / 2));
    tile(int(split / 2));
  } else if (rest > 0) {
    tile(int(rest));
  }
}
#endif

// Columns [c0, c1) of a k-major weight in panels (c0 a multiple of 16) for all n tokens.
//   w: panels of kPanelCols columns, [ceil(ld / kPanelCols)][k][width] (width kPanelCols but
//   for the last panel, which holds ld mod kPanelCols columns when that is not 0)
template <typename W>
void kmajor_block(const float* x, int64_t x_stride, const W* w, int64_t ld, int64_t k, float* out,
                  int64_t out_stride, int64_t n, int64_t c0, int64_t c1, bool accumulate,
                  LineStream* stream) {
#if defined(__AVX512F__)
  for (int64_t c = c0; c < c1;) {
    const int64_t panel = c / kPanelCols * kPanelCols;
    const int64_t width = std::min(kPanelCols, ld - panel);
    const int64_t cols = std::min(c1, panel + kPanelCols) - c;  // this panel's share
    const int64_t vectors = (cols + 15) / 16;
    const __mmask16 last = cols % 16 ? __mmask16((1u << (cols % 16)) - 1) : __mmask16(0xffff);
    const W* wc = w + panel * k + (c - panel);  // rows `width` apart
    float* oc = out + c;
    // Rows asked for in advance. Many tokens: about 8 KB of this panel ahead of the loads (at
    // batch 32 a step's weights and cache exceed L3, so weights come from DRAM, and 2 KB left
    // the first tile stalled on its weight loads). A few tokens: 2 KB, since a tile that short
    // cannot hide a larger up-front burst.
    const int64_t row_bytes = width * int64_t(sizeof(W));
    const int64_t ahead = std::clamp<int64_t>((n > 8 ? 8192 : 2048) / row_bytes, 2, 64);
    for (int64_t i = 0; i < std::min(k, ahead); ++i) {
      for (int64_t v = 0; v < vectors; ++v) prefetch_line(wc + i * width + 16 * v);
    }
    switch (vectors) {
      case 4:
        kmajor_tokens<4, 6>(wc, width, k, x, x_stride, n, oc, out_stride, last, accumulate, ahead,
                            stream);
        break;
      case 3:
        kmajor_tokens<3, 8>(wc, width, k, x, x_stride, n, oc, out_stride, last, accumulate, ahead,
                            stream);
        break;
      case 2:
        kmajor_tokens<2, 12>(wc, width, k, x, x_stride, n, oc, out_stride, last, accumulate, ahead,
                             stream);
        break;
      default:
        kmajor_tokens<1, 16>(wc, width, k, x, x_stride, n, oc, out_stride, last, accumulate, ahead,
                             stream);
        break;
    }
    c += cols;
  }
#else
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t panel = c / kPanelCols * kPanelCols;
      const int64_t width = std::min(kPanelCols, ld - panel);
      float acc = 0.0f;
      for (int64_t i = 0; i < k; ++i)
        acc += to_f32(w[panel * k + i * width + c - panel]) * x[t * x_stride + i];
      float* o = out + t * out_stride + c;
      *o = accumulate ? *o + acc : acc;
    }
  }
#endif
}

}  // namespace

Result<Tensor> CpuOps::adopt_matmul_weight(const Tensor& host, std::vector<Buffer>* owned) {
  if (host.ndim != 2 || !host.is_contiguous() ||
      (host.dtype != DType::F32 && host.dtype != DType::BF16 && host.dtype != DType::F16)) {
    return host;
  }
  const int64_t m = host.shape[0], k = host.shape[1];
  const int64_t ld = (m + 15) / 16 * 16;  // whole vectors per row, padded with zeros
  const size_t es = dtype_size(host.dtype);
  RECUR_ASSIGN_OR_RETURN(Buffer buf, allocator().allocate(size_t(k * ld) * es, "k-major weight"));
  auto* dst = static_cast<uint8_t*>(buf.data());
  const auto* src = static_cast<const uint8_t*>(host.data);
  std::memset(dst, 0, size_t(k * ld) * es);
  // Panel by panel, each written in order while its rows (a few hundred KB) stay in cache.
  for (int64_t panel = 0; panel < ld; panel += kPanelCols) {
    const int64_t width = std::min(kPanelCols, ld - panel), rows = std::min(m - panel, width);
    uint8_t* p = dst + size_t(panel * k) * es;
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(p + size_t(i * width + r) * es, src + size_t((panel + r) * k + i) * es, es);
    }
  }
  Tensor t = host;
  t.data = buf.data();
  t.stride[0] = 1;
  t.stride[1] = ld;
  owned->push_back(std::move(buf));
  return t;
}

Result<Tensor> CpuOps::adopt_block_fp8_weight(const Tensor& w, const Tensor& scales, int block_rows,
                                              int block_cols, std::vector<Buffer>* owned) {
  Buffer buf;
  RECUR_ASSIGN_OR_RETURN(Tensor t, pack_fp8(allocator(), w, scales, block_rows, block_cols, &buf));
  owned->push_back(std::move(buf));
  return t;
}

Result<Tensor> CpuOps::quantize_matmul_weight(const Tensor& host, DType dtype,
                                              std::vector<Buffer>* owned) {
  if (host.ndim != 2 || !host.is_contiguous() || host.shape[1] % 32 != 0 ||
      (dtype != DType::Q8_32 && dtype != DType::Q4_32)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "quantize_matmul_weight: {} needs a contiguous matrix with columns a "
                      "multiple of 32, not {}",
                      dtype_name(dtype), host.shape_string());
  }
  Buffer buf;
  RECUR_ASSIGN_OR_RETURN(Tensor t, pack_q(allocator(), host, dtype, &buf));
  owned->push_back(std::move(buf));
  max_quantized_k_ = std::max(max_quantized_k_, host.shape[1]);
  return t;
}

Status CpuOps::reserve(const ForwardLimits& limits) {
  if (max_quantized_k_ == 0) return Status();  // no integer weights: nothing is quantized
  // One pass reads at most every input row of a forward's widest matmuls: all tokens, or for
  // the experts every routed (token, expert) pair and the shared expert's tokens.
  const int64_t rows = std::max<int64_t>(limits.max_matmul_rows, limits.max_tokens);
  // (each distinct input's pieces start 64-byte aligned: up to 3 · 64 bytes more per input)
  const size_t bytes = quantized_activation_bytes(rows, max_quantized_k_) + 3 * 64 * kMaxPassJobs;
  if (activation_arena_.bytes() >= bytes) return Status();
  activation_arena_.reset();
  RECUR_ASSIGN_OR_RETURN(activation_arena_, allocator().allocate(bytes, "quantized activations"));
  return Status();
}

void CpuOps::quant_matmul(const Tensor& x, const Tensor& w, Tensor out, bool accumulate) {
  const MatmulJob job{x, w, out, accumulate};
  matmul_pass(std::span<const MatmulJob>(&job, 1));
}

namespace {

// matmul's k-major test: the layout of adopt_matmul_weight.
bool is_kmajor(const Tensor& w) {
  return w.ndim == 2 && w.stride[0] == 1 && w.stride[1] >= w.shape[0] && w.stride[1] % 16 == 0;
}

// Columns [c0, c1) (c0 a multiple of 16) of a pass job's product; xq: its input quantized
// (integer formats).
void job_columns(const CpuOps::MatmulJob& job, const QuantizedActivations* xq, QuantIsa isa,
                 int64_t c0, int64_t c1) {
  const int64_t n = job.x.shape[0], k = job.w.shape[1];
  if (is_quantized(job.w.dtype)) {
    quant_matmul_columns(isa, job.w, job.x.ptr<float>(), job.x.stride[0], xq, n,
                         job.out.ptr<float>(), job.out.stride[0], c0, c1, job.accumulate);
    return;
  }
  dispatch_weight(job.w.dtype, [&](auto tag) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    LineStream none;
    kmajor_block<W>(job.x.ptr<float>(), job.x.stride[0], job.w.ptr<W>(), job.w.stride[1], k,
                    job.out.ptr<float>(), job.out.stride[0], n, c0, c1, job.accumulate, &none);
  });
}

}  // namespace

void CpuOps::matmul_pass(std::span<const MatmulJob> jobs) {
  RECUR_CHECK(jobs.size() <= size_t(kMaxPassJobs));
  for (const MatmulJob& job : jobs) {
    if (!is_quantized(job.w.dtype) && !is_kmajor(job.w)) {  // row-major: no column split here
      for (const MatmulJob& j : jobs) matmul(j.x, j.w, j.out, j.accumulate);
      return;
    }
  }
  // The integer formats read their input quantized per token: once per distinct input, into
  // the arena reserve() sized (grown here only for callers that did not reserve).
  QuantizedActivations activations[kMaxPassJobs];
  const QuantizedActivations* xq[kMaxPassJobs] = {};
  const void* quantized_from[kMaxPassJobs];
  int quantized_job[kMaxPassJobs];  // the first job of each distinct input
  int n_quantized = 0;
  size_t arena_used = 0;
  // Work in units of a panel's columns, costed by weight bytes read and products computed
  // alike (a unit's cost ∝ k · (tokens + 1)); unit u of job i starts at start[i] + u·cost[i].
  int64_t start[kMaxPassJobs], cost[kMaxPassJobs], units[kMaxPassJobs];
  int64_t total = 0, macs = 0, all_units = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const MatmulJob& job = jobs[i];
    const int64_t n = job.x.shape[0], k = job.w.shape[1], m = job.w.shape[0];
    RECUR_CHECK(job.x.row_size() == k && job.out.shape[0] == n && job.out.row_size() == m);
    RECUR_CHECK(job.x.stride[job.x.ndim - 1] == 1 && job.out.stride[job.out.ndim - 1] == 1);
    units[i] = n == 0 ? 0 : (m + kPanelCols - 1) / kPanelCols;
    cost[i] = kPanelCols * k * (n + 1);
    start[i] = total;
    total += units[i] * cost[i];
    all_units += units[i];
    macs += n * m * k;
    if (units[i] == 0 || !is_quantized(job.w.dtype) || job.w.dtype == DType::F8_E4M3) continue;
    for (int q = 0; q < n_quantized && xq[i] == nullptr; ++q) {
      const QuantizedActivations& a = activations[q];
      if (quantized_from[q] == job.x.data && a.n == n && a.k == k) xq[i] = &a;
    }
    if (xq[i] == nullptr) {  // a new input: its place in the arena, quantized below
      activations[n_quantized] = {n, k, nullptr, nullptr, nullptr};
      quantized_from[n_quantized] = job.x.data;
      quantized_job[n_quantized] = int(i);
      arena_used += quantized_activation_bytes(n, k);
      xq[i] = &activations[n_quantized++];
    }
  }
  if (arena_used > activation_arena_.bytes()) {
    activation_arena_.reset();
    auto grown = allocator().allocate(arena_used, "quantized activations");
    RECUR_CHECK(grown.ok());
    activation_arena_ = std::move(grown).value();
  }
  size_t offset = 0;
  for (int q = 0; q < n_quantized; ++q) {
    const MatmulJob& job = jobs[size_t(quantized_job[q])];
    activations[q] =
        quantize_activations(job.x.ptr<float>(), job.x.stride[0], activations[q].n,
                             activations[q].k, activation_arena_.as<uint8_t>() + offset);
    offset += quantized_activation_bytes(activations[q].n, activations[q].k);
  }
  if (total == 0) return;
  // Enough products per thread that a split pays for handing it over (a few microseconds);
  // several chunks of the total cost per thread, taken as threads come free.
  const int parts = int(std::clamp<int64_t>(macs / (1 << 16), 1, pool_.size()));
  const int64_t chunks = parts == 1 ? 1 : std::min(all_units, parts * kChunksPerThread);
  const QuantIsa isa = best_quant_isa();
  auto run_chunk = [&](int64_t chunk) {
    // The units that start in [lo, hi) of the total cost.
    const int64_t lo = total * chunk / chunks, hi = total * (chunk + 1) / chunks;
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (units[i] == 0) continue;
      const int64_t u0 =
          std::min(units[i], (std::max<int64_t>(0, lo - start[i]) + cost[i] - 1) / cost[i]);
      const int64_t u1 =
          std::min(units[i], (std::max<int64_t>(0, hi - start[i]) + cost[i] - 1) / cost[i]);
      if (u0 < u1) {
        job_columns(jobs[i], xq[i], isa, u0 * kPanelCols,
                    std::min(jobs[i].w.shape[0], u1 * kPanelCols));
      }
    }
  };
  pool_.parallel_chunks(chunks, parts, run_chunk);
}

void CpuOps::matmul_group(const Tensor& x, std::span<const Tensor> ws,
                          std::span<const Tensor> outs) {
  RECUR_CHECK(ws.size() == outs.size() && ws.size() <= kMaxMatmulGroup);
  MatmulJob jobs[kMaxMatmulGroup];
  for (size_t i = 0; i < ws.size(); ++i) jobs[i] = {x, ws[i], outs[i], false};
  matmul_pass(std::span<const MatmulJob>(jobs, ws.size()));
}

void CpuOps::matmul(const Tensor& x, const Tensor& w, Tensor out, bool accumulate) {
  const int64_t n = x.shape[0], k = w.shape[1], m = w.shape[0];
  RECUR_CHECK(x.row_size() == k && out.shape[0] == n && out.row_size() == m);
  RECUR_CHECK(x.stride[x.ndim - 1] == 1 && out.stride[out.ndim - 1] == 1);
  if (n == 0) return;
  if (is_quantized(w.dtype)) {
    quant_matmul(x, w, out, accumulate);
    return;
  }
  if (is_kmajor(w)) {
    const int64_t ld = w.stride[1];
    // Threads split whole panels when there are enough for all, so each streams its own;
    // otherwise vectors of 16 columns.
    const int64_t unit = (ld + kPanelCols - 1) / kPanelCols >= pool_.size() ? kPanelCols : 16;
    const int64_t units = (m + unit - 1) / unit;
    const int64_t min_units =
        std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, k * n * (unit / 16)));
    const int64_t bytes = k * ld * int64_t(dtype_size(w.dtype));
    NextWeight* prev = last_weight_.load(std::memory_order_relaxed);
    if (prev != nullptr) {  // learn: after prev's weight came this one
      prev->next.store(w.data, std::memory_order_relaxed);
      prev->next_bytes.store(bytes, std::memory_order_relaxed);
    }
    NextWeight& self = next_weight_[(reinterpret_cast<uintptr_t>(w.data) >> 6) % kNextWeightSlots];
    if (self.key.load(std::memory_order_relaxed) != w.data) {
      self.key.store(w.data, std::memory_order_relaxed);
      self.next.store(nullptr, std::memory_order_relaxed);
    }
    last_weight_.store(&self, std::memory_order_relaxed);
    // The step's matmuls come in the same order every time: the weight that followed this one
    // last time is asked for while this one computes (tiles after the first, one line per
    // iteration, when the matmul runs as one part), and its first bytes not yet asked for when
    // this one ends, so the ops in between hide its latency.
    const char* next = static_cast<const char*>(self.next.load(std::memory_order_relaxed));
    const int64_t next_bytes =
        next == nullptr ? 0 : self.next_bytes.load(std::memory_order_relaxed);
    const int parts = pool_.parts_for(units, min_units);
    int64_t streamed = 0;  // bytes the tiles asked for, from the start (one part only)
    dispatch_weight(w.dtype, [&](auto tag) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
      if (parts <= 1) {
        LineStream stream{next, next + next_bytes};
        kmajor_block<W>(x.ptr<float>(), x.stride[0], w.ptr<W>(), ld, k, out.ptr<float>(),
                        out.stride[0], n, 0, m, accumulate, &stream);
        if (next != nullptr) streamed = stream.next - next;
        return;
      }
      const int64_t chunks = std::min(units, parts * kChunksPerThread);
      pool_.parallel_chunks(chunks, parts, [&](int64_t c) {
        LineStream none;
        kmajor_block<W>(x.ptr<float>(), x.stride[0], w.ptr<W>(), ld, k, out.ptr<float>(),
                        out.stride[0], n, units * c / chunks * unit,
                        std::min(m, units * (c + 1) / chunks * unit), accumulate, &none);
      });
    });
    if (next != nullptr) {
      const int64_t from = streamed;
      const int64_t to = std::min<int64_t>(next_bytes, from + kNextWeightPrefetchBytes);
      for (int64_t off = from; off < to; off += 64) prefetch_line(next + off);
      // And the table entry the next call will look up.
      prefetch_line(&next_weight_[(reinterpret_cast<uintptr_t>(next) >> 6) % kNextWeightSlots]);
    }
    return;
  }
  RECUR_CHECK(w.ndim == 2 && w.is_contiguous());
  // Enough rows per thread that a split pays for the wake-up (~tens of microseconds of work).
  const int64_t min_rows = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, k * n));
  dispatch_weight(w.dtype, [&](auto tag) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    pool_.parallel_for(m, min_rows, [&](int64_t m0, int64_t m1) {
      matmul_block<W>(x.ptr<float>(), x.stride[0], w.ptr<W>(), k, out.ptr<float>(), out.stride[0],
                      n, m0, m1, accumulate);
    });
  });
}

}  // namespace recur
