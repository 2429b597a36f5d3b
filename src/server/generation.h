// One API request in flight: its sequences (prompts x n) submitted to the engine, the queue
// the engine's sinks push into, and per-choice output state. A non-streaming request's HTTP
// thread waits on the queue and the client socket at once, so a disconnect cancels
// immediately; a streaming one is handed to the StreamWriter, which drains it once per step.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/metrics.h"
#include "server/output_parser.h"
#include "server/request.h"

namespace recur::server {

using Clock = std::chrono::steady_clock;

struct TokenInfo {
  int32_t id = -1;
  float logprob = 0;
  std::vector<TokenLogprob> top;
};

// What the engine thread hands over; copied out of the Event, whose views die with the call.
struct QueuedEvent {
  int choice = 0;
  Event::Kind kind = Event::Kind::kToken;
  TokenInfo token;
  std::string text;
  FinishReason reason = FinishReason::kStop;
  std::string message;
  int generated_tokens = 0;
  int cached_tokens = 0;  // prompt tokens the engine's prefix cache gave (when it says)
  Clock::time_point time;
};

// A mutex-guarded list plus an eventfd, so a reader can poll it together with a socket.
// Tokens never touch the eventfd: a streaming reader (the StreamWriter) is woken once per
// engine step instead, and a non-streaming one only needs to hear of finishes.
class EventQueue {
 public:
  // nullptr when no eventfd can be made. wake_on_finish: finish events signal the eventfd.
  static std::shared_ptr<EventQueue> create(bool wake_on_finish);
  ~EventQueue();
  void push(QueuedEvent&& e) noexcept;
  void take(std::vector<QueuedEvent>* out);
  bool pending() const { return pending_.load(std::memory_order_acquire); }
  int fd() const { return fd_; }

  // The client went away: its sequences' finish events record how many engine steps their
  // cancellation took (Event::cancel_steps).
  std::atomic<bool> client_gone{false};

 private:
  EventQueue() = default;
  std::mutex mu_;
  std::vector<QueuedEvent> items_;
  std::atomic<bool> pending_{false};  // items_ is not empty
  bool wake_on_finish_ = false;
  int fd_ = -1;
};

// New output of one choice since the last drain.
struct ChoiceUpdate {
  int index = 0;
  std::string text;               // raw text (completions)
  std::vector<Segment> segments;  // reasoning / content / tool calls (chat, messages)
  std::vector<TokenInfo> tokens;  // when logprobs or token ids were asked for
  bool finished = false;
};

struct ChoiceState {
  int prompt_index = 0;
  uint64_t engine_id = 0;
  bool submitted = false;
  std::optional<OutputParser> parser;
  std::string text;               // all released text
  std::vector<Segment> segments;  // merged, for non-streaming responses
  std::vector<int32_t> ids;
  std::vector<TokenInfo> tokens;  // for non-streaming logprobs
  bool finished = false;
  FinishReason reason = FinishReason::kStop;
  std::string message;
  std::string stop_string;            // the stop string that ended it, if one did
  std::optional<int32_t> stop_token;  // a stop_token_ids entry that ended it
  bool stop_text_dropped = false;     // the stop token's text is left out; the rest released
  int generated = 0;
  int cached = 0;  // prompt tokens read from the prefix cache (once an event has said)
  Clock::time_point first_token, last_token;
};

class Generation {
 public:
  Generation(Engine& engine, const ServingContext& ctx, ParsedRequest request,
             std::shared_ptr<Metrics> metrics, Clock::time_point arrival);
  ~Generation();  // cancels whatever has not finished
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // Submits every sequence; on a refusal the ones already submitted are cancelled.
  ApiResult<bool> start();

  enum class Wait { kReady, kTimeout, kClientGone };
  // Non-streaming requests: waits for a choice to finish, or for the client socket (-1: none)
  // to close. (Streaming ones are driven by the StreamWriter, once per engine step.)
  Wait wait(int client_fd, int timeout_ms);
  // Events are queued that drain() has not processed.
  bool has_events() const { return queue_ && queue_->pending(); }
  // Processes queued events; appends one update per choice that has news.
  void drain(std::vector<ChoiceUpdate>* updates);
  // Empties *updates, keeping its updates' buffers for the next drain (a stream drains once
  // per engine step: this keeps that from allocating each time).
  void recycle(std::vector<ChoiceUpdate>* updates);
  bool done() const { return finished_ == int(choices_.size()); }
  // Cancels what is still running; client_gone also records it for the latency metric.
  void cancel(bool client_gone = false);

  const ParsedRequest& request() const { return req_; }
  const ServingContext& context() const { return ctx_; }
  const std::vector<ChoiceState>& choices() const { return choices_; }
  int prompt_tokens() const;
  int completion_tokens() const;
  // Prompt tokens the prefix cache gave: per prompt, the most any of its choices found.
  int cached_tokens() const;
  const std::string& id() const { return id_; }
  int64_t created() const { return created_; }
  // "stop" | "length" | "tool_calls" | "abort" | "error".
  std::string openai_finish_reason(int choice) const;

 private:
  void on_finish(ChoiceState& c, QueuedEvent& e);
  // Whether token `id` ends generation (EOS unless ignored, a stop_token_ids entry).
  bool stops_on(int32_t id) const;
  // The stop token just came: *text becomes the text still to release without its own.
  void drop_stop_text(ChoiceState& c, std::string* text);
  // At the finish, before its text is released: which stop string or token ended the choice,
  // and the finish event's text as the client gets it (with the stop string when kept).
  void settle_stop(ChoiceState& c, QueuedEvent& e);

  Engine& engine_;
  const ServingContext& ctx_;
  ParsedRequest req_;
  std::shared_ptr<Metrics> metrics_;
  Clock::time_point arrival_;
  std::shared_ptr<EventQueue> queue_;
  std::vector<ChoiceState> choices_;
  std::vector<QueuedEvent> events_;
  std::vector<ChoiceUpdate> spare_updates_;  // emptied updates whose buffers drain() reuses
  std::vector<Segment> fresh_;               // one event's parsed segments
  int finished_ = 0;
  bool parse_ = false;
  std::string id_;
  int64_t created_ = 0;
};

}  // namespace recur::server
