"""edgeq's native W4A8 kernel over the stored ``amx_w4a8`` layout: build at first use, load, choose the ISA path, call.

``w4a8_mm(x, qweight, scales, zeros, group_size, bias=None)`` computes exactly what
:func:`edgeq.layouts.w4a8.w4a8_linear` (``fused=True``) computes, bit for bit in bf16: per-token int8 activations
(``127 / amax`` one division, round half to even), exact int32 dot products per K block, ``C = fma(fp32(acc) * s_a,
s_w, C)`` block by block from the fp32 bias, bf16 round-to-nearest-even. It reads the packed tensors as stored (no
repacking, no second copy). Design and the exactness argument: docs/w4a8.md, "Native kernel".

ISA paths (``EDGEQ_W4A8_ISA`` forces one: ``scalar|avx2|avxvnni|vnni|amx``; ``off`` disables the kernel; unset/``auto``
picks the best the CPU has; a forced path the CPU lacks, or an unknown value, is an :class:`EdgeqError`):

- ``amx``: AMX-INT8 tiles (``tdpbusd``) for M > 8, the VNNI code below that (decode is memory-bound).
- ``vnni``: AVX512-VNNI ``vpdpbusd`` on (q_a + 128) x (q - z), minus 128 * the stored compensation.
- ``avxvnni``: the avx2 code with AVX-VNNI's 256-bit ``vpdpbusd`` (Alder Lake and later without AVX512).
- ``avx2``: AVX2 + FMA ``vpmaddubsw`` / ``vpmaddwd`` on the same operands (AVX2-only CPUs, most edge mini-PCs).
- ``scalar``: portable C++, only when forced (``EDGEQ_W4A8_ISA=scalar``, tests): without AVX2 ``auto`` leaves the
  kernel off, because the portable path's int8 GEMM is faster than this code at M >= 8.

Its own extension and ``TORCH_LIBRARY(edgeq_w4a8)`` namespace, separate from :mod:`edgeq.runtime.native` (a process
holds one library per namespace). Built into ``$EDGEQ_CACHE_DIR`` (default ``~/.cache/edgeq``)``/native_w4a8/<key>``,
key = sha256 of the sources, flags, torch version and Python ABI.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeq.errors import EdgeqError
from edgeq.runtime.native import _short, build_or_load, isa_request, source_key

ENV_ISA = "EDGEQ_W4A8_ISA"
ISAS = ("scalar", "avx2", "avxvnni", "vnni", "amx")  # worst first
_ISA_CODE = {"scalar": 0, "vnni": 1, "amx": 2, "avx2": 3, "avxvnni": 4}  # the binding's codes (stable, not the ranking)
_FEATURE_BIT = {"avx2": 4, "avxvnni": 8, "vnni": 1, "amx": 2}

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = ("w4a8mm_ops.cpp", "w4a8mm_scalar.cpp", "w4a8mm_avx2.cpp", "w4a8mm_vnni.cpp", "w4a8mm_amx.cpp")
_HEADERS = ("w4a8mm.h", "w4a8mm_avx512.h", "amx_os.h", "bf16.h")
# -ffp-contract=off: no multiply-add is fused unless written as one (the kernel's rounding is part of its contract).
# -fopenmp: at::parallel_for is header code that is only parallel when compiled with OpenMP.
_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unused-function")
_LDFLAGS = ("-fopenmp",)


@dataclass
class _State:
    available: bool = False
    isa: str | None = None
    reason: str = "not loaded yet"
    user_error: bool = False
    build_seconds: float | None = None
    built_now: bool = False
    library: str | None = None
    cpu_isas: tuple[str, ...] = ()
    forced: str | None = None


_lock = threading.Lock()
_state: _State | None = None
_calls = 0
_loaded_library: str | None = None


def build_key() -> str:
    """sha256 over the kernel sources, flags, torch version and Python ABI (:func:`native.source_key`)."""
    return source_key(_CSRC, _SOURCES + _HEADERS, _CFLAGS, _LDFLAGS)


def _compile(key: str) -> tuple[str, bool]:
    """Build (or reuse) the extension; returns (library path, built_now). Raises on any failure."""
    global _loaded_library
    if _loaded_library is not None:
        return _loaded_library, False
    _loaded_library, built = build_or_load("edgeq_w4a8", "native_w4a8", key, [str(_CSRC / s) for s in _SOURCES],
                                           _CFLAGS, _LDFLAGS)
    return _loaded_library, built


def _cpu_features() -> int:
    """bit 0: the vnni path's instructions, bit 1: amx (AMX-TILE/INT8 granted by the OS), bit 2: avx2 (AVX2 + FMA),
    bit 3: avxvnni (that + AVX-VNNI); asked from the library."""
    return int(torch.ops.edgeq_w4a8.cpu_features())


def _lacks_message(forced: str, has: tuple[str, ...]) -> str:
    return (f"{ENV_ISA}={forced} but this CPU lacks it (has {', '.join(has)}; avx2 needs AVX2 + FMA, avxvnni "
            "that plus AVX-VNNI, vnni needs AVX512 F/BW/VL/DQ + VNNI, amx needs that plus AMX-TILE/AMX-INT8 granted "
            "by Linux); unset it or choose one of those")


def _load() -> _State:
    """Read EDGEQ_W4A8_ISA, build or load the library, pick the ISA: once per process (tests may reset ``_state``)."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        st = _State()
        forced, why_not, st.user_error = isa_request(ENV_ISA, ISAS, "the native W4A8 kernel")
        st.forced = None if forced == "auto" else forced
        if why_not is not None:
            st.reason = why_not
        else:
            t0 = time.perf_counter()
            try:
                st.library, st.built_now = _compile(build_key())
                bits = _cpu_features()
                st.cpu_isas = ("scalar",) + tuple(i for i in ISAS[1:] if bits & _FEATURE_BIT[i])
            except Exception as e:  # noqa: BLE001 - any build/load failure: the portable path runs, and says why
                st.reason = f"native W4A8 kernel build/load failed: {_short(e)}"
                _state = st
                return st
            st.build_seconds = round(time.perf_counter() - t0, 3)
            if forced != "auto" and forced not in st.cpu_isas:
                st.reason, st.user_error = _lacks_message(forced, st.cpu_isas), True
            elif forced == "auto" and st.cpu_isas == ("scalar",):
                # Measured (1536 x 1536, 2 threads): the scalar code takes 0.82 / 6.8 / 109 ms at M = 1 / 8 / 128
                # against 1.0 / 1.65 / 4.2 ms for the portable path (oneDNN's int8 GEMM), so without AVX2 the
                # portable path is the fast one; the scalar code stays reachable with EDGEQ_W4A8_ISA=scalar.
                st.reason = ("this CPU has neither AVX2 nor AVX512-VNNI: the portable path (torch int8 GEMM) is faster "
                             f"than edgeq's scalar W4A8 code; {ENV_ISA}=scalar forces it")
            else:
                st.isa = st.cpu_isas[-1] if forced == "auto" else forced
                st.available = True
                st.reason = "ok" if forced == "auto" else f"forced by {ENV_ISA}={forced}"
        _state = st
        return st


def available() -> bool:
    """True when the kernel is built and usable here; a bad ``EDGEQ_W4A8_ISA`` raises :class:`EdgeqError`."""
    st = _load()
    if st.user_error:
        raise EdgeqError(st.reason)
    return st.available


def status() -> dict:
    """{available, isa, reason, build_seconds, built_now, library, cpu_isas, forced, calls}."""
    st = _load()
    return {"available": st.available, "isa": st.isa, "reason": st.reason, "build_seconds": st.build_seconds,
            "built_now": st.built_now, "library": st.library, "cpu_isas": list(st.cpu_isas), "forced": st.forced,
            "calls": _calls}


def call_count() -> int:
    return _calls


def source_name() -> str:
    """How the runtime names this kernel, e.g. ``edgeq native (vnni)``."""
    st = _load()
    return f"edgeq native ({st.isa})"


def w4a8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            bias: torch.Tensor | None = None, *, isa: str | None = None) -> torch.Tensor:
    """bf16 [M, N] = W4A8(x [M, K] bf16/fp32) with the portable path's signature and bits; ``isa`` overrides the
    process's choice for one call (tests, benchmarks). Raises :class:`EdgeqError` when unavailable or on bad input."""
    global _calls
    st = _state or _load()
    if not st.available:
        if st.user_error:
            raise EdgeqError(st.reason)
        raise EdgeqError(f"native w4a8_mm is not available: {st.reason}")
    if isa is None:
        code = _ISA_CODE[st.isa]
    elif isa in st.cpu_isas:
        code = _ISA_CODE[isa]
    else:
        raise EdgeqError(f"native w4a8_mm: isa {isa!r} is not one this CPU runs ({', '.join(st.cpu_isas)})")
    try:
        y = torch.ops.edgeq_w4a8.w4a8_mm.default(x, qweight, scales, zeros, group_size, bias, code)
    except RuntimeError as e:
        raise EdgeqError(f"native w4a8_mm: {str(e).splitlines()[0]}") from e
    _calls += 1
    return y
