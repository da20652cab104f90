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

    Only the upper triangle is accumulated (:func:`_add_gram`: row panels of ``max(256, K // 8)``, about 56% of
    the full product's flops) and mirrored once when :meth:`hessian` is first read, so H is exactly symmetric. The
    cross term (``cross=True``) has no symmetry and is a full product, 2 n K^2 flops, accumulated as its difference
    from H, ``X~^T (X - X~)`` (in bf16 GEMMs for bf16 inputs: :meth:`_correction`); given the float weights W
    [N, K] of the Linears that read this input it is kept in its output form ``X~^T (X - X~) W^T`` [K, N] instead,
    4 n K N flops, fewer where 2 N < K (down_proj: K = 8192, N = 2048 on Llama-3.2-1B).
    """

    def __init__(self, k: int, name: str = "input", cross: bool = False, weight: torch.Tensor | None = None):
        self.k = int(k)
        self.name = name
        self.n = 0
        self._sum = torch.zeros(self.k, self.k, dtype=torch.float32)
        self._mirrored = False
        if weight is not None and (not cross or weight.dim() != 2 or weight.shape[1] != self.k):
            raise EdgeqError(f"{self.name}: an output-side cross term needs cross=True and a weight [N, {self.k}], "
                             f"got {list(weight.shape)}")
        self._weight = None if weight is None else weight.detach().to(torch.float32)
        self._weight_t: torch.Tensor | None = None  # W^T in the inputs' dtype, made at the first batch
        width = self.k if weight is None else weight.shape[0]
        self._cross = torch.zeros(self.k, width, dtype=torch.float32) if cross else None

    def add(self, x: torch.Tensor, x_float: torch.Tensor | None = None) -> None:
        """Add tokens ``x [..., K]`` (any float dtype); with ``cross``, also ``x_float``: the same tokens' inputs in the
        float model, for :meth:`cross`."""
        if x.shape[-1] != self.k:
            raise EdgeqError(f"{self.name}: calibration input has {x.shape[-1]} features, the Hessian expects K={self.k}")
        if (x_float is None) != (self._cross is None) or (x_float is not None and x_float.shape != x.shape):
            raise EdgeqError(f"{self.name}: the float inputs {None if x_float is None else list(x_float.shape)} do not "
                             f"pair with the inputs {list(x.shape)}")
        xq = x.detach().reshape(-1, self.k)
        if xq.shape[0]:
            if self._mirrored:
                raise EdgeqError(f"{self.name}: tokens added after the Hessian was read")
            _add_gram(self._sum, xq.to(torch.float32))
            if self._cross is not None:
                self._cross.add_(self._correction(xq, x_float.detach().reshape(-1, self.k)))
            self.n += xq.shape[0]

    def _correction(self, xq: torch.Tensor, xf: torch.Tensor) -> torch.Tensor:
        """One batch's ``X~^T (X - X~)`` [K, K], or with the weight ``X~^T ((X - X~) W^T)`` [K, N], fp32.

        Bf16 inputs (the driver's compute dtype on CPUs with bf16 dot products) take bf16 GEMMs: each result is
        rounded to bf16 once per batch, a relative error of 2^-9 of the *correction* (which the sampled tokens
        know far less precisely), never of H; the batches add up in fp32. torch subtracts bf16 values in fp32
        (exact) and rounds once. On AMX a bf16 [K, 2048] x [2048, K] product runs 4-5x (K = 2048) and 2.5-3x
        (K = 8192) the fp32 one's speed (a throwaway timing; docs/gptq.md, "The cross term in bf16"). Other dtypes
        compute in fp32."""
        dt = torch.bfloat16 if xq.dtype == torch.bfloat16 else torch.float32
        d = xf.to(dt) - xq.to(dt)  # bf16 - bf16: the exact fp32 difference, rounded once (no fp32 copies)
        if self._weight is not None:
            if self._weight_t is None or self._weight_t.dtype != dt:
                self._weight_t = self._weight.to(dt).t()
            d = d @ self._weight_t
        return (xq.to(dt).t() @ d).to(torch.float32)

    def _check_tokens(self) -> None:
        if self.n == 0:
            raise EdgeqError(f"{self.name}: no calibration tokens reached this layer; check the calibration data")

    def hessian(self) -> torch.Tensor:
        """float32 [K, K] ``2/n * sum x x^T``."""
        self._check_tokens()
        if not self._mirrored:
            _mirror_upper(self._sum, _panel(self.k))
            self._mirrored = True
        return self._sum * (2.0 / self.n)

    def cross(self) -> torch.Tensor:
        """float32 [K, K] ``2/n * sum x x_float^T``: the cross term of :func:`asymmetric_shift` (kept as H plus the
        accumulated ``2/n sum x (x_float - x)^T``); made with ``weight`` (W fp32 [N, K]), float32 [K, N]
        ``2/n * sum x (x_float - x)^T W^T``, the output form of :func:`target_delta`."""
        if self._cross is None:
            raise EdgeqError(f"{self.name}: this accumulator was made without cross=True")
        self._check_tokens()
        r = self._cross * (2.0 / self.n)
        return r if self._weight is not None else r.add_(self.hessian())


def _panel(k: int) -> int:
    """Rows per panel of :func:`_add_gram`: K // 8, at least 256 (one panel, a plain product, up to K = 256). On
    2 AMD Zen 4 cores (fp32), 2,048 tokens: K = 8960 1.04 s instead of 1.82 s, K = 2048 60 ms instead of 99 ms
    (a throwaway timing of the two GEMM forms, not a script in benchmarks/)."""
    return max(256, k // 8)


def _add_gram(acc: torch.Tensor, x: torch.Tensor) -> None:
    """``acc += x^T x`` on and above the diagonal blocks only (acc fp32 [K, K], x fp32 [n, K]): row panel
    ``[a:e]`` gets ``x[:, a:e]^T x[:, a:]``; the blocks below the diagonal stay as they were (zero) until
    :func:`_mirror_upper`. Example, K = 512, panels of 256: blocks (0,0), (0,1), (1,1): 3 of 4."""
    k = x.shape[1]
    p = _panel(k)
    for a in range(0, k, p):
        e = min(k, a + p)
        acc[a:e, a:].addmm_(x[:, a:e].t(), x[:, a:])


def _mirror_upper(acc: torch.Tensor, p: int) -> None:
    """In place: the strict lower triangle of ``acc`` [K, K] from its upper triangle (the diagonal blocks of
    :func:`_add_gram` hold both halves; their upper one is kept), so the result is exactly symmetric."""
    k = acc.shape[0]
    for a in range(0, k, p):
        e = min(k, a + p)
        d = acc[a:e, a:e]
        d.copy_(d.triu() + d.triu(1).t())
        acc[e:, a:e] = acc[a:e, e:].t()


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


def _lower_cholesky(h: torch.Tensor, dtype: torch.dtype, add: float, flip: bool = False) -> tuple[torch.Tensor, int]:
    """The lower Cholesky factor L of ``h + add * I`` (of ``h`` reversed in both dimensions first, if ``flip``; the
    reversal maps the diagonal onto itself) in ``dtype``, and LAPACK's info (0: positive definite). L is factored in
    place in a column-major copy, LAPACK's own layout, where ``torch.linalg.cholesky_ex`` would hold the damped copy and
    its own column-major result at once: one [K, K] copy instead of two (K = 8192: 256 MiB each in fp32), the same
    values in the same layout (L comes back column-major either way), hence the same bits."""
    a = torch.empty_strided(h.shape, (1, h.shape[0]), dtype=dtype)
    a.copy_(h.flip(0, 1) if flip else h)
    a.diagonal().add_(add)
    info = torch.empty((), dtype=torch.int32)
    torch.linalg.cholesky_ex(a, out=(a, info))
    return a, int(info)


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
            low, info = _lower_cholesky(h, dtype, d * mean, flip=True)
            if info:
                continue
            r = low.flip(0, 1)  # each [K, K] copy released once the next exists (K = 8192: 256 MiB each in fp32)
            del low
            u = _inverse_upper(r)
            del r
            if not bool(torch.isfinite(u).all()) or not bool((u.diagonal() > 0).all()):
                continue
            return u.to(torch.float32), d
    raise EdgeqError(
        f"{name}: the Hessian [{h.shape[0]}x{h.shape[0]}] is not positive definite even with dampening "
        f"{steps[-1]} x mean(diag) (mean diag {mean:.3g}); calibrate with more or longer samples, or use --method rtn"
    )


def asymmetric_shift(H: torch.Tensor, C: torch.Tensor, damp: float, tokens: int, *, name: str = "weight") -> torch.Tensor:
    """The shift S (fp32 [K, K]) that turns a weight W [N, K] into the GPTQ target ``V = W + W S`` when its inputs
    are quantised: V minimises ``||X~ V^T - X W^T||^2 + lam ||V - W||^2`` (X~ [n, K] the inputs in the quantised
    model, X the float model's, ``H = 2/n X~^T X~``, ``C = 2/n X~^T X``: :meth:`HessianAccumulator.cross`,
    ``lam = max(damp, K / n) * mean(diag H)`` with n = ``tokens``)::

        (H + lam I) V^T = C W^T + lam W^T   =>   V = W + W S,  S = ((H + lam I)^-1 (C - H))^T

    GPTQ of V under H then minimises the error of ``X~ W_hat^T`` against the float outputs ``X W^T``: the least-squares
    residual of V is orthogonal to X~'s columns, so ``||X~ W_hat^T - X W^T||^2 = ||X~ (W_hat - V)^T||^2 + const``
    (exactly at lam = 0). The ridge pulls V towards W, not towards 0, so equal inputs (X~ = X: C = H) give S = 0.
    It grows with K / n because V has K free values per row fitted to n tokens: on the bundled model (K up to 768)
    GPTQ's 1% alone overfits 1,024 calibration tokens (held-out KLD above the plain GPTQ target's), K / n does not,
    and at 8,192 tokens both are equal (docs/gptq.md, "The float target").
    Worked example (K = 1): X~ = 0.9 X, so H = 0.81 h, C = 0.9 h (h = 2/n x.x); at lam = 0, S = (0.9 - 0.81) / 0.81
    = 1/9 and V = 10/9 W: X~ V = X W. Cost: one Cholesky and a solve with K right-hand sides (~2.3 K^3 flops).
    ``C`` (fp32) is overwritten (with C - H): at K = 8960 each [K, K] copy is 321 MB. S may be a transposed view.
    """
    if H.shape != C.shape or H.dim() != 2 or H.shape[0] != H.shape[1]:
        raise EdgeqError(f"{name}: the Hessian {list(H.shape)} and the cross term {list(C.shape)} must be one square shape")
    lam = _ridge(H, damp, tokens, name)
    return _ridge_solve(H, C.sub_(H) if C.dtype == torch.float32 else C.to(torch.float32) - H, lam, damp, name)


def target_delta(H: torch.Tensor, R: torch.Tensor, damp: float, tokens: int, *, name: str = "weight") -> torch.Tensor:
    """The same target as :func:`asymmetric_shift` from the output form of the cross term, ``R = (C - H) W^T = 2/n
    X~^T (X - X~) W^T`` (fp32 [K, N]: :meth:`HessianAccumulator.cross` made with ``weight=W``): the correction
    ``D = V - W = ((H + lam I)^-1 R)^T`` (fp32 [N, K]). Mathematically ``W S``; it skips the [K, K] cross term, its
    K-column solve and the [N, K] x [K, K] product, for a solve with N right-hand sides (~K^3 / 3 + 2 K^2 N flops).
    Worked example (K = 1, N = 1, W = 2): X~ = 0.9 X, h = 2/n x.x, so R = 0.9 * 0.1 h * 2 = 0.18 h, H = 0.81 h; at
    lam = 0, D = 0.18 / 0.81 = 2/9 = W S with S = 1/9 (above), and V = 20/9."""
    if H.dim() != 2 or H.shape[0] != H.shape[1] or R.dim() != 2 or R.shape[0] != H.shape[0]:
        raise EdgeqError(f"{name}: the Hessian {list(H.shape)} and the output cross term {list(R.shape)} must be "
                         "[K, K] and [K, N]")
    return _ridge_solve(H, R.to(torch.float32), _ridge(H, damp, tokens, name), damp, name)


def _ridge(H: torch.Tensor, damp: float, tokens: int, name: str) -> float:
    """``lam = max(damp, K / tokens) * mean(diag H)``: the ridge of :func:`asymmetric_shift`."""
    if tokens < 1:
        raise EdgeqError(f"{name}: no calibration tokens for the cross term")
    return max(damp, H.shape[0] / tokens) * float(H.diagonal().mean())


def _ridge_solve(H: torch.Tensor, rhs: torch.Tensor, lam: float, damp: float, name: str) -> torch.Tensor:
    """``((H + lam I)^-1 rhs)^T`` (fp32; fp64 if fp32's Cholesky fails). The result may be a transposed view."""
    for dtype in (torch.float32, torch.float64):
        low, info = _lower_cholesky(H, dtype, lam)
        if info:
            continue
        t = torch.cholesky_solve(rhs.to(dtype), low)
        del low
        if bool(torch.isfinite(t).all()):
            return t.t().to(torch.float32)
    raise EdgeqError(f"{name}: the Hessian [{H.shape[0]}x{H.shape[0]}] plus {damp} x mean(diag) is not positive definite; "
                     "use --gptq-target layer, or a larger --damp")


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
    h = H.to(torch.float32)
    diag = h.diagonal().clone()
    dead = diag == 0
    if bool(dead.any()):  # a copy only then: H is the caller's (K = 8192: 256 MiB)
        h = h.clone()
        h[dead, dead] = 1.0  # decoupled: the error of a dead column goes nowhere, and nothing flows into it
    perm = torch.sort(diag, descending=True, stable=True).indices if act_order else None
    if perm is not None:
        h = h[perm][:, perm]
    u, used = _inverse_cholesky(h, damp, name)
    shift = used * float(h.diagonal().mean())  # what _inverse_cholesky added to the diagonal
    return PreparedHessian(u=u, perm=perm, damp=used, dead=int(dead.sum()), shift=shift, dead_cols=dead)
