// Torch binding of edgeq's native W4A8 kernel: argument checks, CPU features, activation quantisation, threading.
//
//   torch.ops.edgeq_w4a8.w4a8_mm(x bf16|fp32 [M, K], qweight uint8 [N/32, K/bk, bk*16+128], scales fp32 [N/32, K/G, 32],
//                                zeros int8 [N/32, K/G, 32], group_size, bias [N]? (any float dtype, used as fp32), isa) -> bf16 [M, N]
//
// isa: 0 scalar, 1 vnni (AVX512-VNNI), 2 amx (AMX-INT8 for M > 8, VNNI below), 3 avx2 (AVX2 + FMA, vpmaddubsw),
// 4 avxvnni (the avx2 code with AVX-VNNI vpdpbusd); the codes are stable, not an order (the Python side ranks
// scalar < avx2 < avxvnni < vnni < amx) and picks one from
// cpu_features() and EDGEQ_W4A8_ISA. Its own TORCH_LIBRARY namespace: a process may load this next to the W4A16
// library (namespace edgeq), and a namespace can be defined by one library only.
// Threads take contiguous runs of 32-row column blocks; every output element is computed by one thread in a fixed
// order, so the bits do not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <memory>

#include "tensor_bits.h"
#include "w4a8mm.h"

namespace {

using edgeq_w4a8::Args;

int64_t cpu_features() {
  // bit 0: AVX512 F/BW/VL/DQ + VNNI (the vnni path); bit 1: that + AMX-TILE/INT8 granted by the OS (the amx path);
  // bit 2: AVX2 + FMA (the avx2 path); bit 3: that + AVX-VNNI (the avxvnni path).
  static const int64_t features = [] {
    __builtin_cpu_init();
    int64_t f = 0;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
      f |= 1;
    if ((f & 1) && edgeq_w4a8::amx_usable()) f |= 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= 4;
    if ((f & 4) && __builtin_cpu_supports("avxvnni")) f |= 8;
    return f;
  }();
  return features;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros,
                   int64_t group_size, const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128, "group_size must be 32, 64 or 128, got ",
              group_size);
  const int64_t bk = group_size;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: expected bf16/fp32 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.size(2) == bk * 16 + 128,
              "qweight: expected contiguous uint8 [N/32, K/", bk, ", ", bk * 16 + 128, "], got ",
              qweight.scalar_type(), " ", qweight.sizes());
  const int64_t M = x.size(0), K = x.size(1), NB = qweight.size(0), KB = qweight.size(1), N = NB * 32;
  TORCH_CHECK(KB * bk == K, "qweight holds K=", KB * bk, " but x has K=", K);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == NB && scales.size(1) == KB && scales.size(2) == 32,
              "scales: expected contiguous fp32 [", NB, ", ", KB, ", 32], got ", scales.scalar_type(), " ",
              scales.sizes());
  TORCH_CHECK(zeros.scalar_type() == at::kChar && zeros.is_contiguous() && zeros.dim() == 3 && zeros.size(0) == NB &&
                  zeros.size(1) == KB && zeros.size(2) == 32,
              "zeros: expected contiguous int8 [", NB, ", ", KB, ", 32], got ", zeros.scalar_type(), " ",
              zeros.sizes());
  const float* bptr = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias: expected [", N, "], got ", bias->sizes());
    bc = bias->to(at::kFloat).contiguous();  // the kernel's fp32 starting value (exact for a bf16 bias)
    bptr = bc.data_ptr<float>();
  }
  TORCH_CHECK(isa >= 0 && isa <= 4, "isa must be 0 (scalar), 1 (vnni), 2 (amx), 3 (avx2) or 4 (avxvnni)");
  static constexpr int64_t kIsaBit[5] = {0, 1, 2, 4, 8};
  TORCH_CHECK(isa == 0 || (cpu_features() & kIsaBit[isa]), "this CPU lacks the instructions of isa ", isa);

  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kBFloat16));
  if (M == 0) return y;
  at::Tensor au8 = at::empty({M, K}, x.options().dtype(at::kByte));
  at::Tensor sa = at::empty({M}, x.options().dtype(at::kFloat));
  const bool f32 = x.scalar_type() == at::kFloat;
  const uint16_t* xb = f32 ? nullptr : edgeq_bits::in(xc);
  const float* xf = f32 ? xc.data_ptr<float>() : nullptr;
  uint8_t* au = au8.data_ptr<uint8_t>();
  float* sap = sa.data_ptr<float>();
  auto quant = [&](int64_t m0, int64_t m1) {
    if (isa == 0) edgeq_w4a8::quantize_rows_scalar(xb, xf, K, m0, m1, au, sap);
    else if (isa >= 3) edgeq_w4a8::quantize_rows_avx2(xb, xf, K, m0, m1, au, sap);
    else edgeq_w4a8::quantize_rows_vnni(xb, xf, K, m0, m1, au, sap);
  };
  if (M * K >= (1 << 16)) at::parallel_for(0, M, 1, quant);
  else quant(0, M);

  Args a{au, sap, qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<int8_t>(), bptr,
         edgeq_bits::mut(y), M, N, K, bk};
  if (isa >= 1 && M <= edgeq_w4a8::kDecodeMaxRows) {  // decode: a stack buffer, nothing allocated per call
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      alignas(64) uint8_t scratch[edgeq_w4a8::kDecodeScratchBytes];
      for (int64_t nb = b0; nb < b1; ++nb) {
        if (isa == 3) edgeq_w4a8::block_avx2(a, nb, scratch);
        else if (isa == 4) edgeq_w4a8::block_avxvnni(a, nb, scratch);
        else edgeq_w4a8::block_vnni(a, nb, scratch);
      }
    });
    return y;
  }
  const int64_t sbytes = (edgeq_w4a8::scratch_bytes(K, M) + 63) & ~int64_t(63);
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::unique_ptr<uint8_t, FreeDeleter> scratch(static_cast<uint8_t*>(std::aligned_alloc(64, sbytes)));
    TORCH_CHECK(scratch, "w4a8_mm: out of memory for ", sbytes, " bytes of scratch");
    for (int64_t nb = b0; nb < b1; ++nb) {
      if (isa == 2) edgeq_w4a8::block_amx(a, nb, scratch.get());
      else if (isa == 1) edgeq_w4a8::block_vnni(a, nb, scratch.get());
      else if (isa == 3) edgeq_w4a8::block_avx2(a, nb, scratch.get());
      else if (isa == 4) edgeq_w4a8::block_avxvnni(a, nb, scratch.get());
      else edgeq_w4a8::block_scalar(a, nb, scratch.get());
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(edgeq_w4a8, m) {
  m.def("w4a8_mm(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size, Tensor? bias, int isa) -> Tensor");
  m.def("cpu_features() -> int", &cpu_features);
}

TORCH_LIBRARY_IMPL(edgeq_w4a8, CPU, m) { m.impl("w4a8_mm", w4a8_mm); }
