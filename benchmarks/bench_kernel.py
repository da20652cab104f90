"""Kernel-only decode benchmark: aten `_weight_int4pack_mm_for_cpu` vs edgeq's native kernel, DRAM-resident weights.

One "pass" runs one decode step's worth of matmuls of a real model shape (every layer's q, k, v, o, gate, up, down
and the 4-bit head; Qwen2.5-1.5B: 28 layers, 0.82 GB packed), each weight its own tensor, so nothing stays in the
300 MB L3 between uses. Arms are interleaved pass by pass (A B, then B A, ...) on the same weights and activations;
the report gives median / min / max over passes of GB/s of packed weight bytes read (qweight + scales_and_zeros)
and the median of the per-pass ratios time(aten) / time(arm). Wall-clock time: on a shared machine, other processes
slow both arms alike, and the spread shows how much. With --threads 1 a "cpu GB/s" column (bytes per second of
CPU time the thread got) shows the kernel's own speed when the machine is oversubscribed. With 2 threads, if any
other process is runnable, libgomp's default spin-waiting makes every call wait for a time slice (measured: all
arms 10-20x slower than 1 thread); run with OMP_WAIT_POLICY=PASSIVE there (printed in the header).

    python benchmarks/bench_kernel.py                         # qwen2.5-1.5b shapes, M = 1, 4, 8, 2 threads, 5 passes
                                                              # arms aten, native, read (the memory roof)
    python benchmarks/bench_kernel.py --arms aten,avx512,avx2 --m 1 --passes 7 --json /tmp/kernel.json
    python benchmarks/bench_kernel.py --model llama-3.2-1b
    python benchmarks/bench_kernel.py --only down --group 256 --m 1   # one kind of matrix: every layer's down_proj
    python benchmarks/bench_kernel.py --arms avx2:narrow,avx2 --m 8,512   # ISA:TILES -> native.int4_mm(prefill=TILES)
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_kernel.py   # on a machine other processes also use
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time

import torch

from edgeq.layouts import tinygemm
from edgeq.runtime import native

# (hidden, intermediate, layers, q_out, kv_out, vocab): the Linear shapes of one decode step, N x K.
MODELS = {
    "qwen2.5-1.5b": (1536, 8960, 28, 1536, 256, 151936),
    "llama-3.2-1b": (2048, 8192, 16, 2048, 512, 128256),
}


def step_shapes(model: str, layers: int | None) -> list[tuple[str, int, int]]:
    h, i, n_layers, q, kv, vocab = MODELS[model]
    per_layer = [("q", q, h), ("k", kv, h), ("v", kv, h), ("o", h, q), ("gate", i, h), ("up", i, h), ("down", h, i)]
    shapes = [(f"{n}{li}", rows, cols) for li in range(layers or n_layers) for n, rows, cols in per_layer]
    return shapes + [("head", vocab, h)]


def make_weights(shapes, group: int, seed: int = 0):
    """Random packed bytes and scales: kernel speed does not depend on the values (no data-dependent branches)."""
    g = torch.Generator().manual_seed(seed)
    mats = []
    for name, n, k in shapes:
        qw = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        sz = torch.empty(k // group, n, 2, dtype=torch.bfloat16)
        sz[..., 0] = 0.01
        sz[..., 1] = 0.0
        mats.append((name, qw, sz))
    return mats


def packed_bytes(mats) -> int:
    return sum(qw.numel() + sz.numel() * sz.element_size() for _, qw, sz in mats)


def _read(x, qw, sz):
    """The memory roof: read the same packed bytes with torch's (vectorised, multi-accumulator) int64 sum."""
    return qw.view(-1).view(torch.int64).sum() + sz.view(-1).view(torch.int64).sum()


def arm_fn(arm: str, group: int):
    if arm == "aten":
        return lambda x, qw, sz: tinygemm.mm(x, qw, group, sz)
    if arm == "read":
        return _read
    isa, _, tiles = arm.partition(":")  # e.g. avx2:narrow, avx512:fp32 (native.int4_mm's prefill=)
    isa = None if isa == "native" else isa
    return lambda x, qw, sz: native.int4_mm(x, qw, group, sz, isa=isa, prefill=tiles or None)


def run_pass(fn, mats, xs) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread: with one thread, the time the kernel had a core)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _, qw, sz in mats:
        fn(xs[qw.shape[1] * 2], qw, sz)
    return time.perf_counter() - t0, time.thread_time() - c0


def check(arms, mats, group: int) -> None:
    """Refuse to time a kernel that disagrees with aten on the first matrix (1 bf16 ulp on >5% of outputs)."""
    _, qw, sz = mats[0]
    x = torch.randn(3, qw.shape[1] * 2).to(torch.bfloat16)
    ref = tinygemm.mm(x, qw, group, sz)
    for arm in (a for a in arms if a != "read"):
        y = arm_fn(arm, group)(x, qw, sz)
        if float((y != ref).double().mean()) > 0.05:
            raise SystemExit(f"{arm}: disagrees with aten on {mats[0][0]}; not timing it")


def bench(arms, mats, ms, passes: int, group: int) -> list[dict]:
    nbytes = packed_bytes(mats)
    rows = []
    for m in ms:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {qw.shape[1] * 2 for _, qw, _ in mats}}
        fns = {arm: arm_fn(arm, group) for arm in arms}
        for fn in fns.values():  # warm-up: page in, build plans, spin up the thread pool
            run_pass(fn, mats[:8], xs)
        times = {arm: [] for arm in arms}
        cpu = {arm: [] for arm in arms}
        for p in range(passes):
            order = arms if p % 2 == 0 else list(reversed(arms))
            for arm in order:
                wall, c = run_pass(fns[arm], mats, xs)
                times[arm].append(wall)
                cpu[arm].append(c)
        for arm in arms:
            gbs = [nbytes / t / 1e9 for t in times[arm]]
            row = {
                "m": m,
                "arm": arm,
                "gb_s_median": statistics.median(gbs),
                "gb_s_min": min(gbs),
                "gb_s_max": max(gbs),
                "ms_per_step_median": 1e3 * statistics.median(times[arm]),
            }
            if torch.get_num_threads() == 1:  # CPU time is only the kernel's own work with one thread
                row["cpu_gb_s_median"] = statistics.median(nbytes / c / 1e9 for c in cpu[arm])
            if arm != arms[0]:
                ratios = [b / a for a, b in zip(times[arm], times[arms[0]])]  # time(base) / time(arm), per pass
                row["speedup_vs_" + arms[0]] = statistics.median(ratios)
                row["speedup_min"], row["speedup_max"] = min(ratios), max(ratios)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model (less memory; keep > 300 MB)")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--only", default=None, help="only these matrix kinds of the step, e.g. down or gate,up (every "
                    "layer's; GB/s and ms then count those matrices alone)")
    ap.add_argument("--m", default="1,4,8", help="activation rows, comma separated")
    ap.add_argument("--arms", default="aten,native,read",
                    help="aten, native (auto ISA), amx, avx512, avx2, scalar; read = a plain read of the same bytes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    arms = a.arms.split(",")
    st = native.status()
    if any(arm not in ("aten", "read") for arm in arms) and not st["available"]:
        raise SystemExit(f"native kernel unavailable: {st['reason']}")
    shapes = [sh for sh in step_shapes(a.model, a.layers) if not a.only or sh[0].rstrip("0123456789") in a.only.split(",")]
    if not shapes:
        raise SystemExit(f"--only {a.only}: no matrix of that kind; kinds: q, k, v, o, gate, up, down, head")
    mats = make_weights(shapes, a.group)
    nbytes = packed_bytes(mats)
    check(arms, mats, a.group)
    load_before = os.getloadavg()
    started = dt.datetime.now().isoformat(timespec="seconds")
    rows = bench(arms, mats, [int(v) for v in a.m.split(",")], a.passes, a.group)
    meta = {
        "started": started,
        "finished": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "cpu": _cpu_name(),
        "threads": a.threads,
        "torch": torch.__version__,
        "native_isa": st["isa"],
        "model": a.model,
        "matmuls_per_pass": len(mats),
        "packed_bytes_per_pass": nbytes,
        "group": a.group,
        "passes": a.passes,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
    }
    print(json.dumps(meta))
    cpu_col = a.threads == 1
    print(f"{'M':>3} {'arm':>8} {'GB/s med':>9} {'min':>6} {'max':>6} {'ms/step':>8}"
          + (f" {'cpu GB/s':>9}" if cpu_col else "") + "  speedup (min..max)")
    for r in rows:
        sp = next((k for k in r if k.startswith("speedup_vs_")), None)
        extra = f"  {r[sp]:.2f}x ({r['speedup_min']:.2f}..{r['speedup_max']:.2f}) vs {sp[11:]}" if sp else ""
        cpu_txt = f" {r['cpu_gb_s_median']:9.2f}" if cpu_col else ""
        print(f"{r['m']:>3} {r['arm']:>8} {r['gb_s_median']:9.2f} {r['gb_s_min']:6.2f} {r['gb_s_max']:6.2f} "
              f"{r['ms_per_step_median']:8.1f}{cpu_txt}{extra}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
