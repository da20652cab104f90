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
(``--convert``), ``render`` (tables and JSON). This module is the command.

This module imports no torch at import time: the parent only schedules, judges and prints.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from edgeq.bench.conversion import run_convert
from edgeq.bench.gguf_arm import default_context, llama_cpp_available
from edgeq.bench.process import worker_env  # noqa: F401 - alias: tests/test_omp_policy.py imports it from here
from edgeq.bench.records import Arm, BenchConfig
from edgeq.bench.render import render, render_convert, to_json
from edgeq.bench.schedule import run_bench
from edgeq.errors import EdgeqError
from edgeq.io.hub import REVISION_HELP, resolve_model, resolve_models
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
        if skipped:
            err.print(f"[yellow]{skipped}[/yellow]")
    cfg = BenchConfig(prompt_len=prompt_len, gen_len=gen_len, passes=passes, warmup=warmup, timeout_s=timeout)
    report = run_bench(arms, cfg, progress=say)
    if skipped:
        report = replace(report, notes=report.notes + (skipped,))
    write(to_json(report) + "\n") if as_json else render(report, out, err)
    if not report.ok:
        raise typer.Exit(1)


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
