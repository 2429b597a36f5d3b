// Attention over the paged cache, with the CPU's layouts: k_cache [blocks, kv_heads, hd,
// block_size] (keys transposed within a block, so 32 consecutive positions are one coalesced
// row read per key channel) and v_cache [blocks, kv_heads, block_size, dv] (the value head size
// dv may differ from the key head size hd).
//
// One block per (token, kv head, context split) handles the kv head's whole group of query
// heads, so the cache is read once per token. The main kernel gives each warp its own chunks
// of 32 positions, a lane per position for the scores and a lane per channel for the values,
// with a warp-private online softmax and no block-wide barrier in the loop; the warps' partial
// results merge at the end. When the batch alone gives too few blocks to fill the GPU (decode),
// the context is split (flash-decoding) and a second kernel merges the splits. Groups too large
// for the warp kernel's registers (group · ⌈hd/32⌉ > 64) use a block-wide tiled kernel.
// Forwards of few tokens (decode) take a third kernel where both head dims are multiples of 32:
// a thread per channel, every load of a 32-position chunk in flight at once, splits of whole
// chunks (kernels_attention_decode.cu), or over a BF16, F16 or F8_E4M3 cache a tensor-core one
// (kernels_attention_decode_mma.cu). The caches hold F32, BF16, F16 or F8_E4M3 (every CUDA-core
// kernel is compiled for each, T, and widens what it loads to f32).
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/cuda_internal.cuh"

namespace recur {

using namespace cuda;

namespace {

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kTileP = 32;  // positions per tile: one per lane in the softmax
// A split holds at least a chunk of 32 positions for each of the block's warps: shorter
// splits leave warps idle and give the merge more partial results to combine.
constexpr int kMinSplitPositions = 32 * kAttnWarps;

// k [n, kv_heads, hd], v [n, kv_heads, dv] → the caches (elements T) at each token's position;
// grid (n, kv_heads)
template <typename T>
__global__ void kv_cache_write_kernel(const float* k, int64_t k_s0, int64_t k_s1, const float* v,
                                      int64_t v_s0, int64_t v_s1, T* kc, int64_t kc_s0,
                                      int64_t kc_s1, int64_t kc_s2, T* vc, int64_t vc_s0,
                                      int64_t vc_s1, int64_t vc_s2, int64_t vc_sd, int hd, int dv,
                                      int bs, const int32_t* seq_start, int n_seqs,
                                      const int32_t* positions, const int32_t* block_start,
                                      const int32_t* block_ids) {
  grid_dependency_sync();
  const int t = blockIdx.x, h = blockIdx.y;
  const int s = seq_of_token(seq_start, n_seqs, t);
  const int pos = positions[t];
  const int64_t block = block_ids[block_start[s] + pos / bs], off = pos % bs;
  T* kd = kc + block * kc_s0 + h * kc_s1 + off;
  T* vd = vc + block * vc_s0 + h * vc_s1 + off * vc_s2;
  const float* ks = k + int64_t(t) * k_s0 + h * k_s1;
  const float* vs = v + int64_t(t) * v_s0 + h * v_s1;
  for (int j = threadIdx.x; j < hd; j += blockDim.x) kd[j * kc_s2] = cache_from_f32<T>(ks[j]);
  for (int j = threadIdx.x; j < dv; j += blockDim.x) vd[j * vc_sd] = cache_from_f32<T>(vs[j]);
}

size_t attn_smem_bytes(int group, int hd, int dv) {
  return sizeof(float) * (size_t(group) * hd + size_t(kTileP) * (hd + dv) + size_t(group) * kTileP +
                          3 * size_t(group));
}

// The tiled kernel, for groups too large for the warp kernel: the block walks the split in
// tiles of ≤ 32 positions within one cache block (scores, softmax and values each a block-wide
// step). grid (n_tokens, kv_heads, n_splits), NT threads. Thread outputs: e = tid + i·NT over
// the group's [group, dv] accumulator (MAXO of them per thread). Groups of the widest heads
// (32 latent heads of 576) take 512 threads, so that MAXO stays within the registers.
template <int MAXO, int NT, typename T>
__global__ void __launch_bounds__(NT) paged_attention_kernel(AttnArgs a) {
  grid_dependency_sync();
  extern __shared__ float sm[];
  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);
  const int group = a.group, hd = a.hd, dv = a.dv;
  float* Qs = sm;                       // [group][hd]
  float* Ks = Qs + group * hd;          // [hd][kTileP]
  float* Vs = Ks + hd * kTileP;         // [kTileP][dv]
  float* P = Vs + kTileP * dv;          // [group][kTileP]
  float* row_max = P + group * kTileP;  // [group]
  float* row_sum = row_max + group;     // [group]
  float* corr = row_sum + group;        // [group]
  const int t = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z, tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const int seq = seq_of_token(a.seq_start, a.n_seqs, t);
  const int n_ctx = a.positions[t] + 1;
  const int split_len = split_span(a, n_ctx);
  const int p_begin = sp * split_len, p_end = min(n_ctx, p_begin + split_len);
  if (p_begin >= n_ctx) {
    mark_empty_split(a, t, kvh, sp);
    return;
  }
  for (int e = tid; e < group * hd; e += NT) {
    const int g = e / hd, d = e % hd;
    Qs[e] = a.q[int64_t(t) * a.q_s0 + int64_t(kvh * group + g) * a.q_s1 + d];
  }
  if (tid < group) {
    row_max[tid] = -INFINITY;
    row_sum[tid] = 0.0f;
  }
  float acc[MAXO];
#pragma unroll
  for (int i = 0; i < MAXO; ++i) acc[i] = 0.0f;
  __syncthreads();
  for (int p = p_begin; p < p_end;) {
    const int off = p % a.bs;
    const int len = min(min(kTileP, a.bs - off), p_end - p);
    const int64_t block = a.block_ids[a.block_start[seq] + p / a.bs];
    const T* kb = kc + block * a.kc_s0 + kvh * a.kc_s1 + off;
    const T* vb = vc + block * a.vc_s0 + kvh * a.vc_s1 + off * a.vc_s2;
    for (int e = tid; e < hd * len; e += NT) {
      const int d = e / len, pp = e % len;
      Ks[d * kTileP + pp] = load_cache(kb + d * a.kc_s2 + pp);
    }
    for (int e = tid; e < len * dv; e += NT) {
      const int pp = e / dv, d = e % dv;
      Vs[pp * dv + d] = load_cache(vb + pp * a.vc_s2 + d * a.vc_sd);
    }
    __syncthreads();
    for (int e = tid; e < group * len; e += NT) {
      const int g = e / len, pp = e % len;
      float sc = 0.0f;
      for (int d = 0; d < hd; ++d) sc += Qs[g * hd + d] * Ks[d * kTileP + pp];
      P[g * kTileP + pp] = sc * a.scale;
    }
    __syncthreads();
    // Online softmax, a warp per query head, a lane per position.
    for (int g = warp; g < group; g += NT / 32) {
      const float sc = lane < len ? P[g * kTileP + lane] : -INFINITY;
      const float m_old = row_max[g];
      const float m_new = fmaxf(m_old, warp_max(sc));
      const float e = lane < len ? expf(sc - m_new) : 0.0f;
      const float sum = warp_sum(e);
      P[g * kTileP + lane] = e;
      if (lane == 0) {
        const float c = expf(m_old - m_new);  // 0 on the first tile
        corr[g] = c;
        row_sum[g] = row_sum[g] * c + sum;
        row_max[g] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MAXO; ++i) {
      const int e = tid + i * NT;
      if (e < group * dv) {
        const int g = e / dv, d = e % dv;
        float v = acc[i] * corr[g];
        for (int pp = 0; pp < len; ++pp) v += P[g * kTileP + pp] * Vs[pp * dv + d];
        acc[i] = v;
      }
    }
    __syncthreads();  // the next tile overwrites Ks, Vs and P
    p += len;
  }
#pragma unroll
  for (int i = 0; i < MAXO; ++i) {
    const int e = tid + i * NT;
    if (e < group * dv) {
      const int g = e / dv, d = e % dv, h = kvh * group + g;
      if (a.n_splits == 1) {
        store_out(a, t, h, d, acc[i] / row_sum[g], dv);
      } else {
        const int64_t slot = (int64_t(t) * a.heads + h) * a.n_splits + sp;
        a.part_o[slot * dv + d] = acc[i];
        if (d == 0) {
          a.part_ml[slot * 2] = row_max[g];
          a.part_ml[slot * 2 + 1] = row_sum[g];
        }
      }
    }
  }
}

size_t warp_attn_smem_bytes(int group, int hd, int dv) {
  return sizeof(float) *
         (size_t(group) * (hd + size_t(dv) * kAttnWarps) + 2 * kAttnWarps * size_t(group));
}

// grid (n_tokens, kv_heads, n_splits), kAttnThreads. Warp w takes the 32-position chunks
// w, w + kAttnWarps, ... of the split. Scores: lane = position, s[g] = q_g · k_p over the
// channels; values: lane owns value channels lane + 32·i (i < DPL), acc[g][i] += p_g(j) · v_j.
// group ≤ GMAX, dv ≤ 32·DPL. kSplitDims: dv ≠ hd (hd = dv compiles as a kernel of one head
// size, whose registers it was tuned for).
template <int GMAX, int DPL, bool kSplitDims, typename T>
__global__ void __launch_bounds__(kAttnThreads) paged_attention_warps_kernel(AttnArgs a) {
  grid_dependency_sync();
  extern __shared__ float sm[];
  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);
  const int group = a.group, hd = a.hd, dv = kSplitDims ? a.dv : hd;
  float* Qs = sm;                                   // [group][hd]
  float* part = Qs + group * hd;                    // [warps][group][dv]
  float* part_ml = part + kAttnWarps * group * dv;  // [warps][group][2]
  const int t = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z, tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const int seq = seq_of_token(a.seq_start, a.n_seqs, t);
  const int n_ctx = a.positions[t] + 1;
  const int split_len = split_span(a, n_ctx);
  const int p_begin = sp * split_len, p_end = min(n_ctx, p_begin + split_len);
  if (p_begin >= n_ctx) {
    mark_empty_split(a, t, kvh, sp);
    return;
  }
  for (int e = tid; e < group * hd; e += kAttnThreads) {
    const int g = e / hd, d = e % hd;
    Qs[e] = a.q[int64_t(t) * a.q_s0 + int64_t(kvh * group + g) * a.q_s1 + d];
  }
  __syncthreads();
  const int32_t* table = a.block_ids + a.block_start[seq];
  float m[GMAX], l[GMAX], acc[GMAX][DPL];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[g][i] = 0.0f;
  }
  const bool vec_q = hd % 4 == 0;
  for (int c0 = p_begin + warp * 32; c0 < p_end; c0 += kAttnWarps * 32) {
    const int p = c0 + lane;
    const bool valid = p < p_end;
    const int pc = valid ? p : c0;  // invalid lanes read a valid position and discard it
    const int64_t block = table[pc / a.bs];
    const T* kcol = kc + block * a.kc_s0 + kvh * a.kc_s1 + pc % a.bs;
    const T* vrow = vc + block * a.vc_s0 + kvh * a.vc_s1 + (pc % a.bs) * a.vc_s2;
    float s[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) s[g] = 0.0f;
    int d = 0;
    if (vec_q) {
      // Deep unrolling keeps many key loads in flight: at decode one warp per split walks
      // its chunk alone, so the loads' latency, not bandwidth, sets its time.
#pragma unroll 16
      for (; d + 4 <= hd; d += 4) {
        float kv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) kv[u] = load_cache(kcol + (d + u) * a.kc_s2);
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          if (g < group) {
            const float4 q4 = *reinterpret_cast<const float4*>(Qs + g * hd + d);
            s[g] += q4.x * kv[0] + q4.y * kv[1] + q4.z * kv[2] + q4.w * kv[3];
          }
        }
      }
    }
    for (; d < hd; ++d) {
      const float kv = load_cache(kcol + d * a.kc_s2);
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (g < group) s[g] += Qs[g * hd + d] * kv;
      }
    }
    // Online softmax over this chunk, per query head (values uniform across the warp).
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < group) {
        const float sc = valid ? s[g] * a.scale : -INFINITY;
        const float m_new = fmaxf(m[g], warp_max(sc));
        const float corr = expf(m[g] - m_new);  // 0 on the first chunk
        const float e = valid ? expf(sc - m_new) : 0.0f;
        l[g] = l[g] * corr + warp_sum(e);
        m[g] = m_new;
        s[g] = e;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] *= corr;
      }
    }
    const int n_valid = min(32, p_end - c0);
    const unsigned long long vaddr = reinterpret_cast<unsigned long long>(vrow);
#pragma unroll 8
    for (int j = 0; j < n_valid; ++j) {
      const T* vj = reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, vaddr, j));
      float v[DPL];
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int dd = lane + 32 * i;
        v[i] = dd < dv ? load_cache(vj + dd) : 0.0f;
      }
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (g < group) {
          const float pg = __shfl_sync(0xffffffffu, s[g], j);
#pragma unroll
          for (int i = 0; i < DPL; ++i) acc[g][i] += pg * v[i];
        }
      }
    }
  }
  // Merge the warps' partial softmax sums.
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < group) {
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int dd = lane + 32 * i;
        if (dd < dv) part[(warp * group + g) * dv + dd] = acc[g][i];
      }
      if (lane == 0) {
        part_ml[(warp * group + g) * 2] = m[g];
        part_ml[(warp * group + g) * 2 + 1] = l[g];
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < group * dv; e += kAttnThreads) {
    const int g = e / dv, dd = e % dv;
    float mx = -INFINITY;
    for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, part_ml[(w * group + g) * 2]);
    float o = 0.0f, den = 0.0f;
    if (mx != -INFINITY) {  // an empty split has nothing to merge
      for (int w = 0; w < kAttnWarps; ++w) {
        const float mw = part_ml[(w * group + g) * 2];
        if (mw == -INFINITY) continue;
        const float f = expf(mw - mx);
        den += part_ml[(w * group + g) * 2 + 1] * f;
        o += part[(w * group + g) * dv + dd] * f;
      }
    }
    store_result(a, t, kvh * group + g, sp, dd, o, mx, den, dv);
  }
}

template <int GMAX, int DPL, typename T>
void launch_warps(const AttnArgs& a, dim3 grid, cudaStream_t stream) {
  const size_t smem = warp_attn_smem_bytes(a.group, a.hd, a.dv);
  if (a.dv == a.hd) {
    launch_kernel(paged_attention_warps_kernel<GMAX, DPL, false, T>, grid, kAttnThreads, smem,
                  stream, a);
  } else {
    launch_kernel(paged_attention_warps_kernel<GMAX, DPL, true, T>, grid, kAttnThreads, smem,
                  stream, a);
  }
}

template <int DPL, typename T>
bool launch_warps_dpl(const AttnArgs& a, dim3 grid, cudaStream_t stream) {
  if (a.group <= 1) {
    launch_warps<1, DPL, T>(a, grid, stream);
  } else if (a.group <= 2) {
    launch_warps<2, DPL, T>(a, grid, stream);
  } else if (a.group <= 4) {
    launch_warps<4, DPL, T>(a, grid, stream);
  } else if (a.group <= 8) {
    launch_warps<8, DPL, T>(a, grid, stream);
  } else if (a.group <= 16 && DPL <= 4) {
    launch_warps<16, (DPL <= 4 ? DPL : 4), T>(a, grid, stream);
  } else {
    return false;
  }
  return true;
}

// The warp kernel when its registers allow (group · ⌈dv/32⌉ ≤ 64); false otherwise.
template <typename T>
bool launch_attention_warps(const AttnArgs& a, dim3 grid, cudaStream_t stream) {
  const int dpl = (a.dv + 31) / 32;
  if (dpl <= 1) return launch_warps_dpl<1, T>(a, grid, stream);
  if (dpl <= 2) return launch_warps_dpl<2, T>(a, grid, stream);
  if (dpl <= 4) return launch_warps_dpl<4, T>(a, grid, stream);
  if (dpl <= 8) return launch_warps_dpl<8, T>(a, grid, stream);
  return false;
}

constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCombinePer = 16;  // splits per warp held at once: 128 in one round trip
constexpr int kCombineRound = kCombineWarps * kCombinePer;

// Merges the splits of each (token, head): grid (n_tokens, heads, ⌈dv/32⌉), lane = channel.
// Only the splits that hold positions of the token's context are read (a decode graph's split
// count is set by the longest context it allows). In rounds of 128 splits, every load of a
// round (the maxima, each split's statistics and values) is issued before any is used: one
// round trip to L2 per round rather than one per few splits. Warp w sums the round's splits
// w, w + 8, ..., each weighted by e^(m_s − M) against the running maximum M (the same in every
// warp); the warps' sums then add up in shared memory. The output gate, written two kernels
// back (the attention kernel before waits in every block), loads before the wait.
__global__ void __launch_bounds__(kCombineThreads) attention_combine_kernel(AttnArgs a) {
  __shared__ float red_o[kCombineWarps][32], red_den[kCombineWarps];
  const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const int d = blockIdx.z * 32 + lane;
  const bool gated = a.gate && warp == 0 && d < a.dv;
  const float gate = gated ? __ldcg(a.gate + int64_t(t) * a.g_s0 + int64_t(h) * a.dv + d) : 0.0f;
  grid_dependency_sync();
  const int n = used_splits(a, a.positions[t] + 1);
  const int64_t first = (int64_t(t) * a.heads + h) * a.n_splits;
  const float* ml = a.part_ml + first * 2;
  const float* po = a.part_o + first * a.dv + d;
  float o = 0.0f, den = 0.0f, m_run = -INFINITY;
  for (int s0 = 0; s0 < n; s0 += kCombineRound) {
    float mv[kCombineRound / 32], ms[kCombinePer], ls[kCombinePer], ov[kCombinePer];
#pragma unroll
    for (int i = 0; i < kCombineRound / 32; ++i) {
      const int sp = s0 + lane + 32 * i;
      mv[i] = sp < n ? ml[sp * 2] : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < kCombinePer; ++i) {
      const int sp = s0 + warp + kCombineWarps * i;
      ms[i] = sp < n ? ml[sp * 2] : -INFINITY;
      ls[i] = sp < n ? ml[sp * 2 + 1] : 0.0f;
      ov[i] = sp < n && d < a.dv ? po[int64_t(sp) * a.dv] : 0.0f;
    }
    float m = mv[0];
#pragma unroll
    for (int i = 1; i < kCombineRound / 32; ++i) m = fmaxf(m, mv[i]);
    const float m_new = fmaxf(m_run, warp_max(m));
    if (m_new == -INFINITY) continue;     // only empty splits so far: nothing to weigh
    const float c = expf(m_run - m_new);  // 0 on the first round with a split
    o *= c, den *= c, m_run = m_new;
#pragma unroll
    for (int i = 0; i < kCombinePer; ++i) {
      if (ms[i] == -INFINITY) continue;  // empty split (or none): its sums were never written
      const float f = expf(ms[i] - m_new);
      den += ls[i] * f;
      o += ov[i] * f;
    }
  }
  red_o[warp][lane] = o;
  if (lane == 0) red_den[warp] = den;
  __syncthreads();
  if (warp == 0) {
    float so = 0.0f, sd = 0.0f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) so += red_o[w][lane], sd += red_den[w];
    if (d < a.dv) {
      float v = so / sd;
      if (gated) v *= sigmoid(gate);
      a.out[int64_t(t) * a.o_s0 + int64_t(h) * a.o_s1 + d] = v;
    }
  }
}

template <int MAXO, int NT, typename T>
void launch_attention(const AttnArgs& a, dim3 grid, size_t smem, size_t max_smem,
                      cudaStream_t stream) {
  if (smem > (48 << 10)) {
    if (smem > max_smem) fatal("paged_attention: query group × head dim too large");
    opt_in_smem<paged_attention_kernel<MAXO, NT, T>>(max_smem);
  }
  launch_kernel(paged_attention_kernel<MAXO, NT, T>, grid, NT, smem, stream, a);
}

template <typename T>
void launch_attention_tiled(const AttnArgs& a, dim3 grid, size_t max_smem, cudaStream_t stream) {
  const size_t smem = attn_smem_bytes(a.group, a.hd, a.dv);
  const int64_t outputs = int64_t(a.group) * a.dv;
  const int64_t per_thread = (outputs + kAttnThreads - 1) / kAttnThreads;
  if (per_thread <= 1) {
    launch_attention<1, kAttnThreads, T>(a, grid, smem, max_smem, stream);
  } else if (per_thread <= 4) {
    launch_attention<4, kAttnThreads, T>(a, grid, smem, max_smem, stream);
  } else if (per_thread <= 16) {
    launch_attention<16, kAttnThreads, T>(a, grid, smem, max_smem, stream);
  } else if (per_thread <= 64) {
    launch_attention<64, kAttnThreads, T>(a, grid, smem, max_smem, stream);
  } else {
    // Up to Ops::kMaxAttentionGroupDims outputs (32 latent heads of 512 values) on 512 threads.
    constexpr int kWide = 512;
    RECUR_CHECK(outputs <= Ops::kMaxAttentionGroupDims);
    launch_attention<(Ops::kMaxAttentionGroupDims + kWide - 1) / kWide, kWide, T>(a, grid, smem,
                                                                                  max_smem, stream);
  }
}

}  // namespace

namespace cuda {

void set_context_splits(CudaOps::Impl& s, AttnArgs& a, int n, int64_t want, int max_ctx,
                        int min_split, int align) {
  const int64_t fits = int64_t(s.attn_partial.bytes() /
                               (size_t(n) * size_t(a.heads) * (size_t(a.dv) + 2) * sizeof(float)));
  a.n_splits = int(
      std::max<int64_t>(1, std::min({want, (int64_t(max_ctx) + min_split - 1) / min_split, fits})));
  a.split_align = align, a.split_min = min_split;
  if (a.n_splits > 1) {
    const size_t slots = size_t(n) * size_t(a.heads) * size_t(a.n_splits);
    float* p = static_cast<float*>(s.attn_partial.data());
    a.part_o = p;
    a.part_ml = p + slots * size_t(a.dv);
  }
}

void launch_attention_combine(CudaOps::Impl& s, const AttnArgs& a, int n_tokens) {
  launch_kernel(attention_combine_kernel,
                dim3(unsigned(n_tokens), unsigned(a.heads), unsigned((a.dv + 31) / 32)),
                kCombineThreads, 0, s.stream, a);
  s.launched("paged_attention (combine)");
}

}  // namespace cuda

void CudaOps::kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                             const SeqLayout& layout) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t kv_heads = k.shape[1], hd = k.shape[2], dv = v.shape[2];
  RECUR_CHECK(k.ndim == 3 && v.ndim == 3 && v.shape[1] == kv_heads && v.shape[0] == k.shape[0]);
  RECUR_CHECK(k_cache.shape[1] == kv_heads && k_cache.shape[2] == hd &&
              k_cache.shape[3] == layout.block_size && v_cache.shape[1] == kv_heads &&
              v_cache.shape[2] == layout.block_size && v_cache.shape[3] == dv);
  RECUR_CHECK(k.stride[2] == 1 && v.stride[2] == 1 && k_cache.stride[3] == 1);
  RECUR_CHECK(k_cache.dtype == v_cache.dtype);
  for (int s = 0; s < layout.n_seqs; ++s) {
    RECUR_CHECK(layout.seq_len(s) == 0 ||
                (layout.positions[layout.seq_start[s + 1] - 1] / layout.block_size) <
                    layout.block_start[s + 1] - layout.block_start[s]);
  }
  if (layout.n_tokens == 0) return;
  Impl& s = *impl_;
  const DevLayout dl = s.layout(layout, true);
  dispatch_cache(k_cache.dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_kernel(kv_cache_write_kernel<T>, dim3(unsigned(layout.n_tokens), unsigned(kv_heads)),
                  unsigned(std::min<int64_t>(std::max(hd, dv), 256)), 0, s.stream, k.ptr<float>(),
                  k.stride[0], k.stride[1], v.ptr<float>(), v.stride[0], v.stride[1],
                  k_cache.ptr<T>(), k_cache.stride[0], k_cache.stride[1], k_cache.stride[2],
                  v_cache.ptr<T>(), v_cache.stride[0], v_cache.stride[1], v_cache.stride[2],
                  v_cache.stride[3], int(hd), int(dv), layout.block_size, dl.seq_start,
                  layout.n_seqs, dl.positions, dl.block_start, dl.block_ids);
  });
  s.launched("kv_cache_write");
}

namespace {

// Whether a query group of these head sizes is within Ops::kMaxAttentionGroupDims.
bool group_dims_fit(int64_t group, int64_t hd, int64_t dv) {
  return group * std::max(hd, dv) <= Ops::kMaxAttentionGroupDims;
}

// paged_attention, its output times σ(gate) when gate is set (gate [n, heads·dv]).
void run_paged_attention(CudaOps::Impl& s, const Tensor& q, const Tensor& k_cache,
                         const Tensor& v_cache, const SeqLayout& layout, float scale, Tensor out,
                         const Tensor* gate) {
  const int64_t heads = q.shape[1], hd = q.shape[2], kv_heads = k_cache.shape[1];
  const int64_t dv = v_cache.shape[3];
  RECUR_CHECK(heads % kv_heads == 0 && q.stride[2] == 1 && out.stride[2] == 1);
  RECUR_CHECK(k_cache.stride[3] == 1 && k_cache.shape[2] == hd && v_cache.shape[1] == kv_heads);
  RECUR_CHECK(k_cache.dtype == v_cache.dtype);
  RECUR_CHECK(group_dims_fit(heads / kv_heads, hd, dv));
  // Values read across the key cache's channels (latent attention) take the tiled kernel.
  const bool strided_values = v_cache.stride[3] != 1;
  RECUR_CHECK(out.ndim == 3 && out.shape[0] == q.shape[0] && out.shape[1] == heads &&
              out.shape[2] == dv);
  const int n = layout.n_tokens;
  if (n == 0) return;
  const int group = int(heads / kv_heads);
  // The longest context: the reserved limit when given (the split count then depends on the
  // batch's shape alone, as a decode graph needs), else this batch's.
  int max_ctx = s.limits.max_context;
  if (max_ctx <= 0) {
    for (int t = 0; t < n; ++t) max_ctx = std::max(max_ctx, layout.positions[t] + 1);
  }
  // Few tokens (decode) take the decode kernel where its shape allows: its blocks each hold hd
  // threads with a whole chunk's loads in flight, so 4 blocks per SM suffice; the warp kernel
  // walks its chunks one dependent step at a time and wants 16. Splits go no further than one
  // chunk of 32 (decode) or one per warp (warp kernel) and the buffer of partial results.
  const bool decode =
      !strided_values && n <= kDecodeMaxTokens && decode_kernel_fits(group, int(hd), int(dv));
  const DevLayout dl = s.layout(layout, true);
  AttnArgs a{};
  a.q = q.ptr<float>(), a.q_s0 = q.stride[0], a.q_s1 = q.stride[1];
  a.kc = k_cache.data;
  a.kc_s0 = k_cache.stride[0], a.kc_s1 = k_cache.stride[1], a.kc_s2 = k_cache.stride[2];
  a.vc = v_cache.data;
  a.vc_s0 = v_cache.stride[0], a.vc_s1 = v_cache.stride[1], a.vc_s2 = v_cache.stride[2];
  a.vc_sd = v_cache.stride[3];
  a.out = out.ptr<float>(), a.o_s0 = out.stride[0], a.o_s1 = out.stride[1];
  a.seq_start = dl.seq_start, a.positions = dl.positions;
  a.block_start = dl.block_start, a.block_ids = dl.block_ids;
  a.n_seqs = layout.n_seqs, a.heads = int(heads), a.group = group, a.hd = int(hd);
  a.dv = int(dv), a.bs = layout.block_size, a.scale = scale;
  if (gate) {
    RECUR_CHECK(gate->ndim == 2 && gate->shape[0] == n && gate->shape[1] == heads * dv &&
                gate->stride[1] == 1 && gate->dtype == DType::F32);
    a.gate = gate->ptr<float>(), a.g_s0 = gate->stride[0];
  }
  if (strided_values &&
      latent_attention_mma(s, a, k_cache, v_cache, layout, int(kv_heads), max_ctx)) {
    return;
  }
  if (!decode && paged_attention_mma(s, a, k_cache, v_cache, layout, int(kv_heads))) return;
  if (decode && attention_decode_mma(s, a, k_cache, v_cache, layout, int(kv_heads), max_ctx)) {
    return;
  }
  const int64_t base_blocks = int64_t(n) * kv_heads;
  const int64_t per_sm = decode ? 4 : 16;
  // The decode kernel's splits are whole chunks of 32 positions.
  set_context_splits(s, a, n, (per_sm * s.sm_count + base_blocks - 1) / base_blocks, max_ctx,
                     decode ? 32 : kMinSplitPositions, decode ? 32 : 1);
  const int n_splits = a.n_splits;
  const dim3 grid{unsigned(n), unsigned(kv_heads), unsigned(n_splits)};
  if (s.options.profile) {  // each (token, kv head) reads its context once
    double ctx = 0;
    for (int t = 0; t < n; ++t) ctx += layout.positions[t] + 1;
    s.work(attention_flops(layout, heads, hd, dv),
           ctx * double(kv_heads) * double(hd + dv) * double(dtype_size(k_cache.dtype)));
  }
  if (decode) {
    launch_attention_decode(a, k_cache.dtype, grid, s.stream);
    s.launched("paged_attention (decode)");
  } else {
    dispatch_cache(k_cache.dtype, [&](auto tag) {
      using T = decltype(tag);
      if (!strided_values && launch_attention_warps<T>(a, grid, s.stream)) {
        s.launched("paged_attention");
      } else {
        launch_attention_tiled<T>(a, grid, s.max_smem_optin, s.stream);
        s.launched("paged_attention (tiled)");
      }
    });
  }
  if (n_splits > 1) launch_attention_combine(s, a, n);
}

}  // namespace

void CudaOps::paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const SeqLayout& layout, float scale, Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  run_paged_attention(*impl_, q, k_cache, v_cache, layout, scale, out, nullptr);
}

void CudaOps::paged_attention_gated(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                    const SeqLayout& layout, float scale, const Tensor& gate,
                                    Tensor out) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  const int64_t n = q.shape[0], heads = q.shape[1], dv = v_cache.shape[3];
  RECUR_CHECK(out.ndim == 2 && out.shape[1] == heads * dv && out.stride[1] == 1);
  run_paged_attention(*impl_, q, k_cache, v_cache, layout, scale, out.reshaped({n, heads, dv}),
                      &gate);
}

}  // namespace recur
