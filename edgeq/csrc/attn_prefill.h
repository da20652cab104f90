// Causal attention of many queries (prefill), shared declarations; the avx512 unit computes it.
//
//   out[i, h, :] = sum_{t <= p0 + i} softmax_t(scale * q[h, i] . K[j, t]) V[j, t]     j = h / (H / KVH)  (GQA)
//
// q bf16 [H, S, D] (query i sits at absolute position p0 + i); K, V bf16 rows of D contiguous values, kv head j's
// row t at k + j * kv_stride + t * row_stride (the cache's own buffers read in place: [1, KVH, CAP, D] has
// kv_stride = CAP * D, row_stride = D; a fresh [1, S, KVH, D] projection transposed has D and KVH * D);
// out bf16 [S, H, D] (the layout the o projection reads). Keys [0, p0 + S) must be written.
//
// Work: tasks (kv head j, tile of ROWS consecutive rows of the group), rows ordered position-major: row r of kv head
// j is query head j * G + r % G at position r / G (G = H / KVH). A tile walks its keys in blocks of 16 with an
// online softmax (flash attention): per row the running max m, sum l and unnormalised output o[D] in fp32;
//   s = scale * q . k (vdpbf16ps: exact bf16 products, fp32 sums), keys past the row's position masked;
//   m' = max(m, max s), o = o exp(m - m') + sum_t exp(s_t - m') v_t (fp32 FMAs), l likewise; out = bf16(o / l).
// Worked example (one head, D = 1, keys k = [1, 2], v = [10, 20], q = 1, scale = 1, p0 = 0): query 0 sees key 0
// only: out = 10; query 1: s = [1, 2], out = (10 e^-1 + 20) / (e^-1 + 1) = 17.311.
// Every row's sums run over the same keys in the same order whatever the tile and thread split: the output does
// not depend on the thread count. Keys are packed once per call into pairs (K[t][2d], K[t][2d+1]) for 16 keys a
// vector, so that one vdpbf16ps multiplies a query's pair (broadcast) with 16 keys.
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
  const uint32_t* kp;  // packed keys: [KVH][ceil((p0 + S) / 16)][D / 2][16] bf16 pairs
};

constexpr int kPrefillRows = 12;  // rows a tile holds: 12 score vectors, then 2 x 6 rows in the values pass

// Pack kv head j's keys [0, T) into PrefillArgs::kp's layout (the last block's missing keys are zero).
void prefill_pack_keys_avx512(const PrefillArgs& a, int64_t j, int64_t T, uint32_t* kp);
// Tile `tile` (rows [tile * kPrefillRows, ...)) of kv head j; scratch: prefill_scratch_floats(D) floats.
void prefill_tile_avx512(const PrefillArgs& a, int64_t j, int64_t tile, float* scratch);

static inline int64_t prefill_scratch_floats(int64_t D) { return kPrefillRows * (D + 16 + 2) + 64; }

}  // namespace edgeq_attn
