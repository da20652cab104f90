"""Round-to-nearest with tinygemm's asymmetric uint4 and a float zero point; three ways to choose (scale, zero).

For each group of G consecutive input channels of each output row (weight w [N, K], groups along K)::

    scale = (hi - lo) / 15            zero = lo + 8 * scale           (both rounded to bf16, as stored)
    q     = clamp(round((w - (zero - 8 * scale)) / scale), 0, 15)     w_hat = (q - 8) * scale + zero

- ``method="minmax"``: ``[lo, hi]`` is the group's min/max;
- ``method="clip"`` (the default until the least-squares search; checkpoints from then say "rtn"): that range shrunk about its centre by the ratio from
  :data:`CLIP_RATIOS` that gives the least squared reconstruction error for that group;
- ``method="rtn"`` (the default): the least-squares (scale, zero) search of :func:`edgeq.quantize.search.lsq_search`
  (candidate steps, a closed-form affine refit of the codes, bf16 rounding, Lloyd refinement) with the min/max and
  every clipping pair as further candidates, so per group it is never worse than ``clip`` nor ``minmax``.

Worked example (G = 4, one group, min/max): w = [-1.0, 0.0, 0.5, 2.0]; lo = -1, hi = 2; scale = 0.2 -> bf16
0.2001953125, zero = -1 + 8 * scale = 0.6015625 (bf16); (w - zero) / scale = [-8.00, -3.00, -0.51, 6.99], so
q = [0, 5, 7, 15] and w_hat = [-1.0000, 0.0010, 0.4014, 2.0029]. (Before bf16 rounding 0.5 would sit exactly on a
rounding tie; rounding the parameters first is what makes q agree with the stored values.)

The scale and zero are rounded to bf16 *before* q is computed, so the stored parameters are exactly the ones q was
chosen for. A constant group (hi == lo) gets the smallest positive scale and q = 8, w_hat = zero = lo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeq.errors import EdgeqError
from edgeq.quantize import search

CLIP_RATIOS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76, 0.73, 0.70)
METHODS = ("rtn", "clip", "minmax")
CHUNK_ELEMENTS = 1 << 19  # values per searched block (2 MiB of fp32); the block size was measured: docs/results.md


@dataclass(frozen=True)
class QuantizedTensor:
    """One quantised weight in tinygemm terms.

    q: uint8 [N, K] values 0..15; scales_and_zeros: bf16 [K/G, N, 2] (scale, zero); sq_error: float64 [N]
    sum over K of (w - w_hat)^2 per row, sq_norm: float64 [N] sum of w^2 per row (for relative error).
    """

    q: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    sq_error: torch.Tensor
    sq_norm: torch.Tensor

    @property
    def relative_error(self) -> float:
        """||w - w_hat||_F / ||w||_F over the whole tensor."""
        norm = float(self.sq_norm.sum())
        return (float(self.sq_error.sum()) / norm) ** 0.5 if norm > 0 else 0.0


def quantize_groups(w: torch.Tensor, group_size: int, method: str = "rtn", name: str = "weight") -> QuantizedTensor:
    """Quantise a float weight [N, K] (any float dtype) to tinygemm uint4 with per-(row, group) scale and zero.

    Memory: a few fp32 copies of ``w``; callers pass row blocks of a large tensor to bound it.
    """
    if method not in METHODS:
        raise EdgeqError(f"unknown method {method!r}; valid: {', '.join(METHODS)} (gptq with --method gptq)")
    if w.dim() != 2 or not w.is_floating_point():
        raise EdgeqError(f"{name}: expected a 2-D float weight, got {w.dtype} {list(w.shape)}")
    n, k = w.shape
    if k % group_size:
        raise EdgeqError(f"{name} {list(w.shape)}: K={k} is not a multiple of the group size {group_size}")
    wf = w.to(torch.float32).reshape(n, k // group_size, group_size)
    if not bool(torch.isfinite(wf).all()):
        bad = int((~torch.isfinite(wf)).sum())
        raise EdgeqError(f"{name}: {bad} NaN/Inf value(s) in the weights; fix or re-export the checkpoint")
    best_scale, best_zero = choose_params(wf, method)
    best = search.codes(wf, best_scale, best_zero)
    best_err = search.weighted_error(wf, best, best_scale, best_zero, None)
    sz = torch.stack((best_scale[..., 0], best_zero[..., 0]), dim=-1)  # [N, K/G, 2]
    return QuantizedTensor(
        q=best.reshape(n, k).to(torch.uint8),
        scales_and_zeros=sz.transpose(0, 1).contiguous().to(torch.bfloat16),
        group_size=group_size,
        sq_error=best_err[..., 0].sum(-1).to(torch.float64),
        sq_norm=wf.square().sum((-1, -2)).to(torch.float64),
    )


def _clip_candidates(wf: torch.Tensor, ratios) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """bf16 (scale, zero) of the group's [min, max] shrunk about its centre by each ratio."""
    lo, hi = wf.amin(-1, keepdim=True), wf.amax(-1, keepdim=True)
    centre, half = (hi + lo) / 2, (hi - lo) / 2
    return [search.minmax_params(centre - r * half, centre + r * half) for r in ratios]


def choose_params(wf: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group bf16 (scale, zero) fp32 [R, Gc, 1] of the groups ``wf`` fp32 [R, Gc, G] for ``method``; every
    method's first candidate is min/max, and ties keep it. GPTQ uses it too, on each group's error-updated values.

    Rows are searched in blocks of about CHUNK_ELEMENTS values: each group's choice depends on its own values only,
    so the blocks give the same bits as one pass, and a block's ~40 candidate passes stay in the core's cache
    (a 2048 x 8192 weight at g128 on 2 Zen 3 cores, with the in-place search: 1.4 s in blocks, 2.6 s in one pass;
    benchmarks/bench_search.py).
    """
    rows = max(1, CHUNK_ELEMENTS // max(1, wf.shape[1] * wf.shape[2]))
    if wf.shape[0] <= rows:
        return _choose(wf, method)
    parts = [_choose(block, method) for block in wf.split(rows)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _choose(wf: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    candidates = _clip_candidates(wf, CLIP_RATIOS if method != "minmax" else (1.0,))
    if method == "rtn":
        return search.lsq_search(wf, None, extra=tuple(candidates[1:]))
    best = search.Best(wf, None, *candidates[0])
    for scale, zero in candidates[1:]:
        best.offer(scale, zero)
    return best.scale, best.zero
