// Portable C++ path of the W4A8 kernel (any x86-64; also the reference the SIMD paths are tested against through
// the Python portable path). Compiled with -ffp-contract=off: every fp32 operation below rounds once, as written;
// the only fused multiply-add is the explicit std::fma.
#include <cmath>
#include <cstring>

#include "w4a8mm.h"

namespace edgeq_w4a8 {

void quantize_rows_scalar(const uint16_t* xb, const float* xf32, int64_t K, int64_t m0, int64_t m1, uint8_t* au8,
                          float* sa) {
  for (int64_t m = m0; m < m1; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float v = xf32 ? xf32[m * K + k] : bf16_to_f32(xb[m * K + k]);
      amax = std::fmax(amax, std::fabs(v));
    }
    amax = std::fmax(amax, kActEps);
    const float inv = 127.f / amax;
    for (int64_t k = 0; k < K; ++k) {
      const float v = xf32 ? xf32[m * K + k] : bf16_to_f32(xb[m * K + k]);
      const float r = std::nearbyint(v * inv);  // default rounding mode: to nearest, ties to even
      au8[m * K + k] = static_cast<uint8_t>(static_cast<int>(r) + 128);
    }
    sa[m] = amax / 127.f;
  }
}

int64_t scratch_bytes(int64_t K, int64_t M) {
  // vnni/amx: the unpacked block (q - z as int8, K*32 bytes), the fp32 accumulator of up to 32 rows (32*32*4),
  // int32 tile results (4 * 16 * 16 * 4); scalar: M*32 floats. Rounded up generously.
  const int64_t a = K * 32 + 32 * 32 * 4 + 4 * 16 * 16 * 4 + 4096;
  const int64_t b = M * 32 * 4 + 4096;
  return a > b ? a : b;
}

void block_scalar(const Args& a, int64_t nb, uint8_t* scratch) {
  const int64_t M = a.M, bk = a.bk, KB = a.kblocks();
  float* C = reinterpret_cast<float*>(scratch);  // [M][32], row order
  for (int64_t m = 0; m < M; ++m)
    for (int c = 0; c < kBlockN; ++c) C[m * kBlockN + c] = a.bias ? a.bias[nb * kBlockN + c] : 0.f;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* slot = a.qw + (nb * KB + kb) * a.slot_bytes();
    const float* s = a.scales + (nb * KB + kb) * kBlockN;
    const int8_t* z = a.zeros + (nb * KB + kb) * kBlockN;
    int32_t comp[kBlockN];
    std::memcpy(comp, slot + bk * 16, sizeof comp);
    for (int c = 0; c < kBlockN; ++c) {
      const int j = lane_of(c), shift = 4 * lane_half(c);
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* xa = a.au8 + m * a.K + kb * bk;
        int32_t acc = 0;
        for (int64_t kg = 0; kg < bk / 4; ++kg)
          for (int ki = 0; ki < 4; ++ki) {
            const int q = (slot[kg * 64 + j * 4 + ki] >> shift) & 15;
            acc += static_cast<int32_t>(xa[kg * 4 + ki]) * (q - z[c]);
          }
        acc -= 128 * comp[c];
        const float t = static_cast<float>(acc) * a.sa[m];
        C[m * kBlockN + c] = std::fma(t, s[c], C[m * kBlockN + c]);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int c = 0; c < kBlockN; ++c) a.y[m * a.N + nb * kBlockN + c] = f32_to_bf16(C[m * kBlockN + c]);
}

}  // namespace edgeq_w4a8
