// BF16 tensor-core products near f32's accuracy: x = hi + lo, both bf16 (lo the rounded rest:
// about 2^-17 relative), and a·b as al·bh + ah·bl + ah·bh (the small terms first); an operand
// that is exactly bf16 already (a BF16 or F8_E4M3 cache) has no lo term. Fragments are those
// of mma.sync m16n8k16 .bf16 with g = lane / 4, c = lane % 4: a (16 × 16, row-major) holds
// rows g, g + 8 at columns 2c, 2c + 1 and 2c + 8, 2c + 9; b (16 × 8) rows 2c, 2c + 1 and
// 2c + 8, 2c + 9 of column g; the f32 accumulator c (16 × 8) rows g, g + 8 at columns 2c, 2c + 1
// (the layout of mma_tf32.cuh's).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace recur::cuda {

// x's bf16 hi and lo parts (round to nearest).
__device__ __forceinline__ void split_bf16(float x, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(x - __bfloat162float(hi));
}

// Two values' hi parts and lo parts, each packed as an a or b fragment register (the first
// value in the low half).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  __nv_bfloat16 h0, l0, h1, l1;
  split_bf16(x0, h0, l0);
  split_bf16(x1, h1, l1);
  hi = uint32_t(__bfloat16_as_ushort(h0)) | uint32_t(__bfloat16_as_ushort(h1)) << 16;
  lo = uint32_t(__bfloat16_as_ushort(l0)) | uint32_t(__bfloat16_as_ushort(l1)) << 16;
}

// c [16 × 8] += a [16 × 16] · b [16 × 8], bf16 operands, f32 accumulation.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 × 8 bf16 matrices from shared memory (ldmatrix): lane l gives the address of row
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
