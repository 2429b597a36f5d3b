// out[n, m] = x[n, k] · w[m, k]^T (or out += that), w in its stored dtype.
//
// Up to kGemvMaxTokens tokens (decode): the GEMV kernel of gemv.cuh, f32 arithmetic, reading
// each weight byte once at close to memory bandwidth. Larger n (prompts): cuBLAS. F32 weights
// use plain f32 SGEMM. BF16/F16 weights use tensor cores on activations split into two 16-bit
// terms (hi + lo; cuBLAS has no f32 × bf16 product), two products accumulated in f32, so the
// result keeps f32-class accuracy (about 2^-16 relative) at twice the tensor-core work
// error on an element in the worst case, ~3e-3 typical. F16 activations overflow beyond 65504,
// a limit f16 checkpoints already impose on their own activations.
#include <algorithm>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/gemv.cuh"

namespace recur {

using namespace cuda;

namespace {

// One block per 4 weight rows; x [nt ≤ NT, k] rows ldx apart; out [nt, m] rows ldo apart.
template <typename W, int NT, bool kVec>
__global__ void __launch_bounds__(kGemvThreads)
    matmul_gemv_kernel(const W* __restrict__ w, int64_t m, int64_t k, const float* x, int64_t ldx,
                       int nt, float* out, int64_t ldo, bool accumulate) {
  constexpr int R = 4;
  __shared__ float red[R * NT * (kGemvThreads / 32)];
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const int rows = int(min64(R, m - row0));
  const float* xr[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) xr[t] = x + int64_t(t < nt ? t : 0) * ldx;
  float acc[R][NT] = {}, unused[R][NT];
  gemv_partial<W, NT, R, false, kVec>(w + row0 * k, nullptr, k, rows, xr, acc, unused);
  gemv_reduce<NT, R, false>(acc, unused, red);
  if (threadIdx.x < R * NT) {
    const int r = threadIdx.x / NT, t = threadIdx.x % NT;
    if (r < rows && t < nt) {
      float* o = out + int64_t(t) * ldo + row0 + r;
      *o = accumulate ? *o + red[threadIdx.x] : red[threadIdx.x];
    }
  }
}

// hi, lo [n, k] contiguous: x [n, k] (rows ldx apart) = hi + lo + O(2^-16 |x|), both in T.
// Two tensor-core products (hi, then lo accumulated) then carry f32-class accuracy.
template <typename T>
__global__ void split_lowp_kernel(const float* x, int64_t ldx, int64_t n, int64_t k, T* hi,
                                  T* lo) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n * k;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / k, c = e % k;
    const float v = x[r * ldx + c];
    if constexpr (std::is_same_v<T, __half>) {
      hi[e] = __float2half_rn(v);
      lo[e] = __float2half_rn(v - __half2float(hi[e]));
    } else {
      hi[e] = __float2bfloat16_rn(v);
      lo[e] = __float2bfloat16_rn(v - __bfloat162float(hi[e]));
    }
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

template <typename W, int NT>
void launch_gemv(const Tensor& x, const Tensor& w, Tensor out, bool accumulate, int n,
                 cudaStream_t stream) {
  const int64_t m = w.shape[0], k = w.shape[1];
  constexpr int E = Chunk<W>::kElems;
  const bool vec = k % E == 0 && aligned16(w.data) && aligned16(x.data) && x.stride[0] % 4 == 0;
  const unsigned blocks = unsigned((m + 3) / 4);
  if (vec) {
    matmul_gemv_kernel<W, NT, true>
        <<<blocks, kGemvThreads, 0, stream>>>(w.ptr<W>(), m, k, x.ptr<float>(), x.stride[0], n,
                                              out.ptr<float>(), out.stride[0], accumulate);
  } else {
    matmul_gemv_kernel<W, NT, false>
        <<<blocks, kGemvThreads, 0, stream>>>(w.ptr<W>(), m, k, x.ptr<float>(), x.stride[0], n,
                                              out.ptr<float>(), out.stride[0], accumulate);
  }
}

}  // namespace

void CudaOps::matmul(const Tensor& x, const Tensor& w, Tensor out, bool accumulate) {
  RECUR_CHECK(x.ndim == 2 && w.ndim == 2 && out.ndim == 2);
  RECUR_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32 && w.is_contiguous());
  RECUR_CHECK(x.stride[1] == 1 && out.stride[1] == 1);
  const int64_t n = x.shape[0], k = x.shape[1], m = w.shape[0];
  RECUR_CHECK(w.shape[1] == k && out.shape[0] == n && out.shape[1] == m);
  if (n == 0 || m == 0) return;
  Impl& s = *impl_;
  if (n <= kGemvMaxTokens) {
    dispatch_weight(w.dtype, [&](auto tag) {
      using W = decltype(tag);
      if (n == 1) {
        launch_gemv<W, 1>(x, w, out, accumulate, int(n), s.stream);
      } else if (n == 2) {
        launch_gemv<W, 2>(x, w, out, accumulate, int(n), s.stream);
      } else if (n <= 4) {
        launch_gemv<W, 4>(x, w, out, accumulate, int(n), s.stream);
      } else {
        launch_gemv<W, 8>(x, w, out, accumulate, int(n), s.stream);
      }
    });
    s.launched("matmul (gemv)");
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
  const bool half = w.dtype == DType::F16;
  char* xl = static_cast<char*>(s.grow(s.act_lowp, size_t(n * k) * 4, "low-precision activations"));
  void* xh = xl;
  void* xlo = xl + size_t(n * k) * 2;
  const unsigned blocks = unsigned(std::min<int64_t>(blocks_for(n * k, 256), s.sm_count * 8));
  if (half) {
    split_lowp_kernel<__half><<<blocks, 256, 0, s.stream>>>(
        x.ptr<float>(), x.stride[0], n, k, static_cast<__half*>(xh), static_cast<__half*>(xlo));
  } else {
    split_lowp_kernel<__nv_bfloat16><<<blocks, 256, 0, s.stream>>>(
        x.ptr<float>(), x.stride[0], n, k, static_cast<__nv_bfloat16*>(xh),
        static_cast<__nv_bfloat16*>(xlo));
  }
  s.launched("matmul (activation split)");
  const cudaDataType_t t = half ? CUDA_R_16F : CUDA_R_16BF;
  const float one = 1.0f;
  RECUR_CUBLAS_CHECK(cublasGemmEx(s.cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(n), int(k),
                                  &alpha, w.data, t, int(k), xh, t, int(k), &beta, out.data,
                                  CUDA_R_32F, int(out.stride[0]), CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
  RECUR_CUBLAS_CHECK(cublasGemmEx(s.cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(n), int(k),
                                  &alpha, w.data, t, int(k), xlo, t, int(k), &one, out.data,
                                  CUDA_R_32F, int(out.stride[0]), CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
}

}  // namespace recur
