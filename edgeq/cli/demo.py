"""``edgeq demo``: quantize, inspect, score and run the bundled model, offline (edgeq/demo.py does the steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edgeq.cli.options import check_method
from edgeq.console import emit, out, say


def demo(
    scheme: Optional[str] = typer.Option(None, "--scheme", help="Scheme to quantise with [default: as edgeq quantize: "
                                         "w4a16-g256 for the bundled model]."),
    method: Optional[str] = typer.Option(None, "--method", help="rtn | clip | minmax | gptq | gptqmodel (as edgeq "
                                         "quantize) [default: as edgeq quantize: the quality recipe's gptq on ids "
                                         "sampled from the model]."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Keep the quantised checkpoint in this directory "
                                        "[default: a temporary directory, removed]."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="Tokens to generate."),
    fidelity_tokens: int = typer.Option(4096, "--fidelity-tokens", help="Held-out tokens to score."),
    as_json: bool = typer.Option(False, "--json", help="The summary as JSON on stdout (no progress lines)."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No step-by-step progress on stderr."),
) -> None:
    """Quantize, inspect, score and run the bundled trained model, offline, and print one summary."""
    from edgeq.demo import run_demo  # noqa: PLC0415

    check_method(method)
    progress = None if quiet or as_json else say
    emit(run_demo(scheme, method, keep, max_tokens, fidelity_tokens, progress=progress), as_json, render)


def render(r) -> None:
    """The summary of a :class:`edgeq.demo.DemoReport` on stdout, one line per step."""
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    out.print(f"[bold]edgeq demo[/bold]: bundled tiny-prose model (trained Llama, 4 layers, tied head) -> {r.scheme} ({r.method}, recipe {r.recipe})")
    out.print(f"  quantize  {mib(r.bytes_in)} -> {mib(r.bytes_out)} ({r.bytes_in / r.bytes_out:.2f}x) in {r.convert_seconds:.1f} s (one run); "
              f"head quantised: {r.head_quantized}; {r.effective_bits:.2f} bits/weight")
    out.print(f"  inspect   layout matches this machine: {r.layout_matches}; projected serving memory "
              f"{mib(r.projected_total_bytes or 0)}")
    err = f" +- {r.kld_mean_err:.5f}" if r.kld_mean_err is not None else ""
    out.print(f"  fidelity  mean KLD {r.kld_mean:.5f}{err}; same top-1 {r.top1_agreement * 100:.1f}%; "
              f"PPL {r.ppl_ref:.3f} -> {r.ppl_quant:.3f} over {r.tokens_scored} held-out tokens")
    out.print(f"  generate  {r.prompt!r} -> {r.completion!r}")
    out.print(f"            decode path {r.decode_path}: {r.decode_tokens_per_s:.1f} tok/s, prefill of the "
              f"{r.prompt_tokens}-token prompt {r.prefill_tokens_per_s:.1f} tok/s")
    out.print(f"            ({r.speed_basis})", markup=False, highlight=False)
    if r.kept:
        out.print(f"  checkpoint kept in {r.kept}")
