"""The native CPU W4A16 decode kernel: build at first use, load, choose the ISA path, call.

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

- ``avx512``: AVX512 F/BW/VL/VBMI/BF16 (Sapphire Rapids, Zen 4). Weights become bf16 ``1 + q/16`` (exact) and are
  multiplied with the bf16 activations by ``vdpbf16ps`` into fp32 accumulators: exact products, fp32 sums. The
  activations are never quantised.
- ``avx2``: AVX2 + FMA: q converted to fp32, fp32 FMA with the fp32 activations.
- ``scalar``: portable C++, any supported block; also the path for blocks the SIMD paths do not specialise (tails,
  adjacent full blocks).

``EDGEQ_NATIVE_ISA=avx512|avx2|scalar`` forces a path (an :class:`EdgeqError` if the CPU lacks it), ``off`` disables the
native kernel, unset or ``auto`` picks the best. ``EDGEQ_CACHE_DIR`` (default ``~/.cache/edgeq``) holds the build, keyed
by a hash of the sources, compile flags and the torch version.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm

ENV_ISA = "EDGEQ_NATIVE_ISA"
ENV_CACHE = "EDGEQ_CACHE_DIR"
ISAS = ("scalar", "avx2", "avx512", "amx")  # in order of preference, worst first
_ISA_CODE = {"scalar": 0, "avx2": 1, "avx512": 2, "amx": 3}
_FEATURE_BIT = {"avx2": 1, "avx512": 2, "amx": 4}
HALVES, ADJACENT = 0, 1  # block modes, as in edgeq/csrc/int4mm.h
BLOCK_NS = (32, 64)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = ("int4mm_ops.cpp", "int4mm_scalar.cpp", "int4mm_avx2.cpp", "int4mm_avx512.cpp", "int4mm_amx.cpp",
            "attn_ops.cpp", "attn_decode_scalar.cpp", "attn_decode_avx2.cpp", "attn_decode_avx512.cpp", "decode_ops.cpp")
_HEADERS = ("int4mm.h", "int4mm_pairs.h", "amx_os.h", "bf16.h", "attn_decode.h", "attn_decode_body.h")
# -fopenmp: at::parallel_for is header code that is only parallel when compiled with OpenMP (torch's own runtime).
_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-unused-function")
_LDFLAGS = ("-fopenmp",)


@dataclass
class _State:
    available: bool = False
    isa: str | None = None
    reason: str = "not loaded yet"
    user_error: bool = False  # the reason is a bad EDGEQ_NATIVE_ISA: calls raise instead of falling back quietly
    build_seconds: float | None = None
    built_now: bool = False
    library: str | None = None
    cpu_isas: tuple[str, ...] = ()
    forced: str | None = None
    plans: dict = field(default_factory=dict)
    default_args: tuple | None = None  # (block_n, full_mode, tail_modes, isa code) for layout=None, isa=None


_lock = threading.Lock()
_state: _State | None = None
_calls = 0
_loaded_library: str | None = None  # a process can hold one build: a second TORCH_LIBRARY(edgeq) would abort it


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "edgeq")


def source_key(csrc: Path, sources: tuple[str, ...], cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """sha256 over the given sources (and headers), flags, torch version and Python ABI: a new key, a new build.
    Shared by both native kernels (this one and edgeq.runtime.native_w4a8)."""
    h = hashlib.sha256()
    for name in sources:
        h.update(name.encode() + b"\0" + (csrc / name).read_bytes() + b"\0")
    h.update(" ".join(cflags + ldflags).encode())
    h.update(f"{torch.__version__}|{sys.implementation.cache_tag}|{platform.machine()}".encode())
    return h.hexdigest()


def build_or_load(prefix: str, subdir: str, key: str, sources: list[str], cflags: tuple[str, ...],
                  ldflags: tuple[str, ...]) -> tuple[str, bool]:
    """Load ``$EDGEQ_CACHE_DIR/<subdir>/<key[:16]>/<prefix>_<key[:16]>.so``, compiling it first when it is not there
    (an ``ok`` marker is written after a successful build); returns (library path, built now). Raises on any
    failure. Shared by both native kernels."""
    from torch.utils import cpp_extension  # imported lazily: it pulls in setuptools

    name = f"{prefix}_{key[:16]}"
    build_dir = cache_dir() / subdir / key[:16]
    lib, done = build_dir / f"{name}.so", build_dir / "ok"
    if done.exists() and lib.exists():
        torch.ops.load_library(str(lib))
        return str(lib), False
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=name, sources=sources, extra_cflags=list(cflags),  # copies: load() appends to them
                       extra_ldflags=list(ldflags), build_directory=str(build_dir), is_python_module=False,
                       verbose=False)
    done.write_text(f"{torch.__version__}\n")
    return str(lib), True


def build_key() -> str:
    """This kernel's :func:`source_key`."""
    return source_key(_CSRC, _SOURCES + _HEADERS, _CFLAGS, _LDFLAGS)


def _compile(key: str) -> tuple[str, bool]:
    """Build (or reuse) the extension; returns (library path, built_now). Raises on any failure."""
    global _loaded_library
    if _loaded_library is not None:  # one build per process: a second TORCH_LIBRARY(edgeq) would abort it
        return _loaded_library, False
    _loaded_library, built = build_or_load("edgeq_native", "native", key, [str(_CSRC / s) for s in _SOURCES],
                                           _CFLAGS, _LDFLAGS)
    return _loaded_library, built


def _short(err: BaseException, lines: int = 6) -> str:
    """The compiler's own complaint (``error:``, ``not found`` ...), not ninja's command lines."""
    text = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    keys = ("error", "not found", "no such file", "fatal", "permission denied", "undefined")
    noise = ("ninja:", "FAILED:", "[")
    hits = [ln for ln in text if any(k in ln.lower() for k in keys) and not ln.startswith(noise) and " -c " not in ln]
    hits = list(dict.fromkeys(hits))  # each compile step repeats the same complaint
    head = text[0].split(":")[0] if text else type(err).__name__  # e.g. "Error building extension 'edgeq_native_...'"
    return (head + ": " + " | ".join(hits[:lines]))[:2000] if hits else (text[0] if text else type(err).__name__)[:2000]


def _features_to_isas(bits: int) -> tuple[str, ...]:
    return ("scalar",) + tuple(isa for isa, bit in _FEATURE_BIT.items() if bits & bit)


def _lacks_message(forced: str, has: tuple[str, ...]) -> str:
    return (
        f"{ENV_ISA}={forced} but this CPU lacks it (has {', '.join(has)}; amx needs the avx512 set plus AMX-TILE/"
        f"AMX-BF16 granted by Linux, avx512 needs AVX512 F/BW/VL/VBMI/BF16, avx2 needs AVX2+FMA); unset it or choose "
        f"one of those"
    )


def isa_request(env: str, isas: tuple[str, ...], what: str) -> tuple[str, str | None, bool]:
    """Read ``env`` (an ISA of ``isas``, ``off`` or ``auto``; unset is auto): (request, why the kernel cannot run here
    or None, whether that reason is the user's error). Shared by both native kernels."""
    forced = (os.environ.get(env) or "auto").strip().lower()
    if forced not in isas + ("auto", "off"):
        return forced, f"{env}={forced!r} is not one of {', '.join(isas[::-1])}, off, auto; fix or unset it", True
    if forced == "off":
        return forced, f"disabled by {env}=off", False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return forced, f"{what} is x86-64 only (this is {platform.machine()})", False
    return forced, None, False


def _load() -> _State:
    """Read EDGEQ_NATIVE_ISA, build or load the library, pick the ISA: once per process (tests may reset _state)."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        st = _State()
        forced, why_not, st.user_error = isa_request(ENV_ISA, ISAS, "the native kernel")
        st.forced = None if forced == "auto" else forced
        if why_not is not None:
            st.reason = why_not
        else:
            _build_and_choose(st, forced)
        _state = st
        return st


def _build_and_choose(st: _State, forced: str) -> None:
    t0 = time.perf_counter()
    try:
        st.library, st.built_now = _compile(build_key())
        st.cpu_isas = _features_to_isas(int(torch.ops.edgeq.cpu_features()))
    except Exception as e:  # noqa: BLE001 - any build/load failure means: use aten, and say why
        st.reason = f"native kernel build/load failed: {_short(e)}"
        return
    st.build_seconds = round(time.perf_counter() - t0, 3)
    if forced != "auto" and forced not in st.cpu_isas:
        st.reason, st.user_error = _lacks_message(forced, st.cpu_isas), True
        return
    st.isa = st.cpu_isas[-1] if forced == "auto" else forced
    st.available = True
    st.reason = "ok" if forced == "auto" else f"forced by {ENV_ISA}={forced}"


def _raise_if_user_error(st: _State) -> None:
    if st.user_error:
        raise EdgeqError(st.reason)


def available() -> bool:
    """True when the kernel is built and usable here.

    A bad ``EDGEQ_NATIVE_ISA`` raises :class:`EdgeqError` (a user error, not a reason to fall back quietly)."""
    st = _load()
    _raise_if_user_error(st)
    return st.available


def status() -> dict:
    """What runs and why: {available, isa, reason, build_seconds, built_now, library, cpu_isas, forced, calls}.

    ``build_seconds`` is the time spent compiling (``built_now`` True) or loading the cached library.
    """
    st = _load()
    return {
        "available": st.available,
        "isa": st.isa,
        "reason": st.reason,
        "build_seconds": st.build_seconds,
        "built_now": st.built_now,
        "library": st.library,
        "cpu_isas": list(st.cpu_isas),
        "forced": st.forced,
        "calls": _calls,
    }


def call_count() -> int:
    """Number of successful :func:`int4_mm` calls in this process (the runtime and benchmarks read it)."""
    return _calls


def reset_call_count() -> None:
    global _calls
    _calls = 0


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


def _plan_for(st: _State, layout: tinygemm.TinygemmLayout | None) -> Plan:
    layout = tinygemm.probe() if layout is None else layout
    entry = st.plans.get(id(layout))
    if entry is None or entry[0] is not layout:
        p = plan(layout)
        if p is None:
            raise EdgeqError(
                f"native int4_mm: layout {layout.layout_hash[:12]} (block_n={layout.block_n}) is not one the native "
                f"kernel implements (block_n 32/64, halves or adjacent nibble order); use the aten op"
            )
        entry = st.plans[id(layout)] = (layout, p)  # keeps the layout alive so its id stays unique
    return entry[1]


def _kernel_args(st: _State, layout, isa) -> tuple[int, int, int, int]:
    if layout is None and isa is None:
        if st.default_args is None:
            st.default_args = _plan_for(st, None).kernel_args + (_isa_code(st, None),)
        return st.default_args
    return _plan_for(st, layout).kernel_args + (_isa_code(st, isa),)


def _isa_code(st: _State, isa: str | None) -> int:
    if isa is None:
        return _ISA_CODE[st.isa]
    if isa not in st.cpu_isas:
        raise EdgeqError(f"native int4_mm: isa {isa!r} is not one this CPU runs ({', '.join(st.cpu_isas)})")
    return _ISA_CODE[isa]


def int4_mm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    group_size: int,
    scales_and_zeros: torch.Tensor,
    *,
    layout: tinygemm.TinygemmLayout | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """bf16 [M, K] @ dequant(qweight).T -> bf16 [M, N]; the signature of ``aten._weight_int4pack_mm_for_cpu``.

    ``layout`` says how ``qweight`` is packed (default: this machine's :func:`~edgeq.layouts.tinygemm.probe`, which is
    what ``edgeq quantize`` wrote here); ``isa`` overrides the process's ISA choice for one call (tests, benchmarks).
    Raises :class:`EdgeqError` when the kernel is unavailable, the layout unsupported, or the shapes/dtypes wrong.
    """
    global _calls
    st = _state or _load()
    if not st.available:
        raise EdgeqError(f"native int4_mm is not available: {st.reason}")
    args = _kernel_args(st, layout, isa)
    try:
        y = _op(x, qweight, group_size, scales_and_zeros, *args)
    except RuntimeError as e:
        raise EdgeqError(f"native int4_mm: {str(e).splitlines()[0]}") from e
    _calls += 1
    return y


def _op(*args):
    """torch.ops.edgeq.int4_mm.default, looked up once (the OpOverload call is the cheapest way in)."""
    global _op
    _op = torch.ops.edgeq.int4_mm.default
    return _op(*args)


def decode_attn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, end: int, scale: float,
                out: torch.Tensor, *, isa: str | None = None) -> None:
    """Single-query attention over the KV cache into ``out`` (bf16 [H, D]); the same library as :func:`int4_mm`.

    ``q`` bf16 [H, D], ``keys``/``values`` the cache's bf16 [1, KVH, CAP, D] buffers read in place over positions
    ``[start, end)``; query head h attends with kv head ``h // (H // KVH)`` (GQA). fp32 scores, softmax and sums,
    one rounding to bf16 (edgeq/csrc/attn_decode.h has the formula and a worked example). The ISA is the process's
    choice for :func:`int4_mm` (``EDGEQ_NATIVE_ISA``) unless ``isa`` names one for this call (tests). Raises
    :class:`EdgeqError` when the library is unavailable or the arguments are wrong.
    """
    st = _state or _load()
    isa_code = _isa_code(st, isa) if st.available else 0  # unavailable: _small_op raises with the reason
    _small_op("decode_attn", q, keys, values, start, end, scale, out, isa_code)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    """``x += delta`` (when given, bf16, in place), then ``out = weight * bf16(x * rsqrt(mean(x^2) + eps))`` per row:
    transformers' RMSNorm in one call (edgeq/csrc/decode_ops.cpp has the roundings). Raises :class:`EdgeqError`."""
    _small_op("add_rms_norm", x, delta, weight, eps, out)


def rope_to_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, nsin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, pos: int, rot_q: torch.Tensor) -> None:
    """RoPE of one token's q and k (transformers' roundings, bit for bit) into ``rot_q`` and the cache at ``pos``,
    and v into the cache: edgeq/csrc/decode_ops.cpp. Raises :class:`EdgeqError`."""
    _small_op("rope_to_cache", q, k, v, cos, nsin, keys, values, pos, rot_q)


_SMALL_OPS: dict = {}


def _small_op(name: str, *args) -> None:
    """Call ``torch.ops.edgeq.<name>`` (looked up once) when the library is available here (checked every call, as
    :func:`int4_mm` does), with its argument errors as :class:`EdgeqError`."""
    st = _state or _load()
    if not st.available:
        raise EdgeqError(f"native {name} is not available: {st.reason}")
    op = _SMALL_OPS.get(name) or _SMALL_OPS.setdefault(name, getattr(torch.ops.edgeq, name).default)
    try:
        op(*args)
    except RuntimeError as e:
        raise EdgeqError(f"native {name}: {str(e).splitlines()[0]}") from e


def native_command(as_json: bool = False) -> None:
    """`edgeq native`: build the native kernel if needed and say whether it runs here, which ISA path, and why.

    Exit status 0 whether or not the kernel is available (the runtime then uses aten); an invalid
    ``EDGEQ_NATIVE_ISA`` is an :class:`EdgeqError` (exit 2).
    """
    from edgeq.console import emit, line  # noqa: PLC0415
    from edgeq.runtime import native_w4a8  # noqa: PLC0415 - the W4A8 kernel is built and reported here too

    st = status()
    if _state is not None and _state.user_error:
        raise EdgeqError(st["reason"])
    native_w4a8.available()  # builds it if needed; an invalid EDGEQ_W4A8_ISA raises (exit 2)
    w8 = native_w4a8.status()
    if as_json:
        emit({**st, "w4a8": w8}, as_json=True)
        return
    if st["available"]:
        secs = st["build_seconds"]
        built = f"built in {secs} s" if st["built_now"] else f"loaded in {secs} s (cached)"
        line(f"native kernel: available, isa {st['isa']} ({st['reason']}); CPU paths: {', '.join(st['cpu_isas'])}")
        line(f"  {built}: {st['library']}")
    else:
        line(f"native kernel: not available ({st['reason']}); decode uses aten._weight_int4pack_mm_for_cpu")
    if w8["available"]:
        line(f"native W4A8 kernel: available, isa {w8['isa']} ({w8['reason']}); CPU paths: {', '.join(w8['cpu_isas'])}")
    else:
        line(f"native W4A8 kernel: not available ({w8['reason']}); W4A8 runs the portable path")
