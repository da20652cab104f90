"""``edgeq inspect --verify``: read the tensor data too, in blocks of :data:`VERIFY_BLOCK_BYTES`.

Shard sha256 against the manifest; NaN/Inf in every float tensor, scales positive, zero points finite; an
unpack -> pack round trip with the stored layout on a sample of modules (the kernel's layout's, :mod:`edgeq.inspect.packed`)
and on a packed embedding's own levels, whose decoded rows must be finite (:mod:`edgeq.inspect.embeddings`);
a float head that is a byte copy of the embedding; and the model the config builds against the tensor shapes.
"""

from __future__ import annotations

import time

import torch

from edgeq.convert.recipe import Recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.manifest import Manifest
from edgeq.io.safetensors import FLOAT_CODES, TensorInfo, read_tensor, sha256_file
from edgeq.keys import HEAD_MODULE
from edgeq.inspect.embeddings import verify_tables
from edgeq.inspect.kinds import embedding, mib
from edgeq.inspect.packed import packed_checks
from edgeq.inspect.schema import QModule, VerifyResult

VERIFY_BLOCK_BYTES = 16 << 20
ROUNDTRIP_SAMPLE = 4
_SCALE_PAIRS = (".scales_and_zeros", "._weight_scale_and_zero")  # [..., 2]: (scale, zero) pairs
_SCALES = (".scales", ".weight_scale", "._weight_scale", ".weight.absmax", ".SCB")
_ABSMAX = (".weight.absmax", ".SCB")  # absmax of an all-zero block is 0: only negative is wrong


def blocks(info: TensorInfo):
    """The tensor in row blocks of about VERIFY_BLOCK_BYTES (one block for a 0-d tensor)."""
    if not info.shape:
        yield read_tensor(info)
        return
    rows = info.shape[0]
    row_bytes = info.nbytes // rows if rows else 0
    step = max(1, VERIFY_BLOCK_BYTES // max(row_bytes, 1))
    for a in range(0, rows, step):
        yield read_tensor(info, (a, min(rows, a + step)))


def check_values(info: TensorInfo, kind: str) -> list[str]:
    """NaN/Inf in any float tensor; scales must be positive and nonzero, zeros finite."""
    if info.nbytes == 0:
        return []
    if info.dtype not in FLOAT_CODES + ("F64", "F8_E4M3", "F8_E5M2"):
        for _ in blocks(info):  # packed and integer tensors: every bit pattern is a valid value; read them all
            pass
        return []
    bad = nonpos = badzero = 0
    sz = info.name.endswith(_SCALE_PAIRS) and info.shape and info.shape[-1] == 2
    scale = info.name.endswith(_SCALES)
    nonneg_only = info.name.endswith(_ABSMAX)
    for block in blocks(info):
        x = block.float()
        if sz:
            s, z = x[..., 0], x[..., 1]
            bad += int((~torch.isfinite(s)).sum())
            nonpos += int((torch.isfinite(s) & (s <= 0)).sum())
            badzero += int((~torch.isfinite(z)).sum())
        else:
            bad += int((~torch.isfinite(x)).sum())
            if scale:
                nonpos += int((torch.isfinite(x) & ((x < 0) if nonneg_only else (x <= 0))).sum())
    out = []
    what = "scales" if (sz or scale) else "values"
    if bad:
        out.append(f"{info.file.name}: tensor {info.name}: {bad} NaN/Inf {what}")
    if nonpos:
        out.append(f"{info.file.name}: tensor {info.name}: {nonpos} scale(s) {'negative' if nonneg_only else 'zero or negative'}")
    if badzero:
        out.append(f"{info.file.name}: tensor {info.name}: {badzero} NaN/Inf zero point(s)")
    return out


def roundtrip_picks(modules: dict[str, QModule]) -> list[str]:
    """The head, then one module of each distinct shape (different N exercise different tail blocks), at most
    ROUNDTRIP_SAMPLE."""
    picks = [HEAD_MODULE] if HEAD_MODULE in modules else []
    shapes = {(modules[m].n, modules[m].k) for m in picks}
    for m in sorted(modules):
        if len(picks) < ROUNDTRIP_SAMPLE and (modules[m].n, modules[m].k) not in shapes:
            picks.append(m)
            shapes.add((modules[m].n, modules[m].k))
    return picks


def _shard_digests(ckpt: Checkpoint, manifest: Manifest | None, problems: list[str]) -> tuple[dict, int]:
    """(shard -> verdict, bytes read): each shard's sha256 against the manifest's."""
    shards, read = {}, 0
    for f in ckpt.files:
        if manifest is None:
            shards[f.name] = "not checked (no manifest)"
            continue
        want = manifest.shards.get(f.name)
        if want is None:
            shards[f.name] = "not in manifest"
            continue
        got = sha256_file(f)
        read += f.stat().st_size
        shards[f.name] = "ok" if got == want else "sha256 mismatch"
        if got != want:
            problems.append(f"{f.name}: sha256 {got[:12]}... does not match the manifest's {want[:12]}...; the file "
                            "changed after it was written (disk, copy or edit); re-quantise or re-copy it")
    return shards, read


def verify(ckpt: Checkpoint, kind: str, manifest: Manifest | None, modules: dict, problems: list[str]) -> VerifyResult:
    """Read everything: shard digests, every tensor's values, and (edgeq) the unpack/repack round trip."""
    t0 = time.perf_counter()
    shards, read = _shard_digests(ckpt, manifest, problems)
    for info in ckpt.tensors.values():
        problems.extend(check_values(info, kind))
        read += info.nbytes
    roundtrip = []
    if manifest is not None:
        checks = packed_checks(manifest.kernel)
        roundtrip = checks.roundtrip(ckpt, manifest, modules, roundtrip_picks(modules), problems)
        roundtrip += verify_tables(ckpt, manifest, problems)  # a packed embedding's own levels, and E decoded
    return VerifyResult(len(ckpt.tensors), read, time.perf_counter() - t0, shards, tuple(roundtrip))


def config_problems(ckpt: Checkpoint, modules: dict[str, QModule]) -> list[str]:
    """The model config.json builds (on the meta device, as load builds it) must fit the tensors; a hidden_size or
    layer geometry that contradicts them is refused at load, so it is a problem here too."""
    from edgeq.io import skeleton  # noqa: PLC0415 - transformers; only under --verify
    from edgeq.runtime.swap import config_mismatches  # noqa: PLC0415

    try:
        model = skeleton.build_meta_model(skeleton.load_config(ckpt.root), torch.bfloat16)
    except EdgeqError as e:
        return [str(e)]
    shapes = {name: tuple(info.shape) for name, info in ckpt.tensors.items()}
    nk = {m: (q.n, q.k) for m, q in modules.items()}
    return [f"{p} (load refuses it)" for p in config_mismatches(model, shapes, nk)]


def stored_twice_data(ckpt: Checkpoint, recipe: Recipe, problems: list[str]) -> None:
    """An untied float head that is a byte-for-byte copy of the embedding is the same tensor twice."""
    head = ckpt.tensors.get(recipe.head)
    emb = embedding(ckpt, recipe)
    if head is None or emb is None or ckpt.config.get("tie_word_embeddings") is True:
        return
    if head.dtype != emb.dtype or head.shape != emb.shape:
        return
    if all(torch.equal(a, b) for a, b in zip(blocks(head), blocks(emb))):
        problems.append(f"{recipe.head} is a byte-for-byte copy of {emb.name} ({mib(head.nbytes)} stored twice); "
                        "set tie_word_embeddings=true and drop the copy, or quantise the head")
