// The prefix cache (issue 19), with and without it in the same run, in a multi-turn chat and
// in concurrent requests sharing a system prompt; the description in main() is what --help
// prints. Under --config the tiny model's token ids fit the larger vocabularies; replies decode
// to nothing past its own.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "bench_util.h"
#include "engine/engine.h"
#include "io/checkpoint.h"
#include "model/registry.h"
#include "tokenizer/chat_template.h"

using namespace recur;
using Clock = std::chrono::steady_clock;
using ojson = nlohmann::ordered_json;

namespace {

[[noreturn]] void die(const std::string& what) {
  fmt::print(stderr, "{}\n", what);
  std::exit(1);
}

struct Options {
  int threads = 1;
  int turns = 20, turn_tokens = 300, reply_tokens = 32;
  int agents = 32, system_tokens = 8000, question_tokens = 200;
  int interval = 2048;
  std::vector<std::string> parts = {"chat", "agent"};
  std::string model = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";
  std::string config, device = "cpu";
  int layers = 0;
  int kv_cache_mb = 1024, prefix_cache_mb = 1024;
};

struct Outcome {
  Clock::time_point sent;
  double ttft_s = -1;
  int prompt = 0, cached = 0;
  std::string text;
  bool done = false;
};

EventSink sink(Outcome* o) {
  return [o](const Event& ev) {
    if (ev.kind == Event::Kind::kToken) {
      if (o->ttft_s < 0) o->ttft_s = std::chrono::duration<double>(Clock::now() - o->sent).count();
      o->text.append(ev.text);
    } else {
      o->text.append(ev.text);
      o->prompt = ev.prompt_tokens;
      o->cached = ev.cached_tokens;
      o->done = true;
    }
  };
}

struct Chat {
  const Tokenizer& tok;
  const ChatTemplate& tmpl;
  std::vector<int32_t> ids(const ojson& messages, const ojson& tools) const {
    ojson req = {{"messages", messages}, {"add_generation_prompt", true}};
    if (!tools.empty()) req["tools"] = tools;
    auto r = tmpl.render_prompt(req);
    if (!r.ok()) die("chat template: " + r.error().to_string());
    auto e = tok.encode(r->text, r->literal);
    if (!e.ok()) die("tokenizer: " + e.error().to_string());
    return *e;
  }
  // Plain words until the text is at least n tokens long.
  std::string words(int n, std::mt19937& rng) const {
    static const char* kWords[] = {
        "the",    "file",  "returns", "a",      "value",  "when",    "function", "call",
        "error",  "test",  "build",   "server", "memory", "request", "token",    "model",
        "cache",  "read",  "write",   "line",   "with",   "from",    "which",    "each",
        "branch", "merge", "review",  "state",  "layer",  "block",   "prompt",   "answer"};
    std::string s;
    int step = std::max(8, n / 8);
    for (;;) {
      for (int i = 0; i < step; ++i) {
        s += kWords[rng() % (sizeof(kWords) / sizeof(kWords[0]))];
        s += (rng() % 12 == 0) ? ". " : " ";
      }
      auto e = tok.encode(s);
      if (e.ok() && int(e->size()) >= n) return s;
      step = std::max(4, (n - int(e.ok() ? e->size() : 0)) / 2);
    }
  }
};

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

std::unique_ptr<Engine> make_engine(Ops& ops, const Options& o, const Tokenizer& tok, bool cache,
                                    int max_batch) {
  EngineConfig cfg;
  cfg.max_batch = max_batch;
  cfg.max_batch_tokens = std::max(512, max_batch);  // a step takes one token of each sequence
  cfg.seed = 1;
  cfg.kv_cache_bytes = int64_t(o.kv_cache_mb) << 20;
  cfg.prefix_cache_bytes = cache ? int64_t(o.prefix_cache_mb) << 20 : 0;
  cfg.snapshot_interval = o.interval;
  if (o.config.empty()) {
    auto e = Engine::create(o.model, ops, cfg, &tok);
    if (!e.ok()) die("engine: " + e.error().to_string());
    return std::move(*e);
  }
  auto json = read_json_file(o.config);
  if (!json.ok()) die(json.error().to_string());
  auto model =
      load_random_model(cut_layers(*json, o.layers), ops, Engine::load_options(cfg), DType::BF16);
  if (!model.ok()) die("model: " + model.error().to_string());
  auto e = Engine::create(std::move(*model), cfg, &tok);
  if (!e.ok()) die("engine: " + e.error().to_string());
  return std::move(*e);
}

Request greedy(std::vector<int32_t> prompt, int max_tokens) {
  Request r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.stop.ignore_eos = true;
  return r;
}

nlohmann::json run_chat(Ops& ops, const Options& o, const Chat& chat, bool cache) {
  auto e = make_engine(ops, o, chat.tok, cache, 1);
  std::mt19937 rng(7);
  ojson messages =
      ojson::array({{{"role", "system"}, {"content", "You are a helpful assistant."}}});
  std::vector<std::vector<int32_t>> earlier;
  nlohmann::json rows = nlohmann::json::array();
  const char* label = cache ? "cache" : "no cache";
  fmt::print("[chat, {}] turn  prompt  computed  reused  best  ttft_s\n", label);
  for (int t = 1; t <= o.turns; ++t) {
    messages.push_back({{"role", "user"}, {"content", chat.words(o.turn_tokens, rng)}});
    std::vector<int32_t> prompt = chat.ids(messages, ojson::array());
    size_t best = 0;
    for (const auto& p : earlier) best = std::max(best, common_prefix(p, prompt));
    best = std::min(best, prompt.size() - 1);
    earlier.push_back(prompt);
    Outcome out;
    out.sent = Clock::now();
    const auto st = e->submit(greedy(std::move(prompt), o.reply_tokens), sink(&out));
    if (!st.ok()) die("submit: " + st.error().to_string());
    e->run_until_idle();
    messages.push_back({{"role", "assistant"}, {"content", out.text}});
    fmt::print("[chat, {}] {:4d}  {:6d}  {:8d}  {:6d}  {:4d}  {:.3f}\n", label, t, out.prompt,
               out.prompt - out.cached, out.cached, best, out.ttft_s);
    rows.push_back({{"turn", t},
                    {"prompt", out.prompt},
                    {"computed", out.prompt - out.cached},
                    {"reused", out.cached},
                    {"best", best},
                    {"ttft_s", out.ttft_s}});
  }
  return rows;
}

nlohmann::json run_agent(Ops& ops, const Options& o, const Chat& chat, bool cache) {
  std::mt19937 rng(11);
  ojson tools = ojson::array();
  for (int i = 0; i < 8; ++i) {
    ojson params = {
        {"type", "object"},
        {"properties", {{"path", {{"type", "string"}}}, {"limit", {{"type", "integer"}}}}},
        {"required", {"path"}}};
    tools.push_back({{"type", "function"},
                     {"function",
                      {{"name", fmt::format("tool_{}", i)},
                       {"description", chat.words(40, rng)},
                       {"parameters", params}}}});
  }
  // The system text grows until the shared start reaches --system-tokens.
  std::string system = chat.words(o.system_tokens / 2, rng);
  auto shared_len = [&](const std::string& s) {
    ojson m =
        ojson::array({{{"role", "system"}, {"content", s}}, {{"role", "user"}, {"content", ""}}});
    return int(chat.ids(m, tools).size());
  };
  while (shared_len(system) < o.system_tokens) {
    system += chat.words(std::max(16, (o.system_tokens - shared_len(system)) / 2), rng);
  }
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < o.agents; ++i) {
    ojson m = ojson::array({{{"role", "system"}, {"content", system}},
                            {{"role", "user"}, {"content", chat.words(o.question_tokens, rng)}}});
    prompts.push_back(chat.ids(m, tools));
  }
  // The ideal: the start all prompts share once, every prompt's own part.
  size_t shared = prompts[0].size();
  int64_t total = 0;
  for (const auto& p : prompts) {
    shared = std::min(shared, common_prefix(prompts[0], p));
    total += int64_t(p.size());
  }
  const int64_t ideal = total - int64_t(shared) * (o.agents - 1);
  auto e = make_engine(ops, o, chat.tok, cache, o.agents);
  std::vector<Outcome> outs(prompts.size());
  const auto t0 = Clock::now();
  const double cpu0 = bench::cpu_seconds();
  for (size_t i = 0; i < prompts.size(); ++i) {
    outs[i].sent = t0;
    const auto st = e->submit(greedy(prompts[i], 1), sink(&outs[i]));
    if (!st.ok()) die("submit: " + st.error().to_string());
  }
  e->run_until_idle();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cpu = bench::cpu_seconds() - cpu0;
  std::vector<double> ttft;
  for (const Outcome& out : outs) ttft.push_back(out.ttft_s);
  std::sort(ttft.begin(), ttft.end());
  const EngineStats st = e->stats();
  const char* label = cache ? "cache" : "no cache";
  fmt::print(
      "[agent, {}] {} requests, shared start {} tokens, {} prompt tokens in all: computed {} "
      "(ideal {}), reused {}; time to first token min {:.2f} s, median {:.2f} s, max {:.2f} s; "
      "all done in {:.1f} s (CPU {:.1f} s)\n",
      label, o.agents, shared, total, st.prompt_tokens, ideal, st.prefix_hit_tokens, ttft.front(),
      ttft[ttft.size() / 2], ttft.back(), wall, cpu);
  return {{"shared", shared},
          {"total", total},
          {"computed", st.prompt_tokens},
          {"ideal", ideal},
          {"reused", st.prefix_hit_tokens},
          {"ttft_min_s", ttft.front()},
          {"ttft_median_s", ttft[ttft.size() / 2]},
          {"ttft_max_s", ttft.back()},
          {"wall_s", wall},
          {"cpu_s", cpu}};
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out at once, also when cut short
  Options o;
  CLI::App app{
      "The prefix cache (issue 19) on the real-vocabulary tiny model, without and with it in the\n"
      "same run. chat: --turns turns, each prompt the whole conversation so far through the\n"
      "model's chat template (a --turn-tokens user message per turn, the model's --reply-tokens\n"
      "answer sent back as the assistant's turn); per turn the prompt tokens computed and\n"
      "reused, the best reuse possible (the longest start shared with an earlier prompt, less\n"
      "the last token) and the time to first token. agent: --agents concurrent requests sharing\n"
      "a --system-tokens system prompt with tools, each with its own --question-tokens question;\n"
      "prompt tokens computed against the ideal (the shared start once plus every request's own\n"
      "part) and the time to first token. With --config, a published configuration with random\n"
      "bf16 weights replaces the model; its tokenizer and chat template still make the prompts."};
  app.option_defaults()->always_capture_default();
  app.add_option("--parts", o.parts, "what to run, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"chat", "agent"}));
  app.add_option("--model", o.model, "model directory (tokenizer and chat template)");
  app.add_option("--config", o.config,
                 "config.json of a published configuration, run with random bf16 weights");
  app.add_option("--layers", o.layers, "with --config: keep only the first N layers (0: all)")
      ->check(CLI::Range(0, 1 << 16));
  app.add_option("--device", o.device, "backend: cpu, cuda or cuda:N");
  app.add_option("--threads", o.threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--turns", o.turns, "chat turns")->check(CLI::Range(0, 1 << 16));
  app.add_option("--turn-tokens", o.turn_tokens, "tokens of each chat user message")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--reply-tokens", o.reply_tokens, "tokens of each chat answer")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--agents", o.agents, "concurrent agent requests")->check(CLI::Range(1, 4096));
  app.add_option("--system-tokens", o.system_tokens,
                 "tokens of the agents' shared start (system prompt and tools)")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--question-tokens", o.question_tokens, "tokens of each agent's own question")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--interval", o.interval,
                 "the engine's snapshot_interval: prompt tokens between prefix-cache snapshots")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--kv-cache-mb", o.kv_cache_mb, "attention-cache budget in MiB")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--prefix-cache-mb", o.prefix_cache_mb,
                 "prefix-cache memory in MiB in the runs with it")
      ->check(CLI::Range(0, 1 << 24));
  CLI11_PARSE(app, argc, argv);
  auto ops = create_backend(o.device, o.threads);
  auto tok = Tokenizer::load(o.model);
  auto tmpl = ChatTemplate::load(o.model);
  if (!ops.ok() || !tok.ok() || !tmpl.ok()) {
    fmt::print(stderr, "cannot load {} or its tokenizer and chat template\n", o.model);
    return 1;
  }
  const Chat chat{*tok, *tmpl};
  if (o.config.empty()) {
    fmt::print("model: {}\n", o.model);
  } else {
    fmt::print("model: {} with random bf16 weights{}; prompts from {}'s tokenizer\n", o.config,
               o.layers > 0 ? fmt::format(", {} layers", o.layers) : "", o.model);
  }
  fmt::print("device: {}, {} thread(s); snapshot interval {}\n", o.device, o.threads, o.interval);
  nlohmann::json result;
  for (const std::string& part : o.parts) {
    for (bool cache : {false, true}) {
      const char* key = cache ? "cache" : "no_cache";
      if (part == "chat") result["chat"][key] = run_chat(**ops, o, chat, cache);
      if (part == "agent") result["agent"][key] = run_agent(**ops, o, chat, cache);
    }
  }
  fmt::print("{}\n", result.dump());
  return 0;
}
