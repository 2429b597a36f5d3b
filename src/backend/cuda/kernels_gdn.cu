// Gated DeltaNet on the GPU: the causal depthwise conv with its rolling per-slot state, and the
// gated delta rule in its recurrent form (decode: the state tile stays in registers across the
// sequence's tokens) and its chunked WY/UT form (prompts: chunks of 64 tokens, the same
// algebra as delta_rule_chunked in backend/cpu/kernels_gdn.cpp, including the (I + A)^-1
// solve in double). Value columns are independent in the rule, so both forms split dv across
// blocks; the chunked form recomputes the small key-side matrices in each block.
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

// Shared-memory carve-up of the chunked kernel for key dim dk and a tile of dvt value columns.
struct ChunkSmem {
  double* T;                  // [64][64] (I + A)^-1
  float* S;                   // [dk][dvt] state tile
  float* Q;                   // [64][dk+1] queries, then Wk
  float* K;                   // [64][dk+1]
  float* V;                   // [64][dvt+1] values, then Vnew
  float *U, *O;               // [64][dvt+1]
  float *A, *QK;              // [64][65]
  float *G, *beta, *eg, *dl;  // [64] each
  __host__ __device__ static size_t bytes(int dk, int dvt) {
    return sizeof(double) * kChunk * kChunk +
           sizeof(float) * (size_t(dk) * dvt + 2 * kChunk * (dk + 1) + 3 * kChunk * (dvt + 1) +
                            2 * kChunk * (kChunk + 1) + 4 * kChunk);
  }
  __device__ ChunkSmem(void* p, int dk, int dvt) {
    T = static_cast<double*>(p);
    float* f = reinterpret_cast<float*>(T + kChunk * kChunk);
    S = f, f += dk * dvt;
    Q = f, f += kChunk * (dk + 1);
    K = f, f += kChunk * (dk + 1);
    V = f, f += kChunk * (dvt + 1);
    U = f, f += kChunk * (dvt + 1);
    O = f, f += kChunk * (dvt + 1);
    A = f, f += kChunk * (kChunk + 1);
    QK = f, f += kChunk * (kChunk + 1);
    G = f, f += kChunk;
    beta = f, f += kChunk;
    eg = f, f += kChunk;
    dl = f;
  }
};

// Chunked form. grid (⌈dv/dvt⌉, Hv, n_seqs), kChunkThreads threads. Within a chunk (G the
// cumulative log-decay, S0 the state before it): A[i][j] = β_i e^(G_i−G_j) k_i·k_j (j < i),
// T = (I + A)^-1, Wk = T(β e^G K), U = T(βV), Vnew = U − Wk S0,
// out_i = e^(G_i) q_i S0 + Σ_{j≤i} e^(G_i−G_j) (q_i·k_j) Vnew_j,
// S = e^(G_last) S0 + Σ_j e^(G_last−G_j) k_j ⊗ Vnew_j.
__global__ void __launch_bounds__(kChunkThreads) delta_chunked_kernel(DeltaArgs a, int dvt) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int s = blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
  const int j0 = blockIdx.x * dvt;
  const int ncols = min(dvt, a.dv - j0);
  const int64_t base = a.seq_start[s], len = a.seq_start[s + 1] - base;
  if (skip_seq(a.mode, len)) return;
  const int kh = h / a.group, dk = a.dk;
  const int ldq = dk + 1, ldv = dvt + 1, lda = kChunk + 1;
  ChunkSmem m(smem_raw, dk, dvt);
  float* Sg = a.state + (int64_t(a.slot[s]) * a.hv + h) * dk * a.dv;
  for (int e = tid; e < dk * dvt; e += kChunkThreads) {
    const int i = e / dvt, jj = e % dvt;
    m.S[e] = jj < ncols ? Sg[int64_t(i) * a.dv + j0 + jj] : 0.0f;
  }
  for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
    const int L = int(min64(kChunk, len - c0));
    const int64_t t0 = base + c0;
    for (int e = tid; e < L * dk; e += kChunkThreads) {
      const int i = e / dk, mm = e % dk;
      m.Q[i * ldq + mm] = a.q[(t0 + i) * a.q_s0 + kh * a.q_s1 + mm];
      m.K[i * ldq + mm] = a.k[(t0 + i) * a.k_s0 + kh * a.k_s1 + mm];
    }
    for (int e = tid; e < L * dvt; e += kChunkThreads) {
      const int i = e / dvt, jj = e % dvt;
      m.V[i * ldv + jj] = jj < ncols ? a.v[(t0 + i) * a.v_s0 + h * a.v_s1 + j0 + jj] : 0.0f;
    }
    if (tid == 0) {
      // Sequential, as on the CPU, so the cumulative decays round the same way.
      float cum = 0.0f;
      for (int i = 0; i < L; ++i) {
        cum += a.g[(t0 + i) * a.g_s0 + h];
        m.G[i] = cum;
        m.beta[i] = a.beta[(t0 + i) * a.beta_s0 + h];
        m.eg[i] = expf(cum);
      }
      for (int i = 0; i < L; ++i) m.dl[i] = expf(m.G[L - 1] - m.G[i]);
    }
    __syncthreads();
    // A (strictly lower), the decayed q·k products, and the inter-chunk outputs e^G q S0.
    for (int p = tid; p < L * (L + 1) / 2; p += kChunkThreads) {
      // p enumerates the lower triangle row by row: p = i(i+1)/2 + jx, jx ≤ i.
      int i = int((sqrtf(8.0f * float(p) + 1.0f) - 1.0f) * 0.5f);
      while (i * (i + 1) / 2 > p) --i;
      while ((i + 1) * (i + 2) / 2 <= p) ++i;
      const int jx = p - i * (i + 1) / 2;
      const float decay = expf(m.G[i] - m.G[jx]);
      float dkk = 0.0f, dqk = 0.0f;
      for (int mm = 0; mm < dk; ++mm) {
        const float kj = m.K[jx * ldq + mm];
        dkk += m.K[i * ldq + mm] * kj;
        dqk += m.Q[i * ldq + mm] * kj;
      }
      if (jx < i) m.A[i * lda + jx] = m.beta[i] * decay * dkk;
      m.QK[i * lda + jx] = decay * dqk;
    }
    for (int e = tid; e < L * dvt; e += kChunkThreads) {
      const int i = e / dvt, jj = e % dvt;
      float o = 0.0f;
      for (int mm = 0; mm < dk; ++mm) o += (m.Q[i * ldq + mm] * m.eg[i]) * m.S[mm * dvt + jj];
      m.O[i * ldv + jj] = o;
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
      for (int c = 0; c < kSolveCols; ++c) {
        const int col = warp + c * kWarps;
        x0[c] = lane == col ? 1.0 : 0.0;
        x1[c] = lane + 32 == col ? 1.0 : 0.0;
      }
      for (int i = 1; i < L; ++i) {
        // Only A's strictly lower part of row i was written for this chunk.
        const double a0 = lane < i ? double(m.A[i * lda + lane]) : 0.0;
        const double a1 = lane + 32 < i ? double(m.A[i * lda + lane + 32]) : 0.0;
#pragma unroll
        for (int c = 0; c < kSolveCols; ++c) {
          double p = a0 * x0[c] + a1 * x1[c];
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
          if (i > warp + c * kWarps) {  // rows above the diagonal stay 0, the diagonal 1
            if (lane == i) x0[c] = -p;
            if (lane + 32 == i) x1[c] = -p;
          }
        }
      }
#pragma unroll
      for (int c = 0; c < kSolveCols; ++c) {
        const int col = warp + c * kWarps;
        if (lane < L) m.T[lane * kChunk + col] = x0[c];
        if (lane + 32 < L) m.T[(lane + 32) * kChunk + col] = x1[c];
      }
      __syncthreads();
    }
    // Wk = T(β e^G K) into Q's space; U = T(βV).
    for (int e = tid; e < L * dk; e += kChunkThreads) {
      const int i = e / dk, mm = e % dk;
      float w = 0.0f;
      for (int jx = 0; jx <= i; ++jx) {
        const float tk = float(m.T[i * kChunk + jx]) * m.beta[jx] * m.eg[jx];
        w += tk * m.K[jx * ldq + mm];
      }
      m.Q[i * ldq + mm] = w;
    }
    for (int e = tid; e < L * dvt; e += kChunkThreads) {
      const int i = e / dvt, jj = e % dvt;
      float u = 0.0f;
      for (int jx = 0; jx <= i; ++jx) {
        u += float(m.T[i * kChunk + jx]) * m.beta[jx] * m.V[jx * ldv + jj];
      }
      m.U[i * ldv + jj] = u;
    }
    __syncthreads();
    // Vnew = U − Wk S0, into V's space.
    for (int e = tid; e < L * dvt; e += kChunkThreads) {
      const int i = e / dvt, jj = e % dvt;
      float vn = m.U[i * ldv + jj];
      for (int mm = 0; mm < dk; ++mm) vn -= m.Q[i * ldq + mm] * m.S[mm * dvt + jj];
      m.V[i * ldv + jj] = vn;
    }
    __syncthreads();
    // Outputs, and the state carried to the next chunk.
    for (int e = tid; e < L * dvt; e += kChunkThreads) {
      const int i = e / dvt, jj = e % dvt;
      float o = m.O[i * ldv + jj];
      for (int jx = 0; jx <= i; ++jx) o += m.QK[i * lda + jx] * m.V[jx * ldv + jj];
      if (jj < ncols) a.out[(t0 + i) * a.o_s0 + h * a.o_s1 + j0 + jj] = o;
    }
    const float decay_all = m.eg[L - 1];
    for (int e = tid; e < dk * dvt; e += kChunkThreads) {
      const int mm = e / dvt, jj = e % dvt;
      float sv = m.S[e] * decay_all;
      for (int jx = 0; jx < L; ++jx) sv += (m.K[jx * ldq + mm] * m.dl[jx]) * m.V[jx * ldv + jj];
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
    delta_recurrent_kernel<4><<<grid, block, 0, stream>>>(a);
  } else if (rpt <= 8) {
    delta_recurrent_kernel<8><<<grid, block, 0, stream>>>(a);
  } else if (rpt <= 16) {
    delta_recurrent_kernel<16><<<grid, block, 0, stream>>>(a);
  } else if (rpt <= 32) {
    delta_recurrent_kernel<32><<<grid, block, 0, stream>>>(a);
  } else {
    RECUR_CHECK(rpt <= 64);
    delta_recurrent_kernel<64><<<grid, block, 0, stream>>>(a);
  }
}

void launch_chunked(const DeltaArgs& a, int n_seqs, size_t max_smem, cudaStream_t stream) {
  int dvt = 32;
  while (dvt > 4 && ChunkSmem::bytes(a.dk, dvt) > max_smem) dvt /= 2;
  const size_t bytes = ChunkSmem::bytes(a.dk, dvt);
  if (bytes > max_smem) fatal("gated_delta_rule: key head dim too large for the chunked kernel");
  dvt = std::min(dvt, a.dv);
  static size_t opted_in = 48 << 10;
  if (bytes > opted_in) {
    RECUR_CUDA_CHECK(cudaFuncSetAttribute(
        delta_chunked_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(max_smem)));
    opted_in = max_smem;
  }
  const dim3 grid(unsigned((a.dv + dvt - 1) / dvt), unsigned(a.hv), unsigned(n_seqs));
  delta_chunked_kernel<<<grid, kChunkThreads, ChunkSmem::bytes(a.dk, dvt), stream>>>(a, dvt);
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
  if (layout.n_tokens > 0) {
    dispatch_weight(weight.dtype, [&](auto tag) {
      using W = decltype(tag);
      conv1d_out_kernel<W><<<dim3(unsigned(layout.n_tokens), cblocks), 256, 0, s.stream>>>(
          x.ptr<float>(), x.stride[0], weight.ptr<W>(), K, conv_state.ptr<float>(), C, dl.seq_start,
          dl.slot, layout.n_seqs, out.ptr<float>(), out.stride[0]);
    });
    s.launched("conv1d_causal_silu (outputs)");
  }
  if (K > 1) {
    conv1d_state_kernel<<<dim3(unsigned(layout.n_seqs), cblocks), 256, 0, s.stream>>>(
        x.ptr<float>(), x.stride[0], K, conv_state.ptr<float>(), C, dl.seq_start, dl.slot);
    s.launched("conv1d_causal_silu (state)");
  }
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
    launch_chunked(a, layout.n_seqs, s.max_smem_optin, s.stream);
  } else {
    if (any_single) {
      a.mode = kSingleTokenSeqs;
      launch_recurrent(a, layout.n_seqs, s.stream);
    }
    if (any_multi) {
      a.mode = kMultiTokenSeqs;
      launch_chunked(a, layout.n_seqs, s.max_smem_optin, s.stream);
    }
  }
  s.launched("gated_delta_rule");
}

}  // namespace recur
