// Hopper warpgroup matrix products (wgmma, sm_90a) on f16 or bf16 operands with f32 accumulation,
// for the prompt attention kernel (kernels_attention_wgmma.cu), the MoE experts' prompt tiles
// (moe_mma.cu) and their layout tests. A warpgroup (4
// consecutive warps) issues each product together; operands in shared memory are described by
// a matrix descriptor, in the layout without swizzling: 8 × 16-byte "core matrices" of 128
// contiguous bytes, placed by two byte strides (PTX ISA, wgmma's canonical layouts): the
// leading one steps k by 8, the other one the rows (A) or columns (B) by 8.
//   K-major (k contiguous, as A below): a core matrix is 8 rows of 8 consecutive k.
//   MN-major (the rows or columns contiguous, as the transposed B below): a core matrix is 8
// consecutive k of 8 consecutive columns each.
// Results land as mma.sync m16n8 fragments: warp w of the group holds rows 16w .. 16w + 15,
// lane l rows l / 4 and l / 4 + 8, d[j] the columns 8j + 2(l % 4) and + 1 (d[j][0..1] the first
// row, d[j][2..3] the second).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace recur::cuda {

// A shared-memory matrix descriptor without swizzling: start address, the byte stride between
// core matrices 8 apart in k (leading) and 8 apart in the rows or columns (stride); multiples of
// 16, the descriptor keeps each over 16.
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, uint32_t leading_bytes,
                                               uint32_t stride_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return uint64_t((addr & 0x3ffffu) >> 4) | uint64_t((leading_bytes >> 4) & 0x3fffu) << 16 |
         uint64_t((stride_bytes >> 4) & 0x3fffu) << 32;
}

// The byte offset of 16-byte chunk c (k 16c/sizeof(element) on) of row r of a K-major operand in
// the layout without swizzling: 8-row groups row_group_bytes apart (the descriptor's stride),
// chunks 128 apart (its leading step), rows of a core matrix 16 apart.
__host__ __device__ constexpr int kmajor_offset(int r, int c, int row_group_bytes) {
  return (r / 8) * row_group_bytes + c * 128 + (r % 8) * 16;
}

// Before a group of products whose accumulators or register operands other instructions wrote.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Until at most kPending committed groups of this warpgroup's products are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared memory written by this thread (stores, cp.async landed) made visible to the products,
// which read it through the async proxy; a barrier then orders it for the other threads.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Keeps the compiler from moving accesses of registers a product reads or writes across the
// fence before it or the wait after it (the hardware uses them asynchronously).
template <int N>
__device__ __forceinline__ void pin_registers(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
#pragma unroll
    for (int u = 0; u < 4; ++u) asm volatile("" : "+f"(d[j][u])::"memory");
  }
}
template <int N, int T>
__device__ __forceinline__ void pin_registers(uint32_t (&a)[N][T][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
#pragma unroll
    for (int i = 0; i < T; ++i) {
#pragma unroll
      for (int u = 0; u < 4; ++u) asm volatile("" : "+r"(a[j][i][u])::"memory");
    }
  }
}

// The instructions, one function a shape, templated on the operand type M (__half or
// __nv_bfloat16): d [64 × N] (+)= A · B, A [64 × 16] in shared memory (ss: K-major) or in
// registers (rs: the warp's 16 rows as an mma.sync m16n8k16 A fragment), B [16 × N] in shared
// memory with its N columns contiguous (MN-major, transposed for the instruction). accumulate =
// false ignores d's values. The asm statements differ by type only in the instruction's name,
// which the RECUR_WGMMA_* macros take as the string TY.
template <typename M>
constexpr bool kWgmmaOperand = std::is_same_v<M, __half> || std::is_same_v<M, __nv_bfloat16>;

#define RECUR_WGMMA_SS32(TY)                                                                      \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "                 \
      "%16, %17, p, 1, 1, 0, 1;\n}\n"                                                             \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])                                \
      : "l"(a), "l"(b), "r"(int(accumulate))                                                      \
      : "memory")
template <typename M>
__device__ __forceinline__ void wgmma_n32_ss(float (&d)[4][4], uint64_t a, uint64_t b,
                                             bool accumulate) {
  static_assert(kWgmmaOperand<M>);
  if constexpr (std::is_same_v<M, __half>) {
    RECUR_WGMMA_SS32("f16");
  } else {
    RECUR_WGMMA_SS32("bf16");
  }
}
#undef RECUR_WGMMA_SS32

#define RECUR_WGMMA_RS64(TY, TRANS_B)                                                             \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                        \
      "{%32, %33, %34, %35}, %36, p, 1, 1, " TRANS_B ";\n}\n"                                     \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
        "+f"(d[7][2]), "+f"(d[7][3])                                                              \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate))                  \
      : "memory")

#define RECUR_WGMMA_RS128(TY, TRANS_B)                                                             \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "    \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, " \
      "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, " \
      "%55, %56, %57, %58, %59, %60, %61, %62, %63}, "                                             \
      "{%64, %65, %66, %67}, %68, p, 1, 1, " TRANS_B ";\n}\n"                                      \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),  \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),  \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),  \
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),  \
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),  \
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),  \
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),                \
        "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]),            \
        "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]),            \
        "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),            \
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]),            \
        "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                                             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate))                   \
      : "memory")

#define RECUR_WGMMA_RS256(TY, TRANS_B)                                                             \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "    \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, " \
      "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, " \
      "%55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, " \
      "%73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, " \
      "%91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, "    \
      "%107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, " \
      "%122, %123, %124, %125, %126, %127}, "                                                      \
      "{%128, %129, %130, %131}, %132, p, 1, 1, " TRANS_B ";\n}\n"                                 \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),  \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),  \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),  \
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),  \
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),  \
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),  \
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),                \
        "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]),            \
        "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]),            \
        "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),            \
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]),            \
        "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]),            \
        "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]),            \
        "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]),            \
        "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]),            \
        "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]),            \
        "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]),            \
        "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]),            \
        "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]),            \
        "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]),            \
        "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]),            \
        "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]),            \
        "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]),            \
        "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]),            \
        "+f"(d[31][2]), "+f"(d[31][3])                                                             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate))                   \
      : "memory")

// d (+)= A · B for N output columns (64, 128 or 256), A in registers, operands of type M.
template <typename M, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b,
                                         bool accumulate) {
  static_assert(kWgmmaOperand<M>);
  static_assert(N == 64 || N == 128 || N == 256, "the widths instantiated");
  constexpr bool kF16 = std::is_same_v<M, __half>;
  if constexpr (N == 64 && kF16) {
    RECUR_WGMMA_RS64("f16", "1");
  } else if constexpr (N == 64) {
    RECUR_WGMMA_RS64("bf16", "1");
  } else if constexpr (N == 128 && kF16) {
    RECUR_WGMMA_RS128("f16", "1");
  } else if constexpr (N == 128) {
    RECUR_WGMMA_RS128("bf16", "1");
  } else if constexpr (kF16) {
    RECUR_WGMMA_RS256("f16", "1");
  } else {
    RECUR_WGMMA_RS256("bf16", "1");
  }
}

// d (+)= A · B for N output columns (128 or 256), A in registers, B [16 × N] in shared memory
// K-major (each column's 16 k contiguous in two core matrices), f16 operands: latent attention's
// values, which are its keys' channels with the positions (k) contiguous.
template <int N>
__device__ __forceinline__ void wgmma_rs_kmajor_f16(float (&d)[N / 8][4], const uint32_t (&a)[4],
                                                    uint64_t b, bool accumulate) {
  static_assert(N == 128 || N == 256, "the widths instantiated");
  if constexpr (N == 128) {
    RECUR_WGMMA_RS128("f16", "0");
  } else {
    RECUR_WGMMA_RS256("f16", "0");
  }
}

// d (+)= A · B for 64 output columns, A in registers, B [16 × 64] in shared memory K-major (each
// column's 16 k contiguous in two core matrices: B's columns stored as rows, as a token's
// activations lie), f16 operands.
__device__ __forceinline__ void wgmma_rs64_kmajor_f16(float (&d)[8][4], const uint32_t (&a)[4],
                                                      uint64_t b, bool accumulate) {
  RECUR_WGMMA_RS64("f16", "0");
}
#undef RECUR_WGMMA_RS64
#undef RECUR_WGMMA_RS128
#undef RECUR_WGMMA_RS256

}  // namespace recur::cuda
