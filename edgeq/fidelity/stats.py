"""From per-position arrays to the report: means, standard errors, PPL ratio, percentiles (llama-perplexity's
``--kl-divergence`` statistics; every formula in docs/fidelity.md, "Statistics").

Worked example: nll_ref = (1, 2) and nll_quant = (1.5, 2.5) nats give PPL(ref) = e^1.5 = 4.4817,
PPL(quant) = e^2 = 7.3891 and ln ratio = mean(0.5, 0.5) = 0.5 with standard error 0: the two models' errors are
perfectly correlated, so the ratio e^0.5 = 1.6487 is exact although each PPL alone is uncertain.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from edgeq.errors import EdgeqError
from edgeq.fidelity.report import FidelityReport, LayerError


def mean_se(x: np.ndarray) -> tuple[float, Optional[float]]:
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
    m_r, se_r = mean_se(nll_r)
    m_q, se_q = mean_se(nll_q)
    ln_ratio, se_ln = mean_se(nll_q - nll_r)
    corr = None
    if n >= 2 and nll_r.std() > 0 and nll_q.std() > 0:
        corr = float(np.corrcoef(nll_q, nll_r)[0, 1])
    kld_mean, kld_se = mean_se(kld)
    p90, p95, p99, p999, median = (float(v) for v in np.percentile(kld, [90, 95, 99, 99.9, 50]))
    top1 = float(cols["top1_same"].mean())
    top1_se = math.sqrt(top1 * (1 - top1) / (n - 1)) if n >= 2 else None
    top5, top5_se = mean_se(cols["top5_overlap"])
    dp_mean, dp_se = mean_se(cols["delta_p"])
    mse, mse_se = mean_se(cols["delta_p"] ** 2)
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
