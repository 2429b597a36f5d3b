// The server's HTTP/1.1 connections. One event-loop thread (epoll) accepts every connection and
// reads every request head and body without blocking, under limits and deadlines: a head must
// arrive within header_timeout of its first byte, a body within body_timeout of its head, an
// idle keep-alive connection is closed after idle_timeout, and no body grows past max_body
// whatever its transfer encoding (a chunked one fails at the chunk that crosses the limit).
// The handler sees a request's head before any of its body, so a request that is refused
// (authentication, routing, a declared size) costs no body bytes. Only a request whose body
// has fully arrived reaches a worker thread, so slow or idle clients hold a descriptor and a
// small buffer each, never a thread. At max_connections, a new connection displaces the oldest
// one lingering after its last response, then the oldest idle one, then the oldest still
// sending its head; only when every connection is busy with a request is it answered 503.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "core/status.h"
#include "server/http_message.h"
#include "server/metrics.h"

namespace recur::server {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;  // 0: any free port
  int max_connections = 1024;
  int workers = 64;  // threads that run handlers (requests whose body has arrived)
  http::Limits limits;
  // All request bodies being read or handled at once; a body that does not fit is a 503.
  size_t body_budget_bytes = size_t(256) << 20;
  std::chrono::milliseconds header_timeout{10000};
  std::chrono::milliseconds body_timeout{60000};
  std::chrono::milliseconds idle_timeout{5000};
  std::chrono::milliseconds write_timeout{30000};
  // After a response that ends its connection, input is read and dropped up to this long
  // before the close, so that the client sees the response instead of a reset.
  std::chrono::milliseconds linger{2000};
};

class HttpExchange;

// A host as a URL writes it: an IPv6 address in brackets ([::1]).
std::string url_host(const std::string& host);

// Whether host:port can be bound now (resolved, free, permitted); the socket is closed again.
// For a server that takes minutes to load before it binds: a busy port fails at once.
Status check_listen_address(const std::string& host, int port);

class HttpHandler {
 public:
  virtual ~HttpHandler() = default;
  // The loop thread, once a head is read, before any body byte: an answer now (any body is
  // left unread and the connection closed), or nullopt to read the body and call handle() on a
  // worker. Must not block.
  virtual std::optional<http::Response> on_head(const http::Request& head) = 0;
  // A worker thread, with the whole body in req.body.
  virtual void handle(http::Request& req, HttpExchange& ex) = 0;
  // Errors the HTTP layer finds itself (malformed framing, limits, deadlines, overload); req
  // is null when no head was parsed.
  virtual http::Response error_response(const http::Request* req, int status,
                                        std::string message) = 0;
  // Every response, just before it is written (CORS headers, counters); any thread.
  virtual void finish(const http::Request* req, http::Response& res) = 0;
};

class HttpServer {
 public:
  HttpServer(HttpServerOptions options, HttpHandler& handler, std::shared_ptr<Metrics> metrics);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens; returns the port (useful with port 0).
  Result<int> bind();
  // Runs the event loop on the calling thread until stop().
  Status run();
  // Responses from now on close their connections, and idle keep-alive ones are closed; new
  // connections are still accepted (so /health can answer 503).
  void set_draining();
  // From any thread: run() closes the listener and every connection, waits for the workers'
  // requests to end (forcing their sockets shut after a grace period), and returns.
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// A worker's hold on the connection of the request it handles.
class HttpExchange {
 public:
  int fd() const { return fd_; }
  // The whole response. What the socket does not take at once is left to the event loop (under
  // the write timeout), so a client that reads slowly holds no worker. false: the client is gone.
  bool send(http::Response res);
  // A chunked response's status line and headers; the body's chunks are then written to fd()
  // (by the stream writer) and end_chunked() writes the last one. An HTTP/1.0 client knows no
  // chunking: its body is sent as is and ended by the close (chunked() says which).
  bool begin_chunked(http::Response head);
  bool end_chunked();
  // One chunk of a chunked body.
  bool write_chunk(std::string_view data);
  bool chunked() const { return req_->minor_version >= 1; }
  // Not reused after this response (the client went away, or a write failed).
  void close_connection() { keep_alive_ = false; }
  // No response will be sent (the client went away): the connection is closed.
  void abandon() {
    responded_ = true;
    keep_alive_ = false;
  }
  bool responded() const { return responded_; }

 private:
  friend struct HttpServer::Impl;
  HttpExchange() = default;
  bool write_all(std::string_view data);
  bool keep_alive() const;

  HttpServer::Impl* impl_ = nullptr;
  const http::Request* req_ = nullptr;
  int fd_ = -1;
  bool keep_alive_ = true;
  bool responded_ = false;
  bool failed_ = false;
  std::string unsent_;  // of send()'s response, unsent_[unsent_at_..) for the loop to write
  size_t unsent_at_ = 0;
};

}  // namespace recur::server
