// The model, backend and engine flags that `recur generate` and `recur serve` share; what they
// set is launch/engine_options.h's EngineOptions.
#pragma once

#include <string>

#include "cli/commands.h"
#include "launch/engine_options.h"

namespace recur::cli {

// Registers --tensor-parallel N on cmd, writing into *n.
void add_tensor_parallel_option(CLI::App* cmd, int* n);
// Registers --device (cpu, cuda, cuda:N, cuda:N,M,...) on cmd, writing into *device.
void add_device_option(CLI::App* cmd, std::string* device);
// --threads, also read from RECUR_THREADS (0: every core).
void add_threads_option(CLI::App* cmd, int* threads);

// Registers --quantize none|fp8|int8|q4 on cmd, writing into *q.
void add_quantize_option(CLI::App* cmd, Quantize* q);

// Registers --kv-cache-dtype f32|bf16|f16|fp8 on cmd, writing into *t.
void add_kv_cache_dtype_option(CLI::App* cmd, DType* t);

// Registers --fp8-activations e4m3|f16 on cmd, writing into *a.
void add_fp8_activations_option(CLI::App* cmd, Fp8Activations* a);
void add_prompt_activations_option(CLI::App* cmd, PromptActivations* a);

// Registers --model, --device, --threads, --max-batch, --max-batch-tokens, --max-context,
// --kv-cache-mb, --prefix-cache-mb, --snapshot-interval, --seed (described by seed_help),
// --pipeline-decode, --quantize, --kv-cache-dtype, --tensor-parallel and --fp8-activations on
// cmd, writing into *o;
// the defaults are what *o holds.
void add_engine_options(CLI::App* cmd, EngineOptions* o, const std::string& seed_help);

}  // namespace recur::cli
