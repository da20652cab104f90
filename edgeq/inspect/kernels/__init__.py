"""What ``edgeq inspect`` checks that differs per kernel: one module per :class:`edgeq.keys.Kernel`, found by
:func:`edgeq.inspect.kernels.base.get` (edgeq/inspect/kernels/w4a16.py, w4a8.py)."""
