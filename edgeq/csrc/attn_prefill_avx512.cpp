// Prefill attention, avx512 unit (F/BW/VL/BF16 + FMA): attn_prefill.h has the math; D a multiple of 16.
//
// A tile holds kPrefillRows = 12 rows (query head, position). Per block of 16 keys:
//   scores: s[r] (one zmm of 16 keys per row) += vdpbf16ps(keys' pairs (2d, 2d+1) of 16 keys, the row's pair
//           broadcast) over d = 0 .. D/2 - 1: 12 independent accumulators, one key vector load per 12 products;
//   softmax: per row, the scaled scores of its visible keys (later keys masked to -inf), the running max and sum;
//   values:  o[r, :] = o[r, :] * exp(m - m') + sum_t p[r, t] v_t in tiles of 6 rows x 4 vectors of 16 (24 fp32
//            accumulators), each value row widened from bf16 once per 6 rows.
// A row's keys past its position contribute p = 0 (and alpha = 1 once the row has seen none of a block): the same
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

#include "attn_exp16.h"  // after the target pragma: AVX512 code

namespace edgeq_attn {
namespace {

constexpr int R = kPrefillRows, RH = R / 2;

// o[h, 16c + i] = o[h, 16c + i] * alpha[h] + sum_{t < nk} p[h, t] v[t, 16c + i] for h < RH, c < NP; o's rows are
// D floats apart, v's rows vs values.
template <int NP>
void values_rows(const float* p, const float* alpha, const uint16_t* v, int64_t nk, int64_t vs, int64_t D, float* o) {
  __m512 acc[RH][NP];
#pragma GCC unroll 8
  for (int h = 0; h < RH; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) acc[h][c] = _mm512_mul_ps(_mm512_loadu_ps(o + h * D + 16 * c), _mm512_set1_ps(alpha[h]));
  for (int64_t t = 0; t < nk; ++t) {
    __m512 vv[NP];
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + t * vs + 16 * c));
      vv[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
#pragma GCC unroll 8
    for (int h = 0; h < RH; ++h) {
      const __m512 pb = _mm512_set1_ps(p[h * 16 + t]);
#pragma GCC unroll 8
      for (int c = 0; c < NP; ++c) acc[h][c] = _mm512_fmadd_ps(pb, vv[c], acc[h][c]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < RH; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) _mm512_storeu_ps(o + h * D + 16 * c, acc[h][c]);
}

using ValuesFn = void (*)(const float*, const float*, const uint16_t*, int64_t, int64_t, int64_t, float*);
const ValuesFn kValues[4] = {&values_rows<1>, &values_rows<2>, &values_rows<3>, &values_rows<4>};

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

void prefill_pack_keys_avx512(const PrefillArgs& a, int64_t j, int64_t T, uint32_t* kp) {
  const int64_t D = a.D, half = D / 2, nb = (T + 15) / 16;
  uint32_t* dst = kp + j * nb * half * 16;
  std::memset(dst, 0, nb * half * 16 * 4);
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = a.k + j * a.kv_stride + t * a.row_stride;
    uint32_t* blk = dst + (t / 16) * half * 16 + (t % 16);
    for (int64_t d2 = 0; d2 < half; ++d2) std::memcpy(blk + d2 * 16, row + 2 * d2, 4);
  }
}

void prefill_tile_avx512(const PrefillArgs& a, int64_t j, int64_t tile, float* scratch) {
  const int64_t G = a.H / a.KVH, D = a.D, rows = G * a.S, r0 = tile * R;
  const int64_t nr = rows - r0 < R ? rows - r0 : R, T = a.p0 + a.S, nb_all = (T + 15) / 16;
  const uint16_t* qrow[R];
  int64_t lim[R], pos[R], head[R];
  for (int r = 0; r < R; ++r) {  // rows past the group's last repeat its last row (computed, not written)
    const int64_t rr = r0 + (r < nr ? r : nr - 1);
    pos[r] = rr / G;
    head[r] = j * G + rr % G;
    qrow[r] = a.q + (head[r] * a.S + pos[r]) * D;
    lim[r] = a.p0 + pos[r] + 1;  // keys [0, lim) are visible
  }
  float* o = scratch;       // [R, D]
  float* p = o + R * D;     // [R, 16]
  float* alpha = p + R * 16;  // [R]
  float* l = alpha + R;     // [R]
  float m[R];
  std::memset(o, 0, R * D * 4);
  for (int r = 0; r < R; ++r) m[r] = -INFINITY, l[r] = 0.f;
  const int64_t kend = lim[R - 1], nb = (kend + 15) / 16, half = D / 2;
  const uint32_t* kp = a.kp + j * nb_all * half * 16;
  const uint16_t* vj = a.v + j * a.kv_stride;
  const __m512 scale = _mm512_set1_ps(a.scale), ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t b = 0; b < nb; ++b) {
    __m512 s[R];
    score_rows(kp + b * half * 16, qrow, D, s);
    for (int r = 0; r < R; ++r) {
      const int64_t valid = lim[r] - 16 * b;
      if (valid <= 0) {  // none of this block's keys is visible to the row
        _mm512_storeu_ps(p + r * 16, _mm512_setzero_ps());
        alpha[r] = 1.f;
        continue;
      }
      const __mmask16 keep = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
      const __m512 sv = _mm512_mask_mul_ps(ninf, keep, s[r], scale);
      const float mn = std::fmax(m[r], _mm512_reduce_max_ps(sv));
      alpha[r] = exp_nonpositive(m[r] - mn);  // m = -inf (no key yet): 0, and o, l are 0
      const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mn))));
      _mm512_storeu_ps(p + r * 16, e);
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(e);
      m[r] = mn;
    }
    const int64_t nk = kend - 16 * b < 16 ? kend - 16 * b : 16;
    for (int h0 = 0; h0 < R; h0 += RH)
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t np = D - d0 >= 64 ? 4 : (D - d0) / 16;
        kValues[np - 1](p + h0 * 16, alpha + h0, vj + 16 * b * a.row_stride + d0, nk, a.row_stride, D,
                        o + h0 * D + d0);
      }
  }
  for (int r = 0; r < nr; ++r) {
    const __m512 inv = _mm512_set1_ps(l[r]);
    uint16_t* dst = a.out + (pos[r] * a.H + head[r]) * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_div_ps(_mm512_loadu_ps(o + r * D + d), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)h);
    }
  }
}

}  // namespace edgeq_attn

#pragma GCC diagnostic pop
#pragma GCC pop_options
