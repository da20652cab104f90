"""``edgeq bench``: speed and memory, measured so that the numbers can be trusted (edgeq/bench/, docs/methodology.md).

Exit codes: 0; 1 when a pass of any arm failed (the failures are printed, no comparison); 2 for a refused input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edgeq.console import err, out, write
from edgeq.errors import EdgeqError
from edgeq.io.hub import REVISION_HELP


def bench(
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
    from edgeq.bench import run  # noqa: PLC0415 (the bench package: only when the command runs)
    from edgeq.bench.records import BenchConfig  # noqa: PLC0415
    from edgeq.bench.render import render, render_convert, to_json  # noqa: PLC0415

    say = None if as_json or quiet else (lambda msg: err.print(f"[dim]{msg}[/dim]", highlight=False))
    if convert is not None:
        if checkpoint is not None or vs is not None or vs_gguf is not None:
            raise EdgeqError("--convert MODEL measures a conversion; give no CHECKPOINT, --vs or --vs-gguf with it")
        r = run.measure_conversion(convert, revision, scheme, method, passes, timeout, progress=say)
        write(to_json(r) + "\n") if as_json else render_convert(r, out, err)
        if r.failures:
            raise typer.Exit(1)
        return
    arms, skipped = run.plan_arms(checkpoint, vs, revision, vs_gguf, vs_env, threads=threads,
                                  max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                                  prefill_threshold=prefill_threshold)
    if skipped:
        err.print(f"[yellow]{skipped}[/yellow]")
    cfg = BenchConfig(prompt_len=prompt_len, gen_len=gen_len, passes=passes, warmup=warmup, timeout_s=timeout)
    report = run.measure_arms(arms, cfg, skipped, progress=say)
    write(to_json(report) + "\n") if as_json else render(report, out, err)
    if not report.ok:
        raise typer.Exit(1)
