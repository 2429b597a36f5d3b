// Gated DeltaNet on the GPU: the gated delta rule in its recurrent form (decode: the state
// tile stays in registers across the sequence's tokens) and its chunked WY/UT form (prompts:
// chunks of 64 tokens, the same algebra as delta_rule_chunked in backend/cpu/kernels_gdn.cpp,
// including the (I + A)^-1 solve in double; its kernels are in kernels_gdn_chunked.cu). Value
// columns are independent in the rule, so both forms split dv across blocks. The decay is per
// head (Gated DeltaNet) or per key channel (Kimi Delta Attention): every kernel is a template
// on which, so the per-head instructions are those of a kernel that knows nothing else. The
// conv and the input stage are in kernels_gdn_inputs.cu.
#include <algorithm>
#include <functional>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/delta_rule.cuh"
#include "backend/cuda/rms_norm_row.cuh"

namespace recur {

using namespace cuda;

namespace {

constexpr int kRecWarps = 4;

// One token t of the rule for value column j, whose state rows warp + kRecWarps·r this thread
// holds in st: S ← diag(exp(g))·S; kv = Sᵀk; S ← S + k ⊗ β(v − kv); o = Sᵀq, written by warp 0.
// qs, ks [≥ dk] are the block's (and gs, the decay factors of the rows, when kPerChannel);
// red, red2 [kRecWarps][32] its column group's. Every thread of the block calls it (n_threads
// of them); it ends with a barrier, after which o is visible to the block and the shared
// arrays may be rewritten.
// o_shared (or null): o [dv] is also written there, for the block's own later use.
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
// grid (Hv, n_seqs), block (32, kRecWarps · column groups), a block per head so that the head's
// dv ≤ 128 outputs meet in one block. Column group c (warps c·kRecWarps ...) computes columns
// 32c + lane exactly as delta_recurrent_kernel does; then one warp normalises the head's row
// with rms_norm_row, as rms_norm_kernel does (the same bits as the two kernels).
// gate, normed [n, Hv, dv] as rows; norm_w [dv]; the rest as DeltaArgs.
constexpr int kNormMaxGroups = 4;
template <int RPT, typename W, NormGate kGate, bool kPerChannel>
__global__ void __launch_bounds__(32 * kRecWarps * kNormMaxGroups)
    delta_recurrent_norm_kernel(DeltaArgs a, Rows gate, Rows normed, const W* norm_w, float eps) {
  const int s = blockIdx.y, h = blockIdx.x;
  const int lane = threadIdx.x, group = threadIdx.y / kRecWarps, warp = threadIdx.y % kRecWarps;
  const int j = group * 32 + lane;
  const int64_t t = a.seq_start[s];
  float* S = a.state + (int64_t(a.slot[s]) * a.hv + h) * a.dk * a.dv;
  __shared__ float qs[kRecWarps * RPT], ks[kRecWarps * RPT];
  __shared__ float gs[kPerChannel ? kRecWarps * RPT : 1];
  __shared__ float red[kNormMaxGroups][kRecWarps][32], red2[kNormMaxGroups][kRecWarps][32];
  __shared__ float o_head[32 * kNormMaxGroups];
  float st[RPT];
  delta_state_load<RPT>(a, S, j, warp, st);  // before the wait, as in delta_recurrent_kernel
  NormWeights<kWarpNormPer> wpre;
  if (threadIdx.y == 0) wpre = load_norm_weights<kWarpNormPer>(norm_w, a.dv, lane, 32);
  grid_dependency_sync();
  // The head's gate row (written by the kernel before) is requested with the token's inputs,
  // not after the rule: one round trip less before the norm.
  NormWeights<kWarpNormPer> gpre;
  if (threadIdx.y == 0) {
    gpre = load_norm_weights<kWarpNormPer>(gate.row(t * a.hv + h), a.dv, lane, 32);
  }
  delta_token<RPT, kPerChannel>(a, t, h, j, warp, lane, threadIdx.y * 32 + lane, 32 * blockDim.y,
                                st, qs, ks, gs, red[group], red2[group], o_head);
  delta_state_store<RPT>(a, S, j, warp, st);  // the final state, stored while the norm runs
  if (threadIdx.y == 0) {
    // The head's output row from shared memory (every row index maps to o_head).
    const Rows o_row{o_head, normed.n_rows, a.dv, a.hv, 0, 0};
    rms_norm_row<kWarpNormPer, W, kGate>(
        o_row, gate, normed, norm_w, 0.0f, eps, t * a.hv + h, lane, 32,
        [](float ss) { return warp_sum(ss); }, wpre, gpre);
  }
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
  // Decode (one token per sequence) with heads of dv ≤ 128 and dk ≤ 128, while its blocks (one
  // per head and sequence, one per SM) fit one wave: one kernel, whose gain is the shorter
  // chain of a small step; else the two ops, whose smaller blocks keep more warps per SM.
  if (!single || dv > 32 * kNormMaxGroups || dk > kRecWarps * 32 ||
      hv * layout.n_seqs > impl_->sm_count || out.ndim != 3 || gate.ndim != 3 || normed.ndim != 3) {
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
  const dim3 grid(unsigned(hv), unsigned(layout.n_seqs));
  const dim3 block(32, unsigned(kRecWarps * ((dv + 31) / 32)));
  dispatch_weight(norm_w.dtype, [&](auto tag) {
    using W = decltype(tag);
    auto launch = [&](auto kernel) {
      launch_kernel(kernel, grid, block, 0, s.stream, a, gs, ns, norm_w.ptr<W>(), eps);
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

}  // namespace recur
