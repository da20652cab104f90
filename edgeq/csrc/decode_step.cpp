// A whole decode step's decoder layers in one call: the lean loop's native step (edgeq/runtime/lean.py,
// LeanDecoder._step_native) moved from Python into C++, op for op, so the logits are the same bits and the step
// saves the Python interpreter and ~10 dispatches a layer (docs/kernel.md, "Decode breakdown").
//
//   torch.ops.edgeq.decode_layers(x bf16 [1, C] (the residual, updated), n bf16 [1, C] (out: the final norm's
//     output), weights [14 a layer: qweight of q, k, v, o, gate, up, down, then their scales_and_zeros],
//     group_sizes [7 a layer], biases [7 a layer, bf16 [N] or None], norms [2 a layer: input, post-attention; then
//     the final norm], eps [2 a layer, then the final], caches [2 a layer: keys, values bf16 [1, KVH, CAP, D]],
//     scales [1 a layer], windows [1 a layer, 0 = none], cos bf16 [D], nsin bf16 [D], pos, scratch [q [Hq D],
//     k [Hk D], v [Hk D], rot_q [Hq, D], attn [Hq, D], o [1, C], gate [1, I], up [1, I], down [1, C]],
//     block_n, full_mode, tail_modes, isa) -> ()
//
// Per layer, with the ops of edgeq_core (decode_core.h) and, for silu(g) * u, torch's own silu_ and mul_ (so their
// roundings are torch's, including its exp):
//
//     x += delta; n = w_in * norm(x)                    (delta: the previous layer's down output; none in layer 0)
//     q, k, v = n @ Wq^T (+ bq), n @ Wk^T (+ bk), n @ Wv^T (+ bv)                 one int4_multi call
//     rot_q = r(q); keys[pos] = r(k); values[pos] = v; attn = attention(rot_q, keys/values [start, pos + 1))
//     o = attn @ Wo^T (+ bo); x += o; n = w_post * norm(x)
//     g, u = n @ Wg^T (+ bg), n @ Wu^T (+ bu)                                      one int4_multi call
//     delta = (silu(g) * u) @ Wd^T (+ bd)
//
// then x += delta; n = w_final * norm(x). start = pos + 1 - window when a layer's window is set and smaller, else 0.
// The head (and its argmax) stay in Python: the head may have residual levels or another path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "decode_core.h"

namespace {

constexpr int64_t kWeights = 14, kMats = 7;

inline uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// layer < 0: a tensor of the step, not of one layer.
void check_bf16(const at::Tensor& t, int64_t numel, const char* what, int64_t layer = -1) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == numel, "decode_layers: ",
              layer >= 0 ? "layer " + std::to_string(layer) + " " : std::string(), what, ": expected contiguous bf16 of ",
              numel, " values, got ", t.scalar_type(), " ", t.sizes());
}

// Matrix i (0 q, 1 k, 2 v, 3 o, 4 gate, 5 up, 6 down) of layer l reading K inputs, writing out: checked.
edgeq_core::Matrix matrix(at::TensorList w, at::IntArrayRef groups, const c10::List<std::optional<at::Tensor>>& biases,
                          int64_t l, int64_t i, int64_t K, const at::Tensor& out) {
  const at::Tensor& qw = w[l * kWeights + i];
  const at::Tensor& sz = w[l * kWeights + kMats + i];
  const int64_t G = groups[l * kMats + i], N = out.numel();
  TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.dim() == 2 && qw.size(0) == N &&
                  qw.size(1) * 2 == K,
              "decode_layers: layer ", l, " matrix ", i, ": expected uint8 [", N, ", ", K / 2, "], got ",
              qw.scalar_type(), " ", qw.sizes());
  TORCH_CHECK((G == 32 || G == 64 || G == 128 || G == 256) && K % G == 0 && N % 16 == 0,
              "decode_layers: layer ", l, " matrix ", i, ": group size ", G, ", K ", K, ", N ", N);
  check_bf16(sz, (K / G) * N * 2, "scales_and_zeros", l);
  const std::optional<at::Tensor> b = biases.get(l * kMats + i);
  if (b.has_value()) check_bf16(*b, N, "bias", l);
  return {qw.data_ptr<uint8_t>(), bits(sz), b.has_value() ? bits(*b) : nullptr, bits(out), N, G};
}

void decode_layers(const at::Tensor& x, const at::Tensor& n, at::TensorList weights, at::IntArrayRef group_sizes,
                   const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms, at::ArrayRef<double> eps,
                   at::TensorList caches, at::ArrayRef<double> scales, at::IntArrayRef windows, const at::Tensor& cos,
                   const at::Tensor& nsin, int64_t pos, at::TensorList scratch, int64_t block_n, int64_t full_mode,
                   int64_t tail_modes, int64_t isa) {
  const int64_t L = static_cast<int64_t>(scales.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeights * L && static_cast<int64_t>(group_sizes.size()) == kMats * L &&
                  static_cast<int64_t>(biases.size()) == kMats * L && static_cast<int64_t>(norms.size()) == 2 * L + 1 &&
                  static_cast<int64_t>(eps.size()) == 2 * L + 1 && static_cast<int64_t>(caches.size()) == 2 * L &&
                  static_cast<int64_t>(windows.size()) == L && scratch.size() == 9,
              "decode_layers: for ", L, " layers expected ", kWeights * L, " weights, ", kMats * L, " group sizes and "
              "biases, ", 2 * L + 1, " norms and eps, ", 2 * L, " caches, ", L, " windows, 9 scratch; got ",
              weights.size(), ", ", group_sizes.size(), ", ", biases.size(), ", ", norms.size(), ", ", eps.size(), ", ",
              caches.size(), ", ", windows.size(), ", ", scratch.size());
  TORCH_CHECK((block_n == 32 || block_n == 64) && (full_mode == 0 || full_mode == 1), "decode_layers: block_n ",
              block_n, ", full_mode ", full_mode, " (32 or 64; 0 or 1)");
  TORCH_CHECK(isa >= 0 && isa <= 3 && (isa == 0 || (edgeq_core::cpu_features() & (1 << (isa - 1)))),
              "decode_layers: isa ", isa, " is not a path this CPU runs (0 scalar, 1 avx2, 2 avx512, 3 amx)");
  const at::Tensor &q = scratch[0], &k = scratch[1], &v = scratch[2], &rot_q = scratch[3], &attn = scratch[4],
                   &o = scratch[5], &gate = scratch[6], &up = scratch[7], &down = scratch[8];
  const int64_t C = x.numel(), Hq = rot_q.size(0), D = rot_q.size(1), I = weights[4].size(0);  // gate's rows
  check_bf16(x, C, "x");
  check_bf16(n, C, "n");
  check_bf16(cos, D, "cos");
  check_bf16(nsin, D, "nsin");
  TORCH_CHECK(rot_q.dim() == 2 && D % 2 == 0, "decode_layers: rot_q must be [Hq, D] with D even, got ", rot_q.sizes());
  TORCH_CHECK(L > 0 && caches[0].dim() == 4, "decode_layers: no layers, or caches not [1, KVH, CAP, D]");
  const int64_t KVH = caches[0].size(1), cap = caches[0].size(2);
  TORCH_CHECK(KVH > 0 && Hq % KVH == 0 && 0 <= pos && pos < cap, "decode_layers: Hq ", Hq, ", KVH ", KVH, ", pos ",
              pos, ", cache of ", cap);
  for (const at::Tensor* t : {&q, &rot_q, &attn}) check_bf16(*t, Hq * D, "q/rot_q/attn scratch");
  for (const at::Tensor* t : {&k, &v}) check_bf16(*t, KVH * D, "k/v scratch");
  for (const at::Tensor* t : {&o, &down}) check_bf16(*t, C, "o/down scratch");
  check_bf16(up, I, "up scratch");
  check_bf16(gate, I, "gate scratch");
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && o.sizes() == x.sizes(),
              "decode_layers: gate/up must be [1, I] and o [1, C]");

  // Check every layer before the first writes anything.
  std::vector<edgeq_core::Matrix> mats(kMats * L);
  const int64_t outs_k[kMats] = {C, C, C, Hq * D, C, C, I};
  const at::Tensor* outs[kMats] = {&q, &k, &v, &o, &gate, &up, &down};
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t i = 0; i < kMats; ++i) mats[l * kMats + i] = matrix(weights, group_sizes, biases, l, i, outs_k[i], *outs[i]);
    check_bf16(norms[2 * l], C, "input norm weight", l);
    check_bf16(norms[2 * l + 1], C, "post-attention norm weight", l);
    for (int64_t j = 0; j < 2; ++j) {
      const at::Tensor& c = caches[2 * l + j];
      TORCH_CHECK(c.scalar_type() == at::kBFloat16 && c.is_contiguous() && c.dim() == 4 && c.size(0) == 1 &&
                      c.size(1) == KVH && c.size(2) == cap && c.size(3) == D,
                  "decode_layers: layer ", l, " cache ", j, ": expected contiguous bf16 [1, ", KVH, ", ", cap, ", ", D,
                  "], got ", c.scalar_type(), " ", c.sizes());
    }
    TORCH_CHECK(windows[l] >= 0, "decode_layers: layer ", l, " window ", windows[l]);
  }
  check_bf16(norms[2 * L], C, "final norm weight");

  const int64_t end = pos + 1;
  uint16_t *xs = bits(x), *ns = bits(n);
  const uint16_t* delta = nullptr;
  for (int64_t l = 0; l < L; ++l) {
    const edgeq_core::Matrix* m = mats.data() + l * kMats;
    edgeq_core::add_rms_norm(xs, delta, bits(norms[2 * l]), 1, C, static_cast<float>(eps[2 * l]), ns);
    edgeq_core::int4_multi(ns, 1, C, m, 3, block_n, full_mode, tail_modes, isa);
    uint16_t *keys = bits(caches[2 * l]), *values = bits(caches[2 * l + 1]);
    edgeq_core::rope_to_cache(bits(q), bits(k), bits(v), bits(cos), bits(nsin), Hq, KVH, D, keys, values, cap, pos,
                              bits(rot_q));
    const int64_t start = windows[l] > 0 && end > windows[l] ? end - windows[l] : 0;
    edgeq_core::decode_attn(bits(rot_q), keys, values, Hq, KVH, D, cap, start, end, static_cast<float>(scales[l]),
                            bits(attn), isa);
    edgeq_core::int4_multi(bits(attn), 1, Hq * D, m + 3, 1, block_n, full_mode, tail_modes, isa);
    edgeq_core::add_rms_norm(xs, bits(o), bits(norms[2 * l + 1]), 1, C, static_cast<float>(eps[2 * l + 1]), ns);
    edgeq_core::int4_multi(ns, 1, C, m + 4, 2, block_n, full_mode, tail_modes, isa);
    at::silu_(const_cast<at::Tensor&>(gate));  // torch's kernel: the Python step's F.silu(g, inplace=True)
    const_cast<at::Tensor&>(gate).mul_(up);
    edgeq_core::int4_multi(bits(gate), 1, I, m + 6, 1, block_n, full_mode, tail_modes, isa);
    delta = bits(down);
  }
  edgeq_core::add_rms_norm(xs, delta, bits(norms[2 * L]), 1, C, static_cast<float>(eps[2 * L]), ns);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeq, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor(b!) n, Tensor[] weights, int[] group_sizes, Tensor?[] biases, "
        "Tensor[] norms, float[] eps, Tensor(c!)[] caches, float[] scales, int[] windows, Tensor cos, Tensor nsin, "
        "int pos, Tensor(d!)[] scratch, int block_n, int full_mode, int tail_modes, int isa) -> ()");
}

TORCH_LIBRARY_IMPL(edgeq, CPU, m) { m.impl("decode_layers", decode_layers); }
