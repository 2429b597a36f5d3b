// The worker threads' side of the HTTP server: a handler's exchange with its client (blocking
// writes bounded by the write timeout) and the loop that takes connections from the event loop
// and hands them back.
#include <fmt/format.h>

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <exception>
#include <string>

#include "server/http_server_impl.h"

namespace recur::server {

// ---- a worker's side ----

bool HttpExchange::keep_alive() const {
  return keep_alive_ && !failed_ && req_->keep_alive && !impl_->draining.load();
}

bool HttpExchange::write_all(std::string_view data) {
  if (failed_) return false;
  const auto deadline = Clock::now() + impl_->opt.write_timeout;
  while (!data.empty()) {
    const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(size_t(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const int64_t left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      pollfd p{fd_, POLLOUT, 0};
      if (left > 0 && (poll(&p, 1, int(std::min<int64_t>(left, 1000))) >= 0 || errno == EINTR)) {
        continue;
      }
    }
    failed_ = true;  // reset, broken pipe, or nothing read for write_timeout
    return false;
  }
  return true;
}

bool HttpExchange::send(http::Response res) {
  if (responded_) return false;
  responded_ = true;
  impl_->handler.finish(req_, res);
  const bool keep = keep_alive();
  if (!keep) keep_alive_ = false;
  std::string out = http::serialize_head(res, keep, res.body.size());
  if (req_->method != "HEAD") out += res.body;
  size_t sent = 0;
  const SendResult r = send_some(fd_, out, sent);
  if (r == SendResult::kWouldBlock) {
    unsent_ = std::move(out);
    unsent_at_ = sent;
  }
  if (r == SendResult::kFailed) failed_ = true;
  return r != SendResult::kFailed;
}

bool HttpExchange::begin_chunked(http::Response head) {
  if (responded_) return false;
  responded_ = true;
  impl_->handler.finish(req_, head);
  if (!chunked()) keep_alive_ = false;  // the close ends the body
  const bool keep = keep_alive();
  if (!keep) keep_alive_ = false;
  return write_all(http::serialize_head(head, keep, std::nullopt, chunked()));
}

bool HttpExchange::write_chunk(std::string_view data) {
  if (data.empty()) return true;  // an empty chunk would end the body
  if (!chunked()) return write_all(data);
  return write_all(fmt::format("{:x}\r\n", data.size())) && write_all(data) && write_all("\r\n");
}

bool HttpExchange::end_chunked() {
  return chunked() ? write_all("0\r\n\r\n") : !failed_;
}

void HttpServer::Impl::worker_main() {
  pthread_setname_np(pthread_self(), "recur-http");
  for (;;) {
    Conn* c;
    {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return workers_exit || !jobs.empty(); });
      if (jobs.empty()) return;
      c = jobs.front();
      jobs.pop_front();
    }
    HttpExchange ex;
    ex.impl_ = this;
    ex.req_ = &c->req;
    ex.fd_ = c->fd;
    // Nothing may escape into this thread: an exception becomes a 500 when nothing was sent
    // yet, else the connection is closed mid-response.
    std::string failure;
    try {
      handler.handle(c->req, ex);
    } catch (const std::exception& e) {
      failure = std::string("internal error: ") + e.what();
    } catch (...) {
      failure = "internal error";
    }
    if (!ex.responded()) {
      ex.close_connection();  // before the send: the response says so
      try {
        ex.send(handler.error_response(
            &c->req, 500, failure.empty() ? "internal error: no response was made" : failure));
      } catch (...) {
      }
    } else if (!failure.empty()) {
      ex.close_connection();
    }
    c->keep = ex.keep_alive();
    c->out = std::move(ex.unsent_);
    c->out_sent = ex.unsent_at_;
    c->req = http::Request();  // the body's memory goes now
    release_budget(*c);
    {
      std::lock_guard<std::mutex> lk(mu);
      returned.push_back(c);
    }
    wake();
  }
}

}  // namespace recur::server
