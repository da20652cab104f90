"""What `edgeq route` measures, as markdown tables with ratios: every 4-bit path against bf16, at decode and prefill.

    python benchmarks/bench_route.py [--passes 5] [--threads 1] [--shapes 1536x1536,8960x1536] [--prefill-m 512]

Arms (the ones available here, see `edgeq route`): bf16 F.linear, tinygemm (aten int4 op), native (edgeq's kernel),
dequant_prefill (the runtime's prefill path, M > 1 only), w4a8_portable, w4a8_kernel (a compiled W4A8 op, when one
is importable and passes the probe). Random weights, G = 128. Per pass every arm runs once in the same order
(interleaved); M = 1 is the mean of --decode-calls calls, M = prefill one call. Reported: median over passes with
the min-max spread, and the median of the per-pass ratio to bf16 (so a slow pass slows every arm alike). Then the
scheme costs and the choice exactly as `edgeq route` makes them. The machine's load average is printed: on shared
cores only the interleaved ratios mean anything.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics

import torch

from edgeq import route as R


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's]")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in R.SHAPES), help="N x K list")
    ap.add_argument("--prefill-m", type=int, default=R.PREFILL_M)
    ap.add_argument("--decode-calls", type=int, default=10)
    args = ap.parse_args()
    if args.passes < 3:
        ap.error("--passes must be >= 3")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    kernels, found = R.kernels(R.GROUP_SIZE)
    flags = R.cpu_flags()
    print(f"# bench_route {datetime.datetime.now():%Y-%m-%d %H:%M}")
    print(f"device class {R.device_class(flags, torch.backends.cpu.get_cpu_capability())}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    for k in kernels:
        print(f"- {k.name}: {'available' if k.available else 'not available'} ({k.detail})")
    raw = R.measure_raw(shapes, R.GROUP_SIZE, args.prefill_m, args.passes, args.decode_calls, found)
    print(f"\n| N x K | M | arm | ms median | [min - max] | x bf16 |\n|---|---|---|---|---|---|")
    timings = []
    for (n, k, m), arms in raw.items():
        base = arms["bf16"]
        for a, ts in arms.items():
            ratio = statistics.median(t / b for t, b in zip(ts, base))
            print(f"| {n} x {k} | {m} | {a} | {statistics.median(ts):.3f} | [{min(ts):.3f} - {max(ts):.3f}] | {ratio:.2f} |")
            timings.append(R.Timing(a, n, k, m, statistics.median(ts), min(ts), max(ts)))
    costs, choice, reason = R.choose(timings, {t.arm for t in timings}, R.GROUP_SIZE, args.prefill_m)
    print("\n| scheme | decode path | ms/token | prefill path | prefill ms | request ms |\n|---|---|---|---|---|---|")
    for c in costs:
        print(f"| {c.scheme} | {c.decode_path} | {c.decode_ms:.3f} | {c.prefill_path} | {c.prefill_ms:.1f} | {c.cost_ms:.1f} |")
    print(f"\nchoice: {choice}: {reason}")


if __name__ == "__main__":
    main()
