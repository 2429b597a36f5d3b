// The MoE experts' sort for prompts: the (token, expert) pairs ordered by expert in one block
// on the device (nothing returns to the host), and the tile list the grouped GEMMs walk.
#include "backend/cuda/moe.cuh"

namespace recur::cuda {

namespace {

constexpr int kSortThreads = 1024;

// Exclusive prefix sums of two per-thread values across the block; returns totals in *tot.
__device__ void block_scan2(int& a, int& b, int* warp_a, int* warp_b, int* tot_a, int* tot_b) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  int sa = a, sb = b;
  for (int o = 1; o < 32; o <<= 1) {
    const int ya = __shfl_up_sync(0xffffffffu, sa, o), yb = __shfl_up_sync(0xffffffffu, sb, o);
    if (lane >= o) sa += ya, sb += yb;
  }
  if (lane == 31) warp_a[warp] = sa, warp_b[warp] = sb;
  __syncthreads();
  if (threadIdx.x == 0) {
    int ra = 0, rb = 0;
    for (int w = 0; w < n_warps; ++w) {
      const int va = warp_a[w], vb = warp_b[w];
      warp_a[w] = ra, warp_b[w] = rb;
      ra += va, rb += vb;
    }
    *tot_a = ra, *tot_b = rb;
  }
  __syncthreads();
  a = sa - a + warp_a[warp];
  b = sb - b + warp_b[warp];
}

// One block: counting sort of the n·slots (token, expert) pairs by expert, and the tile list
// (tiles of up to tm rows of one expert); pair (t, j) is expert ids[t, j] for j < k, else E − 1.
// Shared: count, offset, cursor, first tile [E] each.
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_kernel(const int32_t* ids, int64_t ld_ids, int n, int k, int slots, int E, int tm,
                    MoeSortOut m) {
  grid_dependency_sync();
  extern __shared__ int sh[];
  int* count = sh;
  int* offset = count + E;
  int* cursor = offset + E;
  int* first_tile = cursor + E;
  __shared__ int warp_a[kSortThreads / 32], warp_b[kSortThreads / 32], tot_a, tot_b;
  const int pairs = n * slots, tid = threadIdx.x;
  auto expert_of = [&](int p) {
    const int j = p % slots;
    return j < k ? ids[int64_t(p / slots) * ld_ids + j] : E - 1;
  };
  for (int e = tid; e < E; e += kSortThreads) count[e] = 0, cursor[e] = 0;
  __syncthreads();
  for (int p = tid; p < pairs; p += kSortThreads) {
    const int e = expert_of(p);
    if (e < 0 || e >= E) __trap();  // ids come from moe_route; anything else is a bug
    atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // Each thread scans a contiguous range of experts.
  const int per = (E + kSortThreads - 1) / kSortThreads;
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int rows = 0, tiles = 0;
  for (int e = e0; e < e1; ++e) rows += count[e], tiles += (count[e] + tm - 1) / tm;
  block_scan2(rows, tiles, warp_a, warp_b, &tot_a, &tot_b);
  for (int e = e0; e < e1; ++e) {
    offset[e] = rows, first_tile[e] = tiles;
    rows += count[e], tiles += (count[e] + tm - 1) / tm;
  }
  __syncthreads();
  for (int p = tid; p < pairs; p += kSortThreads) {
    const int t = p / slots, e = expert_of(p);
    const int row = offset[e] + atomicAdd(&cursor[e], 1);
    m.token_of[row] = t;
    m.row_of[p] = row;
  }
  for (int e = tid; e < E; e += kSortThreads) {
    const int c = count[e];
    for (int q = 0; q * tm < c; ++q) {
      const int tile = first_tile[e] + q;
      m.tile_expert[tile] = e;
      m.tile_row0[tile] = offset[e] + q * tm;
      m.tile_rows[tile] = min(tm, c - q * tm);
    }
  }
  if (tid == 0) *m.n_tiles = tot_b;
}

}  // namespace

void launch_moe_sort(const int32_t* ids, int64_t ld_ids, int n, int k, int slots, int E, int tm,
                     const MoeSortOut& out, cudaStream_t stream) {
  const size_t smem = size_t(4 * E) * sizeof(int);
  opt_in_smem<moe_sort_kernel>(smem);  // beyond 48 KB (E > 3,072)
  launch_kernel(moe_sort_kernel, 1, kSortThreads, smem, stream, ids, ld_ids, n, k, slots, E, tm,
                out);
}

}  // namespace recur::cuda
