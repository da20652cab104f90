"""``edgeq bench --convert``: the time and peak memory of ``edgeq quantize``, measured on a child process per pass
(its peak RSS from ``wait4``, the converter's own sampled peak RssAnon from its JSON report)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from edgeq.bench.machine import machine_info
from edgeq.bench.process import child_env, read_tail, wait_child
from edgeq.bench.records import ConvertBench, Stat
from edgeq.errors import EdgeqError


def run_convert(model: str, scheme: str | None, method: str | None, passes: int, workdir: Path | None = None,
                timeout_s: float = 7200.0, progress: Callable[[str], None] | None = None,
                keep: Path | None = None) -> ConvertBench:
    """``edgeq quantize`` in a child process per pass; the child's peak RSS from wait4()'s rusage (that child and
    any child it waited for) and its own report. The output goes to a temporary directory and is removed, unless
    ``keep`` (one pass only) names where to leave it."""
    if passes < 1:
        raise EdgeqError(f"--passes {passes}: at least 1 conversion pass")
    if keep is not None and passes != 1:
        raise EdgeqError("keep= writes one output: use passes=1")
    if not Path(model).exists():
        raise EdgeqError(f"{model}: no such model directory")
    machine = machine_info()
    base = Path(tempfile.mkdtemp(prefix="edgeq-bench-convert-", dir=workdir))
    secs, peaks, anons, failures = [], [], [], []
    bytes_in = bytes_out = 0
    try:
        for p in range(passes):
            if progress:
                progress(f"conversion pass {p + 1}/{passes}: {model}")
            out = Path(keep) if keep is not None else base / f"out-{p}"
            wall, usage, report, failure = _convert_once(model, scheme, method, out, base, p, timeout_s)
            if failure is not None:
                failures.append(failure)
                break
            secs.append(wall)
            peaks.append(usage.ru_maxrss * 1024)
            anons.append(report.get("peak_rss_anon_bytes", 0))
            bytes_in, bytes_out = report.get("bytes_in", 0), report.get("bytes_out", 0)
            if keep is None:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    machine["loadavg_end"] = list(os.getloadavg())
    empty = Stat(0, 0, 0, 0)
    return ConvertBench(str(model), scheme, method, passes, Stat.of(secs) if secs else empty,
                        Stat.of(peaks) if peaks else empty, Stat.of(anons) if anons else empty, bytes_in, bytes_out,
                        tuple(failures), machine)


def _convert_once(model: str, scheme: str | None, method: str | None, out: Path, base: Path, p: int,
                  timeout_s: float):
    """One ``python -m edgeq.cli quantize ... --json`` child: (wall seconds, its rusage, its JSON report, None)
    or, when it timed out, failed or printed no report, (..., the failure record)."""
    cmd = [sys.executable, "-m", "edgeq.cli", "quantize", str(model), "-o", str(out), "--json", "-q", "--force"]
    cmd += ["--scheme", scheme] if scheme else []
    cmd += ["--method", method] if method else []
    stdout, stderr = base / f"{p}.out", base / f"{p}.err"
    t0 = time.perf_counter()
    with open(stdout, "wb") as so, open(stderr, "wb") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=child_env(), start_new_session=True)
    status, usage, timed_out = wait_child(proc.pid, timeout_s)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    try:
        report = json.loads(stdout.read_text())
    except (OSError, ValueError):
        report = None
    failure = None
    if timed_out or code != 0 or not isinstance(report, dict):
        failure = {"pass_index": p, "exit_code": code, "error": "timed out" if timed_out else
                   (read_tail(stderr).strip().splitlines() or ["no output"])[-1]}
    return wall, usage, report, failure
