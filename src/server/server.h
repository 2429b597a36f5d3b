// `recur serve`: an OpenAI- and Anthropic-compatible HTTP server over one batching engine.
// Every request's sequences go through the same engine, so concurrent requests share decode
// steps; a client that goes away has its sequences cancelled at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "engine/engine.h"
#include "server/request.h"

namespace recur::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;      // 0: any free port
  std::string api_key;  // empty: no authentication
  std::string model_name;
  size_t max_body_bytes = size_t(8) << 20;  // whatever the transfer encoding
  int http_threads = 0;  // 0: enough for max_batch streams plus requests queued behind them
  int max_connections = 1024;
  std::chrono::milliseconds header_timeout{10000};  // a request head, from its first byte
  std::chrono::milliseconds body_timeout{60000};    // a request body, from its head
  std::chrono::milliseconds idle_timeout{5000};     // a connection between requests
  // Browser origins allowed to call the API (CORS); "*" allows any. A request that carries
  // an Origin not listed is refused, so web pages cannot drive a local server unasked.
  std::vector<std::string> allowed_origins;
  bool allow_unknown_fields = false;  // else a request field the server does not know is a 400
  std::string chat_template_error;    // the model directory's template failed to load: why
  std::chrono::milliseconds shutdown_grace{30000};  // then in-flight requests are cancelled
};

class Server {
 public:
  // The engine must be started and outlive the server; tokenizer and template may be null.
  Server(Engine& engine, const Tokenizer* tokenizer, const ChatTemplate* chat_template,
         ServerOptions options);
  ~Server();

  // Binds the listening socket; returns the port (useful with port 0).
  Result<int> bind();
  // Serves until shutdown() has run and in-flight requests have ended.
  Status serve();
  // Safe from any thread, once or more: refuses new requests (503, and /health answers 503),
  // lets running ones finish within the grace period, cancels the rest, then closes the
  // listener and every connection. False when the engine was still busy 10 s after cancelling
  // (a step that does not end: the caller may exit rather than wait on it).
  bool shutdown();

  const ServingContext& context() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace recur::server
