"""RoPE tables for the lean decode loop: cos and signed sin for every position up to ``max_model_len``, from the
model's own rotary module (docs/runtime.md, "The lean decode loop")."""

from __future__ import annotations

import torch
from torch import nn

# RoPE types whose inverse frequencies do not depend on the sequence length: a table over positions is exact.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def rope_tables(rotary: nn.Module, positions: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, nsin) [positions, head_dim] in ``dtype`` from the model's own rotary module, so scaling variants
    (linear, llama3, yarn's attention factor) are the model's. ``nsin`` is sin with its first half negated.

    Computed in blocks of whole rows. Elementwise cos/sin of a row equal the values transformers computes for one
    position when the row is a whole number of the vector loop's double vectors (32 floats on AVX512), so blocks are
    used when ``head_dim % 32 == 0`` and one row at a time otherwise (the scalar tail then falls on the same
    elements as in transformers' own call).
    """
    cos = torch.empty(positions, head_dim, dtype=dtype)
    nsin = torch.empty(positions, head_dim, dtype=dtype)
    block = max(1, (32768 // head_dim)) if head_dim % 32 == 0 else 1  # one parallel chunk, no split rows
    probe = torch.empty(1, 1, head_dim, dtype=dtype)
    with torch.no_grad():
        for a in range(0, positions, block):
            b = min(positions, a + block)
            c, s = rotary(probe, torch.arange(a, b)[None])
            cos[a:b] = c[0]
            nsin[a:b] = s[0]
    nsin[:, : head_dim // 2].neg_()
    return cos, nsin

