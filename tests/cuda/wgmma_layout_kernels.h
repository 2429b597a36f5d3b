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

}  // namespace recur::testing
