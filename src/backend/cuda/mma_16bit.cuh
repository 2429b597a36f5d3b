// 16-bit tensor-core products near f32's accuracy: an f32 operand is split into terms of the
// other operand's type, x = hi + mid (+ lo), each multiplied on the tensor cores against an
// operand exactly of that type, with f32 accumulation. bf16 (8-bit significands, f32's exponent
// range) takes three terms for f32's 24-bit significand (about 2^-24 relative; two leave 2^-16);
// f16 (11 bits) takes two, 22 bits (about 2^-22), within f16's range (below 65504; for |x| under
// 2^-3 the lo term is subnormal, an absolute error of 2^-25, which is why softmax weights are
// scaled up first).
// Fragments are those of mma.sync m16n8k16 with g = lane / 4, c = lane % 4: a (16 × 16,
// row-major) holds rows g, g + 8 at columns 2c, 2c + 1 and 2c + 8, 2c + 9; b (16 × 8) rows 2c,
// 2c + 1 and 2c + 8, 2c + 9 of column g; the f32 accumulator c (16 × 8) rows g, g + 8 at
// columns 2c, 2c + 1 (the layout of mma_tf32.cuh's).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace recur::cuda {

constexpr int kBf16Terms = 3;  // hi, mid, lo

// x0, x1's three bf16 terms (each the rest of the one before, rounded to nearest), each pair
// packed as a fragment register (x0 in the low half).
__device__ __forceinline__ void split3_bf16x2(float x0, float x1, uint32_t (&t)[kBf16Terms]) {
#pragma unroll
  for (int i = 0; i < kBf16Terms; ++i) {
    // One conversion of the pair (x0 to the low half), each half widened back by its bits.
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    t[i] = *reinterpret_cast<const uint32_t*>(&h);
    if (i + 1 < kBf16Terms)
      x0 -= __uint_as_float(t[i] << 16), x1 -= __uint_as_float(t[i] & 0xffff0000u);
  }
}

// c [16 × 8] += a [16 × 16] · b [16 × 8], bf16 operands, f32 accumulation.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Whether M is one of the 16-bit operand types the products take.
template <typename M>
constexpr bool kIs16BitOperand = std::is_same_v<M, __half> || std::is_same_v<M, __nv_bfloat16>;

// The number of terms an f32 operand is split into against 16-bit operands of type M.
template <typename M>
constexpr int kTermsOf = std::is_same_v<M, __half> ? 2 : kBf16Terms;

// Softmax weights (at most 1) are multiplied by this before their split, and the sums they
// weigh divided by it after (exact: a power of two): weights of 2^-17 or more then keep 22 bits,
// and smaller ones err by at most 2^-39 of the largest weight (1). bf16 needs no scaling.
template <typename M>
constexpr float kWeightScaleOf = std::is_same_v<M, __half> ? 16384.0f : 1.0f;

// x0, x1's terms of type M (each the rest of the one before, rounded to nearest), each pair
// packed as a fragment register (x0 in the low half). For f16, |x| must be below 65504.
template <typename M>
__device__ __forceinline__ void split_x2(float x0, float x1, uint32_t (&t)[kTermsOf<M>]) {
  static_assert(kIs16BitOperand<M>);
  if constexpr (std::is_same_v<M, __half>) {
#pragma unroll
    for (int i = 0; i < kTermsOf<M>; ++i) {
      const __half2 h = __floats2half2_rn(x0, x1);
      t[i] = *reinterpret_cast<const uint32_t*>(&h);
      if (i + 1 < kTermsOf<M>) {
        const float2 f = __half22float2(h);
        x0 -= f.x, x1 -= f.y;
      }
    }
  } else {
    split3_bf16x2(x0, x1, t);
  }
}

// A warp's softmax weights over kKeys keys as the A operand's terms of type M for each 16 keys
// (an m16n8k16 A fragment, as wgmma takes its register operand): sc[j] holds keys [8j, 8j + 8)
// of rows g and g + 8, so n-tiles 2kk and 2kk + 1 are that fragment as they lie. The weights are
// multiplied by kWeightScaleOf<M> (the caller divides the sums by it).
template <typename M, int kKeys>
__device__ __forceinline__ void weight_terms(const float (&sc)[kKeys / 8][4],
                                             uint32_t (&ap)[kKeys / 16][kTermsOf<M>][4]) {
  constexpr float kWs = kWeightScaleOf<M>;
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const float(&s)[4] = sc[2 * kk + f / 2];
      uint32_t t[kTermsOf<M>];
      split_x2<M>(s[2 * (f % 2)] * kWs, s[2 * (f % 2) + 1] * kWs, t);
#pragma unroll
      for (int i = 0; i < kTermsOf<M>; ++i) ap[kk][i][f] = t[i];
    }
  }
}

// x limited to f16's finite range (NaN stays NaN), for an operand whose f16 terms must not
// overflow.
__device__ __forceinline__ float clamp_f16_range(float x) {
  return fabsf(x) > 65504.0f ? copysignf(65504.0f, x) : x;
}

// c [16 × 8] += a · b, 16-bit operands of type M, f32 accumulation.
template <typename M>
__device__ __forceinline__ void mma16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) {
  static_assert(kIs16BitOperand<M>);
  if constexpr (std::is_same_v<M, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    mma_bf16(c, a, b0, b1);
  }
}

// Four 8 × 8 16-bit matrices from shared memory (ldmatrix): lane l gives the address of row
// l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); r[i] is matrix i's element pair of the
// lane, (row l / 4, columns 2(l % 4), +1), or with kTrans the pair (rows 2(l % 4), +1,
// column l / 4). Volatile: it stays in program order with the products around it.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned p = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(p));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(p));
  }
}

}  // namespace recur::cuda
