"""Kernel-only benchmark of edgeq's attention ops (docs/kernel.md): the single-query decode attention
(``torch.ops.edgeq.decode_attn``) and, with ``--prefill``, the causal prefill attention (``prefill_attn``) against
torch's SDPA (what the transformers forward runs otherwise).

One "pass" is what a decode step asks of the op: one call per layer, each layer with its own KV cache (so, as in a
real step, a call does not find its keys in the caches the previous call warmed: Qwen2.5-1.5B at 2048 keys is
28 x 2 MB), for each model shape and context length. Arms (ISA paths) are interleaved pass by pass. Reported per
(shape, context, arm): microseconds per call (median over passes, with min and max) and GB/s of the K and V bytes the
call reads (2 x KVH x T x D x 2 bytes; 2 MB for Qwen2.5-1.5B at 2048 keys).

    python benchmarks/bench_attn.py                                  # qwen2.5-1.5b + llama-3.2-1b, 512 and 2048 keys
    python benchmarks/bench_attn.py --arms native,avx2,scalar --passes 9 --json /tmp/attn.json
    python benchmarks/bench_attn.py --prefill                        # prompt of 512 / 2048 tokens: native vs sdpa
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_attn.py          # 2 threads on a machine others also use

``native`` is the path this process runs by default (``EDGEQ_NATIVE_ISA``), the others force one. With ``--prefill``
a call is a whole prompt of ``context`` tokens attending causally (keys = queries, GQA), the arms ``native`` (or a
forced ``avx512`` / ``avx2`` path) and ``sdpa`` (``F.scaled_dot_product_attention(..., is_causal=True,
enable_gqa=True)`` on the same bf16 tensors; ``ATEN_CPU_CAPABILITY=avx2`` makes it torch's AVX2 build), and
GB/s is replaced by GMAC/s of the causal work (H x D x T (T + 1) multiply-adds: q.k and p.v). Wall-clock time:
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
import torch.nn.functional as F

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


def make_prefill_layers(shape: str, context: int, seed: int = 0):
    """Per layer: (q [H, T, D], keys, values [1, KVH, T, D]) of one prompt of ``context`` tokens."""
    H, KVH, D, layers = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    def bf16(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    return [(bf16(H, context, D), bf16(1, KVH, context, D), bf16(1, KVH, context, D)) for _ in range(layers)]


def run_prefill_pass(layers, arm: str) -> float:
    """Seconds per call over one pass of every layer: torch's SDPA, or the native op on this process's ISA path
    ("native") or a forced one ("avx512", "avx2")."""
    scale = 1 / math.sqrt(layers[0][0].shape[2])
    t0 = time.perf_counter()
    for q, k, v in layers:
        if arm == "sdpa":
            F.scaled_dot_product_attention(q[None], k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            native.prefill_attn(q, k, v, scale, isa=None if arm == "native" else arm)
    return (time.perf_counter() - t0) / len(layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--contexts", default="512,2048", help="comma-separated key counts")
    ap.add_argument("--arms", default=None, help="comma-separated: native, avx512, avx2, scalar (decode; default "
                    "native) or native, avx512, avx2, sdpa (--prefill; default native,sdpa)")
    ap.add_argument("--prefill", action="store_true", help="the causal prefill attention instead of decode's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    st = native.status()
    if not st["available"]:
        raise SystemExit(f"native kernel unavailable: {st['reason']}")
    arms = (args.arms or ("native,sdpa" if args.prefill else "native")).split(",")
    print(f"# {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, native isa {st['isa']}, "
          f"{args.passes} passes; {'prefill (causal, keys = queries)' if args.prefill else 'decode'}: us per call "
          f"median [min-max], {'GMAC/s' if args.prefill else 'GB/s of K+V read'}")
    print(f"{'shape':<14} {'keys':>6} {'arm':<8} {'us/call':>24} {'GMAC/s' if args.prefill else 'GB/s':>7}")
    rows = []
    for shape in args.shapes.split(","):
        H, KVH, D, _ = SHAPES[shape]
        for context in (int(c) for c in args.contexts.split(",")):
            if args.prefill:
                layers, work = make_prefill_layers(shape, context), H * D * context * (context + 1)
                one = run_prefill_pass
            else:
                layers, work = make_layers(shape, context), 2 * KVH * context * D * 2

                def one(layers, a, context=context):
                    return run_pass(layers, context, None if a == "native" else a)
            times: dict[str, list[float]] = {a: [] for a in arms}
            for a in arms:  # warm-up: builds, thread pool, first-touch
                one(layers, a)
            for i in range(args.passes):
                for a in (arms if i % 2 == 0 else arms[::-1]):
                    times[a].append(one(layers, a))
            for a, ts in times.items():
                med = statistics.median(ts)
                row = {"shape": shape, "H": H, "KVH": KVH, "D": D, "keys": context, "arm": a,
                       "us_per_call": round(med * 1e6, 1), "min_us": round(min(ts) * 1e6, 1),
                       "max_us": round(max(ts) * 1e6, 1),
                       ("gmac_per_s" if args.prefill else "gb_per_s"): round(work / med / 1e9, 2)}
                rows.append(row)
                span = f"{row['us_per_call']:.1f} [{row['min_us']:.1f}-{row['max_us']:.1f}]"
                print(f"{shape:<14} {context:>6} {a:<8} {span:>24} {row.get('gmac_per_s', row.get('gb_per_s')):>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "isa": st["isa"], "passes": args.passes,
                       "mode": "prefill" if args.prefill else "decode", "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
