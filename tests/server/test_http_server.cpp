// The HTTP connection layer with a trivial handler over loopback: pipelined requests answered
// in order on one connection, a handler's refusal from the head alone, the body budget shared
// by all connections, and a worker's exception turned into a 500.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

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
    return std::nullopt;
  }
  void handle(http::Request& req, HttpExchange& ex) override {
    if (req.path == "/throw") throw std::runtime_error("boom");
    http::Response res;
    res.content_type = "text/plain";
    res.body = req.path + ":" + req.body;
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
};

class HttpServerTest : public ::testing::Test {
 protected:
  void start(HttpServerOptions o) {
    o.host = "127.0.0.1";
    o.port = 0;
    o.workers = 2;
    server_ = std::make_unique<HttpServer>(o, handler_, nullptr);
    auto port = server_->bind();
    ASSERT_TRUE(port.ok()) << port.error().to_string();
    port_ = *port;
    thread_ = std::thread([this] { ASSERT_TRUE(server_->run().ok()); });
  }
  void TearDown() override {
    if (server_) server_->stop();
    if (thread_.joinable()) thread_.join();
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
  std::thread thread_;
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

}  // namespace
}  // namespace recur::server
