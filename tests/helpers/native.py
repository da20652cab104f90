"""Test problems for the native W4A16 kernel (edgeq/runtime/native/): weights quantised by per-group min/max, packed
in a chosen tinygemm layout, with the fp64 reference and the stated tolerance (tests/test_native.py's docstring):
    |y - ref| <= 2**-8 * |ref| + 2**-14 * A,   A = |x| @ |dequant(W)|.T
"""

from __future__ import annotations

import platform

import pytest
import torch

from edgeq.layouts import tinygemm


def halves(s):
    """The row order of a block of ``s`` rows packed as interleaved halves: 0, s/2, 1, s/2 + 1, ..."""
    return tuple(p // 2 + (p % 2) * (s // 2) for p in range(s))


def make_layout(block_n: int, full: tuple, tails: str = "adjacent") -> tinygemm.TinygemmLayout:
    """A layout with ``full`` as the order of a whole ``block_n``-row block and ``tails`` the order of each 16-row
    multiple below it ("adjacent", "halves" or "reversed")."""
    perms = {block_n: full}
    for s in range(16, block_n, 16):
        perms[s] = {"adjacent": tuple(range(s)), "halves": halves(s), "reversed": tuple(reversed(range(s)))}[tails]
    return tinygemm.TinygemmLayout(block_n=block_n, perms=tuple(sorted(perms.items())))


def outlier_activations(m: int, k: int) -> torch.Tensor:
    """bf16 [m, k] activations of mean 1 with channels 7 and 1000 at 300 and -200 (post-norm hidden states): the
    worst case for a kernel that sums x * (offset + q) and cancels offset * sum(x) per group."""
    xf = torch.randn(m, k, generator=torch.Generator().manual_seed(2)) + 1.0
    xf[:, 7], xf[:, 1000] = 300.0, -200.0
    return xf.to(torch.bfloat16)


def problem(m: int, n: int, k: int, g: int, seed: int, layout: tinygemm.TinygemmLayout, x: torch.Tensor | None = None):
    """Weights quantised from a random matrix by per-group min/max (realistic scales/zeros), packed in ``layout``;
    activations random bf16 unless ``x`` [m, k] is given."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    wg = w.reshape(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo).clamp(min=1e-6) / 15
    q = ((wg - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16) if x is None else x
    wd = tinygemm.dequantize(q, sz, g, dtype=torch.float64)
    ref = x.double() @ wd.t()
    bound = 2.0**-8 * ref.abs() + 2.0**-14 * (x.double().abs() @ wd.abs().t())
    return x, tinygemm.pack(q, layout), sz, ref, bound


def excess(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
    """max(|y - ref| / bound): <= 1 means within the stated tolerance."""
    return float(((y.double() - ref).abs() / bound).max())


def folded(isa: str | None, m: int) -> bool:
    """Whether the native op takes the AMX path's M > 16 kernel, which rounds each dequantised weight to bf16 (the
    dequantise path's precision, edgeq/csrc/int4mm_amx.cpp) instead of multiplying exact 1 + q/16 pairs."""
    return isa == "amx" and m > 16


def folded_bound(ref: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The tolerance of weights rounded to bf16: 2**-8 * |ref| + 2**-9 * A (A recovered from ``bound``), 1% slack
    for the fp32 sums."""
    a = (bound - 2.0**-8 * ref.abs()) * 2.0**14
    return 2.0**-8 * ref.abs() + 2.0**-9 * a * 1.01


def dequantise_path(x: torch.Tensor, qw: torch.Tensor, g: int, sz: torch.Tensor) -> torch.Tensor:
    """y from the weights dequantised to bf16 (aten's op on the identity gives bf16(w).T) and an fp32 matmul: what
    the folded AMX kernel computes, up to the order of its sums."""
    k = x.shape[1]
    wt = tinygemm.mm(torch.eye(k, dtype=torch.bfloat16), qw, g, sz)
    return (x.float() @ wt.float()).to(torch.bfloat16)


def ready_or_skip() -> dict:
    """The native library's status for a test module's ``ready`` fixture: skipped off x86-64, a failure (with the
    compiler's reason) where it should build but does not."""
    from edgeq.runtime import native

    st = native.status()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"native kernel is x86-64 only: {st['reason']}")
    if not st["available"]:
        pytest.fail(f"native kernel unavailable: {st['reason']}")
    return st
