"""Speed of the default rounding search (`rtn.choose_params`) by row-block size, and proof that the block size does
not change the bits (docs/results.md, "conversion time").

    python benchmarks/bench_search.py                          # 2048 x 8192 at g128, blocks 2^16 .. 2^22 and one block
    python benchmarks/bench_search.py --shape 1536x8960 --group 32 --blocks 17,19 --passes 5

Random N(0, 0.02) weights (the search's time does not depend on the values). Passes are interleaved (block sizes
in turn, --passes rounds); each row prints the median [min-max] seconds and the pass's CPU share (a pass under 90%
of the threads is flagged as starved). Every block size's (scale, zero) are compared with the first's: a mismatch
exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from edgeq.quantize import rtn


def timed(w: torch.Tensor, method: str) -> tuple[float, float, tuple[torch.Tensor, torch.Tensor]]:
    """(wall seconds, CPU share of the threads, result) of one choose_params call."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = rtn.choose_params(w, method)
    wall = time.perf_counter() - t0
    return wall, (time.process_time() - c0) / (wall * torch.get_num_threads()), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="2048x8192", help="N x K of the weight [default: 2048x8192]")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--method", default="rtn", choices=rtn.METHODS)
    ap.add_argument("--blocks", default="16,18,19,20,22,all",
                    help="log2 of the block's values, comma-separated; 'all' = one block [default: 16,18,19,20,22,all]")
    ap.add_argument("--passes", type=int, default=3)
    a = ap.parse_args()
    n, k = (int(x) for x in a.shape.lower().split("x"))
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02).reshape(n, k // a.group, a.group)
    sizes = [(b, n * k if b == "all" else 1 << int(b)) for b in a.blocks.split(",")]
    default = rtn.CHUNK_ELEMENTS
    times: dict[str, list[tuple[float, float]]] = {b: [] for b, _ in sizes}
    ref, mismatch = None, []
    for _ in range(a.passes):
        for b, elements in sizes:
            rtn.CHUNK_ELEMENTS = elements
            wall, cpu, out = timed(w, a.method)
            times[b].append((wall, cpu))
            if ref is None:
                ref = out
            elif not (torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])):
                mismatch.append(b)
    rtn.CHUNK_ELEMENTS = default
    print(f"choose_params({a.method}) of a {n} x {k} weight, g{a.group}, {torch.get_num_threads()} threads, "
          f"{a.passes} interleaved passes; the default block is 2^{default.bit_length() - 1}")
    print("| block (values) | median s | [min-max] | CPU share (min) |")
    print("|---|---|---|---|")
    for b, elements in sizes:
        walls = [t for t, _ in times[b]]
        low = min(c for _, c in times[b])
        flag = " starved" if low < 0.9 else ""
        label = "one block" if b == "all" else f"2^{b}"
        print(f"| {label} | {statistics.median(walls):.2f} | [{min(walls):.2f}-{max(walls):.2f}] | {low:.0%}{flag} |")
    if mismatch:
        print(f"DIFFERENT BITS for block sizes {sorted(set(mismatch))}", file=sys.stderr)
        sys.exit(1)
    print("same (scale, zero) bits for every block size")


if __name__ == "__main__":
    main()
