"""The native CPU W4A16 decode kernel: ``int4_mm``, the layouts it reads, and its library's ISA choice.

``int4_mm(x, qweight, group_size, scales_and_zeros)`` computes the same thing as
``torch.ops.aten._weight_int4pack_mm_for_cpu`` -- ``y[M, N] = x[M, K] @ dequant(W).T``, x and y bf16,
``w[n, k] = (q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]`` -- reading ``qweight`` (uint8 [N, K/2]) and
``scales_and_zeros`` (bf16 [K/G, N, 2]) as they are stored: no repacking, no second copy, each weight byte read once
from memory. It is built for decode (M <= 8) and accepts any M. Design, numbers and how to rerun: docs/kernel.md.

Layouts. The stored bytes follow a :class:`~edgeq.layouts.tinygemm.TinygemmLayout`: blocks of ``block_n`` rows, k-major,
``s/2`` bytes per k for a block of s rows. The kernel implements ``block_n`` in (32, 64) and, per block size, two nibble
orders: *halves* (``perm = [0, s/2, 1, s/2+1, ...]``, full AVX512/AVX2 blocks) and *adjacent* (``perm = [0, 1, ...]``,
tails and the default path). :func:`supports` compares a layout's measured permutations with these two; any other layout
is refused and the runtime uses the aten op. Worked example (block_n = 64, halves): byte ``32*k + j`` of block 0 holds
``q[j, k]`` in its low nibble and ``q[j + 32, k]`` in its high nibble.

ISA paths, chosen once per process from the CPU flags (``EDGEQ_NATIVE_ISA`` overrides):

- ``amx``: the avx512 set plus AMX-TILE/AMX-BF16 granted by Linux: ``tdpbf16ps`` tiles for M >= 2 (M = 1 runs the
  avx512 code).
- ``avx512``: AVX512 F/BW/VL/VBMI/BF16 (Sapphire Rapids, Zen 4). Weights become bf16 ``128 + q`` (exact; AMX
  tiles ``1 + q/16``) and are multiplied with the bf16 activations by ``vdpbf16ps`` into fp32 accumulators: exact
  products, fp32 sums. The activations are never quantised. For M > 8 the same path has fp32-FMA tiles too (q
  widened to fp32, 12 activation rows a tile), which multiply twice as fast where ``vdpbf16ps`` runs at half the
  fp32 FMA rate (Intel cores); the faster kind is measured once per process (:func:`prefill_tiles`;
  ``EDGEQ_NATIVE_PREFILL=bf16|fp32`` forces one).
- ``avx2``: AVX2 + FMA: q converted to fp32, fp32 FMA with the fp32 activations.
- ``scalar``: portable C++, any supported block; also the path for blocks the SIMD paths do not specialise (tails,
  adjacent full blocks).

``EDGEQ_NATIVE_ISA=amx|avx512|avx2|scalar`` forces a path (an :class:`EdgeqError` if the CPU lacks it), ``off``
disables the native kernel, unset or ``auto`` picks the best. The build and the choice: :mod:`.build`. The same library
holds the small decode ops (:mod:`.ops`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeq import env
from edgeq.env import NATIVE_ISA
from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
import edgeq.runtime.native.build as build

HALVES, ADJACENT = 0, 1  # block modes, as in edgeq/csrc/int4mm.h
BLOCK_NS = (32, 64)

SPEC = build.Spec(
    name="native kernel",
    prefix="edgeq_native",
    subdir="native",
    sources=("int4mm_ops.cpp", "int4mm_scalar.cpp", "int4mm_avx2.cpp", "int4mm_avx512.cpp", "int4mm_amx.cpp",
             "attn_ops.cpp", "attn_decode_scalar.cpp", "attn_decode_avx2.cpp", "attn_decode_avx512.cpp",
             "attn_prefill_avx512.cpp", "attn_prefill_avx2.cpp", "decode_ops.cpp", "decode_step.cpp"),
    headers=("int4mm.h", "int4mm_pairs.h", "amx_os.h", "bf16.h", "attn_decode.h", "attn_decode_body.h",
             "attn_decode_tail.h", "attn_simd512.h", "attn_simd256.h", "attn_prefill.h", "decode_core.h", "tensor_bits.h"),
    # -fopenmp: at::parallel_for is header code that is only parallel when compiled with OpenMP (torch's own runtime).
    cflags=("-O3", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-unused-function"),
    ldflags=("-fopenmp",),
    env_isa=NATIVE_ISA,
    isas=("scalar", "avx2", "avx512", "amx"),  # in order of preference, worst first
    feature_bits={"avx2": 1, "avx512": 2, "amx": 4},
    isa_codes={"scalar": 0, "avx2": 1, "avx512": 2, "amx": 3},
    needs=("amx needs the avx512 set plus AMX-TILE/AMX-BF16 granted by Linux, avx512 needs AVX512 F/BW/VL/VBMI/BF16, "
           "avx2 needs AVX2+FMA"),
)
ENV_ISA, ISAS = SPEC.env_isa, SPEC.isas

_state: build.State | None = None  # loaded at first use (build.Library); tests reset it to re-read EDGEQ_NATIVE_ISA
_calls = 0


def _cpu_features() -> int:
    """bit 0: avx2, bit 1: avx512, bit 2: amx (AMX-TILE/BF16 granted by the OS); asked from the library."""
    return int(torch.ops.edgeq.cpu_features())


_LIBRARY = build.Library(SPEC, globals())
available, status, call_count, build_key = _LIBRARY.available, _LIBRARY.status, _LIBRARY.call_count, _LIBRARY.build_key
state = _LIBRARY.state  # the small decode ops (.ops) share this library's state


def reset_call_count() -> None:
    global _calls
    _calls = 0


def count_calls(n: int) -> None:
    """Count ``n`` matrices computed by another op of this library (``decode_layers``: 7 a layer) as kernel calls."""
    global _calls
    _calls += n


def _halves(s: int) -> tuple[int, ...]:
    return tuple(p // 2 + (p % 2) * (s // 2) for p in range(s))


def _adjacent(s: int) -> tuple[int, ...]:
    return tuple(range(s))


@dataclass(frozen=True)
class Plan:
    """How the kernel reads one layout: block_n and the block mode of every block size (full and tails)."""

    block_n: int
    modes: dict  # rows in block -> HALVES | ADJACENT

    @property
    def kernel_args(self) -> tuple[int, int, int]:
        """(block_n, full-block mode, tail modes as a bitmask: bit s/16 set = the s-row tail is ADJACENT)."""
        tails = sum(1 << (s // 16) for s, m in self.modes.items() if s != self.block_n and m == ADJACENT)
        return self.block_n, self.modes[self.block_n], tails


def plan(layout: tinygemm.TinygemmLayout) -> Plan | None:
    """The kernel's reading of ``layout``, or None when the layout is not one the kernel implements.

    Implemented: op = the CPU pack op, block_n in (32, 64), and for the full block and every tail size 16, 32, ...,
    block_n - 16 a measured permutation equal to *halves* or *adjacent* (compared element by element).
    """
    if layout.op != tinygemm.PACK_OP or layout.block_n not in BLOCK_NS:
        return None
    measured = dict(layout.perms)
    modes = {}
    for s in range(tinygemm.ROW_MULTIPLE, layout.block_n + 1, tinygemm.ROW_MULTIPLE):
        perm = tuple(measured.get(s, ()))
        if perm == _halves(s):
            modes[s] = HALVES
        elif perm == _adjacent(s):
            modes[s] = ADJACENT
        else:
            return None
    return Plan(block_n=layout.block_n, modes=modes)


def supports(layout: tinygemm.TinygemmLayout) -> bool:
    """True when the kernel reads ``layout``'s bytes (see :func:`plan`); False means: use the aten op."""
    return plan(layout) is not None


def _plan_for(st: build.State, layout: tinygemm.TinygemmLayout | None) -> Plan:
    layout = tinygemm.probe() if layout is None else layout
    entry = st.memo.get(id(layout))
    if entry is None or entry[0] is not layout:
        p = plan(layout)
        if p is None:
            raise EdgeqError(
                f"native int4_mm: layout {layout.layout_hash[:12]} (block_n={layout.block_n}) is not one the native "
                f"kernel implements (block_n 32/64, halves or adjacent nibble order); use the aten op"
            )
        entry = st.memo[id(layout)] = (layout, p)  # keeps the layout alive so its id stays unique
    return entry[1]


def _kernel_args(st: build.State, layout, isa) -> tuple[int, int, int, int]:
    """(block_n, full mode, tail modes, isa code with ``$EDGEQ_NATIVE_PREFILL``'s tile bits); the default
    (layout=None, isa=None) computed once per state."""
    if layout is None and isa is None:
        args = st.memo.get(None)
        if args is None:
            args = st.memo[None] = _plan_for(st, None).kernel_args + (isa_code(st, None) | _env_tiles() << 4,)
        return args
    return _plan_for(st, layout).kernel_args + (isa_code(st, isa) | _env_tiles() << 4,)


def _ready_args(layout, isa) -> tuple[int, int, int, int]:
    """The op's trailing arguments for this call, or :class:`EdgeqError` when the library does not run here."""
    st = _state or _LIBRARY.load()
    if not st.available:
        raise EdgeqError(f"native int4_mm is not available: {st.reason}")
    return _kernel_args(st, layout, isa)


def isa_code(st: build.State, isa: str | None) -> int:
    """The code of ``isa`` (None: the process's choice) for this library's ops; messages name ``int4_mm``."""
    return build.isa_code(SPEC, st, isa, "int4_mm")


def int4_mm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    group_size: int,
    scales_and_zeros: torch.Tensor,
    *,
    layout: tinygemm.TinygemmLayout | None = None,
    isa: str | None = None,
    prefill: str | None = None,
) -> torch.Tensor:
    """bf16 [M, K] @ dequant(qweight).T -> bf16 [M, N]; the signature of ``aten._weight_int4pack_mm_for_cpu``.

    ``layout`` says how ``qweight`` is packed (default: this machine's :func:`~edgeq.layouts.tinygemm.probe`, which is
    what ``edgeq quantize`` wrote here); ``isa`` overrides the process's ISA choice for one call (tests, benchmarks).
    ``prefill`` picks the avx512 path's tiles for M > 8 for one call: ``"bf16"`` (vdpbf16ps on bf16 pairs) or
    ``"fp32"`` (fp32 FMAs on widened nibbles); None takes the kind measured faster here (:func:`prefill_tiles`).
    ``"narrow"`` makes the avx2 path use its 2-row tiles at every M instead of its 6-row prefill tiles from M = 3
    (to measure one against the other; results are bit-identical).
    Raises :class:`EdgeqError` when the kernel is unavailable, the layout unsupported, or the shapes/dtypes wrong.
    """
    global _calls
    args = _ready_args(layout, isa)
    if prefill is not None:
        code = NARROW if prefill == "narrow" else PREFILL_TILES.get(prefill)
        if code is None:
            raise EdgeqError(f"native int4_mm: prefill={prefill!r} is not one of {', '.join(PREFILL_TILES)}, narrow")
        args = args[:-1] + (args[-1] & 15 | code << 4,)
    try:
        y = _op(x, qweight, group_size, scales_and_zeros, *args)
    except RuntimeError as e:
        raise EdgeqError(f"native int4_mm: {str(e).splitlines()[0]}") from e
    _calls += 1
    return y


def int4_mm_multi(
    x: torch.Tensor,
    weights: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]],
    *,
    layout: tinygemm.TinygemmLayout | None = None,
    isa: str | None = None,
) -> list[torch.Tensor]:
    """Several matrices that read the same decode rows in one call: ``weights`` is a list of ``(qweight, group_size,
    scales_and_zeros, bias or None)``; returns ``[int4_mm(x, W_i) (+ b_i)]``, bf16 [M, N_i] each, new tensors.

    The same bits as :func:`int4_mm` per matrix followed by ``y.add_(bias)`` (edgeq/csrc/int4mm_ops.cpp): one fp32
    copy of x, its group sums once per group size, one parallel region over all row blocks. For the decode loop's
    q/k/v and gate/up (1 <= M <= 2 rows; prefill tiles are not run here). Raises :class:`EdgeqError` as
    :func:`int4_mm` does, and when M is out of range or a bias has the wrong shape."""
    global _calls
    args = _ready_args(layout, isa)
    qws, groups, szs, biases = (list(t) for t in zip(*weights)) if weights else ([], [], [], [])
    try:
        ys = _multi_op(x, qws, groups, szs, biases, *args)
    except RuntimeError as e:
        raise EdgeqError(f"native int4_mm_multi: {str(e).splitlines()[0]}") from e
    _calls += len(ys)
    return ys


PREFILL_TILES = {"bf16": 1, "fp32": 2}  # the op's isa bits 4-5 (edgeq/csrc/int4mm_ops.cpp)
NARROW = 3  # bits 4-5 = 3: the avx2 path's 2-row tiles at every M (``prefill="narrow"``: measurements and tests only)


def _env_tiles() -> int:
    """``$EDGEQ_NATIVE_PREFILL`` as the op's tile code: 0 for auto (the op's measurement), else bf16 1 / fp32 2;
    another value is an :class:`EdgeqError` naming the variable."""
    picked, _ = env.choice(None, "prefill", env.NATIVE_PREFILL, ("auto", *PREFILL_TILES))
    return PREFILL_TILES.get(picked, 0)


def prefill_tiles() -> str | None:
    """The avx512 path's tiles for M > 8 in this process: ``"bf16"`` or ``"fp32"``, as ``$EDGEQ_NATIVE_PREFILL``
    forces, else whichever multiplied faster in the op's one-time measurement (edgeq/csrc/int4mm_ops.cpp,
    ``prefill_choice``); None without that path."""
    st = _state or _LIBRARY.load()
    if not st.available or "avx512" not in st.cpu_isas:
        return None
    code = _env_tiles() or int(torch.ops.edgeq.prefill_choice())
    return {v: k for k, v in PREFILL_TILES.items()}.get(code)


def _op(*args):
    """torch.ops.edgeq.int4_mm.default, looked up once (the OpOverload call is the cheapest way in)."""
    global _op
    _op = torch.ops.edgeq.int4_mm.default
    return _op(*args)


def _multi_op(*args):
    """torch.ops.edgeq.int4_mm_multi.default, looked up once."""
    global _multi_op
    _multi_op = torch.ops.edgeq.int4_mm_multi.default
    return _multi_op(*args)
