// `recur serve`: loads a model into one batching engine and serves the OpenAI and Anthropic
// HTTP APIs over it until SIGTERM or SIGINT, then drains in-flight requests and exits 0.
#include <fmt/format.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "backend/cpu/cpu_ops.h"
#include "cli/commands.h"
#include "engine/engine.h"
#include "server/server.h"
#include "tokenizer/chat_template.h"

namespace recur::cli {

namespace {

struct ServeOptions {
  std::string model, host = "127.0.0.1", api_key, served_model_name;
  int port = 8080;
  int max_batch = 32;
  int max_batch_tokens = 512;
  int max_context = 0;
  int64_t kv_cache_mb = 1024;
  int threads = 0;
  int http_threads = 0;
  int64_t max_body_mb = 8;
  int shutdown_grace_s = 30;
  std::optional<uint64_t> seed;
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
  const auto t0 = std::chrono::steady_clock::now();
  fmt::print("loading {} ...\n", o.model);
  std::fflush(stdout);
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<ChatTemplate> chat_template;
  if (std::filesystem::exists(std::filesystem::path(o.model) / "tokenizer.json")) {
    auto t = Tokenizer::load(o.model);
    if (!t.ok()) return fail(t.error());
    tokenizer = std::make_unique<Tokenizer>(std::move(*t));
    auto ct = ChatTemplate::load(o.model);
    if (ct.ok()) {
      chat_template = std::make_unique<ChatTemplate>(std::move(*ct));
    } else {
      fmt::print(stderr, "warning: no chat endpoints: {}\n", ct.error().to_string());
    }
  } else {
    fmt::print(stderr, "warning: {} has no tokenizer.json: token-id prompts only\n", o.model);
  }

  CpuOps ops(o.threads > 0 ? o.threads : default_thread_count());
  EngineConfig cfg;
  cfg.max_batch = o.max_batch;
  cfg.max_batch_tokens = std::max(o.max_batch_tokens, o.max_batch);
  cfg.max_context = o.max_context;
  cfg.kv_cache_bytes = o.kv_cache_mb << 20;
  if (o.seed) cfg.seed = *o.seed;
  auto created = Engine::create(o.model, ops, cfg, tokenizer.get());
  if (!created.ok()) return fail(created.error());
  Engine& engine = **created;
  engine.start();
  const ModelInfo& info = engine.model_info();
  fmt::print(
      "loaded in {:.1f}s: {:.1f} MiB of weights, vocab {}, context {}, max batch {}, "
      "{} attention-cache blocks\n",
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
      double(info.weight_bytes) / (1 << 20), info.vocab_size, engine.config().max_context,
      engine.config().max_batch, engine.config().kv_blocks);

  server::ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.api_key = o.api_key;
  so.model_name = o.served_model_name.empty()
                      ? std::filesystem::path(o.model).lexically_normal().filename().string()
                      : o.served_model_name;
  if (so.model_name.empty())
    so.model_name = std::filesystem::path(o.model).parent_path().filename().string();
  so.max_body_bytes = size_t(o.max_body_mb) << 20;
  so.http_threads = o.http_threads;
  so.shutdown_grace = std::chrono::seconds(o.shutdown_grace_s);
  server::Server srv(engine, tokenizer.get(), chat_template.get(), so);
  auto port = srv.bind();
  if (!port.ok()) return fail(port.error());
  const std::string host = o.host.find(':') != std::string::npos ? "[" + o.host + "]" : o.host;
  fmt::print(
      "serving model \"{}\" at http://{}:{}  (POST /v1/chat/completions, /v1/completions, "
      "/v1/messages; GET /v1/models, /health, /metrics)\n",
      so.model_name, host, *port);
  std::fflush(stdout);

  std::atomic<bool> finished{false};
  std::thread signal_thread([&] {
    const timespec tick{0, 200 * 1000 * 1000};
    while (!finished.load()) {
      const int sig = sigtimedwait(&signals, nullptr, &tick);
      if (sig == SIGTERM || sig == SIGINT) {
        fmt::print("received {}: finishing in-flight requests\n",
                   sig == SIGTERM ? "SIGTERM" : "SIGINT");
        std::fflush(stdout);
        srv.shutdown();
        return;
      }
    }
  });
  Status st = srv.serve();
  finished = true;
  srv.shutdown();
  signal_thread.join();
  if (!st.ok()) return fail(st.error());
  fmt::print("stopped\n");
  std::fflush(stdout);
  return 0;
}

}  // namespace

void register_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "Serve the OpenAI and Anthropic HTTP APIs");
  auto o = std::make_shared<ServeOptions>();
  cmd->add_option("--model", o->model, "model directory")->required();
  cmd->add_option("--host", o->host, "address to listen on");
  cmd->add_option("--port", o->port, "port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", o->api_key, "require this key (Authorization: Bearer, x-api-key)");
  cmd->add_option("--served-model-name", o->served_model_name,
                  "the model name clients use (default: the directory's name)");
  cmd->add_option("--max-batch", o->max_batch, "sequences decoded at once")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-batch-tokens", o->max_batch_tokens, "tokens per engine step")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-context", o->max_context, "context length (default: the model's)")
      ->check(CLI::Range(0, 1 << 30));
  cmd->add_option("--kv-cache-mb", o->kv_cache_mb, "attention-cache budget in MiB")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 24));
  cmd->add_option("--threads", o->threads, "CPU threads (default: all)")
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--http-threads", o->http_threads,
                  "HTTP worker threads (default: from --max-batch)")
      ->check(CLI::Range(0, 65536));
  cmd->add_option("--max-body-mb", o->max_body_mb, "largest request body accepted, MiB")
      ->check(CLI::Range(int64_t(1), int64_t(1024)));
  cmd->add_option("--shutdown-grace", o->shutdown_grace_s,
                  "seconds in-flight requests may run after SIGTERM before they are cancelled")
      ->check(CLI::Range(0, 86400));
  cmd->add_option("--seed", o->seed, "seed for requests that give none (default: random)");
  cmd->callback([o] {
    int rc = run_serve(*o);
    if (rc != 0) exit_with(rc);
  });
}

}  // namespace recur::cli
