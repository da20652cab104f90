"""The parent's side of a pass: start one child process (a bench worker, or ``edgeq quantize`` for ``--convert``) in
its own session, with this checkout's edgeq first on PYTHONPATH; wait for it with ``wait4`` (its own rusage: the peak
RSS) under a deadline; kill its whole process group on timeout or Ctrl-C; read its result back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from edgeq.bench.records import Arm, PassResult
from edgeq.bench.spec import PassSpec


def read_tail(path: Path, n: int = 3000) -> str:
    """The last ``n`` bytes of a child's captured output, as text ("" when unreadable)."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", "replace")


def child_env(extra: dict | None = None) -> dict:
    """The environment of a worker or conversion child: this process's, with the directory holding *this* edgeq
    package first on PYTHONPATH, so the child runs the same code as the parent (an editable install may point at
    another checkout than the one the parent was started from)."""
    root = str(Path(__file__).resolve().parents[2])  # edgeq/bench/process.py -> the directory holding edgeq/
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


def worker_env(arm: Arm) -> dict:
    """A worker's environment: this process's (every arm, llama.cpp's included, gets the same OpenMP settings: libgomp
    reads OMP_WAIT_POLICY / GOMP_SPINCOUNT for both), threads from the arm, then the arm's own variables."""
    env = child_env({"OMP_NUM_THREADS": str(arm.threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env.update(dict(arm.env))
    return env


def run_worker(arm: Arm, spec: PassSpec, workdir: Path, timeout_s: float) -> PassResult:
    """Start ``python -m edgeq.bench.worker`` for one pass and wait for it (wait4: its own rusage)."""
    stem = workdir / f"{arm.label}-{spec.pass_index}"
    spec_path, out_path, err_path = stem.with_suffix(".spec.json"), stem.with_suffix(".out"), stem.with_suffix(".err")
    spec_path.write_text(spec.to_json())
    env = worker_env(arm)
    t0 = time.perf_counter()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "edgeq.bench.worker", str(spec_path)], stdout=out, stderr=err,
                                env=env, start_new_session=True)
    status, usage, timed_out = wait_child(proc.pid, timeout_s)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    maxrss = usage.ru_maxrss * 1024 if usage is not None else 0
    tail = read_tail(err_path)
    data: dict = {}
    try:
        data = json.loads(Path(spec.result).read_text())
    except (OSError, ValueError):
        pass
    error = None
    if timed_out:
        error = f"timed out after {timeout_s:.0f} s (killed)"
    elif not data:
        error = f"worker exited with code {code} and wrote no result" + (f": {tail.strip().splitlines()[-1]}" if tail.strip() else "")
    elif not data.get("ok"):
        error = data.get("error") or f"worker exited with code {code}"
    elif code != 0:
        error = f"worker exited with code {code}"
    elif data.get("path_problems"):
        error = "path check: " + "; ".join(data["path_problems"])
    return PassResult(arm.label, spec.pass_index, error is None, error, code, wall, maxrss, data, tail if error else "")


def wait_child(pid: int, timeout_s: float):
    """(wait status, rusage, timed out) of child ``pid``; past ``timeout_s`` its process group is killed first."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            wpid, status, usage = os.wait4(pid, os.WNOHANG)
            if wpid == pid:
                return status, usage, False
            if time.monotonic() > deadline:
                _kill(pid)
                _, status, usage = os.wait4(pid, 0)
                return status, usage, True
            time.sleep(0.05)
    except BaseException:  # Ctrl-C: never leave our worker running
        _kill(pid)
        try:
            os.wait4(pid, 0)
        except ChildProcessError:
            pass
        raise


def _kill(pid: int) -> None:
    """SIGKILL the worker's process group (it was started in its own session, so the group is only ours)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


Runner = Callable[[Arm, PassSpec, Path, float], PassResult]

