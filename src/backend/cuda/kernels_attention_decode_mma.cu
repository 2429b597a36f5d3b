// Decode attention on tensor cores over a BF16, F16 or F8_E4M3 cache (forwards of few tokens, query
// groups of up to 16 heads, head sizes multiples of 64 up to 256): the kernel that keeps a long
// context's step bound by the bytes of its cache rather than by the work per cached element.
//
// A block takes one (token, kv head, context split) and walks the split in tiles of 16
// positions, a tile being one ring stage of three copied by cp.async (TMA for the latent form
// below; two in flight while one is multiplied), so each multiprocessor keeps several tiles of its
// blocks in flight. The group's query heads are the n of both products, in tiles of 8, so no
// product row is padding at groups of 8 and 16: the scores are S^T [16 positions × 8 heads] = K [16
// × hd] · Q^T, the keys read from the stage by ldmatrix with transposition (the cache holds them
// channels by positions), and the output is O^T [dv × 8 heads] += V^T [dv × 16] · P^T, the values
// read transposed the same way and the weights P^T made from the score fragments by movmatrix. The
// four warps split the channels: each sums the scores over a quarter of the key channels, the
// quarters add up in shared memory in one order (every warp then holds the same sums, so the same
// weights), and each accumulates a quarter of the value channels. Queries and weights are f32 split
// into terms of the cache's 16-bit type (mma_16bit.cuh: three bf16 or two f16); the cache's
// elements are exactly bf16 or f16 (e4m3 widens exactly, into an f16 plane per tile): f32's
// accuracy.
//
// Its latent form (latent_decode_mma) serves latent attention's cache, whose values are the
// keys' first dv channels (Kimi-Linear: 32 heads of 576 / 512 over one latent): a stage holds
// the keys only, the values' operand is read from it without transposition, eight warps split
// the wider channels, and a block takes 8 of the group's heads. Its tiles are copied by the
// tensor-memory accelerator: one thread issues a tile's boxes on the stage's mbarrier, and the
// positions past a split's end in its last tile are zeroed after they land. Per-thread cp.async
// were a third of the form's instructions (ncu at a 32k context, H100, session 46); with TMA a
// 131k-context step of Kimi-Linear cut to 8 layers took ~5% less, a 2k one ~0.3% more. Only a
// split's last tile is zeroed, and its stage is not refilled: no proxy fence is needed.
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/mma_16bit.cuh"
#include "backend/cuda/tma.cuh"

namespace recur {
namespace cuda {

namespace {

constexpr int kTile = 16;  // positions per tile (and per ring stage)
// Ring stages: kStages − 1 tiles in flight. Three took a 131,072-token context's step 5 µs
// below four on the H200, as two did (session 21): at Qwen3-Next's heads an SM then holds four
// blocks instead of three.
constexpr int kStages = 3;
constexpr float kLn2 = 0.6931471805599453f;

// What an instance of the kernel takes: kWarps warps split the channels; up to 8 kHeadTiles
// query heads a block, head sizes up to kMaxHd (keys) and kMaxDv (values); kLatent: the values
// are the keys' first dv channels (latent attention's cache), so a stage holds keys only and
// both products read it. A split holds at least kMinTiles tiles.
template <int kWarpsOf, int kHeadTilesOf, int kMaxHdOf, int kMaxDvOf, bool kLatentOf,
          int kMinTilesOf>
struct DecodeShape {
  static constexpr int kWarps = kWarpsOf, kThreads = 32 * kWarpsOf;
  static constexpr int kHeadTiles = kHeadTilesOf, kMaxHd = kMaxHdOf, kMaxDv = kMaxDvOf;
  static constexpr bool kLatent = kLatentOf;
  static constexpr int kMinSplit = kMinTilesOf * kTile;
  // A warp's 16-channel steps of the keys and of the values.
  static constexpr int kKeySteps = (kMaxHd / 16 + kWarps - 1) / kWarps;
  static constexpr int kValueSteps = (kMaxDv / 16 + kWarps - 1) / kWarps;
};
// Grouped-query attention (Qwen3-Next, Qwen3.5): groups of up to 16, heads of up to 256. A
// split holds at least two tiles: at short contexts one-tile splits gave the merge twice the
// partial results for no faster step (H200, session 21).
using GroupedShape = DecodeShape<4, 2, 256, 256, false, 2>;
// Latent attention (Kimi-Linear: 32 heads of 576 over one latent, values its first 512): eight
// warps and 8 heads a block, a group's heads split between blocks. Its 32 heads in one block
// took 45 µs at a 300-position context, 8 took 11.6 (H100, ncu, session 43): a block runs its
// long body about twice there, waiting on instruction fetch, and a quarter of it is quicker.
using LatentShape = DecodeShape<8, 1, 576, 512, true, 2>;
// The kernel's key tensor map: the latent form's TMA copies read one; the others copy by
// cp.async and take an empty stand-in (no 128-byte map among each launch's parameters).
struct NoKeyMap {};
template <typename S>
using KeyMapOf = std::conditional_t<S::kLatent, CUtensorMap, NoKeyMap>;

// A tile as ldmatrix reads it (16-bit): keys [hd][kTile] as the cache holds them (channels by
// positions), the two 16-byte halves of channel d's row swapped when d / 4 is odd; values
// [kTile][dv], 16-byte chunk j of position p's row at j ^ (p % 8). Either way the 8 rows one
// ldmatrix reads lie in distinct banks. A BF16 or F16 stage is this plane; an F8_E4M3 stage holds
// the tile as copied (keys [hd][kTile], values [kTile][dv] bytes), widened into one such plane.
__host__ __device__ constexpr int tile_elems(int hd, int dv, bool latent) {
  return (latent ? hd : hd + dv) * kTile;
}
// The latent form's TMA boxes write this layout (their 32-byte swizzle) at 256-byte aligned stages.
__device__ __forceinline__ int key_offset(int d, int half) {
  return d * kTile + 8 * (half ^ ((d >> 2) & 1));
}
__device__ __forceinline__ int value_offset(int p, int chunk, int dv) {
  return p * dv + 8 * (chunk ^ (p % 8));
}

// Shared memory: the ring of stages (T), the widened plane (F8_E4M3 only), then the warps'
// partial scores [kWarps][kHeadTiles][32 lanes] (float4).
template <typename S>
size_t decode_mma_smem_bytes(int hd, int dv, int elem_bytes) {
  const size_t tile = tile_elems(hd, dv, S::kLatent);
  const size_t plane = elem_bytes == 2 ? 0 : tile * sizeof(__half);
  return size_t(kStages) * tile * elem_bytes + plane +
         S::kWarps * S::kHeadTiles * 32 * sizeof(float4) + (S::kLatent ? kStages * 8 : 0);
}

// The transpose of an 8 × 8 16-bit matrix held as fragments (lane l: row l / 4, columns
// 2(l % 4), +1): lane l then holds rows 2(l % 4), +1 of column l / 4.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// An F8_E4M3 stage widened into the plane (exactly).
template <typename S>
__device__ __forceinline__ void widen_tile(const uint8_t* ks, __half* kp, int hd, int dv) {
  const uint8_t* vs = ks + hd * kTile;
  __half* vp = kp + hd * kTile;
  for (int e = threadIdx.x; e < hd * (kTile / 4); e += S::kThreads) {
    const int d = e / (kTile / 4), q = e % (kTile / 4);
    widen4(ks + d * kTile + 4 * q, kp + key_offset(d, q / 2) + 4 * (q % 2));
  }
  if constexpr (S::kLatent) return;
  const int quads = dv / 4;
  for (int e = threadIdx.x; e < kTile * quads; e += S::kThreads) {
    const int p = e / quads, q = e % quads;
    widen4(vs + p * dv + 4 * q, vp + value_offset(p, q / 2, dv) + 4 * (q % 2));
  }
}

// grid (n_tokens, kv_heads × head tiles, n_splits), S::kThreads; T the cache's element type
// (uint16_t: BF16, __half: F16, uint8_t: F8_E4M3; the products' operands are bf16 for BF16, else
// f16), NT head tiles of 8: the whole group (≤ 8 NT), or (latent) heads 8 NT i .. of it in
// block row i of the kv head's. Warp w owns the 16-channel steps w, w + W, ... (W = S::kWarps) of
// the key channels (scores) and of the value channels (output). Fragments (g = lane / 4, c = lane %
// 4) of head tile n: scores and weights rows (positions) g and g + 8, columns (heads) 8n + 2c, + 1;
// acc[j][n] rows (value channels) 16(w + Wj) + g, + 8, the same head columns.
// key_map (latent): the key cache [blocks, kv heads, hd, bs] as a tensor map with boxes of kTile
// positions × hd / key_boxes channels; the other forms take none (KeyMapOf).
template <typename T, int NT, typename S>
__global__ void __launch_bounds__(S::kThreads)
    attention_decode_mma_kernel(AttnArgs a, const __grid_constant__ KeyMapOf<S> key_map,
                                int key_boxes) {
  static_assert(NT <= S::kHeadTiles);
  constexpr int kWarps = S::kWarps, kThreads = S::kThreads;
  constexpr bool kLatent = S::kLatent;
  using M = std::conditional_t<std::is_same_v<T, uint16_t>, __nv_bfloat16, __half>;
  constexpr int kTerms = kTermsOf<M>;
  constexpr bool kWiden = sizeof(T) == 1;
  constexpr int kChunk = 16 / sizeof(T);  // elements per 16-byte copy
  // 256-byte aligned stages: the TMA's 32-byte swizzle lays rows out as key_offset does.
  extern __shared__ __align__(1024) unsigned char smem[];
  const int hd = a.hd, dv = a.dv, group = a.group;
  T* ring = reinterpret_cast<T*>(smem);
  const int tile = tile_elems(hd, dv, kLatent);
  M* plane = reinterpret_cast<M*>(ring + kStages * tile);  // kWiden only
  float4* partial = reinterpret_cast<float4*>(plane + (kWiden ? tile : 0));
  uint64_t* bars = reinterpret_cast<uint64_t*>(partial + kWarps * S::kHeadTiles * 32);  // latent
  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);
  const int t = blockIdx.x, sp = blockIdx.z;
  // kv head kvh's query heads h0 .. h0 + 8 NT − 1: latent decode may split a group's heads
  // between blocks (gridDim.y = kv heads × head tiles).
  int kvh = blockIdx.y, h0 = 0;
  if constexpr (kLatent) {
    const int head_tiles = int(gridDim.y) * group / a.heads;
    kvh = blockIdx.y / head_tiles, h0 = 8 * NT * (blockIdx.y % head_tiles);
  }
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, c = lane % 4;
  const int seq = seq_of_token(a.seq_start, a.n_seqs, t);
  const int n_ctx = a.positions[t] + 1;
  const int span = split_span(a, n_ctx);  // whole tiles (split_align)
  const int p_begin = sp * span, p_end = min(n_ctx, p_begin + span);
  const int n_tiles = p_begin < n_ctx ? (p_end - p_begin + kTile - 1) / kTile : 0;
  const int32_t* table = a.block_ids + a.block_start[seq];
  auto cache_block = [&](int i) -> int64_t {
    return i < n_tiles ? table[(p_begin + i * kTile) / a.bs] : 0;
  };
  // Tile i (in cache block `block`: bs is a multiple of kTile) into its stage; values past the
  // split are zeros (their weights are 0, and 0 · garbage could be NaN), keys past it are read
  // and their scores masked (the latent form zeroes them after they land: they are its values).
  auto start_tile = [&](int i, int64_t block) {
    const int p0 = p_begin + i * kTile, off = p0 % a.bs;
    T* ks = ring + (i % kStages) * tile;
    if constexpr (kLatent) {  // thread 0 only: the tile's boxes, on the stage's barrier
      const int rows = hd / key_boxes;
      mbar_expect(&bars[i % kStages], uint32_t(hd * kTile * sizeof(T)));
      for (int b = 0; b < key_boxes; ++b) {
        tma_load_4d(ks + b * rows * kTile, &key_map, &bars[i % kStages], off, b * rows, kvh,
                    int(block));
      }
      return;
    }
    T* vs = ks + hd * kTile;
    const T* kb = kc + block * a.kc_s0 + kvh * a.kc_s1 + off;
    const T* vb = vc + block * a.vc_s0 + kvh * a.vc_s1 + int64_t(off) * a.vc_s2;
    constexpr int kRowChunks = kTile / kChunk;  // of a key channel's row
    for (int e = tid; e < kRowChunks * hd; e += kThreads) {
      const int d = e / kRowChunks, half = e % kRowChunks;
      T* dst = ks + (kWiden ? d * kTile : key_offset(d, half));
      const T* src = kb + d * a.kc_s2 + 8 * half;
      copy16_async(dst, src, true);
    }
    const int chunks = dv / kChunk;
    for (int e = tid; e < kTile * chunks; e += kThreads) {
      const int p = e / chunks, j = e % chunks;
      copy16_async(vs + (kWiden ? p * dv + kChunk * j : value_offset(p, j, dv)),
                   vb + p * a.vc_s2 + kChunk * j, p0 + p < p_end);
    }
  };
  if constexpr (kLatent) {
    if (tid == 0) {
      // The descriptor's first use would wait for its fetch: fetched now, beside the setup.
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&key_map))
                   : "memory");
#pragma unroll
      for (int i = 0; i < kStages; ++i) mbar_init(&bars[i]);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  // The first kStages − 1 tiles. Those wholly before the sequence's first position of this
  // forward were written by earlier forwards: they are copied (through L2 only) before waiting
  // for the kernel before, which writes the new positions.
  // Thread 0 issues the latent form's copies: only it needs the cache blocks.
  const bool issuer = !kLatent || tid == 0;
  int64_t blocks[kStages];
#pragma unroll
  for (int i = 0; i < kStages; ++i) blocks[i] = issuer ? cache_block(i) : 0;
  const int first_new = a.positions[a.seq_start[seq]];
  const int early = min(min(kStages - 1, n_tiles), max(0, (first_new - p_begin) / kTile));
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < early) {
      if (issuer) start_tile(i, blocks[i]);
      if constexpr (!kLatent) copy_commit();
    }
  }
  grid_dependency_sync();
  if (n_tiles == 0) {
    mark_empty_split(a, t, kvh, sp);
    return;
  }
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i >= early) {
      if (i < n_tiles && issuer) start_tile(i, blocks[i]);
      if constexpr (!kLatent) copy_commit();
    }
  }

  // The queries' b fragments (k = key channels, n = heads) of the warp's steps, scaled so that
  // scores come out in log2 units (exp2 below), as their terms (within f16's range for f16
  // terms); zeros past the group.
  const float q_scale = a.scale * 1.4426950408889634f;
  uint32_t qf[S::kKeySteps][NT][2][kTerms];
#pragma unroll
  for (int j = 0; j < S::kKeySteps; ++j) {
    const int kk = 16 * (warp + kWarps * j);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float x0 = 0.0f, x1 = 0.0f;
        if (h0 + 8 * n + g < group && kk < hd) {
          const float* q = a.q + int64_t(t) * a.q_s0 +
                           int64_t(kvh * group + h0 + 8 * n + g) * a.q_s1 + kk + 8 * half + 2 * c;
          x0 = q[0] * q_scale, x1 = q[1] * q_scale;
          if constexpr (std::is_same_v<M, __half>)
            x0 = clamp_f16_range(x0), x1 = clamp_f16_range(x1);
        }
        split_x2<M>(x0, x1, qf[j][n][half]);
      }
    }
  }
  float acc[S::kValueSteps][NT][4];
#pragma unroll
  for (int j = 0; j < S::kValueSteps; ++j) {
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[j][n][0] = acc[j][n][1] = acc[j][n][2] = acc[j][n][3] = 0.0f;
  }
  // Running maxima and denominators of heads 8n + 2c, + 1.
  float m[NT][2], l[NT][2];
#pragma unroll
  for (int n = 0; n < NT; ++n) m[n][0] = m[n][1] = -INFINITY, l[n][0] = l[n][1] = 0.0f;
  // ldmatrix: lane l gives row l % 8 of matrix l / 8.
  const int lm_row = lane % 8, lm_mat = lane / 8;
  int64_t next_block = blocks[kStages - 1];

  for (int i = 0; i < n_tiles; ++i) {
    if constexpr (kLatent) {
      mbar_wait(&bars[i % kStages], uint32_t(i / kStages) & 1u);
    } else {
      copy_wait<kStages - 2>();  // this thread's copies of tile i have landed
    }
    __syncthreads();  // everyone's; and tile i − 1's stage, plane and partials are free
    if (i + kStages - 1 < n_tiles && issuer) start_tile(i + kStages - 1, next_block);
    if constexpr (!kLatent) copy_commit();
    if (issuer) next_block = cache_block(i + kStages);
    if constexpr (kLatent) {
      // The boxes copied the cache's positions past the split too: zeros there (they are
      // values as well, and their weight 0 times NaN would be NaN).
      const int p0 = p_begin + i * kTile;
      if (p0 + kTile > p_end) {
        T* ks = ring + (i % kStages) * tile;
        for (int e = tid; e < hd * kTile; e += kThreads) {
          const int d = e / kTile, p = e % kTile;
          if (p0 + p >= p_end) ks[kWiden ? d * kTile + p : key_offset(d, p / 8) + p % 8] = T{};
        }
        __syncthreads();
      }
    }
    const M* ks = reinterpret_cast<const M*>(ring + (i % kStages) * tile);
    if constexpr (kWiden) {
      widen_tile<S>(reinterpret_cast<const uint8_t*>(ks), plane, hd, dv);
      __syncthreads();
      ks = plane;
    }
    const M* vs = ks + hd * kTile;  // unless kLatent

    // Partial scores over the warp's key channels; two accumulators a head tile halve the
    // MMA chains.
    float s0[NT][4], s1[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int r = 0; r < 4; ++r) s0[n][r] = s1[n][r] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < S::kKeySteps; ++j) {
      const int kk = 16 * (warp + kWarps * j);
      if (kk < hd) {
        // a = K [16 positions × 16 channels]: matrix r holds positions 8(r % 2) .. and
        // channels kk + 8(r / 2) .., transposed out of the channel rows.
        const int d = kk + 8 * (lm_mat / 2) + lm_row;
        uint32_t ak[4];
        ldmatrix_x4<true>(ak, ks + key_offset(d, lm_mat % 2));
#pragma unroll
        for (int ti = kTerms - 1; ti >= 0; --ti) {
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            mma16<M>(j % 2 ? s1[n] : s0[n], ak, qf[j][n][0][ti], qf[j][n][1][ti]);
          }
        }
      }
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      partial[(warp * NT + n) * 32 + lane] = make_float4(s0[n][0] + s1[n][0], s0[n][1] + s1[n][1],
                                                         s0[n][2] + s1[n][2], s0[n][3] + s1[n][3]);
    }
    __syncthreads();
    const int p0 = p_begin + i * kTile;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {  // the same order in every warp
        const float4 v = partial[(w * NT + n) * 32 + lane];
        sc[0] += v.x, sc[1] += v.y, sc[2] += v.z, sc[3] += v.w;
      }
      if (p0 + g >= p_end) sc[0] = sc[1] = -INFINITY;
      if (p0 + g + 8 >= p_end) sc[2] = sc[3] = -INFINITY;
      // Online softmax per head (column): the tile's maximum over the lanes of the same c. The
      // tile's first position is in the split, so the new maxima are finite.
      float mx0 = fmaxf(sc[0], sc[2]), mx1 = fmaxf(sc[1], sc[3]);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
      }
      const float mn0 = fmaxf(m[n][0], mx0), mn1 = fmaxf(m[n][1], mx1);
      const float corr0 = exp2f(m[n][0] - mn0), corr1 = exp2f(m[n][1] - mn1);  // 0 at first
      m[n][0] = mn0, m[n][1] = mn1;
      const float p[4] = {exp2f(sc[0] - mn0), exp2f(sc[1] - mn1), exp2f(sc[2] - mn0),
                          exp2f(sc[3] - mn1)};
      l[n][0] = l[n][0] * corr0 + p[0] + p[2];
      l[n][1] = l[n][1] * corr1 + p[1] + p[3];
#pragma unroll
      for (int j = 0; j < S::kValueSteps; ++j) {
        acc[j][n][0] *= corr0, acc[j][n][1] *= corr1;
        acc[j][n][2] *= corr0, acc[j][n][3] *= corr1;
      }
      // The weights' b fragments (k = positions, n = heads): the transposes of the two 8 × 8
      // halves (positions 0-7 and 8-15) of each term, the weights times kWeightScaleOf<M> (the
      // sums divided by it at the end).
      constexpr float kWs = kWeightScaleOf<M>;
      uint32_t top[kTerms], bottom[kTerms], pb[kTerms][2];
      split_x2<M>(p[0] * kWs, p[1] * kWs, top);
      split_x2<M>(p[2] * kWs, p[3] * kWs, bottom);
#pragma unroll
      for (int ti = 0; ti < kTerms; ++ti) {
        pb[ti][0] = transpose8x8(top[ti]);
        pb[ti][1] = transpose8x8(bottom[ti]);
      }
#pragma unroll
      for (int j = 0; j < S::kValueSteps; ++j) {
        const int dd = 16 * (warp + kWarps * j);
        if (dd < dv) {
          // a = V^T [16 channels × 16 positions]: matrix r holds channels dd + 8(r % 2) .. and
          // positions 8(r / 2) .., transposed out of the position rows, or (latent) read as
          // they are out of the key channels' rows.
          uint32_t av[4];
          if constexpr (kLatent) {
            ldmatrix_x4<false>(av, ks + key_offset(dd + 8 * (lm_mat % 2) + lm_row, lm_mat / 2));
          } else {
            const int pr = 8 * (lm_mat / 2) + lm_row;
            ldmatrix_x4<true>(av, vs + value_offset(pr, dd / 8 + lm_mat % 2, dv));
          }
#pragma unroll
          for (int ti = kTerms - 1; ti >= 0; --ti) {
            mma16<M>(acc[j][n], av, pb[ti][0], pb[ti][1]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int n = 0; n < NT; ++n) {
    // The denominators: each column's sum over the lanes of the same c.
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      l[n][0] += __shfl_xor_sync(0xffffffffu, l[n][0], o);
      l[n][1] += __shfl_xor_sync(0xffffffffu, l[n][1], o);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (h0 + 8 * n + 2 * c + e >= group) continue;
      const int h = kvh * group + h0 + 8 * n + 2 * c + e;
      const float m_nat = m[n][e] * kLn2;  // natural-log units, as the combine weighs splits
      constexpr float kUnscale = 1.0f / kWeightScaleOf<M>;
#pragma unroll
      for (int j = 0; j < S::kValueSteps; ++j) {
        const int dd = 16 * (warp + kWarps * j);
        if (dd < dv) {
          store_result(a, t, h, sp, dd + g, acc[j][n][e] * kUnscale, m_nat, l[n][e], dv);
          store_result(a, t, h, sp, dd + g + 8, acc[j][n][2 + e] * kUnscale, m_nat, l[n][e], dv);
        }
      }
    }
  }
}

// Splits a's tokens' contexts into whole tiles, enough to fill every multiprocessor with the
// blocks it holds of this kernel, within the buffer of partial results, and launches it (and
// the merge of the splits).
// head_tiles (latent only): blocks that split each kv head's group, NT · 8 heads each.
// key_map (latent only): the key cache's tensor map, boxes of a.hd / key_boxes_for(a.hd) channels.
template <typename T, int NT, typename S>
void launch_decode_mma(CudaOps::Impl& s, AttnArgs a, const SeqLayout& layout, int kv_heads,
                       int max_ctx, const KeyMapOf<S>& key_map = {}, int head_tiles = 1) {
  constexpr auto kKernel = attention_decode_mma_kernel<T, NT, S>;
  constexpr int kThreads = S::kThreads;
  const size_t smem = decode_mma_smem_bytes<S>(a.hd, a.dv, sizeof(T));
  opt_in_smem<kKernel>(smem);  // before asking how many blocks an SM holds
  // Blocks an SM holds, asked once per thread (a rank's) and shared-memory size: no per-step
  // driver call. It only sizes the splits.
  static thread_local size_t asked_smem = 0;
  static thread_local int per_sm = 0;
  if (asked_smem != smem) {
    RECUR_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, smem));
    asked_smem = smem;
  }
  const int n = layout.n_tokens;
  const int64_t base = int64_t(n) * kv_heads * head_tiles;
  set_context_splits(s, a, n, (int64_t(std::max(per_sm, 1)) * s.sm_count + base - 1) / base,
                     max_ctx, S::kMinSplit, kTile);
  if (s.options.profile) {  // each (token, kv head) reads its context once
    double ctx = 0;
    for (int t = 0; t < n; ++t) ctx += layout.positions[t] + 1;
    const int read = S::kLatent ? a.hd : a.hd + a.dv;
    s.work(attention_flops(layout, a.heads, a.hd, a.dv),
           ctx * double(kv_heads) * double(read) * double(sizeof(T)));
  }
  const dim3 grid{unsigned(n), unsigned(kv_heads * head_tiles), unsigned(a.n_splits)};
  launch_kernel(kKernel, grid, kThreads, smem, s.stream, a, key_map,
                S::kLatent ? key_boxes_for(a.hd) : 0);
  s.launched(S::kLatent ? "paged_attention (latent decode, tensor cores)"
                        : "paged_attention (decode, tensor cores)");
  if (a.n_splits > 1) launch_attention_combine(s, a, n);
}

}  // namespace

namespace {

// Whether 16-byte copies can walk a cache's rows: innermost dimension contiguous, the base and
// the other strides in whole 16-byte chunks.
bool rows_copy16(const Tensor& cache) {
  const int64_t chunk = 16 / int64_t(dtype_size(cache.dtype));  // elements per 16-byte copy
  return reinterpret_cast<uintptr_t>(cache.data) % 16 == 0 && cache.stride[3] == 1 &&
         cache.stride[0] % chunk == 0 && cache.stride[1] % chunk == 0 &&
         cache.stride[2] % chunk == 0;
}

// fn(T{}) for a BF16, F16 or F8_E4M3 cache (dispatch_cache's element types); false for others.
template <typename Fn>
bool dispatch_narrow_cache(DType dt, Fn&& fn) {
  if (dt != DType::BF16 && dt != DType::F16 && dt != DType::F8_E4M3) return false;
  dispatch_cache(dt, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) fn(tag);
  });
  return true;
}

}  // namespace

bool attention_decode_mma(CudaOps::Impl& s, AttnArgs a, const Tensor& k_cache,
                          const Tensor& v_cache, const SeqLayout& layout, int kv_heads,
                          int max_ctx) {
  using S = GroupedShape;
  if (!rows_copy16(k_cache) || !rows_copy16(v_cache) || a.group > 8 * S::kHeadTiles ||
      a.hd % 64 != 0 || a.dv % 64 != 0 || a.hd > S::kMaxHd || a.dv > S::kMaxDv ||
      a.bs % kTile != 0) {
    return false;
  }
  return dispatch_narrow_cache(k_cache.dtype, [&](auto tag) {
    using T = decltype(tag);
    a.group > 8 ? launch_decode_mma<T, 2, S>(s, a, layout, kv_heads, max_ctx)
                : launch_decode_mma<T, 1, S>(s, a, layout, kv_heads, max_ctx);
  });
}

bool latent_decode_mma(CudaOps::Impl& s, AttnArgs a, const Tensor& k_cache, const SeqLayout& layout,
                       int kv_heads, int max_ctx) {
  using S = LatentShape;
  // The values are the keys' channels: only the key cache is copied, in TMA boxes.
  if (!rows_copy16(k_cache) || layout.n_tokens > kDecodeMaxTokens || a.hd % 16 != 0 ||
      a.dv % 16 != 0 || a.dv > a.hd || a.hd > S::kMaxHd || a.dv > S::kMaxDv || a.bs % kTile != 0 ||
      k_cache.shape[3] != a.bs || key_boxes_for(a.hd) == 0) {
    return false;
  }
  const int head_tiles = (a.group + 7) / 8;
  bool launched = false;
  dispatch_narrow_cache(k_cache.dtype, [&](auto tag) {
    using T = decltype(tag);
    CUtensorMap key_map;  // encoded before anything is set up: false leaves no trace
    if (!key_tensor_map<T>(k_cache, kTile, &key_map)) return;
    launch_decode_mma<T, 1, S>(s, a, layout, kv_heads, max_ctx, key_map, head_tiles);
    launched = true;
  });
  return launched;
}

}  // namespace cuda
}  // namespace recur
