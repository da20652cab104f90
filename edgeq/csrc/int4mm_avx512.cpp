// AVX512 path (F/BW/VL/VBMI/BF16): full "halves" blocks of 32 or 64 rows.
//
// A block of S rows stores S/2 bytes per k; byte j holds row j (low nibble) and row j + S/2 (high nibble).
// Two consecutive k are S contiguous bytes: A = bytes of k, B = bytes of k+1. One vpermb turns them into 16 dwords
// (A_j, 0, B_j, 0) for 16 consecutive j. Or-ing 0x4300 into the low nibble's bits (one ternlog, no shift) or into
// the high nibble shifted right by 4 gives, per dword, two bf16 words with value 128 + q (exact: 0x4300 is 128.0 and
// its 7 mantissa bits count ones) for rows j at k and k+1.
// Example: byte A_j = 0x95 (row j: q = 5, row j + S/2: q = 9) -> low word 0x4300 | 5 = 0x4305 = 133 = 128 + 5,
// high-nibble word 0x4300 | 9 = 0x4309 = 137 = 128 + 9.
// vdpbf16ps multiplies them with the bf16 pair (x[k], x[k+1]) and adds both products into an fp32 lane: the
// activations stay bf16, the products are exact, the sums fp32. Per group, with D = sum x (128 + q):
//     sum_k x w = scale * ((D - 128 xs) - 8 xs) + zero * xs = scale D + (zero - 136 scale) xs.
// Precision: D carries the offset 128 xs, which the epilogue cancels, so D's fp32 rounding is ~8x larger relative to
// the result than with the offset-1 encoding 1 + q/16 (which costs one more shift per vector: measured 5-10% slower
// per call at M = 1, the same at M = 8; docs/kernel.md "Arithmetic and precision"); still far inside the tests'
// tolerance (2**-14 of |x|.|w|).
// Loops: tile of activation rows (1..4 rows: all row vectors at once; 5..8: one 16-j vector at a time) -> group g
// (G k's) -> k pairs.
// Re-reads of a group's bytes for the second v come from L1 (G*S/2 bytes <= 8 KB), for the next row tile (M > 8) from
// L2 (the block's K*S/2 bytes: 48 KB at K = 1536, 280 KB at K = 8960); DRAM is read once.
#include <immintrin.h>

#include <cstring>

#include "int4mm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,fma")

#include "int4mm_pairs.h"  // after the target pragma: AVX512 code

namespace edgeq {
namespace {

// acc[m][v][h] = sum over the group's k of x[m, k] * (128 + q) for rows 16(v0+v) + l (h = 0) and
// S/2 + 16(v0+v) + l (h = 1), l = 0..15. NV row vectors per pass; U independent partial sums per accumulator
// (k pairs alternate between them) so that small tiles are not bound by the latency of vdpbf16ps.
template <int S, int MT, int NV, int U>
inline void group_dot(const uint8_t* wg, const uint16_t* x, int64_t ldx, int64_t G, const __m512i* idx,
                      __m512 acc[MT][NV][2]) {
  const __m512i m0f = _mm512_set1_epi32(0x000F000F), b128 = _mm512_set1_epi32(0x43004300);
  __m512 part[U][MT][NV][2];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < NV; ++v) part[u][m][v][0] = part[u][m][v][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < G; kk += 2 * U) {
    for (int u = 0; u < U; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + (kk + 2 * u) * (S / 2) + kPrefetchBytes), _MM_HINT_T0);
      const __m512i r = load_pair<S>(wg + (kk + 2 * u) * (S / 2));
      for (int v = 0; v < NV; ++v) {
        const __m512i d = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, idx[v], r);
        const __m512i lo = _mm512_ternarylogic_epi32(d, m0f, b128, 0xEA);  // (a & b) | c
        const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi32(d, 4), m0f, b128, 0xEA);
        for (int m = 0; m < MT; ++m) {
          int32_t pair;
          std::memcpy(&pair, x + m * ldx + kk + 2 * u, 4);
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
          part[u][m][v][0] = _mm512_dpbf16_ps(part[u][m][v][0], (__m512bh)lo, xb);
          part[u][m][v][1] = _mm512_dpbf16_ps(part[u][m][v][1], (__m512bh)hi, xb);
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v)
      for (int h = 0; h < 2; ++h) {
        __m512 t = part[0][m][v][h];
        for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, part[u][m][v][h]);
        acc[m][v][h] = t;
      }
}

// The per-group epilogue of both tile kinds, for the 16 rows at r of the block and activation rows m0 .. m0+MT-1:
//     y[m, r + l] += scale * D[m][l] + (zero - offset * scale) * xs[m, g]
// with offset 136 (= 128 + 8) for the bf16-pair tiles' sums of x (128 + q), and 8 for the fp32 tiles' sums of x q.
template <int MT>
inline void add_group(const Int4Args& a, int64_t row0, int64_t g, int r, float offset, const __m512 (&dsum)[MT],
                      int64_t m0, int S, float* ys) {
  const uint16_t* sz = a.sz + (g * a.N + row0) * 2;
  const __m512i d = _mm512_loadu_si512(sz + 2 * r);  // 16 (scale, zero) bf16 pairs
  const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
  const __m512 zr = _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const __m512 c_sum = _mm512_fnmadd_ps(_mm512_set1_ps(offset), sc, zr);
  const int64_t ng = a.K / a.G;
  for (int m = 0; m < MT; ++m) {
    float* yp = ys + (m0 + m) * S + r;
    __m512 y = _mm512_loadu_ps(yp);
    y = _mm512_fmadd_ps(sc, dsum[m], y);
    y = _mm512_fmadd_ps(c_sum, _mm512_set1_ps(a.xs[(m0 + m) * ng + g]), y);
    _mm512_storeu_ps(yp, y);
  }
}

// One group, row vectors v0 .. v0+NV-1, activation rows m0 .. m0+MT-1: dot products, then scale and zero.
template <int S, int MT, int NV, int U>
void tile(const Int4Args& a, int64_t row0, int64_t g, int v0, int64_t m0, const __m512i* idx, float* ys) {
  const int64_t K = a.K, G = a.G;
  __m512 acc[MT][NV][2];
  group_dot<S, MT, NV, U>(a.qw + row0 * (K / 2) + g * G * (S / 2), a.x + m0 * K + g * G, K, G, idx + v0, acc);
  const uint16_t* sz = a.sz + (g * a.N + row0) * 2;
  if (v0 == 0 && m0 == 0) prefetch_next_scales(sz, S);
  for (int v = 0; v < NV; ++v)
    for (int h = 0; h < 2; ++h) {
      __m512 dsum[MT];
      for (int m = 0; m < MT; ++m) dsum[m] = acc[m][v][h];
      add_group<MT>(a, row0, g, h * (S / 2) + 16 * (v0 + v), 136.f, dsum, m0, S, ys);
    }
}

// Tiling: about 8+ independent accumulator chains and at most 16 accumulator registers. Activation rows go in tiles
// of 1..4 rows (all row vectors at once) or 5..8 rows (one row vector per pass): tile_rows(M - m0) rows at m0.
inline int64_t tile_rows(int64_t rest) { return rest >= 8 ? 8 : rest; }

// One group g of the block for the activation rows m0 .. m0+mt-1 (mt = tile_rows(M - m0)).
template <int S>
void group_tile(const Int4Args& a, int64_t row0, int64_t g, int64_t m0, int64_t mt, const __m512i* idx, float* ys) {
  constexpr int NV = S / 32;
  if (mt >= 5) {
    for (int v = 0; v < NV; ++v) {
      switch (mt) {
        case 5: tile<S, 5, 1, 1>(a, row0, g, v, m0, idx, ys); break;
        case 6: tile<S, 6, 1, 1>(a, row0, g, v, m0, idx, ys); break;
        case 7: tile<S, 7, 1, 1>(a, row0, g, v, m0, idx, ys); break;
        default: tile<S, 8, 1, 1>(a, row0, g, v, m0, idx, ys); break;
      }
    }
    return;
  }
  switch (mt) {
    case 1: tile<S, 1, NV, 8 / (2 * NV)>(a, row0, g, 0, m0, idx, ys); break;
    case 2: tile<S, 2, NV, (NV == 1 ? 2 : 1)>(a, row0, g, 0, m0, idx, ys); break;
    case 3: tile<S, 3, NV, 1>(a, row0, g, 0, m0, idx, ys); break;
    default: tile<S, 4, NV, 1>(a, row0, g, 0, m0, idx, ys); break;
  }
}

// Row tiles outside, groups inside: a tile's activations (mt rows x K) and its fp32 sums (mt x S) stay in L1/L2 while
// the block's weights (S/2 bytes per k, L2-resident after the first tile) are decoded again per tile. Groups inside
// a tile still run in order, so every y element sees the same operations in the same order for any M split.
template <int S>
void block_halves(const Int4Args& a, int64_t row0, float* ys) {
  const int64_t M = a.M, ng = a.K / a.G;
  __m512i idx[S / 32];
  for (int v = 0; v < S / 32; ++v) idx[v] = pair_index(S / 2, v);
  for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
    mt = tile_rows(M - m0);
    for (int64_t g = 0; g < ng; ++g) group_tile<S>(a, row0, g, m0, mt, idx, ys);
  }
}

// fp32 prefill (M > 8 when picked: int4mm.h, Int4Args::f32_prefill). 16 bytes of one k hold rows 16 hv + l (low
// nibble) and S/2 + 16 hv + l (high nibble), l = 0..15: vpmovzxbd widens them to 16 dwords, and / shift pick the
// nibbles, vcvtdq2ps makes q exact in fp32, and each activation row adds x[m, k] * q with one fp32 FMA per 16 rows.
// Per group, with D = sum x q (products exact: 8 x 4 significant bits):
//     sum_k x w = scale * (D - 8 xs) + zero * xs = scale D + (zero - 8 scale) xs.
// Example: byte 0x95 at k -> row 16 hv: q = 5, row S/2 + 16 hv: q = 9; x[m, k] = 0.5 adds 2.5 and 4.5 to D.
// Per k: 5 ops of weight decode for 2 * MT FMAs (24 at MT = 12: 24 of 32 vector registers hold sums). Where an fp32
// FMA issues at twice the rate of vdpbf16ps's pair product (Intel cores: both FMA ports vs one), this is ~2x the
// bf16-pair tile's multiply rate at prefill sizes; where vdpbf16ps is full rate (AMD Zen 4: 116 GMAC/s a core) the
// bf16 pairs should win: the op picks by measuring both once (int4mm_ops.cpp, prefill_choice).
template <int S, int MT>
void f32_group(const Int4Args& a, int64_t row0, int64_t g, int hv, int64_t m0, float* ys) {
  const int64_t K = a.K, G = a.G;
  const uint8_t* wg = a.qw + row0 * (K / 2) + g * G * (S / 2) + 16 * hv;
  const float* xg = a.xf + m0 * K + g * G;
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const __m512i m0f = _mm512_set1_epi32(15);
#pragma GCC unroll 2
  for (int64_t k = 0; k < G; ++k) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + k * (S / 2))));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, m0f));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_set1_ps(xg[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(xv, lo, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, hi, acc[m][1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    __m512 dsum[MT];
    for (int m = 0; m < MT; ++m) dsum[m] = acc[m][h];
    add_group<MT>(a, row0, g, h * (S / 2) + 16 * hv, 8.f, dsum, m0, S, ys);
  }
}

constexpr int kF32Tile = 12;

// Groups outside, the two 16-byte halves of a k's bytes (S = 64) inside: both halves read the same weight lines and
// the same G x MT activations, so the second comes from L1. Each output's groups still run in order.
template <int S, int MT>
void f32_rows(const Int4Args& a, int64_t row0, int64_t m0, float* ys) {
  for (int64_t g = 0; g < a.K / a.G; ++g)
    for (int hv = 0; hv < S / 32; ++hv) f32_group<S, MT>(a, row0, g, hv, m0, ys);
}

// Row tiles of 12 (the last one 1..12 rows); each row's sums do not depend on the tile it is in.
template <int S>
void block_f32(const Int4Args& a, int64_t row0, float* ys) {
  const int64_t M = a.M;
  for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
    mt = M - m0 >= kF32Tile ? kF32Tile : M - m0;
    switch (mt) {
      case 1: f32_rows<S, 1>(a, row0, m0, ys); break;
      case 2: f32_rows<S, 2>(a, row0, m0, ys); break;
      case 3: f32_rows<S, 3>(a, row0, m0, ys); break;
      case 4: f32_rows<S, 4>(a, row0, m0, ys); break;
      case 5: f32_rows<S, 5>(a, row0, m0, ys); break;
      case 6: f32_rows<S, 6>(a, row0, m0, ys); break;
      case 7: f32_rows<S, 7>(a, row0, m0, ys); break;
      case 8: f32_rows<S, 8>(a, row0, m0, ys); break;
      case 9: f32_rows<S, 9>(a, row0, m0, ys); break;
      case 10: f32_rows<S, 10>(a, row0, m0, ys); break;
      case 11: f32_rows<S, 11>(a, row0, m0, ys); break;
      default: f32_rows<S, 12>(a, row0, m0, ys); break;
    }
  }
}

}  // namespace

// Either tile kind sums into the zeroed fp32 scratch ys [M][s]; the block's rows are then rounded to bf16 once.
bool block_avx512(const Int4Args& a, int64_t row0, int s, int mode, float* ys) {
  if (mode != kHalves || (s != 64 && s != 32)) return false;
  const int64_t M = a.M;
  for (int64_t i = 0; i < M * s; i += 16) _mm512_storeu_ps(ys + i, _mm512_setzero_ps());
  if (a.f32_prefill)
    s == 64 ? block_f32<64>(a, row0, ys) : block_f32<32>(a, row0, ys);
  else
    s == 64 ? block_halves<64>(a, row0, ys) : block_halves<32>(a, row0, ys);
  for (int64_t m = 0; m < M; ++m)
    for (int i = 0; i < s; i += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(ys + m * s + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y + m * a.N + row0 + i), (__m256i)h);
    }
  return true;
}

}  // namespace edgeq

#pragma GCC pop_options
