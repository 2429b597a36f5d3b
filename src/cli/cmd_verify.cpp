// `recur verify`: compares the model's logits with reference logits from transformers, for
// the whole prompt in one call, in chunks of 17 tokens, one token per call, and teacher-forced
// decode of the reference continuation.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "cli/commands.h"
#include "cli/engine_options.h"
#include "io/safetensors.h"
#include "model/registry.h"

namespace recur::cli {

namespace {

struct Reference {
  Tensor ids_tensor;         // [T] I64
  Tensor gen_tensor;         // [N] I64
  std::vector<int32_t> ids;  // [T]
  std::vector<int32_t> gen;  // [N]
  Tensor logits;             // [T, V] or top values [T, 20]
  Tensor logits_top_ids;     // [T, 20] I64 (top-k variant only)
  Tensor gen_logits;         // [N, V] or [N, 20]
  Tensor gen_top_ids;        // [N, 20] I64 (top-k variant only)
};

std::vector<int32_t> read_ids(const Tensor& t) {
  std::vector<int32_t> out(size_t(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = int32_t(t.ptr<int64_t>()[i]);
  return out;
}

// Every id is a token of the model and the logits have the shapes the ids promise; a reference
// file is input like any other, so nothing is indexed before this holds.
Status check_reference(const Reference& r, int64_t vocab, const std::string& p) {
  auto ids_in_vocab = [&](const Tensor& t, const char* key) -> Status {
    const int64_t* v = t.ptr<int64_t>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (v[i] < 0 || v[i] >= vocab) {
        return make_error(ErrorCode::kCorrupt, "{}{}[{}] = {} is outside the vocabulary [0, {})", p,
                          key, i, v[i], vocab);
      }
    }
    return {};
  };
  if (r.ids.empty()) return make_error(ErrorCode::kCorrupt, "{}ids is empty", p);
  RECUR_RETURN_IF_ERROR(ids_in_vocab(r.ids_tensor, "ids"));
  RECUR_RETURN_IF_ERROR(ids_in_vocab(r.gen_tensor, "gen"));
  auto check_logits = [&](const Tensor& values, const Tensor& top_ids, const char* key,
                          size_t rows) -> Status {
    if (values.ndim != 2 || values.rows() != int64_t(rows)) {
      return make_error(ErrorCode::kCorrupt, "{}{} has shape {}; expected {} rows", p, key,
                        values.shape_string(), rows);
    }
    if (top_ids.empty()) {
      if (values.shape[1] != vocab) {
        return make_error(ErrorCode::kCorrupt, "{}{} has {} columns; the model's vocabulary has {}",
                          p, key, values.shape[1], vocab);
      }
      return {};
    }
    if (top_ids.ndim != 2 || top_ids.shape[0] != values.shape[0] ||
        top_ids.shape[1] != values.shape[1]) {
      return make_error(ErrorCode::kCorrupt, "{}{}: top ids of shape {} for values of shape {}", p,
                        key, top_ids.shape_string(), values.shape_string());
    }
    return ids_in_vocab(top_ids, key);
  };
  RECUR_RETURN_IF_ERROR(check_logits(r.logits, r.logits_top_ids, "logits", r.ids.size()));
  RECUR_RETURN_IF_ERROR(check_logits(r.gen_logits, r.gen_top_ids, "gen_logits", r.gen.size()));
  return {};
}

// The largest |ours - reference| of one mode, and the first value that is not a finite number:
// any NaN or infinity, ours or the reference's, fails the comparison (std::max would drop a
// NaN and report the error of the other values).
// A value that is not finite, as the messages name it ("nan" whatever its sign bit).
std::string not_finite(float v) {
  return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf";
}

struct Comparison {
  double err = 0;
  std::string problem;  // empty while every value is finite
  // The report's figures: KL(reference || ours) of the softmax distributions (full rows only),
  // and how often the two argmaxes agree.
  double kl_sum = 0, kl_max = 0;
  int64_t rows = 0, kl_rows = 0, top1_agree = 0;

  bool ok(double tolerance) const { return problem.empty() && err <= tolerance; }

  // One row: `ours` has all V logits; the top-k variant compares at the stored ids.
  void add_row(const float* ours, int64_t vocab, const Tensor& ref, const Tensor& top_ids,
               int64_t row, std::string_view where) {
    if (!problem.empty()) return;
    for (int64_t j = 0; j < vocab; ++j) {
      if (!std::isfinite(ours[j])) {
        problem = fmt::format("our logit {} at {} is {}", j, where, not_finite(ours[j]));
        err = INFINITY;
        return;
      }
    }
    const float* r = ref.row<float>(row);
    const int64_t* ids = top_ids.empty() ? nullptr : top_ids.row<int64_t>(row);
    for (int64_t j = 0; j < ref.shape[1]; ++j) {
      if (!std::isfinite(r[j])) {
        problem = fmt::format("the reference logit {} at {} is {}", ids ? ids[j] : j, where,
                              not_finite(r[j]));
        err = INFINITY;
        return;
      }
      err = std::max(err, std::fabs(double(ours[ids ? ids[j] : j]) - double(r[j])));
    }
    ++rows;
    const int64_t ref_best =
        ids ? ids[std::max_element(r, r + ref.shape[1]) - r] : std::max_element(r, r + vocab) - r;
    top1_agree += (std::max_element(ours, ours + vocab) - ours) == ref_best;
    if (ids == nullptr) {  // KL needs the whole distribution
      const double ref_max = r[ref_best], our_max = *std::max_element(ours, ours + vocab);
      double zr = 0, zo = 0;
      for (int64_t j = 0; j < vocab; ++j) {
        zr += std::exp(double(r[j]) - ref_max);
        zo += std::exp(double(ours[j]) - our_max);
      }
      const double lr = std::log(zr), lo = std::log(zo);
      double kl = 0;
      for (int64_t j = 0; j < vocab; ++j) {
        const double log_p = double(r[j]) - ref_max - lr, log_q = double(ours[j]) - our_max - lo;
        kl += std::exp(log_p) * (log_p - log_q);
      }
      kl_sum += kl;
      kl_max = std::max(kl_max, kl);
      ++kl_rows;
    }
  }
  void add(const Comparison& o) {
    if (problem.empty() && !o.problem.empty()) problem = o.problem;
    err = problem.empty() ? std::max(err, o.err) : INFINITY;
    kl_sum += o.kl_sum;
    kl_max = std::max(kl_max, o.kl_max);
    rows += o.rows;
    kl_rows += o.kl_rows;
    top1_agree += o.top1_agree;
  }
  std::string report() const {
    const std::string kl = kl_rows == 0 ? "kl=n/a (top-k reference)"
                                        : fmt::format("kl_mean={:.3e} kl_max={:.3e}",
                                                      kl_sum / double(kl_rows), kl_max);
    return fmt::format("{} top1={}/{} ({:.2f}%)", kl, top1_agree, rows,
                       rows ? 100.0 * double(top1_agree) / double(rows) : 0.0);
  }
};

void print_mode(size_t prompt, const char* mode, size_t tokens, const Comparison& c,
                double tolerance, bool report) {
  fmt::print("p{} {:<8} tokens={:<4} max_abs_err={:.3e}{}{}{}\n", prompt, mode, tokens, c.err,
             report ? " " + c.report() : "", c.ok(tolerance) || report ? "" : "  FAIL",
             c.problem.empty() ? "" : ": " + c.problem);
}

struct Runner {
  Model& model;
  Tensor logits;  // [max rows, V]
  std::vector<float> host;
  Batch batch;
  std::vector<int32_t> blocks;

  // Feeds tokens at positions pos..; returns logits of the last `rows` tokens into host.
  Status feed(std::span<const int32_t> toks, int pos, bool all_logits) {
    batch.clear();
    batch.add_sequence(0, pos, toks, blocks,
                       all_logits ? Batch::Logits::kAll : Batch::Logits::kLast);
    RECUR_RETURN_IF_ERROR(model.forward(batch, logits));
    const size_t rows = batch.logit_rows.size();
    host.resize(rows * size_t(model.info().vocab_size));
    model.ops().copy_to_host(logits.slice_rows(0, int64_t(rows)), host.data());
    return Status();
  }
};

int run_verify(const std::string& model_dir, const std::string& golden_path, double tolerance,
               int threads, const std::string& device, Quantize quantize, DType kv_cache_dtype,
               bool report, int tensor_parallel, const BackendOptions& backend) {
  auto golden = SafetensorsFile::open(golden_path);
  if (!golden.ok()) {
    fmt::print(stderr, "error: {}\n", golden.error().to_string());
    return 2;
  }
  std::vector<Reference> refs;
  bool missing = false;
  size_t n_prompts = 0;  // p0.ids ... up to the first one missing
  for (;; ++n_prompts) {
    const std::string p = fmt::format("p{}.", n_prompts);
    if (!golden->contains(p + "ids")) break;
    Reference r;
    auto need = [&](const std::string& key, Tensor* out, DType dt) {
      auto t = golden->tensor(p + key);
      if (!t.ok() || t->dtype != dt) {
        fmt::print("{}{}: missing or not {}\n", p, key, dtype_name(dt));
        missing = true;
        return false;
      }
      *out = *t;
      return true;
    };
    need("ids", &r.ids_tensor, DType::I64);
    need("gen", &r.gen_tensor, DType::I64);
    if (golden->contains(p + "logits")) {
      need("logits", &r.logits, DType::F32);
      need("gen_logits", &r.gen_logits, DType::F32);
    } else {
      need("logits_top_values", &r.logits, DType::F32);
      need("logits_top_ids", &r.logits_top_ids, DType::I64);
      need("gen_logits_top_values", &r.gen_logits, DType::F32);
      need("gen_logits_top_ids", &r.gen_top_ids, DType::I64);
    }
    if (missing) continue;
    r.ids = read_ids(r.ids_tensor);
    r.gen = read_ids(r.gen_tensor);
    refs.push_back(std::move(r));
  }
  // The prompts are p0, p1, ... without gaps: a tensor of a prompt past the first one missing
  // (p1.* gone, a stray p99.ids) means prompts that would go unchecked.
  for (const auto& [name, entry] : golden->entries()) {
    if (name.size() < 3 || name[0] != 'p') continue;
    size_t k = 0;
    const auto [end, ec] = std::from_chars(name.data() + 1, name.data() + name.size(), k);
    if (ec == std::errc() && end < name.data() + name.size() && *end == '.' && k >= n_prompts) {
      fmt::print(stderr,
                 "error: {}: {} belongs to prompt {}, but prompt {} has no p{}.ids: prompts "
                 "must be numbered from 0 without gaps\n",
                 golden_path, name, k, n_prompts, n_prompts);
      return 2;
    }
  }
  if (refs.empty()) {
    fmt::print(stderr, "error: no prompts (p0.ids, ...) in {}\n", golden_path);
    return 2;
  }

  size_t max_prompt = 0, max_total = 0;
  for (auto& r : refs) {
    max_prompt = std::max(max_prompt, r.ids.size());
    max_total = std::max(max_total, r.ids.size() + r.gen.size());
  }
  auto ops_r = create_rank_backend(device, threads, tensor_parallel, backend);
  if (!ops_r.ok()) {
    fmt::print(stderr, "error: {}\n", ops_r.error().to_string());
    return 2;
  }
  Ops& ops = **ops_r;
  LoadOptions opt;
  opt.max_batch_tokens = int(std::max<size_t>(max_prompt, 17));
  opt.state.n_slots = 1;
  opt.state.block_size = 16;
  opt.state.n_blocks = int(max_total / 16 + 1);
  opt.quantize = quantize;
  opt.kv_cache_dtype = kv_cache_dtype;
  opt.tensor_parallel = tensor_parallel;
  opt.rank_backend = rank_backend_maker(device, threads, tensor_parallel, backend);
  auto model = load_model(model_dir, ops, opt);
  if (!model.ok()) {
    fmt::print(stderr, "error: {}\n", model.error().to_string());
    return 2;
  }
  Model& m = **model;
  const int V = m.info().vocab_size;
  const std::optional<Fp8Activations> fp8_act = ops.fp8_activations();
  const std::optional<PromptActivations> prompt_act = ops.prompt_activations();
  fmt::print(
      "weights: {:.2f} MiB at load{}{}{}\n", double(m.info().weight_bytes) / (1 << 20),
      quantize == Quantize::kNone ? "" : fmt::format(" (--quantize {})", quantize_name(quantize)),
      fp8_act ? fmt::format("; FP8 prompt activations {}", fp8_activations_name(*fp8_act)) : "",
      prompt_act
          ? fmt::format("; 16-bit prompt activations {}", prompt_activations_name(*prompt_act))
          : "");
  fmt::print("attention cache: {}, {} bytes per token\n", dtype_name(kv_cache_dtype),
             m.info().kv_bytes_per_token);
  for (size_t pi = 0; pi < refs.size(); ++pi) {
    Status st = check_reference(refs[pi], V, fmt::format("p{}.", pi));
    if (!st.ok()) {
      fmt::print(stderr, "error: {}: {}\n", golden_path, st.error().message);
      return 2;
    }
  }
  auto logits_buf =
      ops.allocator().allocate(size_t(opt.max_batch_tokens) * size_t(V) * 4, "logits");
  if (!logits_buf.ok()) {
    fmt::print(stderr, "error: {}\n", logits_buf.error().to_string());
    return 2;
  }
  Runner run{m, view(*logits_buf, DType::F32, {opt.max_batch_tokens, V}), {}, {}, {}};
  for (int b = 0; b < opt.state.n_blocks; ++b) run.blocks.push_back(b);

  Comparison overall;
  bool failed = missing;
  for (size_t pi = 0; pi < refs.size(); ++pi) {
    const Reference& r = refs[pi];
    const int T = int(r.ids.size());
    for (const char* mode : {"whole", "chunks17", "token"}) {
      m.reset_slot(0);
      const int step = std::string(mode) == "whole" ? T : std::string(mode) == "chunks17" ? 17 : 1;
      Comparison c;
      for (int pos = 0; pos < T; pos += step) {
        const int len = std::min(step, T - pos);
        Status st = run.feed(std::span(r.ids).subspan(size_t(pos), size_t(len)), pos, true);
        if (!st.ok()) {
          fmt::print(stderr, "error: {}\n", st.error().to_string());
          return 2;
        }
        for (int i = 0; i < len; ++i) {
          c.add_row(run.host.data() + size_t(i) * size_t(V), V, r.logits, r.logits_top_ids, pos + i,
                    fmt::format("prompt token {}", pos + i));
        }
      }
      print_mode(pi, mode, size_t(T), c, tolerance, report);
      overall.add(c);
      failed = failed || !c.ok(tolerance);
    }
    // Teacher-forced decode: prefill the prompt, then feed the reference continuation.
    m.reset_slot(0);
    Comparison c;
    Status st = run.feed(r.ids, 0, false);
    for (size_t j = 0; st.ok() && j < r.gen.size(); ++j) {
      c.add_row(run.host.data(), V, r.gen_logits, r.gen_top_ids, int64_t(j),
                fmt::format("decode step {}", j));
      if (j + 1 < r.gen.size()) st = run.feed(std::span(&r.gen[j], 1), T + int(j), false);
    }
    if (!st.ok()) {
      fmt::print(stderr, "error: {}\n", st.error().to_string());
      return 2;
    }
    print_mode(pi, "decode", r.gen.size(), c, tolerance, report);
    overall.add(c);
    failed = failed || !c.ok(tolerance);
  }
  if (report) {
    // Figures, not a verdict: fails only on a value that is not finite (or a missing key).
    fmt::print("report: max_abs_err={:.6e} {} kv_cache={}{}\n", overall.err, overall.report(),
               dtype_name(kv_cache_dtype),
               overall.problem.empty() ? "" : "  FAIL: " + overall.problem);
    return missing || !overall.problem.empty() ? 1 : 0;
  }
  // The verdict, on the last line: what `make run` shows.
  fmt::print("max_abs_err={:.6e} tolerance={:.1e} {}\n", overall.err, tolerance,
             failed ? "FAIL" : "PASS");
  return failed ? 1 : 0;
}

}  // namespace

void register_verify(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("verify", "Compare logits with a reference file from transformers");
  auto model = std::make_shared<std::string>();
  auto golden = std::make_shared<std::string>();
  auto tolerance = std::make_shared<double>(1e-3);
  auto threads = std::make_shared<int>(0);
  auto device = std::make_shared<std::string>("cpu");
  add_device_option(cmd, device.get());
  cmd->add_option("--model", *model, "model directory")->required();
  cmd->add_option("--golden", *golden, "golden.safetensors")->required();
  cmd->add_option("--tolerance", *tolerance, "largest allowed |logit error|")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            double v = 0;
            const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
            const bool fine =
                ec == std::errc() && end == text.data() + text.size() && std::isfinite(v) && v >= 0;
            return fine ? "" : "must be a finite number >= 0, got " + text;
          },
          "NUMBER >= 0"));
  add_threads_option(cmd, threads.get());
  auto quantize = std::make_shared<Quantize>(Quantize::kNone);
  add_quantize_option(cmd, quantize.get());
  auto kv_cache_dtype = std::make_shared<DType>(DType::F32);
  add_kv_cache_dtype_option(cmd, kv_cache_dtype.get());
  auto tensor_parallel = std::make_shared<int>(1);
  add_tensor_parallel_option(cmd, tensor_parallel.get());
  auto backend = std::make_shared<BackendOptions>();
  add_fp8_activations_option(cmd, &backend->fp8_activations);
  add_prompt_activations_option(cmd, &backend->prompt_activations);
  auto report = std::make_shared<bool>(false);
  cmd->add_flag("--report", *report,
                "print max error, KL divergence and top-1 agreement per mode and overall "
                "instead of a verdict (for quantized weights or attention caches)");
  cmd->callback([=] {
    int rc = run_verify(*model, *golden, *tolerance, *threads, *device, *quantize, *kv_cache_dtype,
                        *report, *tensor_parallel, *backend);
    if (rc != 0) exit_with(rc);
  });
}

}  // namespace recur::cli
