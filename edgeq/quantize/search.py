"""Data-free (scale, zero) searches for tinygemm's affine uint4 groups: ``w_hat = (q - 8) * scale + zero``.

Every function here works on groups shaped ``[R, Gc, G]`` (fp32) and returns bf16-representable fp32 parameters
shaped ``[R, Gc, 1]``; the codes are always recomputed from the *stored* (bf16) parameters by :func:`codes`, so
what a search measures is what the checkpoint holds.

``lsq_search`` -- a weighted least-squares search in the spirit of llama.cpp's k-quant search (``make_qkx2_quants``;
the idea, not its code). For candidate steps ``(hi - lo) / (15 + d)``, d in ``-1, -0.9, ..., +1``, the codes
``L = round((w - lo) / step)`` are fixed and the affine map that fits them best is solved in closed form::

    minimise  sum_i c_i (s * L_i + m - w_i)^2   ->   D = S_c * S_LL - S_L^2
              s = (S_c * S_Lw - S_L * S_w) / D,     m = (S_LL * S_w - S_L * S_Lw) / D

(S_c = sum c_i, S_L = sum c_i L_i, S_LL = sum c_i L_i^2, S_w = sum c_i w_i, S_Lw = sum c_i L_i w_i). In tinygemm
terms scale = s and zero = m + 8 s. Both are rounded to bf16 (the zero refitted as ``(S_w - scale S_L) / S_c`` after
the scale is rounded, which the rounding otherwise shifts), the codes recomputed for the rounded pair, a few
refit/re-round rounds run on the best candidate, and per group the pair with the least weighted error is kept. The
min/max pair is a candidate, so the result is never worse than min/max on the group's weighted error.

Weights ``c`` (no calibration data): ``c_i = rms(w) + |w_i|`` per group, llama.cpp's choice for Q4_K without an
importance matrix (large weights matter more to a layer's output than small ones), or uniform.

``hqq_zero`` -- half-quadratic optimisation of the zero point for a fixed min/max scale (HQQ's
``optimize_weights_proximal``, re-derived): alternate ``q = round(w / s + z)`` with an l_p (p < 1) shrinkage of the
residual ``e = shrink(w - (q - z) s)`` and the closed-form ``z = mean(q - (w - e) / s)``. Kept for comparison.
"""

from __future__ import annotations

import torch

STEP_OFFSETS = tuple(-1.0 + 0.1 * i for i in range(21))  # candidate steps (hi - lo) / (15 + d)
REFINE_ROUNDS = 3
_MIN_SCALE = 2.0**-24


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest bf16 value, kept in fp32."""
    return x.to(torch.bfloat16).to(torch.float32)


def codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q = clamp(round((w - zero) / scale) + 8, 0, 15) (fp32), the nearest level for the stored pair."""
    return (torch.round((w - zero) / scale) + 8.0).clamp_(0.0, 15.0)


def weighted_error(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   c: torch.Tensor | None) -> torch.Tensor:
    """sum_i c_i ((q_i - 8) scale + zero - w_i)^2 per group, [R, Gc, 1]; ``c`` None: uniform (c_i = 1)."""
    e = ((q - 8.0) * scale + zero - w).square_()
    return (e if c is None else c * e).sum(-1, keepdim=True)


def importance(w: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-weight error weights without data: "rms_abs" (rms of the group + |w|) or "uniform"."""
    if kind == "uniform":
        return torch.ones_like(w)
    if kind == "rms_abs":
        return w.square().mean(-1, keepdim=True).sqrt() + w.abs()
    raise ValueError(f"unknown importance {kind!r}")


def minmax_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (scale, zero) mapping [lo, hi] onto 0..15: scale = (hi - lo) / 15, zero = lo + 8 scale."""
    scale = bf16(((hi - lo) / 15.0).clamp_min(_MIN_SCALE))
    return scale, bf16(lo + 8.0 * scale)


def lsq_fit(w: torch.Tensor, q: torch.Tensor, c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bf16 (scale, zero) that best fit fixed codes ``q`` in the c-weighted least-squares sense.

    Returns (scale, zero, ok); ``ok`` is False where the fit is degenerate (one distinct code, or a slope <= 0), and
    the caller must not use those groups' values. ``c`` None: uniform weights, the same sums without the products
    by 1.0 (exact in fp32, so the same bits as ``torch.ones_like(w)``, and ~2x faster).
    """
    L = q - 8.0  # fit w ~ s * L + zero directly: zero is the intercept at L = 0
    cl = L if c is None else c * L
    s_c = torch.full_like(w[..., :1], w.shape[-1]) if c is None else c.sum(-1, keepdim=True)
    s_l = cl.sum(-1, keepdim=True)
    s_ll = (cl * L).sum(-1, keepdim=True)
    s_w = (w if c is None else c * w).sum(-1, keepdim=True)
    s_lw = (cl * w).sum(-1, keepdim=True)
    return _closed_form(s_c, s_l, s_ll, s_w, s_lw)


def _closed_form(s_c, s_l, s_ll, s_w, s_lw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, zero, ok) from the five sums of :func:`lsq_fit` (all [R, Gc, 1])."""
    det = s_c * s_ll - s_l * s_l
    ok = det > 1e-12 * s_c * s_ll.clamp_min(1e-30)
    safe = torch.where(ok, det, torch.ones_like(det))
    slope = (s_c * s_lw - s_l * s_w) / safe
    ok = ok & (slope > _MIN_SCALE)
    scale = bf16(slope.clamp_min(_MIN_SCALE))
    zero = bf16((s_w - scale * s_l) / s_c.clamp_min(1e-30))  # refit the intercept for the rounded slope
    return scale, zero, ok


class Best:
    """The per-group best (scale, zero, error) seen so far; strict improvement only, so earlier candidates win ties."""

    def __init__(self, w: torch.Tensor, c: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor):
        self.w, self.c = w, c
        self.scale, self.zero = scale, zero
        self.err = weighted_error(w, codes(w, scale, zero), scale, zero, c)

    def offer(self, scale: torch.Tensor, zero: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        err = weighted_error(self.w, codes(self.w, scale, zero), scale, zero, self.c)
        better = err < self.err
        if ok is not None:
            better &= ok
        self.scale = torch.where(better, scale, self.scale)
        self.zero = torch.where(better, zero, self.zero)
        self.err = torch.where(better, err, self.err)


class _Work:
    """One search's scratch space over the groups ``w`` [R, Gc, G]: two buffers of w's size, reused by every
    candidate, and the sums that do not depend on the codes (S_c, S_w).

    The candidates' codes, fits and errors are the very same fp32 operations as :func:`codes`, :func:`lsq_fit` and
    :func:`weighted_error`, in the same order, written into the buffers in place (so the same bits; the tests compare
    with those functions). Why: each of the ~40 candidates otherwise allocates about a dozen temporaries of w's size,
    and glibc serves a 2 MiB block by mmap and returns it by munmap, so every temporary page-faults afresh (a 2048 x
    8192 weight at g128 on 2 Zen 3 cores: 9.4 s, or 1.9 s when the allocator happens to keep them, against 1.2 s in
    place; benchmarks/bench_search.py).
    """

    def __init__(self, w: torch.Tensor, c: torch.Tensor | None):
        self.w, self.c = w, c
        self.a, self.b = torch.empty_like(w), torch.empty_like(w)
        self.s_c = torch.full_like(w[..., :1], w.shape[-1]) if c is None else c.sum(-1, keepdim=True)
        self.s_w = (w if c is None else c * w).sum(-1, keepdim=True)

    def codes(self, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """:func:`codes` into buffer a."""
        a = torch.sub(self.w, zero, out=self.a).div_(scale).round_().add_(8.0)
        return a.clamp_(0.0, 15.0)

    def error(self, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """:func:`weighted_error` of the pair's codes, [R, Gc, 1] (buffer a is spent)."""
        e = self.codes(scale, zero).sub_(8.0).mul_(scale).add_(zero).sub_(self.w).square_()
        return (e if self.c is None else e.mul_(self.c)).sum(-1, keepdim=True)

    def fit(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`lsq_fit` of the codes ``q`` (buffer a, spent)."""
        L = q.sub_(8.0)
        if self.c is None:
            s_l = L.sum(-1, keepdim=True)
            s_ll = torch.mul(L, L, out=self.b).sum(-1, keepdim=True)
            s_lw = torch.mul(L, self.w, out=self.b).sum(-1, keepdim=True)
        else:
            s_l = torch.mul(self.c, L, out=self.b).sum(-1, keepdim=True)
            s_ll = self.b.mul_(L).sum(-1, keepdim=True)
            s_lw = torch.mul(self.c, L, out=self.b).mul_(self.w).sum(-1, keepdim=True)
        return _closed_form(self.s_c, s_l, s_ll, self.s_w, s_lw)


def lsq_search(w: torch.Tensor, c: torch.Tensor | None, offsets=STEP_OFFSETS, rounds: int = REFINE_ROUNDS,
               extra: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Least c-weighted-error bf16 (scale, zero) per group of ``w`` [R, Gc, G] (see the module docstring).

    ``extra``: more candidate pairs (already bf16) to consider, e.g. a clipping search's. ``c`` None: uniform.
    The same choice as offering every candidate to :class:`Best` (strict improvement, earlier wins ties), computed in
    place (:class:`_Work`).
    """
    work = _Work(w, c)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zero = minmax_params(lo, hi)
    err = work.error(scale, zero)

    def offer(s: torch.Tensor, z: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        nonlocal scale, zero, err
        e = work.error(s, z)
        better = e < err if ok is None else (e < err) & ok
        scale, zero, err = torch.where(better, s, scale), torch.where(better, z, zero), torch.where(better, e, err)

    for s, z in extra:
        offer(s, z)
    span = (hi - lo).clamp_min(_MIN_SCALE)
    for d in offsets:
        q = torch.sub(w, lo, out=work.a).mul_((15.0 + d) / span).round_().clamp_(0.0, 15.0)
        offer(*work.fit(q))
    for _ in range(rounds):  # Lloyd-style: codes for the best pair, then the best pair for those codes
        offer(*work.fit(work.codes(scale, zero)))
    return scale, zero


def hqq_zero(w: torch.Tensor, c: torch.Tensor, iters: int = 20, p: float = 0.7, beta: float = 10.0,
             kappa: float = 1.01) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max scale, zero point by half-quadratic (proximal l_p) optimisation; best of it and min/max by c-error."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    best = Best(w, c, *minmax_params(lo, hi))
    scale = best.scale
    z = 8.0 - best.zero / scale  # HQQ's zero in code units: w ~ (q - z) * scale
    for _ in range(iters):
        q = (torch.round(w / scale + z)).clamp_(0.0, 15.0)
        r = w - (q - z) * scale
        e = torch.sign(r) * torch.relu(r.abs() - (1.0 / beta) * r.abs().clamp_min(1e-12).pow(p - 1))
        z = (q - (w - e) / scale).mean(-1, keepdim=True)
        beta *= kappa
        best.offer(scale, bf16((8.0 - z) * scale))
    return best.scale, best.zero
