// The continuous-batching engine: requests are admitted and retired at any step, prompts are
// prefilled in chunks between other sequences' decode steps, and every resource comes from
// pools sized at start-up, so a completion's cost per token in memory and buffers is constant.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "engine/sampler.h"
#include "engine/schedule.h"
#include "engine/token_constraint.h"
#include "model/registry.h"
#include "tokenizer/tokenizer.h"

namespace recur {

struct StopConditions {
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;               // end generation, like EOS
  std::vector<std::vector<int32_t>> stop_sequences;  // token sequences ending generation
  std::vector<std::string> stop_strings;             // matched on decoded text (needs a tokenizer)
};

struct Request {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  StopConditions stop;
  int max_tokens = 16;
  bool skip_special_tokens = true;  // for the text that events carry
  // Lower is served first (as vLLM's `priority`): in admission and in the share of each
  // step's prompt budget. Never starved: see EngineConfig::aging_steps and the minimum share.
  int priority = 0;
  // Structured outputs: the tokens sampled are only those its rule allows (null: any).
  std::shared_ptr<const ConstraintSpec> constraint;
};

// A request's sampling before its own overrides: generation_config.json's values when it sets
// do_sample, greedy otherwise (as transformers' generate does).
SamplingParams default_sampling(const GenerationDefaults& gd);

enum class FinishReason { kStop, kLength, kCancelled, kError };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "cancelled", "error"

// Delivered to a request's sink on the engine thread; views are valid during the call only.
struct Event {
  enum class Kind { kToken, kFinish };
  uint64_t request_id = 0;
  Kind kind = Kind::kToken;
  int32_t token = -1;                          // kToken
  float logprob = 0;                           // kToken, when logprobs were asked for
  std::span<const TokenLogprob> top_logprobs;  // kToken
  std::string_view text;                       // text released with this event (may be empty)
  FinishReason reason = FinishReason::kStop;   // kFinish
  std::string_view message;                    // kFinish: why, for errors and limits
  int prompt_tokens = 0;                       // kFinish
  int generated_tokens = 0;                    // kFinish
  int cached_tokens = 0;                       // prompt tokens the prefix cache gave
  // kFinish of a request that cancel() ended: engine steps completed between the queueing of
  // the cancel and the release, 0 or 1 (the step in flight); -1 otherwise.
  int64_t cancel_steps = -1;
  // kToken, when SamplingParams::vocab_logprobs: log_softmax of the step's raw logits [vocab].
  std::span<const float> vocab_logprobs;
};
// Runs on the engine thread: must be quick and must not call back into the engine.
using EventSink = std::function<void(const Event&)>;
// Runs on the engine thread after each step that delivered events, so that a consumer can take
// a whole step's events at once (one wake-up per step instead of one per token).
using StepListener = std::function<void()>;

// Scheduling, in each step: one decode token for every sequence past its prompt; then the prompt
// budget shared among the prompts being prefilled (engine/schedule.h: a minimum share for each,
// the rest by priority, max-min fair within one), so that a short prompt is done in a few steps
// however long the prompts beside it; then deep chunks cut so that the step's attention work
// fits step_time_target_ms. Admission: by priority, then arrival; a request the free cache
// blocks cannot hold yet is passed by those they can, until it has waited aging_steps.
struct EngineConfig {
  int max_batch = 8;           // sequences in flight (recurrent-state slots)
  int max_batch_tokens = 512;  // tokens per step, decode tokens first, then prompt chunks
  // A step carrying prompt chunks is held to about this long by cutting the chunks of prompts
  // deep into their context, whose attention grows with their position (a 512-token chunk at
  // position 90,000 of the tiny model takes seconds on one core). The cost of an attended
  // position is fitted from the engine's own steps. A new request's first token then comes
  // within about two steps however long the prompts being prefilled. 0: chunks are bounded by
  // max_batch_tokens alone.
  double step_time_target_ms = 100;
  // A request that has waited this many steps for admission goes before all that have waited
  // less, whatever their priorities, and none is admitted past it: low priority and prompts
  // needing many cache blocks are delayed, never starved.
  int aging_steps = 1000;
  // The scheduler before fair prefill, kept as the baseline that bench_fairness measures the
  // default against in the same run: prompt chunks in arrival order (more urgent
  // priorities first), each taking all the budget left, no step-time bound. Admission is the
  // same either way.
  bool arrival_order_prefill = false;
  // 0: the model's limit. Engine::config() holds the effective one: also at most what the
  // attention cache holds for one sequence, so that a lone sequence always fits.
  int max_context = 0;
  int kv_blocks = 0;  // 0: from kv_cache_bytes
  int64_t kv_cache_bytes = int64_t(1) << 30;
  int block_size = 16;
  int max_queue = 4096;  // waiting requests beyond which submit() refuses
  uint64_t seed = 0;     // seeds requests without their own seed; 0: random
  // Greedy decode steps launched one ahead: the next step's forward, fed the picks still on
  // the device, is queued before this step's picks are read. 1 on, 0 off, -1 on for device
  // backends (on the CPU, where the forward runs on the caller's thread, it gains nothing).
  int pipeline_decode = -1;
  // Host rows for SamplingParams::vocab_logprobs ([max_batch, vocab] floats), made at creation;
  // without them requests asking for the vector are refused. The Python package turns it on.
  bool vocab_logprobs = false;
  // Matmul weights of F32/BF16/F16 checkpoints quantized at load (LoadOptions::quantize).
  Quantize quantize = Quantize::kNone;
  DType kv_cache_dtype = DType::F32;  // LoadOptions::kv_cache_dtype
  // Tensor-parallel ranks and the backend of ranks 1.. (LoadOptions::tensor_parallel).
  int tensor_parallel = 1;
  std::function<Result<std::unique_ptr<Ops>>(int rank)> rank_backend;
  // The prefix cache (engine/prefix_cache.h): a prompt starts from the longest prefix whose
  // attention blocks and recurrent-state snapshot an earlier prompt left, and prefills only
  // the rest. prefix_cache_bytes is memory added for it: snapshot slots, each with the blocks
  // of one snapshot interval, which join the attention cache (running sequences take them
  // back when they need them; unreferenced entries go least recently used first). 0: off.
  // A request whose prompt starts like one being prefilled waits (up to aging_steps) for that
  // prefix's snapshot instead of computing it again beside it.
  int64_t prefix_cache_bytes = 0;
  int prefix_snapshots = 0;  // snapshot slots; 0: from prefix_cache_bytes
  // Prompts are snapshotted every this many tokens (rounded up to whole blocks; chunks stop
  // there) and at their last block boundary, the point the next turn of a chat shares.
  int snapshot_interval = 2048;
  // The prefix cache's file (engine_persist.cpp): read at start-up when it was written for
  // this model (its weights' fingerprint, block size and format version) and is whole;
  // written by save_prefix_cache(). Empty: none.
  std::string prefix_cache_file;
};

struct EngineStats {
  int64_t prompt_tokens = 0;     // prompt tokens prefilled
  int64_t generated_tokens = 0;  // tokens sampled
  double prefill_seconds = 0;    // time of steps that carried prompt tokens
  double decode_seconds = 0;     // time of steps that carried only decode tokens
  int64_t decode_step_tokens = 0;
  int64_t steps = 0;
  int64_t pipelined_steps = 0;  // decode steps queued before the previous step's picks were read
  int64_t attention_cut_steps = 0;  // steps whose prompt chunks step_time_target_ms cut
  int running = 0, waiting = 0;
  int kv_blocks_used = 0, kv_blocks_total = 0;
  int slots_used = 0, slots_total = 0;
  int64_t requests_finished = 0;
  int64_t failed_steps = 0;  // steps that threw: their requests in flight ended with an error
  // Running sequences that gave up their cache blocks and state slot for an older sequence's
  // growth and went back to the queue, to resume by recomputing (engine_preempt.cpp).
  int64_t preemptions = 0;
  // The prefix cache: requests looked up, their prompt tokens, the tokens they found cached;
  // entries (blocks) and snapshots held, snapshot slots, state bytes per snapshot; entries
  // and snapshots evicted.
  int64_t prefix_queries = 0, prefix_query_tokens = 0, prefix_hit_tokens = 0;
  int prefix_blocks = 0, prefix_snapshots = 0, prefix_snapshots_total = 0;
  int64_t prefix_snapshot_bytes = 0;  // one snapshot's
  int64_t prefix_evictions = 0, prefix_snapshot_evictions = 0;
  AllocStats alloc;  // the backend's allocator
};

class Engine {
 public:
  // Loads the model with pools sized for `config`. The tokenizer (optional) gives events their
  // text and enables stop strings; it must outlive the engine.
  static Result<std::unique_ptr<Engine>> create(const std::string& model_dir, Ops& ops,
                                                const EngineConfig& config,
                                                const Tokenizer* tokenizer);
  // Runs over a model already loaded (any Model: tests drive the scheduler with a fake one). Its
  // pools must hold what `config` asks: load it with load_options(config).
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<Model> model,
                                                const EngineConfig& config,
                                                const Tokenizer* tokenizer);
  // What a model must be loaded with to serve `config`.
  static LoadOptions load_options(const EngineConfig& config);
  ~Engine();

  // Validates and queues a request; errors name what is wrong with it.
  Result<uint64_t> submit(Request request, EventSink sink);
  // Cancels a queued or running request; its slot and blocks are free after the next step
  // (its finish event tells how many steps that took: Event::cancel_steps).
  void cancel(uint64_t request_id);

  // Runs steps on an engine thread until the engine is destroyed.
  void start();
  // One scheduler step on the caller's thread (when not started); false when idle.
  bool step();
  // Steps until nothing is queued or running (when not started).
  void run_until_idle();

  // Graceful shutdown: refuse new requests, optionally cancel everything in flight, and wait
  // (up to the timeout) until nothing is queued or running. True when idle.
  void stop_accepting();
  void cancel_all();
  bool wait_idle(std::chrono::milliseconds timeout);

  // Replaces the step listener (empty: none). Safe from any thread: once it returns, the
  // previous listener is not running and will not run again.
  void set_step_listener(StepListener listener);

  // Safe from any thread, sinks included.
  EngineStats stats() const;
  // stats() never taken while finishes are being told: every release they show has had its
  // finish event delivered, so what a sink counts of it is counted too (a /metrics read sees a
  // freed slot and its finish together). Not from a sink, which it would wait for.
  EngineStats settled_stats() const;
  const ModelInfo& model_info() const { return model_->info(); }
  const EngineConfig& config() const { return config_; }
  // What start-up made of config().prefix_cache_file: what it loaded, or why it ignored it.
  const std::vector<std::string>& notes() const { return notes_; }
  // Stops the engine as its destruction does (its thread joined, requests in flight
  // cancelled, new ones refused), then writes the prefix cache to config().prefix_cache_file.
  Status save_prefix_cache();
  Model& model() { return *model_; }

  struct Sequence;

 private:
  Engine() = default;
  void thread_main();
  void take_incoming();
  void admit();
  bool build_batch();
  void finish(Sequence& seq, FinishReason reason, std::string_view message);
  void release_finished();
  // A step threw `what`: every request in flight ends with an error, told to its sink.
  void fail_in_flight(std::string_view what);
  void sample_and_emit();
  // vocab_logprobs_'s rows for this step's sequences that asked for them, from the logits rows
  // on the host (host_rows, [rows, vocab]) or, when null, from the backend's, copied once.
  void fill_vocab_logprobs(const float* host_rows);
  void maybe_prelaunch();  // the next step's forward, when this step's picks feed it as they are
  void publish_gauges();   // running, waiting, blocks and slots in use; caller holds mu_
  bool ensure_blocks(Sequence& seq, int last_position);
  // Preemption (engine_preempt.cpp). When a decoding sequence needs a block and none is free,
  // the least urgent running sequences give theirs up, the latest arrival first (vLLM's
  // priority policy; running_ is kept in that order): true when
  // `seq` then has its blocks, false when it was the one preempted (or must wait a step).
  bool make_room(Sequence& seq, int last_position);
  // Releases the sequence's slot and blocks and makes what it generated part of the prompt it
  // resumes with; requeue_preempted() moves it from running_ to the queue.
  void preempt(Sequence& seq);
  void requeue_preempted();
  // The context of one sequence: the configured or model's, bounded by the attention cache.
  static int effective_context(const EngineConfig& config, const ModelInfo& info, int kv_blocks);
  int blocks_for_prompt(const Sequence& seq) const;
  int admittable_blocks() const;  // free blocks no admitted prompt still counts on
  void share_prompt_budget(int budget, int64_t decode_positions);
  void release_blocks(Sequence& seq);
  int32_t take_block();  // a free block, evicting the prefix cache's oldest when none is
  // The prefix cache's part (engine_prefix.cpp).
  // The longest cached prefix of the prompt, into chain_, and its snapshot (-1: none);
  // *pinned: the chain's entries that using it takes from the evictable ones.
  int32_t match_prefix(const Sequence& seq, int* pinned);
  // The admitted sequence's state: chain_'s blocks and the snapshot restored into its slot
  // (or a zeroed slot when snapshot < 0).
  void start_sequence(Sequence& seq, int32_t snapshot);
  // True when a running sequence is prefilling more of the prompt's start than the cache
  // holds: the request then waits for its snapshot (which that sequence is asked to take
  // where the two prompts part) instead of computing the same tokens.
  bool wait_for_shared_prefix(const Sequence& seq);
  int next_cache_stop(const Sequence& seq) const;  // where the current prompt chunk must end
  void cache_prompt_progress(Sequence& seq);       // after a forward fed it prompt tokens
  void notify_step_listener();                     // when this step delivered events
  void shut_down();                                // the destructor's work; idempotent
  // At creation, from the config's file: one that is not a prefix cache is an error (it would
  // be overwritten at exit); a damaged one, or one for other weights, is ignored with a note.
  Status load_prefix_cache();

  EngineConfig config_;
  std::unique_ptr<Model> model_;
  const Tokenizer* tokenizer_ = nullptr;
  Ops* ops_ = nullptr;
  std::unique_ptr<class IdPool> slots_, blocks_;
  std::unique_ptr<class PrefixCache> cache_;  // null: off
  uint64_t cache_seed_ = 0;                   // the model's identity, seeding block hashes
  std::vector<int32_t> chain_;                // admission's match, reused
  std::vector<std::string> notes_;            // about the prefix cache's file
  Buffer logits_buf_;
  Tensor logits_;                   // [max rows, vocab] in the backend's memory
  std::vector<float> host_logits_;  // for backends whose memory the host cannot read
  // Rows of SamplingParams::vocab_logprobs, one per logits row: [max rows, vocab] when
  // EngineConfig::vocab_logprobs, filled by fill_vocab_logprobs for the rows that asked.
  std::vector<float> vocab_logprobs_;
  // Greedy steps on those backends, and pipelined ones: ids chosen by the backend ([max rows]
  // I32) and their host copy.
  Buffer ids_buf_;
  std::vector<int32_t> host_ids_;

  // Owned by the engine thread.
  std::vector<std::unique_ptr<Sequence>> running_, waiting_;
  std::vector<Sequence*> logit_seqs_;       // sequence of each logits row this step
  std::vector<sched::PromptShare> shares_;  // prompts being prefilled this step
  std::vector<Sequence*> share_seqs_;       // the sequence of each share's index
  sched::StepCostModel step_cost_;
  int64_t step_count_ = 0;
  // Cache blocks admitted prompts will still take for their prompt and first token: admission
  // leaves them, and a decode growing past its own reservation cannot take them.
  int reserved_blocks_ = 0;
  int64_t step_attended_ = 0;    // positions this step's tokens attend, for the cost fit
  bool step_preempted_ = false;  // a sequence of running_ was preempted in this step
  bool step_cut_ = false;        // this step's chunks were cut to the step-time target
  Batch batch_;
  bool pipeline_ = false;
  // A forward for the next step is already queued (batch_), with these rows (null: finished
  // since; its result for them is dropped).
  bool prelaunched_ = false;
  std::vector<Sequence*> next_seqs_;
  int64_t pipelined_this_step_ = 0;
  std::string text_buf_;
  int64_t events_this_step_ = 0;

  // Held by the engine thread while the listener runs; set_step_listener takes it to swap.
  std::mutex listener_mu_;
  StepListener step_listener_;

  // Held by the engine thread from the publish of a release until its finishes are told and
  // the gauges count them out of running and waiting; settled_stats() takes it. Before mu_.
  mutable std::mutex telling_mu_;

  // Shared with submitting threads.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Sequence>> incoming_;
  // Request ids, each with the steps completed when its cancel was queued (read together, so
  // that no step passes between them to be counted as the cancellation's).
  std::vector<std::pair<uint64_t, int64_t>> cancels_;
  uint64_t next_id_ = 1;
  bool stop_ = false;
  bool accepting_ = true;
  bool cancel_all_ = false;
  std::condition_variable idle_cv_;
  EngineStats stats_;
  uint64_t seed_counter_ = 0;
  std::thread thread_;
};

}  // namespace recur
