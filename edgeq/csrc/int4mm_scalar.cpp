// Portable path: any block size s (multiple of 16, <= 64) in either block mode. Used for every block when
// EDGEQ_NATIVE_ISA=scalar, and for the blocks the SIMD paths have no fast path for (tails, adjacent blocks).
#include "int4mm.h"

namespace edgeq {

void block_scalar(const Int4Args& a, int64_t row0, int s, int mode, float* ys, float* acc) {
  const int half = s / 2;
  const int64_t K = a.K, G = a.G, N = a.N;
  const uint8_t* w = a.qw + row0 * (K / 2);  // k-major: half bytes per k
  int row_of[64];
  for (int p = 0; p < s; ++p) row_of[p] = mode == kHalves ? (p / 2) + (p % 2) * half : p;
  for (int64_t i = 0; i < a.M * s; ++i) ys[i] = 0.f;

  for (int64_t g = 0; g < K / G; ++g) {
    const uint16_t* sz = a.sz + (g * N + row0) * 2;
    for (int64_t m = 0; m < a.M; ++m) {
      // acc[p] = sum_k x[m, k] * q at nibble position p (fp32, exact products of small integers by bf16 values)
      for (int p = 0; p < s; ++p) acc[p] = 0.f;
      const float* xm = a.xf + m * K;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) {
        const uint8_t* b = w + k * half;
        const float xk = xm[k];
        for (int j = 0; j < half; ++j) {
          acc[2 * j] += xk * static_cast<float>(b[j] & 15);
          acc[2 * j + 1] += xk * static_cast<float>(b[j] >> 4);
        }
      }
      const float xsum = a.xs[m * (K / G) + g];
      float* y = ys + m * s;
      for (int p = 0; p < s; ++p) {
        const int r = row_of[p];
        const float sc = bf16_to_f32(sz[2 * r]), zr = bf16_to_f32(sz[2 * r + 1]);
        y[r] += sc * (acc[p] - 8.f * xsum) + zr * xsum;
      }
    }
  }
  store_rows(a, row0, s, ys);
}

}  // namespace edgeq
