"""``edgeq fidelity``: is the quantised model still the reference model, token by token?

Both models score the same token windows; per scored position we compare the two next-token distributions.
The statistics follow llama.cpp's ``llama-perplexity --kl-divergence`` (PPL of both, their ratio with an uncertainty
that accounts for the correlation of the two, mean KLD +- standard error and its upper percentiles, same-top-1 rate
+- binomial sigma, RMS of delta-p) plus a top-5 overlap and, with ``per_layer``, the relative output error of every
quantised linear. docs/fidelity.md states every formula; the short version:

* Windowing. The text is tokenised once (no special tokens) and cut into consecutive, non-overlapping windows of
  ``ctx`` tokens. When the tokenizer has a BOS token, each window is ``[BOS] + ctx-1`` text tokens. The logits at
  window positions ``first .. ctx-2`` predict the tokens at ``first+1 .. ctx-1``; ``first = ctx // 2`` for
  ``score="half"`` (llama-perplexity's choice: every scored token has at least ctx/2 tokens of context) and ``0`` for
  ``score="all"``. A tail shorter than a window is not scored. ``max_tokens`` stops after that many scored positions
  (the last window is then scored only in part).
* Streaming. One window is run through both models, its scored rows are reduced to a few float64 numbers per position,
  and the logits are dropped before the next window: memory is one window of logits per model plus 48 bytes per
  scored position (64 with a reference file).
* KLD is ``KL(P_ref || P_quant) = sum_i p_i (log p_i - log q_i)``, computed in float64 from log-softmax of the float32
  logits, in blocks of rows so that a 150k vocabulary does not need a [ctx, V] float64 copy.

Models are "sides": a callable ``input_ids [1, T] (int64) -> logits [1, T, V]`` (or the last L >= T - first positions
of them), an ``nn.Module`` whose ``forward(input_ids=...)`` returns ``.logits`` (a transformers causal LM), or an object
with ``.model`` (such a module) and ``.tokenizer`` (e.g. ``edgeq.runtime.load(path)``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, Sequence

import numpy as np
import torch
import typer

from edgeq.keys import DATA
from edgeq.errors import EdgeqError, ThresholdError
from edgeq.io.hub import REVISION_HELP, resolve_models

DEFAULT_TEXT = DATA / "heldout-prose.txt"
REPORT_SCHEMA = "edgeq.fidelity/1"
REF_FORMAT = "edgeq.fidelity-ref/1"
SCORE_MODES = ("half", "all")
DEFAULT_CTX = 512
DEFAULT_REF_TOPK = 32
TOP5 = 5
# Rows of float64 [rows, V] work arrays per block: 2**22 elements = 32 MiB each, whatever the vocabulary.
_BLOCK_ELEMENTS = 1 << 22

Progress = Callable[[int, int, Optional[float]], None]
"""``progress(windows_done, windows_total, eta_seconds_or_None)``, called after every window."""


# ----------------------------------------------------------------------------------------------------------- report
@dataclass(frozen=True)
class LayerError:
    """Relative output error of one quantised linear over the scored positions.

    ``rel_err = ||y_q - y_ref|| / ||y_ref||`` with ``y_q`` the module's output inside the quantised model and ``y_ref``
    the same-named module's output inside the reference model (errors of earlier layers included: end to end).
    ``local_rel_err`` feeds the reference model's input of that module to the quantised module instead, so it is the
    error this layer adds by itself. Norms are Frobenius norms over all scored positions of all windows.
    """

    name: str
    rel_err: float
    local_rel_err: float


@dataclass(frozen=True)
class FidelityReport:
    """The comparison of a quantised model against its reference. ``*_err`` fields are one standard error
    (``None`` when undefined: fewer than 2 positions). Field meanings and formulas: docs/fidelity.md."""

    partial: bool
    ctx: int
    score: str
    windows: int
    tokens_scored: int
    ref_topk: Optional[int]
    ppl_ref: float
    ppl_ref_err: Optional[float]
    ppl_quant: float
    ppl_quant_err: Optional[float]
    ppl_ratio: float
    ppl_ratio_err: Optional[float]
    ln_ppl_ratio: float
    ln_ppl_ratio_err: Optional[float]
    nll_correlation: Optional[float]
    kld_mean: float
    kld_mean_err: Optional[float]
    kld_median: float
    kld_p90: float
    kld_p95: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    kld_topk_bound: Optional[float]
    ref_tail_mass: Optional[float]
    top1_agreement: float
    top1_agreement_err: Optional[float]
    top5_overlap: float
    top5_overlap_err: Optional[float]
    delta_p_mean: float
    delta_p_mean_err: Optional[float]
    delta_p_rms: float
    delta_p_rms_err: Optional[float]
    per_layer: Optional[tuple[LayerError, ...]] = None
    per_layer_count: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (schema ``edgeq.fidelity/1``); non-finite floats become ``None``."""
        d: dict[str, Any] = {"schema": REPORT_SCHEMA}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "per_layer" and v is not None:
                v = [asdict(e) for e in v]
            d[f.name] = v
        return _finite_or_none(d)

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def _finite_or_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite_or_none(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# -------------------------------------------------------------------------------------------------------- windowing
@dataclass(frozen=True)
class Windowing:
    """Which logits of a ``ctx``-token window are scored: rows ``first .. ctx-2`` (targets one position later)."""

    ctx: int
    score: str

    def __post_init__(self) -> None:
        if self.score not in SCORE_MODES:
            raise EdgeqError(f"--score {self.score!r}: unknown mode; use one of {', '.join(SCORE_MODES)}")
        if self.ctx < 3:
            raise EdgeqError(f"--ctx {self.ctx}: a window needs at least 3 tokens to score any; use --ctx 512")

    @property
    def first(self) -> int:
        return self.ctx // 2 if self.score == "half" else 0

    @property
    def per_window(self) -> int:
        """Scored positions per full window: ``ctx - 1 - first`` (255 for ctx 512, half)."""
        return self.ctx - 1 - self.first


def make_windows(ids: Sequence[int], ctx: int, bos_id: Optional[int]) -> torch.Tensor:
    """Cut token ids into int64 windows ``[W, ctx]``; with a BOS id each window is ``[bos] + ctx-1`` text tokens.

    Example: ids 0..9, ctx 4, bos 99 -> [[99,0,1,2],[99,3,4,5],[99,6,7,8]] (token 9 is a short tail, not used).
    """
    step = ctx - 1 if bos_id is not None else ctx
    n = len(ids) // step
    if n == 0:
        raise EdgeqError(f"text: tokenises to {len(ids)} tokens, fewer than one window of --ctx {ctx} needs ({step}); "
                         f"use a longer --text or a smaller --ctx")
    body = torch.as_tensor(list(ids[: n * step]), dtype=torch.long).view(n, step)
    if bos_id is None:
        return body
    return torch.cat([torch.full((n, 1), int(bos_id), dtype=torch.long), body], dim=1)


def plan_counts(n_windows: int, per_window: int, max_tokens: Optional[int]) -> list[int]:
    """Scored positions per window: ``per_window`` each, cut so the total is at most ``max_tokens``."""
    if max_tokens is not None and max_tokens < 1:
        raise EdgeqError(f"--max-tokens {max_tokens}: must be at least 1")
    counts, left = [], (max_tokens if max_tokens is not None else n_windows * per_window)
    for _ in range(n_windows):
        if left <= 0:
            break
        counts.append(min(per_window, left))
        left -= counts[-1]
    return counts


# -------------------------------------------------------------------------------------------- per-position numerics
def _row_blocks(rows: int, vocab: int) -> list[tuple[int, int]]:
    """[a, b) row ranges whose float64 [b - a, vocab] work arrays stay near _BLOCK_ELEMENTS elements."""
    step = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def top_n_mask(logits: torch.Tensor, n: int) -> torch.Tensor:
    """bool [S, V]: the n largest entries of each row, ties at the boundary going to the lowest token ids.

    bf16 logits tie often; torch.topk breaks ties arbitrarily, which would make the top-5 overlap depend on the
    kernel. Example: logits (1, 3, 3, 3, 0), n = 2 -> ids {1, 2}.
    """
    n = min(n, logits.shape[-1])
    nth = torch.topk(logits, n, dim=-1).values[:, -1:]
    above = logits > nth
    room = n - above.sum(-1, keepdim=True)
    tied = logits == nth
    if bool((tied.sum(-1, keepdim=True) == room).all()):  # no row has more tied candidates than free places
        return above | tied
    return above | (tied & (torch.cumsum(tied, dim=-1) <= room))


def _mask_ids(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Ids of the true entries of each row of a mask with exactly n per row, ascending: int64 [S, n]."""
    return mask.nonzero()[:, 1].view(mask.shape[0], n)


def position_stats(ref_logits: torch.Tensor, quant_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-position comparison of two models' next-token distributions, exact over the full vocabulary.

    ``ref_logits``, ``quant_logits``: float [S, V]; ``targets``: int64 [S], the token that followed each row.
    Returns float64 arrays [S]: ``nll_ref = -log p(target)``, ``nll_quant = -log q(target)``,
    ``kld = sum_i p_i (log p_i - log q_i)`` (terms with p_i = 0 are 0), ``delta_p = q(target) - p(target)``,
    ``top1_same`` (argmax of both logits equal, first index on ties) and ``top5_overlap`` (|top5_p & top5_q| / 5,
    sets from :func:`top_n_mask`).
    Example: p = q gives kld 0, delta_p 0, top1_same 1, top5_overlap 1 exactly.
    """
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("nll_ref", "nll_quant", "kld", "delta_p", "top1_same", "top5_overlap")}
    S, V = ref_logits.shape
    for a, b in _row_blocks(S, V):
        r, q, t = ref_logits[a:b], quant_logits[a:b], targets[a:b, None]
        lr = torch.log_softmax(r.double(), dim=-1)
        lq = torch.log_softmax(q.double(), dim=-1)
        pr = lr.exp()
        # p_i = 0 contributes nothing even where log q_i = -inf (masked vocabulary entries)
        out["kld"].append(torch.where(pr > 0, pr * (lr - lq), torch.zeros((), dtype=torch.float64)).sum(-1))
        tr, tq = lr.gather(1, t)[:, 0], lq.gather(1, t)[:, 0]
        out["nll_ref"].append(-tr)
        out["nll_quant"].append(-tq)
        out["delta_p"].append(tq.exp() - tr.exp())
        out["top1_same"].append((r.argmax(-1) == q.argmax(-1)).double())
        n5 = min(TOP5, V)
        out["top5_overlap"].append((top_n_mask(r, n5) & top_n_mask(q, n5)).sum(-1).double() / n5)
    return {k: torch.cat(v).numpy() for k, v in out.items()}


@dataclass(frozen=True)
class RefRows:
    """What ``--save-ref`` keeps of the reference per scored position (see docs/fidelity.md, "--ref format").

    topk_ids int32 [S, k] and topk_logprobs float64 [S, k]: the k most likely tokens, most likely first;
    target_logprob float64 [S]: log p(target); tail_logmass float64 [S]: log of the probability outside the top k
    (logsumexp of the other V-k log-probs, -inf if none); top1 int32 [S]: argmax of the logits (first on ties);
    top5 int32 [S, 5]: the top-5 set of :func:`top_n_mask`, ascending ids.
    """

    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    target_logprob: torch.Tensor
    tail_logmass: torch.Tensor
    top1: torch.Tensor
    top5: torch.Tensor

    def slice(self, a: int, b: int) -> "RefRows":
        return RefRows(*(getattr(self, f.name)[a:b] for f in fields(self)))

    @staticmethod
    def cat(parts: Sequence["RefRows"]) -> "RefRows":
        return RefRows(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(RefRows)))


def _tail_mask(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    mask = torch.ones(ids.shape[0], vocab, dtype=torch.bool)
    mask.scatter_(1, ids.long(), False)
    return mask


def ref_rows(ref_logits: torch.Tensor, targets: torch.Tensor, k: int) -> RefRows:
    """Reduce reference logits [S, V] to the :class:`RefRows` kept by ``--save-ref``."""
    S, V = ref_logits.shape
    parts = []
    for a, b in _row_blocks(S, V):
        r = ref_logits[a:b]
        lr = torch.log_softmax(r.double(), dim=-1)
        top = torch.topk(lr, min(k, V), dim=-1)
        tail = torch.logsumexp(lr.masked_fill(~_tail_mask(top.indices, V), -math.inf), dim=-1)
        n5 = min(TOP5, V)
        parts.append(RefRows(top.indices.int(), top.values, lr.gather(1, targets[a:b, None])[:, 0], tail,
                             r.argmax(-1).int(), _mask_ids(top_n_mask(r, n5), n5).int()))
    return RefRows.cat(parts)


def worst_tail_kl(tail_logq: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Row-wise ``max KL(a || b)`` over distributions a with ``0 <= a_j <= m``, b the tail-conditional quant
    distribution given as log b_j (float64 [S, n]; entries outside the tail = +inf so they sort last), m float64 [S].

    KL is convex in a, so the maximum sits on a vertex of {0 <= a_j <= m, sum a = 1}: c = floor(1/m) entries equal
    to m and one equal to r = 1 - c m. All vertices share sum a log a, so the maximum puts those masses on the
    smallest b_j: ``c m log m + r log r - m sum_{c smallest} log b - r log b_(c+1)``.
    Example: b uniform over 4 tokens, m = 1/2: a = (1/2, 1/2, 0, 0) gives log 2.
    """
    S, n = tail_logq.shape
    zero = torch.zeros((), dtype=torch.float64)
    m = m.clamp(min=1e-300, max=1.0)
    size = (tail_logq != math.inf).sum(-1)  # tail length per row
    c = torch.minimum(torch.floor(1.0 / m), size.double()).long()
    r = (1.0 - c.double() * m).clamp(min=0.0)
    b = torch.sort(tail_logq, dim=-1).values  # ascending; a -inf (q_j = 0) makes the bound +inf, as it should
    rows = torch.arange(S)
    sum_c = torch.where(c > 0, torch.cumsum(b, dim=-1)[rows, (c - 1).clamp(min=0)], zero)
    nxt = b[rows, c.clamp(max=n - 1)]
    val = c.double() * m * torch.log(m) - m * sum_c
    has_next = (r > 0) & (c < size)
    return val + torch.where(has_next, r * torch.log(r.clamp(min=1e-300)) - r * nxt, zero)


def position_stats_topk(ref: RefRows, quant_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, np.ndarray]:
    """Like :func:`position_stats`, with the reference known only through its cached :class:`RefRows`.

    Exact: nll_ref, nll_quant, delta_p, top1_same, top5_overlap. KLD is the KL divergence of the two
    distributions coarse-grained to {each top-k token of the reference, everything else}:
    ``kld_k = sum_{i in K} p_i (log p_i - log q_i) + P_T (log P_T - log Q_T)``, with P_T, Q_T the tail masses.
    By the log-sum inequality ``0 <= kld - kld_k = P_T KL(p|T || q|T)``, and since every tail p_i <= p_(k)
    (the k-th largest), ``kld - kld_k <= P_T max{KL(a || q|T) : 0 <= a_i <= min(1, p_(k)/P_T)}`` =: ``kld_bound``,
    returned per position (see :func:`worst_tail_kl`).
    """
    S, V = quant_logits.shape
    if int(ref.topk_ids.max()) >= V:
        raise EdgeqError(f"--ref: token id {int(ref.topk_ids.max())} in the reference file is outside the quantised "
                         f"model's vocabulary of {V}; the two models do not share a vocabulary")
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("nll_ref", "nll_quant", "kld", "kld_bound", "tail_mass", "delta_p",
                                                          "top1_same", "top5_overlap")}
    for a, b in _row_blocks(S, V):
        q, rr = quant_logits[a:b], ref.slice(a, b)
        lq = torch.log_softmax(q.double(), dim=-1)
        ids = rr.topk_ids.long()
        pk = rr.topk_logprobs.exp()
        head = torch.where(pk > 0, pk * (rr.topk_logprobs - lq.gather(1, ids)), torch.zeros((), dtype=torch.float64)).sum(-1)
        tail = _tail_mask(ids, V)
        tail_q = lq.masked_fill(~tail, -math.inf)
        log_qt = torch.logsumexp(tail_q, dim=-1)
        p_t = rr.tail_logmass.exp()
        lump = torch.where(p_t > 0, p_t * (rr.tail_logmass - log_qt), torch.zeros((), dtype=torch.float64))
        cols["kld"].append(head + lump)
        # tail-conditional log q_j - log Q_T; top-k entries +inf so that they sort behind every tail entry
        tail_b = torch.where(tail, lq - log_qt[:, None], torch.full((), math.inf, dtype=torch.float64))
        m = (rr.topk_logprobs[:, -1] - rr.tail_logmass).exp()  # p_(k) / P_T bounds every tail p_j / P_T
        cols["tail_mass"].append(p_t)
        cols["kld_bound"].append(torch.where(p_t > 0, p_t * worst_tail_kl(tail_b, m), torch.zeros((), dtype=torch.float64)))
        tq = lq.gather(1, targets[a:b, None])[:, 0]
        cols["nll_ref"].append(-rr.target_logprob)
        cols["nll_quant"].append(-tq)
        cols["delta_p"].append(tq.exp() - rr.target_logprob.exp())
        cols["top1_same"].append((q.argmax(-1) == rr.top1.long()).double())
        n5 = rr.top5.shape[1]
        cols["top5_overlap"].append(top_n_mask(q, n5).gather(1, rr.top5.long()).sum(-1).double() / n5)
    return {k: torch.cat(v).numpy() for k, v in cols.items()}


# ------------------------------------------------------------------------------------------------------- statistics
def _mean_se(x: np.ndarray) -> tuple[float, Optional[float]]:
    """Mean and its standard error ``s / sqrt(n)`` (s the sample standard deviation; llama-perplexity's
    ``sqrt((<x^2> - <x>^2) / (n - 1))`` is the same number). ``None`` for n < 2."""
    n = x.size
    mean = float(x.mean())
    return mean, (float(x.std(ddof=1) / math.sqrt(n)) if n >= 2 else None)


def summarize(cols: dict[str, np.ndarray], *, ctx: int, score: str, windows: int, partial: bool,
              ref_topk: Optional[int] = None, per_layer: Optional[tuple[LayerError, ...]] = None,
              per_layer_count: Optional[int] = None) -> FidelityReport:
    """Turn per-position arrays (from :func:`position_stats` / :func:`position_stats_topk`) into the report.

    ln ratio = mean(nll_q - nll_r), whose standard error ``sd(nll_q - nll_r) / sqrt(n)`` equals
    ``sqrt(se_q^2 + se_r^2 - 2 cov)`` (the correlation-aware form llama-perplexity prints); ratio = exp(ln ratio)
    +- ratio * se_ln (delta method); PPL = exp(mean nll) +- PPL * se_nll; top-1 +- sqrt(p (1-p) / (n-1));
    RMS dp = sqrt(<dp^2>) +- se(dp^2) / (2 RMS); percentiles interpolate linearly between order statistics.
    """
    n = int(cols["kld"].size)
    if n == 0:
        raise EdgeqError("fidelity: no position was scored; use a longer --text or a smaller --ctx")
    nll_r, nll_q, kld = cols["nll_ref"], cols["nll_quant"], cols["kld"]
    m_r, se_r = _mean_se(nll_r)
    m_q, se_q = _mean_se(nll_q)
    ln_ratio, se_ln = _mean_se(nll_q - nll_r)
    corr = None
    if n >= 2 and nll_r.std() > 0 and nll_q.std() > 0:
        corr = float(np.corrcoef(nll_q, nll_r)[0, 1])
    kld_mean, kld_se = _mean_se(kld)
    p90, p95, p99, p999, median = (float(v) for v in np.percentile(kld, [90, 95, 99, 99.9, 50]))
    top1 = float(cols["top1_same"].mean())
    top1_se = math.sqrt(top1 * (1 - top1) / (n - 1)) if n >= 2 else None
    top5, top5_se = _mean_se(cols["top5_overlap"])
    dp_mean, dp_se = _mean_se(cols["delta_p"])
    mse, mse_se = _mean_se(cols["delta_p"] ** 2)
    rms = math.sqrt(mse)
    rms_se = None if mse_se is None else (mse_se / (2 * rms) if rms > 0 else 0.0)
    bound = float(cols["kld_bound"].mean()) if "kld_bound" in cols else None
    tail = float(cols["tail_mass"].mean()) if "tail_mass" in cols else None
    ppl_r, ppl_q, ratio = math.exp(m_r), math.exp(m_q), math.exp(ln_ratio)
    return FidelityReport(
        partial=partial, ctx=ctx, score=score, windows=windows, tokens_scored=n, ref_topk=ref_topk,
        ppl_ref=ppl_r, ppl_ref_err=None if se_r is None else ppl_r * se_r,
        ppl_quant=ppl_q, ppl_quant_err=None if se_q is None else ppl_q * se_q,
        ppl_ratio=ratio, ppl_ratio_err=None if se_ln is None else ratio * se_ln,
        ln_ppl_ratio=ln_ratio, ln_ppl_ratio_err=se_ln, nll_correlation=corr,
        kld_mean=kld_mean, kld_mean_err=kld_se, kld_median=median, kld_p90=p90, kld_p95=p95, kld_p99=p99,
        kld_p999=p999, kld_max=float(kld.max()), kld_topk_bound=bound, ref_tail_mass=tail,
        top1_agreement=top1, top1_agreement_err=top1_se, top5_overlap=top5, top5_overlap_err=top5_se,
        delta_p_mean=dp_mean, delta_p_mean_err=dp_se, delta_p_rms=rms, delta_p_rms_err=rms_se,
        per_layer=per_layer, per_layer_count=per_layer_count)


def broken_bounds(report: FidelityReport, *, max_kld: Optional[float] = None, min_top1: Optional[float] = None,
                  max_ppl_ratio: Optional[float] = None) -> list[str]:
    """The user bounds the report breaks, one sentence each (point estimates, not uncertainty intervals)."""
    broken = []
    if max_kld is not None and not report.kld_mean <= max_kld:
        broken.append(f"mean KLD {report.kld_mean:.6g} > --max-kld {max_kld:g}")
    if min_top1 is not None and not report.top1_agreement >= min_top1:
        broken.append(f"same top-1 {report.top1_agreement:.6g} < --min-top1 {min_top1:g}")
    if max_ppl_ratio is not None and not report.ppl_ratio <= max_ppl_ratio:
        broken.append(f"PPL ratio {report.ppl_ratio:.6g} > --max-ppl-ratio {max_ppl_ratio:g}")
    return broken


# ------------------------------------------------------------------------------------------------------------ sides
def _is_quantized(module: torch.nn.Module) -> bool:
    return getattr(type(module), "edgeq_quantized", False) is True


def _config_int(config: Any, key: str) -> Optional[int]:
    v = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _from_configs(obj: Any, module: Any, key: str) -> Optional[int]:
    return _config_int(getattr(obj, "config", None), key) or _config_int(getattr(module, "config", None), key)


class _Side:
    """One model as the comparison sees it: a scoring function, and (when known) its module, tokenizer, vocab size."""

    def __init__(self, obj: Any, label: str, tokenizer: Any = None):
        self.label = label
        self.module: Optional[torch.nn.Module] = None
        if isinstance(obj, torch.nn.Module):
            self.module = obj
        elif isinstance(getattr(obj, "model", None), torch.nn.Module):
            self.module = obj.model
            tokenizer = tokenizer if tokenizer is not None else getattr(obj, "tokenizer", None)
        elif not callable(obj):
            raise EdgeqError(f"{label}: expected a model (nn.Module, an object with .model) or a scoring function, "
                             f"got {type(obj).__name__}")
        self.tokenizer = tokenizer
        self.vocab_size = _from_configs(obj, self.module, "vocab_size")
        self.max_positions = _from_configs(obj, self.module, "max_position_embeddings")
        self._fn = obj if self.module is None else None
        if self.module is not None:
            self.module.eval()  # dropout would make a model differ from itself
            params = inspect.signature(self.module.forward).parameters
            self._kwargs = {k: v for k, v in (("use_cache", False),) if k in params}
            self._keep = "logits_to_keep" in params

    def check_ctx(self, ctx: int) -> None:
        if self.max_positions is not None and ctx > self.max_positions:
            raise EdgeqError(f"--ctx {ctx}: the {self.label} model has max_position_embeddings {self.max_positions}; "
                             f"use --ctx {self.max_positions} or less")

    def logits(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """float32 logits [T', V] of window ``ids`` [1, T], aligned to the window's end (T' >= ``keep``)."""
        T = ids.shape[1]
        with torch.inference_mode():
            if self.module is None:
                out = self._fn(ids)
            else:
                kw = dict(self._kwargs, logits_to_keep=keep) if self._keep else self._kwargs
                out = self.module(input_ids=ids, **kw)
            out = getattr(out, "logits", out)
            if isinstance(out, (tuple, list)):
                out = out[0]
        if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[0] != 1 or not keep <= out.shape[1] <= T:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise EdgeqError(f"{self.label}: the model returned logits of shape {shape} for input [1, {T}]; "
                             f"expected [1, T', V] with {keep} <= T' <= {T}")
        return out[0].float()


# -------------------------------------------------------------------------------------------- tokenizer agreement
def _id_to_token(tok: Any) -> list[Optional[str]]:
    vocab = tok.get_vocab()
    table: list[Optional[str]] = [None] * (max(vocab.values(), default=-1) + 1)
    for t, i in vocab.items():
        table[i] = t
    return table


def tokenizer_sha256(tok: Any) -> str:
    """sha256 of the id->token table, the BOS/EOS ids and (for fast tokenizers) the normalizer, pre-tokenizer and
    model sections of tokenizer.json (the merges): equal hashes mean equal tokenisation."""
    h = hashlib.sha256()
    h.update(json.dumps({"vocab": _id_to_token(tok), "bos": getattr(tok, "bos_token_id", None),
                         "eos": getattr(tok, "eos_token_id", None)}, ensure_ascii=False).encode())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        h.update(json.dumps({k: spec.get(k) for k in ("normalizer", "pre_tokenizer", "model")},
                            sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def check_same_vocabulary(ref: _Side, quant: _Side) -> None:
    """Refuse two models that do not share a vocabulary: config vocab size, then tokenizer size, then the first
    token id whose string differs, then BOS/EOS ids."""
    if ref.vocab_size is not None and quant.vocab_size is not None and ref.vocab_size != quant.vocab_size:
        raise EdgeqError(f"vocab size differs: reference {ref.vocab_size}, quantised {quant.vocab_size}; "
                         f"compare a quantised model only with the model it was made from")
    if ref.tokenizer is None or quant.tokenizer is None:
        return
    a, b = _id_to_token(ref.tokenizer), _id_to_token(quant.tokenizer)
    if len(a) != len(b):
        raise EdgeqError(f"tokenizer differs: reference has {len(a)} token ids, quantised {len(b)}; "
                         f"use the tokenizer files of the reference checkpoint")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            raise EdgeqError(f"tokenizer differs at token id {i}: reference {x!r}, quantised {y!r}; "
                             f"use the tokenizer files of the reference checkpoint")
    for attr in ("bos_token_id", "eos_token_id"):
        x, y = getattr(ref.tokenizer, attr, None), getattr(quant.tokenizer, attr, None)
        if x != y:
            raise EdgeqError(f"tokenizer differs: {attr} is {x} in the reference, {y} in the quantised model")


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _check_same_encoding(ids: list[int], other: list[int]) -> None:
    if ids == other:
        return
    i = next((j for j, (x, y) in enumerate(zip(ids, other)) if x != y), min(len(ids), len(other)))
    x = ids[i] if i < len(ids) else None
    y = other[i] if i < len(other) else None
    raise EdgeqError(f"tokenizer differs: the text tokenises differently at token {i} (reference id {x}, quantised "
                     f"id {y}, {len(ids)} vs {len(other)} tokens); use the tokenizer files of the reference checkpoint")


# -------------------------------------------------------------------------------------------------------- per-layer
class _LayerProbe:
    """Forward hooks measuring each quantised linear against the same-named reference module, one window at a time.

    The quantised model runs first: its hooks keep the outputs at the scored rows of the current window (float32).
    Then the reference model runs: its hooks accumulate, in float64, ``||y_q - y_ref||^2``, ``||y_ref||^2`` and,
    feeding the reference input to the quantised module, ``||quant(x_ref) - y_ref||^2``. Nothing else is stored.
    """

    def __init__(self, ref: torch.nn.Module, quant: torch.nn.Module):
        self.names = [n for n, m in quant.named_modules() if _is_quantized(m)]
        if not self.names:
            raise EdgeqError("--per-layer: the quantised model has no module marked edgeq_quantized; "
                             "it needs an edgeq checkpoint loaded by edgeq.runtime")
        ref_modules = dict(ref.named_modules())
        missing = [n for n in self.names if n not in ref_modules]
        if missing:
            raise EdgeqError(f"--per-layer: quantised module {missing[0]} has no same-named module in the reference "
                             f"model ({len(missing)} missing); compare against the model it was quantised from")
        quant_modules = dict(quant.named_modules())
        self.quant_modules = {n: quant_modules[n] for n in self.names}
        self.sums = {n: np.zeros(3) for n in self.names}  # [e2e diff^2, local diff^2, ref^2]
        self.pending = {n: np.zeros(3) for n in self.names}  # the current window's, added by commit()
        self.phase, self.rows = "", (0, 0)
        self.stash: dict[str, list[torch.Tensor]] = {}
        self.dtype: dict[str, torch.dtype] = {}
        self.handles = [self.quant_modules[n].register_forward_hook(self._quant_hook(n)) for n in self.names]
        self.handles += [ref_modules[n].register_forward_hook(self._ref_hook(n)) for n in self.names]

    def _rows(self, t: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise EdgeqError(f"--per-layer: module {name} produced {type(t).__name__} "
                             f"{tuple(getattr(t, 'shape', ()))}; expected a [1, T, N] tensor")
        a, b = self.rows  # positions counted from the window end, since logits_to_keep may trim the head's input
        T = t.shape[1]
        return t[:, T - a: T - b if b else None]

    def _quant_hook(self, name: str):
        def hook(module, inputs, output):
            if self.phase == "quant":
                self.stash.setdefault(name, []).append(self._rows(output, name).float().clone())
                self.dtype[name] = inputs[0].dtype
        return hook

    def _ref_hook(self, name: str):
        def hook(module, inputs, output):
            if self.phase != "ref":
                return
            y_ref = self._rows(output, name).double()
            queue = self.stash.get(name)
            if not queue:
                raise EdgeqError(f"--per-layer: module {name} ran in the reference model but not in the quantised one")
            y_q = queue.pop(0).double()
            if y_q.shape != y_ref.shape:
                raise EdgeqError(f"--per-layer: module {name} output {tuple(y_q.shape)} in the quantised model, "
                                 f"{tuple(y_ref.shape)} in the reference")
            self.phase = "local"  # the quantised module's own hook must not stash this call
            x = self._rows(inputs[0], name).to(self.dtype.get(name, inputs[0].dtype)).contiguous()
            y_local = self.quant_modules[name](x).double()
            self.phase = "ref"
            s = self.pending[name]
            s[0] += float(((y_q - y_ref) ** 2).sum())
            s[1] += float(((y_local - y_ref) ** 2).sum())
            s[2] += float((y_ref ** 2).sum())
        return hook

    def commit(self) -> None:
        for n, p in self.pending.items():
            self.sums[n] += p
            p[:] = 0

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.stash.clear()

    def results(self, top: int) -> tuple[tuple[LayerError, ...], int]:
        def rel(num: float, den: float) -> float:
            return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
        errs = [LayerError(n, rel(s[0], s[2]), rel(s[1], s[2])) for n, s in self.sums.items()]
        errs.sort(key=lambda e: (-e.rel_err, e.name))
        return tuple(errs[: max(top, 0)]), len(errs)


# ----------------------------------------------------------------------------------------------------- the run loop
@dataclass(frozen=True)
class ReferenceFile:
    """A loaded ``--save-ref`` file: its JSON header, the windows it scored and the per-position :class:`RefRows`."""

    header: dict
    windows: torch.Tensor
    rows: RefRows
    path: str = "--ref"

    @property
    def counts(self) -> list[int]:
        w = Windowing(self.header["ctx"], self.header["score"])
        return plan_counts(self.windows.shape[0], w.per_window, self.header["positions"])


def _window_logits(ids: torch.Tensor, keep: int, count: int, ref: Optional[_Side], quant: Optional[_Side],
                   probe: Optional[_LayerProbe]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Scored rows [count, V] of both models for one window; the quantised model first (the probe needs it so)."""
    out: dict[str, Optional[torch.Tensor]] = {"quant": None, "ref": None}
    for phase, s in (("quant", quant), ("ref", ref)):
        if s is None:
            continue
        if probe is not None:
            probe.phase = phase
        logits = s.logits(ids, keep)
        out[phase] = logits[logits.shape[0] - keep:][:count]
    if probe is not None:
        probe.phase = ""
        probe.stash.clear()
    return out["ref"], out["quant"]


def _run(windows: torch.Tensor, counts: list[int], win: Windowing, *, ref: Optional[_Side], quant: Optional[_Side],
         ref_file: Optional[ReferenceFile], save_k: Optional[int], probe: Optional[_LayerProbe],
         progress: Optional[Progress]) -> tuple[dict[str, np.ndarray], list[RefRows], int, bool, int]:
    """Score window by window; return (per-position arrays, saved ref rows, windows done, interrupted, vocab).

    A window counts only once all of its results are in, so that an interrupt leaves consistent statistics.
    """
    cols: list[dict[str, np.ndarray]] = []
    saved: list[RefRows] = []
    done, interrupted, vocab, offset = 0, False, -1, 0
    keep = win.ctx - win.first
    t0 = time.monotonic()
    try:
        for w, count in enumerate(counts):
            ids = windows[w: w + 1]
            targets = ids[0, win.first + 1: win.first + 1 + count]
            if probe is not None:
                probe.rows = (keep, keep - count)
            r, q = _window_logits(ids, keep, count, ref, quant, probe)
            vocab = _check_vocab(q, r, ref_file, vocab)
            rows = ref_rows(r, targets, save_k) if save_k is not None else None
            if r is not None and q is not None:
                stats = position_stats(r, q, targets)
            elif q is not None:
                stats = position_stats_topk(ref_file.rows.slice(offset, offset + count), q, targets)
            else:
                stats = {"nll_ref": (-rows.target_logprob).numpy()}
            del q, r
            cols.append(stats)
            if rows is not None:
                saved.append(rows)
            if probe is not None:
                probe.commit()
            offset += count
            done += 1
            if progress is not None:
                progress(done, len(counts), (time.monotonic() - t0) / done * (len(counts) - done))
    except KeyboardInterrupt:
        interrupted = True
        if probe is not None:
            probe.phase = ""
        if done == 0:
            raise
    del cols[done:], saved[done:]
    merged = {k: np.concatenate([c[k] for c in cols]) for k in cols[0]} if cols else {}
    return merged, saved, done, interrupted, vocab


def _check_vocab(q: Optional[torch.Tensor], r: Optional[torch.Tensor], ref_file: Optional[ReferenceFile],
                 seen: int) -> int:
    if seen >= 0:
        return seen
    if q is not None and r is not None and q.shape[-1] != r.shape[-1]:
        raise EdgeqError(f"vocab size differs: the reference model has {r.shape[-1]} logits, the quantised model "
                         f"{q.shape[-1]}; compare a quantised model only with the model it was made from")
    if q is not None and ref_file is not None and q.shape[-1] != ref_file.header["vocab_size"]:
        raise EdgeqError(f"vocab size differs: the reference file was made with {ref_file.header['vocab_size']} "
                         f"logits, the quantised model has {q.shape[-1]}; use a reference file of the same model")
    return (q if q is not None else r).shape[-1]


def _resolve_ids(text: Optional[str], input_ids: Optional[Sequence[int]], sides: Sequence[_Side],
                 tokenizer: Any) -> tuple[list[int], Optional[int], Optional[str]]:
    """Token ids of the evaluation text, the BOS id to start windows with, and the text's sha256."""
    tok = tokenizer if tokenizer is not None else next((s.tokenizer for s in sides if s.tokenizer is not None), None)
    if input_ids is not None:
        return [int(i) for i in input_ids], (getattr(tok, "bos_token_id", None) if tok is not None else None), None
    if text is None:
        text = DEFAULT_TEXT.read_text(encoding="utf-8")
    if tok is None:
        raise EdgeqError("fidelity: no tokenizer to turn the text into tokens; pass models with a .tokenizer, "
                         "tokenizer=..., or input_ids=...")
    ids = _encode(tok, text)
    for s in sides:
        if s.tokenizer is not None and s.tokenizer is not tok:
            _check_same_encoding(ids, _encode(s.tokenizer, text))
    return ids, getattr(tok, "bos_token_id", None), hashlib.sha256(text.encode("utf-8")).hexdigest()


def compare(ref: Any, quant: Any, *, text: Optional[str] = None, input_ids: Optional[Sequence[int]] = None,
            tokenizer: Any = None, ctx: int = DEFAULT_CTX, score: str = "half", max_tokens: Optional[int] = None,
            per_layer: bool = False, top: int = 10, save_ref: Optional[str | os.PathLike] = None,
            ref_topk: int = DEFAULT_REF_TOPK, progress: Optional[Progress] = None) -> FidelityReport:
    """Compare two in-memory models on ``text`` (default: the bundled held-out text) or on ``input_ids``.

    ``ref``, ``quant``: sides as in the module docstring. Refuses models whose vocabularies or tokenizers differ.
    ``save_ref``: also write the reference's per-position top-``ref_topk`` data to that file (see
    :func:`save_reference_file`). A KeyboardInterrupt after at least one window returns the statistics so far with
    ``partial=True`` (and writes no reference file).
    """
    win = Windowing(ctx, score)
    if save_ref and ref_topk < 1:
        raise EdgeqError(f"--ref-topk {ref_topk}: must be at least 1 (use {DEFAULT_REF_TOPK})")
    r, q = _Side(ref, "reference", tokenizer), _Side(quant, "quantised", tokenizer)
    check_same_vocabulary(r, q)
    r.check_ctx(ctx)
    q.check_ctx(ctx)
    ids, bos, text_sha = _resolve_ids(text, input_ids, (r, q), tokenizer)
    windows = make_windows(ids, ctx, bos)
    counts = plan_counts(windows.shape[0], win.per_window, max_tokens)
    probe = None
    if per_layer:
        if r.module is None or q.module is None:
            raise EdgeqError("--per-layer needs both models as nn.Modules, not scoring functions")
        probe = _LayerProbe(r.module, q.module)
    try:
        cols, saved, done, interrupted, vocab = _run(windows, counts, win, ref=r, quant=q, ref_file=None,
                                                     save_k=ref_topk if save_ref else None, probe=probe,
                                                     progress=progress)
        layers, n_layers = probe.results(top) if probe else (None, None)
    finally:
        if probe is not None:
            probe.close()
    if save_ref and not interrupted:
        tok = r.tokenizer if r.tokenizer is not None else tokenizer
        _write_reference(save_ref, windows[:done], saved, win, k=ref_topk, vocab=vocab, bos=bos,
                         tokenizer_sha=tokenizer_sha256(tok) if tok is not None else None, text_sha=text_sha)
    return summarize(cols, ctx=ctx, score=score, windows=done, partial=interrupted, per_layer=layers,
                     per_layer_count=n_layers)


# ------------------------------------------------------------------------------------------------ reference files
def _write_reference(path: str | os.PathLike, windows: torch.Tensor, rows: list[RefRows], win: Windowing, *, k: int,
                     vocab: int, bos: Optional[int], tokenizer_sha: Optional[str], text_sha: Optional[str]) -> None:
    from safetensors.torch import save_file

    from edgeq import __version__

    data = RefRows.cat(rows)
    header = {"format": REF_FORMAT, "created_by": f"edgeq {__version__}", "tokenizer_sha256": tokenizer_sha,
              "text_sha256": text_sha, "ctx": win.ctx, "score": win.score, "k": int(data.topk_ids.shape[1]),
              "requested_k": k, "vocab_size": vocab, "bos_id": bos, "windows": int(windows.shape[0]),
              "positions": int(data.target_logprob.shape[0])}
    tensors = {"input_ids": windows.int().contiguous(), **{f.name: getattr(data, f.name).contiguous() for f in fields(RefRows)}}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata={"edgeq_fidelity_ref": json.dumps(header)})
        os.replace(tmp, path)  # a crash never leaves a half-written reference behind under the real name
    finally:
        tmp.unlink(missing_ok=True)


def load_reference_file(path: str | os.PathLike) -> ReferenceFile:
    """Read and validate a ``--save-ref`` file; every defect is an EdgeqError naming the file."""
    from safetensors import safe_open

    path = Path(path)
    fix = "re-create it with edgeq fidelity REF QUANT --save-ref FILE"
    if not path.is_file():
        raise EdgeqError(f"{path}: reference file not found; {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if "edgeq_fidelity_ref" not in meta:
                raise EdgeqError(f"{path}: not an edgeq fidelity reference file (no edgeq_fidelity_ref header); {fix}")
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    except EdgeqError:
        raise
    except Exception as e:  # safetensors reports truncation as "incomplete metadata, file not fully covered" etc.
        raise EdgeqError(f"{path}: unreadable or truncated reference file ({e}); {fix}") from None
    header = json.loads(meta["edgeq_fidelity_ref"])
    if header.get("format") != REF_FORMAT:
        raise EdgeqError(f"{path}: reference format {header.get('format')!r}, this edgeq reads {REF_FORMAT!r}; {fix}")
    names = ["input_ids"] + [f.name for f in fields(RefRows)]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise EdgeqError(f"{path}: reference file lacks tensor(s) {', '.join(missing)}; {fix}")
    P, k, W, ctx = header["positions"], header["k"], header["windows"], header["ctx"]
    n5 = min(TOP5, header["vocab_size"])
    want = {"input_ids": (W, ctx), "topk_ids": (P, k), "topk_logprobs": (P, k), "target_logprob": (P,),
            "tail_logmass": (P,), "top1": (P,), "top5": (P, n5)}
    for n, shape in want.items():
        if tuple(tensors[n].shape) != shape:
            raise EdgeqError(f"{path}: tensor {n} has shape {tuple(tensors[n].shape)}, the header says {shape}; {fix}")
    ref = ReferenceFile(header, tensors["input_ids"].long(), RefRows(*(tensors[f.name] for f in fields(RefRows))),
                        str(path))
    if sum(ref.counts) != P:
        raise EdgeqError(f"{path}: {P} positions do not fit {W} windows of ctx {ctx} ({header['score']}); {fix}")
    return ref


def compare_to_reference_file(ref_file: str | os.PathLike | ReferenceFile, quant: Any, *, text: Optional[str] = None,
                              tokenizer: Any = None, ctx: Optional[int] = None, score: Optional[str] = None,
                              max_tokens: Optional[int] = None, progress: Optional[Progress] = None) -> FidelityReport:
    """Compare ``quant`` against a reference cached by ``--save-ref``, on the windows stored in the file.

    ``text``, ``ctx``, ``score``, when given, must match the file (else EdgeqError); the quantised tokenizer, when
    known, must hash the same as the reference's. KLD statistics are then top-k approximations (lower bounds; the
    report's ``kld_topk_bound`` bounds the mean's shortfall); everything else is exact.
    """
    ref = ref_file if isinstance(ref_file, ReferenceFile) else load_reference_file(ref_file)
    h, name = ref.header, ref.path
    for opt, mine, theirs in (("--ctx", ctx, h["ctx"]), ("--score", score, h["score"])):
        if mine is not None and mine != theirs:
            raise EdgeqError(f"{name}: made with {opt} {theirs}, asked for {opt} {mine}; drop {opt} or re-create "
                             f"the reference file")
    q = _Side(quant, "quantised", tokenizer)
    q.check_ctx(h["ctx"])
    if q.vocab_size is not None and q.vocab_size != h["vocab_size"]:
        raise EdgeqError(f"vocab size differs: the reference file was made with {h['vocab_size']}, the quantised "
                         f"model has {q.vocab_size}; use a reference file of the same model")
    if q.tokenizer is not None and h["tokenizer_sha256"] is not None:
        mine_sha = tokenizer_sha256(q.tokenizer)
        if mine_sha != h["tokenizer_sha256"]:
            raise EdgeqError(f"{name}: made with a different tokenizer (sha256 {h['tokenizer_sha256'][:12]}, the "
                             f"quantised model's is {mine_sha[:12]}); use a reference file of the same model")
    if text is not None:
        sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if h["text_sha256"] is None:
            raise EdgeqError(f"{name}: made from token ids, not from a text; drop --text (the file holds the tokens)")
        if sha != h["text_sha256"]:
            raise EdgeqError(f"{name}: made from another text (sha256 {str(h['text_sha256'])[:12]}, --text has "
                             f"{sha[:12]}); pass the same --text or re-create the reference file")
    win = Windowing(h["ctx"], h["score"])
    counts = ref.counts
    if max_tokens is not None:
        counts = plan_counts(len(counts), win.per_window, min(max_tokens, h["positions"]))
    cols, _, done, interrupted, _ = _run(ref.windows, counts, win, ref=None, quant=q, ref_file=ref, save_k=None,
                                         probe=None, progress=progress)
    return summarize(cols, ctx=win.ctx, score=win.score, windows=done, partial=interrupted, ref_topk=h["k"])


def save_reference_file(ref: Any, path: str | os.PathLike, *, text: Optional[str] = None,
                        input_ids: Optional[Sequence[int]] = None, tokenizer: Any = None, ctx: int = DEFAULT_CTX,
                        score: str = "half", max_tokens: Optional[int] = None, k: int = DEFAULT_REF_TOPK,
                        progress: Optional[Progress] = None) -> tuple[int, float]:
    """Score only the reference and write its ``--ref`` file; returns (positions, PPL of the reference).

    Interrupted runs write nothing (a KeyboardInterrupt propagates).
    """
    win = Windowing(ctx, score)
    if k < 1:
        raise EdgeqError(f"--ref-topk {k}: must be at least 1 (use {DEFAULT_REF_TOPK})")
    r = _Side(ref, "reference", tokenizer)
    r.check_ctx(ctx)
    ids, bos, text_sha = _resolve_ids(text, input_ids, (r,), tokenizer)
    windows = make_windows(ids, ctx, bos)
    counts = plan_counts(windows.shape[0], win.per_window, max_tokens)
    cols, saved, done, interrupted, vocab = _run(windows, counts, win, ref=r, quant=None, ref_file=None, save_k=k,
                                                 probe=None, progress=progress)
    if interrupted:
        raise KeyboardInterrupt
    tok = r.tokenizer if r.tokenizer is not None else tokenizer
    _write_reference(path, windows[:done], saved, win, k=k, vocab=vocab, bos=bos,
                     tokenizer_sha=tokenizer_sha256(tok) if tok is not None else None, text_sha=text_sha)
    return int(cols["nll_ref"].size), math.exp(float(cols["nll_ref"].mean()))


# -------------------------------------------------------------------------------------------------- paths and CLI
def _default_load(path: str | os.PathLike) -> Any:
    from edgeq.runtime import load  # the runtime is heavy and optional for the pure statistics above

    # Scoring runs whole windows without the KV cache; 16 MiB is above any model's bytes per token, far below the
    # 256 MiB default that would otherwise sit unused twice.
    return load(path, kv_cache_bytes=16 << 20)


def run_fidelity(ref: Optional[str | os.PathLike], quant: Optional[str | os.PathLike], *,
                 text_path: Optional[str | os.PathLike] = None, ctx: Optional[int] = None,
                 score: Optional[str] = None, max_tokens: Optional[int] = None,
                 save_ref: Optional[str | os.PathLike] = None, ref_file: Optional[str | os.PathLike] = None,
                 per_layer: bool = False, top: int = 10, ref_topk: int = DEFAULT_REF_TOPK,
                 progress: Optional[Progress] = None,
                 load_fn: Optional[Callable[[Any], Any]] = None, allow_swapped: bool = False) -> FidelityReport:
    """``edgeq fidelity`` on checkpoint paths. ``load_fn(path)`` returns an object with ``.model``, ``.tokenizer``
    and ``.config`` (default: ``edgeq.runtime.load``). With ``ref_file`` the reference is not loaded (``ref`` must be
    None); the reference file is read before the quantised model is loaded so that a bad file fails fast.
    ``allow_swapped``: see :func:`check_order`."""
    load = load_fn or _default_load
    check_order(ref, quant, allow_swapped)
    text = _read_text(text_path) if text_path is not None else None
    if quant is None:
        raise EdgeqError("fidelity: no quantised checkpoint given; usage: edgeq fidelity REF QUANT")
    if ref_file is not None:
        if ref is not None:
            raise EdgeqError("fidelity: --ref FILE replaces the REF checkpoint; give only QUANT")
        if per_layer:
            raise EdgeqError("--per-layer needs the reference model itself; drop --ref and give REF QUANT")
        if save_ref is not None:
            raise EdgeqError("fidelity: --save-ref and --ref together would copy the file; give one of them")
        cached = load_reference_file(ref_file)
        return compare_to_reference_file(cached, load(quant), text=text, ctx=ctx, score=score,
                                         max_tokens=max_tokens, progress=progress)
    if ref is None:
        raise EdgeqError("fidelity: no reference checkpoint; usage: edgeq fidelity REF QUANT (or QUANT --ref FILE)")
    return compare(load(ref), load(quant), text=text, ctx=ctx or DEFAULT_CTX, score=score or "half",
                   max_tokens=max_tokens, per_layer=per_layer, top=top, save_ref=save_ref, ref_topk=ref_topk,
                   progress=progress)


def is_edgeq_checkpoint(path: str | os.PathLike) -> bool:
    """An edgeq checkpoint carries its manifest (every kernel's); a Hugging Face checkpoint does not."""
    from edgeq.io.manifest import MANIFEST

    return (Path(path) / MANIFEST).is_file()


def check_order(ref: Optional[str | os.PathLike], quant: Optional[str | os.PathLike], allow_swapped: bool = False) -> None:
    """Refuse REF and QUANT given the wrong way round: REF an edgeq checkpoint and QUANT not.

    Swapped, the comparison still runs and reports PPL(quant)/PPL(ref) = PPL(reference)/PPL(quantised), typically
    just below 1, which a ``--max-ppl-ratio`` gate passes: a broken quantisation would go green. Two edgeq
    checkpoints, or two plain ones, are taken as given; ``allow_swapped`` takes this case as given too."""
    if allow_swapped or ref is None or quant is None:
        return
    if is_edgeq_checkpoint(ref) and not is_edgeq_checkpoint(quant):
        raise EdgeqError(f"fidelity: REF {ref} is an edgeq checkpoint and QUANT {quant} is not; the order is "
                         f"REF QUANT (the reference first): run edgeq fidelity {quant} {ref}, or pass --allow-swapped "
                         "to score them as given")


def _read_text(path: str | os.PathLike) -> str:
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EdgeqError(f"{p}: text file not found; pass an existing UTF-8 file to --text") from None
    except UnicodeDecodeError as e:
        raise EdgeqError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None


# ------------------------------------------------------------------------------------------------------- rendering
def _pm(v: Optional[float], e: Optional[float], fmt: str) -> tuple[str, str]:
    return ("-" if v is None else format(v, fmt)), ("" if e is None else "± " + format(e, fmt))


def render(report: FidelityReport, top: Optional[int] = None):
    """A compact rich table of the report (and the worst layers with --per-layer)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    r = report
    title = f"fidelity: {r.tokens_scored} tokens in {r.windows} windows, ctx {r.ctx}, scored {r.score}"
    if r.ref_topk is not None:
        title += f", reference top-{r.ref_topk}"
    if r.partial:
        title += "  [PARTIAL: interrupted]"
    t = Table(title=title, box=box.SIMPLE, show_header=True, title_justify="left")
    t.add_column("statistic")
    t.add_column("value", justify="right")
    t.add_column("uncertainty", justify="right")
    rows = [
        ("PPL(ref)", *_pm(r.ppl_ref, r.ppl_ref_err, ".4f")),
        ("PPL(quant)", *_pm(r.ppl_quant, r.ppl_quant_err, ".4f")),
        ("PPL(quant)/PPL(ref)", *_pm(r.ppl_ratio, r.ppl_ratio_err, ".5f")),
        ("ln(PPL ratio)", *_pm(r.ln_ppl_ratio, r.ln_ppl_ratio_err, ".5f")),
        ("Cor(nll ref, nll quant)", *_pm(r.nll_correlation, None, ".2%")),
        ("mean KLD", *_pm(r.kld_mean, r.kld_mean_err, ".6f")),
    ]
    if r.kld_topk_bound is not None:
        rows.append((f"  top-{r.ref_topk} shortfall bound", f"<= {r.kld_topk_bound:.6f}", ""))
        rows.append((f"  ref mass outside top-{r.ref_topk}", f"{r.ref_tail_mass:.3%}", ""))
    rows += [("KLD median / p90 / p95", " / ".join(f"{v:.5f}" for v in (r.kld_median, r.kld_p90, r.kld_p95)), ""),
             ("KLD p99 / p99.9 / max", " / ".join(f"{v:.5f}" for v in (r.kld_p99, r.kld_p999, r.kld_max)), ""),
             ("same top-1", *_pm(r.top1_agreement, r.top1_agreement_err, ".3%")),
             ("top-5 overlap", *_pm(r.top5_overlap, r.top5_overlap_err, ".3%")),
             ("mean Δp", *_pm(r.delta_p_mean, r.delta_p_mean_err, ".3%")),
             ("RMS Δp", *_pm(r.delta_p_rms, r.delta_p_rms_err, ".3%"))]
    for row in rows:
        t.add_row(*row)
    if not r.per_layer:
        return t
    layers = r.per_layer[: top] if top is not None else r.per_layer
    lt = Table(title=f"worst {len(layers)} of {r.per_layer_count} quantised linears (‖y_q−y_ref‖/‖y_ref‖)",
               box=box.SIMPLE, title_justify="left")
    lt.add_column("module")
    lt.add_column("end to end", justify="right")
    lt.add_column("this layer alone", justify="right")
    for e in layers:
        lt.add_row(e.name, f"{e.rel_err:.4%}", f"{e.local_rel_err:.4%}")
    return Group(t, lt)


def _progress_bar(quiet: bool = False):
    """A rich progress bar on stderr and the callback that drives it (``quiet``: neither)."""
    from contextlib import nullcontext

    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

    from edgeq.console import err

    if quiet:
        return nullcontext(), None
    bar = Bar(TextColumn("fidelity windows"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
              console=err, transient=True)
    task = bar.add_task("windows", total=None)

    def update(done: int, total: int, eta: Optional[float]) -> None:
        bar.update(task, completed=done, total=total)
    return bar, update


def fidelity_command(
    models: Annotated[list[Path], typer.Argument(help="REF QUANT (directories or hub ids); or QUANT alone with --ref FILE; or REF alone with --save-ref FILE", show_default=False,
                                             metavar="REF QUANT")],
    revision: Annotated[Optional[str], typer.Option("--revision", help=REVISION_HELP + " Applies to every hub id given.")] = None,
    allow_swapped: Annotated[bool, typer.Option("--allow-swapped", help="score REF QUANT as given when REF is an edgeq checkpoint and QUANT is not (refused otherwise: the order is probably swapped)")] = False,
    text: Annotated[Optional[Path], typer.Option("--text", help="UTF-8 evaluation text (default: the bundled held-out prose, edgeq/data/heldout-prose.txt)")] = None,
    ctx: Annotated[Optional[int], typer.Option("--ctx", help="tokens per window (default: 512, or the --ref file's)")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="stop after this many scored tokens")] = None,
    score: Annotated[Optional[str], typer.Option("--score", help="half: the second half of each window, as llama-perplexity (default); all: every position")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON (schema edgeq.fidelity/1)")] = False,
    save_ref: Annotated[Optional[Path], typer.Option("--save-ref", help="also cache the reference's top-k log-probs here")] = None,
    ref: Annotated[Optional[Path], typer.Option("--ref", help="compare against a --save-ref file instead of REF")] = None,
    ref_topk: Annotated[int, typer.Option("--ref-topk", help="k for --save-ref")] = DEFAULT_REF_TOPK,
    per_layer: Annotated[bool, typer.Option("--per-layer", help="relative output error of every quantised linear")] = False,
    top: Annotated[int, typer.Option("--top", help="layers shown with --per-layer")] = 10,
    max_kld: Annotated[Optional[float], typer.Option("--max-kld", help="exit 1 if mean KLD is above")] = None,
    min_top1: Annotated[Optional[float], typer.Option("--min-top1", help="exit 1 if the same-top-1 rate is below")] = None,
    max_ppl_ratio: Annotated[Optional[float], typer.Option("--max-ppl-ratio", help="exit 1 if PPL(quant)/PPL(ref) is above")] = None,
    save_card: Annotated[bool, typer.Option("--save-card", help="write the figures into QUANT's model card (README.md, its fidelity section; atomic)")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="no progress bar")] = False,
) -> None:
    """Score a quantised checkpoint against its reference (KLD, PPL ratio, top-1 agreement, ...)."""
    from edgeq.convert import card
    from edgeq.console import err, out, write

    if not 1 <= len(models) <= 2:
        raise EdgeqError(f"fidelity: {len(models)} checkpoints given; usage: edgeq fidelity REF QUANT")
    models = resolve_models(models, revision)
    if len(models) == 2:
        check_order(*models, allow_swapped)  # before the progress bar, so that the refusal is the only stderr line
    if save_card:
        card.check_checkpoint(models[-1])  # QUANT, before the run and the progress bar
    bar, update = _progress_bar(quiet)
    with bar:
        if len(models) == 1 and ref is None:
            if save_ref is None:
                raise EdgeqError("fidelity: one checkpoint given; usage: edgeq fidelity REF QUANT, "
                                 "edgeq fidelity QUANT --ref FILE, or edgeq fidelity REF --save-ref FILE")
            n, ppl = save_reference_file(_default_load(models[0]), save_ref,
                                         text=_read_text(text) if text else None, ctx=ctx or DEFAULT_CTX,
                                         score=score or "half", max_tokens=max_tokens, k=ref_topk, progress=update)
            out.print(f"wrote {save_ref}: {n} positions, PPL(ref) {ppl:.4f}")
            return
        ref_path, quant_path = (None, models[0]) if len(models) == 1 else (models[0], models[1])
        report = run_fidelity(ref_path, quant_path, text_path=text, ctx=ctx, score=score, max_tokens=max_tokens,
                              save_ref=save_ref, ref_file=ref, per_layer=per_layer, top=top, ref_topk=ref_topk,
                              progress=update, allow_swapped=allow_swapped)
    if json_out:
        write(report.to_json() + "\n")
    else:
        out.print(render(report, top))
    if report.partial:
        err.print("interrupted: the statistics above are partial" + ("; --save-ref was not written" if save_ref else ""))
        raise typer.Exit(130)
    if save_card:  # the figures as measured, whether or not a bound below is broken
        reference = f"{ref} (a --save-ref file)" if ref else card.source_name(ref_path)
        record = card.fidelity_record(report, reference=reference, text=str(text or "edgeq/data/heldout-prose.txt"))
        err.print(f"wrote the fidelity figures into {card.save_fidelity(quant_path, record)}")
    broken = broken_bounds(report, max_kld=max_kld, min_top1=min_top1, max_ppl_ratio=max_ppl_ratio)
    if broken:
        raise ThresholdError("; ".join(broken))  # the CLI prints "threshold broken: <this>", exit 1
