"""edgeq: 4-bit checkpoints for edge CPUs, one measured packed layout, and proof they are the same model."""

__version__ = "0.1.0"

from edgeq.integrations import install_transformers as _install_transformers  # noqa: E402

_install_transformers()  # transformers' from_pretrained loads edgeq checkpoints (registers lazily, never raises)
