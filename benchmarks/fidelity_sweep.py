"""Fidelity of w4a16 on the bundled model: group size x method, and what a --ref top-k cache loses.

    python benchmarks/fidelity_sweep.py                       # g32..g256 x {rtn, minmax}, k in {32, 128, 512}
    python benchmarks/fidelity_sweep.py --groups 128 --methods rtn --topk 32 --max-tokens 2000   # quick look

Everything runs offline on edgeq/data/tiny-prose and the bundled held-out text (edgeq/data/heldout-prose.txt), through
`edgeq.convert.pipeline.convert` and `edgeq.runtime.load`, so the numbers are what `edgeq fidelity` prints. Statistics are
deterministic (no timing): rerunning on the same torch build and CPU capability reproduces them. Output: markdown
tables on stdout (paste into docs/results.md), and with --json the raw reports.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from edgeq import fidelity as F
from edgeq.convert.pipeline import convert
from edgeq.keys import DATA
from edgeq.runtime import load
from edgeq.scheme import Scheme

FIXTURE = DATA / "tiny-prose"


def pm(v: float, e: float | None, fmt: str) -> str:
    return format(v, fmt) + ("" if e is None else " ± " + format(e, fmt))


def sweep_schemes(ref, tmp: Path, groups, methods, ctx, max_tokens) -> list[tuple[str, str, F.FidelityReport]]:
    rows = []
    for g in groups:
        for method in methods:
            out = tmp / f"g{g}-{method}"
            convert(FIXTURE, out, scheme=Scheme.parse(f"w4a16-g{g}"), method=method)
            t0 = time.perf_counter()
            rep = F.compare(ref, load(out), ctx=ctx, max_tokens=max_tokens)
            print(f"  g{g} {method}: mean KLD {rep.kld_mean:.5f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            rows.append((f"w4a16-g{g}", method, rep))
    return rows


def scheme_table(rows) -> str:
    lines = ["| scheme | method | PPL(quant)/PPL(ref) | mean KLD | KLD p99 | same top-1 | top-5 overlap | RMS Δp |",
             "|---|---|---|---|---|---|---|---|"]
    for scheme, method, r in rows:
        lines.append(f"| {scheme} | {method} | {pm(r.ppl_ratio, r.ppl_ratio_err, '.4f')} | "
                     f"{pm(r.kld_mean, r.kld_mean_err, '.5f')} | {r.kld_p99:.4f} | "
                     f"{pm(100 * r.top1_agreement, 100 * r.top1_agreement_err, '.2f')} % | "
                     f"{pm(100 * r.top5_overlap, 100 * r.top5_overlap_err, '.2f')} % | "
                     f"{pm(100 * r.delta_p_rms, 100 * r.delta_p_rms_err, '.3f')} % |")
    r = rows[0][2]
    lines.append(f"\nPPL(ref) = {pm(r.ppl_ref, r.ppl_ref_err, '.3f')} over {r.tokens_scored} tokens "
                 f"({r.windows} windows of ctx {r.ctx}, scored {r.score}).")
    return "\n".join(lines)


def sweep_topk(ref, quant_dir: Path, tmp: Path, ks, ctx, max_tokens) -> tuple[F.FidelityReport, list]:
    quant = load(quant_dir)
    full = F.compare(ref, quant, ctx=ctx, max_tokens=max_tokens)
    rows = []
    for k in ks:
        path = tmp / f"ref-k{k}.safetensors"
        F.save_reference_file(ref, path, ctx=ctx, max_tokens=max_tokens, k=k)
        cached = F.compare_to_reference_file(path, quant)
        rows.append((k, cached, path.stat().st_size))
        print(f"  k={k}: mean KLD {cached.kld_mean:.5f} vs {full.kld_mean:.5f}", file=sys.stderr)
    return full, rows


def topk_table(full: F.FidelityReport, rows) -> str:
    lines = ["| --ref-topk | ref mass outside top-k | mean KLD (top-k) | shortfall vs full | worst-case bound | "
             "file size |", "|---|---|---|---|---|---|"]
    for k, c, size in rows:
        short = full.kld_mean - c.kld_mean
        lines.append(f"| {k} | {100 * c.ref_tail_mass:.2f} % | {c.kld_mean:.5f} | {short:.5f} "
                     f"({100 * short / full.kld_mean:.1f} %) | {c.kld_topk_bound:.4f} | {size / 2**20:.2f} MiB |")
    lines.append(f"\nFull-vocabulary mean KLD: {pm(full.kld_mean, full.kld_mean_err, '.5f')} "
                 f"({full.tokens_scored} tokens). PPL, top-1, top-5 and Δp are identical in both modes.")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="32,64,128,256")
    ap.add_argument("--methods", default="rtn,minmax")
    ap.add_argument("--topk", default="32,128,512", help="k values for the --ref section ('' to skip)")
    ap.add_argument("--ctx", type=int, default=F.DEFAULT_CTX)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the raw reports here")
    a = ap.parse_args(argv)
    groups = [int(g) for g in a.groups.split(",") if g]
    methods = [m for m in a.methods.split(",") if m]
    ks = [int(k) for k in a.topk.split(",") if k]
    ref = load(FIXTURE)
    raw: dict = {"ctx": a.ctx, "max_tokens": a.max_tokens}
    with tempfile.TemporaryDirectory(prefix="edgeq-fidsweep-") as td:
        tmp = Path(td)
        rows = sweep_schemes(ref, tmp, groups, methods, a.ctx, a.max_tokens)
        print("### w4a16 fidelity on the bundled model (tiny-prose, held-out text)\n")
        print(scheme_table(rows))
        raw["schemes"] = [{"scheme": s, "method": m, "report": r.to_dict()} for s, m, r in rows]
        if ks:
            default = tmp / "g128-rtn"
            if not default.exists():
                convert(FIXTURE, default, scheme=Scheme.parse("w4a16-g128"), method="rtn")
            full, trows = sweep_topk(ref, default, tmp, ks, a.ctx, a.max_tokens)
            print("\n### What a --ref top-k cache loses (w4a16-g128 rtn)\n")
            print(topk_table(full, trows))
            raw["topk"] = [{"k": k, "bytes": size, "report": c.to_dict()} for k, c, size in trows]
    if a.json:
        a.json.write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    main()
