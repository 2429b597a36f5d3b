// Mixture of experts on the GPU. Routing: a warp per token, f32 softmax with a double sum and
// top-k by (logit desc, index asc), as on the CPU. Experts: (token, expert) pairs are sorted by
// expert on the device (one block; nothing returns to the host), cut into tiles of one
// expert's rows, and run as grouped GEMMs over a grid sized by the worst case whose surplus
// blocks exit at once:
//   ≤ kGemvMaxTokens tokens, or few rows per expert (decode batches): the GEMV core
//     (gemv.cuh), f32 arithmetic, each chosen expert's weights read once per tile of ≤ 4 rows;
//   more tokens, BF16/F16 experts: tensor-core tiles (moe_wmma.cu) on activations split
//     exactly into three 16-bit terms (f32-class results, like the cuBLAS matmul path);
//   more tokens, F32 experts: the GEMV core over tiles of 8 rows.
// Gate and up run fused with SwiGLU; a final pass sums each token's k expert outputs in its
// own routing order (deterministic, no atomics).
#include <algorithm>
#include <cstdlib>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/gemv.cuh"
#include "backend/cuda/moe.cuh"

namespace recur {

using namespace cuda;

namespace {

constexpr int kSortThreads = 1024;

// Carve-up of the experts' scratch for n tokens (the same offsets for sizing and use).
struct MoeScratch {
  float* hs;                                     // [pairs, d_ff] SwiGLU outputs
  float* ys;                                     // [pairs, d] expert outputs
  int32_t* token_of;                             // [pairs] token of each sorted row
  int32_t* row_of;                               // [pairs] sorted row of pair (t, j)
  int32_t *tile_expert, *tile_row0, *tile_rows;  // [pairs]
  int32_t* n_tiles;                              // [1]
  size_t bytes;
  MoeScratch(void* base, int64_t n, int64_t k, int64_t d, int64_t d_ff) {
    const int64_t pairs = n * k;
    char* p = static_cast<char*>(base);
    auto take = [&](int64_t count, size_t elem) {
      char* r = p;
      p += (size_t(count) * elem + 255) / 256 * 256;
      return r;
    };
    hs = reinterpret_cast<float*>(take(pairs * d_ff, 4));
    ys = reinterpret_cast<float*>(take(pairs * d, 4));
    token_of = reinterpret_cast<int32_t*>(take(pairs, 4));
    row_of = reinterpret_cast<int32_t*>(take(pairs, 4));
    tile_expert = reinterpret_cast<int32_t*>(take(pairs, 4));
    tile_row0 = reinterpret_cast<int32_t*>(take(pairs, 4));
    tile_rows = reinterpret_cast<int32_t*>(take(pairs, 4));
    n_tiles = reinterpret_cast<int32_t*>(take(1, 4));
    bytes = size_t(p - static_cast<char*>(base));
  }
};

// One warp per token of logits [n, E]: ids, weights [n, k]. With PL > 0 each lane keeps its
// experts' logits (e = lane + 32·i, E ≤ 32·PL) in registers across the k selection rounds;
// PL = 0 re-reads them from memory (large E).
template <int PL>
__global__ void moe_route_kernel(const float* logits, int64_t ld, int n, int E, int k,
                                 bool norm_topk, int32_t* ids, int64_t ld_ids, float* weights,
                                 int64_t ld_w) {
  grid_dependency_sync();
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= n) return;
  const float* l = logits + int64_t(t) * ld;
  float reg[PL > 0 ? PL : 1];
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = lane + 32 * i;
    reg[i] = e < E ? l[e] : -INFINITY;
  }
  // for_each(fn): fn(e, logit) over this lane's experts.
  auto for_each = [&](auto&& fn) {
    if constexpr (PL > 0) {
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        if (lane + 32 * i < E) fn(lane + 32 * i, reg[i]);
      }
    } else {
      for (int e = lane; e < E; e += 32) fn(e, l[e]);
    }
  };
  float mx = -INFINITY;
  for_each([&](int, float v) { mx = fmaxf(mx, v); });
  mx = warp_max(mx);
  double sum = 0.0;
  for_each([&](int, float v) { sum += exp(double(v - mx)); });
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  // The j-th pick is the largest (value desc, index asc) strictly after the (j-1)-th.
  float prev_v = INFINITY;
  int prev_i = -1;
  // Moves (prev_v, prev_i) to the next pick; every lane of the warp agrees on it.
  auto next_pick = [&]() {
    float best_v = -INFINITY;
    int best_i = E;
    for_each([&](int e, float v) {
      const bool after = v < prev_v || (v == prev_v && e > prev_i);
      if (after && (v > best_v || (v == best_v && e < best_i))) best_v = v, best_i = e;
    });
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      if (ov > best_v || (ov == best_v && oi < best_i)) best_v = ov, best_i = oi;
    }
    prev_v = best_v, prev_i = best_i;
  };
  double kept = 0.0;
  int32_t* id_row = ids + int64_t(t) * ld_ids;
  float* w_row = weights + int64_t(t) * ld_w;
  if (k <= 32) {
    // Lane j keeps the j-th pick; the k probabilities (double exp and divide) are then
    // computed side by side rather than one per selection round, with the same formulas,
    // and summed on lane 0 in pick order.
    float my_v = -INFINITY;
    int my_i = E;
    for (int j = 0; j < k; ++j) {
      next_pick();
      if (lane == j) my_v = prev_v, my_i = prev_i;
    }
    const double p = lane < k ? exp(double(my_v - mx)) / sum : 0.0;
    for (int j = 0; j < k; ++j) kept += __shfl_sync(0xffffffffu, p, j);
    if (lane < k) {
      float wf = float(p);
      if (norm_topk) wf = float(double(wf) / kept);
      id_row[lane] = my_i;
      w_row[lane] = wf;
    }
    return;
  }
  for (int j = 0; j < k; ++j) {
    next_pick();
    const double p = exp(double(prev_v - mx)) / sum;
    kept += p;
    if (lane == 0) {
      id_row[j] = prev_i;
      w_row[j] = float(p);
    }
  }
  if (norm_topk && lane == 0) {
    for (int j = 0; j < k; ++j) w_row[j] = float(double(w_row[j]) / kept);
  }
}

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

// One block: counting sort of the n·k (token, expert) pairs by expert, and the tile list
// (tiles of up to tm rows of one expert). Shared: count, offset, cursor, first tile [E] each.
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_kernel(const int32_t* ids, int64_t ld_ids, int n, int k, int E, int tm, MoeScratch m) {
  grid_dependency_sync();
  extern __shared__ int sh[];
  int* count = sh;
  int* offset = count + E;
  int* cursor = offset + E;
  int* first_tile = cursor + E;
  __shared__ int warp_a[kSortThreads / 32], warp_b[kSortThreads / 32], tot_a, tot_b;
  const int pairs = n * k, tid = threadIdx.x;
  for (int e = tid; e < E; e += kSortThreads) count[e] = 0, cursor[e] = 0;
  __syncthreads();
  for (int p = tid; p < pairs; p += kSortThreads) {
    const int e = ids[int64_t(p / k) * ld_ids + p % k];
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
    const int t = p / k, e = ids[int64_t(t) * ld_ids + p % k];
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
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int r = row0 + (t < nt ? t : 0);
    xr[t] = a.x + (a.x_row ? int64_t(a.x_row[r]) : int64_t(r)) * a.ldx;
  }
  const W* w = static_cast<const W*>(a.w[e]) + orow0 * a.k;
  const W* w2 = kDual ? static_cast<const W*>(a.w2[e]) + orow0 * a.k : nullptr;
  float acc[R][NT] = {}, acc2[R][NT] = {};
  gemv_partial<W, NT, R, kDual, kVec>(w, w2, a.k, rows, xr, acc, acc2);
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

// The GEMV core for 16-byte aligned rows, a warp per few output rows: the lanes stride each
// row in 16-byte chunks and sum by shuffles, so a block (4 warps) streams 16 rows of one
// expert (8 of each of gate and up when kDual, SwiGLU applied) with no block barrier. The
// block-wide kernel above leaves threads idle on short rows (d_ff = 512: 64 chunks) and its
// small blocks cost more to schedule than they stream. grid (⌈m/(4·RW)⌉, max_tiles).
template <bool kDual>
constexpr int kWarpRows = kDual ? 2 : 4;
template <typename W, int NT, bool kDual>
__global__ void __launch_bounds__(kGemvThreads) moe_gemv_warp_kernel(MoeGemmArgs a) {
  grid_dependency_sync();
  constexpr int E = Chunk<W>::kElems, RW = kWarpRows<kDual>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t orow0 = (int64_t(blockIdx.x) * (kGemvThreads / 32) + warp) * RW;
  if (orow0 >= a.m) return;  // warp-uniform, and nothing below waits for the block
  int e, row0, nt;
  if (!moe_tile(a, blockIdx.y, e, row0, nt)) return;
  const int rows = int(min64(RW, a.m - orow0));
  const float* xr[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int r = row0 + (t < nt ? t : 0);
    xr[t] = a.x + (a.x_row ? int64_t(a.x_row[r]) : int64_t(r)) * a.ldx;
  }
  const W* wr[RW];
  const W* wr2[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int64_t off = (orow0 + (r < rows ? r : 0)) * a.k;
    wr[r] = static_cast<const W*>(a.w[e]) + off;
    wr2[r] = kDual ? static_cast<const W*>(a.w2[e]) + off : nullptr;
  }
  float acc[RW][NT] = {}, acc2[RW][NT] = {};
  const int64_t n_chunks = a.k / E;
#pragma unroll 2
  for (int64_t c = lane; c < n_chunks; c += 32) {
    fma_chunk<W, RW, NT, kDual>(wr, wr2, xr, c, acc, acc2);
  }
#pragma unroll
  for (int r = 0; r < RW; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float v = warp_sum(acc[r][t]);
      if constexpr (kDual) v = silu(v) * warp_sum(acc2[r][t]);
      if (lane == 0 && r < rows && t < nt) a.out[int64_t(row0 + t) * a.ldo + orow0 + r] = v;
    }
  }
}

// out[t, :] = Σ_j weights[t, j] · ys[row_of[t·k + j], :] (row_of null: the identity); grid
// (tokens, column blocks), a thread per column (a single block per token is latency-bound).
__global__ void moe_combine_kernel(const float* ys, const int32_t* row_of, const float* weights,
                                   int64_t ld_w, int k, int64_t d, float* out, int64_t ldo) {
  grid_dependency_sync();
  const int t = blockIdx.x;
  for (int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; c < d;
       c += int64_t(gridDim.y) * blockDim.x) {
    float o = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int row = row_of ? row_of[t * k + j] : t * k + j;
      o += weights[int64_t(t) * ld_w + j] * ys[int64_t(row) * d + c];
    }
    out[int64_t(t) * ldo + c] = o;
  }
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

template <typename W, int NT, bool kDual>
void launch_moe_gemv_warp(const MoeGemmArgs& a, unsigned max_tiles, cudaStream_t stream) {
  constexpr int64_t kRowsPerBlock = kWarpRows<kDual> * (kGemvThreads / 32);
  const dim3 grid(unsigned((a.m + kRowsPerBlock - 1) / kRowsPerBlock), max_tiles);
  launch_kernel(moe_gemv_warp_kernel<W, NT, kDual>, grid, kGemvThreads, 0, stream, a);
}

template <typename W, bool kDual>
void launch_moe_gemv_nt(const MoeGemmArgs& a, int nt, bool vec, unsigned max_tiles,
                        cudaStream_t stream) {
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

void CudaOps::moe_route(const Tensor& logits, int k, bool norm_topk, Tensor ids, Tensor weights) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t n = logits.shape[0], E = logits.shape[1];
  RECUR_CHECK(k >= 1 && k <= E && E <= 4096 && k <= 64 && logits.stride[1] == 1);
  RECUR_CHECK(ids.dtype == DType::I32 && ids.shape[1] == k && weights.shape[1] == k);
  if (n == 0) return;
  Impl& s = *impl_;
  auto launch = [&](auto kernel) {
    launch_kernel(kernel, blocks_for(n, 4), 128, 0, s.stream, logits.ptr<float>(), logits.stride[0],
                  int(n), int(E), k, norm_topk, ids.ptr<int32_t>(), ids.stride[0],
                  weights.ptr<float>(), weights.stride[0]);
  };
  if (E <= 128) {
    launch(moe_route_kernel<4>);
  } else if (E <= 512) {
    launch(moe_route_kernel<16>);
  } else if (E <= 1024) {
    launch(moe_route_kernel<32>);
  } else {
    launch(moe_route_kernel<0>);
  }
  s.launched("moe_route");
}

size_t CudaOps::moe_experts_scratch_bytes(int n_tokens, int k, int n_experts, int d,
                                          int d_ff) const {
  return MoeScratch(nullptr, n_tokens, k, d, d_ff).bytes;
}

void CudaOps::moe_experts(const Tensor& x, std::span<const ExpertWeights> experts,
                          const Tensor& ids, const Tensor& weights, Tensor out, Tensor scratch) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t n = x.shape[0], d = x.row_size(), k = ids.shape[1];
  const int64_t E = int64_t(experts.size());
  RECUR_CHECK(E >= 1 && E <= 4096 && x.dtype == DType::F32 && out.row_size() == d);
  const int64_t d_ff = experts[0].gate.shape[0];
  const DType wdt = experts[0].gate.dtype;
  bool aligned = true;
  for (const ExpertWeights& ew : experts) {
    RECUR_CHECK(ew.gate.dtype == wdt && ew.up.dtype == wdt && ew.down.dtype == wdt);
    RECUR_CHECK(ew.gate.shape[0] == d_ff && ew.gate.shape[1] == d && ew.up.shape[0] == d_ff &&
                ew.up.shape[1] == d && ew.down.shape[0] == d && ew.down.shape[1] == d_ff);
    for (const Tensor* t : {&ew.gate, &ew.up, &ew.down}) {
      aligned &= (reinterpret_cast<uintptr_t>(t->data) & 15) == 0;
    }
  }
  if (n == 0) return;
  MoeScratch m(scratch.data, n, k, d, d_ff);
  RECUR_CHECK(size_t(scratch.numel()) * dtype_size(scratch.dtype) >= m.bytes);
  Impl& s = *impl_;
  const void* const* table = s.expert_table(experts);
  const int64_t pairs = n * k;

  // Tile rows: for decode 1 or 2 (a few tokens rarely share an expert, and the GEMV core's
  // cost grows with its row count); 2 or 4 while experts average at most 4 rows (decode
  // batches: every expert's weights streamed once, the FMAs still under the loads); then 64
  // for tensor cores, 8 for f32 experts. RECUR_CUDA_MOE_TENSOR_CORES=0 keeps the GEMV core.
  const bool small = n <= kGemvMaxTokens;
  const bool few_per_expert = !small && pairs <= 4 * E;
  static const bool allow_tc = [] {
    const char* e = std::getenv("RECUR_CUDA_MOE_TENSOR_CORES");
    return !(e && e[0] == '0');
  }();
  const bool tensor_cores = allow_tc && !small && !few_per_expert && wdt != DType::F32;
  const int tm = small            ? (n == 1 ? 1 : 2)
                 : few_per_expert ? (pairs <= E ? 2 : 4)
                 : tensor_cores   ? kWmmaTileRows
                                  : 8;
  const int64_t max_tiles = std::min<int64_t>(pairs, (pairs + tm - 1) / tm + std::min(E, pairs));

  // One token: tile j is its pair j (the GEMV core gives the same per-pair arithmetic as the
  // sorted tiles of one row), so the sort's launch is skipped.
  const bool direct = n == 1;
  if (!direct) {
    const size_t sort_smem = size_t(4 * E) * sizeof(int);
    if (sort_smem > (48 << 10)) {
      RECUR_CUDA_CHECK(cudaFuncSetAttribute(
          moe_sort_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sort_smem)));
    }
    launch_kernel(moe_sort_kernel, 1, kSortThreads, sort_smem, s.stream, ids.ptr<int32_t>(),
                  ids.stride[0], int(n), int(k), int(E), tm, m);
    s.launched("moe_experts (sort)");
  }

  MoeGemmArgs up{};
  up.w = table, up.w2 = table + E, up.m = d_ff, up.k = d;
  up.x = x.ptr<float>(), up.ldx = x.stride[0], up.x_row = m.token_of;
  up.out = m.hs, up.ldo = d_ff;
  up.tile_expert = m.tile_expert, up.tile_row0 = m.tile_row0, up.tile_rows = m.tile_rows;
  up.n_tiles = m.n_tiles, up.w_aligned = aligned;
  if (direct) {
    up.direct_ids = ids.ptr<int32_t>(), up.direct_k = int(k), up.n_experts = int(E);
    up.x_row = nullptr, up.ldx = 0;  // every pair reads the one token's row
  }
  MoeGemmArgs down = up;
  down.w = table + 2 * E, down.w2 = nullptr, down.m = d, down.k = d_ff;
  down.x = m.hs, down.ldx = d_ff, down.x_row = nullptr;
  down.out = m.ys, down.ldo = d;

  if (tensor_cores) {
    launch_moe_wmma(up, wdt, true, unsigned(max_tiles), s.stream);
    s.launched("moe_experts (gate/up, tensor cores)");
    launch_moe_wmma(down, wdt, false, unsigned(max_tiles), s.stream);
    s.launched("moe_experts (down, tensor cores)");
  } else {
    dispatch_weight(wdt, [&](auto tag) {
      using W = decltype(tag);
      constexpr int64_t E16 = Chunk<W>::kElems;
      const bool x_vec = (reinterpret_cast<uintptr_t>(x.data) & 15) == 0 && x.stride[0] % 4 == 0;
      launch_moe_gemv_nt<W, true>(up, tm, aligned && x_vec && d % E16 == 0, unsigned(max_tiles),
                                  s.stream);
      s.launched("moe_experts (gate/up)");
      launch_moe_gemv_nt<W, false>(down, tm, aligned && d_ff % E16 == 0, unsigned(max_tiles),
                                   s.stream);
      s.launched("moe_experts (down)");
    });
  }
  const dim3 combine_grid(unsigned(n), unsigned(std::min<int64_t>((d + 255) / 256, 64)));
  launch_kernel(moe_combine_kernel, combine_grid, 256, 0, s.stream, m.ys,
                direct ? nullptr : m.row_of, weights.ptr<float>(), weights.stride[0], int(k), d,
                out.ptr<float>(), out.stride[0]);
  s.launched("moe_experts (combine)");
}

}  // namespace recur
