// Engine decode throughput on the 48-layer reference model (36 Gated DeltaNet layers), the
// configuration of the original bug report, with a roofline measured in the same run; the
// description in main() is what --help prints.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "bench_util.h"
#include "engine/engine.h"

using namespace recur;

namespace {

using bench::cpu_seconds;

struct Run {
  double seconds = 0;
  double cpu_seconds = 0;  // user + system time of the process over the timed part
  int64_t tokens = 0;
  EngineStats first, last;
  int64_t generated = 0;    // tokens of the sequences, prefill step included
  std::string last_finish;  // the message of the last sequence to finish ("" if none given)
  ModelInfo info;
  int64_t context_positions = 0;  // Σ over timed tokens of the positions attention reads
};

// ---- measured roofline of this core ----
// f32 FMA peak: 12 independent register-resident FMA chains (enough to cover latency x pipes).
double fma_peak_gflops() {
  double best = 0;
#if defined(__AVX512F__)
  for (int rep = 0; rep < 5; ++rep) {
    volatile float seed = 1.0f;
    const __m512 a = _mm512_set1_ps(seed * 0.999f), b = _mm512_set1_ps(seed * 1e-3f);
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i));
    const int64_t iters = 2'000'000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
      __asm__ volatile(""
                       : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]),
                         "+v"(acc[5]), "+v"(acc[6]), "+v"(acc[7]), "+v"(acc[8]), "+v"(acc[9]),
                         "+v"(acc[10]), "+v"(acc[11]));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    float sink = 0;
    for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
    if (sink == 12345.0f) fmt::print("");  // keeps the chains alive
    best = std::max(best, double(iters) * 12 * 16 * 2 / s * 1e-9);
  }
#endif
  return best;
}

// Read rate of a cyclic pass over a buffer of `bytes` (best of several passes after the first
// touch): the L3 rate for a buffer that fits, the DRAM rate for one far larger.
double read_bandwidth_gbs(size_t bytes) {
  bytes = std::max<size_t>(bytes / 512 * 512, 512);
  const size_t n = bytes / sizeof(float);
  std::unique_ptr<float[]> buf(new float[n]);
  for (size_t i = 0; i < n; ++i) buf[i] = float(i & 1023);  // touch every page
  double best = 0;
  const int reps = int(std::clamp<size_t>((size_t(1) << 30) / bytes, 4, 64));
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    float sum = 0;
#if defined(__AVX512F__)
    __m512 acc[8];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (size_t i = 0; i + 128 <= n; i += 128) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(&buf[i + 16 * j]));
    }
    for (auto& a : acc) sum += _mm512_reduce_add_ps(a);
#else
    for (size_t i = 0; i < n; ++i) sum += buf[i];
#endif
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (sum == -1.0f) fmt::print("");
    best = std::max(best, double(bytes) / s * 1e-9);
  }
  return best;
}

constexpr int kPromptLen = 8;  // tokens of each sequence's prompt

Run decode(Ops& ops, const std::string& model, int batch, int tokens, int64_t sample_every) {
  EngineConfig cfg;
  cfg.max_batch = batch;
  cfg.max_batch_tokens = std::max(512, batch);
  // A cache no larger than the phase needs, so that pre-faulting it is quick (lowest block ids
  // are handed out first: the blocks used are those of the default 1 GiB pool), but at least
  // the 4,096 blocks the default gives one sequence of the 48-layer model, so that each layer's
  // cache (2 KiB a block there) stays >= 2 MiB and on huge pages as in the default pool.
  cfg.kv_blocks =
      std::max(4096, batch * ((kPromptLen + tokens + cfg.block_size - 1) / cfg.block_size + 1));
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
    for (int i = 1; i <= kPromptLen; ++i) r.prompt.push_back((i + b) % 256);
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
  run.info = eng.model_info();
  // Decode token i (1-based, after the prefill's first) is fed at position prompt + i - 1 and
  // reads prompt + i positions.
  for (int i = 1; i < tokens; ++i) run.context_positions += int64_t(batch) * (kPromptLen + i);
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

// What one decode step of a phase of `n_seqs` sequences must move, from the model's shape.
struct PhaseWork {
  double ctx = 0;           // mean positions attention reads per token
  double flops = 0;         // per token: projections and attention
  double kv_bytes = 0;      // per token: attention cache read
  double state_bytes = 0;   // per token: recurrent state (read once; written in place)
  double weight_bytes = 0;  // per token: the step's weights shared by its n_seqs tokens
  double working_set = 0;   // bytes one step touches: weights + every sequence's cache + state
};

PhaseWork phase_work(const Run& r, int n_seqs) {
  const ModelInfo& in = r.info;
  PhaseWork w;
  w.ctx = double(r.context_positions) / double(std::max<int64_t>(1, r.tokens));
  // 2 FLOPs per multiply-add of the projections; scores and value sums: 2 x 2 per query-head
  // dimension per position.
  w.flops = 2.0 * double(in.active_params_per_token) +
            4.0 * double(in.attention_layers * in.attention_dim) * w.ctx;
  w.kv_bytes = double(in.kv_bytes_per_token) * w.ctx;
  w.state_bytes = double(in.state_bytes_per_slot);
  // Routed experts a step reads: the expected number of distinct experts n_seqs tokens pick
  // (uniform routing), per MoE layer.
  double distinct = 0;
  if (in.n_experts > 0) {
    const double p = double(in.experts_per_token) / double(in.n_experts);
    distinct = double(in.n_experts) * (1.0 - std::pow(1.0 - p, double(n_seqs)));
  }
  const double step_weights = double(in.dense_weight_bytes) +
                              double(in.moe_layers) * distinct * double(in.expert_weight_bytes);
  w.weight_bytes = step_weights / double(n_seqs);
  w.working_set = step_weights + double(n_seqs) * (w.kv_bytes + w.state_bytes);
  return w;
}

// The lower bound of one phase: FLOPs at the FMA peak; weights, KV cache and recurrent state
// read once per step at the rate a cyclic read of a buffer as large as the step's working set
// reaches (so L3-resident phases get the L3 rate, larger ones the DRAM rate); the two fully
// overlapped. Returns the bound in us/token.
double print_phase_bound(const std::string& name, const Run& r, int n_seqs, double gflops) {
  const PhaseWork w = phase_work(r, n_seqs);
  const double gbs = read_bandwidth_gbs(size_t(w.working_set));
  const double bytes = w.kv_bytes + w.state_bytes + w.weight_bytes;
  const double us_compute = w.flops / (gflops * 1e3), us_memory = bytes / (gbs * 1e3);
  const double bound = std::max(us_compute, us_memory);
  const double achieved = r.seconds * 1e6 / double(std::max<int64_t>(1, r.tokens));
  fmt::print(
      "  {}: mean context {:.0f}; per token {:.2f} MFLOP and {:.0f} KB (KV {:.0f}, state {:.0f}, "
      "weights {:.0f}); step working set {:.1f} MB read at {:.1f} GB/s -> bound {:.1f} us/token "
      "(compute {:.1f}, memory {:.1f}); achieved {:.1f} us/token = {:.0f}% of the bound\n",
      name, w.ctx, w.flops * 1e-6, bytes / 1024, w.kv_bytes / 1024, w.state_bytes / 1024,
      w.weight_bytes / 1024, w.working_set / 1e6, gbs, bound, us_compute, us_memory, achieved,
      100.0 * bound / achieved);
  return bound;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, tokens = 2000, batch = 32, prefault = 1;
  std::string device = "cpu", only;
  int64_t long_tokens = 0;
  std::string model = std::string(RECUR_SOURCE_DIR) + "/models/qwen3next-seed-48L";
  CLI::App app{
      "Engine decode throughput on the 48-layer reference model (36 Gated DeltaNet layers), the\n"
      "configuration of the original bug report: one sequence decoding --tokens tokens, then\n"
      "--batch concurrent sequences decoding a quarter as many each (8-token prompts, greedy,\n"
      "prefill untimed), and the ratio of their tokens per second. Next to wall-clock figures it\n"
      "prints the process CPU time per phase (tokens per CPU-second: the steadier figure on a\n"
      "shared machine), and a roofline measured in the same run (FMA peak, read rates, each\n"
      "phase's bound and the fraction of it achieved). --only times one phase alone; --long N\n"
      "instead times one N-token completion with the buffer counters sampled, and exits 1\n"
      "unless it completes with the counters flat."};
  app.option_defaults()->always_capture_default();
  app.add_option("--model", model, "model directory");
  app.add_option("--device", device, "backend: cpu, cuda or cuda:N");
  app.add_option("--threads", threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--tokens", tokens,
                 "tokens decoded by the one sequence (each of the --batch sequences: a quarter)")
      ->check(CLI::Range(8, 1 << 24));
  app.add_option("--batch", batch, "sequences decoded at once in the second phase")
      ->check(CLI::Range(1, 4096));
  app.add_option("--long", long_tokens,
                 "time one completion of this many tokens instead of the two phases (0: off)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30));
  app.add_option("--only", only, "time one phase alone, for profiling (prints no ratio)")
      ->check(CLI::IsMember({"single", "batch"}))
      ->default_str("both phases");
  app.add_option("--prefault", prefault,
                 "populate CPU buffers of 2 MiB and more (the attention cache) when each engine "
                 "is created: 1 on, 0 off")
      ->check(CLI::Range(0, 1));
  CLI11_PARSE(app, argc, argv);
  // The attention cache is populated when each engine is created (untimed): a server faults
  // its pool's pages once, so first-touch faults are not a per-token cost of steady decode.
  CpuOps::set_prefault_large_buffers(prefault != 0);
  auto ops_r = create_backend(device, threads);
  if (!ops_r.ok()) {
    fmt::print(stderr, "error: {}\n", ops_r.error().to_string());
    return 2;
  }
  Ops& ops = **ops_r;
  fmt::print(
      "model: {}\ndevice: {}\nthreads: {}\nCPU buffers >= 2 MiB pre-faulted at engine creation: "
      "{}\n",
      model, device, threads, prefault ? "yes (--prefault 0 to turn off)" : "no");
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
  {
    const double gflops = fma_peak_gflops();
    fmt::print(
        "roofline (one core, measured now): f32 FMA peak {:.1f} GFLOP/s (12 register-resident "
        "AVX-512 FMA chains); streaming read {:.1f} GB/s from a 512 MiB buffer.\n  Assumes: "
        "projection and attention FLOPs at the peak; each step reads its weights, the KV cache "
        "and the recurrent state once, at the rate measured for a buffer of the step's working "
        "set; activations free; compute and memory fully overlapped.\n",
        gflops, read_bandwidth_gbs(size_t(512) << 20));
    const double b1 = print_phase_bound("1 sequence", one, 1, gflops);
    const double bn = print_phase_bound(fmt::format("{} sequences", batch), many, batch, gflops);
    const double one_us = one.seconds * 1e6 / double(one.tokens);
    fmt::print(
        "  largest ratio the bound allows: {:.2f}x against the measured 1-sequence speed ({:.1f} "
        "us/token / {:.1f}); {:.2f}x with both phases at their bounds\n",
        one_us / bn, one_us, bn, b1 / bn);
  }
  fmt::print(
      "{{\"threads\": {}, \"decode_1_tok_s\": {:.1f}, \"decode_{}_tok_s\": {:.1f}, \"ratio\": "
      "{:.2f}}}\n",
      threads, one_tps, batch, many_tps, many_tps / one_tps);
  return 0;
}
