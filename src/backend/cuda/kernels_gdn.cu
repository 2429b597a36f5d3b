// Gated DeltaNet on the GPU: the causal depthwise conv with its rolling per-slot state, and the
// gated delta rule in its recurrent form (decode: the state tile stays in registers across the
// sequence's tokens) and its chunked WY/UT form (prompts: chunks of 64 tokens, the same
// algebra as delta_rule_chunked in backend/cpu/kernels_gdn.cpp, including the (I + A)^-1
// solve in double). Value columns are independent in the rule, so both forms split dv across
// blocks; the chunked form first computes the key-side matrices of every chunk in parallel,
// then walks the chunks in order with the state.
#include <algorithm>

#include "backend/cuda/cuda_internal.cuh"

namespace recur {

using namespace cuda;

namespace {

constexpr int kMaxConvK = 16;

// out[t, c] = silu(Σ_j w[c, j] · input(i − (K−1) + j)), input(<0) from the slot's conv state;
// grid (n_tokens, ⌈C/256⌉).  x, out [n, C]; w [C, 1, K]; state [slots, K-1, C]
template <typename W>
__global__ void conv1d_out_kernel(const float* x, int64_t ldx, const W* w, int K,
                                  const float* state, int64_t C, const int32_t* seq_start,
                                  const int32_t* slot, int n_seqs, float* out, int64_t ldo) {
  grid_dependency_sync();
  const int t = blockIdx.x;
  const int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int s = seq_of_token(seq_start, n_seqs, t);
  const int64_t base = seq_start[s], i = t - base;
  const float* st = state + int64_t(slot[s]) * (K - 1) * C;
  float acc = 0.0f;
  for (int j = 0; j < K; ++j) {
    const int64_t idx = i - (K - 1) + j;
    const float in = idx < 0 ? st[(K - 1 + idx) * C + c] : x[(base + idx) * ldx + c];
    acc += to_f32(w[c * K + j]) * in;
  }
  out[int64_t(t) * ldo + c] = silu(acc);
}

// The state keeps each sequence's last K-1 inputs, oldest first; runs after conv1d_out_kernel
// (which reads the old state). grid (n_seqs, ⌈C/256⌉)
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
// x, out [n = n_seqs, C]; w [C, 1, K]; state [slots, K-1, C]
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

struct GdnDecodeArgs {
  const float* qkvz;  // [n, Hk·width], width = 2dk + 2r·dv
  const float* ba;    // [n, Hk·2r]
  int64_t ld_qkvz, ld_ba;
  const void *conv_w, *a_log, *dt_bias;  // [C, 1, K]; [Hv]; [Hv]
  DType gate_dt;
  float* state;                    // [slots, K-1, C]
  float *conv_out, *z, *g, *beta;  // [n, C]; [n, Hv·dv]; [n, Hv]; [n, Hv]
  int64_t ld_out, ld_z, ld_g, ld_beta;
  int64_t C, key_dim;
  int dk, r, rdv;
  float eps, q_scale;
  const int32_t *seq_start, *slot;
};

constexpr int kGdnInputThreads = 256;
constexpr int kGdnMaxDkPerLane = 8;   // dk ≤ 256: a head's q or k in one warp's registers
constexpr int kGdnMaxVPerThread = 2;  // r·dv ≤ 512

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
// threads take the r value heads (conv) and z (copied); the first r threads take the gates.
// Every load is issued before any store, so the block costs about one memory round trip. The
// results equal split_groups + conv1d_causal_silu + l2_norm + gdn_gates bit for bit.
// The conv state, conv weights and gate parameters load before the wait for the kernel before
// (no kernel of the forward writes them before this one; the batch mirror is uploaded before
// the forward's kernels), the projections after it.
template <typename W, int K>
__global__ void __launch_bounds__(kGdnInputThreads) gdn_inputs_decode_kernel(GdnDecodeArgs a) {
  const int sq = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const int64_t t = a.seq_start[sq];
  float* st = a.state + int64_t(a.slot[sq]) * (K - 1) * a.C;
  const float* src = a.qkvz + t * a.ld_qkvz + int64_t(h) * (2 * a.dk + 2 * a.rdv);
  float* out = a.conv_out + t * a.ld_out;
  const bool qk = warp < 2;
  const int64_t c0 = warp * a.key_dim + int64_t(h) * a.dk;  // q or k channels of warp 0 or 1
  const int64_t v0 = 2 * a.key_dim + int64_t(h) * a.rdv;
  ConvIn<K> qin[kGdnMaxDkPerLane], vin[kGdnMaxVPerThread];
  float zv[kGdnMaxVPerThread];
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
  float bv = 0.0f, av = 0.0f, a_log = 0.0f, dt_bias = 0.0f;
  const int head = h * a.r + tid;
  if (tid < a.r) {
    a_log = weight_f32(a.a_log, a.gate_dt, head), dt_bias = weight_f32(a.dt_bias, a.gate_dt, head);
  }
  grid_dependency_sync();
  if (qk) {
#pragma unroll
    for (int i = 0; i < kGdnMaxDkPerLane; ++i) {
      const int j = lane + 32 * i;
      if (j < a.dk) qin[i].x = src[warp * a.dk + j];
    }
  }
#pragma unroll
  for (int i = 0; i < kGdnMaxVPerThread; ++i) {
    const int j = tid + kGdnInputThreads * i;
    if (j < a.rdv) {
      vin[i].x = src[2 * a.dk + j];
      zv[i] = src[2 * a.dk + a.rdv + j];
    }
  }
  if (tid < a.r) {
    const float* bas = a.ba + t * a.ld_ba + int64_t(h) * 2 * a.r;
    bv = bas[tid], av = bas[a.r + tid];
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
    if (j < a.rdv) {
      out[v0 + j] = conv_finish<K>(a, st, v0 + j, vin[i]);
      a.z[t * a.ld_z + int64_t(h) * a.rdv + j] = zv[i];
    }
  }
  if (tid < a.r) {
    a.g[t * a.ld_g + head] = -expf(a_log) * softplus(av + dt_bias);
    a.beta[t * a.ld_beta + head] = sigmoid(bv);
  }
}

// Which sequences a delta-rule launch handles (kAuto launches both forms).
enum DeltaMode : int { kAllSeqs = 0, kSingleTokenSeqs = 1, kMultiTokenSeqs = 2 };

struct DeltaArgs {
  const float *q, *k, *v, *g, *beta;  // q, k [n, Hk, dk]; v [n, Hv, dv]; g, beta [n, Hv]
  int64_t q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, g_s0, beta_s0, o_s0, o_s1;
  float* state;  // [slots, Hv, dk, dv]
  float* out;    // [n, Hv, dv]
  int hv, group, dk, dv;
  const int32_t *seq_start, *slot;
  int mode;
};

__device__ __forceinline__ bool skip_seq(int mode, int64_t len) {
  return (mode == kSingleTokenSeqs && len != 1) || (mode == kMultiTokenSeqs && len <= 1);
}

constexpr int kRecWarps = 4;

// Recurrent form, token by token. grid (⌈dv/32⌉, Hv, n_seqs), block (32, kRecWarps): lane =
// value column, warp w owns state rows w, w + kRecWarps, ... (RPT of them, in registers).
template <int RPT>
__global__ void __launch_bounds__(32 * kRecWarps) delta_recurrent_kernel(DeltaArgs a) {
  // The state tile loads before the wait for the kernel before: no kernel of this forward
  // writes this slot's state before this one (and the batch mirror is uploaded before the
  // forward's kernels), so its DRAM round trip overlaps that kernel.
  const int s = blockIdx.z, h = blockIdx.y;
  const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
  const int j = blockIdx.x * 32 + lane;
  const int64_t base = a.seq_start[s], len = a.seq_start[s + 1] - base;
  if (skip_seq(a.mode, len)) return;
  const int kh = h / a.group;
  float* S = a.state + (int64_t(a.slot[s]) * a.hv + h) * a.dk * a.dv;
  __shared__ float qs[kRecWarps * RPT], ks[kRecWarps * RPT];
  __shared__ float red[kRecWarps][32], red2[kRecWarps][32];
  float st[RPT];
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const int i = warp + kRecWarps * r;
    st[r] = (i < a.dk && j < a.dv) ? S[int64_t(i) * a.dv + j] : 0.0f;
  }
  grid_dependency_sync();
  for (int64_t t = base; t < base + len; ++t) {
    for (int i = tid; i < a.dk; i += 32 * kRecWarps) {
      qs[i] = a.q[t * a.q_s0 + kh * a.q_s1 + i];
      ks[i] = a.k[t * a.k_s0 + kh * a.k_s1 + i];
    }
    const float decay = expf(a.g[t * a.g_s0 + h]);
    const float b = a.beta[t * a.beta_s0 + h];
    const float vj = j < a.dv ? a.v[t * a.v_s0 + h * a.v_s1 + j] : 0.0f;
    __syncthreads();
    // S ← S·exp(g); kv = Sᵀk
    float p = 0.0f;
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int i = warp + kRecWarps * r;
      if (i < a.dk) {
        st[r] *= decay;
        p += st[r] * ks[i];
      }
    }
    red[warp][lane] = p;
    __syncthreads();
    float kv = 0.0f;
#pragma unroll
    for (int w = 0; w < kRecWarps; ++w) kv += red[w][lane];
    const float delta = (vj - kv) * b;
    // S ← S + k ⊗ delta; o = Sᵀq
    float po = 0.0f;
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int i = warp + kRecWarps * r;
      if (i < a.dk) {
        st[r] += ks[i] * delta;
        po += st[r] * qs[i];
      }
    }
    red2[warp][lane] = po;
    __syncthreads();
    if (warp == 0 && j < a.dv) {
      float o = 0.0f;
#pragma unroll
      for (int w = 0; w < kRecWarps; ++w) o += red2[w][lane];
      a.out[t * a.o_s0 + h * a.o_s1 + j] = o;
    }
    __syncthreads();  // qs, ks, red and red2 are rewritten by the next token
  }
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const int i = warp + kRecWarps * r;
    if (i < a.dk && j < a.dv) S[int64_t(i) * a.dv + j] = st[r];
  }
}

constexpr int kChunk = 64;
constexpr int kChunkThreads = 512;  // 16 warps: the phases are latency-bound at one block per SM
constexpr int kChunkPad = kChunk + 1;

// The chunked form runs in two kernels. Everything that depends only on a chunk's keys,
// queries, gates and betas (not on the state) is computed for all chunks and heads at once by
// delta_chunk_keys_kernel into a record per (sequence, chunk, head); delta_chunk_state_kernel
// then walks each sequence's chunks in order, carrying the state. Within a chunk (G the
// cumulative log-decay, S0 the state before it): A[i][j] = β_i e^(G_i−G_j) k_i·k_j (j < i),
// T = (I + A)^-1, Wk = T(β e^G K), U = T(βV), Vnew = U − Wk S0,
// out_i = e^(G_i) q_i S0 + Σ_{j≤i} e^(G_i−G_j) (q_i·k_j) Vnew_j,
// S = e^(G_last) S0 + Σ_j e^(G_last−G_j) k_j ⊗ Vnew_j.
// The record, floats: Wk [64][dk], QK [64][65] (e^(G_i−G_j) q_i·k_j), Tb [64][65] (T·β, by
// column), eg [64] (e^G_i), dl [64] (e^(G_last−G_i)).
__host__ __device__ inline int64_t chunk_record_floats(int dk) {
  return (int64_t(kChunk) * dk + 2 * kChunk * kChunkPad + 2 * kChunk + 3) / 4 * 4;
}

// Records of chunks [c0, c0 + n_chunks) of sequences [s0, s0 + n_seq_group), each head.
struct ChunkRecords {
  float* base;
  int c0, n_chunks, s0, n_seq_group;
  __device__ float* at(int s, int c, int h, int hv, int dk) const {
    const int64_t idx = (int64_t(s - s0) * n_chunks + (c - c0)) * hv + h;
    return base + idx * chunk_record_floats(dk);
  }
};

// grid (n_chunks, Hv, n_seq_group), kChunkThreads. Shared: T [64][64] double, Q, K
// [64][dk+1], A [64][65], G, beta, eg [64].
__host__ __device__ inline size_t chunk_keys_smem(int dk) {
  return sizeof(double) * kChunk * kChunk +
         sizeof(float) * (2 * size_t(kChunk) * (dk + 1) + kChunk * kChunkPad + 3 * kChunk);
}

__global__ void __launch_bounds__(kChunkThreads)
    delta_chunk_keys_kernel(DeltaArgs a, ChunkRecords rec) {
  grid_dependency_sync();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int c = rec.c0 + blockIdx.x, h = blockIdx.y, s = rec.s0 + blockIdx.z, tid = threadIdx.x;
  const int64_t base = a.seq_start[s], len = a.seq_start[s + 1] - base;
  if (skip_seq(a.mode, len) || int64_t(c) * kChunk >= len) return;
  const int kh = h / a.group, dk = a.dk, ldq = dk + 1, lda = kChunkPad;
  double* T = reinterpret_cast<double*>(smem_raw);
  float* Q = reinterpret_cast<float*>(T + kChunk * kChunk);
  float* K = Q + kChunk * ldq;
  float* A = K + kChunk * ldq;
  float* G = A + kChunk * lda;
  float* beta = G + kChunk;
  float* eg = beta + kChunk;
  float* r = rec.at(s, c, h, a.hv, dk);
  float* Wk = r;                    // [64][dk]
  float* QK = Wk + kChunk * dk;     // [64][65]
  float* Tb = QK + kChunk * lda;    // [64][65]
  float* r_eg = Tb + kChunk * lda;  // [64]
  float* r_dl = r_eg + kChunk;      // [64]
  const int L = int(min64(kChunk, len - int64_t(c) * kChunk));
  const int64_t t0 = base + int64_t(c) * kChunk;
  for (int e = tid; e < L * dk; e += kChunkThreads) {
    const int i = e / dk, mm = e % dk;
    Q[i * ldq + mm] = a.q[(t0 + i) * a.q_s0 + kh * a.q_s1 + mm];
    K[i * ldq + mm] = a.k[(t0 + i) * a.k_s0 + kh * a.k_s1 + mm];
  }
  if (tid == 0) {
    // Sequential, as on the CPU, so the cumulative decays round the same way.
    float cum = 0.0f;
    for (int i = 0; i < L; ++i) {
      cum += a.g[(t0 + i) * a.g_s0 + h];
      G[i] = cum;
      beta[i] = a.beta[(t0 + i) * a.beta_s0 + h];
      eg[i] = expf(cum);
    }
    for (int i = 0; i < L; ++i) {
      r_eg[i] = eg[i];
      r_dl[i] = expf(G[L - 1] - G[i]);
    }
  }
  __syncthreads();
  // A (strictly lower) and the decayed q·k products.
  for (int p = tid; p < L * (L + 1) / 2; p += kChunkThreads) {
    // p enumerates the lower triangle row by row: p = i(i+1)/2 + jx, jx ≤ i.
    int i = int((sqrtf(8.0f * float(p) + 1.0f) - 1.0f) * 0.5f);
    while (i * (i + 1) / 2 > p) --i;
    while ((i + 1) * (i + 2) / 2 <= p) ++i;
    const int jx = p - i * (i + 1) / 2;
    const float decay = expf(G[i] - G[jx]);
    float dkk = 0.0f, dqk = 0.0f;
    for (int mm = 0; mm < dk; ++mm) {
      const float kj = K[jx * ldq + mm];
      dkk += K[i * ldq + mm] * kj;
      dqk += Q[i * ldq + mm] * kj;
    }
    if (jx < i) A[i * lda + jx] = beta[i] * decay * dkk;
    QK[i * lda + jx] = decay * dqk;
  }
  __syncthreads();
  // T = (I + A)^-1 by forward substitution in double (the solve amplifies rounding when many
  // keys of a chunk are nearly parallel). Columns are independent: a warp solves kSolveCols
  // of them together, x = T[:, col] held by the lanes (rows lane and lane + 32), each row's
  // sum x_i = -Σ_{mm<i} A[i][mm] x_mm split across the lanes. No block barrier inside.
  {
    static_assert(kChunk == 64 && kChunkThreads % 32 == 0);
    constexpr int kWarps = kChunkThreads / 32, kSolveCols = kChunk / kWarps;
    const int warp = tid / 32, lane = tid % 32;
    double x0[kSolveCols], x1[kSolveCols];
#pragma unroll
    for (int q = 0; q < kSolveCols; ++q) {
      const int col = warp + q * kWarps;
      x0[q] = lane == col ? 1.0 : 0.0;
      x1[q] = lane + 32 == col ? 1.0 : 0.0;
    }
    for (int i = 1; i < L; ++i) {
      // Only A's strictly lower part of row i was written.
      const double a0 = lane < i ? double(A[i * lda + lane]) : 0.0;
      const double a1 = lane + 32 < i ? double(A[i * lda + lane + 32]) : 0.0;
#pragma unroll
      for (int q = 0; q < kSolveCols; ++q) {
        double p = a0 * x0[q] + a1 * x1[q];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
        if (i > warp + q * kWarps) {  // rows above the diagonal stay 0, the diagonal 1
          if (lane == i) x0[q] = -p;
          if (lane + 32 == i) x1[q] = -p;
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kSolveCols; ++q) {
      const int col = warp + q * kWarps;
      if (lane < L) T[lane * kChunk + col] = x0[q];
      if (lane + 32 < L) T[(lane + 32) * kChunk + col] = x1[q];
    }
  }
  __syncthreads();
  // Wk = T(β e^G K); Tb = T·β for U = T(βV), rounded as the products below use them.
  for (int e = tid; e < L * dk; e += kChunkThreads) {
    const int i = e / dk, mm = e % dk;
    float w = 0.0f;
    for (int jx = 0; jx <= i; ++jx) {
      const float tk = float(T[i * kChunk + jx]) * beta[jx] * eg[jx];
      w += tk * K[jx * ldq + mm];
    }
    Wk[i * dk + mm] = w;
  }
  for (int e = tid; e < L * L; e += kChunkThreads) {
    const int i = e / L, jx = e % L;
    if (jx <= i) Tb[i * lda + jx] = float(T[i * kChunk + jx]) * beta[jx];
  }
}

// Shared-memory carve-up of the state kernel for key dim dk and a tile of dvt value columns.
struct ChunkSmem {
  float* S;        // [dk][dvt] state tile
  float *Q, *K;    // [64][dk+1]
  float* Wk;       // [64][dk+1]
  float *V, *Vn;   // [64][dvt+1] values, new values
  float* O;        // [64][dvt+1] inter-chunk outputs
  float *QK, *Tb;  // [64][65]
  float *eg, *dl;  // [64]
  __host__ __device__ static size_t bytes(int dk, int dvt) {
    return sizeof(float) * (size_t(dk) * dvt + 3 * kChunk * (dk + 1) + 3 * kChunk * (dvt + 1) +
                            2 * kChunk * kChunkPad + 2 * kChunk);
  }
  __device__ ChunkSmem(void* p, int dk, int dvt) {
    float* f = static_cast<float*>(p);
    S = f, f += dk * dvt;
    Q = f, f += kChunk * (dk + 1);
    K = f, f += kChunk * (dk + 1);
    Wk = f, f += kChunk * (dk + 1);
    V = f, f += kChunk * (dvt + 1);
    Vn = f, f += kChunk * (dvt + 1);
    O = f, f += kChunk * (dvt + 1);
    QK = f, f += kChunk * kChunkPad;
    Tb = f, f += kChunk * kChunkPad;
    eg = f, f += kChunk;
    dl = f;
  }
};

// The state's walk over chunks [rec.c0, rec.c0 + rec.n_chunks) of each sequence. grid
// (⌈dv/dvt⌉, Hv, n_seq_group), kChunkThreads threads; three barriers per chunk.
__global__ void __launch_bounds__(kChunkThreads)
    delta_chunk_state_kernel(DeltaArgs a, ChunkRecords rec, int dvt) {
  grid_dependency_sync();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int s = rec.s0 + blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
  const int j0 = blockIdx.x * dvt;
  const int ncols = min(dvt, a.dv - j0);
  const int64_t base = a.seq_start[s], len = a.seq_start[s + 1] - base;
  if (skip_seq(a.mode, len) || int64_t(rec.c0) * kChunk >= len) return;
  const int kh = h / a.group, dk = a.dk;
  const int ldq = dk + 1, ldv = dvt + 1, lda = kChunkPad;
  ChunkSmem m(smem_raw, dk, dvt);
  float* Sg = a.state + (int64_t(a.slot[s]) * a.hv + h) * dk * a.dv;
  for (int e = tid; e < dk * dvt; e += kChunkThreads) {
    const int i = e / dvt, jj = e % dvt;
    m.S[e] = jj < ncols ? Sg[int64_t(i) * a.dv + j0 + jj] : 0.0f;
  }
  const int c_end = int(min64(rec.c0 + rec.n_chunks, (len + kChunk - 1) / kChunk));
  for (int c = rec.c0; c < c_end; ++c) {
    const int L = int(min64(kChunk, len - int64_t(c) * kChunk));
    const int64_t t0 = base + int64_t(c) * kChunk;
    const float* r = rec.at(s, c, h, a.hv, dk);
    const float* rWk = r;
    const float* rQK = rWk + kChunk * dk;
    const float* rTb = rQK + kChunk * lda;
    for (int e = tid; e < L * dk; e += kChunkThreads) {
      const int i = e / dk, mm = e % dk;
      m.Q[i * ldq + mm] = a.q[(t0 + i) * a.q_s0 + kh * a.q_s1 + mm];
      m.K[i * ldq + mm] = a.k[(t0 + i) * a.k_s0 + kh * a.k_s1 + mm];
      m.Wk[i * ldq + mm] = rWk[i * dk + mm];
    }
    for (int e = tid; e < L * dvt; e += kChunkThreads) {
      const int i = e / dvt, jj = e % dvt;
      m.V[i * ldv + jj] = jj < ncols ? a.v[(t0 + i) * a.v_s0 + h * a.v_s1 + j0 + jj] : 0.0f;
    }
    for (int e = tid; e < L * lda; e += kChunkThreads) {
      m.QK[e] = rQK[e];
      m.Tb[e] = rTb[e];
    }
    if (tid < L) {
      m.eg[tid] = rTb[kChunk * lda + tid];
      m.dl[tid] = rTb[kChunk * lda + kChunk + tid];
    }
    __syncthreads();
    // The inter-chunk outputs e^G q S0, and Vnew = T(βV) − Wk S0.
    for (int e = tid; e < L * dvt; e += kChunkThreads) {
      const int i = e / dvt, jj = e % dvt;
      float o = 0.0f;
      for (int mm = 0; mm < dk; ++mm) o += (m.Q[i * ldq + mm] * m.eg[i]) * m.S[mm * dvt + jj];
      m.O[i * ldv + jj] = o;
      float vn = 0.0f;
      for (int jx = 0; jx <= i; ++jx) vn += m.Tb[i * lda + jx] * m.V[jx * ldv + jj];
      for (int mm = 0; mm < dk; ++mm) vn -= m.Wk[i * ldq + mm] * m.S[mm * dvt + jj];
      m.Vn[i * ldv + jj] = vn;
    }
    __syncthreads();
    // Outputs, and the state carried to the next chunk.
    for (int e = tid; e < L * dvt; e += kChunkThreads) {
      const int i = e / dvt, jj = e % dvt;
      float o = m.O[i * ldv + jj];
      for (int jx = 0; jx <= i; ++jx) o += m.QK[i * lda + jx] * m.Vn[jx * ldv + jj];
      if (jj < ncols) a.out[(t0 + i) * a.o_s0 + h * a.o_s1 + j0 + jj] = o;
    }
    const float decay_all = m.eg[L - 1];
    for (int e = tid; e < dk * dvt; e += kChunkThreads) {
      const int mm = e / dvt, jj = e % dvt;
      float sv = m.S[e] * decay_all;
      for (int jx = 0; jx < L; ++jx) sv += (m.K[jx * ldq + mm] * m.dl[jx]) * m.Vn[jx * ldv + jj];
      m.S[e] = sv;
    }
    __syncthreads();
  }
  for (int e = tid; e < dk * dvt; e += kChunkThreads) {
    const int i = e / dvt, jj = e % dvt;
    if (jj < ncols) Sg[int64_t(i) * a.dv + j0 + jj] = m.S[e];
  }
}

void launch_recurrent(const DeltaArgs& a, int n_seqs, cudaStream_t stream) {
  const dim3 grid(unsigned((a.dv + 31) / 32), unsigned(a.hv), unsigned(n_seqs));
  const dim3 block(32, kRecWarps);
  const int rpt = (a.dk + kRecWarps - 1) / kRecWarps;
  if (rpt <= 4) {
    launch_kernel(delta_recurrent_kernel<4>, grid, block, 0, stream, a);
  } else if (rpt <= 8) {
    launch_kernel(delta_recurrent_kernel<8>, grid, block, 0, stream, a);
  } else if (rpt <= 16) {
    launch_kernel(delta_recurrent_kernel<16>, grid, block, 0, stream, a);
  } else if (rpt <= 32) {
    launch_kernel(delta_recurrent_kernel<32>, grid, block, 0, stream, a);
  } else {
    RECUR_CHECK(rpt <= 64);
    launch_kernel(delta_recurrent_kernel<64>, grid, block, 0, stream, a);
  }
}

// Chunk records go through `scratch` in pieces: as many sequences and chunks at a time as it
// holds (host lengths say how many chunks each sequence has).
void launch_chunked(const DeltaArgs& a, const SeqLayout& layout, void* scratch,
                    size_t scratch_bytes, size_t max_smem, cudaStream_t stream) {
  int dvt = 32;
  while (dvt > 4 && ChunkSmem::bytes(a.dk, dvt) > max_smem) dvt /= 2;
  const size_t state_smem = ChunkSmem::bytes(a.dk, dvt), keys_smem = chunk_keys_smem(a.dk);
  if (state_smem > max_smem || keys_smem > max_smem) {
    fatal("gated_delta_rule: key head dim too large for the chunked kernel");
  }
  dvt = std::min(dvt, a.dv);
  static size_t opted_in = 0;
  if (opted_in < max_smem) {
    RECUR_CUDA_CHECK(cudaFuncSetAttribute(
        delta_chunk_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(max_smem)));
    RECUR_CUDA_CHECK(cudaFuncSetAttribute(
        delta_chunk_keys_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(max_smem)));
    opted_in = max_smem;
  }
  int max_chunks = 0;
  for (int i = 0; i < layout.n_seqs; ++i) {
    const int len = layout.seq_len(i);
    if ((a.mode == kSingleTokenSeqs && len != 1) || (a.mode == kMultiTokenSeqs && len <= 1))
      continue;
    max_chunks = std::max(max_chunks, (len + kChunk - 1) / kChunk);
  }
  if (max_chunks == 0) return;
  const size_t per_head_chunk = size_t(chunk_record_floats(a.dk)) * sizeof(float) * size_t(a.hv);
  const int64_t fit = int64_t(scratch_bytes / per_head_chunk);
  if (fit < 1) fatal("gated_delta_rule: scratch too small for one chunk's records");
  const int group = int(std::min<int64_t>(layout.n_seqs, fit));
  const int piece = int(std::max<int64_t>(1, std::min<int64_t>(max_chunks, fit / group)));
  for (int s0 = 0; s0 < layout.n_seqs; s0 += group) {
    const int ns = std::min(group, layout.n_seqs - s0);
    for (int c0 = 0; c0 < max_chunks; c0 += piece) {
      const ChunkRecords rec{static_cast<float*>(scratch), c0, piece, s0, ns};
      launch_kernel(delta_chunk_keys_kernel, dim3(unsigned(piece), unsigned(a.hv), unsigned(ns)),
                    kChunkThreads, keys_smem, stream, a, rec);
      const dim3 grid(unsigned((a.dv + dvt - 1) / dvt), unsigned(a.hv), unsigned(ns));
      launch_kernel(delta_chunk_state_kernel, grid, kChunkThreads, state_smem, stream, a, rec, dvt);
    }
  }
}

}  // namespace

void CudaOps::conv1d_causal_silu(const Tensor& x, const Tensor& weight, Tensor conv_state,
                                 const SeqLayout& layout, Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t C = x.shape[1];
  const int K = int(weight.shape[weight.ndim - 1]);
  RECUR_CHECK(weight.shape[0] == C && conv_state.shape[1] == K - 1 && conv_state.shape[2] == C);
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
      launch_kernel(conv1d_out_kernel<W>, dim3(unsigned(layout.n_tokens), cblocks), 256, 0,
                    s.stream, x.ptr<float>(), x.stride[0], weight.ptr<W>(), K,
                    conv_state.ptr<float>(), C, dl.seq_start, dl.slot, layout.n_seqs,
                    out.ptr<float>(), out.stride[0]);
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
  const int K = int(in.conv_weight.shape[in.conv_weight.ndim - 1]);
  // One kernel when every sequence brings one token and the shapes suit it; else the ops.
  bool fused = layout.n_seqs > 0 && layout.n_tokens == layout.n_seqs && K >= 2 && K <= 4 &&
               dk <= 32 * kGdnMaxDkPerLane &&
               int64_t(r) * dv <= kGdnInputThreads * kGdnMaxVPerThread &&
               in.conv_weight.is_contiguous() && in.conv_weight.shape[0] == C &&
               in.conv_state.is_contiguous() && in.conv_state.shape[1] == K - 1 &&
               in.conv_state.shape[2] == C && in.a_log.dtype == in.dt_bias.dtype &&
               in.a_log.numel() == hv && in.dt_bias.numel() == hv;
  for (const Tensor* t : {&in.qkvz, &in.ba, &in.conv_out, &in.z, &in.g, &in.beta}) {
    fused = fused && t->ndim == 2 && t->stride[1] == 1;
  }
  fused = fused && in.qkvz.shape[1] == hk * (2 * int64_t(dk) + 2 * int64_t(r) * dv) &&
          in.ba.shape[1] == 2 * int64_t(hv) && in.conv_out.shape[1] == C &&
          in.z.shape[1] == int64_t(hv) * dv && in.g.shape[1] == hv && in.beta.shape[1] == hv;
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
  a.qkvz = in.qkvz.ptr<float>(), a.ba = in.ba.ptr<float>();
  a.ld_qkvz = in.qkvz.stride[0], a.ld_ba = in.ba.stride[0];
  a.conv_w = in.conv_weight.data, a.a_log = in.a_log.data, a.dt_bias = in.dt_bias.data;
  a.gate_dt = in.a_log.dtype;
  a.state = in.conv_state.ptr<float>();
  a.conv_out = in.conv_out.ptr<float>(), a.z = in.z.ptr<float>();
  a.g = in.g.ptr<float>(), a.beta = in.beta.ptr<float>();
  a.ld_out = in.conv_out.stride[0], a.ld_z = in.z.stride[0];
  a.ld_g = in.g.stride[0], a.ld_beta = in.beta.stride[0];
  a.C = C, a.key_dim = key_dim, a.dk = dk, a.r = r, a.rdv = r * dv;
  a.eps = in.l2_eps, a.q_scale = in.q_scale;
  a.seq_start = dl.seq_start, a.slot = dl.slot;
  const dim3 grid(unsigned(layout.n_seqs), unsigned(hk));
  dispatch_weight(in.conv_weight.dtype, [&](auto tag) {
    using W = decltype(tag);
    if (K == 2) {
      launch_kernel(gdn_inputs_decode_kernel<W, 2>, grid, kGdnInputThreads, 0, s.stream, a);
    } else if (K == 3) {
      launch_kernel(gdn_inputs_decode_kernel<W, 3>, grid, kGdnInputThreads, 0, s.stream, a);
    } else {
      launch_kernel(gdn_inputs_decode_kernel<W, 4>, grid, kGdnInputThreads, 0, s.stream, a);
    }
  });
  s.launched("gdn_inputs (decode)");
}

size_t CudaOps::gated_delta_rule_scratch_bytes(int dk, int dv) const {
  return 0;  // both forms work in shared memory and registers
}

void CudaOps::gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                               const Tensor& beta, Tensor state, const SeqLayout& layout,
                               Tensor out, Tensor scratch, DeltaRuleForm form) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t hk = q.shape[1], dk = q.shape[2], hv = v.shape[1], dv = v.shape[2];
  RECUR_CHECK(hk > 0 && hv % hk == 0 && k.shape[1] == hk && k.shape[2] == dk);
  RECUR_CHECK(state.shape[1] == hv && state.shape[2] == dk && state.shape[3] == dv &&
              state.is_contiguous());
  RECUR_CHECK(q.stride[2] == 1 && k.stride[2] == 1 && v.stride[2] == 1 && out.stride[2] == 1);
  RECUR_CHECK(dk <= 4 * 64);
  if (layout.n_seqs == 0) return;
  Impl& s = *impl_;
  const DevLayout dl = s.layout(layout, false);
  DeltaArgs a{q.ptr<float>(),    k.ptr<float>(), v.ptr<float>(), g.ptr<float>(),
              beta.ptr<float>(), q.stride[0],    q.stride[1],    k.stride[0],
              k.stride[1],       v.stride[0],    v.stride[1],    g.stride[0],
              beta.stride[0],    out.stride[0],  out.stride[1],  state.ptr<float>(),
              out.ptr<float>(),  int(hv),        int(hv / hk),   int(dk),
              int(dv),           dl.seq_start,   dl.slot,        kAllSeqs};
  bool any_single = false, any_multi = false;
  for (int i = 0; i < layout.n_seqs; ++i) {
    any_single |= layout.seq_len(i) == 1;
    any_multi |= layout.seq_len(i) > 1;
  }
  if (form == DeltaRuleForm::kRecurrent) {
    launch_recurrent(a, layout.n_seqs, s.stream);
  } else if (form == DeltaRuleForm::kChunked) {
    launch_chunked(a, layout, s.gdn_chunks.data(), s.gdn_chunks.bytes(), s.max_smem_optin,
                   s.stream);
  } else {
    if (any_single) {
      a.mode = kSingleTokenSeqs;
      launch_recurrent(a, layout.n_seqs, s.stream);
    }
    if (any_multi) {
      a.mode = kMultiTokenSeqs;
      launch_chunked(a, layout, s.gdn_chunks.data(), s.gdn_chunks.bytes(), s.max_smem_optin,
                     s.stream);
    }
  }
  s.launched("gated_delta_rule");
}

}  // namespace recur
