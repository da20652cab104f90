"""Tensor-parallel slices of edgeq's packed tensors, read as stored (no vLLM import: unit-testable anywhere).

vLLM splits a column-parallel layer's N (output rows) and a row-parallel layer's K (inputs) evenly across ranks.
edgeq's packed tensors can be cut only where their layouts allow, and each rank reads only its own bytes:

- ``tinygemm_w4a16`` ``qweight`` uint8 [N, K/2]: rows come in blocks of ``block_n`` (64 on AVX512, 32 on AVX2 and
  the default path; a tail block of ``N % block_n`` rows at the end), and inside a block of s rows the bytes are
  k-major, ``s/2`` bytes per k (docs/format.md). Rows a..b are the contiguous bytes ``[a*K/2, b*K/2)`` when a is a
  block start and b a block start or N. Inputs c..d of a block are its bytes ``[c*s/2, d*s/2)``: viewed as
  ``[blocks, K, s/2]`` the cut is a strided view ``[:, c:d, :]``. ``scales_and_zeros`` bf16 [K/G, N, 2] is cut on
  whole groups and rows: ``[c/G:d/G, a:b]``.
- ``amx_w4a8`` ``qweight`` uint8 [N/32, K/bk, bk*16 + 128] (each slot holds 32 rows x bk inputs and their
  compensation), ``scales`` fp32 / ``zeros`` int8 [N/32, K/G, 32]: rows cut on 32-row blocks, inputs on groups
  (bk = G for G <= 128), every cut a plain view (docs/w4a8.md).

The copy into a rank's parameter is the only read of the checkpoint bytes; nothing here materialises the full
tensor. The split rules (:func:`split_problem`) say which cuts are legal; :func:`check_split` turns a refusal into
one error naming the layer, its shape and the tensor-parallel sizes that work.
"""

from __future__ import annotations

import torch

from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.layouts import w4a8 as w4a8_layout
from edgeq.layouts.tinygemm import TinygemmLayout

W4A8_BLOCK_N = 32  # the amx_w4a8 layout's row block (block_size_n() in the kernel's source)
TP_CANDIDATES = tuple(range(1, 17))  # sizes listed as "works" in an error


def split_problem(sizes: list[int], k: int, tp: int, *, row_parallel: bool, block_n: int, group_size: int) -> str | None:
    """Why ``tp`` ranks cannot split this layer on layout boundaries, or None when they can.

    ``sizes``: the global output sizes of the layer's logical shards (q, k, v of a fused QKV; gate, up; one entry for
    a plain layer); ``k`` its input size. Column-parallel (``row_parallel=False``): each shard's N/tp rows must be
    whole ``block_n`` blocks when tp > 1, and in a fused layer every shard but the last must be whole blocks on each
    rank (the kernel reads one tail block, at the end). Row-parallel: K/tp inputs must be whole groups.
    """
    if row_parallel:
        if k % tp or (k // tp) % group_size:
            return f"K={k} / {tp} ranks is not a whole number of {group_size}-input groups"
        return None
    for i, n in enumerate(sizes):
        if n % tp:
            return f"N={n} is not divisible by {tp}"
        local = n // tp
        last = i == len(sizes) - 1
        if (tp > 1 or not last) and local % block_n:
            what = f"shard {i} ({n} rows)" if len(sizes) > 1 else f"N={n}"
            return f"{what} / {tp} ranks = {local} rows is not a whole number of {block_n}-row layout blocks"
    return None


def working_sizes(sizes: list[int], k: int, *, row_parallel: bool, block_n: int, group_size: int) -> list[int]:
    """The tensor-parallel sizes (of :data:`TP_CANDIDATES`) this layer can be split for."""
    return [t for t in TP_CANDIDATES
            if split_problem(sizes, k, t, row_parallel=row_parallel, block_n=block_n, group_size=group_size) is None]


def check_split(name: str, sizes: list[int], k: int, tp: int, *, row_parallel: bool, block_n: int,
                group_size: int) -> None:
    """Raise :class:`EdgeqError` naming the layer, its shape and the sizes that work when ``tp`` cannot split it."""
    why = split_problem(sizes, k, tp, row_parallel=row_parallel, block_n=block_n, group_size=group_size)
    if why is None:
        return
    works = working_sizes(sizes, k, row_parallel=row_parallel, block_n=block_n, group_size=group_size)
    kind = "row-parallel (K split)" if row_parallel else "column-parallel (N split)"
    raise EdgeqError(
        f"{name}: [{sum(sizes)}, {k}] ({kind}, shards {sizes}) cannot be split for tensor_parallel_size={tp}: {why}; "
        f"tensor_parallel_size {', '.join(map(str, works))} works for this layer"
    )


def _check_rows(n: int, a: int, b: int, layout: TinygemmLayout) -> None:
    full = n // layout.block_n * layout.block_n
    if not (0 <= a < b <= n) or (a % layout.block_n and a != full) or (b % layout.block_n and b != n):
        raise EdgeqError(f"rows {a}..{b} of N={n} do not fall on the checkpoint's {layout.block_n}-row layout blocks")


def copy_tinygemm(dst: torch.Tensor, qweight: torch.Tensor, n: int, k: int, rows: tuple[int, int],
                  cols: tuple[int, int], layout: TinygemmLayout) -> None:
    """Copy rows a..b, inputs c..d of a packed [N, K/2] ``qweight`` (``layout``) into ``dst`` uint8 [b-a, (d-c)/2]:
    the same layout for those rows and inputs alone. Reads only those bytes (strided views of ``qweight``)."""
    (a, b), (c, d) = rows, cols
    _check_rows(n, a, b, layout)
    if c % 2 or d % 2 or not 0 <= c < d <= k:
        raise EdgeqError(f"inputs {c}..{d} of K={k}: a packed cut needs even bounds inside 0..{k}")
    flat, out = qweight.reshape(-1), dst.view(-1)
    kk = d - c
    for n0, s, count in layout.blocks(n):
        lo, hi = max(a, n0), min(b, n0 + s * count)
        if lo >= hi:
            continue
        blocks = -(-(hi - lo) // s)
        src = flat[lo * k // 2 : (lo + s * blocks) * k // 2].view(blocks, k, s // 2)[:, c:d, :]
        out[(lo - a) * kk // 2 : (hi - a) * kk // 2].view(blocks, kk, s // 2).copy_(src)


def tinygemm_cut(qweight: torch.Tensor, n: int, k: int, rows: tuple[int, int], cols: tuple[int, int],
                 stored: TinygemmLayout, here: TinygemmLayout) -> torch.Tensor:
    """Rows a..b, inputs c..d of ``qweight`` packed for ``here``: the stored bytes when the layouts agree, else those
    rows unpacked from ``stored`` and packed for ``here`` (the repack path; the caller warns)."""
    (a, b), (c, d) = rows, cols
    out = torch.empty(b - a, (d - c) // 2, dtype=torch.uint8)
    copy_tinygemm(out, qweight, n, k, rows, cols, stored)
    if stored.is_compatible(here):
        return out
    return tinygemm.pack(tinygemm.unpack(out, b - a, d - c, stored), here)


def scales_and_zeros_cut(sz: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int], group_size: int) -> torch.Tensor:
    """The [K/G, N, 2] tensor's groups of inputs c..d and rows a..b (a view)."""
    (a, b), (c, d) = rows, cols
    return sz[c // group_size : d // group_size, a:b]


def w4a8_cut(name: str, tensor: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int], group_size: int) -> torch.Tensor:
    """The rows a..b, inputs c..d of one amx_w4a8 tensor (``qweight``, ``scales`` or ``zeros``; a view).
    Dim 0 counts 32-row blocks; dim 1 counts bk-input slots (qweight) or G-input groups (scales, zeros)."""
    (a, b), (c, d) = rows, cols
    unit = w4a8_layout.block_k(group_size) if name == "qweight" else group_size
    if a % W4A8_BLOCK_N or b % W4A8_BLOCK_N or c % unit or d % unit:
        raise EdgeqError(f"{name}: rows {a}..{b} / inputs {c}..{d} do not fall on the amx_w4a8 layout's "
                         f"{W4A8_BLOCK_N}-row blocks and {unit}-input slots")
    return tensor[a // W4A8_BLOCK_N : b // W4A8_BLOCK_N, c // unit : d // unit]
