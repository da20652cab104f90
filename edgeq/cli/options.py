"""Options and checks several commands share: byte sizes, help texts, ``--method``.

Nothing here imports torch or transformers: every command module imports this at ``edgeq --help`` time.
"""

from __future__ import annotations

import typer

from edgeq.errors import EdgeqError
from edgeq.runtime.sizes import parse_bytes

MAX_MODEL_LEN_HELP = "Context length [default: the model's maximum, capped by what the KV cache budget holds]."
THREADS_HELP = "CPU threads [default: torch's default, one per physical core]."
QUIET_HELP = "No progress or status lines on stderr (errors still print)."


def mib(n: int) -> str:
    """``mib(7311360) == "7.0 MiB"`` (one decimal, thousands separated)."""
    return f"{n / 2**20:,.1f} MiB"


def _read_size(ctx, param, value):
    """Parse a byte-size option as it is read, so that a bad value names its flag (``--kv-cache-bytes: ...``)."""
    return None if value is None else parse_bytes(value, param.opts[-1])


def size_option(default: str, flag: str, help: str):
    """A byte-size option (256MiB, 1GiB, 500MB, 1048576); the command receives bytes (an int)."""
    return typer.Option(default, flag, help=help, callback=_read_size)


def check_method(method: str | None) -> None:
    """Refuse an unknown --method before any file is read, suggesting the closest name."""
    from edgeq.convert.gptqmodel import METHOD as GPTQMODEL  # noqa: PLC0415
    from edgeq.quantize.rtn import METHODS  # noqa: PLC0415 (imports torch: only when a command runs)
    from edgeq.scheme import unknown_choice  # noqa: PLC0415

    if method is not None and method not in METHODS + ("gptq", GPTQMODEL):
        raise EdgeqError(unknown_choice("--method", method, METHODS + ("gptq", GPTQMODEL)))
