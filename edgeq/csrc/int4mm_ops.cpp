// Torch binding of the edgeq native W4A16 kernel: argument checks, CPU feature query, threading over row blocks.
//
//   torch.ops.edgeq.int4_mm(x bf16 [M, K], qweight uint8 [N, K/2], group_size, scales_and_zeros bf16 [K/G, N, 2],
//                           block_n, full_mode, tail_modes, isa) -> bf16 [M, N]
//   torch.ops.edgeq.int4_mm_multi(x bf16 [M, K] (M = 1 or 2), qweights [...], group_sizes [...], scales_and_zeros
//                                 [...], biases [bf16 [N_i] or None, ...], block_n, full_mode, tail_modes, isa)
//                                 -> [bf16 [M, N_i], ...]   (several matrices on one x: q/k/v, gate/up)
//
// isa: 0 scalar, 1 avx2, 2 avx512, 3 amx (the Python side chooses it from cpu_features() and EDGEQ_NATIVE_ISA).
// Rows are cut into blocks of block_n rows (mode full_mode) and one tail block of s = N % block_n rows, whose mode is
// bit s/16 of tail_modes (modes: 0 halves, 1 adjacent; see int4mm.h);
// threads take contiguous runs of blocks, so each thread streams one contiguous range of qweight, once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "decode_core.h"
#include "tensor_bits.h"
#include "int4mm.h"

namespace {

using edgeq::Int4Args;

using edgeq_bits::mut;

int64_t cpu_features() {
  // bit 0: avx2+fma, bit 1: the AVX512 path's set (F, BW, VL, VBMI, BF16), bit 2: that set + AMX-TILE/BF16 with the
  // tile state granted by the OS. __builtin_cpu_supports also checks that the OS saves the wide registers.
  static const int64_t features = [] {
  __builtin_cpu_init();
  int64_t f = 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= 1;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16"))
    f |= 2;
  if ((f & 2) && edgeq::amx_usable()) f |= 4;
  return f;
  }();
  return features;
}

// The avx512 path's tiles for M > 8: 1 the bf16-pair dot products (vdpbf16ps), 2 fp32 FMAs on widened nibbles
// (int4mm_avx512.cpp). Which multiplies faster depends on the core (Zen 4 runs vdpbf16ps at full rate, Intel cores at
// half the fp32 FMA rate), so it is measured once per process: one thread, a 24-row x 64-column block over K = 2048,
// each kind run 5 times alternately, the faster best time wins. 0 where the CPU has no avx512 path.
int64_t prefill_choice() {
  static const int64_t choice = [] {
    if (!(cpu_features() & 2)) return int64_t{0};
    const int64_t M = 24, N = 64, K = 2048, G = 128, ng = K / G;
    std::vector<uint16_t> xb(M * K), sz(ng * N * 2), y(M * N);
    std::vector<float> xf(M * K), xs(M * ng), ys(2 * M * 64);
    std::vector<uint8_t> qw(N * K / 2);
    for (size_t i = 0; i < qw.size(); ++i) qw[i] = static_cast<uint8_t>(i * 37 + 11);
    for (size_t i = 0; i < xb.size(); ++i) xb[i] = edgeq::f32_to_bf16(xf[i] = static_cast<float>(i % 7) * 0.25f - 0.5f);
    for (size_t i = 0; i < sz.size(); ++i) sz[i] = edgeq::f32_to_bf16(i % 2 ? 0.01f : 0.002f);
    Int4Args a{xb.data(), xf.data(), xs.data(), qw.data(), sz.data(), y.data(), M, N, K, G};
    double best[2] = {1e30, 1e30};
    for (int rep = 0; rep < 10; ++rep) {
      a.f32_prefill = rep % 2;
      const auto t0 = std::chrono::steady_clock::now();
      edgeq::block_avx512(a, 0, 64, edgeq::kHalves, ys.data());
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      best[rep % 2] = std::min(best[rep % 2], dt.count());
    }
    return best[1] < best[0] ? int64_t{2} : int64_t{1};
  }();
  return choice;
}

// The checks both ops make of one matrix read with x [M, K]; returns N.
int64_t check_matrix(const at::Tensor& x, const at::Tensor& qweight, int64_t group_size,
                     const at::Tensor& scales_and_zeros, int64_t block_n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "x: expected bf16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "qweight: expected contiguous uint8 [N, K/2], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) * 2 == K, "qweight: [", N, ", ", qweight.size(1), "] holds K=", qweight.size(1) * 2,
              " but x has K=", K);
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256,
              "group_size must be one of 32, 64, 128, 256, got ", group_size);
  TORCH_CHECK(K % group_size == 0, "K=", K, " is not a multiple of group_size=", group_size);
  TORCH_CHECK(N % 16 == 0, "qweight: N=", N, " is not a multiple of 16");
  TORCH_CHECK(block_n == 32 || block_n == 64, "block_n=", block_n, " is not implemented (32 or 64)");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.is_contiguous() &&
                  scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == K / group_size &&
                  scales_and_zeros.size(1) == N && scales_and_zeros.size(2) == 2,
              "scales_and_zeros: expected contiguous bf16 [", K / group_size, ", ", N, ", 2], got ",
              scales_and_zeros.scalar_type(), " ", scales_and_zeros.sizes());
  return N;
}

// The path (isa's low 4 bits) after checking it, full_mode and the tile code (*tiles: isa's bits 4-5).
int64_t check_isa(int64_t isa, int64_t full_mode, int64_t* tiles) {
  TORCH_CHECK(full_mode == 0 || full_mode == 1, "full_mode must be 0 (halves) or 1 (adjacent)");
  // isa's bits 4-5: the avx512 path's tiles for M > 8 (0 measured: prefill_choice, 1 bf16 pairs, 2 fp32); 3: the
  // avx2 path's 2-row tiles at every M (its 6-row prefill tiles otherwise; the avx512 path measures its choice).
  *tiles = isa >> 4;
  isa &= 15;
  TORCH_CHECK(*tiles >= 0 && *tiles <= 3, "isa bits 4-5 (prefill tiles) must be 0, 1, 2 or 3");
  TORCH_CHECK(isa >= 0 && isa <= 3, "isa must be 0 (scalar), 1 (avx2), 2 (avx512) or 3 (amx)");
  TORCH_CHECK(isa == 0 || (cpu_features() & (1 << (isa - 1))), "this CPU lacks the instructions of isa ", isa);
  return isa;
}

// Row block b of a matrix of N rows: rows [row0, row0 + s) in block mode `mode` (full blocks full_mode, the tail
// block of s = N % block_n rows bit s/16 of tail_modes).
struct Block {
  int64_t row0;
  int s, mode;
};
inline Block block_at(int64_t N, int64_t b, int64_t block_n, int64_t full_mode, int64_t tail_modes) {
  const int64_t full = N / block_n, tail = N % block_n;
  if (b < full) return Block{b * block_n, static_cast<int>(block_n), static_cast<int>(full_mode)};
  return Block{b * block_n, static_cast<int>(tail), static_cast<int>((tail_modes >> (tail / 16)) & 1)};
}

// Rows [row0, row0 + s) of one matrix: the ISA's block routine, else (no fast path for the block) the scalar one.
void run_block(const Int4Args& a, int64_t isa, int64_t row0, int s, int mode, float* scratch) {
  bool done = false;
  // amx: tiles pay off from two activation rows; for one row the AVX512 dot products measured faster.
  if (isa == 3 && a.M > 1) done = edgeq::block_amx(a, row0, s, mode, scratch);
  if (isa == 2 || (isa == 3 && a.M == 1)) done = edgeq::block_avx512(a, row0, s, mode, scratch);
  if (isa == 1) done = edgeq::block_avx2(a, row0, s, mode, scratch);
  if (!done) edgeq::block_scalar(a, row0, s, mode, scratch, scratch + a.M * 64);
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qweight, int64_t group_size,
                   const at::Tensor& scales_and_zeros, int64_t block_n, int64_t full_mode, int64_t tail_modes,
                   int64_t isa) {
  const int64_t N = check_matrix(x, qweight, group_size, scales_and_zeros, block_n);
  const int64_t M = x.size(0), K = x.size(1);
  int64_t tiles = 0;
  isa = check_isa(isa, full_mode, &tiles);

  // The AMX path for M > 16 loads x in 16-row tiles: pad x to a multiple of 16 rows (zeros; their results are
  // dropped). It reads x as bf16 and never needs the fp32 copy.
  const bool amx_large = isa == 3 && M > 16;
  at::Tensor xc = x.contiguous();
  if (amx_large && M % 16) xc = at::cat({xc, at::zeros({16 - M % 16, K}, x.options())});
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // fp32 copy of x and its group sums, once per call (M*K values: small next to N*K/2 weight bytes), rows split
  // across threads (at M = 512 a single thread spent ~8% of a Qwen2.5-1.5B prefill here). The avx2 path's prefill
  // tiles read x k-major per tile of kWideTile rows instead (int4mm.h, Int4Args::xt), written in the same pass.
  const int64_t ng = K / group_size;
  const bool wide = isa == 1 && tiles != 3 && M >= edgeq::kWideMin;
  // Blocks the AMX path and the avx2 tiles do not take (adjacent mode, odd tails) fall back to the scalar path, which
  // reads xf; so do all blocks of the other paths.
  const bool need_xf = !(amx_large || wide) || N % block_n != 0 || full_mode != 0;
  // The AMX path for M > 16 folds the scales into its weight tiles and reads no group sums either: when it takes
  // every block, this pass over x is skipped.
  const bool need_xs = !amx_large || need_xf;
  std::vector<float> xf(need_xf ? M * K : 0), xt(wide ? M * K : 0), xs(need_xs ? M * ng : 0);
  const uint16_t* xb = edgeq_bits::in(xc);
  const int64_t rows = wide ? edgeq::kWideTile : 16;  // a task's rows: whole tiles, so no two tasks share one
  // One task (decode: M <= 16) runs on this thread: a region for it forks and joins the team for nothing.
  const int64_t tasks = (M + rows - 1) / rows;
  if (need_xs) at::parallel_for(0, tasks, tasks > 1 ? 1 : 2, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t * rows, mt = std::min<int64_t>(rows, M - m0);
      for (int64_t m = m0; m < m0 + mt; ++m)
        for (int64_t g = 0; g < ng; ++g) {
          float sum = 0.f;
          for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
            const float v = edgeq::bf16_to_f32(xb[m * K + k]);
            if (need_xf) xf[m * K + k] = v;
            if (wide) xt[m0 * K + k * mt + (m - m0)] = v;
            sum += v;
          }
          xs[m * ng + g] = sum;
        }
    }
  });

  Int4Args a{xb,
             xf.data(),
             xs.data(),
             qweight.data_ptr<uint8_t>(),
             edgeq_bits::in(scales_and_zeros),
             mut(y),
             M, N, K, group_size};
  a.f32_prefill = isa == 2 && M > 8 && (tiles == 1 || tiles == 2 ? tiles : prefill_choice()) == 2;
  if (wide) a.xt = xt.data();
  at::parallel_for(0, (N + block_n - 1) / block_n, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(2 * M * 64);
    for (int64_t b = b0; b < b1; ++b) {
      const Block k = block_at(N, b, block_n, full_mode, tail_modes);
      run_block(a, isa, k.row0, k.s, k.mode, scratch.data());
    }
  });
  return y;
}

// The op's checks and outputs; the work is edgeq_core::int4_multi (below).
std::vector<at::Tensor> int4_mm_multi(const at::Tensor& x, at::TensorList qweights, at::IntArrayRef group_sizes,
                                      at::TensorList scales, const c10::List<std::optional<at::Tensor>>& biases,
                                      int64_t block_n, int64_t full_mode, int64_t tail_modes, int64_t isa) {
  const int64_t n = static_cast<int64_t>(qweights.size());
  TORCH_CHECK(n >= 1 && static_cast<int64_t>(group_sizes.size()) == n && static_cast<int64_t>(scales.size()) == n &&
                  static_cast<int64_t>(biases.size()) == n,
              "int4_mm_multi: ", qweights.size(), " qweights, ", group_sizes.size(), " group sizes, ", scales.size(),
              " scales_and_zeros, ", biases.size(), " biases: expected as many of each (at least 1)");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) < edgeq::kWideMin,
              "int4_mm_multi: x must be [M, K] with 1 <= M <= ", edgeq::kWideMin - 1, " (decode rows), got ", x.sizes());
  int64_t tiles = 0;
  isa = check_isa(isa, full_mode, &tiles);
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> ys, bias(n);
  std::vector<edgeq_core::Matrix> mats;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t N = check_matrix(x, qweights[i], group_sizes[i], scales[i], block_n);
    const std::optional<at::Tensor> b = biases.get(i);
    if (b.has_value()) {
      TORCH_CHECK(b->dim() == 1 && b->size(0) == N && b->scalar_type() == at::kBFloat16,
                  "biases[", i, "]: expected bf16 [", N, "], got ", b->scalar_type(), " ", b->sizes());
      bias[i] = b->contiguous();
    }
    ys.push_back(at::empty({M, N}, x.options()));
    mats.push_back({qweights[i].data_ptr<uint8_t>(), mut(scales[i]), bias[i].defined() ? mut(bias[i]) : nullptr,
                    mut(ys[i]), N, group_sizes[i]});
  }
  const at::Tensor xc = x.contiguous();
  edgeq_core::int4_multi(mut(xc), M, K, mats.data(), n, block_n, full_mode, tail_modes, isa);
  return ys;
}

}  // namespace

int64_t edgeq_core::cpu_features() { return ::cpu_features(); }

// int4_mm_multi's work (decode_core.h), on checked arguments. Several matrices that read the same x of M < kWideMin
// rows (a layer's q/k/v, or its gate/up): one fp32 copy of x, its group sums once per distinct group size, one
// parallel region over all the matrices' row blocks (matrix 0's blocks first; threads take contiguous runs, as in
// int4_mm), and each matrix's optional bias added to its rows as the runtime adds it to int4_mm's output
// (`y.add_(bias)`: bf16(float(y) + float(b)), two roundings). Each output is the same bits as int4_mm's followed by
// that add: the blocks run the same code on the same x, group sums and scratch sizes. It saves, per matrix after the
// first, the call's dispatch, its x and output buffers, an OpenMP region and the bias op (docs/kernel.md, "Decode
// breakdown").
void edgeq_core::int4_multi(const uint16_t* xb, int64_t M, int64_t K, const Matrix* mats, int64_t n, int64_t block_n,
                            int64_t full_mode, int64_t tail_modes, int64_t isa) {
  std::vector<int64_t> first(n + 1, 0);  // first[i]: matrix i's first block in the combined range
  for (int64_t i = 0; i < n; ++i) first[i + 1] = first[i] + (mats[i].N + block_n - 1) / block_n;
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = edgeq::bf16_to_f32(xb[i]);
  std::vector<std::vector<float>> sums(n);  // matrix i's group sums; empty when an earlier matrix has its G
  std::vector<Int4Args> args;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t G = mats[i].G, ng = K / G;
    int64_t same = -1;
    for (int64_t j = 0; j < i && same < 0; ++j) same = mats[j].G == G && !sums[j].empty() ? j : -1;
    if (same < 0) {
      sums[i].resize(M * ng);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < ng; ++g) {
          float sum = 0.f;  // in int4_mm's order: the same sums, bit for bit
          for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += xf[m * K + k];
          sums[i][m * ng + g] = sum;
        }
    }
    args.push_back(Int4Args{xb, xf.data(), same < 0 ? sums[i].data() : sums[same].data(), mats[i].qw, mats[i].sz,
                            mats[i].y, M, mats[i].N, K, G});
  }
  at::parallel_for(0, first[n], 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(2 * M * 64);
    int64_t i = 0;
    for (int64_t bb = b0; bb < b1; ++bb) {
      while (bb >= first[i + 1]) ++i;
      const Int4Args& a = args[i];
      const Block k = block_at(a.N, bb - first[i], block_n, full_mode, tail_modes);
      run_block(a, isa, k.row0, k.s, k.mode, scratch.data());
      const uint16_t* bv = mats[i].bias;
      if (bv == nullptr) continue;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = k.row0; r < k.row0 + k.s; ++r)
          a.y[m * a.N + r] = edgeq::f32_to_bf16(edgeq::bf16_to_f32(a.y[m * a.N + r]) + edgeq::bf16_to_f32(bv[r]));
    }
  });
}

TORCH_LIBRARY(edgeq, m) {
  m.def("int4_mm(Tensor x, Tensor qweight, int group_size, Tensor scales_and_zeros, int block_n, int full_mode, "
        "int tail_modes, int isa) -> Tensor");
  m.def("int4_mm_multi(Tensor x, Tensor[] qweights, int[] group_sizes, Tensor[] scales_and_zeros, Tensor?[] biases, "
        "int block_n, int full_mode, int tail_modes, int isa) -> Tensor[]");
  m.def("cpu_features() -> int", &cpu_features);
  m.def("prefill_choice() -> int", &prefill_choice);
}

TORCH_LIBRARY_IMPL(edgeq, CPU, m) {
  m.impl("int4_mm", int4_mm);
  m.impl("int4_mm_multi", int4_mm_multi);
}
