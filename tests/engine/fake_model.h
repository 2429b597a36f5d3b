// A Model without weights, for driving the scheduler: it records every Batch it is given, checks
// the invariants a real model relies on (ragged layout, positions that continue each slot's
// state, block tables covering them, the load-time limits), and answers deterministic logits:
// the next token is next_token(last token fed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/registry.h"

namespace recur::testing {

struct RecordedSeq {
  int32_t slot = -1;
  int32_t first_pos = 0;
  std::vector<int32_t> tokens;  // [n_tokens of this sequence]
  int blocks = 0;               // block-table length
  bool logits = false;          // its last token's logits were asked for
};

struct RecordedBatch {
  std::vector<RecordedSeq> seqs;  // in batch order
  int n_tokens = 0;
  int logit_rows = 0;
  int64_t attended_positions = 0;  // Σ over tokens of the positions each attends (pos + 1)
  int n_seqs() const { return int(seqs.size()); }
  // The sequence fed from `slot` (null when absent).
  const RecordedSeq* find_slot(int32_t slot) const;
};

class FakeModel : public Model {
 public:
  static constexpr int kVocab = 64;
  static int32_t next_token(int32_t last) { return (last * 5 + 3) % kVocab; }

  // Sized as load_model would size a model for `opt` (n_blocks 0: 1,024 blocks). Steps take
  // `delay_ns_per_position` × the positions their tokens attend, spun (for cost-model checks).
  FakeModel(Ops& ops, const LoadOptions& opt, int max_position = 1 << 20,
            double delay_ns_per_position = 0);

  const ModelInfo& info() const override { return info_; }
  int max_batch_tokens() const override { return max_batch_tokens_; }
  int max_logit_rows() const override { return max_logit_rows_; }
  const StateConfig& state_config() const override { return state_; }
  void reset_slot(int slot) override;
  // A snapshot holds the position its slot had: a restored slot must continue from there.
  void save_snapshot(int slot, int snapshot) override;
  void restore_snapshot(int snapshot, int slot) override;
  Status forward(const Batch& batch, Tensor logits) override;
  Ops& ops() override { return ops_; }

  // Filled as batches come (the engine owns the model; the test keeps a pointer).
  std::vector<RecordedBatch> batches;
  std::vector<std::string> violations;  // invariants a forward found broken
  int64_t resets = 0;
  bool record = true;  // false: no recording (allocation-free forwards)
  // The forward of this number (1-based) throws std::bad_alloc, as one short of memory would.
  int64_t throw_at_forward = -1;
  int64_t forwards = 0;

 private:
  void violate(std::string what);

  Ops& ops_;
  ModelInfo info_;
  StateConfig state_;
  int max_batch_tokens_ = 0, max_logit_rows_ = 0;
  double delay_ns_per_position_ = 0;
  std::vector<int32_t> slot_pos_;   // [n_slots]: next position each slot's state expects; -1 unset
  std::vector<uint8_t> seen_slot_;  // [n_slots] scratch: a slot fed twice in one batch
  std::vector<int32_t> snapshot_pos_;  // [n_snapshots]: the position each snapshot holds
};

}  // namespace recur::testing
