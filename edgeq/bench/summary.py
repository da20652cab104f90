"""A benchmark's arms summarised: the content identity of each checkpoint, medians with min and max of every metric
and memory reading, and the A/B comparison rows."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

from edgeq.bench.projection import projection
from edgeq.bench.records import METRICS, Arm, ArmSummary, Comparison, PassResult, Stat
from edgeq.keys import CONFIG, MANIFEST


def checkpoint_id(path: str | Path) -> str:
    """Content identity from metadata only: config.json, the manifest and every weight file's header (safetensors) or
    name, size and first MiB (gguf). Two copies of one checkpoint get the same id."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_file():
        h.update(f"{p.stat().st_size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
        return h.hexdigest()[:16]
    for name in (CONFIG, MANIFEST):
        if (p / name).is_file():
            h.update(name.encode() + b"\0" + (p / name).read_bytes())
    for shard in sorted(p.glob("*.safetensors")):
        with open(shard, "rb") as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
            h.update(shard.name.encode() + raw + f.read(min(n, 100 << 20)))
        h.update(str(shard.stat().st_size).encode())
    return h.hexdigest()[:16]


def summarize(arm: Arm, results: list[PassResult]) -> ArmSummary:
    """One arm over its (successful) passes: every metric and memory reading as a :class:`Stat`, the settings and
    paths of the first pass (:func:`edgeq.bench.judge.judge` checks the others agree), the ledger of the pass with
    the median steady RSS, and inspect's projection beside it."""
    data = [r.data for r in results]
    timing = {k: Stat.of(d["timing"][k] for d in data)
              for k in ("pp_tok_s", "tg_tok_s", "ttft_s", "ttft_cold_s", "load_s", "import_s")}
    for phase in ("prefill", "decode"):
        if all(d.get("cpu") for d in data):
            timing[f"cpu_share_{phase}"] = Stat.of(d["cpu"][phase]["share"] for d in data)
    mem = [d["memory"] for d in data]
    memory = {
        "peak_load": Stat.of(m["peak_load"] for m in mem),
        "peak_run": Stat.of(m["peak_run"] for m in mem),
        "steady_rss": Stat.of(m["steady"]["rss"] for m in mem),
        "steady_anon": Stat.of(m["steady"]["anon"] for m in mem),
        "steady_file": Stat.of(m["steady"]["file"] for m in mem),
        "maxrss_wait4": Stat.of(r.maxrss for r in results),
        "maxrss_self": Stat.of(m.get("maxrss_self", 0) for m in mem),
        "maxrss_children": Stat.of(m.get("maxrss_children", 0) for m in mem),
        "checkpoint_cached_before_load": [m["checkpoint_cached_before_load"] for m in mem],
        "checkpoint_file_bytes": mem[0]["checkpoint_file_bytes"],
    }
    median_rss = memory["steady_rss"].median
    ledger = min(data, key=lambda d: abs(d["memory"]["steady"]["rss"] - median_rss))["ledger"]
    settings = dict(data[0]["effective"])
    if arm.kind == "edgeq":
        settings["native_isa"] = (settings.get("native") or {}).get("isa")
    return ArmSummary(
        label=arm.label, checkpoint=str(arm.checkpoint), kind=arm.kind, checkpoint_id=checkpoint_id(arm.checkpoint),
        passes=len(results), timing=timing, settings=settings, paths=data[0]["paths"],
        native_calls=data[0].get("native_calls"), memory=memory, ledger=ledger,
        projection=projection(arm, settings, ledger) if arm.kind == "edgeq" else None,
    )


def compare(a: ArmSummary, b: ArmSummary) -> Comparison:
    """A row per metric: ratio of the medians (a / b), which arm is better, and whether the min-max ranges overlap.
    Example: decode 12.0 [11-13] vs 10.0 [9-10.5] tok/s is ratio 1.20, a better, ranges disjoint."""
    rows = []
    for key, label, unit, higher in METRICS:
        sa, sb = a.timing[key], b.timing[key]
        ratio = sa.median / sb.median if sb.median else float("inf")
        better = a.label if (ratio > 1) == higher else b.label
        overlap = sa.min <= sb.max and sb.min <= sa.max
        rows.append({"metric": key, "label": label, "unit": unit, "a": asdict(sa), "b": asdict(sb), "ratio": ratio,
                     "better": better if ratio != 1 else "=", "overlap": overlap})
    return Comparison(a.label, b.label, tuple(rows))

