// Single-query attention for decode (one new token attending over the static KV cache), shared declarations.
//
//   out[h, :] = sum_t softmax_t(scale * q[h] . K[j, t]) V[j, t]      t in [start, end), j = h / (H / KVH)  (GQA)
//
// q bf16 [H, D]; K, V bf16 [KVH, CAP, D] (the cache's own buffers, read in place); out bf16 [H, D].
// Every product and sum is fp32 (bf16 x bf16 products are exact in fp32); the output is rounded once to bf16.
// Work is split into tasks (kv head j, chunk c of CHUNK keys): each task keeps, per query head of its group, the
// chunk's max m, sum of exp l and unnormalised output o[D] ("flash decoding"); the chunks are merged afterwards:
//   M = max_c m_c,  out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c.
// Worked example (one head, D = 1, keys k = [1, 2], v = [10, 20], q = 1, scale = 1, one chunk):
//   s = [1, 2], m = 2, p = [e^-1, 1], l = 1.3679, o = 10 e^-1 + 20 = 23.679, out = 23.679 / 1.3679 = 17.311.
//
// CHUNK depends on T = end - start and KVH only (chunk_keys below), never on the thread count, and every task and
// the merge add in a fixed order: the output does not depend on how many threads run the tasks.
//
// Paths (one translation unit each; the three compute the same math in different summation orders):
//   scalar (attn_decode_body.h): plain loops, one key at a time; the reference the SIMD paths are tested against.
//   avx2   (attn_decode_avx2.cpp): blocks of 8 keys; scores of (head, key) pairs accumulated in 8 fp32 lanes over D,
//          8 of them reduced together; V rows converted once per key and applied to up to 6 heads in registers.
//   avx512 (attn_decode_avx512.cpp): blocks of 16 keys; scores by vdpbf16ps (exact bf16 products, fp32 sums) in 16
//          lanes over D, 16 (head, key) sums reduced together by a transpose-and-add; V as for avx2 with 16 lanes.
#pragma once
#include <cstdint>

namespace edgeq_attn {

struct AttnArgs {
  const uint16_t* q;  // bf16 [H, D]
  const uint16_t* k;  // bf16 [KVH, CAP, D]
  const uint16_t* v;  // bf16 [KVH, CAP, D]
  int64_t H, KVH, D, CAP, start, end, chunk;
  float scale;
  float* partial;  // per task: group * (2 + D) floats: m, l, o[D] of each query head of the group
};

// Keys per task for T keys over KVH kv heads: at least 16 tasks when the keys allow (so up to 16 threads get work),
// chunks of 64..256 keys, a multiple of 16 (the avx512 key block: only a kv head's last chunk ends in a partial one).
// Examples: T = 512, KVH = 2 -> 64 (16 tasks); T = 2048, KVH = 2 -> 256 (16); T = 2048, KVH = 8 -> 256 (64);
// T = 40 -> 64 (one chunk of 40 keys per kv head). Measured alike at T = 512: chunks of 64, 128 and 256.
static inline int64_t chunk_keys(int64_t T, int64_t KVH) {
  const int64_t per_head = (16 + KVH - 1) / KVH;  // chunks wanted per kv head
  int64_t chunk = (T + per_head - 1) / per_head;
  chunk = (chunk + 15) / 16 * 16;
  return chunk < 64 ? 64 : chunk > 256 ? 256 : chunk;
}

// Query heads of a GQA group in tiles of at most 6, balanced (7 -> 4 + 3, 13 -> 5 + 4 + 4): the number of tiles,
// and how many heads tile ti of `ntiles` holds. The SIMD units' score and value passes both walk these tiles.
static inline int64_t head_tile_count(int64_t group) { return (group + 5) / 6; }
static inline int64_t head_tile_size(int64_t group, int64_t ntiles, int64_t ti) {
  return group / ntiles + (ti < group % ntiles ? 1 : 0);
}

// Floats of scratch one task needs (each thread holds one): scores, the group's queries in fp32, one key block.
static inline int64_t scratch_floats(int64_t group, int64_t D, int64_t chunk) {
  return group * (chunk + D) + 16 * D + 64;
}

// One task's share: kv head j = task / nchunks, keys [t0, t0 + n) with t0 = start + c * chunk, c = task % nchunks;
// q, k, v point at the group's queries and the chunk's first key and value rows; part at the task's partials.
struct TaskView {
  int64_t j, t0, n, group;
  const uint16_t *q, *k, *v;
  float* part;
};

static inline TaskView task_view(const AttnArgs& a, int64_t task) {
  const int64_t group = a.H / a.KVH, nchunks = (a.end - a.start + a.chunk - 1) / a.chunk;
  const int64_t j = task / nchunks, c = task % nchunks;
  const int64_t t0 = a.start + c * a.chunk, t1 = t0 + a.chunk < a.end ? t0 + a.chunk : a.end;
  return TaskView{j, t0, t1 - t0, group, a.q + j * group * a.D, a.k + (j * a.CAP + t0) * a.D,
                  a.v + (j * a.CAP + t0) * a.D, a.partial + task * group * (2 + a.D)};
}

// exp(x) for x <= 0 to ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (error
// < 3.5e-8 relative), times 2^n built in the exponent bits. Branch-free; the SIMD units evaluate the same steps on
// vectors. x < -87 (below the smallest normal float's log) gives 0, as softmax wants.
// Example: x = -1: n = floor(-1.4427 + 0.5) = -1, r = -1 + ln2 = -0.30685, exp(r) = 0.73576, times 2^-1 = 0.36788.
static inline float exp_nonpositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
  const float r = (xc - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  __builtin_memcpy(&two_n, &bits, 4);
  return x < -87.0f ? 0.0f : p * two_n;
}

// Software prefetch of `bytes` from p, one per 64-byte line, into L1 (l1) or L2. The SIMD tasks fetch the key rows a
// few blocks ahead, a block's value rows while its scores are computed (the values pass then reads them from L2),
// and the next chunk's keys during the values pass, so the memory stream runs while they compute: a block's rows
// are read in a strided order that the hardware prefetchers alone follow late.
static inline void prefetch_rows(const uint16_t* p, int64_t bytes, bool l1) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
    if (l1) __builtin_prefetch(c + off, 0, 3);
    else __builtin_prefetch(c + off, 0, 2);
  }
}

// One task: kv head j = task / nchunks, keys [start + c * chunk, min(end, start + (c + 1) * chunk)).
// scratch: scratch_floats(group, D, chunk) floats.
void task_scalar(const AttnArgs& a, int64_t task, float* scratch);
void task_avx2(const AttnArgs& a, int64_t task, float* scratch);
void task_avx512(const AttnArgs& a, int64_t task, float* scratch);

}  // namespace edgeq_attn
