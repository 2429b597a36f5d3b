// The engine's emission of a step's results: sampling each sequence's next token from its
// logits (or the device's greedy picks), the stop rules, the events to each request's sink, and
// the vocabulary's log-probabilities for the requests that ask.
#include <algorithm>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "engine/engine.h"
#include "engine/pools.h"
#include "engine/sequence.h"

namespace recur {

void Engine::sample_and_emit() {
  const int V = model_->info().vocab_size;
  const int64_t n_rows = int64_t(logit_seqs_.size());
  const float* rows = logits_.ptr<float>();
  // A device backend returns the rows of logits, unless every row's choice is its argmax
  // (plain greedy): then the device picks, and only the ids come back. When pipelining, the
  // next step is queued before they are read.
  bool device_argmax = !host_logits_.empty() || pipeline_;
  for (const Sequence* s : logit_seqs_) {
    device_argmax = device_argmax && (!s || s->finished || s->sampler.plain_greedy());
  }
  if (device_argmax) {
    const Tensor ids = view(ids_buf_, DType::I32, {n_rows});
    ops_->argmax_rows(logits_.slice_rows(0, n_rows), ids);
    ops_->copy_to_host_start(ids, host_ids_.data());
    // Before the next step's forward, which writes the logits.
    fill_vocab_logprobs(host_logits_.empty() ? rows : nullptr);
    if (pipeline_) maybe_prelaunch();
    ops_->copy_to_host_finish();
  } else {
    if (!host_logits_.empty()) {
      ops_->copy_to_host(logits_.slice_rows(0, n_rows), host_logits_.data());
      rows = host_logits_.data();
    }
    fill_vocab_logprobs(rows);  // before the sampling adjusts the rows in place
  }
  const std::vector<int32_t>& eos = model_->info().eos_token_ids;
  int64_t sampled = 0;
  for (size_t r = 0; r < logit_seqs_.size(); ++r) {
    if (!logit_seqs_[r]) continue;
    Sequence& s = *logit_seqs_[r];
    if (s.finished) continue;
    const float* vocab_logprobs =
        s.req.sampling.vocab_logprobs ? vocab_logprobs_.data() + r * size_t(V) : nullptr;
    if (device_argmax) {
      s.sampled.id = host_ids_[r];
      s.sampled.logprob = vocab_logprobs ? vocab_logprobs[s.sampled.id] : 0;
      s.sampled.top.clear();
    } else {
      s.sampler.sample(const_cast<float*>(rows) + r * size_t(V), &s.sampled);
    }
    const int32_t tok = s.sampled.id;
    s.sampler.accept(tok);
    s.generated.push_back(tok);
    s.next_token = tok;
    ++sampled;
    text_buf_.clear();
    if (s.text && s.text->push(tok, &text_buf_)) s.stopped_by_string = true;
    Event ev;
    ev.request_id = s.id;
    ev.kind = Event::Kind::kToken;
    ev.token = tok;
    ev.logprob = s.sampled.logprob;
    ev.top_logprobs = s.sampled.top;
    ev.cached_tokens = s.cached_tokens;  // known from admission on: a stream's first event tells
    if (vocab_logprobs) ev.vocab_logprobs = std::span(vocab_logprobs, size_t(V));
    ev.text = text_buf_;
    s.sink(ev);
    ++events_this_step_;

    const StopConditions& stop = s.req.stop;
    auto contains = [](const std::vector<int32_t>& v, int32_t t) {
      return std::find(v.begin(), v.end(), t) != v.end();
    };
    bool stop_now = s.stopped_by_string || (!stop.ignore_eos && contains(eos, tok)) ||
                    contains(stop.stop_token_ids, tok);
    for (const auto& seqv : stop.stop_sequences) {
      stop_now = stop_now || (s.generated.size() >= seqv.size() &&
                              std::equal(seqv.rbegin(), seqv.rend(), s.generated.rbegin()));
    }
    if (stop_now) {
      finish(s, FinishReason::kStop, "");
    } else if (int(s.generated.size()) >= s.req.max_tokens) {
      finish(s, FinishReason::kLength, "max_tokens reached");
    } else if (s.n_past >= config_.max_context) {
      finish(s, FinishReason::kLength, "the context length is reached");
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  stats_.generated_tokens += sampled;
}

void Engine::fill_vocab_logprobs(const float* host_rows) {
  const int V = model_->info().vocab_size;
  const auto wants = [&](const Sequence* s) {
    return s && !s->finished && s->req.sampling.vocab_logprobs;
  };
  int64_t first = -1, last = -1;
  for (size_t r = 0; r < logit_seqs_.size(); ++r) {
    if (!wants(logit_seqs_[r])) continue;
    if (first < 0) first = int64_t(r);
    last = int64_t(r);
  }
  if (first < 0) return;
  if (!host_rows) {
    // One copy for the step: the rows from the first that asked to the last.
    ops_->copy_to_host(logits_.slice_rows(first, last + 1),
                       host_logits_.data() + size_t(first) * size_t(V));
    host_rows = host_logits_.data();
  }
  for (int64_t r = first; r <= last; ++r) {
    if (!wants(logit_seqs_[size_t(r)])) continue;
    log_softmax(host_rows + size_t(r) * size_t(V), V,
                vocab_logprobs_.data() + size_t(r) * size_t(V));
  }
}

void Engine::fail_in_flight(std::string_view what) {
  prelaunched_ = false;  // a queued step's results are not read
  next_seqs_.clear();
  // Every request in flight ends: the exception cannot be pinned on one of them (one queued
  // behind a step that always throws would otherwise never end).
  std::string message;  // left empty if even this cannot be allocated: a fixed one below
  try {
    message = fmt::format("the engine's step failed ({}); the request was ended", what);
  } catch (const std::bad_alloc&) {
  }
  for (auto* list : {&running_, &waiting_}) {
    // A step that threw while moving sequences between the lists may have left empty entries.
    std::erase_if(*list, [](const std::unique_ptr<Sequence>& s) { return !s; });
    for (auto& s : *list) {
      s->text.reset();  // what it holds back may be what failed to grow; not told again
      finish(*s, FinishReason::kError,
             message.empty() ? std::string_view("the engine's step failed") : message);
    }
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.failed_steps++;
  }
  release_finished();
  idle_cv_.notify_all();
  notify_step_listener();
}

void Engine::finish(Sequence& seq, FinishReason reason, std::string_view message) {
  if (seq.finished) return;
  seq.finished = true;
  seq.reason = reason;
  seq.message = message;
}

}  // namespace recur
