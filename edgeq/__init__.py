"""edgeq: 4-bit checkpoints for edge CPUs, one measured packed layout, and proof they are the same model."""

from edgeq.keys import VERSION as __version__  # noqa: E402 (modules read keys.VERSION: no import of the package)

from edgeq.integrations import install_transformers as _install_transformers  # noqa: E402

_install_transformers()  # transformers' from_pretrained loads edgeq checkpoints (registers lazily, never raises)
