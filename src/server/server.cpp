#include "server/server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <ctime>

#include "server/ascii.h"
#include "server/format.h"
#include "server/generation.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/stream_writer.h"

namespace recur::server {

namespace {

enum class Route {
  kChat,
  kCompletions,
  kMessages,
  kCountTokens,
  kResponses,
  kModels,
  kModel,
  kHealth,
  kMetrics,
  kTokenize,
  kDetokenize,
  kVersion,
  kPing
};

struct RouteInfo {
  const char* path;
  Route route;
};

constexpr RouteInfo kRoutes[] = {
    {"/v1/chat/completions", Route::kChat},
    {"/v1/completions", Route::kCompletions},
    {"/v1/messages", Route::kMessages},
    {"/v1/messages/count_tokens", Route::kCountTokens},
    {"/v1/responses", Route::kResponses},
    {"/v1/models", Route::kModels},
    {"/health", Route::kHealth},
    {"/metrics", Route::kMetrics},
    {"/tokenize", Route::kTokenize},
    {"/detokenize", Route::kDetokenize},
    {"/version", Route::kVersion},
    {"/ping", Route::kPing},
};

// The project's version (CMakeLists.txt), as `recur --version` prints it.
constexpr const char* kServerVersion = RECUR_VERSION;

std::optional<Route> find_route(const std::string& path) {
  for (const RouteInfo& r : kRoutes) {
    if (path == r.path) return r.route;
  }
  if (path.size() > 11 && path.rfind("/v1/models/", 0) == 0) return Route::kModel;
  return std::nullopt;
}

const char* route_label(std::optional<Route> r) {
  if (!r) return "other";
  if (*r == Route::kModel) return "/v1/models";
  for (const RouteInfo& info : kRoutes) {
    if (info.route == *r) return info.path;
  }
  return "other";
}

bool is_post(Route r) {
  return r == Route::kChat || r == Route::kCompletions || r == Route::kMessages ||
         r == Route::kCountTokens || r == Route::kResponses || r == Route::kTokenize ||
         r == Route::kDetokenize;
}

const char* allowed_methods(Route r) {
  if (r == Route::kPing) return "GET, HEAD, POST, OPTIONS";  // as vLLM (SageMaker's probe)
  return is_post(r) ? "POST, OPTIONS" : "GET, HEAD, OPTIONS";
}

// Routes that cost work, refused without the API key: the API's, and (beyond vLLM, which
// guards /v1 only) tokenizing.
bool needs_key(const http::Request& req, std::optional<Route> r) {
  return req.path.rfind("/v1/", 0) == 0 || r == Route::kTokenize || r == Route::kDetokenize;
}

// Anthropic SDKs send anthropic-version on every request; /v1/messages is theirs alone.
bool anthropic_client(const http::Request& req) {
  return req.path.rfind("/v1/messages", 0) == 0 || req.header("anthropic-version");
}

// Constant-time comparison: the key must not leak through response timing.
bool same_key(const std::string& given, const std::string& key) {
  if (given.size() != key.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < key.size(); ++i) diff |= uint8_t(given[i] ^ key[i]);
  return diff == 0;
}

// OpenAI's error types (ApiError::to_json gives Anthropic clients theirs).
ApiError error_for(int status, std::string message) {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  if (status == 401) e.code = "invalid_api_key";
  // 501 and 505: a transfer coding or an HTTP version the client chose.
  if (status >= 500 && status != 501 && status != 505) e.type = "server_error";
  return e;
}

http::Response json_response(int status, const ojson& body) {
  http::Response res;
  res.status = status;
  res.body = dump(body);
  return res;
}

http::Response error_json(const ApiError& e, bool anthropic) {
  return json_response(e.status, e.to_json(anthropic));
}

std::string rfc3339(int64_t t) {
  std::tm tm{};
  const std::time_t tt = std::time_t(t);
  gmtime_r(&tt, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

struct Server::Impl final : HttpHandler {
  Engine& engine;
  ServerOptions options;
  ServingContext ctx;
  std::shared_ptr<Metrics> metrics = std::make_shared<Metrics>();
  int64_t started_at = int64_t(std::time(nullptr));
  // Declared before http: it outlives the worker threads that wait on its streams.
  std::unique_ptr<StreamWriter> writer;
  Status writer_status;  // why there is no writer; reported by bind()
  std::unique_ptr<HttpServer> http;
  std::atomic<bool> draining{false};
  std::atomic<bool> shut_down{false};
  std::atomic<bool> engine_idle{true};  // as the first shutdown() found the engine

  Impl(Engine& e, ServerOptions o) : engine(e), options(std::move(o)) {}

  bool authorized(const http::Request& req) const {
    if (options.api_key.empty()) return true;
    if (const std::string* auth = req.header("authorization")) {
      // The scheme's name is case-insensitive (RFC 9110, 11.1).
      if (auth->size() > 7 && iequals(std::string_view(*auth).substr(0, 7), "Bearer ") &&
          same_key(auth->substr(7), options.api_key)) {
        return true;
      }
    }
    const std::string* key = req.header("x-api-key");
    return key && same_key(*key, options.api_key);
  }

  bool origin_allowed(const std::string& origin) const {
    for (const std::string& o : options.allowed_origins) {
      if (o == "*" || o == origin) return true;
    }
    return false;
  }

  http::Response error(const http::Request& req, int status, std::string message) {
    return error_json(error_for(status, std::move(message)), anthropic_client(req));
  }

  // HttpHandler
  std::optional<http::Response> on_head(const http::Request& req) override;
  void handle(http::Request& req, HttpExchange& ex) override;
  http::Response error_response(const http::Request* req, int status,
                                std::string message) override {
    return error_json(error_for(status, std::move(message)), req && anthropic_client(*req));
  }
  void finish(const http::Request* req, http::Response& res) override;

  http::Response preflight(const http::Request& req, Route route);
  http::Response models(const http::Request& req, Route route);
  void generate(http::Request& req, HttpExchange& ex, Endpoint endpoint);
  void stream(std::shared_ptr<Generation> gen, HttpExchange& ex);
  void count_tokens(http::Request& req, HttpExchange& ex);
  void tokenize(http::Request& req, HttpExchange& ex, Route route);
};

std::optional<http::Response> Server::Impl::on_head(const http::Request& req) {
  if (const std::string* origin = req.header("origin"); origin && !origin_allowed(*origin)) {
    return error(req, 403,
                 fmt::format("requests from the web origin '{}' are not allowed; start the server "
                             "with --allowed-origins {} (or '*') to allow them",
                             *origin, *origin));
  }
  const std::optional<Route> route = find_route(req.path);
  if (!route) {
    return error(req, 404,
                 fmt::format("no route {}; the routes are POST /v1/chat/completions, "
                             "/v1/completions, /v1/responses, /v1/messages, "
                             "/v1/messages/count_tokens, /tokenize, /detokenize and GET "
                             "/v1/models, /health, /metrics, /version, /ping",
                             req.path));
  }
  if (req.method == "OPTIONS") return preflight(req, *route);
  if (*route == Route::kPing && req.method == "POST") return json_response(200, ojson::object());
  const bool post = is_post(*route);
  if (post ? req.method != "POST" : (req.method != "GET" && req.method != "HEAD")) {
    http::Response res = error(req, 405,
                               fmt::format("{} is not allowed on {}; use {}", req.method, req.path,
                                           post ? "POST" : "GET"));
    res.set_header("Allow", allowed_methods(*route));
    return res;
  }
  // Before any body byte is read: a refused client costs no memory.
  if (needs_key(req, route) && !authorized(req)) {
    http::Response res = error(
        req, 401, "missing or incorrect API key (send Authorization: Bearer KEY or x-api-key)");
    res.set_header("WWW-Authenticate", "Bearer");
    return res;
  }
  if (draining.load() && (post || *route == Route::kHealth)) {
    if (*route == Route::kHealth) return json_response(503, {{"status", "shutting down"}});
    return error(req, 503, "the server is shutting down");
  }
  switch (*route) {
    case Route::kHealth:
      return json_response(200, {{"status", "ok"}});
    case Route::kMetrics: {
      http::Response res;
      res.content_type = "text/plain; version=0.0.4; charset=utf-8";
      // Settled: a sequence whose release the gauges show is counted in the finishes too.
      res.body = metrics->render(engine.settled_stats());
      return res;
    }
    case Route::kModels:
    case Route::kModel:
      return models(req, *route);
    case Route::kVersion:
      return json_response(200, {{"version", kServerVersion}});
    case Route::kPing:
      return json_response(200, ojson::object());
    default:
      return std::nullopt;  // POST: the body is read, then handle() runs on a worker
  }
}

http::Response Server::Impl::preflight(const http::Request& req, Route route) {
  http::Response res;
  res.status = 204;
  res.content_type.clear();
  res.set_header("Allow", allowed_methods(route));
  if (req.header("origin") && req.header("access-control-request-method")) {
    res.set_header("Access-Control-Allow-Methods", allowed_methods(route));
    const std::string* headers = req.header("access-control-request-headers");
    res.set_header(
        "Access-Control-Allow-Headers",
        headers ? *headers : "authorization, content-type, x-api-key, anthropic-version");
    res.set_header("Access-Control-Max-Age", "600");
  }
  return res;
}

void Server::Impl::finish(const http::Request* req, http::Response& res) {
  // An id per response, for logs and support, under the header each API's clients read.
  try {
    res.set_header(req && anthropic_client(*req) ? "request-id" : "x-request-id",
                   random_id("req_"));
  } catch (...) {
  }
  if (req) {
    // on_head refused origins not allowed, so an Origin still here is allowed.
    if (const std::string* origin = req->header("origin"); origin && origin_allowed(*origin)) {
      res.set_header("Access-Control-Allow-Origin", *origin);
      res.set_header("Vary", "Origin");
    }
  }
  try {
    metrics->http_request(route_label(req ? find_route(req->path) : std::nullopt), res.status);
  } catch (...) {
  }
}

http::Response Server::Impl::models(const http::Request& req, Route route) {
  const bool anthropic = req.header("anthropic-version") != nullptr;
  if (route == Route::kModel) {
    const auto id = http::percent_decode(std::string_view(req.path).substr(11));
    if (!id || *id != ctx.model_name) {
      ApiError e = error_for(404, fmt::format("The model '{}' does not exist; this server serves "
                                              "'{}'",
                                              id.value_or(req.path.substr(11)), ctx.model_name));
      e.code = "model_not_found";
      return error_json(e, anthropic);
    }
  }
  if (anthropic) {
    const ojson model = {{"type", "model"},
                         {"id", ctx.model_name},
                         {"display_name", ctx.model_name},
                         {"created_at", rfc3339(started_at)}};
    if (route == Route::kModel) return json_response(200, model);
    return json_response(200, {{"data", ojson::array({model})},
                               {"has_more", false},
                               {"first_id", ctx.model_name},
                               {"last_id", ctx.model_name}});
  }
  const ojson model = {{"id", ctx.model_name},
                       {"object", "model"},
                       {"created", started_at},
                       {"owned_by", "recur"},
                       {"max_model_len", ctx.max_context}};
  if (route == Route::kModel) return json_response(200, model);
  return json_response(200, {{"object", "list"}, {"data", ojson::array({model})}});
}

void Server::Impl::handle(http::Request& req, HttpExchange& ex) {
  metrics->http_in_flight(1);
  struct Done {
    Metrics& m;
    ~Done() { m.http_in_flight(-1); }
  } done{*metrics};
  switch (find_route(req.path).value_or(Route::kHealth)) {
    case Route::kChat:
      return generate(req, ex, Endpoint::kChat);
    case Route::kCompletions:
      return generate(req, ex, Endpoint::kCompletions);
    case Route::kMessages:
      return generate(req, ex, Endpoint::kMessages);
    case Route::kResponses:
      return generate(req, ex, Endpoint::kResponses);
    case Route::kCountTokens:
      return count_tokens(req, ex);
    case Route::kTokenize:
    case Route::kDetokenize:
      return tokenize(req, ex, *find_route(req.path));
    default:  // on_head answers every other route itself
      ex.send(error(req, 404, "no such route"));
  }
}

void Server::Impl::count_tokens(http::Request& req, HttpExchange& ex) {
  auto body = parse_body(req.body);
  if (!body.ok()) {
    ex.send(error_json(body.error(), true));
    return;
  }
  auto n = count_message_tokens(*body, ctx);
  if (!n.ok()) {
    ex.send(error_json(n.error(), true));
    return;
  }
  ex.send(json_response(200, {{"input_tokens", *n}}));
}

void Server::Impl::tokenize(http::Request& req, HttpExchange& ex, Route route) {
  auto body = parse_body(req.body);
  if (!body.ok()) return (void)ex.send(error_json(body.error(), false));
  if (route == Route::kDetokenize) {
    auto text = parse_detokenize_request(*body, ctx);
    if (!text.ok()) return (void)ex.send(error_json(text.error(), false));
    return (void)ex.send(json_response(200, {{"prompt", *text}}));
  }
  auto tok = parse_tokenize_request(*body, ctx);
  if (!tok.ok()) return (void)ex.send(error_json(tok.error(), false));
  ojson out = {
      {"count", tok->ids.size()}, {"max_model_len", ctx.max_context}, {"tokens", tok->ids}};
  if (tok->token_strs) {
    ojson strs = ojson::array();
    for (int32_t id : tok->ids) strs.push_back(std::string(ctx.tokenizer->id_to_token(id)));
    out["token_strs"] = std::move(strs);
  }
  ex.send(json_response(200, out));
}

void Server::Impl::generate(http::Request& req, HttpExchange& ex, Endpoint endpoint) {
  const auto arrival = Clock::now();
  const bool anthropic = endpoint == Endpoint::kMessages;
  auto fail = [&](const ApiError& e) { ex.send(error_json(e, anthropic)); };
  if (draining.load()) {
    ex.close_connection();
    return fail(error_for(503, "the server is shutting down"));
  }
  auto body = parse_body(req.body);
  if (!body.ok()) return fail(body.error());
  auto parsed = endpoint == Endpoint::kChat          ? parse_chat_request(*body, ctx)
                : endpoint == Endpoint::kCompletions ? parse_completion_request(*body, ctx)
                : endpoint == Endpoint::kResponses   ? parse_responses_request(*body, ctx)
                                                     : parse_messages_request(*body, ctx);
  if (!parsed.ok()) return fail(parsed.error());
  std::string().swap(req.body);  // parsed: the raw body is not needed while generating

  auto gen = std::make_shared<Generation>(engine, ctx, std::move(*parsed), metrics, arrival);
  auto started = gen->start();
  if (!started.ok()) return fail(started.error());
  if (gen->request().stream) return stream(std::move(gen), ex);

  std::vector<ChoiceUpdate> updates;
  while (!gen->done()) {
    if (gen->wait(ex.fd(), 1000) == Generation::Wait::kClientGone) {
      // Counted before the cancel, as the stream writer does: a /metrics read that sees the
      // slot freed sees the disconnect too.
      metrics->client_disconnected();
      metrics->http_request(route_label(find_route(req.path)), 499);  // nobody reads it
      gen->cancel(true);
      ex.abandon();
      return;
    }
    gen->recycle(&updates);
    gen->drain(&updates);
  }
  for (const auto& c : gen->choices()) {
    if (c.reason == FinishReason::kError) return fail(error_for(500, c.message));
    // The Messages API has no stop reason for an answer cut short (the OpenAI routes have one):
    // one the shutdown ended is an error there, not an end_turn a client would take as whole.
    if (anthropic && c.reason == FinishReason::kCancelled) {
      return fail(error_for(503, cut_answer_message(c.message)));
    }
  }
  const ojson out = anthropic                          ? anthropic_response(*gen)
                    : endpoint == Endpoint::kResponses ? responses_response(*gen)
                                                       : openai_response(*gen);
  ex.send(json_response(200, out));
}

void Server::Impl::stream(std::shared_ptr<Generation> gen, HttpExchange& ex) {
  http::Response head;
  head.content_type = "text/event-stream";
  head.set_header("Cache-Control", "no-cache");
  head.set_header("X-Accel-Buffering", "no");
  if (!ex.begin_chunked(std::move(head))) {
    metrics->client_disconnected();
    gen->cancel(true);
    return;
  }
  // From here the stream writer sends the chunks straight to the socket; this thread waits.
  std::shared_ptr<SseStream> s;
  try {
    s = writer->add(gen, ex.fd(), ex.chunked());
  } catch (...) {
    gen->cancel();
    ex.close_connection();
    return;
  }
  std::string data;
  for (;;) {
    switch (s->next(&data)) {
      case SseStream::Next::kData:  // relayed (the writer had no socket)
        if (!ex.write_chunk(data)) {
          s->client_gone();
          ex.close_connection();
          return;
        }
        break;
      case SseStream::Next::kDone:
        if (!ex.end_chunked()) ex.close_connection();
        return;
      case SseStream::Next::kGone:
        ex.close_connection();
        return;
    }
  }
}

Server::Server(Engine& engine, const Tokenizer* tokenizer, const ChatTemplate* chat_template,
               ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {
  Impl& m = *impl_;
  ServingContext& ctx = m.ctx;
  const ModelInfo& info = engine.model_info();
  ctx.model_name = m.options.model_name;
  ctx.vocab_size = info.vocab_size;
  ctx.max_context = engine.config().max_context;
  ctx.generation = info.generation;
  ctx.eos_token_ids = info.eos_token_ids;
  ctx.tokenizer = tokenizer;
  if (tokenizer) ctx.vocab_bytes = VocabularyBytes::build(*tokenizer);
  ctx.chat_template = chat_template;
  if (chat_template) ctx.tool_format = detect_tool_call_format(chat_template->source());
  if (tokenizer && ctx.tool_format == ToolCallFormat::kKimi) {
    ctx.kimi_vocab_bytes = kimi_call_vocabulary(*tokenizer, *ctx.vocab_bytes);
  }
  ctx.allow_unknown_fields = m.options.allow_unknown_fields;
  if (!chat_template) ctx.chat_template_error = m.options.chat_template_error;

  HttpServerOptions ho;
  ho.host = m.options.host;
  ho.port = m.options.port;
  ho.max_connections = m.options.max_connections;
  // A worker per request whose body has arrived: generations the engine runs or queues.
  ho.workers = m.options.http_threads > 0 ? m.options.http_threads
                                          : std::max(64, 4 * engine.config().max_batch + 32);
  ho.limits.max_body = m.options.max_body_bytes;
  ho.body_budget_bytes = std::max(size_t(256) << 20, 4 * m.options.max_body_bytes);
  ho.header_timeout = m.options.header_timeout;
  ho.body_timeout = m.options.body_timeout;
  ho.idle_timeout = m.options.idle_timeout;
  m.http = std::make_unique<HttpServer>(ho, m, m.metrics);

  auto writer = StreamWriter::create(m.metrics, ho.write_timeout);
  if (writer.ok()) {
    m.writer = std::move(*writer);
    engine.set_step_listener([w = m.writer.get()] { w->step_done(); });
  } else {
    m.writer_status = writer.error();
  }
}

Server::~Server() {
  shutdown();
  impl_->http.reset();                  // its workers end before the writer goes
  impl_->engine.set_step_listener({});  // before the writer goes
}

const ServingContext& Server::context() const {
  return impl_->ctx;
}

Result<int> Server::bind() {
  if (!impl_->writer_status.ok()) return impl_->writer_status.error();
  // Every send passes MSG_NOSIGNAL; this covers any other write to a closed socket.
  std::signal(SIGPIPE, SIG_IGN);
  return impl_->http->bind();
}

Status Server::serve() {
  if (impl_->shut_down.load()) return {};
  return impl_->http->run();
}

bool Server::shutdown() {
  if (impl_->shut_down.exchange(true)) return impl_->engine_idle.load();
  impl_->draining = true;
  impl_->http->set_draining();  // still accepting: /health answers 503 meanwhile
  Engine& engine = impl_->engine;
  engine.stop_accepting();
  bool idle = engine.wait_idle(impl_->options.shutdown_grace);
  if (!idle) {
    engine.cancel_all();
    idle = engine.wait_idle(std::chrono::seconds(10));
  }
  impl_->engine_idle = idle;
  impl_->http->stop();
  return idle;
}

}  // namespace recur::server
