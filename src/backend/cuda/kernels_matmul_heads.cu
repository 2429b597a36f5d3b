// out[t, h, :] = x[t, h, :] · w[h]^T for every head h (Ops::matmul_heads): latent attention's
// absorbed projections, one small product per head (512 × 128 per head on the published
// Kimi-Linear, 32 heads).
//
// Token counts that matmul would run on its GEMV kernel (per head's weight: see
// CudaOps::matmul_takes_gemv) go in one launch over all heads, f32 arithmetic, each weight byte
// streamed once per token group. The heads' rows are short (128 or 512 values), so a row is
// summed by a group of 8, 16 or 32 lanes (a warp shuffle, no shared memory), not by a whole
// block as in matmul's GEMV kernel, which would leave most of its threads idle on such rows.
// Larger counts (prompts) run the default: one matmul per head (cuBLAS on activations split
// into three 16-bit terms, f32 accuracy).
#include <string>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/gemv.cuh"

namespace recur {

using namespace cuda;

namespace {

constexpr int kHeadsThreads = 128;

// The weight chunks (16 bytes each, or single elements when !kVec) of R rows at chunk indices
// c + s·lanes (s < S) that exist (< n_units), widened into wc; the others zero.
template <typename W, int R, int S, bool kVec>
struct Units {
  static constexpr int E = kVec ? Chunk<W>::kElems : 1;
  float v[S][R][E];
};

// acc[r][t] += Σ over this lane's units of w[r] · x[t].
template <typename W, int NT, int R, int S, bool kVec>
__device__ __forceinline__ void fma_units(const Units<W, R, S, kVec>& u,
                                          const float* const (&xr)[NT], int64_t c, int lanes,
                                          int64_t n_units, float (&acc)[R][NT]) {
  constexpr int E = Units<W, R, S, kVec>::E;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const int64_t cc = c + int64_t(s) * lanes;
    if (cc >= n_units) break;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float xv[E];
      if constexpr (kVec) {
#pragma unroll
        for (int q = 0; q < E; q += 4) {
          const float4 f = __ldg(reinterpret_cast<const float4*>(xr[t] + cc * E + q));
          xv[q] = f.x, xv[q + 1] = f.y, xv[q + 2] = f.z, xv[q + 3] = f.w;
        }
      } else {
        xv[0] = xr[t][cc];
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int q = 0; q < E; ++q) acc[r][t] = fmaf(u.v[s][r][q], xv[q], acc[r][t]);
      }
    }
  }
}

template <typename W, int R, int S, bool kVec>
__device__ __forceinline__ void load_units(const W* const (&wr)[R], int64_t c, int lanes,
                                           int64_t n_units, Units<W, R, S, kVec>& u) {
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const int64_t cc = c + int64_t(s) * lanes;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (kVec) {
        const Chunk<W> ch = cc < n_units ? load_chunk(wr[r] + cc * Chunk<W>::kElems) : Chunk<W>{};
#pragma unroll
        for (int q = 0; q < Chunk<W>::kElems; ++q) u.v[s][r][q] = ch.v[q];
      } else {
        u.v[s][r][0] = cc < n_units ? to_f32(wr[r][cc]) : 0.0f;
      }
    }
  }
}

// Block (x, h, z): rows of head h's weight w[h] [m, k] for the token group z (≤ NT tokens).
// The block's lanes form groups of `lanes` (8, 16 or 32; dividing the warp), each summing R
// consecutive rows over units of k (16-byte chunks when kVec, else elements) taken `lanes`
// apart, S units per row in flight. Rows past m are clamped to row m-1 (every lane takes part
// in the shuffles) and not written.
//   w [H, m, k]; x [n, H, k] rows x_row apart, heads x_head apart (0: shared);
//   out [n, H, m] rows out_row apart, heads out_head apart; grid (⌈m / rows per block⌉, H,
//   ⌈n / NT⌉)
template <typename W, int NT, int R, int S, bool kVec>
__global__ void __launch_bounds__(kHeadsThreads)
    matmul_heads_kernel(const W* __restrict__ w, int64_t m, int64_t k, int lanes, const float* x,
                        int64_t x_row, int64_t x_head, int n, float* out, int64_t out_row,
                        int64_t out_head) {
  const int64_t h = blockIdx.y;
  const int t0 = int(blockIdx.z) * NT, nt = min(NT, n - t0);
  const int group = int(threadIdx.x) / lanes, lane = int(threadIdx.x) % lanes;
  const int64_t row0 = (int64_t(blockIdx.x) * (kHeadsThreads / lanes) + group) * R;
  const W* wh = w + h * m * k;
  const W* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = wh + min64(row0 + r, m - 1) * k;
  const float* xr[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) xr[t] = x + h * x_head + int64_t(t0 + (t < nt ? t : 0)) * x_row;
  const int64_t n_units = kVec ? k / Chunk<W>::kElems : k;

  float acc[R][NT] = {};
  Units<W, R, S, kVec> u;
  int64_t c = lane;
  load_units<W, R, S, kVec>(wr, c, lanes, n_units, u);  // weights: before the wait
  grid_dependency_sync();
  fma_units<W, NT, R, S, kVec>(u, xr, c, lanes, n_units, acc);
  for (c += int64_t(S) * lanes; c < n_units; c += int64_t(S) * lanes) {
    load_units<W, R, S, kVec>(wr, c, lanes, n_units, u);
    fma_units<W, NT, R, S, kVec>(u, xr, c, lanes, n_units, acc);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float v = acc[r][t];
      for (int o = lanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && row0 + r < m && t < nt) {
        out[h * out_head + int64_t(t0 + t) * out_row + row0 + r] = v;
      }
    }
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Lanes per row and rows per lane group for rows of n_units: short rows (up to two units per
// lane) take four rows per group, each lane one unit of each; long rows one row, four units
// of it in flight.
template <typename W, int NT, bool kVec>
void launch_heads(const Tensor& x, const Tensor& w, Tensor out, int n, cudaStream_t stream) {
  const int64_t H = w.shape[0], m = w.shape[1], k = w.shape[2];
  const int64_t n_units = kVec ? k / Chunk<W>::kElems : k;
  const int lanes = n_units >= 32 ? 32 : n_units >= 16 ? 16 : 8;
  auto go = [&](auto kernel, int rows_per_group) {
    const int64_t rows_per_block = int64_t(kHeadsThreads / lanes) * rows_per_group;
    const dim3 grid(unsigned((m + rows_per_block - 1) / rows_per_block), unsigned(H),
                    unsigned((n + NT - 1) / NT));
    launch_kernel(kernel, grid, kHeadsThreads, 0, stream, w.ptr<W>(), m, k, lanes, x.ptr<float>(),
                  x.stride[0], x.stride[1], n, out.ptr<float>(), out.stride[0], out.stride[1]);
  };
  if (n_units <= 2 * int64_t(lanes)) {
    go(matmul_heads_kernel<W, NT, 4, 1, kVec>, 4);
  } else {
    go(matmul_heads_kernel<W, NT, 1, 4, kVec>, 1);
  }
}

template <int NT>
void launch_heads_nt(const Tensor& x, const Tensor& w, Tensor out, int n, cudaStream_t stream) {
  dispatch_weight(w.dtype, [&](auto tag) {
    using W = decltype(tag);
    const int64_t k = w.shape[2];
    const bool vec = k % Chunk<W>::kElems == 0 && aligned16(w.data) && aligned16(x.data) &&
                     x.stride[0] % 4 == 0 && x.stride[1] % 4 == 0;
    if (vec) {
      launch_heads<W, NT, true>(x, w, out, n, stream);
    } else {
      launch_heads<W, NT, false>(x, w, out, n, stream);
    }
  });
}

}  // namespace

void CudaOps::matmul_heads(const Tensor& x, const Tensor& w, Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  RECUR_CHECK(x.ndim == 3 && w.ndim == 3 && out.ndim == 3 && w.is_contiguous());
  RECUR_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32);
  const int64_t n = x.shape[0], H = w.shape[0], m = w.shape[1], k = w.shape[2];
  RECUR_CHECK(x.shape[1] == H && x.shape[2] == k && x.stride[2] == 1);
  RECUR_CHECK(out.shape[0] == n && out.shape[1] == H && out.shape[2] == m && out.stride[2] == 1);
  if (n == 0 || m == 0 || H == 0) return;
  // One head's weight decides the path, as it would for matmul on that head alone.
  const Tensor head = Tensor::contiguous(w.data, w.dtype, {m, k}, w.device);
  if (!matmul_takes_gemv(n, head) || H > 65535 ||
      (n + kGemvMaxTokens - 1) / kGemvMaxTokens > 65535) {
    Ops::matmul_heads(x, w, out);
    return;
  }
  Impl& s = *impl_;
  if (n == 1) {
    launch_heads_nt<1>(x, w, out, int(n), s.stream);
  } else if (n == 2) {
    launch_heads_nt<2>(x, w, out, int(n), s.stream);
  } else if (n <= 4) {
    launch_heads_nt<4>(x, w, out, int(n), s.stream);
  } else {
    launch_heads_nt<8>(x, w, out, int(n), s.stream);
  }
  if (s.options.profile) {
    const double wbytes = double(w.numel()) * double(dtype_size(w.dtype));
    s.work(2.0 * double(n) * double(H) * double(m) * double(k),
           wbytes + 4.0 * double(n) * double(H) * double(k + m));
    std::string label = "matmul heads ";
    label.append(std::to_string(H)).append("x").append(std::to_string(m)).append("x");
    label.append(std::to_string(k));
    s.launched(label.c_str());
  } else {
    s.launched("matmul heads");
  }
}

}  // namespace recur
