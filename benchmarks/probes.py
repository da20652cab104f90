"""Small one-off measurements quoted in the docs, each a subcommand (single process, not interleaved arms: they
explain where time or memory goes; the comparisons the project claims come from the other scripts).

    python benchmarks/probes.py profile-prefill CKPT [--prompt 512]   # torch profiler over one prefill (docs/kernel.md,
                                                                      #   docs/runtime.md: silu/mul share, kernel share)
    python benchmarks/probes.py shapes                                # native W4A16 vs bf16 GEMM per Qwen shape, M = 512
    python benchmarks/probes.py sdpa                                  # decode SDPA: enable_gqa vs GQA folded into q
    python benchmarks/probes.py embedding-rss CKPT [--cat]            # RssFile of 512 random embedding lookups
    python benchmarks/probes.py w4a8-scalar                           # native W4A8 scalar/vnni vs the portable path
    python benchmarks/probes.py verify-cost CKPT                      # --verify's sha256 of every shard, s per GB

CKPT: an edgeq checkpoint of a Qwen2.5-1.5B shape, e.g. /tmp/edgeq-e2e/qwen2.5-1.5b-w4a16-g128 as
benchmarks/bench_e2e.py builds it. Threads: --threads (default 2).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's edgeq

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _median_us(f, n: int = 200) -> float:
    for _ in range(20):
        f()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n // 5):
            f()
        ts.append((time.perf_counter() - t) / (n // 5) * 1e6)
    return sorted(ts)[2]


def profile_prefill(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    from edgeq.runtime import generate_ids, load

    lm = load(args.checkpoint, threads=args.threads)
    ids = list(range(100, 100 + args.prompt))
    generate_ids(lm, ids, 2)  # warm: pages of the mapped weights, allocator
    for i in range(3):
        t = time.perf_counter()
        generate_ids(lm, ids, 1)
        print(f"prefill {args.prompt} tokens, run {i}: {time.perf_counter() - t:.3f} s")
    with profile(activities=[ProfilerActivity.CPU]) as p:
        generate_ids(lm, ids, 1)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def shapes(args) -> None:
    from edgeq.layouts import tinygemm
    from edgeq.runtime import native

    lay, g, m = tinygemm.probe(), 128, 512
    for n, k in [(1536, 1536), (8960, 1536), (1536, 8960), (256, 1536)]:
        qw = tinygemm.pack(torch.randint(0, 16, (n, k), dtype=torch.uint8), lay)
        sz = torch.rand(k // g, n, 2).to(torch.bfloat16)
        x, w = torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)
        for name, f in [("native", lambda: native.int4_mm(x, qw, g, sz)), ("bf16", lambda: F.linear(x, w))]:
            us = _median_us(f, 10)
            print(f"{n} x {k}, M = {m}, {name}: {us / 1e3:.1f} ms, {2 * m * n * k / us / 1e3:.0f} GFLOPS")


def sdpa(args) -> None:
    q = torch.randn(1, 12, 1, 128).bfloat16()
    keys, values = torch.randn(1, 2, 9362, 128).bfloat16(), torch.randn(1, 2, 9362, 128).bfloat16()
    k, v = keys.narrow(2, 0, 600), values.narrow(2, 0, 600)
    qg = q.view(1, 2, 6, 128)
    a = F.scaled_dot_product_attention(q, k, v, scale=0.088, enable_gqa=True)
    b = F.scaled_dot_product_attention(qg, k, v, scale=0.088).view(1, 12, 1, 128)
    print(f"enable_gqa [1,12,1,128]: {_median_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.088, enable_gqa=True)):.0f} us; "
          f"folded [1,2,6,128]: {_median_us(lambda: F.scaled_dot_product_attention(qg, k, v, scale=0.088)):.0f} us; "
          f"bit-equal here: {torch.equal(a, b)} (600 cached tokens, Qwen2.5-1.5B heads)")


def embedding_rss(args) -> None:
    if args.cat:  # put the file in the page cache by a sequential read first (large folios)
        for f in sorted(Path(args.checkpoint).glob("*.safetensors")):
            subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)
    from edgeq.bench.spec import prompt_ids
    from edgeq.runtime import load

    def rss_file_mib() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("RssFile"):
                return int(line.split()[1]) // 1024
        return -1

    lm = load(args.checkpoint, threads=args.threads)
    emb = lm.model.get_input_embeddings()
    ids = torch.tensor([prompt_ids(512, emb.weight.shape[0], 0)])
    before = rss_file_mib()
    with torch.inference_mode():
        emb(ids)
    print(f"RssFile after load {before} MiB, after 512 random embedding lookups {rss_file_mib()} MiB")


def w4a8_scalar(args) -> None:
    from edgeq.layouts import w4a8 as L
    from edgeq.quantize.w4a8 import quantize_w4a8
    from edgeq.runtime.native import w4a8 as N
    from edgeq.runtime.w4a8_compute import w4a8_linear

    n = k = 1536
    g = 128
    qw = quantize_w4a8(torch.randn(n, k) * 0.02, g, name="w")
    p = L.pack(qw.q, qw.scales, qw.zeros, g)
    for m in (1, 8, 128):
        x = torch.randn(m, k).to(torch.bfloat16)
        arms = {"scalar": lambda: N.w4a8_mm(x, p.qweight, p.scales, p.zeros, g, isa="scalar"),
                "portable": lambda: w4a8_linear(x, p.qweight, p.scales, p.zeros, g),
                "vnni": lambda: N.w4a8_mm(x, p.qweight, p.scales, p.zeros, g, isa="vnni")}
        print(f"M = {m}: " + ", ".join(f"{a} {_median_us(f, 10) / 1e3:.2f} ms" for a, f in arms.items()))


def verify_cost(args) -> None:
    """What `--verify` / verify=True adds: sha256 of every shard from the page cache (docs/runtime.md)."""
    from edgeq.io.safetensors import sha256_file

    files = sorted(Path(args.checkpoint).glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    for f in files:
        f.read_bytes()  # into the page cache: the figure is the hash, not the disk
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for f in files:
            sha256_file(f)
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{total / 1e9:.2f} GB in {len(files)} shards: sha256 {times[1]:.2f} s median [{times[0]:.2f}-{times[2]:.2f}]"
          f" -> {times[1] / (total / 1e9):.2f} s per GB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("probe", choices=["profile-prefill", "shapes", "sdpa", "embedding-rss", "w4a8-scalar",
                                          "verify-cost"])
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--cat", action="store_true", help="embedding-rss: read the files sequentially first")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.probe in ("profile-prefill", "embedding-rss", "verify-cost") and not args.checkpoint:
        ap.error(f"{args.probe} needs CHECKPOINT")
    print(f"# {args.probe}: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"threads {args.threads}")
    {"profile-prefill": profile_prefill, "shapes": shapes, "sdpa": sdpa, "embedding-rss": embedding_rss,
     "w4a8-scalar": w4a8_scalar, "verify-cost": verify_cost}[args.probe](args)


if __name__ == "__main__":
    main()
