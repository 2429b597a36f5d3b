// Quantized matmul weights on the CPU: block-FP8 (F8_E4M3, as released) and the 8-bit / 4-bit
// formats of --quantize (Q8_32, Q4_32). Each is re-laid out once at load into a layout of this
// backend, with the dequantization inside the dot products; nothing is expanded in memory.
//
// Layouts (the 64 bytes before a weight's data hold its QuantHeader):
//  - F8_E4M3: the fp8 bytes k-major [k, ld] (ld = m rounded up to 16, zero padded), then the
//    scales f32 [ceil(k / group), ld]: column c's scale for k-block j, times 256 (the kernels
//    widen e4m3 through f16, which leaves a factor 2^-8).
//  - Q8_32 / Q4_32: per block of 16 output columns, per group g of 32 k: the quants, then the
//    16 columns' f16 scales. Q8_32: 8 steps × 16 columns × 4 bytes, the byte of column c, step
//    j, b = q[c][32g + 4j + b] + 128 (544 bytes with scales); Q4_32: 4 steps × 16 × 4 bytes,
//    low nibble q[c][32g + 4j + b] + 8, high nibble q[c][32g + 16 + 4j + b] + 8 (288 bytes).
//    A column block's groups are consecutive, so a thread's columns stream from memory in order.
//    Activations are quantized per token and group of 32 to int8 (scale amax / 127) for these.
#pragma once

#include <cstdint>
#include <vector>

#include "core/allocator.h"
#include "core/tensor.h"

namespace recur::cpu {

struct QuantHeader {
  int64_t m = 0, k = 0;      // the weight [m, k]
  int64_t ld = 0;            // m rounded up to 16
  int64_t group = 0;         // k per scale: the block's columns (F8_E4M3), 32 (Q8_32, Q4_32)
  int64_t scale_offset = 0;  // F8_E4M3: bytes from data to the scales
};
constexpr int64_t kQuantHeaderBytes = 64;
inline const QuantHeader& quant_header(const Tensor& w) {
  return *reinterpret_cast<const QuantHeader*>(static_cast<const char*>(w.data) -
                                               kQuantHeaderBytes);
}
inline bool is_quantized(DType t) {
  return t == DType::F8_E4M3 || t == DType::Q8_32 || t == DType::Q4_32;
}
constexpr int64_t kQ8GroupBytes = 8 * 64 + 32, kQ4GroupBytes = 4 * 64 + 32;

// w [m, k] F8_E4M3 (contiguous) with scales [ceil(m / block_rows), ceil(k / block_cols)] F32,
// re-laid out as above.
Result<Tensor> pack_fp8(Allocator& alloc, const Tensor& w, const Tensor& scales, int block_rows,
                        int block_cols, Buffer* out);
// w [m, k] F32/BF16/F16 (contiguous, k a multiple of 32) quantized to Q8_32 or Q4_32: per
// column and group, int8 with scale amax / 127 (Q8_32), or 4 bits with scale v / -8 where v is
// the value of largest magnitude (Q4_32, the extreme maps to -8).
Result<Tensor> pack_q(Allocator& alloc, const Tensor& w, DType dtype, Buffer* out);

// Activations quantized for Q8_32 / Q4_32: per token and group of 32, int8 q = round(x / d),
// d = amax / 127, and the sum of the group's q (the kernels subtract the quants' offset · sum).
// A view of memory its caller owns (CpuOps: an arena sized at reserve).
struct QuantizedActivations {
  int64_t n = 0, k = 0;
  int8_t* q = nullptr;     // [n, k]
  float* scale = nullptr;  // [n, k / 32]
  int32_t* sum = nullptr;  // [n, k / 32]
};
// Bytes quantize_activations takes for n rows of k (pieces 64-byte aligned from the start).
size_t quantized_activation_bytes(int64_t n, int64_t k);
// x [n, k] (rows x_stride apart, k a multiple of 32) quantized into `memory`
// (quantized_activation_bytes(n, k) bytes, 64-byte aligned).
QuantizedActivations quantize_activations(const float* x, int64_t x_stride, int64_t n, int64_t k,
                                          void* memory);

// Which instruction set runs the quantized dot products; picked at run time.
enum class QuantIsa { kScalar, kAvx2, kAvx512 };
QuantIsa best_quant_isa();               // the best this CPU has
bool quant_isa_supported(QuantIsa isa);  // for the tests
const char* quant_isa_name(QuantIsa isa);

// out[t][c] (+)= Σ_i x[t][i] · w[c][i] for columns [c0, c1) (c0 a multiple of 16) and tokens
// [0, n): F8_E4M3 reads x; Q8_32 / Q4_32 read xq. The kernels of `isa` (kScalar: the plain
// reference beside them, which gives the same results bit for bit: integer sums are exact and
// every float operation comes in the same order).
void quant_matmul_columns(QuantIsa isa, const Tensor& w, const float* x, int64_t x_stride,
                          const QuantizedActivations* xq, int64_t n, float* out, int64_t out_stride,
                          int64_t c0, int64_t c1, bool accumulate);

// Weight [c][i] of a quantized weight, dequantized (the scalar definition of the layouts).
float quant_weight_at(const Tensor& w, int64_t c, int64_t i);

}  // namespace recur::cpu
