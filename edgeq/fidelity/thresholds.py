"""The user's bounds (``--max-kld``, ``--min-top1``, ``--max-ppl-ratio``): which ones a report breaks."""

from __future__ import annotations

from typing import Optional

from edgeq.fidelity.report import FidelityReport


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
