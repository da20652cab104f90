// exp8, widen8, hsum8: the 8-lane helpers shared by the avx2 attention units (decode and prefill). Include it *after*
// the unit's `#pragma GCC target` (AVX2 intrinsics); anonymous namespace: each unit has its own copy compiled for its
// own target.
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

}  // namespace
}  // namespace edgeq_attn
