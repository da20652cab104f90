// edgeq native W4A16 decode kernel: shared declarations (no torch headers here, on purpose).
//
// The ISA translation units (int4mm_avx512.cpp, int4mm_avx2.cpp) are compiled with `#pragma GCC target`, so they
// must not include torch or any header with inline functions: an inline function compiled for AVX512 in one TU
// and for the baseline in another is one symbol to the linker, which may keep the AVX512 copy and crash an AVX2
// machine. They see only this plain C interface.
//
// Math. qweight holds q in 0..15, w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k / G. Per group
//     y[m, n] += scale * (sum_k x[m, k] q[n, k] - 8 xs[m, g]) + zero * xs[m, g],   xs[m, g] = sum_{k in g} x[m, k]
// so the inner loop only sums x * q, and the scale and zero are applied once per group and row.
#pragma once
#include <xmmintrin.h>

#include <cstdint>

#include "bf16.h"

namespace edgeq {

// Block modes: how the s/2 bytes of one k inside a row block of s rows hold the s rows.
// byte j, low nibble = nibble position 2j, high nibble = position 2j+1.
enum BlockMode : int {
  kHalves = 0,    // position 2j -> row j, 2j+1 -> row j + s/2   (full AVX512 / AVX2 blocks)
  kAdjacent = 1,  // position p -> row p                          (tails, default-capability blocks)
};

struct Int4Args {
  const uint16_t* x;   // bf16 bits [M, K], row-major
  const float* xf;     // fp32 copy of x [M, K]; not allocated where only the AMX or avx2 prefill tiles read x
  const float* xs;     // fp32 group sums [M, K/G]
  const uint8_t* qw;   // packed [N, K/2]; block b of s rows = bytes [row0*K/2, (row0+s)*K/2), k-major
  const uint16_t* sz;  // bf16 bits [K/G, N, 2]: (scale, zero)
  uint16_t* y;         // bf16 bits [M, N]
  int64_t M, N, K, G;
  // avx512 path only: the fp32-FMA tiles instead of the bf16-pair ones (int4mm_avx512.cpp; the op sets it for M > 8
  // when measured faster here, or when asked).
  bool f32_prefill = false;
  // avx2 path only: x in fp32, k-major within tiles of kWideTile rows (row m0 + m of the tile at m0: xt[m0 K + k MT +
  // m], MT = the tile's rows, kWideTile except the last): set by the op for M >= kWideMin, and then the 6-row
  // prefill tiles run (int4mm_avx2.cpp); null: the 2-row tiles (M < kWideMin, or asked: the op's tile code 3).
  const float* xt = nullptr;
};

constexpr int kWideTile = 6;
constexpr int64_t kWideMin = 3;

// Software prefetch distance for the weight stream, in bytes (measured: 4-16 KB all ~1.4x better than none at M=1 on
// DRAM-resident weights; the hardware prefetcher alone leaves the vector units waiting).
constexpr int64_t kPrefetchBytes = 8192;

// Prefetch the next row block's (scale, zero) pairs of one group: s rows x 4 bytes after this block's `sz`. They are
// strided by N (the hardware prefetcher misses them), and a mapped checkpoint's tensors are not 64-byte aligned, so
// the s * 4 bytes span s / 16 + 1 lines: all of them are fetched (fetching one line fewer left a demand miss per group
// and block that made the avx2 decode 1.6x slower end to end on a Llama-3.2-1B-shaped checkpoint: docs/kernel.md).
inline void prefetch_next_scales(const uint16_t* sz, int s) {
  for (int i = 0; i <= s * 4; i += 64) _mm_prefetch(reinterpret_cast<const char*>(sz + s * 2) + i, _MM_HINT_T0);
}

// Compute rows [row0, row0 + s) of y for all M. ys: fp32 scratch of at least M * 64 floats, acc: another M * 64.
// The SIMD routines return false when they have no fast path for (s, mode); the caller then uses the scalar one.
void block_scalar(const Int4Args& a, int64_t row0, int s, int mode, float* ys, float* acc);
bool block_avx2(const Int4Args& a, int64_t row0, int s, int mode, float* ys);
bool block_avx512(const Int4Args& a, int64_t row0, int s, int mode, float* ys);
bool block_amx(const Int4Args& a, int64_t row0, int s, int mode, float* ys);
// CPU has AMX-TILE/AMX-BF16 and Linux granted this process the tile state (asks once; call before block_amx).
bool amx_usable();

using edgeq_bf16::bf16_to_f32;  // bf16.h
using edgeq_bf16::f32_to_bf16;

// Write the fp32 scratch ys [M][s] (rows of the block in order) to y as bf16.
inline void store_rows(const Int4Args& a, int64_t row0, int s, const float* ys) {
  for (int64_t m = 0; m < a.M; ++m)
    for (int r = 0; r < s; ++r) a.y[m * a.N + row0 + r] = f32_to_bf16(ys[m * s + r]);
}

}  // namespace edgeq
