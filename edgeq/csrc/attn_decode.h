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

// One task: kv head j = task / nchunks, keys [start + c * chunk, min(end, start + (c + 1) * chunk)).
// scratch: at least group * (D + chunk) + D floats.
void task_scalar(const AttnArgs& a, int64_t task, float* scratch);
void task_avx2(const AttnArgs& a, int64_t task, float* scratch);
void task_avx512(const AttnArgs& a, int64_t task, float* scratch);

}  // namespace edgeq_attn
