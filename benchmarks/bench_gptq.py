"""GPTQ vs round-to-nearest on the bundled model: fidelity, conversion time and peak memory.

    python benchmarks/bench_gptq.py                         # minmax, rtn, gptq, gptq --act-order; 3 passes
    python benchmarks/bench_gptq.py --arms rtn,gptq --passes 1 --max-tokens 2000      # quick look
    $GPTQ_ENV/bin/python benchmarks/bench_gptq.py --arms rtn,gptq,gptqmodel   # with GPTQModel (the gptq extra's venv)

Every arm converts edgeq/data/tiny-prose to w4a16-g128 with `edgeq quantize` in a child process (what ships, with
the CLI's defaults: GPTQ calibrates on the bundled calib-prose.txt, 128 x 512 tokens asked, 79 windows available),
so its wall time and its peak resident memory (the child's ru_maxrss, from wait4) are the conversion's own. Arms are
interleaved and their order rotates from pass to pass; the table shows the median and the range over passes.
Fidelity is measured once per arm (conversion is deterministic; the passes' shard hashes are compared to show it)
with `edgeq.fidelity.compare` against the bf16 model, both loaded with `edgeq.runtime.load` (the act-order arm
exercises the runtime's input permutation), on the bundled held-out text (disjoint from the calibration text).

Output: a markdown table on stdout with machine, threads, torch and date; progress on stderr; --json for raw data.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "edgeq" / "data" / "tiny-prose"
ARMS = {
    "minmax": ["--method", "minmax"],
    "rtn": ["--method", "rtn"],
    "gptq": ["--method", "gptq"],
    "gptq-act": ["--method", "gptq", "--act-order"],
    "gptqmodel": ["--method", "gptqmodel"],  # GPTQModel's quantiser: run this script from the gptq extra's environment
}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_child(arm: str, out: Path, scheme: str, extra: list[str]) -> dict:
    """One conversion in a fresh interpreter: wall time, the child's peak RSS (wait4's rusage: this child only) and
    the CLI's JSON report. The pipes are drained in threads so that wait4, not communicate(), reaps the child."""
    import threading

    cmd = [sys.executable, "-m", "edgeq.cli", "quantize", str(FIXTURE), "-o", str(out), "--scheme", scheme,
           *ARMS[arm], *extra, "--json", "-q", "--force"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    bufs = {"out": b"", "err": b""}

    def drain(stream, key):
        bufs[key] = stream.read()

    threads = [threading.Thread(target=drain, args=(proc.stdout, "out")), threading.Thread(target=drain, args=(proc.stderr, "err"))]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    for t in threads:
        t.join()
    proc.returncode = os.waitstatus_to_exitcode(status)  # tell Popen it is reaped
    if proc.returncode != 0:
        raise RuntimeError(f"{arm}: quantize failed (exit {proc.returncode}): {bufs['err'].decode()[-2000:]}")
    return {"wall_s": wall, "maxrss_bytes": usage.ru_maxrss * 1024, "report": json.loads(bufs["out"])}


def fidelity(arms: list[str], outs: dict[str, Path], ctx: int, max_tokens: int | None) -> dict:
    from edgeq import fidelity as F
    from edgeq.runtime import load

    ref = load(FIXTURE, kv_cache_bytes=16 << 20)
    res = {}
    for arm in arms:
        t0 = time.perf_counter()
        r = F.compare(ref, load(outs[arm], kv_cache_bytes=16 << 20), ctx=ctx, max_tokens=max_tokens)
        res[arm] = r
        print(f"  fidelity {arm}: KLD {r.kld_mean:.5f}, top-1 {100 * r.top1_agreement:.2f} % "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return res


def med_range(xs: list[float], fmt: str) -> str:
    m = statistics.median(xs)
    return format(m, fmt) + (f" [{format(min(xs), fmt)}–{format(max(xs), fmt)}]" if len(xs) > 1 else "")


def _same(h: list) -> str:
    """Did every pass write identical shards (sha256)?"""
    return "n/a (1 pass)" if len(h) < 2 else ("yes" if len(set(h)) == 1 else "NO")


def table(arms, runs, fid, hashes, meta) -> str:
    lines = [
        f"{meta['scheme']} on edgeq/data/tiny-prose (Llama, 4 layers, hidden 256, vocab 4096, tied head). {meta['date']}; "
        f"{meta['cpu']}, {meta['cores']} logical cores, torch {meta['torch']} ({meta['capability']}), "
        f"{meta['threads']} intra-op threads; load average {meta['load_before']} before, {meta['load_after']} after; "
        f"{meta['passes']} passes, arms interleaved (order rotated), median [min–max].",
        "",
        "| arm | method | mean KLD | KLD p99 | same top-1 | PPL ratio | convert time (s) | peak RSS (MiB) | deterministic |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        r = fid[arm]
        walls = [x["wall_s"] for x in runs[arm]]
        rss = [x["maxrss_bytes"] / 2**20 for x in runs[arm]]
        method = " ".join(ARMS[arm]).replace("--method ", "")
        lines.append(
            f"| {arm} | {method} | {r.kld_mean:.5f} ± {r.kld_mean_err:.5f} | {r.kld_p99:.4f} | "
            f"{100 * r.top1_agreement:.2f} ± {100 * r.top1_agreement_err:.2f} % | {r.ppl_ratio:.4f} | "
            f"{med_range(walls, '.1f')} | {med_range(rss, '.0f')} | {_same(hashes[arm])} |"
        )
    r0 = fid[arms[0]]
    lines.append("")
    lines.append(f"KLD = KL(bf16 || quantised) per scored token, {r0.tokens_scored} tokens of the held-out text "
                 f"({r0.windows} windows of ctx {r0.ctx}, scored {r0.score}); ± one standard error. Conversion time "
                 "is the child process's wall time (interpreter start, imports and the output's checks included); "
                 "peak RSS is its ru_maxrss.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="minmax,rtn,gptq,gptq-act", help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--scheme", default="w4a16-g128")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--gptq-args", default="", help="extra CLI arguments for the gptq arms, e.g. '--nsamples 16'")
    ap.add_argument("--json", action="store_true", help="also print the raw data as JSON")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_name(),
            "cores": os.cpu_count(), "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "passes": args.passes, "scheme": args.scheme,
            "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    runs = {a: [] for a in arms}
    hashes = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="bench-gptq-") as tmp:
        outs = {a: Path(tmp) / a for a in arms}
        for p in range(args.passes):
            order = arms[p % len(arms):] + arms[: p % len(arms)]
            for arm in order:
                extra = args.gptq_args.split() if arm.startswith("gptq") else []
                r = run_child(arm, outs[arm], args.scheme, extra)
                runs[arm].append(r)
                hashes[arm].append(tuple(sorted(r["report"]["shards"].values())))
                print(f"pass {p + 1}/{args.passes} {arm}: {r['wall_s']:.1f} s, peak RSS {r['maxrss_bytes'] / 2**20:.0f} MiB",
                      file=sys.stderr)
        fid = fidelity(arms, outs, args.ctx, args.max_tokens)
    meta["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(table(arms, runs, fid, hashes, meta))
    if args.json:
        from dataclasses import asdict

        print(json.dumps({"meta": meta, "runs": runs, "fidelity": {a: asdict(r) for a, r in fid.items()}}, indent=1,
                         default=str))


if __name__ == "__main__":
    main()
