"""Round-to-nearest with tinygemm's asymmetric uint4 and a float zero point, plus a per-group clipping search.

For each group of G consecutive input channels of each output row (weight w [N, K], groups along K)::

    scale = (hi - lo) / 15            zero = lo + 8 * scale           (both rounded to bf16, as stored)
    q     = clamp(round((w - (zero - 8 * scale)) / scale), 0, 15)     w_hat = (q - 8) * scale + zero

with ``[lo, hi]`` the group's min/max (``method="minmax"``), or that range shrunk about its centre by the ratio
from :data:`CLIP_RATIOS` that gives the least squared reconstruction error for that group (``method="rtn"``, the
default). Ratio 1.0 is in the grid, so the search is never worse than min/max for any group.

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

CLIP_RATIOS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76, 0.73, 0.70)
METHODS = ("rtn", "minmax")
_MIN_SCALE = 2.0**-24  # smallest positive normal-ish step: bf16 represents it exactly


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


def _params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16-rounded (scale, zero) in fp32 for ranges [lo, hi]."""
    scale = ((hi - lo) / 15.0).clamp_min(_MIN_SCALE).to(torch.bfloat16).to(torch.float32)
    zero = (lo + 8.0 * scale).to(torch.bfloat16).to(torch.float32)
    return scale, zero


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q = clamp(round((w - zero) / scale) + 8, 0, 15), shapes [R, Gc, G] / [R, Gc, 1]."""
    return (torch.round((w - zero) / scale) + 8.0).clamp_(0.0, 15.0)


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
    lo, hi = wf.amin(-1, keepdim=True), wf.amax(-1, keepdim=True)
    ratios = CLIP_RATIOS if method == "rtn" else (1.0,)
    centre, half = (hi + lo) / 2, (hi - lo) / 2
    best = best_scale = best_zero = best_err = None
    for r in ratios:
        scale, zero = _params(centre - r * half, centre + r * half)
        q = _round(wf, scale, zero)
        err = ((q - 8.0) * scale + zero - wf).square_().sum(-1, keepdim=True)
        if best is None:
            best, best_scale, best_zero, best_err = q, scale, zero, err
            continue
        better = err < best_err  # strict: ties keep the earlier (wider) range, so minmax wins ties
        best = torch.where(better, q, best)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_err = torch.where(better, err, best_err)
    sz = torch.stack((best_scale[..., 0], best_zero[..., 0]), dim=-1)  # [N, K/G, 2]
    return QuantizedTensor(
        q=best.reshape(n, k).to(torch.uint8),
        scales_and_zeros=sz.transpose(0, 1).contiguous().to(torch.bfloat16),
        group_size=group_size,
        sq_error=best_err[..., 0].sum(-1).to(torch.float64),
        sq_norm=wf.square().sum((-1, -2)).to(torch.float64),
    )
