// The MoE experts' combine: each token's expert rows summed by its routing weights, for prompts
// and one-token steps alike.
#include <algorithm>

#include "backend/cuda/moe.cuh"

namespace recur::cuda {

namespace {

// V consecutive columns from p, or to p (16-byte aligned for V = 4).
__device__ __forceinline__ void load_cols(const float* p, float (&v)[1]) {
  v[0] = *p;
}
__device__ __forceinline__ void load_cols(const float* p, float (&v)[4]) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}
__device__ __forceinline__ void store_cols(float* p, const float (&v)[1]) {
  *p = v[0];
}
__device__ __forceinline__ void store_cols(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

// out[t, :] = Σ_{j<k} weights[t, j] · ys[row_of[t·slots + j], :] (row_of null: the
// identity); grid (tokens, column blocks), a thread per V columns (a single block per token is
// latency-bound; V = 4, 16-byte accesses, for prompts: the same sums, a quarter of the loads).
// Pair (t, j) is pair t·slots + j; with `shared` (slots = k + 1), pair (t, k) is the shared
// expert's: then out[t, :] += σ(score[t]) · its row, as add_scaled_sigmoid, or += its row when
// score is null (an ungated shared expert), as add. With residual [tokens, d] (rows ld_res
// apart): then residual += out, as add.
template <int V>
__global__ void moe_combine_kernel(const float* ys, const int32_t* row_of, int slots,
                                   const float* weights, int64_t ld_w, int k, int64_t d, float* out,
                                   int64_t ldo, bool shared, const float* score, int64_t ld_score,
                                   float* residual, int64_t ld_res) {
  grid_dependency_sync();
  const int t = blockIdx.x;
  auto row = [&](int j) { return int64_t(row_of ? row_of[t * slots + j] : t * slots + j); };
  for (int64_t c = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * V; c < d;
       c += int64_t(gridDim.y) * blockDim.x * V) {
    // Eight pairs' loads in flight at a time; each column's sum in pair order as one at a time.
    float o[V] = {};
    int j = 0;
    for (; j + 8 <= k; j += 8) {
      float wv[8], yv[8][V];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        wv[u] = weights[int64_t(t) * ld_w + j + u];
        load_cols(ys + row(j + u) * d + c, yv[u]);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
#pragma unroll
        for (int q = 0; q < V; ++q) o[q] += wv[u] * yv[u][q];
      }
    }
    for (; j < k; ++j) {
      float y[V];
      load_cols(ys + row(j) * d + c, y);
      const float w = weights[int64_t(t) * ld_w + j];
#pragma unroll
      for (int q = 0; q < V; ++q) o[q] += w * y[q];
    }
    if (shared) {
      float y[V];
      load_cols(ys + row(k) * d + c, y);
      // An ungated shared expert's factor 1 adds its row exactly (1 · y is y).
      const float gate = score ? sigmoid(score[int64_t(t) * ld_score]) : 1.0f;
#pragma unroll
      for (int q = 0; q < V; ++q) o[q] += gate * y[q];
    }
    store_cols(out + int64_t(t) * ldo + c, o);
    if (residual) {
      float r[V];
      float* pr = residual + int64_t(t) * ld_res + c;
      load_cols(pr, r);
#pragma unroll
      for (int q = 0; q < V; ++q) r[q] += o[q];
      store_cols(pr, r);
    }
  }
}

}  // namespace

void launch_moe_combine(const float* ys, const int32_t* row_of, int n, int slots,
                        const float* weights, int64_t ld_w, int k, int64_t d, float* out,
                        int64_t ldo, bool shared, const float* score, int64_t ld_score,
                        float* residual, int64_t ld_res, cudaStream_t stream) {
  // Prompts take 16-byte columns where every row allows them; one token keeps a column a
  // thread (more blocks for its latency-bound step).
  auto rows16 = [](const void* p, int64_t ld) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0 && ld % 4 == 0;
  };
  const bool vec4 =
      n > 1 && rows16(ys, d) && rows16(out, ldo) && (!residual || rows16(residual, ld_res));
  const int64_t cols = 256 * (vec4 ? 4 : 1);  // a block's columns
  const dim3 grid(unsigned(n), unsigned(std::min<int64_t>((d + cols - 1) / cols, 64)));
  launch_kernel(vec4 ? moe_combine_kernel<4> : moe_combine_kernel<1>, grid, 256, 0, stream, ys,
                row_of, slots, weights, ld_w, k, d, out, ldo, shared, score, ld_score, residual,
                ld_res);
}

}  // namespace recur::cuda
