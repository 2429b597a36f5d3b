// The engine over a tensor-parallel model: greedy generations of several requests at once, with
// prompts prefilled in chunks beside decode steps and a second round that starts from the
// prefix cache's snapshots and blocks, give the whole model's tokens, token for token; the
// prefix cache's file written by one split is read back by the next engine of that split.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <numeric>
#include <random>

#include "alloc_counter.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "model/tp_test_device.h"

namespace recur {
namespace {

namespace fs = std::filesystem;
const std::string kRoot = RECUR_SOURCE_DIR;

// One engine over `world` ranks (1: the whole model), each rank's backend one CPU thread (or a
// GPU: model/tp_test_device.h).
struct TpEngine {
  std::unique_ptr<Ops> ops;
  std::unique_ptr<Engine> engine;  // after ops: the model keeps a reference to it

  TpEngine(const std::string& model, int world, const std::string& cache_file = "") {
    auto o = recur_test::tp_test_backend(0, world);
    EXPECT_TRUE(o.ok()) << o.error().to_string();
    if (!o.ok()) return;
    ops = std::move(*o);
    EngineConfig cfg;
    cfg.max_batch = 4;
    cfg.max_batch_tokens = 24;  // prompts in chunks, beside the others' decode tokens
    cfg.kv_blocks = 96;
    cfg.prefix_snapshots = 8;
    cfg.snapshot_interval = 32;
    cfg.prefix_cache_file = cache_file;
    cfg.tensor_parallel = world;
    cfg.rank_backend = [world](int r) { return recur_test::tp_test_backend(r, world); };
    auto e = Engine::create(model, *ops, cfg, nullptr);
    EXPECT_TRUE(e.ok()) << e.error().to_string();
    if (e.ok()) engine = std::move(*e);
  }

  // The prompts submitted together, run until all are done.
  std::vector<Outcome> run(const std::vector<std::vector<int32_t>>& prompts) {
    std::vector<Outcome> out(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_TRUE(engine->submit(greedy_request(prompts[i], 12), collect(&out[i])).ok());
    }
    engine->run_until_idle();
    return out;
  }
};

// Round 1: three prompts of different lengths. Round 2: each continued (a chat's next turn),
// which starts from round 1's snapshots, beside a new prompt.
std::vector<std::vector<std::vector<int32_t>>> rounds() {
  std::vector<std::vector<int32_t>> first = {random_tokens(70, 256, 1), random_tokens(9, 256, 2),
                                             random_tokens(41, 256, 3)};
  std::vector<std::vector<int32_t>> second;
  for (size_t i = 0; i < first.size(); ++i) {
    std::vector<int32_t> p = first[i];
    for (int32_t t : random_tokens(20, 256, uint32_t(10 + i))) p.push_back(t);
    second.push_back(std::move(p));
  }
  second.push_back(random_tokens(33, 256, 4));
  return {first, second};
}

class TensorParallelEngine : public ::testing::TestWithParam<std::pair<const char*, int>> {};

TEST_P(TensorParallelEngine, GeneratesTheWholeModelsTokens) {
  const std::string model = kRoot + "/models/" + GetParam().first;
  const int world = GetParam().second;
  TpEngine whole(model, 1), split(model, world);
  ASSERT_TRUE(whole.engine && split.engine);
  int cached = 0;
  for (const auto& prompts : rounds()) {
    const std::vector<Outcome> a = whole.run(prompts), b = split.run(prompts);
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_TRUE(a[i].done && b[i].done);
      EXPECT_EQ(a[i].ids, b[i].ids) << "prompt " << i << " of " << prompts.size();
      EXPECT_EQ(a[i].cached, b[i].cached) << "prompt " << i;
      cached += b[i].cached;
    }
  }
  EXPECT_GT(cached, 0);  // the second round started from the prefix cache
}

INSTANTIATE_TEST_SUITE_P(Models, TensorParallelEngine,
                         ::testing::Values(std::pair<const char*, int>{"qwen3next-tiny", 2},
                                           std::pair<const char*, int>{"qwen3next-tiny", 4},
                                           std::pair<const char*, int>{"qwen3_5-moe-tiny", 2},
                                           std::pair<const char*, int>{"kimi-linear-tiny", 2}),
                         [](const auto& info) {
                           std::string n = std::string(info.param.first) + "_" +
                                           std::to_string(info.param.second);
                           for (char& c : n) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return n;
                         });

// Blocks and snapshots go to the file as the ranks' parts back to back and come back to the
// same ranks: a restarted engine continues a saved prompt with the tokens of a full prefill.
TEST(TensorParallelEngineFile, ARestartedSplitEngineFindsWhatTheLastOneSaved) {
  const std::string model = kRoot + "/models/qwen3next-tiny";
  const fs::path dir = fs::temp_directory_path() / fmt::format("recur-tp-prefix-{}", getpid());
  fs::create_directories(dir);
  const std::string file = (dir / "prefix-cache.bin").string();
  const auto all = rounds();
  {
    TpEngine saver(model, 2, file);
    ASSERT_TRUE(saver.engine);
    saver.run(all[0]);
    const Status st = saver.engine->save_prefix_cache();
    ASSERT_TRUE(st.ok()) << st.error().to_string();
  }
  TpEngine whole(model, 1), restarted(model, 2, file);
  ASSERT_TRUE(whole.engine && restarted.engine);
  const std::vector<Outcome> a = whole.run({all[1][0]}), b = restarted.run({all[1][0]});
  EXPECT_EQ(a[0].ids, b[0].ids);
  EXPECT_EQ(a[0].cached, 0);
  EXPECT_GT(b[0].cached, 0);  // from the file
  // The whole model's engine does not take the split's file (blocks laid out otherwise).
  TpEngine other(model, 1, file);
  ASSERT_TRUE(other.engine);
  EXPECT_EQ(other.run({all[1][0]})[0].cached, 0);
  fs::remove_all(dir);
}

// A split forward allocates nothing: the ranks' threads, the collectives and the gathered
// logits all use what loading made (decode steps of two sequences after a warm-up).
TEST(TensorParallelModel, DecodeStepsAllocateNothing) {
  auto o = recur_test::tp_test_backend(0, 2);
  ASSERT_TRUE(o.ok()) << o.error().to_string();
  Ops& ops = **o;
  LoadOptions opt;
  opt.max_batch_tokens = 64;
  opt.state = {2, 16, 16};
  opt.tensor_parallel = 2;
  opt.rank_backend = [](int r) { return recur_test::tp_test_backend(r, 2); };
  auto m = load_model(kRoot + "/models/qwen3_5-moe-tiny", ops, opt);
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  Model& model = **m;
  auto buf = ops.allocator().allocate(size_t(64) * 256 * 4, "logits");
  ASSERT_TRUE(buf.ok());
  const Tensor logits = view(*buf, DType::F32, {64, 256});
  const std::vector<int32_t> prompt = random_tokens(20, 256, 5), blocks0 = {0, 2, 4},
                             blocks1 = {1, 3, 5};
  Batch batch;
  batch.add_sequence(0, 0, prompt, blocks0, Batch::Logits::kLast);
  batch.add_sequence(1, 0, prompt, blocks1, Batch::Logits::kLast);
  ASSERT_TRUE(model.forward(batch, logits).ok());
  std::vector<int64_t> allocs;
  for (int pos = 20; pos < 40; ++pos) {
    const int32_t t[] = {int32_t(pos % 256)};
    testing::start_counting_allocs();
    batch.clear();
    batch.add_sequence(0, pos, t, blocks0, Batch::Logits::kLast);
    batch.add_sequence(1, pos, t, blocks1, Batch::Logits::kLast);
    const Status st = model.forward(batch, logits);
    allocs.push_back(testing::stop_counting_allocs());
    ASSERT_TRUE(st.ok()) << st.error().to_string();
  }
  EXPECT_EQ(std::accumulate(allocs.begin() + 2, allocs.end(), int64_t(0)), 0)
      << "heap allocations in 18 split decode steps";
}

}  // namespace
}  // namespace recur
