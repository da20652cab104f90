"""The device class of a CPU: the highest rung of ``AMX > AVX512-VNNI > AVX512 > AVX2 > other`` its flags give, capped
by the ISA torch dispatches its own kernels to. Pure; the flags come from :mod:`edgeq.cpu`.

    >>> device_class({"avx512f", "avx512_vnni", "avx2", "fma"}, "AVX512")
    'AVX512-VNNI'
    >>> device_class({"avx512f", "avx512_vnni", "avx2", "fma"}, "AVX2")    # ATEN_CPU_CAPABILITY=avx2
    'AVX2'
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from edgeq.cpu import CPUINFO, read

CLASSES = ("AMX", "AVX512-VNNI", "AVX512", "AVX2", "other")  # best first
_CAPS = {"AVX2": "AVX2", "DEFAULT": "other"}  # torch capabilities that cap the class; AVX512 (and above) does not
# the flags a route depends on (the report lists these, in this order)
RELEVANT_FLAGS = ("amx_tile", "amx_int8", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                  "avx_vnni", "avx2", "fma", "f16c")


def device_class(flags: Iterable[str], torch_capability: str | None = None) -> str:
    """The device class from CPU flags (``/proc/cpuinfo`` names), capped by torch's capability (rules: :mod:`edgeq.route`)."""
    f = set(flags)
    if {"amx_tile", "amx_int8", "avx512f"} <= f:
        cls = "AMX"
    elif {"avx512_vnni", "avx512f"} <= f:
        cls = "AVX512-VNNI"
    elif {"avx512f", "avx512bw", "avx512vl"} <= f:
        cls = "AVX512"
    elif {"avx2", "fma"} <= f:
        cls = "AVX2"
    else:
        cls = "other"
    cap = _CAPS.get(str(torch_capability or "").upper())
    if cap is not None and CLASSES.index(cap) > CLASSES.index(cls):
        return cap
    return cls


def cpu_flags(cpuinfo: str | Path = CPUINFO) -> frozenset[str]:
    """The ``flags`` (``Features`` on Arm) of the first CPU in ``cpuinfo`` (empty when unreadable, e.g. not Linux):
    :func:`edgeq.cpu.read`'s, of another file when a test gives one."""
    return read(str(cpuinfo)).flags
