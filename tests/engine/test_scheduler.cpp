// The scheduler driven over a fake model (fake_model.h) that records every batch: decode first,
// a short request's first token within a bounded number of steps however long the prompts
// beside it, no prompt stalled, priority in admission and in the prompt budget without
// starvation, the budget and the model's limits never exceeded, ragged batches that carry each
// prompt exactly once and in order, cancellation mid-prefill, admission past a prompt the cache
// cannot hold yet, no heap allocation in steady steps; and the scheduling arithmetic itself.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <thread>

#include "alloc_counter.h"
#include "backend/backend.h"
#include "engine/engine.h"
#include "engine/schedule.h"
#include "fake_model.h"

namespace recur {
namespace {

using testing::FakeModel;
using testing::RecordedBatch;

// One request's view of the run: its tokens and the step each arrived at.
struct Outcome {
  std::vector<int32_t> prompt;
  std::vector<int32_t> ids;
  int64_t submitted_step = -1, first_token_step = -1, finish_step = -1;
  FinishReason reason = FinishReason::kError;
  bool done = false;
};

struct Harness {
  std::unique_ptr<Ops> ops;
  FakeModel* model = nullptr;  // owned by the engine
  std::map<uint64_t, Outcome> out;
  int64_t steps = 0;                   // steps run so far
  std::vector<int64_t> batch_of_step;  // [steps]: index into model->batches, or -1
  // Last, so it goes first: its shutdown cancels what is still running, and the cancellations'
  // events land in `out`.
  std::unique_ptr<Engine> engine;

  explicit Harness(EngineConfig cfg, double delay_ns_per_position = 0) {
    auto o = create_backend("cpu", 1);
    EXPECT_TRUE(o.ok());
    ops = std::move(*o);
    auto m = std::make_unique<FakeModel>(*ops, Engine::load_options(cfg), 1 << 20,
                                         delay_ns_per_position);
    model = m.get();
    auto e = Engine::create(std::move(m), cfg, nullptr);
    EXPECT_TRUE(e.ok()) << e.error().to_string();
    engine = std::move(*e);
  }

  uint64_t submit(std::vector<int32_t> prompt, int max_tokens, int priority = 0) {
    Request r;
    r.prompt = prompt;
    r.max_tokens = max_tokens;
    r.priority = priority;
    r.sampling.temperature = 0;
    r.stop.ignore_eos = true;
    auto id = engine->submit(std::move(r), [this](const Event& ev) { on_event(ev); });
    EXPECT_TRUE(id.ok()) << id.error().to_string();
    Outcome& o = out[*id];
    o.prompt = std::move(prompt);
    o.submitted_step = steps;
    return *id;
  }
  void on_event(const Event& ev) {
    Outcome& o = out[ev.request_id];
    if (ev.kind == Event::Kind::kToken) {
      if (o.ids.empty()) o.first_token_step = steps + 1;  // during step number steps + 1
      o.ids.push_back(ev.token);
    } else {
      o.done = true;
      o.reason = ev.reason;
      o.finish_step = steps + 1;
    }
  }
  bool step() {
    const size_t recorded = model->batches.size();
    const bool more = engine->step();
    ++steps;
    // A step with nothing running calls no forward, so steps and batches need not line up.
    if (model->record) {
      batch_of_step.push_back(model->batches.size() > recorded ? int64_t(recorded) : -1);
    }
    return more;
  }
  void run(int n) {
    for (int i = 0; i < n; ++i) step();
  }
  void run_until_idle(int limit = 100000) {
    for (int i = 0; i < limit && step(); ++i) {
    }
  }
  // The recorded batch of step number `step` (1-based); empty for a step that ran no forward.
  const RecordedBatch& batch(int64_t step) const {
    static const RecordedBatch kNone;
    const int64_t i = batch_of_step.at(size_t(step - 1));
    return i < 0 ? kNone : model->batches[size_t(i)];
  }
};

// Random prompts use ids 8.. ; ids below 8 mark prompts whose chunks a test looks for.
constexpr int kMarkers = 8;
std::vector<int32_t> prompt_of(int len, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (auto& t : p) t = kMarkers + int32_t(rng() % uint32_t(FakeModel::kVocab - kMarkers));
  return p;
}
std::vector<int32_t> marked(int len, int32_t marker) {
  return std::vector<int32_t>(static_cast<size_t>(len), marker);
}

// The first step (1-based) that fed a prompt beginning with `marker` at position 0, and its slot.
std::pair<int64_t, int32_t> started(const FakeModel& m, int32_t marker) {
  for (size_t i = 0; i < m.batches.size(); ++i) {
    for (const auto& s : m.batches[i].seqs) {
      if (s.first_pos == 0 && s.tokens[0] == marker) return {int64_t(i) + 1, s.slot};
    }
  }
  return {-1, -1};
}

EngineConfig small_config(int max_batch, int max_batch_tokens) {
  EngineConfig cfg;
  cfg.max_batch = max_batch;
  cfg.max_batch_tokens = max_batch_tokens;
  cfg.kv_blocks = 4096;
  cfg.step_time_target_ms = 0;  // steps of the fake model take no time
  cfg.seed = 1;
  return cfg;
}

// Greedy over the fake's logits: each token is next_token of the one before, the first of the
// prompt's last.
void expect_chain(const Outcome& o, const std::string& what) {
  ASSERT_FALSE(o.ids.empty()) << what;
  int32_t last = o.prompt.back();
  for (size_t i = 0; i < o.ids.size(); ++i) {
    ASSERT_EQ(o.ids[i], FakeModel::next_token(last)) << what << " token " << i;
    last = o.ids[i];
  }
}

TEST(Scheduler, DecodeTokensGoFirstAndTheRestOfTheBudgetToPrompts) {
  Harness h(small_config(6, 16));
  std::vector<uint64_t> decoders;
  for (int i = 0; i < 4; ++i) decoders.push_back(h.submit(prompt_of(2, 10 + i), 40));
  h.run(1);  // their prompts, 8 tokens
  h.submit(prompt_of(300, 1), 1);
  h.submit(prompt_of(300, 2), 1);
  for (int step = 2; step <= 30; ++step) {
    h.step();
    const RecordedBatch& b = h.batch(step);
    int decode_rows = 0;
    for (const auto& s : b.seqs) decode_rows += s.tokens.size() == 1 && s.logits ? 1 : 0;
    EXPECT_EQ(decode_rows, 4) << "step " << step << ": every decoding sequence, one token";
    EXPECT_EQ(b.n_tokens, 16) << "step " << step << ": the rest of the budget to the prompts";
  }
  EXPECT_TRUE(h.model->violations.empty()) << h.model->violations.front();
}

// Three long prompts prefilling; a 9-token request arrives: its first token comes in the next
// step whether the long prompts have 2,000 or 20,000 tokens; a 100-token one within
// ceil(100 / (64 / 4)) = 7 steps.
TEST(Scheduler, ShortRequestsFirstTokenWithinBoundedStepsHoweverLongTheOthers) {
  for (int long_len : {2000, 20000}) {
    Harness h(small_config(8, 64));
    for (int i = 0; i < 3; ++i) h.submit(prompt_of(long_len, uint32_t(i)), 1);
    h.run(5);
    const uint64_t tiny = h.submit(prompt_of(9, 100), 3);
    const uint64_t medium = h.submit(prompt_of(100, 101), 3);
    h.run(10);
    const Outcome& t = h.out[tiny];
    const Outcome& m = h.out[medium];
    ASSERT_GE(t.first_token_step, 0) << "long prompts of " << long_len;
    EXPECT_EQ(t.first_token_step - t.submitted_step, 1) << "long prompts of " << long_len;
    ASSERT_GE(m.first_token_step, 0) << "long prompts of " << long_len;
    EXPECT_LE(m.first_token_step - m.submitted_step, 7) << "long prompts of " << long_len;
    // Meanwhile the long prompts kept going.
    for (int64_t step = 6; step <= h.steps; ++step) EXPECT_GE(h.batch(step).n_seqs(), 3);
    EXPECT_TRUE(h.model->violations.empty()) << h.model->violations.front();
  }
}

// Every admitted prompt is fed in every step until its prefill ends, with a new short request
// arriving at each step, a higher-priority long prompt beside it, and decoders.
TEST(Scheduler, NoAdmittedPromptStallsWhileOthersArrive) {
  Harness h(small_config(8, 32));
  h.submit(prompt_of(3, 50), 200);  // a decoder
  h.run(1);
  const uint64_t a = h.submit(marked(400, 1), 1, /*priority=*/0);
  const uint64_t b = h.submit(marked(400, 2), 1, /*priority=*/0);
  const uint64_t urgent = h.submit(marked(400, 3), 1, /*priority=*/-5);
  for (int i = 0; i < 60; ++i) {
    h.submit(prompt_of(2 + i % 5, 200 + uint32_t(i)), 1);
    h.step();
  }
  h.run_until_idle();
  for (int32_t marker : {1, 2, 3}) {
    const auto [start, slot] = started(*h.model, marker);
    ASSERT_EQ(start, 2) << "admitted in the step after submission";
    int fed = 0;
    for (int64_t step = start; fed < 400; ++step) {
      ASSERT_LE(step, h.steps);
      const auto* s = h.batch(step).find_slot(slot);
      ASSERT_NE(s, nullptr) << "slot " << slot << " stalled at step " << step << " after " << fed;
      EXPECT_EQ(s->first_pos, fed);
      fed += int(s->tokens.size());
    }
  }
  for (uint64_t id : {a, b, urgent}) {
    EXPECT_TRUE(h.out[id].done);
    expect_chain(h.out[id], "long prompt");
  }
  // The urgent one had the larger share and finished first.
  EXPECT_LT(h.out[urgent].first_token_step, h.out[a].first_token_step);
  EXPECT_LT(h.out[urgent].first_token_step, h.out[b].first_token_step);
  EXPECT_TRUE(h.model->violations.empty()) << h.model->violations.front();
}

// One slot: waiting requests are admitted by priority (lower first), then arrival.
TEST(Scheduler, AdmissionFollowsPriorityThenArrival) {
  Harness h(small_config(1, 16));
  h.submit(prompt_of(4, 1), 5);
  h.run(1);
  const uint64_t low = h.submit(prompt_of(4, 2), 2, 5);
  const uint64_t mid1 = h.submit(prompt_of(4, 3), 2, 0);
  const uint64_t high = h.submit(prompt_of(4, 4), 2, -3);
  const uint64_t mid2 = h.submit(prompt_of(4, 5), 2, 0);
  h.run_until_idle();
  std::vector<std::pair<int64_t, uint64_t>> order;
  for (uint64_t id : {low, mid1, high, mid2}) order.emplace_back(h.out[id].first_token_step, id);
  std::sort(order.begin(), order.end());
  EXPECT_EQ(order[0].second, high);
  EXPECT_EQ(order[1].second, mid1);
  EXPECT_EQ(order[2].second, mid2);
  EXPECT_EQ(order[3].second, low);
}

// Low priority is never starved: with higher-priority requests arriving at every step, a
// low-priority one is admitted once it has waited aging_steps.
TEST(Scheduler, AgingAdmitsLowPriorityDespiteAStreamOfUrgentRequests) {
  EngineConfig cfg = small_config(1, 16);
  cfg.aging_steps = 20;
  Harness h(cfg);
  h.submit(prompt_of(4, 1), 2, -1);
  const uint64_t low = h.submit(prompt_of(4, 2), 1, 10);
  for (int i = 0; i < 100; ++i) {
    h.submit(prompt_of(3, 10 + uint32_t(i)), 2, -1);
    h.step();
  }
  const Outcome& o = h.out[low];
  ASSERT_TRUE(o.done) << "starved";
  // Waited its 20 steps, then the slot's occupant (2 tokens: 2 steps) finished.
  EXPECT_GE(o.first_token_step - o.submitted_step, 20);
  EXPECT_LE(o.first_token_step - o.submitted_step, 20 + 3);
}

// A random workload of prompts, priorities and cancellations: every batch within the budget
// and the model's limits, no broken invariant (positions continue each slot's state, block
// tables cover them), and every request's output the deterministic chain of its prompt.
TEST(Scheduler, RandomWorkloadStaysWithinLimitsAndEachSequenceIsFedInOrder) {
  EngineConfig cfg = small_config(5, 48);
  cfg.kv_blocks = 80;  // 1,280 positions: admission waits for blocks at times
  Harness h(cfg);
  std::mt19937 rng(7);
  std::vector<uint64_t> ids, cancelled;
  for (int step = 0; step < 400; ++step) {
    if (rng() % 3 == 0 && ids.size() < 120) {
      const int len = 1 + int(rng() % (rng() % 4 == 0 ? 600 : 40));
      ids.push_back(h.submit(prompt_of(len, rng()), 1 + int(rng() % 30), int(rng() % 5) - 2));
    }
    if (rng() % 25 == 0 && !ids.empty()) {
      const uint64_t id = ids[rng() % ids.size()];
      h.engine->cancel(id);
      cancelled.push_back(id);
    }
    h.step();
  }
  h.run_until_idle();
  for (const RecordedBatch& b : h.model->batches) {
    ASSERT_LE(b.n_tokens, cfg.max_batch_tokens);
    ASSERT_LE(b.n_seqs(), cfg.max_batch);
    ASSERT_LE(b.logit_rows, cfg.max_batch);
    int sum = 0;
    for (const auto& s : b.seqs) sum += int(s.tokens.size());
    ASSERT_EQ(sum, b.n_tokens) << "no padding";
  }
  EXPECT_TRUE(h.model->violations.empty()) << h.model->violations.front();
  int finished = 0;
  for (uint64_t id : ids) {
    const Outcome& o = h.out[id];
    ASSERT_TRUE(o.done) << "request " << id << " got no answer";
    if (std::find(cancelled.begin(), cancelled.end(), id) != cancelled.end()) continue;
    ++finished;
    EXPECT_EQ(o.reason, FinishReason::kLength);
    expect_chain(o, "request " + std::to_string(id));
  }
  EXPECT_GT(finished, 50);
  const EngineStats st = h.engine->stats();
  EXPECT_EQ(st.slots_used, 0);
  EXPECT_EQ(st.kv_blocks_used, 0);
}

// Each prompt reaches the model exactly once, chunk after chunk in order, with no padding.
TEST(Scheduler, RaggedBatchesCarryEachPromptOnceInOrder) {
  Harness h(small_config(4, 40));
  const std::vector<int> lens = {1, 39, 40, 41, 150, 7};
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < lens.size(); ++i)
    ids.push_back(h.submit(prompt_of(lens[i], uint32_t(i)), 3));
  h.run_until_idle();
  // Per slot, the tokens fed since each reset (a sequence starts at position 0).
  std::vector<std::vector<int32_t>> streams;
  std::map<int32_t, size_t> open;
  for (const RecordedBatch& b : h.model->batches) {
    for (const auto& s : b.seqs) {
      if (s.first_pos == 0) {
        open[s.slot] = streams.size();
        streams.emplace_back();
      }
      auto& st = streams[open.at(s.slot)];
      ASSERT_EQ(int(st.size()), s.first_pos);
      st.insert(st.end(), s.tokens.begin(), s.tokens.end());
    }
  }
  ASSERT_EQ(streams.size(), ids.size());
  for (uint64_t id : ids) {
    const Outcome& o = h.out[id];
    expect_chain(o, "request " + std::to_string(id));
    // Prompt then every generated token but the last, fed once.
    std::vector<int32_t> want = o.prompt;
    want.insert(want.end(), o.ids.begin(), o.ids.end() - 1);
    EXPECT_EQ(std::count(streams.begin(), streams.end(), want), 1) << "request " << id;
  }
}

// Cancelling a prompt mid-prefill frees its slot, its blocks and its reservation at once: a
// request needing most of the cache, waiting behind it, starts in the next step.
TEST(Scheduler, CancellationMidPrefillFreesSlotBlocksAndReservation) {
  EngineConfig cfg = small_config(2, 32);
  cfg.kv_blocks = 40;  // 640 positions
  Harness h(cfg);
  const uint64_t big = h.submit(prompt_of(600, 1), 5);  // 38 blocks reserved
  h.run(3);
  const uint64_t next = h.submit(prompt_of(500, 2), 2);  // 32 blocks: must wait
  h.run(3);
  EXPECT_TRUE(h.out[next].first_token_step < 0);
  EXPECT_EQ(h.batch(h.steps).n_seqs(), 1) << "the second prompt waits for blocks";
  EXPECT_EQ(h.engine->stats().kv_blocks_used, 6 * 32 / 16);
  h.engine->cancel(big);
  h.step();
  EXPECT_TRUE(h.out[big].done);
  EXPECT_EQ(h.out[big].reason, FinishReason::kCancelled);
  EXPECT_EQ(h.engine->stats().slots_used, 0) << "released at the step that saw the cancel";
  EXPECT_EQ(h.engine->stats().kv_blocks_used, 0);
  h.step();
  ASSERT_NE(h.batch(h.steps).find_slot(0), nullptr) << "the waiting prompt started";
  h.run_until_idle();
  EXPECT_EQ(h.out[next].reason, FinishReason::kLength);
  expect_chain(h.out[next], "after the cancelled prompt");
  EXPECT_EQ(h.engine->stats().kv_blocks_used, 0);
  EXPECT_TRUE(h.model->violations.empty()) << h.model->violations.front();
}

// A finish is told after the request's slot and blocks are released and the gauges say so:
// a client that reads the metrics once its last event arrived sees them free (a server test
// read 250 blocks still in use after all of its requests had answered).
TEST(Scheduler, FinishEventsComeAfterTheGaugesShowTheRelease) {
  EngineConfig cfg = small_config(2, 64);
  cfg.kv_blocks = 40;
  Harness h(cfg);
  std::vector<EngineStats> at_finish;
  for (uint32_t seed : {1u, 2u}) {
    Request r;
    r.prompt = prompt_of(40, seed);
    r.max_tokens = 6;
    r.sampling.temperature = 0;
    r.stop.ignore_eos = true;
    auto id = h.engine->submit(std::move(r), [&](const Event& ev) {
      if (ev.kind == Event::Kind::kFinish) at_finish.push_back(h.engine->stats());
    });
    ASSERT_TRUE(id.ok());
  }
  h.run_until_idle();
  ASSERT_EQ(at_finish.size(), 2u);
  for (const EngineStats& st : at_finish) {
    EXPECT_EQ(st.kv_blocks_used, 0) << "both finish in one step";
    EXPECT_EQ(st.slots_used, 0);
    EXPECT_EQ(st.requests_finished, 2);
  }
}

// settled_stats() is never taken while finishes are being told: a reader that sees a release
// sees its finish told, and the request no longer running (the server's /metrics showed a
// cancelled request's slot free before its sink had counted the finish).
TEST(Scheduler, SettledStatsWaitUntilTheFinishesAreTold) {
  std::atomic<bool> telling{false}, told{false};  // before h: the sink may run at its shutdown
  Harness h(small_config(2, 64));
  Request r;
  r.prompt = prompt_of(40, 1);
  r.max_tokens = 3;
  r.sampling.temperature = 0;
  r.stop.ignore_eos = true;
  ASSERT_TRUE(h.engine
                  ->submit(std::move(r),
                           [&](const Event& ev) {
                             if (ev.kind != Event::Kind::kFinish) return;
                             telling = true;
                             // A sink slow to count, as an engine thread descheduled under load.
                             std::this_thread::sleep_for(std::chrono::milliseconds(100));
                             told = true;
                           })
                  .ok());
  h.engine->start();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!telling) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the request never finished";
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  EXPECT_EQ(h.engine->stats().slots_used, 0) << "released before the finish is told";
  const EngineStats st = h.engine->settled_stats();
  EXPECT_TRUE(told) << "settled_stats() returned while the finish was being told";
  EXPECT_EQ(st.slots_used, 0);
  EXPECT_EQ(st.kv_blocks_used, 0);
  EXPECT_EQ(st.running, 0) << "a request told its finish still counted as running";
  EXPECT_EQ(st.requests_finished, 1);
  ASSERT_TRUE(h.engine->wait_idle(std::chrono::seconds(30)));
}

// A cancelled request's finish tells the engine steps completed since its cancel was queued,
// counted from the queueing itself: 0 when no step was in flight, 1 when one was. (The server
// read the step count before queueing the cancel, and under load counted the steps that ran
// while it was descheduled in between: 2 where 1 was allowed.)
TEST(Scheduler, CancelStepsCountFromTheQueueingOfTheCancel) {
  std::vector<int64_t> told;  // before the harnesses: their shutdown may still tell
  std::atomic<bool> first_token{false};
  const auto submit = [&](Harness& h, int prompt_len, uint32_t seed, int max_tokens) {
    Request r;
    r.prompt = prompt_of(prompt_len, seed);
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0;
    r.stop.ignore_eos = true;
    auto id = h.engine->submit(std::move(r), [&](const Event& ev) {
      if (ev.kind == Event::Kind::kToken) first_token = true;
      if (ev.kind == Event::Kind::kFinish) told.push_back(ev.cancel_steps);
    });
    EXPECT_TRUE(id.ok());
    return id.ok() ? *id : 0;
  };
  {
    Harness h(small_config(2, 64));
    const uint64_t a = submit(h, 20, 1, 50);
    h.run(3);
    h.engine->cancel(a);
    h.run(1);
    ASSERT_EQ(told.size(), 1u);
    EXPECT_EQ(told[0], 0) << "queued between steps, released by the next";
    submit(h, 20, 2, 4);
    h.run_until_idle();
    ASSERT_EQ(told.size(), 2u);
    EXPECT_EQ(told[1], -1) << "not cancelled";
  }
  // On the engine's thread, steps of ~20 ms run back to back: the cancel lands mid-step or
  // between two, never further back.
  Harness h(small_config(2, 256), 100000.0);
  h.engine->start();
  first_token = false;
  const uint64_t b = submit(h, 200, 3, 100000);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!first_token) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "no token came";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  h.engine->cancel(b);
  ASSERT_TRUE(h.engine->wait_idle(std::chrono::seconds(30)));
  ASSERT_EQ(told.size(), 3u);
  EXPECT_GE(told[2], 0);
  EXPECT_LE(told[2], 1);
}

// wait_idle returns only once every submitted request has finished, also while the engine
// thread has taken a request in but not yet published its gauges (its first step still runs).
TEST(Scheduler, WaitIdleWaitsForARequestTakenInMidStep) {
  EngineConfig cfg = small_config(2, 256);
  std::atomic<bool> finished{false};  // before h: the sink may still run at its shutdown
  Harness h(cfg, 20000.0);  // 20 µs per attended position: the 100-token prompt's step ~100 ms
  Request r;
  r.prompt = prompt_of(100, 3);
  r.max_tokens = 1;
  r.sampling.temperature = 0;
  r.stop.ignore_eos = true;
  h.engine->start();
  ASSERT_TRUE(h.engine
                  ->submit(std::move(r),
                           [&](const Event& ev) {
                             if (ev.kind == Event::Kind::kFinish) finished = true;
                           })
                  .ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the thread takes it in
  ASSERT_TRUE(h.engine->wait_idle(std::chrono::seconds(30)));
  EXPECT_TRUE(finished) << "wait_idle returned while the request was in its first step";
}

// A prompt too large for the free cache blocks does not hold up short requests behind it;
// once it has waited aging_steps nothing passes it, and it runs when blocks come free.
TEST(Scheduler, PromptWaitingForCacheBlocksDoesNotBlockShortOnes) {
  EngineConfig cfg = small_config(4, 64);
  cfg.kv_blocks = 64;  // 1,024 positions
  cfg.aging_steps = 30;
  Harness h(cfg);
  const uint64_t running = h.submit(prompt_of(500, 1), 60);  // 32 blocks, then grows
  h.run(10);
  const uint64_t huge = h.submit(marked(900, 2), 2);  // 57 blocks: waits
  const uint64_t shorty = h.submit(prompt_of(5, 3), 2);
  h.run(2);
  EXPECT_EQ(h.out[shorty].first_token_step - h.out[shorty].submitted_step, 1)
      << "the short request passed the one waiting for blocks";
  EXPECT_LT(h.out[huge].first_token_step, 0);
  h.run(30);  // the huge prompt is now overdue
  const uint64_t late = h.submit(marked(5, 4), 2);
  h.run(3);
  EXPECT_LT(h.out[late].first_token_step, 0) << "nothing passes an overdue request";
  h.run_until_idle();
  EXPECT_TRUE(h.out[running].done);
  EXPECT_EQ(h.out[huge].reason, FinishReason::kLength);
  expect_chain(h.out[huge], "the huge prompt");
  EXPECT_LE(started(*h.model, 2).first, started(*h.model, 4).first) << "admitted no later";
  EXPECT_EQ(h.out[late].reason, FinishReason::kLength);
  EXPECT_TRUE(h.model->violations.empty()) << h.model->violations.front();
}

// Steps allocate nothing on the heap: prefill chunks shared among prompts, decodes, block
// tables growing, finishes. Admission makes one allocation per request (its block table,
// reserved for its whole life).
TEST(Scheduler, StepsAllocateNothingButOneBlockTablePerAdmission) {
  int64_t events = 0;  // before h: the engine's shutdown still delivers events
  Harness h(small_config(8, 64));
  h.model->record = false;
  auto submit = [&](int len, int max_tokens, int priority) {
    Request r;
    r.prompt = prompt_of(len, uint32_t(len));
    r.max_tokens = max_tokens;
    r.priority = priority;
    r.sampling.temperature = 0;
    r.stop.ignore_eos = true;
    ASSERT_TRUE(h.engine->submit(std::move(r), [&events](const Event&) { ++events; }).ok());
  };
  submit(3000, 100, 0);
  submit(2000, 100, 1);
  submit(5, 300, 0);
  h.run(2);  // vectors reach their capacity
  submit(7, 20, -1);
  submit(900, 5, 0);
  std::vector<int64_t> allocs;
  for (int i = 0; i < 80; ++i) {
    testing::start_counting_allocs();
    h.step();
    allocs.push_back(testing::stop_counting_allocs());
  }
  EXPECT_EQ(allocs[0], 2) << "the two admissions";
  EXPECT_EQ(std::accumulate(allocs.begin() + 1, allocs.end(), int64_t(0)), 0)
      << "heap allocations in 79 steps";
  EXPECT_GT(events, 80);
  EXPECT_GT(h.engine->stats().requests_finished, 0);
}

// Finish events told on the engine's thread, for the tests that start it: each request's
// reasons and messages in order, and a wait until some number of requests were told.
struct FinishLog {
  std::mutex mu;
  std::condition_variable told;
  std::map<uint64_t, std::vector<std::pair<FinishReason, std::string>>> finishes;
  bool thrown = false;

  // Records finishes; with throw_once, the first finish it is told throws instead.
  EventSink sink(bool throw_once = false) {
    return [this, throw_once](const Event& ev) {
      if (ev.kind != Event::Kind::kFinish) return;
      std::lock_guard<std::mutex> lk(mu);
      if (throw_once && !thrown) {
        thrown = true;
        throw std::runtime_error("the sink's queue is full");
      }
      finishes[ev.request_id].emplace_back(ev.reason, std::string(ev.message));
      told.notify_all();
    };
  }
  bool wait_for(size_t n) {
    std::unique_lock<std::mutex> lk(mu);
    return told.wait_for(lk, std::chrono::seconds(30), [&] { return finishes.size() >= n; });
  }
  std::vector<FinishReason> reasons(uint64_t id) {
    std::lock_guard<std::mutex> lk(mu);
    std::vector<FinishReason> out;
    for (const auto& f : finishes[id]) out.push_back(f.first);
    return out;
  }
};

uint64_t submit_greedy(Engine& e, int prompt_len, uint32_t seed, int max_tokens, EventSink sink) {
  Request r;
  r.prompt = prompt_of(prompt_len, seed);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.stop.ignore_eos = true;
  auto id = e.submit(std::move(r), std::move(sink));
  EXPECT_TRUE(id.ok());
  return id.ok() ? *id : 0;
}

// A completion far longer than any first reservation allocates nothing after its admission:
// its history was sized for all it may generate, so no decode step moves it.
TEST(Scheduler, LongCompletionAllocatesNothingAfterItsFirstStep) {
  int64_t tokens = 0;  // before h: the engine's shutdown still delivers events
  Harness h(small_config(2, 64));
  h.model->record = false;
  submit_greedy(*h.engine, 5, 1, 10000, [&tokens](const Event& ev) {
    if (ev.kind == Event::Kind::kToken) ++tokens;
  });
  h.step();  // the admission and the prompt
  testing::start_counting_allocs();
  h.run_until_idle();
  EXPECT_EQ(testing::stop_counting_allocs(), 0);
  EXPECT_EQ(tokens, 10000);
}

// A step that throws (here the model's forward, as one short of memory would) ends the requests
// in flight with an error that says so and frees what they held; the engine's thread goes on
// serving, where the exception used to end the process.
TEST(Scheduler, AStepThatThrowsEndsItsRequestsWithAnErrorAndServingGoesOn) {
  FinishLog log;  // before h: its shutdown may still tell
  Harness h(small_config(4, 64));
  h.model->record = false;
  h.model->throw_at_forward = 3;  // the prompts', one decode, then the throw
  const uint64_t a = submit_greedy(*h.engine, 20, 1, 50, log.sink()),
                 b = submit_greedy(*h.engine, 20, 2, 50, log.sink());
  h.engine->start();
  ASSERT_TRUE(log.wait_for(2)) << "the requests of the step that threw were never told";
  for (uint64_t id : {a, b}) {
    EXPECT_EQ(log.reasons(id), std::vector<FinishReason>{FinishReason::kError});
    std::lock_guard<std::mutex> lk(log.mu);
    EXPECT_NE(log.finishes[id][0].second.find("the engine's step failed (std::bad_alloc)"),
              std::string::npos)
        << log.finishes[id][0].second;
  }
  ASSERT_TRUE(h.engine->wait_idle(std::chrono::seconds(30)));
  EngineStats st = h.engine->settled_stats();
  EXPECT_EQ(st.failed_steps, 1);
  EXPECT_EQ(st.slots_used, 0);
  EXPECT_EQ(st.kv_blocks_used, 0);
  const uint64_t c = submit_greedy(*h.engine, 20, 3, 50, log.sink());
  ASSERT_TRUE(log.wait_for(3)) << "the engine stopped serving after the throw";
  EXPECT_EQ(log.reasons(c), std::vector<FinishReason>{FinishReason::kLength});
  ASSERT_TRUE(h.engine->wait_idle(std::chrono::seconds(30)));
  EXPECT_TRUE(h.model->violations.empty()) << h.model->violations.front();
}

// A sink that throws while told its finish (a client's queue out of memory, say) fails the step:
// the requests beside it end with an error, its own finish is told once, on the retry, and the
// engine serves on.
TEST(Scheduler, ASinkThatThrowsOnItsFinishIsToldOnceAndServingGoesOn) {
  FinishLog log;  // before h: its shutdown may still tell
  Harness h(small_config(4, 64));
  h.model->record = false;
  // `before` and `thrower` finish in the same step and are told in that order: `before` is told
  // once, not again when the telling is retried.
  const uint64_t before = submit_greedy(*h.engine, 20, 1, 3, log.sink()),
                 thrower = submit_greedy(*h.engine, 20, 2, 3, log.sink(true)),
                 slow = submit_greedy(*h.engine, 20, 3, 100000, log.sink());
  h.engine->start();
  ASSERT_TRUE(log.wait_for(3));
  ASSERT_TRUE(h.engine->wait_idle(std::chrono::seconds(30)));
  EXPECT_TRUE(log.thrown);
  EXPECT_EQ(log.reasons(before), std::vector<FinishReason>{FinishReason::kLength});
  EXPECT_EQ(log.reasons(thrower), std::vector<FinishReason>{FinishReason::kLength});
  EXPECT_EQ(log.reasons(slow), std::vector<FinishReason>{FinishReason::kError});
  EXPECT_EQ(h.engine->settled_stats().failed_steps, 1);
  const uint64_t after = submit_greedy(*h.engine, 20, 4, 4, log.sink());
  ASSERT_TRUE(log.wait_for(4)) << "the engine stopped serving";
  EXPECT_EQ(log.reasons(after), std::vector<FinishReason>{FinishReason::kLength});
}

// ---- the arithmetic ----

TEST(Schedule, PromptTokensAreSharedMaxMinFairlyWithAMinimumShareByPriority) {
  using sched::PromptShare;
  auto share = [](std::vector<PromptShare> p, int budget) {
    for (size_t i = 0; i < p.size(); ++i) {
      p[i].index = int(i);
      p[i].order = i;
    }
    sched::share_prompt_tokens(p, budget);
    std::vector<int> out(p.size());
    for (const auto& s : p) out[size_t(s.index)] = s.tokens;
    return out;
  };
  // Same priority: the short ones take what they need, the long ones split the rest.
  // (32 each at first, then (512 - 103) / 2 more for each long one, the odd token to the later)
  EXPECT_EQ(share({{5000}, {9}, {5000}, {30}}, 512), (std::vector<int>{236, 9, 237, 30}));
  EXPECT_EQ(share({{100}, {100}}, 512), (std::vector<int>{100, 100}));
  // Priority: the urgent prompt takes all but the others' minimum shares (512 / (4 · 3) = 42).
  PromptShare urgent{5000};
  urgent.priority = -1;
  EXPECT_EQ(share({{5000}, urgent, {5000}}, 512), (std::vector<int>{42, 428, 42}));
  // One token each at least, while the budget lasts.
  EXPECT_EQ(share({{50}, {50}, {50}}, 3), (std::vector<int>{1, 1, 1}));
}

TEST(Schedule, AttentionCapCutsDeepChunksFirstAndKeepsOneTokenEach) {
  using sched::PromptShare;
  EXPECT_EQ(sched::attended_positions(0, 4), 1 + 2 + 3 + 4);
  EXPECT_EQ(sched::attended_positions(100, 2), 101 + 102);
  std::vector<PromptShare> p(3);
  p[0].tokens = 10;  // shallow: 55 positions
  p[1].tokens = 200, p[1].position = 90000;
  p[2].tokens = 200, p[2].position = 50000;
  for (int i = 0; i < 3; ++i) p[size_t(i)].index = i;
  EXPECT_TRUE(sched::cap_prompt_attention(p, 2e6));
  std::vector<PromptShare> by(3);
  for (const auto& s : p) by[size_t(s.index)] = s;
  EXPECT_EQ(by[0].tokens, 10);
  double total = 0;
  for (const auto& s : by) total += double(sched::attended_positions(s.position, s.tokens));
  EXPECT_LE(total, 2e6);
  EXPECT_GT(total, 2e6 - 90000 - 50000) << "the allowance is used";
  EXPECT_LT(by[1].tokens, by[2].tokens) << "equal attention: fewer tokens for the deeper one";
  EXPECT_FALSE(sched::cap_prompt_attention(p, 1e9)) << "nothing cut under the allowance";
  EXPECT_TRUE(sched::cap_prompt_attention(p, 0));
  for (const auto& s : p) EXPECT_EQ(s.tokens, 1);
}

TEST(Schedule, StepCostFitRecoversTheCostOfAPositionAndSizesTheAllowance) {
  sched::StepCostModel m;
  EXPECT_FALSE(m.fitted());
  // 2 ms per step, 10 us per token, 40 ns per attended position.
  std::mt19937 rng(3);
  for (int i = 0; i < 40; ++i) {
    const double tokens = 16 + double(rng() % 500), positions = double(rng() % 40'000'000);
    m.observe(tokens, positions, 2e-3 + 10e-6 * tokens + 40e-9 * positions);
  }
  ASSERT_TRUE(m.fitted());
  EXPECT_NEAR(m.per_position(), 40e-9, 1e-9);
  EXPECT_NEAR(m.per_token(), 10e-6, 1e-6);
  EXPECT_NEAR(m.per_step(), 2e-3, 3e-4);
  // 100 ms with 512 tokens: (0.1 - 0.002 - 0.00512) / 40 ns positions.
  EXPECT_NEAR(m.attention_allowance(512, 0.1), (0.1 - 0.002 - 512 * 10e-6) / 40e-9, 2e4);
  // When the rest of the step alone takes the target, attention still gets half of it.
  EXPECT_NEAR(m.attention_allowance(20000, 0.1), 0.05 / 40e-9, 2e4);
}

// With the step time target on, a deep prompt's chunks are cut so that a step's attention
// stays near the target: the fake model spins 50 ns per attended position and the target is
// 10 ms, so a step should attend ~200,000 positions, where a whole 256-token chunk past
// position 3,000 attends more than 768,000. Wall time on a loaded machine is noisy (a stalled
// step inflates the fit's per-step part), hence the margins; the fit itself is checked exactly
// above.
TEST(Scheduler, StepTimeTargetCutsDeepChunks) {
  EngineConfig cfg = small_config(4, 256);
  cfg.step_time_target_ms = 10;
  Harness h(cfg, /*delay_ns_per_position=*/50);
  const uint64_t id = h.submit(prompt_of(5000, 1), 1);
  h.run_until_idle();
  ASSERT_TRUE(h.out[id].done);
  expect_chain(h.out[id], "the deep prompt");
  std::vector<int64_t> deep;  // attended positions of each step past position 3,000
  for (const RecordedBatch& b : h.model->batches) {
    if (!b.seqs.empty() && b.seqs[0].first_pos >= 3000) deep.push_back(b.attended_positions);
  }
  ASSERT_GT(deep.size(), 2000u / 256 * 2) << "the chunks were cut";
  std::sort(deep.begin(), deep.end());
  const int64_t median = deep[deep.size() / 2];
  EXPECT_LE(median, 300'000);
  EXPECT_GE(median, 25'000) << "cut far below the target: the fit overestimates a position";
  EXPECT_LE(deep.back(), 600'000) << "no step near a whole chunk's 768,000";
  EXPECT_GT(h.engine->stats().attention_cut_steps, 0);
}

}  // namespace
}  // namespace recur
