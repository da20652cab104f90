"""RTN math: hand-worked vectors, the searches' guarantees (least squares <= clipping <= min/max), edge cases."""

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.layouts.tinygemm import dequantize
from edgeq.quantize import search
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


def _group_sq_error(r, w, g):
    return (dequantize(r.q, r.scales_and_zeros, g) - w).square().reshape(w.shape[0], -1, g).sum(-1)


@pytest.mark.parametrize("g", [32, 64, 128, 256])
def test_searches_never_worse_per_group(g):
    """clip <= minmax and rtn (least squares) <= clip on every group's own squared error, as stored (bf16)."""
    gen = torch.Generator().manual_seed(g)
    w = torch.randn(128, 512, generator=gen) * torch.rand(128, 1, generator=gen)
    w[::7, ::13] *= 8  # outliers, where clipping matters
    mm, clip, rtn = (quantize_groups(w, g, m) for m in ("minmax", "clip", "rtn"))
    assert bool((_group_sq_error(clip, w, g) <= _group_sq_error(mm, w, g) + 1e-9).all())
    assert bool((_group_sq_error(rtn, w, g) <= _group_sq_error(clip, w, g) + 1e-9).all())
    assert clip.relative_error < mm.relative_error * 0.97  # and strictly better overall on such weights
    assert rtn.relative_error < clip.relative_error * 0.99


def test_lsq_fit_hand_worked():
    """w = [0, 1, 2, 4] on codes 8..11 (L = 0..3): s = cov(L, w) / var(L) = 6.5 / 5 = 1.3 -> bf16 1.296875; the
    zero refitted for the rounded slope: (7 - 1.296875 * 6) / 4 = -0.1953125 (exact in bf16)."""
    w = torch.tensor([[[0.0, 1.0, 2.0, 4.0]]])
    scale, zero, ok = search.lsq_fit(w, torch.tensor([[[8.0, 9.0, 10.0, 11.0]]]), torch.ones_like(w))
    assert scale.item() == 1.296875 and zero.item() == -0.1953125 and bool(ok)
    _, _, ok = search.lsq_fit(w, torch.full_like(w, 8.0), torch.ones_like(w))  # one distinct code: no slope
    assert not bool(ok)


def test_rtn_finds_a_grid_minmax_misses():
    """Values on 15 levels 0.25 apart (codes 0..14): min/max stretches them over 16 levels and errs; the search
    tries the step (hi - lo) / 14 = 0.25 and reproduces the group exactly."""
    levels = torch.arange(15, dtype=torch.float32) * 0.25 - 1.5
    w = torch.cat((levels, levels[:1])).repeat(16, 2)  # G = 16 per group, 2 groups, 16 rows
    mm, rtn = quantize_groups(w, 32, "minmax"), quantize_groups(w, 32, "rtn")
    assert mm.relative_error > 0.01
    assert rtn.relative_error == 0.0
    assert torch.equal(dequantize(rtn.q, rtn.scales_and_zeros, 32), w)


@pytest.mark.parametrize("kind", ["uniform", "rms_abs"])
def test_weighted_search_never_worse_than_minmax(kind):
    """The reference: min/max, scored with the same per-weight importance c the search minimises."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(64, 8, 32, generator=gen).pow(3)
    c = search.importance(w, kind)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    ref_s, ref_z = search.minmax_params(lo, hi)
    ref = search.weighted_error(w, search.codes(w, ref_s, ref_z), ref_s, ref_z, c)
    for scale, zero in (search.lsq_search(w, c), search.hqq_zero(w, c)):
        assert torch.equal(scale, search.bf16(scale)) and torch.equal(zero, search.bf16(zero))  # storable
        err = search.weighted_error(w, search.codes(w, scale, zero), scale, zero, c)
        assert bool((err <= ref).all())
    s, z = search.lsq_search(w, c)
    assert float(search.weighted_error(w, search.codes(w, s, z), s, z, c).sum()) < 0.9 * float(ref.sum())


def _reference_lsq_search(w, c, extra=()):
    """search.lsq_search written with the out-of-place primitives (Best, lsq_fit, codes): what it must equal bit for
    bit."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    best = search.Best(w, c, *search.minmax_params(lo, hi))
    for scale, zero in extra:
        best.offer(scale, zero)
    span = (hi - lo).clamp_min(2.0**-24)
    for d in search.STEP_OFFSETS:
        best.offer(*search.lsq_fit(w, torch.round((w - lo) * ((15.0 + d) / span)).clamp_(0.0, 15.0), c))
    for _ in range(search.REFINE_ROUNDS):
        best.offer(*search.lsq_fit(w, search.codes(w, best.scale, best.zero), c))
    return best.scale, best.zero


@pytest.mark.parametrize("kind", ["uniform", "rms_abs"])
def test_in_place_search_equals_the_primitives(kind):
    """The in-place search (search._Work) against the same candidates through the out-of-place primitives, with
    real (non-unit) weights too; heavy-tailed values and degenerate groups so that many candidates compete."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 6, 32, generator=gen).pow(3)
    w[1, 1] = 0.0
    w[2, 3] = -0.5
    c = search.importance(w, kind)
    got = search.lsq_search(w, c)
    ref = _reference_lsq_search(w, c)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    none = search.lsq_search(w, None)
    assert (kind == "uniform") == (torch.equal(none[0], got[0]) and torch.equal(none[1], got[1]))


@pytest.mark.parametrize("method", ["rtn", "clip", "minmax"])
def test_row_blocks_and_uniform_weights_give_the_same_bits(method, monkeypatch):
    """choose_params searches rows in blocks, skips the products by c = 1 and computes in place: all must be
    invisible. Reference: one block of all rows, through the weighted code path with explicit ones, composed of the
    plain primitives (the implementation before the blocks and the in-place search).
    Degenerate groups (constant, all zero) included; 37 rows so that the last block is a partial one."""
    from edgeq.quantize import rtn as rtn_mod
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(37, 4, 32, generator=gen).pow(3)
    w[0, 0] = 0.0
    w[5, 2] = 0.75
    ones = torch.ones_like(w)
    cands = rtn_mod._clip_candidates(w, rtn_mod.CLIP_RATIOS if method != "minmax" else (1.0,))
    if method == "rtn":
        ref = _reference_lsq_search(w, ones, extra=tuple(cands[1:]))
    else:
        best = search.Best(w, ones, *cands[0])
        for scale, zero in cands[1:]:
            best.offer(scale, zero)
        ref = (best.scale, best.zero)
    monkeypatch.setattr(rtn_mod, "CHUNK_ELEMENTS", 5 * 4 * 32)  # blocks of 5 rows: 8 blocks, the last of 2
    scale, zero = rtn_mod.choose_params(w, method)
    assert torch.equal(scale, ref[0]) and torch.equal(zero, ref[1])
    assert scale.shape == (37, 4, 1)


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
