// out[n, m] = x[n, k] · w[m, k]^T (or out += that), w in its stored dtype. Block-FP8 weights
// take the GEMV kernel up to kFp8GemvMaxTokens tokens, then kernels_fp8.cu's tensor-core tiles.
//
// Up to kGemvMaxTokens tokens (decode): the GEMV kernel of gemv.cuh, f32 arithmetic, reading
// each weight byte once at close to memory bandwidth; decode batches on small weights, the same
// kernel in token groups (takes_gemv). Larger n (prompts) and weights: cuBLAS. F32 weights
// use plain f32 SGEMM. BF16/F16 weights use tensor cores on activations split exactly into
// three 16-bit terms (cuBLAS has no f32 × bf16 product), one GEMM per term accumulating into
// the output (one GEMM over the three stacked for decode batches): the GEMV kernel's arithmetic
// up to summation order, at three times the tensor-core work.
// F16 weights (f16 checkpoints, and bf16 blocks re-typed at load by retype_weights) take two f16
// terms of each row instead, scaled by a power of two where its range asks (matmul_f16_terms):
// two GEMMs (one over both terms stacked for few rows), and no overflow beyond 65504.
#include <algorithm>
#include <array>
#include <string>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/gemv.cuh"
#include "backend/cuda/moe.cuh"

namespace recur {

using namespace cuda;

namespace {

// Rows row0 .. row0+R-1 of out [nt ≤ NT, m] (rows ldo apart) = x [nt, k] (rows ldx apart) ·
// w [m, k]^T, by one block: the body of both GEMV kernels below. A row's sums do not depend on
// R (each thread's share of k and the reduction order are fixed), so a weight gives the same
// results alone or in a group.
// pre: the block's first kPre chunks per row from gemv_preload, or null.
// br × bc: a block-FP8 weight's block sizes (unused for other types).
template <typename W, int NT, int R, bool kVec, int kPre = 0>
__device__ __forceinline__ void gemv_rows(const W* __restrict__ w, int64_t m, int64_t k, int br,
                                          int bc, const float* x, int64_t ldx, int nt, float* out,
                                          int64_t ldo, bool accumulate, int64_t row0,
                                          const uint4 (*pre)[R] = nullptr) {
  __shared__ float red[R * NT * (kGemvThreads / 32)];
  const int rows = int(min64(R, m - row0));
  const float* xr[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) xr[t] = x + int64_t(t < nt ? t : 0) * ldx;
  float acc[R][NT] = {}, unused[R][NT];
  const RowScales<W, R> sc = row_scales<W, R>(w, m, k, br, bc, row0, rows);
  gemv_partial<W, NT, R, false, kVec, kPre>(w + row0 * k, nullptr, k, rows, sc, sc, xr, acc, unused,
                                            pre);
  gemv_reduce<NT, R, false>(acc, unused, red);
  if (threadIdx.x < R * NT) {
    const int r = threadIdx.x / NT, t = threadIdx.x % NT;
    if (r < rows && t < nt) {
      float* o = out + int64_t(t) * ldo + row0 + r;
      *o = accumulate ? *o + red[threadIdx.x] : red[threadIdx.x];
    }
  }
}

// Weight rows per GEMV block: eight of one-byte (block-FP8) weights, so a block streams as
// many bytes as four rows of bf16 (80B-A3B FP8 decode, H200, with the chunks widened lazily:
// 16 sequences 18.96 -> 15.80 ms a step; with eight rows for one token only, 17.26).
template <typename W>
constexpr int kGemvRows = sizeof(W) == 1 ? 8 : 4;

// One token, 16-byte rows: chunks per row that a GEMV block of R rows loads before its PDL
// wait (eight loads per thread).
template <int NT, bool kVec, int R>
constexpr int kGemvPre = (kVec && NT == 1) ? 8 / R : 0;

// Token group blockIdx.y of x [n, k] (rows ldx apart): its first token and count (≤ NT).
// More than NT tokens run as groups of NT that each stream the rows again (from L2, where
// the caller keeps the re-reads small): a token's result is the same in any group.
template <int NT>
__device__ __forceinline__ int token_group(const float*& x, int64_t ldx, float*& out, int64_t ldo,
                                           int n) {
  const int t0 = int(blockIdx.y) * NT;
  x += int64_t(t0) * ldx;
  out += int64_t(t0) * ldo;
  return min(NT, n - t0);
}

// One block per R = kGemvRows<W> weight rows of one token group; x [n, k] rows ldx apart;
// out [n, m] rows ldo apart; grid (⌈m/R⌉, ⌈n/NT⌉). kPre > 0 (one token, 16-byte rows): the block's
// first kPre chunks per row are loaded before the PDL wait (4: whole rows of 4,096 bf16, as
// out_proj and o_proj have).
template <typename W, int NT, bool kVec, int kPre>
__global__ void __launch_bounds__(kGemvThreads)
    matmul_gemv_kernel(const W* __restrict__ w, int64_t m, int64_t k, int br, int bc,
                       const float* x, int64_t ldx, int n, float* out, int64_t ldo,
                       bool accumulate) {
  constexpr int R = kGemvRows<W>;
  const int nt = token_group<NT>(x, ldx, out, ldo, n);
  const int64_t row0 = int64_t(blockIdx.x) * R;
  if constexpr (kPre > 0) {
    uint4 pre[kPre][R];
    gemv_preload<W, R, kPre>(w + row0 * k, k, int(min64(R, m - row0)), pre);
    grid_dependency_sync();
    gemv_rows<W, NT, R, kVec, kPre>(w, m, k, br, bc, x, ldx, nt, out, ldo, accumulate, row0, pre);
  } else {
    grid_dependency_sync();
    gemv_rows<W, NT, R, kVec>(w, m, k, br, bc, x, ldx, nt, out, ldo, accumulate, row0);
  }
}

// Several weights sharing x: weight g takes blocks first_block[g] .. first_block[g + 1) - 1.
// Weights are of type W (kGemvRows<W> rows a block), or of W2 where second[g] is set (a
// block-FP8 layer's bf16 gates ride in its launch).
template <typename W, typename W2 = W>
struct GemvGroup {
  const void* w[Ops::kMaxMatmulGroup];  // [m_g, k] each
  bool second[Ops::kMaxMatmulGroup];    // w[g] holds W2
  float* out[Ops::kMaxMatmulGroup];     // [nt, m_g], ldo_g apart
  int64_t m[Ops::kMaxMatmulGroup], ldo[Ops::kMaxMatmulGroup];
  int br[Ops::kMaxMatmulGroup], bc[Ops::kMaxMatmulGroup];  // block-FP8 block sizes
  int first_block[Ops::kMaxMatmulGroup + 1];
  int count;
};

// Block blockIdx.x − first_block[i] of weight i of a group (weights of type W), as
// matmul_gemv_group_kernel's body.
template <typename W, int NT, bool kVec, typename G>
__device__ __forceinline__ void gemv_group_block(const G& g, int i, int64_t k, const float* x,
                                                 int64_t ldx, int nt, float* out) {
  constexpr int R = kGemvRows<W>;
  const W* w = static_cast<const W*>(g.w[i]);
  const int64_t row0 = int64_t(int(blockIdx.x) - g.first_block[i]) * R;
  constexpr int kPre = kGemvPre<NT, kVec, R>;
  if constexpr (kPre > 0) {
    uint4 pre[kPre][R];
    gemv_preload<W, R, kPre>(w + row0 * k, k, int(min64(R, g.m[i] - row0)), pre);
    grid_dependency_sync();
    gemv_rows<W, NT, R, kVec, kPre>(w, g.m[i], k, g.br[i], g.bc[i], x, ldx, nt, out, g.ldo[i],
                                    false, row0, pre);
  } else {
    grid_dependency_sync();
    gemv_rows<W, NT, R, kVec>(w, g.m[i], k, g.br[i], g.bc[i], x, ldx, nt, out, g.ldo[i], false,
                              row0);
  }
}

// x [n, k] rows ldx apart; grid (first_block[count], ⌈n/NT⌉).
template <typename W, typename W2, int NT, bool kVec>
__global__ void __launch_bounds__(kGemvThreads)
    matmul_gemv_group_kernel(GemvGroup<W, W2> g, int64_t k, const float* x, int64_t ldx, int n) {
  int i = 0;
  while (i + 1 < g.count && int(blockIdx.x) >= g.first_block[i + 1]) ++i;
  const int t0 = int(blockIdx.y) * NT, nt = min(NT, n - t0);
  x += int64_t(t0) * ldx;
  float* out = g.out[i] + int64_t(t0) * g.ldo[i];
  if constexpr (!std::is_same_v<W, W2>) {
    if (g.second[i]) {
      gemv_group_block<W2, NT, kVec>(g, i, k, x, ldx, nt, out);
      return;
    }
  }
  gemv_group_block<W, NT, kVec>(g, i, k, x, ldx, nt, out);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

using Fp8Blocks = CudaOps::Impl::Fp8Blocks;

// Whether a weight of k columns (block-FP8: in blocks b) takes the GEMV core's 16-byte path
// with x.
template <typename W>
bool gemv_vec(const Tensor& x, const void* w, int64_t k, Fp8Blocks b) {
  constexpr int E = kChunkElems<W>;
  return k % E == 0 && aligned16(w) && aligned16(x.data) && x.stride[0] % 4 == 0 &&
         (!kBlockFp8<W> || b.cols % E == 0);
}

// b: a block-FP8 weight's block sizes (unused for other types).
template <typename W, int NT>
void launch_gemv(const Tensor& x, const Tensor& w, Tensor out, bool accumulate, int n, Fp8Blocks b,
                 cudaStream_t stream) {
  const int64_t m = w.shape[0], k = w.shape[1];
  constexpr int E = kChunkElems<W>;
  const bool vec = gemv_vec<W>(x, w.data, k, b);
  constexpr int R = kGemvRows<W>;
  const dim3 blocks(unsigned((m + R - 1) / R), unsigned((n + NT - 1) / NT));
  auto go = [&](auto kernel) {
    launch_kernel(kernel, blocks, kGemvThreads, 0, stream, static_cast<const W*>(w.data), m, k,
                  b.rows, b.cols, x.ptr<float>(), x.stride[0], n, out.ptr<float>(), out.stride[0],
                  accumulate);
  };
  if (!vec) {
    go(matmul_gemv_kernel<W, NT, false, 0>);
  } else if (kGemvPre<NT, true, R> == 0) {
    go(matmul_gemv_kernel<W, NT, true, 0>);
  } else if (k / E >= 4 * kGemvThreads) {
    go(matmul_gemv_kernel<W, NT, true, 2 * kGemvPre<NT, true, R>>);
  } else {
    go(matmul_gemv_kernel<W, NT, true, kGemvPre<NT, true, R>>);
  }
}

// Four rows per block. (Eight for one or two tokens on large groups, once chosen to keep the
// grid within one wave, measured 3-4 µs slower per decode step of the 80B configuration:
// smaller blocks keep more of them resident, loading their weights before their wait.)
// The weights ws (outs their outputs, blocks their block-FP8 block sizes; those not of type W
// are of W2) as a GemvGroup.
template <typename W, typename W2>
GemvGroup<W, W2> gemv_group(std::span<const Tensor> ws, std::span<const Tensor> outs,
                            const Fp8Blocks* blocks, DType w_dtype) {
  GemvGroup<W, W2> g{};
  g.count = int(ws.size());
  for (int i = 0; i < g.count; ++i) {
    g.w[i] = ws[i].data;
    g.second[i] = ws[i].dtype != w_dtype;
    g.out[i] = outs[i].ptr<float>();
    g.m[i] = ws[i].shape[0];
    g.ldo[i] = outs[i].stride[0];
    g.br[i] = blocks[i].rows, g.bc[i] = blocks[i].cols;
    const int rows = g.second[i] ? kGemvRows<W2> : kGemvRows<W>;
    g.first_block[i + 1] = g.first_block[i] + int((g.m[i] + rows - 1) / rows);
  }
  return g;
}

template <typename W, typename W2, int NT>
void launch_gemv_group(const Tensor& x, std::span<const Tensor> ws, std::span<const Tensor> outs,
                       const Fp8Blocks* blocks, DType w_dtype, int n, cudaStream_t stream) {
  const int64_t k = x.shape[1];
  const GemvGroup<W, W2> g = gemv_group<W, W2>(ws, outs, blocks, w_dtype);
  const dim3 grid(unsigned(g.first_block[g.count]), unsigned((n + NT - 1) / NT));
  launch_kernel(matmul_gemv_group_kernel<W, W2, NT, true>, grid, kGemvThreads, 0, stream, g, k,
                x.ptr<float>(), x.stride[0], n);
}

// The GEMV launch for n tokens in token groups of 1, 2, 4 or 8.
template <typename Fn>
void by_token_group(int64_t n, Fn&& fn) {
  if (n == 1) {
    fn(std::integral_constant<int, 1>{});
  } else if (n == 2) {
    fn(std::integral_constant<int, 2>{});
  } else if (n <= 4) {
    fn(std::integral_constant<int, 4>{});
  } else {
    fn(std::integral_constant<int, 8>{});
  }
}

// Whether x [n, k] · w^T for weights of `weight_bytes` in all takes the GEMV kernel: up to
// kGemvMaxTokens tokens always; more (decode batches) in token groups of kGemvMaxTokens while
// the groups' re-reads of the weights (from L2) stay within 8 MiB. Few-row weights (gates, the
// router) cost the three-term cuBLAS path three launches for little work; larger ones are
// faster there. Measured on the 35B-A3B decode (H200, bench/results/h200-session12-*): 16 and
// 64 sequences 12.48 -> 11.46 and 25.75 -> 25.27 ms a step with 8 MiB; 16 MiB took 64 sequences
// to 26.39 ms, 4 MiB left 16 at 11.65.
constexpr int64_t kGemvTokenGroupBytes = int64_t(8) << 20;
bool takes_gemv(int64_t n, int64_t weight_bytes) {
  if (n <= CudaOps::kGemvMaxTokens) return true;
  const int64_t groups = (n + CudaOps::kGemvMaxTokens - 1) / CudaOps::kGemvMaxTokens;
  return weight_bytes * groups <= kGemvTokenGroupBytes;
}

int64_t weight_bytes(const Tensor& w) {
  return w.numel() * int64_t(dtype_size(w.dtype));
}

// Block-FP8 weights take the GEMV kernel in token groups up to this many tokens, the
// tensor-core tiles above. Measured on the 80B-A3B FP8 decode (H200, session 15, full depth):
// 16 sequences 36.5 -> 19.1 ms a step against the tiles, 64 sequences 65.3 -> 63.5 ms.
constexpr int64_t kFp8GemvMaxTokens = 64;

// Whether matmul takes the GEMV kernel for w (block-FP8: in blocks b) alone.
bool gemv_alone(int64_t n, const Tensor& w, Fp8Blocks b) {
  if (w.dtype == DType::F8_E4M3) {
    return !fp8_wmma_blocks(b.rows, b.cols) || n <= kFp8GemvMaxTokens;
  }
  return takes_gemv(n, weight_bytes(w));
}

}  // namespace

bool CudaOps::matmul_takes_gemv(int64_t n, const Tensor& w) {
  return takes_gemv(n, weight_bytes(w));
}

namespace {

// Up to kMaxMatmulGroup outputs of the same rows: out[i] [rows, m[i]] (rows ldo[i] apart).
struct ScaledOuts {
  float* out[Ops::kMaxMatmulGroup];
  int64_t ldo[Ops::kMaxMatmulGroup], m[Ops::kMaxMatmulGroup];
  int count = 0;
};

// Each output's rows times 2^(±e) per row, from inv_scale [rows] = 2^-e: times inv_scale, or
// with `invert` times its inverse (powers of two: exact). Rows of scale 1 (most:
// launch_f16_row_split's unit_rows) are skipped.
__global__ void scale_rows_kernel(ScaledOuts outs, int64_t rows, const float* inv_scale,
                                  bool invert) {
  grid_dependency_sync();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    if (inv_scale[r] == 1.0f) continue;
    const float f = invert ? 1.0f / inv_scale[r] : inv_scale[r];
    for (int i = 0; i < outs.count; ++i) {
      float* o = outs.out[i] + r * outs.ldo[i];
      for (int64_t c = threadIdx.x; c < outs.m[i]; c += blockDim.x) o[c] *= f;
    }
  }
}

void scale_rows(const ScaledOuts& outs, int64_t rows, const float* inv_scale, bool invert,
                cudaStream_t stream) {
  const unsigned blocks = unsigned(std::min<int64_t>(rows, 264));  // a row a block at a time
  launch_kernel(scale_rows_kernel, blocks, 256, 0, stream, outs, rows, inv_scale, invert);
}

// out [nr, m] (rows ldo apart) (+)= the sum of n_terms products prod [n_terms, nr, m] (smallest
// term first), added as term_gemms' GEMMs add them one after another: ((p0 (+ out)) + p1) + ...
// With inv_scale [nr] (else null: unit rows), the rows are scaled as scale_rows scales them
// around GEMMs that write out directly (what is there times 1 / inv_scale, the sum times
// inv_scale; powers of two, exact), so the result has the same bits without its two passes.
// Grid: (column blocks, rows), so no element divides a 64-bit index.
__global__ void sum_term_products_kernel(const float* prod, int n_terms, int64_t nr, int64_t m,
                                         float* out, int64_t ldo, bool accumulate,
                                         const float* inv_scale) {
  grid_dependency_sync();
  const int64_t r = blockIdx.y, plane = nr * m;
  const float down = inv_scale ? inv_scale[r] : 1.0f, up = 1.0f / down;
  const float* p = prod + r * m;
  float* o = out + r * ldo;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < m;
       c += int64_t(gridDim.x) * blockDim.x) {
    float v = p[c];
    if (accumulate) v += o[c] * up;
    for (int term = 1; term < n_terms; ++term) v = p[term * plane + c] + v;
    o[c] = v * down;
  }
}

// Where term_gemms may put n_terms products [n_terms, nr, m] of a weight with k columns: the
// start-up scratch from free_from (past what the piece's split put there), when they fit and
// writing and reading them back (8·n_terms·nr·m bytes) costs fewer bytes than the weight reads
// they save (2·(n_terms - 1)·m·k): decode batches, not prompts; else null.
float* stacked_products(CudaOps::Impl& s, const void* free_from, int n_terms, int64_t nr, int64_t k,
                        int64_t m) {
  if (n_terms < 2 || m == 0 || 4 * n_terms * nr >= (n_terms - 1) * k) return nullptr;
  const size_t used =
      size_t(static_cast<const char*>(free_from) - static_cast<const char*>(s.act_lowp.data()));
  const size_t start = (used + 255) / 256 * 256, need = size_t(4 * n_terms * nr * m);
  if (start + need > s.act_lowp.bytes()) return nullptr;
  return reinterpret_cast<float*>(static_cast<char*>(s.act_lowp.data()) + start);
}

// out rows (ldo apart) += w [m, k] (cuBLAS type t) times each of n_terms planes of 16-bit
// activation terms [n_terms, nr, k] (smallest first), one GEMM a term, the first writing out
// unless `accumulate`. With stacked (stacked_products' room for f32 [n_terms, nr, m], else
// null), one GEMM over all planes as n_terms·nr rows instead, then their sum: each weight byte
// is read once, not n_terms times (batched decode on dense weights). Rows scaled by powers of
// two (inv_scale [nr], or null): the sum scales them when stacked; else the caller scales around
// the GEMMs (scale_rows). The profile names the launch `what` m x k, its
// rate counting the product's own flops, not the terms' (n_terms times those).
void term_gemms(CudaOps::Impl& s, const Tensor& w, cudaDataType_t t, const char* terms, int n_terms,
                int64_t nr, float* outr, int64_t ldo, bool accumulate, const char* what,
                float* stacked, const float* inv_scale) {
  const int64_t m = w.shape[0], k = w.shape[1];
  const float zero = 0.0f, one = 1.0f;
  const auto products_launched = [&] {  // the interval holds cuBLAS's products
    if (!s.options.profile) return s.launched("matmul (terms)");
    s.work(2.0 * double(nr) * double(m) * double(k),
           double(weight_bytes(w)) + 4.0 * double(nr) * double(k + m));
    std::string label = what;
    label.append(" ").append(std::to_string(m)).append("x").append(std::to_string(k));
    s.launched(label.c_str());
  };
  if (stacked) {
    RECUR_CUBLAS_CHECK(cublasGemmEx(s.cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(n_terms * nr),
                                    int(k), &one, w.data, t, int(k), terms, t, int(k), &zero,
                                    stacked, CUDA_R_32F, int(m), CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
    products_launched();
    // Column blocks for about four blocks a multiprocessor over all rows.
    const int64_t col_blocks = std::clamp<int64_t>(4 * s.sm_count / nr, 1, (m + 255) / 256);
    launch_kernel(sum_term_products_kernel, dim3(unsigned(col_blocks), unsigned(nr)), 256, 0,
                  s.stream, static_cast<const float*>(stacked), n_terms, nr, m, outr, ldo,
                  accumulate, inv_scale);
    s.launched("matmul (term products summed)");
    return;
  }
  for (int term = 0; term < n_terms; ++term) {
    const char* xt = terms + size_t(term) * size_t(nr * k) * 2;
    RECUR_CUBLAS_CHECK(cublasGemmEx(s.cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(nr), int(k),
                                    &one, w.data, t, int(k), xt, t, int(k),
                                    term == 0 && !accumulate ? &zero : &one, outr, CUDA_R_32F,
                                    int(ldo), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  products_launched();
}

// outs[i] (+)= x · ws[i]^T for F16 weights on cuBLAS: each row of x split into two f16 terms
// (mid, hi: 22 bits), unscaled where its largest |value| lies in [2^-2, 2^15), else times the
// power of two that puts it in [2^14, 2^15) (no overflow or lost bits whatever the row's range;
// launch_f16_row_split), two GEMMs a weight, then the scaled rows of every output times their
// inverse scales. Products of f16 are exact in the f32 accumulators, so a token's result does
// not depend on the batch. Accumulating, scaled rows are first scaled up by the same power of
// two (exact), so the sums round as unscaled. Scaling every row cost two passes over the output
// (H200, 80B-A3B cut to 6 layers, 2,048 tokens: 1.8 ms a forward). A group's weights share one
// split of x and one scaling pass (a split a weight: 36 launches of 16.7 µs a forward there);
// outputs whose terms' products are stacked (decode batches) are scaled in their sum instead.
void matmul_f16_terms(CudaOps::Impl& s, const Tensor& x, std::span<const Tensor> ws,
                      std::span<const Tensor> outs, bool accumulate) {
  RECUR_CHECK(ws.size() == outs.size() && ws.size() <= Ops::kMaxMatmulGroup);
  const int64_t k = x.shape[1];
  const int n_terms = s.one_term_first_row(x.shape[0]) == 0 ? 1 : 2;
  for_f16_row_pieces(x, s.act_lowp.data(), s.act_lowp.bytes(), /*unit_rows=*/true, s.stream,
                     [&](int64_t r0, int64_t nr, const void* terms, const float* inv_scale) {
                       s.launched("matmul (activation split)");
                       std::array<float*, Ops::kMaxMatmulGroup> stacked{};
                       ScaledOuts apart;  // the outputs the GEMMs write directly
                       for (size_t i = 0; i < ws.size(); ++i) {
                         stacked[i] =
                             stacked_products(s, inv_scale + nr, n_terms, nr, k, ws[i].shape[0]);
                         if (stacked[i]) continue;
                         const Tensor& o = outs[i];
                         apart.out[apart.count] = o.ptr<float>() + r0 * o.stride[0];
                         apart.ldo[apart.count] = o.stride[0];
                         apart.m[apart.count++] = ws[i].shape[0];
                       }
                       if (accumulate && apart.count > 0) {
                         scale_rows(apart, nr, inv_scale, true, s.stream);
                         s.launched("matmul (rows scaled)");
                       }
                       // Both terms (mid, hi), or hi alone (BackendOptions::prompt_activations).
                       const char* hi_from = static_cast<const char*>(terms) +
                                             size_t(2 - n_terms) * size_t(nr * k) * 2;
                       for (size_t i = 0; i < ws.size(); ++i) {
                         const Tensor& o = outs[i];
                         term_gemms(s, ws[i], CUDA_R_16F, hi_from, n_terms, nr,
                                    o.ptr<float>() + r0 * o.stride[0], o.stride[0], accumulate,
                                    n_terms == 2 ? "matmul 2-term f16" : "matmul 1-term f16",
                                    stacked[i], inv_scale);
                       }
                       if (apart.count > 0) {
                         scale_rows(apart, nr, inv_scale, false, s.stream);
                         s.launched("matmul (rows scaled)");
                       }
                     });
}

// Whether matmul takes w on two f16 terms (matmul_f16_terms) for n rows.
bool takes_f16_terms(int64_t n, const Tensor& w) {
  return w.dtype == DType::F16 && w.shape[1] % 8 == 0 && !gemv_alone(n, w, Fp8Blocks{});
}

}  // namespace

void CudaOps::matmul_group(const Tensor& x, std::span<const Tensor> ws,
                           std::span<const Tensor> outs) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  RECUR_CHECK(ws.size() == outs.size() && ws.size() <= kMaxMatmulGroup);
  RECUR_CHECK(x.ndim == 2 && x.dtype == DType::F32 && x.stride[1] == 1);
  const int64_t n = x.shape[0], k = x.shape[1];
  Impl& s = *impl_;
  bool any_terms = false;
  for (size_t i = 0; i < ws.size(); ++i) {
    const Tensor &w = ws[i], &o = outs[i];
    RECUR_CHECK(w.ndim == 2 && o.ndim == 2 && w.is_contiguous() && w.shape[1] == k);
    RECUR_CHECK(o.dtype == DType::F32 && o.stride[1] == 1 && o.shape[0] == n &&
                o.shape[1] == w.shape[0]);
    any_terms |= takes_f16_terms(n, w);
  }
  // With one f16 term for prompt rows, a forward's decode rows run apart, as they would alone.
  if (any_terms && s.split_decode_rows(n, s.one_term_prompts, [&](int64_t r0, int64_t r1) {
        std::array<Tensor, kMaxMatmulGroup> part;
        for (size_t i = 0; i < outs.size(); ++i) part[i] = outs[i].slice_rows(r0, r1);
        matmul_group(x.slice_rows(r0, r1), ws, std::span<const Tensor>(part.data(), outs.size()));
      })) {
    return;
  }
  // Per weight type, in order of first appearance: the weights the GEMV kernel takes go in one
  // launch (all of them for up to kGemvMaxTokens tokens; the first few small ones that fit for
  // decode batches), the others one matmul each. A block-FP8 layer keeps its small gates in
  // bf16: those ride in its launch (a launch of their own cost the 80B-A3B FP8 batch-1 step
  // 3.5 µs a layer).
  // Weights that matmul would take on f16 terms, done at the end on one split of x.
  std::array<Tensor, kMaxMatmulGroup> tw, to;
  size_t n_terms = 0;
  auto alone = [&](const Tensor& w, const Tensor& o) {
    if (takes_f16_terms(n, w)) {
      tw[n_terms] = w, to[n_terms] = o, ++n_terms;
    } else {
      matmul(x, w, o);
    }
  };
  std::array<bool, kMaxMatmulGroup> done{};
  for (size_t first = 0; first < ws.size(); ++first) {
    if (done[first]) continue;
    const DType dt = ws[first].dtype;
    const bool takes_bf16 = dt == DType::F8_E4M3;
    std::array<Tensor, kMaxMatmulGroup> gw, go;
    std::array<Fp8Blocks, kMaxMatmulGroup> gb{};
    size_t grouped = 0;
    int64_t group_bytes = 0, bf16_bytes = 0;  // the group's bytes of type dt, and of bf16 riding
    bool mixed = false;
    for (size_t i = first; i < ws.size(); ++i) {
      const Tensor &w = ws[i], &o = outs[i];
      const bool riding = takes_bf16 && w.dtype == DType::BF16;
      if (w.dtype != dt && !riding) continue;
      done[i] = true;
      const Fp8Blocks b = w.dtype == DType::F8_E4M3 ? s.fp8_blocks_of(w) : Fp8Blocks{};
      bool vec = false;
      dispatch_gemv_weight(
          w.dtype, [&](auto tag) { vec = n >= 1 && gemv_vec<decltype(tag)>(x, w.data, k, b); });
      // The 16-byte path only, as matmul takes for each such weight alone (same arithmetic).
      int64_t& bytes = riding ? bf16_bytes : group_bytes;
      const bool gemv =
          w.dtype == DType::F8_E4M3 ? gemv_alone(n, w, b) : takes_gemv(n, bytes + weight_bytes(w));
      if (vec && w.shape[0] > 0 && gemv) {
        gw[grouped] = w, go[grouped] = o, gb[grouped] = b, ++grouped;
        bytes += weight_bytes(w);
        mixed |= riding;
      } else {
        alone(w, o);
      }
    }
    if (grouped == 0) continue;
    if (grouped == 1) {  // nothing to group
      alone(gw[0], go[0]);
      continue;
    }
    group_bytes += bf16_bytes;
    std::span<const Tensor> gws(gw.data(), grouped), gouts(go.data(), grouped);
    dispatch_gemv_weight(dt, [&](auto tag) {
      using W = decltype(tag);
      by_token_group(n, [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        if constexpr (kBlockFp8<W>) {
          if (mixed) {
            launch_gemv_group<W, __nv_bfloat16, NT>(x, gws, gouts, gb.data(), dt, int(n), s.stream);
            return;
          }
        }
        launch_gemv_group<W, W, NT>(x, gws, gouts, gb.data(), dt, int(n), s.stream);
      });
    });
    if (s.options.profile) {
      int64_t rows = 0;
      for (const Tensor& w : gws) rows += w.shape[0];
      s.work(2.0 * double(n) * double(rows) * double(k),
             double(group_bytes) + 4.0 * double(n) * double(k + rows));
      std::string label = dt == DType::F8_E4M3 ? "matmul group fp8 gemv" : "matmul group gemv";
      for (const Tensor& w : gws) label.append(" ").append(std::to_string(w.shape[0]));
      label.append(" x").append(std::to_string(k));
      s.launched(label.c_str());
    } else {
      s.launched("matmul group (gemv)");
    }
  }
  if (n_terms > 0) {
    matmul_f16_terms(s, x, std::span<const Tensor>(tw.data(), n_terms),
                     std::span<const Tensor>(to.data(), n_terms), false);
  }
}

void CudaOps::matmul(const Tensor& x, const Tensor& w, Tensor out, bool accumulate) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  RECUR_CHECK(x.ndim == 2 && w.ndim == 2 && out.ndim == 2);
  RECUR_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32 && w.is_contiguous());
  RECUR_CHECK(x.stride[1] == 1 && out.stride[1] == 1);
  const int64_t n = x.shape[0], k = x.shape[1], m = w.shape[0];
  RECUR_CHECK(w.shape[1] == k && out.shape[0] == n && out.shape[1] == m);
  if (n == 0 || m == 0) return;
  Impl& s = *impl_;
  const Fp8Blocks b = w.dtype == DType::F8_E4M3 ? s.fp8_blocks_of(w) : Fp8Blocks{};
  // Block-FP8 prompts on tensor cores where the block sizes suit their tiles (else the GEMV
  // kernel in token groups); a forward's decode rows apart from its prompt rows under e4m3
  // activations.
  const bool gemv = gemv_alone(n, w, b);
  if (w.dtype == DType::F8_E4M3 && !gemv) {
    if (!s.split_decode_rows(n, s.e4m3_activations, [&](int64_t r0, int64_t r1) {
          matmul(x.slice_rows(r0, r1), w, out.slice_rows(r0, r1), accumulate);
        })) {
      fp8_matmul_tensor_cores(s, x, w, out, accumulate);
    }
    return;
  }
  if (gemv) {
    dispatch_gemv_weight(w.dtype, [&](auto tag) {
      using W = decltype(tag);
      by_token_group(n, [&](auto nt) {
        launch_gemv<W, decltype(nt)::value>(x, w, out, accumulate, int(n), b, s.stream);
      });
    });
    if (s.options.profile) {
      s.work(2.0 * double(n) * double(m) * double(k),
             double(weight_bytes(w)) + 4.0 * double(n) * double(k + m));
      std::string label = w.dtype == DType::F8_E4M3 ? "matmul fp8 gemv " : "matmul gemv ";
      label.append(std::to_string(m)).append("x").append(std::to_string(k));
      s.launched(label.c_str());
    } else {
      s.launched("matmul (gemv)");
    }
    return;
  }
  // Column-major view: out^T [m, n] = w [k, m]^T · x^T [k, n].
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  if (w.dtype == DType::F32) {
    RECUR_CUBLAS_CHECK(cublasSgemm(s.cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(n), int(k),
                                   &alpha, w.ptr<float>(), int(k), x.ptr<float>(), int(x.stride[0]),
                                   &beta, out.ptr<float>(), int(out.stride[0])));
    return;
  }
  RECUR_CHECK(w.dtype == DType::BF16 || w.dtype == DType::F16);
  if (takes_f16_terms(n, w)) {  // the rule matmul_group's f16-term weights follow too
    // One term for prompt rows only: a forward's decode rows apart (as matmul_group).
    if (!s.split_decode_rows(n, s.one_term_prompts, [&](int64_t r0, int64_t r1) {
          matmul(x.slice_rows(r0, r1), w, out.slice_rows(r0, r1), accumulate);
        })) {
      matmul_f16_terms(s, x, std::span(&w, 1), std::span<const Tensor>(&out, 1), accumulate);
    }
    return;
  }
  const cudaDataType_t t = w.dtype == DType::F16 ? CUDA_R_16F : CUDA_R_16BF;
  // Three GEMMs, the smallest term first, each adding its products into out (beta 1 after the
  // first): no f32 buffer of the terms' products to write and sum again (the weights are read
  // three times instead, mostly from L2). Rows go in pieces that fit the start-up scratch: 3 · 2
  // bytes per activation.
  const size_t row_bytes = size_t(6 * k);
  RECUR_CHECK(row_bytes <= s.act_lowp.bytes());
  const int64_t rows_per_piece = int64_t(s.act_lowp.bytes() / row_bytes);
  for (int64_t r0 = 0; r0 < n; r0 += rows_per_piece) {
    const int64_t nr = std::min(rows_per_piece, n - r0);
    char* parts = static_cast<char*>(s.act_lowp.data());
    const float* xr = x.ptr<float>() + r0 * x.stride[0];
    float* outr = out.ptr<float>() + r0 * out.stride[0];
    // x = hi + mid + lo exactly (three 16-bit terms hold f32's 24-bit significand; bf16 keeps
    // f32's exponent range, so only values near the f32 denormal range lose bits). Products with
    // 16-bit weights are exact in the tensor cores' f32 accumulators, so the three GEMMs compute
    // the same sum as the f32 GEMV kernel, up to the order of f32 additions: a token's result
    // does not depend on the batch's size.
    launch_wmma_split(xr, x.stride[0], nr, k, w.dtype, parts, s.stream);
    s.launched("matmul (activation split)");
    term_gemms(s, w, t, parts, 3, nr, outr, out.stride[0], accumulate, "matmul 3-term",
               stacked_products(s, parts + row_bytes * size_t(nr), 3, nr, k, m),
               nullptr);  // lo, mid, hi; unscaled rows
  }
}

}  // namespace recur
