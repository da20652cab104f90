// The decode ops' work on checked arguments (raw bf16 bits), shared by their torch bindings (int4mm_ops.cpp,
// attn_ops.cpp, decode_ops.cpp) and by decode_layers (decode_step.cpp), which runs a whole decode step's layers in
// one call: both reach the same code, so both give the same bits. Each binding documents its op's formula.
#pragma once
#include <cstdint>

namespace edgeq_core {

// torch.ops.edgeq.cpu_features: bit 0 avx2, bit 1 the avx512 set, bit 2 AMX (int4mm_ops.cpp).
int64_t cpu_features();

// One matrix of int4_multi: packed weight [N, K/2], its (scale, zero) pairs bf16 [K/G, N, 2], an optional bias bf16
// [N] (nullptr: none) and the output bf16 [M, N].
struct Matrix {
  const uint8_t* qw;
  const uint16_t* sz;
  const uint16_t* bias;
  uint16_t* y;
  int64_t N, G;
};

// torch.ops.edgeq.int4_mm_multi: y_i = x [M, K] @ dequant(W_i)^T (+ b_i) for M < kWideMin rows, one parallel region
// over all the matrices' row blocks; isa is the path code (0-3, tile bits removed).
void int4_multi(const uint16_t* x, int64_t M, int64_t K, const Matrix* mats, int64_t n, int64_t block_n,
                int64_t full_mode, int64_t tail_modes, int64_t isa);

// torch.ops.edgeq.decode_attn: one query's H heads over cache positions [start, end) of keys/values [KVH, cap, D].
void decode_attn(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t H, int64_t KVH, int64_t D,
                 int64_t cap, int64_t start, int64_t end, float scale, uint16_t* out, int64_t isa);

// torch.ops.edgeq.add_rms_norm over R rows of C: x += delta (delta may be nullptr), out = w * norm(x).
void add_rms_norm(uint16_t* x, const uint16_t* delta, const uint16_t* w, int64_t R, int64_t C, float eps,
                  uint16_t* out);

// torch.ops.edgeq.rope_to_cache: rot_q = r(q) [Hq, D]; keys[h, pos] = r(k[h]), values[h, pos] = v[h] (cache [Hk, cap, D]).
void rope_to_cache(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* cos, const uint16_t* nsin,
                   int64_t Hq, int64_t Hk, int64_t D, uint16_t* keys, uint16_t* values, int64_t cap, int64_t pos,
                   uint16_t* rot_q);

}  // namespace edgeq_core
