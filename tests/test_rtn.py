"""RTN math: hand-worked vectors, the clipping search's guarantee, edge cases."""

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.layouts.tinygemm import dequantize
from edgeq.quantize.rtn import quantize_groups


def _group(values, g=32):
    row = torch.tensor(values, dtype=torch.float32)
    return row.repeat(g // len(values)).unsqueeze(0).repeat(16, 1)


def test_hand_worked_minmax():
    """Docstring example: w = [-1, 0, 0.5, 2] -> scale 0.2001953125, zero 0.6015625, q = [0, 5, 7, 15]."""
    r = quantize_groups(_group([-1.0, 0.0, 0.5, 2.0]), 32, "minmax")
    assert r.q[0, :4].tolist() == [0, 5, 7, 15]
    assert r.scales_and_zeros.dtype == torch.bfloat16 and list(r.scales_and_zeros.shape) == [1, 16, 2]
    assert r.scales_and_zeros[0, 0].float().tolist() == [0.2001953125, 0.6015625]
    w_hat = dequantize(r.q, r.scales_and_zeros, 32)[0, :4]
    assert torch.allclose(w_hat, torch.tensor([-1.0, 0.0009765625, 0.4013671875, 2.0029296875]))


def test_constant_group_is_exact():
    r = quantize_groups(torch.full((16, 64), 0.375), 32, "rtn")
    assert r.q.unique().tolist() == [8]
    assert torch.equal(dequantize(r.q, r.scales_and_zeros, 32), torch.full((16, 64), 0.375))
    assert r.relative_error == 0.0


def test_minmax_is_nearest_level_for_stored_params():
    """q is chosen with the bf16-rounded parameters: every w_hat is within half a step of w (inside the range)."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    r = quantize_groups(w, 64, "minmax")
    scale = r.scales_and_zeros[..., 0].float().t().repeat_interleave(64, 1)
    err = (dequantize(r.q, r.scales_and_zeros, 64) - w).abs()
    assert bool((err <= scale / 2 + scale * 2**-7 + 1e-6).all())  # + the range edge moved by bf16 rounding


@pytest.mark.parametrize("g", [32, 64, 128, 256])
def test_clipping_never_worse_than_minmax_per_group(g):
    gen = torch.Generator().manual_seed(g)
    w = torch.randn(128, 512, generator=gen) * torch.rand(128, 1, generator=gen)
    w[::7, ::13] *= 8  # outliers, where clipping matters
    mm, rtn = quantize_groups(w, g, "minmax"), quantize_groups(w, g, "rtn")
    per_group = lambda r: (dequantize(r.q, r.scales_and_zeros, g) - w).square().reshape(128, -1, g).sum(-1)
    assert bool((per_group(rtn) <= per_group(mm) + 1e-9).all())
    assert rtn.relative_error < mm.relative_error * 0.97  # and strictly better overall on such weights


def test_errors_name_the_tensor():
    w = torch.randn(16, 64)
    w[3, 5] = float("nan")
    with pytest.raises(EdgeqError, match=r"layers.0.q_proj.weight: 1 NaN/Inf"):
        quantize_groups(w, 32, name="layers.0.q_proj.weight")
    with pytest.raises(EdgeqError, match="K=96 is not a multiple of the group size 64"):
        quantize_groups(torch.randn(16, 96), 64, name="x")
    with pytest.raises(EdgeqError, match="unknown method 'awq'"):
        quantize_groups(torch.randn(16, 64), 32, "awq")
    with pytest.raises(EdgeqError, match="2-D float"):
        quantize_groups(torch.zeros(16, 64, dtype=torch.int32), 32)


def test_relative_error_matches_direct_computation():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    r = quantize_groups(w, 32)
    direct = float((dequantize(r.q, r.scales_and_zeros, 32) - w).norm() / w.norm())
    assert r.relative_error == pytest.approx(direct, rel=1e-5)
