// Gated DeltaNet and Kimi Delta Attention on the CPU: the causal depthwise conv with its rolling
// state, and the gated delta rule (decay per head or per key channel) in its recurrent form
// (decode) and its chunked WY form (prompts).
#include <algorithm>
#include <cfloat>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/vector_math.h"

namespace recur {

using namespace cpu;

namespace {

// Channels [c0, c0 + 16) (masked) of one sequence: a window of the last K-1 inputs slides over
// its tokens; wt[j] holds tap j of the 16 channels.
template <int K>
void conv_channels(const float* x, int64_t x_stride, float* out, int64_t out_stride, float* state,
                   int64_t C, int64_t c0, int64_t len, const float (*wt)[16]) {
#if defined(__AVX512F__)
  const __mmask16 m = tail_mask(C - c0);
  __m512 w[K], win[K];  // win[K-1] is the incoming token
  for (int j = 0; j < K; ++j) w[j] = _mm512_loadu_ps(wt[j]);
  for (int j = 0; j < K - 1; ++j) win[j] = _mm512_maskz_loadu_ps(m, state + j * C + c0);
  for (int64_t i = 0; i < len; ++i) {
    win[K - 1] = _mm512_maskz_loadu_ps(m, x + i * x_stride + c0);
    __m512 acc = _mm512_mul_ps(w[0], win[0]);
    for (int j = 1; j < K; ++j) acc = _mm512_fmadd_ps(w[j], win[j], acc);
    _mm512_mask_storeu_ps(out + i * out_stride + c0, m, silu16(acc));
    for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
  }
  for (int j = 0; j < K - 1; ++j) _mm512_mask_storeu_ps(state + j * C + c0, m, win[j]);
#else
  const int64_t nc = std::min<int64_t>(16, C - c0);
  float win[K][16];
  for (int j = 0; j < K - 1; ++j)
    for (int64_t c = 0; c < nc; ++c) win[j][c] = state[j * C + c0 + c];
  for (int64_t i = 0; i < len; ++i) {
    for (int64_t c = 0; c < nc; ++c) win[K - 1][c] = x[i * x_stride + c0 + c];
    for (int64_t c = 0; c < nc; ++c) {
      float acc = wt[0][c] * win[0][c];
      for (int j = 1; j < K; ++j) acc += wt[j][c] * win[j][c];
      out[i * out_stride + c0 + c] = silu(acc);
    }
    for (int j = 0; j < K - 1; ++j)
      for (int64_t c = 0; c < nc; ++c) win[j][c] = win[j + 1][c];
  }
  for (int j = 0; j < K - 1; ++j)
    for (int64_t c = 0; c < nc; ++c) state[j * C + c0 + c] = win[j][c];
#endif
}

// Channels [c_begin, c_end) of every sequence, in blocks of up to kConvBlock channels whose
// transposed taps stay on the stack; within a block, sequence by sequence, asking for the next
// sequence's state (cold after a whole step) while this one runs.
constexpr int64_t kConvBlock = 1024;

template <int K>
void conv_all(const Tensor& x, const Tensor& weight, Tensor conv_state, const SeqLayout& layout,
              Tensor out, int64_t c_begin, int64_t c_end) {
  const int64_t C = x.shape[1];
  alignas(64) float wt[kConvBlock / 16][K][16];
  for (int64_t b0 = c_begin; b0 < c_end; b0 += kConvBlock) {
    const int64_t b1 = std::min(c_end, b0 + kConvBlock);
    for (int64_t c0 = b0; c0 < b1; c0 += 16) {
      for (int j = 0; j < K; ++j) {
        for (int64_t c = 0; c < 16; ++c) {
          wt[(c0 - b0) / 16][j][c] = c0 + c < C ? weight_at(weight, (c0 + c) * K + j) : 0.0f;
        }
      }
    }
    for (int s = 0; s < layout.n_seqs; ++s) {
      if (s + 1 < layout.n_seqs) {
        const float* next = conv_state.ptr<float>() + int64_t(layout.slot[s + 1]) * (K - 1) * C;
        for (int64_t r = 0; r < K - 1; ++r) {
          for (int64_t c = b0; c < b1; c += 16) prefetch_line(next + r * C + c);
        }
      }
      const int64_t base = layout.seq_start[s];
      float* state = conv_state.ptr<float>() + int64_t(layout.slot[s]) * (K - 1) * C;
      for (int64_t c0 = b0; c0 < b1; c0 += 16) {
        conv_channels<K>(x.row<float>(base), x.stride[0], out.row<float>(base), out.stride[0],
                         state, C, c0, layout.seq_len(s), wt[(c0 - b0) / 16]);
      }
    }
  }
}

// conv_all<K> for the runtime kernel size k in [K, 16].
template <int K>
void conv_dispatch(int64_t k, const Tensor& x, const Tensor& weight, Tensor conv_state,
                   const SeqLayout& layout, Tensor out, int64_t c0, int64_t c1) {
  if constexpr (K <= 16) {
    if (k == K) return conv_all<K>(x, weight, conv_state, layout, out, c0, c1);
    conv_dispatch<K + 1>(k, x, weight, conv_state, layout, out, c0, c1);
  }
}

}  // namespace

void CpuOps::conv1d_causal_silu(const Tensor& x, const Tensor& weight, Tensor conv_state,
                                const SeqLayout& layout, Tensor out) {
  const int64_t C = x.shape[1];
  const int64_t K = weight.shape[1];
  RECUR_CHECK(weight.ndim == 2 && weight.shape[0] == C && conv_state.shape[1] == K - 1 &&
              conv_state.shape[2] == C);
  RECUR_CHECK(K >= 1 && K <= 16 && weight.is_contiguous() && x.stride[1] == 1 &&
              out.stride[1] == 1);
  // Threads split the channels in multiples of 16, each sweeping every sequence.
  const int64_t vectors = (C + 15) / 16;
  const int64_t min_vectors = std::max<int64_t>(1, 4096 / std::max(1, layout.n_tokens));
  pool_.parallel_for(vectors, min_vectors, [&](int64_t v0, int64_t v1) {
    const int64_t c0 = v0 * 16, c1 = std::min(C, v1 * 16);
    conv_dispatch<1>(K, x, weight, conv_state, layout, out, c0, c1);
  });
}

namespace {

constexpr int kChunk = 64;
constexpr int64_t kMaxKeyDim = CpuOps::kMaxKeyDim;

// How the key rows of a head's state decay: all alike (g [n, Hv]: Gated DeltaNet) or each by
// its own channel's decay (g [n, Hv, dk]: Kimi Delta Attention). The kernels are templates on
// it, so the per-head loops stay as they were.
enum class Decay { kPerHead, kPerKey };

struct DeltaRuleArgs {
  const Tensor *q, *k;  // [n, Hk, dk], L2-normalized, q scaled
  const Tensor* v;      // [n, Hv, dv]
  const Tensor* g;      // [n, Hv] (Decay::kPerHead) or [n, Hv, dk] (kPerKey): log-decays
  const Tensor* beta;   // [n, Hv]
  float* state;         // [Hv, dk, dv] of this sequence's slot
  Tensor out;           // [n, Hv, dv]
  int64_t base, len;    // token range of the sequence
  int64_t head, key_head, dk, dv;
};

// g[t, head, 0..dk): the log-decays of the head's key channels at token t (per-key g only).
inline const float* key_log_decays(const DeltaRuleArgs& a, int64_t t) {
  return a.g->ptr<float>() + t * a.g->stride[0] + a.head * a.g->stride[1];
}

// dec[0..dk) = exp(g[t, head, 0..dk)): the decay of each key row of the state at token t.
inline void key_decays(const DeltaRuleArgs& a, int64_t t, float* dec) {
  std::copy_n(key_log_decays(a, t), a.dk, dec);
  exp_inplace(dec, a.dk);
}

// One value head of one sequence, token by token: the definition of the rule.
#if defined(__AVX512F__)
// Columns [j0, j0 + 16) of the head's state S [dk, dv] over the sequence's tokens: column
// strips are independent (Sᵀk, the delta and Sᵀq of a column involve only that column). With
// DK > 0 the strip stays in registers across tokens; DK == 0 (any dk) makes two passes over
// memory per token, recomputing the decayed row in the second.
template <int DK, Decay D>
void delta_strip(const DeltaRuleArgs& a, float* S, int64_t j0) {
  const int64_t dk = DK > 0 ? DK : a.dk, dv = a.dv;
  const __mmask16 m = tail_mask(dv - j0);
  [[maybe_unused]] __m512 s[DK > 0 ? DK : 1];
  [[maybe_unused]] alignas(64) float dec[D == Decay::kPerKey ? (DK > 0 ? DK : kMaxKeyDim) : 1];
  if constexpr (DK > 0) {
    for (int i = 0; i < DK; ++i) s[i] = _mm512_maskz_loadu_ps(m, S + i * dv + j0);
  }
  for (int64_t t = a.base; t < a.base + a.len; ++t) {
    const float* q = a.q->ptr<float>() + t * a.q->stride[0] + a.key_head * a.q->stride[1];
    const float* k = a.k->ptr<float>() + t * a.k->stride[0] + a.key_head * a.k->stride[1];
    const float* v = a.v->ptr<float>() + t * a.v->stride[0] + a.head * a.v->stride[1];
    float* o = a.out.ptr<float>() + t * a.out.stride[0] + a.head * a.out.stride[1];
    const __m512 decay = D == Decay::kPerHead ? _mm512_set1_ps(std::exp(a.g->row<float>(t)[a.head]))
                                              : _mm512_setzero_ps();
    if constexpr (D == Decay::kPerKey) key_decays(a, t, dec);
    // The decay of key row i: the head's, or row i's own.
    auto decay_of = [&](int64_t i) {
      if constexpr (D == Decay::kPerHead) {
        return decay;
      } else {
        return _mm512_set1_ps(dec[i]);
      }
    };
    const __m512 beta = _mm512_set1_ps(a.beta->row<float>(t)[a.head]);
    // Two chains each for Sᵀk and Sᵀq (even and odd rows) keep the FMAs overlapped.
    __m512 kv0 = _mm512_setzero_ps(), kv1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {
      __m512 si;
      if constexpr (DK > 0) {
        si = s[i] = _mm512_mul_ps(s[i], decay_of(i));
      } else {
        si = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, S + i * dv + j0), decay_of(i));
      }
      if (i % 2 == 0) {
        kv0 = _mm512_fmadd_ps(si, _mm512_set1_ps(k[i]), kv0);
      } else {
        kv1 = _mm512_fmadd_ps(si, _mm512_set1_ps(k[i]), kv1);
      }
    }
    const __m512 delta = _mm512_mul_ps(
        _mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + j0), _mm512_add_ps(kv0, kv1)), beta);
    __m512 o0 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {
      __m512 si;
      if constexpr (DK > 0) {
        si = s[i] = _mm512_fmadd_ps(_mm512_set1_ps(k[i]), delta, s[i]);
      } else {
        si = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, S + i * dv + j0), decay_of(i));
        si = _mm512_fmadd_ps(_mm512_set1_ps(k[i]), delta, si);
        _mm512_mask_storeu_ps(S + i * dv + j0, m, si);
      }
      if (i % 2 == 0) {
        o0 = _mm512_fmadd_ps(si, _mm512_set1_ps(q[i]), o0);
      } else {
        o1 = _mm512_fmadd_ps(si, _mm512_set1_ps(q[i]), o1);
      }
    }
    _mm512_mask_storeu_ps(o + j0, m, _mm512_add_ps(o0, o1));
  }
  if constexpr (DK > 0) {
    for (int i = 0; i < DK; ++i) _mm512_mask_storeu_ps(S + i * dv + j0, m, s[i]);
  }
}
#endif

template <Decay D>
void delta_rule_recurrent(const DeltaRuleArgs& a) {
  float* S = a.state + a.head * a.dk * a.dv;  // [dk, dv]
#if defined(__AVX512F__)
  for (int64_t j0 = 0; j0 < a.dv; j0 += 16) {
    switch (a.dk) {
      case 16:
        delta_strip<16, D>(a, S, j0);
        break;
      case 32:
        delta_strip<32, D>(a, S, j0);
        break;
      default:
        delta_strip<0, D>(a, S, j0);
        break;
    }
  }
#else
  float kv_mem[CpuOps::kMaxValueDim];
  [[maybe_unused]] float dec[D == Decay::kPerKey ? kMaxKeyDim : 1];
  for (int64_t t = a.base; t < a.base + a.len; ++t) {
    const float* q = a.q->ptr<float>() + t * a.q->stride[0] + a.key_head * a.q->stride[1];
    const float* k = a.k->ptr<float>() + t * a.k->stride[0] + a.key_head * a.k->stride[1];
    const float* v = a.v->ptr<float>() + t * a.v->stride[0] + a.head * a.v->stride[1];
    const float decay = D == Decay::kPerHead ? std::exp(a.g->row<float>(t)[a.head]) : 0.0f;
    if constexpr (D == Decay::kPerKey) key_decays(a, t, dec);
    const float beta = a.beta->row<float>(t)[a.head];
    float* o = a.out.ptr<float>() + t * a.out.stride[0] + a.head * a.out.stride[1];
    std::fill(kv_mem, kv_mem + a.dv, 0.0f);
    for (int64_t i = 0; i < a.dk; ++i) {
      float* Si = S + i * a.dv;
      const float ki = k[i];
      float di;
      if constexpr (D == Decay::kPerHead) {
        di = decay;
      } else {
        di = dec[i];
      }
      for (int64_t j = 0; j < a.dv; ++j) {
        Si[j] *= di;
        kv_mem[j] += Si[j] * ki;
      }
    }
    for (int64_t j = 0; j < a.dv; ++j) kv_mem[j] = (v[j] - kv_mem[j]) * beta;  // delta
    std::fill(o, o + a.dv, 0.0f);
    for (int64_t i = 0; i < a.dk; ++i) {
      float* Si = S + i * a.dv;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < a.dv; ++j) {
        Si[j] += ki * kv_mem[j];
        o[j] += Si[j] * qi;
      }
    }
  }
#endif
}

// One chunk of one head (C = kChunk tokens, L ≤ C of them real; rows past L unused).
struct ChunkScratch {
  float* G;       // [C] cumulative log-decay (per head)
  float *Q, *K;   // [C, dk] the chunk's queries and keys (per key: decayed since its start)
  float* V;       // [C, dv]
  float *A, *QK;  // [C, C] β_i-weighted decayed k_i·k_j (j < i); decayed q_i·k_j (j ≤ i)
  float* Wk;      // [C, dk] T(β e^G K): the keys' part of the WY form
  float* U;       // [C, dv] T(β V)
  float* Vnew;    // [C, dv] U minus the state's prediction
  float* E;       // [C, dk] per key: the per-token decay factors exp(g)
  float* Kr;      // [C, dk] per key: keys decayed to the chunk's end
  float* P;       // [dk] per key: the chunk's total decay
  float* W;       // [dk] per key: one running product
  double* T;      // [C, C] (I + A)^-1, lower triangular
  static size_t floats(int64_t dk, int64_t dv) {
    const int64_t C = kChunk;
    return size_t(C + 2 * C * dk + C * dv + 2 * C * C + 2 * C * C + C * dk + 2 * C * dv + 64) +
           size_t(2 * C * dk + 2 * dk);
  }
  ChunkScratch(float* p, int64_t dk, int64_t dv) {
    const int64_t C = kChunk;
    T = reinterpret_cast<double*>(p);  // first, so it stays 8-byte aligned
    p += 2 * C * C;
    G = p, p += C;
    Q = p, p += C * dk;
    K = p, p += C * dk;
    V = p, p += C * dv;
    A = p, p += C * C;
    QK = p, p += C * C;
    Wk = p, p += C * dk;
    U = p, p += C * dv;
    Vnew = p, p += C * dv;
    E = p, p += C * dk;
    Kr = p, p += C * dk;
    P = p, p += dk;
    W = p;
  }
};

// Per-key decay, the causal products of a chunk from its raw q, k and the per-token decays
// E[s] = exp(g_s) ≤ 1 (per channel):
//   A[i][j] = β_i Σ_c k_i[c] k_j[c] Π_{j<s≤i} E_s[c]  (j < i),  QK[i][j] likewise with q_i (j ≤ i).
// The decay from token j to token i is a running product of per-token factors, never the exp
// of a difference of cumulative sums nor of a positive number: strong decays underflow to
// zero, and products below FLT_MIN are flushed to zero there rather than dragged on as
// subnormals (slow, and far below anything they are added to).
void per_key_causal_products(const ChunkScratch& s, int64_t L, int64_t dk, const float* beta) {
  for (int64_t j = 0; j < L; ++j) {
    const float* kj = s.K + j * dk;
    s.QK[j * kChunk + j] = dot_f32(s.Q + j * dk, kj, dk);
    float* w = s.W;  // k_j decayed from token j to token i
    std::copy_n(kj, dk, w);
    for (int64_t i = j + 1; i < L; ++i) {
      const float* e = s.E + i * dk;
      const float* ki = s.K + i * dk;
      const float* qi = s.Q + i * dk;
      float ak = 0.0f, aq = 0.0f;
#pragma omp simd reduction(+ : ak, aq)
      for (int64_t c = 0; c < dk; ++c) {
        float x = w[c] * e[c];
        x = std::fabs(x) < FLT_MIN ? 0.0f : x;
        w[c] = x;
        ak += ki[c] * x;
        aq += qi[c] * x;
      }
      s.A[i * kChunk + j] = beta[i] * ak;
      s.QK[i * kChunk + j] = aq;
    }
  }
}

// Per-key decay, the decayed keys and queries of a chunk, in place of the raw ones once the
// causal products are formed: Kr_j = k_j ∘ Π_{s>j} E_s (k_j's decay to the chunk's end), then
// q_i, k_i ∘= Π_{s≤i} E_s (the decay since the chunk's start), and P = Π_s E_s (the chunk's).
void per_key_scale(const ChunkScratch& s, int64_t L, int64_t dk) {
  float* r = s.P;
  std::fill(r, r + dk, 1.0f);
  for (int64_t j = L - 1; j >= 0; --j) {
    const float* kj = s.K + j * dk;
    const float* e = s.E + j * dk;
    float* kr = s.Kr + j * dk;
#pragma omp simd
    for (int64_t c = 0; c < dk; ++c) {
      kr[c] = kj[c] * r[c];
      r[c] *= e[c];
    }
  }
  float* p = s.W;
  std::fill(p, p + dk, 1.0f);
  for (int64_t i = 0; i < L; ++i) {
    const float* e = s.E + i * dk;
    float* qi = s.Q + i * dk;
    float* ki = s.K + i * dk;
#pragma omp simd
    for (int64_t c = 0; c < dk; ++c) {
      p[c] *= e[c];
      qi[c] *= p[c];
      ki[c] *= p[c];
    }
  }
}

// One value head of one sequence in chunks of kChunk tokens. Within a chunk (G = cumulative
// log-decay, S0 = state before it), the rule's updates u satisfy (I + A) u = βv − βe^G K S0
// with A[i][j] = β_i e^(G_i − G_j) k_i·k_j (j < i). T = (I + A)^-1 (the UT transform) gives
// u = T(βv) − T(βe^G K) S0, after which outputs and the next state are matrix products.
// With per-key decay every e^G acts channel by channel (diag(e^G_i) between k_i and k_j); see
// per_key_causal_products and per_key_scale.
template <Decay D>
void delta_rule_chunked(const DeltaRuleArgs& a, float* scratch) {
  const int64_t dk = a.dk, dv = a.dv;
  ChunkScratch s(scratch, dk, dv);
  float* S = a.state + a.head * dk * dv;  // [dk, dv]
  for (int64_t c0 = 0; c0 < a.len; c0 += kChunk) {
    const int64_t L = std::min<int64_t>(kChunk, a.len - c0);
    float beta[kChunk];
    float cum = 0.0f;
    for (int64_t i = 0; i < L; ++i) {
      const int64_t t = a.base + c0 + i;
      std::copy_n(a.q->ptr<float>() + t * a.q->stride[0] + a.key_head * a.q->stride[1], dk,
                  s.Q + i * dk);
      std::copy_n(a.k->ptr<float>() + t * a.k->stride[0] + a.key_head * a.k->stride[1], dk,
                  s.K + i * dk);
      std::copy_n(a.v->ptr<float>() + t * a.v->stride[0] + a.head * a.v->stride[1], dv,
                  s.V + i * dv);
      if constexpr (D == Decay::kPerHead) {
        cum += a.g->row<float>(t)[a.head];
        s.G[i] = cum;
      } else {
        std::copy_n(key_log_decays(a, t), dk, s.E + i * dk);
      }
      beta[i] = a.beta->row<float>(t)[a.head];
    }
    if constexpr (D == Decay::kPerHead) {
      // A (strictly lower) and the causal q·k products with their decays.
      for (int64_t i = 0; i < L; ++i) {
        for (int64_t j = 0; j <= i; ++j) {
          const float decay = std::exp(s.G[i] - s.G[j]);
          if (j < i)
            s.A[i * kChunk + j] = beta[i] * decay * dot_f32(s.K + i * dk, s.K + j * dk, dk);
          s.QK[i * kChunk + j] = decay * dot_f32(s.Q + i * dk, s.K + j * dk, dk);
        }
      }
    } else {
      exp_inplace(s.E, L * dk);
      per_key_causal_products(s, L, dk, beta);
    }
    // T = (I + A)^-1 by forward substitution, in double: the solve amplifies rounding when
    // many keys of a chunk are nearly parallel (small key heads).
    for (int64_t i = 0; i < L; ++i) {
      double* Ti = s.T + i * kChunk;
      for (int64_t j = 0; j < i; ++j) {
        double acc = 0.0;
        for (int64_t m = j; m < i; ++m) acc += double(s.A[i * kChunk + m]) * s.T[m * kChunk + j];
        Ti[j] = -acc;
      }
      Ti[i] = 1.0;
    }
    if constexpr (D == Decay::kPerKey) per_key_scale(s, L, dk);
    // Wk = T (β e^G K) [L, dk];  U = T (β V) [L, dv]  (per key, K already holds e^G ∘ k)
    for (int64_t i = 0; i < L; ++i) {
      float* wk = s.Wk + i * dk;
      float* u = s.U + i * dv;
      std::fill(wk, wk + dk, 0.0f);
      std::fill(u, u + dv, 0.0f);
      for (int64_t j = 0; j <= i; ++j) {
        const float tij = float(s.T[i * kChunk + j]) * beta[j];
        const float tk = D == Decay::kPerHead ? tij * std::exp(s.G[j]) : tij;
        const float* kj = s.K + j * dk;
        const float* vj = s.V + j * dv;
#pragma omp simd
        for (int64_t m = 0; m < dk; ++m) wk[m] += tk * kj[m];
#pragma omp simd
        for (int64_t m = 0; m < dv; ++m) u[m] += tij * vj[m];
      }
    }
    // Vnew = U − Wk S0; out_i = e^(G_i) q_i S0 + Σ_j≤i QK[i][j] Vnew_j  (per key, Q already
    // holds e^G ∘ q)
    for (int64_t i = 0; i < L; ++i) {
      float* vn = s.Vnew + i * dv;
      std::copy_n(s.U + i * dv, dv, vn);
      float* o =
          a.out.ptr<float>() + (a.base + c0 + i) * a.out.stride[0] + a.head * a.out.stride[1];
      std::fill(o, o + dv, 0.0f);
      const float eg = D == Decay::kPerHead ? std::exp(s.G[i]) : 1.0f;
      for (int64_t m = 0; m < dk; ++m) {
        const float* Sm = S + m * dv;
        const float w = s.Wk[i * dk + m];
        const float qm = s.Q[i * dk + m] * eg;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          vn[j] -= w * Sm[j];
          o[j] += qm * Sm[j];
        }
      }
    }
    for (int64_t i = 0; i < L; ++i) {
      float* o =
          a.out.ptr<float>() + (a.base + c0 + i) * a.out.stride[0] + a.head * a.out.stride[1];
      for (int64_t j = 0; j <= i; ++j) {
        const float qk = s.QK[i * kChunk + j];
        const float* vn = s.Vnew + j * dv;
#pragma omp simd
        for (int64_t m = 0; m < dv; ++m) o[m] += qk * vn[m];
      }
    }
    if constexpr (D == Decay::kPerHead) {
      // S = e^(G_last) S0 + Σ_j e^(G_last − G_j) k_j ⊗ Vnew_j
      const float g_last = s.G[L - 1];
      const float decay_all = std::exp(g_last);
      for (int64_t m = 0; m < dk * dv; ++m) S[m] *= decay_all;
      for (int64_t j = 0; j < L; ++j) {
        const float dj = std::exp(g_last - s.G[j]);
        const float* vn = s.Vnew + j * dv;
        for (int64_t m = 0; m < dk; ++m) {
          const float kj = s.K[j * dk + m] * dj;
          float* Sm = S + m * dv;
#pragma omp simd
          for (int64_t e = 0; e < dv; ++e) Sm[e] += kj * vn[e];
        }
      }
    } else {
      // S = diag(P) S0 + Σ_j Kr_j ⊗ Vnew_j
      for (int64_t m = 0; m < dk; ++m) {
        const float pm = s.P[m];
        float* Sm = S + m * dv;
#pragma omp simd
        for (int64_t e = 0; e < dv; ++e) Sm[e] *= pm;
      }
      for (int64_t j = 0; j < L; ++j) {
        const float* vn = s.Vnew + j * dv;
        for (int64_t m = 0; m < dk; ++m) {
          const float kj = s.Kr[j * dk + m];
          float* Sm = S + m * dv;
#pragma omp simd
          for (int64_t e = 0; e < dv; ++e) Sm[e] += kj * vn[e];
        }
      }
    }
  }
}

template <Decay D>
void delta_rule(const DeltaRuleArgs& a, DeltaRuleForm form, float* scratch) {
  const bool recurrent =
      form == DeltaRuleForm::kRecurrent || (form == DeltaRuleForm::kAuto && a.len == 1);
  if (recurrent) {
    delta_rule_recurrent<D>(a);
  } else {
    delta_rule_chunked<D>(a, scratch);
  }
}

}  // namespace

size_t CpuOps::gated_delta_rule_scratch_bytes(int dk, int dv) const {
  return ChunkScratch::floats(dk, dv) * sizeof(float) * size_t(pool_.size());
}

void CpuOps::gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta, Tensor state, const SeqLayout& layout, Tensor out,
                              Tensor scratch, DeltaRuleForm form) {
  const int64_t hk = q.shape[1], dk = q.shape[2], hv = v.shape[1], dv = v.shape[2];
  RECUR_CHECK(hv % hk == 0 && dk <= kMaxKeyDim && dv <= kMaxValueDim);
  RECUR_CHECK(k.shape[1] == hk && k.shape[2] == dk && out.shape[1] == hv && out.shape[2] == dv);
  RECUR_CHECK(q.stride[2] == 1 && k.stride[2] == 1 && v.stride[2] == 1 && out.stride[2] == 1);
  RECUR_CHECK(state.shape[1] == hv && state.shape[2] == dk && state.shape[3] == dv);
  const bool per_key = g.ndim == 3;
  RECUR_CHECK(per_key ? g.shape[1] == hv && g.shape[2] == dk && g.stride[2] == 1
                      : g.ndim == 2 && g.shape[1] == hv);
  const size_t per_thread = ChunkScratch::floats(dk, dv);
  RECUR_CHECK(scratch.numel() * int64_t(dtype_size(scratch.dtype)) >=
              int64_t(per_thread * sizeof(float)) * pool_.size());
  const int64_t group = hv / hk;
  // Enough (sequence, head) tasks per thread to pay for a wake-up: decode heads of 16×16 are
  // far too small to split one by one.
  const int64_t tasks = int64_t(layout.n_seqs) * hv;
  const int64_t work =
      std::max<int64_t>(1, dk * dv * (layout.n_tokens / std::max(1, layout.n_seqs) + 1));
  const int64_t min_tasks = std::max<int64_t>(1, (int64_t(1) << 16) / work);
  pool_.parallel_for_indexed(tasks, min_tasks, [&](int64_t b, int64_t e, int part) {
    float* my_scratch = scratch.ptr<float>() + size_t(part) * per_thread;
    for (int64_t task = b; task < e; ++task) {
      const int s = int(task / hv);
      if (task + 1 < e) {  // the next head's state comes from memory: ask for it now
        const int s1 = int((task + 1) / hv);
        const float* next =
            state.ptr<float>() + (int64_t(layout.slot[s1]) * hv + (task + 1) % hv) * dk * dv;
        for (int64_t i = 0; i < dk * dv; i += 16) prefetch_line(next + i);
      }
      DeltaRuleArgs a{&q,
                      &k,
                      &v,
                      &g,
                      &beta,
                      state.ptr<float>() + int64_t(layout.slot[s]) * hv * dk * dv,
                      out,
                      layout.seq_start[s],
                      layout.seq_len(s),
                      task % hv,
                      (task % hv) / group,
                      dk,
                      dv};
      if (per_key) {
        delta_rule<Decay::kPerKey>(a, form, my_scratch);
      } else {
        delta_rule<Decay::kPerHead>(a, form, my_scratch);
      }
    }
  });
}

}  // namespace recur
