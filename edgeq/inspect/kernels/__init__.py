"""Aliases to sweep: inspect's per-kernel checks are now one implementation, :mod:`edgeq.inspect.packed`, asking the
kernel's :class:`edgeq.layouts.base.Layout`. ``base.get`` (edgeq/inspect/report.py) and ``w4a16.block_n``
(edgeq/inspect/hf.py) stay importable here until those import :func:`edgeq.inspect.packed.packed_checks` and
:func:`edgeq.layouts.tinygemm.machine_block_n`; then this package goes."""
