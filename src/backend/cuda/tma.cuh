// Copies by the tensor-memory accelerator (TMA) completing on mbarriers, and the tensor map of
// a paged key cache they read (the decode kernel's latent form, kernels_attention_decode_mma.cu).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_internal.cuh"

namespace recur::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// An mbarrier that one arrival (with the bytes it expects) and those bytes complete.
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)));
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}
// Box (c0 positions, c1 channels, c2 kv head, c3 cache block) of a key cache's tensor map into
// dst, completing on bar.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

// Boxes a tile's hd channels are copied in: at most 256 channels each (the accelerator's limit),
// whole 8-channel groups, dividing hd; 0 when none does.
inline int key_boxes_for(int hd) {
  for (int boxes = 1; boxes <= hd / 8; ++boxes) {
    if (hd % boxes == 0 && hd / boxes <= 256 && (hd / boxes) % 8 == 0) return boxes;
  }
  return 0;
}

// The driver's tensor-map encoder (no link to the driver library: the runtime finds it), or
// null where the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                           cudaEnableDefault, &found);
#else
    const cudaError_t e =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it for the next check
      return PFN_cuTensorMapEncodeTiled_v12000{};
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// The key cache [blocks, kv heads, hd, bs] (T elements: 16-bit or bytes) as a tensor map of
// boxes of `positions` positions × hd / key_boxes_for(hd) channels, rows of 32 bytes (16-bit
// elements) with the 32-byte swizzle (16-byte chunk bit 0 ^= address bit 7), into *map; false
// when the driver cannot encode it (the caller then takes another kernel). Maps are kept per
// cache (a layer's cache does not move) and thread (a rank's).
template <typename T>
bool key_tensor_map(const Tensor& k_cache, int positions, CUtensorMap* map) {
  struct Kept {
    const void* data;
    int64_t shape[4], stride[4];
    int positions;
    CUtensorMap map;
  };
  static thread_local std::vector<Kept> kept;
  for (const Kept& k : kept) {
    if (k.data == k_cache.data && k.positions == positions &&
        std::memcmp(k.shape, k_cache.shape, sizeof(k.shape)) == 0 &&
        std::memcmp(k.stride, k_cache.stride, sizeof(k.stride)) == 0) {
      *map = k.map;
      return true;
    }
  }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const int boxes = key_boxes_for(int(k_cache.shape[2]));
  if (boxes == 0) return false;
  Kept k{k_cache.data, {}, {}, positions, {}};
  std::memcpy(k.shape, k_cache.shape, sizeof(k.shape));
  std::memcpy(k.stride, k_cache.stride, sizeof(k.stride));
  constexpr bool k16 = sizeof(T) == 2;
  const cuuint64_t dims[4] = {cuuint64_t(k_cache.shape[3]), cuuint64_t(k_cache.shape[2]),
                              cuuint64_t(k_cache.shape[1]), cuuint64_t(k_cache.shape[0])};
  const cuuint64_t strides[3] = {cuuint64_t(k_cache.stride[2]) * sizeof(T),
                                 cuuint64_t(k_cache.stride[1]) * sizeof(T),
                                 cuuint64_t(k_cache.stride[0]) * sizeof(T)};
  const cuuint32_t box[4] = {cuuint32_t(positions), cuuint32_t(k_cache.shape[2] / boxes), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type =
      !k16 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
           : (std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                        : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16);
  const CUresult r =
      encode(&k.map, type, 4, k_cache.data, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
             k16 ? CU_TENSOR_MAP_SWIZZLE_32B : CU_TENSOR_MAP_SWIZZLE_NONE,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;
  kept.push_back(k);
  *map = k.map;
  return true;
}

}  // namespace recur::cuda
