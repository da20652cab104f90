// AVX512-VNNI path of the W4A8 kernel.
//
// One 64-byte group of a slot is 4 inputs x 32 rows: `v & 0x0F` is 16 dwords (lanes = rows 0-7, 16-23), each dword
// the 4 consecutive-k int4 values of its row, exactly the signed operand vpdpbusd wants; `(v >> 4) & 0x0F` the same
// for rows 8-15, 24-31. The zero point (one per row and block, replicated to the 4 bytes of the dword) is subtracted
// in int8 (q - z in -15..15), the activation dword (4 bytes of q_a + 128, unsigned) is broadcast, and
//     acc += (q_a + 128) . (q - z)        (vpdpbusd: 4 u8 x s8 products summed into an int32 lane, no saturation)
// After a K block: acc - 128 * comp = sum q_a (q - z), exact (|acc| < 255 * 15 * 128 < 2^23), so the int32 -> fp32
// conversion is exact too. Then t = fp32(acc) * s_a (_mm512_mul_ps, one rounding) and C = _mm512_fmadd_ps(t, s_w, C):
// the same two roundings as the portable path's `acc.to(fp32).mul_(s_a)` and the checked-FMA `c.addcmul_(t, s_w)`.
//
// Loops. Decode (M <= 8): per column block, per K block, the slot's bytes are loaded and unpacked once per tile of
// up to 4 activation rows (rows 5-8 re-read the slot from L1), so DRAM is read once. Prefill (M > 8): the column
// block's K x 32 weights are unpacked once into scratch (K*32 bytes, L2) as q - z and reused by every tile of 8 rows.
#include <immintrin.h>

#include <cstring>

#include "w4a8mm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

#include "w4a8mm_avx512.h"

namespace edgeq_w4a8 {
namespace {

// The K block epilogue for MT rows: acc -> C (lane order) with the kernel's rounding.
template <int MT>
inline void epilogue(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, int64_t m0, __m512i (&acc)[MT][2],
                     float* C) {
  __m512i clo, chi;
  comp128(a, slot, clo, chi);
  __m512 slo, shi;
  load_lanes_ps(a.scales + (nb * a.kblocks() + kb) * kBlockN, slo, shi);
  for (int m = 0; m < MT; ++m) accumulate_row(acc[m][0], acc[m][1], clo, chi, a.sa[m0 + m], slo, shi, C + m * 32);
}

// acc += a (u8) . b (s8) per dword lane: vpdpbusd in place. The intrinsic's result is a new value, and gcc 12 copied
// every accumulator into a scratch register and back around each vpdpbusd of the tiles below (48 register moves
// for 8 vpdpbusd in the 4-row decode tile, two spills a step in the 8-row prefill tile); an asm with the accumulator
// as an in-out operand keeps each sum in one register. The same instruction, so the same bits.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

inline int32_t dword(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Decode tile: MT rows x one slot, weights unpacked from the packed bytes.
template <int MT>
inline void tile_packed(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, __m512i zlo, __m512i zhi,
                        int64_t m0, float* C) {
  __m512i acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* x = a.au8 + m0 * a.K + kb * a.bk;
  for (int64_t kg = 0; kg < a.bk / 4; ++kg) {
    _mm_prefetch(reinterpret_cast<const char*>(slot + kg * 64 + kPrefetch), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(slot + kg * 64);
    const __m512i wlo = _mm512_sub_epi8(_mm512_and_si512(v, low4), zlo);
    const __m512i whi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), zhi);
    for (int m = 0; m < MT; ++m) {
      const __m512i xa = _mm512_set1_epi32(dword(x + m * a.K + kg * 4));
      acc[m][0] = dpbusd(acc[m][0], xa, wlo);
      acc[m][1] = dpbusd(acc[m][1], xa, whi);
    }
  }
  epilogue<MT>(a, nb, kb, slot, m0, acc, C);
}

// Prefill tile: MT rows x one K block, weights from the unpacked scratch w (per kg: 64 bytes lo, 64 bytes hi).
template <int MT>
inline void tile_unpacked(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, const int8_t* w, int64_t m0,
                          float* C) {
  __m512i acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  const uint8_t* x = a.au8 + m0 * a.K + kb * a.bk;
  for (int64_t kg = 0; kg < a.bk / 4; ++kg) {
    const __m512i wlo = _mm512_load_si512(w + kg * 128);
    const __m512i whi = _mm512_load_si512(w + kg * 128 + 64);
    for (int m = 0; m < MT; ++m) {
      const __m512i xa = _mm512_set1_epi32(dword(x + m * a.K + kg * 4));
      acc[m][0] = dpbusd(acc[m][0], xa, wlo);
      acc[m][1] = dpbusd(acc[m][1], xa, whi);
    }
  }
  epilogue<MT>(a, nb, kb, slot, m0, acc, C);
}

template <int MT>
void decode_rows(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, __m512i zlo, __m512i zhi, int64_t m0,
                 int rows, float* C) {
  switch (rows) {
    case 1: return tile_packed<1>(a, nb, kb, slot, zlo, zhi, m0, C);
    case 2: return tile_packed<2>(a, nb, kb, slot, zlo, zhi, m0, C);
    case 3: return tile_packed<3>(a, nb, kb, slot, zlo, zhi, m0, C);
    default: return tile_packed<4>(a, nb, kb, slot, zlo, zhi, m0, C);
  }
}

template <int MT>
inline void prefill_dispatch(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, const int8_t* w, int64_t m0,
                             int rows, float* C) {
  if constexpr (MT == 0) {
    (void)a, (void)nb, (void)kb, (void)slot, (void)w, (void)m0, (void)rows, (void)C;
  } else {
    if (rows == MT) return tile_unpacked<MT>(a, nb, kb, slot, w, m0, C);
    return prefill_dispatch<MT - 1>(a, nb, kb, slot, w, m0, rows, C);
  }
}

constexpr int kDecodeRows = 4;   // accumulators: 2 per row in registers
constexpr int kPrefillRows = 8;  // 16 accumulators + 2 weights + broadcasts fit the 32 zmm registers

}  // namespace

void quantize_rows_vnni(const uint16_t* xb, const float* xf32, int64_t K, int64_t m0, int64_t m1, uint8_t* au8,
                        float* sa) {
  // K % 32 == 0 (checked by the binding). Exact steps as the portable path: |x| and max are exact, 127/amax one
  // division, x*inv one rounded multiply, round to nearest even by the explicit rounding mode.
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  auto load16 = [&](int64_t m, int64_t k) -> __m512 {
    if (xf32) return _mm512_loadu_ps(xf32 + m * K + k);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + m * K + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  for (int64_t m = m0; m < m1; ++m) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_and_ps(load16(m, k), absmask));
    float amax = _mm512_reduce_max_ps(mx);
    amax = amax > kActEps ? amax : kActEps;
    const float inv = 127.f / amax;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i off = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(load16(m, k), vinv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(au8 + m * K + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, off)));
    }
    sa[m] = amax / 127.f;
  }
}

void block_vnni(const Args& a, int64_t nb, uint8_t* scratch) {
  const int64_t M = a.M, KB = a.kblocks(), slot_bytes = a.slot_bytes();
  const uint8_t* slots = a.qw + nb * KB * slot_bytes;
  const int8_t* zeros = a.zeros + nb * KB * kBlockN;
  if (M <= kDecodeMaxRows) {
    float* C = reinterpret_cast<float*>(scratch);  // M rows x 32 fp32 (decode_scratch_bytes)
    init_c(a, nb, C, static_cast<int>(M));
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* slot = slots + kb * slot_bytes;
      __m512i zlo, zhi;
      zero_bytes(zeros + kb * kBlockN, zlo, zhi);
      for (int64_t m0 = 0; m0 < M; m0 += kDecodeRows) {
        const int rows = static_cast<int>(M - m0 < kDecodeRows ? M - m0 : kDecodeRows);
        decode_rows<kDecodeRows>(a, nb, kb, slot, zlo, zhi, m0, rows, C + m0 * 32);
      }
    }
    store_c(a, nb, C, 0, static_cast<int>(M));
    return;
  }
  // Prefill: unpack the column block once (q - z, lo/hi per kg), then tiles of 8 rows over all K blocks.
  int8_t* w = reinterpret_cast<int8_t*>(scratch);                           // K * 32 bytes
  float* C = reinterpret_cast<float*>(scratch + ((a.K * 32 + 63) & ~63));  // 8 rows x 32 fp32
  unpack_column_block(a, nb, w);
  for (int64_t m0 = 0; m0 < M; m0 += kPrefillRows) {
    const int rows = static_cast<int>(M - m0 < kPrefillRows ? M - m0 : kPrefillRows);
    init_c(a, nb, C, rows);
    for (int64_t kb = 0; kb < KB; ++kb)
      prefill_dispatch<kPrefillRows>(a, nb, kb, slots + kb * slot_bytes, w + kb * a.bk * 32, m0, rows, C);
    store_c(a, nb, C, m0, rows);
  }
}

}  // namespace edgeq_w4a8

#pragma GCC pop_options
