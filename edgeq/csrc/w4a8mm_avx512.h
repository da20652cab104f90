// AVX512 helpers shared by the vnni and amx translation units of the W4A8 kernel. Include it only after
// `#pragma GCC target(...avx512...)`: everything here is internal (anonymous namespace), one copy per unit.
#pragma once
#include <immintrin.h>

#include "w4a8mm.h"

namespace edgeq_w4a8 {
namespace {

constexpr int64_t kPrefetch = 8192;

// (rows 0-15, rows 16-31) -> (lo lanes, hi lanes); the same shuffle maps lane order back to row order.
inline void swap_order(__m512i r0, __m512i r1, __m512i& lo, __m512i& hi) {
  lo = _mm512_shuffle_i32x4(r0, r1, 0x44);
  hi = _mm512_shuffle_i32x4(r0, r1, 0xEE);
}

inline void load_lanes_ps(const float* p, __m512& lo, __m512& hi) {
  __m512i a, b;
  swap_order(_mm512_castps_si512(_mm512_loadu_ps(p)), _mm512_castps_si512(_mm512_loadu_ps(p + 16)), a, b);
  lo = _mm512_castsi512_ps(a);
  hi = _mm512_castsi512_ps(b);
}

// zero points of a block as the int8 bytes to subtract: each dword = z of its lane's row, in all 4 bytes.
inline void zero_bytes(const int8_t* z, __m512i& zlo, __m512i& zhi) {
  const __m512i r0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z)));
  const __m512i r1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + 16)));
  swap_order(r0, r1, zlo, zhi);
  const __m512i rep = _mm512_set1_epi32(0x01010101);
  zlo = _mm512_mullo_epi32(zlo, rep);
  zhi = _mm512_mullo_epi32(zhi, rep);
}

// fp32 [16] -> bf16 bits, round to nearest even (integer rule, as c10::BFloat16; no flush of subnormals).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

// C [rows][32] fp32 in lane order (lo 16 then hi 16), initialised from the bias.
inline void init_c(const Args& a, int64_t nb, float* C, int rows) {
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
  if (a.bias) load_lanes_ps(a.bias + nb * kBlockN, lo, hi);
  for (int m = 0; m < rows; ++m) {
    _mm512_store_ps(C + m * 32, lo);
    _mm512_store_ps(C + m * 32 + 16, hi);
  }
}

inline void store_c(const Args& a, int64_t nb, const float* C, int64_t m0, int rows) {
  for (int m = 0; m < rows; ++m) {
    __m512i r0, r1;
    swap_order(_mm512_castps_si512(_mm512_load_ps(C + m * 32)), _mm512_castps_si512(_mm512_load_ps(C + m * 32 + 16)),
               r0, r1);
    uint16_t* y = a.y + (m0 + m) * a.N + nb * kBlockN;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), to_bf16(_mm512_castsi512_ps(r0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16), to_bf16(_mm512_castsi512_ps(r1)));
  }
}

// The column block's weights as q - z int8, for every K block kb and input quad kg: 64 bytes of lo lanes then 64
// bytes of hi lanes at w + kb*bk*32 + kg*128 (so the lo rows of consecutive kg are a 128-byte-strided AMX B tile).
inline void unpack_column_block(const Args& a, int64_t nb, int8_t* w) {
  const int64_t KB = a.kblocks(), slot_bytes = a.slot_bytes();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* slot = a.qw + (nb * KB + kb) * slot_bytes;
    __m512i zlo, zhi;
    zero_bytes(a.zeros + (nb * KB + kb) * kBlockN, zlo, zhi);
    int8_t* wk = w + kb * a.bk * 32;
    for (int64_t kg = 0; kg < a.bk / 4; ++kg) {
      const __m512i v = _mm512_loadu_si512(slot + kg * 64);
      _mm512_store_si512(wk + kg * 128, _mm512_sub_epi8(_mm512_and_si512(v, low4), zlo));
      _mm512_store_si512(wk + kg * 128 + 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), zhi));
    }
  }
}

// acc (lane order, lo/hi) of one row and K block -> C row (lane order): C = fma(fp32(acc - 128 comp) * s_a, s_w, C).
inline void accumulate_row(__m512i acc_lo, __m512i acc_hi, __m512i comp128_lo, __m512i comp128_hi, float sa,
                           __m512 sw_lo, __m512 sw_hi, float* c) {
  const __m512 s = _mm512_set1_ps(sa);
  const __m512 tlo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc_lo, comp128_lo)), s);
  const __m512 thi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc_hi, comp128_hi)), s);
  _mm512_store_ps(c, _mm512_fmadd_ps(tlo, sw_lo, _mm512_load_ps(c)));
  _mm512_store_ps(c + 16, _mm512_fmadd_ps(thi, sw_hi, _mm512_load_ps(c + 16)));
}

// 128 * comp of a slot, in lane order.
inline void comp128(const Args& a, const uint8_t* slot, __m512i& lo, __m512i& hi) {
  const int32_t* comp = reinterpret_cast<const int32_t*>(slot + a.bk * 16);
  swap_order(_mm512_loadu_si512(comp), _mm512_loadu_si512(comp + 16), lo, hi);
  lo = _mm512_slli_epi32(lo, 7);
  hi = _mm512_slli_epi32(hi, 7);
}

}  // namespace
}  // namespace edgeq_w4a8
