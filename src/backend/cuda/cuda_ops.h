// The CUDA backend: every op of ops.h as kernels on one CUDA stream (cuBLAS for the larger
// matrix products). Weights stay in their stored dtype (F32, BF16, F16) on the device and are
// widened to f32 in registers; activations and recurrent state are f32. No op synchronises the
// host: copy_to_host and synchronize() are the only waits.
//
// This header includes no CUDA header, so plain C++ code can hold a CudaOps.
#pragma once

#include <memory>

#include "ops/ops.h"

namespace recur {

class CudaOps final : public Ops {
 public:
  // Selects `device`, creates the stream, the cuBLAS handle and the start-up buffers.
  static Result<std::unique_ptr<CudaOps>> create(int device = 0,
                                                 const BackendOptions& options = {});
  // Whether a backend on `device` takes the paths of this build's sm_90a code (warpgroup
  // products, e4m3 tiles): a Hopper, unless RECUR_CUDA_PORTABLE=1 asks for the paths GPUs after
  // it take; false without a usable device. Tests ask it which paths they will see.
  static bool takes_sm90a_paths(int device);
  ~CudaOps() override;
  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  Device device() const override { return Device::kCuda; }
  std::optional<Fp8Activations> fp8_activations() const override;
  std::optional<PromptActivations> prompt_activations() const override;
  void bind_thread() override;  // cudaSetDevice(this backend's device)
  // Ranks on distinct devices: NCCL (nccl_comm.h); ranks that all share one device: collectives
  // through its memory, ordered by events and host barriers, so those ranks then run every
  // forward launch by launch (a replayed graph would pass the barriers by). cuda_comm.cu.
  Result<std::unique_ptr<CommGroup>> create_group(std::span<Ops* const> ranks) override;
  // The stream this backend's work is queued on now (a cudaStream_t; the capture stream while a
  // decode graph is recorded): a collective queued there is ordered with the rank's own work.
  void* current_stream() const;
  void release_graphs() override;  // cuda_comm.cu
  // cudaMalloc-backed; counts buffers and bytes like the CPU allocator.
  Allocator& allocator() override;
  // Copies a contiguous host weight to the device once, in its stored dtype. Weights live in
  // large slabs owned by this object, so tens of thousands of expert matrices cost a few
  // allocations.
  Result<Tensor> adopt_weight(const Tensor& host) override;
  // As adopt_weight; a BF16 weight is also checked for values beyond f16's range, which keep
  // its experts off the f16 prompt tiles (Impl::beyond_f16).
  Result<Tensor> adopt_matmul_weight(const Tensor& host, std::vector<Buffer>* owned) override;
  // Block-FP8 weights stay fp8 on the device with their block scales (any block sizes; layout in
  // cuda/fp8.cuh); matmul, matmul_group and the MoE experts read them directly.
  Result<Tensor> adopt_block_fp8_weight(const Tensor& w, const Tensor& scales, int block_rows,
                                        int block_cols, std::vector<Buffer>* owned) override;
  // F8_E4M3 only (128×128 blocks, as the CPU's --quantize fp8), quantized by a kernel from a
  // weight in host or device memory; other dtypes are refused as by the default.
  Result<Tensor> quantize_matmul_weight(const Tensor& host, DType dtype,
                                        std::vector<Buffer>* owned) override;
  // BF16 weights become F16 in place when every value of them lies in f16's range (else all
  // stay BF16): prompt matmuls then take two f16 terms of the activations instead of three bf16
  // ones, decode reads as many bytes. Rounded to nearest even: exact in f16's normal range,
  // within 2^-25 below it.
  void retype_weights(std::span<Tensor* const> weights) override;
  // Sizes the batch mirror for the limits; the other scratch is fixed at start-up. With
  // limits given, decode forwards (one token per sequence) run as CUDA graphs.
  Status reserve(const ForwardLimits& limits) override;
  void copy_to_host(const Tensor& src, void* dst) override;  // waits for the stream
  void fill_zero(Tensor t) override;                         // asynchronous
  void zero_in_forward(Tensor t) override;                   // a kernel, recorded in decode graphs
  void copy(const Tensor& src, Tensor dst) override;         // asynchronous, on the device
  void argmax_rows(const Tensor& x, Tensor ids) override;    // asynchronous
  // Packs the batch's host arrays into pinned memory and uploads them in one asynchronous copy;
  // later ops given these same host pointers read the device mirror.
  // Decode forwards (one token per sequence) after reserve() run as CUDA graphs, one per
  // (tokens, sequences, logit rows, output) seen before.
  void begin_forward(const SeqLayout& layout, std::span<const int32_t> tokens,
                     std::span<const int32_t> logit_rows, const void* output = nullptr,
                     const int32_t* device_tokens = nullptr) override;
  // Through a pinned buffer sized by reserve(); larger copies are made at start.
  void copy_to_host_start(const Tensor& src, void* dst) override;
  void copy_to_host_finish() override;
  void synchronize() override;
  void copy_from_host(Tensor dst, const void* src) override;  // waits for the copy
  // Generated on the device with the same counter-based values as the CPU default.
  void fill_random_uniform(Tensor t, uint64_t seed, float lo, float hi) override;
  double measure_copy_bandwidth(size_t bytes) override;  // cudaMemcpy device to device
  int64_t free_memory_bytes() override;                  // cudaMemGetInfo

  void embedding(const int32_t* ids, int n, const Tensor& table, Tensor out) override;
  void embedding_rms_norm(const int32_t* ids, int n, const Tensor& table, Tensor out,
                          const Tensor& w, float weight_offset, float eps, Tensor normed) override;
  void gather_rows(const Tensor& x, const int32_t* rows, int n, Tensor out) override;
  void matmul(const Tensor& x, const Tensor& w, Tensor out, bool accumulate = false) override;
  // Up to kGemvMaxTokens tokens: one GEMV launch over all the weights' rows.
  void matmul_group(const Tensor& x, std::span<const Tensor> ws,
                    std::span<const Tensor> outs) override;
  // Token counts that take matmul's GEMV path: one launch over all heads
  // (kernels_matmul_heads.cu); more: one matmul per head.
  void matmul_heads(const Tensor& x, const Tensor& w, Tensor out) override;
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
  // One kernel when every sequence brings one token (decode); else the default's ops.
  void gdn_inputs(const GdnInputArgs& args, const SeqLayout& layout) override;
  void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
                 Tensor g, Tensor beta) override;
  // Decay per head or per key channel (g [n, Hv] or [n, Hv, dk]). kAuto: the recurrent kernel
  // for one-token sequences, the chunked one for longer (the recurrent one for per-channel
  // decays whose key head is too large for the chunked kernel's shared memory).
  void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                        const Tensor& beta, Tensor state, const SeqLayout& layout, Tensor out,
                        Tensor scratch, DeltaRuleForm form = DeltaRuleForm::kAuto) override;
  // One kernel when every sequence brings one token, dk and dv are at most 128 and the
  // (sequence, head) blocks fit one wave; either decay, either gate activation. Else the
  // default's two ops.
  void gated_delta_rule_norm(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                             const Tensor& beta, Tensor state, const SeqLayout& layout, Tensor out,
                             Tensor scratch, const Tensor& gate, const Tensor& norm_w, float eps,
                             GateActivation act, Tensor normed) override;
  size_t gated_delta_rule_scratch_bytes(int dk, int dv) const override;

  // One kernel per token for the common shapes (value heads of any size); else the default's
  // ops.
  void attention_inputs(const AttentionInputArgs& args, const SeqLayout& layout) override;
  void kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                      const SeqLayout& layout) override;
  // Value heads may differ in size from key heads in every kernel: the decode kernel (with its
  // context splits and their merge), the warp kernel and the tiled one.
  void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                       const SeqLayout& layout, float scale, Tensor out) override;
  void paged_attention_gated(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                             const SeqLayout& layout, float scale, const Tensor& gate,
                             Tensor out) override;

  // Every MoeRouting option; the block-per-token kernels for rows of up to 512 experts and
  // k ≤ 32 without a selection bias, a warp per token otherwise.
  void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids,
                 Tensor weights) override;
  void moe_experts(const Tensor& x, std::span<const ExpertWeights> experts, const Tensor& ids,
                   const Tensor& weights, Tensor out, Tensor scratch) override;
  size_t moe_experts_scratch_bytes(int n_tokens, int k, int n_experts, int d, int d_ff,
                                   DType expert_dtype) const override;
  // One token: the shared expert (gated or not) joins the routed experts' launches as one more
  // pair; else the default's ops.
  void moe_experts_shared(const Tensor& x, std::span<const ExpertWeights> experts,
                          const Tensor& ids, const Tensor& weights, const SharedExpertArgs& shared,
                          Tensor out, Tensor scratch) override;
  // One token: routed inside the gate/up kernel where the routing allows (no selection bias),
  // else by moe_route; then as moe_experts_shared. More tokens: the default's ops.
  void moe_route_experts_shared(const Tensor& logits, const MoeRouting& routing, const Tensor& x,
                                std::span<const ExpertWeights> experts, Tensor ids, Tensor weights,
                                const SharedExpertArgs& shared, Tensor out, Tensor scratch,
                                Tensor residual) override;

  // Largest token count for which matmul and the MoE experts use the bandwidth-bound GEMV
  // kernels (f32 arithmetic); above it they use bf16/f16 tensor cores (see kernels_matmul.cu),
  // except matmuls on weights small enough for GEMV token groups (matmul_takes_gemv).
  static constexpr int kGemvMaxTokens = 8;
  // Whether matmul of n tokens on weight w runs the GEMV kernel (in groups of kGemvMaxTokens
  // tokens beyond that many), rather than cuBLAS.
  static bool matmul_takes_gemv(int64_t n, const Tensor& w);

  struct Impl;  // CUDA-side state; defined in cuda_internal.cuh

 private:
  CudaOps();
  std::unique_ptr<Impl> impl_;
};

}  // namespace recur
