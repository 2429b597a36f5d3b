// Gated DeltaNet input side on the GPU: the causal depthwise conv with its rolling per-slot
// state (prompts and one-token steps), and the fused one-token input stage (conv, L2 norms,
// gates) behind Ops::gdn_inputs. The delta rule itself is in kernels_gdn.cu.
#include <algorithm>
#include <type_traits>

#include "backend/cuda/cuda_internal.cuh"

namespace recur {

using namespace cuda;

namespace {

constexpr int kMaxConvK = 16;

constexpr int kConvRunTokens = 16;  // consecutive tokens a thread walks

// out[t, c] = silu(Σ_j w[c, j] · input(i − (K−1) + j)), input(<0) from the slot's conv state.
// A thread walks kConvRunTokens consecutive tokens of one channel, their inputs loaded up front
// (all in flight at once) and the K-input window kept in registers (reloaded where a sequence
// starts): each input is read once instead of K times (a token a thread took 138 µs a layer for
// 2,048 tokens × 8,192 channels on the H200, about 1 TB/s:
// bench/results/h200-session30-run1-prof-t2.txt). grid (⌈C/256⌉, runs): runs of kConvRunTokens
// tokens from run0, the channel blocks first, so that the blocks running at once read whole
// rows rather than one 1 KB column of thousands of rows (8% faster at 2,048 tokens on the
// H200, the same at 16,384: session 36). KT: the width K at compile time (the window exactly K
// registers), or 0 for any K up to kMaxConvK: the window of kMaxConvK predicated registers took 94
// registers a thread (24% occupancy); K = 4 at compile time took the kernel from 142.5 to 56.4 µs
// at 2,048 tokens (H100, session 37).
// x, out [n, C]; w [C, K]; state [slots, K-1, C]
template <typename W, int KT>
__global__ void conv1d_out_kernel(const float* x, int64_t ldx, const W* w, int k_width,
                                  const float* state, int64_t C, const int32_t* seq_start,
                                  const int32_t* slot, int n_seqs, int n_tokens, float* out,
                                  int64_t ldo, int run0) {
  constexpr int kW = KT > 0 ? KT : kMaxConvK;  // the window's registers
  const int K = KT > 0 ? KT : k_width;
  grid_dependency_sync();
  const int run_index = run0 + int(blockIdx.y);
  const int cblock = int(blockIdx.x);
  const int t0 = run_index * kConvRunTokens, t1 = min(t0 + kConvRunTokens, n_tokens);
  const int64_t c = int64_t(cblock) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float run[kConvRunTokens], wt[kW], in[kW];
#pragma unroll
  for (int u = 0; u < kConvRunTokens; ++u) {
    run[u] = t0 + u < t1 ? x[int64_t(t0 + u) * ldx + c] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kW; ++j) {
    if (j < K) wt[j] = to_f32(w[c * K + j]);
  }
  int s = seq_of_token(seq_start, n_seqs, t0), next = seq_start[s + 1];
#pragma unroll
  for (int u = 0; u < kConvRunTokens; ++u) {
    const int t = t0 + u;
    if (t >= t1) break;
    if (u == 0 || t == next) {  // the window of a sequence's token, from x and the state
      while (t == next) ++s, next = seq_start[s + 1];  // (past sequences without tokens)
      const int64_t base = seq_start[s], i = t - base;
      const float* st = state + int64_t(slot[s]) * (K - 1) * C;
#pragma unroll
      for (int j = 0; j < kW; ++j) {
        if (j < K) {
          const int64_t idx = i - (K - 1) + j;
          in[j] = idx < 0 ? st[(K - 1 + idx) * C + c] : x[(base + idx) * ldx + c];
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kW; ++j) {
        if (j + 1 < K) {
          in[j] = in[j + 1];
        } else if (j + 1 == K) {
          in[j] = run[u];
        }
      }
    }
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kW; ++j) {
      if (j < K) acc += wt[j] * in[j];
    }
    out[int64_t(t) * ldo + c] = silu(acc);
  }
}

// The state keeps each sequence's last K-1 inputs, oldest first; runs after conv1d_out_kernel
// (which reads the old state). grid (n_seqs, ⌈C/256⌉)
// x [n_tokens, C] (row stride ldx); state [slots, K-1, C]; seq_start [n_seqs+1]; slot [n_seqs]
__global__ void conv1d_state_kernel(const float* x, int64_t ldx, int K, float* state, int64_t C,
                                    const int32_t* seq_start, const int32_t* slot) {
  grid_dependency_sync();
  const int s = blockIdx.x;
  const int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t base = seq_start[s], len = seq_start[s + 1] - base;
  float* st = state + int64_t(slot[s]) * (K - 1) * C;
  float tail[kMaxConvK - 1];
#pragma unroll
  for (int r = 0; r < kMaxConvK - 1; ++r) {
    if (r < K - 1) {
      const int64_t idx = len - (K - 1) + r;
      tail[r] = idx < 0 ? st[(K - 1 + idx) * C + c] : x[(base + idx) * ldx + c];
    }
  }
#pragma unroll
  for (int r = 0; r < kMaxConvK - 1; ++r) {
    if (r < K - 1) st[r * C + c] = tail[r];
  }
}

// Decode (every sequence brings exactly one token): the output and the state's shift in one
// kernel. Channels are independent, so each thread reads its channel's K-1 state values and
// the token's input, writes the output (the same sum, in the same order, as
// conv1d_out_kernel) and then the shifted state. grid (n_seqs, ⌈C/256⌉).
// x, out [n = n_seqs, C]; w [C, K]; state [slots, K-1, C]
template <typename W>
__global__ void conv1d_decode_kernel(const float* x, int64_t ldx, const W* w, int K, float* state,
                                     int64_t C, const int32_t* seq_start, const int32_t* slot,
                                     float* out, int64_t ldo) {
  grid_dependency_sync();
  const int s = blockIdx.x;
  const int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t t = seq_start[s];
  float* st = state + int64_t(slot[s]) * (K - 1) * C;
  float in[kMaxConvK];
#pragma unroll
  for (int j = 0; j < kMaxConvK - 1; ++j) {
    if (j < K - 1) in[j] = st[j * C + c];
  }
  const float xv = x[t * ldx + c];
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kMaxConvK; ++j) {
    if (j < K) acc += to_f32(w[c * K + j]) * (j == K - 1 ? xv : in[j]);
  }
  out[t * ldo + c] = silu(acc);
#pragma unroll
  for (int r = 0; r < kMaxConvK - 1; ++r) {
    if (r < K - 1) st[r * C + c] = r + 1 < K - 1 ? in[r + 1] : xv;
  }
}

// A weight element widened to f32, its dtype known only at run time (uniform across the grid).
__device__ __forceinline__ float weight_f32(const void* p, DType dt, int64_t i) {
  if (dt == DType::BF16) return to_f32(static_cast<const __nv_bfloat16*>(p)[i]);
  if (dt == DType::F16) return to_f32(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// The decay is per value head (a, g [n, Hv], dt_bias [Hv]) or per key channel (a, g [n, Hv·dk],
// dt_bias [Hv·dk]; channel j of value head j / dk), as the kernel's template flag says.
struct GdnDecodeArgs {
  const float* mixed;  // [n, C]: q heads | k heads | v heads
  const float *a, *b;  // [n, Hv] or [n, Hv·dk]; [n, Hv]
  int64_t ld_mixed, ld_a, ld_b;
  const void *conv_w, *a_log, *dt_bias;  // [C, K]; [Hv]; [Hv] or [Hv·dk]
  DType gate_dt;
  float* state;                // [slots, K-1, C]
  float *conv_out, *g, *beta;  // [n, C]; [n, Hv] or [n, Hv·dk] (may be a); [n, Hv]
  int64_t ld_out, ld_g, ld_beta;
  int64_t C, key_dim;
  int dk, r, rdv;
  float eps, q_scale;
  const int32_t *seq_start, *slot;  // [n_seqs+1] token offsets; [n_seqs] state slots
};

constexpr int kGdnInputThreads = 256;
constexpr int kGdnMaxDkPerLane = 8;        // dk ≤ 256: a head's q or k in one warp's registers
constexpr int kGdnMaxVPerThread = 2;       // r·dv ≤ 512
constexpr int kGdnMaxDecaysPerThread = 2;  // a decay per key channel: r·dk ≤ 512

// One conv channel's inputs for a one-token step: the state's K-1 values, the weights, x.
template <int K>
struct ConvIn {
  float in[K - 1], w[K], x;
};
// The state and weights of channel c (x is read later, once the projections are done).
template <typename W, int K>
__device__ __forceinline__ ConvIn<K> conv_load(const GdnDecodeArgs& a, const float* st, int64_t c) {
  ConvIn<K> v;
#pragma unroll
  for (int j = 0; j < K - 1; ++j) v.in[j] = st[j * a.C + c];
#pragma unroll
  for (int j = 0; j < K; ++j) v.w[j] = to_f32(static_cast<const W*>(a.conv_w)[c * K + j]);
  v.x = 0.0f;
  return v;
}
// silu(Σ_j w[j] · input_j) and the state shifted by one: conv1d_decode_kernel's arithmetic.
template <int K>
__device__ __forceinline__ float conv_finish(const GdnDecodeArgs& a, float* st, int64_t c,
                                             const ConvIn<K>& v) {
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < K; ++j) acc += v.w[j] * (j == K - 1 ? v.x : v.in[j]);
#pragma unroll
  for (int j = 0; j < K - 1; ++j) st[j * a.C + c] = j + 1 < K - 1 ? v.in[j + 1] : v.x;
  return silu(acc);
}

// The Gated DeltaNet input stage for one-token sequences: grid (n_seqs, Hk), one block per key
// head. Warp 0 takes the head's q, warp 1 its k: conv, then the L2 norm with l2_norm_kernel's
// arithmetic (lane j holds channels j + 32i, summed in that order, then the warp's tree); all
// threads take the r value heads of the key head (conv); the first r threads take the gates.
// kDecayPerChannel (Kimi Delta Attention): the decay is per key channel of those value heads,
// r·dk of them, thread tid taking channels tid and tid + 256; beta stays with the first r
// threads. Every load is issued before any store, so the block costs about one memory round
// trip. The results equal conv1d_causal_silu + l2_norm + gdn_gates bit for bit.
// The conv state, conv weights and gate parameters load before the wait for the kernel before
// (no kernel of the forward writes them before this one; the batch mirror is uploaded before
// the forward's kernels), the projections after it.
template <typename W, int K, bool kDecayPerChannel>
__global__ void __launch_bounds__(kGdnInputThreads) gdn_inputs_decode_kernel(GdnDecodeArgs a) {
  const int sq = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const int64_t t = a.seq_start[sq];
  float* st = a.state + int64_t(a.slot[sq]) * (K - 1) * a.C;
  const float* src = a.mixed + t * a.ld_mixed;
  float* out = a.conv_out + t * a.ld_out;
  const bool qk = warp < 2;
  const int64_t c0 = warp * a.key_dim + int64_t(h) * a.dk;  // q or k channels of warp 0 or 1
  const int64_t v0 = 2 * a.key_dim + int64_t(h) * a.rdv;
  ConvIn<K> qin[kGdnMaxDkPerLane], vin[kGdnMaxVPerThread];
  if (qk) {
#pragma unroll
    for (int i = 0; i < kGdnMaxDkPerLane; ++i) {
      if (lane + 32 * i < a.dk) qin[i] = conv_load<W, K>(a, st, c0 + lane + 32 * i);
    }
  }
#pragma unroll
  for (int i = 0; i < kGdnMaxVPerThread; ++i) {
    const int j = tid + kGdnInputThreads * i;
    if (j < a.rdv) vin[i] = conv_load<W, K>(a, st, v0 + j);
  }
  // The decay of value head `head` (tid < r); per key channel, that of the block's channels
  // ch0 + j, j = tid + 256·i < r·dk, each with its value head's a_log (av_c, a_log_c, dt_bias_c).
  // Separate from the per-head scalars so that the per-head kernel stays as it was.
  float bv = 0.0f, av = 0.0f, a_log = 0.0f, dt_bias = 0.0f;
  const int head = h * a.r + tid;
  const int rdk = a.r * a.dk;
  const int64_t ch0 = int64_t(h) * rdk;
  float av_c[kGdnMaxDecaysPerThread], a_log_c[kGdnMaxDecaysPerThread],
      dt_bias_c[kGdnMaxDecaysPerThread];
  if constexpr (kDecayPerChannel) {
#pragma unroll
    for (int i = 0; i < kGdnMaxDecaysPerThread; ++i) {
      const int j = tid + kGdnInputThreads * i;
      if (j < rdk) {
        a_log_c[i] = weight_f32(a.a_log, a.gate_dt, h * a.r + j / a.dk);
        dt_bias_c[i] = weight_f32(a.dt_bias, a.gate_dt, ch0 + j);
      }
    }
  } else if (tid < a.r) {
    a_log = weight_f32(a.a_log, a.gate_dt, head), dt_bias = weight_f32(a.dt_bias, a.gate_dt, head);
  }
  grid_dependency_sync();
  if (qk) {
#pragma unroll
    for (int i = 0; i < kGdnMaxDkPerLane; ++i) {
      const int j = lane + 32 * i;
      if (j < a.dk) qin[i].x = src[c0 + j];
    }
  }
#pragma unroll
  for (int i = 0; i < kGdnMaxVPerThread; ++i) {
    const int j = tid + kGdnInputThreads * i;
    if (j < a.rdv) vin[i].x = src[v0 + j];
  }
  if constexpr (kDecayPerChannel) {
    if (tid < a.r) bv = a.b[t * a.ld_b + head];
#pragma unroll
    for (int i = 0; i < kGdnMaxDecaysPerThread; ++i) {
      const int j = tid + kGdnInputThreads * i;
      if (j < rdk) av_c[i] = a.a[t * a.ld_a + ch0 + j];
    }
  } else if (tid < a.r) {
    bv = a.b[t * a.ld_b + head], av = a.a[t * a.ld_a + head];
  }
  if (qk) {
    float v[kGdnMaxDkPerLane];
#pragma unroll
    for (int i = 0; i < kGdnMaxDkPerLane; ++i) {
      const int j = lane + 32 * i;
      v[i] = j < a.dk ? conv_finish<K>(a, st, c0 + j, qin[i]) : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kGdnMaxDkPerLane; ++i) {
      if (lane + 32 * i < a.dk) ss += v[i] * v[i];
    }
    ss = warp_sum(ss);
    const float f = (warp == 0 ? a.q_scale : 1.0f) / sqrtf(ss + a.eps);
#pragma unroll
    for (int i = 0; i < kGdnMaxDkPerLane; ++i) {
      const int j = lane + 32 * i;
      if (j < a.dk) out[c0 + j] = v[i] * f;
    }
  }
#pragma unroll
  for (int i = 0; i < kGdnMaxVPerThread; ++i) {
    const int j = tid + kGdnInputThreads * i;
    if (j < a.rdv) out[v0 + j] = conv_finish<K>(a, st, v0 + j, vin[i]);
  }
  // g may be a: each element is read above by the thread that writes it here.
  if constexpr (kDecayPerChannel) {
#pragma unroll
    for (int i = 0; i < kGdnMaxDecaysPerThread; ++i) {
      const int j = tid + kGdnInputThreads * i;
      if (j < rdk) a.g[t * a.ld_g + ch0 + j] = -expf(a_log_c[i]) * softplus(av_c[i] + dt_bias_c[i]);
    }
    if (tid < a.r) a.beta[t * a.ld_beta + head] = sigmoid(bv);
  } else if (tid < a.r) {
    a.g[t * a.ld_g + head] = -expf(a_log) * softplus(av + dt_bias);
    a.beta[t * a.ld_beta + head] = sigmoid(bv);
  }
}

// gdn_inputs_decode_kernel for conv width K (2 to 4).
template <typename W, bool kDecayPerChannel>
void launch_gdn_inputs_decode(int K, dim3 grid, cudaStream_t stream, const GdnDecodeArgs& a) {
  if (K == 2) {
    launch_kernel(gdn_inputs_decode_kernel<W, 2, kDecayPerChannel>, grid, kGdnInputThreads, 0,
                  stream, a);
  } else if (K == 3) {
    launch_kernel(gdn_inputs_decode_kernel<W, 3, kDecayPerChannel>, grid, kGdnInputThreads, 0,
                  stream, a);
  } else {
    launch_kernel(gdn_inputs_decode_kernel<W, 4, kDecayPerChannel>, grid, kGdnInputThreads, 0,
                  stream, a);
  }
}

}  // namespace

void CudaOps::conv1d_causal_silu(const Tensor& x, const Tensor& weight, Tensor conv_state,
                                 const SeqLayout& layout, Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t C = x.shape[1];
  const int K = int(weight.shape[1]);
  RECUR_CHECK(weight.ndim == 2 && weight.shape[0] == C && conv_state.shape[1] == K - 1 &&
              conv_state.shape[2] == C);
  RECUR_CHECK(K >= 1 && K <= kMaxConvK && x.stride[1] == 1 && out.stride[1] == 1);
  RECUR_CHECK(weight.is_contiguous() && conv_state.is_contiguous());
  if (layout.n_seqs == 0) return;
  Impl& s = *impl_;
  const DevLayout dl = s.layout(layout, false);
  const unsigned cblocks = blocks_for(C, 256);
  bool decode = K > 1 && layout.n_tokens == layout.n_seqs;
  for (int q = 0; decode && q < layout.n_seqs; ++q) {
    decode = layout.seq_start[q + 1] - layout.seq_start[q] == 1;
  }
  if (decode) {
    dispatch_weight(weight.dtype, [&](auto tag) {
      using W = decltype(tag);
      launch_kernel(conv1d_decode_kernel<W>, dim3(unsigned(layout.n_seqs), cblocks), 256, 0,
                    s.stream, x.ptr<float>(), x.stride[0], weight.ptr<W>(), K,
                    conv_state.ptr<float>(), C, dl.seq_start, dl.slot, out.ptr<float>(),
                    out.stride[0]);
    });
    s.launched("conv1d_causal_silu (decode)");
    return;
  }
  if (layout.n_tokens > 0) {
    dispatch_weight(weight.dtype, [&](auto tag) {
      using W = decltype(tag);
      const int runs = int((layout.n_tokens + kConvRunTokens - 1) / kConvRunTokens);
      // grid.y holds at most 65,535 runs (about a million tokens) a launch.
      constexpr int kMaxRuns = 65535;
      for (int run0 = 0; run0 < runs; run0 += kMaxRuns) {
        const unsigned n = unsigned(std::min(kMaxRuns, runs - run0));
        auto launch = [&](auto kt) {
          launch_kernel(conv1d_out_kernel<W, decltype(kt)::value>, dim3(cblocks, n), 256, 0,
                        s.stream, x.ptr<float>(), x.stride[0], weight.ptr<W>(), K,
                        conv_state.ptr<float>(), C, dl.seq_start, dl.slot, layout.n_seqs,
                        int(layout.n_tokens), out.ptr<float>(), out.stride[0], run0);
        };
        if (K == 4) {  // the width of every supported model's conv
          launch(std::integral_constant<int, 4>{});
        } else {
          launch(std::integral_constant<int, 0>{});
        }
      }
    });
    s.launched("conv1d_causal_silu (outputs)");
  }
  if (K > 1) {
    launch_kernel(conv1d_state_kernel, dim3(unsigned(layout.n_seqs), cblocks), 256, 0, s.stream,
                  x.ptr<float>(), x.stride[0], K, conv_state.ptr<float>(), C, dl.seq_start,
                  dl.slot);
    s.launched("conv1d_causal_silu (state)");
  }
}

void CudaOps::gdn_inputs(const GdnInputArgs& in, const SeqLayout& layout) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int hk = in.key_heads, hv = in.value_heads, dk = in.dk, dv = in.dv;
  RECUR_CHECK(hk > 0 && hv % hk == 0);
  const int r = hv / hk;
  const int64_t key_dim = int64_t(hk) * dk, C = 2 * key_dim + int64_t(hv) * dv;
  const int K = int(in.conv_weight.shape[1]);
  // A decay per key channel (Kimi Delta Attention) when a has more columns than value heads.
  const bool per_channel = in.a.ndim == 2 && in.a.shape[1] != hv;
  const int64_t decays = per_channel ? int64_t(hv) * dk : hv;  // columns of a and g
  // One kernel when every sequence brings one token and the shapes suit it; else the ops.
  bool fused = layout.n_seqs > 0 && layout.n_tokens == layout.n_seqs && K >= 2 && K <= 4 &&
               r <= kGdnInputThreads && dk <= 32 * kGdnMaxDkPerLane &&
               int64_t(r) * dv <= kGdnInputThreads * kGdnMaxVPerThread &&
               in.conv_weight.is_contiguous() && in.conv_weight.ndim == 2 &&
               in.conv_weight.shape[0] == C && in.conv_state.is_contiguous() &&
               in.conv_state.shape[1] == K - 1 && in.conv_state.shape[2] == C &&
               in.a_log.dtype == in.dt_bias.dtype && in.a_log.numel() == hv &&
               in.dt_bias.numel() == decays &&
               (!per_channel || int64_t(r) * dk <= kGdnInputThreads * kGdnMaxDecaysPerThread);
  for (const Tensor* t : {&in.mixed, &in.a, &in.b, &in.conv_out, &in.g, &in.beta}) {
    fused = fused && t->ndim == 2 && t->stride[1] == 1 && t->shape[0] == layout.n_tokens;
  }
  fused = fused && in.mixed.shape[1] == C && in.conv_out.shape[1] == C && in.a.shape[1] == decays &&
          in.b.shape[1] == hv && in.g.shape[1] == decays && in.beta.shape[1] == hv;
  for (int q = 0; fused && q < layout.n_seqs; ++q) {
    fused = layout.seq_start[q + 1] - layout.seq_start[q] == 1;
  }
  if (!fused) {
    Ops::gdn_inputs(in, layout);
    return;
  }
  Impl& s = *impl_;
  const DevLayout dl = s.layout(layout, false);
  GdnDecodeArgs a{};
  a.mixed = in.mixed.ptr<float>(), a.a = in.a.ptr<float>(), a.b = in.b.ptr<float>();
  a.ld_mixed = in.mixed.stride[0], a.ld_a = in.a.stride[0], a.ld_b = in.b.stride[0];
  a.conv_w = in.conv_weight.data, a.a_log = in.a_log.data, a.dt_bias = in.dt_bias.data;
  a.gate_dt = in.a_log.dtype;
  a.state = in.conv_state.ptr<float>();
  a.conv_out = in.conv_out.ptr<float>();
  a.g = in.g.ptr<float>(), a.beta = in.beta.ptr<float>();
  a.ld_out = in.conv_out.stride[0];
  a.ld_g = in.g.stride[0], a.ld_beta = in.beta.stride[0];
  a.C = C, a.key_dim = key_dim, a.dk = dk, a.r = r, a.rdv = r * dv;
  a.eps = in.l2_eps, a.q_scale = in.q_scale;
  a.seq_start = dl.seq_start, a.slot = dl.slot;
  const dim3 grid(unsigned(layout.n_seqs), unsigned(hk));
  dispatch_weight(in.conv_weight.dtype, [&](auto tag) {
    using W = decltype(tag);
    if (per_channel) {
      launch_gdn_inputs_decode<W, true>(K, grid, s.stream, a);
    } else {
      launch_gdn_inputs_decode<W, false>(K, grid, s.stream, a);
    }
  });
  s.launched("gdn_inputs (decode)");
}

}  // namespace recur
