#include "model/hybrid.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace recur {

int ModelPlan::recurrent_state(int64_t conv_rows, int64_t conv_channels, int64_t heads, int64_t dk,
                               int64_t dv) {
  recurrent.push_back({conv_rows, conv_channels, heads, dk, dv});
  return int(recurrent.size()) - 1;
}

int ModelPlan::attention_cache(int64_t kv_heads, int64_t hd, int64_t dv, bool values_in_keys) {
  RECUR_CHECK(!values_in_keys || dv <= hd);
  caches.push_back({kv_heads, hd, dv, values_in_keys});
  return int(caches.size()) - 1;
}

namespace {

class HybridModel final : public Model {
 public:
  HybridModel(HybridSpec spec, Ops& ops, const LoadOptions& opt, Communicator* comm)
      : spec_(std::move(spec)), ops_(ops), opt_(opt), comm_(comm) {}

  Status allocate(const ModelPlan& plan);
  void keep(WeightLoader& weights, std::unique_ptr<Checkpoint> checkpoint) {
    for (Buffer& b : weights.owned()) owned_weights_.push_back(std::move(b));
    checkpoint_ = std::move(checkpoint);
  }
  ModelInfo& mutable_info() { return info_; }

  const ModelInfo& info() const override { return info_; }
  int max_batch_tokens() const override { return opt_.max_batch_tokens; }
  int max_logit_rows() const override { return opt_.max_logit_rows; }
  const StateConfig& state_config() const override { return opt_.state; }
  Ops& ops() override { return ops_; }
  void reset_slot(int slot) override;
  void save_snapshot(int slot, int snapshot) override;
  void restore_snapshot(int snapshot, int slot) override;
  Status read_block(int block, std::span<uint8_t> out) override;
  Status write_block(int block, std::span<const uint8_t> in) override;
  Status read_snapshot(int snapshot, std::span<uint8_t> out) override;
  Status write_snapshot(int snapshot, std::span<const uint8_t> in) override;
  Status forward(const Batch& batch, Tensor logits) override;

 private:
  Status validate(const Batch& batch, const Tensor& logits) const;
  // Tensor parallel, around each mixer and feed-forward, whose blocks add this rank's part of
  // their output to h: ranks but 0 start from h = 0 (after the block's input was normed from
  // it), so that the all-reduce after the block leaves h + every rank's part on every rank.
  void begin_partial_sum(Tensor h) {
    if (comm_ && comm_->rank() != 0) ops_.zero_in_forward(h);
  }
  void end_partial_sum(Tensor h) {
    if (comm_) comm_->all_reduce_sum(h);
  }
  // Every recurrent layer's conv and delta-rule rows of `slot` into snapshot `snapshot`
  // (to_snapshot), or back.
  void copy_slot_state(int slot, int snapshot, bool to_snapshot);

  HybridSpec spec_;
  Ops& ops_;
  LoadOptions opt_;
  ModelInfo info_;
  Communicator* comm_;      // tensor parallel: this rank's end of the group; null: whole model
  Tensor h_, x_, final_h_;  // [T, hidden], [T, hidden], [R, hidden]
  Tensor logits_part_;      // [R, vocab / world]: this rank's logits (vocab_split)
  std::vector<Buffer> buffers_;
  Scratch scratch_;
  StatePools state_;
  std::unique_ptr<Checkpoint> checkpoint_;  // owns the mapped weights
  std::vector<Buffer> owned_weights_;
};

Status add_tensor(Allocator& alloc, std::vector<Buffer>& owner, Tensor* t, DType dt,
                  std::initializer_list<int64_t> shape, const char* what) {
  int64_t n = 1;
  for (int64_t s : shape) n *= std::max<int64_t>(s, 1);  // never a zero-sized buffer
  RECUR_ASSIGN_OR_RETURN(Buffer buf, alloc.allocate(size_t(n) * dtype_size(dt), what));
  *t = Tensor::contiguous(buf.data(), dt, shape, alloc.device());
  owner.push_back(std::move(buf));
  return Status();
}

Status HybridModel::allocate(const ModelPlan& plan) {
  Allocator& A = ops_.allocator();
  const int64_t T = opt_.max_batch_tokens, H = spec_.hidden_size;
  const ScratchNeeds& n = plan.scratch();
  const DType f32 = DType::F32;
  Scratch& s = scratch_;
  auto add = [&](Tensor* t, DType dt, std::initializer_list<int64_t> shape, const char* what) {
    return add_tensor(A, s.buffers, t, dt, shape, what);
  };
  RECUR_RETURN_IF_ERROR(add_tensor(A, buffers_, &h_, f32, {T, H}, "residual stream"));
  RECUR_RETURN_IF_ERROR(add_tensor(A, buffers_, &x_, f32, {T, H}, "normed input"));
  RECUR_RETURN_IF_ERROR(
      add_tensor(A, buffers_, &final_h_, f32, {opt_.max_logit_rows, H}, "final rows"));
  if (spec_.vocab_split) {
    RECUR_RETURN_IF_ERROR(add_tensor(A, buffers_, &logits_part_, f32,
                                     {opt_.max_logit_rows, spec_.lm_head.shape[0]},
                                     "logits of this rank's vocabulary"));
    RECUR_RETURN_IF_ERROR(comm_->reserve_gather(logits_part_.numel()));
  }
  if (n.conv_channels > 0) {
    RECUR_RETURN_IF_ERROR(add(&s.conv_in, f32, {T, n.conv_channels}, "conv input"));
    RECUR_RETURN_IF_ERROR(add(&s.conv_out, f32, {T, n.conv_channels}, "conv output"));
    RECUR_RETURN_IF_ERROR(add(&s.z, f32, {T, n.value_dim}, "output gate"));
    RECUR_RETURN_IF_ERROR(add(&s.core, f32, {T, n.value_dim}, "delta rule out"));
    RECUR_RETURN_IF_ERROR(add(&s.core_normed, f32, {T, n.value_dim}, "delta rule normed"));
    for (Tensor* t : {&s.a, &s.b, &s.beta}) {
      RECUR_RETURN_IF_ERROR(add(t, f32, {T, n.recurrent_heads}, "recurrent gates"));
    }
    RECUR_RETURN_IF_ERROR(add(&s.decay, f32, {T, n.decay_dim}, "decay"));
    RECUR_RETURN_IF_ERROR(add(&s.delta, DType::U8, {n.delta_scratch_bytes}, "delta scratch"));
  }
  if (n.attn_q > 0) {
    RECUR_RETURN_IF_ERROR(add(&s.q, f32, {T, n.attn_q}, "queries"));
    RECUR_RETURN_IF_ERROR(add(&s.k, f32, {T, n.attn_k}, "keys"));
    RECUR_RETURN_IF_ERROR(add(&s.v, f32, {T, n.attn_v}, "values"));
    RECUR_RETURN_IF_ERROR(add(&s.gate, f32, {T, n.attn_out}, "attention gate"));
    RECUR_RETURN_IF_ERROR(add(&s.attn_out, f32, {T, n.attn_out}, "attention out"));
  }
  if (n.experts > 0) {
    RECUR_RETURN_IF_ERROR(add(&s.router_logits, f32, {T, n.experts}, "router logits"));
    RECUR_RETURN_IF_ERROR(add(&s.expert_ids, DType::I32, {T, n.experts_per_token}, "expert ids"));
    RECUR_RETURN_IF_ERROR(add(&s.expert_weights, f32, {T, n.experts_per_token}, "expert weights"));
    RECUR_RETURN_IF_ERROR(add(&s.moe, DType::U8, {n.moe_scratch_bytes}, "moe scratch"));
    RECUR_RETURN_IF_ERROR(add(&s.shared_score, f32, {T, 1}, "shared expert gate"));
    RECUR_RETURN_IF_ERROR(add(&s.shared_out, f32, {T, H}, "shared expert out"));
  }
  if (n.ff > 0) {
    for (Tensor* t : {&s.ff_gate, &s.ff_up, &s.ff_hidden}) {
      RECUR_RETURN_IF_ERROR(add(t, f32, {T, n.ff}, "feed-forward"));
    }
  }
  RECUR_RETURN_IF_ERROR(add(&s.ffn_out, f32, {T, H}, "feed-forward out"));
  if (n.low_rank > 0) {
    RECUR_RETURN_IF_ERROR(add(&s.low_rank, f32, {T, n.low_rank}, "low-rank projections"));
  }

  // Without an explicit block count, the cache takes the budget, but never more than every slot
  // filled to the context length needs.
  StateConfig& sc = opt_.state;
  const int64_t bs = sc.block_size;
  const DType kv_dtype = opt_.kv_cache_dtype;
  if (kv_dtype != DType::F32 && kv_dtype != DType::BF16 && kv_dtype != DType::F16 &&
      kv_dtype != DType::F8_E4M3) {
    return make_error(ErrorCode::kInvalidArgument,
                      "attention cache of {}: only F32, BF16, F16 and F8_E4M3 are supported",
                      dtype_name(kv_dtype));
  }
  const int64_t kv_elem = int64_t(dtype_size(kv_dtype));
  int64_t per_block = 0;
  for (const ModelPlan::Cache& c : plan.caches) per_block += bs * c.floats_per_token() * kv_elem;
  int64_t state_bytes = 0;
  for (const ModelPlan::Recurrent& r : plan.recurrent) {
    state_bytes += (r.conv_rows * r.conv_channels + r.heads * r.dk * r.dv) * 4;
  }
  if (sc.n_blocks <= 0) {
    const int64_t needed = int64_t(sc.n_slots) * ((int64_t(opt_.max_context) + bs - 1) / bs);
    // The engine hands out block ids whether or not a layer stores in them: without attention
    // layers (a config cut short) they cost no cache, only bookkeeping (block tables, free lists,
    // prefix-cache entries), held to 2^18 blocks (4M tokens of 16) in all.
    const int64_t held = per_block ? opt_.kv_cache_budget_bytes / per_block : int64_t(1) << 18;
    sc.n_blocks = int(std::clamp<int64_t>(std::min(needed, held), 1, int64_t(1) << 30));
  }
  // The prefix cache's budget: snapshots, each with the blocks of one snapshot interval (what
  // a long prompt caches per snapshot), and the blocks the snapshots leave. Its blocks join
  // the attention cache, so running sequences may take them back whenever they need them.
  const int64_t budget = opt_.prefix_cache_budget_bytes;
  if (budget > 0 || sc.n_snapshots > 0) {
    const int64_t interval_blocks = (std::max(opt_.snapshot_interval, 1) + bs - 1) / bs;
    const int64_t per_interval = std::max<int64_t>(state_bytes + per_block * interval_blocks, 1);
    int64_t snapshots = sc.n_snapshots > 0 ? sc.n_snapshots : budget / per_interval;
    if (snapshots == 0 && state_bytes <= budget) snapshots = 1;
    const int64_t left = std::max<int64_t>(0, budget - snapshots * state_bytes);
    const int64_t extra = std::min<int64_t>(per_block ? left / per_block : 0,
                                            (int64_t(1) << 30) - int64_t(sc.n_blocks));
    sc.n_blocks += int(extra);
    info_.prefix_cache_blocks = int(extra);
    // A snapshot is useful only with its blocks: never more snapshots than blocks.
    sc.n_snapshots = int(std::min<int64_t>(snapshots, sc.n_blocks));
  }
  // Sequences of one forward hold distinct slots and distinct blocks.
  ForwardLimits limits;
  limits.max_tokens = opt_.max_batch_tokens;
  limits.max_seqs = sc.n_slots;
  limits.max_blocks = sc.n_blocks;
  limits.max_logit_rows = opt_.max_logit_rows;
  limits.max_context = opt_.max_context;
  limits.max_matmul_rows = int64_t(opt_.max_batch_tokens) * (plan.scratch().experts_per_token + 1);
  RECUR_RETURN_IF_ERROR(ops_.reserve(limits));

  // Recurrent state starts at zero; the cache needs no clearing (positions are written before
  // they are read), so its pages stay untouched until used.
  auto add_state = [&](std::vector<Tensor>& list, std::initializer_list<int64_t> shape,
                       const char* what, bool zero, DType dt = DType::F32) -> Status {
    Tensor t;
    RECUR_RETURN_IF_ERROR(add_tensor(A, state_.buffers, &t, dt, shape, what));
    if (zero) ops_.fill_zero(t);
    list.push_back(t);
    return Status();
  };
  for (const ModelPlan::Recurrent& r : plan.recurrent) {
    RECUR_RETURN_IF_ERROR(
        add_state(state_.conv, {sc.n_slots, r.conv_rows, r.conv_channels}, "conv state", true));
    RECUR_RETURN_IF_ERROR(
        add_state(state_.delta, {sc.n_slots, r.heads, r.dk, r.dv}, "delta state", true));
    if (sc.n_snapshots > 0) {  // written before they are read: not cleared
      RECUR_RETURN_IF_ERROR(add_state(state_.conv_snapshots,
                                      {sc.n_snapshots, r.conv_rows, r.conv_channels},
                                      "conv snapshots", false));
      RECUR_RETURN_IF_ERROR(add_state(state_.delta_snapshots, {sc.n_snapshots, r.heads, r.dk, r.dv},
                                      "delta snapshots", false));
    }
  }
  info_.state_bytes_per_slot = state_bytes;
  for (const ModelPlan::Cache& c : plan.caches) {
    RECUR_RETURN_IF_ERROR(
        add_state(state_.k_cache, {sc.n_blocks, c.kv_heads, c.hd, bs}, "k cache", false, kv_dtype));
    state_.block_tensors.push_back(state_.k_cache.back());
    if (c.values_in_keys) {  // [blocks, kv_heads, bs, dv]: positions contiguous, channels bs apart
      Tensor v = state_.k_cache.back();
      v.shape[2] = bs, v.shape[3] = c.dv;
      v.stride[2] = 1, v.stride[3] = bs;
      state_.v_cache.push_back(v);
    } else {
      RECUR_RETURN_IF_ERROR(add_state(state_.v_cache, {sc.n_blocks, c.kv_heads, bs, c.dv},
                                      "v cache", false, kv_dtype));
      state_.block_tensors.push_back(state_.v_cache.back());
    }
    info_.kv_bytes_per_token += c.floats_per_token() * kv_elem;
  }
  info_.cache_bytes_per_block = per_block;
  return Status();
}

void HybridModel::reset_slot(int slot) {
  for (size_t i = 0; i < state_.conv.size(); ++i) {
    ops_.fill_zero(state_.conv[i].slice_rows(slot, slot + 1));
    ops_.fill_zero(state_.delta[i].slice_rows(slot, slot + 1));
  }
}

void HybridModel::copy_slot_state(int slot, int snapshot, bool to_snapshot) {
  RECUR_CHECK(slot >= 0 && slot < opt_.state.n_slots && snapshot >= 0 &&
              snapshot < opt_.state.n_snapshots);
  for (size_t i = 0; i < state_.conv.size(); ++i) {
    const std::pair<Tensor, Tensor> rows[] = {
        {state_.conv[i].slice_rows(slot, slot + 1),
         state_.conv_snapshots[i].slice_rows(snapshot, snapshot + 1)},
        {state_.delta[i].slice_rows(slot, slot + 1),
         state_.delta_snapshots[i].slice_rows(snapshot, snapshot + 1)}};
    for (const auto& [live, kept] : rows) {
      if (to_snapshot) {
        ops_.copy(live, kept);
      } else {
        ops_.copy(kept, live);
      }
    }
  }
}

void HybridModel::save_snapshot(int slot, int snapshot) {
  copy_slot_state(slot, snapshot, true);
}

void HybridModel::restore_snapshot(int snapshot, int slot) {
  copy_slot_state(slot, snapshot, false);
}

namespace {

// Row `row` of every tensor of `lists`, back to back, to or from host memory at `host`
// (`bytes` long: the rows' total).
template <typename Bytes>
Status copy_rows(Ops& ops, std::initializer_list<const std::vector<Tensor>*> lists, int row,
                 int rows, Bytes* host, size_t bytes) {
  if (row < 0 || row >= rows) {
    return make_error(ErrorCode::kInvalidArgument, "row {} outside [0, {})", row, rows);
  }
  size_t at = 0;
  for (const std::vector<Tensor>* list : lists) {
    for (const Tensor& t : *list) {
      const Tensor r = t.slice_rows(row, row + 1);
      const size_t n = size_t(r.numel()) * dtype_size(r.dtype);
      if (at + n > bytes) break;
      if constexpr (std::is_const_v<Bytes>) {
        ops.copy_from_host(r, host + at);
      } else {
        ops.copy_to_host(r, host + at);
      }
      at += n;
    }
  }
  if (at != bytes) {
    return make_error(ErrorCode::kInvalidArgument, "{} bytes given for a copy of {}", bytes, at);
  }
  return Status();
}

}  // namespace

Status HybridModel::read_block(int block, std::span<uint8_t> out) {
  return copy_rows(ops_, {&state_.block_tensors}, block, opt_.state.n_blocks, out.data(),
                   out.size());
}

Status HybridModel::write_block(int block, std::span<const uint8_t> in) {
  return copy_rows(ops_, {&state_.block_tensors}, block, opt_.state.n_blocks, in.data(), in.size());
}

Status HybridModel::read_snapshot(int snapshot, std::span<uint8_t> out) {
  return copy_rows(ops_, {&state_.conv_snapshots, &state_.delta_snapshots}, snapshot,
                   opt_.state.n_snapshots, out.data(), out.size());
}

Status HybridModel::write_snapshot(int snapshot, std::span<const uint8_t> in) {
  return copy_rows(ops_, {&state_.conv_snapshots, &state_.delta_snapshots}, snapshot,
                   opt_.state.n_snapshots, in.data(), in.size());
}

Status HybridModel::validate(const Batch& batch, const Tensor& logits) const {
  const int n = batch.n_tokens();
  if (n > opt_.max_batch_tokens) {
    return make_error(ErrorCode::kInvalidArgument, "batch of {} tokens exceeds the {} per step", n,
                      opt_.max_batch_tokens);
  }
  if (int(batch.logit_rows.size()) > opt_.max_logit_rows ||
      logits.rows() < int64_t(batch.logit_rows.size())) {
    return make_error(ErrorCode::kInvalidArgument, "{} logit rows exceed the {} per step",
                      batch.logit_rows.size(), opt_.max_logit_rows);
  }
  for (int32_t r : batch.logit_rows) {
    if (r < 0 || r >= n) {
      return make_error(ErrorCode::kInvalidArgument, "logit row {} is outside the batch", r);
    }
  }
  if (!batch.device_tokens) {
    for (int32_t t : batch.tokens) {
      if (t < 0 || t >= spec_.vocab_size) {
        return make_error(ErrorCode::kInvalidArgument,
                          "token id {} is outside the vocabulary [0, {})", t, spec_.vocab_size);
      }
    }
  }
  for (int s = 0; s < batch.n_seqs(); ++s) {
    if (batch.slot[size_t(s)] < 0 || batch.slot[size_t(s)] >= opt_.state.n_slots) {
      return make_error(ErrorCode::kInvalidArgument, "state slot {} out of range",
                        batch.slot[size_t(s)]);
    }
    const int32_t end = batch.seq_start[size_t(s) + 1];
    if (end == batch.seq_start[size_t(s)]) continue;
    const int32_t last_pos = batch.positions[size_t(end) - 1];
    const int32_t n_blocks = batch.block_start[size_t(s) + 1] - batch.block_start[size_t(s)];
    if (!state_.k_cache.empty() && last_pos / opt_.state.block_size >= n_blocks) {
      return make_error(ErrorCode::kOutOfResources,
                        "sequence {} at position {} has only {} cache blocks", s, last_pos,
                        n_blocks);
    }
    for (int32_t b = batch.block_start[size_t(s)]; b < batch.block_start[size_t(s) + 1]; ++b) {
      if (batch.block_ids[size_t(b)] < 0 || batch.block_ids[size_t(b)] >= opt_.state.n_blocks) {
        return make_error(ErrorCode::kInvalidArgument, "cache block {} out of range",
                          batch.block_ids[size_t(b)]);
      }
    }
  }
  return Status();
}

Status HybridModel::forward(const Batch& batch, Tensor logits) {
  RECUR_RETURN_IF_ERROR(validate(batch, logits));
  const int n = batch.n_tokens();
  if (n == 0) return Status();
  const SeqLayout sl = batch.layout(opt_.state.block_size);
  ops_.begin_forward(sl, batch.tokens, batch.logit_rows, logits.data, batch.device_tokens);
  const int32_t* tokens = batch.device_tokens ? batch.device_tokens : batch.tokens.data();
  const float eps = spec_.rms_norm_eps, off = spec_.norm_offset;
  Tensor h = h_.slice_rows(0, n), x = x_.slice_rows(0, n);
  const LayerIo io{ops_, sl, n, h, x, scratch_, state_};

  // The residual stream h: each layer's mixer and feed-forward add their outputs to it (their
  // last projection accumulates into h), and each norm reads it whole into x.
  // Tensor parallel, each block adds this rank's part of its output, and the ranks' parts
  // join in one all-reduce per mixer and per feed-forward (begin/end_partial_sum).
  ops_.embedding_rms_norm(tokens, n, spec_.embed_tokens, h, spec_.layers.front().input_norm, off,
                          eps, x);
  for (size_t i = 0; i < spec_.layers.size(); ++i) {
    const DecoderLayer& L = spec_.layers[i];
    if (i > 0) ops_.rms_norm(h, L.input_norm, off, eps, x);
    begin_partial_sum(h);
    L.mixer->forward(io);
    end_partial_sum(h);
    ops_.rms_norm(h, L.post_norm, off, eps, x);
    begin_partial_sum(h);
    L.ffn->forward(io);
    end_partial_sum(h);
  }
  // Only the rows whose logits are wanted go through the final norm and the LM head.
  const int r = int(batch.logit_rows.size());
  bool all_rows = r > 0 && r == n;
  for (int i = 0; all_rows && i < r; ++i) all_rows = batch.logit_rows[size_t(i)] == i;
  Tensor fh = final_h_.slice_rows(0, r);
  if (all_rows) {
    ops_.rms_norm(h, spec_.final_norm, off, eps, fh);
  } else {
    if (r == 0) return Status();
    ops_.gather_rows(h, batch.logit_rows.data(), r, fh);
    ops_.rms_norm(fh, spec_.final_norm, off, eps, fh);
  }
  if (spec_.vocab_split) {  // this rank's vocabulary rows, then every rank's
    const Tensor part = logits_part_.slice_rows(0, r);
    ops_.matmul(fh, spec_.lm_head, part);
    comm_->all_gather_cols(part, logits.slice_rows(0, r));
  } else {
    ops_.matmul(fh, spec_.lm_head, logits.slice_rows(0, r));
  }
  return Status();
}

// The sampling defaults of generation_config.json (absent or null fields keep ours). A field of
// the wrong type is an error naming it, not a default silently dropped; the engine checks the
// values' ranges as it checks a request's.
Status read_generation_defaults(const nlohmann::json& gen, GenerationDefaults* g) {
  const auto given = [&](const char* key) -> const nlohmann::json* {
    return gen.is_object() && gen.contains(key) && !gen[key].is_null() ? &gen[key] : nullptr;
  };
  const auto wrong = [](const char* key, const char* want, const nlohmann::json& v) {
    return make_error(ErrorCode::kCorrupt, "generation_config.json: '{}' must be {}, got {}", key,
                      want, v.dump().substr(0, 40));
  };
  if (const auto* v = given("do_sample")) {
    if (!v->is_boolean()) return wrong("do_sample", "true or false", *v);
    g->do_sample = v->get<bool>();
  }
  for (auto [key, out] : {std::pair{"temperature", &g->temperature},
                          {"top_p", &g->top_p},
                          {"min_p", &g->min_p},
                          {"repetition_penalty", &g->repetition_penalty}}) {
    if (const auto* v = given(key)) {
      if (!v->is_number() || !(std::abs(v->get<double>()) <= double(FLT_MAX))) {
        return wrong(key, "a number", *v);
      }
      *out = float(v->get<double>());
    }
  }
  if (const auto* v = given("top_k")) {
    const double k = v->is_number() ? v->get<double>() : -1;  // 20.0 is 20
    if (!(k >= 0 && k <= INT32_MAX && std::floor(k) == k)) {
      return wrong("top_k", "a whole number >= 0", *v);
    }
    g->top_k = int(k);
  }
  return Status();
}

}  // namespace

Result<std::unique_ptr<Model>> build_hybrid_model(HybridSpec spec, WeightLoader& weights,
                                                  std::unique_ptr<Checkpoint> checkpoint,
                                                  const nlohmann::json& generation_config, Ops& ops,
                                                  const LoadOptions& options, Communicator* comm) {
  LoadOptions opt = options;
  if (opt.max_logit_rows <= 0) opt.max_logit_rows = opt.max_batch_tokens;
  if (opt.max_context <= 0 || opt.max_context > spec.max_position) {
    opt.max_context = spec.max_position;
  }
  if (opt.max_batch_tokens < 1 || opt.state.n_slots < 1 || opt.state.n_blocks < 0 ||
      opt.state.block_size < 1) {
    return make_error(ErrorCode::kInvalidArgument, "batch tokens, slots and blocks must be >= 1");
  }
  if (spec.layers.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "{}: the model has no layers",
                      spec.architecture);
  }
  for (DecoderLayer& L : spec.layers) {
    L.mixer->finish_load(ops);
    L.ffn->finish_load(ops);
  }
  ModelPlan plan(ops, spec.hidden_size, opt.max_batch_tokens);
  for (DecoderLayer& L : spec.layers) {
    L.mixer->plan(plan);
    L.ffn->plan(plan);
  }
  ModelInfo info;
  info.architecture = spec.architecture;
  info.vocab_size = spec.vocab_size;
  info.max_position = opt.max_context;
  info.eos_token_ids = spec.eos_token_ids;
  info.refused_token_ids = spec.refused_token_ids;
  info.refused_tokens_reason = spec.refused_tokens_reason;
  RECUR_RETURN_IF_ERROR(read_generation_defaults(generation_config, &info.generation));
  const WeightTally& tally = weights.tally();
  info.weight_bytes = tally.bytes;
  info.dense_weight_bytes = tally.dense_bytes;
  info.active_params_per_token = tally.dense_matrix_params;
  if (spec.tied_lm_head) {  // the tied table is read as the LM head every step
    info.dense_weight_bytes += weight_bytes(spec.embed_tokens.dtype, spec.embed_tokens.numel());
    info.active_params_per_token += spec.embed_tokens.numel();
  }
  for (const DecoderLayer& L : spec.layers) {
    L.mixer->describe(info);
    L.ffn->describe(info);
  }
  if (checkpoint) {
    std::vector<std::string> prefixes;
    for (const auto& [prefix, what] : spec.skipped_prefixes) prefixes.push_back(prefix);
    const std::vector<std::string> extra = checkpoint->unused(prefixes);
    if (!extra.empty()) {
      return make_error(ErrorCode::kCorrupt, "{}: unexpected tensor '{}'{}", checkpoint->dir(),
                        extra[0],
                        extra.size() > 1 ? fmt::format(" (and {} more)", extra.size() - 1) : "");
    }
    const std::vector<std::string> unused = checkpoint->unused({});
    for (const auto& skipped : spec.skipped_prefixes) {
      const std::string& prefix = skipped.first;
      const int64_t count = std::count_if(unused.begin(), unused.end(), [&](const std::string& s) {
        return s.rfind(prefix, 0) == 0;
      });
      if (count > 0) {
        info.notes.push_back(fmt::format("skipped {} tensors of {} ({}*): not used for text", count,
                                         skipped.second, prefix));
      }
    }
  }
  if (checkpoint) info.fingerprint = checkpoint->fingerprint();
  RECUR_CHECK(comm || !spec.vocab_split);
  auto model = std::make_unique<HybridModel>(std::move(spec), ops, opt, comm);
  model->mutable_info() = std::move(info);
  RECUR_RETURN_IF_ERROR(model->allocate(plan));
  model->keep(weights, std::move(checkpoint));
  return std::unique_ptr<Model>(std::move(model));
}

}  // namespace recur
