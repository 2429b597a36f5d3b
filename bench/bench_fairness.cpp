// Time to first token of a short request while a long prompt is being prefilled (issue 18), for
// the engine's scheduler and the arrival-order prompt budget it replaced; the description in
// main() is what --help prints. Short requests are submitted from this thread while the engine
// runs on its own, each when the long prompt's prefilled tokens pass one of the --at depths.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "bench_util.h"
#include "engine/engine.h"

using namespace recur;
using Clock = std::chrono::steady_clock;

namespace {

using bench::cpu_seconds;

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

struct Options {
  int threads = 1;
  int long_len = 100000;
  int short_len = 10;
  std::vector<int> at = {10000, 50000, 90000};
  int budget = 512;
  double target_ms = 100;
  std::vector<std::string> policies = {"fair", "arrival"};
  std::string model = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-tiny-realvocab";
};

struct Probe {
  int depth = 0;  // long prompt tokens prefilled when it was submitted
  Clock::time_point sent, first;
  std::atomic<bool> got{false};
};

struct RunResult {
  double long_prefill_s = 0;  // submit to the long prompt's first token
  double cpu_s = 0;
  std::vector<double> ttft_s;  // per probe
  std::vector<int> depth;
  EngineStats stats;
};

std::vector<int32_t> tokens(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = int32_t(rng() % uint32_t(vocab));
  return p;
}

RunResult run(Ops& ops, const Options& o, bool arrival_order, bool with_short) {
  EngineConfig cfg;
  cfg.max_batch = 8;
  cfg.max_batch_tokens = o.budget;
  cfg.step_time_target_ms = o.target_ms;
  cfg.arrival_order_prefill = arrival_order;
  cfg.seed = 1;
  auto e = Engine::create(o.model, ops, cfg, nullptr);
  if (!e.ok()) {
    fmt::print(stderr, "error: {}\n", e.error().to_string());
    std::exit(2);
  }
  Engine& eng = **e;
  const int vocab = eng.model_info().vocab_size;
  auto request = [&](std::vector<int32_t> prompt) {
    Request r;
    r.prompt = std::move(prompt);
    r.max_tokens = 1;
    r.sampling.temperature = 0;
    r.stop.ignore_eos = true;
    return r;
  };
  std::atomic<bool> long_done{false};
  Clock::time_point long_first;
  eng.start();
  const double c0 = cpu_seconds();
  const Clock::time_point t0 = Clock::now();
  auto id = eng.submit(request(tokens(o.long_len, vocab, 1)), [&](const Event& ev) {
    if (ev.kind == Event::Kind::kToken) {
      long_first = Clock::now();
      long_done = true;
    }
  });
  if (!id.ok()) {
    fmt::print(stderr, "error: {}\n", id.error().to_string());
    std::exit(2);
  }
  std::vector<Probe> probes(with_short ? o.at.size() : 0);
  size_t next = 0;
  while (!long_done || next < probes.size()) {
    if (next < probes.size()) {
      const int64_t prefilled = eng.stats().prompt_tokens;
      if (prefilled >= o.at[next] || long_done) {
        Probe& p = probes[next];
        p.depth = int(prefilled);
        p.sent = Clock::now();
        auto sid = eng.submit(request(tokens(o.short_len, vocab, 100 + uint32_t(next))),
                              [&p](const Event& ev) {
                                if (ev.kind == Event::Kind::kToken) {
                                  p.first = Clock::now();
                                  p.got = true;
                                }
                              });
        if (!sid.ok()) std::exit(2);
        ++next;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  eng.wait_idle(std::chrono::hours(1));
  RunResult r;
  r.long_prefill_s = std::chrono::duration<double>(long_first - t0).count();
  r.cpu_s = cpu_seconds() - c0;
  for (Probe& p : probes) {
    r.ttft_s.push_back(p.got ? std::chrono::duration<double>(p.first - p.sent).count() : -1);
    r.depth.push_back(p.depth);
  }
  r.stats = eng.stats();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "Time to first token of a short request while a long prompt is being prefilled (issue 18),\n"
      "on the real-vocabulary tiny model on the CPU: for each scheduler in --policies (fair: the\n"
      "engine's; arrival: the arrival-order prompt budget it replaced), the long prompt alone,\n"
      "then again with a short request sent each time its prefilled tokens pass one of the --at\n"
      "depths. Prints each short request's time to first token and the long prompt's prefill\n"
      "time and CPU time with and without them (the cost of fairness); every request asks for\n"
      "one token."};
  app.option_defaults()->always_capture_default();
  app.add_option("--model", o.model, "model directory");
  app.add_option("--threads", o.threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--long", o.long_len, "tokens of the long prompt")->check(CLI::Range(1, 1 << 24));
  app.add_option("--short", o.short_len, "tokens of each short request")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--at", o.at,
                 "prefilled tokens of the long prompt at which each short request is sent, "
                 "comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(0, 1 << 24));
  app.add_option("--budget", o.budget,
                 "the engine's max_batch_tokens (tokens per step; at least its max_batch, 8)")
      ->check(CLI::Range(8, 1 << 20));
  app.add_option("--target-ms", o.target_ms,
                 "the engine's step_time_target_ms (fair policy; 0: steps bounded by --budget "
                 "alone)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--policies", o.policies, "schedulers to compare, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"fair", "arrival"}));
  CLI11_PARSE(app, argc, argv);
  auto ops = create_backend("cpu", o.threads);
  if (!ops.ok()) {
    fmt::print(stderr, "error: {}\n", ops.error().to_string());
    return 2;
  }
  fmt::print(
      "model: {}\ndevice: cpu, {} thread(s); machine: {} cores, load average at start {}\n"
      "engine: max_batch 8, max_batch_tokens {}, step_time_target_ms {} (fair policy)\n"
      "long prompt: {} tokens, max_tokens 1; short requests: {} tokens, max_tokens 1, sent when "
      "the long prompt has {} tokens prefilled\n",
      o.model, o.threads, std::thread::hardware_concurrency(), loadavg(), o.budget, o.target_ms,
      o.long_len, o.short_len, fmt::join(o.at, ", "));
  std::fflush(stdout);
  struct Row {
    std::string policy;
    RunResult alone, with;
  };
  std::vector<Row> rows;
  for (const std::string& policy : o.policies) {
    const bool arrival = policy == "arrival";
    Row row{policy, {}, {}};
    row.alone = run(**ops, o, arrival, false);
    fmt::print("[{}] long prompt alone: prefill {:.1f} s (CPU {:.1f} s), {} steps, {} cut\n",
               policy, row.alone.long_prefill_s, row.alone.cpu_s, row.alone.stats.steps,
               row.alone.stats.attention_cut_steps);
    std::fflush(stdout);
    row.with = run(**ops, o, arrival, true);
    fmt::print(
        "[{}] long prompt with the short requests: prefill {:.1f} s (CPU {:.1f} s), {} steps, {} "
        "cut\n",
        policy, row.with.long_prefill_s, row.with.cpu_s, row.with.stats.steps,
        row.with.stats.attention_cut_steps);
    for (size_t i = 0; i < row.with.ttft_s.size(); ++i) {
      fmt::print("[{}]   short request sent at {} prefilled tokens: time to first token {:.3f} s\n",
                 policy, row.with.depth[i], row.with.ttft_s[i]);
    }
    std::fflush(stdout);
    rows.push_back(std::move(row));
  }
  fmt::print("summary (load average now {}):\n", loadavg());
  std::string json = "{";
  for (const Row& r : rows) {
    double worst = 0;
    for (double t : r.with.ttft_s) worst = std::max(worst, t);
    // On a shared machine the process CPU time is the steadier figure to compare runs by.
    fmt::print(
        "  {:8} short request TTFT worst {:.3f} s ({}); long prefill {:.1f} s alone, {:.1f} s "
        "with the short requests ({:+.1f}%); CPU {:.1f} s alone, {:.1f} s with ({:+.1f}%)\n",
        r.policy, worst, worst < 1.0 ? "under 1 s" : "NOT under 1 s", r.alone.long_prefill_s,
        r.with.long_prefill_s,
        100.0 * (r.with.long_prefill_s - r.alone.long_prefill_s) / r.alone.long_prefill_s,
        r.alone.cpu_s, r.with.cpu_s, 100.0 * (r.with.cpu_s - r.alone.cpu_s) / r.alone.cpu_s);
    json += fmt::format(
        "{}\"{}\": {{\"ttft_s\": [{:.3f}], \"long_prefill_alone_s\": {:.1f}, "
        "\"long_prefill_with_short_s\": {:.1f}}}",
        json.size() > 1 ? ", " : "", r.policy, fmt::join(r.with.ttft_s, ", "),
        r.alone.long_prefill_s, r.with.long_prefill_s);
  }
  fmt::print("{}}}\n", json);
  return 0;
}
