"""Speed of the W4A8 portable path (edgeq.layouts.w4a8.w4a8_linear) against a bf16 matmul and the tinygemm W4A16 op.

Arms (same input x, interleaved A B C A B C ... in one process; per pass each arm's mean over --reps calls; reported:
median over --passes with min-max, and the median of the per-pass ratio to bf16):
  portable:  w4a8_linear on the packed amx_w4a8 buffers (default backend and FMA for this machine; CALLS checked)
  exact:     (--exact) the same with the float64 FMA emulation instead of a probed torch.addcmul
  bf16:      torch.nn.functional.linear(x, W bf16)
  tinygemm:  aten._weight_int4pack_mm_for_cpu (G = 128), edgeq.layouts.tinygemm.mm

Shapes N x K: 1536 x 1536 and 8960 x 1536 (Qwen2.5-1.5B's q/o and gate/up); M = 1 (decode) and 512 (prefill).
Weights are random (speed does not depend on values).

    python benchmarks/bench_w4a8.py [--passes 5] [--threads N] [--exact] [--shapes 1536x1536,8960x1536] [--ms 1,512]
    python benchmarks/bench_w4a8.py --quant     # clipping search vs min/max on the bundled model's weights instead
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

from edgeq.layouts import tinygemm
from edgeq.layouts import w4a8 as L
from edgeq.quantize.w4a8 import group_sq_error, quantize_w4a8

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
        "portable": lambda x: L.w4a8_linear(x, p.qweight, p.scales, p.zeros, g),
        "bf16": lambda x: torch.nn.functional.linear(x, data["w_bf16"]),
        "tinygemm": lambda x: tinygemm.mm(x, data["tg_q"], g, data["tg_sz"]),
    }
    if exact:
        a["exact"] = lambda x: L.w4a8_linear(x, p.qweight, p.scales, p.zeros, g, fma="exact")
    return a


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
          f"cpu {platform.processor() or platform.machine()}  vnni {L.has_vnni()}  addcmul_is_fma {L.addcmul_is_fma()}  "
          f"load {load0:.1f}")
    print(f"# passes {a.passes} (interleaved), G = {a.group}; ms per call: median [min-max]; ratio = median of per-pass arm/bf16\n")
    print("| N x K | M | arm | ms median | [min - max] | x bf16 |")
    print("|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        data = build(n, k, a.group, gen)
        for m in (int(v) for v in a.ms.split(",")):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            before = L.CALLS["w4a8_linear"]
            reps = 20 if m <= 4 else 2
            times = measure(arms(data, a.group, a.exact), x, a.passes, reps)
            ran = L.CALLS["w4a8_linear"] - before
            assert ran == (1 + a.passes * reps) * (2 if a.exact else 1), f"portable path ran {ran} times"
            for name, ts in times.items():
                ratio = statistics.median(t / b for t, b in zip(ts, times["bf16"]))
                print(f"| {n} x {k} | {m} | {name} | {statistics.median(ts):.2f} | [{min(ts):.2f} - {max(ts):.2f}] | {ratio:.2f} |")
    paths = {key: v for key, v in L.CALLS.items() if key.startswith(("blocks_", "fma_"))}
    print(f"\n# portable path blocks by backend/FMA: {paths}; load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
