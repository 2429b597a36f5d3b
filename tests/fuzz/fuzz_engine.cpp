// The engine under arbitrary interleavings of submissions, cancellations and steps, on the tiny
// Qwen3-Next and Kimi-Linear models with small caches, with and without the prefix cache. For
// every input: each accepted request ends exactly once and nothing follows its end; its tokens
// are the ones it gets alone on an engine without the cache, up to the first step where the
// lone run's two best tokens are nearly tied (chunk boundaries move logits by ~1e-4, and may
// then pick either); a request that ran to its length has them all; and once every request has
// ended, every slot and cache block is free and no buffer was made after start-up.
#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/engine.h"
#include "engine/engine_test_util.h"
#include "fuzz_targets.h"

namespace recur::fuzz {

namespace {

const char* kModels[] = {"qwen3next-tiny", "kimi-linear-tiny"};
constexpr int kRefTokens = 10;  // generated per reference run: the most a fuzzed request asks
constexpr int kPrefixLen = 100;
constexpr int kMaxSuffix = 24;
constexpr int kMaxSubmits = 12;
constexpr int kMaxOps = 48;
constexpr int kMaxIdleSteps = 20000;  // far more than any input's work needs: a stall past it
// Gap between the lone run's two best log-probabilities below which rounding may pick either,
// and the log-probabilities' largest allowed difference before that (chunk boundaries and
// restored snapshots move them by up to ~3e-4 on these models).
constexpr float kTieGap = 2e-3f;
constexpr float kLogprobTolerance = 2e-3f;

std::string model_dir(int which) {
  return std::string(RECUR_SOURCE_DIR) + "/models/" + kModels[which];
}

Ops& cpu_ops() {
  static std::unique_ptr<Ops> ops = [] {
    auto o = create_backend("cpu", 1);
    FUZZ_CHECK(o.ok());
    return std::move(*o);
  }();
  return *ops;
}

// What a request's sink saw.
struct Seen {
  std::vector<int32_t> ids;
  std::vector<std::array<TokenLogprob, 2>> top;  // the two best of each step
  std::vector<float> logprobs;
  int finishes = 0;
  bool event_after_finish = false;
  FinishReason reason = FinishReason::kError;
  std::string message;
  int cached = -1;  // prompt tokens the prefix cache gave
};

EventSink record(Seen* s) {
  return [s](const Event& ev) {
    if (s->finishes > 0) s->event_after_finish = true;
    if (ev.kind == Event::Kind::kToken) {
      s->ids.push_back(ev.token);
      s->logprobs.push_back(ev.logprob);
      FUZZ_CHECK(ev.top_logprobs.size() == 2);
      s->top.push_back({ev.top_logprobs[0], ev.top_logprobs[1]});
    } else {
      ++s->finishes;
      s->reason = ev.reason;
      s->message = std::string(ev.message);
      s->cached = ev.cached_tokens;
    }
  };
}

// A greedy request (engine_test_util.h's) with its priority and the two best log-probabilities
// of each step, which tell a near tie.
Request greedy(std::vector<int32_t> prompt, int max_tokens, int priority) {
  Request r = greedy_request(std::move(prompt), max_tokens);
  r.priority = priority;
  r.sampling.logprobs = 2;
  return r;
}

EngineConfig base_config() {
  EngineConfig c;
  c.step_time_target_ms = 0;  // no timing in the schedule: an input replays as it ran
  c.seed = 1;
  c.pipeline_decode = 0;
  return c;
}

// Each prompt's tokens alone on an engine without the prefix cache, one per model and process.
const Seen& alone(int which, const std::vector<int32_t>& prompt) {
  static std::map<std::vector<int32_t>, Seen> done[2];
  static std::unique_ptr<Engine> engines[2];
  auto it = done[which].find(prompt);
  if (it != done[which].end()) return it->second;
  if (!engines[which]) {
    EngineConfig c = base_config();
    c.max_batch = 1;
    c.max_batch_tokens = 512;
    c.kv_blocks = 64;
    auto e = Engine::create(model_dir(which), cpu_ops(), c, nullptr);
    FUZZ_CHECK(e.ok());
    engines[which] = std::move(*e);
  }
  Seen& s = done[which][prompt];
  FUZZ_CHECK(engines[which]->submit(greedy(prompt, kRefTokens, 0), record(&s)).ok());
  engines[which]->run_until_idle();
  FUZZ_CHECK(s.finishes == 1 && s.reason == FinishReason::kLength &&
             int(s.ids.size()) == kRefTokens);
  return s;
}

// Reads the input a byte at a time, zero past its end.
struct Bytes {
  std::span<const uint8_t> rest;
  bool empty() const { return rest.empty(); }
  uint8_t next() {
    if (rest.empty()) return 0;
    const uint8_t b = rest[0];
    rest = rest.subspan(1);
    return b;
  }
};

struct Submitted {
  Request request;
  uint64_t id = 0;
  std::unique_ptr<Seen> seen = std::make_unique<Seen>();
  bool cancelled = false;
};

// The request's tokens against its lone run's.
void check_against_alone(int which, const Submitted& s) {
  const Seen& got = *s.seen;
  const Seen& ref = alone(which, s.request.prompt);
  FUZZ_CHECK(int(got.ids.size()) <= s.request.max_tokens);
  // Ended short: only at the context's end; a full cache preempts, it never ends a request.
  if (!s.cancelled && int(got.ids.size()) < s.request.max_tokens) {
    FUZZ_CHECK(got.reason == FinishReason::kLength &&
               got.message.find("context length") != std::string::npos);
  }
  for (size_t i = 0; i < got.ids.size(); ++i) {
    const bool tie = ref.top[i][0].logprob - ref.top[i][1].logprob < kTieGap;
    if (got.ids[i] != ref.ids[i]) {
      FUZZ_CHECK(tie);  // a different token only where the lone run nearly tied
      return;           // past a tie the two runs continue from different tokens
    }
    FUZZ_CHECK(std::fabs(got.logprobs[i] - ref.logprobs[i]) <= kLogprobTolerance);
  }
}

}  // namespace

int fuzz_engine(const uint8_t* data, size_t size) {
  Bytes in{std::span(data, size)};
  const uint8_t setup = in.next(), setup2 = in.next();
  const int which = setup & 1;
  EngineConfig c = base_config();
  c.max_batch = 1 + ((setup >> 1) & 3);
  c.max_batch_tokens = std::array{8, 16, 48, 128}[(setup >> 3) & 3];
  c.block_size = (setup >> 5) & 1 ? 4 : 16;
  c.kv_blocks = std::array{10, 16, 24, 64}[(setup >> 6) & 3] * (c.block_size == 4 ? 4 : 1);
  c.prefix_snapshots = std::array{0, 0, 1, 3}[setup2 & 3];
  c.snapshot_interval = (setup2 >> 2) & 1 ? 16 : 48;
  c.aging_steps = (setup2 >> 3) & 1 ? 3 : 1000;
  auto created = Engine::create(model_dir(which), cpu_ops(), c, nullptr);
  FUZZ_CHECK(created.ok());
  Engine& e = **created;
  const int vocab = e.model_info().vocab_size;
  const int64_t live_buffers = e.stats().alloc.live_buffers;

  // Three prompt families: requests share prefixes of one of them, then part.
  const std::vector<int32_t> families[3] = {random_tokens(kPrefixLen, vocab, 1),
                                            random_tokens(kPrefixLen, vocab, 2),
                                            random_tokens(kPrefixLen, vocab, 3)};
  std::vector<Submitted> subs;
  for (int op = 0; op < kMaxOps && !in.empty(); ++op) {
    const uint8_t kind = in.next() % 4;
    if (kind <= 1 && subs.size() < kMaxSubmits) {
      const uint8_t f = in.next() % 3, prefix = in.next() % (kPrefixLen + 1);
      const uint8_t suffix = in.next() % (kMaxSuffix + 1), seed = in.next();
      const int max_tokens = 1 + in.next() % kRefTokens, priority = in.next() % 3;
      std::vector<int32_t> prompt(families[f].begin(), families[f].begin() + prefix);
      const std::vector<int32_t> rest = random_tokens(suffix, vocab, seed);
      prompt.insert(prompt.end(), rest.begin(), rest.end());
      if (prompt.empty()) prompt.push_back(int32_t(seed % vocab));
      Submitted s;
      s.request = greedy(prompt, max_tokens, priority);
      auto id = e.submit(s.request, record(s.seen.get()));
      if (!id.ok()) {  // only a prompt the whole cache cannot hold is refused here
        FUZZ_CHECK(id.error().message.find("cache") != std::string::npos);
        FUZZ_CHECK(s.seen->finishes == 0 && s.seen->ids.empty());
        continue;
      }
      s.id = *id;
      subs.push_back(std::move(s));
    } else if (kind == 2 && !subs.empty()) {
      Submitted& s = subs[in.next() % subs.size()];
      s.cancelled = true;  // may have finished already: then nothing changes
      e.cancel(s.id);
    } else {
      for (int i = 1 + in.next() % 6; i > 0; --i) e.step();
    }
  }
  int steps = 0;
  while (e.step() && ++steps < kMaxIdleSteps) {
  }
  FUZZ_CHECK(steps < kMaxIdleSteps);  // every request ends: nothing waits forever

  // Before the lone runs below, whose engines share the backend's allocator.
  const EngineStats st = e.stats();
  FUZZ_CHECK(st.running == 0 && st.waiting == 0 && st.slots_used == 0);
  FUZZ_CHECK(st.kv_blocks_used == 0);  // the prefix cache's blocks do not count as used
  FUZZ_CHECK(st.alloc.live_buffers == live_buffers);
  for (const Submitted& s : subs) {
    FUZZ_CHECK(s.seen->finishes == 1);
    FUZZ_CHECK(!s.seen->event_after_finish);
    FUZZ_CHECK(s.seen->reason != FinishReason::kError);
    FUZZ_CHECK(s.cancelled || s.seen->reason != FinishReason::kCancelled);
    // The cache gives whole blocks, never the last prompt token (its logits are the first
    // token's), and nothing when it is off.
    const int cached = s.seen->cached;
    FUZZ_CHECK(cached >= 0 && cached < int(s.request.prompt.size()) && cached % c.block_size == 0);
    FUZZ_CHECK(c.prefix_snapshots > 0 || cached == 0);
    check_against_alone(which, s);
  }
  return 0;
}

}  // namespace recur::fuzz
