// The byte gathering shared by the AVX512 and AMX paths of the W4A16 kernel (int4mm_avx512.cpp, int4mm_amx.cpp).
// Include it *after* the unit's `#pragma GCC target` (it uses AVX512 intrinsics); the functions sit in an anonymous
// namespace, so each unit has its own copy compiled for its own target and nothing is shared at link time.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace edgeq {
namespace {

// vpermb index: dword l of row vector v gathers byte 16v + l of k (A_j) and of k + 1 (B_j), bytes 1 and 3 zeroed
// by the caller's mask: (A_j, 0, B_j, 0).
inline __m512i pair_index(int bytes_per_k, int v) {
  alignas(64) uint8_t idx[64] = {0};
  for (int l = 0; l < 16; ++l) {
    idx[4 * l] = static_cast<uint8_t>(16 * v + l);
    idx[4 * l + 2] = static_cast<uint8_t>(bytes_per_k + 16 * v + l);
  }
  return _mm512_load_si512(idx);
}

template <int S>
inline __m512i load_pair(const uint8_t* p) {
  if constexpr (S == 64) return _mm512_loadu_si512(p);
  else return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

}  // namespace
}  // namespace edgeq
