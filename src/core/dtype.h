// Element types of tensors, and the scalar conversions between them.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace recur {

// F8_E4M3: the OCP float8 e4m3fn of block-FP8 checkpoints (no infinities; S.1111.111 is NaN).
// Q8_32, Q4_32: weights quantized at load (--quantize) in groups of 32 along each row with an
// f16 scale per group, in a layout private to the backend that made them (a tensor of these
// dtypes is only ever a matmul weight).
enum class DType : uint8_t { F32, BF16, F16, F64, I64, I32, I8, U8, BOOL, F8_E4M3, Q8_32, Q4_32 };

size_t dtype_size(DType t);  // Q8_32, Q4_32: 1 (bytes depend on the layout)
// Bytes of `numel` weights of dtype t as held for the kernels: the element size, and for Q8_32 /
// Q4_32 their group scales too (the block scales of F8_E4M3, under 1%, are not counted).
int64_t weight_bytes(DType t, int64_t numel);
const char* dtype_name(DType t);                                  // "F32", "BF16", ...
std::optional<DType> dtype_from_safetensors(std::string_view s);  // safetensors' spelling

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

float f16_to_f32(uint16_t h);

// e4m3fn byte -> f32, exactly (subnormals included; the two NaN codes give NaN).
inline float f8_e4m3_to_f32(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80) << 24;
  const uint32_t exp = (b >> 3) & 0xf, mant = b & 0x7;
  float f;
  if ((b & 0x7f) == 0x7f) {
    const uint32_t nan = 0x7fc00000u | sign;
    std::memcpy(&f, &nan, 4);
    return f;
  }
  if (exp == 0) {
    f = float(mant) * (1.0f / 512.0f);  // mant/8 * 2^-6
  } else {
    const uint32_t bits = (exp + 120) << 23 | mant << 20;
    std::memcpy(&f, &bits, 4);
  }
  return sign ? -f : f;
}
// f32 -> e4m3fn, round to nearest even, saturating to ±448 (NaN stays NaN).
uint8_t f32_to_f8_e4m3(float f);
// f32 -> IEEE binary16, round to nearest even (from 65520 on: ±inf; NaN stays NaN).
uint16_t f32_to_f16(float f);
// f32_to_f16, but magnitudes over 65504 (the largest finite) give ±65504, as e4m3's ±448.
uint16_t f32_to_f16_saturating(float f);

}  // namespace recur
