"""The conversion plan, from headers alone: every tensor gets a role and an action, before any weight is read.

Roles (:class:`edgeq.keys.Role`): ``linear`` (2-D ``*.weight`` of a projection), ``head``, ``embedding``, ``norm``
(1-D ``*norm*``), ``bias``, ``other``. Actions (:class:`edgeq.keys.Action`): ``quantize`` (a float weight -> the
kernel's packed tensors, :meth:`edgeq.layouts.base.Layout.out_tensors`), ``keep`` (a Linear the recipe keeps in bf16,
reported), ``copy`` (cast to bf16), and for GPTQ input (edgeq/convert/ingest_gptq.py) ``repack`` (a 4-bit GPTQ layer
mapped exactly onto tinygemm) and ``requantize`` (a GPTQ layer dequantised exactly and quantised again with the
entry's method). Quantised outputs of act-order layers add ``M.perm`` (``PlanEntry.perm``). The head is always
quantised; with tied embeddings it is quantised *from* the embedding table (``source``), which is also copied as
bf16, and the output is untied.

The head is the recipe's (``Recipe.head``, ``lm_head.weight`` in every bundled recipe): its module name
(:attr:`Plan.head_module`) is what the manifest records, the GPTQ driver yields and the written checkpoint is
verified against.

Everything that depends on the kernel (output tensors, bytes, shape rules) is asked of its layout
(:func:`edgeq.layouts.base.get`), never branched on here.

A tensor that should be quantised but cannot be is collected into ``Plan.problems`` (name, shape, rule); callers
refuse the whole plan when there are any. The quantizer and ``edgeq inspect`` build the same plan, so they cannot
disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edgeq.convert.packers import packer
from edgeq.convert.recipe import Recipe, unmatched_patterns
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.safetensors import FLOAT_CODES
from edgeq.keys import QUANTIZED_ACTIONS, Action, Role
from edgeq.layouts.base import Layout, TensorSpec, get
from edgeq.scheme import Scheme

_QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".scales_and_zeros", ".weight_packed", ".SCB")


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
class EmbeddingLevel:
    """One 4-bit level of a packed embedding (edgeq/convert/embeddings.py): ``module``'s tinygemm tensors at
    ``group_size``; ``own`` False when they are another entry's (level 0 of a tied table is the head)."""

    module: str
    group_size: int
    own: bool = True


@dataclass(frozen=True)
class PlanEntry:
    name: str  # the output tensor name (the module's weight name for quantised ones)
    source: str  # the input tensor it comes from (differs for an untied head, and for GPTQ layers: M.qweight)
    shape: tuple[int, ...]  # the logical [N, K] for weights, whatever their stored shape
    dtype: str
    role: Role
    action: Action
    bytes_in: int
    bytes_out: int
    reason: str = ""
    perm: bool = False  # the output has M.perm (act-order): the layer computes kernel(x[..., perm])
    gptq: GPTQSource | None = None  # set when the input is a GPTQ layer (actions repack / requantize / keep)
    method: str = ""  # quantisation method of this entry when it differs from the plan's (GPTQ ingest: rtn for the head)
    origin: str | None = None  # another checkpoint directory the source is read from (--head-from), else the input
    group_size: int = 0  # this entry's group size when the recipe's group_sizes make it finer than the scheme's, else 0
    levels: tuple[EmbeddingLevel, ...] = ()  # action pack-embedding: the levels summed at lookup, in order

    def group(self, scheme: Scheme) -> int:
        """The group size this entry is (or was) quantised with."""
        return self.group_size or scheme.group_size

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")

    @property
    def quantized(self) -> bool:
        return self.action in QUANTIZED_ACTIONS

    def out_tensors(self, scheme: Scheme) -> list[TensorSpec]:
        """(name, dtype code, shape) of what this entry writes: its layout's tensors, a packed embedding's own levels'
        tensors, or itself in bf16."""
        if self.action == Action.PACK_EMBEDDING:
            return [t for lv in self.levels if lv.own for t in layout_of(scheme).out_tensors(lv.module, *self.shape, lv.group_size)]
        if not self.quantized:
            return [(self.name, "BF16", self.shape)]
        return layout_of(scheme).out_tensors(self.module, *self.shape, self.group(scheme), self.perm)


@dataclass(frozen=True)
class Plan:
    scheme: Scheme
    method: str
    recipe: str
    entries: tuple[PlanEntry, ...]
    problems: tuple[str, ...]
    tied: bool  # the input had no separate head tensor
    source: dict = field(default_factory=dict)  # what the input was, when not a float checkpoint (GPTQ ingest)
    options: Any = None  # the method's options (edgeq.convert.calibrated.GPTQOptions for method "gptq")
    head_levels: int = 1  # 2: the head also sums the packed table's residual level (--head-levels, convert/embeddings.py)

    @property
    def bytes_in(self) -> int:
        # a tied head reads the embedding a second time but stores nothing new in the input
        return sum(e.bytes_in for e in self.entries if not (self.tied and e.role == Role.HEAD))

    @property
    def bytes_out(self) -> int:
        return sum(e.bytes_out for e in self.entries)

    @property
    def head(self) -> PlanEntry:
        return next(e for e in self.entries if e.role == Role.HEAD)

    @property
    def packed_embedding(self) -> PlanEntry | None:
        """The embedding entry written as 4-bit levels (``--embeddings packed``), or None (bf16 tables)."""
        return next((e for e in self.entries if e.action == Action.PACK_EMBEDDING), None)

    @property
    def head_module(self) -> str:
        """The output head's module name, from the recipe (``lm_head`` for ``lm_head.weight``)."""
        return self.head.module

    def check(self) -> None:
        if self.problems:
            lines = "\n  ".join(self.problems)
            raise EdgeqError(f"{len(self.problems)} tensor(s) cannot be quantised with {self.scheme}:\n  {lines}")
        assert_head_quantized(self)


def assert_head_quantized(plan: Plan) -> None:
    heads = [e for e in plan.entries if e.role == Role.HEAD]
    if len(heads) != 1 or not heads[0].quantized:
        found = [(e.name, str(e.action)) for e in heads]  # str: the message shows 'keep', not <Action.KEEP: 'keep'>
        raise EdgeqError(f"plan does not quantise the output head ({found}); this is never allowed")


def layout_of(scheme: Scheme) -> Layout:
    """The packed layout ``scheme`` writes (its kernel's registry entry)."""
    return get(scheme.kernel)


def packed_bytes(shape: tuple[int, ...], scheme: Scheme, group_size: int = 0, perm: bool = False) -> int:
    """Bytes of one quantised [N, K] weight in the scheme's layout at ``group_size`` (0: the scheme's)."""
    return layout_of(scheme).nbytes(*shape, group_size or scheme.group_size, perm)


def _entry_group(recipe: Recipe, name: str, scheme: Scheme) -> int:
    """0 (the scheme's group size) unless the recipe's group_sizes give ``name`` a finer one the layout takes per
    module. Only tinygemm takes G per call; the W4A8 layout keeps one group size per checkpoint (its ``group_sizes``
    are the sizes a *scheme* may name), so there a recipe's group_sizes are ignored."""
    if not packer(scheme.kernel).per_module_groups:
        return 0
    g = recipe.group_size(name, scheme.group_size)
    return g if g != scheme.group_size else 0


def group_sizes(plan: "Plan") -> dict[str, int]:
    """{module: group size} of the quantised modules whose group differs from the scheme's (the manifest record)."""
    return {e.module: e.group_size for e in plan.entries if e.quantized and e.group_size}


def tensor_role(name: str, shape: tuple[int, ...], recipe: Recipe) -> Role:
    """What tensor ``name`` of the input is, from its name, its shape and the recipe's head/embedding names."""
    if name == recipe.head:
        return Role.HEAD
    if name in recipe.embeddings:
        return Role.EMBEDDING
    if name.endswith(".bias"):
        return Role.BIAS
    if len(shape) == 1 and "norm" in name.lower():
        return Role.NORM
    if len(shape) == 2 and name.endswith(".weight"):
        return Role.LINEAR
    return Role.OTHER


def weight_rule(shape: tuple[int, ...], dtype: str, scheme: Scheme) -> str | None:
    """Why a 2-D weight [N, K] cannot be quantised with this scheme (dtype, then the layout's shape rule at the
    scheme's group size, with the numbers and the fix), or None."""
    if dtype not in FLOAT_CODES:
        return f"dtype {dtype} is not bf16/fp16/fp32 (an already-quantised or integer tensor)"
    return layout_of(scheme).rule(*shape, scheme.group_size)


def build_plan(ckpt: Checkpoint, scheme: Scheme, method: str, recipe: Recipe) -> Plan:
    entries: list[PlanEntry] = []
    problems: list[str] = []
    for name, info in ckpt.tensors.items():
        if name.endswith(_QUANT_SUFFIXES):
            raise EdgeqError(
                f"{info.file}: tensor {name} looks already quantised but config.json has no quantization_config; "
                "edgeq quantises float checkpoints, and ingests GPTQ ones whose config says quant_method \"gptq\""
            )
        role = tensor_role(name, info.shape, recipe)
        if role in (Role.LINEAR, Role.HEAD):
            keep = recipe.keeps(name) if role == Role.LINEAR else None
            if keep:
                entries.append(PlanEntry(name, name, info.shape, info.dtype, role, Action.KEEP, info.nbytes,
                                         info.numel * 2, f"recipe {recipe.name}: keep_bf16 {keep!r}"))
                continue
            rule = weight_rule(info.shape, info.dtype, scheme)
            if rule:
                problems.append(f"{name} {list(info.shape)} {info.dtype}: {rule}")
            g = _entry_group(recipe, name, scheme)
            out = packed_bytes(info.shape, scheme, g) if not rule else 0
            entries.append(PlanEntry(name, name, info.shape, info.dtype, role, Action.QUANTIZE, info.nbytes, out,
                                     group_size=g))
        else:
            if info.dtype not in FLOAT_CODES:
                raise EdgeqError(f"{info.file}: tensor {name} has dtype {info.dtype}; edgeq expects a bf16, fp16 or fp32 checkpoint")
            entries.append(PlanEntry(name, name, info.shape, info.dtype, role, Action.COPY, info.nbytes, info.numel * 2))
    tied = recipe.head not in ckpt.tensors
    if tied:
        emb = tied_embedding(ckpt, entries, recipe)
        rule = weight_rule(emb.shape, emb.dtype, scheme)
        if rule:
            problems.append(f"{recipe.head} (tied to {emb.name}) {list(emb.shape)} {emb.dtype}: {rule}")
        g = _entry_group(recipe, recipe.head, scheme)
        out = packed_bytes(emb.shape, scheme, g) if not rule else 0
        entries.append(PlanEntry(recipe.head, emb.name, emb.shape, emb.dtype, Role.HEAD, Action.QUANTIZE, emb.bytes_in,
                                 out, f"untied from {emb.name}", group_size=g))
    if not any(e.quantized and e.role == Role.LINEAR for e in entries):
        problems.append(f"no Linear projection weights found among {len(entries)} tensors: nothing to quantise besides the head")
    plan = Plan(scheme, method, recipe.name, tuple(entries), tuple(problems), tied)
    if not problems:
        assert_head_quantized(plan)  # assertion 1 of 3: at plan time
    return plan


def recipe_warnings(plan: Plan, recipe: Recipe) -> list[str]:
    """The recipe's patterns that change nothing in this plan (edgeq.convert.recipe.unmatched_patterns); group_sizes
    count only where they apply: a layout taking G per module, on float input (GPTQ input keeps its own groups)."""
    per_module, float_input = packer(plan.scheme.kernel).per_module_groups, not plan.source
    found = unmatched_patterns(recipe, (e.name for e in plan.entries), per_module and float_input)
    base = plan.scheme.group_size
    finer = [e.name for e in plan.entries if e.quantized and recipe.group_size(e.name, base) < base]
    if finer and float_input and not per_module:  # a W4A8 scheme (--scheme auto may have picked it) drops them
        found.append(f"recipe {recipe.name}'s group_sizes give {len(finer)} tensor(s) finer groups (e.g. {finer[0]}), "
                     f"which {plan.scheme} does not take (one group size per checkpoint): they are quantised at "
                     f"g{base}; a w4a16 scheme keeps them")
    return found


def tied_embedding(ckpt: Checkpoint, entries: list[PlanEntry], recipe: Recipe, also: str = "") -> PlanEntry:
    """The embedding entry a head-less checkpoint's head is quantised from; an error naming the recipe's names when
    there is none (``also``: another head name looked for, e.g. GPTQ's ``lm_head.qweight``)."""
    emb = next((e for e in entries if e.role == Role.EMBEDDING), None)
    if emb is None:
        head = f"{recipe.head} or {also}" if also else recipe.head
        raise EdgeqError(
            f"{ckpt.root}: no output head ({head}) and no embedding table ({', '.join(recipe.embeddings)}) to tie it to; "
            "the recipe's head/embeddings names do not match this checkpoint"
        )
    return emb


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
        if e.levels:
            row["levels"] = [{"module": lv.module, "group_size": lv.group_size} for lv in e.levels]
        rows.append(row)
    return rows


def effective_bits(plan: Plan) -> float:
    """Bits per quantised weight including scales and zeros (4 + 32/G for tinygemm)."""
    q = [e for e in plan.entries if e.quantized]
    weights = sum(math.prod(e.shape) for e in q)
    return 8 * sum(e.bytes_out for e in q) / weights if weights else 0.0
