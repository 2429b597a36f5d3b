#include "session.h"

#include <filesystem>
#include <utility>

#include "backend/backend.h"

namespace recur::py {

Result<std::unique_ptr<Session>> Session::open(const std::string& model_dir,
                                               const SessionOptions& o) {
  if (!std::filesystem::is_directory(model_dir)) {
    return make_error(ErrorCode::kNotFound, "model directory {} does not exist", model_dir);
  }
  std::unique_ptr<Session> s(new Session());
  // The shipped seed models have no tokenizer: they run from token lists alone.
  if (Tokenizer::found_in(model_dir)) {
    RECUR_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::load(model_dir));
    s->tokenizer_ = std::make_unique<Tokenizer>(std::move(tok));
    auto tmpl = ChatTemplate::load(model_dir);
    if (tmpl.ok()) {
      s->template_ = std::move(*tmpl);
    } else {
      s->template_error_ = tmpl.error().message;
    }
  }
  RECUR_ASSIGN_OR_RETURN(s->ops_, create_backend(o));  // rank 0's under tensor_parallel
  EngineConfig config = engine_config(o);
  config.vocab_logprobs = true;  // mlx-lm's responses carry them
  RECUR_ASSIGN_OR_RETURN(s->engine_,
                         Engine::create(model_dir, *s->ops_, config, s->tokenizer_.get()));
  return s;
}

Session::~Session() = default;

Result<uint64_t> Session::submit(std::vector<int32_t> prompt, int max_tokens,
                                 const PySampling& sampling, StopConditions stop) {
  Request req;
  req.prompt = std::move(prompt);
  req.max_tokens = max_tokens;
  req.sampling = default_sampling(info().generation);
  if (sampling.temperature) req.sampling.temperature = *sampling.temperature;
  if (sampling.top_p) req.sampling.top_p = *sampling.top_p;
  if (sampling.min_p) req.sampling.min_p = *sampling.min_p;
  if (sampling.top_k) req.sampling.top_k = *sampling.top_k;
  if (sampling.seed) req.sampling.seed = *sampling.seed;
  req.sampling.logprobs = sampling.logprobs;
  req.sampling.vocab_logprobs = sampling.vocab_logprobs;  // GenerationResponse.logprobs
  req.stop = std::move(stop);
  // Text is decoded with special tokens, as mlx-lm's detokenizer gives them.
  req.skip_special_tokens = false;
  return engine_->submit(std::move(req), [this](const Event& ev) {
    PyEvent e;
    e.uid = ev.request_id;
    e.finish = ev.kind == Event::Kind::kFinish;
    e.token = ev.token;
    e.logprob = ev.logprob;
    e.text = ev.text;
    if (e.finish) {
      e.finish_reason = finish_reason_name(ev.reason);
      e.message = ev.message;
      e.prompt_tokens = ev.prompt_tokens;
      e.generated_tokens = ev.generated_tokens;
    }
    std::lock_guard<std::mutex> lk(events_mu_);
    if (!ev.vocab_logprobs.empty()) {
      if (!spare_rows_.empty()) {
        e.vocab_logprobs = std::move(spare_rows_.back());
        spare_rows_.pop_back();
      }
      e.vocab_logprobs.assign(ev.vocab_logprobs.begin(), ev.vocab_logprobs.end());
    }
    events_.push_back(std::move(e));
  });
}

void Session::cancel(uint64_t uid) {
  engine_->cancel(uid);
}

bool Session::step() {
  std::lock_guard<std::mutex> lk(step_mu_);
  return engine_->step();
}

std::vector<PyEvent> Session::take_events() {
  std::lock_guard<std::mutex> lk(events_mu_);
  return std::exchange(events_, {});
}

void Session::give_back_rows(std::vector<PyEvent>& events) {
  std::lock_guard<std::mutex> lk(events_mu_);
  for (PyEvent& e : events) {
    if (e.vocab_logprobs.capacity() > 0) spare_rows_.push_back(std::move(e.vocab_logprobs));
  }
}

}  // namespace recur::py
