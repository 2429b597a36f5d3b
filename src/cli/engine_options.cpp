#include "cli/engine_options.h"

#include <algorithm>
#include <map>

namespace recur::cli {

void add_engine_options(CLI::App* cmd, EngineOptions* o, const std::string& seed_help) {
  cmd->add_option("--model", o->model, "model directory")->required();
  add_device_option(cmd, &o->device);
  add_threads_option(cmd, &o->threads);
  cmd->add_option("--max-batch", o->max_batch, "sequences decoded at once")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-batch-tokens", o->max_batch_tokens, "tokens per engine step")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-context", o->max_context, "context length (0: the model's)")
      ->check(CLI::Range(0, 1 << 30))
      ->default_str("the model's");
  cmd->add_option("--kv-cache-mb", o->kv_cache_mb, "attention-cache budget in MiB")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 24));
  cmd->add_option("--prefix-cache-mb", o->prefix_cache_mb,
                  "prefix-cache memory in MiB (recurrent-state snapshots and attention blocks "
                  "kept for prompts that start alike), 0: off")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 24));
  cmd->add_option("--snapshot-interval", o->snapshot_interval,
                  "prompt tokens between prefix-cache snapshots inside a long prompt")
      ->check(CLI::Range(1, 1 << 30));
  cmd->add_option("--seed", o->seed, seed_help);
  cmd->add_option("--pipeline-decode", o->pipeline_decode,
                  "greedy steps queued one ahead of reading their picks: 1 on, 0 off, -1 on "
                  "for GPUs (default)")
      ->check(CLI::Range(-1, 1));
  add_quantize_option(cmd, &o->quantize);
  add_kv_cache_dtype_option(cmd, &o->kv_cache_dtype);
  add_tensor_parallel_option(cmd, &o->tensor_parallel);
  add_fp8_activations_option(cmd, &o->backend.fp8_activations);
  add_prompt_activations_option(cmd, &o->backend.prompt_activations);
}

void add_threads_option(CLI::App* cmd, int* threads) {
  cmd->add_option("--threads", *threads, "CPU threads (0: all cores)")
      ->default_str("all cores")
      ->envname("RECUR_THREADS")
      ->check(CLI::Range(0, 1024));
}

void add_device_option(CLI::App* cmd, std::string* device) {
  cmd->add_option("--device", *device,
                  "cpu, cuda or cuda:N; under --tensor-parallel, rank r takes cuda:N+r, or "
                  "cuda:N,M,... names each rank's device");
}

void add_tensor_parallel_option(CLI::App* cmd, int* n) {
  cmd->add_option("--tensor-parallel", *n,
                  "ranks that split every layer's heads and columns between them (CPU: threads "
                  "of this process, --threads shared among them; CUDA: one GPU each, joined "
                  "by NCCL, or all on one GPU when --device lists it for each)")
      ->check(CLI::Range(1, 64));
}

namespace {

// An option whose value is one of the names (any case), stored as what the name maps to; help
// and errors list the names (CLI11's enum transformers would print the enums' raw values).
template <typename T>
void add_named_option(CLI::App* cmd, const std::string& flag, const std::string& help,
                      std::map<std::string, T> names, T* out) {
  std::vector<std::string> keys;
  for (const auto& [name, value] : names) keys.push_back(name);
  cmd->add_option_function<std::string>(
         flag, [names, out](const std::string& v) { *out = names.at(v); }, help)
      ->transform(CLI::IsMember(keys, CLI::ignore_case));
}

}  // namespace

void add_kv_cache_dtype_option(CLI::App* cmd, DType* t) {
  add_named_option(
      cmd, "--kv-cache-dtype",
      "element type of the attention cache: f32 (default), bf16 (half the memory), "
      "f16 (half the memory, 3 more significand bits than bf16, range ±65504, "
      "saturating) or fp8 (e4m3, a quarter)",
      std::map<std::string, DType>{
          {"f32", DType::F32}, {"bf16", DType::BF16}, {"f16", DType::F16}, {"fp8", DType::F8_E4M3}},
      t);
}

void add_fp8_activations_option(CLI::App* cmd, Fp8Activations* a) {
  add_named_option(cmd, "--fp8-activations",
                   "how prompts multiply block-FP8 weights on a GPU with FP8 tensor cores: e4m3 "
                   "(default: activations quantized per token and 128 channels, as the FP8 "
                   "releases' dynamic scheme) or f16 (two f16 terms each: f32-class results, "
                   "slower prompts)",
                   std::map<std::string, Fp8Activations>{{"e4m3", Fp8Activations::kE4m3},
                                                         {"f16", Fp8Activations::kF16}},
                   a);
}

void add_prompt_activations_option(CLI::App* cmd, PromptActivations* a) {
  add_named_option(cmd, "--prompt-activations",
                   "how prompts multiply bf16/f16 weights on a GPU with warpgroup products "
                   "(Hopper): f16x2 (default: two f16 terms of each value, f32-class results) "
                   "or f16 (one f16 term of each row scaled to f16's range: 11 significant "
                   "bits, faster prompts; decode tokens keep f32-class products)",
                   std::map<std::string, PromptActivations>{{"f16x2", PromptActivations::kF16x2},
                                                            {"f16", PromptActivations::kF16}},
                   a);
}

void add_quantize_option(CLI::App* cmd, Quantize* q) {
  add_named_option(cmd, "--quantize",
                   "quantize a bf16/f32 checkpoint's matmul weights at load: fp8 (128x128 "
                   "blocks, as the FP8 releases), int8 or q4 (groups of 32, f16 scales; CPU); "
                   "norms, embeddings, routers and small gates stay as stored",
                   std::map<std::string, Quantize>{{"none", Quantize::kNone},
                                                   {"fp8", Quantize::kFp8},
                                                   {"int8", Quantize::kInt8},
                                                   {"q4", Quantize::kQ4}},
                   q);
}

}  // namespace recur::cli
