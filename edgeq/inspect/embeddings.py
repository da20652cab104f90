"""The input embedding table of an edgeq checkpoint: how it is stored (bf16, or packed 4-bit levels summed at lookup:
docs/format.md, "Packed embeddings"), its bytes against bf16's, the header checks of every level, and under
``--verify`` each own level's unpack -> pack round trip and the decoded table.

The decoded table is the contract's ``E = bf16(sum_l D_l)`` with ``D_l = (q_l - 8) * scale_l + zero_l`` in fp32 (the
writer's own expression, edgeq/convert/embeddings.py), computed one row block at a time; inspect only asks that
every row is finite (a NaN scale would make the token's embedding NaN), not that it equals a re-quantisation.

    info = embedding_info(ckpt, manifest, recipe, problems)   # {module: {"storage", "source", "levels", "bytes", "bf16_bytes"}}
"""

from __future__ import annotations

import math

import torch

from edgeq.convert.recipe import Recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.manifest import Manifest
from edgeq.io.safetensors import read_tensor
from edgeq.keys import MANIFEST, EmbeddingStorage
from edgeq.layouts import tinygemm
from edgeq.layouts.base import get as get_layout
from edgeq.memory import text_config
from edgeq.inspect.kinds import embedding

DECODE_ROWS = 4096  # rows of E decoded at a time under --verify (V x K fp32 per level: bounded)


def embedding_info(ckpt: Checkpoint, manifest: Manifest, recipe: Recipe, problems: list[str]) -> dict:
    """{module: {"storage", "source", "levels": [{"module", "group_size", "bytes", "shared"}], "bytes",
    "bf16_bytes"}} for each packed table (from the headers, each level checked against the layout's tensors for
    [V, K] at its group size; problems appended), else the recipe's bf16 table, else {}. ``bytes`` are the table's
    own stored bytes (a tied level 0 is the head's, counted there: ``shared``)."""
    if not manifest.embeddings:
        emb = embedding(ckpt, recipe)
        if emb is None:
            return {}
        return {emb.name.removesuffix(".weight"): {"storage": str(EmbeddingStorage.BF16), "source": emb.name,
                                                   "levels": [], "bytes": emb.nbytes, "bf16_bytes": emb.nbytes}}
    out = {}
    lay = get_layout(manifest.kernel)
    for module, rec in manifest.embeddings.items():
        levels, vk = [], _shape(ckpt, manifest, module, problems)
        for m, g in manifest.embedding_levels(module):
            shared = m in manifest.quantized_modules
            specs = lay.out_tensors(m, *vk, g) if vk else []
            for name, dtype, shape in specs:
                t = ckpt.tensors.get(name)
                if t is None or t.dtype != dtype or list(t.shape) != list(shape):
                    got = f"{t.dtype} {list(t.shape)}" if t is not None else "missing"
                    problems.append(f"{MANIFEST}: packed embedding {module}: level {m} g{g}: {name} is {got}, expected "
                                    f"{dtype} {list(shape)} (the table is [{vk[0]}, {vk[1]}])")
            nbytes = sum(ckpt.tensors[n].nbytes for n, _, _ in specs if n in ckpt.tensors)
            levels.append({"module": m, "group_size": g, "bytes": nbytes, "shared": shared})
        if rec["source"] in ckpt.tensors:
            problems.append(f"{rec['source']} is stored beside the packed {module} ({ckpt.tensors[rec['source']].nbytes:,} "
                            "bytes twice); the runtime reads the levels, re-quantise without it")
        out[module] = {"storage": str(EmbeddingStorage.PACKED), "source": rec["source"], "levels": levels,
                       "bytes": sum(lv["bytes"] for lv in levels if not lv["shared"]),
                       "bf16_bytes": math.prod(vk) * 2 if vk else 0}
    return out


def _shape(ckpt: Checkpoint, manifest: Manifest, module: str, problems: list[str]) -> tuple[int, int] | None:
    """[V, K] of a packed table from its level 0's packed weight (U8 [V, K/2]), or None with the problem; a [V, K]
    that contradicts config.json's vocab_size / hidden_size is a problem too (load() refuses such a table)."""
    first = manifest.embedding_levels(module)[0][0]
    qw = ckpt.tensors.get(f"{first}.qweight")
    if qw is None or qw.dtype != "U8" or len(qw.shape) != 2:
        problems.append(f"{MANIFEST}: packed embedding {module}: level 0 {first} has no U8 [V, K/2] qweight")
        return None
    v, k = qw.shape[0], 2 * qw.shape[1]
    cfg = text_config(ckpt.config)
    want = (cfg.get("vocab_size"), cfg.get("hidden_size"))
    if None not in want and (v, k) != want:
        problems.append(f"config.json: vocab_size {want[0]} x hidden_size {want[1]}, but the packed embedding {module} is "
                        f"[{v}, {k}] (level 0 {first}.qweight); config.json and the tensors disagree: restore the "
                        f"config.json this checkpoint was written with, or re-quantise")
    return v, k


def packed_parts(manifest: Manifest, info: dict) -> set[str]:
    """The tensor names of every packed table's own levels (mapped as stored by the runtime, never cast/repacked)."""
    lay = get_layout(manifest.kernel)
    return {f"{lv['module']}{s}" for e in info.values() for lv in e["levels"] if not lv["shared"] for s in lay.suffixes}


def parameters(info: dict) -> int:
    """V * K of every packed table: parameters the quantised parts encode (bf16 tables count as plain tensors)."""
    return sum(e["bf16_bytes"] // 2 for e in info.values() if e["storage"] == EmbeddingStorage.PACKED)


def verify_tables(ckpt: Checkpoint, manifest: Manifest, problems: list[str]) -> list[str]:
    """``--verify``: every own level's unpack -> pack round trip, then E decoded in row blocks, every value finite.
    Returns the level modules whose bytes round-tripped (for the report's ``roundtrip``)."""
    if not manifest.embeddings:
        return []
    lay = get_layout(manifest.kernel)
    try:
        record = lay.parse_record(manifest.layout)
    except EdgeqError:
        return []  # reported from the headers already
    done = []
    for module in manifest.embeddings:
        levels = manifest.embedding_levels(module)
        vk = _shape(ckpt, manifest, module, [])
        names = [f"{m}{s}" for m, _ in levels for s in lay.suffixes]
        if vk is None or any(n not in ckpt.tensors for n in names):
            continue  # the header problems say which
        for m, g in levels:
            if m in manifest.quantized_modules:
                continue  # the head: its round trip is the quantised modules'
            read = lambda suffix, m=m: read_tensor(ckpt.tensors[f"{m}{suffix}"])  # noqa: E731
            if problem := lay.roundtrip(m, read, *vk, g, record):
                problems.append(problem)
            else:
                done.append(m)
        bad = _nonfinite_rows(ckpt, levels, vk, record)
        if bad:
            problems.append(f"packed embedding {module}: {bad} row(s) decode to NaN/Inf (E = bf16(sum of the levels)); "
                            "a level's scales or zeros are not finite")
    return done


def _nonfinite_rows(ckpt: Checkpoint, levels: list[tuple[str, int]], vk: tuple[int, int], record) -> int:
    """Rows of E with a NaN/Inf value, decoded DECODE_ROWS rows at a time (whole layout blocks)."""
    v, k = vk
    step = tinygemm.row_block(record, DECODE_ROWS)
    sz = {m: read_tensor(ckpt.tensors[f"{m}.scales_and_zeros"]) for m, _ in levels}
    bad = 0
    for a in range(0, v, step):
        b = min(v, a + step)
        total = None
        for m, g in levels:
            q = tinygemm.unpack(read_tensor(ckpt.tensors[f"{m}.qweight"], (a, b)), b - a, k, record)
            d = tinygemm.dequantize(q, sz[m][:, a:b], g, torch.float32)
            total = d if total is None else total + d
        bad += int((~torch.isfinite(total.to(torch.bfloat16))).any(dim=1).sum())
    return bad
