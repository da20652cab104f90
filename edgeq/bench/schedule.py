"""The passes of a benchmark: interleaved (A B A B ...), each in a fresh worker process, stopped at the first failure;
then judged and summarised into one :class:`~edgeq.bench.records.BenchReport`."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from edgeq.bench.judge import judge
from edgeq.bench.machine import load_notes, machine_info
from edgeq.bench.process import Runner, run_worker
from edgeq.bench.records import MIN_PASSES, SCHEMA_VERSION, Arm, BenchConfig, BenchReport, PassResult
from edgeq.bench.spec import PassSpec
from edgeq.bench.summary import compare, summarize
from edgeq.errors import EdgeqError


def schedule(arms: list[Arm], passes: int) -> list[tuple[int, Arm]]:
    """Interleaved: pass 0 of every arm, then pass 1 of every arm, ... (A B A B for two arms)."""
    return [(p, arm) for p in range(passes) for arm in arms]


def run_bench(arms: list[Arm], cfg: BenchConfig, runner: Runner = run_worker, workdir: Path | None = None,
              progress: Callable[[str], None] | None = None, min_passes: int = MIN_PASSES) -> BenchReport:
    """Run every pass (fresh process each, interleaved), stop at the first failure, judge and summarise."""
    _check(arms, cfg, min_passes)
    machine = machine_info()
    order = schedule(arms, cfg.passes)
    results = _run_passes(order, cfg, runner, workdir, progress)
    machine["loadavg_end"] = list(os.getloadavg())
    failures = tuple({"label": r.label, "pass_index": r.pass_index, "error": r.error, "exit_code": r.exit_code,
                      "stderr_tail": r.stderr_tail} for r in results if not r.ok)
    done = {(r.label, r.pass_index) for r in results}
    not_run = tuple(f"{a.label}#{p}" for p, a in order if (a.label, p) not in done)
    config = {**asdict(cfg), "min_passes": min_passes}
    notes = tuple(load_notes(machine))
    requested = tuple(asdict(a) for a in arms)
    if failures:
        return BenchReport(SCHEMA_VERSION, False, machine, config, requested, (), None, failures, not_run, (), notes,
                           tuple(results))
    summaries = [summarize(a, [r for r in results if r.label == a.label]) for a in arms]
    flags = judge(summaries, results)
    comparisons = tuple(compare(summaries[0], s) for s in summaries[1:])
    return BenchReport(SCHEMA_VERSION, True, machine, config, requested, tuple(summaries), comparisons, (), (),
                       tuple(flags), notes, tuple(results))


def _check(arms: list[Arm], cfg: BenchConfig, min_passes: int) -> None:
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise EdgeqError(f"arm labels must be distinct, got {labels}")
    if cfg.passes < min_passes:
        raise EdgeqError(f"--passes {cfg.passes}: at least {min_passes} are needed for a median with its spread")
    if cfg.prompt_len < 1 or cfg.gen_len < 1:
        raise EdgeqError(f"--prompt-len {cfg.prompt_len} / --gen-len {cfg.gen_len}: both must be at least 1")


def _run_passes(order: list[tuple[int, Arm]], cfg: BenchConfig, runner: Runner, workdir: Path | None,
                progress: Callable[[str], None] | None) -> list[PassResult]:
    """Every pass of ``order`` until one fails, in ``workdir`` (a temporary directory, removed, when None)."""
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="edgeq-bench-")) if own_dir else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results: list[PassResult] = []
    try:
        for i, (p, arm) in enumerate(order):
            if progress:
                progress(f"pass {p + 1}/{cfg.passes} arm {arm.label} ({i + 1}/{len(order)}): {arm.checkpoint}")
            r = runner(arm, _pass_spec(arm, p, cfg, workdir), workdir, cfg.timeout_s)
            results.append(r)
            if not r.ok:
                break
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return results


def _pass_spec(arm: Arm, p: int, cfg: BenchConfig, workdir: Path) -> PassSpec:
    return PassSpec(checkpoint=str(arm.checkpoint), result=str(workdir / f"{arm.label}-{p}.result.json"),
                    kind=arm.kind, label=arm.label, pass_index=p, prompt_len=cfg.prompt_len,
                    gen_len=cfg.gen_len, threads=arm.threads, max_model_len=arm.max_model_len,
                    kv_cache_bytes=str(arm.kv_cache_bytes), prefill_threshold=arm.prefill_threshold,
                    seed=cfg.seed, warmup=cfg.warmup, env=dict(arm.env))
