// AVX2 path of the W4A8 kernel (CPUs without AVX512-VNNI: most edge mini-PCs).
//
// A 64-byte group of a slot (4 inputs x 32 rows) splits into two 32-byte halves, and each half's nibbles are one
// row quarter in natural order: half 0 low = rows 0-7, half 0 high = rows 8-15, half 1 low = rows 16-23, half 1 high
// = rows 24-31 (byte 4j + ki of the group holds q[c(j), 4kg+ki], c(j) = j or j + 8; w4a8mm.h). So a quarter r
// (h = r / 2, nibble = r % 2) is 8 dwords, each the 4 consecutive-k int4 values of one row, and the output needs no
// lane shuffle. The zero point is subtracted in int8 (q - z in -15..15), the activation dword (q_a + 128, 4 u8) is
// broadcast, and
//     p16 = vpmaddubsw(x, q - z)   pairs: |255 * 15 * 2| = 7650, so no int16 saturation
//     s16 = p16(kg) + p16(kg+1) + p16(kg+2) + p16(kg+3)   |s16| <= 4 * 7650 = 30600 < 32767, still exact
//     acc += vpmaddwd(s16, 1)      the int32 sum of 16 products per lane
// which is the exact int32 (q_a + 128) . (q - z); bk / 4 is 8, 16 or 32 groups, a multiple of 4. After a K block
// acc - 128 * comp, fp32(acc) * s_a (one rounding) and one _mm256_fmadd_ps into C: the epilogue of every other path
// (compiled with -ffp-contract=off, so nothing else is fused).
//
// Loops. The 16 ymm registers hold one quarter of a row tile: for each slot and quarter, 4 groups' weights (4
// registers) are unpacked and reused by every row of the tile (one accumulator each). Decode (M <= 8): the slot
// (<= 2 KB, L1) is read from memory once and its halves re-read from L1 per quarter and per tile of 4 rows.
// Prefill (M > 8): the column block is unpacked once into scratch as q - z (per K block, per quarter, per group 32
// bytes) and reused by tiles of 8 rows.
//
// AVX-VNNI (`avxvnni` path, Alder Lake and later, incl. the N100-class mini-PCs): the same code with the four
// vpmaddubsw / vpaddw / vpmaddwd / vpaddd per row and 4 groups replaced by four vpdpbusd (VEX), same exact int32.
// The kernel body below is compiled twice, by including this file into itself under two `#pragma GCC target`s
// (avx2,fma and avx2,fma,avxvnni), each pass in its own namespace, so the avx2 pass can never contain an AVX-VNNI
// instruction and the two share one source.
#ifndef EDGEQ_W4A8_AVX2_PASS
#include <immintrin.h>

#include <cstring>

#include "w4a8mm.h"

#define EDGEQ_W4A8_AVX2_PASS 1
#define EDGEQ_W4A8_AVX2_NS maddubs
#define EDGEQ_W4A8_AVX2_BLOCK block_avx2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "w4a8mm_avx2.cpp"  // NOLINT(build/include): the body, pass 1
#pragma GCC pop_options
#undef EDGEQ_W4A8_AVX2_PASS
#undef EDGEQ_W4A8_AVX2_NS
#undef EDGEQ_W4A8_AVX2_BLOCK

#define EDGEQ_W4A8_AVX2_PASS 2
#define EDGEQ_W4A8_AVX2_NS dpbusd
#define EDGEQ_W4A8_AVX2_BLOCK block_avxvnni
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#include "w4a8mm_avx2.cpp"  // NOLINT(build/include): the body, pass 2
#pragma GCC pop_options

#else  // the body

namespace edgeq_w4a8 {
namespace {
namespace EDGEQ_W4A8_AVX2_NS {

constexpr int64_t kPrefetch = 8192;
constexpr int kDecodeRows = 4;
constexpr int kPrefillRows = 8;

inline int32_t dword(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// z of the 8 rows of quarter r, replicated to the 4 bytes of each dword.
inline __m256i zero_quarter(const int8_t* z, int r) {
  const __m256i z32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + 8 * r)));
  return _mm256_mullo_epi32(z32, _mm256_set1_epi32(0x01010101));
}

// q - z of quarter r of one group (32 bytes at half h of the group).
inline __m256i unpack_quarter(const uint8_t* group, int r, __m256i zq) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * (r >> 1)));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i nib = (r & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4) : _mm256_and_si256(v, low4);
  return _mm256_sub_epi8(nib, zq);
}

// fp32 C rows (natural order, [rows][32]) from the bias or zero.
inline void init_c(const Args& a, int64_t nb, float* C, int rows) {
  for (int r = 0; r < 4; ++r) {
    const __m256 b = a.bias ? _mm256_loadu_ps(a.bias + nb * kBlockN + 8 * r) : _mm256_setzero_ps();
    for (int m = 0; m < rows; ++m) _mm256_store_ps(C + m * 32 + 8 * r, b);
  }
}

// fp32 [8] -> bf16 bits in the low 16 of each dword, round to nearest even, NaN -> 0x7fc0 (no flush of subnormals).
inline __m256i to_bf16_dwords(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

inline void store_c(const Args& a, int64_t nb, const float* C, int64_t m0, int rows) {
  for (int m = 0; m < rows; ++m) {
    uint16_t* y = a.y + (m0 + m) * a.N + nb * kBlockN;
    for (int h = 0; h < 2; ++h) {
      // packus_epi32 interleaves 128-bit lanes; the permute restores order (values are <= 0xffff: no saturation).
      const __m256i p = _mm256_packus_epi32(to_bf16_dwords(_mm256_load_ps(C + m * 32 + 16 * h)),
                                            to_bf16_dwords(_mm256_load_ps(C + m * 32 + 16 * h + 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16 * h), _mm256_permute4x64_epi64(p, 0xD8));
    }
  }
}

// acc of MT rows for quarter r of slot (nb, kb) -> C[m][8r..8r+7].
template <int MT>
inline void epilogue(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, int r, int64_t m0,
                     const __m256i (&acc)[MT], float* C) {
  const int32_t* comp = reinterpret_cast<const int32_t*>(slot + a.bk * 16);
  const __m256i c128 = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp + 8 * r)), 7);
  const __m256 sw = _mm256_loadu_ps(a.scales + (nb * a.kblocks() + kb) * kBlockN + 8 * r);
  for (int m = 0; m < MT; ++m) {
    const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[m], c128)), _mm256_set1_ps(a.sa[m0 + m]));
    float* c = C + m * 32 + 8 * r;
    _mm256_store_ps(c, _mm256_fmadd_ps(t, sw, _mm256_load_ps(c)));
  }
}

// acc[m] += exact int32 dot of 4 groups (4 weight vectors w) with row m's activation dwords at x + m*K.
template <int MT>
inline void dot4(const __m256i (&w)[4], const uint8_t* x, int64_t K, __m256i (&acc)[MT]) {
#if EDGEQ_W4A8_AVX2_PASS == 2
  for (int m = 0; m < MT; ++m) {  // AVX-VNNI: 4 u8 x s8 products summed into each int32 lane, no saturation
    const uint8_t* xm = x + m * K;
    for (int i = 0; i < 4; ++i) acc[m] = _mm256_dpbusd_avx_epi32(acc[m], _mm256_set1_epi32(dword(xm + 4 * i)), w[i]);
  }
#else
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MT; ++m) {
    const uint8_t* xm = x + m * K;
    __m256i s = _mm256_maddubs_epi16(_mm256_set1_epi32(dword(xm)), w[0]);
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_set1_epi32(dword(xm + 4)), w[1]));
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_set1_epi32(dword(xm + 8)), w[2]));
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_set1_epi32(dword(xm + 12)), w[3]));
    acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(s, ones));
  }
#endif
}

// Decode tile: MT rows x one slot, weights unpacked from the packed bytes, quarter by quarter.
template <int MT>
inline void tile_packed(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, const int8_t* z, int64_t m0,
                        float* C) {
  const uint8_t* x = a.au8 + m0 * a.K + kb * a.bk;
  for (int r = 0; r < 4; ++r) {
    const __m256i zq = zero_quarter(z, r);
    __m256i acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t kg = 0; kg < a.bk / 4; kg += 4) {
      __m256i w[4];
      for (int i = 0; i < 4; ++i) {
        if (r == 0) _mm_prefetch(reinterpret_cast<const char*>(slot + (kg + i) * 64 + kPrefetch), _MM_HINT_T0);
        w[i] = unpack_quarter(slot + (kg + i) * 64, r, zq);
      }
      dot4<MT>(w, x + kg * 4, a.K, acc);
    }
    epilogue<MT>(a, nb, kb, slot, r, m0, acc, C);
  }
}

// Prefill tile: MT rows x one K block, weights from scratch wk (quarter r at wk + r*bk*8, 32 bytes per group).
template <int MT>
inline void tile_unpacked(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, const int8_t* wk, int64_t m0,
                          float* C) {
  const uint8_t* x = a.au8 + m0 * a.K + kb * a.bk;
  for (int r = 0; r < 4; ++r) {
    const int8_t* wq = wk + r * a.bk * 8;
    __m256i acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t kg = 0; kg < a.bk / 4; kg += 4) {
      __m256i w[4];
      for (int i = 0; i < 4; ++i) w[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + (kg + i) * 32));
      dot4<MT>(w, x + kg * 4, a.K, acc);
    }
    epilogue<MT>(a, nb, kb, slot, r, m0, acc, C);
  }
}

template <int MT>
inline void decode_dispatch(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, const int8_t* z, int64_t m0,
                            int rows, float* C) {
  if constexpr (MT == 0) {
    (void)a, (void)nb, (void)kb, (void)slot, (void)z, (void)m0, (void)rows, (void)C;
  } else {
    if (rows == MT) return tile_packed<MT>(a, nb, kb, slot, z, m0, C);
    return decode_dispatch<MT - 1>(a, nb, kb, slot, z, m0, rows, C);
  }
}

template <int MT>
inline void prefill_dispatch(const Args& a, int64_t nb, int64_t kb, const uint8_t* slot, const int8_t* wk,
                             int64_t m0, int rows, float* C) {
  if constexpr (MT == 0) {
    (void)a, (void)nb, (void)kb, (void)slot, (void)wk, (void)m0, (void)rows, (void)C;
  } else {
    if (rows == MT) return tile_unpacked<MT>(a, nb, kb, slot, wk, m0, C);
    return prefill_dispatch<MT - 1>(a, nb, kb, slot, wk, m0, rows, C);
  }
}

}  // namespace EDGEQ_W4A8_AVX2_NS
}  // namespace

#if EDGEQ_W4A8_AVX2_PASS == 1
void quantize_rows_avx2(const uint16_t* xb, const float* xf32, int64_t K, int64_t m0, int64_t m1, uint8_t* au8,
                        float* sa) {
  // K % 32 == 0 (checked by the binding). The same fp32 steps as the portable path (see quantize_rows_vnni).
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto load8 = [&](int64_t m, int64_t k) -> __m256 {
    if (xf32) return _mm256_loadu_ps(xf32 + m * K + k);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + m * K + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  const __m256i off = _mm256_set1_epi32(128);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = m0; m < m1; ++m) {
    __m256 mx = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8(m, k), absmask));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    float amax = 0.f;
    for (float v : lanes) amax = v > amax ? v : amax;
    amax = amax > kActEps ? amax : kActEps;
    const float inv = 127.f / amax;
    const __m256 vinv = _mm256_set1_ps(inv);
    auto q8 = [&](int64_t k) {  // round half to even by the explicit rounding mode, then + 128 (1..255)
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(load8(m, k), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm256_add_epi32(_mm256_cvttps_epi32(r), off);
    };
    for (int64_t k = 0; k < K; k += 32) {
      const __m256i ab = _mm256_packus_epi32(q8(k), q8(k + 8));
      const __m256i cd = _mm256_packus_epi32(q8(k + 16), q8(k + 24));
      // bytes per 128-bit lane: a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7 -> dword permute to k order
      const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(au8 + m * K + k), p);
    }
    sa[m] = amax / 127.f;
  }
}
#endif

void EDGEQ_W4A8_AVX2_BLOCK(const Args& a, int64_t nb, uint8_t* scratch) {
  using namespace EDGEQ_W4A8_AVX2_NS;
  const int64_t M = a.M, KB = a.kblocks(), slot_bytes = a.slot_bytes();
  const uint8_t* slots = a.qw + nb * KB * slot_bytes;
  const int8_t* zeros = a.zeros + nb * KB * kBlockN;
  if (M <= kDecodeMaxRows) {
    float* C = reinterpret_cast<float*>(scratch);  // M rows x 32 fp32 (kDecodeScratchBytes)
    init_c(a, nb, C, static_cast<int>(M));
    for (int64_t kb = 0; kb < KB; ++kb)
      for (int64_t m0 = 0; m0 < M; m0 += kDecodeRows) {
        const int rows = static_cast<int>(M - m0 < kDecodeRows ? M - m0 : kDecodeRows);
        decode_dispatch<kDecodeRows>(a, nb, kb, slots + kb * slot_bytes, zeros + kb * kBlockN, m0, rows,
                                     C + m0 * 32);
      }
    store_c(a, nb, C, 0, static_cast<int>(M));
    return;
  }
  // Prefill: unpack the column block once (q - z; per K block: quarter-major, 32 bytes per group).
  int8_t* w = reinterpret_cast<int8_t*>(scratch);                           // K * 32 bytes
  float* C = reinterpret_cast<float*>(scratch + ((a.K * 32 + 63) & ~63));  // 8 rows x 32 fp32
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* slot = slots + kb * slot_bytes;
    for (int r = 0; r < 4; ++r) {
      const __m256i zq = zero_quarter(zeros + kb * kBlockN, r);
      int8_t* wq = w + kb * a.bk * 32 + r * a.bk * 8;
      for (int64_t kg = 0; kg < a.bk / 4; ++kg)
        _mm256_store_si256(reinterpret_cast<__m256i*>(wq + kg * 32), unpack_quarter(slot + kg * 64, r, zq));
    }
  }
  for (int64_t m0 = 0; m0 < M; m0 += kPrefillRows) {
    const int rows = static_cast<int>(M - m0 < kPrefillRows ? M - m0 : kPrefillRows);
    init_c(a, nb, C, rows);
    for (int64_t kb = 0; kb < KB; ++kb)
      prefill_dispatch<kPrefillRows>(a, nb, kb, slots + kb * slot_bytes, w + kb * a.bk * 32, m0, rows, C);
    store_c(a, nb, C, m0, rows);
  }
}

}  // namespace edgeq_w4a8

#endif  // EDGEQ_W4A8_AVX2_PASS
