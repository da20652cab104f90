"""W4A8 math: uint4 weights with integer zero points, per-token int8 activations, and an exact fp32 FMA.

Weights (per group of G consecutive input channels along K, per output row n; w float [N, K])::

    w[n, k] ~= (q[n, k] - z[g, n]) * s[g, n]        g = k // G,  q in 0..15,  z integer in 0..15,  s fp32 > 0

For a group with range [lo, hi] widened to contain 0 (lo <= 0 <= hi, so the zero point is an integer in 0..15 and
w = 0 is exact), shrunk towards 0 by a ratio r::

    s = max(r * (hi - lo) / 15, tiny)      z = clamp(round(-r * lo / s), 0, 15)      q = clamp(round(w / s) + z, 0, 15)

``method="minmax"`` uses r = 1; ``method="rtn"`` (default) tries every r in :data:`CLIP_RATIOS` and keeps, per
(group, row), the one with the least squared reconstruction error sum_k ((q - z) * s - w)^2 (computed in float64).
Ratio 1.0 is tried first and only a strictly smaller error replaces it, so the search is never worse than min/max.

Worked example (G = 4, min/max): w = [-1.0, 0.0, 0.5, 2.0]; lo = -1, hi = 2; s = 0.2 (fp32 0.200000003),
z = round(5.0) = 5; w / s = [-5, 0, 2.5, 10] -> round half even [-5, 0, 2, 10] -> q = [0, 5, 7, 15];
w_hat = (q - 5) * s = [-1.0, 0.0, 0.4, 2.0].

Activations (the kernel's rule, per token row of x [M, K], all in fp32)::

    amax = max(max_k |x[m, k]|, 1e-7)     q_a = round_half_even(x * (127 / amax))     s_a = amax / 127

``127 / amax`` and ``amax / 127`` are each one IEEE division (not a reciprocal times 127). Example: x = [0.5, 1.0,
-2.0, 0.25] (amax 2, 127/amax = 63.5): x * 63.5 = [31.75, 63.5, -127, 15.875] -> q_a = [32, 64, -127, 16]
(63.5 is a tie and goes to the even 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeq.errors import EdgeqError

GROUP_SIZES = (32, 64, 128)
METHODS = ("rtn", "minmax")
CLIP_RATIOS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76, 0.73, 0.70)  # same grid as W4A16 (rtn.py)
ACT_EPS = 1e-7  # the kernel's floor on amax, as fp32
_TINY = torch.finfo(torch.float32).tiny  # scale of an all-zero group: keeps w / s finite, dequantises to 0
_ROW_BLOCK_ELEMENTS = 1 << 18  # weights per pass: temporaries of 1-2 MB (cache-sized), whatever N is


@dataclass(frozen=True)
class W4A8Weights:
    """One quantised weight: q uint8 [N, K] (0..15), scales fp32 [K/G, N], zeros int8 [K/G, N] (0..15)."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


def _check_weight(w: torch.Tensor, group_size: int, name: str) -> None:
    if group_size not in GROUP_SIZES:
        raise EdgeqError(f"{name}: W4A8 group size {group_size} is not supported; use one of {GROUP_SIZES}")
    if w.dim() != 2 or not w.is_floating_point():
        raise EdgeqError(f"{name}: expected a 2-D float weight [N, K], got {w.dtype} {list(w.shape)}")
    if w.shape[1] % group_size:
        raise EdgeqError(
            f"{name} {list(w.shape)}: K={w.shape[1]} is not a multiple of the group size {group_size}; "
            f"use a group size dividing K or keep the module in bf16"
        )


def _check_finite(wf: torch.Tensor, name: str, row0: int) -> None:
    bad = ~torch.isfinite(wf)
    if bool(bad.any()):
        first = int(bad.reshape(wf.shape[0], -1).any(-1).nonzero()[0]) + row0
        raise EdgeqError(
            f"{name}: NaN/Inf in the weight (first at row {first}; {int(bad.sum())} in rows {row0}..{row0 + wf.shape[0] - 1}); "
            "fix or re-export the checkpoint"
        )


def _params(lo: torch.Tensor, hi: torch.Tensor, r: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, z) as fp32 for the range [r * lo, r * hi], lo <= 0 <= hi; shapes [R, Gc, 1]."""
    s = ((hi - lo) * r / 15.0).clamp_min_(_TINY)
    z = torch.round(-(lo * r) / s).clamp_(0.0, 15.0)
    return s, z


def _levels(wf: torch.Tensor, s: torch.Tensor, z: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """q - z = clamp(round(w / s) + z, 0, 15) - z as fp32 (small integers, exact)."""
    q = torch.div(wf, s, out=out).round_().add_(z).clamp_(0.0, 15.0)
    return q.sub_(z)


def _sq_error(w64: torch.Tensor, qz: torch.Tensor, s: torch.Tensor, d64: torch.Tensor | None = None) -> torch.Tensor:
    """sum over the group of ((q - z) * s - w)^2 in float64, where (q - z) * s is exact; shape [R, Gc]."""
    d = d64.copy_(qz) if d64 is not None else qz.double()
    return d.mul_(s.double()).sub_(w64).square_().sum(-1)


def _quantize_block(wf: torch.Tensor, ratios: tuple[float, ...]):
    """wf fp32 [R, Gc, G] -> (q [R, Gc, G], s [R, Gc, 1], z [R, Gc, 1]) as fp32.

    Only the per-group (s, z) of the best ratio so far is kept; q is recomputed once for the winners.
    """
    lo = wf.amin(-1, keepdim=True).clamp_(max=0.0)
    hi = wf.amax(-1, keepdim=True).clamp_(min=0.0)
    w64 = wf.double()
    qz, d64 = torch.empty_like(wf), torch.empty_like(w64)
    best_s, best_z = _params(lo, hi, ratios[0])
    best_err = _sq_error(w64, _levels(wf, best_s, best_z, qz), best_s, d64)
    for r in ratios[1:]:
        s, z = _params(lo, hi, r)
        err = _sq_error(w64, _levels(wf, s, z, qz), s, d64)
        better = err < best_err  # strict: ties keep the earlier (wider) range, so min/max wins ties
        best_err = torch.where(better, err, best_err)
        better = better.unsqueeze(-1)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return _levels(wf, best_s, best_z, qz).add_(best_z), best_s, best_z


def quantize_w4a8(
    w: torch.Tensor,
    group_size: int = 128,
    *,
    name: str = "weight",
    method: str = "rtn",
    ratios: tuple[float, ...] = CLIP_RATIOS,
    row_block: int | None = None,
) -> W4A8Weights:
    """Quantise a float weight [N, K] (any float dtype) to W4A8's uint4 + integer zero point + fp32 scale.

    Rows are processed ``row_block`` at a time (default: ~2M weights per pass), so temporaries stay bounded for a
    150k x 2k head; the outputs (q: N*K bytes, scales/zeros: 5*N*K/G bytes) are the only full-size allocations.
    """
    if method not in METHODS:
        raise EdgeqError(f"{name}: unknown method {method!r}; valid: {', '.join(METHODS)}")
    _check_weight(w, group_size, name)
    if method == "minmax":
        ratios = (1.0,)
    elif not ratios or ratios[0] != 1.0:
        raise EdgeqError(f"{name}: the clipping grid must start with 1.0 (plain min/max), got {ratios}")
    n, k = w.shape
    gc = k // group_size
    rows = row_block or max(1, _ROW_BLOCK_ELEMENTS // k)
    q_out = torch.empty(n, k, dtype=torch.uint8)
    s_out = torch.empty(gc, n, dtype=torch.float32)
    z_out = torch.empty(gc, n, dtype=torch.int8)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        wf = w[r0:r1].to(torch.float32).reshape(r1 - r0, gc, group_size)
        _check_finite(wf, name, r0)
        q, s, z = _quantize_block(wf, ratios)
        q_out[r0:r1] = q.reshape(r1 - r0, k).to(torch.uint8)
        s_out[:, r0:r1] = s[..., 0].t()
        z_out[:, r0:r1] = z[..., 0].t().to(torch.int8)
    return W4A8Weights(q=q_out, scales=s_out, zeros=z_out, group_size=group_size)


def dequantize_w4a8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, dtype=torch.float32):
    """(q - z) * s broadcast per group: q [N, K], scales/zeros [K/G, N] -> [N, K] (exact in float64, then cast)."""
    qz = q.to(torch.float64) - zeros.t().to(torch.float64).repeat_interleave(group_size, dim=1)
    return (qz * scales.t().to(torch.float64).repeat_interleave(group_size, dim=1)).to(dtype)


def group_sq_error(w: torch.Tensor, qw: W4A8Weights) -> torch.Tensor:
    """float64 [K/G, N]: sum over each group of ((q - z) * s - w)^2, the quantity the clipping search minimises."""
    n, k = w.shape
    g = qw.group_size
    w64 = w.to(torch.float32).double().reshape(n, k // g, g)
    qz = qw.q.to(torch.float32).reshape(n, k // g, g) - qw.zeros.t().to(torch.float32).unsqueeze(-1)
    return _sq_error(w64, qz, qw.scales.t().unsqueeze(-1)).t()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's per-token symmetric int8 quantisation: x bf16/fp32 [M, K] -> (q_a int8 [M, K], s_a fp32 [M]).

    Every step is one IEEE fp32 operation, as in the kernel: |x| and max are exact; ``127 / amax`` one division;
    ``x * inv`` one rounded multiply; torch.round is round-half-to-even (the kernel's ``roundscale`` to nearest).
    |x * inv| <= 127 * (1 + 2^-23), so q_a is in -127..127 and no clamp is needed.
    """
    xf = x.to(torch.float32)
    amax = torch.maximum(xf.abs().amax(-1), torch.tensor(ACT_EPS, dtype=torch.float32))
    c127 = torch.tensor(127.0, dtype=torch.float32)
    inv = c127 / amax
    q = torch.round(xf * inv.unsqueeze(-1)).to(torch.int8)
    return q, amax / c127


# --- exact fp32 fused multiply-add ---------------------------------------------------------------------------------
# fma(a, b, c) = round_fp32(a * b + c) with ONE rounding. a * b of two fp32 values is exact in float64 (48 <= 53 bits),
# but the float64 sum p + c can round, and rounding twice (to float64, then to fp32) differs from one rounding exactly
# when the float64 sum s lands on a midpoint between two fp32 neighbours while the exact sum S is not on it (there is
# no float64 number strictly between S and s, and fp32 values and midpoints are float64 numbers, so any other
# disagreement is impossible). Those elements are found by their bits (normal range: the 29 low mantissa bits are
# 1000...0; at or below 2^-126, where fp32 is subnormal, every element is re-checked) and re-rounded from the exact
# error of the sum (TwoSum) by rounding to odd: s is moved one float64 step towards S when S != s and s is even,
# after which round-to-nearest to fp32 is correct (round-to-odd with >= 2 extra bits, Boldo & Melquiond 2008).

_MID_MASK = (1 << 29) - 1
_MID_BITS = 1 << 28
_SMALL_BITS = 0x3810000000000000  # float64 bits of 2^-126, the smallest normal fp32


def _fix_ties(s: torch.Tensor, p: torch.Tensor, c: torch.Tensor) -> None:
    """In place: make round_fp32(s) == round_fp32(p + c) where the float64 sum s = fl64(p + c) sits on a tie."""
    bits = s.view(torch.int64)
    hazard = (bits & _MID_MASK) == _MID_BITS
    hazard |= (bits & 0x7FFFFFFFFFFFFFFF) <= _SMALL_BITS
    if not bool(hazard.any()):
        return
    idx = hazard.reshape(-1).nonzero().squeeze(1)
    sf, pf = s.reshape(-1), p.reshape(-1)
    cv = c.expand_as(s).reshape(-1)[idx].to(torch.float64)
    pv, sv = pf[idx], sf[idx]
    bb = sv - pv
    err = (pv - (sv - bb)) + (cv - bb)  # TwoSum: pv + cv == sv + err exactly
    even = (sv.view(torch.int64) & 1) == 0
    towards = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64)
    sf[idx] = torch.where((err != 0) & even, torch.nextafter(sv, towards), sv)


def fma_into(a: torch.Tensor, b64: torch.Tensor, c: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> None:
    """c <- fma(a, b, c) in place, exactly rounded once to fp32.

    a fp32 [M, N]; b64 the fp32 values of b held as float64 (broadcastable); c fp32 [M, N] (updated);
    p, s float64 [M, N] scratch.
    """
    torch.mul(a, b64, out=p)  # exact
    torch.add(p, c, out=s)
    _fix_ties(s, p, c)
    c.copy_(s)  # round to nearest even


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """round_fp32(a * b + c) with a single rounding, elementwise with broadcasting; a, b, c fp32."""
    a, b, c = torch.broadcast_tensors(a.to(torch.float32), b.to(torch.float32), c.to(torch.float32))
    out = c.clone()
    p, s = torch.empty(out.shape, dtype=torch.float64), torch.empty(out.shape, dtype=torch.float64)
    fma_into(a, b.to(torch.float64), out, p, s)
    return out
