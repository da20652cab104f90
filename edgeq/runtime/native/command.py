"""Both native kernels' status for ``edgeq native`` (the command and its output are edgeq/cli/native.py)."""

from __future__ import annotations

from edgeq.errors import EdgeqError
import edgeq.runtime.native.w4a8 as w4a8
import edgeq.runtime.native.w4a16 as w4a16


def kernels_status() -> dict:
    """Build both kernels if needed and say whether each runs here: the W4A16 kernel's :func:`status`, its measured
    prefill tiles under ``"prefill_tiles"`` (``"bf16"``, ``"fp32"`` or None) and the W4A8 kernel's status under
    ``"w4a8"``.

    An invalid ``EDGEQ_NATIVE_ISA`` or ``EDGEQ_W4A8_ISA`` is an :class:`EdgeqError`; a kernel that cannot be built
    is not (its status says why, and the runtime falls back)."""
    st = w4a16.status()
    if w4a16.state().user_error:
        raise EdgeqError(st["reason"])
    w4a8.available()  # builds it if needed; an invalid EDGEQ_W4A8_ISA raises (exit 2)
    return {**st, "prefill_tiles": w4a16.prefill_tiles(), "w4a8": w4a8.status()}

