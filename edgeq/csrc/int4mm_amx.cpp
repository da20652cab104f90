// AMX path (AMX-TILE + AMX-BF16 on top of the AVX512 path's set): full "halves" blocks of 32 or 64 rows.
//
// The weights are decoded as int4mm_avx512.cpp decoded them before it moved to 128 + q (vpermb, shift, ternlog -> bf16
// pairs 1 + q/16 for rows j at k and k+1: the smaller offset; AMX decodes once for up to 16 rows, so the shift it
// would save is not worth the precision), but instead of one vdpbf16ps per activation row the 16 decoded k-pairs of a 16-row vector are
// stored as one 1 KB B tile (VNNI layout: tile row = k pair, 16 dword columns = 16 output rows) and multiplied by
// the A tile = up to 16 activation rows x 32 k, read straight from x, with one tdpbf16ps into an fp32 C tile. The
// decode is done once per weight byte for up to 16 activation rows, so M = 1..16 cost about the same.
// Per group the C tiles are stored and scaled exactly as in the AVX512 path:
//     sum_k x w = 16 scale D + (zero - 24 scale) xs,   D = sum x (1 + q/16).
// Tiles: 0-3 C (one per 16-row vector v and nibble h), 4 A, 5-7 B. The tile configuration is loaded per block and
// released after it, so whatever else runs on the thread (oneDNN also uses AMX) finds the tiles as it expects.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_os.h"
#include "int4mm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,amx-tile,amx-bf16")

#include "int4mm_pairs.h"  // after the target pragma: AVX512 code

namespace edgeq {
namespace {

// One k pair (r: its bytes, load_pair) of the block's 16-row vector v (idx[v]): the bf16 pairs (1 + q/16) of the low
// (h = 0) and high (h = 1) nibbles.
inline void nibble_pairs(const __m512i r, const __m512i idx, __m512i (&dh)[2]) {
  const __m512i m78 = _mm512_set1_epi32(0x00780078), one = _mm512_set1_epi32(0x3F803F80);
  const __m512i d = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, idx, r);
  dh[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi32(d, 3), m78, one, 0xEA);
  dh[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(d, 1), m78, one, 0xEA);
}

// Decode 32 k (16 pairs) of the block into B tiles bt[v][h]: 16 rows of 16 (w_k, w_k+1) bf16 pairs each, the
// pairs (1 + q/16) as they are, or as `pairs(v, h, d)` turns them (the folded path below: into weights).
template <int S, class Pairs>
inline void decode_32k(const uint8_t* w, const __m512i* idx, uint16_t (*bt)[2][16 * 32], Pairs pairs) {
  for (int p = 0; p < 16; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(w + p * S + kPrefetchBytes), _MM_HINT_T0);
    const __m512i r = load_pair<S>(w + p * S);
    for (int v = 0; v < S / 32; ++v) {
      __m512i dh[2];
      nibble_pairs(r, idx[v], dh);
      for (int h = 0; h < 2; ++h) _mm512_store_si512(bt[v][h] + p * 32, pairs(v, h, dh[h]));
    }
  }
}

template <int S>
inline void decode_32k(const uint8_t* w, const __m512i* idx, uint16_t (*bt)[2][16 * 32]) {
  decode_32k<S>(w, idx, bt, [](int, int, __m512i d) { return d; });
}

// Tiles 0-3: C (v, h); 4: A; 5-7: B. One 32-k step: A = 16 (or fewer) rows of x, B = the decoded pairs b[v][h].
template <int NV>
inline void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NV == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

template <int NV>
inline void tile_step(const uint16_t* x, int64_t ldx, const uint16_t (*b)[2][16 * 32]) {
  _tile_loadd(4, x, ldx * 2);
  _tile_loadd(5, b[0][0], 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, b[0][1], 64);
  _tile_dpbf16ps(1, 4, 6);
  if constexpr (NV == 2) {
    _tile_loadd(7, b[1][0], 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b[1][1], 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

template <int NV>
inline void store_c(float (*cbuf)[2][16 * 16]) {
  _tile_stored(0, cbuf[0][0], 64);
  _tile_stored(1, cbuf[0][1], 64);
  if constexpr (NV == 2) {
    _tile_stored(2, cbuf[1][0], 64);
    _tile_stored(3, cbuf[1][1], 64);
  }
}

// Per group, the scale and zero of the 16 rows of C tile (v, h): y += c_dot * D + c_sum * xs (see the top).
template <int S>
inline void group_coeffs(const Int4Args& a, int64_t row0, int64_t g, int v, int h, __m512* c_dot, __m512* c_sum) {
  const __m512i d = _mm512_loadu_si512(a.sz + (g * a.N + row0) * 2 + 2 * (h * (S / 2) + 16 * v));
  const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
  const __m512 zr = _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  *c_dot = _mm512_mul_ps(sc, _mm512_set1_ps(16.f));
  *c_sum = _mm512_fnmadd_ps(_mm512_set1_ps(24.f), sc, zr);
}

// fp32 rows ys [M][S] -> bf16 y[:, row0 .. row0 + S).
template <int S>
inline void store_bf16(const Int4Args& a, int64_t row0, const float* ys) {
  for (int64_t m = 0; m < a.M; ++m)
    for (int i = 0; i < S; i += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(ys + m * S + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y + m * a.N + row0 + i), (__m256i)h);
    }
}

template <int S>
void block_halves(const Int4Args& a, int64_t row0, float* ys) {
  constexpr int NV = S / 32;
  const int64_t M = a.M, K = a.K, G = a.G, ng = K / G;
  const uint8_t* w = a.qw + row0 * (K / 2);
  __m512i idx[NV];
  for (int v = 0; v < NV; ++v) idx[v] = pair_index(S / 2, v);
  alignas(64) uint16_t bt[2][NV][2][16 * 32];  // double-buffered: decode the next 32 k while tiles read the last
  alignas(64) float cbuf[NV][2][16 * 16];
  for (int64_t i = 0; i < M * S; i += 16) _mm512_storeu_ps(ys + i, _mm512_setzero_ps());

  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int mt = static_cast<int>(M - m0 < 16 ? M - m0 : 16);
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = static_cast<uint8_t>(mt), cfg.colsb[t] = 64;  // C: mt x 16 fp32
    cfg.rows[4] = static_cast<uint8_t>(mt), cfg.colsb[4] = 64;                             // A: mt x 32 bf16
    for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;                      // B: 16 pairs x 16
    load_tile_config(cfg);
    const uint16_t* x = a.x + m0 * K;
    for (int64_t g = 0; g < ng; ++g) {
      zero_c<NV>();
      for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += 32) {
        auto& b = bt[(k0 / 32) & 1];
        decode_32k<S>(w + k0 * (S / 2), idx, b);
        tile_step<NV>(x + k0, K, b);
      }
      store_c<NV>(cbuf);
      const uint16_t* sz = a.sz + (g * a.N + row0) * 2;
      prefetch_next_scales(sz, S);
      for (int v = 0; v < NV; ++v)
        for (int h = 0; h < 2; ++h) {
          const int r = h * (S / 2) + 16 * v;
          __m512 c_dot, c_sum;
          group_coeffs<S>(a, row0, g, v, h, &c_dot, &c_sum);
          for (int m = 0; m < mt; ++m) {
            float* yp = ys + (m0 + m) * S + r;
            __m512 y = _mm512_loadu_ps(yp);
            y = _mm512_fmadd_ps(c_dot, _mm512_load_ps(cbuf[v][h] + m * 16), y);
            y = _mm512_fmadd_ps(c_sum, _mm512_set1_ps(a.xs[(m0 + m) * ng + g]), y);
            _mm512_storeu_ps(yp, y);
          }
        }
    }
    _tile_release();
  }
  store_bf16<S>(a, row0, ys);
}

// M > 16 (prefill): the scales folded into the weights. Each 32-k step of a panel of the block is decoded once into B
// tiles of bf16 w = 16 s (1 + q/16) + (z - 24 s) = (q - 8) s + z, computed in fp32 and rounded once to bf16 (as the
// dequantise path rounds its weights), and every 16-row chunk of x runs the panel's steps into its C tiles, which
// reach ys once per panel. The per-group C store and scaling of the exact path above cost more than the multiplies
// at prefill sizes (at G = 32: 4 tile products, then 4 stores and 64 fp32 updates of ys), so its throughput fell
// with the group size; here it does not depend on it. Precision: each weight is rounded to bf16 (relative 2^-9),
// so |y - ref| <= 2^-8 |ref| + 2^-9 sum_k |x w| (tests/test_native.py). Rows of x are independent (tile rows),
// so a row's result does not depend on M. x must be readable for ceil(M / 16) * 16 rows (the caller pads it).
constexpr int64_t kPanelSteps = 64;  // 2048 k a panel: 256 KB of B tiles at S = 64 (L2), a chunk's C kept that long

// The pairs (1 + q/16) of C tile (v, h)'s 16 rows -> fp32 -> (q - 8) s + z (c_dot, c_sum: group_coeffs) -> bf16 pairs.
template <int S>
inline void decode_32k_folded(const uint8_t* w, const __m512i* idx, const __m512 (*c_dot)[2],
                              const __m512 (*c_sum)[2], uint16_t (*bt)[2][16 * 32]) {
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  // cvtne2ps_pbh(hi, lo) puts lo's 16 values in words 0-15 and hi's in 16-31; a k pair is (lo_j, hi_j) in dword j
  alignas(64) static const uint16_t kPairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kPairs);
  decode_32k<S>(w, idx, bt, [&](int v, int h, __m512i d) {
    const __m512 lo = _mm512_fmadd_ps(c_dot[v][h], _mm512_castsi512_ps(_mm512_slli_epi32(d, 16)), c_sum[v][h]);
    const __m512 hi = _mm512_fmadd_ps(c_dot[v][h], _mm512_castsi512_ps(_mm512_and_si512(d, hi_mask)), c_sum[v][h]);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  });
}

// A thread's buffer of B tiles for one panel (kPanelSteps x NV x 2 tiles of 1 KB), 64-byte aligned.
inline uint16_t* panel_buffer(int64_t n) {
  static thread_local std::vector<uint16_t> store;
  if (static_cast<int64_t>(store.size()) < n + 32) store.resize(n + 32);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t{63});
}

template <int S>
void block_folded_large_m(const Int4Args& a, int64_t row0, float* ys) {
  constexpr int NV = S / 32;
  using Step = uint16_t[NV][2][16 * 32];
  const int64_t M = a.M, K = a.K, G = a.G;
  const uint8_t* w = a.qw + row0 * (K / 2);
  __m512i idx[NV];
  for (int v = 0; v < NV; ++v) idx[v] = pair_index(S / 2, v);
  auto* bt = reinterpret_cast<Step*>(panel_buffer(kPanelSteps * NV * 2 * 16 * 32));
  alignas(64) float cbuf[NV][2][16 * 16];
  for (int64_t i = 0; i < M * S; i += 16) _mm512_storeu_ps(ys + i, _mm512_setzero_ps());
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // C 16 x 16 fp32, A 16 x 32 bf16, B 16 pairs x 16
  load_tile_config(cfg);
  __m512 c_dot[NV][2], c_sum[NV][2];
  for (int64_t k0 = 0; k0 < K; k0 += 32 * kPanelSteps) {
    const int64_t steps = (K - k0 < 32 * kPanelSteps ? K - k0 : 32 * kPanelSteps) / 32;
    for (int64_t st = 0; st < steps; ++st) {
      const int64_t k = k0 + 32 * st;
      if (k % G == 0)
        for (int v = 0; v < NV; ++v)
          for (int h = 0; h < 2; ++h) group_coeffs<S>(a, row0, k / G, v, h, &c_dot[v][h], &c_sum[v][h]);
      decode_32k_folded<S>(w + k * (S / 2), idx, c_dot, c_sum, bt[st]);
    }
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int mt = static_cast<int>(M - m0 < 16 ? M - m0 : 16);
      const uint16_t* x = a.x + m0 * K + k0;
      zero_c<NV>();
      for (int64_t st = 0; st < steps; ++st) tile_step<NV>(x + 32 * st, K, bt[st]);
      store_c<NV>(cbuf);
      for (int m = 0; m < mt; ++m) {
        float* yrow = ys + (m0 + m) * S;
        for (int v = 0; v < NV; ++v)
          for (int h = 0; h < 2; ++h) {
            float* yp = yrow + h * (S / 2) + 16 * v;
            _mm512_storeu_ps(yp, _mm512_add_ps(_mm512_loadu_ps(yp), _mm512_load_ps(cbuf[v][h] + m * 16)));
          }
      }
    }
  }
  _tile_release();
  store_bf16<S>(a, row0, ys);
}

}  // namespace

bool block_amx(const Int4Args& a, int64_t row0, int s, int mode, float* ys) {
  if (mode != kHalves) return false;
  if (a.M > 16) {
    if (s == 64) return block_folded_large_m<64>(a, row0, ys), true;
    if (s == 32) return block_folded_large_m<32>(a, row0, ys), true;
    return false;
  }
  if (s == 64) return block_halves<64>(a, row0, ys), true;
  if (s == 32) return block_halves<32>(a, row0, ys), true;
  return false;
}

}  // namespace edgeq

#pragma GCC pop_options

namespace edgeq {

bool amx_usable() { return amx_granted(22); }  // AMX-TILE + AMX-BF16

}  // namespace edgeq
