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
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import typer

CLASSES = ("AMX", "AVX512-VNNI", "AVX512", "AVX2", "other")  # best first
SHAPES = ((1536, 1536), (8960, 1536))  # (N, K)
GROUP_SIZE = 128
PREFILL_M = 512
DECODE_TOKENS = 128  # the modelled request: one 512-token prefill, then 128 decode steps
CACHE_FILE = "route.json"
_CAPS = {"AVX2": "AVX2", "DEFAULT": "other"}  # torch capabilities that cap the class; AVX512 (and above) does not


def device_class(flags: Iterable[str], torch_capability: str | None = None) -> str:
    """The device class from CPU flags (``/proc/cpuinfo`` names), capped by torch's capability (see module doc)."""
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


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The ``flags`` line of the first CPU (empty when unreadable, e.g. not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# --- results ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    name: str  # tinygemm | native | dequant_prefill | w4a8_portable | w4a8_kernel | bf16
    available: bool
    detail: str


@dataclass(frozen=True)
class Timing:
    arm: str
    n: int
    k: int
    m: int
    ms: float  # median over passes
    ms_min: float
    ms_max: float


@dataclass(frozen=True)
class SchemeCost:
    scheme: str
    decode_path: str
    prefill_path: str
    decode_ms: float  # summed over the shapes, M = 1
    prefill_ms: float  # summed over the shapes, M = PREFILL_M
    cost_ms: float  # prefill_ms + DECODE_TOKENS * decode_ms


@dataclass(frozen=True)
class RouteReport:
    device_class: str
    torch_capability: str
    cpu_flags: tuple[str, ...]  # the ones the classes and kernels depend on
    torch_version: str
    edgeq_version: str
    threads: int
    kernels: tuple[Kernel, ...]
    timings: tuple[Timing, ...]
    schemes: tuple[SchemeCost, ...]
    choice: str  # the scheme `edgeq quantize --scheme auto` uses
    reason: str
    workload: str
    source: str  # "measured" | "cached"
    cache_file: str
    key: str
    seconds: float

    @classmethod
    def from_json(cls, d: dict) -> "RouteReport":
        d = dict(d)
        d["cpu_flags"] = tuple(d["cpu_flags"])
        d["kernels"] = tuple(Kernel(**k) for k in d["kernels"])
        d["timings"] = tuple(Timing(**t) for t in d["timings"])
        d["schemes"] = tuple(SchemeCost(**s) for s in d["schemes"])
        return cls(**d)


_RELEVANT = ("amx_tile", "amx_int8", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "avx2", "fma", "f16c")


# --- cache -----------------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("EDGEQ_CACHE_DIR") or Path.home() / ".cache" / "edgeq")


def cache_key(flags: Iterable[str], torch_version: str, edgeq_version: str, threads: int,
              kernels: Iterable[str] = ()) -> str:
    """Which measurement a cached route belongs to. ``kernels``: the names of the kernels available (a native build
    that starts or stops working changes the route, so it must change the key)."""
    h = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]
    key = f"flags={h}|torch={torch_version}|edgeq={edgeq_version}|threads={threads}"
    return key + (f"|kernels={','.join(sorted(kernels))}" if kernels else "")


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, report: RouteReport) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = asdict(report)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: the result is still printed, just not remembered


# --- arms ------------------------------------------------------------------------------------------------------------


def _weights(n: int, k: int, g: int, gen):
    """One random weight [N, K] quantised both ways: W4A16 (tinygemm-packed) and W4A8 (amx_w4a8-packed)."""
    import torch

    from edgeq.layouts import tinygemm
    from edgeq.layouts import w4a8 as L
    from edgeq.quantize.rtn import quantize_groups
    from edgeq.quantize.w4a8 import quantize_w4a8

    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    qt = quantize_groups(w, g, "minmax", name="route")
    layout = tinygemm.probe()
    qw = quantize_w4a8(w, g, method="minmax", name="route")
    return {"w": w, "tg_q": tinygemm.pack(qt.q, layout), "tg_sz": qt.scales_and_zeros, "layout": layout,
            "w4a8": L.pack(qw.q, qw.scales, qw.zeros, g)}


def kernels(group_size: int = GROUP_SIZE) -> tuple[list[Kernel], dict]:
    """What exists here, with why; and the W4A8 choice and native module for the arms."""
    from edgeq.layouts import tinygemm
    from edgeq.runtime import w4a8linear

    out = [Kernel("bf16", True, "F.linear in bf16 (the reference)")]
    try:
        layout = tinygemm.probe()
        out.append(Kernel("tinygemm", True, f"aten._weight_int4pack_mm_for_cpu, layout {layout.cpu_capability} "
                                            f"block {layout.block_n}"))
        out.append(Kernel("dequant_prefill", True, "runtime prefill: dequantise row blocks + bf16 GEMM"))
    except Exception as e:  # noqa: BLE001 - reported, not raised: route lists what works
        layout = None
        out.append(Kernel("tinygemm", False, f"{type(e).__name__}: {e}"))
    native = None
    try:
        from edgeq.runtime import native as native_mod

        st = native_mod.status()
        ok = bool(st.get("available")) and layout is not None and native_mod.supports(layout)
        native = native_mod if ok else None
        out.append(Kernel("native", ok, f"isa {st.get('isa')}" if ok else str(st.get("reason") or "does not support this layout")))
    except Exception as e:  # noqa: BLE001
        out.append(Kernel("native", False, f"{type(e).__name__}: {e}"))
    out.append(Kernel("w4a8_portable", True, w4a8linear.portable_description()))
    choice = w4a8linear.choose_kernel(group_size)
    out.append(Kernel("w4a8_kernel", choice.fn is not None, choice.reason))
    return out, {"native": native, "w4a8": choice, "tinygemm": layout is not None}


def _arms(data: dict, g: int, found: dict) -> dict[str, Callable]:
    """name -> fn(x) for every available path (the W4A16 runtime prefill through a real Int4Linear)."""
    import torch

    from edgeq.layouts import tinygemm
    from edgeq.layouts import w4a8 as L
    from edgeq.runtime.qlinear import Int4Linear, Runtime, scratch_for

    p = data["w4a8"]
    arms: dict[str, Callable] = {"bf16": lambda x: torch.nn.functional.linear(x, data["w"])}
    if found["tinygemm"]:
        arms["tinygemm"] = lambda x: tinygemm.mm(x, data["tg_q"], g, data["tg_sz"])
        rt = Runtime(layout=data["layout"])
        mod = Int4Linear("route", data["tg_q"], data["tg_sz"], g, None, rt)
        rt.scratch = scratch_for([mod])
        arms["dequant_prefill"] = mod.forward_dequant
    if found["native"] is not None:
        nat = found["native"]
        arms["native"] = lambda x: nat.int4_mm(x, data["tg_q"], g, data["tg_sz"])
    arms["w4a8_portable"] = lambda x: L.w4a8_linear(x, p.qweight, p.scales, p.zeros, g)
    if found["w4a8"].fn is not None:
        fn = found["w4a8"].fn
        arms["w4a8_kernel"] = lambda x: fn(x, p.qweight, p.scales, p.zeros, g, None)
    return arms


def measure(shapes=SHAPES, group_size: int = GROUP_SIZE, prefill_m: int = PREFILL_M, passes: int = 3,
            decode_calls: int = 10, found: dict | None = None, seed: int = 0) -> list[Timing]:
    """Interleaved timings of every available arm at M = 1 and M = prefill_m: median of ``passes`` passes."""
    raw = measure_raw(shapes, group_size, prefill_m, passes, decode_calls, found, seed)
    return [Timing(a, n, k, m, statistics.median(ts), min(ts), max(ts)) for (n, k, m), arms in raw.items()
            for a, ts in arms.items()]


def measure_raw(shapes=SHAPES, group_size: int = GROUP_SIZE, prefill_m: int = PREFILL_M, passes: int = 3,
                decode_calls: int = 10, found: dict | None = None, seed: int = 0) -> dict:
    """{(N, K, M): {arm: [ms per pass]}}: every pass times each arm once, in the same order (interleaved), after
    one warm-up call of each; M = 1 is the mean of ``decode_calls`` calls, M = prefill_m one call."""
    import torch

    if found is None:
        found = kernels(group_size)[1]
    gen = torch.Generator().manual_seed(seed)
    raw = {}
    for n, k in shapes:
        data = _weights(n, k, group_size, gen)
        arms = _arms(data, group_size, found)
        for m, calls in ((1, decode_calls), (prefill_m, 1)):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            use = {a: fn for a, fn in arms.items() if not (a == "dequant_prefill" and m == 1)}
            for fn in use.values():
                fn(x)  # warm-up: allocator, oneDNN primitives
            times: dict[str, list[float]] = {a: [] for a in use}
            for _ in range(passes):
                for a, fn in use.items():
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn(x)
                    times[a].append((time.perf_counter() - t0) / calls * 1e3)
            raw[(n, k, m)] = times
    return raw


def choose(timings: list[Timing], found_arms: set[str], group_size: int = GROUP_SIZE,
           prefill_m: int = PREFILL_M, decode_tokens: int = DECODE_TOKENS) -> tuple[list[SchemeCost], str, str]:
    """Per scheme, the runtime's paths and their modelled cost; returns (costs, chosen scheme, reason).

    W4A16: decode on ``native`` if measured, else ``tinygemm``; prefill on the faster of that kernel and
    ``dequant_prefill`` (summed over shapes). W4A8: ``w4a8_kernel`` if measured, else ``w4a8_portable``, all M.
    """
    def total(arm: str, m: int) -> float:
        return sum(t.ms for t in timings if t.arm == arm and t.m == m)

    costs = []
    if "tinygemm" in found_arms:
        dec = "native" if "native" in found_arms else "tinygemm"
        pre = min((dec, "dequant_prefill"), key=lambda a: total(a, prefill_m) if a in found_arms else float("inf"))
        d, p = total(dec, 1), total(pre, prefill_m)
        costs.append(SchemeCost(f"w4a16-g{group_size}", dec, pre, d, p, p + decode_tokens * d))
    w8 = "w4a8_kernel" if "w4a8_kernel" in found_arms else "w4a8_portable"
    d, p = total(w8, 1), total(w8, prefill_m)
    costs.append(SchemeCost(f"w4a8-g{group_size}", w8, w8, d, p, p + decode_tokens * d))
    best = min(costs, key=lambda c: c.cost_ms)
    others = ", ".join(f"{c.scheme} {c.cost_ms:.1f} ms" for c in costs if c is not best)
    reason = (f"{best.scheme} is cheapest for the modelled request: {best.cost_ms:.1f} ms "
              f"(decode {best.decode_path} {best.decode_ms:.2f} ms/token, prefill {best.prefill_path} "
              f"{best.prefill_ms:.1f} ms)" + (f" vs {others}" if others else ""))
    return costs, best.scheme, reason


def route(refresh: bool = False, *, shapes=SHAPES, passes: int = 3, decode_calls: int = 10,
          prefill_m: int = PREFILL_M, cache: bool = True) -> RouteReport:
    """The route for this machine: from the cache when present (and not ``refresh``), else measured and cached."""
    import torch

    import edgeq

    flags = cpu_flags()
    cap = torch.backends.cpu.get_cpu_capability()
    threads = torch.get_num_threads()
    ks, found = kernels(GROUP_SIZE)
    key = cache_key(flags, torch.__version__, edgeq.__version__, threads, (k.name for k in ks if k.available))
    path = cache_dir() / CACHE_FILE
    if cache and not refresh:
        hit = _read_cache(path).get(key)
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
        cpu_flags=tuple(f for f in _RELEVANT if f in flags), torch_version=torch.__version__,
        edgeq_version=edgeq.__version__, threads=threads, kernels=tuple(ks), timings=tuple(timings),
        schemes=tuple(costs), choice=choice, reason=reason,
        workload=(f"{' + '.join(f'{n}x{k}' for n, k in shapes)} (N x K), G={GROUP_SIZE}: one {prefill_m}-token "
                  f"prefill + {DECODE_TOKENS} decode steps; median of {passes} interleaved passes"),
        source="measured", cache_file=str(path) if cache else "", key=key, seconds=time.perf_counter() - t0,
    )
    if cache:
        _write_cache(path, key, report)
    return report


def auto_scheme() -> str:
    """The scheme ``edgeq quantize --scheme auto`` uses: this machine's measured route (cached after the first run)."""
    return route().choice


# --- CLI -------------------------------------------------------------------------------------------------------------


def render(r: RouteReport, console) -> None:
    from rich.table import Table

    console.print(f"[bold]device class {r.device_class}[/bold] (torch capability {r.torch_capability}, "
                  f"flags {' '.join(r.cpu_flags) or 'none'}) · torch {r.torch_version} · edgeq {r.edgeq_version} · "
                  f"{r.threads} thread(s)", highlight=False)
    t = Table(title="kernels", title_justify="left")
    for col in ("path", "available", "detail"):
        t.add_column(col)
    for k in r.kernels:
        t.add_row(k.name, "yes" if k.available else "[red]no[/red]", k.detail)
    console.print(t)
    t = Table(title=f"measured ({r.source}{', ' + r.cache_file if r.source == 'cached' else ''}): {r.workload}",
              title_justify="left")
    for col in ("path", "N x K", "M", "ms (median)", "min - max"):
        t.add_column(col, justify="left" if col == "path" else "right")
    for x in r.timings:
        t.add_row(x.arm, f"{x.n} x {x.k}", str(x.m), f"{x.ms:.3f}", f"{x.ms_min:.3f} - {x.ms_max:.3f}")
    console.print(t)
    t = Table(title="schemes (the runtime's paths)", title_justify="left")
    for col in ("scheme", "decode path", "ms/token", "prefill path", "prefill ms", "request ms"):
        t.add_column(col, justify="left" if "path" in col or col == "scheme" else "right")
    for s in r.schemes:
        t.add_row(s.scheme, s.decode_path, f"{s.decode_ms:.3f}", s.prefill_path, f"{s.prefill_ms:.1f}",
                  f"{s.cost_ms:.1f}")
    console.print(t)
    console.print(f"[green]fastest here: {r.choice}[/green] — {r.reason}", highlight=False)


def route_command(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    refresh: bool = typer.Option(False, "--refresh", help="Measure again instead of reading the per-machine cache."),
    passes: int = typer.Option(3, "--passes", help="Interleaved passes (the median is reported; at least 3)."),
) -> None:
    """This machine: device class, available kernels, a measured microbenchmark of each path, the fastest scheme."""
    from edgeq.console import emit, out
    from edgeq.errors import EdgeqError

    if passes < 3:
        raise EdgeqError(f"--passes {passes}: need at least 3 (the median of fewer says nothing about the spread)")
    report = route(refresh=refresh, passes=passes)
    emit(report, as_json, lambda r: render(r, out))


def resolve_scheme(text: Optional[str]) -> Optional[str]:
    """``--scheme auto`` -> the measured choice; anything else unchanged (for the CLI's quantize command)."""
    return auto_scheme() if text is not None and text.strip().lower() == "auto" else text
