// bf16 <-> fp32 bit conversions, shared by both native kernels (int4mm.h, w4a8mm.h).
// `static`: one private copy per translation unit, so an ISA unit compiled under `#pragma GCC target` never hands
// the linker a target-specific copy of a shared inline symbol.
#pragma once
#include <cstdint>

namespace edgeq_bf16 {

// fp32 -> bf16, round to nearest even, NaN -> quiet 0x7fc0 (same rule as c10::BFloat16).
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

}  // namespace edgeq_bf16
