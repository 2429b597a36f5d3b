// Sequence-wise kernels (conv, the input stages, paged attention) against the scalar references,
// on ragged batches whose segments straddle the chunk and block sizes. The gated delta rule is
// in test_delta_rule.cpp, MoE in test_moe_ops.cpp.
#include <cstring>
#include <numeric>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/reference.h"
#include "ops/op_test_util.h"

namespace recur {
namespace {

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
    HostTensor x(DType::F32, {n, C}), w(DType::BF16, {C, K});
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

// The Gated DeltaNet input stage (the default: conv, L2 norms, gates) equals the references of
// its parts, on a ragged batch with one- and many-token sequences, at several head shapes and
// conv kernel sizes, with mixed, a and b as strided views of one projection.
TEST_F(SequenceOps, GdnInputsEqualTheReferencesOfTheirParts) {
  struct Dims {
    int64_t hk, hv, dk, dv, K;
  };
  for (const Dims& d :
       {Dims{2, 4, 16, 8, 4}, Dims{3, 3, 32, 16, 2}, Dims{1, 3, 8, 24, 3}, Dims{1, 2, 33, 31, 4}}) {
    const std::vector<int> lens = {1, 3, 1, 5};
    Layout lay(lens, std::vector<int>(lens.size(), 0), 16, rng);
    testing::GdnInputCase c(lay.l.n_tokens, d.hk, d.hv, d.dk, d.dv, d.K, int64_t(lens.size()),
                            DType::BF16, DType::F32, rng);
    testing::GdnInputCase ref = c;
    ops.gdn_inputs(c.args(), lay.l);
    ref.reference(lay.l);
    const int64_t n = c.n;
    EXPECT_LE(max_abs_diff(c.conv_out.f(), ref.conv_out.f(), n * c.C), 1e-5) << "hk=" << d.hk;
    EXPECT_LE(max_abs_diff(c.g.f(), ref.g.f(), n * d.hv), 1e-6);
    EXPECT_LE(max_abs_diff(c.beta.f(), ref.beta.f(), n * d.hv), 1e-6);
    EXPECT_EQ(max_abs_diff(c.state.f(), ref.state.f(), c.state.numel()), 0.0);
    EXPECT_EQ(std::memcmp(c.proj.f(), ref.proj.f(), size_t(c.proj.numel()) * 4), 0)
        << "the projections are inputs only";
  }
}

// The attention input stage (the default: q and k normalised and rotated in place, the cache
// written) equals the references of its parts on a ragged batch, with value heads of the key
// heads' size and of another size, and grouped-query heads.
TEST_F(SequenceOps, AttentionInputsEqualTheReferencesOfTheirParts) {
  struct Dims {
    int64_t heads, kv, hd, dv;
    int rot;
  };
  for (const Dims& d : {Dims{4, 2, 32, 32, 8}, Dims{4, 2, 32, 32, 32}, Dims{6, 2, 24, 16, 24},
                        Dims{3, 3, 20, 33, 0}}) {
    Layout lay({1, 4, 2}, {70, 0, 15}, 16, rng);
    testing::AttentionInputCase c(lay.l, lay.n_blocks(), d.heads, d.kv, d.hd, d.dv, d.rot,
                                  DType::BF16, rng);
    testing::AttentionInputCase ref = c;
    ops.attention_inputs(c.args(), lay.l);
    ref.reference(lay.l);
    EXPECT_LE(max_abs_diff(c.q.f(), ref.q.f(), c.q.numel()), 2e-5) << "rot=" << d.rot;
    EXPECT_LE(max_abs_diff(c.k.f(), ref.k.f(), c.k.numel()), 2e-5);
    EXPECT_EQ(max_abs_diff(c.v.f(), ref.v.f(), c.v.numel()), 0.0);
    EXPECT_LE(max_abs_diff(c.kc.f(), ref.kc.f(), c.kc.numel()), 2e-5);
    EXPECT_EQ(max_abs_diff(c.vc.f(), ref.vc.f(), c.vc.numel()), 0.0) << "dv=" << d.dv;
  }
}

// Cache writes and attention on a ragged batch (a decode token with history, a fresh prompt, a
// chunk continuing a prompt), for grouped-query heads and value heads of other sizes than the
// key heads; then the gated default (attention, then the σ output gate).
TEST_F(SequenceOps, PagedAttentionMatchesReferenceOnRaggedBatchesWithHistory) {
  for (int64_t group : {1, 3}) {
    for (int64_t dv : {20, 12, 33}) {
      const int64_t kv = 2, heads = kv * group, hd = 20;
      const int block_size = 16;
      const std::vector<int> lens = {1, 33, 17}, first = {70, 0, 16};
      Layout lay(lens, first, block_size, rng);
      const int64_t n = lay.l.n_tokens;
      HostTensor kc(DType::F32, {lay.n_blocks(), kv, hd, block_size}),
          vc(DType::F32, {lay.n_blocks(), kv, block_size, dv});
      fill_random(kc, rng);  // stands for the history written by earlier calls
      fill_random(vc, rng);
      HostTensor k(DType::F32, {n, kv, hd}), v(DType::F32, {n, kv, dv}),
          q(DType::F32, {n, heads, hd});
      fill_random(k, rng);
      fill_random(v, rng);
      fill_random(q, rng);
      HostTensor kc_ref = kc, vc_ref = vc;
      ops.kv_cache_write(k.t, v.t, kc.t, vc.t, lay.l);
      ref::kv_cache_write(k.t, v.t, kc_ref.t, vc_ref.t, lay.l);
      ASSERT_EQ(max_abs_diff(kc.f(), kc_ref.f(), kc.numel()), 0.0);
      ASSERT_EQ(max_abs_diff(vc.f(), vc_ref.f(), vc.numel()), 0.0) << "dv=" << dv;
      HostTensor out(DType::F32, {n, heads, dv}), ref_out = out;
      fill_random(out, rng);  // must be overwritten
      const float scale = 1.0f / std::sqrt(float(hd));
      ops.paged_attention(q.t, kc.t, vc.t, lay.l, scale, out.t);
      ref::paged_attention(q.t, kc_ref.t, vc_ref.t, lay.l, scale, ref_out.t);
      EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), out.numel()), 2e-5)
          << "group=" << group << " dv=" << dv;

      HostTensor gate(DType::F32, {n, heads * dv}), gated(DType::F32, {n, heads * dv});
      fill_random(gate, rng, 2.0f);
      ops.paged_attention_gated(q.t, kc.t, vc.t, lay.l, scale, gate.t, gated.t);
      for (int64_t i = 0; i < gated.numel(); ++i) {
        const double want = ref_out.f()[i] / (1.0 + std::exp(-double(gate.f()[i])));
        ASSERT_NEAR(gated.f()[i], want, 2e-5) << "gated, group=" << group << " dv=" << dv;
      }
    }
  }
}

// A latent cache (Kimi's latent attention): one kv head whose values are the first dv channels
// of the keys, v_cache a view of k_cache. Writes through the view land in the keys; attention
// equals the reference, and the reference over the view equals it over a copied value cache.
// Several query heads per kv head, odd block sizes, contexts long enough to be split.
TEST_F(SequenceOps, PagedAttentionReadsValuesFromTheKeyCache) {
  for (int64_t group : {1, 4, 5}) {
    for (int block_size : {16, 5}) {
      const int64_t heads = group, hd = 24, dv = 16;
      const std::vector<int> lens = {1, 33, 17, 2}, first = {70, 0, 16, 1500};
      Layout lay(lens, first, block_size, rng);
      const int64_t n = lay.l.n_tokens;
      HostTensor kc(DType::F32, {lay.n_blocks(), 1, hd, block_size});
      fill_random(kc, rng);
      auto values_of = [&](HostTensor& keys) {
        Tensor v = keys.t;
        v.shape[2] = block_size, v.shape[3] = dv;
        v.stride[2] = 1, v.stride[3] = block_size;
        return v;
      };
      HostTensor k(DType::F32, {n, hd}), q(DType::F32, {n, heads, hd});
      fill_random(k, rng);
      fill_random(q, rng);
      HostTensor kc_ref = kc;
      ops.kv_cache_write(k.t.col_heads(0, 1, hd), k.t.col_heads(0, 1, dv), kc.t, values_of(kc),
                         lay.l);
      ref::kv_cache_write(k.t.col_heads(0, 1, hd), k.t.col_heads(0, 1, dv), kc_ref.t,
                          values_of(kc_ref), lay.l);
      ASSERT_EQ(max_abs_diff(kc.f(), kc_ref.f(), kc.numel()), 0.0);
      // The values as their own cache [blocks, 1, bs, dv].
      HostTensor vc(DType::F32, {lay.n_blocks(), 1, block_size, dv});
      for (int64_t b = 0; b < lay.n_blocks(); ++b)
        for (int64_t p = 0; p < block_size; ++p)
          for (int64_t d = 0; d < dv; ++d)
            vc.f()[(b * block_size + p) * dv + d] = kc.f()[(b * hd + d) * block_size + p];
      HostTensor out(DType::F32, {n, heads, dv}), ref_out = out, copy_out = out;
      fill_random(out, rng);  // must be overwritten
      const float scale = 1.0f / std::sqrt(float(hd));
      ops.paged_attention(q.t, kc.t, values_of(kc), lay.l, scale, out.t);
      ref::paged_attention(q.t, kc.t, values_of(kc), lay.l, scale, ref_out.t);
      ref::paged_attention(q.t, kc.t, vc.t, lay.l, scale, copy_out.t);
      ASSERT_EQ(max_abs_diff(ref_out.f(), copy_out.f(), out.numel()), 0.0);
      EXPECT_LE(max_abs_diff(out.f(), ref_out.f(), out.numel()), 2e-5)
          << "group=" << group << " block_size=" << block_size;
    }
  }
}

// Contexts long enough to be split into parts (kAttentionPartPositions each, up to
// kAttentionMaxParts), odd block sizes and head dims; results must match the reference and be
// bit-identical whatever the thread count and whatever else is in the batch.
TEST_F(SequenceOps, PagedAttentionSplitsLongContextsIdenticallyForAnyThreadsAndBatch) {
  struct Case {
    int64_t kv, group, hd, dv;
    int block_size;
    std::vector<int> lens, first;
  };
  const int64_t P = CpuOps::kAttentionPartPositions;
  const std::vector<Case> cases = {
      {1, 2, 32, 32, 16, {1, 1, 1}, {int(3 * P + 5), int(P - 1), 7}},
      {2, 3, 20, 33, 12, {1, 2}, {int(2 * P + 100), int(P + 3)}},
      {1, 1, 17, 16, 16, {1}, {int(CpuOps::kAttentionMaxParts * P + 3 * P + 40)}},
  };
  for (const Case& c : cases) {
    const int64_t heads = c.kv * c.group;
    Layout lay(c.lens, c.first, c.block_size, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(DType::F32, {lay.n_blocks(), c.kv, c.hd, c.block_size}),
        vc(DType::F32, {lay.n_blocks(), c.kv, c.block_size, c.dv});
    fill_random(kc, rng, 0.5f);
    fill_random(vc, rng);
    HostTensor q(DType::F32, {n, heads, c.hd});
    fill_random(q, rng);
    const float scale = 1.0f / std::sqrt(float(c.hd));
    HostTensor ref_out(DType::F32, {n, heads, c.dv});
    ref::paged_attention(q.t, kc.t, vc.t, lay.l, scale, ref_out.t);
    std::vector<HostTensor> outs;
    for (int threads : {1, 3, 16}) {
      CpuOps pool_ops(threads);
      outs.emplace_back(DType::F32, std::initializer_list<int64_t>{n, heads, c.dv});
      pool_ops.paged_attention(q.t, kc.t, vc.t, lay.l, scale, outs.back().t);
      EXPECT_LE(max_abs_diff(outs.back().f(), ref_out.f(), n * heads * c.dv), 2e-5)
          << "threads=" << threads << " hd=" << c.hd << " dv=" << c.dv;
      EXPECT_EQ(std::memcmp(outs.back().f(), outs[0].f(), size_t(n * heads * c.dv) * 4), 0)
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
      HostTensor alone(DType::F32, {e - b, heads, c.dv});
      pool_ops.paged_attention(q.t.slice_rows(b, e), kc.t, vc.t, one, scale, alone.t);
      EXPECT_EQ(std::memcmp(alone.f(), outs[0].f() + int64_t(b) * heads * c.dv,
                            size_t((e - b) * heads * c.dv) * 4),
                0)
          << "sequence " << s << " alone differs from the batch";
    }
  }
}

}  // namespace
}  // namespace recur
