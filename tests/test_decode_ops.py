"""edgeq's fused decode ops (edgeq/csrc/decode_ops.cpp) against the eager ops of the lean loop they replace:
RoPE + cache write bit for bit; RMSNorm (+ residual add) equal except for the sum of squares taken in another
order, which may move an output by one bf16 ulp, rarely."""

from __future__ import annotations

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.runtime import native
from edgeq.runtime.rmsnorm import RMSNorm as _RMSNorm

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library does not build/run here")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's bf16 ulp."""
    ulp = torch.ldexp(torch.ones_like(b.float()), torch.frexp(b.float()).exponent - 8)
    return (a.float() - b.float()).abs() / ulp


@pytest.mark.parametrize("rows, cols", [(1, 1536), (1, 256), (18, 128), (3, 48)])
def test_add_rms_norm_matches_the_eager_norm(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * 3).bfloat16()
    delta = torch.randn(rows, cols, generator=g).bfloat16()
    w = (torch.rand(cols, generator=g) + 0.5).bfloat16()
    eps = 1e-6
    ref_x = x.clone().add_(delta)  # the eager residual add: bf16(x + delta)
    ref = torch.empty(rows, cols, dtype=torch.bfloat16)
    _RMSNorm(rows, cols, torch.bfloat16)(ref_x, w, torch.tensor(eps, dtype=torch.float32), ref)
    out = torch.empty_like(ref)
    got_x = x.clone()
    native.add_rms_norm(got_x, delta, w, eps, out)
    assert torch.equal(got_x, ref_x)  # the add is exact
    u = _ulps(out, ref)
    assert float(u.max()) <= 1.0 and float((u > 0).float().mean()) <= 0.01, f"{int((u > 0).sum())} outputs differ"
    plain = torch.empty_like(ref)
    native.add_rms_norm(ref_x.clone(), None, w, eps, plain)  # no delta: the norm alone
    assert torch.equal(plain, out)


def test_rope_to_cache_is_bit_identical_to_the_eager_rope():
    from edgeq.runtime.rope import rope_tables

    h, kvh, d, cap, pos = 12, 2, 128, 40, 29
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, h * d, generator=g).bfloat16()
    k = torch.randn(1, kvh * d, generator=g).bfloat16()
    v = torch.randn(1, kvh * d, generator=g).bfloat16()

    class Rotary(torch.nn.Module):  # the default RoPE, as transformers' rotary modules compute it
        def forward(self, x, position_ids):
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            f = position_ids[..., None].float() * inv
            emb = torch.cat((f, f), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    cos, nsin = rope_tables(Rotary(), cap, d, torch.bfloat16)
    c, s_ = cos[pos], nsin[pos]

    def eager(t):  # t * cos + swap_halves(t) * nsin, each op rounding to bf16 (the lean loop's _rope)
        sw = torch.cat([t[:, d // 2:], t[:, : d // 2]], dim=1)
        return (t * c) + (sw * s_)

    keys = torch.full((1, kvh, cap, d), float("nan"), dtype=torch.bfloat16)
    values = torch.full_like(keys, float("nan"))
    rot_q = torch.empty(h, d, dtype=torch.bfloat16)
    native.rope_to_cache(q, k, v, c, s_, keys, values, pos, rot_q)
    assert torch.equal(rot_q, eager(q.view(h, d)))
    assert torch.equal(keys[0, :, pos], eager(k.view(kvh, d)))
    assert torch.equal(values[0, :, pos], v.view(kvh, d))
    others = torch.ones(cap, dtype=torch.bool)
    others[pos] = False
    assert bool(keys[0, :, others].isnan().all()) and bool(values[0, :, others].isnan().all())  # nothing else written


def test_bad_arguments_are_errors():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(EdgeqError, match=r"native add_rms_norm: shapes: x \[1, 64\], weight \[32\]"):
        native.add_rms_norm(x, None, torch.ones(32, dtype=torch.bfloat16), 1e-6, torch.empty_like(x))
    with pytest.raises(EdgeqError, match="native add_rms_norm: x: expected contiguous bf16"):
        native.add_rms_norm(x.float(), None, torch.ones(64, dtype=torch.bfloat16), 1e-6, torch.empty_like(x))
    kv = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    t = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(EdgeqError, match="native rope_to_cache: pos 8 outside the cache of 8 positions"):
        native.rope_to_cache(t, t, t, torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16),
                             kv, kv.clone(), 8, torch.empty(2, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_finite_hand_worked(dtype):
    """The first largest value's index (torch.argmax's tie rule), -1 when anything is NaN or infinite."""
    cases = [([1.0, 3.0, 3.0, 0.0], 1), ([1.0, 3.0, 3.0, float("-inf")], -1), ([float("nan"), 1.0], -1),
             ([2.0, float("inf")], -1), ([-0.0, 0.0, -1.0], 0), ([-5.0], 0), ([-3e38, -1e38, -2e38], 1)]
    for values, want in cases:
        assert native.argmax_finite(torch.tensor(values, dtype=dtype)) == want, values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_finite_equals_torch_on_a_vocabulary(dtype):
    """151,936 logits (Qwen2.5's vocabulary) with planted ties, and the same through generation.greedy."""
    from edgeq.runtime.generation import greedy

    g = torch.Generator().manual_seed(7)
    for trial in range(5):
        x = (torch.randn(151936, generator=g) * 4).to(dtype)
        if trial % 2:
            top = x.max()
            x[[9000, 150000, 40]] = top  # ties: the lowest index wins
        want = int(torch.argmax(x))
        assert native.argmax_finite(x) == want == greedy(x) == greedy(x[None, None])
    x[77] = float("nan")
    assert native.argmax_finite(x) == -1 == greedy(x)


def test_argmax_finite_refuses_what_it_cannot_read():
    with pytest.raises(EdgeqError, match="logits: expected a non-empty contiguous bf16 or fp32"):
        native.argmax_finite(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(EdgeqError, match="non-empty"):
        native.argmax_finite(torch.zeros(0, dtype=torch.float32))
    with pytest.raises(EdgeqError, match="contiguous"):
        native.argmax_finite(torch.zeros(4, 2)[:, 0])
