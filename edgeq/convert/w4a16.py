"""``edgeq quantize --scheme w4a16-gG``: the pieces the quantize pipeline calls for the ``tinygemm_w4a16`` layout
(the W4A8 counterpart is edgeq/convert/w4a8.py; both are reached through :func:`edgeq.convert.packers.packer`).

Per quantised Linear ``M`` of shape [N, K], group size G (tensors and math: edgeq/layouts/tinygemm.py)::

    M.qweight           uint8 [N, K/2]       the kernel's own pack op's output
    M.scales_and_zeros  bf16  [K/G, N, 2]    (scale, zero) per (group, output row)
    M.perm              int64 [K]            act-order input only (GPTQ): the layer computes kernel(x[..., perm])

with ``w[n, k] ~= (q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]`` (edgeq/quantize/rtn.py). Bytes per module:
``N*K/2 + 4*N*K/G`` (+ ``8*K`` with ``M.perm``), e.g. 8960 x 1536 at G = 128: 6,881,280 + 430,080 = 7,311,360
(4.25 bits per weight): :func:`edgeq.layouts.tinygemm.nbytes`.

Streaming: a weight is read, quantised and packed in row blocks of whole layout blocks
(:func:`edgeq.layouts.tinygemm.row_block`), whose packed bytes are exactly those rows of the whole tensor's packing;
the qweight parts go to the writer as they are made and the scales and zeros (4*N*K/G bytes) are held until the
qweight is complete, because the writer takes each tensor whole, in declared order.

The layout record is *measured* (:func:`edgeq.layouts.tinygemm.probe`): torch packs for the ISA it dispatches to,
so the record names the CPU capability and a process on another ISA repacks at load.

Nothing here imports edgeq.convert.plan or edgeq.convert.pipeline (they call in, not the other way round).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from edgeq.errors import EdgeqError
from edgeq.io.manifest import Manifest
from edgeq.layouts import tinygemm
from edgeq.layouts.tinygemm import TinygemmLayout
from edgeq.quantize.rtn import quantize_groups
from edgeq.scheme import Scheme

KERNEL = tinygemm.KERNEL
ROW_BLOCK_ELEMENTS = 4 << 20  # ~4M weights per block: the quantiser's fp32 working set stays ~100 MB


def row_step(record: TinygemmLayout, n: int, k: int) -> int:
    """Rows per streamed block: about ROW_BLOCK_ELEMENTS weights, whole layout blocks, at most N."""
    return min(n, tinygemm.row_block(record, ROW_BLOCK_ELEMENTS // k))


def pack_rows(q: torch.Tensor, record: TinygemmLayout) -> torch.Tensor:
    """A whole q uint8 [N, K] (0..15) packed with the kernel's op, a row block at a time (bounded scratch)."""
    n, k = q.shape
    step = row_step(record, n, k)
    return torch.cat([tinygemm._op_pack(q[a : a + step]) for a in range(0, n, step)])


def quantize_entry(
    read_rows: Callable[[int, int], torch.Tensor],
    n: int,
    k: int,
    group_size: int,
    method: str,
    name: str,
    write: Callable[[str, torch.Tensor], None],
    record: TinygemmLayout,
    progress: Callable[[int], None] | None = None,
    module: str | None = None,
) -> float:
    """Quantise and pack one weight [N, K] in row blocks of whole layout blocks; returns its relative reconstruction
    error sqrt(sum (w_hat - w)^2 / sum w^2).

    ``read_rows(a, b)`` returns rows a..b-1 of the float weight; ``write(tensor name, part)`` receives the qweight
    in row-block parts, then scales_and_zeros whole; ``progress(rows)`` after each block. ``name`` names the source
    tensor in errors; ``module`` the output prefix (default: ``name`` without ``.weight``).
    """
    module = module or name.removesuffix(".weight")
    step = row_step(record, n, k)
    sq_err = sq_norm = 0.0
    sz_parts = []
    for a in range(0, n, step):
        b = min(n, a + step)
        qt = quantize_groups(read_rows(a, b), group_size, method, name=f"{name} rows {a}..{b}")
        tinygemm.check_values(qt.q, name)
        write(f"{module}.qweight", tinygemm._op_pack(qt.q))
        sz_parts.append(qt.scales_and_zeros)
        sq_err += float(qt.sq_error.sum())
        sq_norm += float(qt.sq_norm.sum())
        if progress is not None:
            progress(b - a)
    write(f"{module}.scales_and_zeros", torch.cat(sz_parts, dim=1))
    return (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0


def describe(record: TinygemmLayout) -> str:
    """The packed layout written, and why. Under ATEN_CPU_CAPABILITY torch packs for the forced ISA (e.g. AVX2,
    32-row blocks on an AVX512 CPU), and a process without it repacks at load."""
    text = f"tinygemm {record.cpu_capability} {record.layout_hash[:12]} ({record.block_n}-row blocks"
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if not forced:
        return text + ", torch's dispatch on this CPU)"
    return text + (f", because ATEN_CPU_CAPABILITY={forced} is set; a process without it may use another layout "
                   "and repack at every load: unset it and re-run, or `edgeq repack` where the model runs)")


def runs_on(layout: dict) -> str:
    """The machines that run the stored bytes as they are (no repack), from the manifest's layout record."""
    cap, block = layout.get("cpu_capability"), layout.get("block_n")
    return (f"x86-64 CPUs where torch {layout.get('torch_version')} packs int4 with {cap} kernels ({block}-row blocks, "
            f"layout {str(layout.get('layout_hash'))[:12]}). Elsewhere (another ISA or torch) edgeq repacks in memory at "
            "load with a warning; `edgeq repack` does it once on disk")


def verify_modules(directory: Path, manifest: Manifest, found: dict) -> None:
    """Re-check a written checkpoint from its headers (``found``: tensor name -> TensorInfo): every quantised module
    has qweight U8 [N, K/2] and scales_and_zeros BF16 [K/G, N, 2] at its own G, an optional perm I64 [K], and no
    perm belongs to a module that is not quantised."""
    for m in manifest.quantized_modules:
        g = manifest.group_size(m)
        qw, sz = found.get(f"{m}.qweight"), found.get(f"{m}.scales_and_zeros")
        if qw is None or sz is None:
            raise EdgeqError(f"{directory}: quantised module {m} is missing its qweight or scales_and_zeros")
        n, half_k = qw.shape
        if qw.dtype != "U8" or sz.dtype != "BF16" or list(sz.shape) != [2 * half_k // g, n, 2]:
            raise EdgeqError(f"{directory}: {m}: qweight {qw.dtype} {list(qw.shape)} / scales_and_zeros {sz.dtype} {list(sz.shape)} do not fit G={g}")
        perm = found.get(f"{m}.perm")
        if perm is not None and (perm.dtype != "I64" or list(perm.shape) != [2 * half_k]):
            raise EdgeqError(f"{directory}: {m}.perm is {perm.dtype} {list(perm.shape)}, expected I64 [{2 * half_k}]")
    stray = sorted(n for n in found if n.endswith(".perm") and n.removesuffix(".perm") not in manifest.quantized_modules)
    if stray:
        raise EdgeqError(f"{directory}: {stray[0]} belongs to no quantised module; the checkpoint is inconsistent")


class _Tinygemm:
    """The converter's side of the tinygemm W4A16 layout (:class:`edgeq.convert.packers.Packer`)."""

    kernel = KERNEL
    zero_point_domain = "float"  # w = (q - 8) * s + z, z a bf16 float
    per_module_groups = True  # the mm op takes G per call: a recipe's group_sizes apply
    packed_embeddings = True  # rows of 4-bit levels are decoded at lookup (edgeq/convert/embeddings.py)

    def check_options(self, scheme: Scheme, method: str, *, gptq_input: bool = False) -> None:
        """Every method and input the pipeline has writes this layout."""

    def record(self, scheme: Scheme) -> TinygemmLayout:
        return tinygemm.probe()

    def describe(self, record: TinygemmLayout) -> str:
        return describe(record)

    def runs_on(self, layout: dict) -> str:
        return runs_on(layout)

    def quantize(self, read_rows, n: int, k: int, group_size: int, method: str, *, name: str, module: str,
                 record: TinygemmLayout, write, progress) -> float:
        return quantize_entry(read_rows, n, k, group_size, method, name, write, record, progress, module)

    def verify(self, directory: Path, manifest: Manifest, found: dict) -> None:
        verify_modules(directory, manifest, found)


PACKER = _Tinygemm()
