// Latent attention (values are the first dv channels of the keys, as the absorbed form of
// multi-head latent attention caches them) on tensor cores, for prompts and decode alike.
//
// Every query head of a kv head reads the same wide key (Kimi-Linear: 32 heads of 512 + 64
// channels over one cached latent), so a block takes kRows rows of (token, query head) against
// one kv head and each key tile loaded serves them all, once as keys and once as values: the
// tile is held as the cache holds it, channels by positions, which is the layout both products
// want. Keys and values this wide do not fit one warp's registers: the block's 8 warps are two
// row groups of 16 rows times four parts of the channels. A part's warp multiplies its quarter
// of the key channels into partial scores, the four partials add up in shared memory, and each
// warp then runs the same online softmax on the sums (identical arithmetic, so identical
// weights) and accumulates its quarter of the value channels.
//
// Decode splits the context between blocks (one token's rows a block) and merges the splits
// with the other kernels' combine; prompts walk the whole causal context in each block. The
// products run on TF32 halves as kernels_attention_mma.cu explains (f32's accuracy), in log2
// units (exp2). Decode over a 16-bit or FP8 cache takes the decode kernel's latent form
// instead (kernels_attention_decode_mma.cu: asynchronous copies, 16-bit products): at a Kimi-
// Linear 8-layer batch-1 step it was 5% faster at a 300-position context and 13% at 32,768
// (H100, session 43). Prompts over an F16 or FP8 cache on a Hopper take the warpgroup kernel
// (kernels_attention_latent_wgmma.cu, 1.2x this one's rate at 2,048 tokens, 3.3-3.8x at 32,768);
// this one keeps the rest (BF16 and F32 caches, GPUs after Hopper).
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/mma_tf32.cuh"

namespace recur {
namespace cuda {

namespace {

constexpr int kRowGroups = 2;
constexpr int kParts = 4;
constexpr int kWarps = kRowGroups * kParts;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16 * kRowGroups;  // (token, query head) rows per block
constexpr int kKeys = 16;               // key positions per tile
constexpr int kMaxValuePart = 128;      // value channels per part: dv ≤ 512
// Qs rows hd + 4 floats (≡ 4 mod 32: a fragment's 32 loads in 32 banks); tile rows kKeys + 8
// (24: the score operand's loads, and the value operand's 8-byte pairs, conflict-free).
constexpr int kQPad = 4;
constexpr int kTileStride = kKeys + 8;
// A decode split holds at least this many positions. Each block walks its tiles one after the
// other, so at short contexts the split's length is the kernel's latency: two tiles made
// Kimi-Linear's step faster than four or one (H200, session 21).
constexpr int kMinSplitPositions = 2 * kKeys;

// Shared memory (f32): Qs [kRows][hd + 4]; two stages of the tile [hd][kTileStride]; the
// partial scores [kParts][kRowGroups][kKeys / 8][32 lanes][4].
size_t latent_smem_bytes(int hd) {
  return sizeof(float) * (size_t(kRows) * size_t(hd + kQPad) + 2 * size_t(hd) * kTileStride +
                          size_t(kParts) * kRowGroups * (kKeys / 8) * 32 * 4);
}

// Starts the copies of positions k0 .. k0 + kKeys − 1 of every key channel (zeros outside
// [k0, p_end)).
template <typename T>
__device__ __forceinline__ void start_tile(const AttnArgs& a, const int32_t* table, int kvh, int k0,
                                           int p_end, float* tile) {
  const TileCopier<kKeys, kThreads, 4> copier(a);
  copier.template copy<T>(
      a, table, kvh, k0, p_end - 1, false,
      [&](int d, int p, const T* src, bool valid) {
        // Values are these keys: none past the end may enter (0 · NaN is NaN).
        copy4_first(tile + d * kTileStride + p, src, valid ? min(4, p_end - (k0 + p)) : 0);
      },
      [](int, int, const T*, bool) {});
}

// grid (row tiles, kv_heads, n_splits), kThreads. With splits a block holds one token's rows
// (a.group ≤ kRows of them); without, kRows / group tokens of one sequence.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) latent_attention_mma_kernel(AttnArgs a) {
  grid_dependency_sync();
  extern __shared__ __align__(16) float smem[];
  const int hd = a.hd, dv = a.dv, group = a.group, hdq = hd + kQPad;
  float* Qs = smem;
  float* stage[2] = {Qs + kRows * hdq, Qs + kRows * hdq + hd * kTileStride};
  float4* partial = reinterpret_cast<float4*>(stage[1] + hd * kTileStride);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c = lane % 4;  // fragment row and column
  const int row_group = warp % kRowGroups, part = warp / kRowGroups, m0 = 16 * row_group;
  const int key_part = hd / kParts, value_part = dv / kParts;

  // The block's tokens [t0, t_end) of sequence s: the tiles of sequence s follow those of s − 1.
  const int tokens_per_tile = a.n_splits > 1 ? 1 : kRows / group;
  const RowTile rt = find_row_tile(a, tokens_per_tile, int(blockIdx.x));
  if (rt.s == a.n_seqs) return;
  const int t0 = rt.t0, t_end = rt.t_end;
  const int kvh = int(blockIdx.y), sp = int(blockIdx.z), n_rows = rt.n_rows;
  const int32_t* table = rt.table;
  int max_pos = -1;
  for (int t = t0; t < t_end; ++t) max_pos = max(max_pos, a.positions[t]);
  // This split's positions [p_begin, p_end) (the whole context without splits).
  int p_begin = 0, p_end = max_pos + 1;
  if (a.n_splits > 1) {
    const int span = split_span(a, max_pos + 1);
    p_begin = sp * span, p_end = min(p_end, p_begin + span);
    if (p_begin >= p_end) {
      mark_empty_split(a, t0, kvh, sp);
      return;
    }
  }
  // The queries, copied in with the first tile: one round trip, not one per few rows.
  for (int e = tid; e < kRows * (hd / 4); e += kThreads) {
    const int r = e / (hd / 4), d = 4 * (e % (hd / 4));
    const bool valid = r < n_rows;
    const float* src = a.q;
    if (valid)
      src += int64_t(t0 + r / group) * a.q_s0 + int64_t(kvh * group + r % group) * a.q_s1 + d;
    copy16_async(Qs + r * hdq + d, src, valid);
  }
  start_tile<T>(a, table, kvh, p_begin, p_end, stage[0]);
  copy_commit();
  // Scores come out in log2 units (exp2 below) once multiplied by this.
  const float log2_scale = a.scale * 1.4426950408889634f;
  int row_pos[2];
  fragment_row_positions(a, rt, m0 + g, row_pos);

  float acc[kMaxValuePart / 8][4];
#pragma unroll
  for (int j = 0; j < kMaxValuePart / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int k0 = p_begin, it = 0; k0 < p_end; k0 += kKeys, ++it) {
    const float* cur = stage[it % 2];
    if (k0 + kKeys < p_end) start_tile<T>(a, table, kvh, k0 + kKeys, p_end, stage[(it + 1) % 2]);
    copy_commit();
    copy_wait<1>();   // this thread's copies of the current tile have landed
    __syncthreads();  // and everyone's (and the queries)
    // Partial scores [16 rows × kKeys] over this part's key channels: n-tile j holds keys
    // [8j, 8j + 8).
    // Even and odd k-steps accumulate apart: four independent chains of products, not two
    // (a part's key channels are whole pairs of k-steps).
    float sc[kKeys / 8][4], sc_odd[kKeys / 8][4];
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
      for (int u = 0; u < 4; ++u) sc[j][u] = sc_odd[j][u] = 0.0f;
    }
    for (int kk = part * key_part; kk < (part + 1) * key_part; kk += 16) {
      const SplitA q0 = load_split_a(Qs, hdq, m0, kk, g, c);
      const SplitA q1 = load_split_a(Qs, hdq, m0, kk + 8, g, c);
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        mma_split(sc[j], q0, load_split_b(cur, kTileStride, kk, 8 * j, g, c));
        mma_split(sc_odd[j], q1, load_split_b(cur, kTileStride, kk + 8, 8 * j, g, c));
      }
    }
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
      partial[((part * kRowGroups + row_group) * (kKeys / 8) + j) * 32 + lane] =
          make_float4(sc[j][0] + sc_odd[j][0], sc[j][1] + sc_odd[j][1], sc[j][2] + sc_odd[j][2],
                      sc[j][3] + sc_odd[j][3]);
    }
    __syncthreads();
    // The four parts' sums, in the same order in every warp of the row group.
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
      float4 sum = partial[(row_group * (kKeys / 8) + j) * 32 + lane];
#pragma unroll
      for (int p = 1; p < kParts; ++p) {
        const float4 v = partial[((p * kRowGroups + row_group) * (kKeys / 8) + j) * 32 + lane];
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
      }
      sc[j][0] = sum.x * log2_scale, sc[j][1] = sum.y * log2_scale;
      sc[j][2] = sum.z * log2_scale, sc[j][3] = sum.w * log2_scale;
    }
    // Mask (causal, and the split's end) and the online softmax of rows g and g + 8.
    float corr[2];
    online_softmax_tile<kKeys / 8, true>(sc, k0, c, row_pos, p_end, m, l, corr);
    rescale_rows(acc, corr);
    // acc += P · V over each 8 keys: the score fragment (keys 2c, 2c + 1 of rows g, g + 8) is
    // the a operand with its columns c and c + 4 standing for keys 2c and 2c + 1, so the value
    // operand's rows c and c + 4 are those keys: channel n's two adjacent positions in the tile.
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
      SplitA p;
      split_tf32(sc[j][0], p.hi[0], p.lo[0]);
      split_tf32(sc[j][2], p.hi[1], p.lo[1]);
      split_tf32(sc[j][1], p.hi[2], p.lo[2]);
      split_tf32(sc[j][3], p.hi[3], p.lo[3]);
      const float* v = cur + (part * value_part + g) * kTileStride + 8 * j + 2 * c;
#pragma unroll
      for (int n = 0; n < kMaxValuePart / 8; ++n) {
        if (8 * n < value_part) {
          const float2 pair = *reinterpret_cast<const float2*>(v + 8 * n * kTileStride);
          SplitB b;
          split_tf32(pair.x, b.hi[0], b.lo[0]);
          split_tf32(pair.y, b.hi[1], b.lo[1]);
          mma_split(acc[n], p, b);
        }
      }
    }
    __syncthreads();  // the stage and the partial scores are free for the next tile
  }
  quad_sums(l);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = m0 + g + 8 * i;
    if (r >= n_rows) continue;
    const int t = t0 + r / group, h = kvh * group + r % group;
    // The split's statistics in natural-log units, as the combine weighs them.
    const float m_nat = m[i] * 0.6931471805599453f;
#pragma unroll
    for (int n = 0; n < kMaxValuePart / 8; ++n) {
      if (8 * n < value_part) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int d = part * value_part + 8 * n + 2 * c + hh;
          store_result(a, t, h, sp, d, acc[n][2 * i + hh], m_nat, l[i], dv);
        }
      }
    }
  }
}

}  // namespace

bool latent_attention_mma(CudaOps::Impl& s, AttnArgs a, const Tensor& k_cache,
                          const Tensor& v_cache, const SeqLayout& layout, int kv_heads,
                          int max_ctx) {
  // The values must be the keys' first dv channels (one tile serves both), every part's
  // channels whole fragments, and the cache copyable 4 aligned elements at a time.
  const bool values_in_keys = v_cache.data == k_cache.data &&
                              v_cache.stride[0] == k_cache.stride[0] &&
                              v_cache.stride[1] == k_cache.stride[1] && v_cache.stride[2] == 1 &&
                              v_cache.stride[3] == k_cache.stride[2];
  const bool copies4 =
      reinterpret_cast<uintptr_t>(k_cache.data) % (4 * dtype_size(k_cache.dtype)) == 0 &&
      k_cache.stride[0] % 4 == 0 && k_cache.stride[1] % 4 == 0 && k_cache.stride[2] % 4 == 0 &&
      k_cache.stride[3] == 1;
  // The queries are copied 16 bytes at a time.
  const bool queries16 =
      reinterpret_cast<uintptr_t>(a.q) % 16 == 0 && a.q_s0 % 4 == 0 && a.q_s1 % 4 == 0;
  if (!values_in_keys || !copies4 || !queries16 || a.hd % (16 * kParts) != 0 ||
      a.dv % (8 * kParts) != 0 || a.dv > kParts * kMaxValuePart || a.dv > a.hd || a.group > kRows ||
      a.bs % 4 != 0 || latent_smem_bytes(a.hd) > s.max_smem_optin) {
    return false;
  }
  const int n = layout.n_tokens;
  // Few tokens over a 16-bit or FP8 cache: the decode kernel's latent form (16-bit products,
  // the tiles copied asynchronously).
  if (latent_decode_mma(s, a, k_cache, layout, kv_heads, max_ctx)) return true;
  // More over an F16 or FP8 cache on a Hopper: warpgroup products, f16 terms.
  if (n > kDecodeMaxTokens && latent_prompt_wgmma(s, a, k_cache, layout, kv_heads)) return true;
  // Decode: one token's rows a block, and the context split so that the blocks fill the GPU
  // (one block an SM: its shared memory) within the buffer of partial results.
  a.n_splits = 1;
  if (n <= kDecodeMaxTokens) {
    const int64_t base = int64_t(n) * kv_heads;
    set_context_splits(s, a, n, (int64_t(s.sm_count) + base - 1) / base, max_ctx,
                       kMinSplitPositions, kKeys);
  }
  const int n_splits = a.n_splits;
  // One token's rows a block when split.
  const int64_t row_tiles = n_splits > 1 ? n : prompt_row_tiles(layout, kRows / a.group);
  if (s.options.profile) {  // each block reads its keys once
    double positions = 0;
    for (int t = 0; t < n; ++t) positions += layout.positions[t] + 1;
    const double per_token = n_splits > 1 ? 1.0 : double(a.group) / kRows;
    s.work(attention_flops(layout, a.heads, a.hd, a.dv), positions * per_token * double(kv_heads) *
                                                             double(a.hd) *
                                                             double(dtype_size(k_cache.dtype)));
  }
  const size_t smem = latent_smem_bytes(a.hd);
  const dim3 grid{unsigned(row_tiles), unsigned(kv_heads), unsigned(n_splits)};
  dispatch_cache(k_cache.dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_opted_in<latent_attention_mma_kernel<T>>(grid, kThreads, smem, s.stream, a);
  });
  s.launched("paged_attention (latent, tensor cores)");
  if (n_splits > 1) launch_attention_combine(s, a, n);
  return true;
}

}  // namespace cuda
}  // namespace recur
