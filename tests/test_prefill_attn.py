"""edgeq's native causal prefill attention (edgeq/csrc/attn_prefill.h) against an fp64 reference, and its use in the
runtime's transformers forward (edgeq/runtime/prefill_attn.py).

The kernel computes 12 rows (query head, position) a tile, keys in blocks of 16, values in tiles of 6 rows x 64, so
the cases cover row counts that leave a partial tile, GQA groups of 1, 4, 6, 7 and 13 (a group wider than a tile),
head sizes 16 to 256, key counts around the blocks, queries that continue a cache (S < T) and keys read through the
cache's strides, on each ISA path this CPU has (avx512: vdpbf16ps, 16 keys a vector; avx2: fp32 FMAs, 8 keys).
The bound is the decode attention's (tests/test_attn_decode.py): one bf16 rounding of an fp32 result. There is no
scalar path: there, and where the library does not run, the runtime keeps SDPA (tested below)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from edgeq.errors import EdgeqError
from edgeq.runtime import load, native
from edgeq.runtime import prefill_attn as pa
from edgeq.runtime.native import ops
from helpers.paths import FIXTURE

native_only = pytest.mark.skipif(not ops.prefill_attn_available(), reason="no avx2/avx512 path of the library here")


def _isas():
    """The prefill attention's paths this CPU runs (none where the library does not build or run)."""
    if not native.available():
        return []
    return [isa for isa in ("avx2", "avx512") if isa in native.status()["cpu_isas"]]


def _reference(q, k, v, scale):
    """fp64 causal attention, query i at position T - S + i: [S, H, D]."""
    H, S, D = q.shape
    T, rep = k.shape[2], H // k.shape[1]
    kk, vv = k[0].double().repeat_interleave(rep, 0), v[0].double().repeat_interleave(rep, 0)
    s = q.double() @ kk.transpose(1, 2) * scale
    s = s.masked_fill(torch.arange(T)[None, :] > torch.arange(T - S, T)[:, None], float("-inf"))
    return (s.softmax(-1) @ vv).transpose(0, 1)


def _problem(H, KVH, D, S, T, cap, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(H, S, D, generator=g) * 2).bfloat16()
    k = torch.randn(1, KVH, cap, D, generator=g).bfloat16()[:, :, :T]
    v = torch.randn(1, KVH, cap, D, generator=g).bfloat16()[:, :, :T]
    return q, k, v


def _check(q, k, v, isa=None):
    scale = 1 / math.sqrt(q.shape[2])
    out = ops.prefill_attn(q, k, v, scale, isa=isa)
    ref = _reference(q, k, v, scale)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    bound = ref.abs() * 2.0**-8 + 1e-5 * float(ref.abs().max())
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g}, at most {float(bound.max()):.3g} allowed"
    return out


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("H, KVH, D, S, T, cap", [
    (12, 2, 128, 512, 512, 600),   # Qwen2.5-1.5B heads, a cache view (CAP > T)
    (32, 8, 64, 300, 300, 300),    # Llama-3.2-1B heads
    (4, 1, 16, 37, 50, 64),        # the smallest head size; 13 earlier keys in the cache
    (7, 1, 32, 5, 5, 8),           # group 7, 35 rows: tiles of 12, 12, 11
    (26, 2, 48, 20, 20, 20),       # group 13: a tile spans two positions' heads
    (2, 2, 256, 40, 40, 40),       # no GQA, the largest head size
    (12, 2, 128, 100, 700, 800),   # a continuation: 600 cached keys before the queries
    (12, 2, 128, 1, 33, 40),       # one query (a decode step through the forward)
    (8, 2, 64, 17, 17, 17),        # keys and rows just past a block / a tile
    (8, 2, 64, 130, 130, 130),     # keys past two 64-key steps
])
def test_matches_fp64_reference(isa, H, KVH, D, S, T, cap):
    q, k, v = _problem(H, KVH, D, S, T, cap, seed=H * 1000 + S + T)
    out = _check(q, k, v, isa)
    if T == S:  # the first query sees the first key only: its output is that key's values, exactly
        rep = H // KVH
        assert torch.equal(out[0], v[0, :, 0].repeat_interleave(rep, 0))


@pytest.mark.parametrize("isa", _isas())
def test_strided_rows_of_a_fresh_projection(isa):
    """Without a cache, transformers hands over k and v as [1, S, KVH, D] transposed: rows KVH * D apart."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(8, 40, 64, generator=g).bfloat16()
    k = torch.randn(1, 40, 2, 64, generator=g).bfloat16().transpose(1, 2)
    v = torch.randn(1, 40, 2, 64, generator=g).bfloat16().transpose(1, 2)
    assert k.stride(2) == 128
    out = _check(q, k, v, isa)
    assert torch.equal(out, ops.prefill_attn(q, k.contiguous(), v.contiguous(), 1 / 8, isa=isa))


@pytest.mark.parametrize("isa", _isas())
def test_one_and_two_threads_give_the_same_bits(isa):
    """Tiles and their key order are fixed by the shapes; threads only change who computes a tile."""
    before = torch.get_num_threads()
    try:
        for H, KVH, D, S, T in [(12, 2, 128, 300, 300), (32, 8, 64, 130, 200)]:
            q, k, v = _problem(H, KVH, D, S, T, T, seed=S)
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs.append(ops.prefill_attn(q, k, v, 0.1, isa=isa))
            assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


@native_only
def test_paths_agree_within_the_rounding():
    """avx2 and avx512 sum in different orders (8 vs 16 keys a vector, fp32 FMAs vs vdpbf16ps): both within one bf16
    rounding of fp64, so within two of each other."""
    if len(_isas()) < 2:
        pytest.skip("one path here")
    q, k, v = _problem(12, 2, 128, 200, 260, 300, seed=9)
    a, b = (ops.prefill_attn(q, k, v, 0.09, isa=isa).double() for isa in ("avx2", "avx512"))
    assert float(((a - b).abs() / b.abs().clamp_min(1e-3)).max()) <= 2.0**-7


@native_only
def test_bad_arguments_are_refused():
    q, k, v = _problem(4, 2, 24, 8, 8, 8, seed=1)
    with pytest.raises(EdgeqError, match="native prefill_attn: head size D=24 is not a multiple of 16"):
        ops.prefill_attn(q, k, v, 0.2)
    q, k, v = _problem(4, 2, 32, 8, 4, 8, seed=1)
    with pytest.raises(EdgeqError, match="T=4 keys for S=8 queries"):
        ops.prefill_attn(q, k, v, 0.2)
    q, k, v = _problem(4, 2, 32, 8, 8, 8, seed=1)
    with pytest.raises(EdgeqError, match="avx2 and avx512 paths .*, not scalar: got isa 0"):
        ops.prefill_attn(q, k, v, 0.2, isa="scalar")
    assert not ops.prefill_attn_available("scalar") and ops.prefill_attn_available("avx2")


def test_causal_mask_recognised():
    want = torch.arange(9)[None, :] <= torch.arange(5, 9)[:, None]
    assert pa._causal(None, 4, 4) and pa._causal(None, 1, 9) and not pa._causal(None, 4, 9)
    assert pa._causal(want[None, None], 4, 9)
    padded = want.clone()
    padded[:, 0] = False  # a padding mask: not the plain causal pattern
    assert not pa._causal(padded[None, None], 4, 9)
    assert not pa._causal(want[None, None].float(), 4, 9)
    # the verdict is kept per tensor object (one forward's mask, asked by every layer): objects never share one
    causal, pad = want[None, None].clone(), padded[None, None].clone()
    assert [pa._causal(m, 4, 9) for m in (causal, causal, pad, pad, causal)] == [True, True, False, False, True]


# --------------------------------------------------------------------------------------- in the runtime


def _logits(lm, ids):
    lm.cache.reset()
    first = lm.forward(torch.tensor([ids[:150]]))
    rest = lm.forward(torch.tensor([ids[150:]]))  # continues the cache: the causal mask with an offset
    whole = lm.forward(torch.tensor([ids]), use_cache=False)
    return first, rest, whole


def torch_bf16_sdpa_error() -> str | None:
    """Why torch's own bf16 SDPA cannot run in this process, or None. torch 2.13 raises "pack_vnni2 is only supported
    when avx512 is supported" for 64 or more keys under ATEN_CPU_CAPABILITY=avx2 on a CPU with AMX (its flash kernel
    packs for AMX tiles, which the forced capability then refuses; seen 2026-12-05): the SDPA arm of a comparison
    cannot run there, edgeq's native attention can."""
    q = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as e:
        return str(e)
    return None


@native_only
def test_runtime_forward_uses_it_and_stays_close_to_sdpa():
    """The fixture in bf16 through both attentions: every attention call native, logits within NATIVE_TOL of the
    SDPA forward's (relative to the largest |logit|: as for the native decode ops, tests/test_lean.py), and the
    greedy pick of every position the same."""
    if why := torch_bf16_sdpa_error():
        pytest.skip(f"torch's bf16 SDPA cannot run in this process: {why}")
    ids = torch.randint(3, 4096, (260,), generator=torch.Generator().manual_seed(0)).tolist()
    native_lm = load(FIXTURE, kv_cache_bytes="4MiB")
    sdpa_lm = load(FIXTURE, kv_cache_bytes="4MiB", prefill_attn="sdpa")
    assert (native_lm.settings.prefill_attn, sdpa_lm.settings.prefill_attn) == ("native", "sdpa")
    assert sdpa_lm.settings.prefill_attn_reason == "requested (prefill_attn=sdpa)"
    a, b = _logits(native_lm, ids), _logits(sdpa_lm, ids)
    layers = native_lm.config.num_hidden_layers
    assert native_lm.attn_counts == {"prefill_attn_native": 3 * layers} and not sdpa_lm.attn_counts
    for x, y in zip(a, b):
        assert float((x.float() - y.float()).abs().max() / y.float().abs().max()) <= 0.02
        assert float((x.argmax(-1) == y.argmax(-1)).float().mean()) >= 0.97


@native_only
def test_calls_it_does_not_fit_go_to_sdpa_unchanged():
    """A padding mask is not the causal pattern: the call goes to transformers' SDPA function, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    m = Module()
    m._edgeq_counts = counts = Counter()
    q, k, v = _problem(4, 2, 32, 6, 6, 6, seed=2)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    mask[..., 0] = False
    got, _ = pa.attention(m, q[None], k, v, mask, scaling=0.2)
    want, _ = sdpa_attention_forward(m, q[None], k, v, mask, scaling=0.2)
    assert torch.equal(got, want) and counts == {"prefill_attn_sdpa": 1}
    got, _ = pa.attention(m, q[None], k, v, None, scaling=0.2)  # plain causal: native
    assert counts["prefill_attn_native"] == 1
    ref = F.scaled_dot_product_attention(q[None].double(), k.double().repeat_interleave(2, 1),
                                         v.double().repeat_interleave(2, 1), is_causal=True, scale=0.2)
    assert float((got.double() - ref.transpose(1, 2)).abs().max()) < 0.02


@native_only
def test_sliding_window_layers_native_only_within_their_window(tmp_path):
    """Mistral with a 16-token window: a prompt of 12 tokens is plain causal in every layer (native); a prompt of 40
    needs the window's mask (SDPA, unchanged); both within the tolerance of the SDPA forward."""
    from helpers.models import save_hf, tiny_model

    path = save_hf(tiny_model("mistral", sliding_window=16), tmp_path / "mistral-window")
    ours, ref = load(path, kv_cache_bytes="1MiB"), load(path, kv_cache_bytes="1MiB", prefill_attn="sdpa")
    layers = ours.config.num_hidden_layers
    for n, want in ((12, {"prefill_attn_native": layers}), (40, {"prefill_attn_sdpa": layers})):
        ids = torch.arange(3, 3 + n)[None]
        ours.reset_counts()
        a, b = ours.forward(ids, use_cache=False), ref.forward(ids, use_cache=False)
        assert ours.attn_counts == want
        assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) <= 0.02


def test_choice_where_it_cannot_run(monkeypatch):
    """auto keeps SDPA and says why; native is an error naming the reason; a bad value names its source."""
    monkeypatch.setattr(pa.ops, "prefill_attn_available", lambda isa=None: False)
    lm = load(FIXTURE, kv_cache_bytes="1MiB")
    assert lm.settings.prefill_attn == "sdpa" and "avx2 or avx512 path" in lm.settings.prefill_attn_reason
    with pytest.raises(EdgeqError, match="prefill_attn=native but the native prefill attention needs"):
        load(FIXTURE, kv_cache_bytes="1MiB", prefill_attn="native")
    monkeypatch.setenv("EDGEQ_PREFILL_ATTN", "flash")
    with pytest.raises(EdgeqError, match=r"\$EDGEQ_PREFILL_ATTN='flash': expected one of auto, native, sdpa"):
        load(FIXTURE, kv_cache_bytes="1MiB")
    monkeypatch.setenv("EDGEQ_PREFILL_ATTN", "sdpa")
    assert load(FIXTURE, kv_cache_bytes="1MiB").settings.prefill_attn_reason == "requested ($EDGEQ_PREFILL_ATTN=sdpa)"
