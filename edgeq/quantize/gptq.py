"""GPTQ (Frantar et al., 2022) as pure tensor math, producing tinygemm quantities directly.

Given a linear's weight W [N, K] and the Hessian of its layer-wise loss ``H = 2/n * sum_t x_t x_t^T`` [K, K] over n
calibration tokens, GPTQ quantises the columns of W one at a time and spreads each column's rounding error over the
not-yet-quantised columns so as to minimise ``tr((W - W_hat) H (W - W_hat)^T)`` (= 2/n * ||X W^T - X W_hat^T||^2).
With ``U`` the upper Cholesky factor of ``H^-1`` (``H^-1 = U^T U``), column i is quantised to ``w_hat_i`` and the
remaining columns are updated by ``W[:, j] -= (w_i - w_hat_i) / U[i, i] * U[i, j]`` for j > i.

Choices made here (docs/gptq.md has the reasoning):

- quantiser: tinygemm's asymmetric uint4 with a float zero point, per group of G consecutive columns (in the
  sweep order). When the sweep reaches a group, its (scale, zero) are chosen from the group's *current*
  (error-updated) values, bf16-valued, before any of its columns is quantised; ``group_params`` says how:
  ``"search"`` (default) edgeq's ``rtn`` choice (:func:`edgeq.quantize.rtn.choose_params`: the least-squares search
  with the min/max and clipping pairs as candidates, never a larger squared error on the group than min/max),
  ``"minmax"`` GPTQ's original ``scale = (max - min) / 15``, ``zero = min + 8 * scale``. Then
  ``q = clamp(round((w - zero) / scale) + 8, 0, 15)``, ``w_hat = (q - 8) * scale + zero`` in fp32. So q, with the
  stored bf16 parameters, dequantises bit for bit to the values whose error was propagated. Measured on the bundled
  model (docs/gptq.md): "search" lowers the mean KLD of ``--method gptq`` by 15-17% (packed embeddings: 0.00359 ->
  0.00299; with ``--head-levels 2``: 0.00266 -> 0.00225); weighting the search by the Hessian diagonal (an
  imatrix-like importance) measured the same (0.00301 / 0.00226) and was not kept;
- dampening ``damp * mean(diag(H))`` on the diagonal; if the Cholesky factorisations fail, fp64 at the same
  damping, then damping x10 up to 1.0, then an :class:`EdgeqError`;
- dead input channels (``H[k, k] == 0``: the channel was zero on every calibration token) get ``H[k, k] = 1``; their
  weights are kept (not zeroed as in the reference implementations) and quantised by plain rounding, since the
  calibration data says nothing about them and other inputs may use them;
- lazy batch updates in blocks of ``block_size`` columns (rounded to a multiple of G so a group never straddles a
  block: its parameters then see every earlier column's update), two-level: the per-column rank-1 updates touch
  only a sub-block of 32 columns (gcd(G, 32)), flushed to the rest of the block by one matmul; this keeps each
  Python-level step small enough to run serially instead of paying a thread-pool round trip per column;
- ``act_order``: columns are visited by descending ``H[k, k]`` (stable), and groups are G consecutive columns of that
  order, so the result is ``q`` over permuted columns plus ``perm``: the layer computes ``x[..., perm] @ W_hat^T``;
- ``static_groups``: parameters come from the unmodified W's natural groups (k // G) before the sweep; with
  act_order the visit order is permuted but the result stays in natural order (``perm is None``).

Worked example (no cross-column correlation): with ``H = I`` there is nothing to propagate, and GPTQ returns exactly
``edgeq quantize --method rtn``'s quantisation of W (``group_params="minmax"``: the min/max round-to-nearest).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from edgeq.errors import EdgeqError
from edgeq.quantize import rtn
from edgeq.quantize.hessian import PreparedHessian, prepare_hessian

_MIN_SCALE = 2.0**-24  # a constant group's scale; bf16 represents it exactly
GROUP_PARAMS = ("search", "minmax")  # how a group's (scale, zero) are chosen; the first is the default
_INNER = 32  # columns per inner sub-block: rank-1 updates stay small (serial, cache-resident); see gptq_quantize


@dataclass(frozen=True)
class GPTQResult:
    """One GPTQ-quantised weight in tinygemm terms.

    q: uint8 [N, K] 0..15, columns in ``perm`` order (natural order when ``perm is None``);
    scales_and_zeros: bf16 [K/G, N, 2] (scale, zero), ``w_hat = (q - 8) * scale + zero``;
    perm: int64 [K] or None, the layer computes ``x[..., perm] @ w_hat.T``;
    damp: the relative dampening actually used; output_error: ``tr((W - W_hat) H (W - W_hat)^T)`` with the H given
    (undamped) and W_hat in natural column order, output_norm: ``tr(W H W^T)``; sq_error / sq_norm: float64 [N] per-row
    ``sum (w - w_hat)^2`` and ``sum w^2``; w_hat: fp32 [N, K] in q's column order, only with ``keep_dequantized``.
    """

    q: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None
    damp: float
    output_error: float
    output_norm: float
    sq_error: torch.Tensor
    sq_norm: torch.Tensor
    w_hat: torch.Tensor | None = None

    @property
    def relative_output_error(self) -> float:
        """``tr(E H E^T) / tr(W H W^T)``: the relative squared error of the layer's outputs on the calibration set."""
        return self.output_error / self.output_norm if self.output_norm > 0 else 0.0

    @property
    def relative_error(self) -> float:
        """``||W - W_hat||_F / ||W||_F``."""
        norm = float(self.sq_norm.sum())
        return (float(self.sq_error.sum()) / norm) ** 0.5 if norm > 0 else 0.0


def minmax_qparams(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tinygemm min/max parameters over the last dim of ``w [..., G]``: (scale, zero) fp32 [..., 1], bf16-valued."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp_min(_MIN_SCALE).to(torch.bfloat16).to(torch.float32)
    zero = (lo + 8.0 * scale).to(torch.bfloat16).to(torch.float32)
    return scale, zero


def group_qparams(w: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) fp32 [R, Gc, 1], bf16-valued, of the groups ``w`` [R, Gc, G]; ``how``: one of
    :data:`GROUP_PARAMS`."""
    return minmax_qparams(w) if how == "minmax" else rtn.choose_params(w, "rtn")


def quantize_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float 0..15, w_hat fp32) with ``q = clamp(round((w - zero) / scale) + 8, 0, 15)``,
    ``w_hat = (q - 8) * scale + zero``, the exact fp32 expression of :func:`edgeq.layouts.tinygemm.dequantize`."""
    q = (torch.round((w - zero) / scale) + 8.0).clamp_(0.0, 15.0)
    return q, (q - 8.0) * scale + zero


@contextmanager
def _threads(n: int):
    """torch's intra-op thread count set to ``n`` while active (process-global), restored after.

    The column sweep runs its thousands of small per-column steps on one thread: they gain nothing from a second,
    and with busy cores the thread pool's hand-offs cost more than the work (measured 4-5x slower with 2 threads on
    a loaded 2-core machine). Its large steps (a group's parameter search over N rows, a block's trailing update)
    get the caller's threads back.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gptq_quantize(
    w: torch.Tensor,
    H: torch.Tensor,
    group_size: int,
    damp: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    static_groups: bool = False,
    *,
    name: str = "weight",
    keep_dequantized: bool = False,
    prepared: PreparedHessian | None = None,
    group_params: str = GROUP_PARAMS[0],
) -> GPTQResult:
    """Quantise ``w`` (float [N, K]) with GPTQ under the Hessian ``H`` (float [K, K], e.g.
    :meth:`HessianAccumulator.hessian`) to tinygemm uint4, groups of ``group_size`` along K.

    Rows are independent given H, so a large weight can be quantised in row blocks that share one
    :func:`prepare_hessian` result (``prepared``, which must have been made with the same ``act_order``; ``damp`` is
    then its own) and joined with :func:`concat_rows`. Memory: a few fp32 [N, K] and [K, K] tensors.
    Time: O(K^3) to prepare, O(N K^2) per weight. ``group_params``: how each group's (scale, zero) are chosen (the
    module docstring).
    """
    n, k, g = _check_inputs(w, H, group_size, name)
    if group_params not in GROUP_PARAMS:
        raise EdgeqError(f"{name}: group_params {group_params!r} is not one of {', '.join(GROUP_PARAMS)}")
    if prepared is None:
        prepared = prepare_hessian(H, damp, act_order, name=name)
    elif (prepared.perm is not None) != act_order:
        raise EdgeqError(f"{name}: the prepared Hessian was made with act_order={not act_order}, the call asks for {act_order}")
    U, perm, used = prepared.u, prepared.perm, prepared.damp

    W = w.to(torch.float32)  # read only: the sweep works on its own transposed copy
    if perm is not None:
        W = W[:, perm]

    gc = k // g
    scales = torch.empty(gc, n, dtype=torch.float32)
    zeros = torch.empty(gc, n, dtype=torch.float32)
    static_col_group = None
    if static_groups:
        s0, z0 = group_qparams(w.to(torch.float32).reshape(n, gc, g), group_params)
        scales.copy_(s0[..., 0].t())
        zeros.copy_(z0[..., 0].t())
        static_col_group = (perm if perm is not None else torch.arange(k)) // g

    Q = torch.empty(n, k, dtype=torch.uint8)
    W_hat = torch.empty(n, k, dtype=torch.float32)
    bs, threads = max(g, (block_size // g) * g), torch.get_num_threads()  # the caller's, for the large steps
    with _threads(1):
        err_sq = _sweep(W, U, Q, W_hat, scales, zeros, static_col_group, g, bs, math.gcd(g, _INNER), group_params, threads)
    del W

    out_perm = perm
    if perm is not None and static_groups:  # natural groups: undo the visit order
        inv = torch.argsort(perm)
        Q, W_hat, out_perm = Q[:, inv].contiguous(), W_hat[:, inv].contiguous(), None
    sz = torch.stack((scales, zeros), dim=-1).to(torch.bfloat16)  # [K/G, N, 2], values already bf16
    return _result(w, H, Q, W_hat, sz, g, out_perm, prepared, err_sq, keep_dequantized)


def _check_inputs(w: torch.Tensor, H: torch.Tensor, group_size: int, name: str) -> tuple[int, int, int]:
    """(N, K, G) after checking w is a finite 2-D float [N, K], H a float [K, K] and G divides K."""
    if w.dim() != 2 or not w.is_floating_point():
        raise EdgeqError(f"{name}: expected a 2-D float weight, got {w.dtype} {list(w.shape)}")
    n, k = w.shape
    if H.dim() != 2 or list(H.shape) != [k, k] or not H.is_floating_point():
        raise EdgeqError(f"{name}: the Hessian must be float [{k}, {k}] for a weight {list(w.shape)}, got {H.dtype} {list(H.shape)}")
    g = int(group_size)
    if g <= 0 or k % g:
        raise EdgeqError(f"{name} {list(w.shape)}: K={k} is not a multiple of the group size {group_size}")
    if not bool(torch.isfinite(w).all()):
        raise EdgeqError(f"{name}: {int((~torch.isfinite(w)).sum())} NaN/Inf value(s) in the weights")
    return n, k, g


def _result(w: torch.Tensor, H: torch.Tensor, Q: torch.Tensor, W_hat: torch.Tensor, sz: torch.Tensor, g: int,
            perm: torch.Tensor | None, prepared: PreparedHessian, err_sq: float, keep_dequantized: bool) -> GPTQResult:
    """The result with its error measures against the original ``w`` [N, K] (natural column order): output error
    ``tr(E H E^T)`` with ``E = w - w_hat``, its norm ``tr(w H w^T)`` (float64 sums) and per-row squared errors.

    The output error comes from the sweep, not from a second [N, K] x [K, K] product: GPTQ's updates are exact, so
    the scaled errors it propagates (``e_c = (v_c - w_hat_c) / U[c, c]``, v_c the column when it was quantised) add
    up to the error under the Hessian it used, ``sum e_c^2 = tr(E H' E^T)``, H' = H with dead diagonals set to 1 plus
    ``shift`` on the diagonal (the identity behind GPTQ's per-column losses; checked against the direct product in
    tests/test_gptq.py). Hence ``tr(E H E^T) = sum e^2 - shift * ||E||^2 - ||E[:, dead]||^2``.
    """
    w32 = w.to(torch.float32)
    w_hat_nat = W_hat if perm is None else W_hat[:, torch.argsort(perm)]
    err = w32 - w_hat_nat
    sq_error = err.square_().sum(-1, dtype=torch.float64)  # fp32 squares, fp64 sums: no [N, K] fp64 copies
    dead_sq = float(err[:, prepared.dead_cols].sum(dtype=torch.float64)) if prepared.dead else 0.0
    output_error = err_sq - prepared.shift * float(sq_error.sum()) - dead_sq
    del err
    return GPTQResult(
        q=Q,
        scales_and_zeros=sz,
        group_size=g,
        perm=perm,
        damp=prepared.damp,
        output_error=max(0.0, output_error),
        output_norm=float(((w32 @ H.to(torch.float32)) * w32).sum(dtype=torch.float64)),
        sq_error=sq_error,
        sq_norm=w32.square().sum(-1, dtype=torch.float64),
        w_hat=W_hat if keep_dequantized else None,
    )


def _sweep(W, U, Q, W_hat, scales, zeros, static_col_group, g: int, bs: int, inner: int, how: str,
           threads: int) -> float:
    """The GPTQ column sweep over W [N, K] (fp32, visit order) with U the upper Cholesky factor of the damped H^-1;
    fills Q (uint8), W_hat (fp32) and, for dynamic groups, scales/zeros [K/G, N]. Returns the sum of the squared
    scaled errors it propagated (float64), the output error under the damped H (see _result).

    The sweep runs on the transpose ``WT = W^T`` [K, N], so that each column it visits, quantises, writes and
    updates is one contiguous row of N floats: on W itself every per-column step strides by K and touches N cache
    lines (Qwen2.5-1.5B's gate_proj, 8960 x 1536, on 2 Zen 3 cores: 2.8-3.7 s on W, 1.9 s on W^T; docs/gptq.md
    "Memory order"). The arithmetic per element is the same; the blocked products sum in another order.
    """
    n, k = W.shape
    WT = W.t().contiguous()
    QT = torch.empty(k, n, dtype=torch.uint8)
    WhT = torch.empty(k, n, dtype=torch.float32)
    err_sq = 0.0
    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        ErrT = torch.empty(i2 - i1, n, dtype=torch.float32)
        for j1 in range(i1, i2, inner):
            j2 = min(j1 + inner, i2)
            W1 = WT[j1:j2]  # a view: updates land in WT directly
            U1 = U[j1:j2, j1:j2]
            for i in range(j2 - j1):
                c = j1 + i
                if static_col_group is not None:
                    j = int(static_col_group[c])
                    scale, zero = scales[j], zeros[j]
                elif c % g == 0:  # c == j1 == a sub-block start: every earlier column's update is in WT[c:c+g]
                    with _threads(threads):
                        s1, z1 = group_qparams(WT[c : c + g].t().contiguous().unsqueeze(1), how)
                    scale, zero = s1[:, 0, 0], z1[:, 0, 0]
                    scales[c // g], zeros[c // g] = scale, zero
                row = W1[i]
                qc, wc = quantize_values(row, scale, zero)
                QT[c] = qc  # the copy casts to uint8
                WhT[c] = wc
                e = (row - wc) / U1[i, i]
                ErrT[c - i1] = e
                W1[i + 1 :].addr_(U1[i, i + 1 :], e, alpha=-1.0)
            if j2 < i2:
                WT[j2:i2].addmm_(U[j1:j2, j2:i2].t(), ErrT[j1 - i1 : j2 - i1], alpha=-1.0)
        err_sq += float(ErrT.square().sum(dtype=torch.float64))
        if i2 < k:
            with _threads(threads):  # the one large product of the block: worth the thread pool
                WT[i2:].addmm_(U[i1:i2, i2:].t(), ErrT, alpha=-1.0)
    del WT
    Q.copy_(QT.t())
    W_hat.copy_(WhT.t())
    return err_sq


def concat_rows(parts: list[GPTQResult]) -> GPTQResult:
    """Join results of row blocks of one weight quantised under one :class:`PreparedHessian` (same perm, damp, G)."""
    first = parts[0]
    for p in parts[1:]:
        same_perm = (p.perm is None and first.perm is None) or (
            p.perm is not None and first.perm is not None and torch.equal(p.perm, first.perm)
        )
        if not same_perm or p.group_size != first.group_size or p.damp != first.damp:
            raise EdgeqError("concat_rows: the row blocks were quantised under different Hessians or group sizes")
    w_hats = [p.w_hat for p in parts]
    return GPTQResult(
        q=torch.cat([p.q for p in parts]),
        scales_and_zeros=torch.cat([p.scales_and_zeros for p in parts], dim=1),
        group_size=first.group_size,
        perm=first.perm,
        damp=first.damp,
        output_error=sum(p.output_error for p in parts),
        output_norm=sum(p.output_norm for p in parts),
        sq_error=torch.cat([p.sq_error for p in parts]),
        sq_norm=torch.cat([p.sq_norm for p in parts]),
        w_hat=torch.cat(w_hats) if all(x is not None for x in w_hats) else None,
    )
