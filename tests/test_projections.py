"""Projections that read the same input in one native kernel call (edgeq/runtime/projections.py, the op
``edgeq::int4_mm_multi`` in edgeq/csrc/int4mm_ops.cpp): the same bits as one ``int4_mm`` call per matrix plus the
runtime's bias add, on every ISA path this CPU has; errors by message; the lean decode loop's logits and counters
unchanged by the grouping; what cannot share a call (act-order, a model without the native kernel, the dequant path)
runs one call per projection."""

from __future__ import annotations

import shutil

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.runtime import load, native, projections
from helpers.checkpoints import prose_checkpoint, quantize
from helpers.models import save_hf, tiny_model
from helpers.native import problem, ready_or_skip
from helpers.perm import permute

PROMPT = list(range(5, 29))


@pytest.fixture(scope="module")
def ready():
    return ready_or_skip()


@pytest.fixture(scope="module")
def here():
    return tinygemm.probe()


def _matrices(here, m: int):
    """x [m, 768] and three matrices on it: N with a 16-row and a 48-row tail past whole blocks, group sizes 32, 128
    and 64, a bias on the first and the last (bf16 values that round differently when added)."""
    g = torch.Generator().manual_seed(7)
    out = []
    x = None
    for i, (n, gs) in enumerate([(256 + 16, 32), (64, 128), (128 + 48, 64)]):
        x_i, qw, sz, _, _ = problem(m, n, 768, gs, seed=20 + i, layout=here, x=x)
        x = x_i
        bias = None if i == 1 else (torch.randn(n, generator=g) * 3).to(torch.bfloat16)
        out.append((qw, gs, sz, bias))
    return x, out


def _separate(x, mats, isa):
    ys = []
    for qw, gs, sz, bias in mats:
        y = native.int4_mm(x, qw, gs, sz, isa=isa)
        if bias is not None:
            y.add_(bias)  # what Int4Linear.linear2d does after the kernel
        ys.append(y)
    return ys


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "scalar"])
def test_multi_equals_separate_calls_bit_for_bit(ready, here, isa, m):
    if isa not in ready["cpu_isas"]:
        pytest.skip(f"no {isa} here")
    x, mats = _matrices(here, m)
    ys = native.int4_mm_multi(x, mats, isa=isa)
    for y, ref, (qw, _, _, _) in zip(ys, _separate(x, mats, isa), mats):
        assert y.shape == (m, qw.shape[0]) and y.dtype == torch.bfloat16
        assert torch.equal(y, ref)


def test_multi_bits_do_not_depend_on_threads(ready, here):
    x, mats = _matrices(here, 1)
    n_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.int4_mm_multi(x, mats)
        torch.set_num_threads(2)
        two = native.int4_mm_multi(x, mats)
    finally:
        torch.set_num_threads(n_threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_multi_bad_inputs_raise_edgeq_error(ready, here):
    x, mats = _matrices(here, 2)
    x3 = torch.cat([x, x[:1]])
    with pytest.raises(EdgeqError, match=r"int4_mm_multi: x must be \[M, K\] with 1 <= M <= 2"):
        native.int4_mm_multi(x3, mats)
    qw, gs, sz, bias = mats[0]
    with pytest.raises(EdgeqError, match=r"biases\[0\]: expected bf16 \[272\]"):
        native.int4_mm_multi(x, [(qw, gs, sz, bias[:16])])
    with pytest.raises(EdgeqError, match="holds K=768 but x has K=384"):
        native.int4_mm_multi(x[:, :384].contiguous(), mats)
    with pytest.raises(EdgeqError, match="expected as many of each"):
        native.int4_mm_multi(x, [])
    with pytest.raises(EdgeqError, match="group_size must be one of"):
        native.int4_mm_multi(x, [(qw, 48, sz, None)])


def test_multi_counts_one_call_per_matrix(ready, here):
    x, mats = _matrices(here, 1)
    native.reset_call_count()
    native.int4_mm_multi(x, mats)
    assert native.call_count() == 3


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A quantised tiny Qwen2 (q/k/v biases; gate/up with a 32-row tail block)."""
    root = tmp_path_factory.mktemp("projections")
    return quantize(save_hf(tiny_model("qwen2"), root / "hf"), root / "q")


def _decode(lm, tokens, fuse: bool) -> torch.Tensor:
    lm.decoder.native_layers = False  # the Python step, whose grouped calls this tests (tests/test_stack.py: the C++ one)
    lm.decoder.fuse_projections = fuse
    lm.cache.reset()
    lm.forward(torch.tensor([PROMPT]), logits_to_keep=1)
    return torch.stack([lm.decode_step(t).clone() for t in tokens])


@pytest.mark.parametrize("name", ["qwen2", "prose"])
def test_lean_logits_and_counts_do_not_change(ready, name, qwen2, tmp_path_factory, monkeypatch):
    ckpt = qwen2 if name == "qwen2" else prose_checkpoint(tmp_path_factory)
    lm = load(ckpt, kv_cache_bytes="1MiB", decode_ops="native")
    assert lm.decoder is not None and lm.settings.decode_path == "native_decode"
    assert all(projections.fusable([L.q_proj, L.k_proj, L.v_proj]) for L in (l.self_attn for l in lm.model.model.layers))
    tokens = torch.randint(3, 400, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    calls = []
    real = native.int4_mm_multi
    monkeypatch.setattr(native, "int4_mm_multi", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm.reset_counts()
    fused = _decode(lm, tokens, True)
    counts_fused = dict(lm.path_counts)
    assert len(calls) == 2 * len(lm.decoder.layers) * len(tokens)  # q/k/v and gate/up, every layer, every step
    lm.reset_counts()
    separate = _decode(lm, tokens, False)
    assert len(calls) == 2 * len(lm.decoder.layers) * len(tokens)  # none more
    assert torch.equal(fused, separate)
    assert counts_fused == dict(lm.path_counts)  # one decode call counted per matrix either way


def test_what_cannot_share_a_call_runs_one_call_per_projection(ready, qwen2, tmp_path):
    # act-order: q/k/v read a permuted input; the group falls back to their own linear2d (which gathers it once)
    ckpt = tmp_path / "perm"
    shutil.copytree(qwen2, ckpt)
    permute(ckpt, torch.randperm(128, generator=torch.Generator().manual_seed(1)))
    lm = load(ckpt, kv_cache_bytes="1MiB", decode_ops="native")
    attn = lm.model.model.layers[0].self_attn
    assert not projections.fusable([attn.q_proj, attn.k_proj, attn.v_proj])
    mlp = lm.model.model.layers[0].mlp
    assert projections.fusable([mlp.gate_proj, mlp.up_proj])
    assert not projections.fusable([mlp.gate_proj])  # a group of one is just the call
    # rows at the dequant crossover: each member's own path (here prefill_threshold=1 sends M = 1 there too)
    lm1 = load(qwen2, kv_cache_bytes="1MiB", decode_ops="native", prefill_threshold=1)
    lm1.reset_counts()
    x = torch.randn(1, 128).to(torch.bfloat16)
    L = lm1.decoder.layers[0]
    ys = L.qkv(x)
    assert lm1.path_counts == {"dequant_prefill": 3}
    assert all(torch.equal(y, fn(x)) for y, fn in zip(ys, (L.q.fn, L.k.fn, L.v.fn)))
    # without the native kernel (the runtime on aten's op) nothing is grouped, also when it is switched off after
    # the decoder was built (benchmarks and tests do that)
    lm2 = load(qwen2, kv_cache_bytes="1MiB", decode_ops="native")
    L2, rt = lm2.decoder.layers[0], lm2.runtime
    want = [fn(x) for fn in (L2.gate.fn, L2.up.fn)]
    saved, rt.native = rt.native, None
    try:
        mlp2 = lm2.model.model.layers[0].mlp
        assert not projections.fusable([mlp2.gate_proj, mlp2.up_proj])
        lm2.reset_counts()
        got = L2.gate_up(x)
        assert lm2.path_counts == {"tinygemm_decode": 2}
        for a, b in zip(got, want):  # aten's op instead of edgeq's: the same values within the kernels' tolerance
            assert float((a.float() - b.float()).abs().max()) <= 2**-6 * float(b.float().abs().max())
    finally:
        rt.native = saved
