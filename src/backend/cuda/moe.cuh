// Shared by the MoE kernels: the grouped-GEMM problem description. Rows of the problem are
// (token, expert) pairs sorted by expert; a tile is up to TM consecutive rows of one expert.
#pragma once

#include "backend/cuda/cuda_internal.cuh"

namespace recur::cuda {

struct MoeGemmArgs {
  const void* const* w;   // [E] weights [m, k] per expert, stored dtype
  const void* const* w2;  // [E] second weights for the fused SwiGLU pair (gate, up), or null
  int64_t m, k;           // output columns, reduction length
  const float* x;         // activation rows, ldx apart
  int64_t ldx;
  const int32_t* x_row;  // [pairs] x row of each sorted row, or null for the identity
  float* out;            // [pairs, m], ldo apart; out = silu(x·w)·(x·w2) when w2 is set
  int64_t ldo;
  const int32_t *tile_expert, *tile_row0, *tile_rows;  // [max_tiles]
  const int32_t* n_tiles;                              // [1]
  bool w_aligned;  // every expert's weights start 16-byte aligned
};

// Tensor-core grouped GEMM (moe_wmma.cu): 64×64 output tiles, bf16 (or f16) operands with f32
// accumulation; the activations are split exactly into three terms of the weights' type.
constexpr int kWmmaTileRows = 64;
void launch_moe_wmma(const MoeGemmArgs& a, DType wdtype, bool dual, unsigned max_tiles,
                     cudaStream_t stream);

}  // namespace recur::cuda
