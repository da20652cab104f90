"""``edgeq fidelity``: is the quantised model still the reference model? (edgeq/fidelity/, docs/fidelity.md)

Its Typer signature, the progress bar, printing and the exit codes: 0, 1 when a ``--max-kld`` / ``--min-top1`` /
``--max-ppl-ratio`` bound is broken (ThresholdError), 2 for a refused input (EdgeqError) and when interrupted (the
partial statistics are still printed, then one line says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from edgeq.console import err, out, write
from edgeq.errors import EdgeqError, ThresholdError
from edgeq.io.hub import REVISION_HELP, resolve_models

# edgeq.fidelity.reffile.DEFAULT_REF_TOPK, written here because importing the fidelity package imports torch, which
# `edgeq --help` must not (tests/test_cli.py checks that the two agree)
DEFAULT_REF_TOPK = 32


def _progress_bar(quiet: bool = False):
    """A rich progress bar on stderr and the callback that drives it (``quiet``, or stderr not a terminal: neither; a
    bar stopped on a non-terminal left a blank line before the one ``error:`` line)."""
    from contextlib import nullcontext  # noqa: PLC0415

    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn  # noqa: PLC0415

    if quiet or not err.is_terminal:
        return nullcontext(), None
    bar = Bar(TextColumn("fidelity windows"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
              console=err, transient=True)
    task = bar.add_task("windows", total=None)

    def update(done: int, total: int, eta: Optional[float]) -> None:
        bar.update(task, completed=done, total=total)
    return bar, update


def fidelity(
    models: Annotated[list[Path], typer.Argument(help="REF QUANT (directories or hub ids); or QUANT alone with --ref FILE; or REF alone with --save-ref FILE", show_default=False,
                                             metavar="REF QUANT")],
    revision: Annotated[Optional[str], typer.Option("--revision", help=REVISION_HELP + " Applies to every hub id given.")] = None,
    allow_swapped: Annotated[bool, typer.Option("--allow-swapped", help="score REF QUANT as given when REF is an edgeq checkpoint and QUANT is not (refused otherwise: the order is probably swapped)")] = False,
    text: Annotated[Optional[Path], typer.Option("--text", help="UTF-8 evaluation text (default: the bundled held-out prose, edgeq/data/heldout-prose.txt)")] = None,
    ctx: Annotated[Optional[int], typer.Option("--ctx", help="tokens per window (default: 512, or the --ref file's)")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="stop after this many scored tokens")] = None,
    score: Annotated[Optional[str], typer.Option("--score", help="half: the second half of each window, as llama-perplexity (default); all: every position")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON (schema edgeq.fidelity/1)")] = False,
    save_ref: Annotated[Optional[Path], typer.Option("--save-ref", help="also cache the reference's top-k log-probs here")] = None,
    ref: Annotated[Optional[Path], typer.Option("--ref", help="compare against a --save-ref file instead of REF")] = None,
    ref_topk: Annotated[int, typer.Option("--ref-topk", help="k for --save-ref")] = DEFAULT_REF_TOPK,
    per_layer: Annotated[bool, typer.Option("--per-layer", help="relative output error of every quantised linear")] = False,
    top: Annotated[int, typer.Option("--top", help="layers shown with --per-layer")] = 10,
    max_kld: Annotated[Optional[float], typer.Option("--max-kld", help="exit 1 if mean KLD is above")] = None,
    min_top1: Annotated[Optional[float], typer.Option("--min-top1", help="exit 1 if the same-top-1 rate is below")] = None,
    max_ppl_ratio: Annotated[Optional[float], typer.Option("--max-ppl-ratio", help="exit 1 if PPL(quant)/PPL(ref) is above")] = None,
    save_card: Annotated[bool, typer.Option("--save-card", help="write the figures into QUANT's model card (README.md, its fidelity section; atomic)")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="no progress bar")] = False,
) -> None:
    """Score a quantised checkpoint against its reference (KLD, PPL ratio, top-1 agreement, ...)."""
    from edgeq.convert import card  # noqa: PLC0415 (torch: only when the command runs)
    from edgeq.fidelity.checkpoints import check_order, run_fidelity, save_reference_checkpoint  # noqa: PLC0415
    from edgeq.fidelity.thresholds import broken_bounds  # noqa: PLC0415

    if not 1 <= len(models) <= 2:
        raise EdgeqError(f"fidelity: {len(models)} checkpoints given; usage: edgeq fidelity REF QUANT")
    models = resolve_models(models, revision)
    if len(models) == 2:
        check_order(*models, allow_swapped)  # before the progress bar, so that the refusal is the only stderr line
    if save_card:
        card.check_checkpoint(models[-1])  # QUANT, before the run and the progress bar
    bar, update = _progress_bar(quiet)
    with bar:
        if len(models) == 1 and ref is None:
            if save_ref is None:
                raise EdgeqError("fidelity: one checkpoint given; usage: edgeq fidelity REF QUANT, "
                                 "edgeq fidelity QUANT --ref FILE, or edgeq fidelity REF --save-ref FILE")
            n, ppl = save_reference_checkpoint(models[0], save_ref, text_path=text, ctx=ctx, score=score,
                                               max_tokens=max_tokens, k=ref_topk, progress=update)
            out.print(f"wrote {save_ref}: {n} positions, PPL(ref) {ppl:.4f}")
            return
        ref_path, quant_path = (None, models[0]) if len(models) == 1 else (models[0], models[1])
        report = run_fidelity(ref_path, quant_path, text_path=text, ctx=ctx, score=score, max_tokens=max_tokens,
                              save_ref=save_ref, ref_file=ref, per_layer=per_layer, top=top, ref_topk=ref_topk,
                              progress=update, allow_swapped=allow_swapped)
    _print_report(report, json_out=json_out, top=top, save_ref=save_ref)
    if save_card:  # the figures as measured, whether or not a bound below is broken
        _save_card(report, quant_path, ref_path, ref_file=ref, text=text)
    broken = broken_bounds(report, max_kld=max_kld, min_top1=min_top1, max_ppl_ratio=max_ppl_ratio)
    if broken:
        raise ThresholdError("; ".join(broken))  # the CLI prints "threshold broken: <this>", exit 1


def _print_report(report, *, json_out: bool, top: int, save_ref: Optional[Path]) -> None:
    """The report (a :class:`edgeq.fidelity.report.FidelityReport`) on stdout, JSON or the table; an interrupted run
    says so in one line on stderr and exits 2, as every interrupted command does (not 130: the entry point reads
    typer's 130 as an interruption it must report itself, "nothing was written", which is not this case)."""
    from edgeq.fidelity.report import render  # noqa: PLC0415

    if json_out:
        write(report.to_json() + "\n")
    else:
        out.print(render(report, top))
    if report.partial:
        err.print("interrupted: the statistics above are partial" + ("; --save-ref was not written" if save_ref else ""))
        raise typer.Exit(2)


def _save_card(report, quant_path: Path, ref_path: Optional[Path], *, ref_file: Optional[Path],
               text: Optional[Path]) -> None:
    """``--save-card``: write the report's figures into QUANT's model card and say where (stderr)."""
    from edgeq.convert import card  # noqa: PLC0415

    reference = f"{ref_file} (a --save-ref file)" if ref_file else card.source_name(ref_path)
    record = card.fidelity_record(report, reference=reference, text=str(text or "edgeq/data/heldout-prose.txt"))
    err.print(f"wrote the fidelity figures into {card.save_fidelity(quant_path, record)}")
