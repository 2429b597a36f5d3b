// Default implementations shared by backends whose memory the host can address.
#include "ops/ops.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <limits>
#include <vector>

namespace recur {

const char* fp8_activations_name(Fp8Activations a) {
  return a == Fp8Activations::kE4m3 ? "e4m3" : "f16";
}

const char* prompt_activations_name(PromptActivations a) {
  return a == PromptActivations::kF16 ? "f16" : "f16x2";
}

Result<Tensor> Ops::adopt_block_fp8_weight(const Tensor& w, const Tensor& scales, int block_rows,
                                           int block_cols, std::vector<Buffer>* owned) {
  return make_error(ErrorCode::kUnsupported,
                    "this backend ({}) does not run block-FP8 (F8_E4M3) weights; the CPU "
                    "backend does",
                    device() == Device::kCpu ? "cpu" : "cuda");
}

Result<Tensor> Ops::quantize_matmul_weight(const Tensor& host, DType dtype,
                                           std::vector<Buffer>* owned) {
  return make_error(ErrorCode::kUnsupported,
                    "this backend ({}) does not run {} weights (quantized at load); the CPU "
                    "backend does",
                    device() == Device::kCpu ? "cpu" : "cuda", dtype_name(dtype));
}

void Ops::copy_from_host(Tensor dst, const void* src) {
  RECUR_CHECK(dst.is_contiguous());
  std::memcpy(dst.data, src, size_t(dst.numel()) * dtype_size(dst.dtype));
}

void Ops::copy(const Tensor& src, Tensor dst) {
  RECUR_CHECK(src.is_contiguous() && dst.is_contiguous() && src.dtype == dst.dtype &&
              src.numel() == dst.numel());
  const size_t bytes = size_t(src.numel()) * dtype_size(src.dtype);
  if (device() == Device::kCpu) {
    std::memmove(dst.data, src.data, bytes);
    return;
  }
  std::vector<uint8_t> host(bytes);
  copy_to_host(src, host.data());
  copy_from_host(dst, host.data());
}

void Ops::argmax_rows(const Tensor& x, Tensor ids) {
  RECUR_CHECK(x.ndim == 2 && x.dtype == DType::F32 && x.stride[1] == 1);
  RECUR_CHECK(ids.dtype == DType::I32 && ids.numel() == x.shape[0] && ids.is_contiguous());
  for (int64_t r = 0; r < x.shape[0]; ++r) {
    const float* row = x.ptr<float>() + r * x.stride[0];
    float best = -std::numeric_limits<float>::infinity();
    int32_t best_i = 0;
    for (int64_t j = 0; j < x.shape[1]; ++j) {
      if (row[j] > best) best = row[j], best_i = int32_t(j);  // NaN never compares greater
    }
    ids.ptr<int32_t>()[r] = best_i;
  }
}

namespace {
// splitmix64 of (seed, index): a counter-based generator any backend can reproduce.
inline uint64_t mix(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
}  // namespace

void Ops::fill_random_uniform(Tensor t, uint64_t seed, float lo, float hi) {
  RECUR_CHECK(t.is_contiguous());
  const int64_t n = t.numel();
  const size_t es = dtype_size(t.dtype);
  // Generated on the host in slices and copied in, so device backends reuse this as is.
  constexpr int64_t kSlice = 1 << 20;
  std::vector<uint8_t> host(size_t(std::min(n, kSlice)) * es);
  for (int64_t b = 0; b < n; b += kSlice) {
    const int64_t len = std::min(kSlice, n - b);
    for (int64_t i = 0; i < len; ++i) {
      const float u = float(mix(seed, uint64_t(b + i)) >> 40) * (1.0f / float(1 << 24));
      const float v = lo + (hi - lo) * u;
      switch (t.dtype) {
        case DType::F32:
          std::memcpy(&host[size_t(i) * 4], &v, 4);
          break;
        case DType::BF16: {
          const uint16_t h = f32_to_bf16(v);
          std::memcpy(&host[size_t(i) * 2], &h, 2);
          break;
        }
        case DType::F16: {
          const uint16_t h = f32_to_f16(v);
          std::memcpy(&host[size_t(i) * 2], &h, 2);
          break;
        }
        default:
          RECUR_CHECK(false && "fill_random_uniform: F32, BF16 or F16 only");
      }
    }
    Tensor slice =
        Tensor::contiguous(static_cast<char*>(t.data) + size_t(b) * es, t.dtype, {len}, t.device);
    copy_from_host(slice, host.data());
  }
}

void Ops::matmul_group(const Tensor& x, std::span<const Tensor> ws, std::span<const Tensor> outs) {
  RECUR_CHECK(ws.size() == outs.size() && ws.size() <= kMaxMatmulGroup);
  for (size_t i = 0; i < ws.size(); ++i) matmul(x, ws[i], outs[i]);
}

void Ops::matmul_heads(const Tensor& x, const Tensor& w, Tensor out) {
  RECUR_CHECK(x.ndim == 3 && w.ndim == 3 && out.ndim == 3 && w.is_contiguous());
  const int64_t n = x.shape[0], H = w.shape[0], m = w.shape[1], k = w.shape[2];
  RECUR_CHECK(x.shape[1] == H && x.shape[2] == k && x.stride[2] == 1);
  RECUR_CHECK(out.shape[0] == n && out.shape[1] == H && out.shape[2] == m && out.stride[2] == 1);
  // Head h of t [n, H, d] as a view [n, d].
  auto head = [](const Tensor& t, int64_t h) {
    Tensor v = t;
    v.data = t.ptr<float>() + h * t.stride[1];
    v.ndim = 2, v.shape[1] = t.shape[2], v.stride[1] = 1, v.shape[2] = 0, v.stride[2] = 0;
    return v;
  };
  const size_t es = dtype_size(w.dtype);
  for (int64_t h = 0; h < H; ++h) {
    const Tensor wh = Tensor::contiguous(static_cast<char*>(w.data) + size_t(h * m * k) * es,
                                         w.dtype, {m, k}, w.device);  // [m, k]
    matmul(head(x, h), wh, head(out, h));
  }
}

void Ops::gdn_inputs(const GdnInputArgs& g, const SeqLayout& layout) {
  const int64_t key_dim = int64_t(g.key_heads) * g.dk;
  RECUR_CHECK(g.key_heads > 0 && g.value_heads % g.key_heads == 0 &&
              g.mixed.shape[1] == 2 * key_dim + int64_t(g.value_heads) * g.dv);
  conv1d_causal_silu(g.mixed, g.conv_weight, g.conv_state, layout, g.conv_out);
  l2_norm(g.conv_out.col_heads(0, g.key_heads, g.dk), g.l2_eps, g.q_scale);
  l2_norm(g.conv_out.col_heads(key_dim, g.key_heads, g.dk), g.l2_eps, 1.0f);
  gdn_gates(g.a, g.b, g.a_log, g.dt_bias, g.g, g.beta);
}

void Ops::attention_inputs(const AttentionInputArgs& a, const SeqLayout& layout) {
  const int64_t n = a.q.shape[0], hd = a.head_dim;
  const Tensor q3 = a.q.reshaped({n, a.heads, hd}), k3 = a.k.reshaped({n, a.kv_heads, hd});
  const Tensor v3 = a.v.reshaped({n, a.kv_heads, a.v.shape[1] / a.kv_heads});
  rms_norm(q3, a.q_norm, a.norm_offset, a.eps, q3);
  rms_norm(k3, a.k_norm, a.norm_offset, a.eps, k3);
  rope(q3, layout.positions, a.rot_dim, a.rope_theta);
  rope(k3, layout.positions, a.rot_dim, a.rope_theta);
  kv_cache_write(k3, v3, a.k_cache, a.v_cache, layout);
}

void Ops::moe_experts_shared(const Tensor& x, std::span<const ExpertWeights> experts,
                             const Tensor& ids, const Tensor& weights,
                             const SharedExpertArgs& shared, Tensor out, Tensor scratch) {
  const Tensor ws[] = {shared.w.gate, shared.w.up}, outs[] = {shared.gate, shared.up};
  matmul_group(x, ws, outs);
  moe_experts(x, experts, ids, weights, out, scratch);
  swiglu(shared.gate, shared.up, shared.hidden);
  matmul(shared.hidden, shared.w.down, shared.out);
  if (shared.score.empty()) {
    add(out, shared.out);
  } else {
    add_scaled_sigmoid(out, shared.out, shared.score);
  }
}

void Ops::moe_route_experts_shared(const Tensor& logits, const MoeRouting& routing, const Tensor& x,
                                   std::span<const ExpertWeights> experts, Tensor ids,
                                   Tensor weights, const SharedExpertArgs& shared, Tensor out,
                                   Tensor scratch, Tensor residual) {
  moe_route(logits, routing, ids, weights);
  moe_experts_shared(x, experts, ids, weights, shared, out, scratch);
  if (residual.data) add(residual, out);
}

void Ops::paged_attention_gated(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                const SeqLayout& layout, float scale, const Tensor& gate,
                                Tensor out) {
  paged_attention(q, k_cache, v_cache, layout, scale,
                  out.reshaped({q.shape[0], q.shape[1], out.shape[1] / q.shape[1]}));
  mul_sigmoid(out, gate);
}

void Ops::embedding_rms_norm(const int32_t* ids, int n, const Tensor& table, Tensor out,
                             const Tensor& w, float weight_offset, float eps, Tensor normed) {
  embedding(ids, n, table, out);
  rms_norm(out, w, weight_offset, eps, normed);
}

void Ops::gated_delta_rule_norm(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, Tensor state, const SeqLayout& layout,
                                Tensor out, Tensor scratch, const Tensor& gate,
                                const Tensor& norm_w, float eps, GateActivation act,
                                Tensor normed) {
  gated_delta_rule(q, k, v, g, beta, state, layout, out, scratch);
  rms_norm_gated(out, gate, norm_w, eps, act, normed);
}

Result<std::unique_ptr<CommGroup>> Ops::create_group(std::span<Ops* const> ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r]->device() != Device::kCpu) {
      return make_error(ErrorCode::kUnsupported,
                        "tensor-parallel rank {} is on a GPU and rank 0 on the CPU: ranks of one "
                        "group share a kind of device",
                        r);
    }
  }
  if (ranks.empty() || ranks.size() > 64) {
    return make_error(ErrorCode::kInvalidArgument, "a group of {} ranks: expected 1 to 64",
                      ranks.size());
  }
  return std::unique_ptr<CommGroup>(new InProcessGroup(int(ranks.size())));
}

int64_t Ops::free_memory_bytes() {
  return int64_t(sysconf(_SC_AVPHYS_PAGES)) * int64_t(sysconf(_SC_PAGESIZE));
}

double Ops::measure_copy_bandwidth(size_t bytes) {
  std::vector<uint8_t> a(bytes, 1), b(bytes, 2);
  std::memcpy(b.data(), a.data(), bytes);  // warm
  const int reps = 5;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    std::memcpy(r % 2 ? a.data() : b.data(), r % 2 ? b.data() : a.data(), bytes);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * double(bytes) * reps / s;
}

}  // namespace recur
