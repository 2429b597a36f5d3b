// Sequence-wise kernels (conv, gated delta rule, paged attention) and MoE against the scalar
// references, on ragged batches whose segments straddle the chunk size.
#include <cstring>
#include <numeric>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/reference.h"
#include "ops/op_test_util.h"

namespace recur {
namespace {

using testing::DeltaInputs;
using testing::fill_random;
using testing::HostTensor;
using testing::Layout;
using testing::max_abs;
using testing::max_abs_diff;

class SequenceOps : public ::testing::Test {
 protected:
  CpuOps ops{2};
  std::mt19937 rng{99};
};

TEST_F(SequenceOps, ConvMatchesReferenceAndCarriesStateAcrossCalls) {
  for (int64_t K : {1, 2, 3, 4, 7}) {
    const int64_t C = 37;
    const std::vector<int> lens = {1, 5, 64, 65};
    std::vector<int> zeros(lens.size(), 0);
    Layout lay(lens, zeros, 16, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor x(DType::F32, {n, C}), w(DType::BF16, {C, 1, K});
    HostTensor state(DType::F32, {int64_t(lens.size()), K - 1, C});
    fill_random(x, rng);
    fill_random(w, rng, 0.5f);
    fill_random(state, rng);  // a non-zero initial state
    HostTensor st_ref = state, out(DType::F32, {n, C}), ref(DType::F32, {n, C});
    ops.conv1d_causal_silu(x.t, w.t, state.t, lay.l, out.t);
    ref::conv1d_causal_silu(x.t, w.t, st_ref.t, lay.l, ref.t);
    EXPECT_LE(max_abs_diff(out.f(), ref.f(), n * C), 1e-5) << "K=" << K;
    EXPECT_LE(max_abs_diff(state.f(), st_ref.f(), state.numel()), 0) << "K=" << K;

    // The last sequence fed in pieces of 1, 2 and the rest gives the same outputs and state.
    const int last = int(lens.size()) - 1;
    HostTensor piece_state = st_ref;  // any starting state; compare against one call from it
    HostTensor whole_state = st_ref;
    const int len = lens[size_t(last)];
    const int64_t base = lay.seq_start[size_t(last)];
    HostTensor whole(DType::F32, {len, C});
    Layout one({len}, {0}, 16, rng);
    one.slot[0] = lay.slot[size_t(last)];
    ops.conv1d_causal_silu(x.t.slice_rows(base, base + len), w.t, whole_state.t, one.l, whole.t);
    int done = 0;
    for (int piece : {1, 2, len - 3}) {
      Layout p({piece}, {done}, 16, rng);
      p.slot[0] = lay.slot[size_t(last)];
      HostTensor o(DType::F32, {piece, C});
      ops.conv1d_causal_silu(x.t.slice_rows(base + done, base + done + piece), w.t, piece_state.t,
                             p.l, o.t);
      ASSERT_LE(max_abs_diff(o.f(), whole.f() + done * C, piece * C), 1e-6);
      done += piece;
    }
    EXPECT_LE(max_abs_diff(piece_state.f(), whole_state.f(), state.numel()), 0);
  }
}

// The Gated DeltaNet input stage equals the references of its parts, on a ragged batch with
// one- and many-token sequences, at several head shapes and conv kernel sizes.
TEST_F(SequenceOps, GdnInputsEqualTheReferencesOfTheirParts) {
  struct Dims {
    int64_t hk, hv, dk, dv, K;
  };
  for (const Dims& d : {Dims{2, 4, 16, 8, 4}, Dims{3, 3, 32, 16, 2}, Dims{1, 3, 8, 24, 3}}) {
    const std::vector<int> lens = {1, 3, 1, 5};
    Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
    testing::GdnInputCase c(lay.l.n_tokens, d.hk, d.hv, d.dk, d.dv, d.K, int64_t(lens.size()),
                            DType::BF16, DType::F32, rng);
    testing::GdnInputCase ref = c;
    ops.gdn_inputs(c.args(), lay.l);
    ref.reference(lay.l);
    const int64_t n = c.n;
    EXPECT_LE(max_abs_diff(c.conv_out.f(), ref.conv_out.f(), n * c.C), 1e-5) << "hk=" << d.hk;
    EXPECT_EQ(max_abs_diff(c.z.f(), ref.z.f(), c.z.numel()), 0.0);
    EXPECT_LE(max_abs_diff(c.g.f(), ref.g.f(), n * d.hv), 1e-6);
    EXPECT_LE(max_abs_diff(c.beta.f(), ref.beta.f(), n * d.hv), 1e-6);
    EXPECT_EQ(max_abs_diff(c.state.f(), ref.state.f(), c.state.numel()), 0.0);
  }
}

// The gated-attention input stage equals the references of its parts on a ragged batch.
TEST_F(SequenceOps, AttentionInputsEqualTheReferencesOfTheirParts) {
  for (int rot : {8, 32}) {
    Layout lay({1, 4, 2}, {70, 0, 15}, 16, rng);
    testing::AttentionInputCase c(lay.l, lay.n_blocks(), 4, 2, 32, rot, DType::BF16, rng);
    testing::AttentionInputCase ref = c;
    ops.attention_inputs(c.args(), lay.l);
    ref.reference(lay.l);
    const int64_t nq = c.q.numel();
    EXPECT_LE(max_abs_diff(c.q.f(), ref.q.f(), nq), 2e-5) << "rot=" << rot;
    EXPECT_EQ(max_abs_diff(c.gate.f(), ref.gate.f(), nq), 0.0);
    EXPECT_LE(max_abs_diff(c.k.f(), ref.k.f(), c.k.numel()), 2e-5);
    EXPECT_LE(max_abs_diff(c.kc.f(), ref.kc.f(), c.kc.numel()), 2e-5);
    EXPECT_EQ(max_abs_diff(c.vc.f(), ref.vc.f(), c.vc.numel()), 0.0);
  }
}

// The recurrent form's code paths by key head dim (registers for 16 and 32, memory passes
// otherwise) and value head dims around the 16-lane strips, with a carried state.
TEST_F(SequenceOps, DeltaRuleRecurrentMatchesDefinitionForEveryHeadShape) {
  for (int64_t dk : {16, 20, 32, 40}) {
    for (int64_t dv : {16, 24, 33}) {
      const int64_t hk = 1, hv = 2;
      const int len = 5;
      DeltaInputs in(len, hk, hv, dk, dv, rng);
      Layout lay({len}, {0}, 16, rng);
      HostTensor state0(DType::F32, {1, hv, dk, dv});
      fill_random(state0, rng, 0.5f);
      HostTensor scratch(DType::U8,
                         {int64_t(ops.gated_delta_rule_scratch_bytes(int(dk), int(dv)))});
      HostTensor s_ref = state0, s_rec = state0;
      HostTensor o_ref(DType::F32, {len, hv, dv}), o_rec = o_ref;
      ref::gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, s_ref.t, lay.l, o_ref.t);
      ops.gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, s_rec.t, lay.l, o_rec.t,
                           scratch.t, DeltaRuleForm::kRecurrent);
      const double scale = std::max(1.0, max_abs(o_ref.f(), o_ref.numel()));
      EXPECT_LE(max_abs_diff(o_rec.f(), o_ref.f(), o_ref.numel()) / scale, 2e-5)
          << "dk=" << dk << " dv=" << dv;
      EXPECT_LE(max_abs_diff(s_rec.f(), s_ref.f(), s_ref.numel()), 2e-5)
          << "dk=" << dk << " dv=" << dv;
    }
  }
}

// Chunked and recurrent forms against the double-precision definition, for the lengths around
// the 64-token chunk, with and without an initial state, for value/key head ratios 1, 2, 3.
TEST_F(SequenceOps, DeltaRuleChunkedAndRecurrentAgreeWithTheDefinition) {
  const int64_t dk = 16, dv = 24;
  for (int64_t ratio : {1, 2, 3}) {
    for (int len : {1, 63, 64, 65, 200}) {
      for (bool initial_state : {false, true}) {
        const int64_t hk = 2, hv = hk * ratio;
        DeltaInputs in(len, hk, hv, dk, dv, rng);
        std::vector<int> zeros = {0};
        Layout lay({len}, zeros, 16, rng);
        HostTensor state0(DType::F32, {1, hv, dk, dv});
        if (initial_state) fill_random(state0, rng, 0.5f);
        HostTensor scratch(DType::U8,
                           {int64_t(ops.gated_delta_rule_scratch_bytes(int(dk), int(dv)))});
        HostTensor s_ref = state0, s_rec = state0, s_chunk = state0;
        HostTensor o_ref(DType::F32, {len, hv, dv}), o_rec = o_ref, o_chunk = o_ref;
        ref::gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, s_ref.t, lay.l, o_ref.t);
        ops.gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, s_rec.t, lay.l, o_rec.t,
                             scratch.t, DeltaRuleForm::kRecurrent);
        ops.gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, s_chunk.t, lay.l, o_chunk.t,
                             scratch.t, DeltaRuleForm::kChunked);
        const double scale = std::max(1.0, max_abs(o_ref.f(), o_ref.numel()));
        const int64_t no = o_ref.numel(), ns = s_ref.numel();
        EXPECT_LE(max_abs_diff(o_rec.f(), o_ref.f(), no) / scale, 2e-5)
            << "recurrent ratio=" << ratio << " len=" << len << " init=" << initial_state;
        EXPECT_LE(max_abs_diff(o_chunk.f(), o_ref.f(), no) / scale, 2e-5)
            << "chunked ratio=" << ratio << " len=" << len << " init=" << initial_state;
        EXPECT_LE(max_abs_diff(s_chunk.f(), s_ref.f(), ns), 2e-5);
        EXPECT_LE(max_abs_diff(s_rec.f(), s_ref.f(), ns), 2e-5);
      }
    }
  }
}

// A ragged batch of several sequences in one call equals each sequence run alone.
TEST_F(SequenceOps, DeltaRuleRaggedBatchEqualsSeparateCalls) {
  const int64_t hk = 1, hv = 3, dk = 16, dv = 16;
  const std::vector<int> lens = {1, 65, 7, 130};
  std::vector<int> zeros(lens.size(), 0);
  Layout lay(lens, zeros, 16, rng);
  const int64_t n = lay.l.n_tokens;
  DeltaInputs in(n, hk, hv, dk, dv, rng);
  HostTensor state(DType::F32, {int64_t(lens.size()), hv, dk, dv});
  fill_random(state, rng, 0.3f);
  HostTensor state_sep = state;
  HostTensor scratch(DType::U8, {int64_t(ops.gated_delta_rule_scratch_bytes(int(dk), int(dv)))});
  HostTensor out(DType::F32, {n, hv, dv}), out_sep = out;
  ops.gated_delta_rule(in.q.t, in.k.t, in.v.t, in.g.t, in.beta.t, state.t, lay.l, out.t, scratch.t);
  for (size_t s = 0; s < lens.size(); ++s) {
    const int64_t b = lay.seq_start[s], e = lay.seq_start[s + 1];
    Layout one({lens[s]}, {0}, 16, rng);
    one.slot[0] = lay.slot[s];
    ops.gated_delta_rule(in.q.t.slice_rows(b, e), in.k.t.slice_rows(b, e), in.v.t.slice_rows(b, e),
                         in.g.t.slice_rows(b, e), in.beta.t.slice_rows(b, e), state_sep.t, one.l,
                         out_sep.t.slice_rows(b, e), scratch.t);
  }
  EXPECT_EQ(max_abs_diff(out.f(), out_sep.f(), out.numel()), 0.0);
  EXPECT_EQ(max_abs_diff(state.f(), state_sep.f(), state.numel()), 0.0);
}

TEST_F(SequenceOps, PagedAttentionMatchesReferenceOnRaggedBatchesWithHistory) {
  for (int64_t group : {1, 3}) {
    const int64_t kv = 2, heads = kv * group, hd = 20;
    const int block_size = 16;
    // Sequences: a decode token with long history, a fresh prompt, a chunk continuing a prompt.
    const std::vector<int> lens = {1, 33, 17}, first = {70, 0, 16};
    Layout lay(lens, first, block_size, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(DType::F32, {lay.n_blocks(), kv, hd, block_size}),
        vc(DType::F32, {lay.n_blocks(), kv, block_size, hd});
    fill_random(kc, rng);  // stands for the history written by earlier calls
    fill_random(vc, rng);
    HostTensor k(DType::F32, {n, kv, hd}), v = k, q(DType::F32, {n, heads, hd});
    fill_random(k, rng);
    fill_random(v, rng);
    fill_random(q, rng);
    HostTensor kc_ref = kc, vc_ref = vc;
    ops.kv_cache_write(k.t, v.t, kc.t, vc.t, lay.l);
    ref::kv_cache_write(k.t, v.t, kc_ref.t, vc_ref.t, lay.l);
    ASSERT_EQ(max_abs_diff(kc.f(), kc_ref.f(), kc.numel()), 0.0);
    ASSERT_EQ(max_abs_diff(vc.f(), vc_ref.f(), vc.numel()), 0.0);
    HostTensor out(DType::F32, {n, heads, hd}), ref_out = out;
    const float scale = 1.0f / std::sqrt(float(hd));
    ops.paged_attention(q.t, kc.t, vc.t, lay.l, scale, out.t);
    ref::paged_attention(q.t, kc_ref.t, vc_ref.t, lay.l, scale, ref_out.t);
    EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), out.numel()), 2e-5) << "group=" << group;
  }
}

// Contexts long enough to be split into parts (kAttentionPartPositions each, up to
// kAttentionMaxParts), odd block sizes and head dims; results must match the reference and be
// bit-identical whatever the thread count and whatever else is in the batch.
TEST_F(SequenceOps, PagedAttentionSplitsLongContextsIdenticallyForAnyThreadsAndBatch) {
  struct Case {
    int64_t kv, group, hd;
    int block_size;
    std::vector<int> lens, first;
  };
  const int64_t P = CpuOps::kAttentionPartPositions;
  const std::vector<Case> cases = {
      {1, 2, 32, 16, {1, 1, 1}, {int(3 * P + 5), int(P - 1), 7}},
      {2, 3, 20, 12, {1, 2}, {int(2 * P + 100), int(P + 3)}},
      {1, 1, 17, 16, {1}, {int(CpuOps::kAttentionMaxParts * P + 3 * P + 40)}},
  };
  for (const Case& c : cases) {
    const int64_t heads = c.kv * c.group;
    Layout lay(c.lens, c.first, c.block_size, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(DType::F32, {lay.n_blocks(), c.kv, c.hd, c.block_size}),
        vc(DType::F32, {lay.n_blocks(), c.kv, c.block_size, c.hd});
    fill_random(kc, rng, 0.5f);
    fill_random(vc, rng);
    HostTensor q(DType::F32, {n, heads, c.hd});
    fill_random(q, rng);
    const float scale = 1.0f / std::sqrt(float(c.hd));
    HostTensor ref_out(DType::F32, {n, heads, c.hd});
    ref::paged_attention(q.t, kc.t, vc.t, lay.l, scale, ref_out.t);
    std::vector<HostTensor> outs;
    for (int threads : {1, 3, 16}) {
      CpuOps pool_ops(threads);
      outs.emplace_back(DType::F32, std::initializer_list<int64_t>{n, heads, c.hd});
      pool_ops.paged_attention(q.t, kc.t, vc.t, lay.l, scale, outs.back().t);
      EXPECT_LE(max_abs_diff(outs.back().f(), ref_out.f(), n * heads * c.hd), 2e-5)
          << "threads=" << threads << " hd=" << c.hd;
      EXPECT_EQ(std::memcmp(outs.back().f(), outs[0].f(), size_t(n * heads * c.hd) * 4), 0)
          << "threads=" << threads << " changed the result";
    }
    // Each sequence alone (its own layout view) gives the bits it got in the batch.
    for (int s = 0; s < lay.l.n_seqs; ++s) {
      const int32_t b = lay.seq_start[size_t(s)], e = lay.seq_start[size_t(s) + 1];
      const int32_t seq_start[2] = {0, e - b};
      SeqLayout one = lay.l;
      one.n_seqs = 1;
      one.n_tokens = e - b;
      one.seq_start = seq_start;
      one.slot = lay.l.slot + s;
      one.positions = lay.l.positions + b;
      one.block_start = lay.l.block_start + s;
      CpuOps pool_ops(4);
      HostTensor alone(DType::F32, {e - b, heads, c.hd});
      pool_ops.paged_attention(q.t.slice_rows(b, e), kc.t, vc.t, one, scale, alone.t);
      EXPECT_EQ(std::memcmp(alone.f(), outs[0].f() + int64_t(b) * heads * c.hd,
                            size_t((e - b) * heads * c.hd) * 4),
                0)
          << "sequence " << s << " alone differs from the batch";
    }
  }
}

TEST_F(SequenceOps, MoeRoutingAndExpertsMatchReference) {
  for (bool norm_topk : {true, false}) {
    const int64_t n = 9, d = 24, E = 7, k = 3, ff = 13;
    HostTensor logits(DType::F32, {n, E});
    fill_random(logits, rng, 2.0f);
    HostTensor ids(DType::I32, {n, k}), w(DType::F32, {n, k}), ids_ref = ids, w_ref = w;
    ops.moe_route(logits.t, int(k), norm_topk, ids.t, w.t);
    ref::moe_route(logits.t, int(k), norm_topk, ids_ref.t, w_ref.t);
    for (int64_t i = 0; i < n * k; ++i)
      ASSERT_EQ(ids.t.ptr<int32_t>()[i], ids_ref.t.ptr<int32_t>()[i]);
    EXPECT_LE(max_abs_diff(w.f(), w_ref.f(), n * k), 1e-6);

    std::vector<HostTensor> store;
    std::vector<ExpertWeights> experts;
    store.reserve(size_t(E) * 3);
    for (int64_t e = 0; e < E; ++e) {
      store.emplace_back(DType::BF16, std::initializer_list<int64_t>{ff, d});
      store.emplace_back(DType::BF16, std::initializer_list<int64_t>{ff, d});
      store.emplace_back(DType::BF16, std::initializer_list<int64_t>{d, ff});
      for (size_t j = store.size() - 3; j < store.size(); ++j) fill_random(store[j], rng, 0.3f);
      experts.push_back({store[store.size() - 3].t, store[store.size() - 2].t, store.back().t});
    }
    HostTensor x(DType::F32, {n, d}), out(DType::F32, {n, d}), ref_out = out;
    fill_random(x, rng);
    fill_random(out, rng);  // must be overwritten
    HostTensor scratch(
        DType::U8,
        {int64_t(ops.moe_experts_scratch_bytes(int(n), int(k), int(E), int(d), int(ff)))});
    ops.moe_experts(x.t, experts, ids.t, w.t, out.t, scratch.t);
    ref::moe_experts(x.t, experts, ids.t, w.t, ref_out.t);
    EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), n * d), 1e-5);

    // With a shared expert (the default's ops) against the references.
    HostTensor sg(DType::BF16, {ff, d}), su = sg, sd(DType::BF16, {d, ff});
    for (HostTensor* t : {&sg, &su, &sd}) fill_random(*t, rng, 0.3f);
    SharedExpertArgs shared;
    shared.w = {sg.t, su.t, sd.t};
    HostTensor score(DType::F32, {n, 1}), g(DType::F32, {n, ff}), u = g, h = g, y = x;
    fill_random(score, rng);
    shared.score = score.t, shared.gate = g.t, shared.up = u.t, shared.hidden = h.t;
    shared.out = y.t;
    HostTensor scratch2(
        DType::U8,
        {int64_t(ops.moe_experts_scratch_bytes(int(n), int(k) + 1, int(E) + 1, int(d), int(ff)))});
    fill_random(out, rng);
    ops.moe_experts_shared(x.t, experts, ids.t, w.t, shared, out.t, scratch2.t);
    testing::reference_moe_shared(x.t, experts, ids.t, w.t, shared.w, score.t, ref_out.t);
    EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), n * d), 1e-5);
  }
}

}  // namespace
}  // namespace recur
