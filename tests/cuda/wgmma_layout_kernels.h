// A warpgroup product through backend/cuda/wgmma.cuh (wgmma_layout_kernels.cu).
#pragma once

#include <cstdint>

namespace recur::testing {

// d [64 × n] = a [64 × 16] · b [16 × n] (f16 bits, or bf16 bits with bf16; row-major) on one
// warpgroup: n 32 with A in shared memory, or n 64, 128 or 256 with A in registers
// (registers_a); B placed MN-major with 8-row (k) groups 128 bytes apart and 8-column groups 256
// apart, its descriptor given b_leading (the k step) and b_stride. False on a CUDA error or
// another n.
bool wgmma_layout_product(const uint16_t* a, const uint16_t* b, int n, bool registers_a, bool bf16,
                          uint32_t b_leading, uint32_t b_stride, float* d);

// d [64 × 64] = a [64 × 32] · b [32 × 64] (f16 bits, row-major) on one warpgroup, A in registers,
// B K-major as the MoE experts' kernel stages a token's activations (moe_mma.cu): column n, k at
// (n/8)·512 + (k/8)·128 + (n%8)·16 + (k%8)·2, two products of 16 k each. False on a CUDA error.
bool wgmma_kmajor_product(const uint16_t* a, const uint16_t* b, float* d);

}  // namespace recur::testing
