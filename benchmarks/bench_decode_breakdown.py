"""Where one decode step's time goes: kernel matmuls, attention, the rest of the ops, and what is left (Python,
dispatch, OpenMP fork/join), at given context lengths, for each arm of the step's ops, in one process.

For each context length: the prompt (random ids) is prefilled once per pass, then ``--steps`` greedy decode steps
(``lm.decode_step`` + argmax, as ``edgeq.runtime.generate_ids`` does) are timed. Arms (``--ops``: edgeq's native
decode ops, or torch's eager ops with SDPA) switch the loaded decoder's ops in place, so both arms use the
same mapped weights and cache; they are interleaved pass by pass (order rotated), ``--passes`` times, median [min-max]
reported. Then one profiled run per arm and context (torch.profiler, self CPU time per op, summed per token):

- ``matmul kernel``: the quantised projections (``edgeq::int4_mm``, aten's int4 op, the W4A8 ops, bf16 linears);
- ``head``: the same ops whose weight has the vocabulary's rows;
- ``attention``: ``edgeq::decode_attn`` or SDPA;
- ``norms, RoPE, elementwise``: every other op (RMSNorm, RoPE, cache writes, residual adds, silu, mul; the native
  ``edgeq::add_rms_norm`` and ``edgeq::rope_to_cache``);
- ``argmax``: the greedy pick (and its finiteness check: edgeq.runtime.generation.greedy);
- ``layers in one call``: ``edgeq::decode_layers``, the native step's layers in one op (edgeq.runtime.stack): its
  matmuls, attention and norms are inside it, out of the profiler's sight (its silu and mul show as their own ops);
- ``left``: the unprofiled step time minus all of the above (Python, dispatch, OpenMP fork/join; the profiler
  inflates op times a little, so this is a lower estimate).

``kernel only`` replays the step's linear calls alone (every projection and the head, in order, random inputs of
the same shapes; q/k/v and gate/up as one call each, as the native step makes them): what benchmarks/bench_kernel.py
measures, per token; it is timed in every pass beside the arms
(interleaved: this machine's bandwidth drifts within minutes). ``outside the matmuls`` = step - kernel only.

The arm ``native`` is the native step as it runs by default: where the modules allow, its layers in one native call
(``edgeq::decode_layers``, edgeq/runtime/stack.py). ``native-python`` is the same step op by op from Python
(``LeanDecoder.native_layers = False``; the same bits): what the one call saves. ``native-separate`` is the Python
step with one kernel call per projection instead of one for q/k/v and one for gate/up (``fuse_projections = False``;
the same bits): what the grouped calls save. The ablations replace Python-level ops, so they run the Python step and
are compared with ``native-python`` (``--ablate`` adds that arm).

``--paired N`` replaces the passes with a finer A/B of the arms (for differences of a fraction of a millisecond, below
the passes' spread): per context one prefill, then N rounds, each running every arm for ``--steps`` steps from the
same cache length (the cache rewound between chunks), the arms' order reversed every round; reported per arm
ms/token median [min-max] and, against the first arm, the median of the per-round differences and in how many
rounds the arm was slower. The ablations and ``kernel only`` are arms here too (``--ops "native,without attention"``:
what the attention costs in the step; ``--ops "native,kernel only"``: the time outside the matmuls, paired). So are
the one-call step's own ablations, ops left out inside ``edgeq::decode_layers`` (``one call, kernel only``: its
matmuls alone, called from C++ as the step calls them; ``one call, without attention``, ``one call, without norms +
RoPE``, ``one call, without silu * up``): ``--ops "native,one call, kernel only"`` is not valid CSV, so these arms
are separated by ``;`` when any is given (``--ops "native;one call, kernel only"``).

``--ablate`` (native ops) adds arms that time the same step with one class of native op replaced by a no-op (the
logits are then wrong; only the time counts): ``without attention`` (``decode_attn``), ``without norms + RoPE``
(``add_rms_norm``, ``rope_to_cache``). Step minus ablated step is what that op class really costs in the step,
without the profiler's per-op inflation.

    python benchmarks/synthetic.py qwen2.5-1.5b /tmp/q15-hf && edgeq quantize /tmp/q15-hf -o /tmp/q15 --method minmax
    python benchmarks/bench_decode_breakdown.py /tmp/q15 --contexts 512,2048 --threads 2 --passes 3
    python benchmarks/bench_decode_breakdown.py /tmp/q15 --contexts 512 --ops native,native-separate --paired 150 --steps 4
    python benchmarks/bench_decode_breakdown.py /tmp/q15 --contexts 512 --ops native,native-python --paired 100 --steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import time
from collections import defaultdict

import torch

KERNEL_OPS = ("edgeq::int4_mm", "edgeq::int4_mm_multi", "aten::_weight_int4pack_mm_for_cpu", "edgeq_w4a8::w4a8_mm", "aten::_weight_int8pack_mm",
              "aten::linear", "aten::mm", "aten::addmm", "aten::_int_mm")
ATTN_OPS = ("edgeq::decode_attn", "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")
ARGMAX_OPS = ("aten::argmax", "edgeq::argmax_finite", "aten::isfinite", "aten::all")
LAYERS_OPS = ("edgeq::decode_layers",)
CATEGORIES = ("matmul kernel", "head", "attention", "norms, RoPE, elementwise", "argmax", "layers in one call")


def _category(ev, vocab: int) -> str:
    name = ev.name
    if name in ATTN_OPS:
        return "attention"
    if name in ARGMAX_OPS:
        return "argmax"
    if name in LAYERS_OPS:
        return "layers in one call"
    if name in KERNEL_OPS or name.startswith("edgeq_w4a8::"):
        weights = [s for s in (ev.input_shapes or [])[1:] if s]  # x first, then the weight tensors
        # the head's rows: N for the W4A16 layouts, N / 32 column blocks for the W4A8 one ([N/32, K/bk, ...])
        return "head" if any(s[0] in (vocab, vocab // 32) for s in weights) else "matmul kernel"
    return "norms, RoPE, elementwise"


def _steps(lm, first: int, n: int) -> float:
    """Seconds for ``n`` greedy decode steps starting from token ``first`` (the pick of edgeq's generation loop)."""
    from edgeq.runtime.generation import greedy

    step, token = lm.decode_step, first
    t0 = time.perf_counter()
    for _ in range(n):
        token = max(0, greedy(step(token)))  # an ablated step may give non-finite logits: keep stepping
    return time.perf_counter() - t0


def _paired(lm, arms: list[str], contexts: list[int], vocab: int, rounds: int, steps: int) -> list[dict]:
    """``--paired``: the arms alternated in chunks of ``steps`` steps from one prefill per context (module docstring)."""
    rows = []
    for c in contexts:
        _arm(lm, arms[0])
        token = _prefill(lm, c, vocab)
        t = {a: [] for a in arms}
        for r in range(rounds):
            for a in arms if r % 2 == 0 else arms[::-1]:
                _arm(lm, a)
                for layer in lm.cache.layers:  # rewind: every chunk decodes after the same c tokens
                    layer.length = c
                if a == "kernel only":
                    t[a].append(_replay_linears(lm, steps) * 1e3)
                    continue
                with _without(ABLATIONS.get(a, ())):
                    t[a].append(_steps(lm, token, steps) / steps * 1e3)
        for a in arms:
            d = [y - x for x, y in zip(t[arms[0]], t[a])]
            rows.append(dict(context=c, ops=a, step_ms=statistics.median(t[a]), step_min=min(t[a]),
                             step_max=max(t[a]), paired_diff_ms=statistics.median(d),
                             slower_rounds=sum(v > 0 for v in d), rounds=rounds))
    return rows


ABLATIONS = {"without attention": ("decode_attn",), "without norms + RoPE": ("add_rms_norm", "rope_to_cache")}
# The one-call step (edgeq::decode_layers) with ops left out inside the call: its skip bits (native.decode_layers)
IN_CALL = {"one call, kernel only": 7, "one call, without attention": 1, "one call, without norms + RoPE": 2,
           "one call, without silu * up": 4}
PAIRED_ONLY = ("kernel only", *ABLATIONS, *IN_CALL)  # --ops arms only --paired takes (the passes add them by themselves)


@contextlib.contextmanager
def _without(ops: tuple[str, ...]):
    """The native step with ``ops`` (edgeq.runtime.native functions) replaced by no-ops while inside."""
    from edgeq.runtime import native

    saved = {name: getattr(native, name) for name in ops}
    try:
        for name in ops:
            setattr(native, name, lambda *a, **k: None)
        yield
    finally:
        for name, fn in saved.items():
            setattr(native, name, fn)


def _ablated(lm, ctx: int, vocab: int, steps: int, ops: tuple[str, ...]) -> float:
    """ms per token of the native Python step with ``ops`` replaced by no-ops."""
    _arm(lm, "native-python")
    token = _prefill(lm, ctx, vocab)
    with _without(ops):
        _steps(lm, token, 2)
        return _steps(lm, token, steps) / steps * 1e3


PYTHON_STEP = ("native-python", "native-separate", *ABLATIONS)  # arms that run the native step op by op from Python


def _ops(arm: str) -> str:
    """The decode ops an arm runs: the Python-step arms, the ablations and ``kernel only`` run on the native ops."""
    return "native" if arm in (*PYTHON_STEP, *PAIRED_ONLY) else arm


def _arm(lm, arm: str) -> None:
    lm.decoder.ops = _ops(arm)
    lm.decoder.fuse_projections = arm != "native-separate"
    lm.decoder.native_layers = arm not in PYTHON_STEP
    if lm.decoder.stack is not None:
        lm.decoder.stack.skip = IN_CALL.get(arm, 0)


def _prefill(lm, ctx: int, vocab: int) -> int:
    ids = torch.randint(3, vocab, (1, ctx), generator=torch.Generator().manual_seed(ctx))
    lm.cache.reset()
    return int(torch.argmax(lm.forward(ids, logits_to_keep=1)[0, -1]))


def _replay_linears(lm, steps: int) -> float:
    """Seconds per token of the decode step's linear calls alone (projections + head, in order; q/k/v and gate/up
    grouped as the native step calls them)."""
    dec = lm.decoder
    calls = []
    for L in dec.layers:
        for fn, k in ((L.qkv, dec.hidden), (L.o.fn, dec.heads * dec.head_dim), (L.gate_up, dec.hidden),
                      (L.down.fn, L.gate.out_features)):
            calls.append((fn, torch.randn(1, k).to(dec.dtype)))
    calls.append((dec.head.fn, torch.randn(1, dec.hidden).to(dec.dtype)))
    for fn, x in calls:
        fn(x)
    t0 = time.perf_counter()
    for _ in range(steps):
        for fn, x in calls:
            fn(x)
    return (time.perf_counter() - t0) / steps


def _profile(lm, ctx: int, vocab: int, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    token = _prefill(lm, ctx, vocab)
    _steps(lm, token, 2)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _steps(lm, token, steps)
    per = defaultdict(float)
    for ev in prof.events():
        per[_category(ev, vocab)] += ev.self_cpu_time_total / 1e3 / steps  # ms per token
    return dict(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--ops", default="native,torch", help="arms: native, torch (edgeq.runtime.lean.ops_choice), "
                    "native-python (the native step op by op from Python), native-separate (that, one kernel call "
                    "per projection)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per pass")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ablate", action="store_true", help="also time the native step without attention, and "
                    "without norms + RoPE (no-ops): what each really costs")
    ap.add_argument("--paired", type=int, default=0, metavar="N", help="instead of the passes: N rounds of a paired "
                    "A/B of the arms, --steps steps a chunk (module docstring)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from edgeq.runtime import load
    from edgeq.runtime.lean import ops_choice

    contexts = [int(c) for c in args.contexts.split(",")]
    arms = [a.strip() for a in args.ops.split(";" if ";" in args.ops else ",")]
    if args.ablate and "native-python" not in arms:
        arms.append("native-python")  # what the ablations are compared with
    for arm in arms:
        if arm in PAIRED_ONLY and not args.paired:
            raise SystemExit(f"--ops {arm!r}: only with --paired (the passes time it by themselves; --ablate)")
        ops_choice(_ops(arm))  # an arm that cannot run here is refused before any timing
    lm = load(args.checkpoint, max_model_len=max(contexts) + args.steps + 8, threads=args.threads,
              kv_cache_bytes="1GiB",
              decode_ops=_ops(arms[0]))
    if lm.decoder is None:
        raise SystemExit(f"the lean decoder does not run this model: {lm.settings.decode_loop_reason}")
    if any(a in IN_CALL for a in arms) and lm.decoder.stack_reason is not None:
        raise SystemExit(f"--ops: the 'one call' arms need the one-call step; here: {lm.decoder.stack_reason}")
    vocab = int(lm.config.vocab_size)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    if args.paired:
        _report_paired(lm, args, arms, contexts, vocab, started)
        return
    extra = ["kernel only"] + (list(ABLATIONS) if args.ablate else [])
    times = {(c, a): [] for c in contexts for a in arms + extra}
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    for p in range(args.passes):
        for c in contexts:
            every = arms + extra
            for a in every[p % len(every):] + every[: p % len(every)]:
                if a == "kernel only":
                    times[(c, a)].append(_replay_linears(lm, max(4, args.steps // 2)) * 1e3)
                elif a in ABLATIONS:
                    times[(c, a)].append(_ablated(lm, c, vocab, args.steps, ABLATIONS[a]))
                else:
                    _arm(lm, a)
                    token = _prefill(lm, c, vocab)
                    _steps(lm, token, 2)  # warm
                    times[(c, a)].append(_steps(lm, token, args.steps) / args.steps * 1e3)
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0) / args.threads
    kernel_ms = statistics.median(v for c in contexts for v in times[(c, "kernel only")])
    prof = {}
    for c in contexts:
        for a in arms:
            _arm(lm, a)
            prof[(c, a)] = _profile(lm, c, vocab, max(8, args.steps // 2))
    finished = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")

    s = lm.settings
    _header(f"# decode breakdown: {args.checkpoint}", started, finished, lm, args,
            f"loop {s.decode_loop}, torch {torch.__version__}; CPU share of the timed passes", cpu_share)
    print(f"kernel only (the step's linear calls, {7 * len(lm.decoder.layers) + 1} matrices, replayed in every pass): {kernel_ms:.2f} "
          f"ms/token\n")
    print("| context | ops | step ms/token, median [min-max] | tok/s | outside the matmuls | "
          + " | ".join(CATEGORIES) + " | left |")
    print("|---|---|---|---|---|" + "---|" * (len(CATEGORIES) + 1))
    rows = []
    for c in contexts:
        for a in arms:
            t = times[(c, a)]
            med = statistics.median(t)
            cats = prof[(c, a)]
            left = med - sum(cats.values())
            kms = statistics.median(times[(c, "kernel only")])  # this context's passes
            rows.append(dict(context=c, ops=a, step_ms=med, step_min=min(t), step_max=max(t),
                             kernel_only_ms=kms, outside_ms=med - kms, categories=cats, left_ms=left))
            print(f"| {c} | {a} | {med:.2f} [{min(t):.2f}-{max(t):.2f}] | {1e3 / med:.1f} | {med - kms:.2f} | "
                  + " | ".join(f"{cats.get(k, 0.0):.2f}" for k in CATEGORIES) + f" | {left:.2f} |")
    if args.ablate:
        print("\n| context | arm | step ms/token, median [min-max] | native-python minus this (ms) |\n|---|---|---|---|")
        for c in contexts:
            base = statistics.median(times[(c, "native-python")])
            for a in ABLATIONS:
                t = times[(c, a)]
                diff = f"{base - statistics.median(t):.2f}"
                print(f"| {c} | {a} | {statistics.median(t):.2f} [{min(t):.2f}-{max(t):.2f}] | {diff} |")
                rows.append(dict(context=c, ops=a, step_ms=statistics.median(t), step_min=min(t), step_max=max(t)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(started=started, finished=finished, checkpoint=args.checkpoint, threads=s.threads,
                           cpu_share=cpu_share, machine=platform.processor(), rows=rows,
                           omp=os.environ.get("OMP_WAIT_POLICY")), f, indent=2)


def _header(title: str, started: str, finished: str, lm, args, what: str, cpu_share: float) -> None:
    s = lm.settings
    print(title)
    print(f"{started} -> {finished}; {platform.processor() or platform.machine()}, threads {s.threads}, decode path "
          f"{s.decode_path}, {what} {cpu_share:.0%} of {args.threads} threads"
          + ("  (STARVED: another process was running)" if cpu_share < 0.85 else ""))


def _report_paired(lm, args, arms, contexts, vocab, started) -> None:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rows = _paired(lm, arms, contexts, vocab, args.paired, args.steps)
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0) / args.threads
    finished = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    s = lm.settings
    _header(f"# decode A/B, paired: {args.checkpoint}", started, finished, lm, args,
            f"torch {torch.__version__}; {args.paired} rounds of {args.steps} steps per arm; CPU share", cpu_share)
    print(f"\n| context | ops | step ms/token, median [min-max] | minus {arms[0]}, median of rounds (ms) | rounds slower |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['ops']} | {r['step_ms']:.2f} [{r['step_min']:.2f}-{r['step_max']:.2f}] | "
              f"{r['paired_diff_ms']:+.2f} | {r['slower_rounds']}/{r['rounds']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(started=started, finished=finished, checkpoint=args.checkpoint, threads=s.threads,
                           cpu_share=cpu_share, machine=platform.processor(), paired=args.paired, steps=args.steps,
                           rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
