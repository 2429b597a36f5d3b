// Gated DeltaNet on the GPU: the gated delta rule in its recurrent form (decode: the state
// tile stays in registers across the sequence's tokens) and its chunked WY/UT form (prompts:
// chunks of 64 tokens, the same algebra as delta_rule_chunked in backend/cpu/kernels_gdn.cpp,
// including the (I + A)^-1 solve in double; its kernels are in kernels_gdn_chunked.cu). Value
// columns are independent in the rule, so both forms split dv across blocks. The decay is per
// head (Gated DeltaNet) or per key channel (Kimi Delta Attention): every kernel is a template
// on which, so the per-head instructions are those of a kernel that knows nothing else. The
// conv and the input stage are in kernels_gdn_inputs.cu.
#include <cooperative_groups.h>

#include <algorithm>
#include <functional>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/delta_rule.cuh"
#include "backend/cuda/gdn_decode.cuh"
#include "backend/cuda/rms_norm_row.cuh"

namespace recur {

using namespace cuda;

namespace {

constexpr int kRecWarps = 4;

// One token of the rule for value column j, whose state rows warp + kRecWarps·r this thread
// holds in st: S ← diag(exp(g))·S; kv = Sᵀk; S ← S + k ⊗ β(v − kv); o = Sᵀq, written by warp 0
// to out row t (and to o_shared when given, for the block's own later use). The token's
// operands are in place: qs, ks [≥ dk] in shared memory, the rows' decay factors gs [dk] when
// kPerChannel (else the head's `decay`), β in b, v's column j in vj. red, red2 [kRecWarps][32]
// are the column group's. Every thread of the block calls it; it ends with a barrier, after
// which o is visible to the block and the shared arrays may be rewritten.
template <int RPT, bool kPerChannel>
__device__ __forceinline__ void delta_step(const DeltaArgs& a, int64_t t, int h, int j, int warp,
                                           int lane, float (&st)[RPT], const float* qs,
                                           const float* ks, const float* gs, float decay, float b,
                                           float vj, float (*red)[32], float (*red2)[32],
                                           float* o_shared) {
  // S ← diag(exp(g))·S; kv = Sᵀk
  float p = 0.0f;
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const int i = warp + kRecWarps * r;
    if (i < a.dk) {
      if constexpr (kPerChannel) {
        st[r] *= gs[i];
      } else {
        st[r] *= decay;
      }
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
    if (o_shared) o_shared[j] = o;
  }
  __syncthreads();
}

// Token t of the rule with its operands read from a's tensors (qs, ks, gs: the block's shared
// arrays for them), as delta_step says. n_threads: the block's.
template <int RPT, bool kPerChannel>
__device__ __forceinline__ void delta_token(const DeltaArgs& a, int64_t t, int h, int j, int warp,
                                            int lane, int tid, int n_threads, float (&st)[RPT],
                                            float* qs, float* ks, float* gs, float (*red)[32],
                                            float (*red2)[32], float* o_shared = nullptr) {
  const int kh = h / a.group;
  for (int i = tid; i < a.dk; i += n_threads) {
    qs[i] = a.q[t * a.q_s0 + kh * a.q_s1 + i];
    ks[i] = a.k[t * a.k_s0 + kh * a.k_s1 + i];
    if constexpr (kPerChannel) gs[i] = expf(a.g[t * a.g_s0 + h * a.g_s1 + i]);
  }
  float decay = 1.0f;
  if constexpr (!kPerChannel) decay = expf(a.g[t * a.g_s0 + h]);
  const float b = a.beta[t * a.beta_s0 + h];
  const float vj = j < a.dv ? a.v[t * a.v_s0 + h * a.v_s1 + j] : 0.0f;
  __syncthreads();
  delta_step<RPT, kPerChannel>(a, t, h, j, warp, lane, st, qs, ks, gs, decay, b, vj, red, red2,
                               o_shared);
}

// The state rows of column j that this thread holds (rows warp + kRecWarps·r of slot state S
// [dk, dv]), loaded or stored.
template <int RPT>
__device__ __forceinline__ void delta_state_load(const DeltaArgs& a, const float* S, int j,
                                                 int warp, float (&st)[RPT]) {
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const int i = warp + kRecWarps * r;
    st[r] = (i < a.dk && j < a.dv) ? S[int64_t(i) * a.dv + j] : 0.0f;
  }
}
template <int RPT>
__device__ __forceinline__ void delta_state_store(const DeltaArgs& a, float* S, int j, int warp,
                                                  const float (&st)[RPT]) {
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    const int i = warp + kRecWarps * r;
    if (i < a.dk && j < a.dv) S[int64_t(i) * a.dv + j] = st[r];
  }
}

// Recurrent form, token by token. grid (⌈dv/32⌉, Hv, n_seqs), block (32, kRecWarps): lane =
// value column, warp w owns state rows w, w + kRecWarps, ... (RPT of them, in registers).
template <int RPT, bool kPerChannel>
__global__ void __launch_bounds__(32 * kRecWarps) delta_recurrent_kernel(DeltaArgs a) {
  // The state tile loads before the wait for the kernel before: no kernel of this forward
  // writes this slot's state before this one (and the batch mirror is uploaded before the
  // forward's kernels), so its DRAM round trip overlaps that kernel.
  const int s = blockIdx.z, h = blockIdx.y;
  const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
  const int j = blockIdx.x * 32 + lane;
  const int64_t base = a.seq_start[s], len = a.seq_start[s + 1] - base;
  if (skip_seq(a.mode, len)) return;
  float* S = a.state + (int64_t(a.slot[s]) * a.hv + h) * a.dk * a.dv;
  __shared__ float qs[kRecWarps * RPT], ks[kRecWarps * RPT];
  __shared__ float gs[kPerChannel ? kRecWarps * RPT : 1];
  __shared__ float red[kRecWarps][32], red2[kRecWarps][32];
  float st[RPT];
  delta_state_load<RPT>(a, S, j, warp, st);
  grid_dependency_sync();
  for (int64_t t = base; t < base + len; ++t) {
    delta_token<RPT, kPerChannel>(a, t, h, j, warp, lane, tid, 32 * kRecWarps, st, qs, ks, gs, red,
                                  red2);
  }
  delta_state_store<RPT>(a, S, j, warp, st);
}

// One token per sequence, then the gated RMS norm of each value head (gated_delta_rule_norm):
// grid (Hv · split, n_seqs), block (32, kRecWarps · column groups), a head's split blocks one
// cluster along x (split 1: a block) so that the head's dv ≤ 128 outputs meet in its first
// block's shared memory. Column group c (warps c·kRecWarps ...) computes columns 32c + lane
// exactly as delta_recurrent_kernel does; then one warp of the first block normalises the
// head's row with rms_norm_row, as rms_norm_kernel does (the same bits as the two kernels).
// gate, normed [n, Hv, dv] as rows; norm_w [dv]; the rest as DeltaArgs.
constexpr int kNormMaxGroups = 4;

// A value head's blocks in the decode kernels' grid (Hv · split, n_seqs): with split > 1
// (RECUR_EXP_DELTA_CLUSTER) one cluster along x, rank r holding the head's columns from col0,
// its share of a 64 KB state tile that one block would otherwise read and write alone.
struct HeadBlocks {
  int h, rank, split, col0;
};
__device__ __forceinline__ HeadBlocks head_blocks(int hv) {
  HeadBlocks b;
  b.split = int(gridDim.x) / hv;
  b.h = int(blockIdx.x) / b.split, b.rank = int(blockIdx.x) % b.split;
  b.col0 = b.rank * int(blockDim.y / kRecWarps) * 32;
  if (b.split > 1) cooperative_groups::this_cluster().barrier_arrive();  // this block started
  return b;
}
// Where the head's output row meets: the first block's o_head, once every block of the cluster
// has started (head_blocks' arrival); every thread calls it.
__device__ __forceinline__ float* head_output_row(const HeadBlocks& b, float* o_head) {
  if (b.split == 1) return o_head;
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.barrier_wait();
  return cluster.map_shared_rank(o_head, 0);
}
// The shared arrays of a block's token of the rule and its norm (up to kNormMaxGroups column
// groups): q, k and the rows' decays (kPerChannel), the groups' partial sums, the head's output.
template <int RPT, bool kPerChannel>
struct DeltaNormShared {
  float qs[kRecWarps * RPT], ks[kRecWarps * RPT];
  float gs[kPerChannel ? kRecWarps * RPT : 1];
  float red[kNormMaxGroups][kRecWarps][32], red2[kNormMaxGroups][kRecWarps][32];
  float o_head[32 * kNormMaxGroups];
};
// After the rule, every thread: once every block's outputs are in the first block's o_head (a
// cluster barrier, which also keeps that block from exiting while the others write into it),
// that block's first warp (norm_warp) normalises the head's row of token t as rms_norm_kernel
// does, with the weights and gate row it loaded early (wpre, gpre).
template <typename W, NormGate kGate>
__device__ __forceinline__ void head_norm(const HeadBlocks& b, bool norm_warp, const DeltaArgs& a,
                                          float* o_head, int64_t t, Rows gate, Rows normed,
                                          const W* norm_w, float eps,
                                          const NormWeights<kWarpNormPer>& wpre,
                                          const NormWeights<kWarpNormPer>& gpre) {
  if (b.split > 1) cooperative_groups::this_cluster().sync();
  if (!norm_warp) return;
  // The head's output row from shared memory (every row index maps to o_head).
  const Rows o_row{o_head, normed.n_rows, a.dv, a.hv, 0, 0};
  rms_norm_row<kWarpNormPer, W, kGate>(
      o_row, gate, normed, norm_w, 0.0f, eps, t * a.hv + b.h, threadIdx.x, 32,
      [](float ss) { return warp_sum(ss); }, wpre, gpre);
}
template <int RPT, typename W, NormGate kGate, bool kPerChannel>
__global__ void __launch_bounds__(32 * kRecWarps * kNormMaxGroups)
    delta_recurrent_norm_kernel(DeltaArgs a, Rows gate, Rows normed, const W* norm_w, float eps) {
  const HeadBlocks hb = head_blocks(a.hv);
  const int s = blockIdx.y, h = hb.h;
  const int lane = threadIdx.x, group = threadIdx.y / kRecWarps, warp = threadIdx.y % kRecWarps;
  const int j = hb.col0 + group * 32 + lane;
  const bool norm_warp = hb.rank == 0 && threadIdx.y == 0;
  const int64_t t = a.seq_start[s];
  float* S = a.state + (int64_t(a.slot[s]) * a.hv + h) * a.dk * a.dv;
  __shared__ DeltaNormShared<RPT, kPerChannel> sh;
  float st[RPT];
  delta_state_load<RPT>(a, S, j, warp, st);  // before the wait, as in delta_recurrent_kernel
  NormWeights<kWarpNormPer> wpre;
  if (norm_warp) wpre = load_norm_weights<kWarpNormPer>(norm_w, a.dv, lane, 32);
  grid_dependency_sync();
  // The head's gate row (written by the kernel before) is requested with the token's inputs,
  // not after the rule: one round trip less before the norm.
  NormWeights<kWarpNormPer> gpre;
  if (norm_warp) gpre = load_norm_weights<kWarpNormPer>(gate.row(t * a.hv + h), a.dv, lane, 32);
  float* o_head = head_output_row(hb, sh.o_head);
  delta_token<RPT, kPerChannel>(a, t, h, j, warp, lane, threadIdx.y * 32 + lane, 32 * blockDim.y,
                                st, sh.qs, sh.ks, sh.gs, sh.red[group], sh.red2[group], o_head);
  delta_state_store<RPT>(a, S, j, warp, st);  // the final state, stored while the norm runs
  head_norm<W, kGate>(hb, norm_warp, a, sh.o_head, t, gate, normed, norm_w, eps, wpre, gpre);
}

// Decode from the projections to the gated norm in one kernel: each value head's block runs
// the input stage for its head with gdn_inputs_decode_kernel's arithmetic (its key head's q
// and k, which each of the key head's r value-head blocks computes; its v; its gates) into
// shared memory, then delta_recurrent_norm_kernel's token and norm: the same bits as
// gdn_inputs then gated_delta_rule_norm, with one kernel boundary and the conv_out, g and β
// round trip through L2 less. The q and k conv state is read by r blocks: each warp that read
// it counts itself in (arrivals[2i] for q, [2i + 1] for k, i = sequence · Hk + key head; they
// return to 0 with the last), and the last to arrive stores the shifted state.
// grid (Hv · split, n_seqs) as delta_recurrent_norm_kernel's, block (32, kRecWarps · ⌈dv/32⌉ /
// split): warps 0 and 1 take q and k (lane j: channels j + 32i), thread 64 + c the block's v
// channel col0 + c, threads c < dk its decays per key channel (else thread 0 its decay),
// thread 0 β; every block of a head computes q, k and the gates. K 4, dk ≤ 128, dv ≤ 128.
// in: GdnDecodeArgs' tensors; a: the rule's state, out, sizes and layout; the rest as
// delta_recurrent_norm_kernel.
template <typename W, NormGate kGate, bool kPerChannel>
__global__ void __launch_bounds__(32 * kRecWarps * kNormMaxGroups)
    gdn_decode_core_kernel(GdnDecodeArgs in, DeltaArgs a, Rows gate, Rows normed, const W* norm_w,
                           float eps, unsigned* arrivals) {
  constexpr int K = 4, RPT = 32, kDkPerLane = 4;
  const HeadBlocks hb = head_blocks(a.hv);
  const int s = blockIdx.y, h = hb.h;
  const int lane = threadIdx.x, group = threadIdx.y / kRecWarps, warp = threadIdx.y % kRecWarps;
  const int tid = threadIdx.y * 32 + lane;
  const int j = hb.col0 + group * 32 + lane;
  const bool norm_warp = hb.rank == 0 && threadIdx.y == 0;
  const int kh = h / in.r;
  const int readers = in.r * hb.split;  // of the key head's q/k conv state
  const int64_t t = a.seq_start[s];
  float* S = a.state + (int64_t(a.slot[s]) * a.hv + h) * a.dk * a.dv;
  float* cst = in.state + int64_t(a.slot[s]) * (K - 1) * in.C;
  __shared__ DeltaNormShared<RPT, kPerChannel> sh;
  __shared__ float vs[32 * kNormMaxGroups], decay_beta[2];
  float st[RPT];
  delta_state_load<RPT>(a, S, j, warp, st);  // before the wait, as in delta_recurrent_kernel
  NormWeights<kWarpNormPer> wpre;
  if (norm_warp) wpre = load_norm_weights<kWarpNormPer>(norm_w, a.dv, lane, 32);
  // The conv state and weights and the gate parameters, too (gdn_inputs_decode_kernel's order).
  const bool qk = threadIdx.y < 2;
  const int64_t c_qk = threadIdx.y * in.key_dim + int64_t(kh) * a.dk;  // q or k
  const int vc = tid - 64;  // the block's v channel hb.col0 + vc
  const bool vt = vc >= 0 && vc < int(blockDim.y / kRecWarps) * 32 && hb.col0 + vc < a.dv;
  const int64_t c_v = 2 * in.key_dim + int64_t(h) * a.dv + hb.col0 + vc;
  ConvIn<K> qin[kDkPerLane], vin;
  if (qk) {
#pragma unroll
    for (int i = 0; i < kDkPerLane; ++i) {
      if (lane + 32 * i < a.dk) qin[i] = conv_load<K>(in, cst, c_qk + lane + 32 * i);
    }
  }
  if (vt) vin = conv_load<K>(in, cst, c_v);
  const bool gt = kPerChannel ? tid < a.dk : tid == 0;           // a decay's thread
  const int64_t gc = kPerChannel ? int64_t(h) * a.dk + tid : h;  // its column of a, dt_bias
  float a_log = 0.0f, dt_bias = 0.0f, av = 0.0f, bv = 0.0f;
  if (gt) {
    a_log = weight_f32(in.a_log, in.gate_dt, h), dt_bias = weight_f32(in.dt_bias, in.gate_dt, gc);
  }
  grid_dependency_sync();
  NormWeights<kWarpNormPer> gpre;  // the gate row with the token's inputs
  if (norm_warp) gpre = load_norm_weights<kWarpNormPer>(gate.row(t * a.hv + h), a.dv, lane, 32);
  const float* src = in.mixed + t * in.ld_mixed;
  if (qk) {
#pragma unroll
    for (int i = 0; i < kDkPerLane; ++i) {
      if (lane + 32 * i < a.dk) qin[i].x = src[c_qk + lane + 32 * i];
    }
  }
  if (vt) vin.x = src[c_v];
  if (gt) av = in.a[t * in.ld_a + gc];
  if (tid == 0) bv = in.b[t * in.ld_b + h];
  if (qk) {
    float v[kDkPerLane];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kDkPerLane; ++i) {
      v[i] = lane + 32 * i < a.dk ? conv_output<K>(qin[i]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kDkPerLane; ++i) {
      if (lane + 32 * i < a.dk) ss += v[i] * v[i];
    }
    ss = warp_sum(ss);  // after which every lane's state values are in
    const float f = (threadIdx.y == 0 ? in.q_scale : 1.0f) / sqrtf(ss + in.eps);
    float* qk_s = threadIdx.y == 0 ? sh.qs : sh.ks;
#pragma unroll
    for (int i = 0; i < kDkPerLane; ++i) {
      if (lane + 32 * i < a.dk) qk_s[lane + 32 * i] = v[i] * f;
    }
    bool store = true;
    if (readers > 1) {
      __threadfence();
      __syncwarp();
      unsigned before = 0;
      if (lane == 0) {
        before = atomicInc(&arrivals[2 * (s * (a.hv / in.r) + kh) + threadIdx.y], readers - 1);
      }
      store = __shfl_sync(0xffffffffu, before, 0) == unsigned(readers - 1);
    }
    if (store) {
      __syncwarp();
      __threadfence();  // the stores after every reader's arrival
#pragma unroll
      for (int i = 0; i < kDkPerLane; ++i) {
        if (lane + 32 * i < a.dk) conv_store<K>(in, cst, c_qk + lane + 32 * i, qin[i]);
      }
    }
  }
  if (vt) vs[vc] = conv_finish<K>(in, cst, c_v, vin);
  if (gt) {
    // exp of gdn_gates' g
    const float decay = expf(-expf(a_log) * softplus(av + dt_bias));
    if constexpr (kPerChannel) {
      sh.gs[tid] = decay;
    } else {
      decay_beta[0] = decay;
    }
  }
  if (tid == 0) decay_beta[1] = sigmoid(bv);
  __syncthreads();
  float* o_head = head_output_row(hb, sh.o_head);
  delta_step<RPT, kPerChannel>(
      a, t, h, j, warp, lane, st, sh.qs, sh.ks, sh.gs, kPerChannel ? 1.0f : decay_beta[0],
      decay_beta[1], j < a.dv ? vs[j - hb.col0] : 0.0f, sh.red[group], sh.red2[group], o_head);
  delta_state_store<RPT>(a, S, j, warp, st);
  head_norm<W, kGate>(hb, norm_warp, a, sh.o_head, t, gate, normed, norm_w, eps, wpre, gpre);
}

template <bool kPerChannel>
void launch_recurrent(const DeltaArgs& a, int n_seqs, cudaStream_t stream) {
  const dim3 grid(unsigned((a.dv + 31) / 32), unsigned(a.hv), unsigned(n_seqs));
  const dim3 block(32, kRecWarps);
  const int rpt = (a.dk + kRecWarps - 1) / kRecWarps;
  if (rpt <= 4) {
    launch_kernel(delta_recurrent_kernel<4, kPerChannel>, grid, block, 0, stream, a);
  } else if (rpt <= 8) {
    launch_kernel(delta_recurrent_kernel<8, kPerChannel>, grid, block, 0, stream, a);
  } else if (rpt <= 16) {
    launch_kernel(delta_recurrent_kernel<16, kPerChannel>, grid, block, 0, stream, a);
  } else if (rpt <= 32) {
    launch_kernel(delta_recurrent_kernel<32, kPerChannel>, grid, block, 0, stream, a);
  } else {
    RECUR_CHECK(rpt <= 64);
    launch_kernel(delta_recurrent_kernel<64, kPerChannel>, grid, block, 0, stream, a);
  }
}

// Whether g [n, Hv, dk] holds a decay per key channel (else g [n, Hv], per head); checks the
// shape either way.
bool decay_per_channel(const Tensor& g, int64_t n, int64_t hv, int64_t dk) {
  RECUR_CHECK(g.dtype == DType::F32 && g.shape[0] == n && g.shape[1] == hv);
  if (g.ndim == 3) {
    RECUR_CHECK(g.shape[2] == dk && g.stride[2] == 1);
    return true;
  }
  RECUR_CHECK(g.ndim == 2 && g.stride[1] == 1);
  return false;
}

// The kernels' view of the op's tensors (shapes checked by the caller).
DeltaArgs delta_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                     const Tensor& beta, const Tensor& state, const Tensor& out,
                     const DevLayout& dl, DeltaMode mode) {
  const int64_t hk = q.shape[1], dk = q.shape[2], hv = v.shape[1], dv = v.shape[2];
  DeltaArgs a{};
  a.q = q.ptr<float>(), a.k = k.ptr<float>(), a.v = v.ptr<float>(), a.g = g.ptr<float>();
  a.beta = beta.ptr<float>();
  a.q_s0 = q.stride[0], a.q_s1 = q.stride[1], a.k_s0 = k.stride[0], a.k_s1 = k.stride[1];
  a.v_s0 = v.stride[0], a.v_s1 = v.stride[1];
  a.g_s0 = g.stride[0], a.g_s1 = g.ndim == 3 ? g.stride[1] : 0;
  a.beta_s0 = beta.stride[0], a.o_s0 = out.stride[0], a.o_s1 = out.stride[1];
  a.state = state.ptr<float>(), a.out = out.ptr<float>();
  a.hv = int(hv), a.group = int(hv / hk), a.dk = int(dk), a.dv = int(dv);
  a.seq_start = dl.seq_start, a.slot = dl.slot, a.mode = mode;
  return a;
}

// Whether one-token sequences take the rule and its norm as one kernel: heads of dv ≤ 128 and
// dk ≤ 128, while its blocks (one per head and sequence, one per SM) fit one wave, the gain
// being the shorter chain of a small step; else two ops, whose smaller blocks keep more warps
// per SM.
bool norm_kernel_fits(int64_t hv, int64_t dk, int64_t dv, int n_seqs, int sm_count) {
  return dv <= 32 * kNormMaxGroups && dk <= kRecWarps * 32 && hv * n_seqs <= sm_count;
}

// The blocks of a value head in those kernels (HeadBlocks): with RECUR_EXP_DELTA_CLUSTER the
// most of 4 and 2 that divides the head's column groups while there are no more blocks than
// SMs (a rough wave: clusters are placed per GPC, and small blocks may share an SM); else 1.
// Their grid and block.
struct HeadGrid {
  unsigned split;
  dim3 grid, block;
};
HeadGrid head_grid(bool clusters, int64_t hv, int64_t dv, int n_seqs, int sm_count) {
  const int64_t groups = (dv + 31) / 32;
  int split = 1;
  for (int c : {4, 2}) {
    if (clusters && split == 1 && groups % c == 0 && hv * n_seqs * c <= sm_count) split = c;
  }
  return {unsigned(split), dim3(unsigned(hv * split), unsigned(n_seqs)),
          dim3(32, unsigned(kRecWarps * groups / split))};
}

}  // namespace

size_t CudaOps::gated_delta_rule_scratch_bytes(int dk, int dv) const {
  return 0;  // both forms and both decays work in shared memory, registers and gdn_chunks
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
  const bool per_channel = decay_per_channel(g, q.shape[0], hv, dk);
  if (layout.n_seqs == 0) return;
  Impl& s = *impl_;
  const DevLayout dl = s.layout(layout, false);
  DeltaArgs a = delta_args(q, k, v, g, beta, state, out, dl, kAllSeqs);
  bool any_single = false, any_multi = false;
  for (int i = 0; i < layout.n_seqs; ++i) {
    any_single |= layout.seq_len(i) == 1;
    any_multi |= layout.seq_len(i) > 1;
  }
  // The rule's own arithmetic per token and value head (decay, k·S, update, q·S: 7·dk·dv);
  // bytes: q, k, v, g, β and the output per token, each sequence's state read and written.
  // Counted once for the op: at the recurrent kernel, or at the chunked form's first state walk.
  bool work_counted = false;
  auto rule_work = [&] {
    if (!s.options.profile || work_counted) return;
    work_counted = true;
    const double n = double(q.shape[0]);
    s.work(7.0 * n * double(hv * dk * dv),
           4.0 * (n * double(2 * hk * dk + 2 * hv * dv + (per_channel ? hv * dk : hv) + hv) +
                  2.0 * layout.n_seqs * double(hv * dk * dv)));
  };
  auto recurrent = [&] {
    rule_work();
    if (per_channel) {
      launch_recurrent<true>(a, layout.n_seqs, s.stream);
    } else {
      launch_recurrent<false>(a, layout.n_seqs, s.stream);
    }
    s.launched("gated_delta_rule (recurrent)");
  };
  // Each chunked kernel is its own profile interval; the rule's work goes with the state walk.
  const std::function<void(const char*)> chunk_launched = [&](const char* what) {
    s.launched(what);
    rule_work();  // after the first keys launch: the next is a state walk
  };
  // Per key channel, a key head too large for the chunked kernels' shared memory (dk > 128 on
  // an H200) runs token by token.
  const bool chunked_fits = chunk_columns(int(dk), per_channel, s.max_smem_optin) > 0;
  auto chunked = [&] {
    if (!chunked_fits && per_channel) return recurrent();
    void* records = s.gdn_chunks.data();
    const size_t bytes = s.gdn_chunks.bytes();
    if (per_channel) {
      launch_chunked<true>(a, layout, records, bytes, s.max_smem_optin, s.stream, chunk_launched);
    } else {
      launch_chunked<false>(a, layout, records, bytes, s.max_smem_optin, s.stream, chunk_launched);
    }
  };
  if (form == DeltaRuleForm::kRecurrent) {
    recurrent();
  } else if (form == DeltaRuleForm::kChunked) {
    chunked();
  } else {
    if (any_single) {
      a.mode = kSingleTokenSeqs;
      recurrent();
    }
    if (any_multi) {
      a.mode = kMultiTokenSeqs;
      chunked();
    }
  }
}

void CudaOps::gated_delta_rule_norm(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& g, const Tensor& beta, Tensor state,
                                    const SeqLayout& layout, Tensor out, Tensor scratch,
                                    const Tensor& gate, const Tensor& norm_w, float eps,
                                    GateActivation act, Tensor normed) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t hk = q.shape[1], dk = q.shape[2], hv = v.shape[1], dv = v.shape[2];
  bool single = layout.n_seqs > 0 && layout.n_tokens == layout.n_seqs;
  for (int i = 0; single && i < layout.n_seqs; ++i) single = layout.seq_len(i) == 1;
  if (!single || !norm_kernel_fits(hv, dk, dv, layout.n_seqs, impl_->sm_count) || out.ndim != 3 ||
      gate.ndim != 3 || normed.ndim != 3) {
    Ops::gated_delta_rule_norm(q, k, v, g, beta, state, layout, out, scratch, gate, norm_w, eps,
                               act, normed);
    return;
  }
  RECUR_CHECK(hk > 0 && hv % hk == 0 && k.shape[1] == hk && k.shape[2] == dk);
  RECUR_CHECK(state.shape[1] == hv && state.shape[2] == dk && state.shape[3] == dv &&
              state.is_contiguous());
  RECUR_CHECK(q.stride[2] == 1 && k.stride[2] == 1 && v.stride[2] == 1 && out.stride[2] == 1);
  const int64_t n = layout.n_tokens;
  RECUR_CHECK(norm_w.numel() == dv && out.shape[0] == n && out.shape[1] == hv &&
              out.shape[2] == dv && gate.shape[0] == n && gate.shape[1] == hv &&
              gate.shape[2] == dv && normed.shape[0] == n && normed.shape[1] == hv &&
              normed.shape[2] == dv && q.shape[0] == n && v.shape[0] == n);
  const bool per_channel = decay_per_channel(g, n, hv, dk);
  Impl& s = *impl_;
  const DevLayout dl = s.layout(layout, false);
  const DeltaArgs a = delta_args(q, k, v, g, beta, state, out, dl, kSingleTokenSeqs);
  const Rows gs = rows_of(gate), ns = rows_of(normed);
  const HeadGrid hg = head_grid(s.options.exp_delta_cluster, hv, dv, layout.n_seqs, s.sm_count);
  dispatch_weight(norm_w.dtype, [&](auto tag) {
    using W = decltype(tag);
    auto launch = [&](auto kernel) {
      launch_kernel_clusters(kernel, hg.grid, hg.block, 0, s.stream, hg.split, a, gs, ns,
                             norm_w.ptr<W>(), eps);
    };
    const bool silu = act == GateActivation::kSilu;
    if (per_channel) {
      silu ? launch(delta_recurrent_norm_kernel<32, W, NormGate::kSilu, true>)
           : launch(delta_recurrent_norm_kernel<32, W, NormGate::kSigmoid, true>);
    } else {
      silu ? launch(delta_recurrent_norm_kernel<32, W, NormGate::kSilu, false>)
           : launch(delta_recurrent_norm_kernel<32, W, NormGate::kSigmoid, false>);
    }
  });
  s.launched("gated_delta_rule_norm");
}

void CudaOps::gdn_core(const GdnCoreArgs& c, const SeqLayout& layout) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  Impl& s = *impl_;
  const GdnInputArgs& gi = c.in;
  const int hv = gi.value_heads, dk = gi.dk, dv = gi.dv;
  GdnDecodeArgs in;
  bool per_channel = false;
  // Where gated_delta_rule_norm's one kernel runs, with the input stage's one-token kernel's
  // shapes and a conv of width 4.
  if (!s.options.exp_gdn_fold || !gdn_decode_args(gi, layout, in, per_channel) ||
      gi.conv_weight.shape[1] != 4 || !norm_kernel_fits(hv, dk, dv, layout.n_seqs, s.sm_count) ||
      c.out.ndim != 3 || c.gate.ndim != 3 || c.normed.ndim != 3) {
    Ops::gdn_core(c, layout);
    return;
  }
  const int64_t n = layout.n_tokens;
  RECUR_CHECK(c.state.ndim == 4 && c.state.shape[1] == hv && c.state.shape[2] == dk &&
              c.state.shape[3] == dv && c.state.is_contiguous() && c.state.dtype == DType::F32);
  RECUR_CHECK(c.norm_w.numel() == dv && c.out.shape[0] == n && c.out.shape[1] == hv &&
              c.out.shape[2] == dv && c.out.stride[2] == 1 && c.gate.shape[0] == n &&
              c.gate.shape[1] == hv && c.gate.shape[2] == dv && c.normed.shape[0] == n &&
              c.normed.shape[1] == hv && c.normed.shape[2] == dv);
  const DevLayout dl = s.layout(layout, false);
  in.seq_start = dl.seq_start, in.slot = dl.slot;
  DeltaArgs a{};
  a.o_s0 = c.out.stride[0], a.o_s1 = c.out.stride[1];
  a.state = c.state.ptr<float>(), a.out = c.out.ptr<float>();
  a.hv = hv, a.group = in.r, a.dk = dk, a.dv = dv;
  a.seq_start = dl.seq_start, a.slot = dl.slot, a.mode = kSingleTokenSeqs;
  const Rows gs = rows_of(c.gate), ns = rows_of(c.normed);
  const HeadGrid hg = head_grid(s.options.exp_delta_cluster, hv, dv, layout.n_seqs, s.sm_count);
  unsigned* arrivals = static_cast<unsigned*>(s.arrivals.data());
  dispatch_weight(c.norm_w.dtype, [&](auto tag) {
    using W = decltype(tag);
    auto launch = [&](auto kernel) {
      launch_kernel_clusters(kernel, hg.grid, hg.block, 0, s.stream, hg.split, in, a, gs, ns,
                             c.norm_w.ptr<W>(), c.eps, arrivals);
    };
    const bool silu = c.act == GateActivation::kSilu;
    if (per_channel) {
      silu ? launch(gdn_decode_core_kernel<W, NormGate::kSilu, true>)
           : launch(gdn_decode_core_kernel<W, NormGate::kSigmoid, true>);
    } else {
      silu ? launch(gdn_decode_core_kernel<W, NormGate::kSilu, false>)
           : launch(gdn_decode_core_kernel<W, NormGate::kSigmoid, false>);
    }
  });
  s.launched("gdn_core (decode)");
}

}  // namespace recur
