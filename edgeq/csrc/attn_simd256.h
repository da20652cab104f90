// The 8-lane helpers shared by the avx2 attention units (decode and prefill): widen8, exp8 (attn_decode.h's
// exp_nonpositive on 8 fp32 lanes), hsum8 and the values tile (o += p V for up to 6 heads x 16 values in registers).
// Include it *after* the unit's `#pragma GCC target` (AVX2 intrinsics) and after attn_decode.h (prefetch_rows);
// anonymous namespace: each unit has its own copy compiled for its own target.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace edgeq_attn {
namespace {

// 8 bf16 values at p widened to fp32 (a bf16 is the high half of its fp32).
inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                                                   reinterpret_cast<const __m128i*>(p))), 16));
}

// exp_nonpositive (attn_decode.h) on 8 lanes, the same steps with fused multiply-adds.
inline __m256 exp8(__m256 x) {
  const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// o[h * os + 8 pc + i] += sum_t p[h * ps + t] * v[t * D + 8 pc + i] for h < NH, pc < NP, t < n (in order of t).
// Meanwhile the first npf rows of pf (the next chunk's keys) are prefetched into L2, one per key.
template <int NH, int NP>
void values_tile(const float* p, int64_t ps, const uint16_t* v, int64_t n, int64_t D, float* o, int64_t os,
                 const uint16_t* pf, int64_t npf) {
  __m256 acc[NH][NP];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) acc[h][c] = _mm256_loadu_ps(o + h * os + 8 * c);
  for (int64_t t = 0; t < n; ++t) {
    if (t < npf) prefetch_rows(pf + t * D, D * 2, false);
    __m256 vv[NP];
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) vv[c] = widen8(v + t * D + 8 * c);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m256 pb = _mm256_broadcast_ss(p + h * ps + t);
#pragma GCC unroll 8
      for (int c = 0; c < NP; ++c) acc[h][c] = _mm256_fmadd_ps(pb, vv[c], acc[h][c]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) _mm256_storeu_ps(o + h * os + 8 * c, acc[h][c]);
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t, const uint16_t*,
                       int64_t);
#define EDGEQ_TILES(h) &values_tile<h, 1>, &values_tile<h, 2>
const TileFn kTiles[6][2] = {{EDGEQ_TILES(1)}, {EDGEQ_TILES(2)}, {EDGEQ_TILES(3)},
                             {EDGEQ_TILES(4)}, {EDGEQ_TILES(5)}, {EDGEQ_TILES(6)}};
#undef EDGEQ_TILES

}  // namespace
}  // namespace edgeq_attn
