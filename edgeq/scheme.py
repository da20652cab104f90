"""The quantisation scheme: a frozen value parsed from, and printed back to, strings like ``w4a16-g128``.

``w4aA-gG``: 4-bit weights, activations of A bits (16: bf16 activations, tinygemm kernel; 8: int8 activations,
AMX/VNNI kernel), one scale and zero point per group of G consecutive input channels (along K).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import get_close_matches

from edgeq.errors import EdgeqError
from edgeq.keys import Kernel

# Group sizes each kernel accepts. tinygemm (`_weight_int4pack_mm_for_cpu`) checks qGroupSize in {32, 64, 128, 256};
# the W4A8 kernel blocks K by min(G, 128), so groups above 128 buy nothing there.
_GROUPS = {16: (32, 64, 128, 256), 8: (32, 64, 128)}
_KERNELS = {16: Kernel.W4A16, 8: Kernel.W4A8}
_PATTERN = re.compile(r"^w4a(16|8)-g(\d+)$")


@dataclass(frozen=True)
class Scheme:
    """A weight-only (a16) or int8-activation (a8) 4-bit scheme with group size ``group_size`` along K."""

    activation_bits: int
    group_size: int
    weight_bits: int = 4

    def __post_init__(self) -> None:
        if self.weight_bits != 4 or self.activation_bits not in _GROUPS:
            raise EdgeqError(f"unsupported scheme w{self.weight_bits}a{self.activation_bits}; valid: {', '.join(valid_schemes())}")
        if self.group_size not in _GROUPS[self.activation_bits]:
            raise EdgeqError(f"unknown scheme {self}; valid: {', '.join(valid_schemes())}")

    @classmethod
    def parse(cls, text: str) -> "Scheme":
        """``Scheme.parse("w4a16-g128") == Scheme(activation_bits=16, group_size=128)``."""
        m = _PATTERN.match(text.strip().lower())
        if not m or int(m.group(2)) not in _GROUPS[int(m.group(1))]:
            raise EdgeqError(unknown_choice("scheme", text, valid_schemes()))
        return cls(activation_bits=int(m.group(1)), group_size=int(m.group(2)))

    def __str__(self) -> str:
        return f"w{self.weight_bits}a{self.activation_bits}-g{self.group_size}"

    @property
    def kernel(self) -> Kernel:
        """The runtime path a checkpoint of this scheme must use (written into the manifest)."""
        return _KERNELS[self.activation_bits]


def valid_schemes() -> list[str]:
    return [f"w4a{a}-g{g}" for a in (16, 8) for g in _GROUPS[a]]


def unknown_choice(what: str, given: str, valid: list[str] | tuple[str, ...]) -> str:
    """``unknown scheme 'w4a16-g12'; valid: ...; did you mean 'w4a16-g128'?`` -- the closest valid spellings
    (difflib ratio >= 0.6, compared lower-case) are suggested, as click does for command typos."""
    close = get_close_matches(str(given).strip().lower(), list(valid), n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown {what} {given!r}; valid: {', '.join(valid)}{hint}"
