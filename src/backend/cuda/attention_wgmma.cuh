// One key tile's scores and softmax weights on a warpgroup, shared by the warpgroup prompt
// attention kernels (kernels_attention_wgmma.cu, GQA; kernels_attention_latent_wgmma.cu,
// latent), which differ in how their tiles are laid out and copied, not in this step.
#pragma once

#include <cstdint>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/mma_16bit.cuh"
#include "backend/cuda/wgmma.cuh"

namespace recur::cuda {

constexpr int kWgmmaTileKeys = 32;  // positions per key tile (wgmma_n32_ss's n)

// The scores S [64 rows × 32 keys] = Σᵢ Qᵢ · Kᵀ over the query's terms i and k_steps steps of 16
// channels (q_desc(i, kk), k_desc(kk): the operands' descriptors), the online softmax over them
// (m, l updated, acc rescaled), and the weights as wgmma's register A-operand terms ap, fenced
// for the value products that follow. sc[j] holds keys [8j, 8j + 8) of rows g and g + 8 (c =
// lane % 4); row_pos: the two rows' positions. Registers written by ordinary instructions are
// pinned before a fence (the compiler must not sink the writes past it) and after a wait.
template <typename M, int NA, typename QDesc, typename KDesc>
__device__ __forceinline__ void wgmma_tile_weights(
    int k_steps, QDesc q_desc, KDesc k_desc, int k0, int c, const int (&row_pos)[2], float (&m)[2],
    float (&l)[2], float (&acc)[NA][4], uint32_t (&ap)[kWgmmaTileKeys / 16][kTermsOf<M>][4]) {
  constexpr int kKeys = kWgmmaTileKeys;
  float sc[kKeys / 8][4];
#pragma unroll
  for (int j = 0; j < kKeys / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
  pin_registers(sc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < k_steps; ++kk) {
    const uint64_t kd = k_desc(kk);
#pragma unroll
    for (int i = kTermsOf<M> - 1; i >= 0; --i) wgmma_n32_ss<M>(sc, q_desc(i, kk), kd, true);
  }
  wgmma_commit();
  wgmma_wait<0>();
  pin_registers(sc);
  float corr[2];
  online_softmax_tile<kKeys / 8, false>(sc, k0, c, row_pos, 0, m, l, corr);
  rescale_rows(acc, corr);
  // P's terms for each 16 keys, the weights times kWeightScaleOf<M> (the caller divides the
  // sums by it).
  weight_terms<M, kKeys>(sc, ap);
  pin_registers(acc);
  pin_registers(ap);
  wgmma_fence();
}

}  // namespace recur::cuda
