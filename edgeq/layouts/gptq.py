"""The GPTQ checkpoint layout (AutoGPTQ / GPTQModel / HF ``quant_method: "gptq"``): exact decoding, and an exact
mapping onto the tinygemm layout.

Tensors of one quantised Linear ``M`` with N outputs, K inputs, ``bits`` b (4 or 8), ``pf = 32 // b`` values per
int32 word and ``Gc = ceil(K / G)`` groups (``G = K`` when the config says ``group_size: -1``)::

    M.qweight  int32 [K/pf, N]   word (i, n) holds q[n, pf*i + j] in bits b*j .. b*j+b-1 (lowest bits first)
    M.qzeros   int32 [Gc, N/pf]  word (g, c) holds the zero point of group g, output pf*c + j, in bits b*j ..
    M.scales   fp16  [Gc, N]     (bf16 / fp32 accepted)
    M.g_idx    int32 [K]         group of input channel k (optional; default k // G)

    w[n, k] = scales[g, n] * (q[n, k] - z[g, n])        with g = g_idx[k]

Zero-point conventions (``checkpoint_format`` in ``quantization_config``, default ``"gptq"``):

- ``gptq`` (v1): the stored zero is ``z - 1``. GPTQModel writes it by subtracting ``0x11111111`` (b = 4) from each
  packed *word*, and reads it back by adding the same constant to the word, modulo 2^32. A true zero of 0 therefore
  borrows from the next field; the word-level addition undoes that exactly, so edgeq decodes v1 that way. (Old
  AutoGPTQ added 1 per field instead; the two readings agree whenever no stored field is ``2^b - 1``, i.e. no true
  zero is 0, which is every symmetric checkpoint and nearly every asymmetric one.)
- ``gptq_v2``: the stored zero is ``z``.

``sym: true`` means every zero is ``2^(b-1)`` (8 at 4 bits); decoding checks that, because kernels that assume it
(Marlin, ExLlama) would disagree with the stored zeros otherwise.

``desc_act`` (act-order) checkpoints quantised the columns in a permuted order and store the grouping in ``g_idx``:
it is not ``k // G`` but still puts exactly G channels in each group. Stable-sorting ``g_idx`` gives ``perm``;
``q[:, perm]`` has every group contiguous, so the layer is tinygemm-representable when its input is ``x[:, perm]``.

Mapping to tinygemm (``w ~= (q - 8) * scale + zero``): q is kept, ``scale = s``, ``zero = (8 - z) * s``. Both are
stored in bf16, which is the only loss. bf16 has an 8-bit significand, so round-to-nearest gives
``|bf16(v) - v| <= 2^-8 |v|`` (the unit roundoff; a tie such as v = 1 + 2^-8 attains it), and per element

    |w_tinygemm - w_gptq| <= 2^-8 * |s| * (|q - 8| + |8 - z|)  (<= |s| / 16 at 4 bits: 1/16 of a step)

plus one fp32 rounding of the dequantisation itself (``<= 2^-24 |w|``). Symmetric checkpoints have ``zero = 0``
exactly, halving the bound. Worked example: s = 0.01 (fp16 0.01000213623046875), z = 3, q = 12 -> w_gptq = 0.0900192;
scale = bf16(s) = 0.010009765625, zero = bf16(5 * s) = 0.050048828125, w_tinygemm = 4 * scale + zero = 0.09008789,
error 6.9e-5 <= 2^-8 * 0.01 * (4 + 5) = 3.5e-4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeq.errors import EdgeqError
from edgeq.layouts.tinygemm import GROUP_SIZES

FORMATS = ("gptq", "gptq_v2")
BITS = (4, 8)
_BF16_REL = 2.0**-8  # unit roundoff of bf16 (8-bit significand incl. the implicit bit, round to nearest)


@dataclass(frozen=True)
class GPTQLinear:
    """One decoded GPTQ linear, integers and all, in the v2 (true zero) convention.

    q: uint8 [N, K] (0 .. 2^bits - 1); zeros: int16 [Gc, N] true zero points; scales: fp32 [Gc, N] (the stored
    values, widened exactly); g_idx: int64 [K] group of each input channel (materialised even when the checkpoint
    has none).
    """

    name: str
    bits: int
    group_size: int
    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def act_order(self) -> bool:
        """True when g_idx is not the natural k // G (the layer then needs an input permutation)."""
        k = self.q.shape[1]
        return not torch.equal(self.g_idx, torch.arange(k) // self.group_size)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """GPTQ's own dequantisation ``scales[g_idx] * (q - zeros[g_idx])`` -> [N, K].

        Exact in fp32 for fp16/bf16 scales (|q - z| < 2^8 and an 11-bit significand fit in 24 bits).
        """
        g = self.g_idx
        diff = self.q.to(torch.float32) - self.zeros.t()[:, g].to(torch.float32)
        return (diff * self.scales.t()[:, g]).to(dtype)


@dataclass(frozen=True)
class TinygemmWeights:
    """A linear in tinygemm terms, ready for :func:`edgeq.layouts.tinygemm.pack`.

    q: uint8 [N, K] 0..15, columns in ``perm`` order; scales_and_zeros: bf16 [K/G, N, 2];
    perm: int64 [K] or None. The layer computes ``x[..., perm] @ dequant(q, scales_and_zeros).T``.
    """

    q: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None


def _unpack_fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32/int64 [R, C] words -> uint8 [R, C, pf] fields, lowest bits first (masking makes the sign irrelevant)."""
    mask = (1 << bits) - 1
    pf = 32 // bits
    return torch.stack([((words >> (bits * j)) & mask).to(torch.uint8) for j in range(pf)], dim=-1)


def _field_ones(bits: int) -> int:
    """0x11111111 at 4 bits, 0x01010101 at 8: one added to every field of a word."""
    return sum(1 << (bits * j) for j in range(32 // bits))


def _check_int32(name: str, t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.int32 or t.dim() != 2:
        raise EdgeqError(f"{name}.{what}: expected a 2-D int32 tensor, got {t.dtype} {list(t.shape)}; only 32-bit packing is supported")


def decode_gptq(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    bits: int = 4,
    group_size: int,
    sym: bool,
    checkpoint_format: str = "gptq",
) -> GPTQLinear:
    """Decode one GPTQ linear (tensors as stored, see the module docstring) into integers and fp32 scales.

    ``name`` is the module name used in error messages (e.g. ``model.layers.0.self_attn.q_proj``). ``group_size``
    is the config's value (-1 means one group over all of K).
    """
    if bits not in BITS:
        raise EdgeqError(f"{name}: {bits}-bit GPTQ is not supported (supported: {BITS}); requantise from the original model")
    if checkpoint_format not in FORMATS:
        raise EdgeqError(f"{name}: unknown checkpoint_format {checkpoint_format!r} (known: {', '.join(FORMATS)})")
    pf = 32 // bits
    _check_int32(name, qweight, "qweight")
    _check_int32(name, qzeros, "qzeros")
    k, n = qweight.shape[0] * pf, qweight.shape[1]
    g = k if group_size == -1 else int(group_size)
    if g <= 0:
        raise EdgeqError(f"{name}: group_size {group_size} is invalid (a positive integer or -1)")
    gc = -(-k // g)
    if n % pf:
        raise EdgeqError(f"{name}.qzeros: N={n} outputs is not a multiple of {pf} ({bits}-bit zeros pack {pf} per int32)")
    if list(qzeros.shape) != [gc, n // pf]:
        raise EdgeqError(
            f"{name}.qzeros: expected [{gc}, {n // pf}] for K={k}, N={n}, group_size={g}, bits={bits}, got "
            f"{list(qzeros.shape)}; is the group size in the config right?"
        )
    if not scales.is_floating_point() or list(scales.shape) != [gc, n]:
        raise EdgeqError(f"{name}.scales: expected float [{gc}, {n}] for K={k}, N={n}, group_size={g}, got {scales.dtype} {list(scales.shape)}")
    scales32 = scales.to(torch.float32)
    if not bool(torch.isfinite(scales32).all()):
        bad = int((~torch.isfinite(scales32)).sum())
        raise EdgeqError(f"{name}.scales: {bad} NaN/Inf value(s); the checkpoint is corrupt")

    gi = _group_index(name, g_idx, k, g, gc)
    q = _unpack_fields(qweight, bits).permute(1, 0, 2).reshape(n, k).contiguous()  # [N, K/pf, pf] -> [N, K]
    zeros = _decode_zeros(name, qzeros, bits, gc, n, sym, checkpoint_format)
    return GPTQLinear(name=name, bits=bits, group_size=g, q=q, zeros=zeros, scales=scales32, g_idx=gi)


def _group_index(name: str, g_idx: torch.Tensor | None, k: int, g: int, gc: int) -> torch.Tensor:
    """int64 [K]: the stored g_idx checked (integers in 0..Gc-1), or ``k // G`` when there is none."""
    if g_idx is None:
        return torch.arange(k, dtype=torch.int64) // g
    if g_idx.dim() != 1 or g_idx.numel() != k or g_idx.is_floating_point():
        raise EdgeqError(f"{name}.g_idx: expected an integer tensor [{k}] (K from qweight), got {g_idx.dtype} {list(g_idx.shape)}")
    gi = g_idx.to(torch.int64)
    if k and (int(gi.min()) < 0 or int(gi.max()) >= gc):
        raise EdgeqError(f"{name}.g_idx: values {int(gi.min())}..{int(gi.max())} outside 0..{gc - 1} ({gc} groups)")
    return gi


def _decode_zeros(name: str, qzeros: torch.Tensor, bits: int, gc: int, n: int, sym: bool, checkpoint_format: str) -> torch.Tensor:
    """int16 [Gc, N] true zero points (the v2 convention; v1 words get ``0x11..1`` added modulo 2^32, see the module
    docstring); with ``sym`` every one must be ``2^(bits-1)``."""
    zw = qzeros.to(torch.int64) & 0xFFFFFFFF
    if checkpoint_format == "gptq":
        zw = (zw + _field_ones(bits)) & 0xFFFFFFFF  # word-level, modulo 2^32: undoes the writer's borrows exactly
    zeros = _unpack_fields(zw, bits).reshape(gc, n).to(torch.int16)
    if sym:
        mid = 1 << (bits - 1)
        off = zeros != mid
        if bool(off.any()):
            gg, nn = (int(v) for v in torch.nonzero(off)[0])
            raise EdgeqError(
                f"{name}.qzeros: sym=true but {int(off.sum())} zero point(s) differ from {mid} (first: group {gg}, "
                f"output {nn}: {int(zeros[gg, nn])}, read as checkpoint_format={checkpoint_format!r}); "
                f"check sym / checkpoint_format in quantization_config"
            )
    return zeros


def group_perm(lin: GPTQLinear) -> torch.Tensor | None:
    """The input permutation making every group contiguous (stable sort of g_idx), or None if g_idx is natural.

    Raises when a group does not have exactly ``group_size`` members (tinygemm groups are uniform).
    """
    n, k = lin.q.shape
    g = lin.group_size
    gc = lin.scales.shape[0]
    counts = torch.bincount(lin.g_idx, minlength=gc)
    bad = torch.nonzero(counts != g)
    if len(bad):
        j = int(bad[0])
        raise EdgeqError(
            f"{lin.name}.g_idx: group {j} has {int(counts[j])} input channels, tinygemm needs exactly {g} in every "
            f"group (K={k}, {gc} groups); requantise this layer (--requantize)"
        )
    if not lin.act_order:
        return None
    return torch.sort(lin.g_idx, stable=True).indices


def to_tinygemm(lin: GPTQLinear, group_size: int | None = None, *, allow_split: bool = False) -> TinygemmWeights:
    """Map a decoded 4-bit GPTQ linear onto tinygemm: q kept, scale = s, zero = (8 - z) * s, both in bf16.

    ``group_size`` is the scheme's (default: the checkpoint's). A different one is an error, except that with
    ``allow_split=True`` a group size dividing the checkpoint's is exact too (each group's parameters repeated).
    The bound on the dequantised weights is in the module docstring.
    """
    if lin.bits != 4:
        raise EdgeqError(f"{lin.name}: a {lin.bits}-bit GPTQ layer cannot be repacked exactly into 4 bits; requantise it")
    src = lin.group_size
    tgt = src if group_size is None else int(group_size)
    if tgt != src and not (allow_split and src % tgt == 0):
        hint = " (it divides the checkpoint's, so it can be represented exactly if splitting is allowed)" if src % tgt == 0 else ""
        raise EdgeqError(
            f"{lin.name}: the checkpoint's group size is {src}, the scheme's is {tgt}{hint}; use --scheme "
            f"w4a16-g{src} to repack exactly, or --requantize"
        )
    if tgt not in GROUP_SIZES:
        raise EdgeqError(f"{lin.name}: group size {tgt} is not one tinygemm supports {GROUP_SIZES}; use --requantize")
    perm = group_perm(lin)
    q = lin.q if perm is None else lin.q[:, perm].contiguous()
    s = lin.scales.to(torch.float64)
    zero = (8.0 - lin.zeros.to(torch.float64)) * s  # exact in float64; the bf16 cast is the one rounding
    sz = torch.stack((s, zero), dim=-1).to(torch.bfloat16)  # [Gc, N, 2]; group j of the permuted K is g_idx == j
    if tgt != src:
        sz = sz.repeat_interleave(src // tgt, dim=0)
    return TinygemmWeights(q=q, scales_and_zeros=sz.contiguous(), group_size=tgt, perm=perm)


def error_bound(lin: GPTQLinear) -> torch.Tensor:
    """Per-element bound [N, K] (original column order) on |w_tinygemm - w_gptq| in exact arithmetic:
    ``2^-8 * |s| * (|q - 8| + |8 - z|)``."""
    g = lin.g_idx
    s = lin.scales.t()[:, g].to(torch.float64).abs()
    z = lin.zeros.t()[:, g].to(torch.float64)
    return _BF16_REL * s * ((lin.q.to(torch.float64) - 8.0).abs() + (8.0 - z).abs())
