// `recur generate`: greedy decoding of one prompt given as token ids.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "cli/commands.h"
#include "model/qwen3_next.h"

namespace recur::cli {

namespace {

Result<std::vector<int32_t>> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(int32_t(v));
    } catch (const std::exception&) {
      return make_error(ErrorCode::kInvalidArgument, "--prompt-ids: '{}' is not a token id", item);
    }
  }
  if (ids.empty()) return make_error(ErrorCode::kInvalidArgument, "--prompt-ids is empty");
  return ids;
}

int run_generate(const std::string& model_dir, const std::string& prompt_ids, int max_tokens,
                 int threads) {
  auto ids = parse_ids(prompt_ids);
  if (!ids.ok()) {
    fmt::print(stderr, "error: {}\n", ids.error().to_string());
    return 2;
  }
  CpuOps ops(threads > 0 ? threads : default_thread_count());
  LoadOptions opt;
  opt.max_batch_tokens = std::max<int>(int(ids->size()), 1);
  opt.max_logit_rows = 1;
  opt.state.block_size = 16;
  opt.state.n_blocks = int((ids->size() + size_t(max_tokens)) / 16 + 1);
  auto model = load_model(model_dir, ops, opt);
  if (!model.ok()) {
    fmt::print(stderr, "error: {}\n", model.error().to_string());
    return 2;
  }
  Model& m = **model;
  const int V = m.info().vocab_size;
  auto buf = ops.allocator().allocate(size_t(V) * 4, "logits");
  if (!buf.ok()) return 2;
  Tensor logits = view(*buf, DType::F32, {1, V});
  std::vector<int32_t> blocks;
  for (int b = 0; b < opt.state.n_blocks; ++b) blocks.push_back(b);
  Batch batch;
  std::vector<int32_t> out;
  std::vector<int32_t> next = *ids;
  int pos = 0;
  for (int step = 0; step < max_tokens; ++step) {
    batch.clear();
    batch.add_sequence(0, pos, next, blocks, Batch::Logits::kLast);
    Status st = m.forward(batch, logits);
    if (!st.ok()) {
      fmt::print(stderr, "error: {}\n", st.error().to_string());
      return 2;
    }
    pos += int(next.size());
    const float* l = logits.ptr<float>();
    const int32_t best = int32_t(std::max_element(l, l + V) - l);
    out.push_back(best);
    next.assign(1, best);
    if (std::find(m.info().eos_token_ids.begin(), m.info().eos_token_ids.end(), best) !=
        m.info().eos_token_ids.end()) {
      break;
    }
  }
  for (size_t i = 0; i < out.size(); ++i) fmt::print("{}{}", i ? "," : "", out[i]);
  fmt::print("\n");
  return 0;
}

}  // namespace

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Greedy generation from token ids");
  auto model = std::make_shared<std::string>();
  auto prompt_ids = std::make_shared<std::string>();
  auto max_tokens = std::make_shared<int>(16);
  auto threads = std::make_shared<int>(0);
  cmd->add_option("--model", *model, "model directory")->required();
  cmd->add_option("--prompt-ids", *prompt_ids, "comma-separated token ids")->required();
  cmd->add_option("--max-tokens", *max_tokens, "tokens to generate")->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--threads", *threads, "CPU threads (default: all)");
  cmd->callback([=] {
    int rc = run_generate(*model, *prompt_ids, *max_tokens, *threads);
    if (rc != 0) exit_with(rc);
  });
}

}  // namespace recur::cli
