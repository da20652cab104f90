"""The result of a comparison: :class:`FidelityReport` (JSON schema ``edgeq.fidelity/1``) and its human table.

Field meanings and formulas: docs/fidelity.md; how the numbers are computed: :mod:`edgeq.fidelity.stats`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

REPORT_SCHEMA = "edgeq.fidelity/1"


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
        """:meth:`to_dict` as strict JSON text."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def _finite_or_none(x: Any) -> Any:
    """``x`` with every non-finite float (in nested dicts and lists too) replaced by ``None``: strict JSON."""
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite_or_none(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _pm(v: Optional[float], e: Optional[float], fmt: str) -> tuple[str, str]:
    """A value and its uncertainty as table cells: ``("1.0173", "± 0.0018")``; "-" / "" when unknown."""
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
