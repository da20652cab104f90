"""Zero-copy access to safetensors files: parse the header ourselves and view the data through a private mmap.

Why not ``safe_open(...).get_tensor``: it returns tensors in anonymous memory (a copy). Here every tensor is a
``torch.frombuffer`` view of an ``mmap.ACCESS_COPY`` (MAP_PRIVATE) mapping: the pages stay file-backed (they count
in RssFile, are shared with the page cache and can be dropped under pressure) and nothing is read until used.
Writing to such a tensor would copy only the touched page into anonymous memory and never reach the file.

Headers are parsed and validated by :func:`edgeq.io.safetensors.parse_header` (the one parser: dtypes, shapes, byte
ranges, overlaps) and the shards found by :func:`edgeq.io.hf.weight_files` (the index, else ``model.safetensors``;
pickle weights refused). On top of that the runtime checks what a zero-copy view needs: a shard ends exactly where
its data does (:class:`DamagedCheckpointError` otherwise), and a tensor starts at a multiple of its dtype's size.

Huge pages: each mapping is advised ``MADV_HUGEPAGE`` (:func:`advise_huge`). Where the page cache holds the file in
2 MiB folios (edgeq's writer fills it that way; a cold read through an advised mapping too), the kernel maps them
with one PMD entry each instead of 512 PTEs, and the decode step, which streams every weight once per token, spends
fewer cycles on TLB misses (measured: docs/runtime.md, "Huge pages"). Nothing is copied or allocated: the pages stay
the page cache's, file-backed as before. (A table read by rows, the input embedding, is not treated differently: on
Linux 6.18 a fault maps a large page-cache folio whole even under MADV_NOHUGEPAGE, so that advice saved no RSS;
docs/runtime.md, "Huge pages".)
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.io.hf import add_tensors, weight_files
from edgeq.io.safetensors import Header, TensorInfo, parse_header


def _check_size(header: Header) -> None:
    """A safetensors file ends where its last tensor ends (the format allows no trailing bytes): a shard longer than
    its header says was appended to or overwritten by another file (truncation fails the header's offsets check)."""
    size, end_of_data = header.size, header.data_end
    if size != end_of_data:
        raise DamagedCheckpointError(
            f"{header.path}: {size} bytes but its header describes {end_of_data} ({size - end_of_data:+d}); the file was "
            f"changed after it was written: re-copy it or re-quantise"
        )


def advise_huge(m: mmap.mmap) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on a mapping: its pages may then be 2 MiB folios mapped by one page-table entry
    (reads from disk through it fill the page cache with such folios). A hint only: False where the kernel has no
    transparent huge pages (or Python no madvise), and nothing changes."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or len(m) == 0:
        return False
    try:
        m.madvise(advice)
    except OSError:
        return False
    return True


class MappedFiles:
    """All safetensors shards of a directory, mapped; ``get(name)`` returns a zero-copy tensor."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.files, _ = weight_files(self.directory, any_name=False)
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        for shard in self.files:
            header = parse_header(shard)
            add_tensors(self.tensors, header.tensors)
            _check_size(header)

    def _map(self, file: Path) -> mmap.mmap:
        if file not in self._maps:
            fd = os.open(file, os.O_RDONLY)
            try:
                self._maps[file] = m = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                advise_huge(m)
            finally:
                os.close(fd)
        return self._maps[file]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored, viewing the mapping (no copy, nothing read yet)."""
        info = self.tensors.get(name)
        if info is None:
            raise EdgeqError(f"{self.directory}: tensor {name} is missing from the checkpoint")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.torch_dtype)
        if info.start % info.itemsize:
            raise EdgeqError(f"{info.file.name}: tensor {name} is not aligned to its dtype; rewrite the file")
        t = torch.frombuffer(self._map(info.file), dtype=info.torch_dtype, count=info.nbytes // info.itemsize,
                             offset=info.start)
        return t.view(info.shape)

    def mapped_bytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())
