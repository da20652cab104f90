"""``edgeq bench``: speed and memory of a checkpoint, measured so that the numbers can be trusted.

    edgeq bench out/ --prompt-len 512 --gen-len 128 --passes 3 --threads 2
    edgeq bench out/ --vs ref/                     # A/B against another checkpoint (e.g. the bf16 reference)
    edgeq bench out/ --vs out/ --vs-env EDGEQ_NATIVE_ISA=off   # same checkpoint, another kernel path
    edgeq bench out/ --vs-gguf model-Q4_K_M.gguf   # against llama.cpp (llama-cpp-python), when installed
    edgeq bench --convert model/ --scheme w4a16-g128   # conversion time and peak memory, in a child process

The rules (docs/methodology.md says why each exists):

- every pass runs in a fresh worker process (:mod:`edgeq.bench.worker`); arms are interleaved A B A B ...; at least
  3 passes; each metric is reported as median with min and max;
- if any pass of any arm fails, the failure is printed and there is no comparison (exit code 1);
- the worker counts the calls of each compute path and reads the effective settings back from the loaded runtime;
  a pass whose counted paths contradict its settings fails; two arms with the same checkpoint and the same effective
  settings are flagged (the comparison would measure noise), and so are arms that differ in more than the checkpoint;
- memory is measured inside the worker (RssAnon/RssFile, mincore residency of the mapped checkpoint, KV cache and
  scratch allocated vs touched) and compared with ``edgeq inspect``'s projection (:mod:`edgeq.memory`).

This module imports no torch at import time: the parent only schedules, judges and prints.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import typer

from edgeq.bench.worker import PassSpec
from edgeq.errors import EdgeqError
from edgeq.io.hub import REVISION_HELP, resolve_model, resolve_models

SCHEMA_VERSION = 1
MIN_PASSES = 3
# Settings that make two edgeq arms run the same thing (crossover_source is left out: "measured" then "cached").
COMPARED_SETTINGS = ("quantized", "scheme", "dtype", "max_model_len", "kv_cache_budget", "kv_cache_bytes", "threads_now",
                     "decode_path", "prefill_path", "prefill_crossover", "layout", "native_isa", "env")
GGUF_SETTINGS = ("model_desc", "n_ctx", "n_threads", "n_threads_batch", "n_batch", "n_ubatch")
# Settings that should be equal across arms that compare two checkpoints (otherwise the ratio mixes two effects).
# (name, edgeq key, llama.cpp key, tolerance): llama.cpp pads n_ctx up to a multiple of 256.
SHARED_SETTINGS = (("threads", "threads_now", "n_threads", 0), ("context", "max_model_len", "n_ctx", 256))
METRICS = (  # key, label, unit, higher is better
    ("pp_tok_s", "prefill", "tok/s", True),
    ("tg_tok_s", "decode", "tok/s", True),
    ("ttft_s", "time to first token", "s", False),
    ("load_s", "load", "s", False),
)
STARVED_SHARE = 0.7  # a phase that got less than this share of its threads' CPU time measured contention
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
             "amx_int8", "amx_bf16")


# ----------------------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Arm:
    """One side of a comparison: a checkpoint and how to run it."""

    label: str
    checkpoint: str
    kind: str = "edgeq"  # "edgeq" (edgeq or bf16 HF checkpoint) | "gguf" (llama.cpp)
    threads: int = 2
    max_model_len: Optional[int] = None
    kv_cache_bytes: str = "256MiB"
    prefill_threshold: Optional[int] = None
    env: tuple = ()  # ((KEY, VALUE), ...) set in this arm's worker environment


@dataclass(frozen=True)
class BenchConfig:
    prompt_len: int = 512
    gen_len: int = 128
    passes: int = 3
    seed: int = 0
    warmup: bool = True
    timeout_s: float = 3600.0


@dataclass(frozen=True)
class PassResult:
    """One worker process: its exit, its wait4 rusage, and what it measured (``data``, the worker's JSON)."""

    label: str
    pass_index: int
    ok: bool
    error: Optional[str]
    exit_code: Optional[int]
    wall_s: float
    maxrss: int  # ru_maxrss from wait4, bytes: the larger of this worker's whole-life peak and its waited-for children's
    data: dict
    stderr_tail: str = ""


@dataclass(frozen=True)
class Stat:
    median: float
    min: float
    max: float
    n: int

    @property
    def spread(self) -> float:
        """(max - min) / median."""
        return (self.max - self.min) / self.median if self.median else 0.0

    @classmethod
    def of(cls, values) -> "Stat":
        v = [float(x) for x in values]
        return cls(statistics.median(v), min(v), max(v), len(v))


@dataclass(frozen=True)
class ArmSummary:
    label: str
    checkpoint: str
    kind: str
    checkpoint_id: str
    passes: int
    timing: dict  # metric -> Stat (pp_tok_s, tg_tok_s, ttft_s, ttft_cold_s, load_s, import_s)
    settings: dict  # effective, read back by the worker (first pass)
    paths: dict  # {"prefill": {path: calls}, "decode": {...}} (first pass; every pass is checked equal)
    native_calls: Optional[dict]
    memory: dict  # peak_load, peak_run, steady_rss/anon/file, maxrss -> Stat; cached_before -> list
    ledger: dict  # the ledger of the pass with the median steady RSS
    projection: Optional[dict]  # {"rows": [...], "basis": str} or None with "why"


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    rows: tuple  # ({metric, label, unit, a, b, ratio, better, overlap}, ...)


@dataclass(frozen=True)
class BenchReport:
    schema_version: int
    ok: bool
    machine: dict
    config: dict
    arms_requested: tuple
    arms: tuple  # ArmSummary, only when every pass succeeded
    comparisons: Optional[tuple]  # None when any pass failed
    failures: tuple  # ({label, pass_index, error, exit_code, stderr_tail}, ...)
    not_run: tuple  # "B#2", ... passes skipped after the first failure
    flags: tuple  # judgements that make a comparison suspect (identical arms, arms differing in settings, ...)
    notes: tuple
    passes: tuple  # PassResult, raw


# ------------------------------------------------------------------------------------------------------- machine


def machine_info() -> dict:
    """CPU model and the ISA flags that matter here, cores, memory, kernel, Python. Memory from psutil (MemTotal of
    /proc/meminfo); the model name and flags from /proc/cpuinfo and lscpu, which psutil does not report."""
    import psutil

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key == "flags":
                flags = set(value.split())
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": model, "flags": [f for f in CPU_FLAGS if f in flags], "cores": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "kernel": platform.release(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "loadavg_start": list(os.getloadavg()),
    }


# -------------------------------------------------------------------------------------------------- checkpoint id


def checkpoint_id(path: str | Path) -> str:
    """Content identity from metadata only: config.json, the manifest and every weight file's header (safetensors) or
    name, size and first MiB (gguf). Two copies of one checkpoint get the same id."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_file():
        h.update(f"{p.stat().st_size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
        return h.hexdigest()[:16]
    for name in ("config.json", "edgeq_manifest.json"):
        if (p / name).is_file():
            h.update(name.encode() + b"\0" + (p / name).read_bytes())
    for shard in sorted(p.glob("*.safetensors")):
        with open(shard, "rb") as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
            h.update(shard.name.encode() + raw + f.read(min(n, 100 << 20)))
        h.update(str(shard.stat().st_size).encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------- workers


def _tail(path: Path, n: int = 3000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", "replace")


def child_env(extra: dict | None = None) -> dict:
    """The environment of a worker or conversion child: this process's, with the directory holding *this* edgeq
    package first on PYTHONPATH, so the child runs the same code as the parent (an editable install may point at
    another checkout than the one the parent was started from)."""
    import edgeq

    root = str(Path(edgeq.__file__).resolve().parent.parent)
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
    status, usage, timed_out = _wait(proc.pid, timeout_s)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    maxrss = usage.ru_maxrss * 1024 if usage is not None else 0
    tail = _tail(err_path)
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


def _wait(pid: int, timeout_s: float):
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


def schedule(arms: list[Arm], passes: int) -> list[tuple[int, Arm]]:
    """Interleaved: pass 0 of every arm, then pass 1 of every arm, ... (A B A B for two arms)."""
    return [(p, arm) for p in range(passes) for arm in arms]


def run_bench(arms: list[Arm], cfg: BenchConfig, runner: Runner = run_worker, workdir: Path | None = None,
              progress: Callable[[str], None] | None = None, min_passes: int = MIN_PASSES) -> BenchReport:
    """Run every pass (fresh process each, interleaved), stop at the first failure, judge and summarise."""
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise EdgeqError(f"arm labels must be distinct, got {labels}")
    if cfg.passes < min_passes:
        raise EdgeqError(f"--passes {cfg.passes}: at least {min_passes} are needed for a median with its spread")
    if cfg.prompt_len < 1 or cfg.gen_len < 1:
        raise EdgeqError(f"--prompt-len {cfg.prompt_len} / --gen-len {cfg.gen_len}: both must be at least 1")
    machine = machine_info()
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="edgeq-bench-")) if own_dir else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results: list[PassResult] = []
    failures: list[dict] = []
    order = schedule(arms, cfg.passes)
    try:
        for i, (p, arm) in enumerate(order):
            spec = PassSpec(checkpoint=str(arm.checkpoint), result=str(workdir / f"{arm.label}-{p}.result.json"),
                            kind=arm.kind, label=arm.label, pass_index=p, prompt_len=cfg.prompt_len,
                            gen_len=cfg.gen_len, threads=arm.threads, max_model_len=arm.max_model_len,
                            kv_cache_bytes=str(arm.kv_cache_bytes), prefill_threshold=arm.prefill_threshold,
                            seed=cfg.seed, warmup=cfg.warmup, env=dict(arm.env))
            if progress:
                progress(f"pass {p + 1}/{cfg.passes} arm {arm.label} ({i + 1}/{len(order)}): {arm.checkpoint}")
            r = runner(arm, spec, workdir, cfg.timeout_s)
            results.append(r)
            if not r.ok:
                failures.append({"label": r.label, "pass_index": r.pass_index, "error": r.error,
                                 "exit_code": r.exit_code, "stderr_tail": r.stderr_tail})
                break
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    machine["loadavg_end"] = list(os.getloadavg())
    done = {(r.label, r.pass_index) for r in results}
    not_run = tuple(f"{a.label}#{p}" for p, a in order if (a.label, p) not in done)
    config = {**asdict(cfg), "min_passes": min_passes}
    notes = list(_load_notes(machine))
    if failures:
        return BenchReport(SCHEMA_VERSION, False, machine, config, tuple(asdict(a) for a in arms), (), None,
                           tuple(failures), not_run, (), tuple(notes), tuple(results))
    summaries = [summarize(a, [r for r in results if r.label == a.label]) for a in arms]
    flags = judge(summaries, results)
    comparisons = tuple(compare(summaries[0], s) for s in summaries[1:])
    return BenchReport(SCHEMA_VERSION, True, machine, config, tuple(asdict(a) for a in arms), tuple(summaries),
                       comparisons, (), (), tuple(flags), tuple(notes), tuple(results))


def _load_notes(machine: dict):
    cores = machine.get("cores") or 1
    worst = max(machine.get("loadavg_start", [0])[0], machine.get("loadavg_end", [0])[0])
    if worst > cores:
        yield (f"the machine was busy (load average up to {worst:.1f} on {cores} cores): other processes shared the "
               f"CPU, so absolute numbers are low and noisy; ratios of interleaved arms are the robust result")


# ------------------------------------------------------------------------------------------------------ summarise


def summarize(arm: Arm, results: list[PassResult]) -> ArmSummary:
    data = [r.data for r in results]
    timing = {k: Stat.of(d["timing"][k] for d in data)
              for k in ("pp_tok_s", "tg_tok_s", "ttft_s", "ttft_cold_s", "load_s", "import_s")}
    for phase in ("prefill", "decode"):
        if all(d.get("cpu") for d in data):
            timing[f"cpu_share_{phase}"] = Stat.of(d["cpu"][phase]["share"] for d in data)
    mem = [d["memory"] for d in data]
    memory = {
        "peak_load": Stat.of(m["peak_load"] for m in mem),
        "peak_run": Stat.of(m["peak_run"] for m in mem),
        "steady_rss": Stat.of(m["steady"]["rss"] for m in mem),
        "steady_anon": Stat.of(m["steady"]["anon"] for m in mem),
        "steady_file": Stat.of(m["steady"]["file"] for m in mem),
        "maxrss_wait4": Stat.of(r.maxrss for r in results),
        "maxrss_self": Stat.of(m.get("maxrss_self", 0) for m in mem),
        "maxrss_children": Stat.of(m.get("maxrss_children", 0) for m in mem),
        "checkpoint_cached_before_load": [m["checkpoint_cached_before_load"] for m in mem],
        "checkpoint_file_bytes": mem[0]["checkpoint_file_bytes"],
    }
    median_rss = memory["steady_rss"].median
    ledger = min(data, key=lambda d: abs(d["memory"]["steady"]["rss"] - median_rss))["ledger"]
    settings = dict(data[0]["effective"])
    if arm.kind == "edgeq":
        settings["native_isa"] = (settings.get("native") or {}).get("isa")
    return ArmSummary(
        label=arm.label, checkpoint=str(arm.checkpoint), kind=arm.kind, checkpoint_id=checkpoint_id(arm.checkpoint),
        passes=len(results), timing=timing, settings=settings, paths=data[0]["paths"],
        native_calls=data[0].get("native_calls"), memory=memory, ledger=ledger,
        projection=projection(arm, settings, ledger) if arm.kind == "edgeq" else None,
    )


def _key(s: ArmSummary) -> tuple:
    keys = COMPARED_SETTINGS if s.kind == "edgeq" else GGUF_SETTINGS
    return (s.kind, s.checkpoint_id) + tuple(json.dumps(s.settings.get(k), sort_keys=True) for k in keys)


def judge(summaries: list[ArmSummary], results: list[PassResult]) -> list[str]:
    """Flags that make a comparison suspect. Never raises; the report carries them."""
    flags = []
    for s in summaries:  # every pass of an arm must have run the same thing
        runs = [r.data for r in results if r.label == s.label]
        for phase in ("prefill", "decode"):
            shares = [d["cpu"][phase]["share"] for d in runs if d.get("cpu")]
            if shares and min(shares) < STARVED_SHARE:
                flags.append(f"arm {s.label}: {phase} got only {min(shares):.0%}-{max(shares):.0%} of its threads' CPU "
                             f"time (CPU seconds / (wall x threads)): the machine was oversubscribed, so these "
                             f"{phase} numbers measure contention (every parallel region waits for a preempted thread); "
                             f"on a shared machine run with OMP_WAIT_POLICY=PASSIVE or fewer threads")
        keys = COMPARED_SETTINGS if s.kind == "edgeq" else GGUF_SETTINGS
        for k in keys:
            seen = {json.dumps(d["effective"].get(k) if k != "native_isa" else (d["effective"].get("native") or {}).get("isa"),
                               sort_keys=True) for d in runs}
            if len(seen) > 1:
                flags.append(f"arm {s.label}: effective {k} changed between passes ({', '.join(sorted(seen))})")
        if len({json.dumps(d["paths"], sort_keys=True) for d in runs}) > 1:
            flags.append(f"arm {s.label}: path counts differ between passes: {[d['paths'] for d in runs]}")
    for i, a in enumerate(summaries):
        for b in summaries[i + 1:]:
            if _key(a) == _key(b):
                flags.append(f"arms {a.label} and {b.label} ran the same checkpoint ({a.checkpoint_id}) with identical "
                             f"effective settings: their difference is noise, not an effect")
            elif a.checkpoint_id != b.checkpoint_id:
                for name, ek, gk, tol in SHARED_SETTINGS:
                    va = a.settings.get(ek if a.kind == "edgeq" else gk)
                    vb = b.settings.get(ek if b.kind == "edgeq" else gk)
                    if va is not None and vb is not None and abs(va - vb) > (tol if a.kind != b.kind else 0):
                        flags.append(f"arms {a.label} and {b.label} differ in {name} as well as in checkpoint "
                                     f"({va} vs {vb}): the ratio mixes both effects")
    return flags


def compare(a: ArmSummary, b: ArmSummary) -> Comparison:
    rows = []
    for key, label, unit, higher in METRICS:
        sa, sb = a.timing[key], b.timing[key]
        ratio = sa.median / sb.median if sb.median else float("inf")
        better = a.label if (ratio > 1) == higher else b.label
        overlap = sa.min <= sb.max and sb.min <= sa.max
        rows.append({"metric": key, "label": label, "unit": unit, "a": asdict(sa), "b": asdict(sb), "ratio": ratio,
                     "better": better if ratio != 1 else "=", "overlap": overlap})
    return Comparison(a.label, b.label, tuple(rows))


# ------------------------------------------------------------------------------------------------------ projection


def projection(arm: Arm, settings: dict, ledger: dict) -> dict:
    """edgeq inspect's memory projection (edgeq.memory, the one formula) at the arm's effective context and budget,
    beside what the worker measured. A bf16 reference is projected as stored (every tensor mapped, no scratch)."""
    try:
        proj, basis = _project(arm.checkpoint, settings)
    except Exception as e:  # noqa: BLE001 - the projection is a comparison, not a reason to fail the benchmark
        return {"rows": [], "basis": f"no projection: {type(e).__name__}: {e}"}
    baseline = sum(r["bytes"] for r in ledger["rows"] if r["category"].startswith("runtime baseline"))
    ckpt = ledger["checkpoint"]
    rows = [
        ("mapped weights (file-backed)", proj.mapped_weights, ckpt["rss_bytes"] - ckpt["anonymous_bytes"],
         f"checkpoint pages mapped (smaps); mincore resident {ckpt['resident_bytes']:,} of {ckpt['mapped_bytes']:,} mapped"),
        ("weight copies (anon)", proj.anon_weights, int(settings.get("copied_bytes") or 0), "runtime copied_bytes"),
        ("KV cache", proj.kv_bytes, ledger["kv_allocated"], f"allocated; touched {ledger['kv_touched']:,}"),
        ("prefill scratch", proj.prefill_scratch, ledger["scratch_allocated"],
         f"allocated; touched {ledger['scratch_touched']:,}"),
        ("total (model part)", proj.total, ledger["total"] - baseline, "steady RSS minus the runtime baseline rows"),
    ]
    return {"basis": basis, "max_model_len": proj.max_model_len, "kv_cache_bytes": proj.kv_cache_bytes,
            "rows": [{"category": c, "projected": int(p), "measured": int(m), "diff": int(m) - int(p), "how": h}
                     for c, p, m, h in rows]}


def _project(path: str, settings: dict):
    budget, mml = int(settings["kv_cache_budget"]), int(settings["max_model_len"])
    if settings.get("quantized"):
        from edgeq.inspect.report import inspect_checkpoint

        rep = inspect_checkpoint(path, max_model_len=mml, kv_cache_bytes=budget)
        if rep.memory is None:
            raise EdgeqError(f"inspect gave no projection: {rep.memory_basis}")
        return rep.memory, "edgeq inspect --max-model-len {} --kv-cache-bytes {}".format(mml, budget)
    import math

    from edgeq.io.hf import open_checkpoint
    from edgeq.memory import Tensor, kv_geometry, project

    ckpt = open_checkpoint(path)
    tensors = [Tensor(n, i.dtype, math.prod(i.shape), i.nbytes) for n, i in ckpt.tensors.items()]
    return (project(kv_geometry(ckpt.config), tensors, ("", 0), budget, mml),
            "edgeq.memory.project over the reference's tensors as stored (bf16 mapped, others cast), no scratch")


# ------------------------------------------------------------------------------------------------------- convert


@dataclass(frozen=True)
class ConvertBench:
    model: str
    scheme: Optional[str]
    method: Optional[str]
    passes: int
    seconds: Stat
    peak_rss: Stat  # ru_maxrss of the child (wait4)
    peak_anon: Stat  # the converter's own sampled peak RssAnon
    bytes_in: int
    bytes_out: int
    failures: tuple
    machine: dict


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
            cmd = [sys.executable, "-m", "edgeq.cli.main", "quantize", str(model), "-o", str(out), "--json", "-q", "--force"]
            cmd += ["--scheme", scheme] if scheme else []
            cmd += ["--method", method] if method else []
            stdout, stderr = base / f"{p}.out", base / f"{p}.err"
            t0 = time.perf_counter()
            with open(stdout, "wb") as so, open(stderr, "wb") as se:
                proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=child_env(), start_new_session=True)
            status, usage, timed_out = _wait(proc.pid, timeout_s)
            wall = time.perf_counter() - t0
            code = os.waitstatus_to_exitcode(status)
            try:
                report = json.loads(stdout.read_text())
            except (OSError, ValueError):
                report = None
            if timed_out or code != 0 or not isinstance(report, dict):
                failures.append({"pass_index": p, "exit_code": code, "error": "timed out" if timed_out else
                                 (_tail(stderr).strip().splitlines() or ["no output"])[-1]})
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


# --------------------------------------------------------------------------------------------------------- render


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _fmt(v: float, unit: str) -> str:
    if unit == "s":
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def fmt_stat(s: Stat | dict, unit: str = "") -> str:
    s = Stat(**s) if isinstance(s, dict) else s
    return f"{_fmt(s.median, unit)} [{_fmt(s.min, unit)}-{_fmt(s.max, unit)}]"


def fmt_mem(s: Stat) -> str:
    return f"{s.median / 2**20:,.0f} [{s.min / 2**20:,.0f}-{s.max / 2**20:,.0f}] MiB"


def _paths(paths: dict) -> str:
    return "; ".join(f"{phase}: " + (", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "none")
                     for phase, c in paths.items())


def render(report: BenchReport, out, err) -> None:
    from rich.table import Table

    m, c = report.machine, report.config
    out.print(f"[bold]edgeq bench[/bold]  {m['cpu']} ({m['cores']} cores; {', '.join(m['flags']) or 'no AVX flags'})  "
              f"{m['date']}  load avg {m['loadavg_start'][0]:.1f} -> {m.get('loadavg_end', [0])[0]:.1f}", highlight=False)
    out.print(f"prompt {c['prompt_len']} tokens, generate {c['gen_len']}, {c['passes']} passes per arm, fresh process "
              f"per pass, interleaved; medians [min-max]", highlight=False)
    if not report.ok:
        for f in report.failures:
            err.print(f"[red]FAILED: arm {f['label']} pass {f['pass_index'] + 1}: {f['error']}[/red]", highlight=False)
            if f.get("stderr_tail"):
                err.print(f["stderr_tail"].strip()[-1500:], highlight=False, markup=False)
        if report.not_run:
            err.print(f"not run: {', '.join(report.not_run)}", highlight=False)
        err.print("[red]no comparison: a pass failed, so no number from this run is reported[/red]")
        return
    t = Table(title="speed (median [min-max])")
    for col in ("arm", "checkpoint", "prefill tok/s", "decode tok/s", "TTFT s", "first-request TTFT s", "load s",
                "CPU share pp/tg"):
        t.add_column(col, justify="left" if col in ("arm", "checkpoint") else "right")
    for s in report.arms:
        share = "/".join(f"{s.timing[k].median:.0%}" for k in ("cpu_share_prefill", "cpu_share_decode") if k in s.timing)
        t.add_row(s.label, _short(s.checkpoint), fmt_stat(s.timing["pp_tok_s"], "tok/s"),
                  fmt_stat(s.timing["tg_tok_s"], "tok/s"), fmt_stat(s.timing["ttft_s"], "s"),
                  fmt_stat(s.timing["ttft_cold_s"], "s"), fmt_stat(s.timing["load_s"], "s"), share or "n/a")
    out.print(t)
    for cmp_ in report.comparisons or ():
        t = Table(title=f"{cmp_.a} vs {cmp_.b}")
        for col in ("metric", cmp_.a, cmp_.b, f"{cmp_.a}/{cmp_.b}", "better", "ranges"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for r in cmp_.rows:
            t.add_row(f"{r['label']} ({r['unit']})", fmt_stat(r["a"], r["unit"]), fmt_stat(r["b"], r["unit"]),
                      f"{r['ratio']:.2f}x", r["better"], "overlap" if r["overlap"] else "disjoint")
        out.print(t)
    t = Table(title="effective settings (read back from each loaded runtime) and counted paths")
    for col in ("arm", "settings", "paths (timed request)"):
        t.add_column(col)
    for s in report.arms:
        t.add_row(s.label, _settings_line(s), _paths(s.paths))
    out.print(t)
    for s in report.arms:
        _render_memory(s, out)
    for f in report.flags:
        err.print(f"[red]FLAG: {f}[/red]", highlight=False)
    for n in report.notes:
        err.print(f"[yellow]note: {n}[/yellow]", highlight=False)


def _short(p: str, n: int = 40) -> str:
    return p if len(p) <= n else "..." + p[-(n - 3):]


def _settings_line(s: ArmSummary) -> str:
    e = s.settings
    if s.kind == "gguf":
        return (f"llama.cpp {e.get('model_desc')}; n_ctx {e.get('n_ctx')}, KV {_mib(e.get('kv_cache_bytes', 0))} "
                f"(computed), threads {e.get('n_threads')}/{e.get('n_threads_batch')}, batch {e.get('n_batch')}/"
                f"{e.get('n_ubatch')}; {e.get('system_info', '')[:80]}")
    native = e.get("native") or {}
    return (f"{e.get('scheme') or 'bf16'}; max_model_len {e.get('max_model_len')}, KV {_mib(e.get('kv_cache_bytes', 0))} "
            f"of {_mib(e.get('kv_cache_budget', 0))} budget, threads {e.get('threads_now')}, decode {e.get('decode_path')}"
            f"{' (' + str(native.get('isa')) + ')' if native else ''}, prefill {e.get('prefill_path')} at M >= "
            f"{e.get('prefill_crossover')} ({e.get('crossover_source')}), layout {e.get('layout')}")


def _render_memory(s: ArmSummary, out) -> None:
    from rich.table import Table

    mem, led = s.memory, s.ledger
    cached = mem["checkpoint_cached_before_load"]
    out.print(f"[bold]memory, arm {s.label}[/bold]: peak during load {fmt_mem(mem['peak_load'])}, peak while running "
              f"{fmt_mem(mem['peak_run'])}, whole-life peak {fmt_mem(mem['maxrss_self'])} (largest helper child "
              f"{fmt_mem(mem['maxrss_children'])}, e.g. a kernel build); steady RSS "
              f"{fmt_mem(mem['steady_rss'])} = anon {fmt_mem(mem['steady_anon'])} + file {fmt_mem(mem['steady_file'])}; "
              f"checkpoint in page cache before load: {min(cached) / max(mem['checkpoint_file_bytes'], 1):.0%}-"
              f"{max(cached) / max(mem['checkpoint_file_bytes'], 1):.0%}", highlight=False)
    t = Table(title=f"ledger, arm {s.label} (steady state, pass with the median RSS)")
    for col in ("kind", "category", "bytes", "measured by"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for r in led["rows"]:
        t.add_row(r["kind"], r["category"], _mib(r["bytes"]), r["how"])
    t.add_row("", "[bold]total (VmRSS)[/bold]", _mib(led["total"]),
              f"explained {led['explained'] / max(led['total'], 1):.1%}, unattributed {_mib(led['unattributed'])}")
    out.print(t)
    ck = led["checkpoint"]
    out.print(f"checkpoint {s.label}: mapped {_mib(ck['mapped_bytes'])}; resident in RAM (mincore) "
              f"{_mib(ck['resident_bytes'])}; faulted into this process (smaps Rss) {_mib(ck['rss_bytes'])}; "
              f"copy-on-write {_mib(ck['anonymous_bytes'])}. KV cache allocated {_mib(led['kv_allocated'])}, touched "
              + (_mib(led['kv_touched']) if led['kv_touched'] is not None else "n/a")
              + f"; prefill scratch allocated {_mib(led['scratch_allocated'])}, touched {_mib(led['scratch_touched'])}",
              highlight=False)
    p = s.projection
    if p and p.get("rows"):
        t = Table(title=f"projection vs measured, arm {s.label} ({p['basis']})")
        for col in ("category", "projected", "measured", "measured - projected", "measured as"):
            t.add_column(col, justify="left" if col in ("category", "measured as") else "right")
        for r in p["rows"]:
            t.add_row(r["category"], _mib(r["projected"]), _mib(r["measured"]), _mib(r["diff"]), r["how"])
        out.print(t)
    elif p:
        out.print(p["basis"], highlight=False)


def render_convert(r: ConvertBench, out, err) -> None:
    m = r.machine
    out.print(f"[bold]edgeq bench --convert[/bold] {r.model} ({r.scheme or 'recipe default'}), {m['cpu']}, "
              f"{m['cores']} cores, {m['date']}, load avg {m['loadavg_start'][0]:.1f}", highlight=False)
    for f in r.failures:
        err.print(f"[red]FAILED: conversion pass {f['pass_index'] + 1}: {f['error']}[/red]", highlight=False)
    if r.failures:
        return
    out.print(f"  {_mib(r.bytes_in)} -> {_mib(r.bytes_out)}; time {fmt_stat(r.seconds, 's')} s; peak RSS of the child "
              f"(wait4) {fmt_mem(r.peak_rss)}; peak RssAnon {fmt_mem(r.peak_anon)}; {r.passes} pass(es)", highlight=False)


def to_json(value) -> str:
    def default(o):
        if isinstance(o, Stat):
            return {**asdict(o), "spread": o.spread}
        return str(o)

    def conv(o):
        if isinstance(o, Stat):
            return {**asdict(o), "spread": o.spread}
        if hasattr(o, "__dataclass_fields__"):
            return {k: conv(getattr(o, k)) for k in o.__dataclass_fields__}
        if isinstance(o, dict):
            return {k: conv(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [conv(v) for v in o]
        return o

    return json.dumps(conv(value), indent=2, default=default)


# ------------------------------------------------------------------------------------------------------------ CLI


def _parse_env(items: list[str]) -> tuple:
    env = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise EdgeqError(f"--vs-env {item!r}: expected KEY=VALUE, e.g. EDGEQ_NATIVE_ISA=off")
        env.append((key, value))
    return tuple(env)


def default_context(checkpoint: str, kv_cache_bytes: str) -> int:
    """The context the runtime would choose for ``checkpoint`` (min of the model's maximum and the KV budget):
    given to llama.cpp as n_ctx so both arms hold the same KV cache."""
    from edgeq.memory import kv_geometry
    from edgeq.runtime.sizes import parse_bytes  # the runtime's own reading of the budget

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    g = kv_geometry(config)
    tokens = parse_bytes(kv_cache_bytes, "--kv-cache-bytes") // g.bytes_per_token
    return min(tokens, g.max_positions) if g.max_positions else tokens


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def bench_command(
    checkpoint: Optional[Path] = typer.Argument(None, help="edgeq checkpoint (or bf16 HF checkpoint) to measure: directory or hub id."),
    vs: Optional[Path] = typer.Option(None, "--vs", help="Second arm: another checkpoint (e.g. the bf16 reference), directory or hub id."),
    revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP + " Applies to every hub id given."),
    vs_gguf: Optional[Path] = typer.Option(None, "--vs-gguf", help="llama.cpp arm: a .gguf file (needs llama-cpp-python)."),
    vs_env: list[str] = typer.Option([], "--vs-env", help="KEY=VALUE in the --vs arm's environment, e.g. EDGEQ_NATIVE_ISA=off."),
    prompt_len: int = typer.Option(512, "--prompt-len", help="Prompt tokens (prefill, pp)."),
    gen_len: int = typer.Option(128, "--gen-len", help="Generated tokens (decode, tg)."),
    passes: int = typer.Option(3, "--passes", help="Passes per arm (>= 3), each in a fresh process, arms interleaved."),
    threads: int = typer.Option(2, "--threads", help="Threads for every arm."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context [default: the runtime's]."),
    kv_cache_bytes: str = typer.Option("256MiB", "--kv-cache-bytes", help="KV cache budget, e.g. 256MiB."),
    prefill_threshold: Optional[int] = typer.Option(None, "--prefill-threshold", help="Override the prefill crossover M."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="One untimed request before the timed one."),
    convert: Optional[str] = typer.Option(None, "--convert", help="Conversion mode: time and peak memory of `edgeq quantize MODEL` (directory or hub id, fetched before timing)."),
    scheme: Optional[str] = typer.Option(None, "--scheme", help="Conversion mode: scheme [default: the recipe's]."),
    method: Optional[str] = typer.Option(None, "--method", help="Conversion mode: method [default: the recipe's]."),
    timeout: float = typer.Option(3600.0, "--timeout", help="Seconds before a pass is killed (and counts as failed)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (schema: docs/methodology.md)."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No per-pass progress lines on stderr."),
) -> None:
    """Measure speed and memory: fresh process per pass, interleaved arms, medians with spread, verified paths."""
    from edgeq.console import err, out, write

    say = None if as_json or quiet else (lambda msg: err.print(f"[dim]{msg}[/dim]", highlight=False))
    if convert is not None:
        if checkpoint is not None or vs is not None or vs_gguf is not None:
            raise EdgeqError("--convert MODEL measures a conversion; give no CHECKPOINT, --vs or --vs-gguf with it")
        r = run_convert(str(resolve_model(convert, revision)), scheme, method, passes, timeout_s=timeout, progress=say)
        write(to_json(r) + "\n") if as_json else render_convert(r, out, err)
        if r.failures:
            raise typer.Exit(1)
        return
    if checkpoint is None:
        raise EdgeqError("give a CHECKPOINT to measure (or --convert MODEL)")
    checkpoint, vs = resolve_models([checkpoint, vs], revision)  # hub ids: fetched (or found in the cache) before any pass
    for p in (checkpoint, vs):
        if p is not None and not (Path(p) / "config.json").is_file():
            raise EdgeqError(f"{p}: no config.json; expected an edgeq or Hugging Face checkpoint directory")
    if vs_env and vs is None:
        raise EdgeqError("--vs-env applies to the --vs arm; give --vs too (it may be the same checkpoint)")
    common = dict(threads=threads, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                  prefill_threshold=prefill_threshold)
    arms = [Arm("A", str(checkpoint), **common)]
    if vs is not None:
        arms.append(Arm("B", str(vs), env=_parse_env(vs_env), **common))
    skipped = None
    if vs_gguf is not None:
        if not Path(vs_gguf).is_file():
            raise EdgeqError(f"{vs_gguf}: no such .gguf file")
        if llama_cpp_available():
            ctx = max_model_len or default_context(str(checkpoint), kv_cache_bytes)
            arms.append(Arm("G", str(vs_gguf), kind="gguf", threads=threads, max_model_len=ctx))
        else:
            skipped = ("llama.cpp arm skipped: llama-cpp-python is not installed (optional extra: `pip install "
                       "llama-cpp-python`, which compiles llama.cpp from source)")
            err.print(f"[yellow]{skipped}[/yellow]")
    cfg = BenchConfig(prompt_len=prompt_len, gen_len=gen_len, passes=passes, warmup=warmup, timeout_s=timeout)
    report = run_bench(arms, cfg, progress=say)
    if skipped:
        report = replace(report, notes=report.notes + (skipped,))
    write(to_json(report) + "\n") if as_json else render(report, out, err)
    if not report.ok:
        raise typer.Exit(1)
