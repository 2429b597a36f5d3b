// The gated delta rule on the GPU, with its decay per head (Gated DeltaNet) and per key channel
// (Kimi Delta Attention), in both forms (recurrent: token by token; chunked: 64-token chunks)
// and fused with the gated norm, against ref::gated_delta_rule (double) on ragged batches
// whose segments straddle the chunk, with initial states, states carried across calls, and
// decays strong enough that e^G underflows within a chunk. f32 arithmetic: outputs ≤ 2e-5
// relative to their scale, states ≤ 2e-5 (as the CPU kernels); with the norm ≤ 1e-4.
#include <cstring>

#include "backend/cpu/reference.h"
#include "cuda/cuda_test_util.h"

namespace recur {
namespace {

using namespace testing;

class CudaDeltaRule : public CudaTest {};

const char* form_name(DeltaRuleForm f) {
  return f == DeltaRuleForm::kRecurrent ? "recurrent"
         : f == DeltaRuleForm::kChunked ? "chunked"
                                        : "auto";
}
const char* decay_name(bool per_channel) {
  return per_channel ? "per channel" : "per head";
}

struct DeltaErrors {
  double out, state;
  int64_t nonfinite;
};

// Runs the CUDA delta rule in `form` and the double reference from the same state.
DeltaErrors delta_errors(CudaOps& ops, const DeltaInputs& in, const Layout& lay,
                         const HostTensor& state0, int64_t hv, int64_t dv, DeltaRuleForm form) {
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
          max_abs_diff(s_got.f(), s_ref.f(), s_ref.numel()),
          count_nonfinite(got.f(), got.numel()) + count_nonfinite(s_got.f(), s_got.numel())};
}

void expect_close(const DeltaErrors& e, const std::string& what) {
  EXPECT_EQ(e.nonfinite, 0) << what;
  EXPECT_LE(e.out, 2e-5) << what;
  EXPECT_LE(e.state, 2e-5) << what;
}

TEST_F(CudaDeltaRule, FormsAgreeWithTheDefinition) {
  const int64_t dk = 16, dv = 24;
  for (bool per_channel : {false, true}) {
    for (int64_t ratio : {1, 2, 3}) {
      for (int len : {1, 63, 64, 65, 200}) {
        for (bool initial_state : {false, true}) {
          const int64_t hk = 2, hv = hk * ratio;
          DeltaInputs in(len, hk, hv, dk, dv, rng, per_channel);
          Layout lay({len}, {0}, 16, rng);
          HostTensor state0(DType::F32, {1, hv, dk, dv});
          if (initial_state) fill_random(state0, rng, 0.5f);
          for (DeltaRuleForm f : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
            const DeltaErrors e = delta_errors(ops(), in, lay, state0, hv, dv, f);
            const std::string name =
                std::string("delta rule ") + decay_name(per_channel) + " " + form_name(f);
            record_error(name + " out", e.out);
            record_error(name + " state", e.state);
            expect_close(e, name + " ratio=" + std::to_string(ratio) + " len=" +
                                std::to_string(len) + " init=" + std::to_string(initial_state));
          }
        }
      }
    }
  }
}

// Head sizes the chunked kernels stage in pieces: 18 × 10, not multiples of 4 (rows copied 4
// bytes at a time instead of 16); 20 × 40, 16-byte copies with key channels zero-filled up to
// the fragments' 32 and a second tile of value columns 8 wide.
TEST_F(CudaDeltaRule, OddHeadSizesStageTheirRowsInPieces) {
  const std::vector<int> lens = {130, 1, 65};
  for (const auto& [dk, dv] : {std::pair<int64_t, int64_t>{18, 10}, {20, 40}}) {
    for (bool per_channel : {false, true}) {
      const int64_t hk = 1, hv = 2;
      Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
      DeltaInputs in(lay.l.n_tokens, hk, hv, dk, dv, rng, per_channel);
      HostTensor state0(DType::F32, {int64_t(lens.size()), hv, dk, dv});
      fill_random(state0, rng, 0.5f);
      const DeltaErrors e = delta_errors(ops(), in, lay, state0, hv, dv, DeltaRuleForm::kChunked);
      expect_close(e, std::string("head sizes ") + std::to_string(dk) + "x" + std::to_string(dv) +
                          " " + decay_name(per_channel));
    }
  }
}

// More chunk records than the start-up scratch holds (128 MiB; 64 value heads of 16 × 16 take
// 2.4 MiB a chunk, so 26 chunks of two sequences): the state walks the chunks in two pieces, the
// second from the state the first left, which the shorter sequence does not reach.
TEST_F(CudaDeltaRule, ChunkRecordsInPieces) {
  const int64_t hk = 16, hv = 64, dk = 16, dv = 16;
  const std::vector<int> lens = {3300, 70};
  Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
  DeltaInputs in(lay.l.n_tokens, hk, hv, dk, dv, rng, false);
  HostTensor state0(DType::F32, {int64_t(lens.size()), hv, dk, dv});
  fill_random(state0, rng, 0.5f);
  const DeltaErrors e = delta_errors(ops(), in, lay, state0, hv, dv, DeltaRuleForm::kChunked);
  expect_close(e, "chunk records in pieces");
}

// Model head sizes (dk = dv = 128: Qwen3-Next's and Kimi Linear's), a ragged batch mixing
// decode and prompt sequences (segments of 1, chunk ± 1 and two chunks).
TEST_F(CudaDeltaRule, ModelHeadSizesOnARaggedBatch) {
  const int64_t hk = 2, hv = 4, dk = 128, dv = 128;
  const std::vector<int> lens = {1, 65, 7, 130, 1, 63, 64};
  Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
  for (bool per_channel : {false, true}) {
    DeltaInputs in(lay.l.n_tokens, hk, hv, dk, dv, rng, per_channel);
    HostTensor state0(DType::F32, {int64_t(lens.size()), hv, dk, dv});
    fill_random(state0, rng, 0.1f);
    for (DeltaRuleForm f :
         {DeltaRuleForm::kAuto, DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
      ops().begin_forward(lay.l, {}, {});
      const DeltaErrors e = delta_errors(ops(), in, lay, state0, hv, dv, f);
      const std::string name =
          std::string("delta rule 128x128 ") + decay_name(per_channel) + " " + form_name(f);
      record_error(name + " out", e.out);
      record_error(name + " state", e.state);
      expect_close(e, name);
    }
  }
}

// Decode: one token per sequence, many sequences (the recurrent kernel), per key channel.
TEST_F(CudaDeltaRule, PerChannelDecodeOfOneTokenPerSequence) {
  const int64_t hk = 4, hv = 8, dk = 128, dv = 64;
  const std::vector<int> lens(9, 1);
  Layout lay(lens, std::vector<int>(lens.size(), 40), 16, rng);
  DeltaInputs in(lay.l.n_tokens, hk, hv, dk, dv, rng, true);
  HostTensor state0(DType::F32, {int64_t(lens.size()), hv, dk, dv});
  fill_random(state0, rng, 0.3f);
  ops().begin_forward(lay.l, {}, {});
  const DeltaErrors e = delta_errors(ops(), in, lay, state0, hv, dv, DeltaRuleForm::kAuto);
  record_error("delta rule per channel decode out", e.out);
  record_error("delta rule per channel decode state", e.state);
  expect_close(e, "per-channel decode");
}

// Strong decays (every tenth log-decay −60: e^G of a chunk underflows, and a chunked form that
// split e^(G_i − G_j) into e^G_i · e^−G_j would overflow) stay finite and exact, in both forms
// and for both decays, with a state to forget.
TEST_F(CudaDeltaRule, StrongDecaysStayFinite) {
  const int64_t hk = 2, hv = 2, dk = 32, dv = 32;
  const std::vector<int> lens = {1, 64, 150};
  Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
  for (bool per_channel : {false, true}) {
    DeltaInputs in(lay.l.n_tokens, hk, hv, dk, dv, rng, per_channel, DecayStrength::kUnderflow);
    HostTensor state0(DType::F32, {int64_t(lens.size()), hv, dk, dv});
    fill_random(state0, rng, 0.5f);
    for (DeltaRuleForm f :
         {DeltaRuleForm::kAuto, DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
      const DeltaErrors e = delta_errors(ops(), in, lay, state0, hv, dv, f);
      const std::string name =
          std::string("delta rule strong decay ") + decay_name(per_channel) + " " + form_name(f);
      record_error(name + " out", e.out);
      record_error(name + " state", e.state);
      expect_close(e, name);
    }
  }
}

// A sequence fed over several calls (pieces of 1, chunk − 1, chunk + 1 and the rest, the
// state carried in the pool) equals the reference over the whole sequence; and a ragged batch
// in one call equals each sequence run alone, bit for bit. Both decays.
TEST_F(CudaDeltaRule, StateCarriesAcrossCallsAndBatchesSplit) {
  const int64_t hk = 1, hv = 3, dk = 16, dv = 16;
  for (bool per_channel : {false, true}) {
    const int len = 200;
    DeltaInputs in(len, hk, hv, dk, dv, rng, per_channel);
    HostTensor state0(DType::F32, {1, hv, dk, dv});
    fill_random(state0, rng, 0.3f);
    DeviceTensor dq = dev(in.q), dk_ = dev(in.k), dv_ = dev(in.v), dg = dev(in.g),
                 db = dev(in.beta), dstate = dev(state0);
    HostTensor out(DType::F32, {len, hv, dv}), ref = out, s_ref = state0;
    DeviceTensor dout = poisoned(out);
    int done = 0;
    for (int piece : {1, 63, 65, len - 129}) {
      Layout p({piece}, {done}, 16, rng);
      p.slot[0] = 0;
      ops().gated_delta_rule(
          dq.t.slice_rows(done, done + piece), dk_.t.slice_rows(done, done + piece),
          dv_.t.slice_rows(done, done + piece), dg.t.slice_rows(done, done + piece),
          db.t.slice_rows(done, done + piece), dstate.t, p.l, dout.t.slice_rows(done, done + piece),
          Tensor{});
      done += piece;
    }
    Layout whole({len}, {0}, 16, rng);
    ref::gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, s_ref.t, whole.l, ref.t);
    const double scale = std::max(1.0, max_abs(ref.f(), ref.numel()));
    const double eo = max_abs_diff(host(dout, out).f(), ref.f(), out.numel()) / scale;
    const double es = max_abs_diff(host(dstate, state0).f(), s_ref.f(), s_ref.numel());
    record_error(std::string("delta rule in pieces ") + decay_name(per_channel), std::max(eo, es));
    EXPECT_LE(eo, 2e-5) << decay_name(per_channel);
    EXPECT_LE(es, 2e-5) << decay_name(per_channel);
  }
  for (bool per_channel : {false, true}) {
    const std::vector<int> lens = {1, 65, 7, 130};
    Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
    const int64_t n = lay.l.n_tokens;
    DeltaInputs in(n, hk, hv, dk, dv, rng, per_channel);
    HostTensor state(DType::F32, {int64_t(lens.size()), hv, dk, dv});
    fill_random(state, rng, 0.3f);
    DeviceTensor dq = dev(in.q), dk_ = dev(in.k), dv_ = dev(in.v), dg = dev(in.g),
                 db = dev(in.beta);
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
    EXPECT_TRUE(same_bits(host(o_all, out), host(o_sep, out))) << decay_name(per_channel);
    EXPECT_TRUE(same_bits(host(s_all, state), host(s_sep, state))) << decay_name(per_channel);
  }
}

// The delta rule with the gated norm (one kernel when every sequence has one token) against
// the ops.cpp default (the two ops), bit for bit (out, normed and state), and against the
// references; both gate activations, both decays; heads of 128 (the models'), 96 and 32
// channels; f32 and bf16 norm weights. A batch with a prompt and heads of 256 take the default,
// checked against the references.
TEST_F(CudaDeltaRule, WithTheGatedNormEqualsTheDefault) {
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
    for (bool per_channel : {false, true}) {
      for (GateActivation act : {GateActivation::kSilu, GateActivation::kSigmoid}) {
        for (const Case& c : cases) {
          Layout lay(c.lens, std::vector<int>(c.lens.size(), 0), 16, rng);
          const int64_t n = lay.l.n_tokens, n_seqs = int64_t(c.lens.size());
          DeltaInputs in(n, c.hk, c.hv, c.dk, c.dv, rng, per_channel);
          HostTensor state(DType::F32, {n_seqs, c.hv, c.dk, c.dv});
          HostTensor gate(DType::F32, {n, c.hv, c.dv});
          HostTensor w(wt, {c.dv}), out(DType::F32, {n, c.hv, c.dv});
          fill_random(state, rng, 0.2f);
          fill_random(gate, rng);
          fill_random(w, rng, 0.5f, 1.0f);
          DeviceTensor dq = dev(in.q), dk_ = dev(in.k), dv_ = dev(in.v), dg = dev(in.g);
          DeviceTensor db = dev(in.beta), dgate = dev(gate);
          const Tensor dw = weight(w);
          HostTensor got_out[2] = {out, out}, got_norm[2] = {out, out};
          HostTensor got_state[2] = {state, state};
          for (int path = 0; path < 2; ++path) {  // the backend's op, then the default's two ops
            DeviceTensor ds = dev(state), dout = poisoned(out), dnorm = poisoned(out);
            ops().begin_forward(lay.l, {}, {});
            if (path == 0) {
              ops().gated_delta_rule_norm(dq.t, dk_.t, dv_.t, dg.t, db.t, ds.t, lay.l, dout.t,
                                          Tensor{}, dgate.t, dw, 1e-6f, act, dnorm.t);
            } else {
              ops().Ops::gated_delta_rule_norm(dq.t, dk_.t, dv_.t, dg.t, db.t, ds.t, lay.l, dout.t,
                                               Tensor{}, dgate.t, dw, 1e-6f, act, dnorm.t);
            }
            got_out[path] = host(dout, out), got_norm[path] = host(dnorm, out);
            got_state[path] = host(ds, state);
          }
          const bool silu = act == GateActivation::kSilu;
          const std::string what = std::string(dtype_name(wt)) + " " + decay_name(per_channel) +
                                   (silu ? " silu" : " sigmoid") + " dk=" + std::to_string(c.dk) +
                                   " dv=" + std::to_string(c.dv) +
                                   " seqs=" + std::to_string(n_seqs);
          ASSERT_EQ(count_nonfinite(got_norm[0].f(), out.numel()), 0) << what;
          EXPECT_TRUE(same_bits(got_out[0], got_out[1])) << what;
          EXPECT_TRUE(same_bits(got_norm[0], got_norm[1])) << what;
          EXPECT_TRUE(same_bits(got_state[0], got_state[1])) << what;
          HostTensor s_ref = state, o_ref = out, n_ref = out;
          ref::gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, s_ref.t, lay.l, o_ref.t);
          ref::rms_norm_gated(o_ref.t, gate.t, w.t, 1e-6f, act, n_ref.t);
          const double scale = std::max(1.0, max_abs(n_ref.f(), n_ref.numel()));
          const double err = max_abs_diff(got_norm[0].f(), n_ref.f(), out.numel()) / scale;
          record_error(std::string("delta rule + gated norm ") + (silu ? "silu " : "sigmoid ") +
                           decay_name(per_channel),
                       err);
          EXPECT_LE(err, 1e-4) << what;
          EXPECT_LE(max_abs_diff(got_state[0].f(), s_ref.f(), state.numel()), 2e-5) << what;
        }
      }
    }
  }
}

}  // namespace
}  // namespace recur
