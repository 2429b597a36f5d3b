#include "server/stream_writer.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <optional>
#include <system_error>

#include "server/format.h"

namespace recur::server {

namespace {

using WriterClock = std::chrono::steady_clock;

// A client that leaves this much unsent is dropped as one that stopped reading.
constexpr size_t kMaxPending = size_t(16) << 20;

// One HTTP/1.1 chunk: size in hex, CRLF, data, CRLF.
void append_chunk(std::string* out, std::string_view data) {
  static constexpr char kHex[] = "0123456789abcdef";
  char head[20];
  int n = 0;
  size_t v = data.size();
  do {
    head[n++] = kHex[v & 15];
    v >>= 4;
  } while (v);
  std::reverse(head, head + n);
  out->append(head, size_t(n));
  out->append("\r\n");
  out->append(data);
  out->append("\r\n");
}

}  // namespace

struct StreamWriter::Stream {
  std::shared_ptr<Generation> gen;
  std::shared_ptr<SseStream> handle;
  int fd = -1;          // -1: relayed through the HTTP thread
  bool chunked = true;  // HTTP chunk framing on fd (HTTP/1.0: none, the close ends the body)
  bool anthropic = false;
  std::optional<OpenAiStream> openai;
  std::optional<AnthropicStream> claude;
  std::optional<ResponsesStream> responses;
  std::vector<ChoiceUpdate> updates;
  std::string text;  // SSE text of this pass
  std::string out;   // framed bytes not yet sent; out[0, sent) are sent
  size_t sent = 0;
  bool registered = false;    // in the epoll set
  bool watching_out = false;  // EPOLLOUT requested
  bool closing = false;       // the generation is done; the stream's last text is queued
  bool ended = false;
  WriterClock::time_point progress;  // last time bytes went out (or the stream began)
};

SseStream::Next SseStream::next(std::string* data) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return ended_ || !relay_.empty(); });
  if (!relay_.empty()) {
    data->clear();
    data->swap(relay_);
    return Next::kData;
  }
  return complete_ ? Next::kDone : Next::kGone;
}

void SseStream::client_gone() {
  relay_failed_ = true;
}

Result<std::unique_ptr<StreamWriter>> StreamWriter::create(std::shared_ptr<Metrics> metrics,
                                                           std::chrono::milliseconds stall_limit) {
  std::unique_ptr<StreamWriter> w(new StreamWriter());
  w->metrics_ = std::move(metrics);
  assert(stall_limit.count() > 0);  // else every stream with bytes waiting would be dropped
  w->stall_limit_ = stall_limit;
  w->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  w->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (w->epoll_fd_ < 0 || w->wake_fd_ < 0) {
    return make_error(ErrorCode::kIo, "cannot create the stream writer's epoll or eventfd");
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // the wake-up descriptor
  if (epoll_ctl(w->epoll_fd_, EPOLL_CTL_ADD, w->wake_fd_, &ev) != 0) {
    return make_error(ErrorCode::kIo, "cannot watch the stream writer's eventfd");
  }
  try {
    w->thread_ = std::thread([p = w.get()] { p->run(); });
  } catch (const std::system_error& e) {
    return make_error(ErrorCode::kOutOfResources, "cannot start the stream writer's thread: {}",
                      e.what());
  }
  return w;
}

StreamWriter::~StreamWriter() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    eventfd_write(wake_fd_, 1);
    thread_.join();
  }
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void StreamWriter::step_done() noexcept {
  if (open_streams_.load(std::memory_order_acquire) == 0) return;
  if (wake_pending_.exchange(true, std::memory_order_acq_rel)) return;
  eventfd_write(wake_fd_, 1);
}

std::shared_ptr<SseStream> StreamWriter::add(std::shared_ptr<Generation> gen, int fd,
                                             bool chunked) {
  auto s = std::make_shared<Stream>();
  s->handle = std::make_shared<SseStream>();
  const Endpoint endpoint = gen->request().endpoint;
  s->anthropic = endpoint == Endpoint::kMessages;
  if (s->anthropic) {
    s->claude.emplace(*gen);
  } else if (endpoint == Endpoint::kResponses) {
    s->responses.emplace(*gen);
  } else {
    s->openai.emplace(*gen);
  }
  s->gen = std::move(gen);
  s->fd = fd;
  s->chunked = chunked;
  s->progress = WriterClock::now();
  std::shared_ptr<SseStream> handle = s->handle;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      s->handle->ended_ = true;
      return handle;
    }
    incoming_.push_back(std::move(s));
    open_streams_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_pending_ = true;
  eventfd_write(wake_fd_, 1);
  return handle;
}

void StreamWriter::watch(Stream& s, bool want_out) {
  if (s.fd < 0) return;
  epoll_event ev{};
  ev.events = EPOLLRDHUP | (want_out ? EPOLLOUT : 0u);
  ev.data.ptr = &s;
  // Should the socket not be watchable, a hang-up still shows as a failed send.
  if (epoll_ctl(epoll_fd_, s.registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, s.fd, &ev) == 0) {
    s.registered = true;
    s.watching_out = want_out;
  }
}

void StreamWriter::end(Stream& s, bool complete) {
  if (s.ended) return;
  s.ended = true;
  // Off the epoll set before the HTTP thread hears of it: the descriptor is its again (and may
  // carry the connection's next request, or be closed and reused).
  if (s.registered) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, s.fd, nullptr);
  open_streams_.fetch_sub(1, std::memory_order_acq_rel);
  {
    std::lock_guard<std::mutex> lk(s.handle->mu_);
    s.handle->ended_ = true;
    s.handle->complete_ = complete;
  }
  s.handle->cv_.notify_one();
}

void StreamWriter::stalled(Stream& s) {
  if (s.ended) return;
  if (metrics_) metrics_->connection_closed("write_timeout");
  drop(s);
}

void StreamWriter::gone(Stream& s) {
  if (s.ended) return;
  if (metrics_) metrics_->client_disconnected();
  drop(s);
}

void StreamWriter::drop(Stream& s) {
  end(s, false);
  try {
    s.gen->cancel(true);
  } catch (...) {  // out of memory: the Generation's destructor cancels again
  }
}

void StreamWriter::flush(Stream& s) {
  if (s.ended) return;
  if (s.fd < 0) {  // relayed: hand the bytes over
    if (s.handle->relay_failed_.load()) return gone(s);
    if (s.sent < s.out.size()) {
      {
        std::lock_guard<std::mutex> lk(s.handle->mu_);
        s.handle->relay_.append(s.out, s.sent);
      }
      s.handle->cv_.notify_one();
    }
    s.out.clear();
    s.sent = 0;
    if (s.closing) end(s, true);
    return;
  }
  while (s.sent < s.out.size()) {
    const ssize_t n =
        send(s.fd, s.out.data() + s.sent, s.out.size() - s.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      s.sent += size_t(n);
      s.progress = WriterClock::now();
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    return gone(s);  // reset, broken pipe: the client is gone
  }
  if (s.sent == s.out.size()) {
    s.out.clear();
    s.sent = 0;
    if (s.watching_out) watch(s, false);
    if (s.closing) end(s, true);
    return;
  }
  // The client reads slower than we write: wait for room, and give up on one that stalls.
  if (s.out.size() - s.sent > kMaxPending || WriterClock::now() - s.progress > stall_limit_) {
    return stalled(s);
  }
  if (s.sent > (size_t(1) << 20)) {
    s.out.erase(0, s.sent);
    s.sent = 0;
  }
  if (!s.watching_out) watch(s, true);
}

// Queues SSE text: framed as an HTTP chunk when the writer owns the socket; relayed bytes
// are framed by the HTTP thread (HttpExchange::write_chunk).
void StreamWriter::frame(Stream& s, std::string_view text) {
  if (s.fd >= 0 && s.chunked) {
    append_chunk(&s.out, text);
  } else {
    s.out.append(text);
  }
}

void StreamWriter::pass(Stream& s) {
  if (s.ended || s.closing) return;
  if (s.fd < 0 && s.handle->relay_failed_.load()) return gone(s);
  if (!s.gen->has_events()) return;
  s.gen->recycle(&s.updates);
  s.gen->drain(&s.updates);
  s.text.clear();
  if (s.claude) {
    s.claude->updates(s.updates, &s.text);
  } else if (s.responses) {
    s.responses->updates(s.updates, &s.text);
  } else {
    s.openai->updates(s.updates, &s.text);
  }
  if (s.gen->done()) {
    if (s.openai) s.openai->done(&s.text);
    s.closing = true;
  }
  if (!s.text.empty()) frame(s, s.text);
  flush(s);
}

void StreamWriter::run() {
  pthread_setname_np(pthread_self(), "recur-sse");  // shows in top -H and /proc
  epoll_event events[64];
  for (;;) {
    const int n = epoll_wait(epoll_fd_, events, 64, 1000);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.ptr == nullptr) {
        eventfd_t v;
        eventfd_read(wake_fd_, &v);
        continue;
      }
      Stream& s = *static_cast<Stream*>(events[i].data.ptr);
      if (events[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        gone(s);
      } else if (events[i].events & EPOLLOUT) {
        flush(s);
      }
    }
    bool stop;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop = stop_;
      for (auto& s : incoming_) {
        try {
          // Responses streams open with an event before any token (Anthropic's message_start
          // waits for the first events, whose cache reads its usage tells).
          if (s->responses) frame(*s, s->responses->start());
          active_.push_back(s);
        } catch (...) {  // out of memory: this stream fails, its HTTP thread hears of it
          gone(*s);
          continue;
        }
        watch(*s, false);
      }
      incoming_.clear();
    }
    // Cleared before the pass: events of a step that ends during the pass wake us again.
    wake_pending_.store(false, std::memory_order_release);
    for (auto& s : active_) {
      try {
        pass(*s);
        if (!s->ended && s->sent < s->out.size()) flush(*s);  // stalled-client check
      } catch (...) {  // out of memory while formatting: this stream fails, the rest go on
        gone(*s);
      }
      if (stop) gone(*s);
    }
    std::erase_if(active_, [](const std::shared_ptr<Stream>& s) { return s->ended; });
    if (stop) return;
  }
}

}  // namespace recur::server
