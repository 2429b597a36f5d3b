// The op interface: every kernel the models call, one implementation per backend.
// Ops know tensors and ragged batches, never the model. Activations are f32; weights may be
// F32, BF16 or F16 and are read as stored. Recurrent state is f32.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "core/allocator.h"
#include "core/tensor.h"
#include "ops/comm.h"

namespace recur {

// Host-side description of a ragged batch. Sequence i owns tokens [seq_start[i], seq_start[i+1]);
// there is no padding anywhere.
struct SeqLayout {
  int n_seqs = 0;
  int n_tokens = 0;
  const int32_t* seq_start = nullptr;    // [n_seqs + 1]
  const int32_t* slot = nullptr;         // [n_seqs]: recurrent-state slot of each sequence
  const int32_t* positions = nullptr;    // [n_tokens]: absolute position of each token; a
                                         //   sequence's are consecutive and ascending
  const int32_t* block_start = nullptr;  // [n_seqs + 1]: sequence i's block table is
  const int32_t* block_ids = nullptr;    //   block_ids[block_start[i] .. block_start[i+1])
  int block_size = 0;                    // tokens per attention-cache block

  int seq_len(int i) const { return seq_start[i + 1] - seq_start[i]; }
};

// One SwiGLU expert: down(silu(gate(x)) * up(x)).
struct ExpertWeights {
  Tensor gate;  // [d_ff, d]
  Tensor up;    // [d_ff, d]
  Tensor down;  // [d, d_ff]
};

// Operands of Ops::attention_inputs, one attention layer's input stage after its projections.
struct AttentionInputArgs {
  int heads = 0, kv_heads = 0, head_dim = 0;  // head_dim: of queries and keys
  int rot_dim = 0;                            // rotary channels at the start of each head
  double rope_theta = 0;
  float norm_offset = 0.0f;  // added to the q and k norm weights (1 when zero-centred)
  float eps = 1e-6f;
  Tensor q;                 // [n, heads·hd]: RMS-normalised per head and rotated in place
  Tensor k;                 // [n, kv_heads·hd]: likewise
  Tensor v;                 // [n, kv_heads·dv] (dv may differ from hd)
  Tensor q_norm, k_norm;    // [hd]
  Tensor k_cache, v_cache;  // as kv_cache_write
};

// A shared expert beside the routed ones: its output is added to the routed experts' sum,
// scaled per token by σ(score) when score is given (Qwen), as it is otherwise (Kimi).
struct SharedExpertArgs {
  ExpertWeights w;          // gate, up [ff, d]; down [d, ff]
  Tensor score;             // [n, 1], or empty: ungated
  Tensor gate, up, hidden;  // [n, ff] scratch
  Tensor out;               // [n, d] scratch
};

// How a router's logits [n, E] choose k experts per token and weigh them.
struct MoeRouting {
  enum class Score { kSoftmax, kSigmoid };
  Score score = Score::kSoftmax;  // scores from the logits, in f32 (softmax over the E experts)
  int k = 1;                      // experts per token; ties to the lower index
  Tensor selection_bias;          // [E] f32, or empty: added to the scores to choose the k,
                                  //   never to weigh them
  bool renormalize = true;        // the k chosen scores divided by their sum
  float scale = 1.0f;             // factor on every weight, after renormalisation
  // Group-limited choice (DeepSeek-V3, Kimi): the E experts form n_group equal groups, a
  // group's score is the sum of its two highest choosing values (score + bias), and the k are
  // chosen only among the experts of the topk_group best groups (ties to the lower index).
  int n_group = 1, topk_group = 1;
  bool grouped() const { return n_group > 1 && topk_group < n_group; }
};

// The activation of a gated norm's gate: silu (Gated DeltaNet) or sigmoid (Kimi Delta
// Attention).
enum class GateActivation { kSilu, kSigmoid };

// Which form of the gated delta rule to run; kAuto picks per sequence (recurrent for one
// token, chunked for more).
enum class DeltaRuleForm { kAuto, kRecurrent, kChunked };

// How prompt products over block-FP8 weights take their f32 activations on a backend with FP8
// tensor cores (CUDA on sm_90a code). Decode tokens (one-token sequences) keep f32-class
// products either way, and the CPU always multiplies f32 activations.
enum class Fp8Activations {
  // Quantized to e4m3 per token and 128 channels (scale: the group's largest |value| / 448, as
  // the FP8 releases' dynamic activation scheme), on FP8 tensor cores. The fast default.
  kE4m3,
  // Two f16 terms each, on 16-bit tensor cores: f32-class results (recur verify's 1e-3).
  kF16,
};
const char* fp8_activations_name(Fp8Activations a);  // "e4m3", "f16"

// How prompt products over 16-bit (bf16, f16) weights take their f32 activations on a backend
// with warpgroup tensor-core products (CUDA on sm_90a code): the dense matmuls and the experts.
// Decode tokens keep f32-class products either way, and the CPU multiplies f32 activations.
enum class PromptActivations {
  // Two f16 terms of each row scaled by a power of two (22 significant bits): f32-class results
  // (recur verify's 1e-3). The default.
  kF16x2,
  // One f16 term of the scaled row (11 significant bits, more than the bf16 activations of
  // 16-bit engines): half the products and activation reads of kF16x2, faster prompts.
  kF16,
};
const char* prompt_activations_name(PromptActivations a);  // "f16x2", "f16"

// What a backend is created with (backend/backend.h); the CPU backend takes none of it.
struct BackendOptions {
  Fp8Activations fp8_activations = Fp8Activations::kE4m3;
  PromptActivations prompt_activations = PromptActivations::kF16x2;
};

// The largest forward a model will run, announced once before its first forward: device
// backends size every scratch buffer from it, so no forward allocates.
struct ForwardLimits {
  int max_tokens = 0;      // tokens in one forward
  int max_seqs = 0;        // sequences in one forward
  int max_blocks = 0;      // attention-cache blocks in all block tables of one forward
  int max_logit_rows = 0;  // rows gathered for the LM head
  // Input rows one pass of matmuls may read together: the tokens, or for mixture-of-experts
  // layers every routed (token, expert) pair plus the shared expert's tokens (0: max_tokens).
  int64_t max_matmul_rows = 0;
  int max_context = 0;  // positions a sequence may reach
};

// Operands of Ops::gdn_inputs, one Gated DeltaNet layer's input stage after its projections
// (C = 2·Hk·dk + Hv·dv conv channels: all q heads, all k heads, then all v heads; value head h
// reads key head h / (Hv/Hk)).
struct GdnInputArgs {
  int key_heads = 0, value_heads = 0, dk = 0, dv = 0;
  float l2_eps = 1e-6f;  // of the q and k L2 norms
  float q_scale = 1.0f;  // q's extra factor after its L2 norm
  Tensor mixed;          // [n, C]: q | k | v before the conv
  // The decay's projection a and g: [n, Hv] for a decay per head, or [n, Hv·dk] for one per
  // key channel (Kimi Delta Attention); beta's projection b: [n, Hv]
  Tensor a, b;
  Tensor conv_weight;  // [C, K]
  Tensor a_log;        // [Hv]
  Tensor dt_bias;      // as a's columns: [Hv] or [Hv·dk]
  Tensor conv_state;   // [slots, K-1, C] f32
  Tensor conv_out;     // [n, C] out: q | k | v after conv + SiLU; q, k then L2-normalised
  Tensor g, beta;      // out, as gdn_gates: g as a, beta [n, Hv]
};

class Ops {
 public:
  virtual ~Ops() = default;

  virtual Device device() const = 0;
  // How this backend's block-FP8 prompt products take their activations: as asked
  // (BackendOptions) where it has FP8 tensor cores, else kF16 (GPUs without sm_90a code); none
  // where it multiplies f32 activations (the CPU).
  virtual std::optional<Fp8Activations> fp8_activations() const { return std::nullopt; }
  // Likewise for prompt products over 16-bit weights: as asked where warpgroup products run,
  // else kF16x2; none on the CPU.
  virtual std::optional<PromptActivations> prompt_activations() const { return std::nullopt; }
  virtual Allocator& allocator() = 0;
  // Makes this backend's device the calling thread's current one. A device backend's ops may
  // run on threads other than the one that made it (the engine's, a tensor-parallel rank's):
  // each such thread calls this before its first op, and again after using another backend.
  virtual void bind_thread() {}
  // The communicators of a tensor-parallel group whose rank r runs on ranks[r] (this backend
  // among them, each backend of one rank only), over a transport between those backends: the
  // default joins CPU ranks through host memory (InProcessGroup) and refuses others.
  virtual Result<std::unique_ptr<CommGroup>> create_group(std::span<Ops* const> ranks);
  // Waits for this backend's queued work and forgets what it recorded for replay (CUDA
  // graphs): a group's communicator cannot go while a graph holds its collectives.
  virtual void release_graphs() {}
  // Makes a weight usable by this backend: the same view on the CPU, a device copy elsewhere.
  virtual Result<Tensor> adopt_weight(const Tensor& host) = 0;
  // As adopt_weight, for a weight used only as matmul's w [m, k] or as an expert's (the model
  // adopts experts this way; a backend may check them here): a backend may keep it in a layout
  // of its own, described by the view's strides. Buffers it allocates for that go to
  // `owned`, which the caller keeps as long as the weight. Default: adopt_weight.
  virtual Result<Tensor> adopt_matmul_weight(const Tensor& host, std::vector<Buffer>* owned) {
    return adopt_weight(host);
  }
  // A block-FP8 matmul weight: w [m, k] F8_E4M3 stands for w[r, c] · scales[r / block_rows,
  // c / block_cols] (scales [ceil(m / block_rows), ceil(k / block_cols)] F32; edge blocks
  // partial). A backend that takes it returns a weight for matmul that keeps the fp8 bytes and
  // the scales (in a layout of its own, buffers to `owned`) and dequantizes inside its dot
  // products. The default refuses it with an error.
  virtual Result<Tensor> adopt_block_fp8_weight(const Tensor& w, const Tensor& scales,
                                                int block_rows, int block_cols,
                                                std::vector<Buffer>* owned);
  // A matmul weight [m, k] (F32, BF16 or F16, contiguous) quantized at load to `dtype`: Q8_32
  // or Q4_32 (groups of 32 along k, an f16 scale each), or on a device backend F8_E4M3 (128×128
  // blocks, scale amax / 448, as adopt_block_fp8_weight's; the weight in host or this backend's
  // memory). The backend's own layout; the default refuses it with an error.
  virtual Result<Tensor> quantize_matmul_weight(const Tensor& host, DType dtype,
                                                std::vector<Buffer>* owned);
  // One block's matmul weights, loaded: a backend may re-type them in place to a type its
  // kernels multiply faster that holds their values (up to rounding far below their scale); all
  // of them or none, as an op that takes several weights (matmul_group) takes one type. The
  // default keeps them.
  virtual void retype_weights(std::span<Tensor* const> weights) {}
  virtual void copy_to_host(const Tensor& src, void* dst) = 0;  // src contiguous
  // copy_to_host in two halves, so work queued between them (the next step) runs meanwhile:
  // start orders the copy after the work queued so far; finish waits for it and fills dst.
  // Work queued after start may read src but must not write it until finish has returned (a
  // device backend copies beside that work). One copy at a time, of a few rows of ids. The
  // defaults copy at start.
  virtual void copy_to_host_start(const Tensor& src, void* dst) { copy_to_host(src, dst); }
  virtual void copy_to_host_finish() {}
  virtual void fill_zero(Tensor t) = 0;  // t contiguous
  // t = 0 as a step of the forward (t f32 and contiguous): in order with its other ops and
  // inside a decode graph, where fill_zero ends the forward first. The default is fill_zero.
  virtual void zero_in_forward(Tensor t) { fill_zero(t); }
  // dst = src, both contiguous with the same dtype and element count, in this backend's
  // memory (recurrent-state snapshots of the prefix cache). The default copies directly on the
  // CPU and through host memory elsewhere; device backends override it with a device copy.
  virtual void copy(const Tensor& src, Tensor dst);
  // ids[r] = the index of row r's largest value (ties to the lower index; NaN ranks as -inf):
  // the greedy choice, so a device backend returns n ids instead of n rows of logits.
  //   x [n, V] f32 rows; ids [n] I32. The default reads host memory.
  virtual void argmax_rows(const Tensor& x, Tensor ids);
  // dst contiguous; src holds dst's bytes. The default suits backends whose memory the host
  // can write (the CPU); device backends override it.
  virtual void copy_from_host(Tensor dst, const void* src);
  // Fills a contiguous F32/BF16/F16 tensor with uniform values in [lo, hi) from a
  // counter-based generator: the same (seed, index) gives the same value on every backend.
  virtual void fill_random_uniform(Tensor t, uint64_t seed, float lo, float hi);
  // Device-to-device copy bandwidth in bytes/s (bytes read plus written), measured now over
  // `bytes`-sized buffers: the ceiling that benchmarks report against.
  virtual double measure_copy_bandwidth(size_t bytes);
  // Memory this backend could still allocate, in bytes (the host's available memory by
  // default): what benchmarks divide by a cache's bytes per token for the longest context.
  virtual int64_t free_memory_bytes();

  // Sizes the backend's scratch for forwards within `limits` (once, at model load).
  virtual Status reserve(const ForwardLimits& limits) { return Status(); }
  // Called once at the start of every forward with the batch's host-side arrays, before any
  // op that takes them. Host pointers passed to later ops (ids, positions, rows, layout) are
  // these same arrays: a device backend uploads them here once, asynchronously. `output` is
  // the buffer the forward's results go to (a backend that replays recorded forwards keys
  // them by it).
  // device_tokens: when set, [n_tokens] ids in this backend's memory (the previous step's
  // greedy picks) that ops given that pointer read instead of `tokens`' values.
  virtual void begin_forward(const SeqLayout& layout, std::span<const int32_t> tokens,
                             std::span<const int32_t> logit_rows, const void* output = nullptr,
                             const int32_t* device_tokens = nullptr) {}
  // Waits until the device has finished the forward (no-op on the CPU).
  virtual void synchronize() {}

  // ---- row-wise ----
  // out[n, d] = f32(table[ids[i], :])
  virtual void embedding(const int32_t* ids, int n, const Tensor& table, Tensor out) = 0;
  // embedding into out, then rms_norm(out, w, weight_offset, eps, normed): which the default
  // calls; a backend may fuse them.  out, normed [n, d]; w [d].
  virtual void embedding_rms_norm(const int32_t* ids, int n, const Tensor& table, Tensor out,
                                  const Tensor& w, float weight_offset, float eps, Tensor normed);
  // out[n, d] = x[rows[i], :]
  virtual void gather_rows(const Tensor& x, const int32_t* rows, int n, Tensor out) = 0;
  // out[n, m] = x[n, k] · w[m, k]^T, or out += that when accumulate; w row-major or as
  // adopt_matmul_weight gave it.
  virtual void matmul(const Tensor& x, const Tensor& w, Tensor out, bool accumulate = false) = 0;
  // outs[i][n, m_i] = x[n, k] · ws[i][m_i, k]^T for each of up to kMaxMatmulGroup weights that
  // share one input: exactly the results of one matmul per weight (the default does that); a
  // backend may run them as one launch.
  static constexpr size_t kMaxMatmulGroup = 4;
  virtual void matmul_group(const Tensor& x, std::span<const Tensor> ws,
                            std::span<const Tensor> outs);
  // out[t, h, :] = x[t, h, :] · w[h]^T for every head h: one independent product per head
  // (latent attention's absorbed projections), exactly the results of one matmul per head on
  // views (the default does that); a backend may run them as one launch.
  //   x [n, H, k]: any row and head strides (head stride 0: every head reads the same input),
  //   channels contiguous; w [H, m, k] contiguous, as adopt_weight gives it (F32, BF16 or F16);
  //   out [n, H, m]: any row and head strides, channels contiguous
  virtual void matmul_heads(const Tensor& x, const Tensor& w, Tensor out);
  // Rows of x [..., d]: out = x · rsqrt(mean(x²) + eps) · (w + weight_offset); w [d].
  virtual void rms_norm(const Tensor& x, const Tensor& w, float weight_offset, float eps,
                        Tensor out) = 0;
  // Rows of x, gate [..., d]: out = rms_norm(x) · w · act(gate); w [d] (not zero-centred).
  virtual void rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& w, float eps,
                              GateActivation act, Tensor out) = 0;
  // Rows of x [..., d], in place: x = x · rsqrt(sum(x²) + eps) · scale.
  virtual void l2_norm(Tensor x, float eps, float scale) = 0;
  // Rotary embedding on the first rot_dim channels of each head of x [n, heads, head_dim]
  // (halves rotated, as in rotate_half), angle = position · theta^(-2i/rot_dim).
  virtual void rope(Tensor x, const int32_t* positions, int rot_dim, double theta) = 0;

  // ---- elementwise, [n, d] ----
  virtual void swiglu(const Tensor& gate, const Tensor& up, Tensor out) = 0;  // silu(g)·u
  virtual void mul_sigmoid(Tensor x, const Tensor& gate) = 0;                 // x ·= σ(gate)
  virtual void add(Tensor x, const Tensor& y) = 0;                            // x += y
  // x[r, :] += σ(s[r]) · y[r, :]; s [n, 1]
  virtual void add_scaled_sigmoid(Tensor x, const Tensor& y, const Tensor& s) = 0;

  // ---- Gated DeltaNet ----
  // Per sequence, out = silu(causal depthwise conv of x), continuing from conv_state, whose
  // rows then hold the sequence's last kernel-1 inputs.
  //   x, out [n, C]; weight [C, K]; conv_state [slots, K-1, C] f32
  virtual void conv1d_causal_silu(const Tensor& x, const Tensor& weight, Tensor conv_state,
                                  const SeqLayout& layout, Tensor out) = 0;
  // The Gated DeltaNet input stage (see GdnInputArgs): the results of conv1d_causal_silu
  // (mixed into conv_out), l2_norm of q and k in conv_out, and gdn_gates (a, b into g, beta),
  // which the default calls in that order; a backend may fuse them.
  virtual void gdn_inputs(const GdnInputArgs& args, const SeqLayout& layout);
  // g = -exp(a_log) · softplus(a + dt_bias), beta = σ(b). The decay is per head (a, g [n, Hv],
  // dt_bias [Hv]; Gated DeltaNet) or per key channel (a, g [n, Hv·dk], dt_bias [Hv·dk], channel
  // j of head j / dk; Kimi Delta Attention). b, beta [n, Hv]; a_log [Hv]. g may be a itself.
  virtual void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& a_log,
                         const Tensor& dt_bias, Tensor g, Tensor beta) = 0;
  // The gated delta rule per sequence and value head h (key head h / (Hv/Hk)), from and into
  // state[slot]:  S ← diag(exp(g))·S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq.
  // The decay is per head (g [n, Hv]: every key row of S decays alike; Gated DeltaNet) or per
  // key channel (g [n, Hv, dk]: row i of S decays by exp(g[i]); Kimi Delta Attention); g ≤ 0.
  //   q, k [n, Hk, dk] (already L2-normalised, q scaled); v [n, Hv, dv]; beta [n, Hv];
  //   state [slots, Hv, dk, dv] f32; out [n, Hv, dv]; scratch from gated_delta_rule_scratch_bytes
  //   (enough for either decay)
  virtual void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, Tensor state, const SeqLayout& layout,
                                Tensor out, Tensor scratch,
                                DeltaRuleForm form = DeltaRuleForm::kAuto) = 0;
  virtual size_t gated_delta_rule_scratch_bytes(int dk, int dv) const = 0;
  // gated_delta_rule into out, then rms_norm_gated(out, gate, norm_w, eps, act, normed) over
  // each value head: which the default calls; a backend may fuse them.  gate, normed
  // [n, Hv, dv]; norm_w [dv].
  virtual void gated_delta_rule_norm(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& g, const Tensor& beta, Tensor state,
                                     const SeqLayout& layout, Tensor out, Tensor scratch,
                                     const Tensor& gate, const Tensor& norm_w, float eps,
                                     GateActivation act, Tensor normed);

  // The attention input stage (see AttentionInputArgs): the results of rms_norm of q and k per
  // head, rope on q and k, and kv_cache_write of k and v, which the default calls in that
  // order; a backend may fuse them.
  virtual void attention_inputs(const AttentionInputArgs& args, const SeqLayout& layout);

  // ---- attention over a paged cache ----
  // Cache layouts: k_cache [n_blocks, kv_heads, hd, block_size] (keys transposed within a
  // block, so a block's scores are plain vector FMAs), v_cache [n_blocks, kv_heads, block_size,
  // dv]; the value head size dv may differ from the key head size hd. v_cache may also be a
  // view of k_cache's first dv channels (channels block_size apart: a latent cache, whose
  // values are its keys' first channels). Writes each token's k [n, kv_heads, hd] and
  // v [n, kv_heads, dv] at its position. The caches' element type is F32, BF16, F16 or F8_E4M3
  // (both caches alike): the write rounds to it (to nearest even; f16 saturates at ±65504,
  // e4m3 at ±448) and attention reads it as stored.
  virtual void kv_cache_write(const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                              const SeqLayout& layout) = 0;
  // Causal attention: token t of a sequence attends to its cache positions 0..positions[t].
  // q [n, heads, hd], out [n, heads, dv]; heads a multiple of kv_heads (grouped-query
  // attention), with a group of heads / kv_heads ≤ kMaxAttentionGroup and
  // group · max(hd, dv) ≤ kMaxAttentionGroupDims: 32 heads of 576, the published Kimi-Linear's
  // latent attention, whose heads all share one cached latent and so take one call, reading it
  // once. Models check these at load.
  static constexpr int kMaxAttentionGroup = 64;
  static constexpr int kMaxAttentionGroupDims = 32 * 576;
  virtual void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                               const SeqLayout& layout, float scale, Tensor out) = 0;
  // paged_attention into out, then mul_sigmoid(out, gate) (gated attention's output gate):
  // which the default calls; a backend may fuse them.  gate, out [n, heads·dv].
  virtual void paged_attention_gated(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                     const SeqLayout& layout, float scale, const Tensor& gate,
                                     Tensor out);

  // ---- mixture of experts ----
  // The k experts of each token and their weights, as `routing` describes (see MoeRouting).
  //   logits [n, E] f32; ids [n, k] I32; weights [n, k] f32
  virtual void moe_route(const Tensor& logits, const MoeRouting& routing, Tensor ids,
                         Tensor weights) = 0;
  // out[t] = Σ_j weights[t, j] · expert[ids[t, j]](x[t]); x, out [n, d].
  virtual void moe_experts(const Tensor& x, std::span<const ExpertWeights> experts,
                           const Tensor& ids, const Tensor& weights, Tensor out,
                           Tensor scratch) = 0;
  // expert_dtype: the experts' weight type (a backend's scratch may depend on it).
  virtual size_t moe_experts_scratch_bytes(int n_tokens, int k, int n_experts, int d, int d_ff,
                                           DType expert_dtype) const = 0;
  // moe_experts, then out[t] += σ(score[t]) · down(silu(gate·x[t]) ⊙ up·x[t]) of the shared
  // expert (without σ(score) when the expert is ungated): the results of matmul_group (gate,
  // up), moe_experts, swiglu, matmul (down) and add_scaled_sigmoid (or add), which the default
  // calls; a backend may fuse them. scratch as for
  // moe_experts (with moe_experts_scratch_bytes for one more expert per token).
  virtual void moe_experts_shared(const Tensor& x, std::span<const ExpertWeights> experts,
                                  const Tensor& ids, const Tensor& weights,
                                  const SharedExpertArgs& shared, Tensor out, Tensor scratch);
  // moe_route(logits, routing, ids, weights), moe_experts_shared with those ids and weights,
  // then add(residual, out) when residual has data (the residual stream [n, d] the layer's
  // output joins; not out itself): which the default calls; a backend may fuse them (ids,
  // weights and out are written either way).
  virtual void moe_route_experts_shared(const Tensor& logits, const MoeRouting& routing,
                                        const Tensor& x, std::span<const ExpertWeights> experts,
                                        Tensor ids, Tensor weights, const SharedExpertArgs& shared,
                                        Tensor out, Tensor scratch, Tensor residual);
};

}  // namespace recur
