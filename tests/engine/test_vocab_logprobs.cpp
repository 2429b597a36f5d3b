// SamplingParams::vocab_logprobs: each token event of a request that asks carries log_softmax of
// the step's raw logits over the whole vocabulary. It must normalise, agree with the chosen
// token's logprob and with transformers' logits, be the same whatever else is in the batch (and
// with pipelined decoding, whose next forward overwrites the logits), come only to the requests
// that ask, and cost no allocation per token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "alloc_counter.h"
#include "backend/backend.h"
#include "engine/engine.h"
#include "io/safetensors.h"

namespace recur {
namespace {

const std::string kRoot = RECUR_SOURCE_DIR;
const std::string kTiny = kRoot + "/models/qwen3next-tiny";

// RECUR_TEST_DEVICE=cuda runs these on the CUDA backend (device machine), where the rows that
// ask are copied from the device apart from the greedy ids.
std::unique_ptr<Ops> test_ops() {
  const char* d = std::getenv("RECUR_TEST_DEVICE");
  auto ops = create_backend(d ? d : "cpu", 2);
  EXPECT_TRUE(ops.ok()) << ops.error().to_string();
  return ops.ok() ? std::move(*ops) : nullptr;
}

std::unique_ptr<Engine> make_engine(Ops& ops, EngineConfig cfg) {
  cfg.vocab_logprobs = true;
  auto e = Engine::create(kTiny, ops, cfg, nullptr);
  EXPECT_TRUE(e.ok()) << e.error().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

struct Collected {
  std::vector<int32_t> ids;
  std::vector<float> logprob;               // Event::logprob per token
  std::vector<std::vector<float>> vectors;  // Event::vocab_logprobs per token
  bool done = false;
};

EventSink collect(Collected* c) {
  return [c](const Event& ev) {
    if (ev.kind == Event::Kind::kFinish) {
      c->done = true;
      return;
    }
    c->ids.push_back(ev.token);
    c->logprob.push_back(ev.logprob);
    c->vectors.emplace_back(ev.vocab_logprobs.begin(), ev.vocab_logprobs.end());
  };
}

Request request(std::vector<int32_t> prompt, int max_tokens, bool vector, int logprobs = 0) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.sampling.logprobs = logprobs;
  r.sampling.vocab_logprobs = vector;
  r.stop.ignore_eos = true;
  return r;
}

std::vector<int32_t> ids_of(const SafetensorsFile& f, const std::string& name) {
  auto t = f.tensor(name);
  EXPECT_TRUE(t.ok());
  std::vector<int32_t> out;
  for (int64_t i = 0; i < t->numel(); ++i) out.push_back(int32_t(t->ptr<int64_t>()[i]));
  return out;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  }
  return worst;
}

TEST(VocabLogprobs, NormalisedAndEqualToTheReferenceLogSoftmax) {
  auto golden =
      SafetensorsFile::open(kRoot + "/tests/data/golden/qwen3next-tiny/golden.safetensors");
  ASSERT_TRUE(golden.ok());
  auto ops = test_ops();
  auto e = make_engine(*ops, EngineConfig{});
  double ref_worst = 0;
  for (const char* p : {"p1", "p3"}) {
    const std::vector<int32_t> prompt = ids_of(*golden, std::string(p) + ".ids");
    const std::vector<int32_t> gen = ids_of(*golden, std::string(p) + ".gen");
    auto logits = golden->tensor(std::string(p) + ".gen_logits");  // [steps, vocab]
    ASSERT_TRUE(logits.ok());
    const int64_t V = logits->shape[1];
    Collected c;
    ASSERT_TRUE(e->submit(request(prompt, int(gen.size()), true), collect(&c)).ok());
    e->run_until_idle();
    ASSERT_TRUE(c.done);
    ASSERT_EQ(c.ids, gen) << p;
    for (size_t step = 0; step < gen.size(); ++step) {
      const std::vector<float>& v = c.vectors[step];
      ASSERT_EQ(int64_t(v.size()), V);
      double sum = 0;
      for (float x : v) sum += std::exp(double(x));
      EXPECT_NEAR(std::log(sum), 0.0, 1e-6) << p << " step " << step;
      EXPECT_EQ(std::max_element(v.begin(), v.end()) - v.begin(), c.ids[step]);
      // The same summation as the chosen token's logprob: equal, not close.
      EXPECT_EQ(v[size_t(c.ids[step])], c.logprob[step]) << p << " step " << step;
      const float* row = logits->row<float>(int64_t(step));
      double mx = row[0], ref_sum = 0;
      for (int64_t j = 0; j < V; ++j) mx = std::max(mx, double(row[j]));
      for (int64_t j = 0; j < V; ++j) ref_sum += std::exp(double(row[j]) - mx);
      for (int64_t j = 0; j < V; ++j) {
        const double ref = double(row[j]) - mx - std::log(ref_sum);
        ref_worst = std::max(ref_worst, std::fabs(ref - double(v[size_t(j)])));
      }
    }
  }
  // The engine's logits against transformers' (test_naive_oracle: the reference is within
  // 1e-4 of a float64 forward); log_softmax shifts every logit of a row by one constant. On
  // CUDA the forward itself is held to verify's 1e-3 (`recur verify --device cuda` measures
  // 2.3e-4 on this model, and the vectors measured 2.28e-4 on the H200).
  const char* d = std::getenv("RECUR_TEST_DEVICE");
  const bool cuda = d && std::string(d).rfind("cuda", 0) == 0;
  EXPECT_LE(ref_worst, cuda ? 1e-3 : 2e-4);
  RecordProperty("max_logprob_error", std::to_string(ref_worst));
}

// Batched beside requests that do not ask, one that samples, and prompts being prefilled, and
// with pipelined decoding: the same vectors as the request alone; none to those that did not ask.
TEST(VocabLogprobs, SameInABatchAndPipelinedAndOnlyForTheRequestsThatAsk) {
  auto ops = test_ops();
  const std::vector<int32_t> prompt = {5, 17, 42, 8, 99, 3, 250};
  Collected alone;
  {
    auto e = make_engine(*ops, EngineConfig{});
    ASSERT_TRUE(e->submit(request(prompt, 30, true, -1), collect(&alone)).ok());
    e->run_until_idle();
  }
  ASSERT_EQ(alone.vectors.size(), 30u);
  for (int pipeline : {0, 1}) {
    EngineConfig cfg;
    cfg.max_batch = 4;
    cfg.max_batch_tokens = 64;  // the long prompt is prefilled over several steps
    cfg.pipeline_decode = pipeline;
    auto e = make_engine(*ops, cfg);
    Collected with, without, sampled, late;
    ASSERT_TRUE(e->submit(request({1, 2, 3}, 40, false, -1), collect(&without)).ok());
    ASSERT_TRUE(e->submit(request(prompt, 30, true, -1), collect(&with)).ok());
    Request s = request({7, 7, 7, 7}, 25, true, 3);
    s.sampling.temperature = 0.8f;
    s.sampling.seed = 11;
    ASSERT_TRUE(e->submit(s, collect(&sampled)).ok());
    for (int i = 0; i < 5; ++i) e->step();
    std::vector<int32_t> long_prompt(300);
    for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = int32_t(i * 7 % 256);
    ASSERT_TRUE(e->submit(request(long_prompt, 10, false, -1), collect(&late)).ok());
    e->run_until_idle();
    ASSERT_TRUE(with.done && without.done && sampled.done && late.done);
    ASSERT_EQ(with.ids, alone.ids) << "pipeline " << pipeline;
    // Greedy alone once the sampled request is done: the next step is queued before the picks
    // are read, and its forward writes the logits the vectors were taken from.
    if (pipeline) {
      EXPECT_GE(e->stats().pipelined_steps, 5);
    }
    double worst = 0;
    for (size_t i = 0; i < alone.vectors.size(); ++i) {
      worst = std::max(worst, max_diff(with.vectors[i], alone.vectors[i]));
    }
    EXPECT_LE(worst, 1e-4) << "pipeline " << pipeline;  // summation order in a batch
    for (const auto& v : without.vectors) EXPECT_TRUE(v.empty());
    for (const auto& v : late.vectors) EXPECT_TRUE(v.empty());
    ASSERT_EQ(sampled.vectors.size(), 25u);
    for (size_t i = 0; i < sampled.vectors.size(); ++i) {
      ASSERT_EQ(sampled.vectors[i].size(), 256u);
      EXPECT_EQ(sampled.vectors[i][size_t(sampled.ids[i])], sampled.logprob[i]);
    }
  }
}

// Many tokens with the vector on: no heap allocation in the engine's steps and flat buffer
// counters (the rows come from the pool sized at creation).
TEST(VocabLogprobs, NoAllocationPerTokenAndFlatBufferCounters) {
  auto ops = test_ops();
  EngineConfig cfg;
  cfg.max_batch = 2;
  auto e = make_engine(*ops, cfg);
  int64_t tokens = 0, without = 0;
  EventSink sink = [&](const Event& ev) {
    if (ev.kind != Event::Kind::kToken) return;
    ++tokens;
    without += ev.vocab_logprobs.size() == 256 ? 0 : 1;
  };
  ASSERT_TRUE(e->submit(request({1, 2, 3, 4, 5, 6, 7, 8}, 1500, true), sink).ok());
  ASSERT_TRUE(e->submit(request({9, 8, 7}, 1500, true, -1), sink).ok());
  for (int i = 0; i < 20; ++i) e->step();  // past the prompts and the first steps' reservations
  const EngineStats before = e->stats();
  int64_t allocs = 0;
  for (int i = 0; i < 1000; ++i) {
    testing::start_counting_allocs();
    e->step();
    allocs += testing::stop_counting_allocs();
  }
  const EngineStats after = e->stats();
  EXPECT_EQ(allocs, 0);
  EXPECT_EQ(before.alloc.allocs_total, after.alloc.allocs_total);
  EXPECT_EQ(before.alloc.live_buffers, after.alloc.live_buffers);
  EXPECT_EQ(before.alloc.live_bytes, after.alloc.live_bytes);
  EXPECT_EQ(tokens, 2 * 1020);
  EXPECT_EQ(without, 0);
  e->run_until_idle();
}

TEST(VocabLogprobs, RefusedWhenTheEngineHasNoRowsForThem) {
  auto ops = test_ops();
  auto e = Engine::create(kTiny, *ops, EngineConfig{}, nullptr);
  ASSERT_TRUE(e.ok());
  auto refused = (*e)->submit(request({1, 2, 3}, 4, true), [](const Event&) {});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("vocab_logprobs"), std::string::npos);
  EXPECT_TRUE((*e)->submit(request({1, 2, 3}, 4, false), [](const Event&) {}).ok());
}

}  // namespace
}  // namespace recur
