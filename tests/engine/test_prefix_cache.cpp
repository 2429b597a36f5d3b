// The prefix cache: its bookkeeping alone (matches, references, least-recently-used eviction,
// the hash table under churn), the engine over it with a fake model that checks every restored
// slot continues from the snapshot's position, and the shipped models, whose outputs with the
// cache must equal their outputs without it.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <numeric>
#include <random>

#include "alloc_counter.h"
#include "backend/backend.h"
#include "engine/engine.h"
#include "engine/prefix_cache.h"
#include "engine_test_util.h"
#include "fake_model.h"
#include "model/registry.h"

namespace recur {
namespace {

const std::string kRoot = RECUR_SOURCE_DIR;

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// ---- the bookkeeping alone ----

struct Chain {
  std::vector<int32_t> tokens;
  std::vector<uint64_t> hashes;
  Chain(std::vector<int32_t> t, int bs) : tokens(std::move(t)) {
    prefix_block_hashes(tokens, bs, 7, &hashes);
  }
  std::span<const int32_t> block(int j, int bs) const {
    return std::span(tokens).subspan(size_t(j) * size_t(bs), size_t(bs));
  }
};

TEST(PrefixCache, MatchesTheLongestSnapshottedChainAndSharesEqualBlocks) {
  const int bs = 4;
  PrefixCache cache(bs, 16, 4);
  const Chain a(random_tokens(16, 50, 1), bs);
  int32_t parent = -1;
  std::vector<int32_t> entries;
  for (int j = 0; j < 4; ++j) {
    parent = cache.publish(parent, a.hashes[size_t(j)], a.block(j, bs), 100 + j);
    EXPECT_EQ(cache.block(parent), 100 + j);
    entries.push_back(parent);
  }
  const int32_t snap1 = cache.add_snapshot(entries[1]);
  EXPECT_GE(snap1, 0);
  EXPECT_EQ(cache.add_snapshot(entries[1]), -1) << "one snapshot per entry";
  std::vector<int32_t> chain;
  // The same prompt: the snapshot after block 1 is the longest usable point.
  EXPECT_EQ(cache.match(a.hashes, a.tokens, 15, &chain), snap1);
  EXPECT_EQ(chain, std::vector<int32_t>(entries.begin(), entries.begin() + 2));
  // max_tokens cuts it short.
  EXPECT_EQ(cache.match(a.hashes, a.tokens, 7, &chain), -1);
  EXPECT_TRUE(chain.empty());
  // A prompt differing in its second block shares only the first, which holds no snapshot.
  std::vector<int32_t> other = a.tokens;
  other[5] += 1;
  const Chain b(other, bs);
  EXPECT_EQ(cache.match(b.hashes, b.tokens, 15, &chain), -1);
  // Publishing a block another sequence has published returns that entry, acquired.
  const int32_t again = cache.publish(-1, a.hashes[0], a.block(0, bs), 999);
  EXPECT_EQ(again, entries[0]);
  EXPECT_EQ(cache.block(again), 100);
  EXPECT_EQ(cache.refs(again), 2);
  cache.release(again);
  for (int j = 3; j >= 0; --j) cache.release(entries[size_t(j)]);
  EXPECT_EQ(cache.unreferenced(), 4);
  EXPECT_EQ(cache.unreferenced_in(chain), 0);
}

TEST(PrefixCache, EvictsLeavesLeastRecentlyUsedFirstAndNeverAReferencedEntry) {
  const int bs = 2;
  PrefixCache cache(bs, 8, 2);
  const Chain a({1, 2, 3, 4, 5, 6}, bs), b({7, 8, 9, 10}, bs);
  const int32_t a0 = cache.publish(-1, a.hashes[0], a.block(0, bs), 0);
  const int32_t a1 = cache.publish(a0, a.hashes[1], a.block(1, bs), 1);
  const int32_t b0 = cache.publish(-1, b.hashes[0], b.block(0, bs), 2);
  const int32_t b1 = cache.publish(b0, b.hashes[1], b.block(1, bs), 3);
  EXPECT_EQ(cache.evict_block(), -1) << "everything is referenced";
  cache.release(a1);
  cache.release(a0);  // chain a released first: the oldest
  cache.release(b1);
  EXPECT_EQ(cache.unreferenced(), 3);
  // a1 is the oldest leaf; then a0 (a leaf once a1 is gone); b0 is still referenced by b1's
  // sequence, so b1 goes next and b0 never.
  EXPECT_EQ(cache.evict_block(), 1);
  EXPECT_EQ(cache.evict_block(), 0);
  EXPECT_EQ(cache.evict_block(), 3);
  EXPECT_EQ(cache.evict_block(), -1);
  EXPECT_EQ(cache.entries(), 1);
  cache.release(b0);
  EXPECT_EQ(cache.evict_block(), 2);
  EXPECT_EQ(cache.entries(), 0);
  EXPECT_EQ(cache.evictions(), 4);
}

TEST(PrefixCache, SnapshotsGoLeastRecentlyUsedFirst) {
  const int bs = 2;
  PrefixCache cache(bs, 8, 2);
  const Chain a({1, 2, 3, 4, 5, 6}, bs);
  int32_t e[3], parent = -1;
  for (int j = 0; j < 3; ++j)
    e[j] = parent = cache.publish(parent, a.hashes[size_t(j)], a.block(j, bs), j);
  const int32_t s0 = cache.add_snapshot(e[0]);
  const int32_t s1 = cache.add_snapshot(e[1]);
  cache.touch_snapshot(e[0]);  // e[1]'s is now the oldest
  EXPECT_EQ(cache.add_snapshot(e[2]), s1);
  EXPECT_EQ(cache.snapshot(e[1]), -1);
  EXPECT_EQ(cache.snapshot(e[0]), s0);
  EXPECT_EQ(cache.snapshot_evictions(), 1);
  EXPECT_EQ(cache.snapshots(), 2);
}

// Many chains published and evicted in random order: every entry still in the cache is found
// (the hash table's deletions keep probe runs whole), and evicted ones are not.
TEST(PrefixCache, HashTableStaysConsistentUnderChurn) {
  const int bs = 1, capacity = 64;
  PrefixCache cache(bs, capacity, 0);
  std::mt19937 rng(3);
  std::vector<std::pair<Chain, int32_t>> live;
  int next_block = 0;
  std::vector<int32_t> free_blocks;
  for (int i = 0; i < capacity; ++i) free_blocks.push_back(i);
  for (int round = 0; round < 2000; ++round) {
    if (!free_blocks.empty() && rng() % 3 != 0) {
      Chain c({int32_t(next_block++)}, bs);
      const int32_t b = free_blocks.back();
      free_blocks.pop_back();
      const int32_t id = cache.publish(-1, c.hashes[0], c.block(0, bs), b);
      cache.release(id);
      live.emplace_back(std::move(c), b);
    } else if (!live.empty()) {
      const int32_t b = cache.evict_block();  // the oldest: live's front
      ASSERT_EQ(b, live.front().second);
      free_blocks.push_back(b);
      live.erase(live.begin());
    }
    if (round % 97 == 0) {
      for (const auto& [c, b] : live) {
        const int32_t id = cache.publish(-1, c.hashes[0], c.block(0, bs), -5);
        ASSERT_EQ(cache.block(id), b) << "round " << round;
        cache.release(id);
      }
    }
  }
  EXPECT_EQ(cache.entries(), int(live.size()));
}

// ---- the engine over a fake model ----

struct FakeHarness {
  std::unique_ptr<Ops> ops;
  testing::FakeModel* model = nullptr;  // owned by the engine
  std::unique_ptr<Engine> engine;
  explicit FakeHarness(const EngineConfig& cfg) {
    auto o = create_backend("cpu", 1);
    EXPECT_TRUE(o.ok());
    ops = std::move(*o);
    auto m = std::make_unique<testing::FakeModel>(*ops, Engine::load_options(cfg));
    model = m.get();
    auto e = Engine::create(std::move(m), cfg, nullptr);
    EXPECT_TRUE(e.ok()) << e.error().to_string();
    engine = std::move(*e);
  }
  Outcome run(const Request& r) {
    Outcome out;
    EXPECT_TRUE(engine->submit(r, collect(&out)).ok());
    engine->run_until_idle();
    return out;
  }
  // Every sequence released: no slot, no block held by a sequence, no reference left.
  void expect_idle() const {
    const EngineStats st = engine->stats();
    EXPECT_EQ(st.slots_used, 0);
    EXPECT_EQ(st.kv_blocks_used, 0);
    EXPECT_EQ(st.running + st.waiting, 0);
    EXPECT_TRUE(model->violations.empty()) << model->violations.front();
  }
};

EngineConfig fake_config() {
  EngineConfig cfg;
  cfg.max_batch = 4;
  cfg.max_batch_tokens = 64;
  cfg.kv_blocks = 256;
  cfg.block_size = 16;
  cfg.prefix_snapshots = 16;
  cfg.snapshot_interval = 32;
  return cfg;
}

TEST(PrefixCacheEngine, ANextTurnStartsFromTheLastBlockBoundaryOfThePreviousPrompt) {
  FakeHarness h(fake_config());
  const std::vector<int32_t> turn1 = random_tokens(75, testing::FakeModel::kVocab, 1);
  const Outcome a = h.run(greedy_request(turn1, 4));
  EXPECT_EQ(a.cached, 0);
  const size_t before = h.model->batches.size();
  const Outcome b = h.run(greedy_request(concat(turn1, random_tokens(30, 64, 2)), 4));
  EXPECT_EQ(b.cached, 64) << "the end-of-prompt snapshot, at 75 rounded down to blocks of 16";
  // Its first forward starts where the snapshot was taken (the fake model checks that the
  // restored slot holds that position).
  ASSERT_GT(h.model->batches.size(), before);
  EXPECT_EQ(h.model->batches[before].seqs[0].first_pos, 64);
  // A prompt sharing 40 tokens starts from the interval snapshot at 32.
  const Outcome c = h.run(greedy_request(
      concat(std::vector<int32_t>(turn1.begin(), turn1.begin() + 40), random_tokens(10, 64, 3)),
      4));
  EXPECT_EQ(c.cached, 32);
  const EngineStats st = h.engine->stats();
  EXPECT_EQ(st.prefix_queries, 3);
  EXPECT_EQ(st.prefix_hit_tokens, 96);
  EXPECT_GT(st.prefix_snapshots, 0);
  h.expect_idle();
}

// Requests arriving together with one prefix: the first prefills it, the others wait for its
// snapshot and prefill only their own ends. With aging_steps 1 they stop waiting after a step
// and prefill side by side instead, each reading the blocks another published first.
TEST(PrefixCacheEngine, ConcurrentRequestsForOnePrefixComputeItOnce) {
  for (const int aging : {1000, 1}) {
    EngineConfig cfg = fake_config();
    cfg.aging_steps = aging;
    FakeHarness h(cfg);
    const std::vector<int32_t> shared = random_tokens(96, 64, 4);
    std::vector<Outcome> runs(4);
    int total = 0;
    for (size_t i = 0; i < runs.size(); ++i) {
      auto p = concat(shared, random_tokens(5 + int(i), 64, 10 + uint32_t(i)));
      total += int(p.size());
      ASSERT_TRUE(h.engine->submit(greedy_request(p, 6), collect(&runs[i])).ok());
    }
    h.engine->run_until_idle();
    for (const Outcome& r : runs) EXPECT_TRUE(r.done && r.reason == FinishReason::kLength);
    const EngineStats st = h.engine->stats();
    if (aging == 1000) {
      for (size_t i = 1; i < runs.size(); ++i) EXPECT_EQ(runs[i].cached, 96) << i;
      EXPECT_EQ(st.prompt_tokens, total - 3 * 96) << "the shared tokens were computed once";
    } else {
      EXPECT_GT(st.prompt_tokens, total - 3 * 96) << "side by side";
    }
    // The six shared blocks are held once, whoever computed them.
    EXPECT_EQ(st.prefix_blocks, 6);
    h.expect_idle();
  }
}

TEST(PrefixCacheEngine, TheNextRequestWithAPrefixFindsIt) {
  FakeHarness h(fake_config());
  const std::vector<int32_t> shared = random_tokens(96, 64, 4);
  EXPECT_EQ(h.run(greedy_request(concat(shared, {4, 5, 6, 7}), 2)).cached, 0);
  // And the next request with the prefix finds it.
  EXPECT_EQ(h.run(greedy_request(concat(shared, {1, 2, 3}), 2)).cached, 96);
  h.expect_idle();
}

TEST(PrefixCacheEngine, EvictionUnderMemoryPressureKeepsEveryRequestWhole) {
  EngineConfig cfg = fake_config();
  cfg.kv_blocks = 48;  // room for four sequences; far from all twelve prompts' blocks
  cfg.prefix_snapshots = 3;
  FakeHarness h(cfg);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 12; ++i) prompts.push_back(random_tokens(60 + 7 * i, 64, 100 + uint32_t(i)));
  std::vector<Outcome> runs(prompts.size() * 2);
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_TRUE(
          h.engine
              ->submit(greedy_request(prompts[i], 20), collect(&runs[pass * prompts.size() + i]))
              .ok());
    }
    h.engine->run_until_idle();
  }
  for (const Outcome& r : runs) {
    EXPECT_TRUE(r.done && r.reason == FinishReason::kLength);
    EXPECT_EQ(r.ids.size(), 20u);
  }
  const EngineStats st = h.engine->stats();
  EXPECT_GT(st.prefix_evictions, 0);
  EXPECT_GT(st.prefix_snapshot_evictions, 0);
  EXPECT_LE(st.prefix_snapshots, 3);
  h.expect_idle();
}

TEST(PrefixCacheEngine, CancellingThePrefillingOwnerOfASharedPrefixLeavesItUsable) {
  EngineConfig cfg = fake_config();
  cfg.max_batch_tokens = 32;
  FakeHarness h(cfg);
  const std::vector<int32_t> shared = random_tokens(160, 64, 5);
  Outcome first, second;
  auto submitted = h.engine->submit(greedy_request(shared, 4), collect(&first));
  ASSERT_TRUE(submitted.ok());
  const uint64_t id = *submitted;
  h.engine->step();
  h.engine->step();
  ASSERT_TRUE(h.engine->submit(greedy_request(concat(shared, {9}), 4), collect(&second)).ok());
  h.engine->step();  // the second waits for the first to reach the end of their prefix
  h.engine->cancel(id);
  h.engine->run_until_idle();
  EXPECT_EQ(first.reason, FinishReason::kCancelled);
  EXPECT_EQ(second.reason, FinishReason::kLength);
  EXPECT_EQ(second.cached, 96) << "what the first had snapshotted when it was cancelled";
  h.expect_idle();
  EXPECT_EQ(h.run(greedy_request(concat(shared, {1, 2}), 2)).cached, 160);
  h.expect_idle();
}

// Publishing blocks, taking snapshots, waiting for a shared prefix and restoring allocate
// nothing on the heap: admission makes two allocations per request (its block table and its
// list of cache entries, reserved for their whole life).
TEST(PrefixCacheEngine, StepsAllocateNothingButTwoTablesPerAdmission) {
  FakeHarness h(fake_config());
  h.model->record = false;
  const std::vector<int32_t> shared = random_tokens(200, 64, 8);
  int64_t events = 0;
  auto submit = [&](std::vector<int32_t> prompt) {
    ASSERT_TRUE(
        h.engine
            ->submit(greedy_request(std::move(prompt), 30), [&events](const Event&) { ++events; })
            .ok());
  };
  submit(concat(shared, {1}));
  h.engine->step();
  h.engine->step();  // vectors reach their capacity
  submit(concat(shared, {2, 3}));
  std::vector<int64_t> allocs;
  for (int i = 0; i < 40; ++i) {
    testing::start_counting_allocs();
    h.engine->step();
    allocs.push_back(testing::stop_counting_allocs());
  }
  EXPECT_EQ(std::accumulate(allocs.begin(), allocs.end(), int64_t(0)), 2)
      << "the second admission's";
  EXPECT_EQ(h.engine->stats().prefix_hit_tokens, 192);
  EXPECT_GT(events, 40);
  h.engine->run_until_idle();
  h.expect_idle();
}

// ---- the shipped models ----

struct ModelRun {
  std::vector<int32_t> ids;
  std::vector<std::vector<TokenLogprob>> top;  // raw top logprobs per generated token
  int cached = -1;
  FinishReason reason = FinishReason::kError;
  bool done = false;
};

EventSink collect(ModelRun* r) {
  return [r](const Event& ev) {
    if (ev.kind == Event::Kind::kToken) {
      r->ids.push_back(ev.token);
      r->top.emplace_back(ev.top_logprobs.begin(), ev.top_logprobs.end());
    } else {
      r->cached = ev.cached_tokens;
      r->reason = ev.reason;
      r->done = true;
    }
  };
}

Request model_request(std::vector<int32_t> prompt, int max_tokens) {
  Request r = greedy_request(std::move(prompt), max_tokens);
  r.sampling.logprobs = 5;
  return r;
}

// Same greedy tokens, and the raw log-probabilities (logits less their log-sum-exp) within
// 1e-4 at every step.
void expect_same(const ModelRun& a, const ModelRun& b, const std::string& what) {
  ASSERT_TRUE(a.done && b.done) << what;
  ASSERT_EQ(a.ids, b.ids) << what;
  ASSERT_EQ(a.top.size(), b.top.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < a.top.size(); ++i) {
    ASSERT_EQ(a.top[i].size(), b.top[i].size()) << what;
    for (size_t j = 0; j < a.top[i].size(); ++j) {
      ASSERT_EQ(a.top[i][j].id, b.top[i][j].id) << what << " step " << i;
      worst = std::max(worst, double(std::fabs(a.top[i][j].logprob - b.top[i][j].logprob)));
    }
  }
  EXPECT_LE(worst, 1e-4) << what;
}

class PrefixCacheOnModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const char* device = std::getenv("RECUR_TEST_DEVICE");  // cuda on the device machine
    auto o = create_backend(device ? device : "cpu", 2);
    ASSERT_TRUE(o.ok());
    ops_ = std::move(*o);
    model_ = kRoot + "/models/" + GetParam();
  }
  std::unique_ptr<Engine> engine(bool cache, int max_batch) {
    EngineConfig cfg;
    cfg.max_batch = max_batch;
    cfg.max_batch_tokens = 64;
    cfg.kv_blocks = 64;
    cfg.prefix_snapshots = cache ? 8 : 0;
    cfg.snapshot_interval = 32;
    auto e = Engine::create(model_, *ops_, cfg, nullptr);
    EXPECT_TRUE(e.ok()) << e.error().to_string();
    return e.ok() ? std::move(*e) : nullptr;
  }
  // Each request alone on an engine without the cache.
  std::vector<ModelRun> alone(const std::vector<Request>& reqs) {
    auto e = engine(false, 1);
    std::vector<ModelRun> out(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_TRUE(e->submit(reqs[i], collect(&out[i])).ok());
      e->run_until_idle();
    }
    return out;
  }
  static void expect_idle(const Engine& e, int64_t live_buffers) {
    const EngineStats st = e.stats();
    EXPECT_EQ(st.slots_used, 0);
    EXPECT_EQ(st.kv_blocks_used, 0) << "a reference to a cached block was not given back";
    EXPECT_EQ(st.alloc.live_buffers, live_buffers) << "the cache's memory is all from start-up";
  }
  std::unique_ptr<Ops> ops_;
  std::string model_;
};
INSTANTIATE_TEST_SUITE_P(Models, PrefixCacheOnModel,
                         ::testing::Values("qwen3next-tiny", "qwen3_5-tiny", "qwen3_5-moe-tiny",
                                           "kimi-linear-tiny"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) c = std::isalnum(uint8_t(c)) ? c : '_';
                           return n;
                         });

// The model alone: a snapshot taken after 48 tokens, restored into a slot whose block table
// starts with the blocks another sequence wrote, gives exactly the logits of the same two
// chunks fed from a zeroed slot. (Chunk boundaries themselves move logits by up to ~3e-4 on
// qwen3next-tiny, as verify's chunked mode allows: the reference is cut where the cache cuts.)
TEST_P(PrefixCacheOnModel, ARestoredSnapshotOverSharedBlocksGivesTheLogitsOfThePrefill) {
  LoadOptions opt;
  opt.max_batch_tokens = 80;
  opt.max_logit_rows = 80;
  opt.state.n_slots = 2;
  opt.state.n_blocks = 16;
  opt.state.n_snapshots = 1;
  auto loaded = load_model(model_, *ops_, opt);
  ASSERT_TRUE(loaded.ok()) << loaded.error().to_string();
  Model& m = **loaded;
  const int vocab = m.info().vocab_size;
  auto buf = ops_->allocator().allocate(size_t(80) * size_t(vocab) * 4, "logits");
  ASSERT_TRUE(buf.ok());
  const Tensor logits = view(*buf, DType::F32, {80, vocab});
  const std::vector<int32_t> prompt = random_tokens(80, vocab, 9);
  const std::span<const int32_t> all(prompt);
  auto run = [&](int slot, int first, int n, std::vector<int32_t> blocks, Batch::Logits want) {
    Batch b;
    b.add_sequence(slot, first, all.subspan(size_t(first), size_t(n)), blocks, want);
    ASSERT_TRUE(m.forward(b, logits).ok());
  };
  // Without the cache: slot 1, blocks 5..9.
  m.reset_slot(1);
  run(1, 0, 48, {5, 6, 7}, Batch::Logits::kNone);
  run(1, 48, 32, {5, 6, 7, 8, 9}, Batch::Logits::kAll);
  // The logits may live on a device: read them through the ops.
  auto host_logits = [&] {
    std::vector<float> h(size_t(80) * size_t(vocab));
    ops_->copy_to_host(logits, h.data());
    h.resize(32 * size_t(vocab));
    return h;
  };
  const std::vector<float> want = host_logits();
  // The cached prefix: slot 0 writes blocks 0..2 and is snapshotted after token 48, then
  // takes another prompt's tokens (its state is overwritten) before the restore.
  m.reset_slot(0);
  run(0, 0, 48, {0, 1, 2}, Batch::Logits::kNone);
  m.save_snapshot(0, 0);
  m.reset_slot(0);
  run(0, 0, 20, {3, 4}, Batch::Logits::kNone);
  m.restore_snapshot(0, 0);
  run(0, 48, 32, {0, 1, 2, 10, 11}, Batch::Logits::kAll);
  const std::vector<float> got = host_logits();
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, double(std::fabs(want[i] - got[i])));
  }
  EXPECT_EQ(worst, 0.0) << "the snapshot holds the state bit for bit";
}

// The budget buys snapshots, each with the blocks of one interval, added to the attention
// cache; bad values are errors, not aborts.
TEST_P(PrefixCacheOnModel, TheBudgetSizesSnapshotsAndBlocks) {
  EngineConfig cfg;
  cfg.kv_blocks = 32;
  cfg.snapshot_interval = 64;
  cfg.prefix_cache_bytes = 0;
  auto off = Engine::create(model_, *ops_, cfg, nullptr);
  ASSERT_TRUE(off.ok());
  const ModelInfo& info = (*off)->model_info();
  EXPECT_EQ((*off)->stats().prefix_snapshots_total, 0);
  const int64_t per_interval = info.state_bytes_per_slot + 4 * info.cache_bytes_per_block;
  cfg.prefix_cache_bytes = 3 * per_interval + info.cache_bytes_per_block;
  auto on = Engine::create(model_, *ops_, cfg, nullptr);
  ASSERT_TRUE(on.ok());
  const EngineStats st = (*on)->stats();
  EXPECT_EQ(st.prefix_snapshots_total, 3);
  EXPECT_EQ(st.kv_blocks_total, 32 + 3 * 4 + 1);
  EXPECT_EQ(st.prefix_snapshot_bytes, info.state_bytes_per_slot);
  cfg.prefix_cache_bytes = -1;
  EXPECT_FALSE(Engine::create(model_, *ops_, cfg, nullptr).ok());
  cfg.prefix_cache_bytes = 0;
  cfg.snapshot_interval = 0;
  EXPECT_FALSE(Engine::create(model_, *ops_, cfg, nullptr).ok());
}

// A chat's next turn (the end-of-prompt snapshot), a prompt sharing part of it (a snapshot
// inside the prompt, at a block boundary) and the next turn again (its own end-of-prompt
// snapshot), one after the other.
TEST_P(PrefixCacheOnModel, HitsGiveTheOutputsOfAFullPrefill) {
  const std::vector<int32_t> turn1 = random_tokens(75, 256, 1);
  const std::vector<int32_t> turn2 = concat(turn1, random_tokens(40, 256, 2));
  const std::vector<int32_t> branch =
      concat(std::vector<int32_t>(turn1.begin(), turn1.begin() + 40), random_tokens(20, 256, 3));
  const std::vector<Request> reqs = {model_request(turn1, 8), model_request(turn2, 8),
                                     model_request(branch, 8), model_request(turn2, 8)};
  const std::vector<int> cached = {0, 64, 32, 112};
  const std::vector<ModelRun> want = alone(reqs);
  auto e = engine(true, 2);
  const int64_t live = e->stats().alloc.live_buffers;
  for (size_t i = 0; i < reqs.size(); ++i) {
    ModelRun got;
    ASSERT_TRUE(e->submit(reqs[i], collect(&got)).ok());
    e->run_until_idle();
    expect_same(got, want[i], "request " + std::to_string(i));
    EXPECT_EQ(got.cached, cached[i]) << "request " << i;
  }
  expect_idle(*e, live);
}

// Requests racing for one prefix, one arriving while it is prefilled: they wait for its
// snapshot (aging_steps 1000) or, no longer waiting after a step, prefill it side by side and
// read the blocks each other published (aging_steps 1).
TEST_P(PrefixCacheOnModel, ConcurrentRequestsForOnePrefixGiveTheirOwnOutputs) {
  const std::vector<int32_t> shared = random_tokens(70, 256, 4);
  std::vector<Request> reqs;
  for (uint32_t i = 0; i < 4; ++i) {
    reqs.push_back(model_request(concat(shared, random_tokens(3 + int(i) * 9, 256, 20 + i)), 6));
  }
  const std::vector<ModelRun> want = alone(reqs);
  for (const int aging : {1000, 1}) {
    EngineConfig cfg;
    cfg.max_batch = 3;
    cfg.max_batch_tokens = 64;
    cfg.kv_blocks = 64;
    cfg.prefix_snapshots = 8;
    cfg.snapshot_interval = 32;
    cfg.aging_steps = aging;
    auto created = Engine::create(model_, *ops_, cfg, nullptr);
    ASSERT_TRUE(created.ok());
    Engine& e = **created;
    const int64_t live = e.stats().alloc.live_buffers;
    std::vector<ModelRun> got(reqs.size());
    for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(e.submit(reqs[i], collect(&got[i])).ok());
    for (int s = 0; s < 3; ++s) e.step();
    ASSERT_TRUE(e.submit(reqs[3], collect(&got[3])).ok());
    e.run_until_idle();
    const std::string what = "aging " + std::to_string(aging) + " request ";
    for (size_t i = 0; i < reqs.size(); ++i) expect_same(got[i], want[i], what + std::to_string(i));
    EXPECT_GT(got[3].cached, 0);
    if (aging == 1000) {
      EXPECT_EQ(got[1].cached, 64) << "waited for the first one's snapshot at the prefix's end";
    }
    expect_idle(e, live);
  }
}

// The sequence prefilling a prefix is cancelled while another reads the blocks it published:
// the reader's output is its own, and what the cancelled one left serves a later request.
TEST_P(PrefixCacheOnModel, CancellationWhileAPrefixIsPrefilled) {
  const std::vector<int32_t> shared = random_tokens(150, 256, 5);
  const std::vector<Request> reqs = {model_request(concat(shared, {7}), 5),
                                     model_request(concat(shared, {8, 9}), 5)};
  const std::vector<ModelRun> want = alone(reqs);
  auto e = engine(true, 2);
  const int64_t live = e->stats().alloc.live_buffers;
  ModelRun cancelled, reader, later;
  auto submitted = e->submit(model_request(shared, 5), collect(&cancelled));
  ASSERT_TRUE(submitted.ok());
  const uint64_t id = *submitted;
  e->step();  // 0..32
  e->step();  // 32..64
  ASSERT_TRUE(e->submit(reqs[0], collect(&reader)).ok());
  e->step();  // the reader waits for the prefix: 64..96
  e->cancel(id);
  e->run_until_idle();
  EXPECT_EQ(cancelled.reason, FinishReason::kCancelled);
  EXPECT_EQ(reader.cached, 96);
  expect_same(reader, want[0], "the reader");
  ASSERT_TRUE(e->submit(reqs[1], collect(&later)).ok());
  e->run_until_idle();
  EXPECT_EQ(later.cached, 144);
  expect_same(later, want[1], "the later request");
  expect_idle(*e, live);
}

// Two snapshot slots for many prompts: snapshots and blocks are evicted, outputs stay.
TEST_P(PrefixCacheOnModel, EvictionUnderMemoryPressure) {
  std::vector<Request> reqs;
  const std::vector<int32_t> base = random_tokens(40, 256, 6);
  for (uint32_t i = 0; i < 6; ++i) {
    reqs.push_back(model_request(concat(base, random_tokens(30 + int(i) * 5, 256, 30 + i)), 4));
  }
  reqs.push_back(reqs[1]);  // again, after the cache has moved on
  const std::vector<ModelRun> want = alone(reqs);
  EngineConfig cfg;
  cfg.max_batch = 2;
  cfg.max_batch_tokens = 64;
  cfg.kv_blocks = 14;  // the six prompts leave 18 full blocks
  cfg.prefix_snapshots = 2;
  cfg.snapshot_interval = 32;
  auto created = Engine::create(model_, *ops_, cfg, nullptr);
  ASSERT_TRUE(created.ok());
  Engine& e = **created;
  const int64_t live = e.stats().alloc.live_buffers;
  for (size_t i = 0; i < reqs.size(); ++i) {
    ModelRun got;
    ASSERT_TRUE(e.submit(reqs[i], collect(&got)).ok());
    e.run_until_idle();
    expect_same(got, want[i], "request " + std::to_string(i));
  }
  const EngineStats st = e.stats();
  EXPECT_GT(st.prefix_evictions, 0);
  EXPECT_GT(st.prefix_snapshot_evictions, 0);
  EXPECT_GT(st.prefix_hit_tokens, 0);
  expect_idle(e, live);
}

}  // namespace
}  // namespace recur
