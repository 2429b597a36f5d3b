// Engine invariants: batch invariance, mixed-length prefill, slot reuse after cancellation,
// the reference decode through the engine, a context bounded by a small cache, and flat
// buffer counters over a long completion.
#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <map>
#include <numeric>
#include <random>

#include "alloc_counter.h"
#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "engine/engine.h"
#include "engine/text_stream.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"

namespace recur {
namespace {

const std::string kRoot = RECUR_SOURCE_DIR;
const std::string kTiny = kRoot + "/models/qwen3next-tiny";
// A test-name-safe form of a model directory's name.
std::string name_of(std::string dir) {
  for (char& c : dir) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return dir;
}

struct Result1 {
  std::vector<int32_t> ids;
  std::vector<std::vector<TokenLogprob>> top;  // raw top logprobs per generated token
  FinishReason reason = FinishReason::kError;
  std::string message;
  bool done = false;
};

// Collects one request's events.
EventSink collect(Result1* r) {
  return [r](const Event& ev) {
    if (ev.kind == Event::Kind::kToken) {
      r->ids.push_back(ev.token);
      r->top.emplace_back(ev.top_logprobs.begin(), ev.top_logprobs.end());
    } else {
      r->reason = ev.reason;
      r->message = std::string(ev.message);
      r->done = true;
    }
  };
}

Request greedy(std::vector<int32_t> prompt, int max_tokens, int logprobs = 5) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.sampling.logprobs = logprobs;
  r.stop.ignore_eos = true;
  return r;
}

std::vector<int32_t> random_prompt(int len, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (auto& t : p) t = int32_t(rng() % uint32_t(vocab));
  return p;
}

// RECUR_TEST_DEVICE=cuda runs the engine tests on the CUDA backend (device machine).
std::unique_ptr<Ops> test_ops() {
  const char* d = std::getenv("RECUR_TEST_DEVICE");
  auto ops = create_backend(d ? d : "cpu", 2);
  EXPECT_TRUE(ops.ok()) << ops.error().to_string();
  return ops.ok() ? std::move(*ops) : nullptr;
}

// How far a sequence's log-probabilities may move with the batch around it. f32 arithmetic
// throughout (the CPU; f32 weights anywhere) gives the same values up to summation order. On
// CUDA, steps of more than CudaOps::kGemvMaxTokens tokens run 16-bit weights on tensor cores
// with activations rounded to that width, so a token decoded beside a prompt chunk differs
// from one decoded alone by that rounding (measured up to 3.1e-4 on qwen3_5-moe-tiny).
double batch_tolerance(const std::string& model) {
  const char* d = std::getenv("RECUR_TEST_DEVICE");
  if (!d || std::string(d).rfind("cuda", 0) != 0) return 1e-4;
  auto cfg = read_json_file(model + "/config.json");
  if (!cfg.ok()) return 1e-4;
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (cfg->contains(key) && (*cfg)[key].is_string() && (*cfg)[key] != "float32") return 1e-3;
  }
  return 1e-4;
}

std::unique_ptr<Engine> make_engine(Ops& ops, const std::string& model, EngineConfig cfg) {
  auto e = Engine::create(model, ops, cfg, nullptr);
  EXPECT_TRUE(e.ok()) << e.error().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

Result1 solo(const std::string& model, const Request& req) {
  auto ops_owner = test_ops();
  Ops& ops = *ops_owner;
  EngineConfig cfg;
  cfg.max_batch = 1;
  auto e = make_engine(ops, model, cfg);
  Result1 r;
  if (!e) return r;  // make_engine reported why
  EXPECT_TRUE(e->submit(req, collect(&r)).ok());
  e->run_until_idle();
  return r;
}

// Same greedy tokens, and raw logprobs within tol at every step.
void expect_same(const Result1& a, const Result1& b, double tol, const std::string& what) {
  ASSERT_TRUE(a.done && b.done) << what;
  ASSERT_EQ(a.ids, b.ids) << what;
  ASSERT_EQ(a.top.size(), b.top.size());
  double worst = 0;
  for (size_t i = 0; i < a.top.size(); ++i) {
    ASSERT_EQ(a.top[i].size(), b.top[i].size());
    for (size_t j = 0; j < a.top[i].size(); ++j) {
      ASSERT_EQ(a.top[i][j].id, b.top[i][j].id) << what << " step " << i;
      worst = std::max(worst, double(std::fabs(a.top[i][j].logprob - b.top[i][j].logprob)));
    }
  }
  EXPECT_LE(worst, tol) << what;
}

// The scheduler invariants on every architecture's small reference model (vocabulary 256).
class EngineOnModel : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Models, EngineOnModel,
                         ::testing::Values("qwen3next-tiny", "qwen3_5-tiny", "qwen3_5-moe-tiny",
                                           "kimi-linear-tiny"),
                         [](const auto& info) { return name_of(info.param); });
// The original report's 48-layer shape, as Qwen3-Next and as Qwen3.5.
class EngineOn48Layers : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Models, EngineOn48Layers,
                         ::testing::Values("qwen3next-seed-48L", "qwen3_5-seed-48L"),
                         [](const auto& info) { return name_of(info.param); });
// The same depth for the long decode, and as Kimi-Linear (36 Kimi Delta Attention layers, 12
// latent attention), which has no transformers reference of that depth.
class EngineLongDecode : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Models, EngineLongDecode,
                         ::testing::Values("qwen3next-seed-48L", "qwen3_5-seed-48L",
                                           "kimi-seed-48L"),
                         [](const auto& info) { return name_of(info.param); });

TEST_P(EngineOnModel, BatchedAndStaggeredDecodingEqualsEachSequenceAlone) {
  const std::string model = kRoot + "/models/" + GetParam();
  const std::vector<int> lens = {1, 7, 64, 65, 150};
  std::vector<Request> reqs;
  for (size_t i = 0; i < lens.size(); ++i) {
    reqs.push_back(greedy(random_prompt(lens[i], 256, uint32_t(i + 1)), 20 + int(i) * 3));
  }
  std::vector<Result1> alone;
  for (auto& r : reqs) alone.push_back(solo(model, r));

  auto ops_owner = test_ops();
  Ops& ops = *ops_owner;
  EngineConfig cfg;
  cfg.max_batch = 4;          // the fifth waits in the queue for a free slot
  cfg.max_batch_tokens = 96;  // long prompts are prefilled in chunks between decode steps
  auto e = make_engine(ops, model, cfg);
  ASSERT_TRUE(e);
  std::vector<Result1> together(reqs.size());
  // Staggered admission: a new request every few steps.
  size_t submitted = 0;
  for (int step = 0; submitted < reqs.size() || e->step(); ++step) {
    if (submitted < reqs.size() && step % 3 == 0) {
      ASSERT_TRUE(e->submit(reqs[submitted], collect(&together[submitted])).ok());
      ++submitted;
      e->step();
    }
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    expect_same(together[i], alone[i], batch_tolerance(model), "prompt " + std::to_string(i));
    EXPECT_EQ(together[i].reason, FinishReason::kLength);
  }
  const EngineStats st = e->stats();
  EXPECT_EQ(st.slots_used, 0);
  EXPECT_EQ(st.kv_blocks_used, 0);
}

TEST_P(EngineOnModel, MixedLengthPrefillInOneStepEqualsSeparatePrefills) {
  const std::string model = kRoot + "/models/" + GetParam();
  const std::vector<int> lens = {1, 37, 100, 2};
  auto ops_owner = test_ops();
  Ops& ops = *ops_owner;
  EngineConfig cfg;
  cfg.max_batch = 4;
  cfg.max_batch_tokens = 256;  // all four prompts in the first step
  auto e = make_engine(ops, model, cfg);
  ASSERT_TRUE(e);
  std::vector<Result1> together(lens.size());
  std::vector<Request> reqs;
  for (size_t i = 0; i < lens.size(); ++i) {
    reqs.push_back(greedy(random_prompt(lens[i], 256, uint32_t(40 + i)), 8, 20));
    ASSERT_TRUE(e->submit(reqs.back(), collect(&together[i])).ok());
  }
  e->step();
  for (auto& r : together) ASSERT_EQ(r.ids.size(), 1u) << "every prompt prefilled in step one";
  EXPECT_EQ(e->stats().prompt_tokens, 140);
  e->run_until_idle();
  for (size_t i = 0; i < lens.size(); ++i) {
    expect_same(together[i], solo(model, reqs[i]), batch_tolerance(model),
                "prompt " + std::to_string(i));
  }
}

TEST_P(EngineOnModel, CancelledSequenceFreesItsSlotForAFreshOne) {
  const std::string model = kRoot + "/models/" + GetParam();
  auto ops_owner = test_ops();
  Ops& ops = *ops_owner;
  EngineConfig cfg;
  cfg.max_batch = 1;
  auto e = make_engine(ops, model, cfg);
  ASSERT_TRUE(e);
  Result1 first, second;
  const Request a = greedy(random_prompt(30, 256, 7), 1000);
  const Request b = greedy(random_prompt(45, 256, 8), 25);
  auto id = e->submit(a, collect(&first));
  ASSERT_TRUE(id.ok());
  for (int i = 0; i < 12; ++i) e->step();
  ASSERT_GT(first.ids.size(), 5u);
  ASSERT_TRUE(e->submit(b, collect(&second)).ok());
  e->step();
  EXPECT_TRUE(second.ids.empty()) << "one slot: the second request waits";
  e->cancel(*id);
  e->step();
  EXPECT_TRUE(first.done);
  EXPECT_EQ(first.reason, FinishReason::kCancelled);
  e->run_until_idle();
  expect_same(second, solo(model, b), batch_tolerance(model), "request after the cancelled one");
  EXPECT_EQ(e->stats().kv_blocks_used, 0);
}

// The 48-layer reference model's 1,024 greedy steps through the engine: the same tokens as
// transformers chose, and the same log-probabilities within 1e-3.
TEST_P(EngineOn48Layers, ReferenceDecodeOf48LayerModelThroughTheEngine) {
  const std::string model = kRoot + "/models/" + GetParam();
  auto golden =
      SafetensorsFile::open(kRoot + "/tests/data/golden/" + GetParam() + "/golden.safetensors");
  ASSERT_TRUE(golden.ok());
  auto ids_t = golden->tensor("p0.ids");
  auto gen_t = golden->tensor("p0.gen");
  auto logits_t = golden->tensor("p0.gen_logits");
  ASSERT_TRUE(ids_t.ok() && gen_t.ok() && logits_t.ok());
  std::vector<int32_t> prompt, gen;
  for (int64_t i = 0; i < ids_t->numel(); ++i) prompt.push_back(int32_t(ids_t->ptr<int64_t>()[i]));
  for (int64_t i = 0; i < gen_t->numel(); ++i) gen.push_back(int32_t(gen_t->ptr<int64_t>()[i]));
  Result1 r = solo(model, greedy(prompt, int(gen.size()), 20));
  ASSERT_EQ(r.ids, gen);
  const int64_t V = logits_t->shape[1];
  double worst = 0;
  for (size_t step = 0; step < gen.size(); ++step) {
    const float* row = logits_t->row<float>(int64_t(step));
    double mx = row[0], sum = 0;
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, double(row[j]));
    for (int64_t j = 0; j < V; ++j) sum += std::exp(double(row[j]) - mx);
    for (const TokenLogprob& lp : r.top[step]) {
      const double ref = double(row[lp.id]) - mx - std::log(sum);
      worst = std::max(worst, std::fabs(ref - lp.logprob));
    }
  }
  EXPECT_LE(worst, 1e-3);
  RecordProperty("max_logprob_error", std::to_string(worst));
}

// A small cache bounds the context (test_preemption.cpp has the rest): a sequence runs to the
// context's end, and the other sequence beside it to its length.
TEST(Engine, SmallCacheBoundsTheContextAndSparesTheOthers) {
  auto ops_owner = test_ops();
  Ops& ops = *ops_owner;
  EngineConfig cfg;
  cfg.max_batch = 2;
  cfg.kv_blocks = 6;  // 96 token positions for both sequences together
  auto e = make_engine(ops, kTiny, cfg);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->config().max_context, 96);
  Result1 a, b;
  ASSERT_TRUE(e->submit(greedy(random_prompt(20, 256, 1), 500), collect(&a)).ok());
  ASSERT_TRUE(e->submit(greedy(random_prompt(20, 256, 2), 10), collect(&b)).ok());
  e->run_until_idle();
  EXPECT_EQ(b.reason, FinishReason::kLength);
  EXPECT_EQ(b.ids.size(), 10u);
  EXPECT_EQ(a.reason, FinishReason::kLength);
  EXPECT_EQ(a.message, "the context length is reached");
  EXPECT_EQ(a.ids.size(), 77u);  // the last sampled at the last position, never fed
  EXPECT_EQ(e->stats().kv_blocks_used, 0);
  // A prompt longer than the whole cache is refused at submission, naming the reason.
  auto too_long = e->submit(greedy(random_prompt(200, 256, 3), 1), [](const Event&) {});
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.error().message.find("cache"), std::string::npos);
}

TEST(Engine, RejectsBadRequestsWithClearErrors) {
  auto ops_owner = test_ops();
  Ops& ops = *ops_owner;
  auto e = make_engine(ops, kTiny, EngineConfig{});
  ASSERT_TRUE(e);
  auto sink = [](const Event&) {};
  auto empty = e->submit(greedy({}, 4), sink);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.error().message.find("empty"), std::string::npos);
  auto oov = e->submit(greedy({1, 999}, 4), sink);
  ASSERT_FALSE(oov.ok());
  EXPECT_NE(oov.error().message.find("id 999"), std::string::npos);
  auto zero = e->submit(greedy({1}, 0), sink);
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.error().message.find("max_tokens"), std::string::npos);
  Request strs = greedy({1}, 4);
  strs.stop.stop_strings = {"x"};
  auto no_tok = e->submit(strs, sink);
  ASSERT_FALSE(no_tok.ok());
  EXPECT_NE(no_tok.error().message.find("tokenizer"), std::string::npos);
}

TEST(Engine, StopSequencesAndStopTokensEndGeneration) {
  const Request base = greedy(random_prompt(9, 256, 11), 40);
  Result1 free_run = solo(kTiny, base);
  ASSERT_EQ(free_run.ids.size(), 40u);
  Request by_token = base;
  by_token.stop.stop_token_ids = {free_run.ids[5]};
  Result1 r1 = solo(kTiny, by_token);
  const size_t first = size_t(std::find(free_run.ids.begin(), free_run.ids.end(), free_run.ids[5]) -
                              free_run.ids.begin());
  EXPECT_EQ(r1.ids.size(), first + 1);
  EXPECT_EQ(r1.reason, FinishReason::kStop);
  Request by_seq = base;
  by_seq.stop.stop_sequences = {{free_run.ids[10], free_run.ids[11]}};
  Result1 r2 = solo(kTiny, by_seq);
  EXPECT_LE(r2.ids.size(), 12u);
  EXPECT_EQ(r2.reason, FinishReason::kStop);
  EXPECT_TRUE(std::equal(r2.ids.begin(), r2.ids.end(), free_run.ids.begin()));
}

// Greedy steps launched one ahead (each fed the previous step's picks where the backend keeps
// them) give what step-by-step decoding gives: the same ids and ends, with sequences ending
// at lengths, at a stop token only known after the next step was queued, and by cancellation,
// and a request admitted while the others run. Slots and blocks all come back.
TEST(Engine, PipelinedGreedyDecodeEqualsStepByStep) {
  const std::vector<int> max_tokens = {5, 12, 30, 30, 9};
  std::vector<Request> reqs;
  for (size_t i = 0; i < max_tokens.size(); ++i) {
    reqs.push_back(greedy(random_prompt(5 + int(i) * 3, 256, uint32_t(40 + i)), max_tokens[i], -1));
  }
  int64_t pipelined[2] = {0, 0};
  auto run = [&](int pipeline, const std::vector<Request>& rs) {
    auto ops_owner = test_ops();
    EngineConfig cfg;
    cfg.max_batch = 4;
    cfg.pipeline_decode = pipeline;
    auto e = make_engine(*ops_owner, kTiny, cfg);
    if (!e) return std::vector<Result1>(rs.size());
    std::vector<Result1> out(rs.size());
    uint64_t cancel_id = 0;
    for (size_t i = 0; i + 1 < rs.size(); ++i) {
      auto id = e->submit(rs[i], collect(&out[i]));
      EXPECT_TRUE(id.ok());
      if (i == 3) cancel_id = *id;
    }
    for (int step = 0; step < 200 && e->step(); ++step) {
      if (step == 4) {
        EXPECT_TRUE(e->submit(rs.back(), collect(&out.back())).ok());
      }
      if (out[3].ids.size() == 17) e->cancel(cancel_id);
    }
    const EngineStats st = e->stats();
    EXPECT_EQ(st.slots_used, 0);
    EXPECT_EQ(st.kv_blocks_used, 0);
    pipelined[pipeline] = st.pipelined_steps;
    return out;
  };
  std::vector<Result1> plain = run(0, reqs);
  // A stop token from the middle of the third completion: it ends there either way.
  ASSERT_EQ(plain[2].ids.size(), 30u);
  reqs[2].stop.stop_token_ids = {plain[2].ids[8]};
  plain = run(0, reqs);
  const std::vector<Result1> piped = run(1, reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(plain[i].done && piped[i].done) << i;
    EXPECT_EQ(piped[i].ids, plain[i].ids) << "request " << i;
    EXPECT_EQ(piped[i].reason, plain[i].reason) << "request " << i;
  }
  EXPECT_EQ(plain[2].reason, FinishReason::kStop);
  EXPECT_LE(plain[2].ids.size(), 9u);
  EXPECT_EQ(plain[3].reason, FinishReason::kCancelled);
  EXPECT_EQ(plain[0].ids.size(), 5u);
  EXPECT_EQ(pipelined[0], 0);
  // The path ran (it stands aside while a request waits, or when a pick ends a sequence by
  // its length).
  EXPECT_GE(pipelined[1], 5);
}

// The original report's scenario: 48 layers (36 Gated DeltaNet or Kimi Delta Attention), one
// sequence, prompt 1..8, 20,000 generated tokens through the batched path. Counters at token
// 2,000 and 20,000 match.
TEST_P(EngineLongDecode, TwentyThousandTokensWithFlatBufferCounters) {
  const std::string model = kRoot + "/models/" + GetParam();
  auto ops_owner = test_ops();
  Ops& ops = *ops_owner;
  EngineConfig cfg;
  cfg.max_batch = 4;
  auto e = make_engine(ops, model, cfg);
  ASSERT_TRUE(e);
  std::map<int, EngineStats> at;
  int n = 0;
  Engine* eng = e.get();
  bool done = false;
  FinishReason reason = FinishReason::kError;
  Request req = greedy({1, 2, 3, 4, 5, 6, 7, 8}, 20000, -1);
  ASSERT_TRUE(eng->submit(req,
                          [&](const Event& ev) {
                            if (ev.kind == Event::Kind::kFinish) {
                              done = true;
                              reason = ev.reason;
                              return;
                            }
                            ++n;
                            if (n == 2000 || n == 20000) at[n] = eng->stats();
                          })
                  .ok());
  e->run_until_idle();
  ASSERT_TRUE(done);
  EXPECT_EQ(reason, FinishReason::kLength);
  ASSERT_EQ(n, 20000);
  EXPECT_EQ(at[2000].alloc.allocs_total, at[20000].alloc.allocs_total);
  EXPECT_EQ(at[2000].alloc.live_buffers, at[20000].alloc.live_buffers);
  EXPECT_EQ(at[2000].alloc.live_bytes, at[20000].alloc.live_bytes);
  EXPECT_GT(at[20000].kv_blocks_used, at[2000].kv_blocks_used);  // the cache did grow
}

}  // namespace
}  // namespace recur

// The invariants hold on a Qwen3-Next shape no test model has: value/key head ratio 3, conv
// kernel 3, tied bf16 embeddings, an irregular layer pattern, dense and MoE layers mixed,
// norm_topk_prob false, half-rotary attention.
#include "model/random_checkpoint.h"

namespace recur {
namespace {

TEST(EngineUnseenShape, BatchInvarianceSlotReuseAndMixedPrefill) {
  recur_test::RandomModelSpec spec;
  spec.hidden = 48;
  spec.layers = 5;
  spec.vocab = 300;
  spec.tie_word_embeddings = true;
  spec.heads = 6;
  spec.kv_heads = 2;
  spec.head_dim = 20;
  spec.partial_rotary_factor = 0.5;
  spec.rope_parameters_style = true;
  spec.layer_types = {"linear_attention", "full_attention", "linear_attention", "linear_attention",
                      "full_attention"};
  spec.linear_key_heads = 1;
  spec.linear_value_heads = 3;
  spec.linear_key_dim = 12;
  spec.linear_value_dim = 10;
  spec.conv_kernel = 3;
  spec.experts = 5;
  spec.experts_per_tok = 3;
  spec.norm_topk_prob = false;
  spec.decoder_sparse_step = 2;
  spec.mlp_only_layers = {3};
  spec.dtype = recur_test::StoreType::kBF16;
  recur_test::TempDir dir;
  recur_test::write_checkpoint(dir.path(), recur_test::make_random_checkpoint(spec, 77));

  const std::vector<int> lens = {1, 63, 64, 65, 130};
  std::vector<Request> reqs;
  for (size_t i = 0; i < lens.size(); ++i) {
    reqs.push_back(greedy(random_prompt(lens[i], spec.vocab, uint32_t(90 + i)), 12));
  }
  std::vector<Result1> alone;
  for (auto& r : reqs) alone.push_back(solo(dir.path(), r));

  auto ops_owner = test_ops();
  Ops& ops = *ops_owner;
  EngineConfig cfg;
  cfg.max_batch = 3;           // two requests wait and reuse finished slots
  cfg.max_batch_tokens = 200;  // several prompts prefilled in one step
  auto e = make_engine(ops, dir.path(), cfg);
  ASSERT_TRUE(e);
  std::vector<Result1> together(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i)
    ASSERT_TRUE(e->submit(reqs[i], collect(&together[i])).ok());
  e->run_until_idle();
  for (size_t i = 0; i < reqs.size(); ++i) {
    expect_same(together[i], alone[i], 1e-4, "prompt " + std::to_string(i));
  }
}

// A multimodal Qwen3.5 checkpoint's image and video placeholders are refused at submission with
// the reason, until images are supported; other prompts run.
TEST(EngineUnseenShape, Qwen3_5ImageTokensAreRefusedWithTheReason) {
  recur_test::RandomModelSpec spec;
  spec.family = recur_test::Family::kQwen3_5;
  spec.nested = true;
  spec.vocab = 300;
  recur_test::RandomCheckpoint ck = recur_test::make_random_checkpoint(spec, 5);
  ck.config["image_token_id"] = 250;  // inside this vocabulary, so only the refusal can stop it
  ck.config["video_token_id"] = 251;
  recur_test::TempDir dir;
  recur_test::write_checkpoint(dir.path(), ck);
  auto ops_owner = test_ops();
  auto e = make_engine(*ops_owner, dir.path(), EngineConfig{});
  ASSERT_TRUE(e);
  for (int32_t id : {250, 251}) {
    auto r = e->submit(greedy({1, 2, id, 3}, 4), [](const Event&) {});
    ASSERT_FALSE(r.ok()) << "id " << id;
    EXPECT_EQ(r.error().code, ErrorCode::kUnsupported);
    EXPECT_NE(r.error().message.find("image and video inputs are not supported"), std::string::npos)
        << r.error().message;
  }
  Result1 ok;
  ASSERT_TRUE(e->submit(greedy({1, 2, 249, 3}, 4), collect(&ok)).ok());
  e->run_until_idle();
  EXPECT_EQ(ok.ids.size(), 4u);
}

// A generation_config.json whose defaults are out of range or of the wrong type stops the engine's
// creation with the field and the file named, instead of every request that keeps the default
// failing as if the client had sent the value.
TEST(EngineUnseenShape, BadGenerationDefaultsAreRefusedAtCreationNamingTheFile) {
  recur_test::RandomModelSpec spec;
  spec.family = recur_test::Family::kQwen3_5;
  spec.vocab = 300;
  const recur_test::RandomCheckpoint ck = recur_test::make_random_checkpoint(spec, 5);
  recur_test::TempDir dir;
  recur_test::write_checkpoint(dir.path(), ck);
  auto ops_owner = test_ops();
  const auto create = [&](const std::string& gen) {
    std::ofstream(dir.path() + "/generation_config.json") << gen;
    return Engine::create(dir.path(), *ops_owner, EngineConfig{}, nullptr);
  };
  for (const auto& [gen, names] : std::vector<std::pair<std::string, std::string>>{
           {R"({"do_sample": true, "temperature": -1})",
            "temperature must be a finite number >= 0"},
           {R"({"temperature": 1e308})", "'temperature' must be a number"},
           {R"({"do_sample": true, "top_p": 0})", "top_p must be in (0, 1]"},
           {R"({"do_sample": true, "min_p": 5})", "min_p must be in [0, 1]"},
           {R"({"repetition_penalty": 0})", "repetition_penalty must be a finite number > 0"},
           {R"({"temperature": "hot"})", "'temperature' must be a number"},
           {R"({"do_sample": "yes"})", "'do_sample' must be true or false"},
           {R"({"top_k": 2.5})", "'top_k' must be a whole number >= 0"},
           {R"({"top_k": -1})", "'top_k' must be a whole number >= 0"},
           {R"({"top_k": 1000000000000})", "'top_k' must be a whole number >= 0"}}) {
    auto e = create(gen);
    ASSERT_FALSE(e.ok()) << gen;
    EXPECT_NE(e.error().message.find("generation_config.json"), std::string::npos)
        << e.error().message;
    EXPECT_NE(e.error().message.find(names), std::string::npos) << e.error().message;
  }
  auto fine = create(R"({"do_sample": true, "temperature": 0.6, "top_k": 20.0, "top_p": 0.95,
                         "min_p": null, "repetition_penalty": 1.05})");
  ASSERT_TRUE(fine.ok()) << fine.error().to_string();
  EXPECT_EQ((*fine)->model_info().generation.top_k, 20);
  // A greedy config's sampling values are never used: odd ones do not refuse the model.
  auto greedy = create(R"({"do_sample": false, "temperature": -1, "top_p": 0})");
  ASSERT_TRUE(greedy.ok()) << greedy.error().to_string();
}

}  // namespace
}  // namespace recur

// Stop strings are matched on decoded text across token boundaries, and excluded from it.
namespace recur {
namespace {

TEST(EngineText, StopStringAcrossTokenBoundariesEndsAndIsExcluded) {
  const std::string dir = kRoot + "/models/qwen3next-tiny-realvocab";
  auto tok = Tokenizer::load(dir);
  ASSERT_TRUE(tok.ok()) << tok.error().to_string();
  auto ops_owner = test_ops();
  EngineConfig cfg;
  cfg.max_batch = 2;
  auto eng = Engine::create(dir, *ops_owner, cfg, &*tok);
  ASSERT_TRUE(eng.ok()) << eng.error().to_string();
  auto run = [&](std::vector<std::string> stops, std::string* text) {
    Request r = greedy({9707, 11, 1879, 0}, 40, -1);
    r.stop.stop_strings = std::move(stops);
    r.skip_special_tokens = false;
    FinishReason reason = FinishReason::kError;
    std::vector<int32_t> ids;
    EXPECT_TRUE((*eng)
                    ->submit(r,
                             [&](const Event& ev) {
                               text->append(ev.text);
                               if (ev.kind == Event::Kind::kToken) ids.push_back(ev.token);
                               if (ev.kind == Event::Kind::kFinish) reason = ev.reason;
                             })
                    .ok());
    (*eng)->run_until_idle();
    return std::make_pair(reason, ids);
  };
  std::string full;
  auto [free_reason, free_ids] = run({}, &full);
  ASSERT_EQ(free_ids.size(), 40u);
  EXPECT_EQ(full, tok->decode(free_ids, false));
  // A stop string made of the end of one token's text and the start of the next.
  std::string first_two = tok->decode(std::span(free_ids).subspan(0, 12), false);
  std::string first_one = tok->decode(std::span(free_ids).subspan(0, 11), false);
  ASSERT_GT(first_two.size(), first_one.size());
  ASSERT_GE(first_one.size(), 2u);
  const std::string stop =
      first_one.substr(first_one.size() - 2) + first_two.substr(first_one.size(), 1);
  const size_t at = full.find(stop);
  ASSERT_NE(at, std::string::npos);
  std::string text;
  auto [reason, ids] = run({stop, "never appears in this text"}, &text);
  EXPECT_EQ(reason, FinishReason::kStop);
  EXPECT_EQ(text, full.substr(0, at));
  EXPECT_LT(ids.size(), free_ids.size());
}

// A generated token's text reaches the request's buffer without a heap allocation, also for
// tokens longer than a short string's inline bytes (runs of spaces in code): the stream
// appends into buffers that keep their capacity.
TEST(EngineText, TextStreamAllocatesNothingPerToken) {
  auto tok = Tokenizer::load(kRoot + "/models/qwen3next-tiny-realvocab");
  ASSERT_TRUE(tok.ok()) << tok.error().to_string();
  int32_t long_id = -1;  // a token of 24 or more spaces
  for (int32_t id = 0; id < 200000 && long_id < 0; ++id) {
    const std::string_view bytes = tok->id_to_bytes(id);
    if (bytes.size() >= 24 && bytes.find_first_not_of(' ') == std::string_view::npos) long_id = id;
  }
  ASSERT_GE(long_id, 0) << "no token of 24 spaces in the vocabulary";
  TextStream stream(*tok, {"never appears"}, false);
  std::string out;
  out.reserve(256);
  for (int i = 0; i < 20; ++i) {  // the stream's own buffers reach their size
    out.clear();
    ASSERT_FALSE(stream.push(long_id, &out));
  }
  testing::start_counting_allocs();
  size_t released = 0;
  for (int i = 0; i < 1000; ++i) {
    out.clear();
    stream.push(long_id, &out);
    released += out.size();
  }
  EXPECT_EQ(testing::stop_counting_allocs(), 0);
  EXPECT_EQ(released, 1000 * tok->id_to_bytes(long_id).size());
}

}  // namespace
}  // namespace recur
