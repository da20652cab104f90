"""The conversion plan, from headers alone: every tensor gets a role and an action, before any weight is read.

Roles: ``linear`` (2-D ``*.weight`` of a projection), ``head``, ``embedding``, ``norm`` (1-D ``*norm*``),
``bias``, ``other``. Actions: ``quantize`` (a float weight -> ``M.qweight`` + ``M.scales_and_zeros``), ``keep`` (a
Linear the recipe keeps in bf16, reported), ``copy`` (cast to bf16), and for GPTQ input (edgeq/convert/ingest_gptq.py) ``repack``
(a 4-bit GPTQ layer mapped exactly onto tinygemm) and ``requantize`` (a GPTQ layer dequantised exactly and quantised
again with the entry's method). Quantised outputs of act-order layers add ``M.perm`` (``PlanEntry.perm``). The head
is always quantised; with tied embeddings it is quantised *from* the embedding table (``source``), which is also
copied as bf16, and the output is untied.

A tensor that should be quantised but cannot be is collected into ``Plan.problems`` (name, shape, rule); callers
refuse the whole plan when there are any. The quantizer and ``edgeq inspect`` build the same plan, so they cannot
disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edgeq.io.hf import Checkpoint
from edgeq.convert.recipe import Recipe
from edgeq.convert import w4a8 as convert_w4a8  # the amx_w4a8 tensors, rules and sizes (imports nothing from here)
from edgeq.io.safetensors import FLOAT_CODES
from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.scheme import Scheme

HEAD_MODULE = "lm_head"
_QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".scales_and_zeros", ".weight_packed", ".SCB")
QUANTIZED_ACTIONS = ("quantize", "repack", "requantize")  # actions whose output is M.qweight + M.scales_and_zeros


@dataclass(frozen=True)
class GPTQSource:
    """Where one GPTQ-quantised Linear lives in the input, and how to decode it (edgeq/layouts/gptq.py).

    ``group_size`` is the checkpoint's (-1: one group over K), after GPTQModel's per-module ``dynamic`` overrides.
    """

    qweight: str
    qzeros: str
    scales: str
    g_idx: str | None
    bits: int
    group_size: int
    sym: bool
    checkpoint_format: str


@dataclass(frozen=True)
class PlanEntry:
    name: str  # the output tensor name (the module's weight name for quantised ones)
    source: str  # the input tensor it comes from (differs for an untied head, and for GPTQ layers: M.qweight)
    shape: tuple[int, ...]  # the logical [N, K] for weights, whatever their stored shape
    dtype: str
    role: str
    action: str
    bytes_in: int
    bytes_out: int
    reason: str = ""
    perm: bool = False  # the output has M.perm (act-order): the layer computes kernel(x[..., perm])
    gptq: GPTQSource | None = None  # set when the input is a GPTQ layer (actions repack / requantize / keep)
    method: str = ""  # quantisation method of this entry when it differs from the plan's (GPTQ ingest: rtn for the head)
    origin: str | None = None  # another checkpoint directory the source is read from (--head-from), else the input
    group_size: int = 0  # this entry's group size when the recipe's group_sizes make it finer than the scheme's, else 0

    def group(self, scheme: Scheme) -> int:
        """The group size this entry is (or was) quantised with."""
        return self.group_size or scheme.group_size

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")

    @property
    def quantized(self) -> bool:
        return self.action in QUANTIZED_ACTIONS

    def out_tensors(self, scheme: Scheme) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype code, shape) of what this entry writes."""
        if not self.quantized:
            return [(self.name, "BF16", self.shape)]
        n, k = self.shape
        if scheme.kernel == convert_w4a8.KERNEL:
            return convert_w4a8.out_tensors(self.module, n, k, scheme)
        out = [
            (f"{self.module}.qweight", "U8", (n, k // 2)),
            (f"{self.module}.scales_and_zeros", "BF16", (k // self.group(scheme), n, 2)),
        ]
        if self.perm:
            out.append((f"{self.module}.perm", "I64", (k,)))
        return out


@dataclass(frozen=True)
class Plan:
    scheme: Scheme
    method: str
    recipe: str
    entries: tuple[PlanEntry, ...]
    problems: tuple[str, ...]
    tied: bool  # the input had no separate head tensor
    source: dict = field(default_factory=dict)  # what the input was, when not a float checkpoint (GPTQ ingest)
    options: Any = None  # the method's options (edgeq.convert.pipeline.GPTQOptions for method "gptq")

    @property
    def bytes_in(self) -> int:
        # a tied head reads the embedding a second time but stores nothing new in the input
        return sum(e.bytes_in for e in self.entries if not (self.tied and e.role == "head"))

    @property
    def bytes_out(self) -> int:
        return sum(e.bytes_out for e in self.entries)

    @property
    def head(self) -> PlanEntry:
        return next(e for e in self.entries if e.role == "head")

    def check(self) -> None:
        if self.problems:
            lines = "\n  ".join(self.problems)
            raise EdgeqError(f"{len(self.problems)} tensor(s) cannot be quantised with {self.scheme}:\n  {lines}")
        assert_head_quantized(self)


def assert_head_quantized(plan: Plan) -> None:
    heads = [e for e in plan.entries if e.role == "head"]
    if len(heads) != 1 or not heads[0].quantized:
        raise EdgeqError(f"plan does not quantise the output head ({[(e.name, e.action) for e in heads]}); this is never allowed")


def quantized_bytes(n: int, k: int, group_size: int, perm: bool = False) -> int:
    """Packed nibbles + bf16 (scale, zero) per group: N*K/2 + (K/G)*N*2*2, plus 8*K for an int64 M.perm."""
    return n * k // 2 + (k // group_size) * n * 4 + (8 * k if perm else 0)


def _scheme_bytes(shape: tuple[int, ...], scheme: Scheme, group_size: int = 0) -> int:
    if scheme.kernel == convert_w4a8.KERNEL:
        return convert_w4a8.quantized_bytes(*shape, scheme.group_size)
    return quantized_bytes(*shape, group_size or scheme.group_size)


def _entry_group(recipe: Recipe, name: str, scheme: Scheme) -> int:
    """0 (the scheme's group size) unless the recipe's group_sizes give ``name`` a finer one; W4A8 stays uniform."""
    if scheme.kernel == convert_w4a8.KERNEL:
        return 0
    g = recipe.group_size(name, scheme.group_size)
    return g if g != scheme.group_size else 0


def group_sizes(plan: "Plan") -> dict[str, int]:
    """{module: group size} of the quantised modules whose group differs from the scheme's (the manifest record)."""
    return {e.module: e.group_size for e in plan.entries if e.quantized and e.group_size}


def _role(name: str, shape: tuple[int, ...], recipe: Recipe) -> str:
    if name == recipe.head:
        return "head"
    if name in recipe.embeddings:
        return "embedding"
    if name.endswith(".bias"):
        return "bias"
    if len(shape) == 1 and "norm" in name.lower():
        return "norm"
    if len(shape) == 2 and name.endswith(".weight"):
        return "linear"
    return "other"


def _rule(shape: tuple[int, ...], dtype: str, scheme: Scheme) -> str | None:
    """Why a 2-D weight cannot be quantised with this scheme, or None."""
    if scheme.kernel == convert_w4a8.KERNEL:
        return convert_w4a8.plan_rule(shape, dtype, scheme)
    if dtype not in FLOAT_CODES:
        return f"dtype {dtype} is not bf16/fp16/fp32 (an already-quantised or integer tensor)"
    n, k = shape
    g = scheme.group_size
    if k % g:
        return f"K={k} is not a multiple of the group size {g}" + _suggest(k)
    if n % tinygemm.ROW_MULTIPLE:
        return f"N={n} is not a multiple of {tinygemm.ROW_MULTIPLE} (tinygemm packs rows in 16s)"
    return None


def _suggest(k: int) -> str:
    fits = [g for g in tinygemm.GROUP_SIZES if k % g == 0]
    return f"; use a group size of {', '.join(map(str, fits))}" if fits else "; keep it in bf16 with a recipe (keep_bf16)"


tensor_role = _role  # public names for the GPTQ ingest planner (edgeq/convert/ingest_gptq.py)
weight_rule = _rule


def build_plan(ckpt: Checkpoint, scheme: Scheme, method: str, recipe: Recipe) -> Plan:
    entries: list[PlanEntry] = []
    problems: list[str] = []
    for name, info in ckpt.tensors.items():
        if name.endswith(_QUANT_SUFFIXES):
            raise EdgeqError(
                f"{info.file}: tensor {name} looks already quantised but config.json has no quantization_config; "
                "edgeq quantises float checkpoints, and ingests GPTQ ones whose config says quant_method \"gptq\""
            )
        role = _role(name, info.shape, recipe)
        if role in ("linear", "head"):
            keep = recipe.keeps(name) if role == "linear" else None
            if keep:
                entries.append(PlanEntry(name, name, info.shape, info.dtype, role, "keep", info.nbytes, info.numel * 2,
                                         f"recipe {recipe.name}: keep_bf16 {keep!r}"))
                continue
            rule = _rule(info.shape, info.dtype, scheme)
            if rule:
                problems.append(f"{name} {list(info.shape)} {info.dtype}: {rule}")
            g = _entry_group(recipe, name, scheme)
            out = _scheme_bytes(info.shape, scheme, g) if not rule else 0
            entries.append(PlanEntry(name, name, info.shape, info.dtype, role, "quantize", info.nbytes, out, group_size=g))
        else:
            if info.dtype not in FLOAT_CODES:
                raise EdgeqError(f"{info.file}: tensor {name} has dtype {info.dtype}; edgeq expects a bf16, fp16 or fp32 checkpoint")
            entries.append(PlanEntry(name, name, info.shape, info.dtype, role, "copy", info.nbytes, info.numel * 2))
    tied = recipe.head not in ckpt.tensors
    if tied:
        emb = next((e for e in entries if e.role == "embedding"), None)
        if emb is None:
            raise EdgeqError(
                f"{ckpt.root}: no output head ({recipe.head}) and no embedding table ({', '.join(recipe.embeddings)}) to tie it to; "
                "the recipe's head/embeddings names do not match this checkpoint"
            )
        rule = _rule(emb.shape, emb.dtype, scheme)
        if rule:
            problems.append(f"{recipe.head} (tied to {emb.name}) {list(emb.shape)} {emb.dtype}: {rule}")
        g = _entry_group(recipe, recipe.head, scheme)
        out = _scheme_bytes(emb.shape, scheme, g) if not rule else 0
        entries.append(PlanEntry(recipe.head, emb.name, emb.shape, emb.dtype, "head", "quantize", emb.bytes_in, out,
                                 f"untied from {emb.name}", group_size=g))
    if not any(e.quantized and e.role == "linear" for e in entries):
        problems.append(f"no Linear projection weights found among {len(entries)} tensors: nothing to quantise besides the head")
    plan = Plan(scheme, method, recipe.name, tuple(entries), tuple(problems), tied)
    if not problems:
        assert_head_quantized(plan)  # assertion 1 of 3: at plan time
    return plan


def plan_rows(plan: Plan) -> list[dict]:
    """The plan as table rows (for --dry-run and inspect); ``perm`` / ``method`` / ``from`` only where they apply."""
    rows = []
    for e in plan.entries:
        row = {"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "role": e.role, "action": e.action,
               "bytes_in": e.bytes_in, "bytes_out": e.bytes_out, "reason": e.reason}
        if e.perm:
            row["perm"] = True
        if e.method:
            row["method"] = e.method
        if e.origin:
            row["from"] = e.origin
        if e.group_size:
            row["group_size"] = e.group_size
        rows.append(row)
    return rows


def effective_bits(plan: Plan) -> float:
    """Bits per quantised weight including scales and zeros (4 + 32/G for tinygemm)."""
    q = [e for e in plan.entries if e.quantized]
    weights = sum(math.prod(e.shape) for e in q)
    return 8 * sum(e.bytes_out for e in q) / weights if weights else 0.0
