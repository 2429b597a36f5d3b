// The gated delta rule's chunked WY/UT form on the GPU, for prompts: chunks of 64 tokens, the
// same algebra as delta_rule_chunked in backend/cpu/kernels_gdn.cpp, including the (I + A)^-1
// solve in double; the products on tensor cores to f32's accuracy where the decay is per head
// (mma_tf32.cuh). The key-side matrices of every chunk are computed in parallel, then the
// chunks are walked in order with the state, value columns split across blocks.
//   H200, Qwen3-Next-80B-A3B's heads (16 key, 32 value heads of 128), a 2,048-token prompt, per
// layer (bench/results/h200-session27-notes.md): keys 333 -> 128 µs from a solve in blocks (a
// lane reduction per row had the shuffle unit busy) and two blocks an SM; the state walk 464 ->
// 343 µs from copies of 16 bytes issued a phase ahead.
#include <algorithm>

#include "backend/cuda/delta_rule.cuh"
#include "backend/cuda/mma_tf32.cuh"

namespace recur::cuda {

namespace {

constexpr int kChunk = 64;
constexpr int kChunkThreads = 512;  // 16 warps: the phases are latency-bound
constexpr int kChunkPad = kChunk + 1;
constexpr int kRecLd = kChunk + 4;  // the record's QK and Tb rows: 16-byte copies
constexpr int kALd = kChunk + 4;    // A's space: its rows of kChunkPad, then T·β·e^G's fragments
constexpr int kSolveScratch = 3 * 16 * 16;  // the solve's block sums P, doubles

// The chunked form runs in two kernels. Everything that depends only on a chunk's keys,
// queries, gates and betas (not on the state) is computed for all chunks and heads at once by
// delta_chunk_keys_kernel into a record per (sequence, chunk, head); delta_chunk_state_kernel
// then walks each sequence's chunks in order, carrying the state. Within a chunk (G the
// cumulative log-decay, S0 the state before it): A[i][j] = β_i e^(G_i−G_j) k_i·k_j (j < i),
// T = (I + A)^-1, Wk = T(β e^G K), U = T(βV), Vnew = U − Wk S0,
// out_i = e^(G_i) q_i S0 + Σ_{j≤i} e^(G_i−G_j) (q_i·k_j) Vnew_j,
// S = e^(G_last) S0 + Σ_j e^(G_last−G_j) k_j ⊗ Vnew_j.
// Per key channel, G_i is a vector [dk] and every decay acts channel-wise inside the products:
// A[i][j] = β_i Σ_c k_i[c] k_j[c] e^(G_i[c]−G_j[c]), QK likewise with q_i, Wk = T(β k∘e^G),
// out_i = (q_i∘e^(G_i)) S0 + ..., S = diag(e^(G_last)) S0 + Σ_j (k_j∘e^(G_last−G_j)) ⊗ Vnew_j:
// every exponent is a non-positive difference (G falls within a chunk), so strong decays
// underflow to 0 instead of overflowing.
// The record, floats: Wk [64][dk], QK [64][68] (the decayed q_i·k_j), Tb [64][68] (T·β, by
// column), eg [64] (e^G_i), dl [64] (e^(G_last−G_i)); per key channel then Qd [64][dk]
// (q∘e^G), Kd [64][dk] (k∘e^(G_last−G)), gl [dk] (e^G_last), and eg, dl unused. Only rows < L
// (the chunk's length) are written, and of QK and Tb only columns < 64: the state kernel reads
// nothing else.
__host__ __device__ inline int64_t chunk_record_floats(int dk, bool per_channel) {
  const int64_t per_head = int64_t(kChunk) * dk + 2 * kChunk * kRecLd + 2 * kChunk;
  return (per_head + (per_channel ? 2 * int64_t(kChunk) * dk + dk : 0) + 3) / 4 * 4;
}

// Records of chunks [c0, c0 + n_chunks) of sequences [s0, s0 + n_seq_group), each head.
struct ChunkRecords {
  float* base;
  int c0, n_chunks, s0, n_seq_group;
  bool per_channel;
  __device__ float* at(int s, int c, int h, int hv, int dk) const {
    const int64_t idx = (int64_t(s - s0) * n_chunks + (c - c0)) * hv + h;
    return base + idx * chunk_record_floats(dk, per_channel);
  }
};

// grid (n_chunks, Hv, n_seq_group), kChunkThreads. Shared: the solve's P [3][16][16] double; Q
// [64][ld] (per key channel ld = dk + 1; per head dk padded to 16 with zeros, + 4, for the
// tensor-core fragments) in a region of at least 64 × 64 doubles, which T [64][64] double
// takes over after the solve; K [64][ld]; A [64][65] in [64][68] floats (per head after the
// solve: T·β·e^G as [64][68]); G, beta, eg [64]; per key channel the cumulative decays [64][dk+1].
__host__ __device__ inline int chunk_keys_ld(int dk, bool per_channel) {
  return per_channel ? dk + 1 : (dk + 15) / 16 * 16 + 4;
}
// The queries' space, which T [64][64] double takes over after them.
__host__ __device__ inline int chunk_keys_q_floats(int dk, bool per_channel) {
  const int floats = kChunk * chunk_keys_ld(dk, per_channel);
  return floats > 2 * kChunk * kChunk ? floats : 2 * kChunk * kChunk;
}
__host__ __device__ inline size_t chunk_keys_smem(int dk, bool per_channel) {
  const size_t ld = size_t(chunk_keys_ld(dk, per_channel));
  return sizeof(double) * kSolveScratch +
         sizeof(float) * (chunk_keys_q_floats(dk, per_channel) +
                          (per_channel ? 2 : 1) * size_t(kChunk) * ld + kChunk * kALd + 3 * kChunk);
}

// Element (token t, head hh, channel mm) of an input [n, heads, d] with strides s0, s1.
__device__ __forceinline__ const float* head_elem(const float* p, int64_t s0, int64_t s1, int64_t t,
                                                  int hh, int mm) {
  return p + t * s0 + hh * s1 + mm;
}

// Rows [0, rows) × columns [0, cols) of a tile into shared memory (rows ld floats apart) by
// asynchronous copies, src(i, mm) the address of element (i, mm): zeros for rows ≥ L or
// columns ≥ n (nothing is read there; `any` is a valid address). 16 bytes a copy when vec
// (every row 16-byte aligned; ld, cols and n multiples of 4), else 4 bytes.
template <typename Src>
__device__ __forceinline__ void stage_rows(float* dst, int ld, int rows, int cols, int L, int n,
                                           bool vec, const float* any, Src src) {
  if (vec) {
    const int c4 = cols / 4;
    for (int e = threadIdx.x; e < rows * c4; e += kChunkThreads) {
      const int i = e / c4, mm = 4 * (e % c4);
      const bool in = i < L && mm < n;
      copy16_async(dst + i * ld + mm, in ? src(i, mm) : any, in);
    }
  } else {
    for (int e = threadIdx.x; e < rows * cols; e += kChunkThreads) {
      const int i = e / cols, mm = e % cols;
      const bool in = i < L && mm < n;
      copy4_async(dst + i * ld + mm, in ? src(i, mm) : any, in);
    }
  }
}

// T = (I + A)^-1 for A [64][lda] strictly lower triangular (rows < L written), in double, into
// T [64][64]: rows < L hold it; rows ≥ L hold garbage (possibly NaN, from A's unwritten rows),
// which no caller reads; the blocks above the diagonal are not written, those on it are whole.
// Blocked, so no step waits on a reduction across lanes: the four 16 × 16 diagonal blocks
// D_b = (I + A_bb)^-1 by forward substitution (a thread per column), then the blocks below them
// a diagonal at a time, T_ij = −D_i Σ_{k=j}^{i−1} A_ik T_kj, the sums through P [3][16][16].
// Rows ≥ L depend on nothing but rows ≥ L. Every thread of the block calls it.
__device__ __forceinline__ void solve_unit_lower(const float* A, int lda, int L, double* T,
                                                 double* P) {
  static_assert(kChunk == 64 && kChunkThreads >= 64);
  const int tid = threadIdx.x;
  if (tid < 64) {
    const int r0 = 16 * (tid / 16), col = tid % 16;
    double x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      double sum = r == col ? 1.0 : 0.0;
#pragma unroll
      for (int mm = 0; mm < r; ++mm) sum -= double(A[(r0 + r) * lda + r0 + mm]) * x[mm];
      x[r] = r0 + r < L ? sum : 0.0;
      T[(r0 + r) * kChunk + r0 + col] = x[r];
    }
  }
  __syncthreads();
  for (int d = 1; d < 4; ++d) {  // blocks (j + d, j), j = 0 .. 3 − d
    const int n = (4 - d) * 256;
    for (int e = tid; e < n; e += kChunkThreads) {
      const int j = e / 256, r = e / 16 % 16, c = e % 16, i = j + d;
      const float* arow = A + (16 * i + r) * lda;
      double p = 0.0;
      for (int k = 16 * j; k < 16 * i; ++k) p += double(arow[k]) * T[k * kChunk + 16 * j + c];
      P[e] = p;
    }
    __syncthreads();
    for (int e = tid; e < n; e += kChunkThreads) {
      const int j = e / 256, r = e / 16 % 16, c = e % 16, i = j + d;
      const double* drow = T + (16 * i + r) * kChunk + 16 * i;
      double t = 0.0;
      for (int mm = 0; mm <= r; ++mm) t -= drow[mm] * P[j * 256 + mm * 16 + c];
      T[(16 * i + r) * kChunk + 16 * j + c] = t;
    }
    __syncthreads();
  }
}

// Per head, two blocks share a multiprocessor (about 90 KB of shared memory each for dk = 128).
template <bool kPerChannel>
__global__ void __launch_bounds__(kChunkThreads, 2)
    delta_chunk_keys_kernel(DeltaArgs a, ChunkRecords rec, bool vec) {
  grid_dependency_sync();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Heads along x: the blocks running at once read every head of a few chunks (whole rows of q,
  // k, v), not one head's column of thousands of rows (a little faster on the H200, session 36).
  const int c = rec.c0 + int(blockIdx.y);
  const int h = int(blockIdx.x);
  const int s = rec.s0 + blockIdx.z, tid = threadIdx.x;
  const int64_t base = a.seq_start[s], len = a.seq_start[s + 1] - base;
  if (skip_seq(a.mode, len) || int64_t(c) * kChunk >= len) return;
  const int kh = h / a.group, dk = a.dk, ldq = chunk_keys_ld(dk, kPerChannel), lda = kChunkPad;
  constexpr int ldr = kRecLd;
  const int dkp = (dk + 15) / 16 * 16;  // per head: the fragments' key channels
  const int warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  double* P = reinterpret_cast<double*>(smem_raw);  // [3][16][16]: the solve's block sums
  float* Q = reinterpret_cast<float*>(P + kSolveScratch);
  float* K = Q + chunk_keys_q_floats(dk, kPerChannel);
  float* A = K + kChunk * ldq;
  float* G = A + kChunk * kALd;
  float* beta = G + kChunk;
  float* eg = beta + kChunk;
  float* GC = eg + kChunk;  // [64][dk+1] per key channel
  float* r = rec.at(s, c, h, a.hv, dk);
  float* Wk = r;                    // [64][dk]
  float* QK = Wk + kChunk * dk;     // [64][68]
  float* Tb = QK + kChunk * ldr;    // [64][68]
  float* r_eg = Tb + kChunk * ldr;  // [64]
  float* r_dl = r_eg + kChunk;      // [64]
  float* r_qd = r_dl + kChunk;      // [64][dk] per key channel
  float* r_kd = r_qd + kChunk * dk;
  float* r_gl = r_kd + kChunk * dk;  // [dk]
  const int L = int(min64(kChunk, len - int64_t(c) * kChunk));
  const int64_t t0 = base + int64_t(c) * kChunk;
  // Queries, keys, decays and betas staged by asynchronous copies, all in flight at once; per
  // head whole 64-row tiles, zeros past the chunk and past dk (per key channel rows of dk + 1
  // floats: 4-byte copies).
  const int rows_q = kPerChannel ? L : kChunk, cols_q = kPerChannel ? dk : dkp;
  const bool vec_q = vec && !kPerChannel;
  stage_rows(Q, ldq, rows_q, cols_q, L, dk, vec_q, a.q,
             [&](int i, int mm) { return head_elem(a.q, a.q_s0, a.q_s1, t0 + i, kh, mm); });
  stage_rows(K, ldq, rows_q, cols_q, L, dk, vec_q, a.k,
             [&](int i, int mm) { return head_elem(a.k, a.k_s0, a.k_s1, t0 + i, kh, mm); });
  if constexpr (kPerChannel) {
    for (int e = tid; e < L * dk; e += kChunkThreads) {  // raw decays, summed in place below
      const int i = e / dk, mm = e % dk;
      copy4_async(GC + i * ldq + mm, a.g + (t0 + i) * a.g_s0 + h * a.g_s1 + mm, true);
    }
  } else if (tid < L) {
    copy4_async(G + tid, a.g + (t0 + tid) * a.g_s0 + h, true);
  }
  if (tid < L) copy4_async(beta + tid, a.beta + (t0 + tid) * a.beta_s0 + h, true);
  copy_commit();
  copy_wait<0>();
  __syncthreads();
  if constexpr (kPerChannel) {
    // Sequential per channel, as on the CPU, so the cumulative decays round the same way.
    for (int mm = tid; mm < dk; mm += kChunkThreads) {
      float cum = 0.0f;
      for (int i = 0; i < L; ++i) {
        cum += GC[i * ldq + mm];
        GC[i * ldq + mm] = cum;
      }
    }
  } else if (tid == 0) {
    // Sequential, as on the CPU, so the cumulative decays round the same way.
    float cum = 0.0f;
#pragma unroll 8
    for (int i = 0; i < L; ++i) {
      cum += G[i];
      G[i] = cum;
    }
  }
  __syncthreads();
  if (!kPerChannel && tid < L) {
    eg[tid] = r_eg[tid] = expf(G[tid]);
    r_dl[tid] = expf(G[L - 1] - G[tid]);
  }
  // A (strictly lower) and the decayed q·k products: per head on tensor cores (16 × 8 tiles
  // of k_i·k_j and q_i·k_j, two per warp), per key channel with the decays inside the sums.
  if constexpr (!kPerChannel) {
    for (int tile = warp; tile < 32; tile += kChunkThreads / 32) {
      const int r0 = tile / 8 * 16, c0 = tile % 8 * 8;
      if (c0 > r0 + 15 || r0 >= L) continue;  // above the diagonal, or past the chunk
      float kk[4] = {0, 0, 0, 0}, qk[4] = {0, 0, 0, 0};
      for (int k0 = 0; k0 < dkp; k0 += 8) {
        // b[k = channel][n = key j] = K[j][channel]: K's rows read as b's columns.
        const SplitB b = load_split_b_t(K, ldq, k0, c0, g, t);
        mma_split(kk, load_split_a(K, ldq, r0, k0, g, t), b);
        mma_split(qk, load_split_a(Q, ldq, r0, k0, g, t), b);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = r0 + mma_c_row(g, u), jx = c0 + mma_c_col(t, u);
        if (i >= L || jx > i) continue;
        const float decay = expf(G[i] - G[jx]);
        if (jx < i) A[i * lda + jx] = beta[i] * decay * kk[u];
        QK[i * ldr + jx] = decay * qk[u];
      }
    }
  }
  for (int p = tid; kPerChannel && p < L * (L + 1) / 2; p += kChunkThreads) {
    // p enumerates the lower triangle row by row: p = i(i+1)/2 + jx, jx ≤ i.
    int i = int((sqrtf(8.0f * float(p) + 1.0f) - 1.0f) * 0.5f);
    while (i * (i + 1) / 2 > p) --i;
    while ((i + 1) * (i + 2) / 2 <= p) ++i;
    const int jx = p - i * (i + 1) / 2;
    float dkk = 0.0f, dqk = 0.0f;
    for (int mm = 0; mm < dk; ++mm) {
      const float kj = K[jx * ldq + mm] * expf(GC[i * ldq + mm] - GC[jx * ldq + mm]);
      dkk += K[i * ldq + mm] * kj;
      dqk += Q[i * ldq + mm] * kj;
    }
    if (jx < i) A[i * lda + jx] = beta[i] * dkk;
    QK[i * ldr + jx] = dqk;
  }
  __syncthreads();
  if constexpr (kPerChannel) {
    // The decayed queries and keys of the record; K becomes k∘e^G for Wk below (A and QK,
    // which read K, are done).
    for (int e = tid; e < L * dk; e += kChunkThreads) {
      const int i = e / dk, mm = e % dk;
      const float gi = GC[i * ldq + mm];
      const float eg_i = expf(gi);
      r_qd[i * dk + mm] = Q[i * ldq + mm] * eg_i;
      r_kd[i * dk + mm] = K[i * ldq + mm] * expf(GC[(L - 1) * ldq + mm] - gi);
      K[i * ldq + mm] *= eg_i;
    }
    for (int mm = tid; mm < dk; mm += kChunkThreads) r_gl[mm] = expf(GC[(L - 1) * ldq + mm]);
  }
  // T = (I + A)^-1 in double (the solve amplifies rounding when many keys of a chunk are nearly
  // parallel), into the queries' space (read no more).
  __syncthreads();                           // every read of Q is done
  double* T = reinterpret_cast<double*>(Q);  // [64][64]
  solve_unit_lower(A, lda, L, T, P);
  // Wk = T(β e^G K); Tb = T·β for U = T(βV), rounded as the products below use them. Per
  // head on tensor cores: T·β·e^G rounded to f32 into A's space (read no more), then 16 × 8
  // tiles of Wk, four per warp.
  if constexpr (!kPerChannel) {
    float* tbe = A;  // [64][68], zero above the diagonal and past the chunk
    for (int e = tid; e < kChunk * kChunk; e += kChunkThreads) {
      const int i = e / kChunk, jx = e % kChunk;
      tbe[i * kALd + jx] = i < L && jx <= i ? float(T[i * kChunk + jx]) * beta[jx] * eg[jx] : 0.0f;
    }
    __syncthreads();
    const int col_tiles = dkp / 8;
    for (int tile = warp; tile < 4 * col_tiles; tile += kChunkThreads / 32) {
      const int r0 = tile / col_tiles * 16, c0 = tile % col_tiles * 8;
      if (r0 >= L) continue;
      float w[4] = {0, 0, 0, 0};
      for (int k0 = 0; k0 < min(r0 + 16, kChunk); k0 += 8) {  // T is lower triangular
        mma_split(w, load_split_a(tbe, kALd, r0, k0, g, t), load_split_b(K, ldq, k0, c0, g, t));
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = r0 + mma_c_row(g, u), mm = c0 + mma_c_col(t, u);
        if (i < L && mm < dk) Wk[i * dk + mm] = w[u];
      }
    }
  }
  for (int e = tid; kPerChannel && e < L * dk; e += kChunkThreads) {
    const int i = e / dk, mm = e % dk;
    float w = 0.0f;
    for (int jx = 0; jx <= i; ++jx) {
      w += float(T[i * kChunk + jx]) * beta[jx] * K[jx * ldq + mm];  // K holds k∘e^G
    }
    Wk[i * dk + mm] = w;
  }
  // Rows of QK and Tb whole, zeros above the diagonal: the state kernel copies 16 bytes at a
  // time.
  for (int e = tid; e < L * kChunk; e += kChunkThreads) {
    const int i = e / kChunk, jx = e % kChunk;
    Tb[i * ldr + jx] = jx <= i ? float(T[i * kChunk + jx]) * beta[jx] : 0.0f;
    if (jx > i) QK[i * ldr + jx] = 0.0f;
  }
}

// Shared-memory carve-up of the state kernel for key dim dk (padded to a multiple of 16 with
// zeros: key_pad) and a tile of dvt value columns (a multiple of 8). Row strides put each
// tensor-core fragment's 32 loads in 32 banks: tiles read as a row-major a operand have rows ≡ 4
// (mod 32) floats apart, tiles read as b or as a transposed a operand ≡ 8 (see mma_tf32.cuh for the
// fragments). Every row is 16-byte aligned for the copies.
struct ChunkSmem {
  float* S;        // [dk][dvt + 8] state tile
  float *Q, *Wk;   // [64][dk + 4]: queries (per key channel decayed: the record's Qd), Wk
  float* K;        // [64][dk + 8]: keys (per key channel decayed to the chunk's end: Kd)
  float *V, *Vn;   // [64][dvt + 8] values, new values
  float* Vd;       // [64][dvt + 8] per head: new values decayed to the chunk's end
  float *QK, *Tb;  // [64][68], zero above the diagonal
  float *eg, *dl;  // [64] each: e^(G_i), e^(G_last − G_i) (per head)
  float* gl;       // [dk]: the chunk's decay of each state row
  __host__ __device__ static int lds(int dvt) { return dvt + 8; }
  __host__ __device__ static int key_pad(int dk) { return (dk + 15) / 16 * 16; }
  __host__ __device__ static size_t bytes(int dk_in, int dvt, bool per_channel) {
    const int dk = key_pad(dk_in);
    return sizeof(float) *
           (size_t(dk) * lds(dvt) + 2 * kChunk * size_t(dk + 4) + kChunk * size_t(dk + 8) +
            3 * kChunk * size_t(lds(dvt)) + 2 * kChunk * kRecLd + 2 * kChunk + dk);
  }
  __device__ ChunkSmem(void* p, int dk, int dvt) {  // dk: key_pad's
    float* f = static_cast<float*>(p);
    S = f, f += dk * lds(dvt);
    Q = f, f += kChunk * (dk + 4);
    Wk = f, f += kChunk * (dk + 4);
    K = f, f += kChunk * (dk + 8);
    V = f, f += kChunk * lds(dvt);
    Vn = f, f += kChunk * lds(dvt);
    Vd = f, f += kChunk * lds(dvt);
    QK = f, f += kChunk * kRecLd;
    Tb = f, f += kChunk * kRecLd;
    eg = f, f += kChunk;
    dl = f, f += kChunk;
    gl = f;
  }
};

// The state's walk over chunks [rec.c0, rec.c0 + rec.n_chunks) of each sequence, its products
// on tensor cores to f32's accuracy (mma_tf32.cuh). grid (⌈dv/dvt⌉, Hv, n_seq_group),
// kChunkThreads threads (16 warps); three barriers per chunk. Rows past the chunk's length are
// staged as zeros, so every product runs over whole 64-row tiles.
//   A chunk's operands come in two groups of copies, each issued as soon as the buffers it
// fills are free, so they land while the chunk before is multiplied: group A (Q, Wk, Tb, V, eg,
// dl; read by the first phase, Vnew and the inter-chunk outputs) after the first phase of the
// chunk before, group B (K, QK, gl; read by the second, the outputs and the state update) after
// its second.
template <bool kPerChannel>
__global__ void __launch_bounds__(kChunkThreads)
    delta_chunk_state_kernel(DeltaArgs a, ChunkRecords rec, int dvt, bool vec) {
  grid_dependency_sync();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int s = rec.s0 + blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
  const int j0 = blockIdx.x * dvt;
  const int ncols = min(dvt, a.dv - j0);
  const int64_t base = a.seq_start[s], len = a.seq_start[s + 1] - base;
  if (skip_seq(a.mode, len) || int64_t(rec.c0) * kChunk >= len) return;
  const int kh = h / a.group, dk = a.dk, dkp = ChunkSmem::key_pad(dk);
  const int ldq = dkp + 4, ldk = dkp + 8, ldv = ChunkSmem::lds(dvt);
  ChunkSmem m(smem_raw, dkp, dvt);
  const int warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  // Output tiles of 16 rows × 8 columns: [64 × dvt] has 4·(dvt/8), one per warp (warps past
  // them idle in those phases); the state [dk × dvt] has (dk/16)·(dvt/8), strided over warps.
  const int col_tiles = dvt / 8, out_tiles = 4 * col_tiles, state_tiles = dkp / 16 * col_tiles;
  const int orow = warp / col_tiles * 16, ocol = warp % col_tiles * 8;
  float* Sg = a.state + (int64_t(a.slot[s]) * a.hv + h) * dk * a.dv;
  for (int e = tid; e < dkp * dvt; e += kChunkThreads) {
    const int i = e / dvt, jj = e % dvt;
    m.S[i * ldv + jj] = i < dk && jj < ncols ? Sg[int64_t(i) * a.dv + j0 + jj] : 0.0f;
  }
  const int c_end = int(min64(rec.c0 + rec.n_chunks, (len + kChunk - 1) / kChunk));
  // The record's parts and the chunk's length and first token.
  struct Chunk {
    const float* Wk;       // [64][dk]
    const float *QK, *Tb;  // [64][68]
    const float *eg, *dl;  // [64] (per head)
    const float *Qd, *Kd;  // [64][dk] (per key channel; past a per-head record, unread)
    const float* gl;       // [dk] (per key channel)
    int L;                 // the chunk's tokens
    int64_t t0;            // its first token
  };
  auto chunk = [&](int c) {
    Chunk ch;
    ch.Wk = rec.at(s, c, h, a.hv, dk);
    ch.QK = ch.Wk + kChunk * dk;
    ch.Tb = ch.QK + kChunk * kRecLd;
    ch.eg = ch.Tb + kChunk * kRecLd;
    ch.dl = ch.eg + kChunk;
    ch.Qd = ch.dl + kChunk;
    ch.Kd = ch.Qd + kChunk * dk;
    ch.gl = ch.Kd + kChunk * dk;
    ch.L = int(min64(kChunk, len - int64_t(c) * kChunk));
    ch.t0 = base + int64_t(c) * kChunk;
    return ch;
  };
  // Group A: zeros past the chunk, past dk and past the tile's columns.
  auto issue_a = [&](const Chunk& ch) {
    const int L = ch.L;
    const int64_t t0 = ch.t0;
    // Queries: per key channel the record's decayed ones.
    stage_rows(m.Q, ldq, kChunk, dkp, L, dk, vec, ch.Wk, [&](int i, int mm) {
      return kPerChannel ? ch.Qd + i * dk + mm : head_elem(a.q, a.q_s0, a.q_s1, t0 + i, kh, mm);
    });
    stage_rows(m.Wk, ldq, kChunk, dkp, L, dk, vec, ch.Wk,
               [&](int i, int mm) { return ch.Wk + i * dk + mm; });
    stage_rows(m.Tb, kRecLd, kChunk, kChunk, L, kChunk, vec, ch.Wk,
               [&](int i, int jx) { return ch.Tb + i * kRecLd + jx; });
    stage_rows(m.V, ldv, kChunk, dvt, L, ncols, vec, ch.Wk,
               [&](int i, int jj) { return head_elem(a.v, a.v_s0, a.v_s1, t0 + i, h, j0 + jj); });
    if (!kPerChannel && tid < kChunk) {
      copy4_async(m.eg + tid, ch.eg + tid, tid < L);
      copy4_async(m.dl + tid, ch.dl + tid, tid < L);
    }
  };
  // Group B.
  auto issue_b = [&](const Chunk& ch) {
    const int L = ch.L;
    const int64_t t0 = ch.t0;
    // Keys: per key channel the record's decayed ones, and the state rows' decays.
    stage_rows(m.K, ldk, kChunk, dkp, L, dk, vec, ch.Wk, [&](int i, int mm) {
      return kPerChannel ? ch.Kd + i * dk + mm : head_elem(a.k, a.k_s0, a.k_s1, t0 + i, kh, mm);
    });
    for (int mm = tid; kPerChannel && mm < dkp; mm += kChunkThreads) {
      copy4_async(m.gl + mm, mm < dk ? ch.gl + mm : ch.Wk, mm < dk);
    }
    stage_rows(m.QK, kRecLd, kChunk, kChunk, L, kChunk, vec, ch.Wk,
               [&](int i, int jx) { return ch.QK + i * kRecLd + jx; });
  };
  {
    const Chunk first = chunk(rec.c0);
    issue_a(first);
    copy_commit();
    issue_b(first);
    copy_commit();
  }
  for (int c = rec.c0; c < c_end; ++c) {
    const Chunk ch = chunk(c), next = chunk(c + 1);  // next: issued only when c + 1 < c_end
    const int L = ch.L;
    copy_wait<1>();   // this thread's group A of chunk c has landed (group B may not have)
    __syncthreads();  // everyone's; and the state update of the chunk before is done
    // The inter-chunk outputs e^G q S0 (kept in registers), and Vnew = T(βV) − Wk S0 (per head
    // also decayed to the chunk's end, e^(G_last − G_j) Vnew_j, for the state update).
    float o[4] = {0, 0, 0, 0};
    if (warp < out_tiles) {
      float tv[4] = {0, 0, 0, 0}, ws[4] = {0, 0, 0, 0};
      for (int k0 = 0; k0 < dkp; k0 += 8) {
        const SplitB sb = load_split_b(m.S, ldv, k0, ocol, g, t);
        mma_split(o, load_split_a(m.Q, ldq, orow, k0, g, t), sb);
        mma_split(ws, load_split_a(m.Wk, ldq, orow, k0, g, t), sb);
      }
      for (int k0 = 0; k0 < kChunk; k0 += 8) {
        mma_split(tv, load_split_a(m.Tb, kRecLd, orow, k0, g, t),
                  load_split_b(m.V, ldv, k0, ocol, g, t));
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = orow + mma_c_row(g, u), jj = ocol + mma_c_col(t, u);
        const float vn = tv[u] - ws[u];
        m.Vn[i * ldv + jj] = vn;
        if constexpr (!kPerChannel) {
          o[u] *= m.eg[i];
          m.Vd[i * ldv + jj] = vn * m.dl[i];
        }
      }
    }
    const float decay_all = kPerChannel ? 0.0f : m.eg[L - 1];  // read before group A refills
    copy_wait<0>();                                            // group B of chunk c
    __syncthreads();  // Vnew is written; Q, Wk, Tb, V, eg and dl are free
    if (c + 1 < c_end) issue_a(next);
    copy_commit();
    // Outputs, and the state carried to the next chunk.
    if (warp < out_tiles) {
      for (int k0 = 0; k0 < kChunk; k0 += 8) {
        mma_split(o, load_split_a(m.QK, kRecLd, orow, k0, g, t),
                  load_split_b(m.Vn, ldv, k0, ocol, g, t));
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = orow + mma_c_row(g, u), jj = ocol + mma_c_col(t, u);
        if (i < L && jj < ncols) a.out[(ch.t0 + i) * a.o_s0 + h * a.o_s1 + j0 + jj] = o[u];
      }
    }
    const float* vd = kPerChannel ? m.Vn : m.Vd;
    for (int tile = warp; tile < state_tiles; tile += kChunkThreads / 32) {
      const int srow = tile / col_tiles * 16, scol = tile % col_tiles * 8;
      float su[4] = {0, 0, 0, 0};
      for (int k0 = 0; k0 < kChunk; k0 += 8) {
        mma_split(su, load_split_a_t(m.K, ldk, srow, k0, g, t),
                  load_split_b(vd, ldv, k0, scol, g, t));
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int mm = srow + mma_c_row(g, u), jj = scol + mma_c_col(t, u);
        float& sv = m.S[mm * ldv + jj];
        sv = sv * (kPerChannel ? m.gl[mm] : decay_all) + su[u];
      }
    }
    __syncthreads();  // K, QK, gl and Vnew are free
    if (c + 1 < c_end) issue_b(next);
    copy_commit();
  }
  copy_wait<0>();
  for (int e = tid; e < dk * dvt; e += kChunkThreads) {
    const int i = e / dvt, jj = e % dvt;
    if (jj < ncols) Sg[int64_t(i) * a.dv + j0 + jj] = m.S[i * ldv + jj];  // rows i < dk
  }
}

}  // namespace

// The state kernel's tile of value columns for key dim dk, or 0 when neither chunked kernel
// fits in max_smem bytes of shared memory.
int chunk_columns(int dk, bool per_channel, size_t max_smem) {
  // 32 columns: 16 and 8 (more blocks for the latency-bound walk) ran the 80B shape's state
  // walk 1.45x and 2.5x slower (H200, session 36).
  int dvt = 32;
  while (dvt > 8 && ChunkSmem::bytes(dk, dvt, per_channel) > max_smem) dvt /= 2;
  if (ChunkSmem::bytes(dk, dvt, per_channel) > max_smem) return 0;
  return chunk_keys_smem(dk, per_channel) <= max_smem ? dvt : 0;
}

// Chunk records go through `scratch` in pieces: as many sequences and chunks at a time as it
// holds (host lengths say how many chunks each sequence has).
template <bool kPerChannel>
void launch_chunked(const DeltaArgs& a, const SeqLayout& layout, void* scratch,
                    size_t scratch_bytes, size_t max_smem, cudaStream_t stream,
                    const std::function<void(const char*)>& launched) {
  int dvt = chunk_columns(a.dk, kPerChannel, max_smem);
  if (dvt == 0) fatal("gated_delta_rule: key head dim too large for the chunked kernel");
  const size_t state_smem = ChunkSmem::bytes(a.dk, dvt, kPerChannel);
  const size_t keys_smem = chunk_keys_smem(a.dk, kPerChannel);
  dvt = std::min(dvt, (a.dv + 7) / 8 * 8);  // tiles of 8 columns
  opt_in_smem<delta_chunk_state_kernel<kPerChannel>>(max_smem);
  opt_in_smem<delta_chunk_keys_kernel<kPerChannel>>(max_smem);
  int max_chunks = 0;
  for (int i = 0; i < layout.n_seqs; ++i) {
    const int len = layout.seq_len(i);
    if ((a.mode == kSingleTokenSeqs && len != 1) || (a.mode == kMultiTokenSeqs && len <= 1))
      continue;
    max_chunks = std::max(max_chunks, (len + kChunk - 1) / kChunk);
  }
  if (max_chunks == 0) return;
  // 16-byte copies where every staged row is 16-byte aligned (the records' are when dk is a
  // multiple of 4).
  auto aligned = [](const float* p, int64_t s0, int64_t s1) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0 && s0 % 4 == 0 && s1 % 4 == 0;
  };
  const bool vec = a.dk % 4 == 0 && a.dv % 4 == 0 && aligned(a.q, a.q_s0, a.q_s1) &&
                   aligned(a.k, a.k_s0, a.k_s1) && aligned(a.v, a.v_s0, a.v_s1);
  const size_t per_head_chunk =
      size_t(chunk_record_floats(a.dk, kPerChannel)) * sizeof(float) * size_t(a.hv);
  const int64_t fit = int64_t(scratch_bytes / per_head_chunk);
  if (fit < 1) fatal("gated_delta_rule: scratch too small for one chunk's records");
  const int group = int(std::min<int64_t>(layout.n_seqs, fit));
  // At most grid.y's 65,535 chunks a launch (about 4 million tokens).
  const int piece =
      int(std::max<int64_t>(1, std::min<int64_t>({max_chunks, fit / group, int64_t(65535)})));
  for (int s0 = 0; s0 < layout.n_seqs; s0 += group) {
    const int ns = std::min(group, layout.n_seqs - s0);
    for (int c0 = 0; c0 < max_chunks; c0 += piece) {
      const ChunkRecords rec{static_cast<float*>(scratch), c0, piece, s0, ns, kPerChannel};
      const dim3 keys_grid(unsigned(a.hv), unsigned(piece), unsigned(ns));
      launch_kernel(delta_chunk_keys_kernel<kPerChannel>, keys_grid, kChunkThreads, keys_smem,
                    stream, a, rec, vec);
      launched("gated_delta_rule (chunk keys)");
      const dim3 grid(unsigned((a.dv + dvt - 1) / dvt), unsigned(a.hv), unsigned(ns));
      launch_kernel(delta_chunk_state_kernel<kPerChannel>, grid, kChunkThreads, state_smem, stream,
                    a, rec, dvt, vec);
      launched("gated_delta_rule (chunk state)");
    }
  }
}

template void launch_chunked<false>(const DeltaArgs&, const SeqLayout&, void*, size_t, size_t,
                                    cudaStream_t, const std::function<void(const char*)>&);
template void launch_chunked<true>(const DeltaArgs&, const SeqLayout&, void*, size_t, size_t,
                                   cudaStream_t, const std::function<void(const char*)>&);

}  // namespace recur::cuda
