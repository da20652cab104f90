"""Alias to sweep (edgeq/inspect/hf.py): :func:`edgeq.layouts.tinygemm.machine_block_n` under its old name."""

from edgeq.layouts.tinygemm import machine_block_n as block_n  # noqa: F401
