#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "engine/pools.h"
#include "engine/prefix_cache.h"
#include "engine/sequence.h"

namespace recur {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "error";
}

SamplingParams default_sampling(const GenerationDefaults& gd) {
  SamplingParams sp;
  sp.temperature = gd.do_sample ? gd.temperature : 0.0f;
  sp.top_k = gd.do_sample ? gd.top_k : 0;
  sp.top_p = gd.do_sample ? gd.top_p : 1.0f;
  sp.min_p = gd.do_sample ? gd.min_p : 0.0f;
  sp.repetition_penalty = gd.repetition_penalty;
  return sp;
}

namespace {

Status check_config(const EngineConfig& config) {
  if (config.max_batch < 1 || config.max_batch_tokens < config.max_batch || config.block_size < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "max_batch must be >= 1 and max_batch_tokens >= max_batch (got {} and {})",
                      config.max_batch, config.max_batch_tokens);
  }
  if (config.aging_steps < 1 || !(config.step_time_target_ms >= 0)) {
    return make_error(ErrorCode::kInvalidArgument,
                      "aging_steps must be >= 1 and step_time_target_ms >= 0 (got {} and {})",
                      config.aging_steps, config.step_time_target_ms);
  }
  if (config.prefix_cache_bytes < 0 || config.prefix_snapshots < 0 ||
      config.snapshot_interval < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "prefix_cache_bytes and prefix_snapshots must be >= 0 and "
                      "snapshot_interval >= 1 (got {}, {} and {})",
                      config.prefix_cache_bytes, config.prefix_snapshots, config.snapshot_interval);
  }
  return Status();
}

}  // namespace

LoadOptions Engine::load_options(const EngineConfig& config) {
  LoadOptions opt;
  opt.max_batch_tokens = config.max_batch_tokens;
  opt.max_logit_rows = config.max_batch;  // at most one row per sequence per step
  opt.state.n_slots = config.max_batch;
  opt.state.n_blocks = config.kv_blocks;
  opt.state.block_size = config.block_size;
  opt.kv_cache_budget_bytes = config.kv_cache_bytes;
  opt.max_context = config.max_context;
  opt.prefix_cache_budget_bytes = config.prefix_cache_bytes;
  opt.state.n_snapshots = config.prefix_snapshots;
  opt.snapshot_interval = config.snapshot_interval;
  opt.quantize = config.quantize;
  opt.kv_cache_dtype = config.kv_cache_dtype;
  opt.tensor_parallel = config.tensor_parallel;
  opt.rank_backend = config.rank_backend;
  return opt;
}

Result<std::unique_ptr<Engine>> Engine::create(const std::string& model_dir, Ops& ops,
                                               const EngineConfig& config,
                                               const Tokenizer* tokenizer) {
  RECUR_RETURN_IF_ERROR(check_config(config));
  RECUR_ASSIGN_OR_RETURN(std::unique_ptr<Model> model,
                         load_model(model_dir, ops, load_options(config)));
  return create(std::move(model), config, tokenizer);
}

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<Model> model,
                                               const EngineConfig& config,
                                               const Tokenizer* tokenizer) {
  RECUR_RETURN_IF_ERROR(check_config(config));
  if (!model) return make_error(ErrorCode::kInvalidArgument, "no model");
  const StateConfig& sc = model->state_config();
  if (model->max_batch_tokens() < config.max_batch_tokens ||
      model->max_logit_rows() < config.max_batch || sc.n_slots < config.max_batch ||
      sc.block_size != config.block_size || sc.n_blocks < 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the model was loaded for {} tokens, {} logit rows, {} slots and blocks of "
                      "{} per step; the engine needs {}, {}, {} and {}",
                      model->max_batch_tokens(), model->max_logit_rows(), sc.n_slots, sc.block_size,
                      config.max_batch_tokens, config.max_batch, config.max_batch,
                      config.block_size);
  }
  {
    // The model's sampling defaults are checked once, here, rather than blamed on every request
    // that leaves them as they are: those requests take (greedy configs use fewer of them).
    const Status st = default_sampling(model->info().generation).validate(model->info().vocab_size);
    if (!st.ok()) {
      return make_error(ErrorCode::kInvalidArgument,
                        "the model directory's generation_config.json: {}", st.error().message);
    }
  }
  Ops& ops = model->ops();
  std::unique_ptr<Engine> e(new Engine());
  e->config_ = config;
  e->tokenizer_ = tokenizer;
  e->ops_ = &ops;
  e->model_ = std::move(model);
  const ModelInfo& info = e->model_->info();
  e->config_.kv_blocks = sc.n_blocks;
  e->config_.max_context = effective_context(config, info, sc.n_blocks);
  e->slots_ = std::make_unique<IdPool>(config.max_batch);
  e->blocks_ = std::make_unique<IdPool>(e->config_.kv_blocks);
  const int bs = config.block_size;
  e->config_.snapshot_interval = (config.snapshot_interval + bs - 1) / bs * bs;
  if (sc.n_snapshots > 0) {
    e->cache_ = std::make_unique<PrefixCache>(bs, e->config_.kv_blocks, sc.n_snapshots);
    e->chain_.reserve(size_t(e->config_.kv_blocks));
    // Blocks hashed for one model only: its identity seeds every chain (FNV-1a, the same in
    // every build).
    uint64_t seed = 0xcbf29ce484222325ull;
    for (char c : info.architecture) seed = (seed ^ uint8_t(c)) * 0x100000001b3ull;
    for (int64_t v : {int64_t(info.vocab_size), info.weight_bytes, info.state_bytes_per_slot,
                      info.kv_bytes_per_token, int64_t(bs)}) {
      seed = (seed ^ uint64_t(v)) * 0x100000001b3ull;
    }
    // The cache's bytes per token tell f32, bf16 and fp8 blocks apart but not bf16 from f16:
    // an f16 cache adds its type (the other types' seeds, and their files, stay as they were).
    if (config.kv_cache_dtype == DType::F16) {
      seed = (seed ^ uint64_t(DType::F16)) * 0x100000001b3ull;
    }
    e->cache_seed_ = seed;
    e->stats_.prefix_snapshots_total = sc.n_snapshots;
    e->stats_.prefix_snapshot_bytes = info.state_bytes_per_slot;
    if (!config.prefix_cache_file.empty()) RECUR_RETURN_IF_ERROR(e->load_prefix_cache());
  }
  RECUR_ASSIGN_OR_RETURN(
      e->logits_buf_,
      ops.allocator().allocate(size_t(config.max_batch) * size_t(info.vocab_size) * 4, "logits"));
  e->logits_ = view(e->logits_buf_, DType::F32, {config.max_batch, info.vocab_size});
  if (ops.device() != Device::kCpu) {
    e->host_logits_.resize(size_t(config.max_batch) * size_t(info.vocab_size));
  }
  if (config.vocab_logprobs) {
    e->vocab_logprobs_.resize(size_t(config.max_batch) * size_t(info.vocab_size));
  }
  e->pipeline_ =
      e->model_->reads_device_tokens() &&
      (config.pipeline_decode > 0 || (config.pipeline_decode < 0 && ops.device() != Device::kCpu));
  if (ops.device() != Device::kCpu || e->pipeline_) {
    RECUR_ASSIGN_OR_RETURN(e->ids_buf_,
                           ops.allocator().allocate(size_t(config.max_batch) * 4, "greedy ids"));
    e->host_ids_.resize(size_t(config.max_batch));
  }
  e->running_.reserve(size_t(config.max_batch));
  // The queue, and the running sequences preempted back to it.
  e->waiting_.reserve(size_t(std::max(0, config.max_queue)) + size_t(config.max_batch) + 1);
  e->shares_.reserve(size_t(config.max_batch));
  e->share_seqs_.reserve(size_t(config.max_batch));
  e->logit_seqs_.reserve(size_t(config.max_batch));
  // A step's batch at its largest: every block belongs to one sequence at a time.
  Batch& b = e->batch_;
  b.tokens.reserve(size_t(config.max_batch_tokens));
  b.positions.reserve(size_t(config.max_batch_tokens));
  b.seq_start.reserve(size_t(config.max_batch) + 1);
  b.slot.reserve(size_t(config.max_batch));
  b.block_start.reserve(size_t(config.max_batch) + 1);
  b.block_ids.reserve(size_t(e->config_.kv_blocks));
  b.logit_rows.reserve(size_t(config.max_batch));
  e->next_seqs_.reserve(size_t(config.max_batch));
  e->stats_.kv_blocks_total = e->config_.kv_blocks;
  e->stats_.slots_total = config.max_batch;
  e->seed_counter_ = config.seed ? config.seed : std::random_device{}();
  return e;
}

Engine::~Engine() {
  shut_down();
}

void Engine::shut_down() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    accepting_ = false;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // No accepted request goes unanswered: everything still in flight ends as cancelled.
  take_incoming();
  for (auto& s : running_) finish(*s, FinishReason::kCancelled, "engine shut down");
  for (auto& s : waiting_) finish(*s, FinishReason::kCancelled, "engine shut down");
  release_finished();
}

Result<uint64_t> Engine::submit(Request req, EventSink sink) {
  const ModelInfo& info = model_->info();
  if (req.prompt.empty()) return make_error(ErrorCode::kInvalidArgument, "the prompt is empty");
  for (size_t i = 0; i < req.prompt.size(); ++i) {
    if (req.prompt[i] < 0 || req.prompt[i] >= info.vocab_size) {
      return make_error(ErrorCode::kInvalidArgument,
                        "prompt token {} (id {}) is outside the vocabulary [0, {})", i,
                        req.prompt[i], info.vocab_size);
    }
    for (int32_t refused : info.refused_token_ids) {
      if (req.prompt[i] == refused) {
        return make_error(ErrorCode::kUnsupported, "prompt token {} (id {}): {}", i, refused,
                          info.refused_tokens_reason);
      }
    }
  }
  // The cache first: where it bounds the context, its refusal says so.
  const int64_t blocks_needed = int64_t(req.prompt.size()) / config_.block_size + 1;
  if (blocks_needed > config_.kv_blocks) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the prompt needs {} attention-cache blocks; the cache has {}", blocks_needed,
                      config_.kv_blocks);
  }
  if (int64_t(req.prompt.size()) + 1 > config_.max_context) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the prompt has {} tokens; the context holds {} (prompt plus at least one "
                      "generated token)",
                      req.prompt.size(), config_.max_context);
  }
  if (req.max_tokens < 1) {
    return make_error(ErrorCode::kInvalidArgument, "max_tokens must be at least 1 (got {})",
                      req.max_tokens);
  }
  RECUR_RETURN_IF_ERROR(req.sampling.validate(info.vocab_size));
  if (req.sampling.vocab_logprobs && !config_.vocab_logprobs) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the vocabulary's log-probabilities (vocab_logprobs) are off in this engine "
                      "(EngineConfig::vocab_logprobs)");
  }
  for (auto& s : req.stop.stop_sequences) {
    if (s.empty()) return make_error(ErrorCode::kInvalidArgument, "a stop sequence is empty");
  }
  if (!req.stop.stop_strings.empty() && !tokenizer_) {
    return make_error(ErrorCode::kInvalidArgument,
                      "stop strings need a tokenizer, and this model directory has none");
  }
  uint64_t seed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!accepting_) {
      return make_error(ErrorCode::kOutOfResources, "the engine is shutting down");
    }
    if (int(incoming_.size()) + stats_.waiting >= config_.max_queue) {
      return make_error(ErrorCode::kOutOfResources, "the queue is full ({} requests waiting)",
                        config_.max_queue);
    }
    // splitmix64: distinct, well-mixed default seeds per request.
    uint64_t z = (seed_counter_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    seed = z ^ (z >> 31);
  }
  auto seq = std::make_unique<Sequence>(std::move(req), std::move(sink), info.vocab_size, seed);
  // Sized for all it may generate: a long completion never moves its history mid-decode (pages
  // the vector does not reach are never touched, so this costs address space, not memory).
  // (The context's end stops it at max_context - prompt + 1: the last sampled token is not fed.)
  seq->generated.reserve(size_t(std::min<int64_t>(
      seq->req.max_tokens, int64_t(config_.max_context) - int64_t(seq->req.prompt.size()) + 1)));
  if (cache_) {  // hashed here, on the submitting thread, once
    seq->block_hashes.reserve(seq->req.prompt.size() / size_t(config_.block_size));
    prefix_block_hashes(seq->req.prompt, config_.block_size, cache_seed_, &seq->block_hashes);
  }
  if (tokenizer_) {
    seq->text = std::make_unique<TextStream>(*tokenizer_, seq->req.stop.stop_strings,
                                             seq->req.skip_special_tokens);
  }
  uint64_t id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    id = seq->id = next_id_++;
    incoming_.push_back(std::move(seq));
  }
  cv_.notify_one();
  return id;
}

void Engine::cancel(uint64_t request_id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    cancels_.emplace_back(request_id, stats_.steps);
  }
  cv_.notify_one();
}

void Engine::stop_accepting() {
  std::lock_guard<std::mutex> lk(mu_);
  accepting_ = false;
}

void Engine::cancel_all() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    cancel_all_ = true;
  }
  cv_.notify_one();
}

bool Engine::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  return idle_cv_.wait_for(
      lk, timeout, [&] { return incoming_.empty() && stats_.running == 0 && stats_.waiting == 0; });
}

void Engine::start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { thread_main(); });
}

void Engine::thread_main() {
  model_->ops().bind_thread();  // the model may be on a device other than this thread's default
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] {
        return stop_ || !incoming_.empty() || !cancels_.empty() || !running_.empty() ||
               !waiting_.empty();
      });
      if (stop_) return;
    }
    // A step that throws (memory exhausted while a request's text grows, say) ends the requests
    // in flight with an error instead of the process; later requests are served as usual.
    try {
      try {
        step();
      } catch (const std::exception& e) {
        fail_in_flight(e.what());
      } catch (...) {
        fail_in_flight("an exception of unknown type");
      }
    } catch (const std::exception& e) {
      // Ending the requests threw as well (a sink that cannot take its event): nothing is left
      // that could tell them, so the process ends, saying why.
      std::fprintf(stderr, "error: the engine could not end its requests after a failed step: %s\n",
                   e.what());
      std::abort();
    }
  }
}

void Engine::run_until_idle() {
  while (step()) {
  }
}

void Engine::take_incoming() {
  std::vector<std::pair<uint64_t, int64_t>> cancels;
  bool all = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& s : incoming_) {
      s->queued_step = step_count_;
      waiting_.push_back(std::move(s));
    }
    incoming_.clear();
    // Published with the move, so wait_idle never sees an empty inbox beside a stale idle gauge.
    stats_.waiting = int(waiting_.size());
    cancels.swap(cancels_);
    std::swap(all, cancel_all_);
  }
  if (all) {
    for (auto* list : {&running_, &waiting_}) {
      for (auto& s : *list) finish(*s, FinishReason::kCancelled, "cancelled at shutdown");
    }
  }
  for (const auto& [id, at] : cancels) {
    for (auto* list : {&running_, &waiting_}) {
      for (auto& s : *list) {
        if (s->id != id || s->finished) continue;
        finish(*s, FinishReason::kCancelled, "cancelled");
        s->cancel_step = at;
      }
    }
  }
}

int Engine::blocks_for_prompt(const Sequence& seq) const {
  // Its positions and the next, which a resumed prompt as long as the context never feeds.
  const int last = std::min<int>(int(seq.req.prompt.size()), config_.max_context - 1);
  return last / config_.block_size + 1;
}

int Engine::admittable_blocks() const {
  // The prefix cache's unreferenced blocks are free for the taking.
  return blocks_->available() - reserved_blocks_ + (cache_ ? cache_->unreferenced() : 0);
}

void Engine::admit() {
  if (waiting_.empty() || int(running_.size()) >= config_.max_batch) return;
  // Requests past their wait limit first (a preempted one's wait restarts at its preemption),
  // by arrival; nothing passes them, so they are never starved. Then by priority, a preempted
  // sequence first within its own, then by arrival.
  const auto overdue = [&](const Sequence& s) {
    return step_count_ - s.queued_step >= config_.aging_steps;
  };
  std::sort(waiting_.begin(), waiting_.end(), [&](const auto& a, const auto& b) {
    const bool oa = overdue(*a), ob = overdue(*b);
    if (oa != ob) return oa;
    if (!oa && a->req.priority != b->req.priority) return a->req.priority < b->req.priority;
    if (a->preempted != b->preempted) return a->preempted;
    return a->id < b->id;
  });
  for (size_t i = 0; i < waiting_.size() && int(running_.size()) < config_.max_batch;) {
    Sequence& seq = *waiting_[i];
    if (seq.finished) {  // cancelled while waiting: released after
      ++i;
      continue;
    }
    // A prompt starts only when the cache can hold it now, its blocks reserved so that nothing
    // admitted later cuts it short. One that must wait is passed by requests that fit, until
    // it is overdue; then nothing passes it and blocks come free for it as others finish.
    const int need = blocks_for_prompt(seq);
    int pinned = 0;
    const int32_t snapshot = cache_ ? match_prefix(seq, &pinned) : -1;
    const int cached = int(chain_.size());
    if (cache_ && !overdue(seq) && wait_for_shared_prefix(seq)) {
      ++i;
      continue;
    }
    if (need - cached > admittable_blocks() - pinned) {
      if (overdue(seq)) break;
      ++i;
      continue;
    }
    const int32_t slot = slots_->acquire();
    if (slot < 0) break;
    seq.slot = slot;
    seq.reserve = need;  // the table's length, the cached blocks included
    // The table's whole life at once (bounded by the cache): this allocation, one per
    // request, is the only one its steps make but for its first preemption's.
    const int64_t life = (int64_t(seq.prompt_tokens) + seq.req.max_tokens) / config_.block_size + 1;
    seq.blocks.reserve(size_t(std::min<int64_t>(life, config_.kv_blocks)));
    reserved_blocks_ += need - cached;
    start_sequence(seq, snapshot);
    seq.preempted = false;
    // running_ stays in (priority, arrival) order: a step serves its sequences in that order,
    // and preemption takes from the back, the least urgent and latest first.
    const auto at = std::upper_bound(
        running_.begin(), running_.end(), seq, [](const Sequence& a, const auto& b) {
          return a.req.priority != b->req.priority ? a.req.priority < b->req.priority
                                                   : a.id < b->id;
        });
    running_.insert(at, std::move(waiting_[i]));
    waiting_.erase(waiting_.begin() + std::ptrdiff_t(i));
  }
}

bool Engine::ensure_blocks(Sequence& seq, int last_position) {
  const size_t needed = size_t(last_position / config_.block_size + 1);
  while (seq.blocks.size() < needed) {
    const bool reserved = int(seq.blocks.size()) < seq.reserve;
    if (!reserved && admittable_blocks() <= 0) return false;  // the rest is promised
    const int32_t b = take_block();
    if (b < 0) return false;
    seq.blocks.push_back(b);
    if (reserved) --reserved_blocks_;
  }
  return true;
}

void Engine::release_blocks(Sequence& seq) {
  reserved_blocks_ -= std::max(0, seq.reserve - int(seq.blocks.size()));
  seq.reserve = 0;
  // Last first: an entry is released after the entries that extend it, so it is never older
  // than they are for eviction.
  for (size_t j = seq.blocks.size(); j-- > 0;) {
    if (j < seq.entries.size()) {
      cache_->release(seq.entries[j]);
    } else {
      blocks_->release(seq.blocks[j]);
    }
  }
  seq.blocks.clear();
  seq.entries.clear();
}

int32_t Engine::take_block() {
  int32_t b = blocks_->acquire();
  if (b < 0 && cache_) {
    const int32_t freed = cache_->evict_block();
    if (freed >= 0) {
      blocks_->release(freed);
      b = blocks_->acquire();
    }
  }
  return b;
}

void Engine::share_prompt_budget(int budget, int64_t decode_positions) {
  shares_.clear();
  share_seqs_.clear();
  for (auto& sp : running_) {
    Sequence& s = *sp;
    s.grant = 0;
    if (s.finished || s.preempted || !s.prefilling()) continue;
    sched::PromptShare sh;
    sh.remaining = int(s.req.prompt.size()) - s.prompt_done;
    sh.position = s.n_past;
    sh.priority = s.req.priority;
    sh.order = s.id;
    sh.index = int(share_seqs_.size());
    shares_.push_back(sh);
    share_seqs_.push_back(&s);
  }
  if (shares_.empty() || budget == 0) return;
  if (config_.arrival_order_prefill) {
    for (sched::PromptShare& sh : shares_) {  // running_ is in (priority, arrival) order
      sh.tokens = std::min(sh.remaining, budget);
      budget -= sh.tokens;
    }
  } else {
    sched::share_prompt_tokens(shares_, budget);
    if (config_.step_time_target_ms > 0) {
      int planned = config_.max_batch_tokens - budget;  // the decode tokens
      for (const sched::PromptShare& sh : shares_) planned += sh.tokens;
      const double allowance =
          step_cost_.attention_allowance(planned, config_.step_time_target_ms * 1e-3) -
          double(decode_positions);
      step_cut_ = sched::cap_prompt_attention(shares_, allowance);
    }
  }
  for (const sched::PromptShare& sh : shares_) share_seqs_[size_t(sh.index)]->grant = sh.tokens;
}

bool Engine::build_batch() {
  batch_.clear();
  logit_seqs_.clear();
  step_attended_ = 0;
  step_cut_ = false;
  int budget = config_.max_batch_tokens;
  // Decode tokens first: one per sequence past its prompt.
  int64_t decode_positions = 0;
  for (auto& sp : running_) {
    Sequence& s = *sp;
    s.fed = 0;
    if (s.finished || s.prefilling() || s.next_token < 0 || budget == 0) continue;
    if (s.n_past >= config_.max_context) {
      finish(s, FinishReason::kLength, "the context length is reached");
      continue;
    }
    if (!ensure_blocks(s, s.n_past) && !make_room(s, s.n_past)) continue;
    batch_.add_sequence(s.slot, s.n_past, std::span(&s.next_token, 1), s.blocks,
                        Batch::Logits::kLast);
    logit_seqs_.push_back(&s);
    s.fed = 1;
    --budget;
    decode_positions += s.n_past + 1;
  }
  // Then prompt chunks, as the budget was shared, in running_'s order.
  share_prompt_budget(budget, decode_positions);
  step_attended_ = decode_positions;
  for (auto& sp : running_) {
    Sequence& s = *sp;
    if (s.finished || s.preempted || !s.prefilling() || s.grant == 0) continue;
    const int remaining = int(s.req.prompt.size()) - s.prompt_done;
    // With the prefix cache, chunks end where snapshots are taken.
    const int chunk = cache_ ? std::min(s.grant, next_cache_stop(s) - s.n_past) : s.grant;
    // Reserved at admission: not expected, and even then never cut short.
    if (!ensure_blocks(s, s.n_past + chunk - 1)) {
      preempt(s);
      continue;
    }
    const bool last_chunk = chunk == remaining;
    batch_.add_sequence(s.slot, s.n_past,
                        std::span(s.req.prompt).subspan(size_t(s.prompt_done), size_t(chunk)),
                        s.blocks, last_chunk ? Batch::Logits::kLast : Batch::Logits::kNone);
    if (last_chunk) logit_seqs_.push_back(&s);
    s.fed = chunk;
    step_attended_ += sched::attended_positions(s.n_past, chunk);
  }
  if (step_preempted_) requeue_preempted();
  return batch_.n_tokens() > 0;
}

bool Engine::step() {
  ++step_count_;
  take_incoming();
  admit();
  release_finished();  // cancellations of waiting requests
  if (running_.empty()) {
    // A step queued for sequences that have all finished since: nothing of it is read.
    prelaunched_ = false;
    next_seqs_.clear();
    {
      std::lock_guard<std::mutex> lk(mu_);
      publish_gauges();
    }
    idle_cv_.notify_all();
    notify_step_listener();
    return !waiting_.empty();
  }
  const auto t0 = std::chrono::steady_clock::now();
  int prompt_tokens = 0, decode_tokens = 0;
  if (prelaunched_) {
    // Queued by the previous step, fed its picks: the bookkeeping of a decode step.
    prelaunched_ = false;
    logit_seqs_.swap(next_seqs_);
    next_seqs_.clear();
    for (Sequence* s : logit_seqs_) {
      if (!s) continue;
      s->next_token = -1;
      s->n_past += 1;
      decode_tokens += 1;
    }
    sample_and_emit();
  } else if (build_batch()) {
    const auto f0 = std::chrono::steady_clock::now();
    Status st = model_->forward(batch_, logits_);
    if (!st.ok()) {
      for (auto& s : running_) {
        if (s->fed > 0) finish(*s, FinishReason::kError, st.error().to_string());
      }
    } else {
      for (auto& s : running_) {
        if (s->fed == 0 || s->finished) continue;
        const bool prefill = s->prefilling();
        if (prefill) {
          s->prompt_done += s->fed;
          prompt_tokens += s->fed;
        } else {
          s->next_token = -1;
          decode_tokens += 1;
        }
        s->n_past += s->fed;
        // Before the sampling, which may queue the next step's forward over the state.
        if (prefill && cache_) cache_prompt_progress(*s);
      }
      sample_and_emit();
      if (prompt_tokens > 0) {
        // The forward and the sampling: what a chunk's size changes.
        step_cost_.observe(
            double(batch_.n_tokens()), double(step_attended_),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count());
      }
    }
  }
  release_finished();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.steps++;
    stats_.pipelined_steps += pipelined_this_step_;
    stats_.attention_cut_steps += step_cut_ ? 1 : 0;
    step_cut_ = false;
    pipelined_this_step_ = 0;
    stats_.prompt_tokens += prompt_tokens;
    if (prompt_tokens > 0) {
      stats_.prefill_seconds += secs;
    } else if (decode_tokens > 0) {
      stats_.decode_seconds += secs;
      stats_.decode_step_tokens += decode_tokens;
    }
    publish_gauges();
  }
  idle_cv_.notify_all();
  notify_step_listener();
  return !running_.empty() || !waiting_.empty();
}

void Engine::set_step_listener(StepListener listener) {
  std::lock_guard<std::mutex> lk(listener_mu_);
  step_listener_ = std::move(listener);
}

void Engine::notify_step_listener() {
  if (events_this_step_ == 0) return;
  events_this_step_ = 0;
  std::lock_guard<std::mutex> lk(listener_mu_);
  if (step_listener_) step_listener_();
}

void Engine::maybe_prelaunch() {
  // Only while the step's sequences are all there is: each decodes one token, greedy, and
  // nothing known now ends it at this step's pick (an end of sequence is only known after;
  // the queued step's result for it is then dropped).
  if (!waiting_.empty() || logit_seqs_.size() != running_.size() ||
      batch_.n_tokens() != int(logit_seqs_.size())) {
    return;
  }
  for (const Sequence* s : logit_seqs_) {
    if (!s || s->finished || s->prefilling() || !s->sampler.plain_greedy() ||
        int(s->generated.size()) + 1 >= s->req.max_tokens || s->n_past >= config_.max_context) {
      return;
    }
  }
  for (Sequence* s : logit_seqs_) {
    if (!ensure_blocks(*s, s->n_past)) return;  // the next step would need them as well
  }
  static const int32_t kPlaceholder = 0;  // read from ids_buf_ instead
  batch_.clear();
  for (Sequence* s : logit_seqs_) {
    batch_.add_sequence(s->slot, s->n_past, std::span(&kPlaceholder, 1), s->blocks,
                        Batch::Logits::kLast);
  }
  // The ids come from argmax_rows over the vocabulary: in range, unlike tokens from a client.
  batch_.device_tokens = static_cast<const int32_t*>(ids_buf_.data());
  if (!model_->forward(batch_, logits_).ok()) return;  // the next step runs it the usual way
  next_seqs_ = logit_seqs_;
  prelaunched_ = true;
  ++pipelined_this_step_;  // added to the stats under the step's one lock
}

void Engine::release_finished() {
  // A queued step's rows of sequences released now are dropped when it is read.
  for (Sequence*& s : next_seqs_) {
    if (s && s->finished) s = nullptr;
  }
  // Released before any finish is told: a client that reads the metrics after its last
  // event sees its blocks and slot free.
  int64_t done = 0;
  for (auto* list : {&running_, &waiting_}) {
    for (auto& s : *list) {
      if (!s->finished) continue;
      if (s->slot >= 0) slots_->release(s->slot);
      s->slot = -1;
      release_blocks(*s);
      ++done;
    }
  }
  if (done == 0) return;
  // Until the finishes are told, settled_stats() waits: what the sinks count of a finish is
  // counted before a /metrics read can see its release.
  std::lock_guard<std::mutex> telling(telling_mu_);
  int64_t steps = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.requests_finished += done;
    publish_gauges();
    steps = stats_.steps;
  }
  for (auto* list : {&running_, &waiting_}) {
    for (auto& s : *list) {
      if (!s->finished) continue;
      text_buf_.clear();
      if (s->text && !s->stopped_by_string) s->text->finish(&text_buf_);
      Event ev;
      ev.request_id = s->id;
      ev.kind = Event::Kind::kFinish;
      ev.reason = s->reason;
      ev.message = s->message;
      ev.text = text_buf_;
      ev.prompt_tokens = s->prompt_tokens;
      ev.generated_tokens = int(s->generated.size());
      ev.cached_tokens = s->cached_tokens;
      if (s->cancel_step >= 0) ev.cancel_steps = steps - s->cancel_step;
      if (!s->told) s->sink(ev);  // told already when a sink after it threw, and this retries
      s->told = true;
      ++events_this_step_;
    }
    std::erase_if(*list, [](const std::unique_ptr<Sequence>& s) { return s->finished; });
  }
  // Running and waiting without them: a client told its finish no longer counts as running.
  std::lock_guard<std::mutex> lk(mu_);
  publish_gauges();
}

void Engine::publish_gauges() {
  stats_.running = int(running_.size());
  stats_.waiting = int(waiting_.size());
  // Blocks in use by sequences; the prefix cache's unreferenced ones are counted apart.
  stats_.kv_blocks_used = blocks_->used() - (cache_ ? cache_->unreferenced() : 0);
  stats_.slots_used = slots_->used();
  if (cache_) {
    stats_.prefix_blocks = cache_->entries();
    stats_.prefix_snapshots = cache_->snapshots();
    stats_.prefix_evictions = cache_->evictions();
    stats_.prefix_snapshot_evictions = cache_->snapshot_evictions();
  }
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = stats_;
  s.alloc = ops_->allocator().stats();
  return s;
}

EngineStats Engine::settled_stats() const {
  std::lock_guard<std::mutex> told(telling_mu_);
  return stats();
}

}  // namespace recur
