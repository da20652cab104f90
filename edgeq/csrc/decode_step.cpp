// A whole decode step's decoder layers in one call: the lean loop's native step (edgeq/runtime/lean.py,
// LeanDecoder._step_native) moved from Python into C++, op for op, so the logits are the same bits and the step
// saves the Python interpreter and ~10 dispatches a layer (docs/kernel.md, "Decode breakdown").
//
//   torch.ops.edgeq.decode_layers(x bf16 [1, C] (the residual, updated), n bf16 [1, C] (out: the final norm's
//     output), weights [W4A16 layers (w4a8_isa < 0), 14 a layer: qweight of q, k, v, o, gate, up, down, then their
//     scales_and_zeros; W4A8 layers, 21 a layer: qweight, scales, zeros of the seven, each in that order],
//     group_sizes [7 a layer], biases [7 a layer, bf16 [N] or None], norms [2 a layer: input, post-attention; then
//     the final norm], eps [2 a layer, then the final], caches [2 a layer: keys, values bf16 [1, KVH, CAP, D]],
//     scales [1 a layer], windows [1 a layer, 0 = none], cos bf16 [D], nsin bf16 [D], pos, scratch [q [Hq D],
//     k [Hk D], v [Hk D], rot_q [Hq, D], attn [Hq, D], o [1, C], gate [1, I], up [1, I], down [1, C]],
//     block_n, full_mode, tail_modes, isa, w4a8_isa, qk_norms [Qwen3: 3 a layer: q_norm and k_norm weights bf16 [D],
//     their eps fp32 0-dim; else empty], qk_scratch [Qwen3: qk bf16 [Hq + Hk, D], f fp32 [Hq + Hk, D], sq (the
//     same), var fp32 [Hq + Hk, 1], normed bf16 [Hq + Hk, D], cols fp32 0-dim (= D); else empty], skip = 0) -> ()
//
// skip (benchmarks only: the logits are then wrong, only the time counts): bit 0 leaves out the attention, bit 1 the
// norms, RoPE + cache writes and Qwen3's head norms, bit 2 silu and mul; 7 leaves the matmuls alone.
//
// Per layer, with the ops of edgeq_core (decode_core.h) and, for silu(g) * u, torch's own silu_ and mul_ (so their
// roundings are torch's, including its exp):
//
//     x += delta; n = w_in * norm(x)                    (delta: the previous layer's down output; none in layer 0)
//     q, k, v = n @ Wq^T (+ bq), n @ Wk^T (+ bk), n @ Wv^T (+ bv)                 one int4_multi call
//     q, k = w_qn * norm(q), w_kn * norm(k) per head               (Qwen3; torch's ops, as the Python step)
//     rot_q = r(q); keys[pos] = r(k); values[pos] = v; attn = attention(rot_q, keys/values [start, pos + 1))
//     o = attn @ Wo^T (+ bo); x += o; n = w_post * norm(x)
//     g, u = n @ Wg^T (+ bg), n @ Wu^T (+ bu)                                      one int4_multi call
//     delta = (silu(g) * u) @ Wd^T (+ bd)
//
// then x += delta; n = w_final * norm(x). start = pos + 1 - window when a layer's window is set and smaller, else 0.
// W4A8 layers compute each projection with torch.ops.edgeq_w4a8.w4a8_mm (its own library, reached through the
// dispatcher: the op the Python step calls, with the bias as its starting value), one call per matrix as there.
// The head (and its argmax) stay in Python: the head may have residual levels or another path.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <vector>

#include "decode_core.h"
#include "tensor_bits.h"

namespace {

constexpr int64_t kWeights = 14, kMats = 7;

using edgeq_bits::mut;

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
  return {qw.data_ptr<uint8_t>(), mut(sz), b.has_value() ? mut(*b) : nullptr, mut(out), N, G};
}

// Matrix i of W4A8 layer l reading K inputs into N outputs: the w4a8_mm op's argument checks, made before the step
// writes anything (the op repeats them).
void check_w4a8(at::TensorList w, at::IntArrayRef groups, const c10::List<std::optional<at::Tensor>>& biases,
                int64_t l, int64_t i, int64_t K, int64_t N) {
  const at::Tensor &qw = w[l * 21 + i], &sc = w[l * 21 + 7 + i], &z = w[l * 21 + 14 + i];
  const int64_t G = groups[l * kMats + i];
  TORCH_CHECK((G == 32 || G == 64 || G == 128) && K % G == 0 && N % 32 == 0 && qw.scalar_type() == at::kByte &&
                  qw.is_contiguous() && qw.dim() == 3 && qw.size(0) == N / 32 && qw.size(1) == K / G &&
                  qw.size(2) == G * 16 + 128,
              "decode_layers: layer ", l, " W4A8 matrix ", i, ": expected uint8 [", N / 32, ", ", K / G, ", ",
              G * 16 + 128, "] (group size ", G, "), got ", qw.scalar_type(), " ", qw.sizes());
  TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() && sc.numel() == N * (K / G) &&
                  z.scalar_type() == at::kChar && z.is_contiguous() && z.numel() == N * (K / G),
              "decode_layers: layer ", l, " W4A8 matrix ", i, ": scales fp32 and zeros int8 of ", N * (K / G),
              " values expected, got ", sc.scalar_type(), " ", sc.sizes(), " and ", z.scalar_type(), " ", z.sizes());
  const std::optional<at::Tensor> b = biases.get(l * kMats + i);
  TORCH_CHECK(!b.has_value() || (b->dim() == 1 && b->size(0) == N), "decode_layers: layer ", l, " W4A8 matrix ", i,
              ": bias of ", N, " values expected");
}

// y = w4a8_mm(x, matrix i of W4A8 layer l): the W4A8 library's op through the dispatcher (a new tensor).
at::Tensor w4a8(const at::Tensor& x, at::TensorList w, at::IntArrayRef groups,
                const c10::List<std::optional<at::Tensor>>& biases, int64_t l, int64_t i, int64_t isa) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("edgeq_w4a8::w4a8_mm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t, const std::optional<at::Tensor>&, int64_t)>();
  return op.call(x, w[l * 21 + i], w[l * 21 + 7 + i], w[l * 21 + 14 + i], groups[l * kMats + i],
                 biases.get(l * kMats + i), isa);
}

// Qwen3's head norm over the rows of qk = [q; k] (bf16 [Hq + Hk, D]), in place: the Python step's _qk_norm, op for op
// with the same torch ops on the same buffers (edgeq/runtime/rmsnorm.py: RMSNorm.unweighted, then the weights), so
// the same bits. t: qk_scratch; w: this layer's (w_qn, w_kn, eps).
void qk_norm(at::TensorList t, const at::Tensor& w_qn, const at::Tensor& w_kn, const at::Tensor& eps, int64_t Hq) {
  const at::Tensor &qk = t[0], &f = t[1], &sq = t[2], &var = t[3], &normed = t[4], &cols = t[5];
  at::Tensor fm = f, vm = var;
  fm.copy_(qk);
  at::mul_out(const_cast<at::Tensor&>(sq), f, f);
  at::sum_out(vm, sq, std::vector<int64_t>{-1}, true);
  at::addcdiv_out(vm, eps, var, cols);
  vm.rsqrt_();
  fm.mul_(var);
  at::Tensor(normed).copy_(f);
  const int64_t Hk = qk.size(0) - Hq;
  at::Tensor q_out = qk.narrow(0, 0, Hq), k_out = qk.narrow(0, Hq, Hk);
  at::mul_out(q_out, w_qn, normed.narrow(0, 0, Hq));
  at::mul_out(k_out, w_kn, normed.narrow(0, Hq, Hk));
}

// The argument checks, all made before the step writes anything; returns the W4A16 layers' matrices (none for W4A8).
std::vector<edgeq_core::Matrix> check_args(const at::Tensor& x, const at::Tensor& n, at::TensorList weights,
                                           at::IntArrayRef group_sizes,
                                           const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms,
                                           at::ArrayRef<double> eps, at::TensorList caches, at::IntArrayRef windows,
                                           const at::Tensor& cos, const at::Tensor& nsin, int64_t pos,
                                           at::TensorList scratch, int64_t L, bool w8, int64_t block_n,
                                           int64_t full_mode, int64_t isa) {
  const int64_t per = w8 ? 21 : kWeights;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == per * L && static_cast<int64_t>(group_sizes.size()) == kMats * L &&
                  static_cast<int64_t>(biases.size()) == kMats * L && static_cast<int64_t>(norms.size()) == 2 * L + 1 &&
                  static_cast<int64_t>(eps.size()) == 2 * L + 1 && static_cast<int64_t>(caches.size()) == 2 * L &&
                  static_cast<int64_t>(windows.size()) == L && scratch.size() == 9 && L > 0,
              "decode_layers: for ", L, " layers expected ", per * L, " weights, ", kMats * L, " group sizes and "
              "biases, ", 2 * L + 1, " norms and eps, ", 2 * L, " caches, ", L, " windows, 9 scratch; got ",
              weights.size(), ", ", group_sizes.size(), ", ", biases.size(), ", ", norms.size(), ", ", eps.size(), ", ",
              caches.size(), ", ", windows.size(), ", ", scratch.size());
  TORCH_CHECK((block_n == 32 || block_n == 64) && (full_mode == 0 || full_mode == 1), "decode_layers: block_n ",
              block_n, ", full_mode ", full_mode, " (32 or 64; 0 or 1)");
  TORCH_CHECK(isa >= 0 && isa <= 3 && (isa == 0 || (edgeq_core::cpu_features() & (1 << (isa - 1)))),
              "decode_layers: isa ", isa, " is not a path this CPU runs (0 scalar, 1 avx2, 2 avx512, 3 amx)");
  const at::Tensor &rot_q = scratch[3];
  TORCH_CHECK(rot_q.dim() == 2 && rot_q.size(1) % 2 == 0 && caches[0].dim() == 4,
              "decode_layers: rot_q must be [Hq, D] with D even and the caches [1, KVH, CAP, D], got ", rot_q.sizes(),
              " and ", caches[0].sizes());
  const int64_t C = x.numel(), Hq = rot_q.size(0), D = rot_q.size(1), KVH = caches[0].size(1), cap = caches[0].size(2);
  const int64_t I = w8 ? weights[4].size(0) * 32 : weights[4].size(0);  // gate's rows
  TORCH_CHECK(KVH > 0 && Hq % KVH == 0 && 0 <= pos && pos < cap, "decode_layers: Hq ", Hq, ", KVH ", KVH, ", pos ",
              pos, ", cache of ", cap);
  check_bf16(x, C, "x");
  check_bf16(n, C, "n");
  check_bf16(cos, D, "cos");
  check_bf16(nsin, D, "nsin");
  const char* what[9] = {"q scratch", "k scratch", "v scratch", "rot_q scratch", "attn scratch",
                         "o scratch", "gate scratch", "up scratch", "down scratch"};
  const int64_t numel[9] = {Hq * D, KVH * D, KVH * D, Hq * D, Hq * D, C, I, I, C};
  for (int j = 0; j < 9; ++j) check_bf16(scratch[j], numel[j], what[j]);
  std::vector<edgeq_core::Matrix> mats(w8 ? 0 : kMats * L);
  const int64_t ins[kMats] = {C, C, C, Hq * D, C, C, I}, outs[kMats] = {Hq * D, KVH * D, KVH * D, C, I, I, C};
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t i = 0; i < kMats; ++i) {
      if (w8) check_w4a8(weights, group_sizes, biases, l, i, ins[i], outs[i]);
      else mats[l * kMats + i] = matrix(weights, group_sizes, biases, l, i, ins[i], scratch[i < 3 ? i : i + 2]);
    }
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
  return mats;
}

// Qwen3's head-norm arguments (before anything is written).
void check_qk(at::TensorList w, at::TensorList t, int64_t L, int64_t Hq, int64_t Hk, int64_t D) {
  TORCH_CHECK(static_cast<int64_t>(w.size()) == 3 * L && t.size() == 6, "decode_layers: qk_norms: expected ", 3 * L,
              " (3 a layer) and qk_scratch 6, got ", w.size(), " and ", t.size());
  for (int64_t l = 0; l < L; ++l) {
    check_bf16(w[3 * l], D, "q_norm weight", l);
    check_bf16(w[3 * l + 1], D, "k_norm weight", l);
    TORCH_CHECK(w[3 * l + 2].scalar_type() == at::kFloat && w[3 * l + 2].dim() == 0, "decode_layers: layer ", l,
                " q/k norm eps: expected a 0-dim fp32 tensor");
  }
  const int64_t R = Hq + Hk;
  check_bf16(t[0], R * D, "qk scratch");
  check_bf16(t[4], R * D, "normed scratch");
  for (int j = 1; j < 4; ++j)
    TORCH_CHECK(t[j].scalar_type() == at::kFloat && t[j].is_contiguous() && t[j].dim() == 2 && t[j].size(0) == R &&
                    t[j].size(1) == (j == 3 ? 1 : D),
                "decode_layers: qk_scratch[", j, "]: expected contiguous fp32 [", R, ", ", j == 3 ? 1 : D, "], got ",
                t[j].scalar_type(), " ", t[j].sizes());
  TORCH_CHECK(t[0].dim() == 2 && t[4].dim() == 2 && t[5].scalar_type() == at::kFloat && t[5].dim() == 0,
              "decode_layers: qk and normed must be [", R, ", ", D, "] and cols a 0-dim fp32 tensor");
}

void decode_layers(const at::Tensor& x, const at::Tensor& n, at::TensorList weights, at::IntArrayRef group_sizes,
                   const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms, at::ArrayRef<double> eps,
                   at::TensorList caches, at::ArrayRef<double> scales, at::IntArrayRef windows, const at::Tensor& cos,
                   const at::Tensor& nsin, int64_t pos, at::TensorList scratch, int64_t block_n, int64_t full_mode,
                   int64_t tail_modes, int64_t isa, int64_t w4a8_isa, at::TensorList qk_norms,
                   at::TensorList qk_scratch, int64_t skip) {
  const int64_t L = static_cast<int64_t>(scales.size());
  const bool attention = !(skip & 1), norms_rope = !(skip & 2), gating = !(skip & 4);
  const bool w8 = w4a8_isa >= 0, qk = !qk_norms.empty();
  const std::vector<edgeq_core::Matrix> mats = check_args(x, n, weights, group_sizes, biases, norms, eps, caches,
                                                          windows, cos, nsin, pos, scratch, L, w8, block_n, full_mode,
                                                          isa);
  const at::Tensor &q = scratch[0], &k = scratch[1], &v = scratch[2], &rot_q = scratch[3], &attn = scratch[4],
                   &o = scratch[5], &down = scratch[8];
  const int64_t C = x.numel(), Hq = rot_q.size(0), D = rot_q.size(1), KVH = caches[0].size(1), cap = caches[0].size(2);
  if (qk) check_qk(qk_norms, qk_scratch, L, Hq, KVH, D);
  const at::Tensor attn_row = attn.view({1, Hq * D});  // the o projection's input
  const int64_t end = pos + 1;
  uint16_t *xs = mut(x), *ns = mut(n);
  const uint16_t* delta = nullptr;
  at::Tensor yd;  // a W4A8 layer's down output: delta until the next layer's norm has read it
  for (int64_t l = 0; l < L; ++l) {
    const edgeq_core::Matrix* m = w8 ? nullptr : mats.data() + l * kMats;
    if (norms_rope) edgeq_core::add_rms_norm(xs, delta, mut(norms[2 * l]), 1, C, static_cast<float>(eps[2 * l]), ns);
    at::Tensor yq = q, yk = k, yv = v;
    if (w8) {
      yq = w4a8(n, weights, group_sizes, biases, l, 0, w4a8_isa);
      yk = w4a8(n, weights, group_sizes, biases, l, 1, w4a8_isa);
      yv = w4a8(n, weights, group_sizes, biases, l, 2, w4a8_isa);
    } else {
      edgeq_core::int4_multi(ns, 1, C, m, 3, block_n, full_mode, tail_modes, isa);
    }
    if (qk && norms_rope) {  // Qwen3: the head norms run on [q; k] copied into one buffer, then RoPE reads q and k from it
      const at::Tensor& qkb = qk_scratch[0];
      std::memcpy(mut(qkb), mut(yq), Hq * D * 2);
      std::memcpy(mut(qkb) + Hq * D, mut(yk), KVH * D * 2);
      qk_norm(qk_scratch, qk_norms[3 * l], qk_norms[3 * l + 1], qk_norms[3 * l + 2], Hq);
      yq = qkb.narrow(0, 0, Hq);
      yk = qkb.narrow(0, Hq, KVH);
    }
    uint16_t *keys = mut(caches[2 * l]), *values = mut(caches[2 * l + 1]);
    if (norms_rope)
      edgeq_core::rope_to_cache(mut(yq), mut(yk), mut(yv), mut(cos), mut(nsin), Hq, KVH, D, keys, values, cap,
                                pos, mut(rot_q));
    const int64_t start = windows[l] > 0 && end > windows[l] ? end - windows[l] : 0;
    if (attention)
      edgeq_core::decode_attn(mut(rot_q), keys, values, Hq, KVH, D, cap, start, end, static_cast<float>(scales[l]),
                              mut(attn), isa);
    at::Tensor yo = o;
    if (w8) yo = w4a8(attn_row, weights, group_sizes, biases, l, 3, w4a8_isa);
    else edgeq_core::int4_multi(mut(attn), 1, Hq * D, m + 3, 1, block_n, full_mode, tail_modes, isa);
    if (norms_rope)
      edgeq_core::add_rms_norm(xs, mut(yo), mut(norms[2 * l + 1]), 1, C, static_cast<float>(eps[2 * l + 1]), ns);
    at::Tensor g = scratch[6], u = scratch[7];
    if (w8) {
      g = w4a8(n, weights, group_sizes, biases, l, 4, w4a8_isa);
      u = w4a8(n, weights, group_sizes, biases, l, 5, w4a8_isa);
    } else {
      edgeq_core::int4_multi(ns, 1, C, m + 4, 2, block_n, full_mode, tail_modes, isa);
    }
    if (gating) {
      at::silu_(g);  // torch's kernels: the Python step's F.silu(g, inplace=True) and g.mul_(u)
      g.mul_(u);
    }
    if (w8) {
      yd = w4a8(g, weights, group_sizes, biases, l, 6, w4a8_isa);
      delta = mut(yd);
    } else {
      edgeq_core::int4_multi(mut(g), 1, g.numel(), m + 6, 1, block_n, full_mode, tail_modes, isa);
      delta = mut(down);
    }
  }
  if (norms_rope) edgeq_core::add_rms_norm(xs, delta, mut(norms[2 * L]), 1, C, static_cast<float>(eps[2 * L]), ns);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeq, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor(b!) n, Tensor[] weights, int[] group_sizes, Tensor?[] biases, "
        "Tensor[] norms, float[] eps, Tensor(c!)[] caches, float[] scales, int[] windows, Tensor cos, Tensor nsin, "
        "int pos, Tensor(d!)[] scratch, int block_n, int full_mode, int tail_modes, int isa, int w4a8_isa, "
        "Tensor[] qk_norms, Tensor(e!)[] qk_scratch, int skip=0) -> ()");
}

TORCH_LIBRARY_IMPL(edgeq, CPU, m) { m.impl("decode_layers", decode_layers); }
