#include "model/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace recur {

namespace {

// Threads for ranks 1.. that live as long as the model: run(fn) calls fn(r) for every rank at
// once, rank 0 on the caller's thread, and returns when all have returned. Nothing is
// allocated or created per call.
class RankThreads {
 public:
  explicit RankThreads(int world) {
    for (int r = 1; r < world; ++r) threads_.emplace_back([this, r] { serve(r); });
  }
  ~RankThreads() {
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  template <typename Fn>
  void run(Fn& fn) {
    job_ = [](void* ctx, int rank) { (*static_cast<Fn*>(ctx))(rank); };
    ctx_ = &fn;
    pending_.store(int(threads_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);  // publishes job_ and ctx_
    generation_.notify_all();
    fn(0);
    for (int p; (p = pending_.load(std::memory_order_acquire)) != 0;) {
      pending_.wait(p, std::memory_order_acquire);
    }
  }

 private:
  void serve(int rank) {
    uint32_t seen = 0;
    for (;;) {
      generation_.wait(seen, std::memory_order_acquire);  // until a job (or the end) is posted
      seen = generation_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_relaxed)) return;
      job_(ctx_, rank);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
    }
  }

  void (*job_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<uint32_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

class ParallelModel final : public Model {
 public:
  ParallelModel(std::vector<std::unique_ptr<Ops>> rank_ops, std::unique_ptr<CommGroup> group,
                std::vector<std::unique_ptr<Model>> ranks)
      : rank_ops_(std::move(rank_ops)),
        group_(std::move(group)),
        ranks_(std::move(ranks)),
        status_(ranks_.size()),
        threads_(int(ranks_.size())) {}
  ~ParallelModel() override {
    // NCCL waits, destroying a communicator, until every graph that recorded its collectives
    // is gone; the ranks' graphs go first (rank 0's backend outlives this model).
    each_rank([](int, Model& m) { m.ops().release_graphs(); });
  }
  Status init();

  const ModelInfo& info() const override { return info_; }
  int max_batch_tokens() const override { return ranks_[0]->max_batch_tokens(); }
  int max_logit_rows() const override { return ranks_[0]->max_logit_rows(); }
  const StateConfig& state_config() const override { return ranks_[0]->state_config(); }
  Ops& ops() override { return ranks_[0]->ops(); }
  // Rank 0's memory is every CPU rank's; GPU ranks on other devices neither reach rank 0's
  // ids nor wait for the stream that writes them.
  bool reads_device_tokens() const override {
    return rank_ops_.empty() || rank_ops_[0]->device() == Device::kCpu;
  }
  void reset_slot(int slot) override {
    each_rank([&](int, Model& m) { m.reset_slot(slot); });
  }
  void save_snapshot(int slot, int snapshot) override {
    each_rank([&](int, Model& m) { m.save_snapshot(slot, snapshot); });
  }
  void restore_snapshot(int snapshot, int slot) override {
    each_rank([&](int, Model& m) { m.restore_snapshot(snapshot, slot); });
  }
  // A block's or a snapshot's bytes are the ranks' parts back to back, in rank order.
  Status read_block(int block, std::span<uint8_t> out) override {
    return each_part(out, &ModelInfo::cache_bytes_per_block,
                     [&](Model& m, std::span<uint8_t> p) { return m.read_block(block, p); });
  }
  Status write_block(int block, std::span<const uint8_t> in) override {
    return each_part(in, &ModelInfo::cache_bytes_per_block,
                     [&](Model& m, std::span<const uint8_t> p) { return m.write_block(block, p); });
  }
  Status read_snapshot(int snapshot, std::span<uint8_t> out) override {
    return each_part(out, &ModelInfo::state_bytes_per_slot,
                     [&](Model& m, std::span<uint8_t> p) { return m.read_snapshot(snapshot, p); });
  }
  Status write_snapshot(int snapshot, std::span<const uint8_t> in) override {
    return each_part(
        in, &ModelInfo::state_bytes_per_slot,
        [&](Model& m, std::span<const uint8_t> p) { return m.write_snapshot(snapshot, p); });
  }
  Status forward(const Batch& batch, Tensor logits) override;

 private:
  // fn(r, rank r's model) for every rank at once, each on its rank's thread with its device
  // bound (rank 0 on the caller's, which stays bound to rank 0's).
  template <typename Fn>
  void each_rank(Fn&& fn) {
    auto job = [&](int r) {
      Model& m = *ranks_[size_t(r)];
      m.ops().bind_thread();
      fn(r, m);
    };
    threads_.run(job);
  }

  // bytes holds the ranks' parts back to back, in rank order, each part's size per_rank of
  // the rank's info; fn(model, part) copies one.
  template <typename Bytes, typename Fn>
  Status each_part(std::span<Bytes> bytes, int64_t ModelInfo::*per_rank, Fn fn) {
    if (bytes.size() != size_t(info_.*per_rank)) {
      return make_error(ErrorCode::kInvalidArgument, "{} bytes given for a copy of {}",
                        bytes.size(), info_.*per_rank);
    }
    each_rank([&](int r, Model& m) {
      size_t at = 0;
      for (int k = 0; k < r; ++k) at += size_t(ranks_[size_t(k)]->info().*per_rank);
      status_[size_t(r)] = fn(m, bytes.subspan(at, size_t(m.info().*per_rank)));
    });
    for (const Status& s : status_) RECUR_RETURN_IF_ERROR(s);
    return Status();
  }

  std::vector<std::unique_ptr<Ops>> rank_ops_;  // ranks 1..; rank 0 runs on the caller's
  std::unique_ptr<CommGroup> group_;            // after rank_ops_: its scratch is theirs
  std::vector<std::unique_ptr<Model>> ranks_;   // [world]
  std::vector<Buffer> logits_buffers_;
  std::vector<Tensor> rank_logits_;  // [world]: ranks 1..: [max_logit_rows, vocab] f32
  std::vector<Status> status_;       // [world]: of the last forward
  ModelInfo info_;
  RankThreads threads_;  // last: joined before anything the ranks use goes
};

Status ParallelModel::init() {
  const int world = int(ranks_.size());
  const ModelInfo& first = ranks_[0]->info();
  const StateConfig& sc = ranks_[0]->state_config();
  info_ = first;
  for (int64_t ModelInfo::*sum :
       {&ModelInfo::weight_bytes, &ModelInfo::dense_weight_bytes, &ModelInfo::expert_weight_bytes,
        &ModelInfo::active_params_per_token, &ModelInfo::kv_bytes_per_token,
        &ModelInfo::expanded_kv_bytes_per_token, &ModelInfo::attention_dim,
        &ModelInfo::state_bytes_per_slot, &ModelInfo::cache_bytes_per_block}) {
    info_.*sum = 0;
    for (auto& m : ranks_) info_.*sum += m->info().*sum;
  }
  // A prefix-cache file written by one split is no use to another (blocks hold the ranks'
  // parts back to back).
  if (info_.fingerprint != 0) info_.fingerprint ^= 0x9e3779b97f4a7c15ull * uint64_t(world);
  info_.notes.push_back(fmt::format("tensor parallel over {} ranks ({})", world,
                                    ranks_[0]->ops().device() == Device::kCpu
                                        ? "threads of this process"
                                        : "a thread and a GPU stream each"));
  rank_logits_.resize(size_t(world));
  for (int r = 0; r < world; ++r) {
    const StateConfig& c = ranks_[size_t(r)]->state_config();
    if (c.n_slots != sc.n_slots || c.n_blocks != sc.n_blocks || c.n_snapshots != sc.n_snapshots ||
        ranks_[size_t(r)]->info().vocab_size != first.vocab_size) {
      return make_error(ErrorCode::kInternal, "tensor-parallel rank {} was sized unlike rank 0", r);
    }
    if (r == 0) continue;
    Ops& ops = ranks_[size_t(r)]->ops();
    const int64_t rows = ranks_[size_t(r)]->max_logit_rows();
    RECUR_ASSIGN_OR_RETURN(Buffer b, ops.allocator().allocate(size_t(rows * first.vocab_size) * 4,
                                                              "logits of a rank"));
    rank_logits_[size_t(r)] = view(b, DType::F32, {rows, first.vocab_size});
    logits_buffers_.push_back(std::move(b));
  }
  return Status();
}

Status ParallelModel::forward(const Batch& batch, Tensor logits) {
  // Checked here, not by each rank: a rank that refused a forward the others ran would leave
  // them waiting at its first collective. The ranks' own checks see the same batch and sizes.
  if (logits.ndim != 2 || logits.shape[1] != info_.vocab_size ||
      logits.rows() < int64_t(batch.logit_rows.size())) {
    return make_error(ErrorCode::kInvalidArgument, "logits {} cannot take {} rows of {}",
                      logits.shape_string(), batch.logit_rows.size(), info_.vocab_size);
  }
  if (batch.device_tokens && !reads_device_tokens()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "tensor-parallel GPU ranks take a step's token ids from the host");
  }
  each_rank([&](int r, Model& m) {
    const Tensor& mine = rank_logits_[size_t(r)];
    status_[size_t(r)] = m.forward(
        batch, r == 0 ? logits : mine.slice_rows(0, std::min(logits.rows(), mine.rows())));
  });
  for (const Status& s : status_) RECUR_RETURN_IF_ERROR(s);
  return Status();
}

}  // namespace

Result<std::unique_ptr<Model>> load_parallel_model(Ops& ops, const LoadOptions& options,
                                                   const RankLoader& load_rank) {
  const int world = options.tensor_parallel;
  if (world < 1 || world > 64) {
    return make_error(ErrorCode::kInvalidArgument,
                      "a tensor-parallel model of {} ranks: expected 1 to 64", world);
  }
  if (world > 1 && !options.rank_backend) {
    return make_error(ErrorCode::kInvalidArgument,
                      "tensor parallelism over {} ranks needs a backend for each rank", world);
  }
  // However this returns, the calling thread is left bound to rank 0's device.
  struct Rebind {
    Ops& ops;
    ~Rebind() { ops.bind_thread(); }
  } rebind{ops};
  std::vector<std::unique_ptr<Ops>> rank_ops;
  std::vector<Ops*> all = {&ops};
  for (int r = 1; r < world; ++r) {
    RECUR_ASSIGN_OR_RETURN(std::unique_ptr<Ops> o, options.rank_backend(r));
    all.push_back(o.get());
    rank_ops.push_back(std::move(o));
  }
  // Each rank's ops were made on this thread, which is now bound to the last one's device.
  ops.bind_thread();
  RECUR_ASSIGN_OR_RETURN(std::unique_ptr<CommGroup> group, ops.create_group(all));
  LoadOptions per_rank = options;
  per_rank.tensor_parallel = 1;
  per_rank.rank_backend = nullptr;
  per_rank.kv_cache_budget_bytes = std::max<int64_t>(1, options.kv_cache_budget_bytes / world);
  per_rank.prefix_cache_budget_bytes = options.prefix_cache_budget_bytes / world;
  std::vector<std::unique_ptr<Model>> ranks;
  for (int r = 0; r < world; ++r) {
    all[size_t(r)]->bind_thread();  // the rank's weights and buffers go to its device
    auto m = load_rank(*all[size_t(r)], per_rank, group->rank(r));
    if (!m.ok()) return m.error();
    ranks.push_back(std::move(*m));
  }
  auto model =
      std::make_unique<ParallelModel>(std::move(rank_ops), std::move(group), std::move(ranks));
  RECUR_RETURN_IF_ERROR(model->init());
  return std::unique_ptr<Model>(std::move(model));
}

}  // namespace recur
