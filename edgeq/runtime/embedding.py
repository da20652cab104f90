"""Packed (4-bit) input embeddings: the rows a forward looks up, decoded from the checkpoint's tinygemm tensors.

An edgeq checkpoint whose manifest has a packed ``embeddings`` entry (docs/format.md, format_version 2) stores no bf16
embedding table. The table is the sum of *levels*, each a 4-bit grouped affine matrix in the checkpoint's tinygemm
layout (``M.qweight`` uint8 [V, K/2], ``M.scales_and_zeros`` bf16 [K/G, V, 2]). A tied model's level 0 is the
packed head itself (the same mapped tensors the head's :class:`~edgeq.runtime.qlinear.Int4Linear` reads: one table
for both ends) and level 1 a residual; an untied model stores both levels. For token rows r (the contract's
definition, bit for bit)::

    D_l[r, k] = (float32(q_l[r, k]) - 8) * float32(scale_l[k // G_l, r]) + float32(zero_l[k // G_l, r])  # mul, add
    E[r, k]   = bfloat16(D_0[r, k] + D_1[r, k])                                        # fp32 sum, one RNE rounding

Worked example: q0 = 11, scale0 = 0.25, zero0 = 0.5 give D0 = 3 * 0.25 + 0.5 = 1.25; q1 = 6, scale1 = 0.0078125,
zero1 = 0 give D1 = -2 * 0.0078125 = -0.015625; E = bf16(1.234375) = 1.234375 (exact in bf16: 8 significant bits).

Only the looked-up rows are decoded (:func:`edgeq.layouts.tinygemm.unpack_rows`), never the whole table: a decode
step reads one row (K/2 bytes and K/G scale pairs per level), a prefill of T tokens T rows, in chunks of about
CHUNK_ELEMS values so the fp32 temporaries stay bounded. Each level keeps its own layout: the head's is the one its
Int4Linear runs on (this machine's, after an in-memory repack of a foreign checkpoint), a stored level's is the
checkpoint's record (read in place, never repacked, so it stays file-backed), except a residual level the head also
sums (``--head-levels 2``): that one is the head's second Int4Linear's tensors, shared like level 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from edgeq.errors import EdgeqError
from edgeq.keys import MANIFEST, EmbeddingStorage
from edgeq.layouts import tinygemm
from edgeq.layouts.tinygemm import TinygemmLayout

CHUNK_ELEMS = 1 << 18  # values decoded per chunk: ~1 MiB per fp32 temporary, 2 MiB of gather index


@dataclass(frozen=True, eq=False)
class EmbeddingLevel:
    """One 4-bit level of a packed embedding: ``module`` names the checkpoint tensors (``lm_head`` for a tied level
    0), which are held as they are (mapped views, or the head's own tensors): never copied."""

    module: str
    qweight: torch.Tensor  # uint8 [V, K/2]
    scales_and_zeros: torch.Tensor  # bf16 [K/G, V, 2]
    group_size: int
    layout: TinygemmLayout
    shared: bool = False  # the head's tensors (a tied level 0): counted with the head, not here

    def add_rows(self, rows: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
        """``acc + D[rows]`` (or ``D[rows]`` when ``acc`` is None), fp32 [R, K]: unpack, -8, * scale, + zero."""
        v, k, g = self.qweight.shape[0], self.qweight.shape[1] * 2, self.group_size
        d = tinygemm.unpack_rows(self.qweight, rows, v, k, self.layout, check=False).to(torch.float32).sub_(8.0)
        sz = self.scales_and_zeros.index_select(1, rows).to(torch.float32)  # [K/G, R, 2]
        grouped = d.view(-1, k // g, g)
        grouped.mul_(sz[..., 0].t()[..., None]).add_(sz[..., 1].t()[..., None])  # two roundings, as dequantize
        return d if acc is None else acc.add_(d)


class PackedEmbedding(nn.Module):
    """``forward(ids int64 [...]) -> bf16 [..., K]``: the rows of E (module docstring) for ``ids``.

    ``embed_scale`` (Gemma-2's scaled embedding: the factor of the module it replaces) multiplies the rows in bf16 as
    that module does (``rows * embed_scale.to(bf16)``); BioGPT's is a Python float (``rows * float``). Levels are plain attributes (not parameters or buffers):
    ``.to()`` and ``.state_dict()`` never copy the mapped bytes."""

    edgeq_packed_embedding = True

    def __init__(self, name: str, levels: tuple[EmbeddingLevel, ...], embed_scale: torch.Tensor | float | None = None):
        super().__init__()
        if not levels:
            raise EdgeqError(f"{name}: a packed embedding needs at least one level")
        self.name = name
        self.levels = tuple(levels)
        self.num_embeddings = levels[0].qweight.shape[0]
        self.embedding_dim = levels[0].qweight.shape[1] * 2
        # a float (BioGPT's scaled embedding) multiplies as that module does, unrounded: bf16(rows * float)
        self.scale = embed_scale.to(torch.bfloat16) if isinstance(embed_scale, torch.Tensor) else embed_scale
        self.padding_idx = None

    def extra_repr(self) -> str:
        parts = " + ".join(f"{lv.module} g{lv.group_size}" for lv in self.levels)
        return f"{self.name}: {self.num_embeddings} x {self.embedding_dim}, 4-bit levels {parts}"

    def lookup(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """E[rows] as bf16 [R, K] written into ``out`` (allocated when None): rows int64 [R]. The lean decoder writes
        its residual stream this way (``out`` = its [1, H] buffer)."""
        r, k = rows.numel(), self.embedding_dim
        if out is None:
            out = torch.empty(r, k, dtype=torch.bfloat16)
        lo, hi = (int(rows), int(rows)) if r == 1 else (int(rows.min()), int(rows.max())) if r else (0, 0)
        if lo < 0 or hi >= self.num_embeddings:
            raise IndexError(f"{self.name}: token id outside 0..{self.num_embeddings - 1}")  # as nn.Embedding
        step = max(1, CHUNK_ELEMS // k)
        for a in range(0, r, step):
            chunk = rows[a : a + step]
            acc = None
            for level in self.levels:
                acc = level.add_rows(chunk, acc)
            out[a : a + chunk.numel()].copy_(acc)  # the one rounding to bf16 (round to nearest even)
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = input_ids.reshape(-1).to(torch.int64)
        out = self.lookup(rows).view(*input_ids.shape, self.embedding_dim)
        return out if self.scale is None else out * self.scale

    @property
    def stored_bytes(self) -> int:
        """Bytes of the levels' own tensors, all mapped (a tied level 0 is the head's, counted there)."""
        return sum(lv.qweight.numel() + lv.scales_and_zeros.numel() * 2 for lv in self.levels if not lv.shared)


def row_reader(module):
    """(fn, dtype, source) for the lean decoder, ``fn(ids int64 [R], out [R, K])`` writing the input embedding's rows
    into ``out``: a :class:`PackedEmbedding`'s :meth:`~PackedEmbedding.lookup` (bf16; source: the module), an
    ``nn.Embedding``'s ``index_select`` over its mapped table (its dtype; source: the table itself); None for any
    other module or a scaled embedding (Gemma-2's multiplies its rows, which the lean loop does not)."""
    if getattr(module, "edgeq_packed_embedding", False) and module.scale is None:
        return (lambda ids, out: module.lookup(ids, out=out)), torch.bfloat16, module
    if isinstance(module, nn.Embedding) and getattr(module, "embed_scale", None) is None:
        table = module.weight
        return (lambda ids, out: torch.index_select(table, 0, ids, out=out)), table.dtype, table
    return None


def entries(info) -> dict[str, dict]:
    """The manifest's packed ``embeddings`` entries (module -> record); {} for a bf16-embedding checkpoint."""
    record = info.manifest.embeddings
    return {str(m): e for m, e in record.items() if isinstance(e, dict) and e.get("storage") == EmbeddingStorage.PACKED}


def level_modules(info) -> tuple[str, ...]:
    """Modules whose ``M.qweight`` / ``M.scales_and_zeros`` hold embedding levels in the file (the head excluded: its
    tensors are the head's): the load-time scale check and ``edgeq repack`` cover them."""
    names = [lv.get("module") for e in entries(info).values() for lv in e.get("levels") or ()]
    return tuple(str(n) for n in names if isinstance(n, str) and n != info.head_name)


def _levels(where: str, name: str, info) -> list[tuple[str, int]]:
    """(module, G) of each level, in summation order (the manifest's reader checked the record's form); a level
    named after the head must be level 0 at the head's own group size."""
    levels = info.manifest.embedding_levels(name)
    for i, (m, g) in enumerate(levels):
        if m == info.head_name and (i or g != info.group_size(m)):
            raise EdgeqError(f"{where}.levels[{i}]: the head {m} at G={g} can only be level 0 at its own group size "
                             f"{info.group_size(m)}; the checkpoint is inconsistent, re-quantise it")
    return levels


def stored_level(files, info, module: str, g: int, v: int, k: int) -> EmbeddingLevel:
    """A level with its own tensors: mapped as stored, shapes checked against the embedding and the manifest (also
    the head's residual level of ``--head-levels 2``: edgeq/runtime/qlinear.py)."""
    want = {".qweight": (torch.uint8, [v, k // 2]), ".scales_and_zeros": (torch.bfloat16, [k // g, v, 2])}
    got = {}
    for suffix, (dtype, shape) in want.items():
        name = f"{module}{suffix}"
        if name not in files:
            raise EdgeqError(f"{MANIFEST}: embedding level tensor {name} is missing from the checkpoint; re-quantise")
        t = files.get(name)
        recorded = (info.manifest.tensors.get(name) or {}).get("shape")
        if t.dtype != dtype or list(t.shape) != shape or (recorded is not None and list(recorded) != shape):
            raise EdgeqError(f"{name}: expected {str(dtype).removeprefix('torch.')} {shape} for a {v} x {k} embedding "
                             f"at G={g}, the file has {str(t.dtype).removeprefix('torch.')} {list(t.shape)} (manifest: "
                             f"{recorded}); the checkpoint is inconsistent, re-quantise it")
        got[suffix] = t
    return EmbeddingLevel(module, got[".qweight"], got[".scales_and_zeros"], g, info.layout)


def _head_level(model: nn.Module, info, v: int, k: int) -> EmbeddingLevel:
    """Level 0 of a tied table: the head module's own tensors and the layout its kernel runs on (shared, no copy)."""
    head = model.get_submodule(info.head_name)
    runtime = getattr(head, "runtime", None)
    if not getattr(head, "edgeq_quantized", False) or runtime is None or not hasattr(head, "qweight"):
        raise EdgeqError(f"{MANIFEST}: the embedding's level 0 is the head {info.head_name}, which did not load as a "
                         f"tinygemm int4 module; re-quantise the checkpoint")
    if (head.out_features, head.in_features) != (v, k):
        raise EdgeqError(f"{info.head_name}: [{head.out_features}, {head.in_features}] cannot be the embedding's "
                         f"level 0 ({v} x {k}); the checkpoint is inconsistent, re-quantise it")
    return EmbeddingLevel(info.head_name, head.qweight, head.scales_and_zeros, head.group_size, runtime.layout, True)


def _shared_level(model: nn.Module, info, module: str) -> EmbeddingLevel | None:
    """A level the head also sums (``--head-levels 2``): the head's residual Int4Linear's tensors and the layout its
    kernel runs on (shared, counted with the head, as level 0); None for any other level."""
    head = model.get_submodule(info.head_name)
    lin = next((lv for lv in getattr(head, "residual_levels", ()) if lv.name == module), None)
    if lin is None:
        return None
    return EmbeddingLevel(module, lin.qweight, lin.scales_and_zeros, lin.group_size, lin.runtime.layout, True)


def swap_embeddings(model: nn.Module, files, info, result):
    """Replace the input embedding of ``model`` by a :class:`PackedEmbedding` for each packed ``embeddings`` entry
    of ``info``; returns ``result`` (an :class:`edgeq.runtime.swap.SwapResult`) with the level tensors consumed and
    their bytes counted as mapped. A bf16-embedding checkpoint comes back unchanged. Call after the head is swapped
    in (a tied level 0 is the head's module). Only tinygemm_w4a16 checkpoints have packed embeddings (the manifest's
    reader refuses any other kernel's)."""
    packed = entries(info)
    if not packed:
        return result
    consumed, mapped, what = set(result.consumed), result.mapped_bytes, []
    for name in packed:
        where = f"{MANIFEST}: embeddings[{name!r}]"
        old = _input_embedding(model, name, where)
        v, k = old.num_embeddings, old.embedding_dim
        levels = []
        for m, g in _levels(where, name, info):
            if m == info.head_name:
                levels.append(_head_level(model, info, v, k))
                continue
            if shared := _shared_level(model, info, m):
                levels.append(shared)
                continue
            levels.append(stored_level(files, info, m, g, v, k))
            consumed.update({f"{m}.qweight", f"{m}.scales_and_zeros"})
        emb = PackedEmbedding(name, tuple(levels), embed_scale=_embed_scale(old))
        mapped += emb.stored_bytes
        model.set_input_embeddings(emb)
        what.append(" + ".join(f"{'head' if lv.module == info.head_name else lv.module} g{lv.group_size}"
                               for lv in levels))
    return replace(result, consumed=frozenset(consumed), mapped_bytes=mapped,
                   embeddings=f"packed 4-bit ({'; '.join(what)})")


def _input_embedding(model: nn.Module, name: str, where: str) -> nn.Embedding:
    """The model's input embedding, which must be the module the manifest names."""
    try:
        old = model.get_submodule(name)
    except AttributeError as e:
        raise EdgeqError(f"{where}: the model built from config.json has no module {name}") from e
    if old is not model.get_input_embeddings() or not isinstance(old, nn.Embedding):
        raise EdgeqError(f"{where}: {name} is not the model's input embedding ({type(old).__name__}); the checkpoint "
                         f"does not match config.json")
    return old


def _embed_scale(old: nn.Module) -> torch.Tensor | float | None:
    """The factor a scaled embedding (Gemma-2) multiplies its rows by: its ``embed_scale`` buffer, or, while that is
    still on the meta device (transformers' from_pretrained fills it after the swap), the float it is filled with."""
    buf = getattr(old, "embed_scale", None)
    if buf is None or isinstance(buf, (int, float)):  # BioGPT's is a plain Python number, not a buffer
        return None if buf is None else float(buf)
    if buf.is_meta:
        return torch.tensor(float(old.scalar_embed_scale), dtype=buf.dtype, device="cpu")
    return buf
