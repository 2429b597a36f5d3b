// The operands of attention over the paged cache (kernels_attention.cu), its decode kernel
// (kernels_attention_decode.cu) and its tensor-core prompt kernel (kernels_attention_mma.cu),
// to which the dispatch sends forwards too long for the decode kernel; the cache's element
// types and the result stores they share.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/cuda_internal.cuh"
#include "ops/ops.h"

namespace recur {
namespace cuda {

struct AttnArgs {
  const float* q;  // [n, heads, hd]
  int64_t q_s0, q_s1;
  // The caches hold elements of a cache type (cache_to_f32); strides count elements.
  const void* kc;  // [blocks, kv_heads, hd, bs]
  int64_t kc_s0, kc_s1, kc_s2;
  const void* vc;  // [blocks, kv_heads, bs, dv]
  int64_t vc_s0, vc_s1, vc_s2;
  int64_t vc_sd;  // value channel stride: 1, or the key cache's when values are keys' channels
  float* out;     // [n, heads, dv]
  int64_t o_s0, o_s1;
  const float* gate;  // [n, heads·dv] rows g_s0 apart, or null: out = attention · σ(gate)
  int64_t g_s0;
  float* part_o;   // [n, heads, n_splits, dv] unnormalised sums (n_splits > 1)
  float* part_ml;  // [n, heads, n_splits, 2] running max and denominator
  // [n_seqs+1] token offsets; [n] positions; [n_seqs+1] offsets into block_ids; [Σ blocks]
  const int32_t *seq_start, *positions, *block_start, *block_ids;
  int n_seqs, heads, group, hd, dv, bs, n_splits;
  // A token's context splits are cut from its own context (so the grid, and a captured graph,
  // need not know its length): ⌈n_ctx / n_splits⌉ positions rounded up to split_align, at
  // least split_min; splits past the context are empty.
  int split_align, split_min;
  float scale;
};

// Positions per context split of a token with n_ctx positions (AttnArgs::split_align).
__device__ __forceinline__ int split_span(const AttnArgs& a, int n_ctx) {
  const int even = (n_ctx + a.n_splits - 1) / a.n_splits;
  return max((even + a.split_align - 1) / a.split_align * a.split_align, a.split_min);
}
// The splits that hold positions of a token with n_ctx positions: the others are empty.
__device__ __forceinline__ int used_splits(const AttnArgs& a, int n_ctx) {
  const int span = split_span(a, n_ctx);
  return min(a.n_splits, (n_ctx + span - 1) / span);
}

// Cache element types: float (F32), the bits of BF16 (uint16_t), __half (F16) and the bits of
// F8_E4M3 (uint8_t).
__device__ __forceinline__ float cache_to_f32(float x) {
  return x;
}
__device__ __forceinline__ float cache_to_f32(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float cache_to_f32(uint16_t x) {
  return __uint_as_float(uint32_t(x) << 16);
}
__device__ __forceinline__ float cache_to_f32(uint8_t x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(x), __NV_E4M3)));
}
// x rounded to the cache type, to nearest even (f16 saturating at ±65504, e4m3 at ±448; NaN
// stays NaN, f16's with the CPU's bits), as the CPU rounds.
template <typename T>
__device__ __forceinline__ T cache_from_f32(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else if constexpr (std::is_same_v<T, __half>) {
    if (x != x) return __ushort_as_half(uint16_t(((__float_as_uint(x) >> 16) & 0x8000u) | 0x7e00u));
    return __float2half_rn(fabsf(x) > 65504.0f ? copysignf(65504.0f, x) : x);
  } else {
    return T(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
  }
}
// A cache element as f32, through L2 only when l2 (it may have been written by the kernel
// before, still running under programmatic launch: see paged_attention_decode_kernel).
template <typename T>
__device__ __forceinline__ float load_cache(const T* p, bool l2 = false) {
  return cache_to_f32(l2 ? __ldcg(p) : *p);
}

// 4 e4m3 elements → 4 f16 (exact: e4m3's values all lie in f16).
__device__ __forceinline__ void widen4(const uint8_t* src, __half* dst) {
  const uint32_t u = *reinterpret_cast<const uint32_t*>(src);
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(u & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(u >> 16), __NV_E4M3);
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(uint32_t(lo.x) | uint32_t(lo.y) << 16, uint32_t(hi.x) | uint32_t(hi.y) << 16);
}

// 8 e4m3 values (the bytes of v, low first) as 8 f16, exactly.
__device__ __forceinline__ uint4 widen8(uint2 v) {
  auto pair = [](uint32_t bits) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(bits), __NV_E4M3);
    return uint32_t(h.x) | uint32_t(h.y) << 16;
  };
  return make_uint4(pair(v.x & 0xffffu), pair(v.x >> 16), pair(v.y & 0xffffu), pair(v.y >> 16));
}

// fn(T{}) for the cache element type of `dt` (F32, BF16, F16 or F8_E4M3).
template <typename Fn>
void dispatch_cache(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::F32:
      fn(float{});
      break;
    case DType::BF16:
      fn(uint16_t{});
      break;
    case DType::F16:
      fn(__half{});
      break;
    case DType::F8_E4M3:
      fn(uint8_t{});
      break;
    default:
      fatal("attention cache dtype must be F32, BF16, F16 or F8_E4M3");
  }
}

// 4 consecutive cache elements (4-element aligned) of a 16-bit or FP8 cache as floats.
template <typename T>
__device__ __forceinline__ float4 load4_f32(const T* src) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    const uint2 u = *reinterpret_cast<const uint2*>(src);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
  } else if constexpr (std::is_same_v<T, __half>) {
    const uint2 u = *reinterpret_cast<const uint2*>(src);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  } else {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(src);
    return make_float4(cache_to_f32(uint8_t(u)), cache_to_f32(uint8_t(u >> 8)),
                       cache_to_f32(uint8_t(u >> 16)), cache_to_f32(uint8_t(u >> 24)));
  }
}

// 4 consecutive cache elements (4-element aligned) → 4 floats in shared memory: a cp.async of
// 16 bytes for f32; else one load of 8 (BF16, F16) or 4 (F8_E4M3) bytes, widened and stored now.
template <typename T>
__device__ __forceinline__ void copy4(float* dst, const T* src, bool valid) {
  if constexpr (std::is_same_v<T, float>) {
    copy16_async(dst, src, valid);
  } else {
    *reinterpret_cast<float4*>(dst) = valid ? load4_f32(src) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// As copy4 with the first n (0 to 4) elements copied and the rest zeros: a chunk holding a
// context's last position, whose later elements may be anything (NaN included).
template <typename T>
__device__ __forceinline__ void copy4_first(float* dst, const T* src, int n) {
  if constexpr (std::is_same_v<T, float>) {
    copy16_async_bytes(dst, src, 4 * n);
  } else {
    float4 f = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (n > 0) f = load4_f32(src);
    if (n < 2) f.y = 0.0f;
    if (n < 3) f.z = 0.0f;
    if (n < 4) f.w = 0.0f;
    *reinterpret_cast<float4*>(dst) = f;
  }
}

// 2^x on the special-function unit (ex2.approx.ftz: about 2^-22 relative, subnormal results
// flushed to zero, 2^-inf = 0): exp2f adds range fixes around the same instruction for
// subnormal results, which weights at most 1 summed in f32 do not need.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The online softmax of a warp's two fragment rows (g, i = 0, and g + 8, i = 1, of its 16)
// over one tile of scores in log2 units, sc [NJ n-tiles of 8 keys][4] (element 2i + h of
// n-tile j: key k0 + 8j + 2c + h): keys past the row's position (and with kKeyEnd, from
// key_end on) are masked; sc becomes the weights 2^(s − m), m and l (this lane's part of the
// quad's sum) move on, and corr holds each row's factor for its earlier sums.
template <int NJ, bool kKeyEnd>
__device__ __forceinline__ void online_softmax_tile(float (&sc)[NJ][4], int k0, int c,
                                                    const int (&row_pos)[2], int key_end,
                                                    float (&m)[2], float (&l)[2],
                                                    float (&corr)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    // Only a tile reaching past the row's position has keys to mask (most tiles of a long
    // prompt lie wholly before it).
    if (kKeyEnd || k0 + 8 * NJ - 1 > row_pos[i]) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = k0 + 8 * j + 2 * c + h;
          if (key > row_pos[i] || (kKeyEnd && key >= key_end)) sc[j][2 * i + h] = -INFINITY;
        }
      }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < NJ; ++j) mx = fmaxf(mx, fmaxf(sc[j][2 * i], sc[j][2 * i + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[i], mx);
    // A row with nothing unmasked yet keeps weight 0 everywhere (m_new = -inf).
    corr[i] = m_new == -INFINITY ? 1.0f : exp2_ftz(m[i] - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& v = sc[j][2 * i + h];
        v = m_new == -INFINITY ? 0.0f : exp2_ftz(v - m_new);
        sum += v;
      }
    }
    l[i] = l[i] * corr[i] + sum;
    m[i] = m_new;
  }
}

// A warp's accumulators of rows g (corr[0]) and g + 8 (corr[1]) times their online-softmax
// factors, skipped when no row of the warp moved its maximum (every factor exactly 1, as in most
// tiles of a long context). Warp-uniform, as online_softmax_tile.
template <int NJ>
__device__ __forceinline__ void rescale_rows(float (&acc)[NJ][4], const float (&corr)[2]) {
  if (__all_sync(0xffffffffu, corr[0] == 1.0f && corr[1] == 1.0f)) return;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    acc[j][0] *= corr[0], acc[j][1] *= corr[0];
    acc[j][2] *= corr[1], acc[j][3] *= corr[1];
  }
}

// A prompt kernel block's tokens: tile `tile` of the tiles of tokens_per_tile tokens, those of
// sequence s following those of s − 1. s is a.n_seqs past the last tile.
struct RowTile {
  int s = 0, t0 = 0, t_end = 0;    // sequence, tokens [t0, t_end)
  int n_rows = 0;                  // (token, query head of the group) rows
  const int32_t* table = nullptr;  // the sequence's cache blocks
};
__device__ __forceinline__ RowTile find_row_tile(const AttnArgs& a, int tokens_per_tile, int tile) {
  RowTile r;
  for (; r.s < a.n_seqs; ++r.s) {
    const int len = a.seq_start[r.s + 1] - a.seq_start[r.s];
    const int n_tiles = (len + tokens_per_tile - 1) / tokens_per_tile;
    if (tile < n_tiles) {
      r.t0 = a.seq_start[r.s] + tile * tokens_per_tile;
      r.t_end = min(a.seq_start[r.s + 1], r.t0 + tokens_per_tile);
      r.n_rows = (r.t_end - r.t0) * a.group;
      r.table = a.block_ids + a.block_start[r.s];
      break;
    }
    tile -= n_tiles;
  }
  return r;
}

// The prompt kernels' row tile and kv head of this block (grid: row tiles × kv heads). Blocks
// start in order of their linear index, which is dealt out longest first: the last row tiles
// (which walk the most keys: a causal prompt's work grows along it) with every kv head of each,
// the short ones filling in behind, so no long tile starts last (H100, 80B-A3B cut to 6 layers:
// a 2,048-token forward's attention 509 -> 342 µs; bench/results/h100-session44-call4.txt).
__device__ __forceinline__ void prompt_tile_and_head(int& tile, int& kvh) {
  const int lin = int(blockIdx.x + blockIdx.y * gridDim.x);
  kvh = lin % int(gridDim.y);
  tile = int(gridDim.x) - 1 - lin / int(gridDim.y);
}

// Positions of a thread's two fragment rows r0 and r0 + 8 of the tile (-1: no row; it stays
// masked and is not stored).
__device__ __forceinline__ void fragment_row_positions(const AttnArgs& a, const RowTile& rt, int r0,
                                                       int (&row_pos)[2]) {
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i;
    row_pos[i] = r < rt.n_rows ? a.positions[rt.t0 + r / a.group] : -1;
  }
}

// The last key any row of the block's tokens [t0, t_end) attends to, and (-1 if none) any of
// the warp's rows [m0, m0 + 16), a row being (token, query head of the group).
__device__ __forceinline__ void last_keys(const AttnArgs& a, int t0, int t_end, int m0,
                                          int& max_pos, int& warp_max_pos) {
  warp_max_pos = -1, max_pos = -1;
  for (int t = t0; t < t_end; ++t) {
    const int pos = a.positions[t];
    max_pos = max(max_pos, pos);
    if ((t - t0 + 1) * a.group > m0 && (t - t0) * a.group < m0 + 16) {
      warp_max_pos = max(warp_max_pos, pos);
    }
  }
}

// Each row's denominator, the sum of its quad's parts.
__device__ __forceinline__ void quad_sums(float (&l)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
}

// The normalised outputs of a warp's rows m0 + g and m0 + g + 8 (row r: token t0 + r / group,
// head of kv head kvh) from its accumulators over value channels [v0 + 8j, v0 + 8j + 8) and the
// rows' denominators l (quad_sums done), times σ(gate) when gated; rows from n_rows on and
// channels from v_end (a.dv when negative) on are not stored.
template <int NJ>
__device__ __forceinline__ void store_rows(const AttnArgs& a, const float (&acc)[NJ][4],
                                           const float (&l)[2], int m0, int g, int c, int n_rows,
                                           int t0, int kvh, int v0 = 0, int v_end = -1) {
  const int group = a.group, dv = a.dv;
  if (v_end < 0) v_end = dv;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = m0 + g + 8 * i;
    if (r >= n_rows) continue;
    const int t = t0 + r / group, h = kvh * group + r % group;
    float* out = a.out + int64_t(t) * a.o_s0 + int64_t(h) * a.o_s1;
    const float* gate = a.gate ? a.gate + int64_t(t) * a.g_s0 + int64_t(h) * dv : nullptr;
    const float inv = 1.0f / l[i];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      if (v0 + 8 * j < v_end) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int d = v0 + 8 * j + 2 * c + hh;
          float v = acc[j][2 * i + hh] * inv;
          if (gate) v *= sigmoid(gate[d]);
          out[d] = v;
        }
      }
    }
  }
}

// An empty split's partial result: no weight in the merge, which then skips its sums.
__device__ __forceinline__ void mark_empty_split(const AttnArgs& a, int t, int kvh, int sp) {
  for (int g = threadIdx.x; g < a.group; g += blockDim.x) {
    const int64_t slot = (int64_t(t) * a.heads + kvh * a.group + g) * a.n_splits + sp;
    a.part_ml[slot * 2] = -INFINITY;
    a.part_ml[slot * 2 + 1] = 0.0f;
  }
}

// The final output of (token t, head h, value channel d): v, times σ(gate) when gated (the
// product mul_sigmoid makes). dv: a.dv, passed by the caller (which may know it equals hd).
__device__ __forceinline__ void store_out(const AttnArgs& a, int t, int h, int d, float v, int dv) {
  if (a.gate) v *= sigmoid(a.gate[int64_t(t) * a.g_s0 + int64_t(h) * dv + d]);
  a.out[int64_t(t) * a.o_s0 + int64_t(h) * a.o_s1 + d] = v;
}

// Writes a (token, head) result: the normalised output, or the split's partial sums.
__device__ __forceinline__ void store_result(const AttnArgs& a, int t, int h, int sp, int d,
                                             float o, float m, float l, int dv) {
  if (a.n_splits == 1) {
    store_out(a, t, h, d, o / l, dv);
  } else {
    const int64_t slot = (int64_t(t) * a.heads + h) * a.n_splits + sp;
    a.part_o[slot * dv + d] = o;
    if (d == 0) {
      a.part_ml[slot * 2] = m;
      a.part_ml[slot * 2 + 1] = l;
    }
  }
}

// The decode kernel (kernels_attention_decode.cu): forwards of at most kDecodeMaxTokens tokens
// whose heads it takes (decode_kernel_fits); grid (n_tokens, kv_heads, n_splits).
constexpr int kDecodeMaxTokens = 64;
bool decode_kernel_fits(int group, int hd, int dv);
void launch_attention_decode(const AttnArgs& a, DType cache, dim3 grid, cudaStream_t stream);

// paged_attention of few tokens (decode) on tensor cores over a BF16, F16 or F8_E4M3 cache
// (kernels_attention_decode_mma.cu), the context split between blocks and merged by the
// combine; max_ctx: the longest context the splits must cover. False, having done nothing,
// when the kernel does not take these heads (a query group of at most 16 heads, hd and dv
// multiples of 64 up to 256) or caches (BF16, F16 or F8_E4M3 in blocks of a multiple of 16
// positions, 16-byte aligned, channels contiguous).
bool attention_decode_mma(CudaOps::Impl& s, AttnArgs a, const Tensor& k_cache,
                          const Tensor& v_cache, const SeqLayout& layout, int kv_heads,
                          int max_ctx);

// The same kernel for latent attention's cache (values the keys' first dv channels, v_cache a
// view of k_cache; each tile copied once and read by both products), called by
// latent_attention_mma: few tokens, 8 query heads a block, hd and dv multiples of 16 with
// dv ≤ hd, hd ≤ 576 and dv ≤ 512, BF16, F16 or F8_E4M3 caches as above (key channels'
// positions contiguous), copied by TMA (hd in boxes of at most 256 channels, key_boxes_for; a
// driver that encodes the cache's tensor map). False, having done nothing, otherwise.
bool latent_decode_mma(CudaOps::Impl& s, AttnArgs a, const Tensor& k_cache, const SeqLayout& layout,
                       int kv_heads, int max_ctx);

// Query rows (token, query head) per block of the prompt kernels.
constexpr int kPromptRows = 64;

// Copies of tiles of kKeys positions of the keys and (with values) the values, as chunks of kVec
// elements, zeros past `last`: key_copy(d, p, src, valid) for positions p .. p + kVec − 1 of
// channel d (one cache block: bs is a multiple of kVec; whole chunks past `last` are zeros, the
// rest of a chunk that `last` ends inside is read as it lies, for the causal mask to drop),
// value_copy(p, d, src, valid) for channels d .. d + kVec − 1 of position p, split among kThreads
// threads. A thread's share is worked out when the copier is made (divisions by the runtime value
// size; a kernel keeps it across its walk, or makes it each tile where that measured faster), and
// each tile lane j of each warp finds where position k0 + j lies in each cache for the others to
// shuffle from: a lookup per copy would be a dependent load before each. Before, the per-tile
// divisions and the copy loops took ~40% of the 16-bit prompt kernel's instructions (H200 profile,
// bench/results/h200-session28-notes.md). The value copies shuffle in their loop, so their trip
// count must be warp-uniform (dv · kKeys / kVec kThreads-strided elements a multiple of 32).
template <int kKeys, int kThreads, int kVec>
struct TileCopier {
  static_assert(kKeys <= 32, "a lane per position");
  static_assert(kKeys % kVec == 0 && kThreads % (kKeys / kVec) == 0, "a thread keeps its chunk");
  static constexpr int kChunks = kKeys / kVec;         // key chunks of a channel
  static constexpr int kKeyRows = kThreads / kChunks;  // channels one pass copies
  int key_p, key_d;  // this thread's key chunk (positions key_p ..) and first channel
  int val_p, val_d;  // its first value chunk: position, first channel
  int val_p_step;    // positions between its value chunks; 0: chunks of a row span threads

  __device__ explicit TileCopier(const AttnArgs& a) {
    key_p = kVec * (int(threadIdx.x) % kChunks), key_d = int(threadIdx.x) / kChunks;
    const int row_chunks = a.dv / kVec;
    val_p = int(threadIdx.x) / row_chunks, val_d = kVec * (int(threadIdx.x) % row_chunks);
    val_p_step = kThreads % row_chunks == 0 ? kThreads / row_chunks : 0;
  }

  template <typename T, typename KeyCopy, typename ValueCopy>
  __device__ __forceinline__ void copy(const AttnArgs& a, const int32_t* table, int kvh, int k0,
                                       int last, bool values, KeyCopy&& key_copy,
                                       ValueCopy&& value_copy) const {
    const int lane = threadIdx.x % 32;
    const T* kc = static_cast<const T*>(a.kc) + kvh * a.kc_s1;
    const T* vc = static_cast<const T*>(a.vc) + kvh * a.vc_s1;
    int64_t k_pos = 0, v_pos = 0;  // lane j: position k0 + j's first element in each cache
    if (lane < kKeys && k0 + lane <= last) {
      const int pos = k0 + lane, block_index = pos / a.bs, in_block = pos - block_index * a.bs;
      const int64_t block = table[block_index];
      k_pos = block * a.kc_s0 + in_block;
      v_pos = block * a.vc_s0 + int64_t(in_block) * a.vc_s2;
    }
    {
      const int64_t chunk = __shfl_sync(0xffffffffu, k_pos, key_p);
      const bool valid = k0 + key_p <= last;
      const T* src = valid ? kc + chunk + int64_t(key_d) * a.kc_s2 : kc;
      const int64_t step = valid ? int64_t(kKeyRows) * a.kc_s2 : 0;
#pragma unroll 4
      for (int d = key_d; d < a.hd; d += kKeyRows, src += step) key_copy(d, key_p, src, valid);
    }
    if (!values) return;
    if (val_p_step != 0) {  // a thread keeps its channels and steps positions
      const T* src = vc + val_d;
#pragma unroll 4
      for (int p = val_p; p < kKeys; p += val_p_step) {
        const int64_t chunk = __shfl_sync(0xffffffffu, v_pos, p);
        const bool valid = k0 + p <= last;
        value_copy(p, val_d, valid ? src + chunk : vc, valid);
      }
      return;
    }
    // Element e = p · row_chunks + d / kVec, walked by kThreads without a division per element.
    const int row_chunks = a.dv / kVec, p_step = kThreads / row_chunks;
    const int d_step = kVec * (kThreads % row_chunks);
    int p = val_p, d = val_d;
#pragma unroll 2
    for (int e = threadIdx.x; e < kKeys * row_chunks; e += kThreads) {
      const int64_t chunk = __shfl_sync(0xffffffffu, v_pos, p);
      const bool valid = k0 + p <= last;
      value_copy(p, d, valid ? vc + chunk + d : vc, valid);
      p += p_step, d += d_step;
      if (d >= a.dv) d -= a.dv, ++p;
    }
  }
};

// Launches kKernel (an attention kernel) with smem bytes of dynamic shared memory, opted in.
template <auto kKernel>
void launch_opted_in(dim3 grid, int threads, size_t smem, cudaStream_t stream, const AttnArgs& a) {
  opt_in_smem<kKernel>(smem);
  launch_kernel(kKernel, grid, threads, smem, stream, a);
}

// Splits each of a's n tokens' contexts for the kernels that split them (decode), and points
// a's partial results into the buffer: `want` splits a token (enough blocks for the GPU), no
// more than ⌈max_ctx / min_split⌉ nor than the buffer holds, at least one; each split
// ⌈n_ctx / n_splits⌉ positions rounded up to `align`, at least min_split (AttnArgs).
void set_context_splits(CudaOps::Impl& s, AttnArgs& a, int n, int64_t want, int max_ctx,
                        int min_split, int align);

// The prompt kernel for BF16, F16 and F8_E4M3 caches (kernels_attention_16bit.cu): grid (row tiles
// of kPromptRows rows, kv heads), as paged_attention_mma's; its most shared memory for these
// heads. wide_copies: the caches are 2-byte elements laid out for 16-byte copies (8-element
// aligned, strides and bs multiples of 8).
size_t attention_16bit_smem_bytes(int hd, int dv);
void launch_attention_16bit(const AttnArgs& a, DType cache, bool wide_copies, dim3 grid,
                            cudaStream_t stream);

// The prompt kernel for BF16, F16 and F8_E4M3 caches on Hopper's warpgroup products
// (kernels_attention_wgmma.cu): grid (row tiles of attention_wgmma_rows(cache) rows, kv heads);
// whether it takes this cache and these heads (hd = dv, 64, 128 or 256) within max_smem bytes of
// shared memory. 16-bit caches must allow 16-byte copies (wide_copies).
int attention_wgmma_rows(DType cache);
size_t attention_wgmma_smem_bytes(DType cache, int hd, int dv);
bool attention_wgmma_takes(DType cache, bool wide_copies, int group, int hd, int dv,
                           size_t max_smem);
void launch_attention_wgmma(const AttnArgs& a, DType cache, dim3 grid, cudaStream_t stream);

// paged_attention of every token of the layout, as `a` describes it (its split fields unused),
// on tensor cores, when the kernels take these heads (hd a multiple of 16, dv of 8, both ≤ 256,
// a query group of at most 64 heads) and caches (blocks of a multiple of 4 positions, 4-element
// aligned with strides in multiples of 4 elements, channels contiguous); false, having done
// nothing, otherwise. The caches hold F32 (the TF32 kernel), BF16, F16 or F8_E4M3 (the 16-bit one).
bool paged_attention_mma(CudaOps::Impl& s, const AttnArgs& a, const Tensor& k_cache,
                         const Tensor& v_cache, const SeqLayout& layout, int kv_heads);

// paged_attention of every token of the layout on tensor cores when the values are the keys'
// first dv channels (latent attention: v_cache a view of k_cache), for prompts and decode: a
// block of query rows per key tile, the context split between blocks for few tokens (merged by
// the combine; max_ctx: the longest context the splits must cover). False, having done
// nothing, when the kernel does not take these heads (hd and dv multiples of 64 and 32, dv ≤
// min(hd, 512), a query group of at most 32 heads, queries 16-byte aligned) or caches. Few
// tokens over a 16-bit or FP8 cache go to latent_decode_mma instead, more over an F16 or FP8
// cache on a Hopper to latent_prompt_wgmma (an experiment).
bool latent_attention_mma(CudaOps::Impl& s, AttnArgs a, const Tensor& k_cache,
                          const Tensor& v_cache, const SeqLayout& layout, int kv_heads,
                          int max_ctx);

// latent_attention_mma's prompts (more tokens than the decode kernels take) on Hopper's
// warpgroup products (kernels_attention_latent_wgmma.cu): Kimi-Linear's heads (hd 576, dv 512,
// a query group of at most 64 heads; latent_attention_mma takes at most 32) over an F16 cache laid
// out for 16-byte copies or an F8_E4M3 one (4-element copies, checked by the caller), on sm_90a.
// False, having done nothing, otherwise.
bool latent_prompt_wgmma(CudaOps::Impl& s, const AttnArgs& a, const Tensor& k_cache,
                         const SeqLayout& layout, int kv_heads);

// Merges the context splits of a's partial results (a.n_splits > 1) into a.out: one launch.
void launch_attention_combine(CudaOps::Impl& s, const AttnArgs& a, int n_tokens);

// The row tiles of tokens_per_tile tokens of each sequence (a prompt kernel's grid.x), and,
// when positions is given, the keys they read added to it: each tile its last token's context.
int64_t prompt_row_tiles(const SeqLayout& layout, int tokens_per_tile, double* positions = nullptr);

// Multiply-adds of causal attention over the layout's tokens (scores and values, 2 flops
// each), for the profile.
double attention_flops(const SeqLayout& layout, int64_t heads, int64_t hd, int64_t dv);

}  // namespace cuda
}  // namespace recur
