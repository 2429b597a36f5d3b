// A generation the engine ends with an error, over the tiny real-vocabulary model whose forward
// starts failing after a few steps: an Anthropic stream ends with its error event (no
// message_delta or message_stop after it, as the Messages API ends a failed stream), and an
// OpenAI stream says so in an error chunk.
#include <gtest/gtest.h>

#include <memory>

#include "backend/cpu/cpu_ops.h"
#include "model/registry.h"
#include "request_test_util.h"
#include "server/format.h"

namespace recur::server {
namespace {

// Forwards to a real model until `ok_forwards` steps have run, then fails every step.
class FailingModel final : public Model {
 public:
  FailingModel(std::unique_ptr<Model> inner, int ok_forwards)
      : inner_(std::move(inner)), ok_(ok_forwards) {}
  const ModelInfo& info() const override { return inner_->info(); }
  int max_batch_tokens() const override { return inner_->max_batch_tokens(); }
  int max_logit_rows() const override { return inner_->max_logit_rows(); }
  const StateConfig& state_config() const override { return inner_->state_config(); }
  void reset_slot(int slot) override { inner_->reset_slot(slot); }
  void save_snapshot(int slot, int snapshot) override { inner_->save_snapshot(slot, snapshot); }
  void restore_snapshot(int snapshot, int slot) override {
    inner_->restore_snapshot(snapshot, slot);
  }
  Status forward(const Batch& batch, Tensor logits) override {
    if (++forwards_ > ok_) return make_error(ErrorCode::kInternal, "the device fell over");
    return inner_->forward(batch, logits);
  }
  Ops& ops() override { return inner_->ops(); }
  bool reads_device_tokens() const override { return inner_->reads_device_tokens(); }

 private:
  std::unique_ptr<Model> inner_;
  int ok_ = 0, forwards_ = 0;
};

class StreamErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ops_ = std::make_unique<CpuOps>(1);
    EngineConfig cfg;
    cfg.max_batch = 2;
    cfg.max_batch_tokens = 256;
    cfg.kv_cache_bytes = int64_t(64) << 20;
    auto model = load_model(kRealVocabModel, *ops_, Engine::load_options(cfg));
    ASSERT_TRUE(model.ok()) << model.error().to_string();
    auto e = Engine::create(std::make_unique<FailingModel>(std::move(*model), 3), cfg,
                            &chat_fixture(kRealVocabModel).tok);
    ASSERT_TRUE(e.ok()) << e.error().to_string();
    engine_ = std::move(*e);
    engine_->start();
    ctx_ = tiny_context(chat_fixture(kRealVocabModel), engine_->config().max_context);
    ctx_.vocab_size = engine_->model_info().vocab_size;
  }

  // Runs a streaming request to its end; the formatter's SSE text of every drain.
  template <typename Stream>
  std::string run(ApiResult<ParsedRequest> parsed) {
    EXPECT_TRUE(parsed.ok()) << parsed.error().message;
    Generation gen(*engine_, ctx_, std::move(*parsed), nullptr, Clock::now());
    EXPECT_TRUE(gen.start().ok());
    Stream stream(gen);
    std::string out;
    std::vector<ChoiceUpdate> updates;
    while (!gen.done()) {
      gen.wait(-1, 20);
      gen.recycle(&updates);
      gen.drain(&updates);
      stream.updates(updates, &out);
    }
    EXPECT_EQ(gen.choices()[0].reason, FinishReason::kError);
    return out;
  }

  std::unique_ptr<CpuOps> ops_;
  std::unique_ptr<Engine> engine_;
  ServingContext ctx_;
};

TEST_F(StreamErrorTest, AnAnthropicStreamEndsWithItsErrorEvent) {
  const std::string out = run<AnthropicStream>(parse_messages_request(
      J(R"({"model": "tiny", "max_tokens": 8, "stream": true, "temperature": 0,
            "ignore_eos": true, "messages": [{"role": "user", "content": "Hi"}]})"),
      ctx_));
  EXPECT_TRUE(out.starts_with("event: message_start\n")) << out;
  const size_t error = out.find("event: error\n");
  ASSERT_NE(error, std::string::npos) << out;
  EXPECT_NE(out.find("the device fell over", error), std::string::npos);
  // Nothing after the error: the stream ends there.
  EXPECT_EQ(out.find("event: ", error + 1), std::string::npos) << out.substr(error);
  EXPECT_EQ(out.find("message_delta"), std::string::npos);
  EXPECT_EQ(out.find("message_stop"), std::string::npos);
}

TEST_F(StreamErrorTest, AnOpenAiStreamSaysSoInAnErrorChunk) {
  const std::string out = run<OpenAiStream>(parse_chat_request(
      J(R"({"max_tokens": 8, "stream": true, "temperature": 0, "ignore_eos": true,
            "messages": [{"role": "user", "content": "Hi"}]})"),
      ctx_));
  EXPECT_NE(out.find(R"("type":"server_error")"), std::string::npos) << out;
  EXPECT_NE(out.find(R"("finish_reason":"error")"), std::string::npos) << out;
}

}  // namespace
}  // namespace recur::server
