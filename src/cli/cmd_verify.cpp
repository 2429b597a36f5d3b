// `recur verify`: compares the model's logits with reference logits from transformers, for
// the whole prompt in one call, in chunks of 17 tokens, one token per call, and teacher-forced
// decode of the reference continuation.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "cli/commands.h"
#include "io/safetensors.h"
#include "model/registry.h"

namespace recur::cli {

namespace {

struct Reference {
  std::vector<int32_t> ids;  // [T]
  std::vector<int32_t> gen;  // [N]
  Tensor logits;             // [T, V] or top values [T, 20]
  Tensor logits_top_ids;     // [T, 20] I64 (top-k variant only)
  Tensor gen_logits;         // [N, V] or [N, 20]
  Tensor gen_top_ids;
};

std::vector<int32_t> read_ids(const Tensor& t) {
  std::vector<int32_t> out(size_t(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = int32_t(t.ptr<int64_t>()[i]);
  return out;
}

// Largest |ours - reference| over one row; the top-k variant compares at the stored ids.
double row_error(const float* ours, const Tensor& ref, const Tensor& top_ids, int64_t row) {
  double err = 0;
  if (top_ids.empty()) {
    const float* r = ref.row<float>(row);
    for (int64_t j = 0; j < ref.shape[1]; ++j) err = std::max(err, double(std::fabs(ours[j] - r[j])));
  } else {
    const float* r = ref.row<float>(row);
    const int64_t* ids = top_ids.row<int64_t>(row);
    for (int64_t j = 0; j < ref.shape[1]; ++j) err = std::max(err, double(std::fabs(ours[ids[j]] - r[j])));
  }
  return std::isnan(err) ? INFINITY : err;
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
    batch.add_sequence(0, pos, toks, blocks, all_logits ? Batch::Logits::kAll : Batch::Logits::kLast);
    RECUR_RETURN_IF_ERROR(model.forward(batch, logits));
    const size_t rows = batch.logit_rows.size();
    host.resize(rows * size_t(model.info().vocab_size));
    model.ops().copy_to_host(logits.slice_rows(0, int64_t(rows)), host.data());
    return Status();
  }
};

int run_verify(const std::string& model_dir, const std::string& golden_path, double tolerance,
               int threads, const std::string& device) {
  auto golden = SafetensorsFile::open(golden_path);
  if (!golden.ok()) {
    fmt::print(stderr, "error: {}\n", golden.error().to_string());
    return 2;
  }
  std::vector<Reference> refs;
  bool missing = false;
  for (int i = 0;; ++i) {
    const std::string p = fmt::format("p{}.", i);
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
    Tensor ids, gen;
    need("ids", &ids, DType::I64);
    need("gen", &gen, DType::I64);
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
    r.ids = read_ids(ids);
    r.gen = read_ids(gen);
    if (r.logits.rows() != int64_t(r.ids.size()) || r.gen_logits.rows() != int64_t(r.gen.size())) {
      fmt::print("{}: logits rows do not match the ids\n", p);
      missing = true;
      continue;
    }
    refs.push_back(std::move(r));
  }
  if (refs.empty()) {
    fmt::print("no prompts found in {}\n", golden_path);
    return 1;
  }

  size_t max_prompt = 0, max_total = 0;
  for (auto& r : refs) {
    max_prompt = std::max(max_prompt, r.ids.size());
    max_total = std::max(max_total, r.ids.size() + r.gen.size());
  }
  auto ops_r = create_backend(device, threads);
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
  auto model = load_model(model_dir, ops, opt);
  if (!model.ok()) {
    fmt::print(stderr, "error: {}\n", model.error().to_string());
    return 2;
  }
  Model& m = **model;
  const int V = m.info().vocab_size;
  auto logits_buf = ops.allocator().allocate(size_t(opt.max_batch_tokens) * size_t(V) * 4, "logits");
  if (!logits_buf.ok()) {
    fmt::print(stderr, "error: {}\n", logits_buf.error().to_string());
    return 2;
  }
  Runner run{m, view(*logits_buf, DType::F32, {opt.max_batch_tokens, V}), {}, {}, {}};
  for (int b = 0; b < opt.state.n_blocks; ++b) run.blocks.push_back(b);

  double worst = 0;
  bool failed = missing;
  for (size_t pi = 0; pi < refs.size(); ++pi) {
    const Reference& r = refs[pi];
    const int T = int(r.ids.size());
    for (const char* mode : {"whole", "chunks17", "token"}) {
      m.reset_slot(0);
      const int step = std::string(mode) == "whole" ? T : std::string(mode) == "chunks17" ? 17 : 1;
      double err = 0;
      for (int pos = 0; pos < T; pos += step) {
        const int len = std::min(step, T - pos);
        Status st = run.feed(std::span(r.ids).subspan(size_t(pos), size_t(len)), pos, true);
        if (!st.ok()) {
          fmt::print(stderr, "error: {}\n", st.error().to_string());
          return 2;
        }
        for (int i = 0; i < len; ++i) {
          err = std::max(err, row_error(run.host.data() + size_t(i) * size_t(V), r.logits,
                                        r.logits_top_ids, pos + i));
        }
      }
      fmt::print("p{} {:<8} tokens={:<4} max_abs_err={:.3e}{}\n", pi, mode, T, err,
                 err <= tolerance ? "" : "  FAIL");
      worst = std::max(worst, err);
      failed = failed || !(err <= tolerance);
    }
    // Teacher-forced decode: prefill the prompt, then feed the reference continuation.
    m.reset_slot(0);
    double err = 0;
    Status st = run.feed(r.ids, 0, false);
    for (size_t j = 0; st.ok() && j < r.gen.size(); ++j) {
      err = std::max(err, row_error(run.host.data(), r.gen_logits, r.gen_top_ids, int64_t(j)));
      if (j + 1 < r.gen.size()) st = run.feed(std::span(&r.gen[j], 1), T + int(j), false);
    }
    if (!st.ok()) {
      fmt::print(stderr, "error: {}\n", st.error().to_string());
      return 2;
    }
    fmt::print("p{} {:<8} tokens={:<4} max_abs_err={:.3e}{}\n", pi, "decode", r.gen.size(), err,
               err <= tolerance ? "" : "  FAIL");
    worst = std::max(worst, err);
    failed = failed || !(err <= tolerance);
  }
  fmt::print("max_abs_err={:.6e}\n", worst);
  return failed ? 1 : 0;
}

}  // namespace

void register_verify(CLI::App& app) {
  auto* cmd = app.add_subcommand("verify", "Compare logits with a reference file from transformers");
  auto model = std::make_shared<std::string>();
  auto golden = std::make_shared<std::string>();
  auto tolerance = std::make_shared<double>(1e-3);
  auto threads = std::make_shared<int>(0);
  auto device = std::make_shared<std::string>("cpu");
  cmd->add_option("--device", *device, "cpu, cuda or cuda:N");
  cmd->add_option("--model", *model, "model directory")->required();
  cmd->add_option("--golden", *golden, "golden.safetensors")->required();
  cmd->add_option("--tolerance", *tolerance, "largest allowed |logit error|");
  cmd->add_option("--threads", *threads, "CPU threads (default: all)");
  cmd->callback([=] {
    int rc = run_verify(*model, *golden, *tolerance, *threads, *device);
    if (rc != 0) exit_with(rc);
  });
}

}  // namespace recur::cli
