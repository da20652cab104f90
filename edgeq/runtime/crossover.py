"""The prefill crossover: the smallest M at which dequantise-then-GEMM beats the int4 kernel, measured here.

The kernel's time grows with M (it re-dequantises every weight for every row block of x); the dequant path pays
one dequantisation per call plus a bf16 GEMM that is cheap per row. Both are modelled as ``t(M) = a + b * M`` from
two timed sizes (median of 3 each), and the crossover is where the lines meet, clamped to [2, 1024]. A crossover
beyond the larger timed size is an extrapolation, and the kernel's cost per row falls as M grows (it tiles x), so
it is checked where it is claimed: both paths are timed at that M, and while the kernel still wins there M doubles
(measured on a Zen 4, Qwen2.5-1.5B's 8960 x 1536: the lines met at 444, where the kernel was still faster); a kernel
that still wins at 1024 runs every prefill (NEVER). The result is
cached per machine and shape class in ``$EDGEQ_CACHE_DIR`` (default ``~/.cache/edgeq``)/crossover.json, keyed by
torch version, CPU capability, thread count, kernel path (for the native kernel: its build, ISA path and prefill
tiles) and (N, K, G) of the probed layer.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from edgeq.env import cache_dir

M_SMALL, M_LARGE = 8, 64
LOW, HIGH = 2, 1024
NEVER = 1 << 30  # the dequantise path is slower at every M: the kernel runs every prefill (e.g. AVX2-only CPUs)


def describe(m: int) -> str:
    """``M >= 512`` for a crossover, ``never`` for :data:`NEVER` (how settings and reports print it)."""
    return "never" if m >= NEVER else f"M >= {m}"


def phrase(m: int | None) -> str:
    """The crossover as reports print it after the prefill path's name: ``at M >= 512``, ``never (the kernel runs
    every prefill)``, or ``""`` for a runtime with one path (``None``)."""
    if m is None:
        return ""
    return "never (the kernel runs every prefill)" if m >= NEVER else f"at {describe(m)}"


def cache_capability() -> str:
    """The CPU capability as the crossover cache key spells it: ``$ATEN_CPU_CAPABILITY`` exactly as set (``avx2``),
    else torch's spelling (``AVX512``). Not torch's value alone (which would spell the first ``AVX2``): caches are
    keyed by this spelling, and another one would re-measure every cached crossover."""
    return os.environ.get("ATEN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability()


KEY_VERSION = "v5"  # v2: extrapolated crossovers are checked; v3: keyed by the native kernel's build, ISA and tiles;
# v4: NEVER where the kernel wins per row and at M = 0 (v3 cached HIGH there); v5: NEVER where it still wins at HIGH


def _kernel(path: str) -> str:
    """What the kernel path runs: for the native kernel its build (a new source, a new crossover), ISA path and
    prefill tiles (``EDGEQ_NATIVE_ISA`` and the measured tile kind change its time per row); else torch's op."""
    if not path.startswith("native"):
        return "aten"
    from edgeq.runtime import native  # noqa: PLC0415 - only where the native path runs

    return f"{native.build_key()[:16]}:{native.status()['isa']}:{native.prefill_tiles()}"


def _key(layer, path: str) -> str:
    return "|".join([KEY_VERSION, torch.__version__, cache_capability(), f"threads={torch.get_num_threads()}", path,
                     _kernel(path), f"N={layer.out_features}", f"K={layer.in_features}", f"G={layer.group_size}"])


def _time(fn, reps: int = 3) -> float:
    fn()  # warm-up: first calls allocate
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def solve(time_at) -> int:
    """The crossover M from ``time_at(path, M) -> seconds`` (path "kernel" or "dequant"): where the two lines through
    M_SMALL and M_LARGE meet, then, if that is beyond M_LARGE, doubled while the kernel is still faster there.

    E.g. kernel 0.10 ms + 0.050 ms/row, dequant path 1.00 ms + 0.010 ms/row: the lines meet at
    M = (1.00 - 0.10) / (0.050 - 0.010) = 22.5, rounded to 22 (then clamped to [2, 1024]); had they met at 444 with
    the kernel still faster at M = 444 but not at 888, the answer would be 888."""
    lines = []
    for path in ("kernel", "dequant"):
        t_small, t_large = time_at(path, M_SMALL), time_at(path, M_LARGE)
        slope = max((t_large - t_small) / (M_LARGE - M_SMALL), 1e-12)
        lines.append((t_small - slope * M_SMALL, slope))
    (ka, kb), (da, db) = lines
    if kb <= db:  # the kernel is never slower per row: it wins at every M when it also wins at M = 0
        # (on an AVX2-only Zen 3 the bf16 GEMM behind the dequantise path was ~100x the kernel's time at M = 512;
        # HIGH here once sent every prompt of 1024+ tokens down that path)
        return NEVER if ka <= da else HIGH
    m = int(min(HIGH, max(LOW, round((da - ka) / (kb - db)))))
    while M_LARGE < m < HIGH and time_at("kernel", m) < time_at("dequant", m):
        m = min(HIGH, 2 * m)
    if m == HIGH and time_at("kernel", HIGH) < time_at("dequant", HIGH):
        # the kernel still wins at the largest M probed: HIGH would send long prompts to the slower path (AMX's
        # folded prefill, 2026-12-05: the kernel 1.11x the dequantise path's speed on a 2048-token prompt)
        return NEVER
    return m


def measure(layer) -> int:
    """Time both paths of one Int4Linear (:func:`solve`); return the crossover M."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(HIGH, layer.in_features, generator=gen).to(torch.bfloat16)
    paths = {"kernel": layer.forward_kernel, "dequant": layer.forward_dequant}
    return solve(lambda path, m: _time(lambda: paths[path](x[:m].contiguous())))


def crossover(layer, path: str) -> tuple[int, str]:
    """Return (crossover M, "cached" | "measured"); counters touched by the probe are the caller's to reset."""
    key = _key(layer, path)
    file = cache_dir() / "crossover.json"
    try:
        table = json.loads(file.read_text())
    except (OSError, ValueError):
        table = {}
    if isinstance(table.get(key), int):
        return table[key], "cached"
    m = measure(layer)
    table[key] = m
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(file)
    except OSError:
        pass  # a read-only home only costs a re-measure next time
    return m, "measured"
