"""Byte-size strings for the CLI and the server: ``"256MiB"`` -> 268435456.

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (kB, MB, GB, TB) powers of 1000; a bare number
or a ``B`` suffix is bytes. Case-insensitive for the letters after the first (``256mib`` works); ``k``/``m``/``g``
alone are read as binary because that is what people mean for memory budgets.
"""

from __future__ import annotations

import re

from edgeq.errors import EdgeqError

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000**2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, what: str = "size") -> int:
    """``parse_bytes("1.5GiB") == 1610612736``; ints pass through; negative, empty or unknown units are errors."""
    if isinstance(value, bool):
        raise EdgeqError(f"{what}: expected a byte size like 256MiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise EdgeqError(f"{what}: must not be negative, got {value}")
        return value
    m = _PATTERN.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise EdgeqError(f"{what}: cannot read {value!r} as a byte size; use e.g. 256MiB, 1GiB, 500MB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    """``format_bytes(268435456) == "256.0 MiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} GiB"
