#include "core/dtype.h"

#include <algorithm>
#include <cmath>

namespace recur {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::I8:
    case DType::U8:
    case DType::BOOL:
      return 1;
    case DType::F8_E4M3:
    case DType::Q8_32:
    case DType::Q4_32:
      return 1;
  }
  return 0;
}

int64_t weight_bytes(DType t, int64_t numel) {
  if (t == DType::Q8_32) return numel / 32 * 34 + numel % 32;
  if (t == DType::Q4_32) return numel / 32 * 18 + (numel % 32 + 1) / 2;
  return numel * int64_t(dtype_size(t));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::F64:
      return "F64";
    case DType::I64:
      return "I64";
    case DType::I32:
      return "I32";
    case DType::I8:
      return "I8";
    case DType::U8:
      return "U8";
    case DType::BOOL:
      return "BOOL";
    case DType::F8_E4M3:
      return "F8_E4M3";
    case DType::Q8_32:
      return "Q8_32";
    case DType::Q4_32:
      return "Q4_32";
  }
  return "?";
}

std::optional<DType> dtype_from_safetensors(std::string_view s) {
  if (s == "F32") return DType::F32;
  if (s == "BF16") return DType::BF16;
  if (s == "F16") return DType::F16;
  if (s == "F64") return DType::F64;
  if (s == "I64") return DType::I64;
  if (s == "I32") return DType::I32;
  if (s == "I8") return DType::I8;
  if (s == "U8") return DType::U8;
  if (s == "BOOL") return DType::BOOL;
  if (s == "F8_E4M3") return DType::F8_E4M3;
  return std::nullopt;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        mant <<= 1;
        ++e;
      } while (!(mant & 0x400));
      mant &= 0x3ff;
      bits = sign | uint32_t(127 - 15 - e) << 23 | mant << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  int32_t exp = int32_t((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return uint16_t(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return uint16_t(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return uint16_t(sign);
    mant |= 0x800000;
    uint32_t shift = uint32_t(14 - exp);
    uint32_t half = 1u << (shift - 1);
    uint32_t rounded = (mant + half - 1 + ((mant >> shift) & 1)) >> shift;
    return uint16_t(sign | rounded);
  }
  uint32_t rounded = mant + 0xfff + ((mant >> 13) & 1);
  if (rounded & 0x800000) {
    rounded = 0;
    ++exp;
  }
  if (exp >= 31) return uint16_t(sign | 0x7c00);
  return uint16_t(sign | uint32_t(exp) << 10 | (rounded >> 13));
}

uint16_t f32_to_f16_saturating(float f) {
  return f32_to_f16(std::fabs(f) > 65504.0f ? std::copysign(65504.0f, f) : f);
}

uint8_t f32_to_f8_e4m3(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint8_t sign = uint8_t((x >> 24) & 0x80);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint8_t(sign | 0x7f);
  const float a = std::fabs(f);
  // Saturates: from 464 (half-way past 448, the largest) on, rounding would leave the range.
  if (a >= 464.0f) return uint8_t(sign | 0x7e);
  // The nearest of the 127 finite magnitudes, ties to even: step by the spacing at a's binade.
  int e;
  std::frexp(a, &e);                             // a = m·2^e, m in [0.5, 1)
  const int exp_field = std::max(e - 1 + 7, 1);  // subnormals share the spacing of exp 1
  const float spacing = std::ldexp(1.0f, exp_field - 7 - 3);
  const float q = std::nearbyint(a / spacing);  // current rounding mode: to nearest even
  const float r = q * spacing;
  if (r == 0.0f) return sign;
  int re;
  std::frexp(r, &re);
  const int field = re - 1 + 7;
  if (field <= 0) return uint8_t(sign | uint8_t(r / std::ldexp(1.0f, -9)));  // subnormal
  const uint32_t mant = uint32_t(std::ldexp(r, -(field - 7)) * 8.0f) - 8;
  return uint8_t(sign | uint8_t(field << 3) | uint8_t(mant));
}

}  // namespace recur
