"""The ``edgeq`` command. Each command parses, calls one function that returns a dataclass, and prints it through
:mod:`edgeq.console` (``--json`` everywhere; ``-q`` wherever progress is printed). An :class:`EdgeqError` and a
click usage error alike are one ``error: ...`` line on stderr and exit code 2; a broken threshold exit 1.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from typer._click.exceptions import ClickException, NoArgsIsHelpError, NoSuchOption, UsageError  # typer vendors click

from edgeq.cli.help import EdgeqGroup
from edgeq.console import emit, err, error, out, say  # the commands' one output module
from edgeq.errors import EdgeqError, ThresholdError
from edgeq.io.hub import REVISION_HELP, display_name, resolve_model

# rich_markup_mode=None: plain click help, so a help text's "[default: ...]" is shown, not read as rich markup.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, cls=EdgeqGroup,
                  rich_markup_mode=None, context_settings={"max_content_width": 120},
                  help="4-bit checkpoints for edge CPUs: quantize, inspect, run, and prove fidelity.")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


MAX_MODEL_LEN_HELP = "Context length [default: the model's maximum, capped by what the KV cache budget holds]."
THREADS_HELP = "CPU threads [default: torch's default, one per physical core]."
QUIET_HELP = "No progress or status lines on stderr (errors still print)."


def _read_size(ctx, param, value):
    """Parse a byte-size option as it is read, so that a bad value names its flag (``--kv-cache-bytes: ...``)."""
    return None if value is None else parse_bytes(value, param.opts[-1])


def size_option(default: str, flag: str, help: str):
    """A byte-size option (256MiB, 1GiB, 500MB, 1048576); the command receives bytes (an int)."""
    return typer.Option(default, flag, help=help, callback=_read_size)


def check_method(method: str | None) -> None:
    """Refuse an unknown --method before any file is read, suggesting the closest name."""
    from edgeq.quantize.rtn import METHODS
    from edgeq.scheme import unknown_choice

    if method is not None and method not in METHODS + ("gptq",):
        raise EdgeqError(unknown_choice("--method", method, METHODS + ("gptq",)))


@app.command()
def quantize(
    model: str = typer.Argument(..., help="Hugging Face model directory or hub id (org/name); float or GPTQ."),
    revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output directory [default: MODEL-<scheme>]."),
    scheme: Optional[str] = typer.Option(None, "--scheme", help="w4a16-g32|g64|g128|g256, w4a8-g32|g64|g128, or auto (the fastest here, measured by `edgeq route`) [default: the recipe's; "
                                         "for GPTQ input the checkpoint's group size]."),
    method: Optional[str] = typer.Option(None, "--method", help="rtn (least-squares scale/zero search, default) | clip (min/max + clipping search) | minmax | "
                                         "gptq (calibrated). For GPTQ input: the method of whatever is requantised."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Recipe NAME (see `edgeq recipes`) or a .toml FILE "
                                         "[default: the recipe for config.json's model_type]."),
    requantize: bool = typer.Option(False, "--requantize", help="GPTQ input: requantise (from the exact dequantisation) "
                                    "the layers that cannot be repacked exactly, e.g. another group size."),
    head_from: Optional[Path] = typer.Option(None, "--head-from", help="GPTQ input: quantise the head from this original "
                                             "float model (its lm_head, or its tied embedding)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="--method gptq: calibration text "
                                         "[default: the bundled edgeq/data/calib-prose.txt]."),
    nsamples: Optional[int] = typer.Option(None, "--nsamples", help="--method gptq: calibration windows [default: 128]."),
    seqlen: Optional[int] = typer.Option(None, "--seqlen", help="--method gptq: tokens per window [default: 512]."),
    act_order: Optional[bool] = typer.Option(None, "--act-order/--no-act-order", help="--method gptq: visit columns by "
                                             "decreasing Hessian diagonal; adds M.perm (one input gather) [default: off]."),
    damp: Optional[float] = typer.Option(None, "--damp", help="--method gptq: dampening, a fraction of the mean Hessian "
                                         "diagonal [default: 0.01]."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (from headers only) and exit."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    max_shard_size: str = size_option("2GiB", "--max-shard-size", "Largest output shard, e.g. 2GiB, 500MB."),
) -> None:
    """Quantise a Hugging Face checkpoint (float, or GPTQ: repacked exactly) into one tinygemm-packed W4A16 checkpoint."""
    from edgeq.convert.plan import plan_rows
    from edgeq.convert.pipeline import convert, prepare
    from edgeq.scheme import Scheme

    if scheme is not None and scheme.strip().lower() == "auto":
        from edgeq.route import auto_scheme

        scheme = auto_scheme()  # measured once per machine by `edgeq route`, then cached
        err.print(f"--scheme auto: {scheme} (the fastest scheme `edgeq route` measured on this machine)", highlight=False)
    parsed = Scheme.parse(scheme) if scheme else None
    check_method(method)
    gptq = _gptq_options(calib, nsamples, seqlen, act_order, damp, method)
    prepared = prepare(resolve_model(model, revision), parsed, method, recipe, requantize=requantize,
                       head_from=head_from, gptq=gptq)
    plan = prepared[1]
    if dry_run:
        rows = plan_rows(plan)
        summary = {"scheme": str(plan.scheme), "method": plan.method, "recipe": plan.recipe, "tied": plan.tied,
                   "bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out, "problems": list(plan.problems)}
        if plan.source:
            summary["source"] = plan.source
        emit({"plan": rows, **summary}, as_json, lambda _: _render_plan(rows, summary))
        if plan.problems:
            plan.check()
        return
    target = output or Path(f"{str(model).rstrip('/')}-{plan.scheme}")
    report = _with_progress(lambda cb: convert(model, target, force=force, progress=cb, prepared=prepared,
                                               max_shard_bytes=parse_bytes(max_shard_size)),
                            plan.bytes_in + plan.head.bytes_in * plan.tied, quiet or as_json)
    emit(report, as_json, _render_convert)


def _gptq_options(calib, nsamples, seqlen, act_order, damp, method):
    """GPTQOptions for --method gptq (defaults filled in); None when no calibration option is given otherwise, so
    that prepare() can refuse calibration options without --method gptq."""
    from edgeq.convert.pipeline import GPTQOptions

    given = {k: v for k, v in (("calib", str(calib) if calib else None), ("nsamples", nsamples), ("seqlen", seqlen),
                               ("act_order", act_order), ("damp", damp)) if v is not None}
    if method != "gptq" and not given:
        return None
    return GPTQOptions(**given)


def _with_progress(run, total: int, quiet: bool):
    if quiet:
        return run(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}", style="cyan"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[tensor]}", style="dim"))
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("quantize", total=total, tensor="")
        return run(lambda n, name: bar.update(task, advance=n, tensor=name))


def _render_plan(rows: list[dict], summary: dict) -> None:
    t = Table(title=f"plan: {summary['scheme']} ({summary['method']}, recipe {summary['recipe']})", show_lines=False)
    for col in ("name", "shape", "dtype", "role", "action", "bytes in", "bytes out"):
        t.add_column(col, justify="right" if col.startswith("bytes") else "left")
    for r in rows:
        action = r["action"] + (f" ({r['reason']})" if r["reason"] else "")
        t.add_row(r["name"], "x".join(map(str, r["shape"])), r["dtype"], r["role"], action,
                  f"{r['bytes_in']:,}", f"{r['bytes_out']:,}")
    out.print(t)
    ratio = summary["bytes_in"] / summary["bytes_out"] if summary["bytes_out"] else 0
    out.print(f"total: {_mib(summary['bytes_in'])} -> {_mib(summary['bytes_out'])} ({ratio:.2f}x); "
              f"head {'tied: quantised from the embedding, output untied' if summary['tied'] else 'quantised'}")
    for p in summary["problems"]:
        err.print(f"[red]cannot quantise: {p}[/red]")


def _render_convert(r) -> None:
    out.print(f"wrote {r.out}  ({r.scheme}, {r.method}, recipe {r.recipe}; layout {r.layout})", highlight=False,
              soft_wrap=True)
    out.print(f"  {_mib(r.bytes_in)} -> {_mib(r.bytes_out)}  ({r.ratio:.2f}x)   {r.seconds:.1f} s   "
              f"peak RSS {_mib(r.peak_rss_bytes)} (anon {_mib(r.peak_rss_anon_bytes)})")
    out.print(f"  {r.quantized} weights quantised, head from {r.head_source}{' (untied)' if r.untied else ''}")
    out.print(f"  relative reconstruction error: mean {r.mean_relative_error:.4f}, worst {r.worst_relative_error:.4f} ({r.worst_tensor})")
    for line in r.notes:
        out.print(f"  {line}")


@app.command()
def recipes(as_json: bool = typer.Option(False, "--json")) -> None:
    """List the bundled per-family recipes."""
    from edgeq.convert.recipe import all_recipes

    found = all_recipes()

    def render(_):
        t = Table(title="recipes")
        for col in ("name", "model types", "scheme", "method", "keep bf16", "notes"):
            t.add_column(col)
        for r in found:
            t.add_row(r.name, ", ".join(r.model_types), r.scheme, r.method, ", ".join(r.keep_bf16) or "-", r.notes)
        out.print(t)

    emit([dataclasses.asdict(r) for r in found], as_json, render)


@app.command()
def generate(
    model: str = typer.Argument(..., help="An edgeq checkpoint (or a bf16 Hugging Face checkpoint): directory or hub id."),
    prompt: str = typer.Argument(..., help="The prompt text."),
    revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens to generate at most (EOS or --stop end sooner)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample only from the most likely tokens holding this mass."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (temperature > 0) [default: random]."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt with the tokenizer's chat template."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable) [default: none]."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help=MAX_MODEL_LEN_HELP),
    kv_cache_bytes: str = size_option("256MiB", "--kv-cache-bytes", "KV cache budget, e.g. 512MiB."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Nothing streamed: one JSON object on stdout with the text, "
                                 "token ids, timings and compute paths."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help=QUIET_HELP),
    strict_layout: bool = typer.Option(False, "--strict-layout", help="Refuse a checkpoint packed for another layout."),
    verify: bool = typer.Option(False, "--verify", help="Check every shard's sha256 against the manifest before "
                                "generating (reads the whole checkpoint once; see docs/runtime.md)."),
) -> None:
    """Generate text, streamed to stdout; load info and tokens/s on stderr (--json: one JSON record instead)."""
    from edgeq.runtime.generation import generate_command

    model = str(resolve_model(model, revision))
    generate_command(model, prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, chat=chat,
                     max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes, stop=stop, strict_layout=strict_layout,
                     as_json=as_json, quiet=quiet,
                     threads=threads, verify=verify)


@app.command()
def serve(
    model: str = typer.Argument(..., help="An edgeq checkpoint (or a bf16 Hugging Face checkpoint): directory or hub id."),
    revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port, reported at startup)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help=MAX_MODEL_LEN_HELP),
    kv_cache_bytes: str = size_option("256MiB", "--kv-cache-bytes", "KV cache budget, e.g. 512MiB."),
    queue_size: int = typer.Option(8, "--queue-size", help="Requests waiting beyond the running one; more get 429."),
    max_body_bytes: str = size_option("1MiB", "--max-body-bytes", "Largest request body; larger ones get 413."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="The model id in /v1/models and responses "
                                             "[default: the checkpoint directory's name]."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
    strict_layout: bool = typer.Option(False, "--strict-layout", help="Refuse a checkpoint packed for another layout."),
    as_json: bool = typer.Option(False, "--json", help="Startup as one JSON line on stdout (url, port, model, paths); "
                                 "uvicorn logs warnings only."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No startup line or request log (warnings still print)."),
    verify: bool = typer.Option(False, "--verify", help="Check every shard's sha256 against the manifest before "
                                "serving (reads the whole checkpoint once; see docs/runtime.md)."),
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, /health)."""
    from edgeq.runtime.serve import serve_command

    path = str(resolve_model(model, revision))
    if verify:  # before the server binds: a damaged checkpoint never answers a request
        from edgeq.runtime.loader import verify_shards

        verify_shards(Path(path))
    serve_command(path, host=host, port=port, max_model_len=max_model_len,
                  kv_cache_bytes=kv_cache_bytes, queue_size=queue_size, max_body_bytes=max_body_bytes,
                  model_name=model_name or display_name(model),  # a snapshot directory is named by its commit
                  strict_layout=strict_layout, threads=threads, as_json=as_json, quiet=quiet)


@app.command()
def repack(
    model: str = typer.Argument(..., help="An edgeq checkpoint packed on another machine."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write here instead of in place."),
    as_json: bool = typer.Option(False, "--json", help="The summary as JSON on stdout (path, changed, tensors, bytes, "
                                 "seconds, old and new layout hash)."),
) -> None:
    """Rewrite a checkpoint's packed weights for this machine's measured kernel layout."""
    from edgeq.runtime.repacker import repack, repack_command

    if as_json:
        emit(repack(model, output), as_json)
        return
    repack_command(model, output)


@app.command()
def demo(
    scheme: str = typer.Option("w4a16-g128", "--scheme", help="Scheme to quantise with."),
    method: Optional[str] = typer.Option(None, "--method", help="rtn | minmax | gptq [default: the recipe's]."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Keep the quantised checkpoint in this directory "
                                        "[default: a temporary directory, removed]."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="Tokens to generate."),
    fidelity_tokens: int = typer.Option(4096, "--fidelity-tokens", help="Held-out tokens to score."),
    as_json: bool = typer.Option(False, "--json", help="The summary as JSON on stdout (no progress lines)."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No step-by-step progress on stderr."),
) -> None:
    """Quantize, inspect, score and run the bundled trained model, offline, and print one summary."""
    from edgeq.demo import render, run_demo

    check_method(method)
    progress = None if quiet or as_json else say
    emit(run_demo(scheme, method, keep, max_tokens, fidelity_tokens, progress=progress), as_json,
         lambda r: render(r, out))


@app.command()
def native(as_json: bool = typer.Option(False, "--json")) -> None:
    """The native decode kernel: build it if needed, and say whether it runs here, which ISA path, and why."""
    from edgeq.runtime.native import native_command

    native_command(as_json=as_json)


def _register_edges() -> None:
    """Commands whose modules define their own Typer signatures."""
    from edgeq.fidelity.core import fidelity_command
    from edgeq.inspect.report import inspect_command
    from edgeq.route import route_command
    from edgeq.bench.run import bench_command

    app.command("inspect")(inspect_command)
    app.command("bench")(bench_command)
    app.command("route")(route_command)
    app.command("fidelity")(fidelity_command)


def parse_bytes(text: str, flag: str = "size") -> int:
    """'256MiB' -> 268435456 (one implementation: edgeq.runtime.sizes); an error names ``flag``."""
    from edgeq.runtime.sizes import parse_bytes as parse

    return parse(text, flag)


def version_line() -> str:
    """``edgeq --version``: edgeq, torch, transformers and whether each native kernel is built, on one line."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from edgeq import __version__
    from edgeq.runtime import native, native_w4a8

    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        transformers = "not installed"

    def built(subdir: str, key: str) -> str:  # the build's "ok" marker (native.build_or_load); nothing is built here
        return "built" if (native.cache_dir() / subdir / key[:16] / "ok").exists() else "not built yet (`edgeq native`)"

    return (f"edgeq {__version__}, torch {torch.__version__}, transformers {transformers}; native kernels: "
            f"w4a16 {built('native', native.build_key())}, w4a8 {built('native_w4a8', native_w4a8.build_key())}")


def _print_version(value: bool) -> None:
    if value:
        out.print(version_line(), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the versions of edgeq, torch and transformers and whether the "
                                            "native kernels are built, and exit.")) -> None:
    """4-bit checkpoints for edge CPUs: quantize, inspect, run, and prove fidelity."""


def _usage_message(e: UsageError) -> str:
    """A click usage error as one line, pointing at the command's --help."""
    if isinstance(e, NoSuchOption) and e.possibilities:  # worded like click's "No such command ... Did you mean"
        message = f"{e.message}. Did you mean {', '.join(repr(p) for p in sorted(e.possibilities))}?"
    else:
        message = e.format_message().strip().replace("\n", " ").rstrip(".")
    return f"{message} (see '{e.ctx.command_path} --help')" if e.ctx is not None else message


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings shown to users: ``warning: <message>`` only, never the source path and line that raised it."""
    error(str(message), prefix="warning")


def main(argv: list[str] | None = None) -> None:
    """The ``edgeq`` entry point: every failure is one ``error: ...`` line on stderr, exit code 2 (1: a threshold)."""
    _register_edges()
    warnings.showwarning = _show_warning
    try:
        # Non-standalone typer returns the exit code of typer.Exit, and 130 for a KeyboardInterrupt it caught.
        code = app(args=argv, prog_name="edgeq", standalone_mode=False)
        if code == 130:
            raise KeyboardInterrupt
        sys.exit(code if isinstance(code, int) else 0)
    except EdgeqError as e:
        error(str(e))
        sys.exit(2)
    except ThresholdError as e:
        error(str(e), prefix="threshold broken")
        sys.exit(1)
    except KeyboardInterrupt:
        say("interrupted: nothing was written (partial output removed)")
        sys.exit(2)
    except NoArgsIsHelpError as e:  # bare `edgeq`: the help, on stderr
        e.show()
        sys.exit(2)
    except UsageError as e:
        error(_usage_message(e))
        sys.exit(2)
    except ClickException as e:
        error(e.format_message())
        sys.exit(2)
    except typer.Abort:
        sys.exit(2)


if __name__ == "__main__":
    main()
