"""What ``edgeq bench`` passes around: the arms it runs, one worker's result, the statistics it reports and the
report itself (its ``--json`` output, schema in docs/methodology.md). Frozen dataclasses only; no torch.

    >>> Stat.of([10.0, 12.0, 11.0])
    Stat(median=11.0, min=10.0, max=12.0, n=3)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

SCHEMA_VERSION = 1
MIN_PASSES = 3
METRICS = (  # key, label, unit, higher is better
    ("pp_tok_s", "prefill", "tok/s", True),
    ("tg_tok_s", "decode", "tok/s", True),
    ("ttft_s", "time to first token", "s", False),
    ("load_s", "load", "s", False),
)


@dataclass(frozen=True)
class Arm:
    """One side of a comparison: a checkpoint and how to run it."""

    label: str
    checkpoint: str
    kind: str = "edgeq"  # "edgeq" (edgeq or bf16 HF checkpoint) | "gguf" (llama.cpp)
    threads: int = 2
    max_model_len: Optional[int] = None
    kv_cache_bytes: str = "256MiB"
    prefill_threshold: Optional[int] = None
    env: tuple = ()  # ((KEY, VALUE), ...) set in this arm's worker environment


@dataclass(frozen=True)
class BenchConfig:
    prompt_len: int = 512
    gen_len: int = 128
    passes: int = 3
    seed: int = 0
    warmup: bool = True
    timeout_s: float = 3600.0


@dataclass(frozen=True)
class PassResult:
    """One worker process: its exit, its wait4 rusage, and what it measured (``data``, the worker's JSON)."""

    label: str
    pass_index: int
    ok: bool
    error: Optional[str]
    exit_code: Optional[int]
    wall_s: float
    maxrss: int  # ru_maxrss from wait4, bytes: the larger of this worker's whole-life peak and its waited-for children's
    data: dict
    stderr_tail: str = ""


@dataclass(frozen=True)
class Stat:
    median: float
    min: float
    max: float
    n: int

    @property
    def spread(self) -> float:
        """(max - min) / median."""
        return (self.max - self.min) / self.median if self.median else 0.0

    @classmethod
    def of(cls, values) -> "Stat":
        v = [float(x) for x in values]
        return cls(statistics.median(v), min(v), max(v), len(v))


@dataclass(frozen=True)
class ArmSummary:
    label: str
    checkpoint: str
    kind: str
    checkpoint_id: str
    passes: int
    timing: dict  # metric -> Stat (pp_tok_s, tg_tok_s, ttft_s, ttft_cold_s, load_s, import_s)
    settings: dict  # effective, read back by the worker (first pass)
    paths: dict  # {"prefill": {path: calls}, "decode": {...}} (first pass; every pass is checked equal)
    native_calls: Optional[dict]
    memory: dict  # peak_load, peak_run, steady_rss/anon/file, maxrss -> Stat; cached_before -> list
    ledger: dict  # the ledger of the pass with the median steady RSS
    projection: Optional[dict]  # {"rows": [...], "basis": str} or None with "why"


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    rows: tuple  # ({metric, label, unit, a, b, ratio, better, overlap}, ...)


@dataclass(frozen=True)
class BenchReport:
    schema_version: int
    ok: bool
    machine: dict
    config: dict
    arms_requested: tuple
    arms: tuple  # ArmSummary, only when every pass succeeded
    comparisons: Optional[tuple]  # None when any pass failed
    failures: tuple  # ({label, pass_index, error, exit_code, stderr_tail}, ...)
    not_run: tuple  # "B#2", ... passes skipped after the first failure
    flags: tuple  # judgements that make a comparison suspect (identical arms, arms differing in settings, ...)
    notes: tuple
    passes: tuple  # PassResult, raw


@dataclass(frozen=True)
class ConvertBench:
    """``edgeq bench --convert``: time and peak memory of ``edgeq quantize`` in a child process per pass."""

    model: str
    scheme: Optional[str]
    method: Optional[str]
    passes: int
    seconds: Stat
    peak_rss: Stat  # ru_maxrss of the child (wait4)
    peak_anon: Stat  # the converter's own sampled peak RssAnon
    bytes_in: int
    bytes_out: int
    failures: tuple
    machine: dict

