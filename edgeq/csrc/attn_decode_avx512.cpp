// Decode attention, avx512 unit (F/BW/VL/BF16 + FMA, within the avx512 path's set: docs/kernel.md "ISA paths"), any
// head size D.
//
// Scores, per block of 16 keys (a tail block is copied into a zero-padded 16-row buffer first):
//   for each query head g of the group: acc[i] (i = key of the block, 16 zmm) += vdpbf16ps(q_g[32 d], k_i[32 d]) over
//   the 32-d pieces of D (the last one masked when 32 does not divide D). Each lane of acc[i] holds a partial sum of
//   key i's dot product; reduce16 adds the 16 lanes of all 16 accumulators at once and leaves key i's score in lane i
//   (45 shuffles and adds for 16 dot products, instead of a horizontal reduction per (key, head)).
//   vdpbf16ps multiplies bf16 by bf16 exactly and adds in fp32 (round to nearest even; like every vdpbf16ps it reads
//   bf16 denormals, |x| < 1.2e-38, as zero). The block's rows come from memory for the first head (prefetched two
//   blocks ahead: attn_decode.h's prefetch_rows) and from L1 (<= 8 KB) for the others.
// Softmax, per head: vector max (exact in any order), exp_nonpositive's steps on 16 lanes, the sum in 16 lanes.
// Values: the output o[g, D] is tiled into up to 6 heads x 4 pieces of 16 fp32 lanes (<= 24 zmm accumulators held
// for the whole chunk); per key, each V piece is loaded and widened once (bf16 -> fp32 is a 16-bit shift) and
// fma'd into every head of the tile with that head's broadcast probability. Every (head, d) adds its keys in order.
#include <immintrin.h>

#include <cstring>

#include "attn_decode.h"

#pragma GCC push_options
// gcc 12's intrinsic headers initialise their "undefined" vectors from themselves (`__Y = __Y`), which
// -Wmaybe-uninitialized reports at every use; the values are overwritten, nothing here is read uninitialised.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")

#include "attn_simd512.h"  // after the target pragma: AVX512 code

namespace edgeq_attn {
namespace {

constexpr int BK = 16;  // keys per score block

// lane i of the result = the sum of the 16 lanes of a[i], in a fixed order (pairs, then quads, then 128-bit blocks).
inline __m512 reduce16(const __m512* a) {
  __m512 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: [a2i, a2i+1, a2i, a2i+1] partial sums
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit block: [a4i, a4i+1, a4i+2, a4i+3] partial sums
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // blocks: [u2i (B0+B1), u2i (B2+B3), u2i+1 (B0+B1), u2i+1 (B2+B3)]
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

inline __m512bh bf16x32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh bf16x32(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// s[g * ss + i] = scale * (q_g . k_i) for the 16 keys of rows kb (stride D) and the group's heads. DC: D when it is
// a compile-time constant (the common head sizes: constant row offsets), else 0.
template <int DC>
void score_block(const uint16_t* q, const uint16_t* kb, int64_t Drt, int64_t group, float scale, float* s,
                 int64_t ss, __mmask16 keep) {
  const int64_t D = DC ? DC : Drt, full = D / 32;
  const __mmask32 rm = static_cast<__mmask32>((1ull << (D % 32)) - 1);
  for (int64_t g = 0; g < group; ++g) {
    const uint16_t* qg = q + g * D;
    __m512 acc[BK];
    for (int i = 0; i < BK; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < full; ++p) {
      const __m512bh qv = bf16x32(qg + 32 * p);
#pragma GCC unroll 16
      for (int i = 0; i < BK; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], qv, bf16x32(kb + i * D + 32 * p));
    }
    if (rm) {
      const __m512bh qv = bf16x32(qg + 32 * full, rm);
#pragma GCC unroll 16
      for (int i = 0; i < BK; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], qv, bf16x32(kb + i * D + 32 * full, rm));
    }
    _mm512_mask_storeu_ps(s + g * ss, keep, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
  }
}

constexpr int64_t PF_K = 2;  // key blocks prefetched ahead

template <int DC>
void scores(const TaskView& tv, int64_t D, float scale, float* s, int64_t ss, uint16_t* pad) {
  for (int64_t b = 0; b < PF_K * BK && b < tv.n; b += BK)
    prefetch_rows(tv.k + b * D, (tv.n - b < BK ? tv.n - b : BK) * D * 2, true);
  for (int64_t b = 0; b < tv.n; b += BK) {
    const int64_t nk = tv.n - b < BK ? tv.n - b : BK, ahead = b + PF_K * BK;
    if (ahead < tv.n) prefetch_rows(tv.k + ahead * D, (tv.n - ahead < BK ? tv.n - ahead : BK) * D * 2, true);
    prefetch_rows(tv.v + b * D, nk * D * 2, false);
    const uint16_t* kb = tv.k + b * D;
    if (nk < BK) {  // the tail: its rows then zeros (their scores are computed and not stored)
      std::memcpy(pad, kb, nk * D * 2);
      std::memset(pad + nk * D, 0, (BK - nk) * D * 2);
      kb = pad;
    }
    score_block<DC>(tv.q, kb, D, tv.group, scale, s + b, ss, static_cast<__mmask16>((1u << nk) - 1));
  }
}

// s[0, n) -> exp(s - m) in place; returns (m, l = sum of the exps).
inline void softmax_row(float* s, int64_t n, float* m_out, float* l_out) {
  __m512 mv = _mm512_set1_ps(-__builtin_inff());
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), k, s + t));
  }
  const float m = _mm512_reduce_max_ps(mv);
  __m512 lv = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), _mm512_set1_ps(m)));
    _mm512_mask_storeu_ps(s + t, k, e);
    lv = _mm512_mask_add_ps(lv, k, lv, e);
  }
  *m_out = m;
  *l_out = _mm512_reduce_add_ps(lv);
}


}  // namespace

}  // namespace edgeq_attn

#include "attn_decode_tail.h"  // after the target pragma and the unit's softmax_row: AVX512 code

namespace edgeq_attn {

void task_avx512(const AttnArgs& a, int64_t task, float* scratch) {
  const TaskView tv = task_view(a, task);
  const int64_t D = a.D, group = tv.group, n = tv.n, ss = a.chunk, os = 2 + D;
  float* s = scratch;                                            // [group, chunk]: scores, then probabilities
  uint16_t* pad = reinterpret_cast<uint16_t*>(s + group * ss);  // [16, D] bf16: a tail block of keys
  if (D == 128) scores<128>(tv, D, a.scale, s, ss, pad);
  else if (D == 64) scores<64>(tv, D, a.scale, s, ss, pad);
  else scores<0>(tv, D, a.scale, s, ss, pad);
  softmax_heads(tv, D, s, ss, [](float* row, int64_t len, float* m, float* l) { softmax_row(row, len, m, l); });
  // D in tiles of 4 pieces of 16 lanes (the last piece masked).
  head_tiles(a, tv, [&](int64_t h0, int64_t nh, int64_t& npf) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t left = D - d0, np = left >= 64 ? 4 : (left + 15) / 16, tail = left - 16 * (np - 1);
      const __mmask16 last = tail >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << tail) - 1);
      kTiles[nh - 1][np - 1](s + h0 * ss, ss, tv.v + d0, n, D, tv.part + h0 * os + 2 + d0, os, last, tv.k + n * D,
                             npf);
      npf = 0;
    }
  });
}

}  // namespace edgeq_attn

#pragma GCC diagnostic pop
#pragma GCC pop_options
