"""Kernel-only benchmark of edgeq's single-query decode attention (``torch.ops.edgeq.decode_attn``, docs/kernel.md).

One "pass" is what a decode step asks of the op: one call per layer, each layer with its own KV cache (so, as in a
real step, a call does not find its keys in the caches the previous call warmed: Qwen2.5-1.5B at 2048 keys is
28 x 2 MB), for each model shape and context length. Arms (ISA paths) are interleaved pass by pass. Reported per
(shape, context, arm): microseconds per call (median over passes, with min and max) and GB/s of the K and V bytes the
call reads (2 x KVH x T x D x 2 bytes; 2 MB for Qwen2.5-1.5B at 2048 keys).

    python benchmarks/bench_attn.py                                  # qwen2.5-1.5b + llama-3.2-1b, 512 and 2048 keys
    python benchmarks/bench_attn.py --arms native,avx2,scalar --passes 9 --json /tmp/attn.json
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_attn.py          # 2 threads on a machine others also use

``native`` is the path this process runs by default (``EDGEQ_NATIVE_ISA``), the others force one. Wall-clock time:
on a shared machine other processes slow every arm, and the spread shows how much; it reports, it does not judge.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import statistics
import time

import torch

from edgeq.runtime import native

# name -> (query heads H, kv heads KVH, head size D, layers)
SHAPES = {
    "qwen2.5-1.5b": (12, 2, 128, 28),
    "llama-3.2-1b": (32, 8, 64, 16),
}


def make_layers(shape: str, context: int, seed: int = 0):
    """Per layer: (q, keys, values, out) with the cache filled over [0, context) (values do not change the time)."""
    H, KVH, D, layers = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    cap = context + 16
    out = []
    for _ in range(layers):
        q = torch.randn(H, D, generator=g).bfloat16()
        k = torch.randn(1, KVH, cap, D, generator=g).bfloat16()
        v = torch.randn(1, KVH, cap, D, generator=g).bfloat16()
        out.append((q, k, v, torch.empty(H, D, dtype=torch.bfloat16)))
    return out


def run_pass(layers, context: int, isa: str | None) -> float:
    """Seconds per call over one pass of every layer."""
    scale = 1 / math.sqrt(layers[0][0].shape[1])
    t0 = time.perf_counter()
    for q, k, v, out in layers:
        native.decode_attn(q, k, v, 0, context, scale, out, isa=isa)
    return (time.perf_counter() - t0) / len(layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--contexts", default="512,2048", help="comma-separated key counts")
    ap.add_argument("--arms", default="native", help="comma-separated: native, avx512, avx2, scalar")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    st = native.status()
    if not st["available"]:
        raise SystemExit(f"native kernel unavailable: {st['reason']}")
    arms = args.arms.split(",")
    print(f"# {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, native isa {st['isa']}, "
          f"{args.passes} passes; us per call median [min-max], GB/s of K+V read")
    print(f"{'shape':<14} {'keys':>6} {'arm':<8} {'us/call':>24} {'GB/s':>7}")
    rows = []
    for shape in args.shapes.split(","):
        H, KVH, D, _ = SHAPES[shape]
        for context in (int(c) for c in args.contexts.split(",")):
            layers = make_layers(shape, context)
            nbytes = 2 * KVH * context * D * 2
            times: dict[str, list[float]] = {a: [] for a in arms}
            for a in arms:  # warm-up: builds, thread pool, first-touch
                run_pass(layers, context, None if a == "native" else a)
            for i in range(args.passes):
                for a in (arms if i % 2 == 0 else arms[::-1]):
                    times[a].append(run_pass(layers, context, None if a == "native" else a))
            for a, ts in times.items():
                med = statistics.median(ts)
                row = {"shape": shape, "H": H, "KVH": KVH, "D": D, "keys": context, "arm": a,
                       "us_per_call": round(med * 1e6, 1), "min_us": round(min(ts) * 1e6, 1),
                       "max_us": round(max(ts) * 1e6, 1), "gb_per_s": round(nbytes / med / 1e9, 2)}
                rows.append(row)
                span = f"{row['us_per_call']:.1f} [{row['min_us']:.1f}-{row['max_us']:.1f}]"
                print(f"{shape:<14} {context:>6} {a:<8} {span:>24} {row['gb_per_s']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "isa": st["isa"], "passes": args.passes, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
