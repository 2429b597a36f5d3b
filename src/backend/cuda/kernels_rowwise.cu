// Row-wise and elementwise kernels: embedding, row gathers, the norms, rotary embedding, the
// attention input stage, the SwiGLU/sigmoid elementwise ops and the Gated DeltaNet gates. Each
// mirrors the CPU kernel in cpu_ops.cpp (same formulas, f32 arithmetic, expf rather than fast exp).
#include <algorithm>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/rms_norm_row.cuh"

namespace recur {

using namespace cuda;

namespace {

constexpr int kThreads = 256;

// out[n, d] = f32(table[ids[i], :]);  table [vocab, d] as stored
template <typename W>
__global__ void embedding_kernel(const int32_t* ids, const W* table, int64_t d, float* out,
                                 int64_t ldo) {
  grid_dependency_sync();
  const int64_t i = blockIdx.x;
  const W* src = table + int64_t(ids[i]) * d;
  float* dst = out + i * ldo;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dst[j] = to_f32(src[j]);
}

// out[n, d] = x[rows[i], :]
__global__ void gather_rows_kernel(const float* x, int64_t ldx, const int32_t* rows, int64_t d,
                                   float* out, int64_t ldo) {
  grid_dependency_sync();
  const int64_t i = blockIdx.x;
  const float* src = x + int64_t(rows[i]) * ldx;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[i * ldo + j] = src[j];
}

// Rows at least this wide get a block each: one warp walking a 2048-wide row is bound by
// load latency (about 10 µs for a single decode token). The choice depends on d alone, so a
// token's result never depends on how many rows share the launch.
constexpr int64_t kBlockNormMinWidth = 1024;

// One warp per row of x [rows, d < kBlockNormMinWidth]; gate [rows, d] when kGate is set.
// kPer elements a lane in registers (the same sums in the same order for any kPer).
template <typename W, NormGate kGate, int kPer = kWarpNormPer>
__global__ void rms_norm_kernel(Rows x, Rows gate, Rows out, const W* w, float offset, float eps) {
  grid_dependency_sync();
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= x.n_rows) return;
  rms_norm_row<kPer, W, kGate>(x, gate, out, w, offset, eps, r, threadIdx.x % 32, 32,
                               [](float ss) { return warp_sum(ss); });
}

// The sum of ss over a block of kThreads: the warps' partial sums added in a fixed order.
// red: kThreads / 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float ss, float* red) {
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) total += red[i];
  return total;
}

// One block of kThreads per row of x [rows, d >= kBlockNormMinWidth]; the warps' partial sums
// of squares are added in a fixed order. The weights load before the PDL wait: after it, they
// would queue behind the next kernel's early weight loads (a large GEMV), as x must.
constexpr int kBlockNormPer = 8;
template <typename W, NormGate kGate>
__global__ void __launch_bounds__(kThreads)
    rms_norm_block_kernel(Rows x, Rows gate, Rows out, const W* w, float offset, float eps) {
  const NormWeights<kBlockNormPer> wpre =
      load_norm_weights<kBlockNormPer>(w, x.d, threadIdx.x, kThreads);
  grid_dependency_sync();
  __shared__ float red[kThreads / 32];
  rms_norm_row<kBlockNormPer, W, kGate>(
      x, gate, out, w, offset, eps, blockIdx.x, threadIdx.x, kThreads,
      [&](float ss) { return block_sum(ss, red); }, wpre);
}

// embedding_kernel's rows, then the norm of each as launch_rms_norm's kernel for that width
// computes it (the same bits as the two launches). grid (n), kThreads.
// ids [n]; table [vocab, d] as stored; h, x [n, d] as rows; w [d].
template <typename W, typename WN>
__global__ void __launch_bounds__(kThreads)
    embedding_rms_norm_kernel(const int32_t* ids, const W* table, Rows h, Rows x, const WN* w,
                              float offset, float eps) {
  // The ids (batch mirror), the table row and the norm weights load before the wait: issued
  // after it, they queued behind the next kernel's early weight loads (a large GEMV).
  const int64_t i = blockIdx.x, d = h.d;
  const W* src = table + int64_t(ids[i]) * d;
  constexpr int kPer = kBlockNormPer;
  float row[kPer];
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int64_t j = threadIdx.x + int64_t(q) * blockDim.x;
    row[q] = j < d ? to_f32(src[j]) : 0.0f;
  }
  const bool block_norm = d >= kBlockNormMinWidth;  // launched with kThreads
  NormWeights<kPer> wpre;
  if (block_norm) wpre = load_norm_weights<kPer>(w, d, threadIdx.x, kThreads);
  grid_dependency_sync();
  float* dst = h.row(i);
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int64_t j = threadIdx.x + int64_t(q) * blockDim.x;
    if (j < d) dst[j] = row[q];
  }
  for (int64_t j = threadIdx.x + int64_t(kPer) * blockDim.x; j < d; j += blockDim.x) {
    dst[j] = to_f32(src[j]);
  }
  __syncthreads();  // the row is visible to the whole block
  if (block_norm) {
    __shared__ float red[kThreads / 32];
    rms_norm_row<kBlockNormPer, WN, NormGate::kNone>(
        h, h, x, w, offset, eps, i, threadIdx.x, kThreads,
        [&](float ss) { return block_sum(ss, red); }, wpre);
  } else if (threadIdx.x < 32) {
    rms_norm_row<kWarpNormPer, WN, NormGate::kNone>(h, h, x, w, offset, eps, i, threadIdx.x, 32,
                                                    [](float ss) { return warp_sum(ss); });
  }
}

// Launches the warp-per-row or block-per-row kernel (by width) over x [rows, d].
template <typename W, NormGate kGate>
void launch_rms_norm(const Rows& xs, const Rows& gs, const Rows& os, const W* w, float offset,
                     float eps, cudaStream_t stream) {
  if (xs.d >= kBlockNormMinWidth) {
    launch_kernel(rms_norm_block_kernel<W, kGate>, unsigned(xs.n_rows), kThreads, 0, stream, xs, gs,
                  os, w, offset, eps);
  } else if (xs.d <= 128) {
    // Rows of heads (the gated norms): four registers a lane, not eight, raise occupancy from
    // 34%: 68.9 -> 40.8 us at 2,048 tokens, 2,111 -> 1,180 us at 65,536 (H100, session 37).
    launch_kernel(rms_norm_kernel<W, kGate, 4>, blocks_for(xs.n_rows, kThreads / 32), kThreads, 0,
                  stream, xs, gs, os, w, offset, eps);
  } else {
    launch_kernel(rms_norm_kernel<W, kGate>, blocks_for(xs.n_rows, kThreads / 32), kThreads, 0,
                  stream, xs, gs, os, w, offset, eps);
  }
}

// In place, one warp per row of x [rows, d]: x = x · scale / sqrt(Σx² + eps)
__global__ void l2_norm_kernel(Rows x, float eps, float scale) {
  grid_dependency_sync();
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= x.n_rows) return;
  const int lane = threadIdx.x % 32;
  float* xr = x.row(r);
  const int64_t d = x.d;
  // As in rms_norm_kernel: the first kWarpNormPer elements of each lane in registers.
  float v[kWarpNormPer];
#pragma unroll
  for (int i = 0; i < kWarpNormPer; ++i) {
    const int64_t j = lane + 32 * int64_t(i);
    v[i] = j < d ? xr[j] : 0.0f;
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kWarpNormPer; ++i) {
    if (lane + 32 * int64_t(i) < d) ss += v[i] * v[i];
  }
  for (int64_t j = lane + 32 * int64_t(kWarpNormPer); j < d; j += 32) ss += xr[j] * xr[j];
  ss = warp_sum(ss);
  const float f = scale / sqrtf(ss + eps);
#pragma unroll
  for (int i = 0; i < kWarpNormPer; ++i) {
    const int64_t j = lane + 32 * int64_t(i);
    if (j < d) xr[j] = v[i] * f;
  }
  for (int64_t j = lane + 32 * int64_t(kWarpNormPer); j < d; j += 32) xr[j] *= f;
}

// The rotation of one pair (x0, x1) by cos c and sin s, with the roundings spelled out so that
// every kernel using it gives the same bits (rope_kernel, attention_inputs_kernel).
__device__ __forceinline__ void rotate_pair(float& x0, float& x1, float c, float s) {
  const float a = x0, b = x1;
  x0 = __fmaf_rn(a, c, -__fmul_rn(b, s));
  x1 = __fmaf_rn(b, c, __fmul_rn(a, s));
}

// x [n, heads, head_dim], in place on the first rot_dim channels of each head; one block per
// token. Angles in double, as on the CPU: positions reach millions, where f32 loses the phase.
__global__ void rope_kernel(float* x, int64_t s0, int64_t s1, int64_t heads,
                            const int32_t* positions, int rot_dim, double theta) {
  grid_dependency_sync();
  extern __shared__ float cs[];  // cos [half], sin [half]
  const int half = rot_dim / 2;
  const int64_t t = blockIdx.x;
  const double pos = double(positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const double angle = pos * pow(theta, -2.0 * i / rot_dim);
    cs[i] = float(cos(angle));
    cs[half + i] = float(sin(angle));
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < heads * half; e += blockDim.x) {
    const int64_t h = e / half;
    const int i = int(e % half);
    float* xr = x + t * s0 + h * s1;
    float x0 = xr[i], x1 = xr[i + half];
    rotate_pair(x0, x1, cs[i], cs[half + i]);
    xr[i] = x0, xr[i + half] = x1;
  }
}

struct AttnInputArgs {
  Rows q, k;       // [n·heads, hd], [n·kv, hd] as rows: normalised and rotated in place
  const float* v;  // [n, kv·dv]
  int64_t ld_v;
  const void *q_norm, *k_norm;  // [hd]
  float offset, eps;
  int heads, kv, hd, dv, rot_dim;
  double theta;
  void *kc, *vc;  // the caches, kv_cache_write_kernel's layouts (elements of a cache type)
  int64_t kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2;
  int bs, n_seqs;
  // [n_seqs+1] token offsets; [n] positions; [n_seqs+1] offsets into block_ids; [Σ blocks]
  const int32_t *seq_start, *positions, *block_start, *block_ids;
};

// The attention input stage, one warp per (token, q or k head): rope_kernel's cos/sin table;
// rms_norm_row as rms_norm_kernel computes it, in place, then the rotation as rope_kernel does
// it on the normalised row; a k head then goes into the cache with its v head. The results
// equal rms_norm + rope + kv_cache_write bit for bit. grid (n_tokens, heads + kv_heads), 32
// threads. T: the caches' element type (rounded to as kv_cache_write rounds).
template <typename W, typename T>
__global__ void __launch_bounds__(32) attention_inputs_kernel(AttnInputArgs a) {
  // The angles and the cache slot depend only on the batch's index arrays, uploaded before the
  // forward's kernels: they are computed before the wait for the kernel before.
  extern __shared__ float cs[];  // cos [half], sin [half]
  const int half = a.rot_dim / 2, hd = a.hd, lane = threadIdx.x, row = blockIdx.y;
  const int64_t t = blockIdx.x;
  const double pos = double(a.positions[t]);
  for (int i = lane; i < half; i += 32) {
    const double angle = pos * pow(a.theta, -2.0 * i / a.rot_dim);
    cs[i] = float(cos(angle));
    cs[half + i] = float(sin(angle));
  }
  const bool is_q = row < a.heads;
  T *kd = nullptr, *vd = nullptr;
  if (!is_q) {
    const int h = row - a.heads;
    const int s = seq_of_token(a.seq_start, a.n_seqs, int(t));
    const int p = a.positions[t];
    const int64_t block = a.block_ids[a.block_start[s] + p / a.bs], off = p % a.bs;
    kd = static_cast<T*>(a.kc) + block * a.kc_s0 + h * a.kc_s1 + off;
    vd = static_cast<T*>(a.vc) + block * a.vc_s0 + h * a.vc_s1 + off * a.vc_s2;
  }
  const W* w = static_cast<const W*>(is_q ? a.q_norm : a.k_norm);
  const auto wpre = load_norm_weights<kWarpNormPer>(w, hd, lane, 32);
  // A lane holds channels lane + 32·i of its row in registers through the norm; when the
  // rotated pairs (i, i + half) fall in one lane and the row fits, the rotation and the
  // stores work on those registers, and a k head's v row is requested with the norm's input:
  // one round trip after the wait instead of one per dependent copy.
  constexpr int kPer = kWarpNormPer;
  const bool in_regs = half % 32 == 0 && hd <= 32 * kPer;
  grid_dependency_sync();
  const int64_t r = is_q ? t * a.heads + row : t * a.kv + (row - a.heads);
  const Rows& x = is_q ? a.q : a.k;
  const float* v_src = is_q ? nullptr : a.v + t * a.ld_v + int64_t(row - a.heads) * a.dv;
  if (in_regs) {
    NormWeights<kPer> v_row;
    if (!is_q) v_row = load_norm_weights<kPer>(v_src, a.dv, lane, 32);
    auto rotate = [&](float(&o)[kPer]) {
      constexpr int kHalfMax = kPer / 2;
#pragma unroll
      for (int i = 0; i < kHalfMax; ++i) {
        const int pair = i + half / 32;  // register of channel lane + 32·i + half
        if (32 * i < half && pair < kPer) {
          float x0 = o[i], x1 = o[pair];
          rotate_pair(x0, x1, cs[lane + 32 * i], cs[half + lane + 32 * i]);
          o[i] = x0, o[pair] = x1;
        }
      }
      if (!is_q) {
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int j = lane + 32 * i;
          if (j < hd) kd[j * a.kc_s2] = cache_from_f32<T>(o[i]);
        }
      }
    };
    __syncwarp();  // cs written by every lane
    rms_norm_row<kPer, W, NormGate::kNone>(
        x, x, x, w, a.offset, a.eps, r, lane, 32, [](float ss) { return warp_sum(ss); }, wpre, {},
        rotate);
    if (!is_q) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int j = lane + 32 * i;
        if (j < a.dv) vd[j] = cache_from_f32<T>(v_row.v[i]);
      }
      for (int j = lane + 32 * kPer; j < a.dv; j += 32) vd[j] = cache_from_f32<T>(v_src[j]);
    }
    return;
  }
  __syncwarp();
  rms_norm_row<kWarpNormPer, W, NormGate::kNone>(
      x, x, x, w, a.offset, a.eps, r, lane, 32, [](float ss) { return warp_sum(ss); }, wpre);
  __syncwarp();
  float* xr = x.row(r);
  for (int i = lane; i < half; i += 32) {
    float x0 = xr[i], x1 = xr[i + half];
    rotate_pair(x0, x1, cs[i], cs[half + i]);
    xr[i] = x0, xr[i + half] = x1;
  }
  if (!is_q) {
    __syncwarp();
    for (int j = lane; j < hd; j += 32) kd[j * a.kc_s2] = cache_from_f32<T>(xr[j]);
    for (int j = lane; j < a.dv; j += 32) vd[j] = cache_from_f32<T>(v_src[j]);
  }
}

enum class Elementwise { kSwiglu, kMulSigmoid, kAdd, kAddScaledSigmoid, kZero };

// Elementwise over rows [n, d]: a is the output (and first input except for SwiGLU).
//   kSwiglu: a = silu(b)·c;  kMulSigmoid: a ·= σ(b);  kAdd: a += b;  kAddScaledSigmoid: a +=
//   σ(s[r])·b;  kZero: a = 0
template <Elementwise kOp>
__global__ void elementwise_kernel(Rows a, Rows b, Rows c, const float* s, int64_t lds) {
  grid_dependency_sync();
  const int64_t total = a.n_rows * a.d;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / a.d, j = e % a.d;
    float* ar = a.row(r);
    if constexpr (kOp == Elementwise::kZero) {
      ar[j] = 0.0f;
      continue;
    }
    const float bv = b.row(r)[j];
    if constexpr (kOp == Elementwise::kSwiglu) {
      ar[j] = silu(bv) * c.row(r)[j];
    } else if constexpr (kOp == Elementwise::kMulSigmoid) {
      ar[j] *= sigmoid(bv);
    } else if constexpr (kOp == Elementwise::kAdd) {
      ar[j] += bv;
    } else {
      ar[j] += sigmoid(s[r * lds]) * bv;
    }
  }
}

// g = -exp(a_log) · softplus(a + dt_bias), beta = σ(b);  a, g [n, channels] with dt_bias
// [channels] (channels = Hv·per_head: one decay per head, or per key channel); b, beta [n, Hv];
// a_log [Hv]. One thread per channel; the head's first channel also writes beta.
template <typename W>
__global__ void gdn_gates_kernel(const float* a, int64_t lda, const float* b, int64_t ldb,
                                 const W* a_log, const W* dt_bias, float* g, int64_t ldg,
                                 float* beta, int64_t ldbeta, int64_t n, int64_t channels,
                                 int64_t per_head) {
  grid_dependency_sync();
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n * channels) return;
  const int64_t t = e / channels, j = e % channels, h = j / per_head;
  g[t * ldg + j] = -expf(to_f32(a_log[h])) * softplus(a[t * lda + j] + to_f32(dt_bias[j]));
  if (j % per_head == 0) beta[t * ldbeta + h] = sigmoid(b[t * ldb + h]);
}

unsigned elementwise_blocks(int64_t total, int sms) {
  return unsigned(std::min<int64_t>(blocks_for(total, kThreads), int64_t(sms) * 16));
}

}  // namespace

namespace {
// The device copy of an embedding's ids: host ids are checked against the table first; ids
// already on the device (begin_forward's device tokens) are the backend's own picks.
const int32_t* checked_ids(CudaOps::Impl& s, const int32_t* ids, int n, int64_t vocab) {
  if (!s.on_device(ids, n)) {
    for (int i = 0; i < n; ++i) RECUR_CHECK(ids[i] >= 0 && ids[i] < vocab);
  }
  return s.ints(ids, n);
}
}  // namespace

void CudaOps::embedding(const int32_t* ids, int n, const Tensor& table, Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  if (n == 0) return;
  const int64_t d = table.shape[1];
  RECUR_CHECK(out.shape[0] == n && out.shape[1] == d && out.stride[1] == 1 &&
              table.is_contiguous());
  Impl& s = *impl_;
  const int32_t* dids = checked_ids(s, ids, n, table.shape[0]);
  dispatch_weight(table.dtype, [&](auto tag) {
    using W = decltype(tag);
    launch_kernel(embedding_kernel<W>, n, kThreads, 0, s.stream, dids, table.ptr<W>(), d,
                  out.ptr<float>(), out.stride[0]);
  });
  s.launched("embedding");
}

void CudaOps::embedding_rms_norm(const int32_t* ids, int n, const Tensor& table, Tensor out,
                                 const Tensor& w, float weight_offset, float eps, Tensor normed) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  if (n == 0) return;
  const int64_t d = table.shape[1];
  RECUR_CHECK(out.shape[0] == n && out.shape[1] == d && out.stride[1] == 1 &&
              table.is_contiguous());
  const Rows hs = rows_of(out), xs = rows_of(normed);
  RECUR_CHECK(w.numel() == d && xs.n_rows == n && xs.d == d);
  Impl& s = *impl_;
  const int32_t* dids = checked_ids(s, ids, n, table.shape[0]);
  dispatch_weight(table.dtype, [&](auto tag) {
    using W = decltype(tag);
    dispatch_weight(w.dtype, [&](auto ntag) {
      using WN = decltype(ntag);
      launch_kernel(embedding_rms_norm_kernel<W, WN>, n, kThreads, 0, s.stream, dids,
                    table.ptr<W>(), hs, xs, w.ptr<WN>(), weight_offset, eps);
    });
  });
  s.launched("embedding_rms_norm");
}

void CudaOps::gather_rows(const Tensor& x, const int32_t* rows, int n, Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  if (n == 0) return;
  const int64_t d = x.row_size();
  RECUR_CHECK(out.row_size() == d && x.dtype == DType::F32);
  for (int i = 0; i < n; ++i) RECUR_CHECK(rows[i] >= 0 && rows[i] < x.shape[0]);
  Impl& s = *impl_;
  const int32_t* drows = s.ints(rows, n);
  launch_kernel(gather_rows_kernel, n, kThreads, 0, s.stream, x.ptr<float>(), x.stride[0], drows, d,
                out.ptr<float>(), out.stride[0]);
  s.launched("gather_rows");
}

void CudaOps::rms_norm(const Tensor& x, const Tensor& w, float weight_offset, float eps,
                       Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const Rows xs = rows_of(x), os = rows_of(out);
  RECUR_CHECK(w.numel() == xs.d && os.n_rows == xs.n_rows && os.d == xs.d);
  if (xs.n_rows == 0) return;
  Impl& s = *impl_;
  dispatch_weight(w.dtype, [&](auto tag) {
    using W = decltype(tag);
    launch_rms_norm<W, NormGate::kNone>(xs, xs, os, w.ptr<W>(), weight_offset, eps, s.stream);
  });
  s.launched("rms_norm");
}

void CudaOps::rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& w, float eps,
                             GateActivation act, Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const Rows xs = rows_of(x), gs = rows_of(gate), os = rows_of(out);
  RECUR_CHECK(w.numel() == xs.d && gs.n_rows == xs.n_rows && os.n_rows == xs.n_rows &&
              gs.d == xs.d && os.d == xs.d);
  if (xs.n_rows == 0) return;
  Impl& s = *impl_;
  dispatch_weight(w.dtype, [&](auto tag) {
    using W = decltype(tag);
    if (act == GateActivation::kSilu) {
      launch_rms_norm<W, NormGate::kSilu>(xs, gs, os, w.ptr<W>(), 0.0f, eps, s.stream);
    } else {
      launch_rms_norm<W, NormGate::kSigmoid>(xs, gs, os, w.ptr<W>(), 0.0f, eps, s.stream);
    }
  });
  s.launched("rms_norm_gated");
}

void CudaOps::l2_norm(Tensor x, float eps, float scale) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const Rows xs = rows_of(x);
  if (xs.n_rows == 0) return;
  Impl& s = *impl_;
  launch_kernel(l2_norm_kernel, blocks_for(xs.n_rows, kThreads / 32), kThreads, 0, s.stream, xs,
                eps, scale);
  s.launched("l2_norm");
}

void CudaOps::rope(Tensor x, const int32_t* positions, int rot_dim, double theta) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  RECUR_CHECK(x.ndim == 3 && x.stride[2] == 1 && rot_dim % 2 == 0 && rot_dim <= x.shape[2]);
  const int64_t n = x.shape[0];
  if (n == 0 || rot_dim == 0) return;
  Impl& s = *impl_;
  const int32_t* dpos = s.ints(positions, n);
  launch_kernel(rope_kernel, unsigned(n), 128, size_t(rot_dim) * sizeof(float), s.stream,
                x.ptr<float>(), x.stride[0], x.stride[1], x.shape[1], dpos, rot_dim, theta);
  s.launched("rope");
}

void CudaOps::attention_inputs(const AttentionInputArgs& in, const SeqLayout& layout) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t n = in.q.shape[0], hd = in.head_dim, heads = in.heads, kv = in.kv_heads;
  const int64_t dv = kv > 0 ? in.v.shape[1] / kv : 0;
  // One kernel where its rows are warp-per-row norms (as rms_norm would run them) and the
  // layouts are plain; else the ops.
  bool fused = n > 0 && kv > 0 && dv > 0 && hd < kBlockNormMinWidth && in.rot_dim % 2 == 0 &&
               in.rot_dim <= hd && in.q_norm.dtype == in.k_norm.dtype && in.q_norm.numel() == hd &&
               in.k_norm.numel() == hd && in.k_cache.ndim == 4 && in.v_cache.ndim == 4 &&
               in.k_cache.shape[1] == kv && in.k_cache.shape[2] == hd &&
               in.k_cache.shape[3] == layout.block_size && in.v_cache.shape[1] == kv &&
               in.v_cache.shape[2] == layout.block_size && in.v_cache.shape[3] == dv &&
               in.k_cache.stride[3] == 1 && in.v_cache.stride[3] == 1 &&
               in.k_cache.dtype == in.v_cache.dtype;
  for (const Tensor* t : {&in.q, &in.k, &in.v}) {
    fused = fused && t->ndim == 2 && t->stride[1] == 1 && t->shape[0] == n;
  }
  fused =
      fused && in.q.shape[1] == heads * hd && in.k.shape[1] == kv * hd && in.v.shape[1] == kv * dv;
  if (!fused) {
    Ops::attention_inputs(in, layout);
    return;
  }
  for (int s = 0; s < layout.n_seqs; ++s) {  // as kv_cache_write checks
    RECUR_CHECK(layout.seq_len(s) == 0 ||
                (layout.positions[layout.seq_start[s + 1] - 1] / layout.block_size) <
                    layout.block_start[s + 1] - layout.block_start[s]);
  }
  Impl& s = *impl_;
  const DevLayout dl = s.layout(layout, true);
  AttnInputArgs a{};
  a.q = Rows{in.q.ptr<float>(), n * heads, hd, heads, in.q.stride[0], hd};
  a.k = Rows{in.k.ptr<float>(), n * kv, hd, kv, in.k.stride[0], hd};
  a.v = in.v.ptr<float>(), a.ld_v = in.v.stride[0];
  a.q_norm = in.q_norm.data, a.k_norm = in.k_norm.data;
  a.offset = in.norm_offset, a.eps = in.eps;
  a.heads = int(heads), a.kv = int(kv), a.hd = int(hd), a.dv = int(dv), a.rot_dim = in.rot_dim;
  a.theta = in.rope_theta;
  a.kc = in.k_cache.data, a.vc = in.v_cache.data;
  a.kc_s0 = in.k_cache.stride[0], a.kc_s1 = in.k_cache.stride[1], a.kc_s2 = in.k_cache.stride[2];
  a.vc_s0 = in.v_cache.stride[0], a.vc_s1 = in.v_cache.stride[1], a.vc_s2 = in.v_cache.stride[2];
  a.bs = layout.block_size, a.n_seqs = layout.n_seqs;
  a.seq_start = dl.seq_start, a.positions = dl.positions;
  a.block_start = dl.block_start, a.block_ids = dl.block_ids;
  dispatch_weight(in.q_norm.dtype, [&](auto wtag) {
    using W = decltype(wtag);
    dispatch_cache(in.k_cache.dtype, [&](auto ctag) {
      using T = decltype(ctag);
      launch_kernel(attention_inputs_kernel<W, T>, dim3(unsigned(n), unsigned(heads + kv)), 32,
                    size_t(std::max(in.rot_dim, 2)) * sizeof(float), s.stream, a);
    });
  });
  s.launched("attention_inputs");
}

void CudaOps::swiglu(const Tensor& gate, const Tensor& up, Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const Rows gs = rows_of(gate), us = rows_of(up), os = rows_of(out);
  RECUR_CHECK(gs.n_rows == os.n_rows && us.n_rows == os.n_rows && gs.d == os.d && us.d == os.d);
  if (os.n_rows * os.d == 0) return;
  Impl& s = *impl_;
  launch_kernel(elementwise_kernel<Elementwise::kSwiglu>,
                elementwise_blocks(os.n_rows * os.d, s.sm_count), kThreads, 0, s.stream, os, gs, us,
                nullptr, 0);
  s.launched("swiglu");
}

void CudaOps::mul_sigmoid(Tensor x, const Tensor& gate) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const Rows xs = rows_of(x), gs = rows_of(gate);
  RECUR_CHECK(gs.n_rows == xs.n_rows && gs.d == xs.d);
  if (xs.n_rows * xs.d == 0) return;
  Impl& s = *impl_;
  launch_kernel(elementwise_kernel<Elementwise::kMulSigmoid>,
                elementwise_blocks(xs.n_rows * xs.d, s.sm_count), kThreads, 0, s.stream, xs, gs, gs,
                nullptr, 0);
  s.launched("mul_sigmoid");
}

void CudaOps::add(Tensor x, const Tensor& y) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const Rows xs = rows_of(x), ys = rows_of(y);
  RECUR_CHECK(ys.n_rows == xs.n_rows && ys.d == xs.d);
  if (xs.n_rows * xs.d == 0) return;
  Impl& s = *impl_;
  launch_kernel(elementwise_kernel<Elementwise::kAdd>,
                elementwise_blocks(xs.n_rows * xs.d, s.sm_count), kThreads, 0, s.stream, xs, ys, ys,
                nullptr, 0);
  s.launched("add");
}

void CudaOps::zero_in_forward(Tensor x) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  RECUR_CHECK(x.is_contiguous() && x.dtype == DType::F32);
  const int64_t n = x.numel();
  if (n == 0) return;
  const Rows xs = rows_of(x.reshaped({1, n}));
  Impl& s = *impl_;
  launch_kernel(elementwise_kernel<Elementwise::kZero>, elementwise_blocks(n, s.sm_count), kThreads,
                0, s.stream, xs, xs, xs, nullptr, 0);
  s.launched("zero_in_forward");
}

void CudaOps::add_scaled_sigmoid(Tensor x, const Tensor& y, const Tensor& sc) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const Rows xs = rows_of(x), ys = rows_of(y);
  RECUR_CHECK(ys.n_rows == xs.n_rows && ys.d == xs.d && sc.shape[0] == xs.n_rows);
  if (xs.n_rows * xs.d == 0) return;
  Impl& s = *impl_;
  launch_kernel(elementwise_kernel<Elementwise::kAddScaledSigmoid>,
                elementwise_blocks(xs.n_rows * xs.d, s.sm_count), kThreads, 0, s.stream, xs, ys, ys,
                sc.ptr<float>(), sc.stride[0]);
  s.launched("add_scaled_sigmoid");
}

void CudaOps::gdn_gates(const Tensor& a, const Tensor& b, const Tensor& a_log,
                        const Tensor& dt_bias, Tensor g, Tensor beta) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t n = a.shape[0], hv = b.shape[1], channels = a.shape[1];
  RECUR_CHECK(hv > 0 && channels % hv == 0 && g.shape[1] == channels && beta.shape[1] == hv);
  RECUR_CHECK(a_log.numel() == hv && dt_bias.numel() == channels && a_log.dtype == dt_bias.dtype);
  RECUR_CHECK(a.stride[1] == 1 && b.stride[1] == 1 && g.stride[1] == 1 && beta.stride[1] == 1);
  if (n * channels == 0) return;
  Impl& s = *impl_;
  dispatch_weight(a_log.dtype, [&](auto tag) {
    using W = decltype(tag);
    launch_kernel(gdn_gates_kernel<W>, blocks_for(n * channels, kThreads), kThreads, 0, s.stream,
                  a.ptr<float>(), a.stride[0], b.ptr<float>(), b.stride[0], a_log.ptr<W>(),
                  dt_bias.ptr<W>(), g.ptr<float>(), g.stride[0], beta.ptr<float>(), beta.stride[0],
                  n, channels, channels / hv);
  });
  s.launched("gdn_gates");
}

}  // namespace recur
