// Torch bindings of the decode attention (attn_decode.h: checks, task split across threads, merge of the chunks)
// and of the prefill attention (attn_prefill.h: keys packed once, tiles of rows spread over the threads).
//
//   torch.ops.edgeq.decode_attn(q bf16 [H, D], keys bf16 [1, KVH, CAP, D], values (same), start, end, scale,
//                               out bf16 [H, D], isa) -> ()
//   torch.ops.edgeq.prefill_attn(q bf16 [H, S, D], keys bf16 [1, KVH, T, D] (each row of D contiguous; heads and
//                                rows strided: a view of the cache), values (same strides), scale, isa)
//                                -> out bf16 [S, H, D]
//                                (causal; query i at position T - S + i; the avx2 and avx512 paths: isa >= 1)
//
// isa as for int4_mm: 0 scalar, 1 avx2, 2 avx512 (3, amx, runs the avx512 code: there is no tile work here).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "attn_decode.h"
#include "attn_prefill.h"
#include "bf16.h"
#include "decode_core.h"
#include "tensor_bits.h"

namespace {

using edgeq_attn::AttnArgs;

void check_cache(const at::Tensor& t, const char* what, int64_t KVH, int64_t D) {
  TORCH_CHECK(t.dim() == 4 && t.size(0) == 1 && t.size(1) == KVH && t.size(3) == D && t.is_contiguous() &&
                  t.scalar_type() == at::kBFloat16,
              what, ": expected contiguous bf16 [1, ", KVH, ", CAP, ", D, "], got ", t.scalar_type(), " ", t.sizes());
}

void decode_attn(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start, int64_t end,
                 double scale, const at::Tensor& out, int64_t isa) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kBFloat16,
              "q: expected contiguous bf16 [H, D], got ", q.scalar_type(), " ", q.sizes());
  const int64_t H = q.size(0), D = q.size(1), KVH = keys.size(1);
  check_cache(keys, "keys", KVH, D);
  check_cache(values, "values", KVH, D);
  TORCH_CHECK(values.size(2) == keys.size(2), "values: ", values.size(2), " positions, keys: ", keys.size(2));
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "H=", H, " query heads is not a multiple of KVH=", KVH);
  TORCH_CHECK(0 <= start && start < end && end <= keys.size(2), "keys [", start, ", ", end, ") outside the cache of ",
              keys.size(2), " positions");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "out: expected contiguous bf16 ", q.sizes(), ", got ", out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(isa >= 0 && isa <= 3, "isa must be 0 (scalar), 1 (avx2), 2 (avx512) or 3 (amx)");
  edgeq_core::decode_attn(edgeq_bits::in(q),
                          edgeq_bits::in(keys),
                          edgeq_bits::in(values), H, KVH, D, keys.size(2),
                          start, end, static_cast<float>(scale),
                          edgeq_bits::mut(out), isa);
}

void check_rows(const at::Tensor& t, const char* what, int64_t KVH, int64_t D) {
  TORCH_CHECK(t.dim() == 4 && t.size(0) == 1 && t.size(1) == KVH && t.size(3) == D && t.stride(3) == 1 &&
                  t.scalar_type() == at::kBFloat16,
              what, ": expected bf16 [1, ", KVH, ", T, ", D, "] with contiguous rows, got ", t.scalar_type(), " ",
              t.sizes(), " strides ", t.strides());
}

at::Tensor prefill_attn(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale,
                        int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16,
              "q: expected contiguous bf16 [H, S, D], got ", q.scalar_type(), " ", q.sizes());
  const int64_t H = q.size(0), S = q.size(1), D = q.size(2), KVH = keys.size(1), T = keys.size(2);
  check_rows(keys, "keys", KVH, D);
  check_rows(values, "values", KVH, D);
  TORCH_CHECK(values.size(2) == T && values.stride(1) == keys.stride(1) && values.stride(2) == keys.stride(2),
              "values: ", values.sizes(), " strides ", values.strides(), " differ from keys' ", keys.sizes(), " ",
              keys.strides());
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "H=", H, " query heads is not a multiple of KVH=", KVH);
  TORCH_CHECK(S > 0 && T >= S, "T=", T, " keys for S=", S, " queries: the queries must be the last S positions");
  TORCH_CHECK(D % 16 == 0 && D > 0, "head size D=", D, " is not a multiple of 16");
  TORCH_CHECK(isa >= 1 && isa <= 3, "prefill_attn has avx2 and avx512 paths (isa 1, 2 or 3), not scalar: got isa ",
              isa);
  at::Tensor out = at::empty({S, H, D}, q.options());
  const int64_t G = H / KVH;
  at::Tensor kp = at::empty({edgeq_attn::prefill_packed_bytes(KVH, T, D)}, at::TensorOptions().dtype(at::kByte));
  edgeq_attn::PrefillArgs a{edgeq_bits::in(q),
                            edgeq_bits::in(keys),
                            edgeq_bits::in(values),
                            edgeq_bits::mut(out),
                            H, KVH, S, D, T - S, keys.stride(1), keys.stride(2), static_cast<float>(scale),
                            kp.data_ptr<uint8_t>()};
  void* kpw = kp.data_ptr<uint8_t>();
  const bool wide = isa >= 2;
  at::parallel_for(0, KVH, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      wide ? edgeq_attn::prefill_pack_keys_avx512(a, j, T, kpw) : edgeq_attn::prefill_pack_keys_avx2(a, j, T, kpw);
  });
  // Tiles heaviest first (later positions see more keys), handed out one at a time: the causal work is uneven.
  const int64_t ntiles = (G * S + edgeq_attn::kPrefillRows - 1) / edgeq_attn::kPrefillRows, ntasks = KVH * ntiles;
  const int64_t need = edgeq_attn::prefill_scratch_floats(D);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scratch(need);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ntasks; ++t) {
      if (wide) edgeq_attn::prefill_tile_avx512(a, t % KVH, ntiles - 1 - t / KVH, scratch.data());
      else edgeq_attn::prefill_tile_avx2(a, t % KVH, ntiles - 1 - t / KVH, scratch.data());
    }
  }
  return out;
}

}  // namespace

// decode_attn's work (decode_core.h), on checked arguments.
void edgeq_core::decode_attn(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t H, int64_t KVH,
                             int64_t D, int64_t cap, int64_t start, int64_t end, float scale, uint16_t* out,
                             int64_t isa) {
  const int64_t group = H / KVH, T = end - start;
  // The split depends on T and KVH only (attn_decode.h): the same chunks, hence the same bits, for any thread count.
  const int64_t chunk = edgeq_attn::chunk_keys(T, KVH);
  const int64_t nchunks = (T + chunk - 1) / chunk, ntasks = KVH * nchunks;
  // Buffers kept per thread across calls (grown, never shrunk): no allocation on the decode path after warm-up.
  thread_local std::vector<float> partial;
  if (partial.size() < static_cast<size_t>(ntasks * group * (2 + D))) partial.resize(ntasks * group * (2 + D));
  AttnArgs a{q, keys, values, H, KVH, D, cap, start, end, chunk, scale, partial.data()};
  const int64_t need = edgeq_attn::scratch_floats(group, D, chunk);
  at::parallel_for(0, ntasks, 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(need)) scratch.resize(need);
    for (int64_t i = i0; i < i1; ++i) {
      if (isa >= 2) edgeq_attn::task_avx512(a, i, scratch.data());
      else if (isa == 1) edgeq_attn::task_avx2(a, i, scratch.data());
      else edgeq_attn::task_scalar(a, i, scratch.data());
    }
  });
  // Merge the chunks of each query head h (kv head j = h / group, slot g = h % group of its tasks).
  thread_local std::vector<float> acc;
  if (acc.size() < static_cast<size_t>(D)) acc.resize(D);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t j = h / group, g = h % group;
    const float* first = a.partial + (j * nchunks) * group * (2 + D) + g * (2 + D);
    float M = first[0];
    for (int64_t c = 1; c < nchunks; ++c) M = std::fmax(M, first[c * group * (2 + D)]);
    float L = 0.f;
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    for (int64_t c = 0; c < nchunks; ++c) {
      const float* pc = first + c * group * (2 + D);
      const float w = std::exp(pc[0] - M);
      L += w * pc[1];
      for (int64_t d = 0; d < D; ++d) acc[d] += w * pc[2 + d];
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = edgeq_bf16::f32_to_bf16(acc[d] / L);
  }
}

TORCH_LIBRARY_FRAGMENT(edgeq, m) {
  m.def("decode_attn(Tensor q, Tensor keys, Tensor values, int start, int end, float scale, Tensor(a!) out, "
        "int isa) -> ()");
  m.def("prefill_attn(Tensor q, Tensor keys, Tensor values, float scale, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(edgeq, CPU, m) {
  m.impl("decode_attn", decode_attn);
  m.impl("prefill_attn", prefill_attn);
}
