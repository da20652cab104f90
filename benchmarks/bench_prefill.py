"""pp512 prefill through edgeq's two W4A16 paths on a Qwen2.5-1.5B-shaped stack of quantised linears.

Arms (same packed buffers, same inputs, interleaved A B A B ... in one process, median of --passes with min-max):
  dequant: Int4Linear.forward_dequant - dequantise row blocks into the shared bf16 scratch, bf16 GEMM
  kernel:  Int4Linear.forward_kernel with the aten tinygemm op (_weight_int4pack_mm_for_cpu) at M = 512
  native:  (--native, when edgeq.runtime.native is available) the native kernel at M = 512

Weights are random (speed does not depend on values). Only the linears run (q, k, v, o, gate, up, down per layer;
attention, norms and the head are outside this measurement): they are where the two paths differ.

    python benchmarks/bench_prefill.py [--layers 28] [--passes 3] [--prompt 512] [--threads N] [--native]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from edgeq.layouts import tinygemm
from edgeq.runtime.qlinear import Int4Linear, Runtime, _native, scratch_for

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 1536, 8960, 12, 2, 128, 28  # Qwen2.5-1.5B


def build_stack(layers: int, group: int, runtime: Runtime) -> list[list[Int4Linear]]:
    gen = torch.Generator().manual_seed(0)
    shapes = [("q", HEADS * HEAD_DIM, HIDDEN), ("k", KV_HEADS * HEAD_DIM, HIDDEN), ("v", KV_HEADS * HEAD_DIM, HIDDEN),
              ("o", HIDDEN, HEADS * HEAD_DIM), ("gate", INTER, HIDDEN), ("up", INTER, HIDDEN), ("down", HIDDEN, INTER)]
    stack = []
    for i in range(layers):
        row = []
        for name, n, k in shapes:
            qw = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
            sz = torch.empty(k // group, n, 2)
            sz[..., 0] = 0.002
            sz[..., 1] = torch.randn(k // group, n, generator=gen) * 0.001
            row.append(Int4Linear(f"layers.{i}.{name}", qw, sz.to(torch.bfloat16), group, None, runtime))
        stack.append(row)
    runtime.scratch = scratch_for([m for row in stack for m in row])
    return stack


def run(stack, x: torch.Tensor, path: str) -> float:
    xi = torch.randn(x.shape[0], INTER).to(torch.bfloat16)
    t = time.perf_counter()
    for q, k, v, o, gate, up, down in stack:
        for m, inp in ((q, x), (k, x), (v, x), (o, x), (gate, x), (up, x), (down, xi)):
            getattr(m, path)(inp)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--native", action="store_true", help="add the native kernel as a third arm when available")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    layout = tinygemm.probe()
    kernel_rt = Runtime(layout=layout)
    stack = build_stack(a.layers, a.group, kernel_rt)
    arms = {"dequant": "forward_dequant", "kernel": "forward_kernel"}
    native = _native() if a.native else None
    if native is not None and native.supports(layout):
        arms["native"] = "native"
    x = torch.randn(a.prompt, HIDDEN).to(torch.bfloat16)
    # agreement of the two paths on one layer (max |diff| relative to max |y|)
    y_d, y_k = stack[0][4].forward_dequant(x), stack[0][4].forward_kernel(x)
    agree = float((y_d.float() - y_k.float()).abs().max() / y_k.float().abs().max())
    times = {arm: [] for arm in arms}
    for arm, fn in arms.items():  # warm-up pass of each arm, not counted
        _one(stack, x, arm, fn, kernel_rt, native)
    for _ in range(a.passes):
        for arm, fn in arms.items():
            times[arm].append(_one(stack, x, arm, fn, kernel_rt, native))
    print(f"# bench_prefill: {datetime.date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"capability {layout.cpu_capability}, threads {torch.get_num_threads()}, layers {a.layers} (Qwen2.5-1.5B shapes), "
          f"M = {a.prompt}, G = {a.group}, scratch {kernel_rt.scratch.nbytes / 2**20:.1f} MiB, passes {a.passes}")
    print(f"# paths agree on gate_proj: max |dequant - kernel| / max |kernel| = {agree:.2e}")
    print("| arm | pp tok/s (median) | min | max | s per pass (median) |")
    print("|---|---|---|---|---|")
    med = {}
    for arm, ts in times.items():
        tps = sorted(a.prompt / t for t in ts)
        med[arm] = statistics.median(tps)
        print(f"| {arm} | {med[arm]:.1f} | {tps[0]:.1f} | {tps[-1]:.1f} | {statistics.median(ts):.2f} |")
    print(f"# dequant / kernel = {med['dequant'] / med['kernel']:.2f}x")


def _one(stack, x, arm, fn, rt, native) -> float:
    if arm == "native":
        rt.native = native
        try:
            return run(stack, x, "forward_kernel")
        finally:
            rt.native = None
    return run(stack, x, fn)


if __name__ == "__main__":
    main()
