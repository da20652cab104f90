"""Speed of the W4A8 paths (edgeq's native op, the portable path) against a bf16 matmul and the W4A16 kernels.

Arms (same input x, interleaved A B C A B C ... in one process; per pass each arm's mean over --reps calls; reported:
median over --passes with min-max, and the median of the per-pass ratio to bf16):
  portable:  w4a8_linear on the packed amx_w4a8 buffers (default backend and FMA for this machine; CALLS checked)
  exact:     (--exact) the same with the float64 FMA emulation instead of a probed torch.addcmul
  bf16:      torch.nn.functional.linear(x, W bf16)
  tinygemm:  aten._weight_int4pack_mm_for_cpu (G = 128), edgeq.layouts.tinygemm.mm
  native:    edgeq.runtime.native.w4a8.w4a8_mm (edgeq's own W4A8 op, best ISA here), when it builds

Shapes N x K: 1536 x 1536 and 8960 x 1536 (Qwen2.5-1.5B's q/o and gate/up); M = 1 (decode) and 512 (prefill).
Weights are random (speed does not depend on values).

    python benchmarks/bench_w4a8.py [--passes 5] [--threads N] [--exact] [--shapes 1536x1536,8960x1536] [--ms 1,512]
    python benchmarks/bench_w4a8.py --quant     # clipping search vs min/max on the bundled model's weights instead
    python benchmarks/bench_w4a8.py --layer [--threads 2] [--passes 5] [--footprint-mb 400]

``--layer``: one Qwen2.5-1.5B decoder layer's seven projections (q 1536x1536, k/v 256x1536, o 1536x1536, gate/up
8960x1536, down 1536x8960; G = 128) per arm, at M = 1 and M = 512, arms interleaved per pass:
  w4a8_native   edgeq.runtime.native.w4a8.w4a8_mm, ISA chosen as the runtime does (amx: AMX for M > 8, VNNI below)
  w4a8_vnni     the same op forced to its AVX512-VNNI path
  w4a8_avxvnni  the same op forced to its AVX-VNNI path (256-bit vpdpbusd; `auto` on AVX-VNNI CPUs without AVX512)
  w4a8_avx2     the same op forced to its AVX2 path (vpmaddubsw; what `auto` picks on AVX2-only CPUs)
  w4a8_portable edgeq.runtime.w4a8_compute.w4a8_linear (M = 512 only with --portable-prefill: ~10x slower)
  w4a8_portable_fp32  the same with backend="fp32" (the portable path's backend on CPUs without AVX512-VNNI/AMX)
  w4a16_native  edgeq.runtime.native.int4_mm on the tinygemm layout of the same q (W4A16, bf16 activations)
  bf16          torch.nn.functional.linear on bf16 weights
At M = 1 each arm cycles through enough copies of the layer that its weights (>= --footprint-mb, default 400 MB,
more than this VM's 300 MB L3) come from DRAM, and reports GB/s of its stored weight bytes (W4A8: qweight +
scales + zeros; W4A16: qweight + scales_and_zeros; bf16: 2 bytes per weight). At M = 512 one copy; reported as
the time of the seven projections and "tok/s-eq" = 512 / (28 layers x that time): the prefill rate of the
projections alone (no attention, norms, head).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

from pathlib import Path

import torch

from edgeq.cpu import has_vnni
from edgeq.layouts import tinygemm
from edgeq.layouts import w4a8 as L
from edgeq.quantize.w4a8 import group_sq_error, quantize_w4a8
from edgeq.runtime import w4a8_compute as C

MODEL = Path(__file__).resolve().parent.parent / "edgeq" / "data" / "tiny-prose" / "model.safetensors"


def quant_report() -> None:
    """Reconstruction error of every 2-D weight of the bundled model (linears and the tied embedding/head), W4A8
    min/max vs the clipping search, per group size: relative Frobenius error and the share of groups improved."""
    from safetensors import safe_open

    with safe_open(str(MODEL), "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys() if len(f.get_slice(k).get_shape()) == 2}
    print(f"# W4A8 weight reconstruction on {MODEL.parent.name}: {len(weights)} 2-D tensors, "
          f"{sum(w.numel() for w in weights.values())} weights\n")
    print("| G | minmax rel. error | clip rel. error | clip / minmax (squared) | groups improved |")
    print("|---|---|---|---|---|")
    for g in (32, 64, 128):
        e_mm = e_clip = norm = 0.0
        better = total = 0
        for name, w in weights.items():
            a = group_sq_error(w, quantize_w4a8(w, g, name=name, method="minmax"))
            b = group_sq_error(w, quantize_w4a8(w, g, name=name))
            e_mm, e_clip, norm = e_mm + float(a.sum()), e_clip + float(b.sum()), norm + float(w.double().square().sum())
            better, total = better + int((b < a).sum()), total + a.numel()
        print(f"| {g} | {(e_mm / norm) ** 0.5:.4f} | {(e_clip / norm) ** 0.5:.4f} | {e_clip / e_mm:.3f} | {better / total:.1%} |")


def build(n: int, k: int, g: int, gen: torch.Generator) -> dict:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    zeros = torch.randint(4, 12, (k // g, n), generator=gen).to(torch.int8)
    scales = torch.rand(k // g, n, generator=gen) * 0.002 + 0.001
    p = L.pack(q, scales, zeros, g)
    sz = torch.stack((scales, torch.randn(k // g, n, generator=gen) * 0.001), dim=-1).to(torch.bfloat16)
    layout = tinygemm.probe()
    return {
        "packed": p,
        "w_bf16": torch.randn(n, k, generator=gen).mul_(0.02).to(torch.bfloat16),
        "tg_q": tinygemm.pack(q, layout),
        "tg_sz": sz,
    }


def arms(data: dict, g: int, exact: bool) -> dict:
    p = data["packed"]
    a = {
        "portable": lambda x: C.w4a8_linear(x, p.qweight, p.scales, p.zeros, g),
        "bf16": lambda x: torch.nn.functional.linear(x, data["w_bf16"]),
        "tinygemm": lambda x: tinygemm.mm(x, data["tg_q"], g, data["tg_sz"]),
    }
    if exact:
        a["exact"] = lambda x: C.w4a8_linear(x, p.qweight, p.scales, p.zeros, g, fma="exact")
    nat = _native_w4a8()
    if nat is not None:
        a["native"] = lambda x: nat.w4a8_mm(x, p.qweight, p.scales, p.zeros, g)
    return a


def _native_w4a8():
    """edgeq.runtime.native.w4a8 when it builds and runs here, else None (and say why once)."""
    from edgeq.runtime.native import w4a8 as native_w4a8

    if native_w4a8.available():
        return native_w4a8
    print(f"# native W4A8 op not available: {native_w4a8.status()['reason']}")
    return None


# --- one Qwen2.5-1.5B layer ------------------------------------------------------------------------------------------

QWEN_LAYER = (("q", 1536, 1536), ("k", 256, 1536), ("v", 256, 1536), ("o", 1536, 1536), ("gate", 8960, 1536),
              ("up", 8960, 1536), ("down", 1536, 8960))
QWEN_LAYERS = 28


def _layer_weights(g: int, gen: torch.Generator) -> dict:
    """One layer per format from the same random q: W4A8 packed, W4A16 tinygemm-packed, bf16 dense."""
    layout = tinygemm.probe()
    out = {"w4a8": [], "w4a16": [], "bf16": []}
    for _, n, k in QWEN_LAYER:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        zeros = torch.randint(4, 12, (k // g, n), generator=gen).to(torch.int8)
        scales = torch.rand(k // g, n, generator=gen) * 0.002 + 0.001
        p = L.pack(q, scales, zeros, g)
        sz = torch.stack((scales, torch.randn(k // g, n, generator=gen) * 0.001), dim=-1).to(torch.bfloat16)
        out["w4a8"].append((p.qweight, p.scales, p.zeros))
        out["w4a16"].append((tinygemm.pack(q, layout), sz))
        out["bf16"].append(torch.randn(n, k, generator=gen).mul_(0.02).to(torch.bfloat16))
    return out


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in (ts if isinstance(ts, (tuple, list)) else (ts,)))


def _copies(layer: list, footprint: int) -> list:
    """Enough independent copies of one layer's tensors to hold >= footprint bytes (at least one)."""
    per = sum(_nbytes(t) for t in layer)
    n = max(1, -(-footprint // per))
    clone = lambda t: tuple(x.clone() for x in t) if isinstance(t, tuple) else t.clone()  # noqa: E731
    return [layer] + [[clone(t) for t in layer] for _ in range(n - 1)]


def _layer_arms(w: dict, g: int, m: int, footprint: int, portable_prefill: bool) -> dict:
    """name -> (fn(xs by K) running the seven projections over every copy, weight bytes of one copy, copies)."""
    from edgeq.runtime import native

    arms = {}
    nat = _native_w4a8()
    fp = footprint if m == 1 else 0
    w8 = _copies(w["w4a8"], fp)
    xs_k = lambda xs, k: xs[k]  # noqa: E731

    def run_w4a8(fn, copies):
        def go(xs):
            for layer in copies:
                for (_, n, k), (qw, s, z) in zip(QWEN_LAYER, layer):
                    fn(xs_k(xs, k), qw, s, z, g)
        return go

    b8 = sum(_nbytes(t) for t in w["w4a8"])
    if nat is not None:
        arms["w4a8_native"] = (run_w4a8(nat.w4a8_mm, w8), b8, len(w8))
        for isa in ("vnni", "avxvnni", "avx2"):  # forced paths below the chosen one (avx2*: AVX2-class CPUs)
            if isa in nat.status()["cpu_isas"]:
                arms[f"w4a8_{isa}"] = (run_w4a8(lambda *a, isa=isa: nat.w4a8_mm(*a, isa=isa), w8), b8, len(w8))
    if m == 1 or portable_prefill:
        arms["w4a8_portable"] = (run_w4a8(C.w4a8_linear, w8), b8, len(w8))
        if has_vnni():  # the portable backend of CPUs without AVX512-VNNI/AMX (run here with this CPU's fp32 GEMM)
            fp32 = lambda *a: C.w4a8_linear(*a, backend="fp32")  # noqa: E731
            arms["w4a8_portable_fp32"] = (run_w4a8(fp32, w8), b8, len(w8))
    if native.available():
        w16 = _copies(w["w4a16"], fp)

        def go16(xs):
            for layer in w16:
                for (_, n, k), (qw, sz) in zip(QWEN_LAYER, layer):
                    native.int4_mm(xs[k], qw, g, sz)
        arms["w4a16_native"] = (go16, sum(_nbytes(t) for t in w["w4a16"]), len(w16))
    else:
        print(f"# W4A16 native kernel not available: {native.status()['reason']}")
    wb = _copies(w["bf16"], fp)

    def gob(xs):
        for layer in wb:
            for (_, n, k), t in zip(QWEN_LAYER, layer):
                torch.nn.functional.linear(xs[k], t)
    arms["bf16"] = (gob, sum(_nbytes(t) for t in w["bf16"]), len(wb))
    return arms


def layer_bench(a) -> None:
    g = a.group
    gen = torch.Generator().manual_seed(0)
    w = _layer_weights(g, gen)
    print("| M | arm | copies | ms per layer: median | [min - max] | GB/s (M=1) or tok/s-eq (M=512) | [min - max] |")
    print("|---|---|---|---|---|---|---|")
    for m in (int(v) for v in a.ms.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {k for _, _, k in QWEN_LAYER}}
        arms = _layer_arms(w, g, m, a.footprint_mb << 20, a.portable_prefill)
        reps = 3 if m == 1 else 1
        times = measure({name: fn for name, (fn, _, _) in arms.items()}, xs, a.passes, reps)
        for name, ts in times.items():
            _, nbytes, copies = arms[name]
            per_layer = [t / copies for t in ts]  # ms per layer (one copy)
            if m == 1:
                rate = [nbytes / (t * 1e-3) / 1e9 for t in per_layer]
            else:
                rate = [m / (QWEN_LAYERS * t * 1e-3) for t in per_layer]
            print(f"| {m} | {name} | {copies} | {statistics.median(per_layer):.3f} | [{min(per_layer):.3f} - "
                  f"{max(per_layer):.3f}] | {statistics.median(rate):.1f} | [{min(rate):.1f} - {max(rate):.1f}] |")


def measure(fns: dict, x: torch.Tensor, passes: int, reps: int) -> dict[str, list[float]]:
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up (oneDNN primitive creation, allocator)
        fn(x)
    for _ in range(passes):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn(x)
            times[name].append((time.perf_counter() - t) / reps * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--exact", action="store_true", help="add the float64-FMA arm")
    ap.add_argument("--shapes", default="1536x1536,8960x1536")
    ap.add_argument("--ms", default="1,512")
    ap.add_argument("--quant", action="store_true", help="report clipping vs min/max reconstruction error and exit")
    ap.add_argument("--layer", action="store_true", help="one Qwen2.5-1.5B layer per arm (native vs portable vs W4A16)")
    ap.add_argument("--footprint-mb", type=int, default=400, help="--layer, M=1: weight bytes cycled per arm")
    ap.add_argument("--portable-prefill", action="store_true", help="--layer: also time the portable path at M>1")
    a = ap.parse_args()
    if a.quant:
        quant_report()
        return
    if a.passes < 3:
        ap.error("--passes must be >= 3 (medians of at least three)")
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    load0 = os.getloadavg()[0]
    print(f"# bench_w4a8  {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"capability {torch.backends.cpu.get_cpu_capability()}  threads {torch.get_num_threads()}  "
          f"cpu {platform.processor() or platform.machine()}  vnni {has_vnni()}  addcmul_is_fma {C.addcmul_is_fma()}  "
          f"load {load0:.1f}")
    if a.layer:
        from edgeq.runtime.native import w4a8 as native_w4a8

        st = native_w4a8.status()
        print(f"# --layer: Qwen2.5-1.5B layer, G = {a.group}, passes {a.passes} (interleaved); native W4A8 isa "
              f"{st['isa']} ({st['reason']}), build/load {st['build_seconds']} s\n")
        layer_bench(a)
        print(f"\n# load at end {os.getloadavg()[0]:.1f}  finished {datetime.datetime.now().isoformat(timespec='seconds')}")
        return
    print(f"# passes {a.passes} (interleaved), G = {a.group}; ms per call: median [min-max]; ratio = median of per-pass arm/bf16\n")
    print("| N x K | M | arm | ms median | [min - max] | x bf16 |")
    print("|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        data = build(n, k, a.group, gen)
        for m in (int(v) for v in a.ms.split(",")):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            before = C.PROCESS_COUNTS["w4a8_linear"]
            reps = 20 if m <= 4 else 2
            times = measure(arms(data, a.group, a.exact), x, a.passes, reps)
            ran = C.PROCESS_COUNTS["w4a8_linear"] - before
            assert ran == (1 + a.passes * reps) * (2 if a.exact else 1), f"portable path ran {ran} times"
            for name, ts in times.items():
                ratio = statistics.median(t / b for t, b in zip(ts, times["bf16"]))
                print(f"| {n} x {k} | {m} | {name} | {statistics.median(ts):.2f} | [{min(ts):.2f} - {max(ts):.2f}] | {ratio:.2f} |")
    paths = {key: v for key, v in C.PROCESS_COUNTS.items() if key.startswith(("blocks_", "fma_"))}
    print(f"\n# portable path blocks by backend/FMA: {paths}; load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
