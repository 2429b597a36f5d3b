// `recur serve`: loads a model into one batching engine and serves the OpenAI and Anthropic
// HTTP APIs over it until SIGTERM or SIGINT, then drains in-flight requests and exits 0.
#include <fmt/format.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/engine_options.h"
#include "engine/engine.h"
#include "server/http_server.h"
#include "server/server.h"
#include "tokenizer/chat_template.h"

namespace recur::cli {

namespace {

struct ServeOptions {
  EngineOptions engine;  // --model, --device, --max-batch, --seed, ...
  std::string host = "127.0.0.1", api_key, served_model_name;
  int port = 8080;
  int http_threads = 0;
  int max_connections = 1024;
  int64_t max_body_mb = 8;
  double header_timeout_s = 10, body_timeout_s = 60, idle_timeout_s = 5;
  std::vector<std::string> allowed_origins;
  bool allow_unknown_fields = false;
  bool special_tokens_in_requests = false;  // transformers' behaviour: request text may hold
                                            // control tokens
  int shutdown_grace_s = 30;
  std::string prefix_cache_dir;  // the prefix cache's file lives there across restarts

  ServeOptions() { engine.max_batch = 32; }
};

int run_serve(const ServeOptions& o) {
  // Signals are taken by one thread with sigwait; every thread started below inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto fail = [](const Error& e) {
    fmt::print(stderr, "error: {}\n", e.to_string());
    return 2;
  };
  const std::string& model = o.engine.model;
  const auto t0 = std::chrono::steady_clock::now();
  auto ops = create_backend(o.engine);  // first: a device that is not there fails at once
  if (!ops.ok()) return fail(ops.error());
  if (!std::filesystem::is_directory(model)) {  // before any warning about what it lacks
    return fail(make_error(ErrorCode::kNotFound, "--model {}: no such directory", model));
  }
  // A port in use is said now, not after a load of minutes (bind() below says it too should
  // another process take the port meanwhile).
  if (Status st = server::check_listen_address(o.host, o.port); !st.ok()) return fail(st.error());
  fmt::print("loading {} on {} ...\n", model, o.engine.device);
  std::fflush(stdout);
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<ChatTemplate> chat_template;
  std::string chat_template_error;  // a template that is there but broken
  if (Tokenizer::found_in(model)) {
    auto t = Tokenizer::load(model);
    if (!t.ok()) return fail(t.error());
    tokenizer = std::make_unique<Tokenizer>(std::move(*t));
    ChatTemplateOptions cto;
    cto.request_special_tokens_as_text = !o.special_tokens_in_requests;
    auto ct = ChatTemplate::load(model, cto);
    if (ct.ok()) {
      chat_template = std::make_unique<ChatTemplate>(std::move(*ct));
    } else {
      fmt::print(stderr, "warning: no chat endpoints: {}\n", ct.error().to_string());
      if (ct.error().code != ErrorCode::kNotFound) chat_template_error = ct.error().to_string();
    }
  } else {
    fmt::print(stderr,
               "warning: {} has no tokenizer.json or tiktoken.model: token-id prompts only\n",
               model);
  }

  EngineConfig config = engine_config(o.engine);
  if (!o.prefix_cache_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.prefix_cache_dir, ec);
    if (ec) {
      return fail(Error{ErrorCode::kIo, fmt::format("--prefix-cache-dir {}: {}", o.prefix_cache_dir,
                                                    ec.message())});
    }
    config.prefix_cache_file =
        (std::filesystem::path(o.prefix_cache_dir) / "prefix-cache.bin").string();
  }
  auto created = Engine::create(model, **ops, config, tokenizer.get());
  if (!created.ok()) return fail(created.error());
  Engine& engine = **created;
  engine.start();
  const ModelInfo& info = engine.model_info();
  fmt::print(
      "loaded {} in {:.1f}s: {:.1f} MiB of weights, vocab {}, context {}, max batch {}, "
      "{} attention-cache blocks\n",
      info.architecture,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
      double(info.weight_bytes) / (1 << 20), info.vocab_size, engine.config().max_context,
      engine.config().max_batch, engine.config().kv_blocks);
  // What the attention cache holds: a context of every block (one sequence alone).
  fmt::print("attention cache: {}, {} bytes per token, {} tokens in all ({} blocks of {})\n",
             dtype_name(config.kv_cache_dtype), info.kv_bytes_per_token,
             int64_t(engine.config().kv_blocks) * engine.config().block_size,
             engine.config().kv_blocks, engine.config().block_size);
  // The context one sequence may reach is what the cache holds when that is less.
  const int asked =
      config.max_context > 0 ? std::min(config.max_context, info.max_position) : info.max_position;
  if (engine.config().max_context < asked) {
    fmt::print(
        "context: {} tokens, what the attention cache holds for one sequence ({} "
        "otherwise; --kv-cache-mb raises it)\n",
        engine.config().max_context, asked);
  }
  for (const std::string& note : info.notes) fmt::print("note: {}\n", note);
  for (const std::string& note : engine.notes()) fmt::print("{}\n", note);

  server::ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.api_key = o.api_key;
  so.model_name = o.served_model_name.empty()
                      ? std::filesystem::path(model).lexically_normal().filename().string()
                      : o.served_model_name;
  if (so.model_name.empty())
    so.model_name = std::filesystem::path(model).parent_path().filename().string();
  so.max_body_bytes = size_t(o.max_body_mb) << 20;
  so.http_threads = o.http_threads;
  so.max_connections = o.max_connections;
  const auto ms = [](double s) { return std::chrono::milliseconds(int64_t(s * 1000)); };
  so.header_timeout = ms(o.header_timeout_s);
  so.body_timeout = ms(o.body_timeout_s);
  so.idle_timeout = ms(o.idle_timeout_s);
  so.allowed_origins = o.allowed_origins;
  so.allow_unknown_fields = o.allow_unknown_fields;
  so.chat_template_error = chat_template_error;
  so.shutdown_grace = std::chrono::seconds(o.shutdown_grace_s);
  server::Server srv(engine, tokenizer.get(), chat_template.get(), so);
  auto port = srv.bind();
  if (!port.ok()) return fail(port.error());
  fmt::print(
      "serving model \"{}\" at http://{}:{}  (POST /v1/chat/completions, /v1/completions, "
      "/v1/responses, /v1/messages, /v1/messages/count_tokens, /tokenize, /detokenize; GET "
      "/v1/models, /health, /metrics, /version, /ping)\n",
      so.model_name, server::url_host(o.host), *port);
  std::fflush(stdout);

  // The first signal drains (on its own thread, so that this one hears a second signal, which
  // exits at once, as uvicorn's and llama-server's second Ctrl-C does).
  std::atomic<bool> finished{false};
  std::thread drain_thread;
  std::thread signal_thread([&] {
    const timespec tick{0, 200 * 1000 * 1000};
    while (!finished.load()) {
      const int sig = sigtimedwait(&signals, nullptr, &tick);
      if (sig != SIGTERM && sig != SIGINT) continue;
      const char* name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
      if (drain_thread.joinable()) {
        fmt::print(stderr, "received {} again: exiting without waiting for in-flight requests\n",
                   name);
        std::fflush(stderr);
        std::_Exit(1);
      }
      fmt::print("received {}: finishing in-flight requests (send it again to exit at once)\n",
                 name);
      std::fflush(stdout);
      drain_thread = std::thread([&srv] { srv.shutdown(); });
    }
  });
  Status st = srv.serve();
  finished = true;
  const bool idle = srv.shutdown();
  signal_thread.join();
  if (drain_thread.joinable()) drain_thread.join();
  if (!idle) {
    // A step that does not end would hold the engine's thread, and exit, forever.
    fmt::print(stderr,
               "error: the engine was still busy {} s after SIGTERM (the grace period and 10 s "
               "after cancelling); exiting without waiting for it\n",
               o.shutdown_grace_s + 10);
    std::fflush(stderr);
    std::_Exit(1);
  }
  if (!st.ok()) return fail(st.error());
  if (!config.prefix_cache_file.empty()) {
    const Status saved = engine.save_prefix_cache();
    if (saved.ok()) {
      fmt::print("prefix cache written to {}\n", config.prefix_cache_file);
    } else {
      fmt::print(stderr, "warning: prefix cache not written: {}\n", saved.error().to_string());
    }
  }
  fmt::print("stopped\n");
  std::fflush(stdout);
  return 0;
}

}  // namespace

void register_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "Serve the OpenAI and Anthropic HTTP APIs");
  auto o = std::make_shared<ServeOptions>();
  add_engine_options(cmd, &o->engine, "seed for requests that give none (default: random)");
  cmd->add_option("--host", o->host, "address to listen on");
  cmd->add_option("--port", o->port, "port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", o->api_key, "require this key (Authorization: Bearer, x-api-key)");
  cmd->add_option("--served-model-name", o->served_model_name,
                  "the model name clients use (default: the directory's name)");
  cmd->add_option("--http-threads", o->http_threads, "HTTP worker threads (0: from --max-batch)")
      ->check(CLI::Range(0, 4096))
      ->default_str("from --max-batch");
  cmd->add_option("--max-body-mb", o->max_body_mb,
                  "largest request body accepted, MiB (chunked or not)")
      ->check(CLI::Range(int64_t(1), int64_t(1024)));
  cmd->add_option("--max-connections", o->max_connections,
                  "open connections at most; beyond it the oldest idle or slow one is closed")
      ->check(CLI::Range(16, 1 << 20));
  cmd->add_option("--header-timeout", o->header_timeout_s,
                  "seconds a request head may take from its first byte (then 408)")
      ->check(CLI::Range(0.1, 3600.0));
  cmd->add_option("--body-timeout", o->body_timeout_s,
                  "seconds a request body may take after its head (then 408)")
      ->check(CLI::Range(0.1, 3600.0));
  cmd->add_option("--idle-timeout", o->idle_timeout_s,
                  "seconds a connection may wait between requests before it is closed")
      ->check(CLI::Range(0.1, 3600.0));
  cmd->add_option("--allowed-origins", o->allowed_origins,
                  "web origins allowed to call the API (CORS), comma-separated; '*' for any; "
                  "requests from other origins are refused")
      ->delimiter(',');
  cmd->add_flag("--allow-unknown-fields", o->allow_unknown_fields,
                "ignore request fields the server does not know (default: 400 naming them)");
  cmd->add_flag("--special-tokens-in-requests", o->special_tokens_in_requests,
                "let special-token strings written in chat requests become control tokens, as "
                "transformers does (default: they are the text they spell)");
  cmd->add_option("--shutdown-grace", o->shutdown_grace_s,
                  "seconds in-flight requests may run after SIGTERM before they are cancelled")
      ->check(CLI::Range(0, 86400));
  cmd->add_option("--prefix-cache-dir", o->prefix_cache_dir,
                  "directory where the prefix cache is written at shutdown and read at start-up");
  cmd->callback([o] {
    int rc = run_serve(*o);
    if (rc != 0) exit_with(rc);
  });
}

}  // namespace recur::cli
