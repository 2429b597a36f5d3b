// The HTTP server's private state, shared by its event loop (http_server.cpp) and its workers
// (http_worker.cpp): one connection's state, and the server's.
#pragma once

#include <sys/eventfd.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "server/http_server.h"

namespace recur::server {

using Clock = std::chrono::steady_clock;

enum class Phase {
  kIdle,     // waiting for the first byte of a request (fresh or kept alive)
  kHead,     // reading a request head
  kBody,     // reading a request body
  kWorker,   // a worker owns it
  kWriting,  // the loop is writing a response of its own
  kLinger,   // response written and output shut; dropping input until the peer closes
};

struct Conn {
  int fd = -1;
  size_t slot = 0;  // index in Impl::conns
  Phase phase = Phase::kIdle;
  std::string in;    // bytes read; in[0, in_at) consumed, erased once per pass, not per request
  size_t in_at = 0;  // (per request, pipelined requests would cost quadratic time)
  std::string_view unread() const { return std::string_view(in).substr(in_at); }
  size_t head_scanned = 0;
  bool head_parsed = false;
  http::Request req;
  http::ChunkedDecoder chunked;
  uint64_t body_left = 0;  // Content-Length bodies
  size_t budget = 0;       // bytes of the body budget held for this request
  std::string out;         // the loop's own response, out[out_sent..) not yet sent
  size_t out_sent = 0;
  bool close_after = false;  // after out is sent: a lingering close
  bool keep = false;         // set by the worker: reuse after its response
  int requests = 0;          // answered on this connection
  Clock::time_point deadline;
  std::list<Conn*>* lru = nullptr;  // linger_lru, idle_lru, head_lru or refused_lru while in one
  std::list<Conn*>::iterator lru_it;
  uint32_t events = 0;  // registered epoll events, 0: not registered
  bool dead = false;
  bool refused = false;  // answered 503 at accept (over --max-connections), lingering
};

enum class SendResult { kAll, kWouldBlock, kFailed };

// Sends out[sent..) without blocking, as far as the socket takes it, advancing `sent`.
inline SendResult send_some(int fd, std::string_view out, size_t& sent) {
  while (sent < out.size()) {
    const ssize_t n = ::send(fd, out.data() + sent, out.size() - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      sent += size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return SendResult::kWouldBlock;
    return SendResult::kFailed;  // reset or broken pipe
  }
  return SendResult::kAll;
}

struct HttpServer::Impl {
  HttpServerOptions opt;
  HttpHandler& handler;
  std::shared_ptr<Metrics> metrics;
  int listen_fd = -1, epoll_fd = -1, wake_fd = -1;
  std::atomic<bool> draining{false}, stopping{false};
  std::atomic<size_t> budget_used{0};

  // Loop thread only.
  std::vector<std::unique_ptr<Conn>> conns;
  std::vector<std::unique_ptr<Conn>> graveyard;     // closed during this loop pass
  std::list<Conn*> linger_lru, idle_lru, head_lru;  // oldest first
  // Connections refused at capacity linger too, so that their request bytes are drained before
  // the close (a close with unread input resets the connection, and the reset can destroy the
  // 503 before the client reads it). A few at a time, outside the connection limit; past that
  // a refusal closes at once.
  static constexpr int kRefusedLingerMax = 32;
  std::list<Conn*> refused_lru;
  int refused_lingering = 0;
  bool listening_paused = false;
  Clock::time_point resume_accept;
  bool drained_idle = false;

  // Workers.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Conn*> jobs;       // guarded by mu
  std::vector<Conn*> returned;  // guarded by mu
  bool workers_exit = false;    // guarded by mu
  std::vector<std::thread> workers;
  int with_workers = 0;  // loop thread: connections a worker holds or will

  char tag_listen = 0, tag_wake = 0;

  Impl(HttpServerOptions o, HttpHandler& h, std::shared_ptr<Metrics> m)
      : opt(std::move(o)), handler(h), metrics(std::move(m)) {}

  void wake() { eventfd_write(wake_fd, 1); }
  void watch(Conn& c, uint32_t events);
  void lru_remove(Conn& c);
  void lru_add(Conn& c, std::list<Conn*>& list);
  void close_conn(Conn& c, const char* reason = nullptr);
  void accept_all();
  Conn& add_conn(int fd);  // a new connection's record, not yet watched
  void refuse(int fd);     // 503 to a connection over the limit, lingering if there is room
  bool evict_one();
  void on_event(Conn& c, uint32_t events);
  void read_input(Conn& c);
  void process(Conn& c);
  void process_unread(Conn& c);
  void start_request(Conn& c);
  bool read_body(Conn& c);
  void dispatch(Conn& c);
  void respond(Conn& c, http::Response res, bool keep_alive);
  void fail(Conn& c, int status, std::string message);
  void flush_out(Conn& c);
  void to_idle(Conn& c);
  void resume(Conn& c);
  void check_deadlines(Clock::time_point now);
  void release_budget(Conn& c);
  void worker_main();
};

}  // namespace recur::server
