// The plain-loop attention task (attn_decode.h), included by the scalar unit with ATTN_TASK naming the function: one
// key at a time, a dot product per (key, head), a scalar-broadcast axpy per (key, head) for V. It is the reference
// the SIMD units (attn_decode_avx2.cpp, attn_decode_avx512.cpp) are tested against, and runs any head size D.
// `omp simd` reductions let the compiler use the baseline ISA's vectors (sums reassociated into lanes).
#include "attn_decode.h"
#include "bf16.h"

namespace edgeq_attn {

void ATTN_TASK(const AttnArgs& a, int64_t task, float* scratch) {
  const TaskView tv = task_view(a, task);
  const int64_t D = a.D, group = tv.group, n = tv.n;
  float* qf = scratch;                   // [group, D]
  float* s = qf + group * D;             // [group, chunk]: scores, then exp(score - m)
  float* row = s + group * a.chunk;      // [D]: one key or value row in fp32
  for (int64_t i = 0; i < group * D; ++i) qf[i] = edgeq_bf16::bf16_to_f32(tv.q[i]);
  for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = edgeq_bf16::bf16_to_f32(tv.k[t * D + d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * row[d];
      s[g * a.chunk + t] = acc * a.scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * a.chunk;
    float m = sg[0];
    for (int64_t t = 1; t < n; ++t) m = sg[t] > m ? sg[t] : m;
    float l = 0.f;
#pragma omp simd reduction(+ : l)
    for (int64_t t = 0; t < n; ++t) {
      sg[t] = exp_nonpositive(sg[t] - m);
      l += sg[t];
    }
    float* pg = tv.part + g * (2 + D);
    pg[0] = m;
    pg[1] = l;
    for (int64_t d = 0; d < D; ++d) pg[2 + d] = 0.f;
  }
  for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = edgeq_bf16::bf16_to_f32(tv.v[t * D + d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = s[g * a.chunk + t];
      float* o = tv.part + g * (2 + D) + 2;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * row[d];
    }
  }
}

}  // namespace edgeq_attn
