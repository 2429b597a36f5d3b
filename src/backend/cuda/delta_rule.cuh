// The gated delta rule's kernel arguments, shared by its recurrent kernels (kernels_gdn.cu)
// and its chunked prompt kernels (kernels_gdn_chunked.cu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "backend/cuda/cuda_internal.cuh"
#include "ops/ops.h"

namespace recur::cuda {

// Which sequences a delta-rule launch handles (kAuto launches both forms).
enum DeltaMode : int { kAllSeqs = 0, kSingleTokenSeqs = 1, kMultiTokenSeqs = 2 };

struct DeltaArgs {
  // q, k [n, Hk, dk]; v [n, Hv, dv]; beta [n, Hv]; g [n, Hv] or, per key channel, [n, Hv, dk]
  // (g_s1 apart, channels contiguous)
  const float *q, *k, *v, *g, *beta;
  int64_t q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, g_s0, g_s1, beta_s0, o_s0, o_s1;
  float* state;  // [slots, Hv, dk, dv]
  float* out;    // [n, Hv, dv]
  int hv, group, dk, dv;
  const int32_t *seq_start, *slot;  // [n_seqs+1] token offsets; [n_seqs] state slots
  int mode;
};

__device__ __forceinline__ bool skip_seq(int mode, int64_t len) {
  return (mode == kSingleTokenSeqs && len != 1) || (mode == kMultiTokenSeqs && len <= 1);
}

// The chunked form's tile of value columns for key dim dk, or 0 when its kernels do not fit in
// max_smem bytes of shared memory.
int chunk_columns(int dk, bool per_channel, size_t max_smem);
// The chunked form over the sequences a.mode selects, chunk records through `scratch`;
// launched(label) after each kernel (the profile's intervals).
template <bool kPerChannel>
void launch_chunked(const DeltaArgs& a, const SeqLayout& layout, void* scratch,
                    size_t scratch_bytes, size_t max_smem, cudaStream_t stream,
                    const std::function<void(const char*)>& launched);

}  // namespace recur::cuda
