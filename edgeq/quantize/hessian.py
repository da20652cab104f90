"""The Hessian side of GPTQ: accumulating ``H = 2/n * X^T X`` over calibration tokens, and what the column sweep
needs from it (dead channels, the act-order permutation, the damped inverse's upper Cholesky factor).

Shapes: H float32 [K, K] for a linear input of width K; the factor U fp32 [K, K], ``H_damped^-1 = U^T U``.
Worked example: H = 2 I (unit-variance, uncorrelated inputs), damp 0.01 -> H_damped = 2.02 I, U = I / sqrt(2.02).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeq.errors import EdgeqError


class HessianAccumulator:
    """Running ``H = 2/n * X^T X`` over calibration tokens for one linear input of width K.

    The sum is kept in float32: its relative rounding error after B batches is about B * 2^-24 (1e-5 for 128
    batches), three orders below the 1 % dampening GPTQ adds anyway, and fp32 halves the memory of an fp64
    accumulator (4 K^2 bytes: 320 MB at K = 8960). bf16 activations widen to fp32 exactly.
    """

    def __init__(self, k: int, name: str = "input"):
        self.k = int(k)
        self.name = name
        self.n = 0
        self._sum = torch.zeros(self.k, self.k, dtype=torch.float32)

    def add(self, x: torch.Tensor) -> None:
        """Add tokens ``x [..., K]`` (any float dtype)."""
        if x.shape[-1] != self.k:
            raise EdgeqError(f"{self.name}: calibration input has {x.shape[-1]} features, the Hessian expects K={self.k}")
        x2 = x.detach().reshape(-1, self.k).to(torch.float32)
        if x2.shape[0]:
            self._sum.addmm_(x2.t(), x2)
            self.n += x2.shape[0]

    def hessian(self) -> torch.Tensor:
        """float32 [K, K] ``2/n * sum x x^T``."""
        if self.n == 0:
            raise EdgeqError(f"{self.name}: no calibration tokens reached this layer; check the calibration data")
        return self._sum * (2.0 / self.n)


def _inverse_upper(r: torch.Tensor, leaf: int = 512) -> torch.Tensor:
    """The inverse of an upper-triangular ``r`` [n, n] (positive diagonal) by halves::

        [[A, B], [0, D]]^-1 = [[A^-1, -A^-1 B D^-1], [0, D^-1]]

    with the off-diagonal block from two triangular solves (n^3/8 flops each) and the halves recursively: about
    n^3/3 flops in all, where one solve against the identity costs n^3 (torch has no triangular inverse). K = 8192
    on 2 Zen 3 cores: 3.3 s instead of 7.4 s, the same accuracy (max error 6.0e-8 vs 5.9e-8 of max |U|, fp32).
    """
    n = r.shape[0]
    if n <= leaf:
        return torch.linalg.solve_triangular(r, torch.eye(n, dtype=r.dtype), upper=True)
    m = n // 2 if n < 128 else n // 2 // 64 * 64  # 0 < m < n; whole 64-column panels where there are any
    a, b, d = r[:m, :m], r[:m, m:], r[m:, m:]
    out = torch.zeros_like(r)
    out[:m, :m] = _inverse_upper(a, leaf)
    out[m:, m:] = _inverse_upper(d, leaf)
    y = torch.linalg.solve_triangular(d, b, upper=True, left=False)  # B D^-1
    out[:m, m:] = torch.linalg.solve_triangular(a, y, upper=True).neg_()
    return out


def _inverse_cholesky(h: torch.Tensor, damp: float, name: str) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + d*mean(diag H)*I)^-1 (fp32) and the relative damping d that worked.

    Without forming the inverse: with J the reversal matrix, J H J = L L^T gives H = R R^T with R = J L J upper
    triangular, so H^-1 = (R^-1)^T R^-1 and U = R^-1 (positive diagonal, hence the Cholesky factor). One Cholesky
    and one triangular inverse (:func:`_inverse_upper`) instead of a Cholesky, an inverse and a second Cholesky.
    """
    mean = float(h.diagonal().mean())
    steps, d = [], damp
    while d < 1.0:
        steps.append(d)
        d *= 10.0
    steps.append(1.0)
    for d in steps:
        for dtype in (torch.float32, torch.float64):
            h2 = h.to(dtype, copy=True)
            h2.diagonal().add_(d * mean)
            low, info = torch.linalg.cholesky_ex(h2.flip(0, 1))
            if int(info):
                continue
            u = _inverse_upper(low.flip(0, 1))
            if not bool(torch.isfinite(u).all()) or not bool((u.diagonal() > 0).all()):
                continue
            return u.to(torch.float32), d
    raise EdgeqError(
        f"{name}: the Hessian [{h.shape[0]}x{h.shape[0]}] is not positive definite even with dampening "
        f"{steps[-1]} x mean(diag) (mean diag {mean:.3g}); calibrate with more or longer samples, or use --method rtn"
    )


@dataclass(frozen=True)
class PreparedHessian:
    """What GPTQ needs from H, shared by every weight (or row block) quantised under the same H.

    u: fp32 [K, K] upper Cholesky factor of the damped ``H^-1``, rows/columns in visit order; perm: int64 [K] visit
    order (act_order) or None; damp: the relative dampening used; dead: number of dead input channels; shift: the
    absolute dampening added to the diagonal (``damp * mean(diag)``); dead_cols: bool [K] (natural order), the dead
    channels, whose diagonal entry the sweep's Hessian sets to 1.
    """

    u: torch.Tensor
    perm: torch.Tensor | None
    damp: float
    dead: int
    shift: float
    dead_cols: torch.Tensor


def prepare_hessian(H: torch.Tensor, damp: float = 0.01, act_order: bool = False, *, name: str = "weight") -> PreparedHessian:
    """Dead channels, act-order permutation and the damped inverse Cholesky factor of ``H`` (float [K, K])."""
    if H.dim() != 2 or H.shape[0] != H.shape[1] or not H.is_floating_point():
        raise EdgeqError(f"{name}: the Hessian must be a square float matrix, got {H.dtype} {list(H.shape)}")
    if not 0.0 < damp <= 1.0:
        raise EdgeqError(f"{name}: damp={damp} must be in (0, 1]")
    if not bool(torch.isfinite(H).all()):
        raise EdgeqError(f"{name}: the Hessian has NaN/Inf entries (calibration activations overflowed)")
    h = H.to(torch.float32).clone()
    diag = h.diagonal().clone()
    dead = diag == 0
    h[dead, dead] = 1.0  # decoupled: the error of a dead column goes nowhere, and nothing flows into it
    perm = torch.sort(diag, descending=True, stable=True).indices if act_order else None
    if perm is not None:
        h = h[perm][:, perm]
    u, used = _inverse_cholesky(h, damp, name)
    shift = used * float(h.diagonal().mean())  # what _inverse_cholesky added to the diagonal
    return PreparedHessian(u=u, perm=perm, damp=used, dead=int(dead.sum()), shift=shift, dead_cols=dead)
