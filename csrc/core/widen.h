// 16-bit float storage (IEEE half, bfloat16) and its exact widening to float32 bits, torch-free and
// usable from host C++ and CUDA device code: every kernel that reads 16-bit tensors widens them here.
#pragma once

#include <cstdint>

#include "stats_state.h"

namespace gapmon {
namespace core {

// 16-bit storage of bfloat16 and IEEE half elements (the bits; no torch types).
struct BF16 {
  uint16_t x;
};
struct Half {
  uint16_t x;
};

// IEEE half bits -> float32 bits, exact (subnormals normalised, Inf/NaN kept).
GAPMON_HD uint32_t half_to_f32_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return sign | 0x7F800000u | (man << 13);
  if (exp != 0) return sign | ((exp + 112u) << 23) | (man << 13);
  if (man == 0) return sign;
  uint32_t e = 113;  // a subnormal m * 2^-24: shift m up to its leading 1
  while ((man & 0x400u) == 0) {
    man <<= 1;
    --e;
  }
  return sign | (e << 23) | ((man & 0x3FFu) << 13);
}

// float32 <-> its bits (a union: valid in GCC, Clang and nvcc, and vectorises, unlike a memcpy in device code).
union F32Bits {
  uint32_t u;
  float f;
};
GAPMON_HD float f32_from_bits(uint32_t bits) { return F32Bits{bits}.f; }
GAPMON_HD uint32_t bits_of(float v) {
  F32Bits pun;
  pun.f = v;
  return pun.u;
}

// An element as double, exactly (every float32/half/bfloat16 value is a double).
GAPMON_HD double widen(float v) { return v; }
GAPMON_HD double widen(double v) { return v; }
GAPMON_HD double widen(Half v) { return f32_from_bits(half_to_f32_bits(v.x)); }
GAPMON_HD double widen(BF16 v) { return f32_from_bits(static_cast<uint32_t>(v.x) << 16); }

}  // namespace core
}  // namespace gapmon
