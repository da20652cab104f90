// Decode attention, avx512 unit: the shared body (attn_decode_body.h) compiled for this ISA.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define ATTN_TASK task_avx512
#include "attn_decode_body.h"
#pragma GCC pop_options
