// The experts on the GEMV core (gemv.cuh), for decode: few tokens, or few rows an expert. A
// block-wide kernel for any row, and the warp kernel for 16-byte rows, which also routes one
// token itself (gate/up) and loads down's first chunks before its PDL wait. Entry points in
// moe.cuh; kernels_moe.cu chooses among these and the tensor-core tiles.
#include <cooperative_groups.h>

#include <algorithm>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/gemv.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_route.cuh"

namespace recur::cuda {

namespace {

// The GEMV core over tiles of ≤ NT rows: grid (⌈m/R⌉, max_tiles).
template <typename W, int NT, bool kDual, bool kVec>
__global__ void __launch_bounds__(kGemvThreads) moe_gemv_kernel(MoeGemmArgs a) {
  grid_dependency_sync();
  constexpr int R = kDual ? 2 : 4;
  __shared__ float red[(kDual ? 2 : 1) * R * NT * (kGemvThreads / 32)];
  int e, row0, nt;
  if (!moe_tile(a, blockIdx.y, e, row0, nt)) return;
  const int64_t orow0 = int64_t(blockIdx.x) * R;
  const int rows = int(min64(R, a.m - orow0));
  const float* xr[NT];
  moe_tile_rows<NT>(a, row0, nt, xr);
  const W* w = static_cast<const W*>(a.w[e]) + orow0 * a.k;
  const W* w2 = kDual ? static_cast<const W*>(a.w2[e]) + orow0 * a.k : nullptr;
  const int br = a.fp8_block_rows, bc = a.fp8_block_cols;
  const RowScales<W, R> sc = row_scales<W, R>(a.w[e], a.m, a.k, br, bc, orow0, rows);
  const RowScales<W, R> sc2 = kDual ? row_scales<W, R>(a.w2[e], a.m, a.k, br, bc, orow0, rows) : sc;
  float acc[R][NT] = {}, acc2[R][NT] = {};
  gemv_partial<W, NT, R, kDual, kVec>(w, w2, a.k, rows, sc, sc2, xr, acc, acc2);
  gemv_reduce<NT, R, kDual>(acc, acc2, red);
  if (threadIdx.x < R * NT) {
    const int r = threadIdx.x / NT, t = threadIdx.x % NT;
    if (r < rows && t < nt) {
      float v = red[threadIdx.x];
      if constexpr (kDual) v = silu(v) * red[R * NT + threadIdx.x];
      a.out[int64_t(row0 + t) * a.ldo + orow0 + r] = v;
    }
  }
}

// The expert of direct tile `tile` when gate/up routes the token itself: pick `tile` of its
// logits (chosen with the selection bias when kBiased), the shared expert for the last tile, -1
// past the tiles. Every thread of the block calls it with the same tile (route_filter_block has
// block barriers). In clusters (all of one tile), the first block selects and stores the expert
// into the others' handoff (their barrier_arrive before the PDL wait said they had started).
// Block (0, 0) also stores the ids and weights (as moe_route; down reads the ids before its
// wait, the combine the weights), fenced before the barrier that precedes the block's
// allow_dependents.
static_assert(kGemvThreads == kRouteThreads, "a GEMV block routes as a routing block");
template <int PL, bool kBiased>
__device__ __forceinline__ int routed_expert(const MoeGemmArgs& a, int tile,
                                             RouteFilterShared<PL>& s, int& handoff) {
  const MoeInKernelRoute& r = a.route;
  if (tile >= r.k) return a.direct_shared >= 0 && tile == a.direct_k - 1 ? a.direct_shared : -1;
  namespace cg = cooperative_groups;
  const unsigned rank = r.cluster > 1 ? cg::this_cluster().block_rank() : 0u;
  int e = -1;
  if (rank == 0) {
    const bool publish = blockIdx.x == 0 && tile == 0;
    float mx = 0.0f;
    double sum = 0.0;
    route_filter_block<PL, kBiased>(r.logits, r.k, s, r.scoring, publish, &mx, &sum);
    if (publish) {
      if (threadIdx.x < 32) {
        store_pick_keys<kBiased>(int(threadIdx.x), r.k, s.pick, r.logits, mx, sum, r.scoring, r.ids,
                                 r.weights);
        __threadfence();
      }
      __syncthreads();
    }
    e = expert_of_key(s.pick[tile]);
  }
  if (r.cluster > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.barrier_wait();  // every block of the cluster has started
    if (rank == 0 && threadIdx.x < unsigned(r.cluster) && threadIdx.x > 0) {
      *cluster.map_shared_rank(&handoff, int(threadIdx.x)) = e;
    }
    cluster.sync();
    if (rank != 0) e = handoff;
  }
  return e;
}

// Rows per warp: down's rows of one-byte (block-FP8) weights go eight to a warp, so a warp
// streams as many bytes as four bf16 rows (d_ff = 512 in FP8 is a single chunk per lane; ncu of
// the 80B-A3B's batch-1 down, H200: 19.1 -> 8.4 µs with the chunks widened lazily).
template <typename W, bool kDual>
constexpr int kWarpRows = kDual            ? 2
                          : sizeof(W) == 1 ? 8
                                           : 4;
// The warp kernel's arithmetic: this warp's RW rows (from orow0) of each of the block's row
// groups, for the nt ≤ NT tokens of the tile at row0, expert e. pre (kPre > 0 and preloaded):
// the first group's first kPre chunks per row, loaded before the PDL wait.
template <typename W, int NT, int RW, bool kDual, int kPre>
__device__ __forceinline__ void moe_warp_rows(const MoeGemmArgs& a, int e, int row0, int nt,
                                              int64_t orow0,
                                              const uint4 (&pre)[kPre > 0 ? kPre : 1][RW],
                                              bool preloaded) {
  constexpr int E = kChunkElems<W>;
  constexpr int64_t kGroupRows = (kGemvThreads / 32) * RW;
  const int lane = threadIdx.x % 32;
  const int64_t n_chunks = a.k / E;
  const float* xr[NT];
  moe_tile_rows<NT>(a, row0, nt, xr);
#pragma unroll 1
  for (int g = 0; g < a.row_groups; ++g) {
    const int64_t orow = orow0 + g * kGroupRows;
    if (orow >= a.m) break;
    const int rows = int(min64(RW, a.m - orow));
    const W* wr[RW];
    const W* wr2[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const int64_t off = (orow + (r < rows ? r : 0)) * a.k;
      wr[r] = static_cast<const W*>(a.w[e]) + off;
      wr2[r] = kDual ? static_cast<const W*>(a.w2[e]) + off : nullptr;
    }
    const int br = a.fp8_block_rows, bc = a.fp8_block_cols;
    const RowScales<W, RW> sc = row_scales<W, RW>(a.w[e], a.m, a.k, br, bc, orow, rows);
    const RowScales<W, RW> sc2 =
        kDual ? row_scales<W, RW>(a.w2[e], a.m, a.k, br, bc, orow, rows) : sc;
    float acc[RW][NT] = {}, acc2[RW][NT] = {};
    int64_t c0 = lane;
    if constexpr (kPre > 0) {
      if (preloaded && g == 0) {  // the preloaded chunks first, in the loop's order
#pragma unroll
        for (int p = 0; p < kPre; ++p) {
          const int64_t c = lane + int64_t(p) * 32;
          if (c < n_chunks) fma_chunk_raw<W, RW, NT>(pre[p], sc, xr, c, acc);
        }
        c0 = lane + int64_t(kPre) * 32;
      }
    }
    // For one token, sixteen 16-byte chunks in flight per lane (gate/up rows of 2048 bf16
    // take 8 chunks per lane: two round trips rather than four); more would only cost
    // registers, and so resident warps.
    constexpr int kUnroll = NT == 1 ? 16 / (RW * (kDual ? 2 : 1)) : 2;
#pragma unroll(kUnroll)
    for (int64_t c = c0; c < n_chunks; c += 32) {
      fma_chunk<W, RW, NT, kDual>(wr, wr2, sc, sc2, xr, c, acc, acc2);
    }
#pragma unroll
    for (int r = 0; r < RW; ++r) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float v = warp_sum(acc[r][t]);
        if constexpr (kDual) v = silu(v) * warp_sum(acc2[r][t]);
        if (lane == 0 && r < rows && t < nt) a.out[int64_t(row0 + t) * a.ldo + orow + r] = v;
      }
    }
  }
}

// The GEMV core for 16-byte aligned rows, a warp per few output rows: the lanes stride each
// row in 16-byte chunks and sum by shuffles, so a block (4 warps) streams 16 rows (32 of block-FP8
// down) of one expert (8 of each of gate and up when kDual, SwiGLU applied) per row group with no
// block barrier. The block-wide kernel above leaves threads idle on short rows (d_ff = 512: 64
// chunks) and its small blocks cost more to schedule than they stream.
// grid (⌈m/(4·RW·row_groups)⌉, max_tiles).
// PL > 0 (gate/up of one token, a.route set): the kernel routes the token itself after its
// wait (routed_expert; kBiasedRoute: a.route.scoring.bias set) and lets the down launch start
// only after the ids are stored. The biased selection is its own kernel (as a branch it took
// the bias-free kernels from 68-70 to 72-74 registers).
template <typename W, int NT, bool kDual, int PL = 0, bool kBiasedRoute = false>
__global__ void __launch_bounds__(kGemvThreads) moe_gemv_warp_kernel(MoeGemmArgs a) {
  static_assert(PL == 0 || (NT == 1 && kDual), "in-kernel routing is gate/up's, one token");
  static_assert(PL > 0 || !kBiasedRoute, "a biased route is an in-kernel route");
  constexpr int E = kChunkElems<W>, RW = kWarpRows<W, kDual>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int64_t kGroupRows = (kGemvThreads / 32) * RW;
  const int64_t orow0 = int64_t(blockIdx.x) * a.row_groups * kGroupRows + int64_t(warp) * RW;
  const int64_t n_chunks = a.k / E;
  __shared__ RouteFilterShared<(PL > 0 ? PL : 1)> route_shared;
  // One token's down rows (a.ids_early): the tile's expert is read and the first kPre chunks
  // per row are loaded before the PDL wait, while gate/up still runs. The id is read again after
  // the wait, which guarantees it (gate/up routing the token stores the ids and fences before
  // letting this launch start, which in practice makes them visible, but PDL promises
  // visibility only at the wait): on a difference the preloaded chunks are loaded again.
  // Not for block-FP8's eight rows: holding their chunks across the wait took the kernel to
  // 255 registers (80B-A3B batch-1 down 12.1 µs against 8.4 without, the step 2.75 -> 2.66 ms).
  constexpr int kPre = (NT == 1 && !kDual && RW == 4) ? 2 : 0;
  uint4 pre[kPre > 0 ? kPre : 1][RW];
  // This warp's first kPre chunks of each of its rows of expert e into pre.
  auto preload = [&](int e) {
    const int rows = int(min64(RW, a.m - orow0));
#pragma unroll
    for (int p = 0; p < kPre; ++p) {
      const int64_t c = lane + int64_t(p) * 32;
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const W* wr = static_cast<const W*>(a.w[e]) + (orow0 + (r < rows ? r : 0)) * a.k;
        if (c < n_chunks) pre[p][r] = load_streaming(wr + c * E);
      }
    }
  };
  int pre_e = -1;        // ≥ 0: the tile's expert, read before the wait (or routed here)
  bool recheck = false;  // pre_e came from the ids
  if constexpr (kPre > 0) {
    int e;
    if (a.ids_early && moe_direct_expert(a, blockIdx.y, e)) {
      pre_e = e;
      recheck = !(a.direct_shared >= 0 && int(blockIdx.y) == a.direct_k - 1);
      if (orow0 < a.m) preload(e);
    }
  }
  if constexpr (kDual && NT == 1) {
    // Gate/up of one token waits for the routing that picks its experts (the routing kernel,
    // or its own selection after the wait), a chain that leaves DRAM idle. The shared
    // expert's tile needs no routing: its rows are fetched into L2 meanwhile, and read from
    // there after the wait.
    if (a.direct_shared >= 0 && int(blockIdx.y) == a.direct_k - 1 && orow0 < a.m) {
      const int rows = int(min64(RW, a.m - orow0));
      const int64_t row_bytes = a.k * int64_t(sizeof(W));
      const char* gate = static_cast<const char*>(a.w[a.direct_shared]) + orow0 * row_bytes;
      const char* up = static_cast<const char*>(a.w2[a.direct_shared]) + orow0 * row_bytes;
      for (int64_t off = int64_t(lane) * 128; off < rows * row_bytes; off += 32 * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(gate + off));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(up + off));
      }
    }
  }
  if constexpr (PL > 0) {
    // After the wait (the router directly before wrote the logits), before any warp leaves
    // (the selection has block barriers); the next launch only after the ids are stored.
    __shared__ int handoff;
    if (a.route.cluster > 1 && int(blockIdx.y) < a.route.k)
      cooperative_groups::this_cluster().barrier_arrive();
    grid_dependency_wait();
    pre_e = routed_expert<PL, kBiasedRoute>(a, int(blockIdx.y), route_shared, handoff);
    allow_dependents();
  } else {
    grid_dependency_sync();
  }
  if (orow0 >= a.m) return;  // warp-uniform, and nothing below waits for the block
  int e, row0, nt;
  if (pre_e >= 0) {
    e = pre_e, row0 = int(blockIdx.y), nt = 1;
  } else if (PL > 0 || !moe_tile(a, blockIdx.y, e, row0, nt)) {
    return;
  }
  if constexpr (kPre > 0) {
    if (recheck) {
      const int checked = __ldcg(a.direct_ids + blockIdx.y);
      if (checked != e) {  // the id read early was stale: the preloaded chunks again, from it
        if (checked < 0 || checked >= a.n_experts) __trap();  // ids come from routing
        e = checked;
        preload(e);
      }
    }
  }
  if constexpr (NT > 1) {
    // A decode batch's tiles mostly hold fewer rows than NT (64 sequences average two tokens
    // per expert): each takes the loop of its row count, with the same sums (a row's result
    // does not depend on NT) and a fraction of the FMAs and activation loads. The 35B-A3B's
    // 64-sequence step went from 28.6 to 25.8 ms (H200, bench/results/h200-session12-*).
    if (nt == 1) {
      moe_warp_rows<W, 1, RW, kDual, 0>(a, e, row0, nt, orow0, pre, false);
      return;
    }
    if constexpr (NT == 4) {
      if (nt == 2) {
        moe_warp_rows<W, 2, RW, kDual, 0>(a, e, row0, nt, orow0, pre, false);
        return;
      }
    }
  }
  moe_warp_rows<W, NT, RW, kDual, kPre>(a, e, row0, nt, orow0, pre, pre_e >= 0);
}

template <typename W, int NT, bool kDual>
void launch_moe_gemv(const MoeGemmArgs& a, bool vec, unsigned max_tiles, cudaStream_t stream) {
  constexpr int R = kDual ? 2 : 4;
  const dim3 grid(unsigned((a.m + R - 1) / R), max_tiles);
  if (vec) {
    launch_kernel(moe_gemv_kernel<W, NT, kDual, true>, grid, kGemvThreads, 0, stream, a);
  } else {
    launch_kernel(moe_gemv_kernel<W, NT, kDual, false>, grid, kGemvThreads, 0, stream, a);
  }
}

// a.route.cluster > 1 (routing in gate/up): clusters of up to that many blocks, halved until
// they divide a tile's blocks.
template <typename W, int NT, bool kDual, int PL = 0, bool kBiasedRoute = false>
void launch_moe_gemv_warp(const MoeGemmArgs& a, unsigned max_tiles, cudaStream_t stream) {
  const int64_t rows_per_block = kWarpRows<W, kDual> * (kGemvThreads / 32) * a.row_groups;
  const dim3 grid(unsigned((a.m + rows_per_block - 1) / rows_per_block), max_tiles);
  MoeGemmArgs b = a;
  while (b.route.cluster > 1 && grid.x % unsigned(b.route.cluster) != 0) b.route.cluster /= 2;
  launch_kernel_clusters(moe_gemv_warp_kernel<W, NT, kDual, PL, kBiasedRoute>, grid, kGemvThreads,
                         0, stream, unsigned(b.route.cluster), b);
}

// Row groups per warp-kernel block for tiles of nt > 1 rows (decode batches), measured on the
// Qwen3.5-35B-A3B decode (H200, bench/results/h200-session11-*): down blocks that stream about
// 64 KiB each (4 groups of 16 rows of 512 bf16) took the 64-sequence step from 33.5 to 31.2 ms,
// and two groups of gate/up rows for tiles of 4 rows to 30.6 ms. One-token tiles keep one group
// (two made the batch-1 step 3% slower).
template <typename W, bool kDual>
int warp_row_groups(const MoeGemmArgs& a, int nt) {
  if (nt <= 1) return 1;
  if constexpr (kDual) {
    return nt == 4 ? 2 : 1;
  } else {
    const int64_t group_bytes =
        kWarpRows<W, false> * (kGemvThreads / 32) * a.k * int64_t(sizeof(W));
    return int(std::clamp<int64_t>((64 << 10) / std::max<int64_t>(group_bytes, 1), 1, 8));
  }
}

template <typename W, bool kDual>
void launch_moe_gemv_nt(const MoeGemmArgs& a_in, int nt, bool vec, unsigned max_tiles,
                        cudaStream_t stream) {
  MoeGemmArgs a = a_in;
  a.row_groups = warp_row_groups<W, kDual>(a, nt);
  if (vec && nt <= 4) {  // eight rows of two matrices would cost the warp kernel registers
    if (nt == 1) {
      launch_moe_gemv_warp<W, 1, kDual>(a, max_tiles, stream);
    } else if (nt == 2) {
      launch_moe_gemv_warp<W, 2, kDual>(a, max_tiles, stream);
    } else {
      launch_moe_gemv_warp<W, 4, kDual>(a, max_tiles, stream);
    }
    return;
  }
  if (nt == 1) {
    launch_moe_gemv<W, 1, kDual>(a, vec, max_tiles, stream);
  } else if (nt == 2) {
    launch_moe_gemv<W, 2, kDual>(a, vec, max_tiles, stream);
  } else if (nt <= 4) {
    launch_moe_gemv<W, 4, kDual>(a, vec, max_tiles, stream);
  } else {
    launch_moe_gemv<W, 8, kDual>(a, vec, max_tiles, stream);
  }
}

}  // namespace

void launch_moe_gemv_experts(const MoeGemmArgs& a, DType wdt, bool gate_up, int nt, bool vec,
                             unsigned max_tiles, cudaStream_t stream) {
  dispatch_gemv_weight(wdt, [&](auto tag) {
    using W = decltype(tag);
    if (gate_up) {
      launch_moe_gemv_nt<W, true>(a, nt, vec, max_tiles, stream);
    } else {
      launch_moe_gemv_nt<W, false>(a, nt, vec, max_tiles, stream);
    }
  });
}

// The warp kernel for the expert count kRouteThreads·PL (routes_in_kernels checked PL) and for
// the selection bias or none.
void launch_moe_gemv_routed(const MoeGemmArgs& a, DType wdt, int PL, unsigned tiles,
                            cudaStream_t stream) {
  dispatch_gemv_weight(wdt, [&](auto tag) {
    using W = decltype(tag);
    auto launch = [&](auto biased) {  // std::true_type or std::false_type
      constexpr bool kBiased = decltype(biased)::value;
      if (PL == 1) {
        launch_moe_gemv_warp<W, 1, true, 1, kBiased>(a, tiles, stream);
      } else if (PL == 2) {
        launch_moe_gemv_warp<W, 1, true, 2, kBiased>(a, tiles, stream);
      } else {
        launch_moe_gemv_warp<W, 1, true, 4, kBiased>(a, tiles, stream);
      }
    };
    if (a.route.scoring.bias) {
      launch(std::true_type{});
    } else {
      launch(std::false_type{});
    }
  });
}

}  // namespace recur::cuda
