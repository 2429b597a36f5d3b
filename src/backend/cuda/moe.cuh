// Shared by the MoE kernels: the grouped-GEMM problem description. Rows of the problem are
// (token, expert) pairs sorted by expert; a tile is up to TM consecutive rows of one expert.
#pragma once

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/moe_route.cuh"

namespace recur::cuda {

// One token routed by the gate/up kernel itself (moe_route_experts_shared): the first block of
// each cluster selects the picks from the logits (route_filter_block; E = kRouteThreads·PL,
// k ≤ 32, with a selection bias or without) for the cluster, so no routing kernel stands
// between the router and gate/up; one block stores ids and weights as moe_route would, for
// down and the combine.
struct MoeInKernelRoute {
  const float* logits = nullptr;  // [E] or null: the ids come from memory
  int k = 0;
  RouteScoring scoring;      // bias [E] or null
  int32_t* ids = nullptr;    // [k]
  float* weights = nullptr;  // [k]
  // Gate/up launched in clusters of this many blocks along x (one tile's rows): the cluster's
  // first block selects and hands the tile's expert to the others through their shared memory
  // (one selection per cluster rather than per block).
  int cluster = 1;
};
// Gate/up blocks per routing cluster for one token (the fastest of 1 to 8 on the H200, where
// the first block's selection and the handoff cost less than each block selecting).
constexpr int kRouteCluster = 4;

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
  // One token (decode of one sequence): no sort. Tile j is pair j, of expert direct_ids[j]
  // (< n_experts), its one row j; the tile fields and n_tiles above are unused.
  const int32_t* direct_ids = nullptr;  // [direct_k] or null
  int direct_k = 0, n_experts = 0;
  // ≥ 0: the last direct tile is this expert (the shared one), not an id from direct_ids.
  int direct_shared = -1;
  // The direct ids may be read before the PDL wait: set only for a launch that directly follows
  // one whose every block waits before it exits (gate/up), so the kernels before that one (the
  // routing that wrote the ids) have completed when this launch starts, or that stored the ids
  // before letting this launch start (gate/up routing the token itself).
  bool ids_early = false;
  // Gate/up only: direct tiles 0..route.k-1 routed in the kernel (direct_ids null), the
  // shared one last.
  MoeInKernelRoute route;
  // The warp kernel: each block covers this many consecutive groups of its 4 warps' rows, one
  // after another (fewer, longer-lived blocks where a tile's rows are short).
  int row_groups = 1;
  // F8_E4M3 weights (fp8.cuh's layout): the rows and columns per block scale of w and w2.
  int fp8_block_rows = 0, fp8_block_cols = 0;
  // Tensor cores only: a plain matmul rather than experts (dense_w set, [m, k]): tile t is rows
  // [64t, 64t + 64) of the dense_rows rows of x, written (or added, when accumulate) to out.
  const void* dense_w = nullptr;
  int64_t dense_rows = 0;
  bool accumulate = false;
  // Tensor cores, pipelined (moe_wmma_pipelined): the activations as their terms, read in
  // place of x (through x_row as x would be), x_terms_plane elements apart, rows ldxt apart:
  // two f16 terms (mid, hi; launch_f16_row_split) [2, rows of x, ldxt] of each row times a
  // power of two, and x_scale [rows of x] its inverse (moe_mma.cu: experts, and a dense
  // block-FP8 matmul with dense_w).
  const void* x_terms = nullptr;
  int64_t ldxt = 0, x_terms_plane = 0;
  const float* x_scale = nullptr;
  // Gate/up on the pipelined tiles: the SwiGLU outputs stored as their terms [terms, pairs, m]
  // (m a multiple of 8), out_terms_plane elements apart, in place of out: down's x_terms (and,
  // on the f16 tiles, out_scale [pairs] down's x_scale).
  void* out_terms = nullptr;
  int64_t out_terms_plane = 0;
  float* out_scale = nullptr;
  // The pipelined tiles of 16-bit weights on warpgroup products (moe_mma.cu's moe_wgmma_kernel;
  // sm_90a only) rather than mma.sync; one_term: their products take the hi term of each
  // activation alone (BackendOptions::prompt_activations kF16).
  bool warpgroup = false, one_term = false;
  // Block-FP8 weights on FP8 tensor cores (moe_fp8_act.cu): the rows of x as e4m3 [rows, k]
  // and their scales [rows, ⌈k/128⌉] (launch_e4m3_group_quantize), read in place of x.
  const uint8_t* x_q = nullptr;
  const float* x_q_scale = nullptr;
};

// The experts on the GEMV core (moe_gemv.cu), weights of type wdt (F32, BF16, F16 or F8_E4M3):
// gate/up with SwiGLU (gate_up) or down, over tiles of up to nt rows (1 to 8; vec: 16-byte
// rows, aligned weights and activations); grid rows max_tiles.
void launch_moe_gemv_experts(const MoeGemmArgs& a, DType wdt, bool gate_up, int nt, bool vec,
                             unsigned max_tiles, cudaStream_t stream);
// Gate/up of one token routed in the kernel (a.route set), for E = kRouteThreads·PL experts
// (PL 1, 2 or 4) and 16-byte rows.
void launch_moe_gemv_routed(const MoeGemmArgs& a, DType wdt, int PL, unsigned tiles,
                            cudaStream_t stream);

// The sort's slices of pairs (moe_sort.cu): one up to 2,048 pairs (one block sorts them), else
// slices of at least 2,048 pairs (a block's count is worth its launch), at most kMoeSortBlocks.
constexpr int kMoeSortBlocks = 128;
inline int moe_sort_slices(int64_t pairs) {
  return int(std::max<int64_t>(1, std::min<int64_t>(kMoeSortBlocks, (pairs + 2047) / 2048)));
}
// Where the sort of a prompt's (token, expert) pairs puts its results (pairs = n·slots rows).
struct MoeSortOut {
  int32_t* token_of;                             // [pairs] token of each sorted row
  int32_t* row_of;                               // [pairs] sorted row of pair (t, j)
  int32_t *tile_expert, *tile_row0, *tile_rows;  // [pairs] each tile's expert, rows
  int32_t* n_tiles;                              // [1]
  int* slice_rows;  // [moe_sort_slices(pairs), E] the sort's own scratch (unused for one slice)
};
// ids [n, k] (rows ld_ids apart, experts < E) sorted by expert into tiles of up to tm rows of
// one expert (moe_sort.cu). slots > k (k + 1): each token's pair k is expert E − 1, a shared
// expert riding along (pair (t, j) is pair t·slots + j).
void launch_moe_sort(const int32_t* ids, int64_t ld_ids, int n, int k, int slots, int E, int tm,
                     const MoeSortOut& out, cudaStream_t stream);

// out [n, d] (rows ldo apart) = Σ_{j<k} weights[t, j] · ys[row_of[t·slots + j], :] (row_of
// null: pair t·slots + j), plus with `shared` pair (t, k)'s row times σ(score[t]) (score null:
// times 1); with residual [n, d] (rows ld_res apart), residual += out (moe_combine.cu).
// ys [pairs, d]; weights [n, k] (rows ld_w apart); score [n] (ld_score apart).
void launch_moe_combine(const float* ys, const int32_t* row_of, int n, int slots,
                        const float* weights, int64_t ld_w, int k, int64_t d, float* out,
                        int64_t ldo, bool shared, const float* score, int64_t ld_score,
                        float* residual, int64_t ld_res, cudaStream_t stream);

// The (expert, first row, row count) of tile `tile`, or false when the tile is past the
// problem's tile count (surplus blocks of a worst-case grid).
__device__ __forceinline__ bool moe_tile(const MoeGemmArgs& a, int tile, int& e, int& row0,
                                         int& nt) {
  if (a.direct_ids) {
    if (tile >= a.direct_k) return false;
    if (a.direct_shared >= 0 && tile == a.direct_k - 1) {
      e = a.direct_shared;
    } else {
      e = a.direct_ids[tile];
      if (e < 0 || e >= a.n_experts) __trap();  // ids come from routing; else a bug
    }
    row0 = tile, nt = 1;
    return true;
  }
  if (tile >= *a.n_tiles) return false;
  e = a.tile_expert[tile], row0 = a.tile_row0[tile], nt = a.tile_rows[tile];
  return true;
}

// The expert of direct tile `tile` read before the PDL wait (L2, not L1: written by an
// earlier kernel of this forward), or false for a surplus tile or an id out of range.
__device__ __forceinline__ bool moe_direct_expert(const MoeGemmArgs& a, int tile, int& e) {
  if (!a.direct_ids || tile >= a.direct_k) return false;
  if (a.direct_shared >= 0 && tile == a.direct_k - 1) {
    e = a.direct_shared;
    return true;
  }
  e = __ldcg(a.direct_ids + tile);
  return e >= 0 && e < a.n_experts;
}

// The activation rows of a tile's nt tokens starting at row0 (slots ≥ nt repeat the first,
// valid memory whose results are discarded).
template <int NT>
__device__ __forceinline__ void moe_tile_rows(const MoeGemmArgs& a, int row0, int nt,
                                              const float* (&xr)[NT]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int r = row0 + (t < nt ? t : 0);
    xr[t] = a.x + (a.x_row ? int64_t(a.x_row[r]) : int64_t(r)) * a.ldx;
  }
}

// Tensor-core grouped GEMM (moe_wmma.cu): tiles of 64 rows, bf16 (or f16) operands with f32
// accumulation; the activations are split exactly into three terms of the weights' type.
// F8_E4M3 weights (fp8_wmma_blocks) are widened to bf16 exactly, each k block's products
// scaled once: the fallback tiles of block-FP8 weights (unaligned, or k not a multiple of the
// copies); the pipelined ones are moe_mma.cu's.
constexpr int kWmmaTileRows = 64;
// The expert, first row and row count of block row blockIdx.y's tile: rows [64y, 64y + 64) of a
// dense matmul's dense_rows (expert 0), else moe_tile's; false past the problem's tiles.
__device__ __forceinline__ bool block_tile(const MoeGemmArgs& a, int& e, int& row0, int& rows) {
  if (a.dense_w) {
    e = 0, row0 = int(blockIdx.y) * kWmmaTileRows;
    rows = int(min64(kWmmaTileRows, a.dense_rows - row0));
    return rows > 0;
  }
  return moe_tile(a, int(blockIdx.y), e, row0, rows);
}
// Whether the pipelined tiles take weights of wdtype with rows of k (16-byte copies of both
// operands; w_aligned: every weight starts 16-byte aligned); 16-bit experts also need every
// bf16 weight within f16's range (CudaOps::Impl::experts_fit_f16). Else the fallback tiles,
// which split f32 activations per block.
bool moe_wmma_pipelined(DType wdtype, int64_t k, bool w_aligned);
// x [rows, k] f32 (rows ldx apart) → terms [3, rows, k] of type (BF16 or F16; lo, mid, hi,
// each the nearest to what the larger ones leave; 16-byte aligned): the dense matmul on cuBLAS
// with bf16 weights (and f16 weights whose k is not a multiple of 8).
void launch_wmma_split(const float* x, int64_t ldx, int64_t rows, int64_t k, DType type,
                       void* terms, cudaStream_t stream);
// x [rows, k] f32 (rows ldx apart; k a multiple of 8) → terms [2, rows, k] f16 (mid, hi;
// 16-byte aligned) of each row times the power of two 2^e that puts its largest |value| in
// [2^14, 2^15), and inv_scale [rows] = 2^-e: 16-bit weights' activations (moe_mma.cu). With
// unit_rows, a row whose largest |value| lies in [2^-2, 2^15) keeps e = 0: unscaled, its terms
// still hold every value to 2^-25 (the mid term's subnormal step), within 2^-23 of the largest,
// and a caller that must undo the scale after its products skips that row.
void launch_f16_row_split(const float* x, int64_t ldx, int64_t rows, int64_t k, void* terms,
                          float* inv_scale, cudaStream_t stream, bool unit_rows = false);
// x [n, k] f32 (k a multiple of 8) in pieces of rows that fit `scratch` (bytes), each split there
// by launch_f16_row_split (its two f16 term planes, then the rows' inverse scales) and handed to
// fn(r0, nr, terms, inv_scale) for rows [r0, r0 + nr): the dense matmuls on f16 terms.
template <typename Fn>
void for_f16_row_pieces(const Tensor& x, void* scratch, size_t bytes, bool unit_rows,
                        cudaStream_t stream, Fn&& fn) {
  const int64_t n = x.shape[0], k = x.shape[1];
  const int64_t piece = int64_t(bytes / size_t(4 * k + 4));
  RECUR_CHECK(piece >= 1);
  for (int64_t r0 = 0; r0 < n; r0 += piece) {
    const int64_t nr = std::min(piece, n - r0);
    float* inv_scale = reinterpret_cast<float*>(static_cast<char*>(scratch) + size_t(4 * nr * k));
    launch_f16_row_split(x.ptr<float>() + r0 * x.stride[0], x.stride[0], nr, k, scratch, inv_scale,
                         stream, unit_rows);
    fn(r0, nr, scratch, inv_scale);
  }
}
// Gate/up blocks of one tile run as a cluster on the 16-bit weights' tiles (moe_mma.cu): at
// most this many (sixteen is beyond the portable eight, which the H200 allows).
constexpr int kMaxClusterBlocks = 16;
// Whether gate/up's blocks of one tile of d_ff SwiGLU columns (weights of wdtype) fit one
// cluster, so it stores down's terms itself (else it stores f32 rows, and launch_f16_row_split
// splits them).
bool moe_mma_takes(int64_t d_ff, DType wdtype);
void launch_moe_wmma(const MoeGemmArgs& a, DType wdtype, bool dual, unsigned max_tiles,
                     cudaStream_t stream);
// The pipelined tiles of 16-bit (bf16, f16) and block-FP8 weights (moe_mma.cu) on two scaled
// f16 terms of the activations (a.x_terms and a.x_scale set): experts, or a dense block-FP8
// matmul (dense_w, not dual); launch_moe_wmma hands them here.
void launch_moe_mma(const MoeGemmArgs& a, DType wdtype, bool dual, unsigned max_tiles,
                    cudaStream_t stream);

// Block-FP8 prompt products on e4m3 activations (moe_fp8_act.cu): weights times activations
// quantized to e4m3 per row and group of kFp8ActBlock channels (scale = the group's largest
// |value| / kFp8ActMax), on FP8 warpgroup products (sm_90a).
constexpr int kFp8ActBlock = 128;
constexpr float kFp8ActMax = 448.0f;  // e4m3's largest finite value
// Whether those tiles take a weight of br × bc blocks and rows of k (16-byte aligned: w_aligned).
bool fp8_act_takes(int br, int bc, int64_t k, bool w_aligned);
// x [rows, k] f32 (rows ldx apart; k a multiple of 16) → q [rows, k] e4m3 and scale
// [rows, ⌈k/kFp8ActBlock⌉] f32: x ≈ q · scale.
void launch_e4m3_group_quantize(const float* x, int64_t ldx, int64_t rows, int64_t k, uint8_t* q,
                                float* scale, cudaStream_t stream);
// The tiles on a.x_q and a.x_q_scale: experts (gate/up with dual: the SwiGLU rows, f32), or a
// dense block-FP8 matmul (dense_w, not dual); f32 rows out.
void launch_moe_fp8_act(const MoeGemmArgs& a, bool dual, unsigned max_tiles, cudaStream_t stream);

}  // namespace recur::cuda
