"""Alias to sweep: ``edgeq fidelity`` is edgeq/cli/fidelity.py. This module only keeps the old name for
edgeq/fidelity/core.py's re-export; it goes with that line (an upward import until then)."""

from __future__ import annotations


def fidelity_command(*args, **kwargs) -> None:
    """Alias to sweep: :func:`edgeq.cli.fidelity.fidelity`."""
    from edgeq.cli.fidelity import fidelity  # noqa: PLC0415

    fidelity(*args, **kwargs)
