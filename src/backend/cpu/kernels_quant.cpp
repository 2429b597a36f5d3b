// Quantized matmul weights (kernels_quant.h): packing at load, activation quantization, and the
// dot products in three forms picked at run time: AVX-512 (VNNI for the integer formats), AVX2
// (the integer formats; F8_E4M3 falls back to scalar there) and the plain scalar reference.
#include "backend/cpu/kernels_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define RECUR_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,f16c,fma")))
#define RECUR_AVX2 __attribute__((target("avx2,f16c,fma")))
#endif

namespace recur::cpu {

namespace {

int64_t round_up(int64_t v, int64_t to) {
  return (v + to - 1) / to * to;
}

float widen(const Tensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::F32:
      return t.ptr<float>()[i];
    case DType::BF16:
      return bf16_to_f32(t.ptr<uint16_t>()[i]);
    case DType::F16:
      return f16_to_f32(t.ptr<uint16_t>()[i]);
    default:
      return 0.0f;
  }
}

// A buffer of header + data_bytes; the tensor view [m, k] over the data (strides {1, ld}: the
// columns are what the threads split).
Result<Tensor> make_quant(Allocator& alloc, DType dtype, const QuantHeader& h, int64_t data_bytes,
                          Buffer* out) {
  RECUR_ASSIGN_OR_RETURN(
      *out, alloc.allocate(size_t(kQuantHeaderBytes + data_bytes), "quantized weight"));
  std::memset(out->data(), 0, size_t(kQuantHeaderBytes + data_bytes));
  std::memcpy(out->data(), &h, sizeof h);
  Tensor t = Tensor::contiguous(static_cast<char*>(out->data()) + kQuantHeaderBytes, dtype,
                                {h.m, h.k}, out->device());
  t.stride[0] = 1;
  t.stride[1] = h.ld;
  return t;
}

// The layout's view of group g of column block cb.
const uint8_t* group_block(const Tensor& w, const QuantHeader& h, int64_t cb, int64_t g) {
  const int64_t bytes = w.dtype == DType::Q8_32 ? kQ8GroupBytes : kQ4GroupBytes;
  return static_cast<const uint8_t*>(w.data) + (cb * (h.k / 32) + g) * bytes;
}

// ---- scalar reference ----

void fp8_columns_scalar(const Tensor& w, const QuantHeader& h, const float* x, int64_t xs,
                        int64_t n, float* out, int64_t os, int64_t c0, int64_t c1,
                        bool accumulate) {
  const auto* q = static_cast<const uint8_t*>(w.data);
  const auto* sc =
      reinterpret_cast<const float*>(static_cast<const char*>(w.data) + h.scale_offset);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = c0; c < c1; ++c) {
      float acc = 0.0f;
      for (int64_t k0 = 0; k0 < h.k; k0 += h.group) {
        float part = 0.0f;
        for (int64_t i = k0; i < std::min(h.k, k0 + h.group); ++i) {
          // f8 / 256, as the vector kernels widen it through f16 (exact).
          part = std::fma(f8_e4m3_to_f32(q[i * h.ld + c]) * (1.0f / 256.0f), x[t * xs + i], part);
        }
        acc = std::fma(part, sc[(k0 / h.group) * h.ld + c], acc);
      }
      float* o = out + t * os + c;
      *o = accumulate ? *o + acc : acc;
    }
  }
}

void q_columns_scalar(const Tensor& w, const QuantHeader& h, const QuantizedActivations& xq,
                      int64_t n, float* out, int64_t os, int64_t c0, int64_t c1, bool accumulate) {
  const bool q4 = w.dtype == DType::Q4_32;
  const int64_t G = h.k / 32, qbytes = q4 ? 4 * 64 : 8 * 64;
  const int32_t offset = q4 ? 8 : 128;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t cc = c % 16;
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* blk = group_block(w, h, c / 16, g);
        const int8_t* xg = xq.q + t * h.k + 32 * g;
        int32_t dot = 0;
        for (int r = 0; r < 32; ++r) {
          int32_t stored;
          if (q4) {
            const uint8_t byte = blk[(r % 16) / 4 * 64 + cc * 4 + r % 4];
            stored = r < 16 ? byte & 15 : byte >> 4;
          } else {
            stored = blk[r / 4 * 64 + cc * 4 + r % 4];
          }
          dot += stored * int32_t(xg[r]);
        }
        uint16_t d16;
        std::memcpy(&d16, blk + qbytes + 2 * cc, 2);
        const float d = f16_to_f32(d16) * xq.scale[size_t(t * G + g)];
        acc = std::fma(float(dot - offset * xq.sum[size_t(t * G + g)]), d, acc);
      }
      float* o = out + t * os + c;
      *o = accumulate ? *o + acc : acc;
    }
  }
}

#if defined(__x86_64__)
// ---- AVX-512 ----

// 16 e4m3 bytes as f32 / 256: each byte becomes an f16 with the same sign, exponent bits and
// mantissa bits (f16's bias is 8 more than e4m3's), which the hardware widens exactly.
RECUR_AVX512 inline __m512 fp8x16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1),
                                     _mm256_set1_epi16(int16_t(0xbfff)));
  return _mm512_cvtph_ps(h);
}

// out[t, 16v ..] (+)= acc[t][v] for a tile of NT tokens (rows os apart) × NV blocks of 16
// columns, the last block masked by `last`.
template <int NV, int NT>
RECUR_AVX512 inline void store_tile_avx512(const __m512 (&acc)[NT][NV], float* out, int64_t os,
                                           __mmask16 last, bool accumulate) {
  for (int t = 0; t < NT; ++t) {
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? last : __mmask16(0xffff);
      float* o = out + t * os + 16 * v;
      __m512 r = acc[t][v];
      if (accumulate) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, o));
      _mm512_mask_storeu_ps(o, m, r);
    }
  }
}

template <int NV, int NT>
RECUR_AVX512 void fp8_tile_avx512(const uint8_t* w, const float* sc, const QuantHeader& h,
                                  const float* x, int64_t xs, float* out, int64_t os,
                                  __mmask16 last, bool accumulate) {
  __m512 acc[NT][NV];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < h.k; k0 += h.group) {
    const int64_t k1 = std::min(h.k, k0 + h.group);
    __m512 part[NT][NV];
    for (int t = 0; t < NT; ++t)
      for (int v = 0; v < NV; ++v) part[t][v] = _mm512_setzero_ps();
    for (int64_t i = k0; i < k1; ++i) {
      __m512 wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = fp8x16(w + i * h.ld + 16 * v);
      for (int t = 0; t < NT; ++t) {
        const __m512 xb = _mm512_set1_ps(x[t * xs + i]);
        for (int v = 0; v < NV; ++v) part[t][v] = _mm512_fmadd_ps(wv[v], xb, part[t][v]);
      }
    }
    const float* s = sc + (k0 / h.group) * h.ld;
    for (int v = 0; v < NV; ++v) {
      const __m512 sv = _mm512_loadu_ps(s + 16 * v);
      for (int t = 0; t < NT; ++t) acc[t][v] = _mm512_fmadd_ps(part[t][v], sv, acc[t][v]);
    }
  }
  store_tile_avx512<NV, NT>(acc, out, os, last, accumulate);
}

template <int NV>
RECUR_AVX512 void fp8_tokens_avx512(const uint8_t* w, const float* sc, const QuantHeader& h,
                                    const float* x, int64_t xs, int64_t n, float* out, int64_t os,
                                    __mmask16 last, bool accumulate) {
  int64_t t = 0;
  for (; t + 3 <= n; t += 3)
    fp8_tile_avx512<NV, 3>(w, sc, h, x + t * xs, xs, out + t * os, os, last, accumulate);
  if (n - t == 2)
    fp8_tile_avx512<NV, 2>(w, sc, h, x + t * xs, xs, out + t * os, os, last, accumulate);
  if (n - t == 1)
    fp8_tile_avx512<NV, 1>(w, sc, h, x + t * xs, xs, out + t * os, os, last, accumulate);
}

RECUR_AVX512 void fp8_columns_avx512(const Tensor& w, const QuantHeader& h, const float* x,
                                     int64_t xs, int64_t n, float* out, int64_t os, int64_t c0,
                                     int64_t c1, bool accumulate) {
  const auto* q = static_cast<const uint8_t*>(w.data);
  const auto* sc =
      reinterpret_cast<const float*>(static_cast<const char*>(w.data) + h.scale_offset);
  for (int64_t c = c0; c < c1;) {
    const int64_t cols = std::min<int64_t>(c1 - c, 64);
    const int vectors = int((cols + 15) / 16);
    const __mmask16 last = cols % 16 ? __mmask16((1u << (cols % 16)) - 1) : __mmask16(0xffff);
    switch (vectors) {
      case 4:
        fp8_tokens_avx512<4>(q + c, sc + c, h, x, xs, n, out + c, os, last, accumulate);
        break;
      case 3:
        fp8_tokens_avx512<3>(q + c, sc + c, h, x, xs, n, out + c, os, last, accumulate);
        break;
      case 2:
        fp8_tokens_avx512<2>(q + c, sc + c, h, x, xs, n, out + c, os, last, accumulate);
        break;
      default:
        fp8_tokens_avx512<1>(q + c, sc + c, h, x, xs, n, out + c, os, last, accumulate);
        break;
    }
    c += cols;
  }
}

// NV column blocks (consecutive, `cb_bytes` apart) × NT tokens from t0: VNNI dot products of the
// unsigned quants with the signed activations, per group of 32, then scaled into f32.
template <int NV, int NT, bool Q4>
RECUR_AVX512 void q_tile_avx512(const uint8_t* w, int64_t cb_bytes, const QuantHeader& h,
                                const QuantizedActivations& xq, int64_t t0, float* out, int64_t os,
                                __mmask16 last, bool accumulate) {
  constexpr int64_t kBytes = Q4 ? kQ4GroupBytes : kQ8GroupBytes, kQuantBytes = kBytes - 32;
  constexpr int32_t kOffset = Q4 ? 8 : 128;
  const int64_t G = h.k / 32;
  __m512 acc[NT][NV];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_setzero_ps();
  const int8_t* xrow[NT];
  for (int t = 0; t < NT; ++t) xrow[t] = xq.q + (t0 + t) * h.k;
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[NT][NV];
    for (int t = 0; t < NT; ++t)
      for (int v = 0; v < NV; ++v) dot[t][v] = _mm512_setzero_si512();
    const uint8_t* blk[NV];
    for (int v = 0; v < NV; ++v) blk[v] = w + v * cb_bytes + g * kBytes;
    if constexpr (Q4) {
      const __m512i low = _mm512_set1_epi8(0x0f);
      for (int j = 0; j < 4; ++j) {
        __m512i lo[NV], hi[NV];
        for (int v = 0; v < NV; ++v) {
          const __m512i raw = _mm512_loadu_si512(blk[v] + 64 * j);
          lo[v] = _mm512_and_si512(raw, low);
          hi[v] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        for (int t = 0; t < NT; ++t) {
          int32_t a, b;
          std::memcpy(&a, xrow[t] + 32 * g + 4 * j, 4);
          std::memcpy(&b, xrow[t] + 32 * g + 16 + 4 * j, 4);
          const __m512i xa = _mm512_set1_epi32(a), xb = _mm512_set1_epi32(b);
          for (int v = 0; v < NV; ++v) {
            dot[t][v] = _mm512_dpbusd_epi32(dot[t][v], lo[v], xa);
            dot[t][v] = _mm512_dpbusd_epi32(dot[t][v], hi[v], xb);
          }
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m512i wv[NV];
        for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(blk[v] + 64 * j);
        for (int t = 0; t < NT; ++t) {
          int32_t a;
          std::memcpy(&a, xrow[t] + 32 * g + 4 * j, 4);
          const __m512i xa = _mm512_set1_epi32(a);
          for (int v = 0; v < NV; ++v) dot[t][v] = _mm512_dpbusd_epi32(dot[t][v], wv[v], xa);
        }
      }
    }
    __m512 dw[NV];
    for (int v = 0; v < NV; ++v) {
      dw[v] = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[v] + kQuantBytes)));
    }
    for (int t = 0; t < NT; ++t) {
      const size_t at = size_t((t0 + t) * G + g);
      const __m512i off = _mm512_set1_epi32(kOffset * xq.sum[at]);
      const __m512 dx = _mm512_set1_ps(xq.scale[at]);
      for (int v = 0; v < NV; ++v) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[t][v], off));
        acc[t][v] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw[v], dx), acc[t][v]);
      }
    }
  }
  store_tile_avx512<NV, NT>(acc, out, os, last, accumulate);
}

template <int NV, bool Q4>
RECUR_AVX512 void q_tokens_avx512(const uint8_t* w, int64_t cb_bytes, const QuantHeader& h,
                                  const QuantizedActivations& xq, int64_t n, float* out, int64_t os,
                                  __mmask16 last, bool accumulate) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4)
    q_tile_avx512<NV, 4, Q4>(w, cb_bytes, h, xq, t, out + t * os, os, last, accumulate);
  switch (n - t) {
    case 3:
      q_tile_avx512<NV, 3, Q4>(w, cb_bytes, h, xq, t, out + t * os, os, last, accumulate);
      break;
    case 2:
      q_tile_avx512<NV, 2, Q4>(w, cb_bytes, h, xq, t, out + t * os, os, last, accumulate);
      break;
    case 1:
      q_tile_avx512<NV, 1, Q4>(w, cb_bytes, h, xq, t, out + t * os, os, last, accumulate);
      break;
    default:
      break;
  }
}

template <bool Q4>
RECUR_AVX512 void q_columns_avx512(const Tensor& w, const QuantHeader& h,
                                   const QuantizedActivations& xq, int64_t n, float* out,
                                   int64_t os, int64_t c0, int64_t c1, bool accumulate) {
  const int64_t cb_bytes = (h.k / 32) * (Q4 ? kQ4GroupBytes : kQ8GroupBytes);
  for (int64_t c = c0; c < c1;) {
    const int64_t cols = std::min<int64_t>(c1 - c, 64);
    const int vectors = int((cols + 15) / 16);
    const __mmask16 last = cols % 16 ? __mmask16((1u << (cols % 16)) - 1) : __mmask16(0xffff);
    const uint8_t* wc = group_block(w, h, c / 16, 0);
    switch (vectors) {
      case 4:
        q_tokens_avx512<4, Q4>(wc, cb_bytes, h, xq, n, out + c, os, last, accumulate);
        break;
      case 3:
        q_tokens_avx512<3, Q4>(wc, cb_bytes, h, xq, n, out + c, os, last, accumulate);
        break;
      case 2:
        q_tokens_avx512<2, Q4>(wc, cb_bytes, h, xq, n, out + c, os, last, accumulate);
        break;
      default:
        q_tokens_avx512<1, Q4>(wc, cb_bytes, h, xq, n, out + c, os, last, accumulate);
        break;
    }
    c += cols;
  }
}

// ---- AVX2: one column block (two halves of 8 lanes) × NT tokens ----

template <int NT, bool Q4>
RECUR_AVX2 void q_tile_avx2(const uint8_t* w, const QuantHeader& h, const QuantizedActivations& xq,
                            int64_t t0, float* out, int64_t os, int cols, bool accumulate) {
  constexpr int64_t kBytes = Q4 ? kQ4GroupBytes : kQ8GroupBytes, kQuantBytes = kBytes - 32;
  const int64_t G = h.k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const int8_t* xrow[NT];
  for (int t = 0; t < NT; ++t) xrow[t] = xq.q + (t0 + t) * h.k;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk = w + g * kBytes;
    __m256i dot[NT][2];
    for (int t = 0; t < NT; ++t) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
    if constexpr (Q4) {
      // Quants 0..15 times int8: pair sums stay far inside int16.
      const __m256i low = _mm256_set1_epi8(0x0f);
      for (int j = 0; j < 4; ++j) {
        for (int half = 0; half < 2; ++half) {
          const __m256i raw =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half));
          const __m256i lo = _mm256_and_si256(raw, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
          for (int t = 0; t < NT; ++t) {
            int32_t a, b;
            std::memcpy(&a, xrow[t] + 32 * g + 4 * j, 4);
            std::memcpy(&b, xrow[t] + 32 * g + 16 + 4 * j, 4);
            const __m256i pa = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a));
            const __m256i pb = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b));
            dot[t][half] =
                _mm256_add_epi32(dot[t][half], _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones));
          }
        }
      }
    } else {
      // The signed quants (stored + 128 flips to them by the top bit) with |x| and x's sign
      // moved onto them: unsigned × signed pairs of at most 2·127·127, inside int16.
      const __m256i flip = _mm256_set1_epi8(int8_t(0x80));
      for (int j = 0; j < 8; ++j) {
        for (int half = 0; half < 2; ++half) {
          const __m256i ws = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * half)), flip);
          for (int t = 0; t < NT; ++t) {
            int32_t a;
            std::memcpy(&a, xrow[t] + 32 * g + 4 * j, 4);
            const __m256i xa = _mm256_set1_epi32(a);
            const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xa), _mm256_sign_epi8(ws, xa));
            dot[t][half] = _mm256_add_epi32(dot[t][half], _mm256_madd_epi16(p, ones));
          }
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256 dw = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kQuantBytes + 16 * half)));
      for (int t = 0; t < NT; ++t) {
        const size_t at = size_t((t0 + t) * G + g);
        // Q4 quants carry their offset of 8; Q8 ones were made signed above.
        const __m256i off = _mm256_set1_epi32(Q4 ? 8 * xq.sum[at] : 0);
        const __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot[t][half], off));
        acc[t][half] =
            _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(xq.scale[at])), acc[t][half]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    alignas(32) float r[16];
    _mm256_store_ps(r, acc[t][0]);
    _mm256_store_ps(r + 8, acc[t][1]);
    float* o = out + t * os;
    for (int c = 0; c < cols; ++c) o[c] = accumulate ? o[c] + r[c] : r[c];
  }
}

template <bool Q4>
RECUR_AVX2 void q_columns_avx2(const Tensor& w, const QuantHeader& h,
                               const QuantizedActivations& xq, int64_t n, float* out, int64_t os,
                               int64_t c0, int64_t c1, bool accumulate) {
  for (int64_t c = c0; c < c1; c += 16) {
    const int cols = int(std::min<int64_t>(c1 - c, 16));
    const uint8_t* wc = group_block(w, h, c / 16, 0);
    int64_t t = 0;
    for (; t + 4 <= n; t += 4)
      q_tile_avx2<4, Q4>(wc, h, xq, t, out + t * os + c, os, cols, accumulate);
    for (; t < n; ++t) q_tile_avx2<1, Q4>(wc, h, xq, t, out + t * os + c, os, cols, accumulate);
  }
}
#endif

}  // namespace

Result<Tensor> pack_fp8(Allocator& alloc, const Tensor& w, const Tensor& scales, int block_rows,
                        int block_cols, Buffer* out) {
  RECUR_CHECK(w.ndim == 2 && w.is_contiguous() && w.dtype == DType::F8_E4M3);
  RECUR_CHECK(scales.dtype == DType::F32 && scales.is_contiguous());
  QuantHeader h;
  h.m = w.shape[0];
  h.k = w.shape[1];
  h.ld = round_up(h.m, 16);
  h.group = block_cols;
  const int64_t kb = (h.k + block_cols - 1) / block_cols;
  RECUR_CHECK(scales.numel() == (h.m + block_rows - 1) / block_rows * kb);
  h.scale_offset = round_up(h.k * h.ld, 64);
  RECUR_ASSIGN_OR_RETURN(Tensor t,
                         make_quant(alloc, DType::F8_E4M3, h, h.scale_offset + kb * h.ld * 4, out));
  auto* q = static_cast<uint8_t*>(t.data);
  auto* sc = reinterpret_cast<float*>(q + h.scale_offset);
  const auto* src = w.ptr<uint8_t>();
  for (int64_t r = 0; r < h.m; ++r) {
    for (int64_t i = 0; i < h.k; ++i) q[i * h.ld + r] = src[r * h.k + i];
    for (int64_t j = 0; j < kb; ++j)
      sc[j * h.ld + r] = scales.ptr<float>()[(r / block_rows) * kb + j] * 256.0f;
  }
  return t;
}

Result<Tensor> pack_q(Allocator& alloc, const Tensor& w, DType dtype, Buffer* out) {
  RECUR_CHECK(w.ndim == 2 && w.is_contiguous() && w.shape[1] % 32 == 0);
  RECUR_CHECK(dtype == DType::Q8_32 || dtype == DType::Q4_32);
  const bool q4 = dtype == DType::Q4_32;
  QuantHeader h;
  h.m = w.shape[0];
  h.k = w.shape[1];
  h.ld = round_up(h.m, 16);
  h.group = 32;
  const int64_t G = h.k / 32, bytes = q4 ? kQ4GroupBytes : kQ8GroupBytes;
  RECUR_ASSIGN_OR_RETURN(Tensor t, make_quant(alloc, dtype, h, h.ld / 16 * G * bytes, out));
  for (int64_t cb = 0; cb < h.ld / 16; ++cb) {
    for (int64_t g = 0; g < G; ++g) {
      auto* blk = const_cast<uint8_t*>(group_block(t, h, cb, g));
      for (int64_t cc = 0; cc < 16; ++cc) {
        const int64_t c = cb * 16 + cc;
        float v[32] = {};
        if (c < h.m) {
          for (int r = 0; r < 32; ++r) v[r] = widen(w, c * h.k + 32 * g + r);
        }
        float big = 0.0f;  // the value of largest magnitude
        for (float x : v) big = std::fabs(x) > std::fabs(big) ? x : big;
        // The scale as stored (f16), and the quants against that very scale.
        const uint16_t d16 = f32_to_f16(q4 ? big / -8.0f : std::fabs(big) / 127.0f);
        const float d = f16_to_f32(d16);
        for (int r = 0; r < 32; ++r) {
          const float qf = d != 0.0f ? std::nearbyint(v[r] / d) : 0.0f;
          if (q4) {
            const auto q = uint8_t(std::clamp(qf, -8.0f, 7.0f) + 8.0f);
            uint8_t& byte = blk[(r % 16) / 4 * 64 + cc * 4 + r % 4];
            byte = r < 16 ? uint8_t((byte & 0xf0) | q) : uint8_t((byte & 0x0f) | (q << 4));
          } else {
            blk[r / 4 * 64 + cc * 4 + r % 4] = uint8_t(std::clamp(qf, -127.0f, 127.0f) + 128.0f);
          }
        }
        std::memcpy(blk + bytes - 32 + 2 * cc, &d16, 2);
      }
    }
  }
  return t;
}

namespace {
size_t round64(size_t bytes) {
  return (bytes + 63) / 64 * 64;
}
}  // namespace

size_t quantized_activation_bytes(int64_t n, int64_t k) {
  const size_t groups = size_t(n * (k / 32));
  return round64(size_t(n * k)) + 2 * round64(groups * 4);
}

QuantizedActivations quantize_activations(const float* x, int64_t x_stride, int64_t n, int64_t k,
                                          void* memory) {
  const int64_t G = k / 32;
  QuantizedActivations a;
  a.n = n;
  a.k = k;
  uint8_t* p = static_cast<uint8_t*>(memory);
  a.q = reinterpret_cast<int8_t*>(p);
  a.scale = reinterpret_cast<float*>(p + round64(size_t(n * k)));
  a.sum = reinterpret_cast<int32_t*>(p + round64(size_t(n * k)) + round64(size_t(n * G) * 4));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + t * x_stride + 32 * g;
      float amax = 0.0f;
      for (int r = 0; r < 32; ++r) amax = std::max(amax, std::fabs(xg[r]));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* q = a.q + t * k + 32 * g;
      int32_t sum = 0;
      for (int r = 0; r < 32; ++r) {
        q[r] = int8_t(std::clamp(std::nearbyint(xg[r] * inv), -127.0f, 127.0f));
        sum += q[r];
      }
      a.scale[t * G + g] = d;
      a.sum[t * G + g] = sum;
    }
  }
  return a;
}

#if defined(__x86_64__)
namespace {
// CPUID leaf 1, ECX bit 29 (clang before 16 has no "f16c" for __builtin_cpu_supports).
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
}
}  // namespace
#endif

bool quant_isa_supported(QuantIsa isa) {
#if defined(__x86_64__)
  switch (isa) {
    case QuantIsa::kScalar:
      return true;
    case QuantIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case QuantIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni") && quant_isa_supported(QuantIsa::kAvx2);
  }
  return false;
#else
  return isa == QuantIsa::kScalar;
#endif
}

QuantIsa best_quant_isa() {
  static const QuantIsa best = quant_isa_supported(QuantIsa::kAvx512) ? QuantIsa::kAvx512
                               : quant_isa_supported(QuantIsa::kAvx2) ? QuantIsa::kAvx2
                                                                      : QuantIsa::kScalar;
  return best;
}

const char* quant_isa_name(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kScalar:
      return "scalar";
    case QuantIsa::kAvx2:
      return "avx2";
    case QuantIsa::kAvx512:
      return "avx512-vnni";
  }
  return "?";
}

void quant_matmul_columns(QuantIsa isa, const Tensor& w, const float* x, int64_t x_stride,
                          const QuantizedActivations* xq, int64_t n, float* out, int64_t out_stride,
                          int64_t c0, int64_t c1, bool accumulate) {
  const QuantHeader& h = quant_header(w);
  RECUR_CHECK(c0 % 16 == 0 && c1 <= h.m && is_quantized(w.dtype));
  if (w.dtype == DType::F8_E4M3) {
#if defined(__x86_64__)
    if (isa == QuantIsa::kAvx512) {
      fp8_columns_avx512(w, h, x, x_stride, n, out, out_stride, c0, c1, accumulate);
      return;
    }
#endif
    fp8_columns_scalar(w, h, x, x_stride, n, out, out_stride, c0, c1, accumulate);
    return;
  }
  RECUR_CHECK(xq != nullptr && xq->k == h.k && xq->n >= n);
  const bool q4 = w.dtype == DType::Q4_32;
#if defined(__x86_64__)
  if (isa == QuantIsa::kAvx512) {
    if (q4) {
      q_columns_avx512<true>(w, h, *xq, n, out, out_stride, c0, c1, accumulate);
    } else {
      q_columns_avx512<false>(w, h, *xq, n, out, out_stride, c0, c1, accumulate);
    }
    return;
  }
  if (isa == QuantIsa::kAvx2) {
    if (q4) {
      q_columns_avx2<true>(w, h, *xq, n, out, out_stride, c0, c1, accumulate);
    } else {
      q_columns_avx2<false>(w, h, *xq, n, out, out_stride, c0, c1, accumulate);
    }
    return;
  }
#endif
  q_columns_scalar(w, h, *xq, n, out, out_stride, c0, c1, accumulate);
}

float quant_weight_at(const Tensor& w, int64_t c, int64_t i) {
  const QuantHeader& h = quant_header(w);
  if (w.dtype == DType::F8_E4M3) {
    const auto* q = static_cast<const uint8_t*>(w.data);
    const auto* sc = reinterpret_cast<const float*>(q + h.scale_offset);
    return f8_e4m3_to_f32(q[i * h.ld + c]) * (sc[(i / h.group) * h.ld + c] / 256.0f);
  }
  const bool q4 = w.dtype == DType::Q4_32;
  const uint8_t* blk = group_block(w, h, c / 16, i / 32);
  const int64_t cc = c % 16, r = i % 32;
  int q;
  if (q4) {
    const uint8_t byte = blk[(r % 16) / 4 * 64 + cc * 4 + r % 4];
    q = (r < 16 ? byte & 15 : byte >> 4) - 8;
  } else {
    q = int(blk[r / 4 * 64 + cc * 4 + r % 4]) - 128;
  }
  uint16_t d16;
  std::memcpy(&d16, blk + (q4 ? kQ4GroupBytes : kQ8GroupBytes) - 32 + 2 * cc, 2);
  return float(q) * f16_to_f32(d16);
}

}  // namespace recur::cpu
