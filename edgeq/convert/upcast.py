"""Linear layers over bf16 weights, computed in fp32 a cache-sized block of output rows at a time.

``--calib self`` samples from the float model over its mapped bf16 weights (no copy). On a CPU without bf16 dot
products (no AVX512-BF16, no AMX: e.g. AVX2-only edge CPUs) PyTorch emulates bf16 GEMMs, ~19 GFLOP/s on 2 Zen 3
cores; fp32 GEMMs run 2-5x faster but need fp32 weights, and a cast copy of the model doubles its bytes. This
forward casts one block of ``rows`` weight rows at a time into a reused fp32 buffer that stays in cache
(``CHUNK_BYTES``), so the weights are read once, as bf16, and the arithmetic is fp32 GEMM's:

    x: [..., K] bf16, W: [N, K] bf16, b: [N] or None
    for each block r = a..a+rows:   Y32[r] = float(W[r]) @ float(x)^T       (fp32 accumulation)
    y = bf16(Y32^T + float(b))                                              (one rounding, as a bf16 GEMM's output)

The casts bf16 -> fp32 are exact, so the result differs from PyTorch's bf16 linear (fp32 accumulation, one rounding
at the output) only by the order of the fp32 sums: at most about one bf16 ulp, on a few outputs. Worked example:
x = [1, 2], W = [[0.5, 0.25], [3, -1]], b = [0, 1] -> Y32 = [1.0, 1.0], y = bf16([1.0, 2.0]).

Measured on 2 AMD Zen 3 cores (docs/gptq.md, "Compute dtype"): a 32 x 2048 by 128,256 x 2048 head (Llama-3.2-1B's)
957 ms in bf16, 471 ms in fp32 (its 1 GB of fp32 weights streamed), 238 ms this way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_BYTES = 4 << 20  # fp32 weight rows cast per block: inside the L2/L3 of one core complex (tuned on Zen 3)


def rows_per_chunk(k: int) -> int:
    """Weight rows per block: ``CHUNK_BYTES`` of fp32, at least 16 (K = 2048: 512 rows; K = 8192: 128)."""
    return max(16, CHUNK_BYTES // (4 * k))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bf16 ``x`` [..., K] and ``weight`` [N, K], computed in fp32 by row blocks
    (module docstring); returns bf16 [..., N]. Inference only (no autograd graph). Other dtypes go to ``F.linear``
    unchanged."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return F.linear(x, weight, bias)
    with torch.no_grad():
        return _linear(x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    xt = x.reshape(-1, k).to(torch.float32).t()  # [K, M]; rows of the fp32 result are output features
    y = torch.empty(n, xt.shape[1], dtype=torch.float32)
    step = rows_per_chunk(k)
    buf = torch.empty(min(step, n), k, dtype=torch.float32)
    for a in range(0, n, step):
        b = min(n, a + step)
        w = buf[: b - a]
        w.copy_(weight[a:b])
        torch.mm(w, xt, out=y[a:b])
    if bias is not None:
        y += bias.to(torch.float32).unsqueeze(1)
    out = torch.empty(xt.shape[1], n, dtype=torch.bfloat16)
    out.copy_(y.t())
    return out.reshape(*x.shape[:-1], n)


def upcast_linears(model: nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` through :func:`linear` (an instance attribute, so only this model
    changes); returns how many. For a model that is thrown away afterwards (the sampling model)."""
    count = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.forward = _bound(m)
            count += 1
    return count


def _bound(m: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, m.weight, m.bias)
    return forward
