// Causal attention of many queries (prefill), shared declarations; the avx512 and avx2 units compute it.
//
//   out[i, h, :] = sum_{t <= p0 + i} softmax_t(scale * q[h, i] . K[j, t]) V[j, t]     j = h / (H / KVH)  (GQA)
//
// q bf16 [H, S, D] (query i sits at absolute position p0 + i); K, V bf16 rows of D contiguous values, kv head j's
// row t at k + j * kv_stride + t * row_stride (the cache's own buffers read in place: [1, KVH, CAP, D] has
// kv_stride = CAP * D, row_stride = D; a fresh [1, S, KVH, D] projection transposed has D and KVH * D);
// out bf16 [S, H, D] (the layout the o projection reads). Keys [0, p0 + S) must be written.
//
// Work: tasks (kv head j, tile of ROWS consecutive rows of the group), rows ordered position-major: row r of kv head
// j is query head j * G + r % G at position r / G (G = H / KVH). A tile walks its keys in steps of 64 with an
// online softmax (flash attention): per row the running max m, sum l and unnormalised output o[D] in fp32;
//   s = scale * q . k (vdpbf16ps: exact bf16 products, fp32 sums), keys past the row's position masked;
//   m' = max(m, max s), o = o exp(m - m') + sum_t exp(s_t - m') v_t (fp32 FMAs), l likewise; out = bf16(o / l).
// Worked example (one head, D = 1, keys k = [1, 2], v = [10, 20], q = 1, scale = 1, p0 = 0): query 0 sees key 0
// only: out = 10; query 1: s = [1, 2], out = (10 e^-1 + 20) / (e^-1 + 1) = 17.311.
// Every row's sums run over the same keys in the same order whatever the tile and thread split: the output does
// not depend on the thread count. Keys are packed once per call so that one instruction multiplies a query's value
// (broadcast) with a vector of keys: avx512, pairs (K[t][2d], K[t][2d+1]) of 16 keys a vector for vdpbf16ps (exact
// bf16 products, fp32 sums); avx2, K[t][d] widened to fp32 for 8 keys a vector (fp32 FMAs: exact products too).
#pragma once
#include <cstdint>

namespace edgeq_attn {

struct PrefillArgs {
  const uint16_t* q;  // bf16 [H, S, D]
  const uint16_t* k;  // bf16, kv head j's row t at j * kv_stride + t * D
  const uint16_t* v;
  uint16_t* out;      // bf16 [S, H, D]
  int64_t H, KVH, S, D, p0, kv_stride, row_stride;
  float scale;
  const void* kp;  // packed keys: avx512 uint32 [KVH][ceil(T / 16)][D / 2][16] bf16 pairs; avx2 float
                   // [KVH][ceil(T / 8)][D][8]; T = p0 + S
};

constexpr int kPrefillRows = 12;  // rows a tile holds: 12 score vectors, then 2 x 6 rows in the values pass
constexpr int kPrefillStep = 64;  // keys per online-softmax step (a multiple of both paths' 16 and 8)

// Bytes of the packed keys for KVH heads of D over T keys (either path's layout fits).
static inline int64_t prefill_packed_bytes(int64_t KVH, int64_t T, int64_t D) {
  return KVH * ((T + 15) / 16) * 16 * D * 4;
}

// Pack kv head j's keys [0, T) into PrefillArgs::kp's layout (the last block's missing keys are zero).
void prefill_pack_keys_avx512(const PrefillArgs& a, int64_t j, int64_t T, void* kp);
void prefill_pack_keys_avx2(const PrefillArgs& a, int64_t j, int64_t T, void* kp);
// Tile `tile` (rows [tile * kPrefillRows, ...)) of kv head j; scratch: prefill_scratch_floats(D) floats.
void prefill_tile_avx512(const PrefillArgs& a, int64_t j, int64_t tile, float* scratch);
void prefill_tile_avx2(const PrefillArgs& a, int64_t j, int64_t tile, float* scratch);

// A tile's rows: row r is query head head[r] at position pos[r], query row q[r], keys [0, lim[r]) visible; rows
// past the group's last (nr of them are real) repeat its last row (computed, not written). ISA-free: both paths'.
struct TileRows {
  const uint16_t* q[kPrefillRows];
  int64_t lim[kPrefillRows], pos[kPrefillRows], head[kPrefillRows];
  int64_t nr;
};

static inline TileRows tile_rows(const PrefillArgs& a, int64_t j, int64_t tile) {
  const int64_t G = a.H / a.KVH, rows = G * a.S, r0 = tile * kPrefillRows;
  TileRows t;
  t.nr = rows - r0 < kPrefillRows ? rows - r0 : kPrefillRows;
  for (int r = 0; r < kPrefillRows; ++r) {
    const int64_t rr = r0 + (r < t.nr ? r : t.nr - 1);
    t.pos[r] = rr / G;
    t.head[r] = j * G + rr % G;
    t.q[r] = a.q + (t.head[r] * a.S + t.pos[r]) * a.D;
    t.lim[r] = a.p0 + t.pos[r] + 1;
  }
  return t;
}

// o [R, D], p [R, kPrefillStep], alpha [R], l [R], the tile's queries in fp32 [R, D] (avx2), and slack.
static inline int64_t prefill_scratch_floats(int64_t D) { return kPrefillRows * (2 * D + kPrefillStep + 2) + 64; }

}  // namespace edgeq_attn
