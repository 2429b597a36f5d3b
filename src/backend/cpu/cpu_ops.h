// The CPU backend: vectorised f32 kernels over a fixed thread pool. Weights are read in their
// stored dtype (F32, BF16, F16) and widened to f32 inside the loops.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "core/threads.h"
#include "ops/ops.h"

namespace recur {

class CpuOps final : public Ops {
 public:
  explicit CpuOps(int n_threads = default_thread_count());

  // Attention splits a context into attention_parts(n_ctx) parts (a function of the length
  // alone, so that results do not depend on the batch or the thread count).
  static constexpr int64_t kAttentionPartPositions = 1024;
  static constexpr int kAttentionMaxParts = 16;
  static constexpr int kMaxGroup = Ops::kMaxAttentionGroup;  // query heads per kv head
  // Query heads per kv head × head size, for the key head size and for the value head size
  // alike (queries and partial sums live in buffers of this many floats).
  static constexpr int kMaxGroupDims = Ops::kMaxAttentionGroupDims;
  static int attention_parts(int64_t n_ctx);

  Device device() const override { return Device::kCpu; }
  // Sizes the quantized-activation arena for the largest matmul pass `limits` allows over the
  // Q8_32 / Q4_32 weights made so far (quantize_matmul_weight), so forwards allocate nothing.
  Status reserve(const ForwardLimits& limits) override;
  // Bytes of that arena (a pass that needs more, as in ops used without reserve, grows it).
  size_t activation_arena_bytes() const { return activation_arena_.bytes(); }
  // Host memory; buffers of 2 MiB or more (attention cache, state pools) are advised onto
  // transparent huge pages: first touch faults once per 2 MiB, not per 4 KiB, and the
  // attention's scattered 2 KB blocks need fewer TLB entries.
  Allocator& allocator() override;
  // Opt-in (off by default): buffers of 2 MiB or more are populated when allocated, so the
  // attention cache's first-touch page faults happen at start-up instead of during decode (a
  // long-running server pays them once; a benchmark would count them per token). Costs the
  // whole pool in resident memory at once.
  static void set_prefault_large_buffers(bool on);
  static bool prefault_large_buffers();
  Result<Tensor> adopt_weight(const Tensor& host) override { return host; }
  // A k-major copy (ld = m rounded up to 16, zero padded) in panels of 64 columns,
  // [ceil(ld / 64)][k][64] (the last panel ld mod 64 wide when that is not 0), as the view with
  // strides {1, ld}, which mark the layout (they address elements only when ld <= 64): the
  // layout of the register-tiled matmul kernel, each panel a stream read in order.
  Result<Tensor> adopt_matmul_weight(const Tensor& host, std::vector<Buffer>* owned) override;
  // Block-FP8 and --quantize weights, re-laid out as kernels_quant.h describes.
  Result<Tensor> adopt_block_fp8_weight(const Tensor& w, const Tensor& scales, int block_rows,
                                        int block_cols, std::vector<Buffer>* owned) override;
  Result<Tensor> quantize_matmul_weight(const Tensor& host, DType dtype,
                                        std::vector<Buffer>* owned) override;
  void copy_to_host(const Tensor& src, void* dst) override;
  void fill_zero(Tensor t) override;
  int n_threads() const { return pool_.size(); }

  void embedding(const int32_t* ids, int n, const Tensor& table, Tensor out) override;
  void gather_rows(const Tensor& x, const int32_t* rows, int n, Tensor out) override;
  void matmul(const Tensor& x, const Tensor& w, Tensor out, bool accumulate = false) override;
  // One parallel pass (matmul_pass) over the group.
  void matmul_group(const Tensor& x, std::span<const Tensor> ws,
                    std::span<const Tensor> outs) override;
  // One product of a matmul pass: out[n, m] (+)= x[n, k] · w[m, k]^T, as matmul's arguments.
  struct MatmulJob {
    Tensor x, w, out;  // [n, k], [m, k], [n, m]
    bool accumulate = false;
  };
  static constexpr int kMaxPassJobs = 64;
  // Up to kMaxPassJobs matmuls as one parallel loop: the threads split all the jobs' column
  // panels by work, so each weight byte is read once, by one thread, and small products do
  // not leave a thread waiting at a barrier of their own. Each job's results are exactly
  // matmul()'s. Jobs with row-major weights run as one matmul each.
  void matmul_pass(std::span<const MatmulJob> jobs);
  void rms_norm(const Tensor& x, const Tensor& w, float weight_offset, float eps,
                Tensor out) override;
  void rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& w, float eps,
                      GateActivation act, Tensor out) override;
  void l2_norm(Tensor x, float eps, float scale) override;
  void rope(Tensor x, const int32_t* positions, int rot_dim, double theta) override;

  void swiglu(const Tensor& gate, const Tensor& up, Tensor out) override;
  void mul_sigmoid(Tensor x, const Tensor& gate) override;
  void add(Tensor x, const Tensor& y) override;
  void add_scaled_sigmoid(Tensor x, const Tensor& y, const Tensor& s) override;

  void conv1d_causal_silu(const Tensor& x, const Tensor& weight, Tensor conv_state,
                          const SeqLayout& layout, Tensor out) override;
  void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
                 Tensor g, Tensor beta) override;
  // Key heads up to kMaxKeyDim channels, value heads up to kMaxValueDim.
  static constexpr int kMaxKeyDim = 1024, kMaxValueDim = 1024;
  void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                        const Tensor& beta, Tensor state, const SeqLayout& layout, Tensor out,
                        Tensor scratch, DeltaRuleForm form = DeltaRuleForm::kAuto) override;
  size_t gated_delta_rule_scratch_bytes(int dk, int dv) const override;

  void kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                      const SeqLayout& layout) override;
  void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                       const SeqLayout& layout, float scale, Tensor out) override;

  // Up to kMaxRouteExperts experts, kMaxRouteTopK of them per token.
  static constexpr int kMaxRouteExperts = 4096, kMaxRouteTopK = 64;
  void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids,
                 Tensor weights) override;
  void moe_experts(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                   const Tensor& weights, Tensor out, Tensor scratch) override;
  void moe_experts_shared(const Tensor& x, std::span<const ExpertWeights> experts,
                          const Tensor& ids, const Tensor& weights, const SharedExpertArgs& shared,
                          Tensor out, Tensor scratch) override;
  size_t moe_experts_scratch_bytes(int n_tokens, int k, int n_experts, int d, int d_ff,
                                   DType expert_dtype) const override;

 private:
  // The routed experts into out, and the shared one's output into shared->out (not added):
  // two matmul passes, every gate and up, then every down.  x, out [n, d]; ids, weights [n, k].
  void moe_experts_pass(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                        const Tensor& weights, const SharedExpertArgs* shared, Tensor out,
                        Tensor scratch);
  // matmul with a weight of kernels_quant.h's layouts.
  void quant_matmul(const Tensor& x, const Tensor& w, Tensor out, bool accumulate);
  ThreadPool pool_;
  // The integer formats' inputs of one matmul pass, quantized per token: U8, every distinct
  // input of the pass back to back (cpu::quantized_activation_bytes each).
  Buffer activation_arena_;
  int64_t max_quantized_k_ = 0;  // the widest Q8_32 / Q4_32 weight made (its columns)
  // cos/sin of the last rope call, [token][kRopeCacheHalf]; pages are touched only as used.
  // Taken with try_lock: a concurrent caller computes its own angles instead.
  static constexpr int kRopeCacheTokens = 1024, kRopeCacheHalf = 128;
  struct RopeCache {
    std::mutex mu;
    int n = -1, rot_dim = 0;
    double theta = 0;
    std::unique_ptr<int32_t[]> positions{new int32_t[kRopeCacheTokens]};
    std::unique_ptr<float[]> cos{new float[size_t(kRopeCacheTokens) * kRopeCacheHalf]};
    std::unique_ptr<float[]> sin{new float[size_t(kRopeCacheTokens) * kRopeCacheHalf]};
  };
  RopeCache rope_cache_;
  // Which k-major weight followed which in earlier matmuls (a direct-mapped table by address):
  // matmul asks for the start of the predicted next weight as it finishes. Advisory only;
  // relaxed atomics because any thread may call matmul.
  static constexpr int kNextWeightSlots = 4096;
  static constexpr int64_t kNextWeightPrefetchBytes = 8192;
  struct NextWeight {
    std::atomic<const void*> key{nullptr}, next{nullptr};
    std::atomic<int64_t> next_bytes{0};
  };
  std::unique_ptr<NextWeight[]> next_weight_{new NextWeight[kNextWeightSlots]};
  std::atomic<NextWeight*> last_weight_{nullptr};
  // Partial softmax states of attention parts: kAttentionMaxParts per thread, allocated once
  // (left uninitialised: pages are only touched by contexts long enough to be split).
  std::unique_ptr<float[]> attention_scratch_;
  static std::atomic<bool> prefault_large_buffers_;
};

}  // namespace recur
