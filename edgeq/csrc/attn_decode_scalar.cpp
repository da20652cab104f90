// Decode attention, scalar unit: the plain-loop reference task (attn_decode_body.h) compiled for the baseline ISA.
#define ATTN_TASK task_scalar
#include "attn_decode_body.h"
