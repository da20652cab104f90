"""Decode loop benchmark: edgeq's lean decode step vs the transformers forward, and what each costs besides the matmuls.

Arms (each pass of each arm is a fresh process; arms are interleaved pass by pass, the order rotated every pass):

- ``lean/native``, ``transformers/native``: the two decode loops (``EDGEQ_DECODE_LOOP``) on the default kernel;
- ``lean/aten``, ``transformers/aten``: the same with the native kernel disabled (``EDGEQ_NATIVE_ISA=off``), so
  every projection runs ``aten._weight_int4pack_mm_for_cpu``;
- ``lean/noop``, ``transformers/noop``: every quantised projection replaced by a no-op returning a preallocated zero
  tensor of its output shape (``Int4Linear.linear2d`` patched before load): the time per token is the loop's own
  cost outside the matmuls (norms, RoPE, cache writes, attention, residuals, argmax, Python).

One pass: load (``threads``, prefill threshold fixed so no crossover probe runs), a warm-up request, then the timed
request through ``edgeq.runtime.generate_ids``: a ``--prompt``-token prefill and ``--gen`` decode steps (tg128 after
pp64 by default), greedy, EOS ignored. Real-kernel arms then replay the decode step's linear calls alone (every
projection and the head, in order, on random inputs of the same shapes, ``--replay-steps`` times): *decode per
token minus linears per token* is a second estimate of the overhead. The pass fails when the counters contradict the arm (the loop that ran, the
kernel path counted).

    python benchmarks/synthetic.py qwen2.5-1.5b /tmp/q15-hf && edgeq quantize /tmp/q15-hf -o /tmp/q15 --method minmax
    python benchmarks/bench_decode.py /tmp/q15 --passes 3 --threads 2 --json /tmp/decode.json
    python benchmarks/bench_decode.py edgeq-quantized-tiny-prose/ --arms lean/native,transformers/native
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("lean/native", "transformers/native", "lean/aten", "transformers/aten", "lean/noop", "transformers/noop")


# ------------------------------------------------------------------------------------------------------ worker


def _noop_linears() -> None:
    """Replace every Int4Linear's compute by a preallocated zero tensor [M, N] (per module and M); still counted."""
    import torch

    from edgeq.runtime.qlinear import Int4Linear

    zeros: dict = {}

    def linear2d(self, x2):
        key = (id(self), x2.shape[0])
        z = zeros.get(key)
        if z is None:
            z = zeros[key] = torch.zeros(x2.shape[0], self.out_features, dtype=torch.bfloat16)
        rt = self.runtime
        rt.counts["dequant_prefill" if x2.shape[0] >= rt.prefill_threshold else rt.decode_path] += 1
        return z

    Int4Linear.linear2d = linear2d


def _decode_linears(lm) -> list:
    """The quantised modules one decode step calls, in order: per layer q, k, v, o, gate, up, down; then the head."""
    mods = []
    for layer in lm.model.model.layers:
        a, m = layer.self_attn, layer.mlp
        mods += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    return mods + [lm.model.lm_head]


def _replay_linears(lm, steps: int) -> tuple[float, float]:
    """(wall s, cpu s) of ``steps`` decode steps' linear calls alone, on random inputs of the same shapes."""
    import torch

    mods = _decode_linears(lm)
    g = torch.Generator().manual_seed(0)
    xs = {k: (torch.randn(1, k, generator=g) * 0.5).to(torch.bfloat16) for k in {m.in_features for m in mods}}
    calls = [(m.linear2d, xs[m.in_features]) for m in mods]
    with torch.inference_mode():
        for fn, x in calls:  # warm-up: one step
            fn(x)
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            for fn, x in calls:
                fn(x)
        return time.perf_counter() - w0, time.process_time() - c0


def worker(spec: dict) -> dict:
    loop, kernel = spec["arm"].split("/")
    if kernel == "noop":
        _noop_linears()
    import random

    import torch

    from edgeq.runtime import generate_ids, load
    from edgeq.runtime import native

    t0 = time.perf_counter()
    lm = load(spec["checkpoint"], threads=spec["threads"], prefill_threshold=spec["prefill_threshold"],
              max_model_len=spec["prompt"] + spec["gen"] + 8, kv_cache_bytes="64MiB")
    load_s = time.perf_counter() - t0
    s = lm.settings
    vocab = int(lm.config.get_text_config(decoder=True).vocab_size)
    rng = random.Random(spec["seed"])
    ids = [rng.randrange(vocab) for _ in range(spec["prompt"])]
    generate_ids(lm, ids, 3)  # warm-up (first calls allocate, the kernel's plan is built)
    lm.reset_counts()
    native_before = native.call_count() if lm.runtime.native is not None else None
    la0 = os.getloadavg()[0]
    c0 = time.process_time()
    out, prefill_s, ttft_s, decode_s = generate_ids(lm, ids, spec["gen"] + 1)
    cpu_s = time.process_time() - c0
    problems = []
    if s.decode_loop != loop:
        problems.append(f"settings.decode_loop is {s.decode_loop}, the arm asked for {loop}")
    want = {"lean": {"lean": spec["gen"], "transformers": 1}, "transformers": {"transformers": spec["gen"] + 1}}[loop]
    if dict(lm.loop_counts) != want:
        problems.append(f"loop counts {dict(lm.loop_counts)}, expected {want}")
    want_path = "tinygemm_decode" if kernel == "aten" else ("native_decode" if kernel == "native" else s.decode_path)
    if s.decode_path != want_path:
        problems.append(f"settings.decode_path is {s.decode_path}, the arm needs {want_path}")
    step_calls = len(_decode_linears(lm)) * spec["gen"]
    if lm.path_counts.get(s.decode_path, 0) < step_calls:
        problems.append(f"{s.decode_path} counted {lm.path_counts.get(s.decode_path, 0)} < {step_calls} decode calls")
    if native_before is not None and kernel == "native":
        n = native.call_count() - native_before
        if n != lm.path_counts["native_decode"]:
            problems.append(f"native kernel ran {n} calls, the runtime counted {lm.path_counts['native_decode']}")
    steps = spec["replay_steps"]
    replay = _replay_linears(lm, steps) if kernel != "noop" else None
    gen = spec["gen"]
    linear_ms = 1e3 * replay[0] / steps if replay else None
    return {
        "arm": spec["arm"], "pass": spec["pass"], "ok": not problems, "problems": problems,
        "load_s": load_s, "prefill_s": prefill_s, "ttft_s": ttft_s, "decode_s": decode_s, "decode_cpu_s": cpu_s,
        "tok_s": gen / decode_s, "ms_per_token": 1e3 * decode_s / gen, "cpu_ms_per_token": 1e3 * cpu_s / gen,
        "linear_ms_per_token": linear_ms,
        "overhead_ms_per_token": 1e3 * decode_s / gen - (linear_ms or 0.0),
        "loadavg_before": la0, "loadavg_after": os.getloadavg()[0],
        "threads": torch.get_num_threads(), "settings": {"decode_loop": s.decode_loop, "decode_path": s.decode_path,
                                                          "lean_bytes": s.lean_bytes, "threads": s.threads},
        "native": native.status()["isa"] if lm.runtime.native is not None else None,
        "paths": dict(lm.path_counts), "loops": dict(lm.loop_counts), "ids_head": out[:8],
    }


# ------------------------------------------------------------------------------------------------------ parent


def run_pass(args, arm: str, i: int) -> dict:
    spec = {"checkpoint": str(args.checkpoint), "arm": arm, "pass": i, "threads": args.threads, "prompt": args.prompt,
            "gen": args.gen, "prefill_threshold": args.prefill_threshold, "seed": 0, "replay_steps": args.replay_steps}
    loop, kernel = arm.split("/")
    env = {**os.environ, "EDGEQ_DECODE_LOOP": loop}
    if kernel == "aten":
        env["EDGEQ_NATIVE_ISA"] = "off"
    else:
        env.pop("EDGEQ_NATIVE_ISA", None)
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"arm": arm, "pass": i, "ok": False, "problems": [proc.stderr.strip()[-2000:]]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def summarize(results: list[dict], arms: list[str]) -> dict:
    by_arm = {a: [r for r in results if r["arm"] == a and r["ok"]] for a in arms}
    table = {}
    for a, rs in by_arm.items():
        if not rs:
            continue
        row = {"passes": len(rs)}
        for key in ("tok_s", "ms_per_token", "cpu_ms_per_token", "overhead_ms_per_token", "linear_ms_per_token", "prefill_s"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            if vals:
                row[key] = _stats(vals)
        table[a] = row
    ratios = {}
    for kernel in ("native", "aten", "noop"):
        lean, hf = by_arm.get(f"lean/{kernel}", []), by_arm.get(f"transformers/{kernel}", [])
        pairs = [(a["tok_s"] / b["tok_s"]) for a in lean for b in hf if a["pass"] == b["pass"]]
        if pairs:
            ratios[f"lean/transformers tok/s ({kernel})"] = _stats(pairs)
    for loop in ("lean", "transformers"):
        nat, aten = by_arm.get(f"{loop}/native", []), by_arm.get(f"{loop}/aten", [])
        pairs = [(a["tok_s"] / b["tok_s"]) for a in nat for b in aten if a["pass"] == b["pass"]]
        if pairs:
            ratios[f"native/aten tok/s ({loop})"] = _stats(pairs)
    return {"arms": table, "ratios": ratios}


def markdown(summary: dict) -> str:
    f = lambda t, d=1: f"{t[0]:.{d}f} [{t[1]:.{d}f}-{t[2]:.{d}f}]"  # noqa: E731
    lines = ["| arm | passes | tg tok/s | ms/token | CPU ms/token | overhead ms/token | linears alone ms/token |",
             "|---|---|---|---|---|---|---|"]
    for arm, row in summary["arms"].items():
        lines.append(f"| {arm} | {row['passes']} | {f(row['tok_s'])} | {f(row['ms_per_token'])} | {f(row['cpu_ms_per_token'])} | "
                     f"{f(row['overhead_ms_per_token'], 2)} | "
                     f"{f(row['linear_ms_per_token']) if 'linear_ms_per_token' in row else '-'} |")
    lines += ["", "| ratio (paired by pass) | median [min-max] |", "|---|---|"]
    lines += [f"| {k} | {f(v, 2)} |" for k, v in summary["ratios"].items()]
    return "\n".join(lines)


def machine() -> dict:
    cpu = "?"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "date": dt.datetime.now().isoformat(timespec="minutes"), "capability": torch.backends.cpu.get_cpu_capability()}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prefill-threshold", type=int, default=16, help="fixed crossover: no probe at load")
    ap.add_argument("--replay-steps", type=int, default=32, help="decode steps of linear calls replayed alone")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        sys.exit(f"unknown arms {bad}; choose from {', '.join(ARMS)}")
    info = machine()
    print(f"# {args.checkpoint}: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {args.threads} threads, "
          f"pp{args.prompt} + tg{args.gen}, {args.passes} passes, {info['date']}", flush=True)
    results = []
    for i in range(args.passes):
        order = arms[i % len(arms):] + arms[: i % len(arms)]  # rotate: no arm always first or last
        for arm in order:
            r = run_pass(args, arm, i)
            results.append(r)
            status = f"{r['tok_s']:.2f} tok/s, overhead {r['overhead_ms_per_token']:.2f} ms/token" if r["ok"] else f"FAILED {r['problems']}"
            print(f"pass {i} {arm}: {status} (load avg {r.get('loadavg_before', float('nan')):.1f})", flush=True)
    summary = summarize(results, arms)
    print(markdown(summary))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
