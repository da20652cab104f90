"""What ``edgeq route`` reports and caches: the compute paths found here, their timings, each scheme's modelled cost
and the choice (``RouteReport``, also the JSON of ``edgeq route --json`` and of the cache file)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    """A compute path and whether it runs here (``detail``: how, or why not). Not :class:`edgeq.keys.Kernel`, the
    checkpoint layout: route names paths, several per layout."""

    name: str  # tinygemm | native | dequant_prefill | w4a8_portable | w4a8_kernel | bf16
    available: bool
    detail: str


@dataclass(frozen=True)
class Timing:
    """One path at one shape [M, K] x [N, K]^T: milliseconds per call, median and range over the passes."""

    arm: str
    n: int
    k: int
    m: int
    ms: float  # median over passes
    ms_min: float
    ms_max: float


@dataclass(frozen=True)
class SchemeCost:
    """A scheme with the paths the runtime would take for it and the modelled request's cost."""

    scheme: str
    decode_path: str
    prefill_path: str
    decode_ms: float  # summed over the shapes, M = 1
    prefill_ms: float  # summed over the shapes, M = PREFILL_M
    cost_ms: float  # prefill_ms + DECODE_TOKENS * decode_ms


@dataclass(frozen=True)
class RouteReport:
    """The route of this machine: what was found, measured and chosen, and under which cache key."""

    device_class: str
    torch_capability: str
    cpu_flags: tuple[str, ...]  # the ones the classes and kernels depend on
    torch_version: str
    edgeq_version: str
    threads: int
    kernels: tuple[Kernel, ...]
    timings: tuple[Timing, ...]
    schemes: tuple[SchemeCost, ...]
    choice: str  # the scheme `edgeq quantize --scheme auto` uses
    reason: str
    workload: str
    source: str  # "measured" | "cached"
    cache_file: str
    key: str
    seconds: float

    @classmethod
    def from_json(cls, d: dict) -> "RouteReport":
        """The report from its JSON form (a cache entry)."""
        d = dict(d)
        d["cpu_flags"] = tuple(d["cpu_flags"])
        d["kernels"] = tuple(Kernel(**k) for k in d["kernels"])
        d["timings"] = tuple(Timing(**t) for t in d["timings"])
        d["schemes"] = tuple(SchemeCost(**s) for s in d["schemes"])
        return cls(**d)
