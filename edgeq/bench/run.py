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

Where each part lives (all in :mod:`edgeq.bench`): ``records`` (arms, results, the report), ``schedule`` (the
interleaved passes), ``process`` (starting and waiting for a worker), ``worker`` with ``spec``, ``edgeq_arm``,
``gguf_arm`` and ``ledger`` (one pass, in the child), ``measure`` (the kernel's memory counters), ``summary`` and
``projection`` (medians, comparisons, inspect's projection), ``judge`` (the flags), ``machine``, ``conversion``
(``--convert``), ``render`` (tables and JSON). This module checks a command line's arms and runs them
(edgeq/cli/bench.py is the command: its options and output).

This module imports no torch at import time: the parent only schedules and judges.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from edgeq.bench.conversion import run_convert
from edgeq.bench.gguf_arm import default_context, llama_cpp_available
from edgeq.bench.records import Arm, BenchConfig, BenchReport, ConvertBench
from edgeq.bench.schedule import run_bench
from edgeq.errors import EdgeqError
from edgeq.io.hub import resolve_model, resolve_models
from edgeq.keys import CONFIG


def _parse_env(items: list[str]) -> tuple:
    """``--vs-env KEY=VALUE`` items as ((KEY, VALUE), ...)."""
    env = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise EdgeqError(f"--vs-env {item!r}: expected KEY=VALUE, e.g. EDGEQ_NATIVE_ISA=off")
        env.append((key, value))
    return tuple(env)


def measure_conversion(model: str, revision: Optional[str], scheme: Optional[str], method: Optional[str], passes: int,
                       timeout: float, progress=None) -> ConvertBench:
    """``edgeq bench --convert MODEL``: time and peak memory of ``edgeq quantize MODEL`` over ``passes`` child
    processes (a hub id is fetched before timing)."""
    return run_convert(str(resolve_model(model, revision)), scheme, method, passes, timeout_s=timeout,
                       progress=progress)


def plan_arms(checkpoint, vs, revision: Optional[str], vs_gguf: Optional[Path], vs_env: list[str], *, threads: int,
              max_model_len: Optional[int], kv_cache_bytes: str,
              prefill_threshold: Optional[int]) -> tuple[list[Arm], Optional[str]]:
    """The arms ``edgeq bench CHECKPOINT [--vs B] [--vs-gguf G]`` measures, checked before any pass, and the note
    saying why the llama.cpp arm was left out (None when it was not asked for or is there)."""
    if checkpoint is None:
        raise EdgeqError("give a CHECKPOINT to measure (or --convert MODEL)")
    checkpoint, vs = resolve_models([checkpoint, vs], revision)  # hub ids: fetched (or found in the cache) before any pass
    for p in (checkpoint, vs):
        if p is not None and not (Path(p) / CONFIG).is_file():
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
        skipped = _add_gguf_arm(arms, vs_gguf, checkpoint, threads, max_model_len, kv_cache_bytes)
    return arms, skipped


def measure_arms(arms: list[Arm], cfg: BenchConfig, note: Optional[str] = None, progress=None) -> BenchReport:
    """Run the interleaved passes of ``arms`` (:func:`edgeq.bench.schedule.run_bench`, through this module's name:
    tests replace it); ``note`` (a skipped arm) joins the report's notes."""
    report = run_bench(arms, cfg, progress=progress)
    return replace(report, notes=report.notes + (note,)) if note else report


def _add_gguf_arm(arms: list[Arm], vs_gguf: Path, checkpoint, threads: int, max_model_len: Optional[int],
                  kv_cache_bytes: str) -> Optional[str]:
    """Append the llama.cpp arm ``G`` (its n_ctx: the edgeq arm's context) to ``arms``; or, without
    llama-cpp-python, leave it out and return the note that says so."""
    if not Path(vs_gguf).is_file():
        raise EdgeqError(f"{vs_gguf}: no such .gguf file")
    if not llama_cpp_available():
        return ("llama.cpp arm skipped: llama-cpp-python is not installed (optional extra: `pip install "
                "llama-cpp-python`, which compiles llama.cpp from source)")
    ctx = max_model_len or default_context(str(checkpoint), kv_cache_bytes)
    arms.append(Arm("G", str(vs_gguf), kind="gguf", threads=threads, max_model_len=ctx))
    return None
