// What the engine sees of a model: a ragged-batch forward over state pools the model allocates
// once. Slot and block numbers are chosen by the caller (the engine's allocators).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/ops.h"

namespace recur {

// A ragged batch. Vectors keep their capacity across clear(), so a steady engine loop that
// rebuilds its batch every step allocates nothing.
struct Batch {
  std::vector<int32_t> tokens;       // [n_tokens]: new tokens of all sequences, back to back
  std::vector<int32_t> positions;    // [n_tokens]: absolute position of each token
  std::vector<int32_t> seq_start;    // [n_seqs + 1]
  std::vector<int32_t> slot;         // [n_seqs]: recurrent-state slot
  std::vector<int32_t> block_start;  // [n_seqs + 1]
  std::vector<int32_t> block_ids;    // block tables of all sequences, back to back
  std::vector<int32_t> logit_rows;   // token indices whose logits are wanted, in output order
  // When set: the tokens' ids [n_tokens] in the backend's memory (the previous step's greedy
  // picks, still on the device), read instead of `tokens`, whose values are then placeholders.
  const int32_t* device_tokens = nullptr;

  int n_seqs() const { return int(slot.size()); }
  int n_tokens() const { return int(tokens.size()); }
  void clear();
  // Appends a sequence bringing `new_tokens` at positions first_pos.. with the given block
  // table (which must cover its last position); `want`: logits of no token, the last or all.
  enum class Logits { kNone, kLast, kAll };
  void add_sequence(int32_t slot_id, int32_t first_pos, std::span<const int32_t> new_tokens,
                    std::span<const int32_t> blocks, Logits want);
  SeqLayout layout(int block_size) const;
};

struct StateConfig {
  int n_slots = 1;      // sequences that can hold recurrent state at once
  int n_blocks = 64;    // attention-cache blocks shared by all sequences
  int block_size = 16;  // tokens per block
  // Snapshot slots, each holding one sequence's whole recurrent state (the prefix cache's
  // copies at token boundaries); 0: none, and no prefix cache.
  int n_snapshots = 0;
};

// Sampling defaults from generation_config.json (greedy unless it sets do_sample).
struct GenerationDefaults {
  bool do_sample = false;
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
};

struct ModelInfo {
  std::string architecture;  // e.g. "qwen3_next", "qwen3_5_moe"
  int vocab_size = 0;
  int max_position = 0;  // the context length a sequence may reach
  GenerationDefaults generation;
  std::vector<int32_t> eos_token_ids;
  int64_t weight_bytes = 0;  // as stored
  // What one decode step reads, for benchmarks: every weight but the routed experts and the
  // embedding table; each routed expert's bytes; and the MoE shape.
  int64_t dense_weight_bytes = 0;
  int64_t expert_weight_bytes = 0;  // one routed expert of one layer
  int moe_layers = 0, n_experts = 0, experts_per_token = 0;
  int64_t active_params_per_token = 0;  // multiply-adds per token in the projections
  int64_t kv_bytes_per_token = 0;       // attention cache, all layers
  // What the same layers' keys and values expanded per head would take (latent attention
  // caches a latent instead): the cache's saving, for benchmarks.
  int64_t expanded_kv_bytes_per_token = 0;
  int64_t attention_layers = 0, attention_dim = 0;  // for the attention FLOPs (heads · head_dim)
  int64_t state_bytes_per_slot = 0;                 // recurrent state of one sequence, all layers
  int64_t cache_bytes_per_block = 0;                // one attention-cache block, all layers
  int prefix_cache_blocks = 0;  // attention-cache blocks the prefix-cache budget added
  uint64_t fingerprint = 0;     // the weights' identity (Checkpoint::fingerprint); 0: unknown
  // Input ids the model cannot take yet (Qwen3.5's image and video placeholders), and why: a
  // prompt holding one is refused with that reason.
  std::vector<int32_t> refused_token_ids;
  std::string refused_tokens_reason;
  std::vector<std::string> notes;  // what loading did that a user should hear of (skipped tensors)
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelInfo& info() const = 0;
  virtual int max_batch_tokens() const = 0;  // tokens one forward may carry
  virtual int max_logit_rows() const = 0;
  virtual const StateConfig& state_config() const = 0;
  // Zeroes the recurrent state of a slot before a new sequence uses it.
  virtual void reset_slot(int slot) = 0;
  // Copies the whole recurrent state of `slot` into snapshot slot `snapshot`, and back. Queued
  // in order with forwards, so a save after a forward holds the state that forward left.
  virtual void save_snapshot(int slot, int snapshot) {}
  virtual void restore_snapshot(int snapshot, int slot) {}
  // One attention-cache block (every attention layer's keys and values:
  // info().cache_bytes_per_block bytes) or one snapshot (info().state_bytes_per_slot bytes)
  // to or from host memory, for the prefix cache's files.
  virtual Status read_block(int block, std::span<uint8_t> out);
  virtual Status write_block(int block, std::span<const uint8_t> in);
  virtual Status read_snapshot(int snapshot, std::span<uint8_t> out);
  virtual Status write_snapshot(int snapshot, std::span<const uint8_t> in);
  // logits [batch.logit_rows.size(), vocab] f32, in the backend's memory.
  virtual Status forward(const Batch& batch, Tensor logits) = 0;
  virtual Ops& ops() = 0;
  // Whether forward may be given Batch::device_tokens (ids left in ops()'s memory by the
  // previous step): what pipelined greedy decode needs.
  virtual bool reads_device_tokens() const { return true; }
};

}  // namespace recur
