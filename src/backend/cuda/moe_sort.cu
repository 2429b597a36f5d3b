// The MoE experts' sort for prompts: the (token, expert) pairs ordered by expert on the device
// (nothing returns to the host), and the tile list the grouped GEMMs walk. Up to 2,048 pairs
// (decode batches, short prompts) one block does everything in one launch. More pairs take three
// kernels: each of up to kMoeSortBlocks blocks counts its own slice of the pairs per expert; one
// block turns the counts into each expert's rows and tiles and each slice's first row of each
// expert; the slices' blocks then place their pairs. (One block for everything took 37 µs a
// layer for 2,048 tokens × 11 pairs and 1.1 ms for 65,536 on the H200:
// bench/results/h200-session30-run1-prof-65k.txt.)
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

// The pairs of a sort: pair (t, j) = t·slots + j is expert ids[t, j] for j < k, else E − 1;
// slice b (block b of the count and place kernels) holds pairs [b·per, (b + 1)·per).
struct SortPairs {
  const int32_t* ids;
  int64_t ld_ids;
  int n, k, slots, E, per;
  __device__ int pairs() const { return n * slots; }
  __device__ int expert(int p) const {
    const int j = p % slots;
    const int e = j < k ? ids[int64_t(p / slots) * ld_ids + j] : E - 1;
    if (e < 0 || e >= E) __trap();  // ids come from moe_route; anything else is a bug
    return e;
  }
  __device__ int first(int b) const { return b * per; }
  __device__ int end(int b) const { return min(pairs(), (b + 1) * per); }
};

// The block's slice b counted per expert into hist [E] (shared; the block's threads).
__device__ void count_slice(const SortPairs& sp, int b, int* hist) {
  for (int e = threadIdx.x; e < sp.E; e += kSortThreads) hist[e] = 0;
  __syncthreads();
  for (int p = sp.first(b) + int(threadIdx.x); p < sp.end(b); p += kSortThreads) {
    atomicAdd(&hist[sp.expert(p)], 1);
  }
  __syncthreads();
}

// From each expert's pair count [E], its first row (offset) and first tile [E] and the tile
// list (tiles of up to tm rows of one expert): one block, count to first_tile in shared memory.
__device__ void rows_and_tiles(const int* count, int* offset, int* first_tile, int E, int tm,
                               const MoeSortOut& m) {
  __shared__ int warp_a[kSortThreads / 32], warp_b[kSortThreads / 32], tot_a, tot_b;
  const int tid = threadIdx.x;
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

// The block's slice b placed from cursor [E] (shared: each expert's next row); the order within
// an expert does not matter (each row's products depend on its token alone).
__device__ void place_slice(const SortPairs& sp, int b, int* cursor, const MoeSortOut& m) {
  for (int p = sp.first(b) + int(threadIdx.x); p < sp.end(b); p += kSortThreads) {
    const int row = atomicAdd(&cursor[sp.expert(p)], 1);
    m.token_of[row] = p / sp.slots;
    m.row_of[p] = row;
  }
}

// One slice, one block: count, rows and tiles, place. Shared: count, offset, first tile [E].
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_kernel(SortPairs sp, int tm, MoeSortOut m) {
  grid_dependency_sync();
  extern __shared__ int sh[];
  int *count = sh, *offset = count + sp.E, *first_tile = offset + sp.E;
  count_slice(sp, 0, count);
  rows_and_tiles(count, offset, first_tile, sp.E, tm, m);
  __syncthreads();                // the tile list has read every offset
  place_slice(sp, 0, offset, m);  // offset[e] becomes expert e's next row
}

// Block b: counts [b, E] = its slice's pairs per expert. Shared: [E].
__global__ void __launch_bounds__(kSortThreads) moe_sort_count_kernel(SortPairs sp, int* counts) {
  grid_dependency_sync();
  extern __shared__ int hist[];
  count_slice(sp, int(blockIdx.x), hist);
  for (int e = threadIdx.x; e < sp.E; e += kSortThreads) {
    counts[int64_t(blockIdx.x) * sp.E + e] = hist[e];
  }
}

// One block: from counts [slices, E] the rows and tiles, and counts [b, e] turned into slice
// b's first row of expert e. Shared: count, offset, first tile [E].
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_tiles_kernel(int slices, int E, int tm, int* counts, MoeSortOut m) {
  grid_dependency_sync();
  extern __shared__ int sh[];
  int *count = sh, *offset = count + E, *first_tile = offset + E;
  for (int e = threadIdx.x; e < E; e += kSortThreads) {
    int c = 0;
    for (int b = 0; b < slices; ++b) c += counts[int64_t(b) * E + e];
    count[e] = c;
  }
  __syncthreads();
  rows_and_tiles(count, offset, first_tile, E, tm, m);
  for (int e = threadIdx.x; e < E; e += kSortThreads) {
    int row = offset[e];
    for (int b = 0; b < slices; ++b) {
      int& c = counts[int64_t(b) * E + e];
      const int mine = c;
      c = row, row += mine;
    }
  }
}

// Block b places its slice from its first rows of each expert (firsts [b, E]). Shared: [E].
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_place_kernel(SortPairs sp, const int* firsts, MoeSortOut m) {
  grid_dependency_sync();
  extern __shared__ int cursor[];
  for (int e = threadIdx.x; e < sp.E; e += kSortThreads) {
    cursor[e] = firsts[int64_t(blockIdx.x) * sp.E + e];
  }
  __syncthreads();
  place_slice(sp, int(blockIdx.x), cursor, m);
}

}  // namespace

void launch_moe_sort(const int32_t* ids, int64_t ld_ids, int n, int k, int slots, int E, int tm,
                     const MoeSortOut& out, cudaStream_t stream) {
  const int pairs = n * slots, slices = moe_sort_slices(pairs);
  const SortPairs sp{ids, ld_ids, n, k, slots, E, (pairs + slices - 1) / slices};
  const size_t hist = size_t(E) * sizeof(int);
  opt_in_smem<moe_sort_kernel>(3 * hist);  // beyond 48 KB (E > 4,096)
  opt_in_smem<moe_sort_tiles_kernel>(3 * hist);
  if (slices == 1) {
    launch_kernel(moe_sort_kernel, 1, kSortThreads, 3 * hist, stream, sp, tm, out);
    return;
  }
  launch_kernel(moe_sort_count_kernel, unsigned(slices), kSortThreads, hist, stream, sp,
                out.slice_rows);
  launch_kernel(moe_sort_tiles_kernel, 1, kSortThreads, 3 * hist, stream, slices, E, tm,
                out.slice_rows, out);
  launch_kernel(moe_sort_place_kernel, unsigned(slices), kSortThreads, hist, stream, sp,
                static_cast<const int*>(out.slice_rows), out);
}

}  // namespace recur::cuda
