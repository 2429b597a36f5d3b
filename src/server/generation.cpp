#include "server/generation.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <span>

namespace recur::server {

namespace {

const char* finish_label(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kError:
      return "error";
    case FinishReason::kCancelled:
      return "abort";
  }
  return "error";
}

// Adjacent text of one kind becomes one segment; tool calls stay separate.
void append_merged(std::vector<Segment>* to, Segment s) {
  if (s.kind != Segment::Kind::kToolCall && !to->empty() && to->back().kind == s.kind) {
    to->back().text += s.text;
  } else {
    to->push_back(std::move(s));
  }
}

}  // namespace

std::shared_ptr<EventQueue> EventQueue::create(bool wake_on_finish) {
  const int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) return nullptr;
  std::shared_ptr<EventQueue> q(new EventQueue());
  q->fd_ = fd;
  q->wake_on_finish_ = wake_on_finish;
  return q;
}

EventQueue::~EventQueue() {
  if (fd_ >= 0) close(fd_);
}

void EventQueue::push(QueuedEvent&& e) noexcept {
  const bool wake = wake_on_finish_ && e.kind == Event::Kind::kFinish;
  try {
    std::lock_guard<std::mutex> lk(mu_);
    items_.push_back(std::move(e));
    pending_.store(true, std::memory_order_release);
  } catch (...) {
    // Out of memory on the engine thread: the event is lost, the engine keeps running.
  }
  if (wake) eventfd_write(fd_, 1);
}

void EventQueue::take(std::vector<QueuedEvent>* out) {
  out->clear();
  std::lock_guard<std::mutex> lk(mu_);
  out->swap(items_);
  pending_.store(false, std::memory_order_release);
}

Generation::Generation(Engine& engine, const ServingContext& ctx, ParsedRequest request,
                       std::shared_ptr<Metrics> metrics, Clock::time_point arrival)
    : engine_(engine),
      ctx_(ctx),
      req_(std::move(request)),
      metrics_(std::move(metrics)),
      arrival_(arrival) {
  parse_ = req_.endpoint != Endpoint::kCompletions;
  const char* prefix = req_.endpoint == Endpoint::kChat          ? "chatcmpl-"
                       : req_.endpoint == Endpoint::kCompletions ? "cmpl-"
                       : req_.endpoint == Endpoint::kResponses   ? "resp_"
                                                                 : "msg_";
  id_ = random_id(prefix);
  created_ = int64_t(std::time(nullptr));
  choices_.resize(req_.prompts.size() * size_t(req_.n));
  for (size_t i = 0; i < choices_.size(); ++i) {
    choices_[i].prompt_index = int(i) / req_.n;
    if (parse_) {
      choices_[i].parser.emplace(req_.output,
                                 req_.endpoint == Endpoint::kMessages ? "toolu_" : "call_");
    }
  }
}

Generation::~Generation() {
  cancel();
}

void Generation::cancel(bool client_gone) {
  // Before the cancels are queued: their finish events may come at once.
  if (client_gone && queue_) queue_->client_gone = true;
  for (auto& c : choices_) {
    if (c.submitted && !c.finished) engine_.cancel(c.engine_id);
  }
}

ApiResult<bool> Generation::start() {
  queue_ = EventQueue::create(/*wake_on_finish=*/!req_.stream);
  if (!queue_) {
    ApiError e;
    e.status = 503;
    e.type = "server_error";
    e.message = "the server is out of file descriptors";
    return e;
  }
  const bool want_top = req_.engine.sampling.logprobs > 0;
  for (size_t i = 0; i < choices_.size(); ++i) {
    ChoiceState& c = choices_[i];
    const std::vector<int32_t>& prompt = req_.prompts[size_t(c.prompt_index)];
    Request r = req_.engine;
    r.prompt = prompt;
    if (!req_.max_tokens_given) r.max_tokens = ctx_.max_context - int(prompt.size());
    // n choices from one seed must still differ.
    if (r.sampling.seed && req_.n > 1) *r.sampling.seed += uint64_t(i % size_t(req_.n));
    auto q = queue_;
    const int index = int(i);
    std::shared_ptr<Metrics> metrics = metrics_;
    auto id = engine_.submit(std::move(r), [q, index, want_top, metrics](const Event& ev) {
      QueuedEvent e;
      e.choice = index;
      e.kind = ev.kind;
      e.time = Clock::now();
      try {
        e.text.assign(ev.text);
        e.cached_tokens = ev.cached_tokens;
        if (ev.kind == Event::Kind::kToken) {
          e.token.id = ev.token;
          e.token.logprob = ev.logprob;
          if (want_top) e.token.top.assign(ev.top_logprobs.begin(), ev.top_logprobs.end());
        } else {
          e.reason = ev.reason;
          e.message.assign(ev.message);
          e.generated_tokens = ev.generated_tokens;
          // Counted here, not by the HTTP thread, which is gone when its client went away.
          if (metrics) {
            metrics->request_finished(finish_label(ev.reason));
            if (ev.cancel_steps >= 0 && q->client_gone.load()) {
              metrics->cancel_steps.observe(double(ev.cancel_steps));
            }
          }
        }
      } catch (...) {
      }
      q->push(std::move(e));
    });
    if (!id.ok()) {
      cancel();
      return from_error(id.error(), req_.endpoint == Endpoint::kCompletions ? "prompt" : "");
    }
    c.engine_id = *id;
    c.submitted = true;
    // Counted once its first sequence is in, so that every sequence the engine finishes
    // belongs to a counted request.
    if (i == 0 && metrics_) {
      metrics_->request_started(req_.endpoint == Endpoint::kChat          ? "chat"
                                : req_.endpoint == Endpoint::kCompletions ? "completions"
                                : req_.endpoint == Endpoint::kResponses   ? "responses"
                                                                          : "messages");
    }
  }
  return true;
}

Generation::Wait Generation::wait(int client_fd, int timeout_ms) {
  pollfd fds[2] = {{queue_->fd(), POLLIN, 0}, {client_fd, POLLRDHUP, 0}};
  const int n = poll(fds, client_fd >= 0 ? 2 : 1, timeout_ms);
  if (n <= 0) return Wait::kTimeout;
  if (client_fd >= 0 && (fds[1].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) {
    return Wait::kClientGone;
  }
  if (fds[0].revents & POLLIN) {
    eventfd_t v;
    eventfd_read(queue_->fd(), &v);
    return Wait::kReady;
  }
  return Wait::kTimeout;
}

bool Generation::stops_on(int32_t id) const {
  const auto& ids = req_.engine.stop.stop_token_ids;
  const auto& eos = ctx_.eos_token_ids;
  return std::find(ids.begin(), ids.end(), id) != ids.end() ||
         (!req_.engine.stop.ignore_eos && std::find(eos.begin(), eos.end(), id) != eos.end());
}

void Generation::drop_stop_text(ChoiceState& c, std::string* text) {
  // As vLLM, the output is the text of the tokens before the stop token: what the engine still
  // held back of them (a possible stop string's start, an unfinished character) goes out now,
  // and the engine's finish text (the rest of the stop token's) is not used.
  c.stop_text_dropped = true;
  text->clear();
  if (!ctx_.tokenizer) return;
  const std::string before = ctx_.tokenizer->decode(
      std::span<const int32_t>(c.ids).first(c.ids.size() - 1), req_.engine.skip_special_tokens);
  if (before.size() > c.text.size()) text->assign(before, c.text.size());
}

void Generation::settle_stop(ChoiceState& c, QueuedEvent& e) {
  if (c.stop_text_dropped) e.text.clear();
  if (e.reason != FinishReason::kStop || c.ids.empty()) return;
  const auto& stops = req_.engine.stop.stop_strings;
  if (!c.stop_text_dropped && !stops.empty() && ctx_.tokenizer) {
    // The engine cuts the text where a stop string begins: then less is released than the
    // tokens decode to, and what follows starts with that stop string. It wins over a stop
    // token whose text it is in, as in vLLM.
    const std::string all = ctx_.tokenizer->decode(c.ids, req_.engine.skip_special_tokens);
    const size_t released = c.text.size() + e.text.size();
    for (const std::string& s : stops) {
      if (released < all.size() && !s.empty() && all.compare(released, s.size(), s) == 0) {
        c.stop_string = s;
        break;
      }
    }
  }
  const int32_t last = c.ids.back();
  const auto& ids = req_.engine.stop.stop_token_ids;
  if (c.stop_string.empty() && std::find(ids.begin(), ids.end(), last) != ids.end()) {
    c.stop_token = last;
  }
  if (req_.keep_stop_string) e.text += c.stop_string;
}

void Generation::on_finish(ChoiceState& c, QueuedEvent& e) {
  c.finished = true;
  ++finished_;
  c.reason = e.reason;
  c.message = std::move(e.message);
  c.generated = std::max(c.generated, e.generated_tokens);
  c.cached = e.cached_tokens;
  if (!metrics_) return;
  if (c.generated > 0) {
    metrics_->e2e.observe(std::chrono::duration<double>(c.last_token - arrival_).count());
  }
  if (c.generated > 1) {
    metrics_->tpot.observe(std::chrono::duration<double>(c.last_token - c.first_token).count() /
                           double(c.generated - 1));
  }
}

void Generation::drain(std::vector<ChoiceUpdate>* updates) {
  queue_->take(&events_);
  const bool keep_tokens = req_.engine.sampling.logprobs >= 0 || req_.return_token_ids;
  for (QueuedEvent& e : events_) {
    if (e.choice < 0 || e.choice >= int(choices_.size())) continue;
    ChoiceState& c = choices_[size_t(e.choice)];
    if (c.finished) continue;
    auto it = std::find_if(updates->begin(), updates->end(),
                           [&](const ChoiceUpdate& u) { return u.index == e.choice; });
    if (it == updates->end()) {
      if (spare_updates_.empty()) {
        updates->emplace_back();
      } else {
        updates->push_back(std::move(spare_updates_.back()));
        spare_updates_.pop_back();
      }
      it = updates->end() - 1;
      it->index = e.choice;
    }
    ChoiceUpdate& u = *it;
    if (e.kind == Event::Kind::kToken) {
      if (c.generated == 0) {
        c.first_token = e.time;
        if (metrics_)
          metrics_->ttft.observe(std::chrono::duration<double>(e.time - arrival_).count());
      }
      c.last_token = e.time;
      ++c.generated;
      c.ids.push_back(e.token.id);
      c.cached = std::max(c.cached, e.cached_tokens);
      if (!req_.keep_stop_token_text && stops_on(e.token.id)) drop_stop_text(c, &e.text);
      if (keep_tokens) {
        if (!req_.stream) c.tokens.push_back(e.token);
        u.tokens.push_back(std::move(e.token));
      }
    }
    if (e.kind == Event::Kind::kFinish) settle_stop(c, e);
    fresh_.clear();
    if (!e.text.empty()) {
      c.text += e.text;
      u.text += e.text;
      if (c.parser) c.parser->push(e.text, &fresh_);
    }
    if (e.kind == Event::Kind::kFinish) {
      if (c.parser) c.parser->finish(&fresh_);
      u.finished = true;
      on_finish(c, e);
    }
    for (Segment& s : fresh_) {
      if (!req_.stream) append_merged(&c.segments, s);
      append_merged(&u.segments, std::move(s));
    }
  }
}

void Generation::recycle(std::vector<ChoiceUpdate>* updates) {
  for (ChoiceUpdate& u : *updates) {
    u.text.clear();
    u.segments.clear();
    u.tokens.clear();
    u.finished = false;
    spare_updates_.push_back(std::move(u));
  }
  updates->clear();
}

int Generation::prompt_tokens() const {
  int n = 0;
  for (const auto& p : req_.prompts) n += int(p.size());
  return n;
}

int Generation::cached_tokens() const {
  int n = 0;
  for (size_t p = 0; p < req_.prompts.size(); ++p) {
    int most = 0;
    for (const auto& c : choices_) {
      if (c.prompt_index == int(p)) most = std::max(most, c.cached);
    }
    n += most;
  }
  return n;
}

int Generation::completion_tokens() const {
  int n = 0;
  for (const auto& c : choices_) n += c.generated;
  return n;
}

std::string Generation::openai_finish_reason(int choice) const {
  const ChoiceState& c = choices_[size_t(choice)];
  switch (c.reason) {
    case FinishReason::kStop:
      return c.parser && c.parser->tool_calls() > 0 ? "tool_calls" : "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kError:
      return "error";
    case FinishReason::kCancelled:
      return "abort";
  }
  return "stop";
}

}  // namespace recur::server
