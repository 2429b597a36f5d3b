// An attention cache too small for every running sequence at once: sequences are preempted and
// resume by recomputation, and each still gets exactly the tokens it gets alone (greedy, seeded
// sampling with penalties, a constraint), every one of them once; a sequence's context is
// bounded by what the cache holds for it alone; and repeated preemptions allocate nothing.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "alloc_counter.h"
#include "backend/backend.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "fake_model.h"

namespace recur {
namespace {

using testing::FakeModel;

const std::string kRoot = RECUR_SOURCE_DIR;

// One request's events.
struct Seen {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  int finishes = 0;
  bool event_after_finish = false;
  FinishReason reason = FinishReason::kError;
  std::string message;
  int prompt_tokens = -1, generated_tokens = -1, cached = -1;
};

EventSink record(Seen* s) {
  return [s](const Event& ev) {
    if (s->finishes > 0) s->event_after_finish = true;
    if (ev.kind == Event::Kind::kToken) {
      s->ids.push_back(ev.token);
      s->logprobs.push_back(ev.logprob);
      return;
    }
    ++s->finishes;
    s->reason = ev.reason;
    s->message = std::string(ev.message);
    s->prompt_tokens = ev.prompt_tokens;
    s->generated_tokens = ev.generated_tokens;
    s->cached = ev.cached_tokens;
  };
}

// Allows a token when (token + tokens accepted so far) is not a multiple of 3: its answer
// depends on everything the sequence generated, so a rule restarted on resumption would differ.
class CountingConstraint : public TokenConstraint {
 public:
  bool allows(int32_t t) override { return (t + accepted_) % 3 != 0; }
  void mask(std::span<float> logits) override {
    for (size_t t = 0; t < logits.size(); ++t) {
      if (!allows(int32_t(t))) logits[t] = -INFINITY;
    }
  }
  void accept(int32_t) override { ++accepted_; }

 private:
  int accepted_ = 0;
};
class CountingSpec : public ConstraintSpec {
 public:
  std::unique_ptr<TokenConstraint> start() const override {
    return std::make_unique<CountingConstraint>();
  }
};

// Request i of a mixed set: greedy, or seeded sampling with every penalty (and, on the fake
// model, a constraint on some), all ignoring end-of-sequence.
Request mixed_request(size_t i, std::vector<int32_t> prompt, int max_tokens, bool constrain) {
  Request r = greedy_request(std::move(prompt), max_tokens);
  r.sampling.logprobs = 2;
  if (i % 2 == 1) {
    r.sampling.temperature = 2.5f;
    r.sampling.seed = 1000 + i;
    r.sampling.repetition_penalty = 1.2f;
    r.sampling.presence_penalty = 0.5f;
    r.sampling.frequency_penalty = 0.3f;
    if (i % 4 == 1) r.sampling.top_p = 0.95f;
    if (i % 4 == 3) r.sampling.top_k = 40;
  }
  if (constrain && i % 3 == 2) r.constraint = std::make_shared<CountingSpec>();
  return r;
}

void expect_whole(const Seen& got, const Request& req, const std::string& what) {
  EXPECT_EQ(got.finishes, 1) << what;
  EXPECT_FALSE(got.event_after_finish) << what;
  EXPECT_EQ(got.reason, FinishReason::kLength) << what << ": " << got.message;
  EXPECT_EQ(got.message, "max_tokens reached") << what;
  EXPECT_EQ(int(got.ids.size()), req.max_tokens) << what;
  EXPECT_EQ(got.generated_tokens, req.max_tokens) << what;
  EXPECT_EQ(got.prompt_tokens, int(req.prompt.size())) << what << ": the request's own prompt";
}

// ---- the fake model: the logits depend on the last token only, so a resumed sequence's
// logits are exactly those it had, and only its sampler's state can make it differ ----

struct FakeEngine {
  std::unique_ptr<Ops> ops;
  FakeModel* model = nullptr;
  std::unique_ptr<Engine> engine;
  explicit FakeEngine(const EngineConfig& cfg) {
    auto o = create_backend("cpu", 1);
    EXPECT_TRUE(o.ok());
    ops = std::move(*o);
    auto m = std::make_unique<FakeModel>(*ops, Engine::load_options(cfg));
    model = m.get();
    auto e = Engine::create(std::move(m), cfg, nullptr);
    EXPECT_TRUE(e.ok()) << e.error().to_string();
    engine = std::move(*e);
  }
};

EngineConfig fake_config(int max_batch, int kv_blocks) {
  EngineConfig cfg;
  cfg.max_batch = max_batch;
  cfg.max_batch_tokens = 32;
  cfg.kv_blocks = kv_blocks;
  cfg.step_time_target_ms = 0;
  cfg.seed = 1;
  return cfg;
}

std::vector<Request> fake_requests(int n, int max_tokens) {
  std::vector<Request> reqs;
  for (int i = 0; i < n; ++i) {
    reqs.push_back(mixed_request(size_t(i), random_tokens(20 + 9 * i, FakeModel::kVocab, 50 + i),
                                 max_tokens, true));
  }
  return reqs;
}

TEST(Preemption, ResumedSequencesSampleExactlyAsIfNeverPreempted) {
  const std::vector<Request> reqs = fake_requests(6, 150);
  std::vector<Seen> alone(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    FakeEngine f(fake_config(1, 4096));
    ASSERT_TRUE(f.engine->submit(reqs[i], record(&alone[i])).ok());
    f.engine->run_until_idle();
    expect_whole(alone[i], reqs[i], "alone " + std::to_string(i));
  }
  // 16 blocks (256 positions) for six sequences growing to 170-215 positions each.
  FakeEngine f(fake_config(6, 16));
  ASSERT_EQ(f.engine->config().max_context, 256);
  std::vector<Seen> together(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(f.engine->submit(reqs[i], record(&together[i])).ok());
  }
  f.engine->run_until_idle();
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::string what = "request " + std::to_string(i);
    expect_whole(together[i], reqs[i], what);
    EXPECT_EQ(together[i].ids, alone[i].ids) << what;
    EXPECT_EQ(together[i].logprobs, alone[i].logprobs) << what;
  }
  EXPECT_TRUE(f.model->violations.empty()) << f.model->violations.front();
  const EngineStats st = f.engine->stats();
  EXPECT_GT(st.preemptions, 0) << "the cache never ran out: nothing was tested";
  RecordProperty("preemptions", std::to_string(st.preemptions));
  // What the model was fed after each reset of a slot: a start of one request's prompt and
  // tokens, once per admission; some resumptions fed tokens the request had generated.
  std::vector<std::vector<int32_t>> streams;
  std::vector<int> first_logits;  // the stream's length when it first asked for logits
  std::map<int32_t, size_t> open;
  for (const testing::RecordedBatch& b : f.model->batches) {
    for (const testing::RecordedSeq& s : b.seqs) {
      if (s.first_pos == 0) {
        open[s.slot] = streams.size();
        streams.emplace_back();
        first_logits.push_back(-1);
      }
      const size_t k = open.at(s.slot);
      ASSERT_EQ(int(streams[k].size()), s.first_pos);
      streams[k].insert(streams[k].end(), s.tokens.begin(), s.tokens.end());
      if (s.logits && first_logits[k] < 0) first_logits[k] = int(streams[k].size());
    }
  }
  EXPECT_EQ(int64_t(streams.size()), int64_t(reqs.size()) + st.preemptions);
  int resumed_with_tokens = 0;
  for (size_t k = 0; k < streams.size(); ++k) {
    int owner = -1;
    for (size_t i = 0; i < reqs.size(); ++i) {
      std::vector<int32_t> all = reqs[i].prompt;
      all.insert(all.end(), together[i].ids.begin(), together[i].ids.end());
      if (streams[k].size() <= all.size() &&
          std::equal(streams[k].begin(), streams[k].end(), all.begin())) {
        owner = int(i);
      }
    }
    ASSERT_GE(owner, 0) << "stream " << k << " is no request's tokens";
    if (first_logits[k] > int(reqs[size_t(owner)].prompt.size())) ++resumed_with_tokens;
  }
  EXPECT_GT(resumed_with_tokens, 0) << "no sequence was preempted after generating";
  RecordProperty("resumed_with_tokens", std::to_string(resumed_with_tokens));
  EXPECT_EQ(st.slots_used, 0);
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_EQ(st.running + st.waiting, 0);
}

// A preempted sequence's first preemption sizes its prompt once for its whole life: later
// ones, and resumptions, allocate nothing.
TEST(Preemption, RepeatedPreemptionsAllocateNothingAfterEachSequencesFirst) {
  int64_t events = 0;                // before f: the engine's shutdown still delivers events
  FakeEngine f(fake_config(6, 20));  // every prompt fits at first
  f.model->record = false;
  std::vector<Request> reqs = fake_requests(6, 150);
  for (Request& r : reqs) {
    r.sampling.logprobs = -1;  // a sampler's first top-n list reserves its room
    ASSERT_TRUE(f.engine->submit(r, [&events](const Event&) { ++events; }).ok());
  }
  f.engine->step();  // every request admitted: their block tables are made
  ASSERT_EQ(f.engine->stats().running, 6);
  testing::start_counting_allocs();
  f.engine->run_until_idle();
  const int64_t allocs = testing::stop_counting_allocs();
  const EngineStats st = f.engine->stats();
  EXPECT_GT(st.preemptions, int64_t(reqs.size())) << "some sequence was preempted twice";
  EXPECT_LE(allocs, int64_t(reqs.size())) << st.preemptions << " preemptions";
  RecordProperty("preemptions", std::to_string(st.preemptions));
  RecordProperty("allocations", std::to_string(allocs));
  EXPECT_EQ(st.requests_finished, int64_t(reqs.size()));
  EXPECT_EQ(events, 6 * 151);
}

// When the cache runs out, the least urgent sequence gives its blocks up, though it came first
// and the urgent one came later; both still finish whole. Each admission of a sequence starts
// a stream at position 0 of its slot: the urgent request's tokens are fed in one stream only.
TEST(Preemption, TheLeastUrgentSequenceIsPreemptedFirst) {
  FakeEngine f(fake_config(2, 8));  // 128 positions; each needs 120, both 240
  Request low = greedy_request(random_tokens(20, FakeModel::kVocab, 7), 100);
  low.priority = 5;
  Request urgent = greedy_request(random_tokens(20, FakeModel::kVocab, 8), 100);
  urgent.priority = -1;
  Seen a, b;
  ASSERT_TRUE(f.engine->submit(low, record(&a)).ok());
  f.engine->step();  // the low-priority request is admitted and running first
  ASSERT_TRUE(f.engine->submit(urgent, record(&b)).ok());
  f.engine->run_until_idle();
  expect_whole(a, low, "low priority");
  expect_whole(b, urgent, "urgent");
  const EngineStats st = f.engine->stats();
  EXPECT_GT(st.preemptions, 0) << "the cache never ran out: nothing was tested";
  int streams_low = 0, streams_urgent = 0;
  for (const testing::RecordedBatch& batch : f.model->batches) {
    for (const testing::RecordedSeq& s : batch.seqs) {
      if (s.first_pos != 0) continue;
      streams_low += s.tokens.front() == low.prompt.front();
      streams_urgent += s.tokens.front() == urgent.prompt.front();
    }
  }
  ASSERT_NE(low.prompt.front(), urgent.prompt.front());
  EXPECT_EQ(streams_urgent, 1) << "the urgent sequence was preempted";
  EXPECT_EQ(streams_low, 1 + st.preemptions);
}

// ---- the shipped models: a resumed sequence's state is recomputed from its tokens, which
// gives what decoding them one by one gave up to rounding; its tokens are still the same ----

struct ModelAndCache {
  std::string model;
  bool prefix_cache;
};
class PreemptionOnModel : public ::testing::TestWithParam<ModelAndCache> {};
INSTANTIATE_TEST_SUITE_P(Models, PreemptionOnModel,
                         ::testing::Values(ModelAndCache{"qwen3next-tiny", false},
                                           ModelAndCache{"qwen3next-tiny", true},
                                           ModelAndCache{"kimi-linear-tiny", false},
                                           ModelAndCache{"kimi-linear-tiny", true}),
                         [](const auto& info) {
                           std::string name = info.param.model;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name + (info.param.prefix_cache ? "_prefix_cache" : "");
                         });

std::unique_ptr<Ops> test_ops() {
  const char* d = std::getenv("RECUR_TEST_DEVICE");
  auto ops = create_backend(d ? d : "cpu", 2);
  EXPECT_TRUE(ops.ok()) << ops.error().to_string();
  return ops.ok() ? std::move(*ops) : nullptr;
}

TEST_P(PreemptionOnModel, EverySequenceFinishesWithItsSoloTokensThoughTheCacheRunsOut) {
  const std::string model = kRoot + "/models/" + GetParam().model;
  auto ops = test_ops();
  ASSERT_TRUE(ops);
  std::vector<Request> reqs;
  for (size_t i = 0; i < 6; ++i) {
    reqs.push_back(
        mixed_request(i, random_tokens(30 + 13 * int(i), 256, uint32_t(100 + i)), 100, false));
  }
  std::vector<Seen> alone(reqs.size());
  {
    EngineConfig cfg;
    cfg.max_batch = 1;
    auto e = Engine::create(model, *ops, cfg, nullptr);
    ASSERT_TRUE(e.ok()) << e.error().to_string();
    for (size_t i = 0; i < reqs.size(); ++i) {
      ASSERT_TRUE((*e)->submit(reqs[i], record(&alone[i])).ok());
      (*e)->run_until_idle();
      expect_whole(alone[i], reqs[i], "alone " + std::to_string(i));
    }
  }
  // 24 blocks (384 positions) for six sequences growing to 130-195 positions each.
  EngineConfig cfg;
  cfg.max_batch = 6;
  cfg.max_batch_tokens = 64;
  cfg.kv_blocks = 24;
  cfg.seed = 1;
  if (GetParam().prefix_cache) {
    cfg.prefix_snapshots = 4;
    cfg.snapshot_interval = 32;
  }
  auto created = Engine::create(model, *ops, cfg, nullptr);
  ASSERT_TRUE(created.ok()) << created.error().to_string();
  Engine& e = **created;
  const int64_t live_buffers = e.stats().alloc.live_buffers;
  std::vector<Seen> together(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(e.submit(reqs[i], record(&together[i])).ok());
  }
  e.run_until_idle();
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::string what = "request " + std::to_string(i);
    expect_whole(together[i], reqs[i], what);
    EXPECT_EQ(together[i].ids, alone[i].ids) << what;
    // Recomputed states differ from decoded ones by rounding (as chunk boundaries do).
    ASSERT_EQ(together[i].logprobs.size(), alone[i].logprobs.size());
    for (size_t t = 0; t < alone[i].logprobs.size(); ++t) {
      ASSERT_NEAR(together[i].logprobs[t], alone[i].logprobs[t], 2e-3) << what << " token " << t;
    }
    EXPECT_EQ(together[i].cached, 0) << what << ": the prompts share nothing";
  }
  const EngineStats st = e.stats();
  EXPECT_GT(st.preemptions, 0) << "the cache never ran out: nothing was tested";
  RecordProperty("preemptions", std::to_string(st.preemptions));
  EXPECT_EQ(st.slots_used, 0);
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_EQ(st.alloc.live_buffers, live_buffers);
  if (GetParam().prefix_cache) {
    EXPECT_GT(st.prefix_hit_tokens, 0) << "resumptions restore what their prompts cached";
  }
}

// ---- the context bound ----

TEST(Preemption, ContextIsBoundedByWhatTheCacheHoldsForOneSequence) {
  auto ops = test_ops();
  ASSERT_TRUE(ops);
  const std::string tiny = kRoot + "/models/qwen3next-tiny";  // its context: 4,096
  auto make = [&](int kv_blocks, int max_context) {
    EngineConfig cfg;
    cfg.max_batch = 2;
    cfg.kv_blocks = kv_blocks;
    cfg.max_context = max_context;
    auto e = Engine::create(tiny, *ops, cfg, nullptr);
    EXPECT_TRUE(e.ok()) << e.error().to_string();
    return e.ok() ? std::move(*e) : nullptr;
  };
  EXPECT_EQ(make(1000, 0)->config().max_context, 4096) << "the model's, when the cache holds it";
  EXPECT_EQ(make(6, 50)->config().max_context, 50) << "the configured one, when smaller";
  auto e = make(6, 0);
  ASSERT_TRUE(e);
  ASSERT_EQ(e->config().max_context, 96) << "6 blocks of 16";
  // A prompt the cache cannot hold with one generated token is refused, naming the cache.
  auto too_long = e->submit(greedy_request(random_tokens(96, 256, 3), 1), [](const Event&) {});
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.error().message.find("cache"), std::string::npos);
  // Beside another sequence, one asking for more than the context runs to the context's end
  // (the server refuses such a request up front against config().max_context): the other
  // gives its blocks up for it rather than cut it short.
  Seen a, b;
  ASSERT_TRUE(e->submit(greedy_request(random_tokens(20, 256, 1), 500), record(&a)).ok());
  ASSERT_TRUE(e->submit(greedy_request(random_tokens(30, 256, 2), 60), record(&b)).ok());
  e->run_until_idle();
  EXPECT_EQ(a.reason, FinishReason::kLength);
  EXPECT_EQ(a.message, "the context length is reached");
  EXPECT_EQ(a.ids.size(), 96u - 20u + 1u);  // the last sampled at the last position
  EXPECT_EQ(b.message, "max_tokens reached");
  EXPECT_EQ(b.ids.size(), 60u);
  const EngineStats st = e->stats();
  EXPECT_GT(st.preemptions, 0);
  RecordProperty("preemptions", std::to_string(st.preemptions));
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_EQ(st.slots_used, 0);
}

}  // namespace
}  // namespace recur
