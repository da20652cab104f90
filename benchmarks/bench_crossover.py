"""The prefill crossover at work: a pp prompt with the crossover the runtime measured vs given thresholds, in one
process, interleaved, on one loaded W4A16 checkpoint (docs/kernel.md, "Prefill crossover").

A prompt of M tokens runs every projection on the int4 kernel when M < threshold, else dequantise + bf16 GEMM. The
load measures the threshold (edgeq/runtime/crossover.py); this times the prefill of ``--prompt-len`` tokens under
that threshold and under each ``--thresholds`` value, arms interleaved A B C A B C ..., ``--passes`` each, and prints
the median prefill tokens/s with min and max per arm and the ratio of each to the measured arm's median.

    python benchmarks/bench_crossover.py /tmp/edgeq-e2e/qwen2.5-1.5b-w4a16-g128 --thresholds 444,1025

(1025: the kernel for every M of the prompt; 1: always dequantise.) Run it on a quiet machine; it reports, it does
not judge.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from edgeq.runtime import load
from edgeq.runtime.generation import generate_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--thresholds", default="1025", help="comma-separated prefill thresholds to compare")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    lm = load(args.checkpoint, max_model_len=args.prompt_len + 8, threads=args.threads)
    s = lm.settings
    measured = s.prefill_crossover
    arms = {f"measured ({measured}, {s.crossover_source})": measured}
    arms.update({f"threshold {t}": int(t) for t in args.thresholds.split(",")})
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_len)]
    times: dict[str, list[float]] = {a: [] for a in arms}
    generate_ids(lm, prompt, 1)  # warm-up: first calls allocate
    for _ in range(args.passes):
        for arm, threshold in arms.items():
            lm.runtime.prefill_threshold = threshold
            _, prefill_s, _, _ = generate_ids(lm, prompt, 1)
            times[arm].append(prefill_s)
    base = statistics.median(times[next(iter(arms))])
    rows = []
    for arm, ts in times.items():
        tps = [args.prompt_len / t for t in ts]
        rows.append({"arm": arm, "pp_tokens_per_s": round(statistics.median(tps), 1), "min": round(min(tps), 1),
                     "max": round(max(tps), 1), "ratio_to_measured": round(base / statistics.median(ts), 3)})
    print(json.dumps({"checkpoint": args.checkpoint, "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
                      "passes": args.passes, "decode_path": s.decode_path, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
