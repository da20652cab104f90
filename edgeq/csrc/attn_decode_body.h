// The body of one attention task (attn_decode.h), included once per ISA unit with ATTN_TASK naming the function.
// Plain loops with `omp simd` reductions: each unit's `#pragma GCC target` lets the compiler vectorise them for
// that ISA (the sums are reassociated into vector lanes: a different but equally exact-in-fp32 order per ISA).
#include "attn_decode.h"
#include "bf16.h"

namespace edgeq_attn {
namespace {

// exp(x) for x <= 0 to ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (error
// < 3.5e-8 relative), times 2^n built in the exponent bits. Written branch-free so that loops over it vectorise.
// x < -87 (below the smallest normal float's log) gives 0, as softmax wants.
inline float exp_nonpositive(float x) {
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

}  // namespace

void ATTN_TASK(const AttnArgs& a, int64_t task, float* scratch) {
  const int64_t D = a.D, group = a.H / a.KVH;
  const int64_t nchunks = (a.end - a.start + a.chunk - 1) / a.chunk;
  const int64_t j = task / nchunks, c = task % nchunks;
  const int64_t t0 = a.start + c * a.chunk, t1 = t0 + a.chunk < a.end ? t0 + a.chunk : a.end, n = t1 - t0;
  float* qf = scratch;                   // [group, D]
  float* s = qf + group * D;             // [group, chunk]: scores, then exp(score - m)
  float* row = s + group * a.chunk;      // [D]: one key or value row in fp32
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = edgeq_bf16::bf16_to_f32(a.q[(j * group + g) * D + d]);
  const uint16_t* kb = a.k + (j * a.CAP + t0) * D;
  for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = edgeq_bf16::bf16_to_f32(kb[t * D + d]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * row[d];
      s[g * a.chunk + t] = acc * a.scale;
    }
  }
  float* part = a.partial + task * group * (2 + D);
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
    float* pg = part + g * (2 + D);
    pg[0] = m;
    pg[1] = l;
    for (int64_t d = 0; d < D; ++d) pg[2 + d] = 0.f;
  }
  const uint16_t* vb = a.v + (j * a.CAP + t0) * D;
  for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = edgeq_bf16::bf16_to_f32(vb[t * D + d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = s[g * a.chunk + t];
      float* o = part + g * (2 + D) + 2;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * row[d];
    }
  }
}

}  // namespace edgeq_attn
