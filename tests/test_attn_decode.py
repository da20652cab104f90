"""edgeq's native single-query attention (edgeq/csrc/attn_decode.h) against an fp64 reference, on every ISA path
this CPU has: GQA groups, head sizes, window starts, one key, and lengths that split into several chunks per kv
head (the flash-decoding merge). The bound is ISA-independent: one bf16 rounding of an fp32 result.

The SIMD paths take keys in blocks (8 for avx2, 16 for avx512) and the output in tiles of up to 6 heads x 64 (avx512)
or 16 (avx2) values of D, so the cases below also cover key counts around the block sizes, group sizes that tile
unevenly (7 = 4 + 3, 8 = 4 + 4, 13 = 5 + 4 + 4), head sizes that leave a partial piece, and a last chunk of one key;
and the output is the same bits for 1 and 2 threads (the key split does not depend on the thread count)."""

from __future__ import annotations

import math

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.runtime import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library does not build/run here")


def _reference(q, k, v, start, end, scale):
    """fp64 softmax(scale q K^T) V over positions [start, end), kv head h // group for query head h: [H, D]."""
    H, D = q.shape
    kvh = k.shape[1]
    qq = q.double().view(kvh, H // kvh, D)
    ks, vs = k[0, :, start:end].double(), v[0, :, start:end].double()
    s = torch.einsum("jgd,jtd->jgt", qq, ks) * scale
    return torch.einsum("jgt,jtd->jgd", s.softmax(-1), vs).reshape(H, D)


def _isas():
    return [isa for isa in ("scalar", "avx2", "avx512") if isa in native.status()["cpu_isas"]]


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("H, KVH, D, cap, start, end", [
    (4, 2, 64, 16, 0, 1),          # one key: out = v
    (12, 2, 128, 600, 0, 520),     # Qwen2.5-1.5B heads, several chunks per kv head
    (32, 8, 64, 2100, 0, 2048),    # Llama-3.2-1B heads, long context
    (4, 4, 48, 100, 37, 93),       # no GQA, head size not a multiple of the vector width, a window start
    (6, 1, 32, 300, 0, 257),       # one kv head, a chunk boundary just passed
])
def test_matches_fp64_reference(isa, H, KVH, D, cap, start, end):
    q, k, v = _problem(H, KVH, D, cap, H * 1000 + end)
    out = _check(q, k, v, start, end, isa)
    if end - start == 1:
        assert torch.equal(out.view(KVH, H // KVH, D), v[0, :, start, None, :].expand(KVH, H // KVH, D))


def _problem(H, KVH, D, cap, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(H, D, generator=g) * 2).bfloat16()
    k = torch.randn(1, KVH, cap, D, generator=g).bfloat16()
    v = torch.randn(1, KVH, cap, D, generator=g).bfloat16()
    return q, k, v


def _check(q, k, v, start, end, isa):
    """decode_attn on `isa` within the fp64 reference's bound: one bf16 rounding (relative 2^-9) of an fp32 result
    whose own error is ~1e-6 of the output's scale. Returns the output."""
    H, D = q.shape
    out = torch.full((H, D), float("nan"), dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    native.decode_attn(q, k, v, start, end, scale, out, isa=isa)
    ref = _reference(q, k, v, start, end, scale)
    bound = ref.abs() * 2.0**-8 + 1e-5 * float(ref.abs().max())
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}, at most {float(bound.max()):.3g} allowed"
    return out


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100])
@pytest.mark.parametrize("H, KVH, D", [(12, 2, 128), (8, 2, 64), (4, 4, 64), (16, 2, 128), (14, 2, 64)])
def test_key_counts_around_the_blocks(isa, n, H, KVH, D):
    """Key counts below, at and past the 8- and 16-key blocks (a tail block is padded and its padding's scores are
    never stored); groups 6, 4, 1 (no GQA), 8 (two head tiles) and 7 (4 + 3); a window start of 3."""
    q, k, v = _problem(H, KVH, D, n + 8, seed=n * 100 + H + D)
    _check(q, k, v, 3, 3 + n, isa)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("H, KVH, D, start, end", [
    (26, 2, 40, 0, 70),         # group 13 (head tiles 5 + 4 + 4); D = 40: a partial last piece on both paths
    (4, 2, 80, 11, 130),        # D = 80: 5 pieces of 16, 2 tiles (4 + 1 pieces) on avx512
    (2, 1, 256, 0, 300),        # the largest head size, 5 chunks (4 x 64 + 44)
    (12, 2, 128, 0, 2049),      # 9 chunks per kv head, the last with one key
    (16, 8, 64, 1000, 1777),    # group 2, a window start far into the cache
    (6, 3, 24, 1, 50),          # D = 24: not a multiple of 16
])
def test_head_sizes_groups_and_chunks(isa, H, KVH, D, start, end):
    q, k, v = _problem(H, KVH, D, end + 5, seed=H * D + end)
    _check(q, k, v, start, end, isa)


@pytest.mark.parametrize("isa", _isas())
def test_one_and_two_threads_give_the_same_bits(isa):
    """The chunking is a function of the key count and KVH only, and each output is merged in chunk order: the
    thread count changes who computes a chunk, not what. The first three cases are lengths where the former split
    (a function of the thread count) cut other chunks for 1 and 2 threads (300 keys: 256 + 44 vs 150 + 150): on
    this data that changed the last bit of 3 of these 14k outputs on each ISA path (checked by running the C++ tasks
    with both splits); the last case has many chunks (2048 keys: 16 tasks)."""
    before = torch.get_num_threads()
    try:
        for H, KVH, D, end in [(48, 2, 128, 300), (48, 2, 128, 450), (32, 1, 64, 1000), (12, 2, 128, 2048)]:
            q, k, v = _problem(H, KVH, D, end, seed=end)
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = torch.empty(H, D, dtype=torch.bfloat16)
                native.decode_attn(q, k, v, 0, end, 1 / math.sqrt(D), out, isa=isa)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (H, KVH, D, end)
    finally:
        torch.set_num_threads(before)


def test_isa_paths_agree_within_one_rounding():
    """Every path computes the same fp32 math in another summation order: outputs within a bf16 ulp or two."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(12, 128, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 800, 128, generator=g).bfloat16() for _ in range(2))
    outs = []
    for isa in _isas():
        out = torch.empty(12, 128, dtype=torch.bfloat16)
        native.decode_attn(q, k, v, 0, 777, 0.088, out, isa=isa)
        outs.append(out.double())
    for o in outs[1:]:
        assert bool(((o - outs[0]).abs() <= outs[0].abs() * 2.0**-7 + 1e-6).all())


@pytest.mark.parametrize("isa", _isas())
def test_large_scores_do_not_overflow(isa):
    """Scores of +-1e4 (a peaked softmax): the max is subtracted before exp, so the output is the top key's value."""
    q = torch.zeros(2, 64, dtype=torch.bfloat16)
    q[:, 0] = 100.0
    k = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    k[0, 0, :, 0] = torch.tensor([-100.0, 3, 100, -5, 0, 1, 2, 99])  # key 2 wins by 100 * 1 * scale
    v = torch.arange(8 * 64, dtype=torch.float32).view(1, 1, 8, 64).bfloat16()
    out = torch.empty(2, 64, dtype=torch.bfloat16)
    native.decode_attn(q, k, v, 0, 8, 1.0, out, isa=isa)
    assert torch.equal(out, v[0, 0, 2].expand(2, 64))


@pytest.mark.parametrize("args, message", [
    (dict(q=torch.zeros(4, 64)), "q: expected contiguous bf16 [H, D]"),
    (dict(end=17), "keys [0, 17) outside the cache of 16 positions"),
    (dict(q=torch.zeros(3, 64, dtype=torch.bfloat16), out=torch.zeros(3, 64, dtype=torch.bfloat16)),
     "H=3 query heads is not a multiple of KVH=2"),
    (dict(out=torch.zeros(4, 32, dtype=torch.bfloat16)), "out: expected contiguous bf16 [4, 64]"),
])
def test_bad_arguments_are_errors_naming_the_argument(args, message):
    base = dict(q=torch.zeros(4, 64, dtype=torch.bfloat16), k=torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16),
                v=torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16), start=0, end=16, scale=0.125,
                out=torch.zeros(4, 64, dtype=torch.bfloat16))
    base.update(args)
    with pytest.raises(EdgeqError, match=r"native decode_attn: " + __import__("re").escape(message)):
        native.decode_attn(base["q"], base["k"], base["v"], base["start"], base["end"], base["scale"], base["out"])
