"""Settings that may come from an argument or from an ``EDGEQ_*`` environment variable, read in one way.

(The architecture issue's `env.py`: every ``EDGEQ_*`` variable is to be read here; today the decode settings are.)
"""

from __future__ import annotations

import os

from edgeq.errors import EdgeqError


def choice(arg: str | None, name: str, env_var: str, choices: tuple[str, ...]) -> tuple[str, str]:
    """(the lower-cased choice, where it came from): ``arg`` when given (source ``name``), else ``$env_var``, else
    "auto" (source ``$env_var``). A value outside ``choices`` is an :class:`EdgeqError` naming the source, e.g.
    ``choice(None, "decode_loop", "EDGEQ_DECODE_LOOP", ("auto", "lean"))`` with the variable set to "fast" raises
    "$EDGEQ_DECODE_LOOP='fast': expected one of auto, lean"."""
    source = name
    if arg is None:
        arg, source = os.environ.get(env_var) or "auto", f"${env_var}"
    picked = str(arg).strip().lower()
    if picked not in choices:
        raise EdgeqError(f"{source}={arg!r}: expected one of {', '.join(choices)}")
    return picked, source
