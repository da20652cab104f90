"""Judgements that make a comparison suspect, as flags in the report (never exceptions): a phase starved of CPU, an
arm whose effective settings or counted paths changed between passes, two arms that ran the same thing (their
difference is noise), two checkpoints compared under different settings (the ratio mixes two effects)."""

from __future__ import annotations

import json

from edgeq.bench.records import ArmSummary, PassResult

# Settings that make two edgeq arms run the same thing (crossover_source is left out: "measured" then "cached").
COMPARED_SETTINGS = ("quantized", "scheme", "dtype", "max_model_len", "kv_cache_budget", "kv_cache_bytes", "threads_now",
                     "decode_path", "prefill_path", "prefill_crossover", "layout", "native_isa", "decode_ops",
                     "decode_layers", "prefill_attn", "env")
GGUF_SETTINGS = ("model_desc", "n_ctx", "n_threads", "n_threads_batch", "n_batch", "n_ubatch")
# Settings that should be equal across arms that compare two checkpoints (otherwise the ratio mixes two effects).
# (name, edgeq key, llama.cpp key, tolerance): llama.cpp pads n_ctx up to a multiple of 256.
SHARED_SETTINGS = (("threads", "threads_now", "n_threads", 0), ("context", "max_model_len", "n_ctx", 256))
STARVED_SHARE = 0.7  # a phase that got less than this share of its threads' CPU time measured contention


def judge(summaries: list[ArmSummary], results: list[PassResult]) -> list[str]:
    """Flags that make a comparison suspect. Never raises; the report carries them."""
    flags = []
    for s in summaries:  # every pass of an arm must have run the same thing
        runs = [r.data for r in results if r.label == s.label]
        flags += starved(s.label, runs) + drift(s, runs)
    for i, a in enumerate(summaries):
        for b in summaries[i + 1:]:
            flags += pair_flags(a, b)
    return flags


def starved(label: str, runs: list[dict]) -> list[str]:
    """A phase whose CPU share (:func:`edgeq.bench.spec.cpu_share`) fell below :data:`STARVED_SHARE` in any pass."""
    flags = []
    for phase in ("prefill", "decode"):
        shares = [d["cpu"][phase]["share"] for d in runs if d.get("cpu")]
        if shares and min(shares) < STARVED_SHARE:
            flags.append(f"arm {label}: {phase} got only {min(shares):.0%}-{max(shares):.0%} of its threads' CPU "
                         f"time (CPU seconds / (wall x threads)): the machine was oversubscribed, so these "
                         f"{phase} numbers measure contention (every parallel region waits for a preempted thread); "
                         f"on a shared machine run with OMP_WAIT_POLICY=PASSIVE or fewer threads")
    return flags


def drift(s: ArmSummary, runs: list[dict]) -> list[str]:
    """Effective settings or counted paths that differ between the passes of one arm."""
    flags = []
    for k in _compared(s):
        seen = {json.dumps(d["effective"].get(k) if k != "native_isa" else (d["effective"].get("native") or {}).get("isa"),
                           sort_keys=True) for d in runs}
        if len(seen) > 1:
            flags.append(f"arm {s.label}: effective {k} changed between passes ({', '.join(sorted(seen))})")
    if len({json.dumps(d["paths"], sort_keys=True) for d in runs}) > 1:
        flags.append(f"arm {s.label}: path counts differ between passes: {[d['paths'] for d in runs]}")
    return flags


def pair_flags(a: ArmSummary, b: ArmSummary) -> list[str]:
    """Two arms that ran the same thing, or two checkpoints compared under different shared settings."""
    if _key(a) == _key(b):
        return [f"arms {a.label} and {b.label} ran the same checkpoint ({a.checkpoint_id}) with identical "
                f"effective settings: their difference is noise, not an effect"]
    flags = []
    if a.checkpoint_id != b.checkpoint_id:
        for name, ek, gk, tol in SHARED_SETTINGS:
            va = a.settings.get(ek if a.kind == "edgeq" else gk)
            vb = b.settings.get(ek if b.kind == "edgeq" else gk)
            if va is not None and vb is not None and abs(va - vb) > (tol if a.kind != b.kind else 0):
                flags.append(f"arms {a.label} and {b.label} differ in {name} as well as in checkpoint "
                             f"({va} vs {vb}): the ratio mixes both effects")
    return flags


def _compared(s: ArmSummary) -> tuple:
    return COMPARED_SETTINGS if s.kind == "edgeq" else GGUF_SETTINGS


def _key(s: ArmSummary) -> tuple:
    """What an arm ran: its kind, checkpoint id and compared settings (JSON, so dicts and None compare)."""
    return (s.kind, s.checkpoint_id) + tuple(json.dumps(s.settings.get(k), sort_keys=True) for k in _compared(s))
