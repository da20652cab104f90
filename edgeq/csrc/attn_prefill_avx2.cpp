// Prefill attention, avx2 unit (AVX2 + FMA): attn_prefill.h has the math; D a multiple of 16.
//
// The avx512 unit's tiles with 8-lane fp32 vectors: the keys are packed once per call as fp32, 8 keys a vector
// (K[t][d] for t = 8b .. 8b + 7), and a tile's 12 queries are widened to fp32 once. Per step of 64 keys:
//   scores: per 8 keys, s[r] += q[r, d] (broadcast) * keys' d-th values over d: 12 accumulators (14 of the 16 ymm
//           registers), stored;
//   softmax: as on avx512, over the step's 64 scores of each row (exp8, attn_simd256.h);
//   values:  o[r, :] = o[r, :] * exp(m - m') + sum_t p[r, t] v_t: the rescale, then the decode attention's values
//            tiles (attn_simd256.h: 6 rows x 2 vectors of 8, 12 accumulators).
// The step is 64 keys, not 8, because with 12 accumulators a values tile is loaded, rescaled and stored per step:
// per 8 keys that traffic made the path slower than SDPA at 2048 keys (0.9x; 64 keys: docs/kernel.md).
// fp32 products of bf16 values are exact, as vdpbf16ps's are; the sums run in another order than the avx512 unit's,
// so the two paths agree within the rounding bound, not bit for bit.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "attn_decode.h"
#include "attn_prefill.h"
#include "bf16.h"

#pragma GCC push_options
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // gcc 12's intrinsic headers: see attn_decode_avx512.cpp
#pragma GCC target("avx2,fma")

#include "attn_simd256.h"  // after the target pragma: AVX2 code

namespace edgeq_attn {
namespace {

constexpr int R = kPrefillRows, RH = R / 2, BK = 8, STEP = kPrefillStep;

inline float hmax8(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

// o[r, :] *= alpha[r]: the online softmax's rescale of the rows whose max moved (alpha = 1: unchanged).
inline void rescale(float* o, const float* alpha, int64_t D) {
  for (int r = 0; r < R; ++r)
    if (alpha[r] != 1.f)
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(o + r * D + d, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d), _mm256_set1_ps(alpha[r])));
}

// s[r] = the 8 keys' dot products with row r's fp32 query qf[r * D ..] over D.
inline void score_rows(const float* kb, const float* qf, int64_t D, __m256* s) {
  for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 kv = _mm256_loadu_ps(kb + d * BK);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) s[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + r * D + d), kv, s[r]);
  }
}

}  // namespace

void prefill_pack_keys_avx2(const PrefillArgs& a, int64_t j, int64_t T, void* kp) {
  const int64_t D = a.D, nb = (T + BK - 1) / BK;
  float* dst = static_cast<float*>(kp) + j * nb * D * BK;
  std::memset(dst, 0, nb * D * BK * 4);
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = a.k + j * a.kv_stride + t * a.row_stride;
    float* blk = dst + (t / BK) * D * BK + (t % BK);
    for (int64_t d = 0; d < D; ++d) blk[d * BK] = edgeq_bf16::bf16_to_f32(row[d]);
  }
}

void prefill_tile_avx2(const PrefillArgs& a, int64_t j, int64_t tile, float* scratch) {
  const TileRows rows = tile_rows(a, j, tile);
  const int64_t D = a.D, T = a.p0 + a.S, nb_all = (T + BK - 1) / BK;
  float* o = scratch;          // [R, D]
  float* p = o + R * D;        // [R, STEP]
  float* alpha = p + R * STEP; // [R]
  float* l = alpha + R;        // [R]
  float* qf = l + R;           // [R, D]
  float m[R];
  std::memset(o, 0, R * D * 4);
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY, l[r] = 0.f;
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(qf + r * D + d, widen8(rows.q[r] + d));
  }
  const int64_t kend = rows.lim[R - 1];
  const float* kp = static_cast<const float*>(a.kp) + j * nb_all * D * BK;
  const uint16_t* vj = a.v + j * a.kv_stride;
  const __m256 scale = _mm256_set1_ps(a.scale), ninf = _mm256_set1_ps(-INFINITY);
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t k0 = 0; k0 < kend; k0 += STEP) {
    const int64_t nk = kend - k0 < STEP ? kend - k0 : STEP;
    for (int64_t c = 0; c < nk; c += BK) {  // scores of the step, scaled; keys past a row's position -inf
      __m256 s[R];
      score_rows(kp + (k0 + c) * D, qf, D, s);
      for (int r = 0; r < R; ++r) {
        const __m256 keep = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(rows.lim[r] - k0 - c)), _CMP_LT_OQ);
        _mm256_storeu_ps(p + r * STEP + c, _mm256_blendv_ps(ninf, _mm256_mul_ps(s[r], scale), keep));
      }
    }
    const int64_t n8 = (nk + BK - 1) / BK * BK;
    for (int r = 0; r < R; ++r) {
      float* pr = p + r * STEP;
      if (rows.lim[r] <= k0) {  // none of the step's keys is visible to the row
        std::memset(pr, 0, n8 * 4);
        alpha[r] = 1.f;
        continue;
      }
      __m256 mv = ninf;
      for (int64_t c = 0; c < n8; c += BK) mv = _mm256_max_ps(mv, _mm256_loadu_ps(pr + c));
      const float mn = std::fmax(m[r], hmax8(mv));
      alpha[r] = exp_nonpositive(m[r] - mn);  // m = -inf (no key yet): 0, and o, l are 0
      __m256 lv = _mm256_setzero_ps();
      for (int64_t c = 0; c < n8; c += BK) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pr + c), _mm256_set1_ps(mn)));  // -inf -> 0
        _mm256_storeu_ps(pr + c, e);
        lv = _mm256_add_ps(lv, e);
      }
      l[r] = l[r] * alpha[r] + hsum8(lv);
      m[r] = mn;
    }
    rescale(o, alpha, D);
    for (int h0 = 0; h0 < R; h0 += RH)  // the values tiles of attn_simd256.h (the decode attention's)
      for (int64_t d0 = 0; d0 < D; d0 += 16)
        kTiles[RH - 1][1](p + h0 * STEP, STEP, vj + k0 * a.row_stride + d0, nk, a.row_stride, o + h0 * D + d0, D,
                          nullptr, 0);
  }
  for (int r = 0; r < rows.nr; ++r) {
    uint16_t* dst = a.out + (rows.pos[r] * a.H + rows.head[r]) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = edgeq_bf16::f32_to_bf16(o[r * D + d] / l[r]);
  }
}

}  // namespace edgeq_attn

#pragma GCC diagnostic pop
#pragma GCC pop_options
