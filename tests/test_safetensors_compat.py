"""edgeq's own safetensors code against the safetensors package, both directions, every dtype.

edgeq has one parser of the format (edgeq.io.safetensors) behind two readers (its positioned reads for conversion
and inspect; edgeq.io.mapped for the runtime: a private mmap) and one writer (edgeq.io.safetensors.ShardedWriter).
Each is checked here against the reference implementation: what safetensors writes, both readers read to the same
bits; what edgeq writes, safetensors reads to the same bits; and on fuzzed headers, whatever safetensors accepts both
readers accept with the same dtype, shape and byte range, while edgeq's errors stay EdgeqError.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from edgeq.io import safetensors as io
from edgeq.errors import EdgeqError
from edgeq.io import mapped as weights
from helpers.mapping import vm_flags

CODES = sorted(io.DTYPES)
SHAPES = {"matrix": (3, 5), "scalar": (), "empty": (0, 4), "vector": (7,)}


def _random(code: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of a dtype (every bit pattern, NaNs included; bool 0/1), so that equality is bitwise."""
    dtype, size = io.DTYPES[code]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw[: torch.Size(shape).numel() * size].view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _all_dtypes() -> dict[str, torch.Tensor]:
    return {f"{code}.{kind}": _random(code, shape, seed=i * 10 + j)
            for i, code in enumerate(CODES) for j, (kind, shape) in enumerate(SHAPES.items())}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and _bits(a) == _bits(b)


def test_edgeq_knows_every_dtype_safetensors_reads_into_torch():
    from safetensors import torch as st_torch

    theirs = set(getattr(st_torch, "_TYPES", {}))
    assert theirs, "safetensors.torch no longer lists its dtypes in _TYPES; update this test"
    assert theirs <= set(io.DTYPES), f"edgeq lacks {sorted(theirs - set(io.DTYPES))}"
    assert {"U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0"} <= set(io.DTYPES)
    # one table: the runtime indexes its shards with the same parser (no table of its own to drift)
    assert not hasattr(weights, "DTYPES") and weights.parse_header is io.parse_header


def test_edgeq_reads_what_safetensors_writes(tmp_path):
    tensors = _all_dtypes()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"origin": "safetensors"})
    infos, meta = io.read_header(path)
    assert meta == {"origin": "safetensors"} and set(infos) == set(tensors)
    mapped = weights.MappedFiles(tmp_path)
    for name, want in tensors.items():
        info = infos[name]
        assert (info.dtype, info.shape) == (name.split(".")[0], tuple(want.shape)), name
        assert _same(io.read_tensor(info), want), name
        assert _same(mapped.get(name), want), name


def test_safetensors_reads_what_edgeq_writes(tmp_path):
    tensors = _all_dtypes()
    specs = [io.OutSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    writer = io.ShardedWriter(tmp_path, specs, max_shard_bytes=64, metadata={"origin": "edgeq"})
    for name, t in tensors.items():
        if t.dim() == 2 and t.shape[0] > 1:  # in row blocks, as the converter streams them
            writer.write(name, t[:1])
            writer.write(name, t[1:])
        else:
            writer.write(name, t)
    digests = writer.close()
    assert len(digests) > 1  # sharded: the index is checked too
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(tensors)
    seen = set()
    for shard in digests:
        with safe_open(str(tmp_path / shard), framework="pt") as f:  # the reference parser: strict about layout
            assert f.metadata() == {"format": "pt", "origin": "edgeq"}
            for name in f.keys():
                assert index[name] == shard and _same(f.get_tensor(name), tensors[name]), name
                seen.add(name)
    assert seen == set(tensors)


def test_sub_byte_dtypes_are_refused_by_name(tmp_path):
    """F4 packs two values a byte and its shape counts values: not in edgeq's tables, refused, never misread."""
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    save_file({"w": torch.zeros(4, dtype=torch.uint8).view(fp4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(EdgeqError, match="tensor w: unsupported dtype 'F4'"):
        io.read_header(tmp_path / "model.safetensors")
    with pytest.raises(EdgeqError, match="F4"):
        weights.MappedFiles(tmp_path)


def _raw_file(path: Path, header: object, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("header, message", [
    ([{"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}], r"corrupt safetensors header \(not a JSON object\)"),
    ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, r"tensor w: unsupported dtype 'Q4' \(edgeq reads BF16"),
], ids=["json-list", "unknown-dtype"])
def test_the_runtime_refuses_a_bad_header_naming_the_file(tmp_path, header, message):
    """Once the runtime's own parser raised TypeError on a JSON list and called an unknown dtype a malformed entry."""
    path = _raw_file(tmp_path / "model.safetensors", header, b"\0\0")
    with pytest.raises(EdgeqError, match=f"^{path}: {message}"):
        weights.MappedFiles(tmp_path)


def test_the_runtime_refuses_trailing_bytes_and_a_stray_name(tmp_path):
    """What the runtime checks beyond the parser: the file ends where its data does; a shard found by the index or
    as model.safetensors (another *.safetensors beside it is no shard); the same tensor in two shards."""
    from edgeq.errors import DamagedCheckpointError

    w = {"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    path = _raw_file(tmp_path / "model.safetensors", w, b"\1\2\3")
    with pytest.raises(DamagedCheckpointError, match=f"^{path}: .* but its header describes .*\\(\\+1\\)"):
        weights.MappedFiles(tmp_path)
    _raw_file(path, w, b"\1\2")
    _raw_file(tmp_path / "other.safetensors", {"v": w["w"]}, b"\1\2")
    assert weights.MappedFiles(tmp_path).names() == ["w"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors",
                                                                                       "v": "other.safetensors"}}))
    assert sorted(weights.MappedFiles(tmp_path).names()) == ["v", "w"]
    _raw_file(tmp_path / "other.safetensors", w, b"\1\2")
    with pytest.raises(EdgeqError, match="other.safetensors: tensor w also appears in model.safetensors"):
        weights.MappedFiles(tmp_path)


# -------------------------------------------------------------------------------------------------- fuzzing
_entry = st.tuples(st.text("abc._", min_size=1, max_size=4),
                   st.sampled_from(CODES + ["Q8", "bf16"]),
                   st.lists(st.integers(0, 3), max_size=3),
                   st.one_of(st.just(0), st.integers(-2, 2)))  # error added to this entry's end (often none)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.lists(_entry, max_size=4, unique_by=lambda e: e[0]), tail=st.one_of(st.just(0), st.integers(-3, 3)),
       meta=st.one_of(st.none(), st.dictionaries(st.text("xy", max_size=2), st.text("z", max_size=2), max_size=2)))
def test_fuzzed_headers_agree_with_safetensors(entries, tail, meta):
    header, off = {}, 0
    if meta is not None:
        header["__metadata__"] = meta
    for name, code, shape, err in entries:
        n = torch.Size(shape).numel() * (io.DTYPES[code][1] if code in io.DTYPES else 1)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [off, max(off, off + n + err)]}
        off = max(off, off + n + err)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data = bytes((i * 7) % 256 for i in range(max(0, off + tail)))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        try:
            with safe_open(str(path), framework="pt") as f:
                reference = {n: f.get_tensor(n) for n in f.keys()}
        except Exception:  # safetensors refuses it: edgeq may refuse or accept (it allows gaps), never crash
            reference = None
        try:
            ours = io.read_header(path)[0]
        except EdgeqError:
            assert reference is None, "safetensors reads this header, edgeq refuses it"
            return
        if reference is None:
            return
        assert set(ours) == set(reference)
        mapped = weights.MappedFiles(Path(d))
        for name, want in reference.items():
            assert _same(io.read_tensor(ours[name]), want), name
            if want.numel() and ours[name].start % want.element_size():
                # the runtime's zero-copy view needs dtype alignment (safetensors copies): refused by name instead
                with pytest.raises(EdgeqError, match=f"tensor {name} is not aligned"):
                    mapped.get(name)
            else:
                assert _same(mapped.get(name), want), name


class _Recorder:
    """A file object that records the file offset at which each write ends."""

    def __init__(self, f, ends: list[int]):
        self.f, self.ends = f, ends

    def write(self, data) -> int:
        n = self.f.write(data)
        self.ends.append(self.f.tell())
        return n

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_the_writer_ends_every_write_on_a_chunk_boundary(tmp_path, monkeypatch):
    """Writes end on multiples of WRITE_CHUNK (so the page cache can hold the file in 2 MiB folios; edgeq/io/
    safetensors.py says why), except a shard's last write; the bytes are what safetensors
    reads, and the digest is the file's; read_back serves what is still pending from the buffer (it writes nothing).
    40-byte chunks here so that small tensors cross many boundaries."""
    monkeypatch.setattr(io, "WRITE_CHUNK", 40)
    ends: list[int] = []
    real_open = open
    monkeypatch.setattr(io, "open", lambda p, mode="r", *a, **k: _Recorder(real_open(p, mode, *a, **k), ends)
                        if "w" in mode else real_open(p, mode, *a, **k), raising=False)
    tensors = {"a": _random("U8", (3, 50), 1), "b": _random("BF16", (7,), 2), "c": _random("F32", (33, 5), 3)}
    writer = io.ShardedWriter(tmp_path, [io.OutSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    writer.write("a", tensors["a"][:1])
    writer.write("a", tensors["a"][1:])
    written = list(ends)
    # the header is 216 bytes: `a` is file bytes 216..366, of which 360..366 are still pending
    assert writer.read_back("a", 10, 60) == _bits(tensors["a"])[10:60]  # on disk
    assert writer.read_back("a", 140, 150) == _bits(tensors["a"])[140:150]  # partly on disk, partly pending
    assert writer.read_back("a", 146, 150) == _bits(tensors["a"])[146:150]  # pending only
    assert ends == written  # reading back wrote nothing
    writer.write("b", tensors["b"])
    for block in tensors["c"].split(4):
        writer.write("c", block)
    digests = writer.close()
    size = (tmp_path / "model.safetensors").stat().st_size
    unaligned = [e for e in ends if e % 40]
    assert ends[-1] == size and unaligned == ([size] if size % 40 else [])
    assert len(ends) > 10 and all(e > d for d, e in zip(ends, ends[1:]))
    assert digests == {"model.safetensors": io.sha256_file(tmp_path / "model.safetensors")}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert all(_same(f.get_tensor(n), t) for n, t in tensors.items())


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="no transparent huge pages")
def test_the_runtime_advises_huge_pages_on_every_mapping(tmp_path):
    """Each shard mapping carries MADV_HUGEPAGE (VmFlags `hg` in smaps): 2 MiB page-cache folios get PMD-mapped."""
    save_file({"w": torch.zeros(1024, 1024, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    files = weights.MappedFiles(tmp_path)
    t = files.get("w")
    flags = vm_flags(t.data_ptr())
    assert flags is not None and "hg" in flags, flags
