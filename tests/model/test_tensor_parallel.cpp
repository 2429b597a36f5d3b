// Tensor parallelism (on the CPU, or on GPUs under RECUR_TEST_DEVICE: tp_test_device.h): N ranks
// give the logits of the whole model (within f32 rounding of the split sums) on every reference
// model whose heads split, and on random checkpoints with the splits those lack (key heads
// shared by ranks, feed-forward columns that do not divide evenly, a vocabulary that does not
// divide, tied embeddings, fused experts); heads that cannot be split are refused with an error
// naming the count and the ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "model/random_checkpoint.h"
#include "model/registry.h"
#include "model/tp_test_device.h"

namespace recur_test {
namespace {

const std::string kRoot = RECUR_SOURCE_DIR;

// Relative to the largest |logit|. The ranks' projections sum their input columns in parts, so
// their f32 rounding differs from the whole model's; through the layers that gives up to
// 2.3e-5 of the largest logit on these models (9.7e-5 at 4.3, 2.7e-4 at 31 on the tied ones),
// the size of the whole model's own f32 error (recur verify: both are within 1.5e-4 of
// transformers on qwen3next-tiny). A missing or doubled part moves logits by O(0.1).
constexpr double kRelativeTolerance = 1e-4;
constexpr int kSlots = 4, kBlockSize = 16, kBlocksPerSlot = 8, kMaxTokens = 64;

recur::LoadOptions options(int world) {
  recur::LoadOptions opt;
  opt.max_batch_tokens = kMaxTokens;
  opt.state = {kSlots, kSlots * kBlocksPerSlot, kBlockSize};
  opt.tensor_parallel = world;
  opt.rank_backend = [world](int r) { return tp_test_backend(r, world); };
  return opt;
}

// A model over `world` ranks (1: the whole model), each rank on one CPU thread (or a GPU:
// tp_test_device.h).
struct Loaded {
  std::unique_ptr<recur::Ops> ops;
  std::unique_ptr<recur::Model> model;  // after ops: it keeps a reference to it
};

recur::Result<Loaded> load(const std::string& dir, int world) {
  Loaded l;
  RECUR_ASSIGN_OR_RETURN(l.ops, tp_test_backend(0, world));
  RECUR_ASSIGN_OR_RETURN(l.model, recur::load_model(dir, *l.ops, options(world)));
  return l;
}

// A fixed script of forwards, teacher-forced so that both models see the same inputs: three
// prompts in two forwards (the second mixing decode tokens and a prompt), then decode steps of
// all three; every logit row of every step, back to back.
std::vector<float> run_script(recur::Model& m) {
  const int vocab = m.info().vocab_size;
  struct Seq {
    int slot, pos = 0;
    std::vector<int32_t> toks;
  };
  std::vector<Seq> seqs = {{0, 0, random_tokens(60, vocab, 1)},
                           {2, 0, random_tokens(40, vocab, 2)},
                           {1, 0, random_tokens(50, vocab, 3)}};
  auto blocks = [](int slot) {
    std::vector<int32_t> b;
    for (int j = 0; j < kBlocksPerSlot; ++j) b.push_back(j * kSlots + (kSlots - 1 - slot));
    return b;
  };
  auto buf = m.ops().allocator().allocate(size_t(kMaxTokens) * size_t(vocab) * 4, "logits");
  EXPECT_TRUE(buf.ok());
  std::vector<float> all;
  recur::Batch batch;
  for (const Seq& s : seqs) m.reset_slot(s.slot);
  // Tokens each sequence brings per step (0: not in this step).
  const std::vector<std::vector<int>> steps = {{30, 5, 0}, {1, 1, 20}, {1, 1, 1}, {1, 1, 1},
                                               {1, 1, 1},  {1, 1, 1},  {1, 1, 1}};
  for (const std::vector<int>& step : steps) {
    batch.clear();
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = seqs[i];
      const int n = step[i];
      if (n == 0) continue;
      const std::vector<int32_t> t(s.toks.begin() + s.pos, s.toks.begin() + s.pos + n);
      batch.add_sequence(s.slot, s.pos, t, blocks(s.slot), recur::Batch::Logits::kAll);
      s.pos += n;
    }
    const int rows = int(batch.logit_rows.size());
    recur::Tensor out = recur::view(*buf, recur::DType::F32, {rows, vocab});
    const recur::Status st = m.forward(batch, out);
    EXPECT_TRUE(st.ok()) << st.error().to_string();
    const size_t at = all.size();
    all.resize(at + size_t(rows) * size_t(vocab));
    m.ops().copy_to_host(out, all.data() + at);
  }
  return all;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    m = std::isnan(d) ? INFINITY : std::max(m, d);
  }
  return m;
}

// The whole model's logits against `world` ranks', on the model in `dir`.
void expect_same_logits(const std::string& dir, int world) {
  auto whole = load(dir, 1);
  ASSERT_TRUE(whole.ok()) << whole.error().to_string();
  auto split = load(dir, world);
  ASSERT_TRUE(split.ok()) << split.error().to_string();
  const std::vector<float> a = run_script(*whole->model), b = run_script(*split->model);
  const double diff = max_abs_diff(a, b);
  double scale = 0;
  for (float v : a) scale = std::max(scale, std::fabs(double(v)));
  std::printf(
      "  %s, %d ranks: max |logit difference| %.3g over %zu logits, %.2g of the largest "
      "|logit| %.3g\n",
      dir.c_str(), world, diff, a.size(), diff / std::max(scale, 1.0), scale);
  EXPECT_LE(diff, kRelativeTolerance * std::max(scale, 1.0));
  // The ranks' state and cache together are the whole model's (heads held by one rank each).
  EXPECT_EQ(split->model->info().vocab_size, whole->model->info().vocab_size);
}

struct ReferenceCase {
  const char* model;
  int world;
};

class ReferenceModels : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(ReferenceModels, RanksGiveTheWholeModelsLogits) {
  expect_same_logits(kRoot + "/models/" + GetParam().model, GetParam().world);
}

INSTANTIATE_TEST_SUITE_P(
    TensorParallel, ReferenceModels,
    ::testing::Values(ReferenceCase{"qwen3next-tiny", 2}, ReferenceCase{"qwen3next-tiny", 4},
                      ReferenceCase{"qwen3next-seed-48L", 2},
                      ReferenceCase{"qwen3next-tiny-realvocab", 2},
                      ReferenceCase{"qwen3_5-tiny", 2}, ReferenceCase{"qwen3_5-tiny", 4},
                      ReferenceCase{"qwen3_5-seed-48L", 2}, ReferenceCase{"qwen3_5-moe-tiny", 2},
                      ReferenceCase{"qwen3_5-moe-tiny", 4},
                      // block-FP8: a rank's columns start inside a 128-column scale block
                      ReferenceCase{"qwen3next-fp8-tiny", 2},
                      ReferenceCase{"qwen3next-fp8-tiny", 4},
                      // latent attention: every rank computes and caches the whole latent
                      ReferenceCase{"kimi-linear-tiny", 2}, ReferenceCase{"kimi-seed-48L", 2}),
    [](const ::testing::TestParamInfo<ReferenceCase>& info) {
      std::string name = std::string(info.param.model) + "_" + std::to_string(info.param.world);
      for (char& c : name) {
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return name;
    });

// Splits the references lack: at 4 ranks the 2 kv heads and 2 key heads are each shared by two
// ranks, the feed-forward columns (50, 18, 22) do not divide by 4 and neither does the
// vocabulary (50: the LM head stays whole on every rank).
RandomModelSpec uneven_spec(Family family) {
  RandomModelSpec s;
  s.family = family;
  s.hidden = 32, s.layers = 4, s.vocab = 50, s.heads = 4, s.kv_heads = 2, s.head_dim = 16;
  s.linear_key_heads = 2, s.linear_value_heads = 4, s.linear_key_dim = 8, s.linear_value_dim = 8;
  s.intermediate = 50, s.experts = 4, s.experts_per_tok = 2;
  s.moe_intermediate = 18, s.shared_intermediate = 22;
  s.mlp_only_layers = {1};  // Qwen3-Next: a dense layer among the MoE ones
  return s;
}

TEST(TensorParallel, SharedKeyHeadsUnevenColumnsAndWholeVocabulary) {
  for (Family family : {Family::kQwen3Next, Family::kQwen3_5, Family::kQwen3_5Moe}) {
    for (bool tied : {false, true}) {
      RandomModelSpec spec = uneven_spec(family);
      spec.tie_word_embeddings = tied;
      TempDir dir;
      write_checkpoint(dir.path(), make_random_checkpoint(spec, 11));
      for (int world : {2, 4}) {
        SCOPED_TRACE(::testing::Message()
                     << "family " << int(family) << " tied " << tied << " ranks " << world);
        expect_same_logits(dir.path(), world);
      }
    }
  }
}

// Expects loading `dir` over `world` ranks to fail with an error holding every one of `parts`.
void expect_refused(const std::string& dir, int world, std::vector<std::string> parts) {
  auto m = load(dir, world);
  ASSERT_FALSE(m.ok()) << dir << " loaded over " << world << " ranks";
  std::printf("  %s\n", m.error().to_string().c_str());
  for (const std::string& p : parts) {
    EXPECT_NE(m.error().message.find(p), std::string::npos) << m.error().to_string();
  }
}

TEST(TensorParallel, HeadsThatDoNotSplitAreRefused) {
  // 4 value heads over 3 ranks; 2 value heads over 4.
  expect_refused(kRoot + "/models/qwen3next-tiny", 3,
                 {"over 3 ranks", "4 value heads", "do not divide"});
  expect_refused(kRoot + "/models/qwen3next-seed-48L", 4,
                 {"over 4 ranks", "2 value heads", "do not divide"});
  // Attention: 6 query heads on 3 kv heads divide among 2 ranks, the kv heads neither divide
  // nor share evenly.
  RandomModelSpec s = uneven_spec(Family::kQwen3_5);
  s.heads = 6, s.kv_heads = 3;
  s.linear_key_heads = 2, s.linear_value_heads = 4;
  TempDir dir;
  write_checkpoint(dir.path(), make_random_checkpoint(s, 5));
  expect_refused(dir.path(), 2, {"over 2 ranks", "the attention has 3 kv heads"});
  expect_refused(kRoot + "/models/kimi-linear-var", 2,
                 {"over 2 ranks", "Kimi Delta Attention has 3 heads", "do not divide"});
  expect_refused(kRoot + "/models/kimi-linear-tiny", 4,
                 {"over 4 ranks", "Kimi Delta Attention has 2 heads", "do not divide"});
}

// --device for GPU ranks: "cuda:N" gives rank r device N + r; a list names one device per rank
// and must name as many as there are ranks; anything else is refused by name (checked before
// any device is touched, so on a machine without one too).
TEST(TensorParallel, DeviceListsNameOneDevicePerRank) {
  auto expect_error = [](const std::string& device, int rank, int world, const std::string& part) {
    auto o = recur::create_backend(device, 1, rank, world);
    ASSERT_FALSE(o.ok()) << device;
    EXPECT_NE(o.error().message.find(part), std::string::npos) << o.error().to_string();
  };
  expect_error("cuda:0,1", 0, 4, "names 2 devices for 4 tensor-parallel ranks");
  expect_error("cuda:0,1,2", 1, 2, "names 3 devices for 2");
  expect_error("cuda:0,x", 0, 2, "expected cuda:N or cuda:N,M");
  expect_error("cuda:-1", 0, 1, "expected cuda:N or cuda:N,M");
  expect_error("cuda:0,", 0, 2, "expected cuda:N or cuda:N,M");
  expect_error("gpu", 0, 1, "expected cpu, cuda, cuda:N or cuda:N,M");
}

}  // namespace
}  // namespace recur_test
