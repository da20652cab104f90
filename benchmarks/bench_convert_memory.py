"""Conversion peak memory vs model size: it must not grow with the model (streaming, row blocks, no mmap).

Builds synthetic checkpoints of ~0.5x, 1x and ~4x a base size (hidden 1024, vocab 16384, untied head; 3, 8 and 35
layers), converts each in a child process (`edgeq quantize --method rtn`), and reads the child's own peak RSS from wait4()'s
rusage (ru_maxrss of that child alone) plus the peak RssAnon the converter sampled itself.

    python benchmarks/bench_convert_memory.py [--workdir /tmp/edgeq-convmem] [--passes 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import SHAPES, write  # noqa: E402

LAYERS = {"0.5x": 3, "1x": 8, "4x": 35}


def convert_child(src: Path, out: Path) -> dict:
    # --method rtn: the streaming conversion this measures (tensor by tensor in row blocks). The plain command's quality
    # recipe (GPTQ) streams one decoder layer at a time; its peak grows with the layer's width (docs/gptq.md).
    cmd = [sys.executable, "-m", "edgeq.cli", "quantize", str(src), "-o", str(out), "--json", "--force", "-q",
           "--method", "rtn"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"conversion failed: {stderr.decode()[-2000:]}")
    report = json.loads(stdout)
    return {"seconds": time.perf_counter() - t0, "child_maxrss": usage.ru_maxrss * 1024,
            "anon_peak": report["peak_rss_anon_bytes"], "bytes_in": report["bytes_in"], "bytes_out": report["bytes_out"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/edgeq-convmem"))
    ap.add_argument("--passes", type=int, default=1)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, layers in LAYERS.items():
        src = args.workdir / f"src-{label}"
        if not (src / "config.json").exists():
            write({**SHAPES["scaled"], "num_hidden_layers": layers}, src)
        runs = [convert_child(src, args.workdir / f"out-{label}") for _ in range(args.passes)]
        shutil.rmtree(args.workdir / f"out-{label}", ignore_errors=True)
        best = min(runs, key=lambda r: r["child_maxrss"])
        rows.append({"size": label, "layers": layers, **best, "maxrss_all": [r["child_maxrss"] for r in runs]})
    base = next(r for r in rows if r["size"] == "1x")
    print(f"# conversion peak memory, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| size | layers | bf16 input | output | seconds | peak RSS (child) | vs 1x | peak RssAnon |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['layers']} | {r['bytes_in'] / 2**20:.0f} MiB | {r['bytes_out'] / 2**20:.0f} MiB | "
              f"{r['seconds']:.1f} | {r['child_maxrss'] / 2**20:.0f} MiB | {r['child_maxrss'] / base['child_maxrss']:.3f} | "
              f"{r['anon_peak'] / 2**20:.0f} MiB |")
    spread = max(r["child_maxrss"] for r in rows) / min(r["child_maxrss"] for r in rows) - 1
    print(f"\nlargest/smallest peak RSS - 1 = {spread * 100:.1f}% (target: within 10%)")


if __name__ == "__main__":
    main()
