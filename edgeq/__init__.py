"""edgeq: 4-bit checkpoints for edge CPUs, one measured packed layout, and proof they are the same model."""

__version__ = "0.1.0"
