"""bf16 Linears computed in fp32 by row blocks (edgeq/convert/upcast.py), as ``--calib self`` samples on CPUs
without bf16 dot products. Exact checks use small integers, whose fp32 sums are exact whatever the summation order,
so the one rounding to bf16 is the only one and the result must equal the fp64 product rounded to bf16 bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgeq.convert import upcast


def _ints(*shape: int, lo: int = -20, hi: int = 21, seed: int = 0) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_worked_example():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    w = torch.tensor([[0.5, 0.25], [3.0, -1.0]], dtype=torch.bfloat16)
    b = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    y = upcast.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.tolist() == [[1.0, 2.0]]


def test_row_blocks_equal_the_exact_product(monkeypatch):
    """Many blocks and a short last one (N = 1000 in blocks of 48 rows), leading dims, a bias: every output equals
    bf16(exact). Sums of 300 products of |v| <= 20 are exact in fp32
    (< 2^24) but need more than bf16's 8 bits, so the rounding itself is exercised."""
    monkeypatch.setattr(upcast, "CHUNK_BYTES", 48 * 4 * 300)
    assert upcast.rows_per_chunk(300) == 48
    x, w, b = _ints(2, 3, 300, seed=1), _ints(1000, 300, seed=2), _ints(1000, lo=-7, hi=8, seed=3)
    y = upcast.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), b.double()).to(torch.bfloat16)
    assert y.shape == (2, 3, 1000) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert torch.equal(y, exact)
    assert torch.equal(upcast.linear(x, w), F.linear(x.double(), w.double()).to(torch.bfloat16))
    assert int((exact.double() != F.linear(x.double(), w.double(), b.double())).sum()) > 100  # rounding happened


def test_close_to_torchs_bf16_linear_on_real_values():
    """Random normal values: the fp32 sums' order differs from torch's bf16 GEMM, so a few outputs may land one bf16
    step apart, never more."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 700, generator=g).to(torch.bfloat16)
    w = torch.randn(1100, 700, generator=g).to(torch.bfloat16)
    y, ref = upcast.linear(x, w).double(), F.linear(x.double(), w.double())
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref)[1] - 8)  # bf16 spacing at |ref|
    assert bool(((y - ref).abs() <= ulp).all())
    assert float((y != ref.to(torch.bfloat16).double()).double().mean()) < 0.01


def test_other_dtypes_are_torchs_linear():
    x, w = torch.randn(3, 64), torch.randn(10, 64)
    assert torch.equal(upcast.linear(x, w), F.linear(x, w))


def test_upcast_linears_switches_that_model_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8, bias=False)).to(torch.bfloat16)
    other = nn.Linear(32, 64).to(torch.bfloat16)
    x = _ints(4, 32, seed=5)
    before = model(x)
    assert upcast.upcast_linears(model) == 2
    assert "forward" in vars(model[0]) and "forward" not in vars(other)
    after = model(x)
    assert after.dtype == torch.bfloat16 and after.shape == (4, 8)
    step = torch.ldexp(torch.ones_like(before.double()), torch.frexp(before.double())[1] - 7)
    assert bool(((after.double() - before.double()).abs() <= step).all())
