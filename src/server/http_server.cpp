#include "server/http_server.h"
#include "server/http_server_impl.h"

#include <fmt/format.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace recur::server {

// ---- the loop's side ----

void HttpServer::Impl::watch(Conn& c, uint32_t events) {
  if (events == c.events) return;
  epoll_event ev{};
  ev.events = events;
  ev.data.ptr = &c;
  const int op = events == 0 ? EPOLL_CTL_DEL : c.events == 0 ? EPOLL_CTL_ADD : EPOLL_CTL_MOD;
  epoll_ctl(epoll_fd, op, c.fd, &ev);
  c.events = events;
}

void HttpServer::Impl::lru_remove(Conn& c) {
  if (!c.lru) return;
  c.lru->erase(c.lru_it);
  c.lru = nullptr;
}

void HttpServer::Impl::lru_add(Conn& c, std::list<Conn*>& list) {
  lru_remove(c);
  list.push_back(&c);
  c.lru_it = std::prev(list.end());
  c.lru = &list;
}

void HttpServer::Impl::release_budget(Conn& c) {
  if (c.budget) budget_used.fetch_sub(c.budget);
  c.budget = 0;
}

void HttpServer::Impl::close_conn(Conn& c, const char* reason) {
  if (c.dead) return;
  c.dead = true;
  lru_remove(c);
  watch(c, 0);
  ::close(c.fd);
  release_budget(c);
  if (c.refused) {
    --refused_lingering;
  } else if (metrics) {
    metrics->http_connections(-1);
    if (reason) metrics->connection_closed(reason);
  }
  const size_t slot = c.slot;
  graveyard.push_back(std::move(conns[slot]));  // freed after this loop pass
  if (slot + 1 != conns.size()) {
    conns[slot] = std::move(conns.back());
    conns[slot]->slot = slot;
  }
  conns.pop_back();
}

bool HttpServer::Impl::evict_one() {
  // Answered and only lingering first, then idle, then still sending a head.
  std::list<Conn*>& from = !linger_lru.empty() ? linger_lru
                           : !idle_lru.empty() ? idle_lru
                                               : head_lru;
  if (from.empty()) return false;
  close_conn(*from.front(), "evicted");
  return true;
}

void HttpServer::Impl::accept_all() {
  for (int k = 0; k < 64; ++k) {
    const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        if (evict_one()) continue;
        // Out of descriptors with nothing to displace: stop accepting for a moment (the
        // listener would otherwise wake the loop at once, again and again).
        epoll_event ev{};
        ev.data.ptr = &tag_listen;
        epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
        listening_paused = true;
        resume_accept = Clock::now() + std::chrono::milliseconds(100);
      }
      return;
    }
    if (int(conns.size()) - refused_lingering >= opt.max_connections && !evict_one()) {
      refuse(fd);
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Conn& ref = add_conn(fd);
    lru_add(ref, idle_lru);
    watch(ref, EPOLLIN | EPOLLRDHUP);
    if (metrics) metrics->http_connections(1);
  }
}

Conn& HttpServer::Impl::add_conn(int fd) {
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  c->slot = conns.size();
  c->deadline = Clock::now() + opt.idle_timeout;
  Conn& ref = *c;
  conns.push_back(std::move(c));
  return ref;
}

void HttpServer::Impl::refuse(int fd) {
  http::Response res = handler.error_response(
      nullptr, 503,
      fmt::format("all {} connections this server allows are busy with requests; retry later",
                  opt.max_connections));
  res.set_header("Retry-After", "1");
  if (metrics) metrics->connection_closed("refused");
  if (refused_lingering >= kRefusedLingerMax) {
    handler.finish(nullptr, res);
    const std::string out = http::serialize_head(res, false, res.body.size()) + res.body;
    [[maybe_unused]] ssize_t n = ::send(fd, out.data(), out.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    ::close(fd);
    return;
  }
  Conn& c = add_conn(fd);
  c.refused = true;
  ++refused_lingering;
  respond(c, std::move(res), false);
}

void HttpServer::Impl::on_event(Conn& c, uint32_t events) {
  if (c.dead || c.phase == Phase::kWorker) return;
  if (c.phase == Phase::kWriting) {
    flush_out(c);
    if (!c.dead && c.phase == Phase::kIdle) process(c);
    return;
  }
  if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) read_input(c);
}

void HttpServer::Impl::read_input(Conn& c) {
  char buf[65536];
  // A bounded amount per wake-up: one fast sender must not hold the loop. Body bytes are read
  // on, but once a read has completed a request the rest waits for the next pass, so that a
  // client pipelining many small requests takes its turn with the others.
  const int answered = c.requests;
  for (int k = 0; k < 16; ++k) {
    if (c.dead) return;
    if (c.phase != Phase::kIdle && c.phase != Phase::kHead && c.phase != Phase::kBody &&
        c.phase != Phase::kLinger) {
      return;
    }
    const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n == 0) return close_conn(c);  // the peer is gone (a request it had not finished, too)
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      return close_conn(c);
    }
    if (c.phase == Phase::kLinger) continue;  // dropped
    c.in.append(buf, size_t(n));
    process(c);
    if (c.requests != answered) return;
  }
}

void HttpServer::Impl::process(Conn& c) {
  process_unread(c);
  if (!c.dead && c.in_at) {
    c.in.erase(0, c.in_at);
    c.in_at = 0;
  }
}

void HttpServer::Impl::process_unread(Conn& c) {
  for (;;) {
    if (c.dead) return;
    switch (c.phase) {
      case Phase::kIdle: {
        // Empty lines before a request (an old client's CRLF after a body) are no request yet:
        // dropped here, they keep the connection idle instead of starting a head (and a 408).
        for (std::string_view u = c.unread(); !u.empty(); u = c.unread()) {
          if (u[0] == '\n') {
            c.in_at += 1;
          } else if (u.substr(0, 2) == "\r\n") {
            c.in_at += 2;
          } else {
            break;
          }
        }
        if (c.unread().empty() || c.unread() == "\r") return;  // (a CRLF may be split in two)
        c.phase = Phase::kHead;
        c.head_scanned = 0;
        c.deadline = Clock::now() + opt.header_timeout;
        lru_add(c, head_lru);
        break;
      }
      case Phase::kHead: {
        auto end = http::find_head_end(c.unread(), &c.head_scanned, opt.limits);
        if (auto* e = std::get_if<http::ParseError>(&end)) return fail(c, e->status, e->message);
        const std::optional<size_t> at = std::get<std::optional<size_t>>(end);
        if (!at) return;
        auto parsed = http::parse_head(c.unread().substr(0, *at), opt.limits);
        c.in_at += *at;
        if (auto* e = std::get_if<http::ParseError>(&parsed)) return fail(c, e->status, e->message);
        c.req = std::move(std::get<http::Request>(parsed));
        c.head_parsed = true;
        lru_remove(c);
        start_request(c);
        break;
      }
      case Phase::kBody:
        if (read_body(c)) dispatch(c);
        return;
      default:
        return;
    }
  }
}

namespace {

bool reserve(std::atomic<size_t>& used, size_t limit, size_t n) {
  size_t cur = used.load();
  do {
    if (cur + n > limit) return false;
  } while (!used.compare_exchange_weak(cur, cur + n));
  return true;
}

}  // namespace

void HttpServer::Impl::start_request(Conn& c) {
  std::optional<http::Response> reply;
  try {
    reply = handler.on_head(c.req);
  } catch (...) {
    return fail(c, 500, "internal error while routing the request");
  }
  if (reply) {
    // Any body is left unread: the connection cannot carry another request.
    const bool body = c.req.has_body();
    return respond(c, std::move(*reply), c.req.keep_alive && !body && !draining.load());
  }
  const size_t max_body = opt.limits.max_body;
  if (c.req.content_length && *c.req.content_length > max_body) {
    return fail(c, 413,
                fmt::format("the request body ({} bytes) is larger than the {} bytes this server "
                            "accepts (--max-body-mb)",
                            *c.req.content_length, max_body));
  }
  if (c.req.content_length) {
    const size_t n = size_t(*c.req.content_length);
    if (!reserve(budget_used, opt.body_budget_bytes, n)) {
      return fail(c, 503, "too many request bodies are in flight; retry shortly");
    }
    c.budget += n;
    c.req.body.reserve(n);
    c.body_left = n;
  }
  c.chunked = http::ChunkedDecoder();
  if (!c.req.has_body()) return dispatch(c);
  c.phase = Phase::kBody;
  c.deadline = Clock::now() + opt.body_timeout;
  if (c.req.expect_continue && c.unread().empty()) {
    static constexpr std::string_view k100 = "HTTP/1.1 100 Continue\r\n\r\n";
    if (::send(c.fd, k100.data(), k100.size(), MSG_DONTWAIT | MSG_NOSIGNAL) !=
        ssize_t(k100.size())) {
      return close_conn(c);
    }
  }
}

bool HttpServer::Impl::read_body(Conn& c) {
  if (c.req.chunked) {
    size_t used = 0;
    const size_t before = c.req.body.size();
    const auto st = c.chunked.feed(c.unread(), &used, &c.req.body, opt.limits);
    c.in_at += used;
    const size_t grown = c.req.body.size() - before;
    if (grown) {
      if (!reserve(budget_used, opt.body_budget_bytes, grown)) {
        fail(c, 503, "too many request bodies are in flight; retry shortly");
        return false;
      }
      c.budget += grown;
    }
    if (st == http::ChunkedDecoder::Status::kError) {
      fail(c, c.chunked.error().status, c.chunked.error().message);
      return false;
    }
    return st == http::ChunkedDecoder::Status::kDone;
  }
  const size_t take = size_t(std::min<uint64_t>(c.body_left, c.unread().size()));
  c.req.body.append(c.unread().substr(0, take));
  c.in_at += take;
  c.body_left -= take;
  return c.body_left == 0;
}

void HttpServer::Impl::dispatch(Conn& c) {
  watch(c, 0);
  lru_remove(c);
  c.phase = Phase::kWorker;
  ++with_workers;
  {
    std::lock_guard<std::mutex> lk(mu);
    jobs.push_back(&c);
  }
  cv.notify_one();
}

void HttpServer::Impl::respond(Conn& c, http::Response res, bool keep_alive) {
  const http::Request* req = c.head_parsed ? &c.req : nullptr;
  handler.finish(req, res);
  c.out = http::serialize_head(res, keep_alive, res.body.size());
  if (!req || req->method != "HEAD") c.out += res.body;
  c.out_sent = 0;
  c.close_after = !keep_alive;
  c.phase = Phase::kWriting;
  c.deadline = Clock::now() + opt.write_timeout;
  lru_remove(c);
  flush_out(c);
}

void HttpServer::Impl::fail(Conn& c, int status, std::string message) {
  release_budget(c);
  http::Response res =
      handler.error_response(c.head_parsed ? &c.req : nullptr, status, std::move(message));
  respond(c, std::move(res), false);
}

void HttpServer::Impl::flush_out(Conn& c) {
  const SendResult r = send_some(c.fd, c.out, c.out_sent);
  if (r == SendResult::kWouldBlock) return watch(c, EPOLLOUT);
  if (r == SendResult::kFailed) return close_conn(c);
  std::string().swap(c.out);
  c.out_sent = 0;
  ++c.requests;
  if (!c.close_after) return to_idle(c);
  // Closing with unread input would reset the connection and could discard the response's tail
  // still in the send queue: the output is shut and the input dropped until the peer closes.
  ::shutdown(c.fd, SHUT_WR);
  c.phase = Phase::kLinger;
  c.deadline = Clock::now() + opt.linger;
  lru_add(c, c.refused ? refused_lru : linger_lru);
  std::string().swap(c.in);
  c.in_at = 0;
  watch(c, EPOLLIN | EPOLLRDHUP);
}

void HttpServer::Impl::to_idle(Conn& c) {
  c.req = http::Request();
  c.chunked = http::ChunkedDecoder();
  c.head_parsed = false;
  c.body_left = 0;
  release_budget(c);
  if (draining.load()) return close_conn(c);
  c.phase = Phase::kIdle;
  c.deadline = Clock::now() + opt.idle_timeout;
  lru_add(c, idle_lru);
  watch(c, EPOLLIN | EPOLLRDHUP);
  // A pipelined request may be buffered already: the caller processes it (process() itself when
  // it is the caller, looping, so that many such requests never nest calls).
}

void HttpServer::Impl::resume(Conn& c) {
  --with_workers;
  if (stopping.load()) return close_conn(c);
  // The rest of the worker's response, if any, then the next request or a lingering close.
  c.phase = Phase::kWriting;
  c.close_after = !c.keep;
  c.deadline = Clock::now() + opt.write_timeout;
  flush_out(c);
  if (!c.dead && c.phase == Phase::kIdle) process(c);
}

void HttpServer::Impl::check_deadlines(Clock::time_point now) {
  std::vector<Conn*> due;
  for (auto& c : conns) {
    if (c->phase != Phase::kWorker && now >= c->deadline) due.push_back(c.get());
  }
  const auto secs = [](std::chrono::milliseconds d) { return double(d.count()) / 1000.0; };
  for (Conn* c : due) {
    if (c->dead) continue;
    switch (c->phase) {
      case Phase::kIdle:
        close_conn(*c, "idle_timeout");
        break;
      case Phase::kHead:
        if (metrics) metrics->connection_closed("header_timeout");
        fail(*c, 408,
             fmt::format("the request head did not arrive within {} s", secs(opt.header_timeout)));
        break;
      case Phase::kBody:
        if (metrics) metrics->connection_closed("body_timeout");
        fail(*c, 408,
             fmt::format("the request body did not arrive within {} s", secs(opt.body_timeout)));
        break;
      case Phase::kWriting:
        close_conn(*c, "write_timeout");
        break;
      case Phase::kLinger:
        close_conn(*c);
        break;
      case Phase::kWorker:
        break;
    }
  }
}

// ---- the server ----

HttpServer::HttpServer(HttpServerOptions options, HttpHandler& handler,
                       std::shared_ptr<Metrics> metrics)
    : impl_(std::make_unique<Impl>(std::move(options), handler, std::move(metrics))) {}

HttpServer::~HttpServer() {
  for (auto& c : impl_->conns) ::close(c->fd);
  if (impl_->listen_fd >= 0) ::close(impl_->listen_fd);
  if (impl_->epoll_fd >= 0) ::close(impl_->epoll_fd);
  if (impl_->wake_fd >= 0) ::close(impl_->wake_fd);
}

namespace {

// A socket bound to host:port, listening when `and_listen`; or why none could be.
Result<int> bound_socket(const std::string& host, int port, bool and_listen) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return make_error(ErrorCode::kIo, "cannot resolve {}: {}", host, gai_strerror(rc));
  }
  std::string why = "no address";
  int bound = -1;
  for (addrinfo* a = found; a && bound < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    // SO_REUSEADDR only: SO_REUSEPORT would let a second server share the port silently.
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && (!and_listen || ::listen(fd, 1024) == 0)) {
      bound = fd;
    } else {
      why = std::strerror(errno);
      ::close(fd);
    }
  }
  freeaddrinfo(found);
  if (bound < 0) {
    return make_error(ErrorCode::kIo, "cannot listen on {}:{}: {}", url_host(host), port, why);
  }
  return bound;
}

}  // namespace

std::string url_host(const std::string& host) {
  return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

Status check_listen_address(const std::string& host, int port) {
  RECUR_ASSIGN_OR_RETURN(const int fd, bound_socket(host, port, false));
  ::close(fd);
  return Status();
}

Result<int> HttpServer::bind() {
  Impl& m = *impl_;
  // Every connection is a descriptor: take the hard limit, and keep the connection bound below
  // it (request event queues and the model's files need some too).
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    const int64_t room =
        int64_t(rl.rlim_cur) - 2 * int64_t(m.opt.workers) - 64 - Impl::kRefusedLingerMax;
    if (room < m.opt.max_connections) {
      const int capped = int(std::max<int64_t>(16, room));
      fmt::print(stderr, "warning: {} connections do not fit the descriptor limit {}; using {}\n",
                 m.opt.max_connections, uint64_t(rl.rlim_cur), capped);
      m.opt.max_connections = capped;
    }
  }
  RECUR_ASSIGN_OR_RETURN(m.listen_fd, bound_socket(m.opt.host, m.opt.port, true));
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(m.listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int bound =
      ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(addr).sin6_port
                                       : reinterpret_cast<sockaddr_in&>(addr).sin_port);
  m.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  m.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (m.epoll_fd < 0 || m.wake_fd < 0) {
    return make_error(ErrorCode::kIo, "cannot create the HTTP loop's epoll or eventfd");
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = &m.tag_listen;
  epoll_ctl(m.epoll_fd, EPOLL_CTL_ADD, m.listen_fd, &ev);
  ev.data.ptr = &m.tag_wake;
  epoll_ctl(m.epoll_fd, EPOLL_CTL_ADD, m.wake_fd, &ev);
  return bound;
}

Status HttpServer::run() {
  Impl& m = *impl_;
  if (m.listen_fd < 0) return make_error(ErrorCode::kInternal, "HttpServer::run before bind");
  try {
    for (int i = 0; i < m.opt.workers; ++i) m.workers.emplace_back([&m] { m.worker_main(); });
  } catch (const std::system_error& e) {  // the system would not make that many threads
    {
      std::lock_guard<std::mutex> lk(m.mu);
      m.workers_exit = true;
    }
    m.cv.notify_all();
    for (auto& t : m.workers) t.join();
    const size_t started = m.workers.size();
    m.workers.clear();
    return make_error(ErrorCode::kOutOfResources,
                      "cannot start {} HTTP worker threads (started {}): {}", m.opt.workers,
                      started, e.what());
  }
  pthread_setname_np(pthread_self(), "recur-http-loop");
  epoll_event events[256];
  auto next_scan = Clock::now();
  bool stop_started = false, forced = false, drain_seen = false;
  Clock::time_point stop_time;
  for (;;) {
    const int n = epoll_wait(m.epoll_fd, events, 256, 100);
    for (int i = 0; i < n; ++i) {
      void* p = events[i].data.ptr;
      if (p == &m.tag_listen) {
        m.accept_all();
      } else if (p == &m.tag_wake) {
        eventfd_t v;
        eventfd_read(m.wake_fd, &v);
      } else {
        m.on_event(*static_cast<Conn*>(p), events[i].events);
      }
    }
    std::vector<Conn*> back;
    {
      std::lock_guard<std::mutex> lk(m.mu);
      back.swap(m.returned);
    }
    for (Conn* c : back) m.resume(*c);
    const auto now = Clock::now();
    if (m.listening_paused && now >= m.resume_accept && m.listen_fd >= 0) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.ptr = &m.tag_listen;
      epoll_ctl(m.epoll_fd, EPOLL_CTL_MOD, m.listen_fd, &ev);
      m.listening_paused = false;
    }
    if (m.draining.load() && !drain_seen) {
      drain_seen = true;  // kept-alive connections between requests go; new ones still come
      std::vector<Conn*> idle;
      for (auto& c : m.conns) {
        if (c->phase == Phase::kIdle && c->requests > 0) idle.push_back(c.get());
      }
      for (Conn* c : idle) m.close_conn(*c);
    }
    if (now >= next_scan) {
      m.check_deadlines(now);
      next_scan = now + std::chrono::milliseconds(100);
    }
    if (m.stopping.load()) {
      if (!stop_started) {
        stop_started = true;
        stop_time = now;
        epoll_ctl(m.epoll_fd, EPOLL_CTL_DEL, m.listen_fd, nullptr);
        ::close(m.listen_fd);
        m.listen_fd = -1;
        std::vector<Conn*> mine;
        for (auto& c : m.conns) {
          if (c->phase != Phase::kWorker) mine.push_back(c.get());
        }
        for (Conn* c : mine) m.close_conn(*c);
      }
      if (m.with_workers == 0) break;
      if (!forced && now - stop_time > std::chrono::seconds(2)) {
        forced = true;  // a handler still writing to a client that reads nothing
        for (auto& c : m.conns) ::shutdown(c->fd, SHUT_RDWR);
      }
    }
    m.graveyard.clear();
  }
  m.graveyard.clear();
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.workers_exit = true;
  }
  m.cv.notify_all();
  for (auto& t : m.workers) t.join();
  m.workers.clear();
  return {};
}

void HttpServer::set_draining() {
  impl_->draining = true;
  if (impl_->wake_fd >= 0) impl_->wake();
}

void HttpServer::stop() {
  impl_->stopping = true;
  if (impl_->wake_fd >= 0) impl_->wake();
}

}  // namespace recur::server
