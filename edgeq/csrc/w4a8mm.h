// edgeq native W4A8 kernel over the stored amx_w4a8 layout: shared declarations (no torch headers, on purpose:
// the ISA translation units are compiled with `#pragma GCC target` and must not share inline torch code with the
// baseline binding, see int4mm.h for the same rule).
//
// Layout (edgeq/layouts/w4a8.py): qweight uint8 [N/32, K/bk, bk*16 + 128]; slot (nb, kb) = rows 32nb..32nb+31,
// inputs bk*kb..; byte kg*64 + 4j + ki holds q[c(j), 4kg+ki] (low nibble) and q[c(j)+8, 4kg+ki] (high nibble),
// c(j) = j (j < 8), j + 8 (j >= 8); then int32 comp[32] = sum over the slot of (q - z). scales fp32 [N/32, K/G, 32],
// zeros int8 [N/32, K/G, 32]; G = bk here (G in 32, 64, 128).
//
// Arithmetic, exactly that of edgeq.layouts.w4a8.w4a8_linear(fused=True):
//     amx = max(max_k |x[m,k]|, 1e-7f); inv = 127.f / amx; q_a = rint_even(x * inv); s_a = amx / 127.f
//     C = fp32(bias) or 0
//     for kb in order: acc = sum_k (q_a + 128) * (q - z) - 128 * comp   (== sum_k q_a * (q - z), exact int32)
//                      C = fma(fp32(acc) * s_a, s[kb], C)               (one rounding for the product, one for the fma)
//     y = bf16_rne(C)
// The "lane order" of a 32-row block: two 16-lane vectors, lo = rows 0-7, 16-23 and hi = rows 8-15, 24-31 (what the
// low / high nibbles of one 64-byte group hold).
#pragma once
#include <cstdint>

#include "bf16.h"

namespace edgeq_w4a8 {

constexpr float kActEps = 1e-7f;
constexpr int kBlockN = 32;

struct Args {
  const uint8_t* au8;   // (q_a + 128) [M, K] row-major
  const float* sa;      // s_a [M]
  const uint8_t* qw;    // packed weight
  const float* scales;  // [N/32, K/G, 32]
  const int8_t* zeros;  // [N/32, K/G, 32]
  const float* bias;    // fp32 [N] or nullptr
  uint16_t* y;          // bf16 [M, N]
  int64_t M, N, K, bk;
  int64_t slot_bytes() const { return bk * 16 + 128; }
  int64_t kblocks() const { return K / bk; }
};

// Quantise rows [m0, m1) of x (bf16 bits, or fp32 when xf32 is set) into au8 / sa.
void quantize_rows_scalar(const uint16_t* xb, const float* xf32, int64_t K, int64_t m0, int64_t m1, uint8_t* au8,
                          float* sa);
void quantize_rows_vnni(const uint16_t* xb, const float* xf32, int64_t K, int64_t m0, int64_t m1, uint8_t* au8,
                        float* sa);
void quantize_rows_avx2(const uint16_t* xb, const float* xf32, int64_t K, int64_t m0, int64_t m1, uint8_t* au8,
                        float* sa);

// Column block nb (32 output rows), all M rows. scratch: 64-byte aligned, at least scratch_bytes(K, M) bytes, or
// only kDecodeScratchBytes for block_vnni / block_avx2 with M <= kDecodeMaxRows (the decode paths stream the packed
// bytes and keep just the fp32 rows: no per-call allocation that grows with K).
constexpr int64_t kDecodeMaxRows = 8;
constexpr int64_t kDecodeScratchBytes = kDecodeMaxRows * 32 * 4;
int64_t scratch_bytes(int64_t K, int64_t M);
void block_scalar(const Args& a, int64_t nb, uint8_t* scratch);
void block_vnni(const Args& a, int64_t nb, uint8_t* scratch);
void block_avx2(const Args& a, int64_t nb, uint8_t* scratch);     // AVX2 + FMA (vpmaddubsw)
void block_avxvnni(const Args& a, int64_t nb, uint8_t* scratch);  // the same with AVX-VNNI (VEX vpdpbusd)
void block_amx(const Args& a, int64_t nb, uint8_t* scratch);
// Must be called on every thread before block_amx (configures this thread's tiles, once per call of the op).
bool amx_usable();  // CPU has AMX-TILE/AMX-INT8 and Linux granted the tile data state (asks once)

using edgeq_bf16::bf16_to_f32;  // bf16.h
using edgeq_bf16::f32_to_bf16;

// Row c (0..31) of a block: which 16-lane vector (0 lo, 1 hi) and lane hold it.
inline int lane_half(int c) { return (c >> 3) & 1; }
inline int lane_of(int c) { return (c & 7) + 8 * (c >> 4); }

}  // namespace edgeq_w4a8
