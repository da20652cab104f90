"""What this CPU can do, read once: ``/proc/cpuinfo``'s model name and flags.

Questions about the machine's ISA flags go through here (the router's device class, the W4A8 backend choice, the
bench's machine record). Not here, each for its reason: the native kernels ask their own compiled ``cpu_features``
op (CPUID plus the Linux AMX permission, which no file shows), and torch's dispatch capability is asked of torch
(``torch.backends.cpu.get_cpu_capability()``, which applies ``ATEN_CPU_CAPABILITY`` itself).

    >>> from edgeq import cpu
    >>> "avx2" in cpu.flags(), cpu.has_vnni()            # on a Zen 4
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class CpuInfo:
    """The first CPU's ``model name`` and ``flags`` (``Features`` on Arm); empty when unreadable (not Linux)."""

    model: str
    flags: frozenset[str]


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor's model name and flag set from the text of ``/proc/cpuinfo``."""
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
    return CpuInfo(model=model, flags=flags or frozenset())


@lru_cache(maxsize=None)
def read(path: str = CPUINFO) -> CpuInfo:
    """:func:`parse_cpuinfo` of ``path`` (cached: the CPU does not change under a running process)."""
    try:
        return parse_cpuinfo(Path(path).read_text())
    except OSError:
        return CpuInfo(model="", flags=frozenset())


def flags() -> frozenset[str]:
    """This CPU's flags as Linux names them (``avx512f``, ``avx512_vnni``, ``amx_tile``, ...)."""
    return read().flags


def has_vnni() -> bool:
    """AVX512-VNNI or AMX-INT8: where ``torch._int_mm`` runs on integer dot-product units through oneDNN."""
    return bool({"avx512_vnni", "amx_int8"} & flags())


def has_bf16_dot() -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 GEMMs run on bf16 dot-product units. Without them PyTorch's bf16 GEMMs convert
    and are slower than fp32 ones (the GPTQ sweep in bf16 took 1.7x its fp32 time on Zen 3: docs/gptq.md)."""
    return bool({"avx512_bf16", "amx_bf16"} & flags())
