#include "backend/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <vector>

#include "backend/cpu/kernels.h"

namespace recur::ref {

using cpu::RowView;
using cpu::weight_at;

namespace {
double silu(double x) {
  return x / (1.0 + std::exp(-x));
}
double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}
float& at3(const Tensor& t, int64_t a, int64_t b, int64_t c) {
  return t.ptr<float>()[a * t.stride[0] + b * t.stride[1] + c * t.stride[2]];
}
}  // namespace

void embedding(const int32_t* ids, int n, const Tensor& table, Tensor out) {
  const int64_t d = table.shape[1];
  for (int i = 0; i < n; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      out.row<float>(i)[j] =
          float(weight_at(table, ids[i] * table.stride[0] + j * table.stride[1]));
    }
  }
}

void gather_rows(const Tensor& x, const int32_t* rows, int n, Tensor out) {
  for (int i = 0; i < n; ++i) {
    for (int64_t j = 0; j < x.shape[1]; ++j) out.row<float>(i)[j] = x.row<float>(rows[i])[j];
  }
}

void matmul(const Tensor& x, const Tensor& w, Tensor out) {
  const int64_t n = x.shape[0], m = w.shape[0], k = w.shape[1];
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < m; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < k; ++i) {
        acc += double(x.row<float>(t)[i]) * weight_at(w, j * w.stride[0] + i * w.stride[1]);
      }
      out.row<float>(t)[j] = float(acc);
    }
  }
}

void matmul_heads(const Tensor& x, const Tensor& w, Tensor out) {
  const int64_t n = x.shape[0], H = w.shape[0], m = w.shape[1], k = w.shape[2];
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const float* xh = x.ptr<float>() + t * x.stride[0] + h * x.stride[1];
      float* oh = out.ptr<float>() + t * out.stride[0] + h * out.stride[1];
      for (int64_t j = 0; j < m; ++j) {
        double acc = 0;
        for (int64_t i = 0; i < k; ++i) acc += double(xh[i]) * weight_at(w, (h * m + j) * k + i);
        oh[j] = float(acc);
      }
    }
  }
}

void rms_norm(const Tensor& x, const Tensor& w, float weight_offset, float eps, Tensor out) {
  RowView xs(x), os(out);
  for (int64_t r = 0; r < xs.n_rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < xs.d; ++j) ss += double(xs.row(r)[j]) * xs.row(r)[j];
    const double inv = 1.0 / std::sqrt(ss / double(xs.d) + eps);
    for (int64_t j = 0; j < xs.d; ++j) {
      os.row(r)[j] = float(xs.row(r)[j] * inv * (weight_at(w, j) + double(weight_offset)));
    }
  }
}

void rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& w, float eps,
                    GateActivation act, Tensor out) {
  RowView xs(x), gs(gate), os(out);
  for (int64_t r = 0; r < xs.n_rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < xs.d; ++j) ss += double(xs.row(r)[j]) * xs.row(r)[j];
    const double inv = 1.0 / std::sqrt(ss / double(xs.d) + eps);
    for (int64_t j = 0; j < xs.d; ++j) {
      const double gv = gs.row(r)[j];
      const double a = act == GateActivation::kSilu ? silu(gv) : sigmoid(gv);
      os.row(r)[j] = float(xs.row(r)[j] * inv * weight_at(w, j) * a);
    }
  }
}

void swiglu(const Tensor& gate, const Tensor& up, Tensor out) {
  RowView gs(gate), us(up), os(out);
  for (int64_t r = 0; r < gs.n_rows; ++r) {
    for (int64_t j = 0; j < gs.d; ++j) {
      os.row(r)[j] = float(silu(gs.row(r)[j]) * double(us.row(r)[j]));
    }
  }
}

void mul_sigmoid(Tensor x, const Tensor& gate) {
  RowView xs(x), gs(gate);
  for (int64_t r = 0; r < xs.n_rows; ++r) {
    for (int64_t j = 0; j < xs.d; ++j) {
      xs.row(r)[j] = float(double(xs.row(r)[j]) * sigmoid(gs.row(r)[j]));
    }
  }
}

void add(Tensor x, const Tensor& y) {
  RowView xs(x), ys(y);
  for (int64_t r = 0; r < xs.n_rows; ++r) {
    for (int64_t j = 0; j < xs.d; ++j) xs.row(r)[j] = float(double(xs.row(r)[j]) + ys.row(r)[j]);
  }
}

void add_scaled_sigmoid(Tensor x, const Tensor& y, const Tensor& s) {
  RowView xs(x), ys(y), ss(s);
  for (int64_t r = 0; r < xs.n_rows; ++r) {
    const double scale = sigmoid(ss.row(r)[0]);
    for (int64_t j = 0; j < xs.d; ++j) {
      xs.row(r)[j] = float(double(xs.row(r)[j]) + scale * ys.row(r)[j]);
    }
  }
}

void l2_norm(Tensor x, float eps, float scale) {
  RowView xs(x);
  for (int64_t r = 0; r < xs.n_rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < xs.d; ++j) ss += double(xs.row(r)[j]) * xs.row(r)[j];
    const double f = double(scale) / std::sqrt(ss + eps);
    for (int64_t j = 0; j < xs.d; ++j) xs.row(r)[j] = float(xs.row(r)[j] * f);
  }
}

void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
               Tensor g, Tensor beta) {
  const int64_t per_head = a.shape[1] / b.shape[1];  // 1, or dk for a per-channel decay
  for (int64_t t = 0; t < a.shape[0]; ++t) {
    for (int64_t j = 0; j < a.shape[1]; ++j) {
      const double x = double(a.row<float>(t)[j]) + weight_at(dt_bias, j);
      const double softplus = x > 20.0 ? x : std::log1p(std::exp(x));
      g.row<float>(t)[j] = float(-std::exp(double(weight_at(a_log, j / per_head))) * softplus);
    }
    for (int64_t h = 0; h < b.shape[1]; ++h) {
      beta.row<float>(t)[h] = float(sigmoid(b.row<float>(t)[h]));
    }
  }
}

void rope(Tensor x, const int32_t* positions, int rot_dim, double theta) {
  const int half = rot_dim / 2;
  for (int64_t t = 0; t < x.shape[0]; ++t) {
    for (int64_t h = 0; h < x.shape[1]; ++h) {
      for (int i = 0; i < half; ++i) {
        const double inv_freq = 1.0 / std::pow(theta, double(2 * i) / rot_dim);
        const double angle = positions[t] * inv_freq;
        const double a = at3(x, t, h, i), b = at3(x, t, h, i + half);
        at3(x, t, h, i) = float(a * std::cos(angle) - b * std::sin(angle));
        at3(x, t, h, i + half) = float(b * std::cos(angle) + a * std::sin(angle));
      }
    }
  }
}

void conv1d_causal_silu(const Tensor& x, const Tensor& weight, Tensor conv_state,
                        const SeqLayout& layout, Tensor out) {
  const int64_t C = x.shape[1], K = weight.shape[1];
  for (int s = 0; s < layout.n_seqs; ++s) {
    float* state = conv_state.ptr<float>() + int64_t(layout.slot[s]) * (K - 1) * C;
    const int64_t base = layout.seq_start[s], len = layout.seq_len(s);
    // The sequence's full input: state rows, then the new tokens.
    std::vector<double> in(static_cast<size_t>((K - 1 + len) * C));
    for (int64_t r = 0; r < K - 1; ++r)
      for (int64_t c = 0; c < C; ++c) in[size_t(r * C + c)] = state[r * C + c];
    for (int64_t i = 0; i < len; ++i)
      for (int64_t c = 0; c < C; ++c) in[size_t((K - 1 + i) * C + c)] = x.row<float>(base + i)[c];
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < K; ++j)
          acc += weight_at(weight, c * K + j) * in[size_t((i + j) * C + c)];
        out.row<float>(base + i)[c] = float(silu(acc));
      }
    }
    for (int64_t r = 0; r < K - 1; ++r)
      for (int64_t c = 0; c < C; ++c) state[r * C + c] = float(in[size_t((len + r) * C + c)]);
  }
}

void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                      const Tensor& beta, Tensor state, const SeqLayout& layout, Tensor out) {
  const int64_t hk = q.shape[1], dk = q.shape[2], hv = v.shape[1], dv = v.shape[2];
  const int64_t group = hv / hk;
  const bool per_key = g.ndim == 3;  // [n, Hv, dk]; else [n, Hv]
  std::vector<double> S(static_cast<size_t>(dk * dv)), kv(static_cast<size_t>(dv));
  for (int s = 0; s < layout.n_seqs; ++s) {
    for (int64_t h = 0; h < hv; ++h) {
      float* st = state.ptr<float>() + (int64_t(layout.slot[s]) * hv + h) * dk * dv;
      for (int64_t i = 0; i < dk * dv; ++i) S[size_t(i)] = st[i];
      for (int64_t t = layout.seq_start[s]; t < layout.seq_start[s + 1]; ++t) {
        const double b = beta.row<float>(t)[h];
        for (int64_t i = 0; i < dk; ++i) {  // S ← diag(exp(g))·S: row i by its channel's decay
          const double decay = std::exp(double(per_key ? at3(g, t, h, i) : g.row<float>(t)[h]));
          for (int64_t j = 0; j < dv; ++j) S[size_t(i * dv + j)] *= decay;
        }
        for (int64_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < dk; ++i) acc += S[size_t(i * dv + j)] * at3(k, t, h / group, i);
          kv[size_t(j)] = (at3(v, t, h, j) - acc) * b;
        }
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t j = 0; j < dv; ++j)
            S[size_t(i * dv + j)] += at3(k, t, h / group, i) * kv[size_t(j)];
        for (int64_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < dk; ++i) acc += S[size_t(i * dv + j)] * at3(q, t, h / group, i);
          at3(out, t, h, j) = float(acc);
        }
      }
      for (int64_t i = 0; i < dk * dv; ++i) st[i] = float(S[size_t(i)]);
    }
  }
}

namespace {
// Offsets of elements of k_cache [blocks, kv_heads, hd, block_size] and v_cache [blocks,
// kv_heads, block_size, dv]; the caches hold F32, BF16, F16 or F8_E4M3.
int64_t k_off(const Tensor& c, const SeqLayout& l, int s, int64_t pos, int64_t h, int64_t j) {
  const int32_t block = l.block_ids[l.block_start[s] + pos / l.block_size];
  return block * c.stride[0] + h * c.stride[1] + j * c.stride[2] + pos % l.block_size;
}
int64_t v_off(const Tensor& c, const SeqLayout& l, int s, int64_t pos, int64_t h, int64_t j) {
  const int32_t block = l.block_ids[l.block_start[s] + pos / l.block_size];
  return block * c.stride[0] + h * c.stride[1] + (pos % l.block_size) * c.stride[2] +
         j * c.stride[3];
}
float cache_load(const Tensor& c, int64_t i) {
  switch (c.dtype) {
    case DType::F32:
      return c.ptr<float>()[i];
    case DType::BF16:
      return bf16_to_f32(c.ptr<uint16_t>()[i]);
    case DType::F16:
      return f16_to_f32(c.ptr<uint16_t>()[i]);
    case DType::F8_E4M3:
      return f8_e4m3_to_f32(c.ptr<uint8_t>()[i]);
    default:
      RECUR_CHECK(false && "attention cache of F32, BF16, F16 or F8_E4M3");
      return 0.0f;
  }
}
void cache_store(const Tensor& c, int64_t i, float x) {
  switch (c.dtype) {
    case DType::F32:
      c.ptr<float>()[i] = x;
      break;
    case DType::BF16:
      c.ptr<uint16_t>()[i] = f32_to_bf16(x);
      break;
    case DType::F16:
      c.ptr<uint16_t>()[i] = f32_to_f16_saturating(x);
      break;
    case DType::F8_E4M3:
      c.ptr<uint8_t>()[i] = f32_to_f8_e4m3(x);
      break;
    default:
      RECUR_CHECK(false && "attention cache of F32, BF16, F16 or F8_E4M3");
  }
}
float k_at(const Tensor& c, const SeqLayout& l, int s, int64_t pos, int64_t h, int64_t j) {
  return cache_load(c, k_off(c, l, s, pos, h, j));
}
float v_at(const Tensor& c, const SeqLayout& l, int s, int64_t pos, int64_t h, int64_t j) {
  return cache_load(c, v_off(c, l, s, pos, h, j));
}
}  // namespace

// The caches' element type rounds what is stored (as Ops::kv_cache_write says) and is read back
// exactly.
void kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                    const SeqLayout& layout) {
  for (int s = 0; s < layout.n_seqs; ++s)
    for (int64_t t = layout.seq_start[s]; t < layout.seq_start[s + 1]; ++t)
      for (int64_t h = 0; h < k.shape[1]; ++h) {
        for (int64_t j = 0; j < k.shape[2]; ++j)
          cache_store(k_cache, k_off(k_cache, layout, s, layout.positions[t], h, j),
                      at3(k, t, h, j));
        for (int64_t j = 0; j < v.shape[2]; ++j)
          cache_store(v_cache, v_off(v_cache, layout, s, layout.positions[t], h, j),
                      at3(v, t, h, j));
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
          for (int64_t j = 0; j < hd; ++j)
            acc += double(at3(q, t, h, j)) * k_at(k_cache, layout, s, p, h / group, j);
          score[size_t(p)] = acc * scale;
        }
        const double mx = *std::max_element(score.begin(), score.end());
        double sum = 0;
        for (auto& e : score) sum += (e = std::exp(e - mx));
        for (int64_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (int64_t p = 0; p < n_ctx; ++p)
            acc += score[size_t(p)] * v_at(v_cache, layout, s, p, h / group, j);
          at3(out, t, h, j) = float(acc / sum);
        }
      }
    }
  }
}

void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids, Tensor weights) {
  const int64_t n = logits.shape[0], E = logits.shape[1];
  const int k = routing.k;
  const bool biased = !routing.selection_bias.empty();
  for (int64_t t = 0; t < n; ++t) {
    const float* l = logits.row<float>(t);
    // The scores, computed in double and held in f32; the values that choose add the bias.
    std::vector<float> score(static_cast<size_t>(E)), choose(static_cast<size_t>(E));
    if (routing.score == MoeRouting::Score::kSoftmax) {
      double mx = -INFINITY, sum = 0;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, double(l[e]));
      for (int64_t e = 0; e < E; ++e) sum += std::exp(double(l[e]) - mx);
      for (int64_t e = 0; e < E; ++e) score[size_t(e)] = float(std::exp(double(l[e]) - mx) / sum);
    } else {
      for (int64_t e = 0; e < E; ++e) score[size_t(e)] = float(sigmoid(l[e]));
    }
    for (int64_t e = 0; e < E; ++e) {
      choose[size_t(e)] = score[size_t(e)] + (biased ? weight_at(routing.selection_bias, e) : 0.0f);
    }
    if (routing.grouped()) {  // experts outside the topk_group best groups cannot be chosen
      const int64_t size = E / routing.n_group;
      std::vector<double> group_score(size_t(routing.n_group));
      for (int64_t g = 0; g < routing.n_group; ++g) {
        std::vector<float> v(choose.begin() + g * size, choose.begin() + (g + 1) * size);
        std::sort(v.begin(), v.end(), std::greater<float>());
        group_score[size_t(g)] = double(v[0]) + (size > 1 ? double(v[1]) : 0.0);
      }
      std::vector<int> groups(size_t(routing.n_group));
      std::iota(groups.begin(), groups.end(), 0);
      std::stable_sort(groups.begin(), groups.end(), [&](int a, int b) {
        return group_score[size_t(a)] > group_score[size_t(b)];
      });
      std::vector<bool> kept_group(size_t(routing.n_group), false);
      for (int j = 0; j < routing.topk_group; ++j) kept_group[size_t(groups[size_t(j)])] = true;
      for (int64_t e = 0; e < E; ++e) {
        if (!kept_group[size_t(e / size)]) choose[size_t(e)] = -INFINITY;
      }
    }
    std::vector<int> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return choose[size_t(a)] > choose[size_t(b)]; });
    double kept = 0;
    for (int j = 0; j < k; ++j) kept += score[size_t(order[size_t(j)])];
    for (int j = 0; j < k; ++j) {
      const double w = score[size_t(order[size_t(j)])] / (routing.renormalize ? kept : 1.0);
      ids.row<int32_t>(t)[j] = order[size_t(j)];
      weights.row<float>(t)[j] = float(w * routing.scale);
    }
  }
}

void moe_experts(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                 const Tensor& weights, Tensor out) {
  const int64_t n = x.shape[0], d = x.shape[1], k = ids.shape[1];
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> acc(static_cast<size_t>(d), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const ExpertWeights& ew = experts[size_t(ids.row<int32_t>(t)[j])];
      const int64_t f = ew.gate.shape[0];
      std::vector<double> h(static_cast<size_t>(f));
      for (int64_t i = 0; i < f; ++i) {
        double gsum = 0, usum = 0;
        for (int64_t c = 0; c < d; ++c) {
          gsum += weight_at(ew.gate, i * d + c) * double(x.row<float>(t)[c]);
          usum += weight_at(ew.up, i * d + c) * double(x.row<float>(t)[c]);
        }
        h[size_t(i)] = silu(gsum) * usum;
      }
      for (int64_t c = 0; c < d; ++c) {
        double y = 0;
        for (int64_t i = 0; i < f; ++i) y += weight_at(ew.down, c * f + i) * h[size_t(i)];
        acc[size_t(c)] += weights.row<float>(t)[j] * y;
      }
    }
    for (int64_t c = 0; c < d; ++c) out.row<float>(t)[c] = float(acc[size_t(c)]);
  }
}

}  // namespace recur::ref
