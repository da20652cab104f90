"""Assertion 3 of 3 that the head is quantised (1: the plan, 2: the loader): re-open what was written, from its
headers, before it is renamed into place."""

from __future__ import annotations

from pathlib import Path

from edgeq.convert.embeddings import verify_levels
from edgeq.convert.packers import packer
from edgeq.errors import EdgeqError
from edgeq.io.manifest import read_manifest
from edgeq.io.safetensors import read_header, sha256_file


def verify_written(directory: Path, head: str | None = None) -> None:
    """Re-open a written checkpoint from its headers: manifest, every shard's sha256, the head quantised, every
    quantised tensor's dtypes and shapes (the kernel's packer: :meth:`edgeq.convert.packers.Packer.verify`), every
    packed embedding level's (:func:`edgeq.convert.embeddings.verify_levels`).

    ``head``: the module the plan quantised as the output head (the recipe's); by default the manifest's record."""
    manifest = read_manifest(directory)
    found = {}
    for shard, digest in manifest.shards.items():
        path = Path(directory) / shard
        tensors, _ = read_header(path)
        found.update(tensors)
        if sha256_file(path) != digest:
            raise EdgeqError(f"{path}: sha256 does not match the manifest; the write was corrupted (disk?)")
    recorded = manifest.head_name
    head = head or recorded
    if recorded != head:
        raise EdgeqError(f"{directory}: the manifest records the output head {recorded!r}, the plan quantised {head!r}; refusing it")
    if f"{head}.qweight" not in found or head not in manifest.quantized_modules:
        raise EdgeqError(f"{directory}: the written checkpoint has no quantised {head}; refusing it")
    packer(manifest.kernel).verify(directory, manifest, found)
    verify_levels(directory, manifest, found)
