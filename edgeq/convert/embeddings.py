"""``edgeq quantize --embeddings packed``: the input embedding table as 4-bit levels in the checkpoint's tinygemm
layout, summed at lookup (docs/format.md, "Packed embeddings"; issue 16).

The math every reader computes (bit-exact), for level l with codes q_l (0..15), bf16 scale_l and zero_l, group G_l::

    D_l[r, k] = (float32(q_l[r, k]) - 8) * float32(scale_l[k // G_l, r]) + float32(zero_l[k // G_l, r])   # fp32
    E[r, k]   = bfloat16(D_0[r, k] + D_1[r, k])                                        # fp32 add, one RNE rounding

Worked example: q0 = 11, scale0 = 0.25, zero0 = 0.5 -> D0 = 1.25; q1 = 6, scale1 = 0.0078125, zero1 = 0 ->
D1 = -0.015625; E = bf16(1.234375) = 1.234375.

The levels (``PlanEntry.levels``; the manifest's ``embeddings`` record):

- tied (the head was quantised from this very table, in its own column order): level 0 is the head's tensors as
  stored, whatever made them (rtn, gptq, a GPTQ ingest), at the head's group size; level 1, the residual, is the
  table's own ``M.qweight`` / ``M.scales_and_zeros`` at the scheme's base group size;
- otherwise (an own ``lm_head.weight``, a head from ``--head-from``, or an act-order head whose columns are stored
  permuted): level 0 is ``M.*``, the table quantised with rtn at the head's group size, and level 1 is
  ``M.residual.*`` at the base group size.

Conversion, in row blocks (bounded memory, as the head): the residual ``R = float32(W) - D_0`` is computed from the
level-0 tensors *as written*, read back from the shard (:meth:`edgeq.io.safetensors.ShardedWriter.read_back`), and
``quantize_groups(R, G_1, "rtn")`` is packed with the kernel's op. So the entry is written after the head (the plan
moves it last), the level-0 codes are read one row block at a time, and only the level's scales and zeros
(K/G * V * 4 bytes) are held whole, as the packer holds the head's. ``model.embed_tokens.weight`` is not written.

Only the tinygemm_w4a16 kernel has the lookup (its packer's ``packed_embeddings``): an amx_w4a8 scheme with
``--embeddings packed`` is refused; its default is bf16 whatever the recipe says.

``--head-levels 2`` (:func:`resolve_head_levels`) adds nothing to the file but the head record's ``levels`` (the
table's, the head first): the output head then sums both levels too, logits = x @ (D0 + D1)^T, for a tied table
whose level 0 is the head; the runtime computes it (edgeq/runtime/qlinear.py).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from edgeq.convert.packers import packer
from edgeq.convert.plan import EmbeddingLevel, Plan, PlanEntry, layout_of
from edgeq.convert.recipe import Recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.manifest import Manifest
from edgeq.io.safetensors import ShardedWriter
from edgeq.keys import FORMAT_VERSION, FORMAT_VERSION_BF16_EMBEDDINGS, RESIDUAL_MODULE, Action, EmbeddingStorage, Role
from edgeq.layouts import tinygemm
from edgeq.quantize.rtn import quantize_groups
from edgeq.scheme import Scheme

METHOD = "rtn"  # every level the converter makes (an embedding has no Hessian for GPTQ)
ROW_BLOCK_ELEMENTS = 4 << 20  # as the packers' row blocks: a few fp32 copies of ~4M weights


def resolve_storage(flag: str | None, recipe: Recipe, scheme: Scheme) -> EmbeddingStorage:
    """``--embeddings`` if given (``packed`` refused for a kernel without the lookup, naming the flag and the fix),
    else the recipe's ``embeddings_storage``, which a kernel without the lookup turns into bf16."""
    can = packer(scheme.kernel).packed_embeddings
    if flag is not None:
        try:
            storage = EmbeddingStorage(flag)
        except ValueError:
            raise EdgeqError(f"--embeddings {flag!r}: valid: {', '.join(EmbeddingStorage)}") from None
        if storage == EmbeddingStorage.PACKED and not can:
            raise EdgeqError(f"--embeddings packed: scheme {scheme} ({scheme.kernel}) has no packed embedding lookup; "
                             "use a w4a16 scheme, or --embeddings bf16 (the default for this scheme)")
        return storage
    storage = EmbeddingStorage(recipe.embeddings_storage)
    return storage if can else EmbeddingStorage.BF16


def pack_plan(plan: Plan, recipe: Recipe, storage: EmbeddingStorage, explicit: bool = True) -> Plan:
    """``plan`` with its input embedding table (the first of the recipe's embeddings it has) written as packed
    levels, moved after every other entry (its residual reads the head back); unchanged for bf16. A level the
    layout cannot take (K not a multiple of G, V not of 16) is a plan problem with the fix. No 2-D table to pack is
    an error when packed was asked for (``explicit``: --embeddings), else the table stays as it is (a recipe's
    default)."""
    if storage != EmbeddingStorage.PACKED:
        return plan
    by_name = {e.name: e for e in plan.entries}
    emb = next((by_name[n] for n in recipe.embeddings if n in by_name and by_name[n].role == Role.EMBEDDING), None)
    if emb is None or len(emb.shape) != 2:
        if not explicit:
            return plan
        what = f"{emb.name} is {list(emb.shape)}, not a 2-D table" if emb else \
            f"the checkpoint has none of the recipe's embeddings ({', '.join(recipe.embeddings)})"
        raise EdgeqError(f"--embeddings packed: {what}; use --embeddings bf16")
    levels = _levels(plan, emb)
    problems = []
    for lv in levels:
        if lv.own and (rule := layout_of(plan.scheme).rule(*emb.shape, lv.group_size)):
            problems.append(f"{emb.name} {list(emb.shape)} (--embeddings packed, level {lv.module} g{lv.group_size}): "
                            f"{rule}; or --embeddings bf16")
    nbytes = sum(layout_of(plan.scheme).nbytes(*emb.shape, lv.group_size) for lv in levels if lv.own) if not problems else 0
    what = " + ".join(_words([(lv.module, lv.group_size, lv.own) for lv in levels]))
    packed = replace(emb, action=Action.PACK_EMBEDDING, bytes_out=nbytes, levels=levels, method=METHOD,
                     reason=f"4-bit levels: {what}")
    entries = tuple(e for e in plan.entries if e is not emb) + (packed,)
    return replace(plan, entries=entries, problems=plan.problems + tuple(problems))


def resolve_head_levels(flag: int | None, recipe: Recipe, plan: Plan) -> Plan:
    """``plan`` with ``head_levels`` set: ``--head-levels`` if given, else the recipe's ``head_levels``. 2 makes the
    output head sum the packed table's levels, y = x @ (D0 + D1)^T (docs/format.md, "Head levels"): no extra bytes
    (the residual level is already stored), one more 4-bit matmul per step. It applies only when the table is packed
    and its level 0 is the head (tied, no --head-from, no act-order permutation); else the flag is refused (naming
    why and the fix) and the recipe's 2 means 1."""
    levels = recipe.head_levels if flag is None else flag
    if levels not in (1, 2):
        raise EdgeqError(f"--head-levels {levels}: valid: 1 (the head's own tensors), 2 (plus the packed embedding's "
                         "residual level)")
    if levels == 1:
        return replace(plan, head_levels=1)
    e, why, fix = plan.packed_embedding, None, "use --head-levels 1"
    if e is None:
        why = "the embedding table is bf16, and the second level is a packed table's residual"
        fix = "add --embeddings packed, or use --head-levels 1"
    elif e.levels[0].own or e.levels[0].module != plan.head_module:
        head = plan.head
        cause = ("the head is written with an act-order permutation (--act-order)" if head.perm else
                 "the head comes from --head-from" if head.origin else
                 f"the head has its own {head.source} (an untied model)" if head.source != e.source else
                 "the head is not the table's level 0")
        why = f"the head must be the packed table's level 0, and {cause}"
    if why is None:
        return replace(plan, head_levels=2)
    if flag is None:
        return replace(plan, head_levels=1)
    raise EdgeqError(f"--head-levels 2: {why}; {fix}")


def _levels(plan: Plan, emb: PlanEntry) -> tuple[EmbeddingLevel, ...]:
    """Level 0 is the head when it was quantised from this table as read here, in its own column order; else the
    table's own rtn level at the head's group size. The residual is at the scheme's base group size."""
    head, base = plan.head, plan.scheme.group_size
    module = emb.module
    if head.source == emb.name and head.origin is None and not head.perm:
        return (EmbeddingLevel(head.module, head.group(plan.scheme), own=False), EmbeddingLevel(module, base))
    return (EmbeddingLevel(module, head.group(plan.scheme)), EmbeddingLevel(module + RESIDUAL_MODULE, base))


def format_version(plan: Plan) -> int:
    """2 when an embedding is packed, else 1: a checkpoint with bf16 tables is written exactly as before format 2."""
    return FORMAT_VERSION if plan.packed_embedding is not None else FORMAT_VERSION_BF16_EMBEDDINGS


def manifest_record(plan: Plan) -> dict:
    """The manifest's ``embeddings`` key: {module: {"storage": "packed", "source", "levels"}}; {} for bf16."""
    e = plan.packed_embedding
    if e is None:
        return {}
    return {e.module: {"storage": str(EmbeddingStorage.PACKED), "source": e.source,
                       "levels": [{"module": lv.module, "group_size": lv.group_size} for lv in e.levels]}}


def head_record(plan: Plan) -> list[dict]:
    """The head record's ``levels`` (``--head-levels 2``): the packed table's levels, the head first; [] for one."""
    return manifest_record(plan)[plan.packed_embedding.module]["levels"] if plan.head_levels == 2 else []


def describe(plan: Plan) -> dict:
    """What is written for the input embedding: storage, module, levels, bytes and the bf16 bytes it replaces (the
    summary of ``--dry-run``, ``--json`` and the report line), and ``head_levels`` when the head sums 2. Empty when
    the plan has no embedding table."""
    e = plan.packed_embedding
    if e is not None and plan.head_levels == 2:
        return {**_describe(plan), "head_levels": 2}
    return _describe(plan)


def _describe(plan: Plan) -> dict:
    e = plan.packed_embedding
    if e is None:
        emb = next((x for x in plan.entries if x.role == Role.EMBEDDING), None)
        if emb is None:
            return {}
        return {"storage": str(EmbeddingStorage.BF16), "module": emb.module, "source": emb.source,
                "bytes": emb.bytes_out, "bf16_bytes": emb.bytes_out}
    return {"storage": str(EmbeddingStorage.PACKED), "module": e.module, "source": e.source,
            "levels": [{"module": lv.module, "group_size": lv.group_size, "own": lv.own} for lv in e.levels],
            "bytes": e.bytes_out, "bf16_bytes": math.prod(e.shape) * 2}


def summary_line(d: dict) -> str:
    """E.g. ``embeddings: packed 4-bit (lm_head + residual g128), 0.53 MiB (bf16: 2.00 MiB)``."""
    if not d:
        return "embeddings: none found"
    size = f"{d['bytes'] / 2**20:.2f} MiB"
    if d["storage"] != EmbeddingStorage.PACKED:
        return f"embeddings: bf16 ({d['source']}), {size}"
    parts = _words([(lv["module"], lv["group_size"], lv["own"]) for lv in d["levels"]])
    line = f"embeddings: packed 4-bit ({' + '.join(parts)}), {size} (bf16: {d['bf16_bytes'] / 2**20:.2f} MiB)"
    if "relative_error" in d:
        line += (f"; relative error {d['relative_error']:.4f}, max |E - W| {d['max_error']:.4g} "
                 f"(level 0 alone: {d['level0_relative_error']:.4f}, {d['level0_max_error']:.4g})")
    if d.get("head_levels") == 2:
        line += f"; head levels 2 (the head adds the residual g{d['levels'][-1]['group_size']}: logits = x @ (D0 + D1)^T)"
    return line


def _words(levels: list[tuple[str, int, bool]]) -> list[str]:
    """Each level in a few words: the head's module name when level 0 is the head's, else its group size; the
    residual ("residual g128")."""
    return [(m if not own else f"g{g}") if i == 0 else f"residual g{g}" for i, (m, g, own) in enumerate(levels)]


def write_levels(ckpt: Checkpoint, plan: Plan, e: PlanEntry, record: tinygemm.TinygemmLayout, writer: ShardedWriter,
                 progress) -> dict:
    """Write the entry's own levels (the module docstring): an own level 0 quantised with rtn in row blocks, then
    the residual against level 0 as written. Returns the error of E and of level 0 alone against W (relative
    Frobenius and largest absolute), for the report."""
    v, k = e.shape
    first, residual = e.levels[0], e.levels[-1]
    itemsize = ckpt.tensors[e.source].itemsize

    def read_rows(a: int, b: int) -> torch.Tensor:
        return ckpt.read(e.source, (a, b))

    if first.own:
        packer(plan.scheme.kernel).quantize(read_rows, v, k, first.group_size, METHOD, name=e.source,
                                            module=first.module, record=record, write=writer.write,
                                            progress=lambda rows: progress(rows * k * itemsize, e.name))
    sz0 = _read_back(writer, f"{first.module}.scales_and_zeros", torch.bfloat16, (k // first.group_size, v, 2))
    step = min(v, tinygemm.row_block(record, ROW_BLOCK_ELEMENTS // k))
    sums = dict.fromkeys(("sq_e", "sq_0", "sq_w", "max_e", "max_0"), 0.0)
    parts = []
    for a in range(0, v, step):
        b = min(v, a + step)
        w = read_rows(a, b).to(torch.float32)
        q0 = tinygemm.unpack(_read_back(writer, f"{first.module}.qweight", torch.uint8, (b - a, k // 2), a * k // 2),
                             b - a, k, record)
        d0 = tinygemm.dequantize(q0, sz0[:, a:b], first.group_size, torch.float32)
        qt = quantize_groups(w - d0, residual.group_size, METHOD, name=f"{e.source} residual rows {a}..{b}")
        tinygemm.check_values(qt.q, e.source)
        writer.write(f"{residual.module}.qweight", tinygemm._op_pack(qt.q))
        parts.append(qt.scales_and_zeros)
        d1 = tinygemm.dequantize(qt.q, qt.scales_and_zeros, residual.group_size, torch.float32)
        _accumulate(sums, w, (d0 + d1).to(torch.bfloat16).float(), d0.to(torch.bfloat16).float())
        progress((b - a) * k * itemsize, e.name)
    writer.write(f"{residual.module}.scales_and_zeros", torch.cat(parts, dim=1))
    rel = (lambda sq: (sq / sums["sq_w"]) ** 0.5 if sums["sq_w"] > 0 else 0.0)
    return {"relative_error": rel(sums["sq_e"]), "max_error": sums["max_e"],
            "level0_relative_error": rel(sums["sq_0"]), "level0_max_error": sums["max_0"]}


def _accumulate(sums: dict, w: torch.Tensor, e: torch.Tensor, e0: torch.Tensor) -> None:
    """Squared and largest errors of E (both levels) and of level 0 alone (as bf16), and W's squared norm."""
    sums["sq_w"] += float(w.double().square().sum())
    for key, x in (("e", e), ("0", e0)):
        err = (x - w).abs()
        sums[f"sq_{key}"] += float(err.double().square().sum())
        sums[f"max_{key}"] = max(sums[f"max_{key}"], float(err.max()) if err.numel() else 0.0)


def _read_back(writer: ShardedWriter, name: str, dtype: torch.dtype, shape: tuple[int, ...], start: int = 0) -> torch.Tensor:
    """Elements of a tensor the writer has written whole, from byte ``start``, as ``dtype`` ``shape``."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    data = bytearray(writer.read_back(name, start, start + size))
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


def verify_levels(directory: Path, manifest: Manifest, found: dict) -> None:
    """Re-check a written checkpoint's packed embeddings from its headers (``found``: name -> TensorInfo): the source
    table is not also stored, and every level has the layout's tensors for [V, K] (V, K from level 0's qweight) at
    its group size."""
    lay = layout_of(Scheme.parse(manifest.scheme))
    for module, rec in manifest.embeddings.items():
        if rec["source"] in found:
            raise EdgeqError(f"{directory}: {module} is packed but {rec['source']} is stored too; the checkpoint is inconsistent")
        levels = manifest.embedding_levels(module)
        first = found.get(f"{levels[0][0]}.qweight")
        if first is None or len(first.shape) != 2:
            raise EdgeqError(f"{directory}: packed embedding {module}: level 0 {levels[0][0]} has no 2-D qweight")
        v, k = first.shape[0], 2 * first.shape[1]
        for m, g in levels:
            for name, dtype, shape in lay.out_tensors(m, v, k, g):
                t = found.get(name)
                if t is None or t.dtype != dtype or list(t.shape) != list(shape):
                    got = f"{t.dtype} {list(t.shape)}" if t is not None else "missing"
                    raise EdgeqError(f"{directory}: packed embedding {module}: {name} is {got}, expected {dtype} {list(shape)}")
