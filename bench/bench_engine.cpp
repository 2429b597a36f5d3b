// Engine decode throughput on the 48-layer reference model (36 Gated DeltaNet layers), the
// configuration of the original bug report: one sequence, then 32 concurrent sequences, on
// one CPU thread by default. Also a long single completion with flat-counter checks.
//   bench_engine [--device cpu|cuda] [--threads N] [--tokens N] [--batch N] [--long N]
//                [--only single|batch]   (one phase alone, for profiling; prints no ratio)
// Next to the wall-clock figures it prints the process CPU time per phase: on a shared,
// oversubscribed machine tokens per CPU-second is the steadier figure to compare builds by.
#include <fmt/format.h>

#include <sys/resource.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/engine.h"

using namespace recur;

namespace {

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct Run {
  double seconds = 0;
  double cpu_seconds = 0;  // user + system time of the process over the timed part
  int64_t tokens = 0;
  EngineStats first, last;
  int64_t generated = 0;    // tokens of the sequences, prefill step included
  std::string last_finish;  // the message of the last sequence to finish ("" if none given)
};

Run decode(Ops& ops, const std::string& model, int batch, int tokens, int64_t sample_every) {
  EngineConfig cfg;
  cfg.max_batch = batch;
  cfg.max_batch_tokens = std::max(512, batch);
  auto e = Engine::create(model, ops, cfg, nullptr);
  if (!e.ok()) {
    fmt::print(stderr, "error: {}\n", e.error().to_string());
    std::exit(2);
  }
  Engine& eng = **e;
  Run run;
  int64_t seen = 0;
  for (int b = 0; b < batch; ++b) {
    Request r;
    for (int i = 1; i <= 8; ++i) r.prompt.push_back((i + b) % 256);
    r.max_tokens = tokens;
    r.sampling.temperature = 0;
    r.stop.ignore_eos = true;
    auto id = eng.submit(r, [&](const Event& ev) {
      if (ev.kind == Event::Kind::kFinish) {
        run.generated += ev.generated_tokens;
        run.last_finish = std::string(ev.message);
        return;
      }
      if (ev.kind != Event::Kind::kToken) return;
      ++seen;
      if (sample_every > 0 && seen % sample_every == 0) {
        EngineStats s = eng.stats();
        if (seen == sample_every) run.first = s;
        run.last = s;
        fmt::print(
            "  token {:>8}: allocs_total={} live_buffers={} live_bytes={} kv_blocks_used={}\n",
            seen, s.alloc.allocs_total, s.alloc.live_buffers, s.alloc.live_bytes, s.kv_blocks_used);
      }
    });
    if (!id.ok()) std::exit(2);
  }
  eng.step();  // prefill (not timed: this measures decode)
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = cpu_seconds();
  const int64_t before = seen;
  eng.run_until_idle();
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  run.cpu_seconds = cpu_seconds() - c0;
  run.tokens = seen - before;
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, tokens = 2000, batch = 32;
  std::string device = "cpu", only;
  int64_t long_tokens = 0;
  std::string model = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-seed-48L";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--tokens")) tokens = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--batch")) batch = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--long")) long_tokens = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--model")) model = argv[i + 1];
    if (!std::strcmp(argv[i], "--device")) device = argv[i + 1];
    if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
  }
  auto ops_r = create_backend(device, threads);
  if (!ops_r.ok()) {
    fmt::print(stderr, "error: {}\n", ops_r.error().to_string());
    return 2;
  }
  Ops& ops = **ops_r;
  fmt::print("model: {}\ndevice: {}\nthreads: {}\n", model, device, threads);
  if (long_tokens > 0) {
    fmt::print("long completion: 1 sequence, prompt 1..8, {} tokens\n", long_tokens);
    Run r = decode(ops, model, 1, int(long_tokens), std::max<int64_t>(1, long_tokens / 10));
    const bool flat = r.first.alloc.allocs_total == r.last.alloc.allocs_total &&
                      r.first.alloc.live_buffers == r.last.alloc.live_buffers;
    // A completion that stopped short (the model's context length, the cache) is no evidence
    // for the length asked: say so and fail.
    const bool complete = r.generated >= long_tokens;
    fmt::print(
        "{{\"long_tokens\": {}, \"generated\": {}, \"complete\": {}, \"finish\": \"{}\", "
        "\"seconds\": {:.1f}, \"tok_s\": {:.1f}, \"flat_counters\": {}}}\n",
        r.tokens, r.generated, complete ? "true" : "false", r.last_finish, r.seconds,
        double(r.tokens) / r.seconds, flat ? "true" : "false");
    return flat && complete ? 0 : 1;
  }
  if (only == "single" || only == "batch") {
    const int n_seqs = only == "single" ? 1 : batch;
    Run r = decode(ops, model, n_seqs, only == "single" ? tokens : tokens / 4, 0);
    fmt::print(
        "decode {} sequence(s): {} tokens in {:.3f} s = {:.1f} tok/s ({:.1f} tok per CPU-second)\n",
        n_seqs, r.tokens, r.seconds, double(r.tokens) / r.seconds,
        double(r.tokens) / r.cpu_seconds);
    return 0;
  }
  Run one = decode(ops, model, 1, tokens, 0);
  const double one_tps = double(one.tokens) / one.seconds;
  Run many = decode(ops, model, batch, tokens / 4, 0);
  const double many_tps = double(many.tokens) / many.seconds;
  fmt::print(
      "decode 1 sequence:   {:>8} tokens in {:.3f} s = {:>8.1f} tok/s (target 2000: {:.2f}x)\n",
      one.tokens, one.seconds, one_tps, one_tps / 2000.0);
  fmt::print(
      "decode {} sequences: {:>8} tokens in {:.3f} s = {:>8.1f} tok/s ({:.2f}x one sequence; "
      "target 8x)\n",
      batch, many.tokens, many.seconds, many_tps, many_tps / one_tps);
  fmt::print("CPU time: 1 sequence {:.1f} tok per CPU-second, {} sequences {:.1f} (ratio {:.2f})\n",
             double(one.tokens) / one.cpu_seconds, batch, double(many.tokens) / many.cpu_seconds,
             (double(many.tokens) / many.cpu_seconds) / (double(one.tokens) / one.cpu_seconds));
  fmt::print(
      "{{\"threads\": {}, \"decode_1_tok_s\": {:.1f}, \"decode_{}_tok_s\": {:.1f}, \"ratio\": "
      "{:.2f}}}\n",
      threads, one_tps, batch, many_tps, many_tps / one_tps);
  return 0;
}
