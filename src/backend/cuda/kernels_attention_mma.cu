// Prompt attention on tensor cores over an F32 cache: the online softmax of flash attention 2
// over tiles of the paged cache, with mma.sync (f32 accumulation). BF16, F16 and F8_E4M3 caches
// take kernels_attention_16bit.cu's kernel, whose tiles are exactly bf16 or f16.
//
// A block takes kRows query rows of one sequence and one kv head, a row being (token, query
// head of the group), so every key and value tile loaded serves the whole group. Its four warps
// own 16 rows each and walk the key positions in tiles of kKeys, causal per row; the next tile
// is copied in (cp.async) while the current one is used.
//
// The tiles are f32 and the results must stay within f32's error (2e-5 of the scalar reference,
// as the other kernels), so the products run on TF32 halves, x = hi + lo (about 20 bits), as
// hi·hi + hi·lo + lo·hi: three tensor-core products per term, still far above the CUDA-core
// kernels' rate.
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/mma_tf32.cuh"

namespace recur {
namespace cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = kPromptRows;
static_assert(kRows == 16 * kWarps, "a warp owns 16 rows");
constexpr int kKeys = 32;  // key positions per tile
// Row strides (floats) that put a fragment's 32 loads in 32 banks: Qs rows hd + 4 (≡ 4 mod 32
// for hd a multiple of 32... and of 16: 4·g + c spreads either way), Ks rows kKeys + 8 and Vs
// rows a multiple of 32 plus 8 (8·c + g).
constexpr int kQPad = 4;
constexpr int kKeyStride = kKeys + 8;
__host__ __device__ constexpr int value_stride(int dv) {
  return (dv + 31) / 32 * 32 + 8;
}

// A shared-memory load kept in program order with the (volatile) products.
__device__ __forceinline__ float lds_ordered(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n"
               : "=f"(v)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return v;
}

// c[u] += a · b[u] for N independent accumulators to f32's accuracy: the three products of
// the split operands, each pass over all N before the next (a warp issues in order, and an
// accumulator's next product waits for its last: interleaving hides that latency).
template <int N>
__device__ __forceinline__ void mma_split_n(float (&c)[N][4], const uint32_t (&ah)[4],
                                            const uint32_t (&al)[4], const float (&b0)[N],
                                            const float (&b1)[N], int n_valid) {
  uint32_t bh[N][2], bl[N][2];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    split_tf32(b0[u], bh[u][0], bl[u][0]);
    split_tf32(b1[u], bh[u][1], bl[u][1]);
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
    if (u < n_valid) mma_tf32(c[u], al, bh[u][0], bh[u][1]);
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
    if (u < n_valid) mma_tf32(c[u], ah, bl[u][0], bl[u][1]);
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
    if (u < n_valid) mma_tf32(c[u], ah, bh[u][0], bh[u][1]);
  }
}

// Shared memory (f32): Qs [kRows][hd + 4]; two stages of Ks [hd][kKeyStride] (keys as the
// cache holds them, positions along a row) and Vs [kKeys][value_stride(dv)], whose rows are
// the keys in the order the first product's fragments leave them (see key_row).
size_t mma_smem_bytes(int hd, int dv) {
  return sizeof(float) * (size_t(kRows) * size_t(hd + kQPad) +
                          2 * (size_t(hd) * kKeyStride + size_t(kKeys) * value_stride(dv)));
}

// The Vs row of key p of a tile: within each 8 keys, the even ones first. A thread's score
// fragment holds keys 2c and 2c + 1 of each 8, which the second product's a operand wants
// as its columns c and c + 4; reordering the values' rows to match spares the shuffles.
__device__ __forceinline__ int key_row(int p) {
  const int q = p % 8;
  return p - q + (q % 2 == 0 ? q / 2 : q / 2 + 4);
}

struct TileCopy {
  float* Ks;  // [hd][kKeyStride]
  float* Vs;  // [kKeys][vs]
};

// Starts the copies of keys and values k0 .. k0 + kKeys − 1 (zeros past max_pos), values into
// the rows key_row orders. The copier is made afresh each tile: kept across the walk, it made
// this kernel 9% slower at 65,536 tokens, not faster (H200, bench/results/h200-session28-notes.md;
// the cause not established: the registers came out the same).
__device__ __forceinline__ void start_tile(const AttnArgs& a, const int32_t* table, int kvh, int k0,
                                           int max_pos, TileCopy t) {
  const int vs = value_stride(a.dv);
  const TileCopier<kKeys, kThreads, 4> copier(a);
  copier.copy<float>(
      a, table, kvh, k0, max_pos, true,
      [&](int d, int p, const float* src, bool valid) {
        copy4(t.Ks + d * kKeyStride + p, src, valid);
      },
      [&](int p, int d, const float* src, bool valid) {
        copy4(t.Vs + key_row(p) * vs + d, src, valid);
      });
}

// grid (query tiles, kv_heads), kThreads. DV_MAX ≥ dv bounds the accumulator's registers:
// acc[j] holds value channels [8j, 8j + 8) of the thread's rows g and g + 8 (g = lane / 4).
template <int DV_MAX>
__global__ void __launch_bounds__(kThreads) attention_mma_kernel(AttnArgs a) {
  grid_dependency_sync();
  extern __shared__ __align__(16) float smem[];
  const int hd = a.hd, dv = a.dv, group = a.group, hdq = hd + kQPad, vs = value_stride(dv);
  float* Qs = smem;
  TileCopy even, odd;  // the stages of even and odd tiles
  even.Ks = Qs + kRows * hdq;
  even.Vs = even.Ks + hd * kKeyStride;
  odd.Ks = even.Vs + kKeys * vs;
  odd.Vs = odd.Ks + hd * kKeyStride;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c = lane % 4;  // fragment row and column

  // The tiles of sequence s follow those of sequence s − 1.
  const int tokens_per_tile = kRows / group;
  int tile, kvh;
  prompt_tile_and_head(tile, kvh);
  const RowTile rt = find_row_tile(a, tokens_per_tile, tile);
  if (rt.s == a.n_seqs) return;
  const int t0 = rt.t0, t_end = rt.t_end;
  const int n_rows = rt.n_rows;
  const int32_t* table = rt.table;
  const int m0 = warp * 16;
  int max_pos, warp_max_pos;  // the last key any row of the block, or of the warp, attends to
  last_keys(a, t0, t_end, m0, max_pos, warp_max_pos);
  start_tile(a, table, kvh, 0, max_pos, even);
  copy_commit();

  // Queries, scaled so that scores come out in log2 units (exp2 below).
  const float q_scale = a.scale * 1.4426950408889634f;
  for (int e = tid; e < kRows * hd; e += kThreads) {
    const int r = e / hd, d = e % hd;
    Qs[r * hdq + d] = r < n_rows ? a.q[int64_t(t0 + r / group) * a.q_s0 +
                                       int64_t(kvh * group + r % group) * a.q_s1 + d] *
                                       q_scale
                                 : 0.0f;
  }
  int row_pos[2];
  fragment_row_positions(a, rt, m0 + g, row_pos);

  float acc[DV_MAX / 8][4];
#pragma unroll
  for (int j = 0; j < DV_MAX / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int k0 = 0, it = 0; k0 <= max_pos; k0 += kKeys, ++it) {
    const TileCopy cur = it % 2 ? odd : even;
    copy_wait<0>();   // this thread's copies of the current tile have landed
    __syncthreads();  // and everyone's (and the queries); every warp is done with the last tile
    // The next tile goes into the other stage, which no warp reads any more, while this one is
    // multiplied: one block barrier a tile.
    if (k0 + kKeys <= max_pos) {
      start_tile(a, table, kvh, k0 + kKeys, max_pos, it % 2 ? even : odd);
    }
    copy_commit();
    if (k0 <= warp_max_pos) {  // else every key of the tile is past the warp's rows
      // Scores S [16 rows × kKeys] of the warp: n-tile j holds keys [8j, 8j + 8).
      float sc[kKeys / 8][4];
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll 1
      for (int kk = 0; kk < hd; kk += 8) {
        uint32_t ah[4], al[4];
        const float* q0 = Qs + (m0 + g) * hdq + kk + c;
        split_tf32(q0[0], ah[0], al[0]);
        split_tf32(q0[8 * hdq], ah[1], al[1]);
        split_tf32(q0[4], ah[2], al[2]);
        split_tf32(q0[8 * hdq + 4], ah[3], al[3]);
        const float* k = cur.Ks + (kk + c) * kKeyStride + g;
        float b0[kKeys / 8], b1[kKeys / 8];
#pragma unroll
        for (int j = 0; j < kKeys / 8; ++j) b0[j] = k[8 * j], b1[j] = k[4 * kKeyStride + 8 * j];
        mma_split_n<kKeys / 8>(sc, ah, al, b0, b1, kKeys / 8);
      }
      // Causal mask and the online softmax of the thread's rows g and g + 8.
      float corr[2];
      online_softmax_tile<kKeys / 8, false>(sc, k0, c, row_pos, 0, m, l, corr);
      rescale_rows(acc, corr);
      // acc += P · V over each 8 keys: the score fragment (keys 2c, 2c + 1 of rows g, g + 8)
      // is the a operand as it lies, against the reordered value rows. Values are read
      // kBatch channel groups at a time, in order with the products (lds_ordered): left free,
      // the compiler hoists them all and spills the accumulators.
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        uint32_t ph[4], pl[4];
        split_tf32(sc[j][0], ph[0], pl[0]);
        split_tf32(sc[j][2], ph[1], pl[1]);
        split_tf32(sc[j][1], ph[2], pl[2]);
        split_tf32(sc[j][3], ph[3], pl[3]);
        const float* v = cur.Vs + (8 * j + c) * vs + g;
        constexpr int kBatch = 8;
#pragma unroll
        for (int n0 = 0; n0 < DV_MAX / 8; n0 += kBatch) {
          if (8 * n0 < dv) {
            float b0[kBatch], b1[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
              const bool in = 8 * (n0 + u) < dv;  // past dv lies the next row, or nothing
              b0[u] = in ? lds_ordered(v + 8 * (n0 + u)) : 0.0f;
              b1[u] = in ? lds_ordered(v + 4 * vs + 8 * (n0 + u)) : 0.0f;
            }
            mma_split_n<kBatch>(*reinterpret_cast<float(*)[kBatch][4]>(&acc[n0]), ph, pl, b0, b1,
                                (dv - 8 * n0) / 8);
          }
        }
      }
    }
  }
  quad_sums(l);
  store_rows(a, acc, l, m0, g, c, n_rows, t0, kvh);
}

template <int DV_MAX>
void launch_dv(const AttnArgs& a, dim3 grid, size_t smem, cudaStream_t stream) {
  launch_opted_in<attention_mma_kernel<DV_MAX>>(grid, kThreads, smem, stream, a);
}

// Shared memory of the kernel for the cache type.
size_t prompt_smem_bytes(DType cache, int hd, int dv) {
  return cache == DType::F32 ? mma_smem_bytes(hd, dv) : attention_16bit_smem_bytes(hd, dv);
}

bool attention_mma_fits(DType cache, int group, int hd, int dv, int block_size, size_t max_smem) {
  return hd % 16 == 0 && dv % 8 == 0 && hd > 0 && dv > 0 && hd <= 256 && dv <= 256 &&
         block_size % 4 == 0 && group >= 1 && group <= kRows &&
         prompt_smem_bytes(cache, hd, dv) <= max_smem;
}

// wgmma: the warpgroup kernel takes the prompt (attention_wgmma_takes).
void launch_attention_mma(const AttnArgs& a, DType cache, bool wide_copies, bool wgmma,
                          const SeqLayout& layout, int kv_heads, cudaStream_t stream,
                          double* cache_bytes) {
  double positions = 0;  // for the profile: a tile reads keys and values up to its last position
  const int rows = wgmma ? attention_wgmma_rows(cache) : kRows;
  const int64_t n_tiles =
      prompt_row_tiles(layout, rows / a.group, cache_bytes ? &positions : nullptr);
  if (cache_bytes) {
    *cache_bytes = positions * double(kv_heads) * double(a.hd + a.dv) * double(dtype_size(cache));
  }
  if (n_tiles == 0) return;
  const dim3 grid{unsigned(n_tiles), unsigned(kv_heads)};
  if (wgmma) {
    launch_attention_wgmma(a, cache, grid, stream);
    return;
  }
  if (cache != DType::F32) {
    launch_attention_16bit(a, cache, wide_copies, grid, stream);
    return;
  }
  const size_t smem = mma_smem_bytes(a.hd, a.dv);
  if (a.dv <= 64) {
    launch_dv<64>(a, grid, smem, stream);
  } else if (a.dv <= 128) {
    launch_dv<128>(a, grid, smem, stream);
  } else {
    launch_dv<256>(a, grid, smem, stream);
  }
}

}  // namespace

int64_t prompt_row_tiles(const SeqLayout& layout, int tokens_per_tile, double* positions) {
  int64_t tiles = 0;
  for (int s = 0; s < layout.n_seqs; ++s) {
    for (int t = layout.seq_start[s]; t < layout.seq_start[s + 1]; t += tokens_per_tile) {
      ++tiles;
      if (positions) {
        const int last = std::min(layout.seq_start[s + 1], t + tokens_per_tile) - 1;
        *positions += layout.positions[last] + 1;
      }
    }
  }
  return tiles;
}

double attention_flops(const SeqLayout& layout, int64_t heads, int64_t hd, int64_t dv) {
  double ctx = 0;
  for (int t = 0; t < layout.n_tokens; ++t) ctx += layout.positions[t] + 1;
  return 2.0 * ctx * double(heads) * double(hd + dv);
}

bool paged_attention_mma(CudaOps::Impl& s, const AttnArgs& a, const Tensor& k_cache,
                         const Tensor& v_cache, const SeqLayout& layout, int kv_heads) {
  // The kernels copy 4 aligned elements at a time, or 8 (16 bytes of 2-byte elements).
  auto copies = [](const Tensor& t, int n) {
    return reinterpret_cast<uintptr_t>(t.data) % (n * dtype_size(t.dtype)) == 0 &&
           t.stride[0] % n == 0 && t.stride[1] % n == 0 && t.stride[2] % n == 0 && t.stride[3] == 1;
  };
  if (!copies(k_cache, 4) || !copies(v_cache, 4) ||
      !attention_mma_fits(k_cache.dtype, a.group, a.hd, a.dv, a.bs, s.max_smem_optin)) {
    return false;
  }
  if (s.options.profile) s.work(attention_flops(layout, a.heads, a.hd, a.dv), 0);
  const bool wide_copies = dtype_size(k_cache.dtype) == 2 && a.bs % 8 == 0 && a.dv % 8 == 0 &&
                           copies(k_cache, 8) && copies(v_cache, 8);
  const bool wgmma = s.sm90a && attention_wgmma_takes(k_cache.dtype, wide_copies, a.group, a.hd,
                                                      a.dv, s.max_smem_optin);
  launch_attention_mma(a, k_cache.dtype, wide_copies, wgmma, layout, kv_heads, s.stream,
                       s.options.profile ? &s.next_bytes : nullptr);
  s.launched(wgmma ? "paged_attention (wgmma)" : "paged_attention (tensor cores)");
  return true;
}

}  // namespace cuda
}  // namespace recur
