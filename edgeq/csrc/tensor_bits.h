#pragma once
// A bf16 tensor's storage as raw uint16 bits: the kernels read and write bf16 as bits (bf16.h converts). The one
// spelling of that cast for every binding (int4mm_ops, decode_ops, decode_step, attn_ops, w4a8mm_ops). The caller has
// checked dtype and contiguity: data_ptr<at::BFloat16>() still throws on another dtype.
#include <ATen/ATen.h>

#include <cstdint>

namespace edgeq_bits {

inline uint16_t* mut(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }
inline const uint16_t* in(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

}  // namespace edgeq_bits
