#include "server/server.h"

#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <ctime>

#include "server/connection.h"
#include "server/format.h"
#include "server/generation.h"
#include "server/metrics.h"
#include "server/stream_writer.h"

namespace recur::server {

namespace {

constexpr const char* kJson = "application/json";

// httplib listens with a backlog of 5; a burst of clients would see dropped SYNs and retry a
// second later. listen() again on the bound socket raises the backlog.
class HttpServer : public httplib::Server {
 public:
  void raise_backlog(int backlog) {
    const socket_t s = svr_sock_;
    if (s != INVALID_SOCKET) ::listen(s, backlog);
  }
};

std::string route_label(const std::string& path) {
  static const char* kRoutes[] = {"/v1/chat/completions", "/v1/completions", "/v1/messages",
                                  "/v1/models",           "/health",         "/metrics"};
  for (const char* r : kRoutes) {
    if (path == r) return r;
  }
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models";
  return "other";
}

bool anthropic_path(const std::string& path) {
  return path.rfind("/v1/messages", 0) == 0;
}

void send_error(httplib::Response& res, const ApiError& e, bool anthropic) {
  res.status = e.status;
  res.set_content(dump(e.to_json(anthropic)), kJson);
}

// Constant-time comparison: the key must not leak through response timing.
bool same_key(const std::string& given, const std::string& key) {
  if (given.size() != key.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < key.size(); ++i) diff |= uint8_t(given[i] ^ key[i]);
  return diff == 0;
}

const char* status_message(int status) {
  switch (status) {
    case 400:
      return "malformed HTTP request";
    case 404:
      return "no such route; see /v1/models, /v1/chat/completions, /v1/completions, "
             "/v1/messages, /health, /metrics";
    case 405:
      return "method not allowed on this route";
    case 413:
      return "the request body is larger than the server accepts";
    case 414:
      return "the request URI is too long";
    case 416:
      return "range not satisfiable";
    default:
      return status < 500 ? "bad request" : "internal server error";
  }
}

}  // namespace

struct Server::Impl {
  Engine& engine;
  ServerOptions options;
  ServingContext ctx;
  std::shared_ptr<Metrics> metrics = std::make_shared<Metrics>();
  // Declared before http: it outlives the HTTP threads that wait on its streams.
  std::unique_ptr<StreamWriter> writer;
  Status writer_status;  // why there is no writer; reported by bind()
  HttpServer http;
  std::atomic<bool> draining{false};
  std::atomic<bool> shut_down{false};

  Impl(Engine& e, ServerOptions o) : engine(e), options(std::move(o)) {}

  bool authorized(const httplib::Request& req) const {
    if (options.api_key.empty()) return true;
    const std::string auth = req.get_header_value("Authorization");
    if (auth.rfind("Bearer ", 0) == 0 && same_key(auth.substr(7), options.api_key)) return true;
    return req.has_header("x-api-key") &&
           same_key(req.get_header_value("x-api-key"), options.api_key);
  }

  void setup();
  void handle_generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint);
  void stream(std::shared_ptr<Generation> gen, int fd, httplib::Response& res);
  void models(const httplib::Request& req, httplib::Response& res);
};

void Server::Impl::setup() {
  const int threads = options.http_threads > 0 ? options.http_threads
                                               : std::max(64, 4 * engine.config().max_batch + 32);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  http.set_payload_max_length(options.max_body_bytes);
  http.set_keep_alive_max_count(1000);
  http.set_keep_alive_timeout(5);
  http.set_read_timeout(10, 0);
  http.set_write_timeout(30, 0);
  http.set_tcp_nodelay(true);
  // httplib's default also sets SO_REUSEPORT, which lets a second server bind the same port
  // and silently take half its connections; a port in use must be an error instead.
  http.set_socket_options([](socket_t sock) {
    const int one = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  });

  auto guard = [this](auto fn) {
    return [this, fn](const httplib::Request& req, httplib::Response& res) {
      metrics->http_in_flight(1);
      try {
        fn(req, res);
      } catch (const std::exception& e) {
        ApiError err;
        err.status = 500;
        err.type = "server_error";
        err.message = std::string("internal error: ") + e.what();
        send_error(res, err, anthropic_path(req.path));
      } catch (...) {
        ApiError err;
        err.status = 500;
        err.type = "server_error";
        err.message = "internal error";
        send_error(res, err, anthropic_path(req.path));
      }
      metrics->http_in_flight(-1);
    };
  };
  auto generate = [this, guard](Endpoint ep) {
    return guard([this, ep](const httplib::Request& req, httplib::Response& res) {
      handle_generate(req, res, ep);
    });
  };
  http.Post("/v1/chat/completions", generate(Endpoint::kChat));
  http.Post("/v1/completions", generate(Endpoint::kCompletions));
  http.Post("/v1/messages", generate(Endpoint::kMessages));
  auto models_handler =
      guard([this](const httplib::Request& req, httplib::Response& res) { models(req, res); });
  http.Get("/v1/models", models_handler);
  http.Get(R"(/v1/models/(.+))", models_handler);
  http.Get("/health", guard([this](const httplib::Request&, httplib::Response& res) {
             if (draining.load()) {
               res.status = 503;
               res.set_content(R"({"status":"shutting down"})", kJson);
             } else {
               res.set_content(R"({"status":"ok"})", kJson);
             }
           }));
  http.Get("/metrics", guard([this](const httplib::Request&, httplib::Response& res) {
             res.set_content(metrics->render(engine.stats()),
                             "text/plain; version=0.0.4; charset=utf-8");
           }));
  auto not_allowed = [](const httplib::Request& req, httplib::Response& res) {
    ApiError e;
    e.status = 405;
    e.message = fmt::format("{} is not allowed on {}", req.method, req.path);
    send_error(res, e, anthropic_path(req.path));
  };
  for (const char* p : {"/v1/chat/completions", "/v1/completions", "/v1/messages"}) {
    http.Get(p, not_allowed);
    http.Put(p, not_allowed);
    http.Delete(p, not_allowed);
  }
  for (const char* p : {"/v1/models", "/health", "/metrics"}) {
    http.Post(p, not_allowed);
  }

  // Errors httplib produces itself (bad request lines, body limits, unknown routes) get the
  // same JSON error body as the API's own.
  http.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || res.is_chunked_content_provider_) {
          return httplib::Server::HandlerResponse::Unhandled;
        }
        try {
          ApiError e;
          e.status = res.status;
          e.message = status_message(res.status);
          if (res.status == 404) e.type = "not_found_error";
          if (res.status >= 500) e.type = "server_error";
          send_error(res, e, anthropic_path(req.path));
          return httplib::Server::HandlerResponse::Handled;
        } catch (...) {  // nothing may escape into httplib's threads
          return httplib::Server::HandlerResponse::Unhandled;
        }
      }));
  http.set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr) {
        res.status = 500;
        try {
          ApiError e;
          e.status = 500;
          e.type = "server_error";
          e.message = "internal error";
          send_error(res, e, anthropic_path(req.path));
        } catch (...) {
        }
      });
  // The API has no use for byte ranges; httplib would answer them with an empty 416.
  http.set_pre_routing_handler([](const httplib::Request& req, httplib::Response&) {
    const_cast<httplib::Request&>(req).ranges.clear();  // httplib's own object, not const
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    try {
      metrics->http_request(route_label(req.path), res.status);
    } catch (...) {
    }
  });
}

void Server::Impl::models(const httplib::Request& req, httplib::Response& res) {
  if (!authorized(req)) {
    ApiError e;
    e.status = 401;
    e.type = "authentication_error";
    e.code = "invalid_api_key";
    e.message = "missing or incorrect API key";
    return send_error(res, e, false);
  }
  ojson model = {{"id", ctx.model_name},
                 {"object", "model"},
                 {"created", 0},
                 {"owned_by", "recur"},
                 {"max_model_len", ctx.max_context}};
  if (req.matches.size() > 1) {
    if (req.matches[1] != ctx.model_name) {
      ApiError e;
      e.status = 404;
      e.type = "not_found_error";
      e.code = "model_not_found";
      e.message = fmt::format("The model '{}' does not exist", std::string(req.matches[1]));
      return send_error(res, e, false);
    }
    res.set_content(dump(model), kJson);
    return;
  }
  res.set_content(dump(ojson{{"object", "list"}, {"data", ojson::array({model})}}), kJson);
}

void Server::Impl::handle_generate(const httplib::Request& req, httplib::Response& res,
                                   Endpoint endpoint) {
  const auto arrival = Clock::now();
  const bool anthropic = endpoint == Endpoint::kMessages;
  if (draining.load()) {
    ApiError e;
    e.status = 503;
    e.type = "overloaded_error";
    e.message = "the server is shutting down";
    res.set_header("Connection", "close");
    return send_error(res, e, anthropic);
  }
  if (!authorized(req)) {
    ApiError e;
    e.status = 401;
    e.type = "authentication_error";
    e.code = "invalid_api_key";
    e.message = "missing or incorrect API key (send Authorization: Bearer KEY or x-api-key)";
    return send_error(res, e, anthropic);
  }
  auto body = parse_body(req.body);
  if (!body.ok()) return send_error(res, body.error(), anthropic);
  auto parsed = endpoint == Endpoint::kChat          ? parse_chat_request(*body, ctx)
                : endpoint == Endpoint::kCompletions ? parse_completion_request(*body, ctx)
                                                     : parse_messages_request(*body, ctx);
  if (!parsed.ok()) return send_error(res, parsed.error(), anthropic);

  auto gen = std::make_shared<Generation>(engine, ctx, std::move(*parsed), metrics, arrival);
  auto started = gen->start();
  if (!started.ok()) return send_error(res, started.error(), anthropic);
  const int fd = find_socket(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
  if (gen->request().stream) return stream(std::move(gen), fd, res);

  std::vector<ChoiceUpdate> updates;
  while (!gen->done()) {
    const auto w = gen->wait(fd, 1000);
    if (w == Generation::Wait::kClientGone) {
      gen->cancel(true);
      metrics->client_disconnected();
      res.status = 499;  // nobody reads it; keeps the access counters honest
      res.set_header("Connection", "close");
      return;
    }
    gen->recycle(&updates);
    gen->drain(&updates);
  }
  for (const auto& c : gen->choices()) {
    if (c.reason == FinishReason::kError) {
      ApiError e;
      e.status = 500;
      e.type = "server_error";
      e.message = c.message;
      return send_error(res, e, anthropic);
    }
  }
  res.set_content(dump(anthropic ? anthropic_response(*gen) : openai_response(*gen)), kJson);
}

void Server::Impl::stream(std::shared_ptr<Generation> gen, int fd, httplib::Response& res) {
  if (fd >= 0) {
    // Each event is a small write; Nagle would hold it back for the previous one's ACK.
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  // httplib has sent the headers when it calls the provider; from then on the stream writer
  // writes the body (straight to the socket when it is known) and this thread only waits.
  auto provider = [this, gen, fd](size_t, httplib::DataSink& sink) -> bool {
    std::shared_ptr<SseStream> s;
    try {
      s = writer->add(gen, fd);
    } catch (...) {
      gen->cancel();
      return false;
    }
    std::string data;
    for (;;) {
      switch (s->next(&data)) {
        case SseStream::Next::kData:  // relayed: no socket of our own to write to
          if (!sink.write(data.data(), data.size())) {
            s->client_gone();
            return false;
          }
          break;
        case SseStream::Next::kDone:
          sink.done();
          return true;
        case SseStream::Next::kGone:
          return false;
      }
    }
  };
  // The releaser runs when the response is destroyed, written or not; dropping the last
  // reference to the generation cancels whatever it still has running.
  res.set_chunked_content_provider("text/event-stream", std::move(provider),
                                   [gen](bool) mutable { gen.reset(); });
}

Server::Server(Engine& engine, const Tokenizer* tokenizer, const ChatTemplate* chat_template,
               ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {
  ServingContext& ctx = impl_->ctx;
  const ModelInfo& info = engine.model_info();
  ctx.model_name = impl_->options.model_name;
  ctx.vocab_size = info.vocab_size;
  ctx.max_context = engine.config().max_context;
  ctx.generation = info.generation;
  ctx.eos_token_ids = info.eos_token_ids;
  ctx.tokenizer = tokenizer;
  ctx.chat_template = chat_template;
  if (chat_template) ctx.tool_format = detect_tool_call_format(chat_template->source());
  impl_->setup();
  auto writer = StreamWriter::create(impl_->metrics);
  if (writer.ok()) {
    impl_->writer = std::move(*writer);
    engine.set_step_listener([w = impl_->writer.get()] { w->step_done(); });
  } else {
    impl_->writer_status = writer.error();
  }
}

Server::~Server() {
  shutdown();
  impl_->engine.set_step_listener({});  // before the writer goes
}

const ServingContext& Server::context() const {
  return impl_->ctx;
}

Result<int> Server::bind() {
  if (!impl_->writer_status.ok()) return impl_->writer_status.error();
  // A client that vanishes mid-write must not kill the process.
  std::signal(SIGPIPE, SIG_IGN);
  int port = impl_->options.port;
  if (port == 0) {
    port = impl_->http.bind_to_any_port(impl_->options.host);
    if (port <= 0) {
      return make_error(ErrorCode::kIo, "cannot bind to {} (any port)", impl_->options.host);
    }
  } else if (!impl_->http.bind_to_port(impl_->options.host, port)) {
    return make_error(ErrorCode::kIo, "cannot bind to {}:{} (in use, or not an address here?)",
                      impl_->options.host, port);
  }
  impl_->http.raise_backlog(1024);
  return port;
}

Status Server::serve() {
  if (impl_->shut_down.load()) return {};
  if (!impl_->http.listen_after_bind() && !impl_->shut_down.load()) {
    return make_error(ErrorCode::kIo, "the HTTP server stopped unexpectedly");
  }
  return {};
}

void Server::shutdown() {
  if (impl_->shut_down.exchange(true)) return;
  impl_->draining = true;
  impl_->http.stop();  // closes the listening socket; workers finish their connections
  Engine& engine = impl_->engine;
  engine.stop_accepting();
  if (!engine.wait_idle(impl_->options.shutdown_grace)) {
    engine.cancel_all();
    engine.wait_idle(std::chrono::seconds(10));
  }
}

}  // namespace recur::server
