"""edgeq.cli: the ``edgeq`` command (entry point edgeq.cli.main:main, or ``python -m edgeq.cli``), one module per
command group, registered on the app by :mod:`edgeq.cli.main`; shared options in :mod:`edgeq.cli.options`, the
click-style help in :mod:`edgeq.cli.help`."""
