"""``edgeq route``: which 4-bit kernels run here, how fast, and which scheme to quantise to (edgeq/route/)."""

from __future__ import annotations

import typer

from edgeq.console import emit, out
from edgeq.errors import EdgeqError


def route(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    refresh: bool = typer.Option(False, "--refresh", help="Measure again instead of reading the per-machine cache."),
    passes: int = typer.Option(3, "--passes", help="Interleaved passes (the median is reported; at least 3)."),
) -> None:
    """This machine: device class, available kernels, a measured microbenchmark of each path, the fastest scheme."""
    import edgeq.route as machine  # noqa: PLC0415 (through the package's names: tests replace its measurements)

    if passes < 3:
        raise EdgeqError(f"--passes {passes}: need at least 3 (the median of fewer says nothing about the spread)")
    report = machine.route(refresh=refresh, passes=passes)
    emit(report, as_json, lambda r: machine.render(r, out))
