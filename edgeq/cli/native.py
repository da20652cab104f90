"""``edgeq native``: build the native kernels if needed and say whether each runs here (edgeq/runtime/native/)."""

from __future__ import annotations

import typer

from edgeq.console import emit, line


def native(as_json: bool = typer.Option(False, "--json")) -> None:
    """The native decode kernel: build it if needed, and say whether it runs here, which ISA path, and why."""
    native_command(as_json=as_json)


def native_command(as_json: bool = False) -> None:
    """Print both kernels' status (:func:`edgeq.runtime.native.command.kernels_status`).

    Exit status 0 whether or not a kernel is available (the runtime then uses aten, or W4A8's portable path); an
    invalid ``EDGEQ_NATIVE_ISA`` / ``EDGEQ_W4A8_ISA`` is an :class:`EdgeqError` (exit 2)."""
    from edgeq.runtime.native.command import kernels_status  # noqa: PLC0415 (torch: only when the command runs)

    st = kernels_status()
    if as_json:
        emit(st, as_json=True)
        return
    w8 = st["w4a8"]
    if st["available"]:
        secs = st["build_seconds"]
        built = f"built in {secs} s" if st["built_now"] else f"loaded in {secs} s (cached)"
        line(f"native kernel: available, isa {st['isa']} ({st['reason']}); CPU paths: {', '.join(st['cpu_isas'])}")
        line(f"  {built}: {st['library']}")
        if st["prefill_tiles"]:
            line(f"  prefill (M > 8) on the avx512 path: {st['prefill_tiles']} tiles (measured faster here)")
    else:
        line(f"native kernel: not available ({st['reason']}); decode uses aten._weight_int4pack_mm_for_cpu")
    if w8["available"]:
        line(f"native W4A8 kernel: available, isa {w8['isa']} ({w8['reason']}); CPU paths: {', '.join(w8['cpu_isas'])}")
    else:
        line(f"native W4A8 kernel: not available ({w8['reason']}); W4A8 runs the portable path")
