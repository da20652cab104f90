"""``edgeq route``: on this machine, which 4-bit kernels exist, how fast each runs, and which scheme to quantise to.

1. **Device class** (:func:`device_class`, a pure function of the CPU flags and torch's capability), the highest
   rung of ``AMX > AVX512-VNNI > AVX512 > AVX2 > other`` that the flags give, capped by what torch dispatches its
   own kernels to (``torch.backends.cpu.get_cpu_capability()``: AVX2 caps at AVX2, DEFAULT at other). Rules:
   AMX = ``amx_tile`` + ``amx_int8`` + ``avx512f``; AVX512-VNNI = ``avx512_vnni`` + ``avx512f``; AVX512 =
   ``avx512f`` + ``avx512bw`` + ``avx512vl``; AVX2 = ``avx2`` + ``fma``. Worked example: this project's
   Sapphire Rapids (amx_tile, amx_int8, avx512_vnni, avx512f/bw/vl, avx2, fma) with torch capability AVX512 is
   ``AMX``; the same flags with ``ATEN_CPU_CAPABILITY=avx2`` are ``AVX2``.
2. **Kernels** available: the tinygemm aten op (W4A16 decode), edgeq's native kernel
   (``edgeq.runtime.native.status()``), the runtime's dequantise + bf16 GEMM prefill path, the W4A8 portable path
   (always) and a compiled W4A8 ``int4_scaled_mm_cpu`` (only when importable and bit-equal to the portable path on
   the load-time probe), plus bf16 ``F.linear`` as the reference.
3. **Measurement**: on representative shapes (default 1536 x 1536 and 8960 x 1536, N x K, G = 128: Qwen2.5-1.5B's
   attention and MLP), decode M = 1 (mean of ``decode_calls`` calls) and prefill M = 512 (one call), every
   available arm interleaved within each pass, median of ``passes`` (>= 3) passes, min-max spread kept, at the
   current thread count.
4. **Choice**: per scheme, the runtime's own path: W4A16 decodes on the native kernel when available, else
   tinygemm, and prefills on whichever of its kernel and the dequant path is faster at M = 512 (the runtime
   measures that crossover at load); W4A8 runs its one path for every M. The cost of a scheme is the modelled
   request ``sum over shapes of (t_prefill(512) + 128 * t_decode(1))``; the cheapest wins. Nothing is assumed from
   a table: a machine where the W4A8 path is faster gets w4a8.
5. **Cache**: ``$EDGEQ_CACHE_DIR`` (default ``~/.cache/edgeq``)/route.json, keyed by a hash of the CPU flags, the
   torch version, the edgeq version and the thread count; ``--refresh`` measures again.

Where each part lives: :mod:`edgeq.route.device` (1), :mod:`edgeq.route.timing` (2, 3), :mod:`edgeq.route.choice`
(4, and the workload), :mod:`edgeq.route.cache_file` (5), :mod:`edgeq.route.records` (the report),
:mod:`edgeq.route.tables` (its tables). This module puts them together (:func:`route`); the command is
edgeq/cli/route.py.
"""

from __future__ import annotations

import time
from typing import Optional

from edgeq.env import cache_dir
from edgeq.keys import VERSION
from edgeq.route.cache_file import CACHE_FILE, cache_key, read_cache, write_cache
from edgeq.route.choice import DECODE_TOKENS, GROUP_SIZE, PREFILL_M, SHAPES, choose
from edgeq.route.device import CLASSES, RELEVANT_FLAGS, cpu_flags, device_class
from edgeq.route.records import Kernel, RouteReport, SchemeCost, Timing
from edgeq.route.tables import render
from edgeq.route.timing import kernels, measure, measure_raw

__all__ = ["CACHE_FILE", "CLASSES", "DECODE_TOKENS", "GROUP_SIZE", "PREFILL_M", "SHAPES", "Kernel", "RouteReport",
           "SchemeCost", "Timing", "auto_scheme", "cache_dir", "cache_key", "choose", "cpu_flags", "device_class",
           "kernels", "measure", "measure_raw", "render", "resolve_scheme", "route"]


def route(refresh: bool = False, *, shapes=SHAPES, passes: int = 3, decode_calls: int = 10,
          prefill_m: int = PREFILL_M, cache: bool = True) -> RouteReport:
    """The route for this machine: from the cache when present (and not ``refresh``), else measured and cached."""
    import torch

    flags = cpu_flags()  # through this module's name (tests substitute another machine's flags)
    # torch's own spelling ("AVX2"): edgeq.cpu.capability() returns $ATEN_CPU_CAPABILITY as written ("avx2")
    cap = torch.backends.cpu.get_cpu_capability()
    threads = torch.get_num_threads()
    ks, found = kernels(GROUP_SIZE)
    key = cache_key(flags, torch.__version__, VERSION, threads, (k.name for k in ks if k.available))
    path = cache_dir() / CACHE_FILE
    if cache and not refresh:
        hit = read_cache(path).get(key)
        if isinstance(hit, dict):
            try:
                return RouteReport.from_json({**hit, "source": "cached", "cache_file": str(path)})
            except (TypeError, KeyError):
                pass  # an older record: measure again
    t0 = time.perf_counter()
    timings = measure(shapes, GROUP_SIZE, prefill_m, passes, decode_calls, found)
    arms = {t.arm for t in timings}
    costs, choice, reason = choose(timings, arms, GROUP_SIZE, prefill_m)
    report = RouteReport(
        device_class=device_class(flags, cap), torch_capability=cap,
        cpu_flags=tuple(f for f in RELEVANT_FLAGS if f in flags), torch_version=torch.__version__,
        edgeq_version=VERSION, threads=threads, kernels=tuple(ks), timings=tuple(timings),
        schemes=tuple(costs), choice=choice, reason=reason,
        workload=(f"{' + '.join(f'{n}x{k}' for n, k in shapes)} (N x K), G={GROUP_SIZE}: one {prefill_m}-token "
                  f"prefill + {DECODE_TOKENS} decode steps; median of {passes} interleaved passes"),
        source="measured", cache_file=str(path) if cache else "", key=key, seconds=time.perf_counter() - t0,
    )
    if cache:
        write_cache(path, key, report)
    return report


def auto_scheme() -> str:
    """The scheme ``edgeq quantize --scheme auto`` uses: this machine's measured route (cached after the first run)."""
    return route().choice


def resolve_scheme(text: Optional[str]) -> Optional[str]:
    """``--scheme auto`` -> the measured choice; anything else unchanged (for the CLI's quantize command)."""
    return auto_scheme() if text is not None and text.strip().lower() == "auto" else text
