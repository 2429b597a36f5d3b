// Helpers for comparing kernels with their scalar references on random data, on any backend:
// host tensors of any dtype, error measures, ragged batch layouts, and the inputs and
// references of the delta rule, the attention and Gated DeltaNet input stages and shared-expert
// MoE. Host-only (the CUDA tests add device copies in cuda/cuda_test_util.h).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "backend/cpu/reference.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace recur::testing {

// Owned host storage for a tensor of any dtype (zeroed, with slack past the end).
struct HostTensor {
  std::vector<uint8_t> bytes;
  Tensor t;
  HostTensor(DType dt, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    bytes.assign(size_t(n) * dtype_size(dt) + 64, 0);
    t = Tensor::contiguous(bytes.data(), dt, shape);
  }
  HostTensor(const HostTensor& o) : bytes(o.bytes), t(o.t) { t.data = bytes.data(); }
  HostTensor& operator=(const HostTensor& o) {
    bytes = o.bytes;
    t = o.t;
    t.data = bytes.data();
    return *this;
  }
  // A move keeps the bytes' buffer, so views into it stay valid (a growing vector moves).
  HostTensor(HostTensor&& o) noexcept : bytes(std::move(o.bytes)), t(o.t) {}
  HostTensor& operator=(HostTensor&& o) noexcept {
    bytes = std::move(o.bytes);
    t = o.t;
    return *this;
  }
  float* f() const { return t.ptr<float>(); }
  int64_t numel() const { return t.numel(); }
};

inline void fill_random(HostTensor& h, std::mt19937& rng, float scale = 1.0f, float offset = 0) {
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < h.numel(); ++i) {
    const float v = dist(rng) + offset;
    switch (h.t.dtype) {
      case DType::F32:
        h.t.ptr<float>()[i] = v;
        break;
      case DType::BF16:
        h.t.ptr<uint16_t>()[i] = f32_to_bf16(v);
        break;
      case DType::F16:
        h.t.ptr<uint16_t>()[i] = f32_to_f16(v);
        break;
      case DType::F8_E4M3:
        h.t.ptr<uint8_t>()[i] = f32_to_f8_e4m3(v);
        break;
      default:
        FAIL() << "fill_random: unsupported dtype";
    }
  }
}

// Largest |a - b| over the first n floats; NaN counts as infinite.
inline double max_abs_diff(const float* a, const float* b, int64_t n) {
  double d = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = std::fabs(double(a[i]) - double(b[i]));
    if (std::isnan(e)) return INFINITY;
    d = std::max(d, e);
  }
  return d;
}

inline double max_abs(const float* a, int64_t n) {
  double d = 0;
  for (int64_t i = 0; i < n; ++i) d = std::max(d, std::fabs(double(a[i])));
  return d;
}

// max |a − b| / max(floor, max |b|): error relative to the reference's scale.
inline double rel_err(const float* a, const float* b, int64_t n, double floor = 1.0) {
  return max_abs_diff(a, b, n) / std::max(floor, max_abs(b, n));
}

// sqrt(Σ (a − b)²) / sqrt(Σ b²): an error that a few values rounded to the other side of a
// step move little.
inline double rms_rel_err(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

inline int64_t count_nonfinite(const float* a, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += !std::isfinite(a[i]);
  return c;
}

inline bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.bytes.size() == b.bytes.size() &&
         std::memcmp(a.t.data, b.t.data, size_t(a.numel()) * dtype_size(a.t.dtype)) == 0;
}

// Host-side layout of a ragged batch: one slot per sequence, block tables shuffled.
struct Layout {
  std::vector<int32_t> seq_start{0}, slot, positions, block_start{0}, block_ids;
  SeqLayout l;
  Layout(const std::vector<int>& lens, const std::vector<int>& first_pos, int block_size,
         std::mt19937& rng) {
    int32_t next_block = 0;
    for (size_t s = 0; s < lens.size(); ++s) {
      for (int i = 0; i < lens[s]; ++i) positions.push_back(first_pos[s] + i);
      seq_start.push_back(seq_start.back() + lens[s]);
      slot.push_back(int32_t(lens.size() - 1 - s));  // slots in reverse order of sequences
      const int n_blocks = (first_pos[s] + lens[s] + block_size - 1) / block_size;
      for (int b = 0; b < n_blocks; ++b) block_ids.push_back(next_block++);
      block_start.push_back(int32_t(block_ids.size()));
    }
    std::shuffle(block_ids.begin(), block_ids.end(), rng);  // non-contiguous physical blocks
    l.n_seqs = int(lens.size());
    l.n_tokens = seq_start.back();
    l.seq_start = seq_start.data();
    l.slot = slot.data();
    l.positions = positions.data();
    l.block_start = block_start.data();
    l.block_ids = block_ids.data();
    l.block_size = block_size;
  }
  Layout(const Layout&) = delete;  // l points into this object's vectors
  int n_blocks() const { return int(block_ids.size()); }
};

// Element i of a cache tensor (F32, BF16, F16 or F8_E4M3) set to a NaN of its type.
inline void set_nan(HostTensor& h, int64_t i) {
  switch (h.t.dtype) {
    case DType::F32:
      h.f()[i] = std::nanf("");
      break;
    case DType::BF16:
      h.t.ptr<uint16_t>()[i] = 0x7fc0;
      break;
    case DType::F16:
      h.t.ptr<uint16_t>()[i] = 0x7e00;
      break;
    case DType::F8_E4M3:
      h.t.ptr<uint8_t>()[i] = 0x7f;  // e4m3fn's NaN
      break;
    default:
      FAIL() << "set_nan: unsupported dtype";
  }
}

// NaN in every cached position past each sequence's last (lens[s] tokens from first[s]), as a
// block freed by a sequence whose activations overflowed could hold: key cache kc [blocks, kv,
// hd, bs]; value cache vc [blocks, kv, bs, dv], or none (a latent cache: values are the keys).
// A kernel may read those positions but must not let them into a sum (0 · NaN is NaN).
inline void poison_past_ends(const Layout& lay, const std::vector<int>& lens,
                             const std::vector<int>& first, HostTensor& kc, HostTensor* vc) {
  const int64_t kv = kc.t.shape[1], hd = kc.t.shape[2], bs = kc.t.shape[3];
  for (size_t s = 0; s < lens.size(); ++s) {
    const int n_blocks = lay.block_start[s + 1] - lay.block_start[s];
    for (int64_t pos = first[s] + lens[s]; pos < n_blocks * bs; ++pos) {
      const int64_t block = lay.block_ids[size_t(lay.block_start[s] + pos / bs)];
      for (int64_t h = 0; h < kv; ++h) {
        for (int64_t d = 0; d < hd; ++d) set_nan(kc, ((block * kv + h) * hd + d) * bs + pos % bs);
        if (vc == nullptr) continue;
        const int64_t dv = vc->t.shape[3];
        for (int64_t d = 0; d < dv; ++d) set_nan(*vc, ((block * kv + h) * bs + pos % bs) * dv + d);
      }
    }
  }
}

// How DeltaInputs draws the log-decays g.
enum class DecayStrength {
  kMixed,      // in [-2, 0], mostly mild
  kStrong,     // a quarter of the heads (per head) or key channels (per key) at -5 to -20 per
               // token, so that a 64-token chunk's sum is far below -80; the rest as kMixed,
               // with some exactly 0 (no decay)
  kUnderflow,  // as kMixed, but every tenth decay -60 (e^g underflows in f32)
};

// Delta-rule inputs as the model makes them: l2-normalised q (scaled) and k (by the scalar
// reference, so that no kernel under test makes its own inputs), log-decays g (per head
// [n, hv] or per key channel [n, hv, dk]), beta in (0, 1).
struct DeltaInputs {
  HostTensor q, k, v, g, beta;
  DeltaInputs(int64_t n, int64_t hk, int64_t hv, int64_t dk, int64_t dv, std::mt19937& rng,
              bool per_key = false, DecayStrength strength = DecayStrength::kMixed)
      : q(DType::F32, {n, hk, dk}),
        k(DType::F32, {n, hk, dk}),
        v(DType::F32, {n, hv, dv}),
        g(per_key ? HostTensor(DType::F32, {n, hv, dk}) : HostTensor(DType::F32, {n, hv})),
        beta(DType::F32, {n, hv}) {
    fill_random(q, rng);
    fill_random(k, rng);
    fill_random(v, rng);
    ref::l2_norm(q.t, 1e-6f, 1.0f / std::sqrt(float(dk)));
    ref::l2_norm(k.t, 1e-6f, 1.0f);
    std::uniform_real_distribution<float> gd(-2.0f, 0.0f), bd(0.0f, 1.0f), strong(-20.0f, -5.0f);
    const int64_t channels = per_key ? hv * dk : hv;  // decays per token
    std::vector<int> kind(size_t(channels), 0);       // 0 mixed, 1 strong, 2 none
    if (strength == DecayStrength::kStrong) {
      for (int64_t c = 0; c < channels; ++c) kind[size_t(c)] = c % 4 == 1 ? 1 : c % 8 == 2 ? 2 : 0;
      std::shuffle(kind.begin(), kind.end(), rng);
    }
    for (int64_t i = 0; i < g.numel(); ++i) {
      switch (kind[size_t(i % channels)]) {
        case 0:
          g.f()[i] = -gd(rng) * gd(rng) * 0.5f;  // log-decays in [-2, 0]: mostly mild, some strong
          if (strength == DecayStrength::kUnderflow && i % 10 == 3) g.f()[i] = -60.0f;
          break;
        case 1:
          g.f()[i] = strong(rng);
          break;
        default:
          g.f()[i] = 0.0f;
      }
    }
    for (int64_t i = 0; i < beta.numel(); ++i) beta.f()[i] = bd(rng);
  }
};

// One attention layer's input stage (Ops::attention_inputs) on random data over a ragged
// layout's positions and blocks, and its reference from the scalar references of its parts.
// Value heads of dv channels, query and key heads of hd.
struct AttentionInputCase {
  int64_t n, heads, kv, hd, dv;
  int rot;
  HostTensor q, k, v, q_norm, k_norm, kc, vc;
  // cache_t: the caches' element type (F32, BF16, F16 or F8_E4M3).
  AttentionInputCase(const SeqLayout& l, int n_blocks, int64_t heads_, int64_t kv_, int64_t hd_,
                     int64_t dv_, int rot_, DType norm_t, std::mt19937& rng,
                     DType cache_t = DType::F32)
      : n(l.n_tokens),
        heads(heads_),
        kv(kv_),
        hd(hd_),
        dv(dv_),
        rot(rot_),
        q(DType::F32, {n, heads * hd}),
        k(DType::F32, {n, kv * hd}),
        v(DType::F32, {n, kv * dv}),
        q_norm(norm_t, {hd}),
        k_norm(norm_t, {hd}),
        kc(cache_t, {n_blocks, kv, hd, l.block_size}),
        vc(cache_t, {n_blocks, kv, l.block_size, dv}) {
    for (HostTensor* t : {&q, &k, &v, &kc, &vc}) fill_random(*t, rng);
    fill_random(q_norm, rng, 0.2f);
    fill_random(k_norm, rng, 0.2f);
  }
  AttentionInputArgs args() const {
    AttentionInputArgs a;
    a.heads = int(heads), a.kv_heads = int(kv), a.head_dim = int(hd), a.rot_dim = rot;
    a.rope_theta = 1e7, a.norm_offset = 1.0f, a.eps = 1e-6f;
    a.q = q.t, a.k = k.t, a.v = v.t, a.q_norm = q_norm.t, a.k_norm = k_norm.t;
    a.k_cache = kc.t, a.v_cache = vc.t;
    return a;
  }
  // The stage from the references, in place on this case: the norms, the rotations and the
  // cache writes.
  void reference(const SeqLayout& l) {
    const Tensor q3 = q.t.reshaped({n, heads, hd}), k3 = k.t.reshaped({n, kv, hd});
    ref::rms_norm(q3, q_norm.t, 1.0f, 1e-6f, q3);
    ref::rms_norm(k3, k_norm.t, 1.0f, 1e-6f, k3);
    ref::rope(q3, l.positions, rot, 1e7);
    ref::rope(k3, l.positions, rot, 1e7);
    ref::kv_cache_write(k3, v.t.reshaped({n, kv, dv}), kc.t, vc.t, l);
  }
};

// moe_experts_shared from the references: ref::moe_experts, then the shared expert (gate and up
// by ref::matmul, SwiGLU and the σ(score) scale in double, down by ref::matmul) added in; score
// empty for an ungated shared expert. x [n, d]; score [n, 1]; out [n, d].
inline void reference_moe_shared(const Tensor& x, std::span<const ExpertWeights> experts,
                                 const Tensor& ids, const Tensor& weights,
                                 const ExpertWeights& shared, const Tensor& score, Tensor out) {
  const int64_t n = x.shape[0], d = x.shape[1], ff = shared.gate.shape[0];
  ref::moe_experts(x, experts, ids, weights, out);
  HostTensor g(DType::F32, {n, ff}), u = g, h = g, y(DType::F32, {n, d});
  ref::matmul(x, shared.gate, g.t);
  ref::matmul(x, shared.up, u.t);
  for (int64_t i = 0; i < n * ff; ++i) {
    const double gv = g.f()[i];
    h.f()[i] = float(gv / (1.0 + std::exp(-gv)) * u.f()[i]);
  }
  ref::matmul(h.t, shared.down, y.t);
  for (int64_t t = 0; t < n; ++t) {
    const double sg = score.empty() ? 1.0 : 1.0 / (1.0 + std::exp(-double(score.row<float>(t)[0])));
    for (int64_t c = 0; c < d; ++c) {
      out.row<float>(t)[c] = float(out.row<float>(t)[c] + sg * y.f()[t * d + c]);
    }
  }
}

// Ops::gdn_inputs from the scalar references of its parts, on host tensors, in place on a's
// outputs and conv state: the conv, the L2 norms of every q and k head (q scaled), the gates.
// a.conv_out contiguous [n, C].
inline void reference_gdn_inputs(const GdnInputArgs& a, const SeqLayout& layout) {
  const int64_t n = a.mixed.shape[0], C = a.mixed.shape[1], dk = a.dk;
  const int64_t key_dim = int64_t(a.key_heads) * dk;
  ref::conv1d_causal_silu(a.mixed, a.conv_weight, a.conv_state, layout, a.conv_out);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < a.key_heads; ++h) {
      for (int64_t part = 0; part < 2; ++part) {
        Tensor row = Tensor::contiguous(a.conv_out.ptr<float>() + t * C + part * key_dim + h * dk,
                                        DType::F32, {1, dk});
        ref::l2_norm(row, a.l2_eps, part == 0 ? a.q_scale : 1.0f);
      }
    }
  }
  ref::gdn_gates(a.a, a.b, a.a_log, a.dt_bias, a.g, a.beta);
}

// One Gated DeltaNet layer's input stage (Ops::gdn_inputs) on random data: the operands, the
// outputs, and the reference built from the scalar references of its parts. mixed, a and b are
// column views of one projection output [n, C + 2·hv + 3], as a model's fused projection gives
// them (rows not packed).
struct GdnInputCase {
  int64_t n, hk, hv, dk, dv, K, C;
  HostTensor proj, conv_w, a_log, dt_bias, state;  // operands
  HostTensor conv_out, g, beta;                    // outputs
  GdnInputCase(int64_t n_, int64_t hk_, int64_t hv_, int64_t dk_, int64_t dv_, int64_t K_,
               int64_t slots, DType wt, DType gate_t, std::mt19937& rng)
      : n(n_),
        hk(hk_),
        hv(hv_),
        dk(dk_),
        dv(dv_),
        K(K_),
        C(2 * hk_ * dk_ + hv_ * dv_),
        proj(DType::F32, {n, C + 2 * hv + 3}),
        conv_w(wt, {C, K}),
        a_log(gate_t, {hv}),
        dt_bias(gate_t, {hv}),
        state(DType::F32, {slots, K - 1, C}),
        conv_out(DType::F32, {n, C}),
        g(DType::F32, {n, hv}),
        beta(DType::F32, {n, hv}) {
    fill_random(proj, rng);
    fill_random(conv_w, rng, 0.5f);
    fill_random(a_log, rng, 0.5f);
    fill_random(dt_bias, rng);
    fill_random(state, rng);
  }
  Tensor mixed() const { return proj.t.slice_cols(0, C); }
  Tensor a() const { return proj.t.slice_cols(C, C + hv); }
  Tensor b() const { return proj.t.slice_cols(C + hv, C + 2 * hv); }
  GdnInputArgs args() const {
    GdnInputArgs r;
    r.key_heads = int(hk), r.value_heads = int(hv), r.dk = int(dk), r.dv = int(dv);
    r.l2_eps = 1e-6f, r.q_scale = 1.0f / std::sqrt(float(dk));
    r.mixed = mixed(), r.a = a(), r.b = b(), r.conv_weight = conv_w.t;
    r.a_log = a_log.t, r.dt_bias = dt_bias.t, r.conv_state = state.t;
    r.conv_out = conv_out.t, r.g = g.t, r.beta = beta.t;
    return r;
  }
  // The stage from the references, in place on this case's outputs and state.
  void reference(const SeqLayout& layout) { reference_gdn_inputs(args(), layout); }
};

}  // namespace recur::testing
