"""edgeq.cli: the `edgeq` command (entry point edgeq.cli.main:main), one module per command group."""
