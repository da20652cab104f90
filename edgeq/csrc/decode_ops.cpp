// Small fused ops of the lean decode step (one token), each replacing several eager torch ops with the same
// roundings, so a step dispatches ~13 ops a layer instead of ~50. Single-threaded: a row of hidden size is a few
// microseconds of work, less than an OpenMP fork/join.
//
//   torch.ops.edgeq.add_rms_norm(x bf16 [R, C], delta bf16 [R, C] or None, weight bf16 [C], eps, out bf16 [R, C])
//     x += delta (bf16(fp32(x) + fp32(delta)), in place, when given), then per row
//     out = bf16(fp32(w) * fp32(bf16(fp32(x) * (1 / sqrt(sum(fp32(x)^2) / C + eps)))))
//     which is transformers' RMSNorm (round to bf16 before the weight) with the sum in another order: the only
//     difference from the eager ops (tests/test_decode_ops.py bounds it: at most one bf16 ulp, rarely).
//   torch.ops.edgeq.rope_to_cache(q bf16 [Hq, D], k bf16 [Hk, D], v bf16 [Hk, D], cos bf16 [D], nsin bf16 [D],
//                                 keys, values bf16 [1, Hk, CAP, D], pos, rot_q bf16 [Hq, D])
//     r(t) = bf16(bf16(t * cos) + bf16(swap_halves(t) * nsin)) (transformers' apply_rotary_pos_emb, bit for bit);
//     rot_q = r(q); keys[0, :, pos] = r(k); values[0, :, pos] = v.
//     Worked example, D = 4, t = [a, b, c, e], nsin = [-s0, -s1, s0, s1]: swap_halves(t) = [c, e, a, b], so
//     r(t)[0] = bf16(bf16(a cos0) + bf16(c * -s0)).
//   torch.ops.edgeq.argmax_finite(logits bf16 or fp32, contiguous) -> int
//     the index of the first largest value (torch.argmax's choice), or -1 when any value is NaN or +-Inf: the
//     decode loop's greedy pick and its finiteness check in two passes over the row (79 us on 151,936 bf16 logits;
//     torch's isfinite().all() + argmax 1.08 ms, 2 threads, Zen 4). Example: [1, 3, 3, -inf] -> -1; [1, 3, 3, 0] -> 1.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "bf16.h"
#include "decode_core.h"
#include "tensor_bits.h"

namespace {

using edgeq_bf16::bf16_to_f32;
using edgeq_bf16::f32_to_bf16;

using edgeq_bits::in;
using edgeq_bits::mut;

void check_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous(), what, ": expected contiguous bf16, got ",
              t.scalar_type(), " ", t.sizes());
}

void add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
                  const at::Tensor& out) {
  check_bf16(x, "x");
  check_bf16(weight, "weight");
  check_bf16(out, "out");
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && weight.numel() == x.size(1), "shapes: x ", x.sizes(),
              ", weight ", weight.sizes(), ", out ", out.sizes());
  const uint16_t* ds = nullptr;
  if (delta.has_value()) {
    check_bf16(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "delta ", delta->sizes(), " vs x ", x.sizes());
    ds = in(*delta);
  }
  edgeq_core::add_rms_norm(mut(x), ds, in(weight), x.size(0), x.size(1), static_cast<float>(eps), mut(out));
}

// rot[i] = r(t)[i] for one head row t of D values.
inline void rope_row(const uint16_t* t, const uint16_t* cs, const uint16_t* ns, int64_t D, uint16_t* rot) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(t[i]) * bf16_to_f32(cs[i])));
    const uint16_t sw = t[i < half ? i + half : i - half];
    const float b = bf16_to_f32(f32_to_bf16(bf16_to_f32(sw) * bf16_to_f32(ns[i])));
    rot[i] = f32_to_bf16(a + b);
  }
}

void rope_to_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& nsin, const at::Tensor& keys, const at::Tensor& values, int64_t pos,
                   const at::Tensor& rot_q) {
  for (auto* p : {&q, &k, &v, &cos, &nsin, &keys, &values, &rot_q}) check_bf16(*p, "rope_to_cache argument");
  const int64_t D = cos.numel(), Hq = q.numel() / D, Hk = k.numel() / D;
  TORCH_CHECK(D % 2 == 0 && nsin.numel() == D && q.numel() == Hq * D && k.numel() == Hk * D && v.numel() == Hk * D &&
                  rot_q.numel() == Hq * D,
              "shapes: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", cos ", cos.sizes(), ", rot_q ",
              rot_q.sizes());
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(1) == Hk && keys.size(3) == D,
              "keys/values: expected [1, ", Hk, ", CAP, ", D, "], got ", keys.sizes(), " and ", values.sizes());
  const int64_t cap = keys.size(2);
  TORCH_CHECK(0 <= pos && pos < cap, "pos ", pos, " outside the cache of ", cap, " positions");
  edgeq_core::rope_to_cache(in(q), in(k), in(v), in(cos), in(nsin), Hq, Hk, D, mut(keys), mut(values), cap, pos,
                            mut(rot_q));
}

template <typename T, typename ToFloat, typename Bad>
int64_t argmax_finite_impl(const T* v, int64_t n, ToFloat to_float, Bad bad) {
  float m = -INFINITY;
  int nonfinite = 0;
#pragma omp simd reduction(max : m) reduction(| : nonfinite)
  for (int64_t i = 0; i < n; ++i) {
    const float f = to_float(v[i]);
    m = f > m ? f : m;
    nonfinite |= bad(v[i]);
  }
  if (nonfinite) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (to_float(v[i]) == m) return i;
  return -1;  // n == 0
}

int64_t argmax_finite(const at::Tensor& logits) {
  TORCH_CHECK(logits.is_contiguous() && logits.numel() > 0 &&
                  (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat),
              "logits: expected a non-empty contiguous bf16 or fp32 tensor, got ", logits.scalar_type(), " ",
              logits.sizes());
  const int64_t n = logits.numel();
  if (logits.scalar_type() == at::kBFloat16)
    return argmax_finite_impl(in(logits), n, [](uint16_t u) { return bf16_to_f32(u); },
                              [](uint16_t u) { return static_cast<int>((u & 0x7F80u) == 0x7F80u); });
  return argmax_finite_impl(logits.data_ptr<float>(), n, [](float f) { return f; }, [](float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    return static_cast<int>((u & 0x7F800000u) == 0x7F800000u);
  });
}

}  // namespace

// add_rms_norm's work (decode_core.h), on checked arguments.
void edgeq_core::add_rms_norm(uint16_t* xs, const uint16_t* ds, const uint16_t* w, int64_t R, int64_t C, float feps,
                              uint16_t* o) {
  if (ds != nullptr)
    for (int64_t i = 0; i < R * C; ++i) xs[i] = f32_to_bf16(bf16_to_f32(xs[i]) + bf16_to_f32(ds[i]));
  const float fc = static_cast<float>(C);
  for (int64_t r = 0; r < R; ++r) {
    const uint16_t* xr = xs + r * C;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < C; ++c) {
      const float f = bf16_to_f32(xr[c]);
      sum += f * f;
    }
    const float inv = 1.0f / std::sqrt(feps + sum / fc);
    for (int64_t c = 0; c < C; ++c) {
      const float n = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[c]) * inv));
      o[r * C + c] = f32_to_bf16(bf16_to_f32(w[c]) * n);
    }
  }
}

// rope_to_cache's work (decode_core.h), on checked arguments.
void edgeq_core::rope_to_cache(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* cs,
                               const uint16_t* ns, int64_t Hq, int64_t Hk, int64_t D, uint16_t* keys, uint16_t* values,
                               int64_t cap, int64_t pos, uint16_t* rot_q) {
  for (int64_t h = 0; h < Hq; ++h) rope_row(q + h * D, cs, ns, D, rot_q + h * D);
  for (int64_t h = 0; h < Hk; ++h) {
    rope_row(k + h * D, cs, ns, D, keys + (h * cap + pos) * D);
    const uint16_t* vr = v + h * D;
    uint16_t* dst = values + (h * cap + pos) * D;
    for (int64_t i = 0; i < D; ++i) dst[i] = vr[i];
  }
}

TORCH_LIBRARY_FRAGMENT(edgeq, m) {
  m.def("argmax_finite(Tensor logits) -> int");
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def("rope_to_cache(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor nsin, Tensor(a!) keys, Tensor(b!) values, "
        "int pos, Tensor(c!) rot_q) -> ()");
}

TORCH_LIBRARY_IMPL(edgeq, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rope_to_cache", rope_to_cache);
  m.impl("argmax_finite", argmax_finite);
}
