"""Small one-off measurements quoted in the docs, each a subcommand (single process, not interleaved arms: they
explain where time or memory goes; the comparisons the project claims come from the other scripts).

    python benchmarks/probes.py profile-prefill CKPT [--prompt 512]   # torch profiler over one prefill (docs/kernel.md,
                                                                      #   docs/runtime.md: silu/mul share, kernel share)
    python benchmarks/probes.py shapes [--model llama] [--groups 32,128]  # native W4A16 vs bf16 GEMM per Qwen (Llama)
                                                                      #   shape, M = --prompt (512), each group size
    python benchmarks/probes.py sdpa                                  # decode SDPA: enable_gqa vs GQA folded into q
    python benchmarks/probes.py embedding-rss CKPT [--cat]            # RssFile of 512 random embedding lookups
    python benchmarks/probes.py w4a8-scalar                           # native W4A8 scalar/vnni vs the portable path
    python benchmarks/probes.py verify-cost CKPT                      # --verify's sha256 of every shard, s per GB
    python benchmarks/probes.py pmd-map CKPT                          # 2 MiB regions of each shard the kernel maps huge
    python benchmarks/probes.py huge-pages CKPT [--passes 12]         # one token's linears: mapped vs anonymous copies
    python benchmarks/probes.py peak                                  # the multiply-add roof: vdpbf16ps / vpdpbusd
                                                                      #   per second, and the prefill ceilings it sets
    python benchmarks/probes.py kernel-calls [--threads 1]            # native W4A16 us per call, L2-resident weights
    python benchmarks/probes.py prefill-calls [--prompt 512]          # native W4A16 ms per call at prefill sizes, each tile kind
    python benchmarks/probes.py w4a8-calls [--prompt 512]             # native W4A8 ms per call at prefill size
    python benchmarks/probes.py kernel-precision                      # native W4A16 vs aten and fp64 on outlier inputs
    python benchmarks/probes.py token-bytes CKPT [--gguf FILE]        # bytes a decoded token reads: edgeq vs GGUF
    python benchmarks/probes.py gptq-time                             # GPTQ per matrix, --gptq-params search vs minmax
    python benchmarks/probes.py sample-rows MODEL --passes 2          # --calib self sampling s per rows-per-batch cap
                                                                      #   (--rows 31,128 --nsamples 128 --seqlen 32)

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


def _call_times_us(f, runs: int, calls: int, warmup: int) -> list[float]:
    """Microseconds per call of ``f()`` in each of ``runs`` timed runs of ``calls`` calls, after ``warmup``; sorted."""
    for _ in range(warmup):
        f()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        ts.append((time.perf_counter() - t) / calls * 1e6)
    return sorted(ts)


def _median_us(f, n: int = 200) -> float:
    return _call_times_us(f, 5, n // 5, 20)[2]


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

    lay, m = tinygemm.probe(), args.prompt
    shapes_ = {"qwen": [(1536, 1536), (8960, 1536), (1536, 8960), (256, 1536)],
               "llama": [(2048, 2048), (8192, 2048), (2048, 8192), (512, 2048)]}[args.model]
    for n, k in shapes_:
        qw = tinygemm.pack(torch.randint(0, 16, (n, k), dtype=torch.uint8), lay)
        x, w = torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)
        arms = [(f"native g{g}", lambda g=g, sz=torch.rand(k // g, n, 2).to(torch.bfloat16): native.int4_mm(x, qw, g, sz))
                for g in map(int, args.groups.split(","))] + [("bf16 GEMM", lambda: F.linear(x, w))]
        for name, f in arms:
            us = _median_us(f, 10)
            print(f"{n} x {k}, M = {m}, {name}: {us / 1e3:.2f} ms, {2 * m * n * k / us / 1e3:.0f} GFLOPS", flush=True)


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
    ids = torch.tensor([prompt_ids(512, emb.num_embeddings, 0)])
    own = [lv.qweight for lv in getattr(emb, "levels", ()) if not lv.shared] or [emb.weight]  # the table's own bytes
    before = rss_file_mib()
    with torch.inference_mode():
        emb(ids)
    table = sum(_in_page_tables(t.data_ptr(), t.numel() * t.element_size()) for t in own) >> 20
    print(f"RssFile after load {before} MiB, after 512 random embedding lookups {rss_file_mib()} MiB; the table's own "
          f"{sum(t.numel() * t.element_size() for t in own) >> 20} MiB: {table} MiB in the page tables (pagemap)")


def _in_page_tables(ptr: int, n: int) -> int:
    """Bytes of [ptr, ptr + n) mapped in this process's page tables (/proc/self/pagemap bit 63 per 4 KiB page): what
    RSS counts of that range, whatever the VMA around it."""
    import mmap
    import struct

    page = mmap.PAGESIZE
    first, last = ptr // page, (ptr + n - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    return sum(1 for (e,) in struct.iter_unpack("<Q", raw) if e >> 63) * page


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


def pmd_map(args) -> None:
    """Map each 2 MiB region of every shard on its own (read-only, touched) and read its FilePmdMapped from smaps:
    'H' = mapped with one 2 MiB entry (the page cache holds it as one 2 MiB folio), '.' = small pages."""
    import mmap
    import os

    from edgeq.bench.measure import pmd_mapped

    huge = 2 << 20
    for shard in sorted(Path(args.checkpoint).glob("*.safetensors")):
        fd = os.open(shard, os.O_RDONLY)
        maps = []
        for off in range(0, os.path.getsize(shard) - huge + 1, huge):
            m = mmap.mmap(fd, huge, access=mmap.ACCESS_READ, offset=off)
            m.madvise(mmap.MADV_HUGEPAGE)
            m[0], m[huge - 1]
            maps.append(m)
        got = pmd_mapped()
        marks = "".join("H" if got.get(address_of_ro(m), 0) else "." for m in maps)
        print(f"{shard.name}: {marks.count('H')} of {len(marks)} 2 MiB regions PMD-mapped\n{marks}")
        for m in maps:
            m.close()
        os.close(fd)


def address_of_ro(m) -> int:
    """Start address of a read-only mmap (ctypes needs a writable buffer; numpy reads the address of any)."""
    import numpy as np

    return np.frombuffer(m, dtype=np.uint8).ctypes.data


def huge_pages(args) -> None:
    """The decode step's linear calls (native kernel, M = 1) on the checkpoint's mapped tensors against anonymous
    copies of the same tensors (4 KiB pages where transparent huge pages are madvise-only), arms interleaved; median
    [min-max] over passes of the best of 3."""
    import statistics

    from edgeq.runtime import load

    lm = load(args.checkpoint, max_model_len=1024, threads=args.threads, kv_cache_bytes="256MiB")
    dec = lm.decoder
    mods = [lin.fn.__self__ for L in dec.layers for lin in (L.q, L.k, L.v, L.o, L.gate, L.up, L.down)]
    mods.append(dec.head.fn.__self__)
    mapped = [(m.qweight, m.scales_and_zeros, m.group_size) for m in mods]
    anon = [(q.clone(), sz.clone(), g) for q, sz, g in mapped]
    layout = mods[0].runtime.layout
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for k in {q.shape[1] * 2 for q, _, _ in mapped}}
    from edgeq.runtime import native

    def run(mats) -> float:
        t = time.perf_counter()
        for q, sz, g in mats:
            native.int4_mm(xs[q.shape[1] * 2], q, g, sz, layout=layout)
        return time.perf_counter() - t

    times = {"mapped": [], "anonymous": []}
    for p in range(args.passes):
        for arm in (("mapped", "anonymous") if p % 2 == 0 else ("anonymous", "mapped")):
            mats = mapped if arm == "mapped" else anon
            run(mats)
            times[arm].append(min(run(mats) for _ in range(3)) * 1e3)
    nbytes = sum(q.numel() + sz.numel() * 2 for q, sz, _ in mapped)
    for arm, v in times.items():
        med = statistics.median(v)
        print(f"{arm}: {med:.2f} ms [{min(v):.2f}-{max(v):.2f}], {nbytes / med / 1e6:.1f} GB/s")
    from edgeq.bench.measure import mapped_residency

    r = mapped_residency(args.checkpoint)
    print(f"checkpoint mapping: Rss {r.rss_bytes >> 20} MiB, of which PMD-mapped {r.pmd_mapped_bytes >> 20} MiB")

_PEAK_SRC = r"""
// Register-only loops of independent vdpbf16ps (bf16 pairs -> fp32, 32 multiply-adds per 512-bit instruction),
// vpdpbusd (u8 x s8 quads -> s32, 64 per instruction) and vfmadd231ps (fp32, 16 per instruction): the most
// multiply-adds a core retires, no memory traffic.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
// 12 independent accumulator chains per thread. The empty asm makes every value opaque each iteration: the compiler
// can neither fold a chain into a + n * c nor merge equal chains into one (both happened without it).
template <class A, class V, class F> double chains(int threads, long n, V x, V w, A zero, F step) {
  auto body = [=] {
    V xx = x, ww = w;
    A a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero, a6 = zero, a7 = zero,
      a8 = zero, a9 = zero, a10 = zero, a11 = zero;
    for (long i = 0; i < n; ++i) {
      __asm__ volatile("" : "+v"(xx), "+v"(ww), "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),
                       "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
      a0 = step(a0, xx, ww); a1 = step(a1, xx, ww); a2 = step(a2, xx, ww); a3 = step(a3, xx, ww);
      a4 = step(a4, xx, ww); a5 = step(a5, xx, ww); a6 = step(a6, xx, ww); a7 = step(a7, xx, ww);
      a8 = step(a8, xx, ww); a9 = step(a9, xx, ww); a10 = step(a10, xx, ww); a11 = step(a11, xx, ww);
    }
    __asm__ volatile("" ::"v"(a0), "v"(a1), "v"(a2), "v"(a3), "v"(a4), "v"(a5), "v"(a6), "v"(a7), "v"(a8), "v"(a9),
                     "v"(a10), "v"(a11));
  };
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back(body);
  for (auto& t : ts) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
int main() {
  const long n = 20000000;
  const auto bf16 = [](__m512 a, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(a, x, w); };
  const auto vnni = [](__m512i a, __m512i x, __m512i w) { return _mm512_dpbusd_epi32(a, x, w); };
  const auto fma = [](__m512 a, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, a); };
  const __m512bh bx = (__m512bh)_mm512_set1_epi32(0x3F803F80), bw = (__m512bh)_mm512_set1_epi32(0x3C003C00);
  for (int threads = 1; threads <= 2; ++threads) {
    double best_b = 1e9, best_v = 1e9, best_f = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      best_b = std::min(best_b, chains(threads, n, bx, bw, _mm512_setzero_ps(), bf16));
      best_v = std::min(best_v, chains(threads, n, _mm512_set1_epi8(3), _mm512_set1_epi8(5), _mm512_setzero_si512(), vnni));
      best_f = std::min(best_f, chains(threads, n, _mm512_set1_ps(1e-3f), _mm512_set1_ps(0.5f), _mm512_setzero_ps(), fma));
    }
    std::printf("%d %.3f %.3f %.3f\n", threads, 12.0 * 32 * n * threads / best_b / 1e9,
                12.0 * 64 * n * threads / best_v / 1e9, 12.0 * 16 * n * threads / best_f / 1e9);
  }
}
"""

# Multiply-adds of one prefilled token through the linears of each bench_e2e shape (q, k, v, o, gate, up, down per
# layer; the head runs for the last token only): hidden * (q + 2 kv + q) + 3 hidden * intermediate, times layers.
_PREFILL_MACS = {
    "qwen2.5-1.5b": 28 * (1536 * (1536 + 2 * 256 + 1536) + 3 * 1536 * 8960),
    "llama-3.2-1b": 16 * (2048 * (2048 + 2 * 512 + 2048) + 3 * 2048 * 8192),
}


def peak(args) -> None:
    """The multiply-add roof of this CPU (1 and 2 threads) and the pp512 ceiling it puts on a kernel that spends all
    its time multiplying: bf16 pairs (the W4A16 kernel's vdpbf16ps tiles), fp32 (its fp32 tiles' vfmadd231ps) and
    int8 (the W4A8 kernel's vpdpbusd)."""
    import tempfile

    from edgeq.cpu import flags

    missing = {"avx512f", "avx512_bf16", "avx512_vnni"} - flags()
    if missing:
        raise SystemExit(f"peak measures AVX512-BF16 and AVX512-VNNI instructions; this CPU lacks {', '.join(sorted(missing))}")
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "peak.cpp", Path(d) / "peak"
        src.write_text(_PEAK_SRC)
        subprocess.run(["g++", "-O2", "-std=c++17", "-pthread", "-mavx512f", "-mavx512bf16", "-mavx512vnni", str(src),
                        "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    for line in out.split("\n"):
        if not line.strip():
            continue
        threads, bf16, int8, f32 = (float(v) if i else v for i, v in enumerate(line.split()))
        print(f"{threads} thread(s): vdpbf16ps {bf16:.1f} GMAC/s, vpdpbusd {int8:.1f} GMAC/s, vfmadd231ps {f32:.1f} "
              f"GMAC/s")
        for model, macs in _PREFILL_MACS.items():
            print(f"  {model} linears ({macs / 1e9:.2f} GMAC a token): ceiling {bf16 * 1e9 / macs:.0f} tok/s bf16 "
                  f"pairs, {f32 * 1e9 / macs:.0f} tok/s fp32, {int8 * 1e9 / macs:.0f} tok/s int8")


def kernel_calls(args) -> None:
    """The native W4A16 kernel's time per call on L2-resident weights (768 x 1536: compute, not memory): best and
    median of 9 runs of 300 calls, for M = 1 (g128, g32), 2 and 8. To compare two builds, run it in a checkout of
    each, alternating (each checkout builds its own library)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kernel import arm_fn, make_weights

    for m, g in ((1, 128), (1, 32), (2, 128), (8, 128)):
        (_, qw, sz), = make_weights([("w", 768, 1536)], g)
        x = torch.randn(m, 1536).to(torch.bfloat16)
        f = arm_fn("native", g)
        ts = _call_times_us(lambda: f(x, qw, sz), 9, 300, 100)
        print(f"M = {m}, g{g}: best {ts[0]:.1f} us, median {ts[4]:.1f} us")


def prefill_calls(args) -> None:
    """The native W4A16 kernel at prefill sizes, each kind of the avx512 path's M > 8 tiles (bf16 pairs, fp32) and
    the aten op: ms per call (median of 5 runs of 2 calls, the arms interleaved run by run, and the best) and GMAC/s
    for the Qwen2.5-1.5B MLP shapes (gate/up 8960 x 1536, down 1536 x 8960, g128) at M = 64 and --prompt (512)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kernel import make_weights

    from edgeq.layouts import tinygemm
    from edgeq.runtime import native

    print(f"measured choice here: {native.prefill_tiles()} tiles")
    arms = {"bf16 tiles": lambda x, qw, sz: native.int4_mm(x, qw, 128, sz, isa="avx512", prefill="bf16"),
            "fp32 tiles": lambda x, qw, sz: native.int4_mm(x, qw, 128, sz, isa="avx512", prefill="fp32"),
            "aten": lambda x, qw, sz: tinygemm.mm(x, qw, 128, sz)}
    for n, k in ((8960, 1536), (1536, 8960)):
        (_, qw, sz), = make_weights([("w", n, k)], 128)
        for m in (64, args.prompt):
            x = torch.randn(m, k).to(torch.bfloat16)
            times = {a: [] for a in arms}
            for _ in range(5):
                for a, f in arms.items():
                    times[a] += _call_times_us(lambda f=f: f(x, qw, sz), 1, 2, 1)
            for a, ts in times.items():
                ts.sort()
                print(f"{n} x {k}, M = {m}, {a}: median {ts[2] / 1e3:.2f} ms [best {ts[0] / 1e3:.2f}] "
                      f"({m * n * k / ts[2] / 1e3:.1f} GMAC/s)")


def w4a8_calls(args) -> None:
    """The native W4A8 kernel at prefill size: ms per call (median and best of 7 calls after one) and GMAC/s for the
    Qwen2.5-1.5B MLP shapes (gate/up 8960 x 1536, down 1536 x 8960, g128) at M = --prompt (512). To compare two
    builds, run it in a checkout of each, alternating (each checkout builds its own library)."""
    from edgeq.route.timing import _weights
    from edgeq.runtime.native import w4a8

    gen = torch.Generator().manual_seed(0)
    for n, k in ((8960, 1536), (1536, 8960)):
        p = _weights(n, k, 128, gen)["w4a8"]
        x = torch.randn(args.prompt, k, generator=gen).to(torch.bfloat16)
        ts = _call_times_us(lambda: w4a8.w4a8_mm(x, p.qweight, p.scales, p.zeros, 128), 7, 1, 1)
        print(f"{n} x {k}, M = {args.prompt}: median {ts[3] / 1e3:.2f} ms [best {ts[0] / 1e3:.2f}] "
              f"({args.prompt * n * k / ts[3] / 1e3:.0f} GMAC/s), isa {w4a8.status()['isa']}")


def kernel_precision(args) -> None:
    """The native W4A16 kernel against aten and the fp64 reference on its worst case for rounding (N = 512,
    K = 4096, g128; activations of mean 1 with channels of 300 and -200): share of outputs that differ from aten's,
    worst error in bf16 ulps of the reference, and the largest error relative to the tests' bound."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers.native import excess, outlier_activations, problem

    from edgeq.layouts import tinygemm
    from edgeq.runtime import native

    here = tinygemm.probe()
    for m in (1, 4, 8):  # the problem of test_native.py's test_offset_encoding_within_tolerance_on_outlier_activations
        x, qw, sz, ref, bound = problem(m, 512, 4096, 128, seed=1, layout=here, x=outlier_activations(m, 4096))
        ulp = (ref.abs().clamp_min(1e-30).log2().floor() - 7).exp2()
        aten = tinygemm.mm(x, qw, 128, sz)
        for isa in native.status()["cpu_isas"]:
            y = native.int4_mm(x, qw, 128, sz, isa=isa)
            print(f"M = {m}, {isa}: differ from aten {100 * float((y != aten).double().mean()):.2f}%, worst "
                  f"{float(((y.double() - ref).abs() / ulp).max()):.1f} ulps (aten "
                  f"{float(((aten.double() - ref).abs() / ulp).max()):.1f}), excess {excess(y, ref, bound):.3f} "
                  f"(aten {excess(aten, ref, bound):.3f})")


def token_bytes(args) -> None:
    """Bytes one decoded token reads from the weights: every tensor of the checkpoint but the input embedding's own
    tables (a lookup reads one row; a packed table's level 0 is the head, read whole, so it counts as the head; with
    ``--head-levels 2`` the head reads the residual level too, and it counts), and
    for a GGUF every tensor but ``token_embd`` when the file has an ``output`` head (tied: the table is the head)."""
    from edgeq.io.manifest import read_manifest
    from edgeq.io.safetensors import parse_header

    tensors = [t for f in sorted(Path(args.checkpoint).glob("*.safetensors")) for t in parse_header(f).tensors.values()]
    total = sum(t.nbytes for t in tensors)
    embed = sum(t.nbytes for t in tensors if "embed_tokens" in t.name)
    if len(read_manifest(Path(args.checkpoint)).head_levels) > 1:  # --head-levels 2: the head reads the residual level
        embed = 0
    print(f"{args.checkpoint}: {(total - embed) / 1e6:.1f} MB a token ({total / 1e6:.1f} MB of tensors, "
          f"{embed / 1e6:.1f} MB embedding tables not read whole)")
    if args.gguf:
        from gguf import GGUFReader

        tensors = {t.name: int(t.n_bytes) for t in GGUFReader(args.gguf).tensors}
        skip = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0
        print(f"{args.gguf}: {(sum(tensors.values()) - skip) / 1e6:.1f} MB a token "
              f"({'untied: token_embd not counted' if skip else 'tied: token_embd is the head'})")


def gptq_time(args) -> None:
    """Seconds of one ``gptq_quantize`` call per group-parameter choice, on Qwen2.5-1.5B's gate_proj and down_proj
    shapes (random weights, a Hessian from 2,048 random inputs, g128), and ``--method rtn`` of the same weight."""
    from edgeq.quantize import rtn
    from edgeq.quantize.gptq import GROUP_PARAMS, gptq_quantize

    gen = torch.Generator().manual_seed(0)
    for n, k in ((8960, 1536), (1536, 8960)):
        w = torch.randn(n, k, generator=gen) * 0.02
        x = torch.randn(2048, k, generator=gen)
        h = 2 / 2048 * x.t() @ x
        for how in GROUP_PARAMS:
            t = time.perf_counter()
            gptq_quantize(w, h, 128, group_params=how)
            print(f"{n} x {k}: gptq {how} {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        rtn.quantize_groups(w, 128, "rtn")
        print(f"{n} x {k}: rtn {time.perf_counter() - t:.1f} s")


def sample_rows(args) -> None:
    """``--calib self`` sampling time per rows-per-batch cap: one ``sample_windows`` call per fresh process, arms
    interleaved ``--passes`` times (the cap is ``selfcal.MAX_ROWS``, the KV budget lifted so that it binds; the
    batches are still balanced; ``default``: the shipped cap and budget). Prints seconds, the rows a batch held,
    peak RSS (VmHWM) and peak anonymous memory (sampled every 0.2 s) and the ids' sha256 prefix."""
    for _ in range(args.passes):
        for rows in args.rows.split(","):
            subprocess.run([sys.executable, __file__, "sample-rows-one", args.checkpoint, "--rows", rows,
                            "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen),
                            "--threads", str(args.threads)], check=True)


def sample_rows_one(args) -> None:
    import threading

    from edgeq.bench import measure
    from edgeq.convert import selfcal

    anon = [0]

    def watch() -> None:  # the kernel keeps RSS's peak (VmHWM), not RssAnon's
        while True:
            anon[0] = max(anon[0], measure.status().anon)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    if args.rows != "default":  # else the shipped cap, KV budget and balancing
        selfcal.MAX_ROWS, selfcal.KV_BUDGET = int(args.rows), 1 << 40
    t = time.perf_counter()
    _, rec = selfcal.sample_windows(args.checkpoint, args.nsamples, args.seqlen, seed=0)
    print(f"cap {args.rows}: {time.perf_counter() - t:.1f} s, {rec['rows_per_batch']} rows a batch, peak RSS "
          f"{measure.status().hwm >> 20} MiB (anon {anon[0] >> 20} MiB), ids {rec['ids_sha256'][:12]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("probe", choices=["profile-prefill", "shapes", "sdpa", "embedding-rss", "w4a8-scalar",
                                          "verify-cost", "pmd-map", "huge-pages", "peak", "kernel-calls",
                                          "prefill-calls", "w4a8-calls", "kernel-precision", "token-bytes", "gptq-time",
                                          "sample-rows", "sample-rows-one"])
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--cat", action="store_true", help="embedding-rss: read the files sequentially first")
    ap.add_argument("--passes", type=int, default=12, help="huge-pages: interleaved passes")
    ap.add_argument("--gguf", default=None, help="token-bytes: a GGUF file to count too")
    ap.add_argument("--rows", default="31,128",
                    help="sample-rows: rows-per-batch caps, comma-separated ('default': as shipped)")
    ap.add_argument("--nsamples", type=int, default=128, help="sample-rows: windows")
    ap.add_argument("--seqlen", type=int, default=32, help="sample-rows: tokens per window")
    ap.add_argument("--model", choices=["qwen", "llama"], default="qwen", help="shapes: Qwen2.5-1.5B or Llama-3.2-1B")
    ap.add_argument("--groups", default="128", help="shapes: group sizes, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.probe in ("profile-prefill", "embedding-rss", "verify-cost", "pmd-map", "huge-pages", "token-bytes",
                      "sample-rows", "sample-rows-one") and not args.checkpoint:
        ap.error(f"{args.probe} needs CHECKPOINT")
    if args.probe == "sample-rows-one":
        return sample_rows_one(args)
    print(f"# {args.probe}: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
          f"threads {args.threads}")
    {"profile-prefill": profile_prefill, "shapes": shapes, "sdpa": sdpa, "embedding-rss": embedding_rss,
     "w4a8-scalar": w4a8_scalar, "verify-cost": verify_cost, "pmd-map": pmd_map, "huge-pages": huge_pages,
     "peak": peak, "kernel-calls": kernel_calls, "prefill-calls": prefill_calls, "w4a8-calls": w4a8_calls,
     "kernel-precision": kernel_precision, "token-bytes": token_bytes,
     "gptq-time": gptq_time, "sample-rows": sample_rows}[args.probe](args)


if __name__ == "__main__":
    main()
