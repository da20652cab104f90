"""edgeq's native W4A8 kernel over the stored ``amx_w4a8`` layout: ``w4a8_mm`` and its library's ISA choice.

``w4a8_mm(x, qweight, scales, zeros, group_size, bias=None)`` computes exactly what
:func:`edgeq.runtime.w4a8_compute.w4a8_linear` (``fused=True``) computes, bit for bit in bf16: per-token int8
activations (``127 / amax`` one division, round half to even), exact int32 dot products per K block,
``C = fma(fp32(acc) * s_a, s_w, C)`` block by block from the fp32 bias, bf16 round-to-nearest-even. It reads the
packed tensors as stored (no repacking, no second copy). Design and the exactness argument: docs/w4a8.md, "Native
kernel".

ISA paths (``EDGEQ_W4A8_ISA`` forces one: ``scalar|avx2|avxvnni|vnni|amx``; ``off`` disables the kernel; unset/``auto``
picks the best the CPU has; a forced path the CPU lacks, or an unknown value, is an :class:`EdgeqError`):

- ``amx``: AMX-INT8 tiles (``tdpbusd``) for M > 8, the VNNI code below that (decode is memory-bound).
- ``vnni``: AVX512-VNNI ``vpdpbusd`` on (q_a + 128) x (q - z), minus 128 * the stored compensation.
- ``avxvnni``: the avx2 code with AVX-VNNI's 256-bit ``vpdpbusd`` (Alder Lake and later without AVX512).
- ``avx2``: AVX2 + FMA ``vpmaddubsw`` / ``vpmaddwd`` on the same operands (AVX2-only CPUs, most edge mini-PCs).
- ``scalar``: portable C++, only when forced (``EDGEQ_W4A8_ISA=scalar``, tests): without AVX2 ``auto`` leaves the
  kernel off, because the portable path's int8 GEMM is faster than this code at M >= 8.

Its own extension and ``TORCH_LIBRARY(edgeq_w4a8)`` namespace, separate from the W4A16 library (a process holds one
library per namespace), built by :mod:`.build` into ``$EDGEQ_CACHE_DIR/native_w4a8/<key>``.
"""

from __future__ import annotations

import torch

from edgeq.env import W4A8_ISA
from edgeq.errors import EdgeqError
import edgeq.runtime.native.build as build

SPEC = build.Spec(
    name="native W4A8 kernel",
    prefix="edgeq_w4a8",
    subdir="native_w4a8",
    sources=("w4a8mm_ops.cpp", "w4a8mm_scalar.cpp", "w4a8mm_avx2.cpp", "w4a8mm_vnni.cpp", "w4a8mm_amx.cpp"),
    headers=("w4a8mm.h", "w4a8mm_avx512.h", "amx_os.h", "bf16.h", "tensor_bits.h"),
    # -ffp-contract=off: no multiply-add is fused unless written as one (the kernel's rounding is part of its contract).
    # -fopenmp: at::parallel_for is header code that is only parallel when compiled with OpenMP.
    cflags=("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unused-function"),
    ldflags=("-fopenmp",),
    env_isa=W4A8_ISA,
    isas=("scalar", "avx2", "avxvnni", "vnni", "amx"),  # worst first
    feature_bits={"avx2": 4, "avxvnni": 8, "vnni": 1, "amx": 2},
    isa_codes={"scalar": 0, "vnni": 1, "amx": 2, "avx2": 3, "avxvnni": 4},  # the binding's codes, not the ranking
    needs=("avx2 needs AVX2 + FMA, avxvnni that plus AVX-VNNI, vnni needs AVX512 F/BW/VL/DQ + VNNI, amx needs that "
           "plus AMX-TILE/AMX-INT8 granted by Linux"),
    # Measured (1536 x 1536, 2 threads): the scalar code takes 0.82 / 6.8 / 109 ms at M = 1 / 8 / 128 against
    # 1.0 / 1.65 / 4.2 ms for the portable path (oneDNN's int8 GEMM), so without AVX2 the portable path is the fast
    # one; the scalar code stays reachable with EDGEQ_W4A8_ISA=scalar.
    scalar_only=("this CPU has neither AVX2 nor AVX512-VNNI: the portable path (torch int8 GEMM) is faster than "
                 f"edgeq's scalar W4A8 code; {W4A8_ISA}=scalar forces it"),
)
ENV_ISA, ISAS = SPEC.env_isa, SPEC.isas

_state: build.State | None = None  # loaded at first use (build.Library); tests reset it to re-read EDGEQ_W4A8_ISA
_calls = 0


def _cpu_features() -> int:
    """bit 0: the vnni path's instructions, bit 1: amx (AMX-TILE/INT8 granted by the OS), bit 2: avx2 (AVX2 + FMA),
    bit 3: avxvnni (that + AVX-VNNI); asked from the library."""
    return int(torch.ops.edgeq_w4a8.cpu_features())


_LIBRARY = build.Library(SPEC, globals())
available, status, call_count, build_key = _LIBRARY.available, _LIBRARY.status, _LIBRARY.call_count, _LIBRARY.build_key


def isa_code(isa: str | None = None) -> int:
    """The op's ``isa`` argument: the process's choice, or ``isa`` (tests, benchmarks). Raises :class:`EdgeqError`
    when the kernel is unavailable (its reason itself when it is the user's error, e.g. a bad ``EDGEQ_W4A8_ISA``)."""
    st = _state or _LIBRARY.load()
    if not st.available:
        raise EdgeqError(st.reason if st.user_error else f"native w4a8_mm is not available: {st.reason}")
    return build.isa_code(SPEC, st, isa, "w4a8_mm")


def count_calls(n: int) -> None:
    """Count ``n`` matrices computed through this op by another (the W4A16 library's ``decode_layers``)."""
    global _calls
    _calls += n


def source_name() -> str:
    """How the runtime names this kernel, e.g. ``edgeq native (vnni)``."""
    st = _LIBRARY.load()
    return f"edgeq native ({st.isa})"


def w4a8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            bias: torch.Tensor | None = None, *, isa: str | None = None) -> torch.Tensor:
    """bf16 [M, N] = W4A8(x [M, K] bf16/fp32) with the portable path's signature and bits; ``isa`` overrides the
    process's choice for one call (tests, benchmarks). Raises :class:`EdgeqError` when unavailable or on bad input."""
    global _calls
    code = isa_code(isa)
    try:
        y = torch.ops.edgeq_w4a8.w4a8_mm.default(x, qweight, scales, zeros, group_size, bias, code)
    except RuntimeError as e:
        raise EdgeqError(f"native w4a8_mm: {str(e).splitlines()[0]}") from e
    _calls += 1
    return y
