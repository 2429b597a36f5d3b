// The HTTP connection layer with a trivial handler over loopback: pipelined requests answered
// in order on one connection, a handler's refusal from the head alone, the body budget shared
// by all connections, and a worker's exception turned into a 500.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include "server/http_server.h"

namespace recur::server {
namespace {

class EchoHandler : public HttpHandler {
 public:
  std::optional<http::Response> on_head(const http::Request& head) override {
    if (head.path == "/refuse") {
      http::Response res;
      res.status = 401;
      res.body = "refused";
      return res;
    }
    if (head.path == "/fast") {  // answered by the loop, the connection kept
      http::Response res;
      res.content_type = "text/plain";
      res.body = "ok";
      return res;
    }
    return std::nullopt;
  }
  void handle(http::Request& req, HttpExchange& ex) override {
    if (req.path == "/throw") throw std::runtime_error("boom");
    if (req.path == "/stream" || req.path == "/stream-big") {
      worker = pthread_self();
      has_worker = true;
      http::Response head;
      head.content_type = "text/event-stream";
      if (!ex.begin_chunked(std::move(head))) return;
      if (!ex.write_chunk("hello ")) return;
      if (!ex.write_chunk(req.path == "/stream" ? std::string("world")
                                                : std::string(size_t(8) << 20, 'w'))) {
        return;
      }
      ex.end_chunked();
      return;
    }
    http::Response res;
    res.content_type = "text/plain";
    res.body = req.path + ":" + req.body;
    if (req.path == "/big") res.body.append(size_t(8) << 20, 'b');  // more than a socket holds
    ex.send(std::move(res));
  }
  http::Response error_response(const http::Request*, int status, std::string message) override {
    http::Response res;
    res.status = status;
    res.content_type = "text/plain";
    res.body = message;
    return res;
  }
  void finish(const http::Request*, http::Response&) override {}

  std::atomic<pthread_t> worker{};  // of the last streamed response
  std::atomic<bool> has_worker{false};
};

class HttpServerTest : public ::testing::Test {
 protected:
  // The loop runs on a thread with a small stack (256 KiB), so that stack use that grows with
  // what a client sends shows as a crash here rather than at 8 MiB in production.
  void start(HttpServerOptions o, int workers = 2) {
    o.host = "127.0.0.1";
    o.port = 0;
    o.workers = workers;
    server_ = std::make_unique<HttpServer>(o, handler_, nullptr);
    auto port = server_->bind();
    ASSERT_TRUE(port.ok()) << port.error().to_string();
    port_ = *port;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, size_t(256) << 10);
    ASSERT_EQ(pthread_create(
                  &loop_, &attr,
                  [](void* self) -> void* {
                    static_cast<HttpServerTest*>(self)->run_ok_ =
                        static_cast<HttpServerTest*>(self)->server_->run().ok();
                    return nullptr;
                  },
                  this),
              0);
    pthread_attr_destroy(&attr);
    running_ = true;
  }
  void TearDown() override {
    if (server_) server_->stop();
    if (running_) {
      pthread_join(loop_, nullptr);
      EXPECT_TRUE(run_ok_);
    }
  }
  int connect_client() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port_));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    return fd;
  }
  // Reads until `want` responses' worth of "HTTP/1.1 " lines and their bodies arrived, or the
  // peer closed, or 3 s passed.
  static std::string read_until(int fd, const std::string& marker, int count) {
    std::string got;
    char buf[4096];
    for (int waited = 0; waited < 3000;) {
      size_t n = 0;
      for (size_t at = got.find(marker); at != std::string::npos; at = got.find(marker, at + 1)) {
        ++n;
      }
      if (int(n) >= count) break;
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 50) == 0) {
        waited += 50;
        continue;
      }
      const ssize_t r = recv(fd, buf, sizeof(buf), 0);
      if (r <= 0) break;
      got.append(buf, size_t(r));
    }
    return got;
  }

  EchoHandler handler_;
  std::unique_ptr<HttpServer> server_;
  pthread_t loop_{};
  bool running_ = false;
  std::atomic<bool> run_ok_{false};
  int port_ = 0;
};

TEST_F(HttpServerTest, PipelinedRequestsAreAnsweredInOrder) {
  start(HttpServerOptions());
  const int fd = connect_client();
  const std::string two =
      "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nonePOST /b HTTP/1.1\r\nHost: "
      "x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\ntwo\r\n0\r\n\r\nGET /c HTTP/1.1\r\nHost: "
      "x\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(send(fd, two.data(), two.size(), 0), ssize_t(two.size()));
  const std::string got = read_until(fd, "HTTP/1.1 200", 3);
  const size_t a = got.find("/a:one"), b = got.find("/b:two"), c = got.find("/c:");
  ASSERT_NE(a, std::string::npos) << got;
  ASSERT_NE(b, std::string::npos) << got;
  ASSERT_NE(c, std::string::npos) << got;
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
  EXPECT_NE(got.find("Connection: close"), std::string::npos);
  close(fd);
}

TEST_F(HttpServerTest, RefusedFromTheHeadAndBodyBudget) {
  HttpServerOptions o;
  o.limits.max_body = 4000;
  o.body_budget_bytes = 3000;
  start(o);
  // Refused on the head: the declared body never has to arrive.
  int fd = connect_client();
  std::string req = "POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  std::string got = read_until(fd, "refused", 1);
  EXPECT_EQ(got.rfind("HTTP/1.1 401", 0), 0u) << got;
  close(fd);
  // Two bodies of 2000 bytes being read at once do not fit a 3000-byte budget.
  const int first = connect_client();
  req = "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\npartial";
  send(first, req.data(), req.size(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  fd = connect_client();
  send(fd, req.data(), req.size(), 0);
  got = read_until(fd, "in flight", 1);
  EXPECT_EQ(got.rfind("HTTP/1.1 503", 0), 0u) << got;
  close(fd);
  close(first);  // its share of the budget is released with it
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  fd = connect_client();
  req = "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n" + std::string(2000, 'z');
  send(fd, req.data(), req.size(), 0);
  got = read_until(fd, "zzz", 1);
  EXPECT_EQ(got.rfind("HTTP/1.1 200", 0), 0u) << got.substr(0, 100);
  close(fd);
}

TEST_F(HttpServerTest, AnExceptionInAHandlerIsA500) {
  start(HttpServerOptions());
  const int fd = connect_client();
  const std::string req = "GET /throw HTTP/1.1\r\nHost: x\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  const std::string got = read_until(fd, "boom", 1);
  EXPECT_EQ(got.rfind("HTTP/1.1 500", 0), 0u) << got;
  EXPECT_NE(got.find("Connection: close"), std::string::npos);
  close(fd);
}

// Thousands of pipelined requests that the loop answers itself (from the head) are answered in
// turn, not by a call chain as deep as the requests in the buffer.
TEST_F(HttpServerTest, ManyPipelinedHeadAnswersDoNotNestCalls) {
  start(HttpServerOptions());
  const int fd = connect_client();
  const int n = 20000;
  std::string all;
  for (int i = 0; i < n; ++i) all += "GET /fast HTTP/1.1\r\nHost: x\r\n\r\n";
  all += "GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  std::thread sender([&] {
    for (size_t at = 0; at < all.size();) {
      const ssize_t k = send(fd, all.data() + at, all.size() - at, MSG_NOSIGNAL);
      if (k <= 0) break;
      at += size_t(k);
    }
  });
  std::string got;
  char buf[65536];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 5000) <= 0) break;
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r <= 0) break;
    got.append(buf, size_t(r));
  }
  sender.join();
  size_t answers = 0;
  for (size_t at = got.find("HTTP/1.1 200"); at != std::string::npos;
       at = got.find("HTTP/1.1 200", at + 1)) {
    ++answers;
  }
  EXPECT_EQ(answers, size_t(n + 1));
  close(fd);
}

// A client that never reads a response larger than the socket's buffers holds no worker: with
// one worker, another connection is still answered at once, and the first client gets its
// whole response once it reads.
TEST_F(HttpServerTest, AClientThatDoesNotReadHoldsNoWorker) {
  start(HttpServerOptions(), /*workers=*/1);
  const int slow = connect_client();
  const int rcvbuf = 65536;
  setsockopt(slow, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  std::string req = "GET /big HTTP/1.1\r\nHost: x\r\n\r\n";
  send(slow, req.data(), req.size(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  const int fd = connect_client();
  req = "GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  const std::string got = read_until(fd, "/a:", 1);
  EXPECT_EQ(got.rfind("HTTP/1.1 200", 0), 0u) << got;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  close(fd);
  // The slow client reads now: all of it arrives.
  size_t body = 0;
  std::string head;
  char buf[65536];
  for (;;) {
    pollfd p{slow, POLLIN, 0};
    if (poll(&p, 1, 3000) <= 0) break;
    const ssize_t r = recv(slow, buf, sizeof(buf), 0);
    if (r <= 0) break;
    if (head.find("\r\n\r\n") == std::string::npos) {
      head.append(buf, size_t(r));
      const size_t end = head.find("\r\n\r\n");
      if (end != std::string::npos) body = head.size() - end - 4;
    } else {
      body += size_t(r);
    }
    if (body >= (size_t(8) << 20) + 5) break;
  }
  EXPECT_EQ(body, (size_t(8) << 20) + 5) << head.substr(0, 200);
  close(slow);
}

// Reads a response with a Content-Length body from fd; the body's size, or what arrived before
// the connection ended (a reset included).
size_t read_body_size(int fd, std::string* head, bool* reset) {
  size_t body = 0;
  char buf[65536];
  *reset = false;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 3000) <= 0) break;
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r < 0) *reset = true;
    if (r <= 0) break;
    if (head->find("\r\n\r\n") == std::string::npos) {
      head->append(buf, size_t(r));
      const size_t end = head->find("\r\n\r\n");
      if (end != std::string::npos) body = head->size() - end - 4;
    } else {
      body += size_t(r);
    }
  }
  return body;
}

// A response that ends its connection (Connection: close) reaches a client that sent more
// bytes meanwhile whole: closing with those bytes unread would reset the connection and drop
// the response's tail still queued in the kernel.
TEST_F(HttpServerTest, AClosingResponseIsNotResetByUnreadInput) {
  start(HttpServerOptions(), /*workers=*/1);
  const int fd = connect_client();
  const int rcvbuf = 65536;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  std::string req = "GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server reads no more
  req = "GET /a HTTP/1.1\r\nHost: x\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::string head;
  bool reset = false;
  EXPECT_EQ(read_body_size(fd, &head, &reset), (size_t(8) << 20) + 5) << head.substr(0, 200);
  EXPECT_FALSE(reset);
  close(fd);
}

// Reads until the peer closes (or 3 s pass without a byte).
std::string read_all(int fd) {
  std::string got;
  char buf[65536];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 3000) <= 0) break;
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r <= 0) break;
    got.append(buf, size_t(r));
  }
  return got;
}

// A streamed response is chunked for HTTP/1.1; HTTP/1.0 knows no chunking, so its body is
// the bytes themselves, ended by the close (RFC 9112 6.1: no Transfer-Encoding for 1.0).
TEST_F(HttpServerTest, StreamedResponsesAreChunkedFor11AndCloseDelimitedFor10) {
  start(HttpServerOptions());
  int fd = connect_client();
  std::string req = "GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  std::string got = read_all(fd);
  close(fd);
  EXPECT_NE(got.find("Transfer-Encoding: chunked\r\n"), std::string::npos) << got;
  EXPECT_EQ(got.substr(got.find("\r\n\r\n") + 4), "6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n");

  fd = connect_client();
  req = "GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  got = read_all(fd);
  close(fd);
  EXPECT_EQ(got.find("Transfer-Encoding"), std::string::npos) << got;
  EXPECT_NE(got.find("Connection: close\r\n"), std::string::npos) << got;
  EXPECT_EQ(got.substr(got.find("\r\n\r\n") + 4), "hello world");
}

// A signal that interrupts a worker waiting for the socket to take a chunk does not fail the
// response (a poll interrupted with EINTR is retried).
TEST_F(HttpServerTest, ASignalDuringABlockedWriteDoesNotFailTheResponse) {
  struct sigaction sa {
  }, old{};
  sa.sa_handler = [](int) {};
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART (poll is never restarted anyway)
  ASSERT_EQ(sigaction(SIGUSR1, &sa, &old), 0);
  start(HttpServerOptions(), /*workers=*/1);
  const int fd = connect_client();
  const int rcvbuf = 65536;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  const std::string req = "GET /stream-big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  for (int i = 0; i < 100 && !handler_.has_worker; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(handler_.has_worker);
  for (int i = 0; i < 20; ++i) {  // while the client reads nothing
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    pthread_kill(handler_.worker.load(), SIGUSR1);
  }
  const std::string got = read_all(fd);
  close(fd);
  sigaction(SIGUSR1, &old, nullptr);
  const size_t end = got.find("\r\n\r\n");
  ASSERT_NE(end, std::string::npos);
  const std::string want =
      "6\r\nhello \r\n800000\r\n" + std::string(size_t(8) << 20, 'w') + "\r\n0\r\n\r\n";
  EXPECT_TRUE(got.compare(end + 4, std::string::npos, want) == 0) << got.size() - end - 4;
}

// The empty line an old client sends after a body is not the start of a request: the idle
// connection is closed at the idle timeout without a word, not answered 408 at the header
// timeout (an unasked-for response that the client's next request would read as its own).
TEST_F(HttpServerTest, AnEmptyLineAfterARequestIsNotARequestHead) {
  HttpServerOptions o;
  o.idle_timeout = std::chrono::milliseconds(600);
  o.header_timeout = std::chrono::milliseconds(200);
  start(o);
  const int fd = connect_client();
  const std::string req = "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none\r\n";
  send(fd, req.data(), req.size(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string got = read_all(fd);
  const auto waited = std::chrono::steady_clock::now() - t0;
  close(fd);
  EXPECT_EQ(got.rfind("HTTP/1.1 200", 0), 0u) << got;
  EXPECT_EQ(got.find("HTTP/1.1 408"), std::string::npos) << got;
  EXPECT_GE(waited, std::chrono::milliseconds(500));  // kept open until the idle timeout
}

// Clients that pipeline small requests as fast as they can take their turns with the others:
// a request on another connection is still answered promptly (before, each pass read and
// answered up to 1 MiB of one client's requests, erasing each from the front of its buffer,
// and another client waited seconds).
TEST_F(HttpServerTest, ClientsPipeliningWithoutPauseDoNotStarveOthers) {
  start(HttpServerOptions());
  std::atomic<bool> stop{false};
  std::vector<int> fds;
  std::vector<std::thread> threads;
  std::string batch;
  while (batch.size() < 65536) batch += "GET /fast HTTP/1.1\r\nHost:\r\n\r\n";
  for (int k = 0; k < 2; ++k) {
    const int fd = connect_client();
    fds.push_back(fd);
    threads.emplace_back([&, fd] {  // sends
      while (!stop && send(fd, batch.data(), batch.size(), MSG_NOSIGNAL) > 0) {
      }
    });
    threads.emplace_back([&, fd] {  // reads the answers
      char buf[65536];
      while (!stop && recv(fd, buf, sizeof(buf), 0) > 0) {
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto worst = std::chrono::steady_clock::duration::zero();
  for (int i = 0; i < 10; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const int fd = connect_client();
    const std::string req = "GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    send(fd, req.data(), req.size(), 0);
    const std::string got = read_until(fd, "\r\n\r\nok", 1);
    worst = std::max(worst, std::chrono::steady_clock::now() - t0);
    close(fd);
    EXPECT_EQ(got.rfind("HTTP/1.1 200", 0), 0u) << got;
  }
  stop = true;
  for (const int fd : fds) shutdown(fd, SHUT_RDWR);
  for (auto& t : threads) t.join();
  for (const int fd : fds) close(fd);
  EXPECT_LT(worst, std::chrono::milliseconds(1000))
      << std::chrono::duration<double, std::milli>(worst).count() << " ms";
}

// Requests that arrive a byte at a time (every split of a head, a Content-Length body, a
// chunked body and the next pipelined request) are read as if whole.
TEST_F(HttpServerTest, RequestsSplitAtEveryByteAreReadWhole) {
  start(HttpServerOptions());
  const int fd = connect_client();
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  const std::string all =
      "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhelloPOST /b HTTP/1.1\r\n"
      "Host: x\r\nTransfer-Encoding: chunked\r\n\r\n3;e=1\r\nabc\r\n2\r\nde\r\n0\r\nT: v\r\n\r\n"
      "GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  for (const char ch : all) {
    ASSERT_EQ(send(fd, &ch, 1, 0), 1);
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  const std::string got = read_all(fd);
  close(fd);
  const size_t a = got.find("/a:hello"), b = got.find("/b:abcde"), c = got.find("/c:");
  EXPECT_NE(a, std::string::npos) << got;
  EXPECT_NE(b, std::string::npos) << got;
  EXPECT_NE(c, std::string::npos) << got;
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
}

// A HEAD response carries the length of the GET body but no body, from the loop or a worker:
// the next pipelined response follows its head directly.
TEST_F(HttpServerTest, HeadResponsesHaveNoBody) {
  start(HttpServerOptions());
  const int fd = connect_client();
  const std::string req =
      "HEAD /fast HTTP/1.1\r\nHost: x\r\n\r\nHEAD /a HTTP/1.1\r\nHost: x\r\n\r\n"
      "GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  const std::string got = read_all(fd);
  close(fd);
  const std::string fast_head = "Content-Length: 2\r\nConnection: keep-alive\r\n\r\n";
  const std::string worker_head = "Content-Length: 3\r\nConnection: keep-alive\r\n\r\n";
  EXPECT_NE(got.find(fast_head + "HTTP/1.1 200"), std::string::npos) << got;
  EXPECT_NE(got.find(worker_head + "HTTP/1.1 200"), std::string::npos) << got;
  EXPECT_TRUE(got.size() > 4 && got.compare(got.size() - 6, 6, "\r\n\r\nok") == 0) << got;
}

size_t open_descriptors() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Connections that end in every state (idle, in a head, in a body, refused, answered with an
// error, kept alive, displaced at the connection limit) leave no descriptor behind.
TEST_F(HttpServerTest, NoDescriptorOutlivesItsConnection) {
  HttpServerOptions o;
  o.max_connections = 8;
  o.linger = std::chrono::milliseconds(200);
  start(o);
  const size_t before = open_descriptors();
  const char* sends[] = {
      "",                                                               // idle
      "GET /a HTTP/1.1\r\nHost:",                                       // in a head
      "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nabc",    // in a body
      "GET /a HTTP/1.1\r\nNo colon\r\n\r\n",                            // a 400
      "POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n",  // refused from the head
      "GET /a HTTP/1.1\r\nHost: x\r\n\r\n",                             // kept alive
  };
  for (int round = 0; round < 5; ++round) {
    std::vector<int> fds;
    for (const char* bytes : sends) {
      for (int k = 0; k < 3; ++k) {  // 18 connections, 8 allowed: some are displaced
        const int fd = connect_client();
        send(fd, bytes, strlen(bytes), MSG_NOSIGNAL);
        fds.push_back(fd);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (const int fd : fds) close(fd);
  }
  size_t after = 0;
  for (int i = 0; i < 50; ++i) {  // the server sees the closes and the linger ends
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if ((after = open_descriptors()) == before) break;
  }
  EXPECT_EQ(after, before);
}

// At the connection limit, connections that are only lingering after their last response are
// the first displaced: a flood of Connection: close requests whose clients keep their sockets
// open does not turn new clients away.
TEST_F(HttpServerTest, LingeringConnectionsAreDisplacedFirst) {
  HttpServerOptions o;
  o.max_connections = 4;
  o.linger = std::chrono::seconds(10);
  start(o);
  std::vector<int> lingering;
  for (int i = 0; i < 4; ++i) {
    const int fd = connect_client();
    const std::string req = "GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    send(fd, req.data(), req.size(), 0);
    EXPECT_NE(read_until(fd, "\r\n\r\nok", 1).find("ok"), std::string::npos);
    lingering.push_back(fd);  // answered, but kept open
  }
  const int fd = connect_client();
  const std::string req = "GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  const std::string got = read_until(fd, "\r\n\r\n", 1);
  EXPECT_EQ(got.rfind("HTTP/1.1 200", 0), 0u) << got;
  close(fd);
  for (const int l : lingering) close(l);
}

// Over the connection limit with every connection busy, a new client gets the 503 whole even
// when its request arrived unread before the answer: the refusal lingers instead of closing
// with input unread, which would reset the connection (and could drop the 503).
TEST_F(HttpServerTest, ARefusalAtTheConnectionLimitIsNotAReset) {
  HttpServerOptions o;
  o.max_connections = 2;
  start(o);
  std::vector<int> busy;
  for (int i = 0; i < 2; ++i) {  // in a body: not displaceable
    const int fd = connect_client();
    const std::string req = "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nabc";
    send(fd, req.data(), req.size(), 0);
    busy.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::string req =
      "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n" + std::string(60000, 'x');
  for (int k = 0; k < 3; ++k) {
    const int fd = connect_client();
    send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::string head;
    bool reset = false;
    read_body_size(fd, &head, &reset);
    EXPECT_EQ(head.rfind("HTTP/1.1 503", 0), 0u) << head.substr(0, 200);
    EXPECT_FALSE(reset);
    close(fd);
  }
  for (const int fd : busy) close(fd);
}

// One that never reads at all is cut off at the write timeout.
TEST_F(HttpServerTest, AResponseNobodyReadsEndsAtTheWriteTimeout) {
  HttpServerOptions o;
  o.write_timeout = std::chrono::milliseconds(300);
  start(o, /*workers=*/1);
  const int slow = connect_client();
  const std::string req = "GET /big HTTP/1.1\r\nHost: x\r\n\r\n";
  send(slow, req.data(), req.size(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  size_t got = 0;
  char buf[65536];
  bool closed = false;
  for (;;) {
    pollfd p{slow, POLLIN, 0};
    if (poll(&p, 1, 1000) <= 0) break;
    const ssize_t r = recv(slow, buf, sizeof(buf), 0);
    if (r <= 0) {
      closed = true;
      break;
    }
    got += size_t(r);
  }
  EXPECT_TRUE(closed);
  EXPECT_LT(got, size_t(8) << 20);
  close(slow);
}

}  // namespace
}  // namespace recur::server
