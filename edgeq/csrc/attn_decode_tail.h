// The end of a SIMD attention task, shared by attn_decode_avx2.cpp and attn_decode_avx512.cpp: softmax of each
// head's scores, then the V pass in head tiles. Include it *after* the unit's `#pragma GCC target` and after the
// unit's own softmax_row and tiles: the helpers sit in an anonymous namespace, so each unit compiles its own copy
// for its own target (inlined into its task), and nothing is shared at link time.
#pragma once
#include <cstdint>
#include <cstring>

#include "attn_decode.h"

namespace edgeq_attn {
namespace {

// Each head's row of s [group, ss] becomes probabilities (the unit's softmax_row writes the row's max m and sum l
// into its partial), and the head's output accumulator in the partial is zeroed for the V pass.
template <class SoftmaxRow>
inline void softmax_heads(const TaskView& tv, int64_t D, float* s, int64_t ss, SoftmaxRow softmax_row) {
  for (int64_t g = 0; g < tv.group; ++g) {
    float* pg = tv.part + g * (2 + D);
    softmax_row(s + g * ss, tv.n, pg, pg + 1);
    std::memset(pg + 2, 0, D * sizeof(float));
  }
}

// The V pass in head tiles of at most 6 heads, balanced (7 -> 4 + 3): tile(h0, nh, npf) for each. npf starts as the
// number of the next chunk's keys whose K rows the tiles may prefetch (at most this chunk's n); the unit's tile
// resets it to 0 after its first kernel call, so only the first call prefetches.
template <class Tile>
inline void head_tiles(const AttnArgs& a, const TaskView& tv, Tile tile) {
  const int64_t next_n = tv.t0 + tv.n + a.chunk < a.end ? a.chunk : a.end - tv.t0 - tv.n;  // the next chunk's keys
  int64_t npf = next_n < tv.n ? next_n : tv.n;
  const int64_t ntiles = head_tile_count(tv.group);
  for (int64_t ti = 0, h0 = 0; ti < ntiles; ++ti) {
    const int64_t nh = head_tile_size(tv.group, ntiles, ti);
    tile(h0, nh, npf);
    h0 += nh;
  }
}

}  // namespace
}  // namespace edgeq_attn
