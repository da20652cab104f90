"""Zero-copy access to safetensors files: parse the header ourselves and view the data through a private mmap.

Why not ``safe_open(...).get_tensor``: it returns tensors in anonymous memory (a copy). Here every tensor is a
``torch.frombuffer`` view of an ``mmap.ACCESS_COPY`` (MAP_PRIVATE) mapping: the pages stay file-backed (they count
in RssFile, are shared with the page cache and can be dropped under pressure) and nothing is read until used.
Writing to such a tensor would copy only the touched page into anonymous memory and never reach the file.

File format: ``u64 little-endian header length | JSON header | data``; the header maps each name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the start of the data.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeq.errors import DamagedCheckpointError, EdgeqError

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu,
}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """Return (header dict without __metadata__, absolute offset of the data section)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise EdgeqError(f"{path}: truncated safetensors file ({size} bytes); re-create it")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise EdgeqError(f"{path}: header length {n} exceeds the file ({size} bytes); the file is truncated or corrupt")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise EdgeqError(f"{path}: safetensors header is not valid JSON ({e}); the file is corrupt") from e
    header.pop("__metadata__", None)
    return header, 8 + n


def _check_size(shard: Path, size: int, end_of_data: int) -> None:
    """A safetensors file ends where its last tensor ends (the format allows no trailing bytes): a shard longer than
    its header says was appended to or overwritten by another file (truncation fails the offsets check above)."""
    if size != end_of_data:
        raise DamagedCheckpointError(
            f"{shard}: {size} bytes but its header describes {end_of_data} ({size - end_of_data:+d}); the file was "
            f"changed after it was written: re-copy it or re-quantise"
        )


class MappedFiles:
    """All safetensors shards of a directory, mapped; ``get(name)`` returns a zero-copy tensor."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.infos: dict[str, TensorInfo] = {}
        self._maps: dict[str, mmap.mmap] = {}
        for shard in self._shards():
            self._index_shard(shard)

    def _shards(self) -> list[Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError) as e:
                raise EdgeqError(f"{index}: malformed index ({e}); re-create the checkpoint") from e
            shards = [self.directory / n for n in names]
            for s in shards:
                if not s.exists():
                    raise EdgeqError(f"{index}: points at missing shard {s.name}; the checkpoint is incomplete")
            return shards
        single = self.directory / "model.safetensors"
        if single.exists():
            return [single]
        if any(self.directory.glob("*.bin")) or any(self.directory.glob("*.pt")):
            raise EdgeqError(f"{self.directory}: only pickle weights (*.bin/*.pt); edgeq never unpickles, convert to safetensors")
        raise EdgeqError(f"{self.directory}: no model.safetensors or model.safetensors.index.json")

    def _index_shard(self, shard: Path) -> None:
        header, data_start = read_header(shard)
        size = shard.stat().st_size
        end_of_data = data_start
        for name, h in header.items():
            try:
                dtype = DTYPES[h["dtype"]]
                shape = tuple(int(d) for d in h["shape"])
                begin, end = (int(v) for v in h["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise EdgeqError(f"{shard.name}: tensor {name}: malformed header entry ({e})") from e
            nbytes = math.prod(shape) * dtype.itemsize
            if end - begin != nbytes or data_start + end > size or begin < 0:
                raise EdgeqError(
                    f"{shard.name}: tensor {name} {list(shape)} {h['dtype']}: offsets {begin}..{end} do not match its "
                    f"size {nbytes} or run past the file ({size} bytes); the file is truncated or corrupt"
                )
            if name in self.infos:
                raise EdgeqError(f"{shard.name}: tensor {name} also appears in {Path(self.infos[name].file).name}")
            self.infos[name] = TensorInfo(name, str(shard), dtype, shape, data_start + begin, nbytes)
            end_of_data = max(end_of_data, data_start + end)
        _check_size(shard, size, end_of_data)

    def _map(self, file: str) -> mmap.mmap:
        if file not in self._maps:
            fd = os.open(file, os.O_RDONLY)
            try:
                self._maps[file] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
        return self._maps[file]

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def names(self) -> list[str]:
        return list(self.infos)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored, viewing the mapping (no copy, nothing read yet)."""
        info = self.infos.get(name)
        if info is None:
            raise EdgeqError(f"{self.directory}: tensor {name} is missing from the checkpoint")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        if info.offset % info.dtype.itemsize:
            raise EdgeqError(f"{Path(info.file).name}: tensor {name} is not aligned to its dtype; rewrite the file")
        t = torch.frombuffer(self._map(info.file), dtype=info.dtype, count=info.nbytes // info.dtype.itemsize, offset=info.offset)
        return t.view(info.shape)

    def mapped_bytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())
