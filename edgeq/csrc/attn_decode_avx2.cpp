// Decode attention, avx2 unit (AVX2 + FMA), head sizes D that are a multiple of 8 (others run the scalar task).
//
// Scores, per block of 8 keys: the block's rows are widened once to fp32 (bf16 -> fp32 is a 16-bit shift; a tail
// block is padded with zero rows), then for each query head g (queries widened once per task) acc[i] (i = key of
// the block, 8 ymm) += q_g[8 d] * k_i[8 d] over D; reduce8 adds the 8 lanes of all 8 accumulators at once and leaves
// key i's score in lane i. Softmax per head: vector max, exp_nonpositive's steps on 8 lanes, the sum in 8 lanes.
// Values: the output o[g, D] is tiled into up to 6 heads x 2 pieces of 8 fp32 lanes (<= 12 ymm accumulators held
// for the whole chunk); per key, each V piece is widened once and fma'd into every head of the tile with that head's
// broadcast probability. Every (head, d) adds its keys in order. Prefetching as in the avx512 unit
// (attn_decode.h's prefetch_rows): keys 4 blocks ahead, a block's values with its scores, the next chunk's keys.
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

constexpr int BK = 8;  // keys per score block

// lane i of the result = the sum of the 8 lanes of a[i], in a fixed order.
inline __m256 reduce8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // [a0..a3 | a0..a3]
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));  // halves of a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// s[g * ss + t] = scale * (q_g . k_t) for the task's keys; qf: the group's queries in fp32, kf: [8, D] fp32 scratch.
void scores(const TaskView& tv, int64_t D, float scale, const float* qf, float* kf, float* s, int64_t ss) {
  const __m256 vscale = _mm256_set1_ps(scale);
  constexpr int64_t PF = 4 * BK;  // keys prefetched ahead
  prefetch_rows(tv.k, (tv.n < PF ? tv.n : PF) * D * 2, true);
  for (int64_t b = 0; b < tv.n; b += BK) {
    const int64_t nk = tv.n - b < BK ? tv.n - b : BK, ahead = b + PF;
    if (ahead < tv.n) prefetch_rows(tv.k + ahead * D, (tv.n - ahead < BK ? tv.n - ahead : BK) * D * 2, true);
    prefetch_rows(tv.v + b * D, nk * D * 2, false);
    for (int64_t i = 0; i < nk; ++i)
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(kf + i * D + d, widen8(tv.k + (b + i) * D + d));
    if (nk < BK) std::memset(kf + nk * D, 0, (BK - nk) * D * sizeof(float));
    for (int64_t g = 0; g < tv.group; ++g) {
      const float* qg = qf + g * D;
      __m256 acc[BK];
      for (int i = 0; i < BK; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
#pragma GCC unroll 8
        for (int i = 0; i < BK; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + i * D + d), acc[i]);
      }
      alignas(32) float r[BK];
      _mm256_store_ps(r, _mm256_mul_ps(reduce8(acc), vscale));
      for (int64_t i = 0; i < nk; ++i) s[g * ss + b + i] = r[i];
    }
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
  float* kf = qf + group * D;    // [8, D]: one key block in fp32
  for (int64_t i = 0; i < group * D; i += 8) _mm256_storeu_ps(qf + i, widen8(tv.q + i));
  scores(tv, D, a.scale, qf, kf, s, ss);
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
