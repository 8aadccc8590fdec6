// Float values stored as the bytes of a tensor of dtype `dt` (the kernels' raw input): float32 and float64
// exactly; bfloat16 and float16 by truncating the float32 value (exact for values with at most 8 significant
// bits in float16's range; others become the truncated neighbour, out-of-range ones +-inf).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/core/strided_view.h"

inline uint16_t half_bits_truncated(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float a = std::fabs(v);
  if (std::isnan(a)) return sign | 0x7E00u;
  if (a >= 65536.0f) return sign | 0x7C00u;
  if (a < 0x1p-14f) return sign | static_cast<uint16_t>(a * 0x1p24f);  // subnormal: multiples of 2^-24
  int e;
  const float m = std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  return sign | static_cast<uint16_t>(((e - 1 + 15) << 10) | (static_cast<uint32_t>(m * 2048) & 0x3FFu));
}

inline std::vector<uint8_t> store(const std::vector<float>& values, gapmon::core::DType dt) {
  using gapmon::core::DType;
  std::vector<uint8_t> out;
  for (float v : values) {
    if (dt == DType::kFloat32) {
      out.insert(out.end(), reinterpret_cast<uint8_t*>(&v), reinterpret_cast<uint8_t*>(&v) + 4);
    } else if (dt == DType::kFloat64) {
      double d = v;
      out.insert(out.end(), reinterpret_cast<uint8_t*>(&d), reinterpret_cast<uint8_t*>(&d) + 8);
    } else {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      const uint16_t h = dt == DType::kBFloat16 ? static_cast<uint16_t>(bits >> 16) : half_bits_truncated(v);
      out.push_back(h & 0xFF), out.push_back(h >> 8);
    }
  }
  return out;
}
