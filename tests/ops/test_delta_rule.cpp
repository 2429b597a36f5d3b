// The gated delta rule against its double-precision definition (ref::gated_delta_rule), for both
// decays (per head: Gated DeltaNet; per key channel: Kimi Delta Attention) and every form
// (recurrent, chunked, auto), on ragged batches whose segments straddle the 64-token chunk,
// with states carried across calls and decays from none to strong.
#include <array>
#include <cstring>
#include <string>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/reference.h"
#include "ops/op_test_util.h"

namespace recur {
namespace {

using testing::DecayStrength;
using testing::DeltaInputs;
using testing::fill_random;
using testing::HostTensor;
using testing::Layout;
using testing::max_abs;
using testing::max_abs_diff;

constexpr DeltaRuleForm kForms[] = {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked,
                                    DeltaRuleForm::kAuto};

const char* form_name(DeltaRuleForm f) {
  return f == DeltaRuleForm::kRecurrent ? "recurrent"
         : f == DeltaRuleForm::kChunked ? "chunked"
                                        : "auto";
}

// Outputs and final states of one gated_delta_rule call.
struct DeltaRun {
  HostTensor state, out;
};

DeltaRun run_kernel(CpuOps& ops, const DeltaInputs& in, const HostTensor& state0,
                    const SeqLayout& l, DeltaRuleForm form) {
  const int64_t hk = in.q.t.shape[1], dk = in.q.t.shape[2], hv = in.v.t.shape[1],
                dv = in.v.t.shape[2];
  (void)hk;
  DeltaRun r{state0, HostTensor(DType::F32, {l.n_tokens, hv, dv})};
  HostTensor scratch(DType::U8, {int64_t(ops.gated_delta_rule_scratch_bytes(int(dk), int(dv)))});
  ops.gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, r.state.t, l, r.out.t, scratch.t,
                       form);
  return r;
}

DeltaRun run_reference(const DeltaInputs& in, const HostTensor& state0, const SeqLayout& l) {
  DeltaRun r{state0, HostTensor(DType::F32, {l.n_tokens, in.v.t.shape[1], in.v.t.shape[2]})};
  ref::gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, r.state.t, l, r.out.t);
  return r;
}

// Outputs within 2e-5 of the definition relative to their scale (at least 1); states within
// 2e-5 absolute.
void expect_matches(const DeltaRun& got, const DeltaRun& want, const std::string& what) {
  const int64_t no = want.out.numel(), ns = want.state.numel();
  const double scale = std::max(1.0, max_abs(want.out.f(), no));
  EXPECT_LE(max_abs_diff(got.out.f(), want.out.f(), no) / scale, 2e-5) << "outputs, " << what;
  EXPECT_LE(max_abs_diff(got.state.f(), want.state.f(), ns), 2e-5) << "states, " << what;
}

class DeltaRule : public ::testing::Test {
 protected:
  CpuOps ops{2};
  std::mt19937 rng{99};
};

// The recurrent form's code paths by key head dim (AVX-512 keeps the state of 16 and 32 key
// channels in registers, others make passes over memory) and value head dims around the
// 16-lane strips, with a carried state, for both decays.
TEST_F(DeltaRule, RecurrentMatchesDefinitionForEveryHeadShape) {
  for (bool per_key : {false, true}) {
    for (int64_t dk : {16, 20, 32, 33, 40}) {
      for (int64_t dv : {16, 24, 33}) {
        const int64_t hk = 1, hv = 2;
        const int len = 5;
        DeltaInputs in(len, hk, hv, dk, dv, rng, per_key);
        Layout lay({len}, {0}, 16, rng);
        HostTensor state0(DType::F32, {1, hv, dk, dv});
        fill_random(state0, rng, 0.5f);
        expect_matches(run_kernel(ops, in, state0, lay.l, DeltaRuleForm::kRecurrent),
                       run_reference(in, state0, lay.l),
                       "per_key=" + std::to_string(per_key) + " dk=" + std::to_string(dk) +
                           " dv=" + std::to_string(dv));
      }
    }
  }
}

// Every form against the definition, for the lengths around the 64-token chunk, with and
// without an initial state, for value/key head ratios 1, 2, 3, key and value head sizes apart.
TEST_F(DeltaRule, EveryFormAgreesWithTheDefinition) {
  struct Dims {
    int64_t dk, dv;
  };
  for (bool per_key : {false, true}) {
    for (const Dims d : {Dims{16, 24}, Dims{33, 31}}) {
      for (int64_t ratio : {1, 2, 3}) {
        for (int len : {1, 63, 64, 65, 200}) {
          for (bool initial_state : {false, true}) {
            const int64_t hk = 2, hv = hk * ratio;
            DeltaInputs in(len, hk, hv, d.dk, d.dv, rng, per_key);
            Layout lay({len}, {0}, 16, rng);
            HostTensor state0(DType::F32, {1, hv, d.dk, d.dv});
            if (initial_state) fill_random(state0, rng, 0.5f);
            const DeltaRun want = run_reference(in, state0, lay.l);
            for (DeltaRuleForm form : kForms) {
              expect_matches(run_kernel(ops, in, state0, lay.l, form), want,
                             std::string(form_name(form)) + " per_key=" + std::to_string(per_key) +
                                 " dk=" + std::to_string(d.dk) + " ratio=" + std::to_string(ratio) +
                                 " len=" + std::to_string(len) +
                                 " init=" + std::to_string(initial_state));
            }
          }
        }
      }
    }
  }
}

// Strong decays: per-token log-decays down to -20 on some heads or key channels (chunk sums far
// below -80, where e^G underflows and e^-G overflows), none on others. Every form stays finite
// and follows the definition.
TEST_F(DeltaRule, StrongDecaysStayFiniteAndAccurate) {
  for (bool per_key : {false, true}) {
    for (int len : {64, 65, 130, 200}) {
      const int64_t hk = 2, hv = 4, dk = per_key ? 32 : 33, dv = 20;
      DeltaInputs in(len, hk, hv, dk, dv, rng, per_key, DecayStrength::kStrong);
      // The data is what this test claims: some per-token decays near -20, some chunk sums
      // below -80 and some channels without decay.
      const int64_t channels = in.g.numel() / len;
      double min_g = 0, min_chunk_sum = 0;
      int64_t undecayed = 0;
      for (int64_t c = 0; c < channels; ++c) {
        double sum = 0;
        bool any = false;
        for (int64_t t = 0; t < std::min(len, 64); ++t) {
          const float gv = in.g.f()[t * channels + c];
          min_g = std::min(min_g, double(gv));
          sum += gv;
          any = any || gv != 0.0f;
        }
        min_chunk_sum = std::min(min_chunk_sum, sum);
        undecayed += any ? 0 : 1;
      }
      ASSERT_LT(min_g, -19.0);
      ASSERT_LT(min_chunk_sum, -300.0);
      ASSERT_GT(undecayed, 0);

      Layout lay({len}, {0}, 16, rng);
      HostTensor state0(DType::F32, {1, hv, dk, dv});
      fill_random(state0, rng, 0.5f);
      const DeltaRun want = run_reference(in, state0, lay.l);
      for (DeltaRuleForm form : kForms) {
        const DeltaRun got = run_kernel(ops, in, state0, lay.l, form);
        const std::string what = std::string(form_name(form)) +
                                 " per_key=" + std::to_string(per_key) +
                                 " len=" + std::to_string(len);
        for (int64_t i = 0; i < got.out.numel(); ++i)
          ASSERT_TRUE(std::isfinite(got.out.f()[i])) << what;
        for (int64_t i = 0; i < got.state.numel(); ++i)
          ASSERT_TRUE(std::isfinite(got.state.f()[i])) << what;
        expect_matches(got, want, what);
      }
    }
  }
}

// A ragged batch of several sequences (lengths 1 and around the chunk) in one call equals each
// sequence run alone, bit for bit, and the definition.
TEST_F(DeltaRule, RaggedBatchEqualsSeparateCallsAndTheDefinition) {
  for (bool per_key : {false, true}) {
    const int64_t hk = 2, hv = 4, dk = 33, dv = 32;
    const std::vector<int> lens = {1, 65, 7, 130, 63, 64, 1};
    Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
    const int64_t n = lay.l.n_tokens;
    DeltaInputs in(n, hk, hv, dk, dv, rng, per_key, DecayStrength::kStrong);
    HostTensor state(DType::F32, {int64_t(lens.size()), hv, dk, dv});
    fill_random(state, rng, 0.3f);
    const DeltaRun batch = run_kernel(ops, in, state, lay.l, DeltaRuleForm::kAuto);
    expect_matches(batch, run_reference(in, state, lay.l), "per_key=" + std::to_string(per_key));
    HostTensor state_sep = state;
    HostTensor scratch(DType::U8, {int64_t(ops.gated_delta_rule_scratch_bytes(int(dk), int(dv)))});
    HostTensor out_sep(DType::F32, {n, hv, dv});
    for (size_t s = 0; s < lens.size(); ++s) {
      const int64_t b = lay.seq_start[s], e = lay.seq_start[s + 1];
      Layout one({lens[s]}, {0}, 16, rng);
      one.slot[0] = lay.slot[s];
      ops.gated_delta_rule(in.q.t.slice_rows(b, e), in.k.t.slice_rows(b, e),
                           in.v.t.slice_rows(b, e), in.g.t.slice_rows(b, e),
                           in.beta.t.slice_rows(b, e), state_sep.t, one.l,
                           out_sep.t.slice_rows(b, e), scratch.t);
    }
    EXPECT_EQ(max_abs_diff(batch.out.f(), out_sep.f(), batch.out.numel()), 0.0);
    EXPECT_EQ(max_abs_diff(batch.state.f(), state_sep.f(), state.numel()), 0.0);
  }
}

// Rows [begin, end) of every tensor of `in`, as inputs of their own.
DeltaInputs rows_of(const DeltaInputs& in, int64_t begin, int64_t end, std::mt19937& rng) {
  const int64_t hk = in.q.t.shape[1], dk = in.q.t.shape[2], hv = in.v.t.shape[1],
                dv = in.v.t.shape[2];
  DeltaInputs part(end - begin, hk, hv, dk, dv, rng, in.g.t.ndim == 3);
  auto copy = [&](const HostTensor& src, HostTensor& dst) {
    const int64_t row = src.numel() / src.t.shape[0];
    std::memcpy(dst.f(), src.f() + begin * row, size_t((end - begin) * row) * 4);
  };
  copy(in.q, part.q);
  copy(in.k, part.k);
  copy(in.v, part.v);
  copy(in.g, part.g);
  copy(in.beta, part.beta);
  return part;
}

// Two sequences fed in steps as a server does (chunked prefill of one beside decode of the
// other, then both decoding; kAuto throughout) give the outputs and final states of the
// definition over each whole sequence.
TEST_F(DeltaRule, CarriesStateFromChunkedPrefillIntoDecode) {
  const int64_t hk = 1, hv = 3, dk = 32, dv = 24;
  // Per step, the tokens each sequence brings.
  const std::vector<std::array<int, 2>> steps = {{65, 1}, {64, 63}, {1, 1}, {1, 64}, {1, 1}};
  for (bool per_key : {false, true}) {
    std::array<int, 2> total = {0, 0};
    for (const auto& st : steps) total[0] += st[0], total[1] += st[1];
    std::vector<DeltaInputs> whole;
    HostTensor state0(DType::F32, {2, hv, dk, dv});
    fill_random(state0, rng, 0.3f);
    std::vector<DeltaRun> want;
    for (int s = 0; s < 2; ++s) {
      whole.emplace_back(total[s], hk, hv, dk, dv, rng, per_key);
      Layout one({total[s]}, {0}, 16, rng);
      one.slot[0] = s;
      want.push_back(run_reference(whole.back(), state0, one.l));
    }
    HostTensor state = state0;
    std::vector<HostTensor> outs;
    for (int s = 0; s < 2; ++s)
      outs.emplace_back(DType::F32, std::initializer_list<int64_t>{total[s], hv, dv});
    std::array<int, 2> done = {0, 0};
    for (const auto& st : steps) {
      // The step's batch: sequence 0's tokens, then sequence 1's, as one set of inputs.
      const int n = st[0] + st[1];
      DeltaInputs batch(n, hk, hv, dk, dv, rng, per_key);
      for (int s = 0; s < 2; ++s) {
        const DeltaInputs part = rows_of(whole[size_t(s)], done[s], done[s] + st[s], rng);
        const int64_t at = s == 0 ? 0 : st[0];
        for (auto [src, dst] : {std::pair{&part.q, &batch.q}, std::pair{&part.k, &batch.k},
                                std::pair{&part.v, &batch.v}, std::pair{&part.g, &batch.g},
                                std::pair{&part.beta, &batch.beta}}) {
          const int64_t row = src->numel() / src->t.shape[0];
          std::memcpy(dst->f() + at * row, src->f(), size_t(src->numel()) * 4);
        }
      }
      Layout lay({st[0], st[1]}, {done[0], done[1]}, 16, rng);
      lay.slot[0] = 0, lay.slot[1] = 1;
      const DeltaRun got = run_kernel(ops, batch, state, lay.l, DeltaRuleForm::kAuto);
      state = got.state;
      for (int s = 0; s < 2; ++s) {
        const int64_t at = s == 0 ? 0 : st[0];
        std::memcpy(outs[size_t(s)].f() + done[s] * hv * dv, got.out.f() + at * hv * dv,
                    size_t(st[s] * hv * dv) * 4);
        done[s] += st[s];
      }
    }
    for (int s = 0; s < 2; ++s) {
      const HostTensor& w = want[size_t(s)].out;
      const double scale = std::max(1.0, max_abs(w.f(), w.numel()));
      EXPECT_LE(max_abs_diff(outs[size_t(s)].f(), w.f(), w.numel()) / scale, 2e-5)
          << "per_key=" << per_key << " sequence " << s;
      const int64_t slot = int64_t(hv * dk * dv);
      EXPECT_LE(max_abs_diff(state.f() + s * slot, want[size_t(s)].state.f() + s * slot, slot),
                2e-5)
          << "per_key=" << per_key << " sequence " << s;
    }
  }
}

// kAuto runs a one-token sequence in the recurrent form and a longer one chunked, per sequence
// of a batch: bit for bit what those forms give.
TEST_F(DeltaRule, AutoPicksTheRecurrentFormForOneTokenAndTheChunkedOneForMore) {
  for (bool per_key : {false, true}) {
    const int64_t hk = 1, hv = 2, dk = 20, dv = 20;
    Layout lay({1, 70}, {0, 0}, 16, rng);
    DeltaInputs in(lay.l.n_tokens, hk, hv, dk, dv, rng, per_key);
    HostTensor state0(DType::F32, {2, hv, dk, dv});
    fill_random(state0, rng, 0.5f);
    const DeltaRun autos = run_kernel(ops, in, state0, lay.l, DeltaRuleForm::kAuto);
    const DeltaRun rec = run_kernel(ops, in, state0, lay.l, DeltaRuleForm::kRecurrent);
    const DeltaRun chunk = run_kernel(ops, in, state0, lay.l, DeltaRuleForm::kChunked);
    const int64_t row = hv * dv;
    // Token 0 is the one-token sequence's; the rest the long one's.
    EXPECT_EQ(std::memcmp(autos.out.f(), rec.out.f(), size_t(row) * 4), 0) << per_key;
    EXPECT_NE(std::memcmp(autos.out.f(), chunk.out.f(), size_t(row) * 4), 0)
        << "the forms must differ in their rounding for this test to tell them apart";
    EXPECT_EQ(std::memcmp(autos.out.f() + row, chunk.out.f() + row, size_t(70 * row) * 4), 0)
        << per_key;
  }
}

// gated_delta_rule_scratch_bytes is enough for either decay: a chunked run writes nothing past
// it, for one thread and for several.
TEST_F(DeltaRule, ScratchBytesSufficeForEitherDecay) {
  for (int threads : {1, 3}) {
    CpuOps pool_ops(threads);
    for (bool per_key : {false, true}) {
      for (int64_t dk : {16, 33}) {
        const int64_t hk = 1, hv = 3, dv = 40;
        const std::vector<int> lens = {130, 64, 65};
        Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
        DeltaInputs in(lay.l.n_tokens, hk, hv, dk, dv, rng, per_key);
        HostTensor state(DType::F32, {int64_t(lens.size()), hv, dk, dv});
        HostTensor out(DType::F32, {lay.l.n_tokens, hv, dv});
        const int64_t bytes = int64_t(pool_ops.gated_delta_rule_scratch_bytes(int(dk), int(dv)));
        const int64_t guard = bytes;  // room for any overrun to land in
        HostTensor scratch(DType::U8, {bytes + guard});
        std::memset(scratch.t.data, 0xA5, size_t(bytes + guard));
        const Tensor exact = Tensor::contiguous(scratch.t.data, DType::U8, {bytes});
        pool_ops.gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, state.t, lay.l, out.t,
                                  exact, DeltaRuleForm::kChunked);
        const uint8_t* tail = scratch.t.ptr<uint8_t>() + bytes;
        int64_t touched = 0;
        for (int64_t i = 0; i < guard; ++i) touched += tail[i] != 0xA5;
        EXPECT_EQ(touched, 0) << "threads=" << threads << " per_key=" << per_key << " dk=" << dk;
      }
    }
  }
}

// The default gated_delta_rule_norm: the rule, then the gated norm with the given activation
// over each value head.
TEST_F(DeltaRule, NormDefaultIsTheRuleThenTheGatedNorm) {
  for (bool per_key : {false, true}) {
    for (GateActivation act : {GateActivation::kSilu, GateActivation::kSigmoid}) {
      const int64_t hk = 1, hv = 2, dk = 16, dv = 24;
      Layout lay({1, 66}, {0, 0}, 16, rng);
      const int64_t n = lay.l.n_tokens;
      DeltaInputs in(n, hk, hv, dk, dv, rng, per_key);
      HostTensor state(DType::F32, {2, hv, dk, dv}), gate(DType::F32, {n, hv, dv}),
          norm_w(DType::BF16, {dv});
      fill_random(state, rng, 0.5f);
      fill_random(gate, rng, 2.0f);
      fill_random(norm_w, rng, 0.5f, 1.0f);
      HostTensor state_ref = state, out(DType::F32, {n, hv, dv}), normed = out, out_ref = out,
                 normed_ref = out;
      HostTensor scratch(DType::U8,
                         {int64_t(ops.gated_delta_rule_scratch_bytes(int(dk), int(dv)))});
      ops.gated_delta_rule_norm(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, state.t, lay.l, out.t,
                                scratch.t, gate.t, norm_w.t, 1e-6f, act, normed.t);
      ref::gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, state_ref.t, lay.l,
                            out_ref.t);
      ref::rms_norm_gated(out_ref.t, gate.t, norm_w.t, 1e-6f, act, normed_ref.t);
      EXPECT_LE(max_abs_diff(out.f(), out_ref.f(), out.numel()), 2e-5);
      EXPECT_LE(max_abs_diff(normed.f(), normed_ref.f(), normed.numel()), 1e-4)
          << "per_key=" << per_key << " act=" << int(act);
    }
  }
}

}  // namespace
}  // namespace recur
