"""``edgeq repack``: rewrite a checkpoint's packed weights for this machine (edgeq/runtime/repacker.py does it)."""

from __future__ import annotations

from typing import Optional

import typer

from edgeq.console import emit, say


def repack(
    model: str = typer.Argument(..., help="An edgeq checkpoint packed on another machine."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write here instead of in place."),
    as_json: bool = typer.Option(False, "--json", help="The summary as JSON on stdout (path, changed, tensors, bytes, "
                                 "seconds, old and new layout hash)."),
) -> None:
    """Rewrite a checkpoint's packed weights for this machine's measured kernel layout."""
    from edgeq.convert.records import describe_layout  # noqa: PLC0415 (torch: only when the command runs)
    from edgeq.layouts import tinygemm  # noqa: PLC0415
    from edgeq.runtime.repacker import repack as rewrite  # noqa: PLC0415

    r = rewrite(model, output)
    if as_json:
        emit(r, as_json)
        return
    layout = describe_layout(tinygemm.probe())  # the target: what this process's torch packs for, and why
    if not r.changed and output is not None:  # a copy was still written: say so
        say(f"{r.path}: copied from {model}, already packed for this machine (layout {layout})")
    elif not r.changed:
        say(f"{r.path}: already packed for this machine (layout {layout}); nothing to do")
    else:
        say(f"{r.path}: repacked {r.tensors} tensors ({r.bytes_repacked} bytes) from layout {r.old_layout_hash[:12]} "
            f"to {layout} in {r.seconds:.2f} s")
