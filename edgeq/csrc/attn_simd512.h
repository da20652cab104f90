// The 16-lane helpers shared by the avx512 attention units (decode and prefill): exp16 (attn_decode.h's
// exp_nonpositive on 16 fp32 lanes) and the values tile (o += p V for up to 6 heads x 64 values in registers). Include
// it *after* the unit's `#pragma GCC target` (AVX512 intrinsics) and after attn_decode.h (prefetch_rows); anonymous
// namespace: each unit has its own copy compiled for its own target.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace edgeq_attn {
namespace {

// exp_nonpositive (attn_decode.h) on 16 lanes, the same steps with fused multiply-adds.
inline __m512 exp16(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(bits));
}

// o[h * os + 16 pc + i] += sum_t p[h * ps + t] * v[t * D + 16 pc + i] for h < NH, pc < NP, t < n (in order of t);
// the last piece is masked by `last` (i < 16 lanes of it are real). Meanwhile the first npf rows of pf (the next
// chunk's keys) are prefetched into L2, one per key.
template <int NH, int NP>
void values_tile(const float* p, int64_t ps, const uint16_t* v, int64_t n, int64_t D, float* o, int64_t os,
                 __mmask16 last, const uint16_t* pf, int64_t npf) {
  __m512 acc[NH][NP];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) acc[h][c] = _mm512_maskz_loadu_ps(c == NP - 1 ? last : 0xFFFF, o + h * os + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    if (t < npf) prefetch_rows(pf + t * D, D * 2, false);
    __m512 vv[NP];
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) {
      const __m256i raw = _mm256_maskz_loadu_epi16(c == NP - 1 ? last : 0xFFFF, v + t * D + 16 * c);
      vv[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m512 pb = _mm512_set1_ps(p[h * ps + t]);
#pragma GCC unroll 8
      for (int c = 0; c < NP; ++c) acc[h][c] = _mm512_fmadd_ps(pb, vv[c], acc[h][c]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) _mm512_mask_storeu_ps(o + h * os + 16 * c, c == NP - 1 ? last : 0xFFFF, acc[h][c]);
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t, __mmask16,
                       const uint16_t*, int64_t);
#define EDGEQ_TILES(h) &values_tile<h, 1>, &values_tile<h, 2>, &values_tile<h, 3>, &values_tile<h, 4>
const TileFn kTiles[6][4] = {{EDGEQ_TILES(1)}, {EDGEQ_TILES(2)}, {EDGEQ_TILES(3)},
                             {EDGEQ_TILES(4)}, {EDGEQ_TILES(5)}, {EDGEQ_TILES(6)}};
#undef EDGEQ_TILES

}  // namespace
}  // namespace edgeq_attn
