"""``edgeq quantize --scheme w4a8-gG``: the pieces the quantize pipeline (edgeq/convert/pipeline.py, edgeq/convert/plan.py)
calls for the ``amx_w4a8`` layout, through :func:`edgeq.convert.packers.packer` (the W4A16 counterpart is
edgeq/convert/w4a16.py). The pipeline itself (plan, streaming, shards, manifest, commit) is shared.

Per quantised Linear ``M`` of shape [N, K], group size G, ``bk = min(G, 128)`` (= G for 32/64/128)::

    M.qweight   uint8 [N/32, K/bk, bk*16 + 128]    VNNI-4 nibbles + int32[32] compensation per slot
    M.scales    fp32  [N/32, K/G, 32]              scales[nb, g, c] = s[g, 32 nb + c]
    M.zeros     int8  [N/32, K/G, 32]              zeros[nb, g, c]  = z[g, 32 nb + c], 0..15
    M.bias      bf16  [N]                          unchanged (the kernel reads it as fp32)

with ``w[n, k] ~= (q[n, k] - z[k // G, n]) * s[k // G, n]`` (edgeq/quantize/w4a8.py; the bytes: edgeq/layouts/w4a8.py,
docs/w4a8.md). Bytes per module: ``N*K/2`` nibbles + ``4*N*K/bk`` compensation + ``5*N*K/G`` scales and zeros, e.g.
1536 x 1536 at G = 128: 1,179,648 + 73,728 + 92,160 = 1,345,536 (4.56 bits per weight).

Streaming: every packed tensor's first dimension is the 32-row block, and :func:`edgeq.layouts.w4a8.pack` of rows
32a..32b gives exactly rows a..b of the whole tensor's packing, so a weight is read, quantised and packed in row
blocks of a multiple of 32 rows; the qweight parts go to the writer as they are made, the scales and zeros
(5*N*K/G bytes: 9.1 MB for a 151936 x 1536 head at G = 128) are held until the qweight is complete, because the
writer takes each tensor whole, in declared order.

Nothing here imports edgeq.convert.plan or edgeq.convert.pipeline (they call in, not the other way round).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from edgeq.errors import EdgeqError
from edgeq.io.manifest import Manifest
from edgeq.keys import Kernel
from edgeq.layouts import w4a8 as layout
from edgeq.quantize.w4a8 import METHODS, group_sq_error, quantize_w4a8
from edgeq.scheme import Scheme

KERNEL = layout.KERNEL
ROW_BLOCK_ELEMENTS = 4 << 20  # weights per row block, as the W4A16 pipeline: a ~100 MB fp32 working set at most


def check_options(scheme: Scheme, method: str, *, gptq_input: bool = False) -> None:
    """What the W4A8 pipeline cannot do, refused before anything is read."""
    if gptq_input:
        raise EdgeqError(f"scheme {scheme}: GPTQ input is repacked exactly onto the tinygemm layout only; use a w4a16 "
                         "scheme, or quantise the original float model to w4a8")
    if method not in METHODS:
        raise EdgeqError(f"scheme {scheme}: method {method!r} is not available for W4A8 (valid: {', '.join(METHODS)}); "
                         "GPTQ calibration writes w4a16 only")


def row_step(n: int, k: int) -> int:
    """Rows per streamed block: about ROW_BLOCK_ELEMENTS weights, a multiple of 32 (whole packed blocks), at most N."""
    rows = max(layout.BLOCK_N, (ROW_BLOCK_ELEMENTS // max(k, 1)) // layout.BLOCK_N * layout.BLOCK_N)
    return min(rows, n)


def quantize_entry(
    read_rows: Callable[[int, int], torch.Tensor],
    n: int,
    k: int,
    scheme: Scheme,
    method: str,
    name: str,
    write: Callable[[str, torch.Tensor], None],
    progress: Callable[[int], None] | None = None,
    module: str | None = None,
) -> float:
    """Quantise and pack one weight [N, K] in row blocks; returns its relative reconstruction error
    sqrt(sum (w_hat - w)^2 / sum w^2) (float64 sums, w_hat = (q - z) * s exactly).

    ``read_rows(a, b)`` returns rows a..b-1 of the float weight; ``write(tensor name, part)`` is called in the order
    of :func:`out_tensors` (qweight in row-block parts, then scales, then zeros, whole); ``progress(rows)`` after each
    block. ``name`` names the source tensor in errors; ``module`` the output prefix (default: ``name`` without
    ``.weight``).
    """
    return _quantize(read_rows, n, k, scheme.group_size, method, name, write, progress, module)


def _quantize(read_rows, n: int, k: int, g: int, method: str, name: str, write, progress=None, module=None) -> float:
    """:func:`quantize_entry` at group size ``g``."""
    module = module or name.removesuffix(".weight")
    layout.check_shape(name, n, k, g)
    step = row_step(n, k)
    scales, zeros = [], []
    sq_err = sq_norm = 0.0
    for a in range(0, n, step):
        b = min(n, a + step)
        w = read_rows(a, b)
        if tuple(w.shape) != (b - a, k):
            raise EdgeqError(f"{name}: rows {a}..{b} read as {list(w.shape)}, expected [{b - a}, {k}]")
        qw = quantize_w4a8(w, g, name=f"{name} rows {a}..{b}", method=method)
        packed = layout.pack(qw.q, qw.scales, qw.zeros, g, name=name)
        write(f"{module}.qweight", packed.qweight)
        scales.append(packed.scales)
        zeros.append(packed.zeros)
        sq_err += float(group_sq_error(w, qw).sum())
        sq_norm += float(w.to(torch.float64).square().sum())
        if progress is not None:
            progress(b - a)
    write(f"{module}.scales", torch.cat(scales))
    write(f"{module}.zeros", torch.cat(zeros))
    return (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0


@dataclass(frozen=True)
class W4A8Layout:
    """The layout record the pipeline writes for ``amx_w4a8`` (the role TinygemmLayout plays for W4A16).

    Nothing is measured: the bytes are fixed by the kernel's source, so ``to_json()`` (manifest) and
    ``fingerprint()`` (config.json) are both :func:`edgeq.layouts.w4a8.fingerprint` of the group size, and a loader
    accepts a checkpoint exactly when its record equals that dict.
    """

    group_size: int
    kernel: ClassVar[Kernel] = KERNEL

    def to_json(self) -> dict:
        return layout.fingerprint(self.group_size)

    def fingerprint(self) -> dict:
        return layout.fingerprint(self.group_size)

    @property
    def layout_hash(self) -> str:
        return layout.LAYOUT_HASH


def layout_record(scheme: Scheme) -> W4A8Layout:
    return W4A8Layout(scheme.group_size)


def verify_modules(directory, modules, group_size: int, found: dict) -> None:
    """Re-check a written checkpoint from its headers (``found``: tensor name -> TensorInfo): every quantised module
    has qweight/scales/zeros of the W4A8 dtypes and mutually consistent shapes, and no tinygemm tensor."""
    bk = layout.block_k(group_size)
    for m in modules:
        qw, sc, zp = (found.get(f"{m}{s}") for s in layout.LAYOUT.suffixes)
        if qw is None or sc is None or zp is None:
            raise EdgeqError(f"{directory}: W4A8 module {m} is missing its qweight, scales or zeros")
        if f"{m}.scales_and_zeros" in found:
            raise EdgeqError(f"{directory}: W4A8 module {m} also has a tinygemm scales_and_zeros; the checkpoint is inconsistent")
        if qw.dtype != "U8" or len(qw.shape) != 3 or qw.shape[2] != bk * 16 + layout.COMP_BYTES:
            raise EdgeqError(f"{directory}: {m}.qweight is {qw.dtype} {list(qw.shape)}, expected U8 "
                             f"[N/32, K/{bk}, {bk * 16 + layout.COMP_BYTES}] for G={group_size}")
        want = [qw.shape[0], qw.shape[1] * bk // group_size, layout.BLOCK_N]
        for info, code in ((sc, "F32"), (zp, "I8")):
            if info.dtype != code or list(info.shape) != want:
                raise EdgeqError(f"{directory}: {info.name} is {info.dtype} {list(info.shape)}, expected {code} {want} "
                                 f"for N={qw.shape[0] * 32}, K={qw.shape[1] * bk}, G={group_size}")


def describe(record: W4A8Layout) -> str:
    """The packed layout written (the summary line of ``edgeq quantize``): fixed bytes, nothing measured."""
    return f"amx_w4a8 {record.layout_hash[:12]} (fixed bytes, the same on every CPU)"


def runs_on(record: dict) -> str:
    """The machines that run the stored bytes as they are: all of them (the layout is fixed by the kernel's source)."""
    return ("any x86-64 CPU, unchanged: the amx_w4a8 layout is fixed by the kernel's source (version "
            f"{record.get('version')}, 32-row blocks, K blocks of {record.get('block_k')}), not measured per machine. "
            "edgeq's native kernel uses AMX, AVX512-VNNI, AVX-VNNI or AVX2 when present; other CPUs run the "
            "bit-exact portable path")


class _W4A8:
    """The converter's side of the amx_w4a8 layout (:class:`edgeq.convert.packers.Packer`)."""

    kernel = KERNEL
    zero_point_domain = "int"  # w = (q - z) * s, z an integer 0..15
    per_module_groups = False  # one group size per checkpoint: a recipe's group_sizes are ignored
    packed_embeddings = False  # no lookup for 4-bit levels in this layout: embeddings stay bf16

    def check_options(self, scheme: Scheme, method: str, *, gptq_input: bool = False) -> None:
        check_options(scheme, method, gptq_input=gptq_input)

    def record(self, scheme: Scheme) -> W4A8Layout:
        return layout_record(scheme)

    def describe(self, record: W4A8Layout) -> str:
        return describe(record)

    def runs_on(self, layout_json: dict) -> str:
        return runs_on(layout_json)

    def quantize(self, read_rows, n: int, k: int, group_size: int, method: str, *, name: str, module: str,
                 record: W4A8Layout, write, progress) -> float:
        return _quantize(read_rows, n, k, group_size, method, name, write, progress, module)

    def verify(self, directory: Path, manifest: Manifest, found: dict) -> None:
        verify_modules(directory, manifest.quantized_modules, Scheme.parse(manifest.scheme).group_size, found)


PACKER = _W4A8()
