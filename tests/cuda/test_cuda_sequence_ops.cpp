// Sequence-wise CUDA ops (conv, the Gated DeltaNet and attention input stages, the paged cache
// and attention over it) against the scalar references on ragged batches, with initial states
// and histories; the fused input stages also against the ops.cpp defaults they replace, bit
// for bit (and, through the profile, that the Gated DeltaNet one is one launch at decode).
// All f32 arithmetic: conv ≤ 1e-5, rope 2e-5, attention ≤ 2e-5. The delta rule is in
// test_cuda_delta_rule.cpp. Last, the profile (RECUR_CUDA_PROFILE): its columns over two of
// these ops, and its median launch.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

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
      HostTensor x(DType::F32, {n, C}), w(wt, {C, K});
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

// One Gated DeltaNet layer's input stage (Ops::gdn_inputs) on random data: the projections as
// the model leaves them (mixed q | k | v before the conv, and a, b as column slices of one
// [n, Hv + decays] buffer, b first), the conv weights and state, and the outputs. The decay is
// per value head (decays = Hv) or per key channel (decays = Hv·dk, Kimi Delta Attention, whose
// g is written over a: g_in_a).
struct GdnInputCase {
  int64_t n, hk, hv, dk, dv, K, C, decays;
  bool g_in_a;
  HostTensor mixed_big, ba, conv_w, a_log, dt_bias, state;  // ba [n, Hv + decays]: b | a
  HostTensor conv_out, g, beta;                             // g [n, decays]; unused if g_in_a
  GdnInputCase(int64_t n_, int64_t hk_, int64_t hv_, int64_t dk_, int64_t dv_, int64_t K_,
               int64_t slots, DType wt, DType gate_t, bool per_channel, bool g_in_a_,
               std::mt19937& rng)
      : n(n_),
        hk(hk_),
        hv(hv_),
        dk(dk_),
        dv(dv_),
        K(K_),
        C(2 * hk_ * dk_ + hv_ * dv_),
        decays(per_channel ? hv_ * dk_ : hv_),
        g_in_a(g_in_a_),
        mixed_big(DType::F32, {n, C + 8}),
        ba(DType::F32, {n, hv + decays}),
        conv_w(wt, {C, K}),
        a_log(gate_t, {hv}),
        dt_bias(gate_t, {decays}),
        state(DType::F32, {slots, K - 1, C}),
        conv_out(DType::F32, {n, C}),
        g(DType::F32, {n, decays}),
        beta(DType::F32, {n, hv}) {
    fill_random(mixed_big, rng);
    fill_random(ba, rng);
    fill_random(conv_w, rng, 0.5f);
    fill_random(a_log, rng, 0.5f);
    fill_random(dt_bias, rng);
    fill_random(state, rng);
  }
  // The operands in `mixed`, `ba` (device or host copies of this case's) and the outputs.
  GdnInputArgs args(const Tensor& mixed, const Tensor& ba_t, const Tensor& w, const Tensor& al,
                    const Tensor& dt, const Tensor& st, const Tensor& out, const Tensor& gt,
                    const Tensor& bt) const {
    GdnInputArgs r;
    r.key_heads = int(hk), r.value_heads = int(hv), r.dk = int(dk), r.dv = int(dv);
    r.l2_eps = 1e-6f, r.q_scale = 1.0f / std::sqrt(float(dk));
    r.mixed = mixed.slice_cols(4, 4 + C);
    r.b = ba_t.slice_cols(0, hv), r.a = ba_t.slice_cols(hv, hv + decays);
    r.conv_weight = w, r.a_log = al, r.dt_bias = dt, r.conv_state = st;
    r.conv_out = out, r.g = g_in_a ? r.a : gt, r.beta = bt;
    return r;
  }
  // The tensor that holds g: ba when g is written over a, else g.
  const HostTensor& g_holder() const { return g_in_a ? ba : g; }
  // The stage from the references, in place on this case's outputs and state.
  void reference(const SeqLayout& layout) {
    reference_gdn_inputs(
        args(mixed_big.t, ba.t, conv_w.t, a_log.t, dt_bias.t, state.t, conv_out.t, g.t, beta.t),
        layout);
  }
};

// The fused Gated DeltaNet input stage (one token per sequence) equals the ops.cpp default (the
// conv, L2 norm and gate ops on the GPU) bit for bit, and the references to their tolerances;
// other layouts take the default itself. Shapes: the model's (Hk 16, Hv 32, dk = dv = 128,
// K 4), three value heads per key head, and dk 256 (eight channels per lane); weight dtypes
// mixed; operands as column slices of wider buffers. A decay per key channel (Kimi Delta
// Attention; g_in_a: g written over a, as the model does): Kimi-Linear's shape (32 heads,
// dk = dv = 128, K 4), odd head counts, dk 64, 128 and 256, K 2 to 4, several key heads of
// r = 2 or 3 value heads (r·dk 384 and 512: two channels a thread), r·dk over 512 (the
// default), and a prompt layout (the default). The per-channel g is checked relative to its
// largest value (the gdn_gates test's measure): its values reach 10 to 20, where 1e-6 is an ulp.
TEST_F(CudaSequence, GdnInputsDecodeEqualsTheDefault) {
  struct Case {
    int64_t hk, hv, dk, dv, K;
    DType wt, gate_t;
    std::vector<int> lens;
    bool per_channel = false, g_in_a = false;
  };
  const Case cases[] = {{16, 32, 128, 128, 4, DType::BF16, DType::BF16, {1, 1, 1}},
                        {2, 6, 64, 32, 3, DType::F32, DType::F32, {1, 1}},
                        {1, 1, 256, 64, 2, DType::BF16, DType::F32, {1, 1, 1, 1}},
                        {2, 6, 64, 32, 3, DType::BF16, DType::F32, {2, 1, 3}},  // not decode
                        {32, 32, 128, 128, 4, DType::BF16, DType::F32, {1, 1, 1}, true, true},
                        {3, 3, 64, 64, 3, DType::F32, DType::F32, {1, 1}, true, true},
                        {5, 5, 128, 128, 4, DType::BF16, DType::BF16, {1, 1, 1, 1, 1}, true},
                        {2, 6, 128, 32, 3, DType::F32, DType::BF16, {1, 1, 1}, true},
                        {3, 6, 256, 64, 2, DType::BF16, DType::F32, {1, 1}, true, true},
                        {1, 5, 128, 32, 4, DType::BF16, DType::F32, {1, 1}, true},  // default
                        {3, 3, 64, 64, 4, DType::BF16, DType::F32, {2, 1, 3}, true, true}};
  for (const Case& cs : cases) {
    Layout lay(cs.lens, std::vector<int>(cs.lens.size(), 5), 16, rng);
    GdnInputCase c(lay.l.n_tokens, cs.hk, cs.hv, cs.dk, cs.dv, cs.K, int64_t(cs.lens.size()), cs.wt,
                   cs.gate_t, cs.per_channel, cs.g_in_a, rng);
    const Tensor dw = weight(c.conv_w), dal = weight(c.a_log), ddt = weight(c.dt_bias);
    DeviceTensor dmixed = dev(c.mixed_big);
    // Two runs from the same state: the op as the backend runs it, and the default's ops.
    struct Run {
      DeviceTensor ba, state, conv_out, g, beta;
    };
    Run runs[2];
    for (Run& r : runs) {
      r.ba = dev(c.ba), r.state = dev(c.state);
      r.conv_out = poisoned(c.conv_out), r.g = poisoned(c.g), r.beta = poisoned(c.beta);
    }
    auto args = [&](Run& r) {
      return c.args(dmixed.t, r.ba.t, dw, dal, ddt, r.state.t, r.conv_out.t, r.g.t, r.beta.t);
    };
    ops().begin_forward(lay.l, {}, {});
    ops().gdn_inputs(args(runs[0]), lay.l);
    ops().Ops::gdn_inputs(args(runs[1]), lay.l);
    GdnInputCase ref = c;
    ref.reference(lay.l);
    const HostTensor* refs[4] = {&ref.conv_out, &ref.g_holder(), &ref.beta, &ref.state};
    const double tol[4] = {1e-5, 1e-6, 1e-6, 0.0};
    const char* names[4] = {"conv_out", cs.per_channel ? "g per key channel" : "g", "beta",
                            "state"};
    const std::string what = " hk=" + std::to_string(cs.hk) + " hv=" + std::to_string(cs.hv) +
                             " dk=" + std::to_string(cs.dk) + " K=" + std::to_string(cs.K);
    for (int i = 0; i < 4; ++i) {
      auto outs = [&](Run& r) {
        const DeviceTensor* d[4] = {&r.conv_out, c.g_in_a ? &r.ba : &r.g, &r.beta, &r.state};
        return d[i];
      };
      const HostTensor g0 = host(*outs(runs[0]), *refs[i]), g1 = host(*outs(runs[1]), *refs[i]);
      const int64_t len = refs[i]->numel();
      ASSERT_EQ(count_nonfinite(g0.f(), len), 0) << names[i] << what;
      EXPECT_TRUE(same_bits(g0, g1)) << names[i] << what;
      const double err = i == 1 && cs.per_channel ? rel_err(g0.f(), refs[i]->f(), len)
                                                  : max_abs_diff(g0.f(), refs[i]->f(), len);
      record_error(std::string("gdn_inputs ") + names[i], err);
      EXPECT_LE(err, tol[i]) << names[i] << what;
    }
  }
}

// At decode, gdn_inputs is one launch for either decay (per head; per key channel, one and two
// channels a thread) instead of the default's conv, L2 norms and gates, which would also pass
// the bit-for-bit test above: the profile's table names every launch.
TEST(CudaGdnInputs, DecodeIsOneLaunch) {
  std::mt19937 rng(11);
  struct Shape {
    int64_t hk, hv;
    bool per_channel;
  };
  const Shape shapes[] = {{2, 4, false}, {2, 2, true}, {1, 3, true}};
  bool ok = false;
  const std::string table = profile_table(
      [&](CudaOps& ops) {
        const std::vector<int> lens = {1, 1, 1};
        Layout lay(lens, std::vector<int>{5, 9, 0}, 16, rng);
        for (const Shape& sh : shapes) {
          GdnInputCase c(lay.l.n_tokens, sh.hk, sh.hv, 128, 128, 4, int64_t(lens.size()),
                         DType::BF16, DType::F32, sh.per_channel, sh.per_channel, rng);
          const Tensor dw = ops.adopt_weight(c.conv_w.t).value();
          const Tensor dal = ops.adopt_weight(c.a_log.t).value();
          const Tensor ddt = ops.adopt_weight(c.dt_bias.t).value();
          DeviceTensor dmixed(ops, c.mixed_big), dba(ops, c.ba), dstate(ops, c.state),
              dout(ops, c.conv_out), dg(ops, c.g), dbeta(ops, c.beta);
          ops.begin_forward(lay.l, {}, {});
          ops.gdn_inputs(c.args(dmixed.t, dba.t, dw, dal, ddt, dstate.t, dout.t, dg.t, dbeta.t),
                         lay.l);
          ops.synchronize();
        }
      },
      &ok);
  if (!ok) GTEST_SKIP() << "no usable CUDA device";
  EXPECT_EQ(profile_count(table, "decode b=3 gdn_inputs (decode)"), 3) << table;
  for (const char* op : {"conv1d", "l2_norm", "gdn_gates"}) {
    EXPECT_EQ(table.find(op), std::string::npos) << op << "\n" << table;
  }
}

// The fused attention input stage equals the ops.cpp default (rms_norm, rope, kv_cache_write
// on the GPU) bit for bit, and the references to the rope tolerance: the Qwen3-Next shape (16
// heads, 2 kv heads, hd 256, 64 rotary channels) at decode, a ragged prompt batch with an f32
// norm weight, rotated pairs two registers apart, and value heads of other sizes than the key
// heads (hd 192 / dv 128 as MLA-style heads; dv 320, wider than a warp's registers; hd 40 /
// dv 24 off the register path).
TEST_F(CudaSequence, AttentionInputsEqualTheDefault) {
  struct Case {
    int64_t heads, kv, hd, dv;
    int rot;
    DType norm_t;
    std::vector<int> lens, first;
  };
  const Case cases[] = {{16, 2, 256, 256, 64, DType::BF16, {1, 1, 1}, {2050, 0, 31}},
                        {4, 2, 40, 40, 20, DType::F32, {3, 1, 5}, {0, 17, 40}},
                        {8, 2, 128, 128, 128, DType::BF16, {1, 2}, {100, 7}},
                        {8, 2, 192, 128, 64, DType::BF16, {1, 1}, {300, 12}},
                        {8, 2, 192, 128, 64, DType::BF16, {5, 1}, {0, 77}},
                        {4, 1, 64, 320, 64, DType::F32, {1, 3}, {9, 20}},
                        {4, 2, 40, 24, 20, DType::F32, {2, 1}, {0, 30}}};
  for (const Case& cs : cases) {
    Layout lay(cs.lens, cs.first, 16, rng);
    AttentionInputCase c(lay.l, lay.n_blocks(), cs.heads, cs.kv, cs.hd, cs.dv, cs.rot, cs.norm_t,
                         rng);
    const auto runs = fused_and_default_attention_inputs(c, lay.l);
    AttentionInputCase ref = c;
    ref.reference(lay.l);
    const HostTensor* refs[4] = {&ref.q, &ref.k, &ref.kc, &ref.vc};
    const double tol[4] = {2e-5, 2e-5, 2e-5, 0.0};
    const char* names[4] = {"q", "k", "k cache", "v cache"};
    const std::string what = " hd=" + std::to_string(cs.hd) + " dv=" + std::to_string(cs.dv);
    for (int i = 0; i < 4; ++i) {
      const DeviceTensor* d0[4] = {&runs[0].q, &runs[0].k, &runs[0].kc, &runs[0].vc};
      const DeviceTensor* d1[4] = {&runs[1].q, &runs[1].k, &runs[1].kc, &runs[1].vc};
      const HostTensor g0 = host(*d0[i], *refs[i]), g1 = host(*d1[i], *refs[i]);
      const int64_t len = refs[i]->numel();
      EXPECT_TRUE(same_bits(g0, g1)) << names[i] << what;
      const double err = max_abs_diff(g0.f(), refs[i]->f(), len);
      record_error(std::string("attention_inputs ") + names[i], err);
      EXPECT_LE(err, tol[i]) << names[i] << what;
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
      HostTensor x(DType::F32, {n, C}), w(wt, {C, K});
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

// Decode tokens with long histories (context splits and their merge), a fresh prompt and a
// chunk continuing a prompt; group sizes 1, 2, 3, 4, 8 (Qwen3-Next's) and 16 (the tiled
// fallback); head dims 20, 64, 128 and 256 (multiples of 32 at few tokens: the decode kernel);
// value heads of other sizes than the key heads in every kernel (the decode kernel with more
// key than value channels and the reverse, with splits; the tiled one; the tensor-core one); with
// and without the output gate (then bit for bit paged_attention then mul_sigmoid).
TEST_F(CudaSequence, PagedAttentionMatchesReferenceOnRaggedBatchesWithHistory) {
  struct Case {
    int64_t group, hd, dv;
    int block_size;
    std::vector<int> lens, first;
  };
  const Case cases[] = {{1, 20, 20, 16, {1, 33, 17}, {70, 0, 16}},
                        {3, 20, 20, 16, {1, 33, 17}, {70, 0, 16}},
                        {3, 20, 20, 32, {1, 1, 40}, {2000, 333, 5}},
                        {8, 256, 256, 16, {1, 1}, {3000, 77}},
                        {8, 256, 256, 16, {70, 1}, {0, 600}},
                        {16, 256, 256, 16, {1, 3}, {300, 40}},  // too large for the warp kernel
                        // The decode kernel at other head dims, group sizes and block sizes:
                        // chunks crossing blocks, splits ending mid-chunk, one-token contexts.
                        {2, 64, 64, 32, {1, 1, 1}, {5000, 31, 0}},
                        {4, 128, 128, 16, {1, 2, 1}, {1000, 3, 63}},
                        // Several new tokens of a sequence after a history: chunks of earlier
                        // positions (loaded before the kernel's wait at group 8) and new ones.
                        {8, 128, 128, 16, {5, 1}, {100, 40}},
                        {4, 128, 128, 16, {5, 1}, {100, 40}},
                        // One token, a long history: more splits than the merge holds at once.
                        {8, 256, 256, 16, {1}, {6000}},
                        // dv ≠ hd: the decode kernel (splits, combine) with hd 192 / dv 128 and
                        // hd 64 / dv 128, GQA; prompts through the warp kernel; the tiled one.
                        {8, 192, 128, 16, {1, 1}, {4000, 70}},
                        {8, 192, 128, 16, {5, 1}, {100, 40}},
                        {2, 64, 128, 16, {1, 1, 1}, {3000, 31, 0}},
                        {4, 192, 128, 16, {70, 1}, {0, 600}},
                        {4, 40, 24, 16, {1, 33, 17}, {70, 0, 16}},
                        {16, 64, 160, 16, {1, 3}, {300, 40}},
                        // Prompts past the decode kernel's 64 tokens: the tensor-core kernel
                        // (tiles of 64 / group tokens, 32 keys), fresh and continuing a cached
                        // prefix, groups that do not divide its 64 rows, value heads of other
                        // sizes, a decode token with a long history in the same forward.
                        {1, 64, 64, 16, {300, 5, 80}, {0, 700, 40}},
                        {3, 128, 128, 32, {100, 1}, {37, 2000}},
                        {8, 256, 256, 16, {200}, {1000}},
                        {8, 192, 128, 16, {100, 33}, {0, 50}},
                        {2, 128, 64, 16, {130}, {0}},
                        {16, 64, 160, 16, {90}, {10}}};
  for (const Case& c : cases) {
    const int64_t kv = 2, heads = kv * c.group, hd = c.hd, dv = c.dv;
    Layout lay(c.lens, c.first, c.block_size, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(DType::F32, {lay.n_blocks(), kv, hd, c.block_size}),
        vc(DType::F32, {lay.n_blocks(), kv, c.block_size, dv});
    fill_random(kc, rng);
    fill_random(vc, rng);
    HostTensor k(DType::F32, {n, kv, hd}), v(DType::F32, {n, kv, dv}),
        q(DType::F32, {n, heads, hd});
    fill_random(k, rng);
    fill_random(v, rng);
    fill_random(q, rng);
    DeviceTensor dkc = dev(kc), dvc = dev(vc), dk = dev(k), dv_ = dev(v), dq = dev(q);
    HostTensor kc_ref = kc, vc_ref = vc;
    ops().begin_forward(lay.l, {}, {});
    ops().kv_cache_write(dk.t, dv_.t, dkc.t, dvc.t, lay.l);
    ref::kv_cache_write(k.t, v.t, kc_ref.t, vc_ref.t, lay.l);
    const std::string what = "group=" + std::to_string(c.group) + " hd=" + std::to_string(hd) +
                             " dv=" + std::to_string(dv) + " first=" + std::to_string(c.first[0]);
    ASSERT_TRUE(same_bits(host(dkc, kc), kc_ref)) << what;
    ASSERT_TRUE(same_bits(host(dvc, vc), vc_ref)) << what;
    HostTensor out(DType::F32, {n, heads, dv}), ref = out;
    DeviceTensor dout = poisoned(out);
    const float scale = 1.0f / std::sqrt(float(hd));
    ops().paged_attention(dq.t, dkc.t, dvc.t, lay.l, scale, dout.t);
    ref::paged_attention(q.t, kc_ref.t, vc_ref.t, lay.l, scale, ref.t);
    const double err = max_abs_diff(host(dout, out).f(), ref.f(), out.numel());
    record_error(dv == hd ? "paged_attention" : "paged_attention dv != hd", err);
    EXPECT_LE(err, 2e-5) << what;
    // With the output gate: paged_attention then mul_sigmoid, bit for bit.
    HostTensor gate(DType::F32, {n, heads * dv}), flat = gate;
    fill_random(gate, rng);
    DeviceTensor dgate = dev(gate), gated = poisoned(flat), composed = poisoned(flat);
    ops().paged_attention_gated(dq.t, dkc.t, dvc.t, lay.l, scale, dgate.t, gated.t);
    ops().Ops::paged_attention_gated(dq.t, dkc.t, dvc.t, lay.l, scale, dgate.t, composed.t);
    const HostTensor g0 = host(gated, flat), g1 = host(composed, flat);
    ASSERT_EQ(count_nonfinite(g0.f(), flat.numel()), 0) << what;
    EXPECT_TRUE(same_bits(g0, g1)) << "gated, " << what;
  }
}

// A latent cache (Kimi's latent attention): one kv head whose values are the keys' first dv
// channels, v_cache a view of k_cache (channels block_size apart). The write through the view
// lands in the keys; attention (the tiled kernel) equals the reference, at the tiny model's
// shape and at Kimi-Linear-48B's (r + dr = 576, r = 512, 14 heads per call), with long
// histories (splits) and prompts, odd block sizes.
TEST_F(CudaSequence, PagedAttentionReadsValuesFromTheKeyCache) {
  struct Case {
    int64_t group, hd, dv;
    int block_size;
    std::vector<int> lens, first;
  };
  const Case cases[] = {{4, 24, 16, 16, {1, 33, 17}, {70, 0, 16}},
                        {5, 24, 16, 5, {1, 2, 9}, {100, 3, 0}},
                        {14, 576, 512, 16, {1, 1}, {3000, 70}},
                        {4, 576, 512, 16, {40, 1}, {0, 600}}};
  for (const Case& c : cases) {
    const int64_t heads = c.group, hd = c.hd, dv = c.dv;
    const int bs = c.block_size;
    Layout lay(c.lens, c.first, bs, rng);
    const int64_t n = lay.l.n_tokens;
    HostTensor kc(DType::F32, {lay.n_blocks(), 1, hd, bs});
    fill_random(kc, rng);
    auto values_of = [&](Tensor keys) {
      keys.shape[2] = bs, keys.shape[3] = dv;
      keys.stride[2] = 1, keys.stride[3] = bs;
      return keys;
    };
    HostTensor k(DType::F32, {n, hd}), q(DType::F32, {n, heads, hd});
    fill_random(k, rng);
    fill_random(q, rng);
    DeviceTensor dkc = dev(kc), dk = dev(k), dq = dev(q);
    HostTensor kc_ref = kc;
    ops().begin_forward(lay.l, {}, {});
    ops().kv_cache_write(dk.t.col_heads(0, 1, hd), dk.t.col_heads(0, 1, dv), dkc.t,
                         values_of(dkc.t), lay.l);
    ref::kv_cache_write(k.t.col_heads(0, 1, hd), k.t.col_heads(0, 1, dv), kc_ref.t,
                        values_of(kc_ref.t), lay.l);
    const std::string what = "group=" + std::to_string(c.group) + " hd=" + std::to_string(hd) +
                             " bs=" + std::to_string(bs) + " first=" + std::to_string(c.first[0]);
    ASSERT_TRUE(same_bits(host(dkc, kc), kc_ref)) << what;
    HostTensor out(DType::F32, {n, heads, dv}), ref = out;
    DeviceTensor dout = poisoned(out);
    const float scale = 1.0f / std::sqrt(float(hd));
    ops().paged_attention(dq.t, dkc.t, values_of(dkc.t), lay.l, scale, dout.t);
    ref::paged_attention(q.t, kc_ref.t, values_of(kc_ref.t), lay.l, scale, ref.t);
    const double err = max_abs_diff(host(dout, out).f(), ref.f(), out.numel());
    record_error("paged_attention values in keys", err);
    EXPECT_LE(err, 2e-5) << what;
  }
}

}  // namespace
}  // namespace recur

namespace recur::testing {
namespace {

// The row of `label` in the profile table: its TFLOP/s column (-1 when the row or the column is
// missing).
double profile_tflops(const std::string& table, const std::string& label) {
  size_t at = table.find(label);
  if (at == std::string::npos) return -1;
  at += label.size();
  const std::string line = table.substr(at, table.find('\n', at) - at);
  double ms = 0, each = 0, tflops = -1, gbs = -1;
  long long count = 0;
  if (std::sscanf(line.c_str(), "%lf %lld %lf %lf %lf", &ms, &count, &each, &tflops, &gbs) != 5) {
    return -1;
  }
  return ms > 0 && count > 0 && gbs > 0 ? tflops : -1;
}

// RECUR_CUDA_PROFILE=1 (issue 22): per-op device time with each op's FLOP/s and bytes/s,
// printed when the ops go away. It once aborted with cudaErrorNotReady after a copy started
// beside queued work; the copy here does the same.
TEST(CudaProfile, PrintsEachOpsTimeAndRates) {
  std::mt19937 rng(7);
  bool ok = false;
  const std::string table = profile_table(
      [&](CudaOps& ops) {
        const int64_t group = 8, kv = 2, hd = 128, heads = group * kv;
        Layout lay({300}, {0}, 16, rng);
        const int64_t n = lay.l.n_tokens, k = 1024, m = 4096;
        HostTensor x(DType::F32, {n, k}), w(DType::BF16, {m, k}), y(DType::F32, {n, m});
        HostTensor q(DType::F32, {n, heads, hd}), kc(DType::F32, {lay.n_blocks(), kv, hd, 16}),
            vc(DType::F32, {lay.n_blocks(), kv, 16, hd}), out(DType::F32, {n, heads, hd});
        for (HostTensor* t : {&x, &q, &kc, &vc}) fill_random(*t, rng);
        fill_random(w, rng, 0.05f);
        auto dw = ops.adopt_weight(w.t);
        ASSERT_TRUE(dw.ok());
        ASSERT_FALSE(ops.matmul_takes_gemv(n, dw.value()));
        DeviceTensor dx(ops, x), dy(ops, y), dq(ops, q), dkc(ops, kc), dvc(ops, vc), dout(ops, out);
        ops.matmul(dx.t, dw.value(), dy.t, false);  // cuBLAS's first call sets itself up
        ops.begin_forward(lay.l, {}, {});
        ops.matmul(dx.t, dw.value(), dy.t, false);
        ops.paged_attention(dq.t, dkc.t, dvc.t, lay.l, 1.0f / std::sqrt(float(hd)), dout.t);
        std::vector<float> row(static_cast<size_t>(m));
        ops.copy_to_host_start(dy.t.slice_rows(0, 1), row.data());
        ops.copy_to_host_finish();
      },
      &ok);
  if (!ok) GTEST_SKIP() << "no usable CUDA device";
  EXPECT_NE(table.find("TFLOP/s"), std::string::npos) << table;
  EXPECT_GT(profile_tflops(table, "prompt n=300 matmul 3-term 4096x1024"), 0.0) << table;
  EXPECT_GT(profile_tflops(table, "prompt n=300 paged_attention (tensor cores)"), 0.0) << table;
}

// The profile's per-launch column is the median launch: time the device spent waiting for the
// host before an op (a first call's set-up, say; here a sleep before the first of five launches)
// stays in the op's total only, where a mean would have spread it over every launch.
TEST(CudaProfile, MedianLeavesOutAWaitBeforeOneLaunch) {
  std::mt19937 rng(5);
  bool ok = false;
  const std::string table = profile_table(
      [&](CudaOps& ops) {
        Layout lay({256}, {0}, 16, rng);
        const int64_t n = lay.l.n_tokens, d = 1024;
        HostTensor x(DType::F32, {n, d}), w(DType::F32, {d}), y(DType::F32, {n, d});
        fill_random(x, rng);
        fill_random(w, rng);
        auto dw = ops.adopt_weight(w.t);
        ASSERT_TRUE(dw.ok());
        DeviceTensor dx(ops, x), dy(ops, y);
        ops.synchronize();
        ops.begin_forward(lay.l, {}, {});
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        for (int i = 0; i < 5; ++i) ops.rms_norm(dx.t, dw.value(), 0.0f, 1e-6f, dy.t);
      },
      &ok);
  if (!ok) GTEST_SKIP() << "no usable CUDA device";
  const std::string label = "prompt n=256 rms_norm";
  const size_t at = table.find(label);
  ASSERT_NE(at, std::string::npos) << table;
  double total_ms = 0, median_us = 0;
  long long count = 0;
  ASSERT_EQ(
      std::sscanf(table.c_str() + at + label.size(), "%lf %lld %lf", &total_ms, &count, &median_us),
      3)
      << table;
  EXPECT_EQ(count, 5) << table;
  EXPECT_GE(total_ms, 40.0) << table;     // the wait is in the total
  EXPECT_LT(median_us, 2000.0) << table;  // and not in the median launch (a mean: ≥ 8 ms)
}

}  // namespace
}  // namespace recur::testing
