// Decode attention, avx2 unit (AVX2 + FMA), head sizes D that are a multiple of 8 (others run the scalar task).
//
// Scores, two keys at a time: each 8 values of a key row are widened once to fp32 (bf16 -> fp32 is a 16-bit shift)
// and FMA'd into the sums of every query head of a tile of <= 6 (queries widened once per task): acc[key][head]
// holds 8 lanes over D, 12 sums in registers for 2 keys x 6 heads; reduce8 then adds the 8 lanes of 8 sums at once
// (the same lane order for every sum). The keys were first widened into an fp32 block of 8 rows and re-read for
// each head (9 loads per 8 FMAs and a store per 8 values): 1.3x slower for the Qwen2.5-1.5B shape (docs/kernel.md,
// "Decode attention, blocked"); the bits are the same (the same products, sums and reduction order).
// Softmax per head: vector max, exp_nonpositive's steps on 8 lanes, the sum in 8 lanes.
// Values: the output o[g, D] is tiled into up to 6 heads x 2 pieces of 8 fp32 lanes (<= 12 ymm accumulators held
// for the whole chunk); per key, each V piece is widened once and fma'd into every head of the tile with that head's
// broadcast probability. Every (head, d) adds its keys in order. Prefetching (attn_decode.h's prefetch_rows): keys
// 32 ahead into L1, a key pair's values with its scores into L2, the next chunk's keys during the values pass.
#include <immintrin.h>

#include <cstring>

#include "attn_decode.h"

#pragma GCC push_options
// gcc 12's intrinsic headers initialise their "undefined" vectors from themselves (`__Y = __Y`), which
// -Wmaybe-uninitialized reports at every use; the values are overwritten, nothing here is read uninitialised.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx2,fma")

#include "attn_simd256.h"  // after the target pragma: AVX2 code

namespace edgeq_attn {
namespace {

// lane i of the result = the sum of the 8 lanes of a[i], in a fixed order.
inline __m256 reduce8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // [a0..a3 | a0..a3]
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));  // halves of a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// Scores of NK (1 or 2) keys at t for NH (<= 6) heads h0..: acc[key][head] (8 lanes over D) += q_h[8 d] * k[8 d],
// each 8 values of a key row widened once and used for all NH heads (12 sums, 2 key pieces and one query piece
// in registers); then the sums are reduced 8 at a time by reduce8 (the same lane order for every sum) and scaled.
template <int NH, int NK>
inline void score_keys(const uint16_t* k, int64_t D, const float* qf, int64_t h0, __m256 vscale, float* s, int64_t ss,
                       int64_t t) {
  __m256 acc[NK][NH];
#pragma GCC unroll 6
  for (int j = 0; j < NK; ++j)
#pragma GCC unroll 6
    for (int h = 0; h < NH; ++h) acc[j][h] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 kv[NK];
#pragma GCC unroll 2
    for (int j = 0; j < NK; ++j) kv[j] = widen8(k + j * D + d);
#pragma GCC unroll 6
    for (int h = 0; h < NH; ++h) {
      const __m256 qv = _mm256_loadu_ps(qf + (h0 + h) * D + d);
#pragma GCC unroll 2
      for (int j = 0; j < NK; ++j) acc[j][h] = _mm256_fmadd_ps(qv, kv[j], acc[j][h]);
    }
  }
  __m256 all[16];
  int n = 0;
#pragma GCC unroll 6
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 2
    for (int j = 0; j < NK; ++j) all[n++] = acc[j][h];
  for (int i = n; i < 16; ++i) all[i] = _mm256_setzero_ps();
  alignas(32) float r[16];
  _mm256_store_ps(r, _mm256_mul_ps(reduce8(all), vscale));
  if (n > 8) _mm256_store_ps(r + 8, _mm256_mul_ps(reduce8(all + 8), vscale));
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < NK; ++j) s[(h0 + h) * ss + t + j] = r[h * NK + j];
}

// All n keys of a task for the heads h0 .. h0 + NH - 1, two at a time; keys are prefetched PF ahead into L1 and a
// pair's values into L2 (in the first head tile only: pf).
template <int NH>
void score_tile(const uint16_t* k, const uint16_t* v, int64_t n, int64_t D, const float* qf, int64_t h0, float scale,
                float* s, int64_t ss, bool pf) {
  constexpr int64_t PF = 32;  // keys prefetched ahead
  const __m256 vscale = _mm256_set1_ps(scale);
  if (pf) prefetch_rows(k, (n < PF ? n : PF) * D * 2, true);
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    if (pf && t + PF < n) prefetch_rows(k + (t + PF) * D, (n - t - PF < 2 ? 1 : 2) * D * 2, true);
    if (pf) prefetch_rows(v + t * D, 2 * D * 2, false);
    score_keys<NH, 2>(k + t * D, D, qf, h0, vscale, s, ss, t);
  }
  if (t < n) score_keys<NH, 1>(k + t * D, D, qf, h0, vscale, s, ss, t);
}

using ScoreFn = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, const float*, int64_t, float, float*,
                         int64_t, bool);
const ScoreFn kScores[6] = {&score_tile<1>, &score_tile<2>, &score_tile<3>, &score_tile<4>, &score_tile<5>,
                            &score_tile<6>};

// s[g * ss + t] = scale * (q_g . k_t) for the task's keys, the heads in tiles of <= 6 (7 -> 4 + 3); qf: the
// group's queries in fp32.
void scores(const TaskView& tv, int64_t D, float scale, const float* qf, float* s, int64_t ss) {
  const int64_t ntiles = head_tile_count(tv.group);
  for (int64_t ti = 0, h0 = 0; ti < ntiles; ++ti) {
    const int64_t nh = head_tile_size(tv.group, ntiles, ti);
    kScores[nh - 1](tv.k, tv.v, tv.n, D, qf, h0, scale, s, ss, ti == 0);
    h0 += nh;
  }
}

// s[0, n) -> exp(s - m) in place; returns (m, l = sum of the exps).
inline void softmax_row(float* s, int64_t n, float* m_out, float* l_out) {
  const int64_t n8 = n / 8 * 8;
  float m = s[0];
  if (n8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (int64_t t = 8; t < n8; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    alignas(32) float r[8];
    _mm256_store_ps(r, mv);
    for (int i = 0; i < 8; ++i) m = r[i] > m ? r[i] : m;
  }
  for (int64_t t = n8; t < n; ++t) m = s[t] > m ? s[t] : m;
  __m256 lv = _mm256_setzero_ps();
  for (int64_t t = 0; t < n8; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m)));
    _mm256_storeu_ps(s + t, e);
    lv = _mm256_add_ps(lv, e);
  }
  float l = hsum8(lv);
  for (int64_t t = n8; t < n; ++t) {
    s[t] = exp_nonpositive(s[t] - m);
    l += s[t];
  }
  *m_out = m;
  *l_out = l;
}


}  // namespace

}  // namespace edgeq_attn

#include "attn_decode_tail.h"  // after the target pragma and the unit's softmax_row: AVX2 code

namespace edgeq_attn {

void task_avx2(const AttnArgs& a, int64_t task, float* scratch) {
  const int64_t D = a.D;
  if (D % 8 != 0) return task_scalar(a, task, scratch);
  const TaskView tv = task_view(a, task);
  const int64_t group = tv.group, n = tv.n, ss = a.chunk, os = 2 + D;
  float* s = scratch;            // [group, chunk]: scores, then probabilities
  float* qf = s + group * ss;    // [group, D]: the queries in fp32
  for (int64_t i = 0; i < group * D; i += 8) _mm256_storeu_ps(qf + i, widen8(tv.q + i));
  scores(tv, D, a.scale, qf, s, ss);
  softmax_heads(tv, D, s, ss, [](float* row, int64_t len, float* m, float* l) { softmax_row(row, len, m, l); });
  // D in tiles of 2 pieces of 8 lanes (one when 8 is left).
  head_tiles(a, tv, [&](int64_t h0, int64_t nh, int64_t& npf) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const int64_t np = D - d0 >= 16 ? 2 : 1;
      kTiles[nh - 1][np - 1](s + h0 * ss, ss, tv.v + d0, n, D, tv.part + h0 * os + 2 + d0, os, tv.k + n * D, npf);
      npf = 0;
    }
  });
}

}  // namespace edgeq_attn

#pragma GCC diagnostic pop
#pragma GCC pop_options
