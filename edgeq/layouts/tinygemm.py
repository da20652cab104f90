"""The CPU tinygemm W4A16 layout: measured, fingerprinted, exactly invertible.

Math (torchao's "tinygemm" affine scheme, float zero point, per group of G input channels along K)::

    w[n, k] ~= (q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]        q in 0..15 (uint4)

Tensors as stored and as the kernel consumes them:

- ``qweight``: uint8 [N, K/2], the output of ``aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)``;
- ``scales_and_zeros``: bf16 [K/G, N, 2], ``[..., 0]`` the scale, ``[..., 1]`` the zero;
- ``aten._weight_int4pack_mm_for_cpu(x bf16 [M, K], qweight, G, scales_and_zeros) -> bf16 [M, N]``.

The packing is not documented and depends on the CPU capability torch dispatches to, so it is *measured*
(:func:`probe`): a position-coded matrix is packed and the permutation read back. What torch 2.13 does, as measured
on this project's machines (the probe re-derives it on every machine; nothing below is assumed by the code):

- rows are cut into blocks of ``block_n`` rows (64 on AVX512, 32 on AVX2 and the default path) and a tail block of
  ``N % block_n`` rows (a multiple of 16); block b occupies exactly its own rows of the [N, K/2] tensor;
- inside a block of s rows the bytes are k-major: ``s/2`` bytes for k = 0, then for k = 1, ...; nibble position
  ``p`` (``p = 2*j`` the low nibble of byte j, ``2*j + 1`` its high nibble) holds row ``n0 + perm_s[p]``;
- full AVX512/AVX2 blocks interleave halves (``perm = [0, s/2, 1, s/2 + 1, ...]``); tails and the default
  path hold adjacent rows (``perm = [0, 1, 2, ...]``).

Worked example (AVX512, s = 64, K = 2): the first byte of block 0 is ``q[0, 0] | q[32, 0] << 4``, the 33rd byte
is ``q[0, 1] | q[32, 1] << 4``.

The measured permutations are stored in the checkpoint's manifest, so any machine can unpack any checkpoint exactly
(and repack it for its own kernel), and the fingerprint says whether the stored bytes are the kernel's own here.
"""

# size: one file per layout (docs/architecture.md, "Adding a layout"): the measured packing, its record and its
# Layout members belong together; the W4A16 compute (mm, dequantize) is the part that could move to the runtime.
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

import torch

from edgeq.errors import EdgeqError
from edgeq.keys import MANIFEST, Kernel
from edgeq.layouts.base import RecordCheck, StoredShape, stored_mismatches
from edgeq.memory import scratch

PACK_OP = "aten::_convert_weight_to_int4pack_for_cpu"
KERNEL = Kernel.W4A16
ROW_MULTIPLE = 16  # the pack op requires N % 16 == 0
GROUP_SIZES = (32, 64, 128, 256)  # the mm op requires qGroupSize in this set


@dataclass(frozen=True)
class TinygemmLayout:
    """A measured tinygemm packing: the row-block size and the nibble order of every block size.

    ``perms`` maps a block's row count (``block_n`` for full blocks, smaller for the tail) to the tuple
    ``perm`` with ``perm[p] = row offset held by nibble position p``.
    """

    block_n: int
    perms: tuple[tuple[int, tuple[int, ...]], ...]
    torch_version: str = ""
    cpu_capability: str = ""
    op: str = PACK_OP

    @property
    def layout_hash(self) -> str:
        """sha256 over the op name, block size and permutations: equal hashes mean identical bytes."""
        payload = json.dumps({"op": self.op, "block_n": self.block_n, "perms": [[s, list(p)] for s, p in self.perms]})
        return hashlib.sha256(payload.encode()).hexdigest()

    def perm(self, rows: int) -> tuple[int, ...]:
        for s, p in self.perms:
            if s == rows:
                return p
        raise EdgeqError(f"layout has no measured block of {rows} rows (block_n={self.block_n}); repack the checkpoint")

    def blocks(self, n: int) -> list[tuple[int, int, int]]:
        """``(first_row, block_rows, count)`` runs covering n rows: full blocks, then the tail."""
        if n % ROW_MULTIPLE:
            raise EdgeqError(f"N={n} is not a multiple of {ROW_MULTIPLE} (tinygemm packs rows in 16s)")
        full, tail = divmod(n, self.block_n)
        runs = [(0, self.block_n, full)] if full else []
        if tail:
            runs.append((full * self.block_n, tail, 1))
        return runs

    def fingerprint(self) -> dict:
        """The record without its permutations: what config.json copies and what says whether bytes are the same."""
        return {"op": self.op, "torch_version": self.torch_version, "cpu_capability": self.cpu_capability,
                "block_n": self.block_n, "layout_hash": self.layout_hash}

    def to_json(self) -> dict:
        return {**self.fingerprint(), "perms": {str(s): list(p) for s, p in self.perms}}

    @classmethod
    def from_json(cls, d: dict) -> "TinygemmLayout":
        try:
            layout = cls(
                block_n=int(d["block_n"]),
                perms=tuple(sorted((int(s), tuple(int(v) for v in p)) for s, p in d["perms"].items())),
                torch_version=str(d.get("torch_version", "")),
                cpu_capability=str(d.get("cpu_capability", "")),
                op=str(d.get("op", PACK_OP)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise EdgeqError(f"layout record is malformed ({e}); re-quantise or `edgeq repack` the checkpoint") from e
        if "layout_hash" in d and d["layout_hash"] != layout.layout_hash:
            raise EdgeqError("layout record's layout_hash does not match its permutations: the manifest was edited or corrupted")
        for s, p in layout.perms:
            if sorted(p) != list(range(s)):
                raise EdgeqError(f"layout record: block of {s} rows is not a permutation")
        return layout

    def is_compatible(self, other: "TinygemmLayout") -> bool:
        return self.op == other.op and self.layout_hash == other.layout_hash

    def missing_block(self, rows: Iterable[tuple[str, int]]) -> str | None:
        """The first module (name, N) this record cannot unpack: N needs a measured block for its tail rows
        (N % block_n) and, when N >= block_n, a whole one. E.g. block_n 64 with blocks {64, 32} cannot unpack N = 80
        (a tail of 16)."""
        sizes = {s for s, _ in self.perms}
        for name, n in rows:
            tail = n % self.block_n
            if n % ROW_MULTIPLE == 0 and ((tail and tail not in sizes) or (n >= self.block_n and self.block_n not in sizes)):
                return (f"{MANIFEST}: the layout record has no block of {tail or self.block_n} rows, which {name} "
                        f"(N={n}) needs; it cannot be unpacked or repacked")
        return None


def _op_pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def _measure_positions(n: int, k: int) -> torch.Tensor:
    """Pack a position-coded [n, k] matrix digit by digit (4 bits a pass); return the source index of every nibble,
    in memory order (int64 [n * k])."""
    idx = torch.arange(n * k, dtype=torch.int64).reshape(n, k)
    src = torch.zeros(n * k // 2, 2, dtype=torch.int64)
    for d in range(max(1, math.ceil(math.log(n * k, 16)))):
        packed = _op_pack((idx >> (4 * d)) & 15).to(torch.int64).reshape(-1)
        src[:, 0] += (packed & 15) << (4 * d)
        src[:, 1] += (packed >> 4) << (4 * d)
    return src.reshape(-1)


def _block_perm(src: torch.Tensor, n0: int, s: int, k: int) -> tuple[int, ...]:
    """Read the nibble order of the block of s rows starting at row n0; check it is k-major and the same for all k."""
    region = src[n0 * k : (n0 + s) * k].reshape(k, s)
    rows, cols = region // k, region % k
    perm = rows[0] - n0
    if not bool((cols == torch.arange(k).unsqueeze(1)).all()) or not bool((rows - n0 == perm).all()):
        raise EdgeqError(
            f"{PACK_OP} packs a block of {s} rows in an order edgeq does not model (not k-major); "
            f"torch {torch.__version__} is not supported by this edgeq version"
        )
    if sorted(perm.tolist()) != list(range(s)):
        raise EdgeqError(f"{PACK_OP}: block of {s} rows at row {n0} mixes rows of other blocks")
    return tuple(perm.tolist())


def _first_block_rows(src: torch.Tensor, k: int) -> int:
    """Rows in the first block = nibbles before k changes (k-major order)."""
    cols = src % k
    changes = torch.nonzero(cols != cols[0])
    return int(changes[0]) if len(changes) else int(src.numel() // k)


@lru_cache(maxsize=None)
def probe() -> TinygemmLayout:
    """Measure the packing on this machine (a few ms): block size, permutations, then verify on random data."""
    k = 4
    src = _measure_positions(256, k)
    block_n = _first_block_rows(src, k)
    if block_n % ROW_MULTIPLE or 256 % block_n:
        raise EdgeqError(f"{PACK_OP}: measured block of {block_n} rows; edgeq expects a multiple of 16 dividing 256")
    perms = {block_n: _block_perm(src, 0, block_n, k)}
    for tail in range(ROW_MULTIPLE, block_n, ROW_MULTIPLE):
        n = 2 * block_n + tail
        s = _measure_positions(n, k)
        if _first_block_rows(s[2 * block_n * k :], k) != tail:
            raise EdgeqError(f"{PACK_OP}: a tail of {tail} rows is split further; not modelled")
        perms[tail] = _block_perm(s, 2 * block_n, tail, k)
    layout = TinygemmLayout(
        block_n=block_n,
        perms=tuple(sorted(perms.items())),
        torch_version=torch.__version__,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
    )
    _verify(layout)
    return layout


def _verify(layout: TinygemmLayout) -> None:
    """The derived model must reproduce the op bit for bit on random values, tails included."""
    g = torch.Generator().manual_seed(0)
    for n in (layout.block_n, 3 * layout.block_n + ROW_MULTIPLE, 2 * layout.block_n + layout.block_n - ROW_MULTIPLE, 16):
        q = torch.randint(0, 16, (n, 96), generator=g, dtype=torch.uint8)
        if not torch.equal(pack(q, layout), _op_pack(q)):
            raise EdgeqError(f"{PACK_OP}: measured layout does not reproduce the op for N={n}; not supported")
        if not torch.equal(unpack(_op_pack(q), n, 96, layout), q):
            raise EdgeqError(f"{PACK_OP}: measured unpack is not the inverse for N={n}; not supported")


def check_values(q: torch.Tensor, name: str = "weight") -> None:
    """The pack op does not mask its input: a value outside 0..15 silently corrupts the neighbouring nibble."""
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise EdgeqError(f"{name}: quantised values must lie in 0..15, got {int(q.min())}..{int(q.max())}")


def check_shapes(name: str, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> tuple[int, int]:
    """Everything the mm op does not check; returns (N, K). A wrong ``scales_and_zeros.shape[0]`` reads out of bounds."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise EdgeqError(f"{name}.qweight: expected uint8 [N, K/2], got {qweight.dtype} {list(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if group_size not in GROUP_SIZES or k % group_size:
        raise EdgeqError(f"{name}: K={k} must be a multiple of the group size {group_size} (one of {GROUP_SIZES})")
    want = [k // group_size, n, 2]
    if scales_and_zeros.dtype != torch.bfloat16 or list(scales_and_zeros.shape) != want:
        raise EdgeqError(
            f"{name}.scales_and_zeros: expected bf16 {want} for N={n}, K={k}, G={group_size}, "
            f"got {scales_and_zeros.dtype} {list(scales_and_zeros.shape)}"
        )
    if n % ROW_MULTIPLE:
        raise EdgeqError(f"{name}: N={n} is not a multiple of {ROW_MULTIPLE}")
    return n, k


def pack(q: torch.Tensor, layout: TinygemmLayout) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> uint8 [N, K/2] in ``layout`` (equals the op's output when layout = probe())."""
    check_values(q)
    n, k = q.shape
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    flat = out.view(-1)
    for n0, s, count in layout.blocks(n):
        perm = torch.tensor(layout.perm(s))
        rows = q[n0 : n0 + s * count].to(torch.uint8).reshape(count, s, k)
        nib = rows[:, perm, :].permute(0, 2, 1)  # [count, K, s]: position p holds row perm[p]
        byte = nib[..., 0::2] | (nib[..., 1::2] << 4)
        flat[n0 * k // 2 : (n0 + s * count) * k // 2] = byte.reshape(-1)
    return out


def unpack(qweight: torch.Tensor, n: int, k: int, layout: TinygemmLayout, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """uint8 [N, K/2] packed -> uint8 [N, K] values 0..15; the exact inverse of :func:`pack`.

    ``rows=(a, b)`` unpacks only rows a..b (both on block boundaries, or b = N): the prefill path dequantises a
    weight one row block at a time into scratch.
    """
    a, b = rows if rows is not None else (0, n)
    flat = qweight.reshape(-1)
    out = torch.empty(b - a, k, dtype=torch.uint8)
    for n0, s, count in layout.blocks(n):
        lo, hi = max(a, n0), min(b, n0 + s * count)
        if lo >= hi:
            continue
        if (lo - n0) % s or ((hi - n0) % s and hi != b):
            raise EdgeqError(f"unpack rows {a}..{b} do not fall on {s}-row block boundaries")
        c = -(-(hi - lo) // s)
        byte = flat[lo * k // 2 : (lo + s * c) * k // 2].reshape(c, k, s // 2)
        nib = torch.stack((byte & 15, byte >> 4), dim=-1).reshape(c, k, s)
        blk = torch.empty_like(nib)
        blk[..., torch.tensor(layout.perm(s))] = nib
        out[lo - a : hi - a] = blk.permute(0, 2, 1).reshape(c * s, k)[: hi - lo]
    return out


@lru_cache(maxsize=64)
def _row_plan(layout: TinygemmLayout, n: int) -> tuple[int, int, torch.Tensor, torch.Tensor | None]:
    """(first tail row, tail rows, nibble position of each row offset in a full block, the same in the tail block or
    None): ``pos[o] = p`` with ``perm[p] = o``, the inverse of the measured permutation."""
    layout.blocks(n)  # refuses an N that is not a multiple of 16
    full = n // layout.block_n * layout.block_n
    tail = n - full

    def inverse(s: int) -> torch.Tensor:
        pos = torch.empty(s, dtype=torch.int64)
        pos[torch.tensor(layout.perm(s))] = torch.arange(s)
        return pos

    pos_full = inverse(layout.block_n) if full else torch.zeros(1, dtype=torch.int64)
    return full, tail, pos_full, (inverse(tail) if tail else None)


def unpack_rows(qweight: torch.Tensor, rows: torch.Tensor, n: int, k: int, layout: TinygemmLayout,
                check: bool = True) -> torch.Tensor:
    """uint8 values 0..15 [R, K] of any rows (int64 [R], any order, repeats allowed) of a packed uint8 [N, K/2]:
    ``unpack(qweight, n, k, layout)[rows]`` bit for bit, without unpacking the rest (an embedding lookup reads one
    row to a few thousand of a 150k-row table).

    Row r lies in the block starting at ``n0`` (``r - r % block_n``, or the tail block's first row) of ``s`` rows
    (``block_n`` or the tail's). Inside the block the bytes are k-major, ``s/2`` bytes per k, and nibble position
    ``p = pos[r - n0]`` (the inverse of the measured ``perm``) holds the row, so::

        q[r, c] = (qweight.flat[n0 * K/2 + c * s/2 + p // 2] >> 4 * (p % 2)) & 15

    Worked example (AVX512 halves, block_n 64, K = 2): row 33 is offset 33 of block 0, ``perm = [0, 32, 1, 33, ...]``
    so p = 3: byte 1 (``q[1, 0] | q[33, 0] << 4``), high nibble; for c = 1 the byte 32 + 1 = 33.
    ``check=False`` skips the row-range check (a caller that checked the ids once for several tables).
    """
    rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
    if check and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise EdgeqError(f"unpack_rows: row {int(rows.min()) if int(rows.min()) < 0 else int(rows.max())} is outside "
                         f"0..{n - 1}")
    full, tail, pos_full, pos_tail = _row_plan(layout, n)
    flat = qweight.reshape(-1)
    if rows.numel() == 1:  # a decode step's token: its bytes are a strided view, no index tensor
        r = int(rows)
        n0, s, pos = (full, tail, pos_tail) if r >= full else (r - r % layout.block_n, layout.block_n, pos_full)
        p = int(pos[r - n0])
        start = n0 * (k // 2) + p // 2
        return ((flat[start : start + (k - 1) * (s // 2) + 1 : s // 2] >> 4 * (p % 2)) & 15).view(1, k)
    if pos_tail is None:  # every row is in a full block
        n0 = rows - rows % layout.block_n
        p = pos_full[rows - n0]
        step = torch.full_like(rows, layout.block_n // 2)
    else:
        in_tail = rows >= full
        n0 = torch.where(in_tail, full, rows - rows % layout.block_n)
        offset = rows - n0
        p = torch.where(in_tail, pos_tail[offset.clamp(max=tail - 1)], pos_full[offset.clamp(max=pos_full.numel() - 1)])
        step = torch.where(in_tail, tail // 2, layout.block_n // 2)
    index = (n0 * (k // 2) + p // 2)[:, None] + torch.arange(k)[None, :] * step[:, None]
    return (flat[index] >> ((p % 2) * 4).to(torch.uint8)[:, None]) & 15


def row_block(layout: TinygemmLayout, target_rows: int) -> int:
    """A row-block size near ``target_rows`` that is a whole number of layout blocks (so packing a row block gives
    exactly the bytes of those rows in the whole tensor's packing)."""
    return max(layout.block_n, (target_rows // layout.block_n) * layout.block_n)


def dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, dtype=torch.float32) -> torch.Tensor:
    """(q - 8) * scale + zero, broadcast per group: q uint8 [N, K], scales_and_zeros [K/G, N, 2] -> [N, K]."""
    sz = scales_and_zeros.to(torch.float32)
    n, k = q.shape
    scale = sz[..., 0].t().repeat_interleave(group_size, dim=1)  # [N, K]
    zero = sz[..., 1].t().repeat_interleave(group_size, dim=1)
    return ((q.to(torch.float32) - 8.0) * scale + zero).to(dtype)


def mm(x: torch.Tensor, qweight: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The kernel: bf16 [M, K] @ dequant(W).T -> bf16 [M, N]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, group_size, scales_and_zeros)


def nbytes(n: int, k: int, group_size: int, perm: bool = False) -> int:
    """Packed nibbles + bf16 (scale, zero) per group: N*K/2 + (K/G)*N*2*2, plus 8*K for an int64 ``M.perm``.

    E.g. 8960 x 1536 at G = 128: 6,881,280 + 430,080 = 7,311,360 bytes (4.25 bits per weight)."""
    return n * k // 2 + (k // group_size) * n * 4 + (8 * k if perm else 0)


def machine_block_n() -> int:
    """The row-block size the runtime uses on this machine (its layout's; a foreign checkpoint is repacked to it):
    what the prefill scratch is sized by. 64 when torch's packing cannot be measured here."""
    try:
        return probe().block_n
    except EdgeqError:
        return 64


class _Tinygemm:
    """The tinygemm W4A16 layout as a :class:`edgeq.layouts.base.Layout` (registered as :data:`LAYOUT`)."""

    kernel = KERNEL
    group_sizes = GROUP_SIZES
    suffixes = (".qweight", ".scales_and_zeros")
    optional_suffixes = (".perm",)  # act-order input: the int64 [K] input permutation, used in place by the loader
    summary = "4-bit weights, bf16 activations (W4A16)"
    runtime_class = "edgeq.runtime.qlinear:Int4Linear"
    runtime_choice = None  # two paths by M: the kernel below the measured crossover, dequantise + GEMM at and above
    measured = True
    per_module_groups = True  # the mm op takes G per call

    def out_tensors(self, module: str, n: int, k: int, group_size: int, perm: bool = False):
        out = [(f"{module}.qweight", "U8", (n, k // 2)), (f"{module}.scales_and_zeros", "BF16", (k // group_size, n, 2))]
        return out + ([(f"{module}.perm", "I64", (k,))] if perm else [])

    def nbytes(self, n: int, k: int, group_size: int, perm: bool = False) -> int:
        return nbytes(n, k, group_size, perm)

    def parse_record(self, stored: dict) -> TinygemmLayout:
        return TinygemmLayout.from_json(stored)

    def config_problem(self, config_copy, record: TinygemmLayout) -> str | None:
        """Which fingerprint field (op, torch_version, cpu_capability, block_n, layout_hash) of config.json's copy
        differs from the manifest's record, or None. The manifest's record is the one whose hash is checked against
        its permutations; the copy has none, so it is compared field by field (an edited ``block_n`` or
        ``cpu_capability`` there would otherwise pass unnoticed)."""
        copy, want = (config_copy if isinstance(config_copy, dict) else {}), record.fingerprint()
        for key in want:
            if copy.get(key) != want[key]:
                return (f"config.json quantization_config.layout.{key} {str(copy.get(key))[:16]!r} differs from the "
                        f"manifest's {str(want[key])[:16]!r}")
        return None

    def read_record(self, stored, config_copy, group_size: int, directory) -> TinygemmLayout:
        """The manifest's layout record ``stored`` parsed (hash checked against its permutations) and equal to
        config.json's copy in every fingerprint field; the refusal names ``directory`` and the field. ``group_size``
        is not part of a tinygemm record (its layout does not depend on G)."""
        if not isinstance(stored, dict):
            raise EdgeqError(f"{directory}/{MANIFEST}: no layout record; re-quantise or `edgeq repack` the checkpoint")
        layout = self.parse_record(stored)
        if problem := self.config_problem(config_copy, layout):
            raise EdgeqError(f"{directory}: {problem}; the checkpoint is inconsistent, re-quantise it")
        return layout

    def check_record(self, stored: dict, group_size, rows) -> RecordCheck:
        """The record is measured, so it may be another machine's: readable, with a block for every module's rows,
        then compared with this machine's (:func:`probe`) by op and hash; another machine's is ``differs``."""
        view = {key: v for key, v in stored.items() if key != "perms"}
        try:
            record = self.parse_record(stored)
        except EdgeqError as e:
            return RecordCheck(view, None, False, "refused: the stored layout record is unreadable",
                               problems=(f"{MANIFEST}: {e}",))
        problems = tuple(p for p in [record.missing_block(rows)] if p)
        try:
            here = probe()
        except EdgeqError as e:
            return RecordCheck(view, None, False, "refused: torch's int4 packing cannot be measured here",
                               problems=problems, warnings=(f"this machine: {e}",))
        if record.is_compatible(here):
            return RecordCheck(view, here.fingerprint(), True, "zero-copy: the stored bytes are this machine's kernel "
                               "layout", problems=problems)
        what = (f"layout {record.layout_hash[:12]} ({record.cpu_capability}, block {record.block_n}, torch "
                f"{record.torch_version}) differs from this machine's {here.layout_hash[:12]} "
                f"({here.cpu_capability}, block {here.block_n}, torch {here.torch_version})")
        return RecordCheck(view, here.fingerprint(), False, differs=what, problems=problems)

    def logical_shape(self, module: str, tensors, group_size) -> StoredShape:
        """M.qweight U8 [N, K/2] gives N and K; M.scales_and_zeros must then be [K/G, N, 2] (checked when G is known)
        and N a multiple of 16."""
        qw, sz = tensors.get(f"{module}.qweight"), tensors.get(f"{module}.scales_and_zeros")
        if qw is None or sz is None:
            return StoredShape(None, None, (f"{module}: quantised module without "
                                            f"{'qweight' if qw is None else 'scales_and_zeros'}",))
        if qw.dtype != "U8" or len(qw.shape) != 2:
            return StoredShape(None, None, (f"{module}.qweight: expected U8 [N, K/2], got {qw.dtype} {list(qw.shape)}",))
        n, k = qw.shape[0], 2 * qw.shape[1]
        problems = stored_mismatches(self, module, tensors, n, k, group_size) if group_size else []
        if n % ROW_MULTIPLE:
            problems.append(f"{module}: N={n} is not a multiple of {ROW_MULTIPLE}; the kernel cannot use it")
        return StoredShape(n, k, tuple(problems))

    def roundtrip(self, module: str, read, n: int, k: int, group_size: int, record: TinygemmLayout) -> str | None:
        try:
            stored = read(".qweight")
            again = pack(unpack(stored, n, k, record), record)
        except EdgeqError as e:
            return f"{module}.qweight: unpack/repack failed ({e})"
        if not torch.equal(again, stored):
            return (f"{module}.qweight: unpack/repack with the stored layout changes {int((again != stored).sum())} "
                    "byte(s); the layout record does not describe these bytes")
        return None

    def scratch(self, modules) -> tuple[str, int]:
        """The prefill path dequantises one row block of the largest weight at a time (:func:`edgeq.memory.scratch`)."""
        return scratch(modules, machine_block_n())

    def describe(self, stored: dict, matches: bool) -> tuple[str, str]:
        what = f"{stored.get('cpu_capability')}, block {stored.get('block_n')}, torch {stored.get('torch_version')}"
        return what, "matches this machine" if matches else "differs from this machine"

    def rule(self, n: int, k: int, group_size: int) -> str | None:
        if k % group_size:
            fits = [g for g in GROUP_SIZES if k % g == 0]
            fix = f"use a group size of {', '.join(map(str, fits))}" if fits else "keep it in bf16 with a recipe (keep_bf16)"
            return f"K={k} is not a multiple of the group size {group_size}; {fix}"
        if n % ROW_MULTIPLE:
            return f"N={n} is not a multiple of {ROW_MULTIPLE} (tinygemm packs rows in 16s)"
        return None


LAYOUT = _Tinygemm()
