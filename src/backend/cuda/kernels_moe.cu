// Mixture of experts on the GPU (routing kernels: kernels_moe_route.cu). Experts: (token, expert)
// pairs are sorted by expert on the device (moe_sort.cu: one block; nothing returns to the
// host), cut into tiles of one expert's rows, and run as grouped GEMMs over a grid sized by the
// worst case whose surplus blocks exit at once:
//   ≤ kGemvMaxTokens tokens, or few rows per expert (decode batches): the GEMV core
//     (gemv.cuh; its expert kernels in moe_gemv.cu), f32 arithmetic, each chosen expert's
//     weights read once per tile of ≤ 4 rows;
//   more tokens, BF16/F16 experts: tensor-core tiles (moe_mma.cu) on activations split into
//     two f16 terms of each row scaled by a power of two (f32-class results, like the cuBLAS
//     matmul path); experts with a bf16 weight beyond f16's range, or unaligned, take the
//     tiles of moe_wmma.cu that split f32 activations into three terms as they stage them;
//   more tokens, F32 experts: the GEMV core over tiles of 8 rows.
// F8_E4M3 experts take the same GEMV core over their bytes and block scales, and the
// tensor-core tiles where their block sizes suit them (else the GEMV core over tiles of 8 rows):
// FP8 products on e4m3 activations (BackendOptions::fp8_activations, sm_90a), or f16 terms.
// Gate and up run fused with SwiGLU; a final pass sums each token's k expert outputs in its
// own routing order (deterministic, no atomics).
#include <algorithm>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_route.cuh"

namespace recur {

using namespace cuda;

namespace {

// Whether the experts' scratch holds the SwiGLU rows' e4m3 bytes: block-FP8 experts' prompt
// products on e4m3 activations.
bool e4m3_rows(const CudaOps::Impl& s, DType expert_dtype) {
  return s.e4m3_activations && expert_dtype == DType::F8_E4M3;
}

// Carve-up of the experts' scratch for n tokens (the same offsets for sizing and use). Prompts
// (more than kGemvMaxTokens tokens) may take the pipelined tensor-core tiles, whose split
// activations (two f16 terms: the bytes of f32) share regions with f32 buffers not live at the
// same time: x's terms with ys (written by down, after gate/up read them; pairs ≥ n), the
// SwiGLU outputs' terms with hs (f32 on the other paths).
struct MoeScratch {
  float* hs;                 // [pairs, d_ff] SwiGLU outputs
  void* hs_terms;            // [2, pairs, d_ff] f16 terms of them
  void* hs_wide_terms;       // [2, pairs, d_ff] f16 terms of hs when it is f32 too (after it)
  float* ys;                 // [pairs, d] expert outputs
  void* x_terms;             // [2, n, d] f16 terms of x
  float *x_scale, *h_scale;  // [n], [pairs]: f16 terms' inverse scales
  // With e4m3 activations (e4m3_rows; sized only then): the SwiGLU rows as e4m3
  // [pairs, d_ff] and their scales [pairs, ⌈d_ff/128⌉] (x's go where its f16 terms would).
  uint8_t* hs_q;
  float* hs_q_scale;
  MoeSortOut sorted;  // the sort's rows and tiles (moe.cuh)
  size_t bytes;
  // k pairs per token over E experts (shared ones riding along included).
  MoeScratch(void* base, int64_t n, int64_t k, int64_t E, int64_t d, int64_t d_ff, bool e4m3_rows) {
    const int64_t pairs = n * k;
    char* p = static_cast<char*>(base);
    auto take = [&](int64_t count, size_t elem) {
      char* r = p;
      p += (size_t(count) * elem + 255) / 256 * 256;
      return r;
    };
    const bool prompt = n > CudaOps::kGemvMaxTokens;
    // Prompts with SwiGLU rows wider than a cluster keep hs (f32) and its two f16 terms (the
    // block-FP8 tiles' narrower cluster bounds both kinds).
    const size_t wide =
        prompt && !moe_mma_takes(d_ff, DType::F8_E4M3) ? size_t(pairs * d_ff) * 8 : 0;
    hs = reinterpret_cast<float*>(take(1, std::max(size_t(pairs * d_ff) * 4, wide)));
    hs_terms = hs;
    hs_wide_terms = hs + pairs * d_ff;
    ys = reinterpret_cast<float*>(take(pairs * d, 4));
    x_terms = ys;
    x_scale = reinterpret_cast<float*>(take(prompt ? n : 0, 4));
    h_scale = reinterpret_cast<float*>(take(prompt ? pairs : 0, 4));
    const bool q = prompt && e4m3_rows;
    hs_q = reinterpret_cast<uint8_t*>(take(q ? pairs * d_ff : 0, 1));
    hs_q_scale = reinterpret_cast<float*>(
        take(q ? pairs * ((d_ff + kFp8ActBlock - 1) / kFp8ActBlock) : 0, 4));
    for (int32_t** a : {&sorted.token_of, &sorted.row_of, &sorted.tile_expert, &sorted.tile_row0,
                        &sorted.tile_rows}) {
      *a = reinterpret_cast<int32_t*>(take(pairs, 4));
    }
    sorted.n_tiles = reinterpret_cast<int32_t*>(take(1, 4));
    const int slices = moe_sort_slices(pairs);
    sorted.slice_rows = reinterpret_cast<int*>(take(slices > 1 ? slices * E : 0, 4));
    bytes = size_t(p - static_cast<char*>(base));
  }
};

}  // namespace

size_t CudaOps::moe_experts_scratch_bytes(int n_tokens, int k, int n_experts, int d, int d_ff,
                                          DType expert_dtype) const {
  return MoeScratch(nullptr, n_tokens, k, n_experts, d, d_ff, e4m3_rows(*impl_, expert_dtype))
      .bytes;
}

namespace {

// Whether every expert's (and the shared expert's) weights start 16-byte aligned.
bool experts_aligned(std::span<const ExpertWeights> experts, const SharedExpertArgs* shared) {
  bool aligned = true;
  auto check = [&](const ExpertWeights& ew) {
    for (const Tensor* t : {&ew.gate, &ew.up, &ew.down}) {
      aligned &= (reinterpret_cast<uintptr_t>(t->data) & 15) == 0;
    }
  };
  for (const ExpertWeights& ew : experts) check(ew);
  if (shared) check(shared->w);
  return aligned;
}

// Whether n tokens' `pairs` (token, expert) pairs over E experts leave the GEMV core for the
// prompt tiles: more tokens than the GEMV kernel takes, more than four rows an expert.
bool many_rows_per_expert(int64_t n, int64_t pairs, int64_t E) {
  return n > CudaOps::kGemvMaxTokens && pairs > 4 * E;
}

// Whether the shared expert can ride along the routed experts' launches as one more pair of
// each token: one token, or a prompt on the tiles (more tokens than the GEMV kernel takes, more
// than four rows an expert, 16-bit or block-FP8 weights: its rows fill whole tiles there, where
// cuBLAS took three terms); the routed experts' shape and dtype, and room in the scratch for the
// extra pairs.
bool shared_rides_along(const Tensor& x, std::span<const ExpertWeights> experts, int64_t k,
                        const SharedExpertArgs& shared, const Tensor& scratch, bool e4m3) {
  const ExpertWeights& e0 = experts.front();
  const int64_t n = x.shape[0], E = int64_t(experts.size());
  const bool prompt = many_rows_per_expert(n, n * (k + 1), E + 1) && e0.gate.dtype != DType::F32;
  return (n == 1 || prompt) && shared.w.gate.dtype == e0.gate.dtype &&
         shared.w.up.dtype == e0.gate.dtype && shared.w.down.dtype == e0.gate.dtype &&
         shared.w.gate.shape[0] == e0.gate.shape[0] && shared.w.gate.shape[1] == e0.gate.shape[1] &&
         shared.w.up.shape[0] == e0.up.shape[0] && shared.w.down.shape[1] == e0.down.shape[1] &&
         shared.w.down.shape[0] == e0.down.shape[0] &&
         size_t(scratch.numel()) * dtype_size(scratch.dtype) >=
             MoeScratch(nullptr, n, k + 1, E + 1, x.row_size(), e0.gate.shape[0], e4m3).bytes;
}

// Whether gate/up can route one token whose shared expert rides along (shared_rides_along,
// checked by the caller): no groups (route_filter_block chooses over all experts, with a
// selection bias or without), its logits [1, E] contiguous with E = kRouteThreads·PL (PL 1, 2
// or 4) and k ≤ 32, and 16-byte rows for the warp GEMV kernel.
bool routes_in_kernels(const CudaOps::Impl& s, const Tensor& logits, const MoeRouting& routing,
                       const Tensor& x, std::span<const ExpertWeights> experts,
                       const SharedExpertArgs& shared) {
  const int64_t E = logits.shape[1], d = x.row_size();
  const int k = routing.k;
  const ExpertWeights& e0 = experts.front();
  const int64_t elems16 = 16 / int64_t(dtype_size(e0.gate.dtype));
  const bool fp8_vec =
      e0.gate.dtype != DType::F8_E4M3 || (s.fp8_blocks_of(e0.gate).cols % elems16 == 0 &&
                                          s.fp8_blocks_of(e0.down).cols % elems16 == 0);
  return fp8_vec && !routing.grouped() && logits.shape[0] == 1 && logits.stride[1] == 1 &&
         int64_t(experts.size()) == E &&
         (E == kRouteThreads || E == 2 * kRouteThreads || E == 4 * kRouteThreads) && k >= 1 &&
         k <= 32 && experts_aligned(experts, &shared) &&
         (reinterpret_cast<uintptr_t>(x.data) & 15) == 0 && x.stride[0] % 4 == 0 &&
         d % elems16 == 0 && e0.gate.shape[0] % elems16 == 0;
}

// moe_experts; with `shared` (shared_rides_along), the shared expert runs as one more pair of
// each token: its gate/up and down rows join the routed experts' launches (sorted as expert E
// for more than one token) and the combine adds it.
// With `route` (one token, routes_in_kernels), the expert kernels route it themselves. With
// residual data: then residual += out, by the combine.
void run_moe_experts(CudaOps::Impl& s, const Tensor& x, std::span<const ExpertWeights> experts,
                     const Tensor& ids, const Tensor& weights, Tensor out, Tensor scratch,
                     const SharedExpertArgs* shared, const MoeInKernelRoute* route = nullptr,
                     Tensor residual = {}) {
  const int64_t n = x.shape[0], d = x.row_size(), k = ids.shape[1];
  const int64_t E = int64_t(experts.size());
  RECUR_CHECK(E >= 1 && E <= 4096 && x.dtype == DType::F32 && out.row_size() == d);
  const int64_t d_ff = experts[0].gate.shape[0];
  const DType wdt = experts[0].gate.dtype;
  for (const ExpertWeights& ew : experts) {
    RECUR_CHECK(ew.gate.dtype == wdt && ew.up.dtype == wdt && ew.down.dtype == wdt);
    RECUR_CHECK(ew.gate.shape[0] == d_ff && ew.gate.shape[1] == d && ew.up.shape[0] == d_ff &&
                ew.up.shape[1] == d && ew.down.shape[0] == d && ew.down.shape[1] == d_ff);
  }
  const bool aligned = experts_aligned(experts, shared);
  if (n == 0) return;
  RECUR_CHECK(!route || (n == 1 && shared && route->k == k && E % kRouteThreads == 0));
  RECUR_CHECK(!residual.data || (residual.dtype == DType::F32 && residual.shape[0] == n &&
                                 residual.row_size() == d && residual.stride[1] == 1));
  const int64_t slots = k + (shared ? 1 : 0);  // pairs per token in the scratch
  MoeScratch m(scratch.data, n, slots, E + (shared ? 1 : 0), d, d_ff,
               e4m3_rows(s, experts.front().gate.dtype));
  RECUR_CHECK(size_t(scratch.numel()) * dtype_size(scratch.dtype) >= m.bytes);
  const void* const* table = s.expert_table(experts, shared ? &shared->w : nullptr);
  const int64_t table_e = E + (shared ? 1 : 0);
  // More than one token: a shared expert is sorted as expert E, pair k of each token.
  const bool direct = n == 1;
  const int64_t sort_slots = direct ? k : slots, sort_e = direct ? E : table_e;
  const int64_t pairs = n * sort_slots;

  // Tile rows: for decode 1 or 2 (a few tokens rarely share an expert, and the GEMV core's
  // cost grows with its row count); 2 or 4 while experts average at most 4 rows (decode
  // batches: every expert's weights streamed once, the FMAs still under the loads); then 64
  // for tensor cores, 8 for f32 experts.
  const bool small = n <= CudaOps::kGemvMaxTokens;
  const bool few_per_expert = !small && !many_rows_per_expert(n, pairs, sort_e);
  const bool fp8 = wdt == DType::F8_E4M3;
  // F8_E4M3 experts: the block sizes of gate/up and of down (each list loaded alike).
  CudaOps::Impl::Fp8Blocks fp8_up, fp8_down;
  if (fp8) {
    fp8_up = s.fp8_blocks_of(experts[0].gate), fp8_down = s.fp8_blocks_of(experts[0].down);
    const CudaOps::Impl::Fp8Blocks b = s.fp8_blocks_of(experts[0].up);
    RECUR_CHECK(b.rows == fp8_up.rows && b.cols == fp8_up.cols);
    if (shared) {
      for (const Tensor* t : {&shared->w.gate, &shared->w.up, &shared->w.down}) {
        const CudaOps::Impl::Fp8Blocks sb = s.fp8_blocks_of(*t);
        const CudaOps::Impl::Fp8Blocks& want = t == &shared->w.down ? fp8_down : fp8_up;
        RECUR_CHECK(sb.rows == want.rows && sb.cols == want.cols);
      }
    }
  }
  const bool tensor_cores = !small && !few_per_expert && wdt != DType::F32 &&
                            (!fp8 || (fp8_wmma_blocks(fp8_up.rows, fp8_up.cols) &&
                                      fp8_wmma_blocks(fp8_down.rows, fp8_down.cols)));
  const int tm = small            ? (n == 1 ? 1 : 2)
                 : few_per_expert ? (pairs <= sort_e ? 2 : 4)
                 : tensor_cores   ? kWmmaTileRows
                                  : 8;
  const int64_t max_tiles =
      std::min<int64_t>(pairs, (pairs + tm - 1) / tm + std::min(sort_e, pairs));

  // One token: tile j is its pair j (the GEMV core gives the same per-pair arithmetic as the
  // sorted tiles of one row), so the sort's launch is skipped.
  if (!direct) {
    launch_moe_sort(ids.ptr<int32_t>(), ids.stride[0], int(n), int(k), int(sort_slots), int(sort_e),
                    tm, m.sorted, s.stream);
    s.launched("moe_experts (sort)");
  }

  MoeGemmArgs up{};
  up.w = table, up.w2 = table + table_e, up.m = d_ff, up.k = d;
  up.x = x.ptr<float>(), up.ldx = x.stride[0], up.x_row = m.sorted.token_of;
  up.out = m.hs, up.ldo = d_ff;
  up.tile_expert = m.sorted.tile_expert, up.tile_row0 = m.sorted.tile_row0;
  up.tile_rows = m.sorted.tile_rows, up.n_tiles = m.sorted.n_tiles, up.w_aligned = aligned;
  if (direct) {
    up.direct_ids = ids.ptr<int32_t>(), up.direct_k = int(slots), up.n_experts = int(E);
    up.direct_shared = shared ? int(E) : -1;
    up.x_row = nullptr, up.ldx = 0;  // every pair reads the one token's row
  }
  MoeGemmArgs down = up;
  if (route) up.route = *route, up.direct_ids = nullptr;  // gate/up routes and stores the ids
  down.w = table + 2 * table_e, down.w2 = nullptr, down.m = d, down.k = d_ff;
  down.ids_early = direct;  // launched right after gate/up below
  down.x = m.hs, down.ldx = d_ff, down.x_row = nullptr;
  down.out = m.ys, down.ldo = d;
  if (fp8) {
    up.fp8_block_rows = fp8_up.rows, up.fp8_block_cols = fp8_up.cols;
    down.fp8_block_rows = fp8_down.rows, down.fp8_block_cols = fp8_down.cols;
  }

  // For the profile: the pairs' products, and the weights of at most min(E, pairs) experts.
  const double all_pairs = double(n * slots), wb = double(dtype_size(wdt));
  const double touched = double(std::min<int64_t>(E, pairs) + (shared ? 1 : 0));
  auto work = [&](bool gate_up) {
    if (!s.options.profile) return;
    const double mats = gate_up ? 2.0 : 1.0;
    s.work(2.0 * mats * all_pairs * double(d * d_ff),
           mats * touched * double(d * d_ff) * wb +
               4.0 * all_pairs * double(gate_up ? d + 2 * d_ff : d_ff + d));
  };
  const bool e4m3 = tensor_cores && fp8 && s.e4m3_first_row(n) == 0 &&
                    fp8_act_takes(fp8_up.rows, fp8_up.cols, d, aligned) &&
                    fp8_act_takes(fp8_down.rows, fp8_down.cols, d_ff, aligned);
  if (e4m3) {
    // e4m3 activations (moe_fp8_act.cu): x and the SwiGLU rows as e4m3, on FP8 tensor cores; x's
    // bytes and scales where its f16 terms would go (4 bytes a value, pairs ≥ n rows).
    auto* xq = static_cast<uint8_t*>(m.x_terms);
    auto* xs = reinterpret_cast<float*>(xq + (n * d + 255) / 256 * 256);
    launch_e4m3_group_quantize(x.ptr<float>(), x.stride[0], n, d, xq, xs, s.stream);
    up.x_q = xq, up.x_q_scale = xs;
    s.launched("moe_experts (e4m3 activations)");
    work(true);
    launch_moe_fp8_act(up, true, unsigned(max_tiles), s.stream);
    s.launched("moe_experts (gate/up, e4m3 wgmma)");
    launch_e4m3_group_quantize(m.hs, d_ff, pairs, d_ff, m.hs_q, m.hs_q_scale, s.stream);
    s.launched("moe_experts (SwiGLU e4m3)");
    down.x_q = m.hs_q, down.x_q_scale = m.hs_q_scale;
    work(false);
    launch_moe_fp8_act(down, false, unsigned(max_tiles), s.stream);
    s.launched("moe_experts (down, e4m3 wgmma)");
  } else if (tensor_cores) {
    // The pipelined tiles read x split once (rather than by each of gate/up's column blocks);
    // gate/up stores the SwiGLU outputs split for down. 16-bit and block-FP8 weights multiply
    // f16 terms (moe_mma.cu), unless a bf16 weight of any of these experts holds a value beyond
    // f16's range: then all of them take the tiles that split f32 activations as they stage them.
    const bool pipelined =
        moe_wmma_pipelined(wdt, d, aligned) && moe_wmma_pipelined(wdt, d_ff, aligned) &&
        (fp8 || (s.experts_fit_f16(experts) && (!shared || s.experts_fit_f16({&shared->w, 1}))));
    // SwiGLU rows wider than one cluster: gate/up stores them in f32 and a row split follows.
    const bool wide = pipelined && !moe_mma_takes(d_ff, wdt);
    if (pipelined) {
      launch_f16_row_split(x.ptr<float>(), x.stride[0], n, d, m.x_terms, m.x_scale, s.stream);
      up.x_scale = m.x_scale, down.x_scale = m.h_scale;
      s.launched("moe_experts (activation split)");
      up.x_terms = m.x_terms, up.ldxt = d, up.x_terms_plane = n * d;
      down.x_terms = wide ? m.hs_wide_terms : m.hs_terms, down.ldxt = d_ff;
      down.x_terms_plane = pairs * d_ff;
      if (!wide) {
        up.out_terms = m.hs_terms, up.out_terms_plane = pairs * d_ff;
        up.out_scale = m.h_scale;
      }
      // Warpgroup products where sm_90a code runs (C80 prefill +1-2%: performance.md, session 39).
      up.warpgroup = down.warpgroup = !fp8 && s.sm90a;
      up.one_term = down.one_term = up.warpgroup && s.one_term_first_row(n) == 0;
    }
    // The profile names the f16 tiles (the pipelined ones) apart from the others (a test checks
    // which ran).
    work(true);
    launch_moe_wmma(up, wdt, true, unsigned(max_tiles), s.stream);
    s.launched(up.one_term    ? "moe_experts (gate/up, 1-term f16 wgmma)"
               : up.warpgroup ? "moe_experts (gate/up, f16 wgmma)"
               : pipelined    ? "moe_experts (gate/up, f16 tensor cores)"
                              : "moe_experts (gate/up, tensor cores)");
    if (wide) {
      launch_f16_row_split(m.hs, d_ff, pairs, d_ff, m.hs_wide_terms, m.h_scale, s.stream);
      s.launched("moe_experts (SwiGLU split)");
    }
    work(false);
    launch_moe_wmma(down, wdt, false, unsigned(max_tiles), s.stream);
    s.launched(down.one_term    ? "moe_experts (down, 1-term f16 wgmma)"
               : down.warpgroup ? "moe_experts (down, f16 wgmma)"
               : pipelined      ? "moe_experts (down, f16 tensor cores)"
                                : "moe_experts (down, tensor cores)");
  } else {
    const int64_t E16 = 16 / int64_t(dtype_size(wdt));  // elements in a 16-byte chunk
    // Block-FP8: 16-byte chunks within one column block of scales.
    const bool blocks_vec = !fp8 || (fp8_up.cols % E16 == 0 && fp8_down.cols % E16 == 0);
    const bool x_vec =
        (reinterpret_cast<uintptr_t>(x.data) & 15) == 0 && x.stride[0] % 4 == 0 && blocks_vec;
    const unsigned tiles = unsigned(max_tiles + (shared && direct ? 1 : 0));
    if (route) {
      RECUR_CHECK(aligned && x_vec && d % E16 == 0 && d_ff % E16 == 0);
      up.route.cluster = kRouteCluster;
      work(true);
      launch_moe_gemv_routed(up, wdt, int(E / kRouteThreads), tiles, s.stream);
      s.launched("moe_experts (routing, gate/up)");
      work(false);
      launch_moe_gemv_experts(down, wdt, false, 1, true, tiles, s.stream);
      s.launched("moe_experts (down)");
    } else {
      work(true);
      launch_moe_gemv_experts(up, wdt, true, tm, aligned && x_vec && d % E16 == 0, tiles, s.stream);
      s.launched("moe_experts (gate/up)");
      work(false);
      launch_moe_gemv_experts(down, wdt, false, tm, aligned && blocks_vec && d_ff % E16 == 0, tiles,
                              s.stream);
      s.launched("moe_experts (down)");
    }
  }
  const bool gated = shared && !shared->score.empty();
  launch_moe_combine(m.ys, direct ? nullptr : m.sorted.row_of, int(n), int(slots),
                     weights.ptr<float>(), weights.stride[0], int(k), d, out.ptr<float>(),
                     out.stride[0], shared != nullptr, gated ? shared->score.ptr<float>() : nullptr,
                     gated ? shared->score.stride[0] : 0,
                     residual.data ? residual.ptr<float>() : nullptr,
                     residual.data ? residual.stride[0] : 0, s.stream);
  s.launched("moe_experts (combine)");
}

// Rows [r0, r1) of an optional [n, ...] tensor, and of a shared expert's per-token tensors.
Tensor rows(const Tensor& t, int64_t r0, int64_t r1) {
  return t.data ? t.slice_rows(r0, r1) : t;
}
SharedExpertArgs rows(const SharedExpertArgs& a, int64_t r0, int64_t r1) {
  SharedExpertArgs t = a;
  for (Tensor* p : {&t.score, &t.gate, &t.up, &t.hidden, &t.out}) *p = rows(*p, r0, r1);
  return t;
}

// Experts over a forward's decode and prompt rows run as two (CudaOps::Impl::split_decode_rows)
// where prompt rows take lower-precision products: e4m3 activations for block-FP8 weights, one
// f16 term for 16-bit ones; true when op has run so.
template <typename Op>
bool split_lowp_rows(CudaOps::Impl& s, const Tensor& x, std::span<const ExpertWeights> experts,
                     Op&& op) {
  const DType wdt = experts.front().gate.dtype;
  const bool lowp = wdt == DType::F8_E4M3
                        ? s.e4m3_activations
                        : (wdt == DType::BF16 || wdt == DType::F16) && s.one_term_prompts;
  return s.split_decode_rows(x.shape[0], lowp, op);
}

}  // namespace

void CudaOps::moe_experts(const Tensor& x, std::span<const ExpertWeights> experts,
                          const Tensor& ids, const Tensor& weights, Tensor out, Tensor scratch) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  if (split_lowp_rows(*impl_, x, experts, [&](int64_t r0, int64_t r1) {
        moe_experts(rows(x, r0, r1), experts, rows(ids, r0, r1), rows(weights, r0, r1),
                    rows(out, r0, r1), scratch);
      })) {
    return;
  }
  run_moe_experts(*impl_, x, experts, ids, weights, out, scratch, nullptr);
}

void CudaOps::moe_experts_shared(const Tensor& x, std::span<const ExpertWeights> experts,
                                 const Tensor& ids, const Tensor& weights,
                                 const SharedExpertArgs& shared, Tensor out, Tensor scratch) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  if (split_lowp_rows(*impl_, x, experts, [&](int64_t r0, int64_t r1) {
        moe_experts_shared(rows(x, r0, r1), experts, rows(ids, r0, r1), rows(weights, r0, r1),
                           rows(shared, r0, r1), rows(out, r0, r1), scratch);
      })) {
    return;
  }
  // One token or a prompt on the tiles: the shared expert rides along as one more pair of each
  // token; else the default's ops.
  if (!shared_rides_along(x, experts, ids.shape[1], shared, scratch,
                          e4m3_rows(*impl_, experts.front().gate.dtype))) {
    Ops::moe_experts_shared(x, experts, ids, weights, shared, out, scratch);
    return;
  }
  run_moe_experts(*impl_, x, experts, ids, weights, out, scratch, &shared);
}

void CudaOps::moe_route_experts_shared(const Tensor& logits, const MoeRouting& routing,
                                       const Tensor& x, std::span<const ExpertWeights> experts,
                                       Tensor ids, Tensor weights, const SharedExpertArgs& shared,
                                       Tensor out, Tensor scratch, Tensor residual) {
  if (impl_->replaying()) return;  // the decode graph does this op's work
  if (split_lowp_rows(*impl_, x, experts, [&](int64_t r0, int64_t r1) {
        moe_route_experts_shared(rows(logits, r0, r1), routing, rows(x, r0, r1), experts,
                                 rows(ids, r0, r1), rows(weights, r0, r1), rows(shared, r0, r1),
                                 rows(out, r0, r1), scratch, rows(residual, r0, r1));
      })) {
    return;
  }
  if (!shared_rides_along(x, experts, ids.shape[1], shared, scratch,
                          e4m3_rows(*impl_, experts.front().gate.dtype))) {
    Ops::moe_route_experts_shared(logits, routing, x, experts, ids, weights, shared, out, scratch,
                                  residual);
    return;
  }
  // One token: routed by gate/up itself where it can, else by the routing kernel; the shared
  // expert rides along; the combine adds the result to the residual.
  const int k = routing.k;
  RECUR_CHECK(ids.dtype == DType::I32 && ids.shape[1] == k && weights.shape[1] == k);
  RECUR_CHECK(!residual.data || residual.data != out.data);
  RECUR_CHECK(routing.selection_bias.empty() ||
              (routing.selection_bias.dtype == DType::F32 &&
               routing.selection_bias.numel() == logits.shape[1] &&
               routing.selection_bias.is_contiguous()));
  if (!routes_in_kernels(*impl_, logits, routing, x, experts, shared)) {
    moe_route(logits, routing, ids, weights);
    run_moe_experts(*impl_, x, experts, ids, weights, out, scratch, &shared, nullptr, residual);
    return;
  }
  MoeInKernelRoute route;
  route.logits = logits.ptr<float>(), route.k = k, route.scoring = route_scoring(routing);
  route.ids = ids.ptr<int32_t>(), route.weights = weights.ptr<float>();
  run_moe_experts(*impl_, x, experts, ids, weights, out, scratch, &shared, &route, residual);
}

}  // namespace recur
