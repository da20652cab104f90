// Decode attention, avx2 unit: the shared body (attn_decode_body.h) compiled for this ISA.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define ATTN_TASK task_avx2
#include "attn_decode_body.h"
#pragma GCC pop_options
