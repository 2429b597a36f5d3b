// Tensor-core products to f32's accuracy from TF32 halves: x = hi + lo (hi x truncated to TF32's
// 10 mantissa bits, lo the exact f32 rest, of which the tensor core reads the top 10 bits), and
// a·b as al·bh + ah·bl + ah·bh (the small terms first), about 2^-20 relative error per product.
// Fragments are those of mma.sync m16n8k8 .tf32 with g = lane / 4, t = lane % 4:
// a (16 × 8, row-major) rows g, g + 8 and columns t, t + 4; b (8 × 8) rows t, t + 4 of column g;
// c (16 × 8) rows g, g + 8 and columns 2t, 2t + 1.
#pragma once

#include <cstdint>

namespace recur::cuda {

// Two instructions: cvt.rna.tf32 costs several, and splitting can dominate a kernel's issue
// slots.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

// c [16 × 8] += a [16 × 8] · b [8 × 8], TF32 (a row-major, b column-major fragments).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A split fragment pair: the a operand (4 values) or the b operand (2 values).
struct SplitA {
  uint32_t hi[4], lo[4];
};
struct SplitB {
  uint32_t hi[2], lo[2];
};

// Element u (0..3) of a 16 × 8 accumulator fragment (mma_split's c): its row and column within
// the tile, for the lane of groupID g and threadID_in_group t.
__device__ __forceinline__ int mma_c_row(int g, int u) {
  return g + (u / 2) * 8;
}
__device__ __forceinline__ int mma_c_col(int t, int u) {
  return 2 * t + u % 2;
}

// a from a tile whose element A[r][k] is at A[r·rs + k·cs], at rows r0.., columns k0..
__device__ __forceinline__ SplitA load_split_a_strided(const float* A, int rs, int cs, int r0,
                                                       int k0, int g, int t) {
  SplitA f;
  split_tf32(A[(r0 + g) * rs + (k0 + t) * cs], f.hi[0], f.lo[0]);
  split_tf32(A[(r0 + g + 8) * rs + (k0 + t) * cs], f.hi[1], f.lo[1]);
  split_tf32(A[(r0 + g) * rs + (k0 + t + 4) * cs], f.hi[2], f.lo[2]);
  split_tf32(A[(r0 + g + 8) * rs + (k0 + t + 4) * cs], f.hi[3], f.lo[3]);
  return f;
}
// a from a row-major tile A[r][k] (rows ld floats apart).
__device__ __forceinline__ SplitA load_split_a(const float* A, int ld, int r0, int k0, int g,
                                               int t) {
  return load_split_a_strided(A, ld, 1, r0, k0, g, t);
}
// a from a tile stored transposed, A[r][k] = At[k][r] (rows of At ld floats apart).
__device__ __forceinline__ SplitA load_split_a_t(const float* At, int ld, int r0, int k0, int g,
                                                 int t) {
  return load_split_a_strided(At, 1, ld, r0, k0, g, t);
}
// b from a row-major tile B[k][c] (rows ld floats apart) at rows k0.., columns c0..
__device__ __forceinline__ SplitB load_split_b(const float* B, int ld, int k0, int c0, int g,
                                               int t) {
  SplitB f;
  split_tf32(B[(k0 + t) * ld + c0 + g], f.hi[0], f.lo[0]);
  split_tf32(B[(k0 + t + 4) * ld + c0 + g], f.hi[1], f.lo[1]);
  return f;
}

// b from a tile stored transposed, B[k][c] = Bt[c][k] (rows of Bt ld floats apart).
__device__ __forceinline__ SplitB load_split_b_t(const float* Bt, int ld, int k0, int c0, int g,
                                                 int t) {
  SplitB f;
  split_tf32(Bt[(c0 + g) * ld + k0 + t], f.hi[0], f.lo[0]);
  split_tf32(Bt[(c0 + g) * ld + k0 + t + 4], f.hi[1], f.lo[1]);
  return f;
}

// c += a · b to f32's accuracy (three products).
__device__ __forceinline__ void mma_split(float (&c)[4], const SplitA& a, const SplitB& b) {
  mma_tf32(c, a.lo, b.hi[0], b.hi[1]);
  mma_tf32(c, a.hi, b.lo[0], b.lo[1]);
  mma_tf32(c, a.hi, b.hi[0], b.hi[1]);
}

}  // namespace recur::cuda
