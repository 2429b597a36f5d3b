// The prefix cache's file: an engine started after another saved its cache finds the prompts
// that one computed, with the outputs of a full prefill; a file written for other weights (or
// another attention-cache type of the same size), or a damaged, cut or empty one, is ignored with
// a note saying why; one that is not a prefix-cache file (a FIFO included) is refused, kept.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "backend/backend.h"
#include "engine/engine.h"
#include "engine_test_util.h"

namespace recur {
namespace {

namespace fs = std::filesystem;
const std::string kRoot = RECUR_SOURCE_DIR;

class PrefixCacheFile : public ::testing::Test {
 protected:
  void SetUp() override {
    auto o = create_backend("cpu", 2);
    ASSERT_TRUE(o.ok());
    ops_ = std::move(*o);
    dir_ = fs::temp_directory_path() /
           fmt::format("recur-prefix-{}-{}", getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    file_ = (dir_ / "prefix-cache.bin").string();
    turn1_ = random_tokens(75, 256, 1);
    turn2_ = turn1_;
    for (int32_t t : random_tokens(40, 256, 2)) turn2_.push_back(t);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::unique_ptr<Engine> engine(const std::string& model, bool cache,
                                 DType kv_cache_dtype = DType::F32) {
    EngineConfig cfg;
    cfg.kv_cache_dtype = kv_cache_dtype;
    cfg.max_batch = 2;
    cfg.max_batch_tokens = 64;
    cfg.kv_blocks = 64;
    cfg.prefix_snapshots = cache ? 8 : 0;
    cfg.snapshot_interval = 32;
    if (cache) cfg.prefix_cache_file = file_;
    auto e = Engine::create(kRoot + "/models/" + model, *ops_, cfg, nullptr);
    EXPECT_TRUE(e.ok()) << e.error().to_string();
    return e.ok() ? std::move(*e) : nullptr;
  }
  static Outcome run(Engine& e, const std::vector<int32_t>& prompt) {
    Request r = greedy_request(prompt, 6);
    r.sampling.logprobs = 0;
    Outcome out;
    EXPECT_TRUE(e.submit(r, collect(&out)).ok());
    e.run_until_idle();
    return out;
  }
  // Saves turn 1's prefix with `model`.
  void save_turn1(const std::string& model, DType kv_cache_dtype = DType::F32) {
    auto e = engine(model, true, kv_cache_dtype);
    ASSERT_EQ(e->notes().size(), 1u);
    EXPECT_NE(e->notes()[0].find("no file"), std::string::npos) << e->notes()[0];
    EXPECT_EQ(run(*e, turn1_).cached, 0);
    const Status st = e->save_prefix_cache();
    ASSERT_TRUE(st.ok()) << st.error().to_string();
  }
  // An engine that ignored the file: a note says why, nothing is cached, every block is free.
  void expect_ignored(const std::string& model, const std::string& why,
                      DType kv_cache_dtype = DType::F32) {
    auto e = engine(model, true, kv_cache_dtype);
    ASSERT_EQ(e->notes().size(), 1u);
    EXPECT_NE(e->notes()[0].find("ignored: " + why), std::string::npos) << e->notes()[0];
    const EngineStats st = e->stats();
    EXPECT_EQ(st.prefix_blocks, 0);
    EXPECT_EQ(st.prefix_snapshots, 0);
    EXPECT_EQ(run(*e, turn2_).cached, 0);
  }

  std::unique_ptr<Ops> ops_;
  fs::path dir_;
  std::string file_;
  std::vector<int32_t> turn1_, turn2_;
};

TEST_F(PrefixCacheFile, ARestartedEngineFindsWhatTheLastOneSaved) {
  for (const char* model : {"qwen3next-tiny", "qwen3_5-moe-tiny", "kimi-linear-tiny"}) {
    fs::remove(file_);
    Outcome want;
    {
      auto plain = engine(model, false);
      want = run(*plain, turn2_);
    }
    save_turn1(model);
    auto e = engine(model, true);
    ASSERT_EQ(e->notes().size(), 1u);
    EXPECT_NE(e->notes()[0].find("(blocks: 4, snapshots: 2)"), std::string::npos) << e->notes()[0];
    const Outcome got = run(*e, turn2_);
    EXPECT_EQ(got.cached, 64) << model;
    EXPECT_EQ(got.ids, want.ids) << model;
    ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
    for (size_t i = 0; i < got.logprobs.size(); ++i) {
      EXPECT_NEAR(got.logprobs[i], want.logprobs[i], 1e-4) << model << " token " << i;
    }
    EXPECT_EQ(e->stats().kv_blocks_used, 0);
  }
}

TEST_F(PrefixCacheFile, AFileForOtherWeightsIsIgnored) {
  save_turn1("qwen3_5-tiny");
  expect_ignored("qwen3next-tiny", "written for other weights");
}

// bf16 and f16 caches have blocks of the same size: neither reads the other's file, and each
// reads its own.
TEST_F(PrefixCacheFile, AFileForAnotherCacheTypeOfTheSameSizeIsIgnored) {
  for (auto [wrote, reads] : {std::pair{DType::BF16, DType::F16}, {DType::F16, DType::BF16}}) {
    fs::remove(file_);
    save_turn1("qwen3next-tiny", wrote);
    expect_ignored("qwen3next-tiny", "written for other weights", reads);
    fs::remove(file_);
    save_turn1("qwen3next-tiny", wrote);
    auto e = engine("qwen3next-tiny", true, wrote);
    EXPECT_EQ(run(*e, turn2_).cached, 64) << dtype_name(wrote);
  }
}

TEST_F(PrefixCacheFile, ADamagedCutOrForeignFileIsIgnored) {
  save_turn1("qwen3next-tiny");
  std::string bytes;
  {
    std::ifstream f(file_, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  ASSERT_GT(bytes.size(), 1000u);
  auto write = [&](const std::string& b) {
    std::ofstream f(file_, std::ios::binary | std::ios::trunc);
    f.write(b.data(), std::streamsize(b.size()));
  };
  std::string damaged = bytes;
  damaged[damaged.size() / 2] ^= 0x10;  // one bit of a block's keys
  write(damaged);
  expect_ignored("qwen3next-tiny", "damaged");
  write(bytes.substr(0, bytes.size() - 100));
  expect_ignored("qwen3next-tiny", "damaged");
  write(bytes.substr(0, 20));
  expect_ignored("qwen3next-tiny", "cut short");
  std::string other_version = bytes;
  other_version[8] = 9;
  write(other_version);
  expect_ignored("qwen3next-tiny", "format version 9");
  // The intact file still loads.
  write(bytes);
  auto e = engine("qwen3next-tiny", true);
  EXPECT_EQ(run(*e, turn2_).cached, 64);
}

// A file at the cache's path that is not a prefix cache (a path mistyped for the weights', say)
// is refused at creation and never overwritten, also when it appears after the engine started.
TEST_F(PrefixCacheFile, AFileThatIsNotAPrefixCacheIsRefusedAndKept) {
  const std::string foreign = "{\"not\": \"a cache\"}";
  auto write = [&](const std::string& b) {
    std::ofstream f(file_, std::ios::binary | std::ios::trunc);
    f.write(b.data(), std::streamsize(b.size()));
  };
  auto read = [&] {
    std::ifstream f(file_, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  EngineConfig cfg;
  cfg.max_batch = 2;
  cfg.max_batch_tokens = 64;
  cfg.kv_blocks = 64;
  cfg.prefix_snapshots = 8;
  cfg.prefix_cache_file = file_;
  for (const std::string& content : {foreign, std::string("RECUR")}) {
    write(content);
    auto e = Engine::create(kRoot + "/models/qwen3next-tiny", *ops_, cfg, nullptr);
    ASSERT_FALSE(e.ok()) << "a file of " << content.size() << " bytes";
    EXPECT_NE(e.error().message.find("exists and is not a prefix-cache file"), std::string::npos)
        << e.error().message;
    EXPECT_EQ(read(), content);
  }
  // A FIFO is refused by its type, before anything opens it (an open would wait for a writer).
  fs::remove(file_);
  ASSERT_EQ(mkfifo(file_.c_str(), 0600), 0);
  auto fifo = Engine::create(kRoot + "/models/qwen3next-tiny", *ops_, cfg, nullptr);
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.error().message.find("is not a prefix-cache file"), std::string::npos);
  // An empty file (a first save cut short by a power loss) is a cache cut short: ignored, then
  // written over.
  fs::remove(file_);
  write("");
  {
    auto empty = engine("qwen3next-tiny", true);
    ASSERT_EQ(empty->notes().size(), 1u);
    EXPECT_NE(empty->notes()[0].find("ignored: cut short"), std::string::npos) << empty->notes()[0];
    EXPECT_EQ(run(*empty, turn1_).cached, 0);
    ASSERT_TRUE(empty->save_prefix_cache().ok());
    EXPECT_EQ(read().substr(0, 8), "RECURPFX");
  }
  fs::remove(file_);
  auto e = engine("qwen3next-tiny", true);
  EXPECT_EQ(run(*e, turn1_).cached, 0);
  write(foreign);  // put there while the engine ran
  const Status st = e->save_prefix_cache();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("not a prefix-cache file"), std::string::npos);
  EXPECT_EQ(read(), foreign);
}

}  // namespace
}  // namespace recur
