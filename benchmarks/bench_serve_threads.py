"""Where `edgeq serve`'s decode time went (docs/vllm.md, "Where edgeq was slower, and why"): three in-process probes
on one W4A16 checkpoint, prompt 128 token ids, 128 greedy tokens, 3 passes each, decode tokens/s per pass.

    python benchmarks/bench_serve_threads.py CKPT --mode loop      # bare argmax loop vs the server's loop, main thread
    python benchmarks/bench_serve_threads.py CKPT --mode threads   # load on main; generate on main, then on a worker
    python benchmarks/bench_serve_threads.py CKPT --mode one       # load and generate on the same worker thread

``loop``: `generate_ids` (argmax only) vs `Generation` (the server's iterator: sampling, a finiteness check and
detokenising every step), interleaved. ``threads``: the server's old shape (torch work on two OS threads, so two
OpenMP teams), passes interleaved main / worker. ``one``: the server's shape now. Run each mode in a fresh process
(``threads`` leaves two teams behind by design) on a quiet machine; it reports, it does not judge.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor

PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(128)]


def _setup(checkpoint: str):
    from edgeq.runtime import load

    return load(checkpoint, max_model_len=272, threads=2)


def _server_loop(lm) -> float:
    from edgeq.runtime.generation import Generation, SamplingParams

    g = Generation(lm, PROMPT, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    for _ in g:
        pass
    return (len(g.result.token_ids) - 1) / g.result.decode_seconds


def _bare_loop(lm) -> float:
    from edgeq.runtime.generation import generate_ids

    ids, _, _, decode_s = generate_ids(lm, PROMPT, 128)
    return (len(ids) - 1) / decode_s


def _report(label: str, tps: list[float]) -> None:
    print(f"{label:<40} {[round(x, 1) for x in tps]}  median {statistics.median(tps):.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--mode", choices=("loop", "threads", "one"), required=True)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    pool = ThreadPoolExecutor(max_workers=1)
    if args.mode == "one":
        lm = pool.submit(_setup, args.checkpoint).result()
        pool.submit(_server_loop, lm).result()  # warm-up
        _report("load + generate on one worker thread", [pool.submit(_server_loop, lm).result() for _ in range(args.passes)])
        return
    lm = _setup(args.checkpoint)
    _server_loop(lm)  # warm-up
    first, second = [], []
    for _ in range(args.passes):
        if args.mode == "loop":
            first.append(_bare_loop(lm))
            second.append(_server_loop(lm))
        else:
            first.append(_server_loop(lm))
            second.append(pool.submit(_server_loop, lm).result())
    labels = ("generate_ids (argmax only)", "Generation (the server's loop)") if args.mode == "loop" else \
        ("main thread (loaded here)", "worker thread (second OpenMP team)")
    _report(labels[0], first)
    _report(labels[1], second)


if __name__ == "__main__":
    main()
