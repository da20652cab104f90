"""Build, cache and load one native library, and pick its ISA path: the state machine both native kernels share.

A :class:`Spec` names what to compile (sources in ``edgeq/csrc/``, flags), where its build is cached and which
environment variable picks its ISA path. :func:`load` turns a spec into a :class:`State` once per process:

1. read the spec's variable (``EDGEQ_NATIVE_ISA`` / ``EDGEQ_W4A8_ISA``): an ISA of ``spec.isas``, ``off`` or
   ``auto`` (unset). An unknown value is the user's error (``State.user_error``: calls raise it, never fall back
   quietly); ``off``, or a machine that is not x86-64, leaves the kernel off with that reason;
2. build (or load the cached build of) the library with ``torch.utils.cpp_extension`` into
   ``$EDGEQ_CACHE_DIR`` (default ``~/.cache/edgeq``)``/<spec.subdir>/<key[:16]>/``, key = sha256 of the sources,
   headers, flags, torch version and Python ABI (:func:`source_key`): a new key, a new build. Any failure leaves the
   kernel off with the compiler's own complaint (:func:`short`);
3. ask the library's compiled ``cpu_features`` op which paths this CPU runs (CPUID plus the Linux AMX permission,
   which no file shows: the one CPU question that does not go through :mod:`edgeq.cpu`);
4. choose: the forced path when the CPU has it (else a user error naming what each path needs), or the best one.

A process holds one build per library (a second ``TORCH_LIBRARY`` of the same namespace would abort it), so a
reloaded state reuses the library already loaded, whatever the cache directory says by then.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from edgeq import env
from edgeq.env import cache_dir as _cache_dir
from edgeq.errors import EdgeqError

CSRC = Path(__file__).resolve().parents[2] / "csrc"  # edgeq/csrc

LOCK = threading.Lock()  # held while a kernel loads its state
_LOADED: dict[str, str] = {}  # library prefix -> the path loaded in this process (one build per process)


@dataclass(frozen=True)
class Spec:
    """One native library: its sources, build flags, cache place, ISA variable and ISA paths.

    ``isas`` are worst first; ``feature_bits`` map each path above ``scalar`` to its bit in the library's
    ``cpu_features()``, ``isa_codes`` each path to the code its ops take. ``name`` is how messages call the kernel
    ("native kernel"), ``needs`` what each path needs of the CPU (said when a forced path is missing).
    ``scalar_only``: with ``auto`` on a CPU that runs only the scalar code, leave the kernel off with this reason
    (None: the scalar code runs).
    """

    name: str
    prefix: str  # the library file: <prefix>_<key[:16]>.so
    subdir: str  # the cache directory under $EDGEQ_CACHE_DIR
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    env_isa: str
    isas: tuple[str, ...]
    feature_bits: dict = field(hash=False)
    isa_codes: dict = field(hash=False)
    needs: str = ""
    scalar_only: str | None = None

    def key(self) -> str:
        """This library's :func:`source_key`."""
        return source_key(CSRC, self.sources + self.headers, self.cflags, self.ldflags)

    def isas_from_bits(self, bits: int) -> tuple[str, ...]:
        """The paths a ``cpu_features()`` bit set runs, worst first: scalar always, then each path whose bit is set."""
        return ("scalar",) + tuple(isa for isa in self.isas[1:] if bits & self.feature_bits[isa])


@dataclass
class State:
    """What loading one library found (:func:`load`); ``memo`` holds a kernel's lookups that live as long as the
    state (the W4A16 kernel's layout plans), so a reset state forgets them too."""

    available: bool = False
    isa: str | None = None
    reason: str = "not loaded yet"
    user_error: bool = False  # the reason is a bad ISA variable: calls raise instead of falling back quietly
    build_seconds: float | None = None
    built_now: bool = False
    library: str | None = None
    cpu_isas: tuple[str, ...] = ()
    forced: str | None = None
    memo: dict = field(default_factory=dict)

    def as_dict(self, calls: int) -> dict:
        """{available, isa, reason, build_seconds, built_now, library, cpu_isas, forced, calls}: a kernel's status()."""
        return {"available": self.available, "isa": self.isa, "reason": self.reason,
                "build_seconds": self.build_seconds, "built_now": self.built_now, "library": self.library,
                "cpu_isas": list(self.cpu_isas), "forced": self.forced, "calls": calls}


def cache_dir() -> Path:
    """``$EDGEQ_CACHE_DIR``, default ``~/.cache/edgeq`` (:func:`edgeq.env.cache_dir`), read at every build."""
    return _cache_dir()


def source_key(csrc: Path, sources: tuple[str, ...], cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """sha256 over the given sources (and headers), flags, torch version and Python ABI: a new key, a new build."""
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
    failure."""
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


def compile_library(spec: Spec) -> tuple[str, bool]:
    """Build (or reuse) ``spec``'s library; returns (library path, built now). Once loaded in this process, the
    same path again (not built now). Raises on any failure."""
    if spec.prefix in _LOADED:
        return _LOADED[spec.prefix], False
    lib, built = build_or_load(spec.prefix, spec.subdir, spec.key(), [str(CSRC / s) for s in spec.sources],
                               spec.cflags, spec.ldflags)
    _LOADED[spec.prefix] = lib
    return lib, built


def short(err: BaseException, lines: int = 6) -> str:
    """The compiler's own complaint (``error:``, ``not found`` ...), not ninja's command lines."""
    text = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    keys = ("error", "not found", "no such file", "fatal", "permission denied", "undefined")
    noise = ("ninja:", "FAILED:", "[")
    hits = [ln for ln in text if any(k in ln.lower() for k in keys) and not ln.startswith(noise) and " -c " not in ln]
    hits = list(dict.fromkeys(hits))  # each compile step repeats the same complaint
    head = text[0].split(":")[0] if text else type(err).__name__  # e.g. "Error building extension 'edgeq_native_...'"
    return (head + ": " + " | ".join(hits[:lines]))[:2000] if hits else (text[0] if text else type(err).__name__)[:2000]


def isa_request(var: str, isas: tuple[str, ...], what: str) -> tuple[str, str | None, bool]:
    """Read ``$var`` (an ISA of ``isas``, ``off`` or ``auto``; unset is auto): (request, why the kernel cannot run here
    or None, whether that reason is the user's error). Read here, not through :func:`edgeq.env.choice`: a bad value
    is recorded for the kernel's calls to raise, with its own message."""
    forced = env.raw(var, "auto").lower()
    if forced not in isas + ("auto", "off"):
        return forced, f"{var}={forced!r} is not one of {', '.join(isas[::-1])}, off, auto; fix or unset it", True
    if forced == "off":
        return forced, f"disabled by {var}=off", False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return forced, f"{what} is x86-64 only (this is {platform.machine()})", False
    return forced, None, False


def load(spec: Spec, cpu_isas: Callable[[], tuple[str, ...]]) -> State:
    """Steps 1-4 of the module docstring for ``spec``; ``cpu_isas`` asks the loaded library which paths the CPU runs.
    Never raises: a user error is recorded in the state (``user_error``) for the kernel's calls to raise."""
    st = State()
    forced, why_not, st.user_error = isa_request(spec.env_isa, spec.isas, f"the {spec.name}")
    st.forced = None if forced == "auto" else forced
    if why_not is not None:
        st.reason = why_not
        return st
    t0 = time.perf_counter()
    try:
        st.library, st.built_now = compile_library(spec)
        st.cpu_isas = cpu_isas()
    except Exception as e:  # noqa: BLE001 - any build/load failure: the fallback path runs, and says why
        st.reason = f"{spec.name} build/load failed: {short(e)}"
        return st
    st.build_seconds = round(time.perf_counter() - t0, 3)
    _choose(spec, st, forced)
    return st


def _choose(spec: Spec, st: State, forced: str) -> None:
    if forced != "auto" and forced not in st.cpu_isas:
        st.user_error = True
        st.reason = (f"{spec.env_isa}={forced} but this CPU lacks it (has {', '.join(st.cpu_isas)}; {spec.needs}); "
                     "unset it or choose one of those")
    elif forced == "auto" and st.cpu_isas == ("scalar",) and spec.scalar_only:
        st.reason = spec.scalar_only
    else:
        st.isa = st.cpu_isas[-1] if forced == "auto" else forced
        st.available = True
        st.reason = "ok" if forced == "auto" else f"forced by {spec.env_isa}={forced}"


class Library:
    """A kernel module's library in this process: loaded once (:func:`load`), reported, its calls counted.

    The state lives in the kernel module's own globals ``ns``: ``_state`` (None until the first use) and ``_calls``,
    so the kernel's hot path reads them as plain globals, and setting ``module._state = None`` (tests, after changing
    the ISA variable) makes the next use load again (the library itself stays loaded: :func:`compile_library`). The
    CPU's paths come from the module's ``_cpu_features()`` (the library's bits; tests replace it to simulate a CPU).
    """

    def __init__(self, spec: Spec, ns: dict):
        self.spec, self._ns = spec, ns

    def load(self) -> State:
        """The module's state, loading it first when it is None (under :data:`LOCK`: one load at a time)."""
        with LOCK:
            if self._ns["_state"] is None:
                self._ns["_state"] = load(self.spec, lambda: self.spec.isas_from_bits(self._ns["_cpu_features"]()))
            return self._ns["_state"]

    def state(self) -> State:
        """The loaded state (loaded at first use)."""
        return self._ns["_state"] or self.load()

    def available(self) -> bool:
        """True when the kernel is built and usable here.

        A bad ISA variable raises :class:`EdgeqError` (a user error, not a reason to fall back quietly)."""
        st = self.load()
        if st.user_error:
            raise EdgeqError(st.reason)
        return st.available

    def status(self) -> dict:
        """What runs and why: {available, isa, reason, build_seconds, built_now, library, cpu_isas, forced, calls}.

        ``build_seconds`` is the time spent compiling (``built_now`` True) or loading the cached library."""
        return self.load().as_dict(self._ns["_calls"])

    def call_count(self) -> int:
        """Number of successful kernel calls in this process (the runtime and benchmarks read it)."""
        return self._ns["_calls"]

    def build_key(self) -> str:
        """sha256 over the kernel's sources, flags, torch version and Python ABI (:func:`source_key`)."""
        return self.spec.key()


def isa_code(spec: Spec, st: State, isa: str | None, op: str) -> int:
    """The code ``op`` takes for ``isa`` (None: the process's choice); an ISA this CPU does not run is an error."""
    if isa is None:
        return spec.isa_codes[st.isa]
    if isa not in st.cpu_isas:
        raise EdgeqError(f"native {op}: isa {isa!r} is not one this CPU runs ({', '.join(st.cpu_isas)})")
    return spec.isa_codes[isa]
