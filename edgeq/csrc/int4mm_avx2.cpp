// AVX2 path (AVX2 + FMA): full "halves" blocks of 32 or 64 rows, fp32 arithmetic.
//
// Byte j of a k holds row j (low nibble) and row j + S/2 (high nibble). Eight bytes are zero-extended to eight
// dwords b; b itself (lo + 16 hi) and b >> 4 (hi) are converted to fp32 and FMA'd with the broadcast fp32 x[k], so
// per group the sums are B = sum_k x b and H = sum_k x hi, and the low-nibble rows' sum is L = B - 16 H (no mask op:
// 12 vector ops per 16 bytes instead of 14; M = 1 1.07-1.08x in bench_kernel on Zen 3, decode 1.04-1.09x). Per group
// y += scale * L + (zero - 8 scale) * xs (H for the high-nibble rows). Example: b = 0x95, x = 0.5: B = 74.5, H = 4.5,
// L = 74.5 - 72 = 2.5 = 0.5 * 5. B carries up to 16x the magnitude of L, so its fp32 rounding error is larger
// (docs/kernel.md, "Arithmetic and precision": the share of outputs one bf16 ulp off aten's, measured).
// Loops: group -> 16-byte column strip u (32 rows) -> tile of up to 2 activation rows -> k.
#include <immintrin.h>

#include "int4mm.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace edgeq {
namespace {

constexpr int kMaxTile = 2;

// y[m][r .. r+7] += scale * D[m] + (zero - 8 scale) * xs[m, g] for the 8 rows r.. of this group's (scale, zero),
// D[m] = sum_k x[m, k] q[r.., k] over group g; sz: the block's (scale, zero) of group g. Both tile kinds end here.
// ng = K / G comes from the caller: computed here it was an idiv per call (seen in the disassembly).
template <int MT>
inline void epilogue(const Int4Args& a, const uint16_t* sz, int64_t g, int64_t ng, int r, int64_t m0, int S,
                     const __m256 (&dsum)[MT], float* ys) {
  const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 2 * r));
  const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
  const __m256 zr = _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const __m256 c_sum = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sc, zr);
#pragma GCC unroll 6
  for (int m = 0; m < MT; ++m) {
    float* yp = ys + (m0 + m) * S + r;
    __m256 y = _mm256_loadu_ps(yp);
    y = _mm256_fmadd_ps(sc, dsum[m], y);
    y = _mm256_fmadd_ps(c_sum, _mm256_set1_ps(a.xs[(m0 + m) * ng + g]), y);
    _mm256_storeu_ps(yp, y);
  }
}

// The low-nibble rows' sum from the whole byte's: sum x lo = sum x b - 16 sum x hi (b = lo + 16 hi, exact in fp32).
inline __m256 lo_from_byte(__m256 byte_sum, __m256 hi_sum) {
  return _mm256_fnmadd_ps(_mm256_set1_ps(16.f), hi_sum, byte_sum);
}

// acc[m][i]: i = 0, 1 -> rows 16u + 8i + l (low nibbles); i = 2, 3 -> rows S/2 + 16u + 8(i-2) + l (high nibbles).
// U partial sums per accumulator (consecutive k alternate) so that one activation row still has 8 FMA chains.
template <int S, int MT, int U>
void tile(const Int4Args& a, int64_t row0, int64_t g, int u, int64_t m0, float* ys) {
  const int64_t K = a.K, G = a.G, ng = K / G;
  const uint8_t* wg = a.qw + row0 * (K / 2) + g * G * (S / 2) + 16 * u;
  const float* x = a.xf + m0 * K + g * G;
  __m256 part[U][MT][4];
#pragma GCC unroll 4
  for (int v = 0; v < U; ++v)
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < 4; ++i) part[v][m][i] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < G; k0 += U) {
#pragma GCC unroll 4
    for (int v = 0; v < U; ++v) {
      const int64_t k = k0 + v;
      const uint8_t* p = wg + k * (S / 2);
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
      const __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      const __m256i d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
      const __m256 w0 = _mm256_cvtepi32_ps(d0);  // the whole byte b = lo + 16 hi (see the file's comment)
      const __m256 w1 = _mm256_cvtepi32_ps(d1);
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(d0, 4));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(d1, 4));
      for (int m = 0; m < MT; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
        part[v][m][0] = _mm256_fmadd_ps(w0, xb, part[v][m][0]);
        part[v][m][1] = _mm256_fmadd_ps(w1, xb, part[v][m][1]);
        part[v][m][2] = _mm256_fmadd_ps(w2, xb, part[v][m][2]);
        part[v][m][3] = _mm256_fmadd_ps(w3, xb, part[v][m][3]);
      }
    }
  }
  __m256 acc[MT][4];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
    for (int i = 0; i < 4; ++i) {
      acc[m][i] = part[0][m][i];
      for (int v = 1; v < U; ++v) acc[m][i] = _mm256_add_ps(acc[m][i], part[v][m][i]);
    }
  const uint16_t* sz = a.sz + (g * a.N + row0) * 2;
  if (u == 0 && m0 == 0) prefetch_next_scales(sz, S);
  // Unrolled (as every loop over the sums here): with a runtime index GCC keeps the sums' home on the stack and
  // stores all of them in every k iteration (measured: 8 dead 32-byte stores per two k in the loop above).
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    __m256 d[MT];  // low-nibble rows: sum x b - 16 sum x hi
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) d[m] = i < 2 ? lo_from_byte(acc[m][i], acc[m][i + 2]) : acc[m][i];
    epilogue<MT>(a, sz, g, ng, (i / 2) * (S / 2) + 16 * u + 8 * (i % 2), m0, S, d, ys);
  }
}

// Prefill tiles (M >= kWideMin). Per group, the block's S x G nibbles are decoded once into fp32 (wq, <= 64 KB:
// the 8 bytes of chunk c at k hold rows 8c + l, low nibble, and S/2 + 8c + l, high nibble, l = 0..7; one vpmovzxbd,
// a shift and two conversions give the whole bytes b and the high nibbles, stored as wq[c][k][16]; the low rows'
// sums are taken as B - 16 H, as in the 2-row tiles); then every tile of up to
// kWideTile activation rows multiplies them: per k and chunk, 2 weight loads and MT broadcasts for 2 MT FMAs (12 at
// MT = 6: 12 sum registers, 2 weight vectors and a broadcast fill the 16 ymm registers). The activations come k-major
// per tile (Int4Args::xt), so a tile's MT values of one k are adjacent (read in place, its rows are K floats apart,
// which for K a multiple of 1024 puts them all in one L1 set). Each sum is one fp32 chain over the group's k in order,
// exactly as in the 2-row tiles above, so every output is bit-identical to theirs (tested); only the time differs.
// Example: byte 0x95 at k, chunk 0 -> b = 149, hi = 9 (row S/2); x[m, k] = 0.5 adds 74.5 and 4.5 to the sums, and
// row 0 gets 74.5 - 16 * 4.5 = 2.5 = 0.5 * 5.

// One chunk c (rows 8c.. and S/2 + 8c..) of group g for activation rows m0 .. m0 + MT - 1.
template <int S, int MT>
void wide_chunk(const Int4Args& a, int64_t row0, int64_t g, int64_t ng, int c, int64_t m0, const float* wq,
                float* ys) {
  const int64_t K = a.K, G = a.G;
  const float* xt = a.xt + m0 * K + g * G * MT;
  __m256 lo_acc[MT], hi_acc[MT];
#pragma GCC unroll 6
  for (int m = 0; m < MT; ++m) lo_acc[m] = hi_acc[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < G; ++k) {
    const __m256 lo = _mm256_load_ps(wq + k * 16), hi = _mm256_load_ps(wq + k * 16 + 8);
#pragma GCC unroll 6
    for (int m = 0; m < MT; ++m) {
      const __m256 xb = _mm256_broadcast_ss(xt + k * MT + m);
      lo_acc[m] = _mm256_fmadd_ps(lo, xb, lo_acc[m]);
      hi_acc[m] = _mm256_fmadd_ps(hi, xb, hi_acc[m]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MT; ++m) lo_acc[m] = lo_from_byte(lo_acc[m], hi_acc[m]);
  const uint16_t* sz = a.sz + (g * a.N + row0) * 2;
  epilogue<MT>(a, sz, g, ng, 8 * c, m0, S, lo_acc, ys);
  epilogue<MT>(a, sz, g, ng, S / 2 + 8 * c, m0, S, hi_acc, ys);
}

template <int S, int MT>
void wide_tile(const Int4Args& a, int64_t row0, int64_t g, int64_t ng, int64_t m0, const float* wq, float* ys) {
  for (int c = 0; c < S / 16; ++c) wide_chunk<S, MT>(a, row0, g, ng, c, m0, wq + c * a.G * 16, ys);
}

template <int S>
void block_wide(const Int4Args& a, int64_t row0, float* ys) {
  const int64_t K = a.K, G = a.G, ng = K / G;
  alignas(32) float wq[64 * 256];  // S x G <= 64 x 256
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = a.qw + row0 * (K / 2) + g * G * (S / 2);
    for (int64_t k = 0; k < G; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + k * (S / 2) + kPrefetchBytes), _MM_HINT_T0);
      for (int c = 0; c < S / 16; ++c) {
        const __m256i d =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wg + k * (S / 2) + 8 * c)));
        _mm256_store_ps(wq + (c * G + k) * 16, _mm256_cvtepi32_ps(d));  // b = lo + 16 hi, as in the 2-row tiles
        _mm256_store_ps(wq + (c * G + k) * 16 + 8, _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4)));
      }
    }
    for (int64_t m0 = 0, mt; m0 < a.M; m0 += mt) {
      mt = a.M - m0 >= kWideTile ? kWideTile : a.M - m0;
      switch (mt) {
        case 1: wide_tile<S, 1>(a, row0, g, ng, m0, wq, ys); break;
        case 2: wide_tile<S, 2>(a, row0, g, ng, m0, wq, ys); break;
        case 3: wide_tile<S, 3>(a, row0, g, ng, m0, wq, ys); break;
        case 4: wide_tile<S, 4>(a, row0, g, ng, m0, wq, ys); break;
        case 5: wide_tile<S, 5>(a, row0, g, ng, m0, wq, ys); break;
        default: wide_tile<S, 6>(a, row0, g, ng, m0, wq, ys); break;
      }
    }
  }
}

template <int S>
void block_halves(const Int4Args& a, int64_t row0, float* ys) {
  const int64_t M = a.M, ng = a.K / a.G;
  for (int64_t i = 0; i < M * S; i += 8) _mm256_storeu_ps(ys + i, _mm256_setzero_ps());
  if (a.xt != nullptr) {
    block_wide<S>(a, row0, ys);
  } else {
    for (int64_t g = 0; g < ng; ++g)
      for (int u = 0; u < S / 32; ++u)
        for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
          if (M - m0 >= 2) tile<S, 2, 1>(a, row0, g, u, m0, ys);
          else tile<S, 1, 2>(a, row0, g, u, m0, ys);
        }
  }
  store_rows(a, row0, S, ys);
}

}  // namespace

bool block_avx2(const Int4Args& a, int64_t row0, int s, int mode, float* ys) {
  if (mode != kHalves) return false;
  if (s == 64) return block_halves<64>(a, row0, ys), true;
  if (s == 32) return block_halves<32>(a, row0, ys), true;
  return false;
}

}  // namespace edgeq

#pragma GCC pop_options
