"""The W4A8 layout of sglang's / vLLM's CPU kernel ``int4_scaled_mm_cpu``, and a bit-exact portable path in torch.

Layout (the bytes ``convert_weight_packed_scale_zp`` produces; N output rows, K inputs, G the group size)::

    bk = min(G, 128)                         K block (G in {32, 64, 128}, so bk = G here)
    qweight      uint8 [N/32, K/bk, bk*16 + 128]
    scales       fp32  [N/32, K/G, 32]       scales[nb, g, c]  = s[g, 32*nb + c]
    zeros        int8  [N/32, K/G, 32]       zeros[nb, g, c]   = z[g, 32*nb + c]

Each ``qweight[nb, kb]`` slot covers output rows n0 = 32*nb .. n0+31 and inputs k0 = bk*kb .. k0+bk-1:

- bytes 0 .. bk*16-1, VNNI-4 interleaved: for each group of 4 inputs (kg = 0 .. bk/4-1) 64 bytes; byte
  ``kg*64 + j*4 + ki`` (j = 0..15, ki = 0..3) holds q[n0 + c(j), k0 + 4*kg + ki] in its low nibble and
  q[n0 + c(j) + 8, k0 + 4*kg + ki] in its high nibble, with c(j) = j for j < 8 and j + 8 for j >= 8. So low
  nibbles carry rows 0-7 and 16-23 of the block, high nibbles rows 8-15 and 24-31;
- bytes bk*16 .. bk*16+127: int32[32] little-endian, the compensation comp[c] = sum over the slot's bk inputs of
  (q[n0 + c, k] - z[g(k), n0 + c]). (The kernel subtracts 128 * comp after a uint8 x int8 dot product: it
  quantises activations symmetrically, then shifts them by +128 to uint8.)

Worked example (G = 32, a 32 x 32 block, one slot of 32*16 + 128 = 640 bytes): byte 0 = q[0,0] | q[8,0] << 4,
byte 1 = q[0,1] | q[8,1] << 4, byte 4 = q[1,0] | q[9,0] << 4, byte 28 = q[7,0] | q[15,0] << 4,
byte 32 = q[16,0] | q[24,0] << 4, byte 63 = q[23,3] | q[31,3] << 4, byte 64 = q[0,4] | q[8,4] << 4, ...,
bytes 512..515 = comp[0] (low byte first).

This module is the bytes only (pack, unpack, shapes, sizes, the layout record). The kernel's arithmetic, and the
portable path that reproduces it bit for bit, are the runtime's: :mod:`edgeq.runtime.w4a8_compute`.

Source checked: sgl-project/sglang sgl-kernel/csrc/cpu/gemm_int4.cpp
(``convert_int4_weight_packed_with_compensation``, ``_da8w4_linear_impl``, ``_dequant_gemm_accum``,
``quantize_row_int8`` in vec.h) and the identical port in
vllm-project/vllm csrc/cpu/sgl-kernels/gemm_int4.cpp.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass

import torch

from edgeq.errors import EdgeqError
from edgeq.keys import MANIFEST, Kernel
from edgeq.layouts.base import RecordCheck, StoredShape, stored_mismatches
from edgeq.memory import w4a8_scratch

KERNEL = Kernel.W4A8
LAYOUT_NAME = "amx_w4a8"  # the layout record's "layout"/"op" value
LAYOUT_VERSION = 1
BLOCK_N = 32
VNNI = 4
MAX_BLOCK_K = 128
COMP_BYTES = BLOCK_N * 4
GROUP_SIZES = (32, 64, 128)
_DESCRIPTION = {
    "layout": LAYOUT_NAME,
    "version": LAYOUT_VERSION,
    "source": "sglang int4_scaled_mm_cpu / convert_weight_packed_scale_zp (vLLM CPU port identical)",
    "block_n": BLOCK_N,
    "block_k": "min(G, 128)",
    "qweight": "uint8 [N/32, K/bk, bk*16 + 128]",
    "nibbles": "byte kg*64 + j*4 + ki: low q[n0+c(j), k0+4kg+ki], high q[n0+c(j)+8, ...], "
    "c(j) = j if j < 8 else j + 8",
    "compensation": "int32 little-endian [32] after the nibbles: sum over the block of (q - z)",
    "scales": "fp32 [N/32, K/G, 32]",
    "zeros": "int8 [N/32, K/G, 32], values 0..15",
    "math": "C = bias; C = fma(fp32(acc_int32) * s_a, s_w, C) per K block in order; bf16(C)",
}
LAYOUT_HASH = hashlib.sha256(json.dumps(_DESCRIPTION, sort_keys=True).encode()).hexdigest()


def block_k(group_size: int) -> int:
    return min(group_size, MAX_BLOCK_K)


def fingerprint(group_size: int) -> dict:
    """What the manifest records: equal dicts mean identical bytes for the same (N, K)."""
    return {
        "op": LAYOUT_NAME,
        "kernel": KERNEL,
        "version": LAYOUT_VERSION,
        "block_n": BLOCK_N,
        "block_k": block_k(group_size),
        "vnni": VNNI,
        "layout_hash": LAYOUT_HASH,
    }


def check_shape(name: str, n: int, k: int, group_size: int) -> None:
    """The kernel's constraints: N % 32, K % bk, K % 32 (its activation quantiser reads 32 at a time), K % G."""
    if group_size not in GROUP_SIZES:
        raise EdgeqError(f"{name}: W4A8 group size {group_size} is not supported; use one of {GROUP_SIZES}")
    bk = block_k(group_size)
    if n % BLOCK_N:
        raise EdgeqError(
            f"{name} [{n}, {k}]: N={n} is not a multiple of {BLOCK_N} (W4A8 packs 32 output rows per block); "
            "keep the module in bf16 or use w4a16"
        )
    if k % bk or k % group_size:
        raise EdgeqError(
            f"{name} [{n}, {k}]: K={k} is not a multiple of the K block {bk} (group size {group_size}); "
            "use a group size dividing K"
        )
    if k % 32:
        raise EdgeqError(f"{name} [{n}, {k}]: K={k} is not a multiple of 32 (the kernel quantises activations 32 at once)")


@dataclass(frozen=True)
class W4A8Packed:
    """The three tensors of one W4A8 linear in the kernel's layout (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return packed_shape(self.qweight, self.group_size)


def packed_shape(qweight: torch.Tensor, group_size: int) -> tuple[int, int]:
    """(N, K) of a packed qweight."""
    bk = block_k(group_size)
    return qweight.shape[0] * BLOCK_N, qweight.shape[1] * bk


def check_packed(name: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
    """Validate dtypes and shapes of the three packed tensors against each other; returns (N, K)."""
    if group_size not in GROUP_SIZES:
        raise EdgeqError(f"{name}: W4A8 group size {group_size} is not supported; use one of {GROUP_SIZES}")
    bk = block_k(group_size)
    if qweight.dtype != torch.uint8 or qweight.dim() != 3 or qweight.shape[2] != bk * 16 + COMP_BYTES:
        raise EdgeqError(
            f"{name}.qweight: expected uint8 [N/32, K/{bk}, {bk * 16 + COMP_BYTES}] for G={group_size}, "
            f"got {qweight.dtype} {list(qweight.shape)}"
        )
    n, k = packed_shape(qweight, group_size)
    want = [n // BLOCK_N, k // group_size, BLOCK_N]
    for t, dt, label in ((scales, torch.float32, "scales"), (zeros, torch.int8, "zeros")):
        if t.dtype != dt or list(t.shape) != want:
            raise EdgeqError(
                f"{name}.{label}: expected {dt} {want} for N={n}, K={k}, G={group_size}, got {t.dtype} {list(t.shape)}"
            )
    check_shape(name, n, k, group_size)
    return n, k


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise EdgeqError("the amx_w4a8 layout stores little-endian int32 and VNNI words; this host is big-endian")


def _nibble_view(t: torch.Tensor, nc: int, kc: int, bk: int) -> torch.Tensor:
    """[N, K] viewed as [Nc, h, hi, i, Kc, kg, ki]: row = 32nb + 16h + 8hi + i, k = bk*kb + 4kg + ki."""
    return t.view(nc, 2, 2, 8, kc, bk // VNNI, VNNI)


def compensation(q: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """int32 [N/32, K/bk, 32]: sum over each K block of (q - z); q uint8 [N, K], zeros [K/G, N]."""
    n, k = q.shape
    bk = block_k(group_size)
    z = zeros.t().to(torch.int32).repeat_interleave(group_size // bk, dim=1)  # [N, K/bk]
    sums = q.view(n, k // bk, bk).sum(-1, dtype=torch.int32) - bk * z
    return sums.view(n // BLOCK_N, BLOCK_N, k // bk).permute(0, 2, 1).contiguous()


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, name: str = "weight"):
    """q uint8 [N, K] (0..15), scales fp32 [K/G, N], zeros int8 [K/G, N] (0..15) -> :class:`W4A8Packed`.

    Callers may pack a range of 32-row blocks at a time: the bytes of rows 32a..32b are exactly rows a..b of
    the whole tensor's packing (every tensor's first dimension is the row block).
    """
    if q.dim() != 2:
        raise EdgeqError(f"{name}: expected q [N, K], got {list(q.shape)}")
    n, k = q.shape
    check_shape(name, n, k, group_size)
    gc = k // group_size
    for t, label in ((scales, "scales"), (zeros, "zeros")):
        if list(t.shape) != [gc, n]:
            raise EdgeqError(
                f"{name}.{label}: expected [{gc}, {n}] for N={n}, K={k}, G={group_size}, got {list(t.shape)}"
            )
    for t, label in ((q, "q"), (zeros, "zeros")):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > 15):
            raise EdgeqError(f"{name}.{label}: values must lie in 0..15, got {int(t.min())}..{int(t.max())}")
    if not bool(torch.isfinite(scales).all()):
        raise EdgeqError(f"{name}.scales: NaN/Inf scale(s); re-quantise")
    _require_little_endian()
    bk = block_k(group_size)
    nc, kc = n // BLOCK_N, k // bk
    v = _nibble_view(q.to(torch.uint8).contiguous(), nc, kc, bk)  # [nc, h, hi, i, kc, kg, ki]
    nib = v.permute(0, 4, 5, 1, 3, 6, 2)  # [nc, kc, kg, h, i, ki, hi]: byte order, then the two nibbles
    out = torch.empty(nc, kc, bk * 16 + COMP_BYTES, dtype=torch.uint8)
    body = out[:, :, : bk * 16].view(nc, kc, bk // VNNI, 2, 8, VNNI)
    torch.bitwise_or(nib[..., 0], nib[..., 1] << 4, out=body)
    comp = compensation(q, zeros, group_size)
    out[:, :, bk * 16 :] = comp.view(torch.uint8).view(nc, kc, COMP_BYTES)  # host order: little-endian (checked)
    blocked = lambda t: t.reshape(gc, nc, BLOCK_N).permute(1, 0, 2).contiguous()  # noqa: E731
    scales, zeros = blocked(scales.to(torch.float32)), blocked(zeros.to(torch.int8))
    return W4A8Packed(qweight=out, scales=scales, zeros=zeros, group_size=group_size)


def _words(qweight: torch.Tensor, a: int, b: int, bk: int) -> torch.Tensor:
    """The nibble bytes of row blocks a..b-1 as int32 words [nc, kc, bk/4, 16]: word (kg, j) holds bytes ki = 0..3."""
    body = qweight[a:b, :, : bk * 16]
    if body.storage_offset() % 4:  # e.g. a tensor inside a memory-mapped file at an odd offset: copy this chunk only
        body = body.contiguous()
    return body.view(torch.int32).view(b - a, qweight.shape[1], bk // VNNI, 16)


def unpack_into(qweight: torch.Tensor, group_size: int, a: int, b: int, out: torch.Tensor, tmp: torch.Tensor):
    """q of row blocks a..b-1 into ``out`` (uint8/int8, >= 32*(b-a)*K elements) as [32*(b-a), K]; ``tmp`` is int32
    scratch of >= 32*(b-a)*K/8 elements.

    Words of 4 bytes move, not nibbles: the [kg, j] words of each slot are transposed to [j, kb, kg] (one int32
    copy), which puts the 4 VNNI bytes of a row next to each other, so ``word & 0x0F0F0F0F`` and
    ``(word >> 4) & 0x0F0F0F0F`` are 4 low / high nibbles already in K order: whole contiguous rows of q.
    """
    _require_little_endian()
    bk = block_k(group_size)
    nc, kc = b - a, qweight.shape[1]
    k4 = kc * bk // VNNI
    t = tmp[: nc * 16 * k4].view(nc, 16, kc, bk // VNNI)
    t.copy_(_words(qweight, a, b, bk).permute(0, 3, 1, 2))
    t = t.view(nc, 2, 8, k4)  # j = 8h + i
    o = out[: nc * BLOCK_N * k4 * VNNI].view(torch.int32).view(nc, 2, 2, 8, k4)  # row 16h + 8*hi + i
    torch.bitwise_and(t, 0x0F0F0F0F, out=o[:, :, 0])
    t.bitwise_right_shift_(4)
    torch.bitwise_and(t, 0x0F0F0F0F, out=o[:, :, 1])
    return out[: nc * BLOCK_N * k4 * VNNI].view(nc * BLOCK_N, k4 * VNNI)


def unpack(qweight: torch.Tensor, group_size: int, blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """Packed qweight -> q uint8 [rows, K], the exact inverse of :func:`pack`.

    ``blocks=(a, b)`` unpacks only 32-row blocks a..b-1 (rows 32a .. 32b-1), so a caller can work one block of N at
    a time in scratch.
    """
    a, b = blocks if blocks is not None else (0, qweight.shape[0])
    if not 0 <= a < b <= qweight.shape[0]:
        raise EdgeqError(f"unpack: block range {a}..{b} outside 0..{qweight.shape[0]}")
    n, k = (b - a) * BLOCK_N, packed_shape(qweight, group_size)[1]
    out, tmp = torch.empty(n * k, dtype=torch.uint8), torch.empty(n * k // 8, dtype=torch.int32)
    return unpack_into(qweight, group_size, a, b, out, tmp)


def unpack_compensation(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """int32 [N/32, K/bk, 32] stored after the nibbles of every slot."""
    bk = block_k(group_size)
    return qweight[:, :, bk * 16 :].contiguous().view(torch.int32)


def unpack_params(packed_param: torch.Tensor) -> torch.Tensor:
    """scales or zeros [N/32, K/G, 32] -> [K/G, N]."""
    nc, gc, _ = packed_param.shape
    return packed_param.permute(1, 0, 2).reshape(gc, nc * BLOCK_N)


def nbytes(n: int, k: int, group_size: int) -> int:
    """N*K/2 nibbles + 4*N*K/bk compensation (int32 per row and K block) + 5*N*K/G (fp32 scale + int8 zero).

    E.g. 1536 x 1536 at G = 128: 1,179,648 + 73,728 + 92,160 = 1,345,536 bytes (4.56 bits per weight)."""
    bk = block_k(group_size)
    return n * k // 2 + 4 * n * (k // bk) + 5 * n * (k // group_size)


class _W4A8:
    """The AMX/VNNI W4A8 layout as a :class:`edgeq.layouts.base.Layout` (registered as :data:`LAYOUT`). The layout
    is fixed by the kernel's source, not measured: a record must equal :func:`fingerprint` for G, and there is no
    repack (load refuses any other record). Nothing is copied at load."""

    kernel = KERNEL
    group_sizes = GROUP_SIZES
    suffixes = (".qweight", ".scales", ".zeros")
    optional_suffixes = ()  # no act-order: an M.perm is refused at load
    summary = "4-bit weights, int8 per-token activations (W4A8)"
    runtime_class = "edgeq.runtime.w4a8linear:W4A8Linear"
    runtime_choice = "edgeq.runtime.w4a8linear:choose_kernel"  # the compiled op after its probe, else the portable path
    measured = False
    per_module_groups = False  # one G per checkpoint (a scheme's); a recipe's group_sizes do not apply

    def out_tensors(self, module: str, n: int, k: int, group_size: int, perm: bool = False):
        if perm:
            raise EdgeqError(f"{module}: act-order (M.perm) is not supported by the W4A8 layout; use a w4a16 scheme")
        bk = block_k(group_size)
        return [
            (f"{module}.qweight", "U8", (n // BLOCK_N, k // bk, bk * 16 + COMP_BYTES)),
            (f"{module}.scales", "F32", (n // BLOCK_N, k // group_size, BLOCK_N)),
            (f"{module}.zeros", "I8", (n // BLOCK_N, k // group_size, BLOCK_N)),
        ]

    def nbytes(self, n: int, k: int, group_size: int, perm: bool = False) -> int:
        return nbytes(n, k, group_size)

    def read_record(self, stored, config_copy, group_size: int, directory) -> dict:
        """The layout record of a G = ``group_size`` checkpoint: the manifest's (``stored``) and config.json's copy
        must both equal :func:`fingerprint` exactly -- the bytes are fixed by the kernel's source, so there is nothing
        to repack and a different record is refused, naming ``directory``, the file and both records' versions."""
        want = fingerprint(group_size)
        for label, record in ((MANIFEST, stored), ("config.json quantization_config", config_copy)):
            if record != want:
                got = record if isinstance(record, dict) else {}
                raise EdgeqError(
                    f"{directory}: {label} layout record (op {got.get('op')!r}, version {got.get('version')!r}, "
                    f"block_k {got.get('block_k')!r}, hash {str(got.get('layout_hash'))[:12]}) is not the amx_w4a8 "
                    f"layout this edgeq reads (version {want['version']}, block_k {want['block_k']}, hash "
                    f"{want['layout_hash'][:12]}); re-quantise with this edgeq or upgrade edgeq")
        return dict(want)

    def parse_record(self, stored: dict) -> dict:
        return dict(stored)  # nothing to parse: a record is compared whole (check_record)

    def config_problem(self, config_copy, record: dict) -> str | None:
        """No permutations in the record: config.json's copy must be the same dict."""
        return None if config_copy == record else "quantization_config.layout differs from the manifest's layout record"

    def check_record(self, stored: dict, group_size, rows) -> RecordCheck:
        """The record must equal this edgeq's fingerprint for the scheme's G (``rows`` do not matter: one record
        describes every N)."""
        stored = dict(stored)
        if group_size not in GROUP_SIZES:
            return RecordCheck(stored, None, False, "refused: the scheme's group size is not a W4A8 one")
        want = fingerprint(group_size)
        if stored != want:
            return RecordCheck(stored, want, False, f"refused: unknown {LAYOUT_NAME} layout record", problems=(
                f"{MANIFEST}: {LAYOUT_NAME} layout record (version {stored.get('version')!r}, block_k "
                f"{stored.get('block_k')!r}, hash {str(stored.get('layout_hash'))[:12]}) is not the one this edgeq "
                f"reads (version {want['version']}, block_k {want['block_k']}, hash {want['layout_hash'][:12]}); "
                "load refuses it, re-quantise",))
        return RecordCheck(stored, want, True, "zero-copy: the layout is fixed by the kernel's source")

    def logical_shape(self, module: str, tensors, group_size) -> StoredShape:
        """M.qweight's first two dims give N = 32 * dim0 and K = bk * dim1 (bk from the scheme's G); M.scales and
        M.zeros must then be the layout's [N/32, K/G, 32]."""
        parts = [tensors.get(f"{module}{s}") for s in self.suffixes]
        if None in parts:
            missing = ", ".join(s.lstrip(".") for s, t in zip(self.suffixes, parts) if t is None)
            return StoredShape(None, None, (f"{module}: quantised module without {missing} ({LAYOUT_NAME} stores "
                                            "qweight, scales, zeros)",))
        qw = parts[0]
        bk = block_k(group_size) if group_size in GROUP_SIZES else None
        slot = (bk or 0) * 16 + COMP_BYTES
        if bk is None or qw.dtype != "U8" or len(qw.shape) != 3 or qw.shape[2] != slot:
            return StoredShape(None, None, (f"{module}.qweight: expected U8 [N/32, K/{bk}, {slot}] for G={group_size}, "
                                            f"got {qw.dtype} {list(qw.shape)}",))
        n, k = qw.shape[0] * BLOCK_N, qw.shape[1] * bk
        return StoredShape(n, k, tuple(stored_mismatches(self, module, tensors, n, k, group_size)))

    def roundtrip(self, module: str, read, n: int, k: int, group_size: int, record) -> str | None:
        """unpack + pack must give back the stored bytes, the int32 compensation after every slot included (a stale
        compensation would shift every output of the kernel)."""
        qw, sc, zp = (read(s) for s in self.suffixes)
        try:
            again = pack(unpack(qw, group_size), unpack_params(sc), unpack_params(zp), group_size, name=module)
        except EdgeqError as e:
            return f"{module}: unpack/repack failed ({e})"
        if not torch.equal(again.qweight, qw):
            return (f"{module}.qweight: unpack/repack changes {int((again.qweight != qw).sum())} byte(s) (nibbles or "
                    "the int32 compensation after each slot do not agree with the zeros); the kernel would compute "
                    "wrong outputs")
        return None

    def scratch(self, modules) -> tuple[str, int]:
        return w4a8_scratch()  # nothing shared at load: the portable path's scratch is per call

    def describe(self, stored: dict, matches: bool) -> tuple[str, str]:
        what = (f"{LAYOUT_NAME} v{stored.get('version')}, block {stored.get('block_n')} x {stored.get('block_k')}, "
                f"VNNI-{stored.get('vnni')}")
        return what, "read by this edgeq" if matches else "not one this edgeq reads"

    def rule(self, n: int, k: int, group_size: int) -> str | None:
        bk = block_k(group_size)
        if n % BLOCK_N:
            return (f"N={n} is not a multiple of {BLOCK_N} (the W4A8 kernel packs 32 output rows per block); "
                    "keep it in bf16 with a recipe (keep_bf16) or use a w4a16 scheme")
        if k % 32:
            return f"K={k} is not a multiple of 32 (the W4A8 kernel quantises activations 32 at a time); use a w4a16 scheme"
        if k % group_size or k % bk:
            fits = [x for x in GROUP_SIZES if k % x == 0]
            return f"K={k} is not a multiple of the group size {group_size} (K block {bk}); use w4a8-g{max(fits)}"
        return None


LAYOUT = _W4A8()
