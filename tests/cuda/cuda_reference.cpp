#include "cuda/cuda_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend/cpu/reference.h"

namespace recur::testing::host_ref {

namespace {

double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
double silu(double x) {
  return x * sigmoid(x);
}

// Element i of a contiguous 1-D weight of any float dtype, in double.
double weight_at(const Tensor& w, int64_t i) {
  switch (w.dtype) {
    case DType::F32:
      return w.ptr<float>()[i];
    case DType::BF16:
      return bf16_to_f32(w.ptr<uint16_t>()[i]);
    case DType::F16:
      return f16_to_f32(w.ptr<uint16_t>()[i]);
    default:
      return NAN;
  }
}

// Row r of a 2-D or 3-D f32 tensor with a contiguous last dimension.
float* row(const Tensor& t, int64_t r) {
  if (t.ndim == 2) return t.ptr<float>() + r * t.stride[0];
  return t.ptr<float>() + (r / t.shape[1]) * t.stride[0] + (r % t.shape[1]) * t.stride[1];
}
int64_t n_rows(const Tensor& t) {
  return t.ndim == 2 ? t.shape[0] : t.shape[0] * t.shape[1];
}

float& at3(const Tensor& t, int64_t a, int64_t b, int64_t c) {
  return t.ptr<float>()[a * t.stride[0] + b * t.stride[1] + c * t.stride[2]];
}

float& k_at(const Tensor& c, const SeqLayout& l, int s, int64_t pos, int64_t h, int64_t j) {
  const int32_t block = l.block_ids[l.block_start[s] + pos / l.block_size];
  return c
      .ptr<float>()[block * c.stride[0] + h * c.stride[1] + j * c.stride[2] + pos % l.block_size];
}
float& v_at(const Tensor& c, const SeqLayout& l, int s, int64_t pos, int64_t h, int64_t j) {
  const int32_t block = l.block_ids[l.block_start[s] + pos / l.block_size];
  return c
      .ptr<float>()[block * c.stride[0] + h * c.stride[1] + (pos % l.block_size) * c.stride[2] + j];
}

}  // namespace

void rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& w, float eps,
                    GateActivation act, Tensor out) {
  const int64_t d = x.shape[x.ndim - 1];
  for (int64_t r = 0; r < n_rows(x); ++r) {
    const float* xr = row(x, r);
    const float* gr = row(gate, r);
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += double(xr[j]) * xr[j];
    const double inv = 1.0 / std::sqrt(ss / double(d) + eps);
    for (int64_t j = 0; j < d; ++j) {
      const double g = act == GateActivation::kSilu ? silu(gr[j]) : sigmoid(gr[j]);
      row(out, r)[j] = float(xr[j] * inv * weight_at(w, j) * g);
    }
  }
}

void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                      const Tensor& beta, Tensor state, const SeqLayout& layout, Tensor out) {
  const int64_t hk = q.shape[1], dk = q.shape[2], hv = v.shape[1], dv = v.shape[2];
  const bool per_channel = g.ndim == 3;
  std::vector<double> S(static_cast<size_t>(dk * dv)), kv(static_cast<size_t>(dv));
  for (int s = 0; s < layout.n_seqs; ++s) {
    for (int64_t h = 0; h < hv; ++h) {
      const int64_t kh = h / (hv / hk);
      float* st = state.ptr<float>() + (int64_t(layout.slot[s]) * hv + h) * dk * dv;
      for (int64_t i = 0; i < dk * dv; ++i) S[size_t(i)] = st[i];
      for (int64_t t = layout.seq_start[s]; t < layout.seq_start[s + 1]; ++t) {
        for (int64_t i = 0; i < dk; ++i) {
          const double gi = per_channel ? at3(g, t, h, i) : g.ptr<float>()[t * g.stride[0] + h];
          const double decay = std::exp(gi);
          for (int64_t j = 0; j < dv; ++j) S[size_t(i * dv + j)] *= decay;
        }
        std::fill(kv.begin(), kv.end(), 0.0);
        for (int64_t i = 0; i < dk; ++i) {
          for (int64_t j = 0; j < dv; ++j)
            kv[size_t(j)] += S[size_t(i * dv + j)] * at3(k, t, kh, i);
        }
        const double b = beta.ptr<float>()[t * beta.stride[0] + h];
        for (int64_t j = 0; j < dv; ++j) {
          const double delta = b * (at3(v, t, h, j) - kv[size_t(j)]);
          for (int64_t i = 0; i < dk; ++i) S[size_t(i * dv + j)] += at3(k, t, kh, i) * delta;
        }
        for (int64_t j = 0; j < dv; ++j) {
          double o = 0;
          for (int64_t i = 0; i < dk; ++i) o += S[size_t(i * dv + j)] * at3(q, t, kh, i);
          at3(out, t, h, j) = float(o);
        }
      }
      for (int64_t i = 0; i < dk * dv; ++i) st[i] = float(S[size_t(i)]);
    }
  }
}

void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids, Tensor weights) {
  const int64_t n = logits.shape[0], E = logits.shape[1];
  const int k = routing.k;
  const bool sig = routing.score == MoeRouting::Score::kSigmoid;
  const float* bias =
      routing.selection_bias.empty() ? nullptr : routing.selection_bias.ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float* l = logits.row<float>(t);
    std::vector<double> p(static_cast<size_t>(E));
    double mx = -INFINITY, sum = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, double(l[e]));
    for (int64_t e = 0; e < E; ++e) sum += std::exp(double(l[e]) - mx);
    for (int64_t e = 0; e < E; ++e) {
      p[size_t(e)] = sig ? sigmoid(l[e]) : std::exp(double(l[e]) - mx) / sum;
    }
    std::vector<float> key(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) key[size_t(e)] = bias ? float(p[size_t(e)]) + bias[e] : l[e];
    std::vector<int> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    // Key descending (NaN last), index ascending.
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const float ka = key[size_t(a)], kb = key[size_t(b)];
      if (std::isnan(kb)) return !std::isnan(ka);
      return ka > kb;
    });
    double kept = 0;
    for (int j = 0; j < k; ++j) kept += p[size_t(order[size_t(j)])];
    for (int j = 0; j < k; ++j) {
      const double pj = p[size_t(order[size_t(j)])];
      ids.row<int32_t>(t)[j] = order[size_t(j)];
      weights.row<float>(t)[j] = float((routing.renormalize ? pj / kept : pj) * routing.scale);
    }
  }
}

void kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                    const SeqLayout& layout) {
  for (int s = 0; s < layout.n_seqs; ++s) {
    for (int64_t t = layout.seq_start[s]; t < layout.seq_start[s + 1]; ++t) {
      const int64_t pos = layout.positions[t];
      for (int64_t h = 0; h < k.shape[1]; ++h) {
        for (int64_t j = 0; j < k.shape[2]; ++j)
          k_at(k_cache, layout, s, pos, h, j) = at3(k, t, h, j);
        for (int64_t j = 0; j < v.shape[2]; ++j)
          v_at(v_cache, layout, s, pos, h, j) = at3(v, t, h, j);
      }
    }
  }
}

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const SeqLayout& layout, float scale, Tensor out) {
  const int64_t heads = q.shape[1], hd = q.shape[2], group = heads / k_cache.shape[1];
  const int64_t dv = v_cache.shape[3];
  for (int s = 0; s < layout.n_seqs; ++s) {
    for (int64_t t = layout.seq_start[s]; t < layout.seq_start[s + 1]; ++t) {
      const int64_t n_ctx = layout.positions[t] + 1;
      for (int64_t h = 0; h < heads; ++h) {
        std::vector<double> score(static_cast<size_t>(n_ctx));
        for (int64_t p = 0; p < n_ctx; ++p) {
          double acc = 0;
          for (int64_t j = 0; j < hd; ++j) {
            acc += double(at3(q, t, h, j)) * k_at(k_cache, layout, s, p, h / group, j);
          }
          score[size_t(p)] = acc * scale;
        }
        const double mx = *std::max_element(score.begin(), score.end());
        double sum = 0;
        for (double& e : score) sum += (e = std::exp(e - mx));
        for (int64_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (int64_t p = 0; p < n_ctx; ++p) {
            acc += score[size_t(p)] * v_at(v_cache, layout, s, p, h / group, j);
          }
          at3(out, t, h, j) = float(acc / sum);
        }
      }
    }
  }
}

void moe_experts_shared(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                        const Tensor& weights, const ExpertWeights& shared, const Tensor& score,
                        Tensor out) {
  const int64_t n = x.shape[0], d = x.shape[1], ff = shared.gate.shape[0];
  ref::moe_experts(x, experts, ids, weights, out);
  std::vector<float> g(static_cast<size_t>(n * ff)), u(g), h(g), y(static_cast<size_t>(n * d));
  ref::matmul(x, shared.gate, Tensor::contiguous(g.data(), DType::F32, {n, ff}));
  ref::matmul(x, shared.up, Tensor::contiguous(u.data(), DType::F32, {n, ff}));
  for (size_t i = 0; i < h.size(); ++i) h[i] = float(silu(g[i]) * u[i]);
  ref::matmul(Tensor::contiguous(h.data(), DType::F32, {n, ff}), shared.down,
              Tensor::contiguous(y.data(), DType::F32, {n, d}));
  for (int64_t t = 0; t < n; ++t) {
    const double sg = score.empty() ? 1.0 : sigmoid(score.row<float>(t)[0]);
    for (int64_t c = 0; c < d; ++c) {
      out.row<float>(t)[c] = float(out.row<float>(t)[c] + sg * y[size_t(t * d + c)]);
    }
  }
}

}  // namespace recur::testing::host_ref
