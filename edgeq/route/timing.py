"""The measurement behind a route: which 4-bit compute paths exist here (:func:`kernels`) and how long each takes on
random weights of the workload's shapes (:func:`measure`), every available path interleaved within each pass."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from edgeq.route.choice import GROUP_SIZE, PREFILL_M, SHAPES
from edgeq.route.records import Kernel, Timing


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
    from edgeq.runtime.qlinear import Int4Linear, Runtime, scratch_for
    from edgeq.runtime.w4a8_compute import w4a8_linear

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
    arms["w4a8_portable"] = lambda x: w4a8_linear(x, p.qweight, p.scales, p.zeros, g)
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
