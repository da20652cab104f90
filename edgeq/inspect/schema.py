"""The report ``edgeq inspect`` builds: frozen dataclasses whose ``asdict`` is the ``--json`` document.

The key structure is documented in docs/inspect.md ("JSON") and pinned by tests/test_inspect.py; a change here is
a schema change (bump :data:`SCHEMA_VERSION` unless it only adds keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from edgeq.memory import MemoryProjection

SCHEMA_VERSION = 1
CATEGORIES = ("quantized_linears", "linears_unquantized", "head", "embeddings", "norms", "other")


@dataclass(frozen=True)
class TensorRow:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # linear | head | embedding | norm | bias | other (edgeq.keys.Role), or perm (an act-order M.perm)
    quantized: bool  # part of a quantised module (packed weight, scales, zeros, indices)
    bytes: int
    file: str


@dataclass(frozen=True)
class QModule:
    """One quantised Linear as the tensor shapes describe it (n, k None when the shapes do not tell)."""

    name: str
    n: Optional[int]
    k: Optional[int]
    numel: int
    bits: Optional[float]
    group_size: Optional[int]
    bytes: int


@dataclass(frozen=True)
class EdgeqInfo:
    format_version: int
    scheme: str
    group_size: int
    method: str
    kernel: str
    layout_stored: dict
    layout_machine: Optional[dict]
    layout_matches: bool
    on_load: str
    head_quantized: bool
    head_source: str
    untied: bool
    quantized_modules: int
    modules_not_converted: dict
    created_by: dict
    group_sizes: tuple = ()  # ((module, G), ...) where a recipe made G finer than the scheme's
    # {module: {"storage": "bf16"|"packed", "source", "levels": [{"module", "group_size", "bytes", "shared"}], "bytes",
    # "bf16_bytes"}}: the input embedding table as stored (edgeq/inspect/embeddings.py)
    embeddings: dict = field(default_factory=dict)
    head_levels: tuple = ()  # ((module, G), ...) the head sums with --head-levels 2 (manifest head.levels); () = 1


@dataclass(frozen=True)
class ForeignInfo:
    format: str
    quant_method: str
    bits: Optional[int]
    group_size: Optional[int]
    symmetric: Optional[bool]
    act_order: Optional[str]
    head: str  # how the output head is stored
    quantized_modules: int
    bits_seen: tuple[float, ...]  # from the tensor shapes, over all quantised modules
    group_sizes_seen: tuple[int, ...]
    unquantized_linears: tuple[str, ...]
    details: dict


@dataclass(frozen=True)
class SchemeOption:
    scheme: str
    bytes_out: int
    ratio: float
    effective_bits: float
    cannot_quantize: tuple[str, ...]


@dataclass(frozen=True)
class VerifyResult:
    tensors_checked: int
    bytes_read: int
    seconds: float
    shards: dict  # shard file -> "ok" | "sha256 mismatch" | "not in manifest" | "not checked (no manifest)"
    roundtrip: tuple[str, ...]  # modules whose unpack/repack reproduced the stored bytes


@dataclass(frozen=True)
class InspectReport:
    schema_version: int
    path: str
    kind: str  # edgeq | hf | foreign
    model: dict
    files: dict
    bytes_by_category: dict
    effective_bits: Optional[float]  # bits per quantised weight, scales and zeros included
    bits_per_parameter: float  # all stored bytes over all parameters
    edgeq: Optional[EdgeqInfo]
    foreign: Optional[ForeignInfo]
    schemes: Optional[tuple[SchemeOption, ...]]
    memory: Optional[MemoryProjection]
    memory_basis: str
    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    verify: Optional[VerifyResult] = None
    tensors: Optional[tuple[TensorRow, ...]] = None
