// The engine as the Python binding drives it: requests submitted from Python, steps run on the
// caller's thread (with the GIL released by the binding), and every request's events collected
// in one list that Python takes after each step. Nothing here touches Python objects, so the
// engine's sinks never need the GIL.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "launch/engine_options.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace recur::py {

// The engine settings `recur serve` takes, mapped to the engine's configuration the same way
// (recur::engine_config); the binding turns the prefix cache off by default.
using SessionOptions = EngineOptions;

// One engine event, owned (the engine's views live only during the sink call).
struct PyEvent {
  uint64_t uid = 0;
  bool finish = false;
  int32_t token = -1;
  float logprob = 0;
  std::string text;
  std::string finish_reason;  // finish: "stop", "length", "cancelled", "error"
  std::string message;
  int prompt_tokens = 0;
  int generated_tokens = 0;
  // The whole vocabulary's log-probabilities, when asked for ([vocab]; empty otherwise). A row
  // from the session's spares, given back by give_back_rows once Python has its copy.
  std::vector<float> vocab_logprobs;
};

struct PySampling {
  std::optional<float> temperature, top_p, min_p;
  std::optional<int> top_k;
  std::optional<uint64_t> seed;
  int logprobs = -1;            // SamplingParams::logprobs
  bool vocab_logprobs = false;  // SamplingParams::vocab_logprobs
};

class Session {
 public:
  static Result<std::unique_ptr<Session>> open(const std::string& model_dir,
                                               const SessionOptions& options);
  ~Session();

  Result<uint64_t> submit(std::vector<int32_t> prompt, int max_tokens, const PySampling& sampling,
                          StopConditions stop);
  void cancel(uint64_t uid);
  // One engine step on this thread; false when nothing is queued or running.
  bool step();
  std::vector<PyEvent> take_events();
  // Takes the events' vocab_logprobs rows back for later events (each keeps its capacity, so
  // steady decoding allocates none).
  void give_back_rows(std::vector<PyEvent>& events);
  EngineStats stats() const { return engine_->stats(); }

  const ModelInfo& info() const { return engine_->model_info(); }
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  const ChatTemplate* chat_template() const { return template_ ? &*template_ : nullptr; }
  const std::string& template_error() const { return template_error_; }
  int max_context() const { return engine_->config().max_context; }

 private:
  Session() = default;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> template_;
  std::string template_error_;  // why there is no template, for apply_chat_template's error
  std::unique_ptr<Ops> ops_;
  std::unique_ptr<Engine> engine_;  // after ops_ and tokenizer_: destroyed before them
  std::mutex step_mu_;              // step() from two Python threads runs one at a time
  std::mutex events_mu_;
  std::vector<PyEvent> events_;
  std::vector<std::vector<float>> spare_rows_;  // under events_mu_
};

}  // namespace recur::py
