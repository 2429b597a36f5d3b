// The decode kernel of attention over the paged cache (layouts and the other kernels in
// kernels_attention.cu), for forwards of few tokens whose head sizes are multiples of 32.
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/cuda_internal.cuh"

namespace recur {
namespace cuda {

namespace {

// One thread per channel (of the wider head).
constexpr int kDecodeMaxHd = 512;

// Decode kernel for few tokens (hd and dv multiples of 32, ≤ kDecodeMaxHd): a block of
// max(hd, dv) threads per (token, kv head, context split), warp w owning key channels
// [32w, 32w + 32) and thread i value channel i. Per chunk of 32 positions each lane issues its
// 32 key loads (lane = position, the warp's channels) and 32 value loads (lane = channel, the
// chunk's positions) before using any, so a chunk costs about one memory round trip; the warps'
// partial scores add up in shared memory, one warp per query head runs the online softmax, and
// every thread then accumulates its own channel of the values. kSplitDims: dv ≠ hd, so some
// warps hold no key channels or some threads no value channel (hd = dv compiles without the
// checks). Shared memory: Qs [group][hd], S [hd/32][group][32], P [group][32], corr [group],
// ml [group][2]. T: the cache's element type, widened to f32 as it is loaded.
template <int GMAX, bool kSplitDims, typename T>
__global__ void __launch_bounds__(kDecodeMaxHd) paged_attention_decode_kernel(AttnArgs a) {
  extern __shared__ float sm[];
  const T* kc = static_cast<const T*>(a.kc);
  const T* vc = static_cast<const T*>(a.vc);
  const int group = a.group, hd = a.hd, nw = hd / 32;
  const int n_threads = kSplitDims ? int(blockDim.x) : hd, n_warps = n_threads / 32;
  float* Qs = sm;
  float* S = Qs + group * hd;
  float* P = S + nw * group * 32;
  float* corr = P + group * 32;
  float* ml = corr + group;
  const int t = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z, tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const bool key_warp = !kSplitDims || warp < nw;       // owns key channels
  const bool value_thread = !kSplitDims || tid < a.dv;  // owns a value channel
  const int seq = seq_of_token(a.seq_start, a.n_seqs, t);
  const int n_ctx = a.positions[t] + 1;
  const int span = split_span(a, n_ctx);  // whole chunks of 32 (split_align)
  const int p_begin = sp * span, p_end = min(n_ctx, p_begin + span);
  const int32_t* table = a.block_ids + a.block_start[seq];
  // One chunk's keys (lane = position, the warp's 32 channels) and values (lane = channel,
  // the chunk's positions); positions past the split repeat position c0 (weight 0 later).
  float kv[32], vv[32];
  auto load_chunk = [&](int c0, bool l2) {
    const int p = c0 + lane;
    const int pc = p < p_end ? p : c0;  // invalid lanes read a valid position and discard it
    const int64_t block = table[pc / a.bs];
    const T* kcol = kc + block * a.kc_s0 + kvh * a.kc_s1 + int64_t(warp * 32) * a.kc_s2 + pc % a.bs;
    const T* vrow = vc + block * a.vc_s0 + kvh * a.vc_s1 + (pc % a.bs) * a.vc_s2;
    const unsigned long long vaddr = reinterpret_cast<unsigned long long>(vrow);
    if (key_warp) {
#pragma unroll
      for (int i = 0; i < 32; ++i) kv[i] = load_cache(kcol + i * a.kc_s2, l2);
    }
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int src = c0 + j < p_end ? j : 0;
      const T* vp = reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, vaddr, src)) + tid;
      if (value_thread) vv[j] = load_cache(vp, l2);
    }
  };
  // Positions before the sequence's first token of this forward (its positions ascend) were
  // written by earlier forwards, so a first chunk that holds only those is loaded, through L2,
  // before waiting for the kernel before (which writes the new positions); the batch mirror it
  // reads is uploaded before the forward's kernels. Only for the widest groups: for smaller
  // ones the chunk's 64 registers held across the wait made the kernel spill.
  const int first_new = a.positions[a.seq_start[seq]];
  const bool preloaded = GMAX >= 8 && p_begin < n_ctx && min(p_end, p_begin + 32) <= first_new;
  if (preloaded) {
    load_chunk(p_begin, true);
  } else if (p_begin < n_ctx) {
    // Else ask L2 for the first chunk's key rows (thread = channel; positions c0 and c0 + 16
    // cover blocks of ≥ 16) and value rows (dv/32 lines per position): a hint, so it cannot
    // read anything stale.
    if (!kSplitDims || tid < hd) {
      for (int q = 0; q < 32; q += 16) {
        const int p = min(p_begin + q, p_end - 1);
        const T* k = kc + int64_t(table[p / a.bs]) * a.kc_s0 + kvh * a.kc_s1 +
                     int64_t(tid) * a.kc_s2 + p % a.bs;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(k));
      }
    }
    if (value_thread) {
      // A row of 32 elements per line of 128 bytes at most (f32; narrower types fit more).
      const int lines = (kSplitDims ? a.dv : hd) / 32, p = min(p_begin + tid / lines, p_end - 1);
      const T* v = vc + int64_t(table[p / a.bs]) * a.vc_s0 + kvh * a.vc_s1 +
                   int64_t(p % a.bs) * a.vc_s2 + (tid % lines) * 32;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(v));
    }
  }
  grid_dependency_sync();
  if (p_begin >= n_ctx) {
    mark_empty_split(a, t, kvh, sp);
    return;
  }
  for (int e = tid; e < group * hd; e += n_threads) {
    const int g = e / hd, d = e % hd;
    Qs[e] = a.q[int64_t(t) * a.q_s0 + int64_t(kvh * group + g) * a.q_s1 + d];
  }
  if (tid < group) ml[tid * 2] = -INFINITY, ml[tid * 2 + 1] = 0.0f;
  float acc[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) acc[g] = 0.0f;
  for (int c0 = p_begin; c0 < p_end; c0 += 32) {
    const bool valid = c0 + lane < p_end;
    if (c0 != p_begin || !preloaded) load_chunk(c0, false);
    __syncthreads();  // Qs and ml written (first chunk); the last chunk's P and corr read
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < group && key_warp) {
        const float* qg = Qs + g * hd + warp * 32;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i += 4) {
          const float4 q4 = *reinterpret_cast<const float4*>(qg + i);
          s += q4.x * kv[i] + q4.y * kv[i + 1] + q4.z * kv[i + 2] + q4.w * kv[i + 3];
        }
        S[(warp * group + g) * 32 + lane] = s;
      }
    }
    __syncthreads();
    for (int g = warp; g < group; g += n_warps) {
      float s = 0.0f;
      for (int w = 0; w < nw; ++w) s += S[(w * group + g) * 32 + lane];
      const float sc = valid ? s * a.scale : -INFINITY;
      const float m_old = ml[g * 2];
      const float m_new = fmaxf(m_old, warp_max(sc));
      const float c = expf(m_old - m_new);  // 0 on the first chunk
      const float e = valid ? expf(sc - m_new) : 0.0f;
      const float sum = warp_sum(e);
      P[g * 32 + lane] = e;
      __syncwarp();
      if (lane == 0) {
        corr[g] = c;
        ml[g * 2] = m_new;
        ml[g * 2 + 1] = ml[g * 2 + 1] * c + sum;
      }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (g < group) {
        float o = acc[g] * corr[g];
#pragma unroll
        for (int j = 0; j < 32; j += 4) {
          const float4 p4 = *reinterpret_cast<const float4*>(P + g * 32 + j);
          o += p4.x * vv[j] + p4.y * vv[j + 1] + p4.z * vv[j + 2] + p4.w * vv[j + 3];
        }
        acc[g] = o;
      }
    }
  }
  __syncthreads();
  if (!value_thread) return;
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < group) {
      store_result(a, t, kvh * group + g, sp, tid, acc[g], ml[g * 2], ml[g * 2 + 1],
                   kSplitDims ? a.dv : hd);
    }
  }
}

size_t decode_attn_smem_bytes(int group, int hd) {
  return sizeof(float) * (size_t(group) * hd + size_t(hd / 32) * group * 32 + 33 * size_t(group) +
                          2 * size_t(group));
}

}  // namespace

// Whether the decode kernel takes heads of these sizes (groups of up to 16 query heads a kv
// head; larger ones take the prompt kernels, which hold no context split for one token).
bool decode_kernel_fits(int group, int hd, int dv) {
  return hd % 32 == 0 && dv % 32 == 0 && hd <= kDecodeMaxHd && dv <= kDecodeMaxHd && group <= 16 &&
         decode_attn_smem_bytes(group, hd) <= (48 << 10);
}

template <bool kSplitDims, typename T>
void launch_decode(const AttnArgs& a, dim3 grid, cudaStream_t stream) {
  const size_t smem = decode_attn_smem_bytes(a.group, a.hd);
  const unsigned threads = unsigned(std::max(a.hd, a.dv));
  auto launch = [&](auto kernel) { launch_kernel(kernel, grid, threads, smem, stream, a); };
  if (a.group <= 1) {
    launch(paged_attention_decode_kernel<1, kSplitDims, T>);
  } else if (a.group <= 2) {
    launch(paged_attention_decode_kernel<2, kSplitDims, T>);
  } else if (a.group <= 4) {
    launch(paged_attention_decode_kernel<4, kSplitDims, T>);
  } else if (a.group <= 8) {
    launch(paged_attention_decode_kernel<8, kSplitDims, T>);
  } else {  // Qwen3.5-122B-A10B: 32 query heads over 2 kv heads
    launch(paged_attention_decode_kernel<16, kSplitDims, T>);
  }
}

void launch_attention_decode(const AttnArgs& a, DType cache, dim3 grid, cudaStream_t stream) {
  dispatch_cache(cache, [&](auto tag) {
    using T = decltype(tag);
    if (a.dv == a.hd) {
      launch_decode<false, T>(a, grid, stream);
    } else {
      launch_decode<true, T>(a, grid, stream);
    }
  });
}

}  // namespace cuda
}  // namespace recur
