// `recur bench`: prefill and decode throughput of the model forward on a backend, against the
// memory-bandwidth limit measured in the same run. Works from a model directory or from a
// published config with random weights (--random-weights), cut to --layers.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "cli/commands.h"
#include "cli/engine_options.h"
#include "core/threads.h"
#include "io/checkpoint.h"
#include "model/registry.h"

namespace recur::cli {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct BenchOptions {
  std::string config, model, device = "cpu", batches = "1,16,64", dtype = "bf16";
  std::string prefill_lens;     // empty: prompt_len
  std::string decode_contexts;  // batch-1 decode at these contexts; empty: none
  bool random_weights = false;
  Quantize quantize = Quantize::kNone;
  DType kv_cache_dtype = DType::F32;
  BackendOptions backend;
  int layers = 0, prompt_len = 2048, gen_len = 64, threads = 0, block_size = 16;
  int prefill_chunk = 0;  // tokens per prefill forward (0: each prompt in one forward)
  int tensor_parallel = 1;
};

// This process's resident bytes (Linux /proc/self/statm; 0 elsewhere).
size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * size_t(sysconf(_SC_PAGESIZE));
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The host's read bandwidth in bytes/s with `threads` threads, each summing its share of a
// `bytes` buffer (best of several passes after the first touch): the bound of a CPU decode
// step, which reads its weights once. Decode fractions are of this.
double measure_read_bandwidth(int threads, size_t bytes) {
  const size_t n = bytes / sizeof(float);
  std::unique_ptr<float[]> buf(new float[n]);
  for (size_t i = 0; i < n; ++i) buf[i] = float(i & 1023);  // touch every page
  std::vector<float> sums(size_t(threads) * 16);
  double best = 0;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const size_t b = n * size_t(t) / size_t(threads), e = n * size_t(t + 1) / size_t(threads);
        // Eight independent sums of 16 lanes each, so the adds never wait on each other.
        float acc[8][16] = {};
        size_t i = b;
        for (; i + 128 <= e; i += 128) {
          for (int j = 0; j < 8; ++j) {
#pragma omp simd
            for (int l = 0; l < 16; ++l) acc[j][l] += buf[i + 16 * size_t(j) + size_t(l)];
          }
        }
        float total = 0;
        for (; i < e; ++i) total += buf[i];
        for (auto& a : acc)
          for (float v : a) total += v;
        sums[size_t(t) * 16] = total;  // one cache line apart
      });
    }
    for (auto& th : pool) th.join();
    best = std::max(best, double(bytes) / seconds_since(t0));
  }
  return best;
}

int run_bench(const BenchOptions& o) {
  auto fail = [](const std::string& msg) {
    fmt::print(stderr, "error: {}\n", msg);
    return 2;
  };
  auto parse_list = [](const std::string& text, std::vector<int>* out) {
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) {
      try {
        out->push_back(std::stoi(item));
      } catch (const std::exception&) {
        return false;
      }
      if (out->back() < 1) return false;
    }
    return !out->empty();
  };
  std::vector<int> batches, prefill_lens;
  if (!parse_list(o.batches, &batches)) return fail("--batch: positive integers, comma-separated");
  if (o.prompt_len < 1) return fail("--prompt-len must be >= 1");
  if (!parse_list(o.prefill_lens.empty() ? std::to_string(o.prompt_len) : o.prefill_lens,
                  &prefill_lens)) {
    return fail("--prefill-lens: positive integers, comma-separated");
  }
  const int max_prefill = *std::max_element(prefill_lens.begin(), prefill_lens.end());
  std::vector<int> decode_contexts;
  if (!o.decode_contexts.empty() && !parse_list(o.decode_contexts, &decode_contexts)) {
    return fail("--decode-contexts: positive integers, comma-separated");
  }
  for (int c : decode_contexts) {
    if (c <= o.gen_len) return fail("--decode-contexts: each context must exceed --gen-len");
  }
  const int max_decode_context =
      decode_contexts.empty() ? 0
                              : *std::max_element(decode_contexts.begin(), decode_contexts.end());
  if (o.gen_len < 4) return fail("--gen-len must be at least 4 (untimed warm-up steps)");
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  auto ops_r = create_rank_backend(o.device, o.threads, o.tensor_parallel, o.backend);
  if (!ops_r.ok()) return fail(ops_r.error().to_string());
  Ops& ops = **ops_r;

  if (o.prefill_chunk < 0) return fail("--prefill-chunk must be >= 0");
  // A forward's scratch grows with its tokens: a model that fills most of the device prefills
  // long prompts in chunks, as the engine does.
  const int chunk = o.prefill_chunk > 0 ? o.prefill_chunk : std::max(o.prompt_len, max_prefill);
  LoadOptions opt;
  opt.max_batch_tokens = std::max(chunk, max_batch);
  opt.max_logit_rows = max_batch;
  opt.state.n_slots = max_batch;
  opt.state.block_size = o.block_size;
  // Each batch size decodes gen_len steps the synchronous way, then gen_len pipelined, after a
  // prompt_len context; the prefill runs get blocks of their own past the decode sequences'.
  const int decode_context = o.prompt_len + 2 * o.gen_len + 1;
  const int blocks_per_seq = decode_context / o.block_size + 1;
  const int prefill_blocks = max_prefill / o.block_size + 1;
  // Decode at a given context: one sequence's blocks up to the longest context.
  const int long_context = max_decode_context;
  const int long_blocks = decode_contexts.empty() ? 0 : long_context / o.block_size + 1;
  opt.state.n_blocks = max_batch * blocks_per_seq + prefill_blocks + long_blocks;
  opt.max_context = std::max({decode_context, max_prefill, long_context});
  opt.kv_cache_dtype = o.kv_cache_dtype;
  opt.tensor_parallel = o.tensor_parallel;
  opt.rank_backend = rank_backend_maker(o.device, o.threads, o.tensor_parallel, o.backend);
  // The ceiling: device copy bandwidth, measured before the model takes the memory its buffers
  // need (a model that fills the device leaves no 4 GiB for them).
  const size_t copy_bytes = ops.device() == Device::kCpu ? (size_t(256) << 20) : (size_t(2) << 30);
  const double copy_bw = ops.measure_copy_bandwidth(copy_bytes);
  const auto t_load = Clock::now();
  Result<std::unique_ptr<Model>> model_r = make_error(ErrorCode::kInvalidArgument, "no model");
  json config;
  if (o.random_weights) {
    if (o.config.empty()) return fail("--random-weights needs --config");
    auto cfg = read_json_file(o.config);
    if (!cfg.ok()) return fail(cfg.error().to_string());
    config = cut_layers(*cfg, o.layers);
    const DType dt = o.dtype == "f32" ? DType::F32 : o.dtype == "f16" ? DType::F16 : DType::BF16;
    opt.quantize = o.quantize;
    model_r = load_random_model(config, ops, opt, dt);
  } else {
    if (o.model.empty()) return fail("give --model DIR, or --config FILE --random-weights");
    if (o.layers > 0) return fail("--layers applies to --random-weights");
    opt.quantize = o.quantize;
    model_r = load_model(o.model, ops, opt);
  }
  if (!model_r.ok()) return fail(model_r.error().to_string());
  Model& m = **model_r;
  const double load_s = seconds_since(t_load);
  const size_t resident_after_load = resident_bytes();
  const ModelInfo& info = m.info();
  const int V = info.vocab_size;
  auto logits_buf = ops.allocator().allocate(size_t(max_batch) * size_t(V) * 4, "logits");
  if (!logits_buf.ok()) return fail(logits_buf.error().to_string());
  Tensor logits = view(*logits_buf, DType::F32, {max_batch, V});
  auto ids_buf = ops.allocator().allocate(size_t(max_batch) * 4, "greedy ids");
  if (!ids_buf.ok()) return fail(ids_buf.error().to_string());

  // On the CPU, also the read bandwidth at the decode's thread count (a decode step reads).
  const int read_threads = o.threads > 0 ? o.threads : default_thread_count();
  const double read_bw =
      ops.device() == Device::kCpu ? measure_read_bandwidth(read_threads, size_t(512) << 20) : 0.0;

  // Sequence s's prompt of len tokens. Each sequence its own, so sequences decoding greedily pick
  // their own tokens (and route to their own experts) rather than one sequence's picks b times.
  auto prompt_of = [&](int s, int len) {
    std::vector<int32_t> p(static_cast<size_t>(len));
    for (int i = 0; i < len; ++i) {
      p[size_t(i)] = int32_t((int64_t(i) * 7919 + 13 + int64_t(s) * 104729) % V);
    }
    return p;
  };
  auto blocks_of = [&](int slot) {
    std::vector<int32_t> b(static_cast<size_t>(blocks_per_seq));
    for (int i = 0; i < blocks_per_seq; ++i) b[size_t(i)] = slot * blocks_per_seq + i;
    return b;
  };
  Batch batch;
  auto check = [&](const Status& st) {
    if (!st.ok()) {
      fmt::print(stderr, "error: {}\n", st.error().to_string());
      exit_with(2);
    }
  };

  // Sequence slot's prompt in forwards of at most `chunk` tokens (positions continue).
  auto prefill_chunked = [&](int slot, const std::vector<int32_t>& p,
                             const std::vector<int32_t>& table, Batch::Logits last) {
    const int len = int(p.size());
    for (int pos = 0; pos < len; pos += chunk) {
      const int n = std::min(chunk, len - pos);
      batch.clear();
      batch.add_sequence(slot, pos, std::span<const int32_t>(p.data() + pos, size_t(n)), table,
                         pos + n == len ? last : Batch::Logits::kNone);
      check(m.forward(batch, logits));
    }
  };

  // Prefill: one sequence of each length (in forwards of `chunk` tokens); a warm-up, then the
  // median of three (long prompts: see kLongPrefill).
  std::vector<int32_t> prefill_table(static_cast<size_t>(prefill_blocks));
  for (int i = 0; i < prefill_blocks; ++i)
    prefill_table[size_t(i)] = max_batch * blocks_per_seq + i;
  json prefill = json::array();
  // Prompts past kLongPrefill tokens run once, untimed runs of a shorter length before them
  // having warmed the same kernels: a 262,144-token prefill takes tens of seconds.
  constexpr int kLongPrefill = 32768;
  bool warmed = false;
  for (int len : prefill_lens) {
    const std::vector<int32_t> p = prompt_of(0, len);
    std::vector<double> times;
    const bool once = len > kLongPrefill && warmed;
    for (int rep = once ? 1 : 0; rep < (once ? 2 : 4); ++rep) {
      m.reset_slot(0);
      ops.synchronize();
      const auto t0 = Clock::now();
      prefill_chunked(0, p, prefill_table, Batch::Logits::kLast);
      ops.synchronize();
      if (rep > 0) times.push_back(seconds_since(t0));
    }
    warmed = true;
    std::sort(times.begin(), times.end());
    // Projections at 2 FLOPs per multiply-add, plus causal attention (QK and PV).
    const double flops = 2.0 * double(info.active_params_per_token) * len +
                         2.0 * 2.0 * double(info.attention_layers) * double(info.attention_dim) *
                             len * (len + 1) / 2.0;
    const double median = times[times.size() / 2];
    prefill.push_back({{"tokens", len},
                       {"runs", times.size()},
                       {"seconds", median},
                       {"tok_s", len / median},
                       {"tflop_s", flops / median / 1e12}});
  }

  json decode = json::array();
  for (int b : batches) {
    // Every sequence holds a prompt_len context, prefilled in chunks that fit a step.
    std::vector<std::vector<int32_t>> tables;
    for (int s = 0; s < b; ++s) {
      m.reset_slot(s);
      tables.push_back(blocks_of(s));
    }
    for (int s = 0; s < b; ++s) {
      prefill_chunked(s, prompt_of(s, o.prompt_len), tables[size_t(s)], Batch::Logits::kNone);
    }
    ops.synchronize();
    std::vector<int32_t> tok(1);
    auto step = [&](int pos) {
      batch.clear();
      for (int s = 0; s < b; ++s) {
        tok[0] = int32_t((pos * 31 + s * 17) % V);  // fixed ids: sampling is not measured
        batch.add_sequence(s, pos, tok, tables[size_t(s)], Batch::Logits::kLast);
      }
      check(m.forward(batch, logits));
      ops.synchronize();  // the engine reads sampled ids every step
    };
    // Untimed warm-up: a device backend runs a new decode shape eagerly once and records it
    // as a graph the second time; the timed steps are replays.
    step(o.prompt_len);
    step(o.prompt_len + 1);
    const auto t0 = Clock::now();
    for (int g = 2; g < o.gen_len; ++g) step(o.prompt_len + g);
    const double secs = seconds_since(t0);
    const int steps = o.gen_len - 2;
    const double step_s = secs / steps;

    // The engine's greedy decode on a device: the argmax on the device, the ids read back every
    // step, and the next step queued before they are read, fed the device's picks (as
    // Engine::maybe_prelaunch). The first three reads are untimed (the host-id step, then the
    // device-id shape's eager run and its capture); the rest time steady-state steps.
    const Tensor ids = view(*ids_buf, DType::I32, {b});
    std::vector<int32_t> host_ids(static_cast<size_t>(b)), sorted(host_ids.size());
    const int pos0 = o.prompt_len + o.gen_len;
    auto queue_forward = [&](int pos, bool device_ids) {
      batch.clear();
      for (int s = 0; s < b; ++s) {
        tok[0] = int32_t((pos * 31 + s * 17) % V);  // the first step's; later ones read `ids`
        batch.add_sequence(s, pos, tok, tables[size_t(s)], Batch::Logits::kLast);
      }
      batch.device_tokens = device_ids ? ids.ptr<int32_t>() : nullptr;
      check(m.forward(batch, logits));
    };
    queue_forward(pos0, false);
    Clock::time_point tp0;
    double distinct_sum = 0.0;
    constexpr int kPipelineWarmup = 3;
    for (int g = 0; g < o.gen_len; ++g) {
      ops.argmax_rows(logits.slice_rows(0, b), ids);
      ops.copy_to_host_start(ids, host_ids.data());
      if (g + 1 < o.gen_len) queue_forward(pos0 + g + 1, true);
      ops.copy_to_host_finish();
      std::copy(host_ids.begin(), host_ids.end(), sorted.begin());
      std::sort(sorted.begin(), sorted.end());
      distinct_sum += double(std::unique(sorted.begin(), sorted.end()) - sorted.begin());
      if (g + 1 == kPipelineWarmup) tp0 = Clock::now();
    }
    batch.device_tokens = nullptr;
    const int pipelined_steps = o.gen_len - kPipelineWarmup;
    const double pipelined_step_s =
        pipelined_steps > 0 ? seconds_since(tp0) / pipelined_steps : 0.0;
    // Bytes one step must read: dense weights, the distinct routed experts b tokens pick
    // (expected, uniform routing), each sequence's recurrent state (read and written) and its
    // attention cache.
    const double E = info.n_experts, k = info.experts_per_token;
    const double experts_read =
        E > 0 ? E * (1.0 - std::pow(1.0 - k / E, double(b))) * info.moe_layers : 0.0;
    const double weight_bytes =
        double(info.dense_weight_bytes) + experts_read * double(info.expert_weight_bytes);
    const double state_bytes =
        2.0 * b * double(info.state_bytes_per_slot) +
        double(b) * (o.prompt_len + o.gen_len / 2.0) * double(info.kv_bytes_per_token);
    const double bw = (weight_bytes + state_bytes) / step_s;
    json pipelined = nullptr;
    if (pipelined_steps > 0) {
      const double pbw = (weight_bytes + state_bytes) / pipelined_step_s;
      pipelined = {{"tok_s", b / pipelined_step_s},
                   {"step_ms", pipelined_step_s * 1e3},
                   {"steps", pipelined_steps},
                   {"distinct_ids_per_step", distinct_sum / o.gen_len},
                   {"achieved_bandwidth_gb_s", pbw / 1e9},
                   {"fraction_of_copy_bandwidth", pbw / copy_bw}};
      if (read_bw > 0) pipelined["fraction_of_read_bandwidth"] = pbw / read_bw;
    }
    decode.push_back({{"batch", b},
                      {"tok_s", b / step_s},
                      {"step_ms", step_s * 1e3},
                      {"weight_bytes_per_step", weight_bytes},
                      {"state_bytes_per_step", state_bytes},
                      {"achieved_bandwidth_gb_s", bw / 1e9},
                      {"fraction_of_copy_bandwidth", bw / copy_bw},
                      {"greedy_pipelined", pipelined}});
    if (read_bw > 0) decode.back()["fraction_of_read_bandwidth"] = bw / read_bw;
  }
  // Batch-1 decode at each --decode-contexts length C: the gen_len steps that end at position
  // C − 1 (the last attends to C positions, so C may be the model's whole context), of a
  // sequence whose earlier positions were never prefilled (the cache's contents do not change
  // the work: every step reads all its positions); two untimed steps first (graph capture).
  json long_decode = json::array();
  if (!decode_contexts.empty()) {
    std::vector<int32_t> table(static_cast<size_t>(long_blocks));
    for (int i = 0; i < long_blocks; ++i)
      table[size_t(i)] = max_batch * blocks_per_seq + prefill_blocks + i;
    std::vector<int32_t> tok(1);
    double first_step_s = 0;  // the first context's step: each step is also given against it
    for (int ctx : decode_contexts) {
      const int first = ctx - o.gen_len;
      m.reset_slot(0);
      auto step = [&](int pos) {
        batch.clear();
        tok[0] = int32_t((pos * 31) % V);
        batch.add_sequence(0, pos, tok, table, Batch::Logits::kLast);
        check(m.forward(batch, logits));
        ops.synchronize();
      };
      step(first);
      step(first + 1);
      const auto t0 = Clock::now();
      for (int g = 2; g < o.gen_len; ++g) step(first + g);
      const double step_s = seconds_since(t0) / (o.gen_len - 2);
      // Positions read per timed step, on average.
      const double cache_bytes =
          (first + (o.gen_len + 1) / 2.0 + 1) * double(info.kv_bytes_per_token);
      if (long_decode.empty()) first_step_s = step_s;
      long_decode.push_back({{"context", ctx},
                             {"tok_s", 1.0 / step_s},
                             {"step_ms", step_s * 1e3},
                             {"step_vs_first_context", step_s / first_step_s},
                             {"attention_cache_bytes_read", cache_bytes},
                             {"attention_cache_gb_s", cache_bytes / step_s / 1e9}});
    }
  }
  // The longest single context the memory left after loading (and this benchmark's own
  // buffers) would hold in the attention cache.
  const int64_t free_bytes = ops.free_memory_bytes();
  const int64_t max_context_fits =
      info.kv_bytes_per_token > 0 ? free_bytes / info.kv_bytes_per_token : 0;
  const std::optional<Fp8Activations> fp8_act = ops.fp8_activations();
  const std::optional<PromptActivations> prompt_act = ops.prompt_activations();
  json out = {
      {"device", o.device},
      {"config", o.random_weights ? o.config : o.model},
      {"random_weights", o.random_weights},
      {"layers", o.layers},
      {"weight_dtype", o.random_weights ? o.dtype : "as stored"},
      {"quantize", quantize_name(o.quantize)},
      // Ranks splitting the model; weight, cache and state figures are all ranks' together.
      {"tensor_parallel", o.tensor_parallel},
      {"weight_bytes", info.weight_bytes},
      {"kv_cache_dtype", dtype_name(o.kv_cache_dtype)},
      // As the backend runs them (e4m3 asked for runs as f16 terms without sm_90a code); null
      // where f32 activations are multiplied (the CPU).
      {"fp8_activations", fp8_act ? json(fp8_activations_name(*fp8_act)) : json(nullptr)},
      // Likewise for bf16/f16 weights (f16 asked for runs as f16x2 without sm_90a code).
      {"prompt_activations",
       prompt_act ? json(prompt_activations_name(*prompt_act)) : json(nullptr)},
      {"kv_bytes_per_token", info.kv_bytes_per_token},
      // Tokens per GB (1e9 bytes) of this attention cache, of one holding keys and values
      // expanded per head (what latent attention's latent saves), and their ratio.
      {"kv_tokens_per_gb", info.kv_bytes_per_token ? 1e9 / double(info.kv_bytes_per_token) : 0.0},
      {"expanded_kv_tokens_per_gb",
       info.expanded_kv_bytes_per_token ? 1e9 / double(info.expanded_kv_bytes_per_token) : 0.0},
      {"free_memory_bytes", free_bytes},
      {"max_context_in_free_memory", max_context_fits},
      {"kv_cache_saving", info.kv_bytes_per_token ? double(info.expanded_kv_bytes_per_token) /
                                                        double(info.kv_bytes_per_token)
                                                  : 1.0},
      {"load_seconds", load_s},
      {"resident_bytes_after_load", resident_after_load},
      {"copy_bandwidth_gb_s", copy_bw / 1e9},
      {"read_bandwidth_gb_s", read_bw / 1e9},
      {"read_bandwidth_threads", read_threads},
      {"architecture", info.architecture},
      {"prompt_len", o.prompt_len},
      {"prefill_chunk", chunk},
      {"gen_len", o.gen_len},
      {"prefill_tok_s", prefill[0]["tok_s"]},
      {"prefill_tflop_s", prefill[0]["tflop_s"]},
      {"prefill", prefill},
      {"decode", decode},
      {"decode_at_context", long_decode},
      {"note",
       "decode: fixed token ids, the host waits for each step before queuing the next, no "
       "sampling; decode.greedy_pipelined: the engine's greedy decode (argmax on the device, ids "
       "read back every step, the next step queued before they are read and fed the device's "
       "picks), after the fixed-id steps; every sequence has its own prompt"}};
  fmt::print("{}\n", out.dump(2));
  return 0;
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("bench", "Prefill and decode throughput against the bandwidth limit");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("--config", o->config, "config.json (with --random-weights)");
  cmd->add_option("--model", o->model, "model directory");
  cmd->add_flag("--random-weights", o->random_weights, "random weights from the config alone");
  cmd->add_option("--layers", o->layers, "keep only the first N layers");
  add_device_option(cmd, &o->device);
  cmd->add_option("--batch", o->batches, "decode batch sizes, comma-separated");
  cmd->add_option("--prompt-len", o->prompt_len, "prompt tokens (prefill; decode context)")
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--prefill-lens", o->prefill_lens,
                  "prefill lengths to time, comma-separated (default: --prompt-len)");
  cmd->add_option("--gen-len", o->gen_len, "decode steps per batch size")
      ->check(CLI::Range(4, 1 << 24));
  cmd->add_option("--prefill-chunk", o->prefill_chunk,
                  "tokens per prefill forward (default 0: each prompt in one forward)");
  cmd->add_option("--decode-contexts", o->decode_contexts,
                  "batch-1 decode timed at these contexts, comma-separated (e.g. "
                  "2048,32768,131072,262144)");
  cmd->add_option("--dtype", o->dtype, "random weights' dtype: bf16, f16, f32")
      ->check(CLI::IsMember({"bf16", "f16", "f32"}));
  add_threads_option(cmd, &o->threads);
  add_tensor_parallel_option(cmd, &o->tensor_parallel);
  add_quantize_option(cmd, &o->quantize);
  add_kv_cache_dtype_option(cmd, &o->kv_cache_dtype);
  add_fp8_activations_option(cmd, &o->backend.fp8_activations);
  add_prompt_activations_option(cmd, &o->backend.prompt_activations);
  cmd->callback([o] {
    int rc = run_bench(*o);
    if (rc != 0) exit_with(rc);
  });
}

}  // namespace recur::cli
