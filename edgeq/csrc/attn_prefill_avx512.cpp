// Prefill attention, avx512 unit (F/BW/VL/BF16 + FMA): attn_prefill.h has the math; D a multiple of 16.
//
// A tile holds kPrefillRows = 12 rows (query head, position). Per step of kPrefillStep = 64 keys:
//   scores:  per 16 keys, s[r] (one zmm of 16 keys per row) += vdpbf16ps(keys' pairs (2d, 2d+1), the row's pair
//            broadcast) over d = 0 .. D/2 - 1: 12 independent accumulators, one key vector load per 12 products;
//            scaled and stored, keys past a row's position -inf;
//   softmax: per row, the step's running max and sum (exp16, attn_simd512.h);
//   values:  o[r, :] = o[r, :] * exp(m - m') + sum_t p[r, t] v_t: the rescale, then the decode attention's values
//            tiles (attn_simd512.h: 6 rows x 4 vectors of 16, 24 fp32 accumulators, each value row widened once).
// A step of 64 keys rather than 16 loads, rescales and stores each values tile a quarter as often: 1.2-1.6x the
// whole op (2026-12-02, Zen 5; docs/kernel.md "Prefill attention").
// A row's keys past its position contribute p = 0 (and alpha = 1 once the row has seen none of a step): the same
// sums as a tile that stops at the row's own last key, so the output does not depend on which rows share a tile.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "attn_decode.h"
#include "attn_prefill.h"

#pragma GCC push_options
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // gcc 12's intrinsic headers: see attn_decode_avx512.cpp
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")

#include "attn_simd512.h"  // after the target pragma: AVX512 code

namespace edgeq_attn {
namespace {

constexpr int R = kPrefillRows, RH = R / 2, STEP = kPrefillStep;

// o[r, :] *= alpha[r]: the online softmax's rescale of the rows whose max moved (alpha = 1: unchanged).
inline void rescale(float* o, const float* alpha, int64_t D) {
  for (int r = 0; r < R; ++r)
    if (alpha[r] != 1.f)
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), _mm512_set1_ps(alpha[r])));
}

// s[r] = the 16 keys' dot products with row r's query over D (pairs of bf16 per 32-bit lane).
inline void score_rows(const uint32_t* kb, const uint16_t* const* qrow, int64_t D, __m512* s) {
  for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + d2 * 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, qrow[r] + 2 * d2, 4);
      s[r] = _mm512_dpbf16_ps(s[r], kv, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
    }
  }
}

}  // namespace

void prefill_pack_keys_avx512(const PrefillArgs& a, int64_t j, int64_t T, void* kp) {
  const int64_t D = a.D, half = D / 2, nb = (T + 15) / 16;
  uint32_t* dst = static_cast<uint32_t*>(kp) + j * nb * half * 16;
  std::memset(dst, 0, nb * half * 16 * 4);
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = a.k + j * a.kv_stride + t * a.row_stride;
    uint32_t* blk = dst + (t / 16) * half * 16 + (t % 16);
    for (int64_t d2 = 0; d2 < half; ++d2) std::memcpy(blk + d2 * 16, row + 2 * d2, 4);
  }
}

void prefill_tile_avx512(const PrefillArgs& a, int64_t j, int64_t tile, float* scratch) {
  const TileRows rows = tile_rows(a, j, tile);
  const int64_t D = a.D, nr = rows.nr, T = a.p0 + a.S, nb_all = (T + 15) / 16;
  const uint16_t* const* qrow = rows.q;
  const int64_t* lim = rows.lim;
  float* o = scratch;          // [R, D]
  float* p = o + R * D;        // [R, STEP]
  float* alpha = p + R * STEP; // [R]
  float* l = alpha + R;        // [R]
  float m[R];
  std::memset(o, 0, R * D * 4);
  for (int r = 0; r < R; ++r) m[r] = -INFINITY, l[r] = 0.f;
  const int64_t kend = lim[R - 1], half = D / 2;
  const uint32_t* kp = static_cast<const uint32_t*>(a.kp) + j * nb_all * half * 16;
  const uint16_t* vj = a.v + j * a.kv_stride;
  const __m512 scale = _mm512_set1_ps(a.scale), ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t k0 = 0; k0 < kend; k0 += STEP) {
    const int64_t nk = kend - k0 < STEP ? kend - k0 : STEP, n16 = (nk + 15) / 16 * 16;
    for (int64_t c = 0; c < nk; c += 16) {  // scores of the step, scaled; keys past a row's position -inf
      __m512 s[R];
      score_rows(kp + (k0 + c) * half, qrow, D, s);
      for (int r = 0; r < R; ++r) {
        const int64_t valid = lim[r] - k0 - c;
        const __mmask16 keep = valid >= 16 ? 0xFFFF : valid <= 0 ? 0 : static_cast<__mmask16>((1u << valid) - 1);
        _mm512_storeu_ps(p + r * STEP + c, _mm512_mask_mul_ps(ninf, keep, s[r], scale));
      }
    }
    for (int r = 0; r < R; ++r) {
      float* pr = p + r * STEP;
      if (lim[r] <= k0) {  // none of the step's keys is visible to the row
        std::memset(pr, 0, n16 * 4);
        alpha[r] = 1.f;
        continue;
      }
      __m512 mv = ninf;
      for (int64_t c = 0; c < n16; c += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(pr + c));
      const float mn = std::fmax(m[r], _mm512_reduce_max_ps(mv));
      alpha[r] = exp_nonpositive(m[r] - mn);  // m = -inf (no key yet): 0, and o, l are 0
      __m512 lv = _mm512_setzero_ps();
      for (int64_t c = 0; c < n16; c += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(pr + c), _mm512_set1_ps(mn)));  // -inf -> 0
        _mm512_storeu_ps(pr + c, e);
        lv = _mm512_add_ps(lv, e);
      }
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(lv);
      m[r] = mn;
    }
    rescale(o, alpha, D);
    for (int h0 = 0; h0 < R; h0 += RH)  // the values tiles of attn_simd512.h (the decode attention's)
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t np = D - d0 >= 64 ? 4 : (D - d0) / 16;
        kTiles[RH - 1][np - 1](p + h0 * STEP, STEP, vj + k0 * a.row_stride + d0, nk, a.row_stride, o + h0 * D + d0, D,
                               0xFFFF, nullptr, 0);
      }
  }
  for (int r = 0; r < nr; ++r) {
    const __m512 lr = _mm512_set1_ps(l[r]);
    uint16_t* dst = a.out + (rows.pos[r] * a.H + rows.head[r]) * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_div_ps(_mm512_loadu_ps(o + r * D + d), lr));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)h);
    }
  }
}

}  // namespace edgeq_attn

#pragma GCC diagnostic pop
#pragma GCC pop_options
