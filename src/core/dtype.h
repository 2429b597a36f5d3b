// Element types of tensors, and the scalar conversions between them.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace recur {

enum class DType : uint8_t { F32, BF16, F16, F64, I64, I32, I8, U8, BOOL };

size_t dtype_size(DType t);
const char* dtype_name(DType t);                             // "F32", "BF16", ...
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
uint16_t f32_to_f16(float f);

}  // namespace recur
