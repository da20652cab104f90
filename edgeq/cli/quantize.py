"""``edgeq quantize`` and ``edgeq recipes``: the convert package's commands (edgeq/convert/; docs/format.md, docs/gptq.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from edgeq.cli.options import check_method, mib, size_option
from edgeq.console import emit, err, out
from edgeq.errors import EdgeqError
from edgeq.io.hub import REVISION_HELP, resolve_model
from edgeq.runtime.sizes import parse_bytes

# --calib self picks its own count and length (edgeq.convert.selfcal: NSAMPLES, TOKENS_PER_K, SEQLEN; not imported:
# torch is not loaded for --help); a text's are edgeq.convert.calibrated.TEXT_NSAMPLES / TEXT_SEQLEN
_NSAMPLES_HELP = ("--method gptq: calibration windows [default: 128 for a text; for --calib self, max(32, ceil(4 x the "
                  "widest Linear input / --seqlen))].")
_SEED_HELP = ("--calib self: the sampling seed [default: 0]. Same seed, same machine class: the same windows; another "
              "seed: other windows (docs/gptq.md: the KLD moves within ~2%).")
_SEQLEN_HELP = "--method gptq: tokens per window [default: 512 for a text; 256 for --calib self]."
_CALIB_HELP = ("--method gptq: calibration text, or 'self': token ids sampled from the model itself (seed 0; default "
               "256-token windows, max(32, 4 x the widest Linear input / 256) of them) [default: self for the default "
               "command's quality recipe; with --method gptq or --recipe, the bundled edgeq/data/calib-prose.txt].")
# Printed after the default command's conversion where it took the quality recipe (edgeq/convert/default.py).
_QUALITY_DEFAULT = ("default conversion: recipe quality, GPTQ on ids sampled from the model itself (no data needed; "
                    "mean KLD ~2.7x lower than `--method rtn` on the bundled model). `--method rtn` is the quick "
                    "conversion: for a 1B model on 2 cores, measured, ~1/7 of this one's time on an Intel Xeon with "
                    "AMX and ~1/18-1/20 on AMD Zen 4, ~0.6-0.9 GiB peak against ~4; its checkpoint decoded 1.1-1.4x as "
                    "fast on AMX (g128, one head level; docs/results.md)")
_METHOD_HELP = ("rtn (least-squares scale/zero search; the quick conversion) | clip (min/max + clipping search) | "
                "minmax | gptq (calibrated) | gptqmodel (GPTQModel's GPTQ, the gptq extra; ingested exactly). For GPTQ "
                "input: the method of whatever is requantised. [default: with no --recipe either, the quality recipe's "
                "gptq on ids sampled from the model for float llama, mistral, qwen2 and qwen3 checkpoints at W4A16; "
                "else the recipe's, rtn]")
_RECIPE_HELP = ("Recipe NAME (see `edgeq recipes`) or a .toml FILE [default: quality (--calib self) for float llama, "
                "mistral, qwen2, qwen3 at W4A16 unless --method is given; else the recipe for config.json's "
                "model_type].")
_EMBEDDINGS_HELP = ("packed (4-bit: the head's levels plus a residual, tinygemm schemes) | bf16 [default: the recipe's "
                    "embeddings_storage; w4a8: bf16].")
_HEAD_LEVELS_HELP = ("1 | 2: with --embeddings packed on a tied model, 2 makes the output head add the table's "
                     "residual level too (logits = x @ (D0 + D1)^T: no extra bytes, a second 4-bit matmul per token) [default: "
                     "the recipe's head_levels, 1].")
_GPTQ_PARAMS_HELP = ("--method gptq: each group's scale and zero, chosen when the sweep reaches it: search (the rtn "
                     "least-squares search on its error-updated values) | minmax (GPTQ's original; the default "
                     "before 2026-12-02) [default: search].")
_GPTQ_TARGET_HELP = ("--method gptq: what each Linear's quantised weights are fitted to, on its inputs in the quantised "
                     "model: float (the float model's outputs: later Linears make up for earlier errors; a second copy "
                     "of the calibration activations) | layer (the Linear's own float weights: GPTQ as published; the "
                     "default before 2026-12-04) [default: float].")


def quantize(
    model: str = typer.Argument(..., help="Hugging Face model directory or hub id (org/name); float or GPTQ."),
    revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output directory [default: MODEL-<scheme>]."),
    scheme: Optional[str] = typer.Option(None, "--scheme", help="w4a16-g32|g64|g128|g256, w4a8-g32|g64|g128, or auto (the fastest here, measured by `edgeq route`) [default: the recipe's (quality: g256 where every K divides by 256, else g128); "
                                         "for GPTQ input the checkpoint's group size]."),
    method: Optional[str] = typer.Option(None, "--method", help=_METHOD_HELP),
    recipe: Optional[str] = typer.Option(None, "--recipe", help=_RECIPE_HELP),
    requantize: bool = typer.Option(False, "--requantize", help="GPTQ input: requantise (from the exact dequantisation) "
                                    "the layers that cannot be repacked exactly, e.g. another group size."),
    head_from: Optional[Path] = typer.Option(None, "--head-from", help="GPTQ input: quantise the head from this original "
                                             "float model (its lm_head, or its tied embedding)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help=_CALIB_HELP),
    calib_seed: Optional[int] = typer.Option(None, "--calib-seed", help=_SEED_HELP),
    nsamples: Optional[int] = typer.Option(None, "--nsamples", help=_NSAMPLES_HELP),
    seqlen: Optional[int] = typer.Option(None, "--seqlen", help=_SEQLEN_HELP),
    act_order: Optional[bool] = typer.Option(None, "--act-order/--no-act-order", help="--method gptq: visit columns by "
                                             "decreasing Hessian diagonal; adds M.perm (one input gather) [default: off]."),
    damp: Optional[float] = typer.Option(None, "--damp", help="--method gptq: dampening, a fraction of the mean Hessian "
                                         "diagonal [default: 0.01]."),
    gptq_params: Optional[str] = typer.Option(None, "--gptq-params", help=_GPTQ_PARAMS_HELP),
    gptq_target: Optional[str] = typer.Option(None, "--gptq-target", help=_GPTQ_TARGET_HELP),
    embeddings: Optional[str] = typer.Option(None, "--embeddings", help=_EMBEDDINGS_HELP),
    head_levels: Optional[int] = typer.Option(None, "--head-levels", help=_HEAD_LEVELS_HELP),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (from headers only) and exit."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    max_shard_size: str = size_option("2GiB", "--max-shard-size", "Largest output shard, e.g. 2GiB, 500MB."),
) -> None:
    """Quantise a Hugging Face checkpoint (float, or GPTQ: repacked exactly) into one packed checkpoint: W4A16 (tinygemm) or W4A8."""
    from edgeq.convert.default import default_choice  # noqa: PLC0415 (torch: only when the command runs)
    from edgeq.convert.pipeline import convert, prepare  # noqa: PLC0415

    parsed = _parse_scheme(scheme)
    check_method(method)
    src = resolve_model(model, revision)
    chosen = default_choice(src, parsed) if recipe is None and method is None else None  # edgeq/convert/default.py
    if chosen is not None and chosen.recipe:
        recipe, parsed, calib = chosen.recipe, chosen.scheme, calib or Path(chosen.calib)  # --calib TEXT stays
    prepared = prepare(src, parsed, method, recipe, requantize=requantize, head_from=head_from,
                       gptq=_gptq_options(calib, nsamples, seqlen, act_order, damp, method, calib_seed, gptq_params,
                                          gptq_target),
                       embeddings=embeddings, head_levels=head_levels)
    plan = prepared[1]
    if dry_run:
        _dry_run(plan, prepared[2], as_json)
        return
    target = output or Path(f"{str(model).rstrip('/')}-{plan.scheme}")
    shard_bytes = parse_bytes(max_shard_size, "--max-shard-size")
    if shard_bytes < 1:  # 0 wrote one file per tensor
        raise EdgeqError(f"--max-shard-size {max_shard_size}: must be a positive size, e.g. 2GiB")
    report = _with_progress(lambda cb: convert(model, target, force=force, progress=cb, prepared=prepared,
                                               max_shard_bytes=shard_bytes),
                            plan.bytes_in + plan.head.bytes_in * plan.tied + _extra_reads(plan), quiet or as_json)
    emit(report, as_json, _render_convert)
    if chosen is not None and not (quiet or as_json):  # after the summary: an error before it stays one line
        _say_default(chosen)


def _say_default(chosen) -> None:
    """One line on stderr after the default command: what it chose (the quality recipe: and the quick alternative),
    or why a float checkpoint kept its family recipe; nothing for GPTQ input."""
    if chosen.recipe or chosen.why:
        err.print(_QUALITY_DEFAULT if chosen.recipe else f"default conversion: {chosen.why}", highlight=False,
                  soft_wrap=True)


def _parse_scheme(scheme: str | None):
    """--scheme as a Scheme (None: the recipe's); ``auto`` becomes what `edgeq route` measured on this machine (then
    cached), said on stderr."""
    from edgeq.route import resolve_scheme  # noqa: PLC0415
    from edgeq.scheme import Scheme  # noqa: PLC0415

    chosen = resolve_scheme(scheme)
    if chosen != scheme:
        err.print(f"--scheme auto: {chosen} (the fastest scheme `edgeq route` measured on this machine)", highlight=False)
    return Scheme.parse(chosen) if chosen is not None else None  # "" is parsed, and refused, not the default


def _dry_run(plan, recipe, as_json: bool) -> None:
    """The plan (from headers only): a table and a summary, or one JSON document; an error after it when the plan
    cannot be written."""
    from edgeq.convert.embeddings import describe  # noqa: PLC0415
    from edgeq.convert.plan import plan_rows, recipe_warnings  # noqa: PLC0415

    rows = plan_rows(plan)
    summary = {"scheme": str(plan.scheme), "method": plan.method, "recipe": plan.recipe, "tied": plan.tied,
               "bytes_in": plan.bytes_in, "bytes_out": plan.bytes_out, "problems": list(plan.problems),
               "embeddings": describe(plan), "warnings": recipe_warnings(plan, recipe)}
    if plan.source:
        summary["source"] = plan.source
    emit({"plan": rows, **summary}, as_json, lambda _: _render_plan(rows, summary))
    if plan.problems:
        plan.check()


def _extra_reads(plan) -> int:
    """Bytes read beyond each input tensor once: an embedding packed with its own level 0 is read twice."""
    e = plan.packed_embedding
    return e.bytes_in if e is not None and e.levels[0].own else 0


def _gptq_options(calib, nsamples, seqlen, act_order, damp, method, seed=None, group_params=None, target=None):
    """GPTQOptions for --method gptq (defaults filled in); None when no calibration option is given otherwise, so
    that prepare() can refuse calibration options without --method gptq."""
    from edgeq.convert.calibrated import GPTQOptions  # noqa: PLC0415

    if seed is not None and str(calib) != "self":
        raise EdgeqError(f"--calib-seed {seed}: seeds the windows sampled by --calib self; a calibration text has no "
                         f"seed (drop --calib-seed, or add --calib self)")
    for flag, value in (("--gptq-params", group_params), ("--gptq-target", target)):
        if value is not None and method not in (None, "gptq"):  # None: the recipe's method decides (prepare())
            raise EdgeqError(f"{flag} {value}: applies to --method gptq (edgeq's own GPTQ sweep), not to "
                             f"--method {method or 'rtn'}; drop it or add --method gptq")
    if seed is not None and not 0 <= seed < 2**63:
        raise EdgeqError(f"--calib-seed {seed}: must be in [0, 2^63)")
    given = {k: v for k, v in (("calib", str(calib) if calib else None), ("nsamples", nsamples), ("seqlen", seqlen),
                               ("act_order", act_order), ("damp", damp), ("seed", seed),
                               ("group_params", group_params), ("target", target)) if v is not None}
    if method != "gptq" and not given:
        return None
    return GPTQOptions(**given)


def _with_progress(run, total: int, quiet: bool):
    """``run(callback)`` under a byte progress bar on stderr (``quiet``, or stderr not a terminal: ``run(None)``, no
    bar; a bar stopped on a non-terminal left a blank line before the one ``error:`` line)."""
    if quiet or not err.is_terminal:
        return run(None)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: PLC0415

    columns = (TextColumn("{task.description}", style="cyan"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[tensor]}", style="dim"))
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("quantize", total=total, tensor="")
        return run(lambda n, name: bar.update(task, advance=n, tensor=name))


def _render_plan(rows: list[dict], summary: dict) -> None:
    from rich.table import Table  # noqa: PLC0415

    from edgeq.convert.embeddings import summary_line  # noqa: PLC0415

    t = Table(title=f"plan: {summary['scheme']} ({summary['method']}, recipe {summary['recipe']})", show_lines=False)
    for col in ("name", "shape", "dtype", "role", "action", "bytes in", "bytes out"):
        t.add_column(col, justify="right" if col.startswith("bytes") else "left")
    for r in rows:
        action = r["action"] + (f" ({r['reason']})" if r["reason"] else "")
        t.add_row(r["name"], "x".join(map(str, r["shape"])), r["dtype"], r["role"], action,
                  f"{r['bytes_in']:,}", f"{r['bytes_out']:,}")
    out.print(t)
    ratio = summary["bytes_in"] / summary["bytes_out"] if summary["bytes_out"] else 0
    out.print(f"total: {mib(summary['bytes_in'])} -> {mib(summary['bytes_out'])} ({ratio:.2f}x); "
              f"head {'tied: quantised from the embedding, output untied' if summary['tied'] else 'quantised'}")
    out.print(summary_line(summary["embeddings"]), highlight=False)
    for w in summary["warnings"]:
        err.print(f"warning: {w}", highlight=False, soft_wrap=True, markup=False)
    for p in summary["problems"]:
        err.print(f"[red]cannot quantise: {p}[/red]")


def _render_convert(r) -> None:
    from edgeq.convert.embeddings import summary_line  # noqa: PLC0415

    out.print(f"wrote {r.out}  ({r.scheme}, {r.method}, recipe {r.recipe}; layout {r.layout})", highlight=False,
              soft_wrap=True)
    out.print(f"  {mib(r.bytes_in)} -> {mib(r.bytes_out)}  ({r.ratio:.2f}x)   {r.seconds:.1f} s   "
              f"peak RSS {mib(r.peak_rss_bytes)} (anon {mib(r.peak_rss_anon_bytes)})")
    out.print(f"  {r.quantized} weights quantised, head from {r.head_source}{' (untied)' if r.untied else ''}")
    out.print(f"  relative reconstruction error: mean {r.mean_relative_error:.4f}, worst {r.worst_relative_error:.4f} ({r.worst_tensor})")
    if r.embeddings:
        out.print(f"  {summary_line(r.embeddings)}", highlight=False, soft_wrap=True)
    for line in r.notes:
        out.print(f"  {line}")


def recipes(as_json: bool = typer.Option(False, "--json")) -> None:
    """List the bundled per-family recipes."""
    from rich.table import Table  # noqa: PLC0415

    from edgeq.convert.recipe import all_recipes  # noqa: PLC0415

    found = all_recipes()

    def render(_):
        t = Table(title="recipes")
        for col in ("name", "model types", "scheme", "method", "keep bf16", "notes"):
            t.add_column(col)
        for r in found:
            t.add_row(r.name, ", ".join(r.model_types), r.scheme, r.method, ", ".join(r.keep_bf16) or "-", r.notes)
        out.print(t)

    emit([dataclasses.asdict(r) for r in found], as_json, render)
