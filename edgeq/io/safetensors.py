"""safetensors, read and written by edgeq itself: validated headers, positioned reads, streamed writes.

File format: ``u64 little-endian header length n | n bytes of JSON header | data``. The header maps each tensor
name to ``{"dtype": "BF16", "shape": [N, K], "data_offsets": [begin, end]}`` (offsets relative to the data
section) plus an optional ``"__metadata__"`` dict of strings.

Why not ``safe_open`` for conversion: it memory-maps the file, and every page it touches then counts in the
converting process's RSS (file-backed) until unmapped, so peak RSS would grow with the model. Positioned reads
(``readinto``) into a small buffer keep the conversion's resident memory bounded by one row block. The runtime, which
*wants* the mapping, maps the files whose headers :func:`parse_header` validated (edgeq.io.mapped).

Every header is checked before any data is trusted: length within the file, valid JSON, known dtypes, shapes
consistent with byte ranges, ranges inside the file and not overlapping. Each failure names the file and, where
there is one, the tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeq.errors import EdgeqError

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    # the rest of what the safetensors package writes (tests/test_safetensors_compat.py); not F4/F6, whose shape
    # counts sub-byte elements
    "U16": (torch.uint16, 2),
    "U32": (torch.uint32, 4),
    "U64": (torch.uint64, 8),
    "F8_E4M3FNUZ": (torch.float8_e4m3fnuz, 1),
    "F8_E5M2FNUZ": (torch.float8_e5m2fnuz, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "C64": (torch.complex64, 8),
}
CODES = {dt: code for code, (dt, _) in DTYPES.items()}
FLOAT_CODES = ("BF16", "F16", "F32")
MAX_HEADER = 100 << 20  # the safetensors reference implementation refuses larger headers too
ALIGN = 8


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``file`` and the absolute byte offset ``start`` of its ``nbytes`` bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """One file's validated header: its tensors in header order, its metadata, where the data section starts and
    the file's size. E.g. a file holding one BF16 [2, 3] tensor after a 56-byte header: ``data_start`` 64, the
    tensor's ``start`` 64 and ``nbytes`` 12, ``data_end`` 76, and ``size`` 76 unless bytes follow the data."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    size: int

    @property
    def data_end(self) -> int:
        """The absolute offset where the last tensor's bytes end (``data_start`` when there are none)."""
        return max((t.start + t.nbytes for t in self.tensors.values()), default=self.data_start)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header without reading tensor data; returns (tensors, metadata)."""
    header = parse_header(path)
    return header.tensors, header.metadata


def parse_header(path: Path) -> Header:
    """:func:`read_header`, also returning where the data starts and the file's size (the runtime checks that the
    file ends where its data does)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise EdgeqError(f"{path}: truncated safetensors file ({size} bytes, no header); re-download or re-export it")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise EdgeqError(
                    f"{path}: corrupt safetensors header (claims {n} header bytes in a {size}-byte file); re-download or re-export it"
                )
            raw = f.read(n)
    except OSError as e:
        raise EdgeqError(f"{path}: cannot read ({e.strerror}); check the path and permissions") from e
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # also over-long integers and nesting too deep for the parser
        raise EdgeqError(f"{path}: corrupt safetensors header (not JSON: {str(e)[:100]}); re-download or re-export it") from e
    if not isinstance(header, dict):
        raise EdgeqError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise EdgeqError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    data_start, data_size = 8 + n, size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _entry(path, name, entry, data_start, data_size)
    spans = sorted((t.start, t.start + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, e0, a), (b1, _, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise EdgeqError(f"{path}: corrupt safetensors header (tensors {a} and {b} overlap)")
    return Header(path, tensors, {str(k): str(v) for k, v in meta.items()}, data_start, size)


def _entry(path: Path, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
    where = f"{path}: tensor {name}"
    if not isinstance(entry, dict):
        raise EdgeqError(f"{where}: corrupt header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise EdgeqError(f"{where}: unsupported dtype {dtype!r} (edgeq reads {', '.join(DTYPES)})")
    ok_shape = isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ok_off = (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    )
    if not ok_shape or not ok_off:
        raise EdgeqError(f"{where}: corrupt header entry (shape {shape!r}, data_offsets {offsets!r})")
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype][1]
    if not 0 <= begin <= end or end - begin != nbytes:
        raise EdgeqError(f"{where}: header says {dtype} {shape} ({nbytes} bytes) but data_offsets span {end - begin} bytes")
    if end > data_size:
        raise EdgeqError(
            f"{where}: data ends at byte {data_start + end} but the file has {data_start + data_size}: truncated file; re-download it"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, nbytes)


def read_tensor(info: TensorInfo, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Read a tensor, or rows a..b of its first dimension, with one positioned read into fresh memory."""
    a, b = rows if rows is not None else (0, info.shape[0] if info.shape else 1)
    row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
    count = (b - a) * row_bytes
    buf = bytearray(count)
    with open(info.file, "rb") as f:
        f.seek(info.start + a * row_bytes)
        got = f.readinto(buf)
    if got != count:
        raise EdgeqError(f"{info.file}: tensor {info.name}: short read ({got} of {count} bytes): the file is truncated")
    if count == 0:
        return torch.empty((b - a, *info.shape[1:]) if info.shape else (), dtype=info.torch_dtype)
    t = torch.frombuffer(buf, dtype=info.torch_dtype)
    return t.reshape((b - a, *info.shape[1:]) if info.shape else ())


@dataclass(frozen=True)
class OutSpec:
    """One output tensor, declared before writing so headers can be written first and data streamed after."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[CODES[self.dtype]][1]


def _header_bytes(specs: list[OutSpec], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    off = 0
    for s in specs:
        header[s.name] = {"dtype": CODES[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)  # data section 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(raw)) + raw


# Bytes go to the file in whole, aligned chunks of this size (the last one of a shard shorter). Why: the page cache
# keeps a file in folios sized by the writes that filled it, and only 2 MiB folios can be mapped with one PMD entry.
# Measured on ext4, Linux 6.18, Zen 4 (2026-12-01): a 1.2 GB checkpoint copied in 4 MiB writes was 100% PMD-mapped
# when loaded, in 1 MiB writes (or by cp) 0%; a fresh conversion gets 2 MiB folios only where free 2 MiB blocks were
# found while it wrote (36-77% while other jobs ran). Reading one decode step's packed weights through PMD-mapped
# pages ran 1.08-1.19x the rate of 4 KiB pages, decode 1.08x (docs/runtime.md, "Huge pages"). One 4 MiB buffer.
WRITE_CHUNK = 4 << 20


class ShardedWriter:
    """Stream tensors into ``model[-0000i-of-0000n].safetensors`` in declared order; hash while writing.

    ``write(name, part)`` appends bytes of the current tensor (a tensor may arrive in row blocks); calls must follow
    the declared order and deliver exactly the declared byte count, which ``close()`` checks. The file receives them
    in :data:`WRITE_CHUNK`-aligned writes of that size (small tensors are gathered first; why: above).
    """

    def __init__(self, out_dir: Path, specs: list[OutSpec], max_shard_bytes: int = 2 << 30, metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards: list[list[OutSpec]] = [[]]
        size = 0
        for s in specs:
            if self.shards[-1] and size + s.nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(s)
            size += s.nbytes
        n = len(self.shards)
        self.names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.order = [(i, s) for i, shard in enumerate(self.shards) for s in shard]
        self.pos = 0  # index into self.order of the tensor being written
        self.written = 0  # bytes of it written so far
        self.shard = -1
        self.file = None
        self.hash = None
        self.digests: dict[str, str] = {}
        self._pending = bytearray()  # bytes not yet written, short of the next WRITE_CHUNK boundary
        self._at = 0  # bytes of the open shard written to its file

    def _open(self, i: int) -> None:
        self._finish_shard()
        self.shard = i
        self.file = open(self.out_dir / self.names[i], "wb")
        self._at = 0
        self.hash = hashlib.sha256()
        self._emit(_header_bytes(self.shards[i], self.metadata))

    def _emit(self, data: bytes | memoryview) -> None:
        """Hash ``data`` and pass it on so that every write ends on a multiple of WRITE_CHUNK (the shard's end apart):
        bytes short of the next boundary wait in ``_pending``; large tensors go straight from the caller's buffer."""
        self.hash.update(data)
        view = memoryview(data).cast("B")
        while len(view):
            room = WRITE_CHUNK - (self._at + len(self._pending)) % WRITE_CHUNK
            if len(view) < room:
                self._pending += view
                return
            if self._pending:
                self._pending += view[:room]
                view = view[room:]
                self._write(self._pending)
                self._pending = bytearray()
            else:
                n = room + (len(view) - room) // WRITE_CHUNK * WRITE_CHUNK
                self._write(view[:n])
                view = view[n:]

    def _write(self, data) -> None:
        try:
            self.file.write(data)
        except OSError as e:
            raise EdgeqError(f"{self.out_dir / self.names[self.shard]}: write failed ({e.strerror}); free disk space and retry") from e
        self._at += len(data)

    def _finish_shard(self) -> None:
        if self.file is not None:
            try:
                if self._pending:  # the shard's last, shorter write
                    self._write(self._pending)
                    self._pending = bytearray()
            finally:
                self.file.close()
                self.file = None
            self.digests[self.names[self.shard]] = self.hash.hexdigest()

    def write(self, name: str, part: torch.Tensor) -> None:
        if self.pos >= len(self.order) or self.order[self.pos][1].name != name:
            expected = self.order[self.pos][1].name if self.pos < len(self.order) else "nothing"
            raise RuntimeError(f"writer: got {name}, expected {expected}")
        shard, spec = self.order[self.pos]
        if part.dtype != spec.dtype:
            raise RuntimeError(f"writer: {name} is {spec.dtype}, got {part.dtype}")
        if shard != self.shard:
            self._open(shard)
        data = part.contiguous().reshape(-1).view(torch.uint8).numpy().data
        self._emit(data)
        self.written += data.nbytes
        if self.written > spec.nbytes:
            raise RuntimeError(f"writer: {name} got {self.written} bytes, declared {spec.nbytes}")
        if self.written == spec.nbytes:
            self.pos, self.written = self.pos + 1, 0

    def read_back(self, name: str, start: int, stop: int) -> bytes:
        """Bytes ``start..stop`` of the data of ``name``, a tensor already written whole, as stored: a later tensor
        computed from an earlier one reads it back in blocks instead of holding it (edgeq/convert/embeddings.py: a
        packed embedding's residual from the head as written). What is still pending comes from the buffer, so
        reading back never breaks the aligned writes (it is called once per row block)."""
        done = [(i, s) for i, s in self.order[: self.pos] if s.name == name]
        if not done or not 0 <= start <= stop <= done[0][1].nbytes:
            raise RuntimeError(f"writer: cannot read back {name} bytes {start}..{stop} (not written whole, or out of range)")
        shard, spec = done[0]
        specs = self.shards[shard]
        before = sum(s.nbytes for s in specs[: next(j for j, s in enumerate(specs) if s.name == name)])
        a = len(_header_bytes(specs, self.metadata)) + before + start
        b = a + stop - start
        on_disk = b
        tail = b""
        if shard == self.shard and self.file is not None:
            self.file.flush()  # what _write handed over (the buffered file object may hold a few bytes)
            on_disk = min(b, self._at)
            tail = bytes(self._pending[max(a, self._at) - self._at : b - self._at]) if b > self._at else b""
        data = b""
        if on_disk > a:
            with open(self.out_dir / self.names[shard], "rb") as f:
                f.seek(a)
                data = f.read(on_disk - a)
        data += tail
        if len(data) != stop - start:
            raise RuntimeError(f"writer: read back {len(data)} of {stop - start} bytes of {name}")
        return data

    def close(self) -> dict[str, str]:
        """Finish the last shard, write the index when sharded; returns {shard file: sha256}."""
        if self.pos != len(self.order):
            raise RuntimeError(f"writer: closed before {self.order[self.pos][1].name} was written")
        while self.shard < len(self.shards) - 1:  # trailing shards with only empty tensors
            self._open(self.shard + 1)
        self._finish_shard()
        if len(self.names) > 1:
            index = {
                "metadata": {"total_size": sum(s.nbytes for _, s in self.order)},
                "weight_map": {s.name: self.names[i] for i, s in self.order},
            }
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return dict(self.digests)

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self._pending = bytearray()


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
