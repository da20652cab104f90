"""Alias to sweep (edgeq/inspect/report.py): :func:`edgeq.inspect.packed.packed_checks` under its old name."""

from edgeq.inspect.packed import LayoutVerdict, PackedChecks, packed_checks as get  # noqa: F401
