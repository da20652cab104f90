"""Transformers' RMSNorm for one token's rows, into buffers allocated once: the lean decode loop's torch ops
(``decode_ops="torch"``, edgeq/runtime/lean.py), bit for bit the transformers computation."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm:
    """Transformers' RMSNorm with buffers: ``w * bf16(fp32(x) * rsqrt(mean(fp32(x)^2, -1) + eps))``, rows [R, C].

    Six ops into preallocated buffers, the last one rounding the fp32 product once to the bf16 ``normed``, then the
    weight (the seventh: transformers rounds before weighting, so this cannot be folded in). ``__call__`` writes
    ``out`` and returns it. (``torch.mul(f, var, out=normed)`` would save an op but allocates an fp32 temporary.)
    """

    def __init__(self, rows: int, cols: int, dtype: torch.dtype):
        self.f = torch.empty(rows, cols, dtype=torch.float32)
        self.sq = torch.empty(rows, cols, dtype=torch.float32)
        self.var = torch.empty(rows, 1, dtype=torch.float32)
        self.normed = torch.empty(rows, cols, dtype=dtype)
        self.cols = torch.tensor(float(cols))  # 0-dim fp32: no scalar wrapping (and no dtype conversion) per call

    def unweighted(self, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """bf16(fp32(x) * rsqrt(mean(fp32(x)^2) + eps)) into ``normed``; ``eps`` a 0-dim fp32 tensor."""
        f, var = self.f, self.var
        f.copy_(x)
        torch.mul(f, f, out=self.sq)
        torch.sum(self.sq, -1, keepdim=True, out=var)
        torch.addcdiv(eps, var, self.cols, out=var)  # eps + sum / C: mean() is sum() then div_ on the CPU, same bits
        var.rsqrt_()
        f.mul_(var)
        self.normed.copy_(f)  # one rounding to the model dtype: transformers' x.to(input_dtype)
        return self.normed

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return torch.mul(weight, self.unweighted(x, eps), out=out)


def eps_tensor(norm: nn.Module) -> torch.Tensor:
    """The norm's epsilon as a 0-dim fp32 tensor (transformers adds the Python float to an fp32 tensor: the same)."""
    return torch.tensor(float(norm.variance_epsilon), dtype=torch.float32)
