// Sequence-wise CUDA ops (conv, gated delta rule, paged attention) against the CPU scalar
// references on ragged batches whose segments straddle the 64-token chunk, with initial states.
// All f32 arithmetic: conv ≤ 1e-5, delta rule ≤ 2e-5 (as the CPU kernels), attention ≤ 2e-5.
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/reference.h"
#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using namespace testing;

class CudaSequence : public CudaTest {};

// Decode layouts (one token per sequence) take the fused output-and-state kernel.
TEST_F(CudaSequence, ConvDecodeStepMatchesReference) {
  for (int64_t K : {2, 4}) {
    for (DType wt : {DType::BF16, DType::F32}) {
      const int64_t C = 300;
      const std::vector<int> lens = {1, 1, 1};
      Layout lay(lens, std::vector<int>{7, 0, 30}, 16, rng);
      const int64_t n = lay.l.n_tokens;
      HostTensor x(DType::F32, {n, C}), w(wt, {C, 1, K});
      HostTensor state(DType::F32, {int64_t(lens.size()), K - 1, C});
      fill_random(x, rng);
      fill_random(w, rng, 0.5f);
      fill_random(state, rng);
      auto dw = ops().adopt_weight(w.t);
      ASSERT_TRUE(dw.ok());
      HostTensor out(DType::F32, {n, C}), ref = out, st_ref = state;
      DeviceTensor dx = dev(x), dstate = dev(state), dout = poisoned(out);
      ops().begin_forward(lay.l, {}, {});
      ops().conv1d_causal_silu(dx.t, dw.value(), dstate.t, lay.l, dout.t);
      ref::conv1d_causal_silu(x.t, w.t, st_ref.t, lay.l, ref.t);
      const double err = max_abs_diff(host(dout, out).f(), ref.f(), n * C);
      record_error("conv1d_causal_silu decode", err);
      EXPECT_LE(err, 1e-5) << "K=" << K;
      EXPECT_EQ(max_abs_diff(host(dstate, state).f(), st_ref.f(), state.numel()), 0.0);
    }
  }
}

// The fused Gated DeltaNet input stage (one token per sequence) equals the ops it replaces run
// on the GPU bit for bit, and the CPU references to their tolerances; other layouts take the
// ops themselves. Shapes: the model's (Hk 16, Hv 32, dk = dv = 128, K 4), three value heads
// per key head, and dk 256 (eight channels per lane); weight dtypes mixed.
TEST_F(CudaSequence, GdnInputsDecodeEqualsTheOpsItFuses) {
  struct Case {
    int64_t hk, hv, dk, dv, K;
    DType wt, gate_t;
    std::vector<int> lens;
  };
  const Case cases[] = {{16, 32, 128, 128, 4, DType::BF16, DType::BF16, {1, 1, 1}},
                        {2, 6, 64, 32, 3, DType::F32, DType::F32, {1, 1}},
                        {1, 1, 256, 64, 2, DType::BF16, DType::F32, {1, 1, 1, 1}},
                        {2, 6, 64, 32, 3, DType::BF16, DType::F32, {2, 1, 3}}};  // not decode
  for (const Case& cs : cases) {
    Layout lay(cs.lens, std::vector<int>(cs.lens.size(), 5), 16, rng);
    GdnInputCase c(lay.l.n_tokens, cs.hk, cs.hv, cs.dk, cs.dv, cs.K, int64_t(cs.lens.size()), cs.wt,
                   cs.gate_t, rng);
    auto dw = ops().adopt_weight(c.conv_w.t);
    auto dal = ops().adopt_weight(c.a_log.t);
    auto ddt = ops().adopt_weight(c.dt_bias.t);
    ASSERT_TRUE(dw.ok() && dal.ok() && ddt.ok());
    DeviceTensor dqkvz = dev(c.qkvz), dba = dev(c.ba);
    // Two runs from the same state: the op as the backend runs it, and the default's ops.
    struct Run {
      DeviceTensor state, mixed, a, b, conv_out, z, g, beta;
    };
    Run runs[2];
    for (Run& r : runs) {
      r.state = dev(c.state);
      r.mixed = poisoned(c.mixed), r.a = poisoned(c.a), r.b = poisoned(c.b);
      r.conv_out = poisoned(c.conv_out), r.z = poisoned(c.z);
      r.g = poisoned(c.g), r.beta = poisoned(c.beta);
    }
    auto args = [&](Run& r) {
      GdnInputArgs in = c.args();
      in.qkvz = dqkvz.t, in.ba = dba.t;
      in.conv_weight = dw.value(), in.a_log = dal.value(), in.dt_bias = ddt.value();
      in.conv_state = r.state.t, in.mixed = r.mixed.t, in.a = r.a.t, in.b = r.b.t;
      in.conv_out = r.conv_out.t, in.z = r.z.t, in.g = r.g.t, in.beta = r.beta.t;
      return in;
    };
    ops().begin_forward(lay.l, {}, {});
    ops().gdn_inputs(args(runs[0]), lay.l);
    ops().Ops::gdn_inputs(args(runs[1]), lay.l);
    GdnInputCase ref = c;
    ref.reference(lay.l);
    const HostTensor outs[2][5] = {
        {host(runs[0].conv_out, c.conv_out), host(runs[0].z, c.z), host(runs[0].g, c.g),
         host(runs[0].beta, c.beta), host(runs[0].state, c.state)},
        {host(runs[1].conv_out, c.conv_out), host(runs[1].z, c.z), host(runs[1].g, c.g),
         host(runs[1].beta, c.beta), host(runs[1].state, c.state)}};
    const HostTensor* refs[5] = {&ref.conv_out, &ref.z, &ref.g, &ref.beta, &ref.state};
    const double tol[5] = {1e-5, 0.0, 1e-6, 1e-6, 0.0};
    const char* names[5] = {"conv_out", "z", "g", "beta", "state"};
    for (int i = 0; i < 5; ++i) {
      const int64_t len = refs[i]->numel();
      EXPECT_EQ(max_abs_diff(outs[0][i].f(), outs[1][i].f(), len), 0.0)
          << names[i] << " hk=" << cs.hk << " dk=" << cs.dk;
      const double err = max_abs_diff(outs[0][i].f(), refs[i]->f(), len);
      record_error(std::string("gdn_inputs ") + names[i], err);
      EXPECT_LE(err, tol[i]) << names[i] << " hk=" << cs.hk << " dk=" << cs.dk;
    }
  }
}

// The fused gated-attention input stage equals the ops it replaces on the GPU bit for bit, and
// the CPU references to the rope tolerance: the model's shape (16 heads, 2 kv heads, hd 256,
// 64 rotary channels) at decode, and a ragged prompt batch with an f32 norm weight.
TEST_F(CudaSequence, AttentionInputsEqualTheOpsTheyFuse) {
  struct Case {
    int64_t heads, kv, hd;
    int rot;
    DType norm_t;
    std::vector<int> lens, first;
  };
  const Case cases[] = {{16, 2, 256, 64, DType::BF16, {1, 1, 1}, {2050, 0, 31}},
                        {4, 2, 40, 20, DType::F32, {3, 1, 5}, {0, 17, 40}},
                        // Rotated pairs two registers apart (half 64), every channel rotated.
                        {8, 2, 128, 128, DType::BF16, {1, 2}, {100, 7}}};
  for (const Case& cs : cases) {
    Layout lay(cs.lens, cs.first, 16, rng);
    AttentionInputCase c(lay.l, lay.n_blocks(), cs.heads, cs.kv, cs.hd, cs.rot, cs.norm_t, rng);
    auto dqn = ops().adopt_weight(c.q_norm.t);
    auto dkn = ops().adopt_weight(c.k_norm.t);
    ASSERT_TRUE(dqn.ok() && dkn.ok());
    DeviceTensor dqg = dev(c.qg);
    struct Run {
      DeviceTensor k, v, q, gate, kc, vc;
    };
    Run runs[2];
    for (Run& r : runs) {
      r.k = dev(c.k), r.v = dev(c.v), r.kc = dev(c.kc), r.vc = dev(c.vc);
      r.q = poisoned(c.q), r.gate = poisoned(c.gate);
    }
    auto args = [&](Run& r) {
      AttentionInputArgs a = c.args();
      a.qg = dqg.t, a.q_norm = dqn.value(), a.k_norm = dkn.value();
      a.k = r.k.t, a.v = r.v.t, a.q = r.q.t, a.gate = r.gate.t;
      a.k_cache = r.kc.t, a.v_cache = r.vc.t;
      return a;
    };
    ops().begin_forward(lay.l, {}, {});
    ops().attention_inputs(args(runs[0]), lay.l);
    ops().Ops::attention_inputs(args(runs[1]), lay.l);
    AttentionInputCase ref = c;
    ref.reference(lay.l);
    const HostTensor* refs[5] = {&ref.q, &ref.gate, &ref.k, &ref.kc, &ref.vc};
    const double tol[5] = {2e-5, 0.0, 2e-5, 2e-5, 0.0};
    const char* names[5] = {"q", "gate", "k", "k cache", "v cache"};
    for (int i = 0; i < 5; ++i) {
      const DeviceTensor* d0[5] = {&runs[0].q, &runs[0].gate, &runs[0].k, &runs[0].kc, &runs[0].vc};
      const DeviceTensor* d1[5] = {&runs[1].q, &runs[1].gate, &runs[1].k, &runs[1].kc, &runs[1].vc};
      const HostTensor g0 = host(*d0[i], *refs[i]), g1 = host(*d1[i], *refs[i]);
      const int64_t len = refs[i]->numel();
      EXPECT_EQ(max_abs_diff(g0.f(), g1.f(), len), 0.0) << names[i] << " hd=" << cs.hd;
      const double err = max_abs_diff(g0.f(), refs[i]->f(), len);
      record_error(std::string("attention_inputs ") + names[i], err);
      EXPECT_LE(err, tol[i]) << names[i] << " hd=" << cs.hd;
    }
  }
}

TEST_F(CudaSequence, ConvMatchesReferenceAndCarriesStateAcrossCalls) {
  for (int64_t K : {2, 3, 4}) {
    for (DType wt : {DType::BF16, DType::F32}) {
      const int64_t C = 37;
      const std::vector<int> lens = {1, 5, 64, 65, 2};
      Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
      const int64_t n = lay.l.n_tokens;
      HostTensor x(DType::F32, {n, C}), w(wt, {C, 1, K});
      HostTensor state(DType::F32, {int64_t(lens.size()), K - 1, C});
      fill_random(x, rng);
      fill_random(w, rng, 0.5f);
      fill_random(state, rng);
      auto dw = ops().adopt_weight(w.t);
      ASSERT_TRUE(dw.ok());
      HostTensor out(DType::F32, {n, C}), ref = out, st_ref = state;
      DeviceTensor dx = dev(x), dstate = dev(state), dout = poisoned(out);
      ops().begin_forward(lay.l, {}, {});
      ops().conv1d_causal_silu(dx.t, dw.value(), dstate.t, lay.l, dout.t);
      ref::conv1d_causal_silu(x.t, w.t, st_ref.t, lay.l, ref.t);
      const double err = max_abs_diff(host(dout, out).f(), ref.f(), n * C);
      record_error("conv1d_causal_silu", err);
      EXPECT_LE(err, 1e-5) << "K=" << K;
      EXPECT_EQ(max_abs_diff(host(dstate, state).f(), st_ref.f(), state.numel()), 0.0);

      // The last sequence fed in pieces of 1, 2 and the rest equals one call (ad hoc uploads).
      const int last = 3, len = lens[size_t(last)];
      const int64_t base = lay.seq_start[size_t(last)];
      HostTensor whole(DType::F32, {len, C});
      DeviceTensor s_whole = dev(st_ref), s_piece = dev(st_ref), dwhole = poisoned(whole);
      Layout one({len}, {0}, 16, rng);
      one.slot[0] = lay.slot[size_t(last)];
      ops().conv1d_causal_silu(dx.t.slice_rows(base, base + len), dw.value(), s_whole.t, one.l,
                               dwhole.t);
      HostTensor gw = host(dwhole, whole);
      int done = 0;
      for (int piece : {1, 2, len - 3}) {
        Layout p({piece}, {done}, 16, rng);
        p.slot[0] = lay.slot[size_t(last)];
        HostTensor o(DType::F32, {piece, C});
        DeviceTensor dpo = poisoned(o);
        ops().conv1d_causal_silu(dx.t.slice_rows(base + done, base + done + piece), dw.value(),
                                 s_piece.t, p.l, dpo.t);
        ASSERT_EQ(max_abs_diff(host(dpo, o).f(), gw.f() + done * C, piece * C), 0.0);
        done += piece;
      }
      EXPECT_EQ(max_abs_diff(host(s_piece, state).f(), host(s_whole, state).f(), state.numel()),
                0.0);
    }
  }
}

// Runs the CUDA delta rule in `form` and the double reference from the same state; returns
// {output error relative to scale, state error}.
std::pair<double, double> delta_errors(CudaOps& ops, const DeltaInputs& in, const Layout& lay,
                                       const HostTensor& state0, int64_t hv, int64_t dv,
                                       DeltaRuleForm form) {
  const int64_t n = lay.l.n_tokens;
  DeviceTensor dq(ops, in.q), dk(ops, in.k), dv_(ops, in.v), dg(ops, in.g), db(ops, in.beta);
  DeviceTensor dstate(ops, state0);
  HostTensor out(DType::F32, {n, hv, dv}), ref = out, s_ref = state0;
  DeviceTensor dout(ops, out);
  dout.poison();
  HostTensor scratch_h(
      DType::U8, {int64_t(ops.gated_delta_rule_scratch_bytes(int(in.q.t.shape[2]), int(dv))) + 1});
  DeviceTensor scratch(ops, scratch_h);
  ops.gated_delta_rule(dq.t, dk.t, dv_.t, dg.t, db.t, dstate.t, lay.l, dout.t, scratch.t, form);
  ref::gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, s_ref.t, lay.l, ref.t);
  HostTensor got = dout.download(ops, out), s_got = dstate.download(ops, state0);
  const double scale = std::max(1.0, max_abs(ref.f(), ref.numel()));
  return {max_abs_diff(got.f(), ref.f(), ref.numel()) / scale,
          max_abs_diff(s_got.f(), s_ref.f(), s_ref.numel())};
}

const char* form_name(DeltaRuleForm f) {
  return f == DeltaRuleForm::kRecurrent ? "recurrent"
         : f == DeltaRuleForm::kChunked ? "chunked"
                                        : "auto";
}

TEST_F(CudaSequence, DeltaRuleFormsAgreeWithTheDefinition) {
  const int64_t dk = 16, dv = 24;
  for (int64_t ratio : {1, 2, 3}) {
    for (int len : {1, 63, 64, 65, 200}) {
      for (bool initial_state : {false, true}) {
        const int64_t hk = 2, hv = hk * ratio;
        DeltaInputs in(len, hk, hv, dk, dv, rng);
        Layout lay({len}, {0}, 16, rng);
        HostTensor state0(DType::F32, {1, hv, dk, dv});
        if (initial_state) fill_random(state0, rng, 0.5f);
        for (DeltaRuleForm f : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
          const auto [eo, es] = delta_errors(ops(), in, lay, state0, hv, dv, f);
          record_error(std::string("delta rule ") + form_name(f) + " out", eo);
          record_error(std::string("delta rule ") + form_name(f) + " state", es);
          EXPECT_LE(eo, 2e-5) << form_name(f) << " ratio=" << ratio << " len=" << len
                              << " init=" << initial_state;
          EXPECT_LE(es, 2e-5) << form_name(f) << " ratio=" << ratio << " len=" << len;
        }
      }
    }
  }
}

// The model's head sizes (dk = dv = 128), a ragged batch mixing decode and prompt sequences.
TEST_F(CudaSequence, DeltaRuleAtModelHeadSizesOnARaggedBatch) {
  const int64_t hk = 2, hv = 4, dk = 128, dv = 128;
  const std::vector<int> lens = {1, 65, 7, 130, 1};
  Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
  DeltaInputs in(lay.l.n_tokens, hk, hv, dk, dv, rng);
  HostTensor state0(DType::F32, {int64_t(lens.size()), hv, dk, dv});
  fill_random(state0, rng, 0.1f);
  for (DeltaRuleForm f :
       {DeltaRuleForm::kAuto, DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
    ops().begin_forward(lay.l, {}, {});
    const auto [eo, es] = delta_errors(ops(), in, lay, state0, hv, dv, f);
    record_error(std::string("delta rule 128x128 ") + form_name(f) + " out", eo);
    record_error(std::string("delta rule 128x128 ") + form_name(f) + " state", es);
    EXPECT_LE(eo, 2e-5) << form_name(f);
    EXPECT_LE(es, 2e-5) << form_name(f);
  }
}

// A ragged batch in one call equals each sequence run alone, bit for bit.
TEST_F(CudaSequence, DeltaRuleRaggedBatchEqualsSeparateCalls) {
  const int64_t hk = 1, hv = 3, dk = 16, dv = 16;
  const std::vector<int> lens = {1, 65, 7, 130};
  Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
  const int64_t n = lay.l.n_tokens;
  DeltaInputs in(n, hk, hv, dk, dv, rng);
  HostTensor state(DType::F32, {int64_t(lens.size()), hv, dk, dv});
  fill_random(state, rng, 0.3f);
  DeviceTensor dq = dev(in.q), dk_ = dev(in.k), dv_ = dev(in.v), dg = dev(in.g), db = dev(in.beta);
  DeviceTensor s_all = dev(state), s_sep = dev(state);
  HostTensor out(DType::F32, {n, hv, dv});
  DeviceTensor o_all = poisoned(out), o_sep = poisoned(out);
  ops().gated_delta_rule(dq.t, dk_.t, dv_.t, dg.t, db.t, s_all.t, lay.l, o_all.t, Tensor{});
  for (size_t s = 0; s < lens.size(); ++s) {
    const int64_t b = lay.seq_start[s], e = lay.seq_start[s + 1];
    Layout one({lens[s]}, {0}, 16, rng);
    one.slot[0] = lay.slot[s];
    ops().gated_delta_rule(dq.t.slice_rows(b, e), dk_.t.slice_rows(b, e), dv_.t.slice_rows(b, e),
                           dg.t.slice_rows(b, e), db.t.slice_rows(b, e), s_sep.t, one.l,
                           o_sep.t.slice_rows(b, e), Tensor{});
  }
  EXPECT_EQ(max_abs_diff(host(o_all, out).f(), host(o_sep, out).f(), out.numel()), 0.0);
  EXPECT_EQ(max_abs_diff(host(s_all, state).f(), host(s_sep, state).f(), state.numel()), 0.0);
}

// The delta rule with the gated norm (one kernel when every sequence has one token) against
// the two ops it fuses, bit for bit (out, normed and state), and against the scalar references;
// heads of 128 (the model's), 96 and 32 channels; f32 and bf16 norm weights. A batch with a
// prompt and heads of 256 take the two ops, checked against the references.
TEST_F(CudaSequence, DeltaRuleNormEqualsTheTwoOps) {
  struct Case {
    int64_t hk, hv, dk, dv;
    std::vector<int> lens;
  };
  const Case cases[] = {{2, 4, 128, 128, {1, 1, 1}},
                        {1, 3, 16, 96, {1, 1}},
                        {2, 2, 64, 32, {1}},
                        {2, 4, 128, 128, {1, 7, 1}},
                        {1, 2, 32, 256, {1, 1}}};
  for (DType wt : {DType::F32, DType::BF16}) {
    for (const Case& c : cases) {
      Layout lay(c.lens, std::vector<int>(c.lens.size(), 0), 16, rng);
      const int64_t n = lay.l.n_tokens, n_seqs = int64_t(c.lens.size());
      DeltaInputs in(n, c.hk, c.hv, c.dk, c.dv, rng);
      HostTensor state(DType::F32, {n_seqs, c.hv, c.dk, c.dv}), gate(DType::F32, {n, c.hv, c.dv});
      HostTensor w(wt, {c.dv}), out(DType::F32, {n, c.hv, c.dv});
      fill_random(state, rng, 0.2f);
      fill_random(gate, rng);
      fill_random(w, rng, 0.5f, 1.0f);
      DeviceTensor dq = dev(in.q), dk_ = dev(in.k), dv_ = dev(in.v), dg = dev(in.g);
      DeviceTensor db = dev(in.beta), dgate = dev(gate);
      const Tensor dw = ops().adopt_weight(w.t).value();
      HostTensor got_out[2] = {out, out}, got_norm[2] = {out, out}, got_state[2] = {state, state};
      for (int path = 0; path < 2; ++path) {  // the backend's op, then the default's two ops
        DeviceTensor ds = dev(state), dout = poisoned(out), dnorm = poisoned(out);
        ops().begin_forward(lay.l, {}, {});
        if (path == 0) {
          ops().gated_delta_rule_norm(dq.t, dk_.t, dv_.t, dg.t, db.t, ds.t, lay.l, dout.t, Tensor{},
                                      dgate.t, dw, 1e-6f, dnorm.t);
        } else {
          ops().Ops::gated_delta_rule_norm(dq.t, dk_.t, dv_.t, dg.t, db.t, ds.t, lay.l, dout.t,
                                           Tensor{}, dgate.t, dw, 1e-6f, dnorm.t);
        }
        got_out[path] = host(dout, out), got_norm[path] = host(dnorm, out);
        got_state[path] = host(ds, state);
      }
      const std::string what = std::string(dtype_name(wt)) + " dk=" + std::to_string(c.dk) +
                               " dv=" + std::to_string(c.dv) + " seqs=" + std::to_string(n_seqs);
      ASSERT_EQ(count_nonfinite(got_norm[0].f(), out.numel()), 0) << what;
      EXPECT_EQ(std::memcmp(got_out[0].f(), got_out[1].f(), size_t(out.numel()) * 4), 0) << what;
      EXPECT_EQ(std::memcmp(got_norm[0].f(), got_norm[1].f(), size_t(out.numel()) * 4), 0) << what;
      EXPECT_EQ(std::memcmp(got_state[0].f(), got_state[1].f(), size_t(state.numel()) * 4), 0)
          << what;
      HostTensor s_ref = state, o_ref = out, n_ref = out;
      ref::gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, s_ref.t, lay.l, o_ref.t);
      ref::rms_norm_gated(o_ref.t, gate.t, w.t, 1e-6f, n_ref.t);
      const double scale = std::max(1.0, max_abs(n_ref.f(), n_ref.numel()));
      const double err = max_abs_diff(got_norm[0].f(), n_ref.f(), out.numel()) / scale;
      record_error("delta rule + gated norm", err);
      EXPECT_LE(err, 1e-4) << what;
      EXPECT_LE(max_abs_diff(got_state[0].f(), s_ref.f(), state.numel()), 2e-5) << what;
    }
  }
}

// Decode tokens with long histories (context splits and their merge), a fresh prompt and a
// chunk continuing a prompt; group sizes 1, 2, 3, 4, 8 (the model's) and 16 (the tiled
// fallback); head dims 20, 64, 128 and 256 (multiples of 32 at few tokens: the decode kernel).
TEST_F(CudaSequence, PagedAttentionMatchesReferenceOnRaggedBatchesWithHistory) {
  struct Case {
    int64_t group, hd;
    int block_size;
    std::vector<int> lens, first;
  };
  const Case cases[] = {{1, 20, 16, {1, 33, 17}, {70, 0, 16}},
                        {3, 20, 16, {1, 33, 17}, {70, 0, 16}},
                        {3, 20, 32, {1, 1, 40}, {2000, 333, 5}},
                        {8, 256, 16, {1, 1}, {3000, 77}},
                        {8, 256, 16, {70, 1}, {0, 600}},
                        {16, 256, 16, {1, 3}, {300, 40}},  // too large for the warp kernel
                        // The decode kernel at other head dims, group sizes and block sizes:
                        // chunks crossing blocks, splits ending mid-chunk, one-token contexts.
                        {2, 64, 32, {1, 1, 1}, {5000, 31, 0}},
                        {4, 128, 16, {1, 2, 1}, {1000, 3, 63}},
                        // Several new tokens of a sequence after a history: chunks of earlier
                        // positions (loaded before the kernel's wait at group 8) and new ones.
                        {8, 128, 16, {5, 1}, {100, 40}},
                        {4, 128, 16, {5, 1}, {100, 40}},
                        // One token, a long history: more splits than the merge holds at once.
                        {8, 256, 16, {1}, {6000}}};
  for (const Case& c : cases) {
    const int64_t kv = 2, heads = kv * c.group, hd = c.hd;
    Layout lay(c.lens, c.first, c.block_size, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(DType::F32, {lay.n_blocks(), kv, hd, c.block_size}),
        vc(DType::F32, {lay.n_blocks(), kv, c.block_size, hd});
    fill_random(kc, rng);
    fill_random(vc, rng);
    HostTensor k(DType::F32, {n, kv, hd}), v = k, q(DType::F32, {n, heads, hd});
    fill_random(k, rng);
    fill_random(v, rng);
    fill_random(q, rng);
    DeviceTensor dkc = dev(kc), dvc = dev(vc), dk = dev(k), dv = dev(v), dq = dev(q);
    HostTensor kc_ref = kc, vc_ref = vc;
    ops().begin_forward(lay.l, {}, {});
    ops().kv_cache_write(dk.t, dv.t, dkc.t, dvc.t, lay.l);
    ref::kv_cache_write(k.t, v.t, kc_ref.t, vc_ref.t, lay.l);
    ASSERT_EQ(max_abs_diff(host(dkc, kc).f(), kc_ref.f(), kc.numel()), 0.0);
    ASSERT_EQ(max_abs_diff(host(dvc, vc).f(), vc_ref.f(), vc.numel()), 0.0);
    HostTensor out(DType::F32, {n, heads, hd}), ref = out;
    DeviceTensor dout = poisoned(out);
    const float scale = 1.0f / std::sqrt(float(hd));
    ops().paged_attention(dq.t, dkc.t, dvc.t, lay.l, scale, dout.t);
    ref::paged_attention(q.t, kc_ref.t, vc_ref.t, lay.l, scale, ref.t);
    const double err = max_abs_diff(host(dout, out).f(), ref.f(), out.numel());
    record_error("paged_attention", err);
    EXPECT_LE(err, 2e-5) << "group=" << c.group << " hd=" << hd << " first=" << c.first[0];
    // With the output gate: paged_attention then mul_sigmoid, bit for bit.
    HostTensor gate(DType::F32, {n, heads * hd}), flat = gate;
    fill_random(gate, rng);
    DeviceTensor dgate = dev(gate), gated = poisoned(flat), composed = poisoned(flat);
    ops().paged_attention_gated(dq.t, dkc.t, dvc.t, lay.l, scale, dgate.t, gated.t);
    ops().Ops::paged_attention_gated(dq.t, dkc.t, dvc.t, lay.l, scale, dgate.t, composed.t);
    EXPECT_EQ(
        std::memcmp(host(gated, flat).f(), host(composed, flat).f(), size_t(flat.numel()) * 4), 0)
        << "gated, group=" << c.group << " hd=" << hd;
  }
}

}  // namespace
}  // namespace recur
