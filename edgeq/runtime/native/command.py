"""``edgeq native``: build both native kernels if needed and say whether each runs here, which ISA path, and why."""

from __future__ import annotations

from edgeq.errors import EdgeqError
import edgeq.runtime.native.w4a8 as w4a8
import edgeq.runtime.native.w4a16 as w4a16


def native_command(as_json: bool = False) -> None:
    """`edgeq native`: build the native kernel if needed and say whether it runs here, which ISA path, and why.

    Exit status 0 whether or not the kernel is available (the runtime then uses aten); an invalid
    ``EDGEQ_NATIVE_ISA`` is an :class:`EdgeqError` (exit 2).
    """
    from edgeq.console import emit, line  # noqa: PLC0415

    st = w4a16.status()
    if w4a16.state().user_error:
        raise EdgeqError(st["reason"])
    w4a8.available()  # builds it if needed; an invalid EDGEQ_W4A8_ISA raises (exit 2)
    w8 = w4a8.status()
    if as_json:
        emit({**st, "w4a8": w8}, as_json=True)
        return
    if st["available"]:
        secs = st["build_seconds"]
        built = f"built in {secs} s" if st["built_now"] else f"loaded in {secs} s (cached)"
        line(f"native kernel: available, isa {st['isa']} ({st['reason']}); CPU paths: {', '.join(st['cpu_isas'])}")
        line(f"  {built}: {st['library']}")
    else:
        line(f"native kernel: not available ({st['reason']}); decode uses aten._weight_int4pack_mm_for_cpu")
    if w8["available"]:
        line(f"native W4A8 kernel: available, isa {w8['isa']} ({w8['reason']}); CPU paths: {', '.join(w8['cpu_isas'])}")
    else:
        line(f"native W4A8 kernel: not available ({w8['reason']}); W4A8 runs the portable path")
