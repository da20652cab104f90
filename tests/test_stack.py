"""A decode step's layers in one native call (edgeq/runtime/stack.py, the op ``edgeq::decode_layers`` in
edgeq/csrc/decode_step.cpp): the same logits, cache and counters as the Python native step, bit for bit (Llama with a
tied head, Qwen2 with q/k/v biases, Qwen3 with q/k head norms, Mistral with a sliding window shorter than the
context, a W4A8 Qwen2 through edgeq's W4A8 op); the models and states it does not take run the Python step and say
why; a runtime switched to aten's op falls back; bad arguments raise EdgeqError before anything is written; an
act-order head reads each step's norm; the benchmarks' skip bits leave out what they name."""

from __future__ import annotations

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.runtime import load, native, stack
from edgeq.runtime.native import w4a8 as native_w4a8
from edgeq.runtime.w4a8linear import PORTABLE, KernelChoice
from helpers.checkpoints import prose_checkpoint, quantize
from helpers.models import save_hf, tiny_model
from helpers.native import ready_or_skip

PROMPT = list(range(5, 29))


@pytest.fixture(scope="module")
def ready():
    return ready_or_skip()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    out = {"prose": prose_checkpoint(tmp_path_factory)}
    out["qwen2"] = quantize(save_hf(tiny_model("qwen2"), root / "qwen2-hf"), root / "qwen2-q")
    out["mistral-window"] = quantize(save_hf(tiny_model("mistral", sliding_window=16), root / "mw-hf"), root / "mw-q")
    out["qwen3"] = quantize(save_hf(tiny_model("qwen3"), root / "qwen3-hf"), root / "qwen3-q")
    if native_w4a8.available():
        from edgeq.convert.pipeline import convert
        from edgeq.scheme import Scheme

        out["qwen2-w4a8"] = root / "qwen2-w4a8"
        convert(root / "qwen2-hf", out["qwen2-w4a8"], Scheme.parse("w4a8-g32"), method="minmax", force=True)
    return out


def _decode(lm, tokens, one_call: bool):
    """Prefill PROMPT, decode ``tokens``: (logits [steps, V], the cache's rows written, path counts, kernel calls)."""
    lm.decoder.native_layers = one_call
    lm.cache.reset()
    lm.forward(torch.tensor([PROMPT]), logits_to_keep=1)
    lm.reset_counts()
    calls = native.call_count(), native_w4a8.call_count()
    logits = torch.stack([lm.decode_step(t).clone() for t in tokens])
    end = len(PROMPT) + len(tokens)
    assert all(layer.length == end for layer in lm.cache.layers)
    rows = [torch.cat([c.keys[..., :end, :], c.values[..., :end, :]]) for c in lm.cache.layers]
    return logits, rows, dict(lm.path_counts), (native.call_count() - calls[0], native_w4a8.call_count() - calls[1])


@pytest.mark.parametrize("name", ["prose", "qwen2", "qwen3", "mistral-window", "qwen2-w4a8"])
def test_one_call_equals_the_python_step_bit_for_bit(ready, tiny, name, monkeypatch):
    if name not in tiny:
        pytest.skip(f"edgeq's W4A8 kernel does not run here: {native_w4a8.status()['reason']}")
    lm = load(tiny[name], kv_cache_bytes="1MiB", decode_ops="native")
    dec = lm.decoder
    assert dec.stack is not None and dec.native_layers, dec.stack_reason
    assert lm.settings.decode_ops_reason.endswith("; the layers in one call (decode_layers)")
    assert lm.settings.decode_layers == "one call"
    if name == "mistral-window":
        assert [L.window for L in dec.layers] == [16, 16]  # 24 + 24 positions: the window slides
    tokens = torch.randint(3, 400, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    calls = []
    real = native.decode_layers
    monkeypatch.setattr(native, "decode_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    one = _decode(lm, tokens, True)
    assert len(calls) == len(tokens)  # one call a step
    python = _decode(lm, tokens, False)
    assert len(calls) == len(tokens)  # none more
    assert torch.equal(one[0], python[0])
    assert all(torch.equal(a, b) for a, b in zip(one[1], python[1]))
    path = "w4a8_kernel" if name.endswith("w4a8") else "native_decode"
    assert one[2] == python[2] == {path: (7 * len(dec.layers) + 1) * len(tokens)}
    assert one[3] == python[3]
    assert one[3][1 if path == "w4a8_kernel" else 0] == (7 * len(dec.layers) + 1) * len(tokens)


def test_bits_do_not_depend_on_threads(ready, tiny):
    lm = load(tiny["qwen2"], kv_cache_bytes="1MiB", decode_ops="native")
    tokens = [7, 300, 12, 5]
    before = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            runs.append(_decode(lm, tokens, True)[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[0], runs[1])


def test_what_it_does_not_take_runs_the_python_step_and_says_why(ready, tiny, tmp_path):
    import shutil

    from helpers.perm import permute

    ckpt = tmp_path / "qkv-perm"  # act-order q/k/v in layer 0
    shutil.copytree(tiny["qwen2"], ckpt)
    permute(ckpt, torch.randperm(128, generator=torch.Generator().manual_seed(1)))
    lm = load(ckpt, kv_cache_bytes="1MiB", decode_ops="native")
    assert lm.decoder.stack is None and not lm.decoder.native_layers
    assert lm.settings.decode_ops_reason.endswith(
        "; the layers op by op (model.layers.0.q_proj has an act-order permutation or residual levels)")
    assert lm.settings.decode_layers == "op by op"
    layers = list(load(tiny["prose"], kv_cache_bytes="1MiB", decode_ops="native").model.model.layers)
    assert stack.why_not(layers) is None
    assert stack.why_not([]) == "no layers"
    down = layers[2].mlp.down_proj
    layers[2].mlp.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False)  # e.g. a bf16 reference
    assert stack.why_not(layers) == ("model.layers.2.down_proj is not a W4A16 Int4Linear or a W4A8Linear like the "
                                     "first projection")
    if "qwen2-w4a8" in tiny:  # W4A8 on another kernel than edgeq's (the portable path here)
        w8 = list(load(tiny["qwen2-w4a8"], kv_cache_bytes="1MiB", decode_ops="native").model.model.layers)
        assert stack.why_not(w8) is None
        w8[1].self_attn.o_proj.choice = KernelChoice(PORTABLE, None, "portable", "test")
        assert stack.why_not(w8) == "model.layers.1.o_proj runs W4A8 on portable, not edgeq's native op"
    torch_ops = load(tiny["prose"], kv_cache_bytes="1MiB", decode_ops="torch")
    assert torch_ops.settings.decode_ops_reason == "requested (decode_ops=torch)"  # no layer phrase off the native ops
    assert torch_ops.settings.decode_layers == "n/a"
    assert torch_ops.decoder.stack is None  # its buffers are allocated with the native ops' only
    torch_ops.decoder.ops = "native"  # switched (benchmarks do): built then
    assert torch_ops.decoder.native_layers and torch_ops.decoder.owned_bytes > torch_ops.settings.lean_bytes


def test_a_runtime_switched_to_aten_falls_back_to_the_python_step(ready, tiny, monkeypatch):
    lm = load(tiny["prose"], kv_cache_bytes="1MiB", decode_ops="native")
    tokens = [9, 41, 200]
    want = _decode(lm, tokens, True)[0]
    monkeypatch.setattr(native, "decode_layers", lambda *a, **k: pytest.fail("decode_layers called"))
    rt = lm.runtime
    saved, rt.native = rt.native, None
    try:
        assert not lm.decoder.stack.usable
        logits, _, counts, _ = _decode(lm, tokens, True)
        assert set(counts) == {"tinygemm_decode"}
        # aten's op instead of edgeq's kernel: the same logits within the kernels' rounding
        assert float((logits.float() - want.float()).abs().max()) <= 2**-5 * float(want.float().abs().max())
    finally:
        rt.native = saved
    lm1 = load(tiny["prose"], kv_cache_bytes="1MiB", decode_ops="native", prefill_threshold=1)
    assert not lm1.decoder.stack.usable  # one row at the crossover: the dequant path, from Python


def _args(lm):
    st = lm.decoder.stack
    d = lm.decoder
    return [d.x, d.n, list(st.weights), list(st.group_sizes), list(st.biases), list(st.norms), list(st.eps),
            list(st.caches), list(st.scales), list(st.windows), d.cos_p, d.nsin_p, 3, list(st.scratch)]


@pytest.mark.parametrize("bad, message", [
    (lambda a: a[2].pop(), "for 4 layers expected 56 weights"),
    (lambda a: a.__setitem__(12, 10_000), "pos 10000, cache of"),
    (lambda a: a[3].__setitem__(0, 48), "layer 0 matrix 0: group size 48"),
    (lambda a: a[13].__setitem__(6, torch.empty(1, 5, dtype=torch.bfloat16)), "gate scratch"),
    (lambda a: a[5].__setitem__(1, torch.empty(3, dtype=torch.bfloat16)), "layer 0 post-attention norm weight"),
    (lambda a: a[7].__setitem__(3, a[7][3].float()), "layer 1 cache 1: expected contiguous bf16"),
])
def test_bad_arguments_raise_edgeq_error_before_writing(ready, tiny, bad, message):
    lm = load(tiny["prose"], kv_cache_bytes="1MiB", decode_ops="native")
    lm.cache.reset()
    lm.forward(torch.tensor([PROMPT]), logits_to_keep=1)
    args = _args(lm)
    bad(args)
    x_before = lm.decoder.x.view(torch.int16).clone()
    cache_before = [c.keys.view(torch.int16).clone() for c in lm.cache.layers]  # bits: unused rows may be NaN
    with pytest.raises(EdgeqError, match=message):
        native.decode_layers(*args)
    assert torch.equal(lm.decoder.x.view(torch.int16), x_before)
    assert all(torch.equal(c.keys.view(torch.int16), b) for c, b in zip(lm.cache.layers, cache_before))


def test_an_act_order_head_reads_this_steps_norm(ready, tiny, tmp_path):
    """The native ops write the final norm's output in place through raw pointers, which torch's version counter does
    not see; an act-order head gathers its input keyed on that counter (Runtime.gather), so the step bumps it: every
    step's logits are the head of that step's norm, not a stale gather of the previous one."""
    import shutil

    from helpers.perm import permute

    ckpt = tmp_path / "head-perm"
    shutil.copytree(tiny["qwen2"], ckpt)
    permute(ckpt, torch.randperm(128, generator=torch.Generator().manual_seed(2)), modules=["lm_head"])
    lm = load(ckpt, kv_cache_bytes="1MiB", decode_ops="native")
    dec = lm.decoder
    assert dec.stack is not None and lm.model.lm_head.perm is not None
    for one_call in (True, False):
        dec.native_layers = one_call
        lm.cache.reset()
        lm.forward(torch.tensor([PROMPT]), logits_to_keep=1)
        steps = [(lm.decode_step(t).reshape(-1).clone(), dec.n.clone()) for t in (11, 250, 37)]
        for logits, n in steps:  # after the steps: a gather here would refresh the head's cached one
            assert torch.equal(logits, dec.head.fn(n).reshape(-1))


def test_skip_bits_leave_out_ops_for_benchmarks(ready, tiny):
    """The benchmarks' ablations inside the call: 7 runs the matmuls alone (the residual and the cache stay as they
    were); 1 (no attention) changes the logits; 0 is the normal step."""
    lm = load(tiny["prose"], kv_cache_bytes="1MiB", decode_ops="native")
    dec = lm.decoder
    want = _decode(lm, [9, 41], True)[0]
    lm.cache.reset()
    lm.forward(torch.tensor([PROMPT]), logits_to_keep=1)
    x = dec.x.view(torch.int16).clone()
    cache = [torch.cat([c.keys, c.values]).view(torch.int16).clone() for c in lm.cache.layers]
    dec.stack.skip = 7
    try:
        dec.stack(len(PROMPT))
        assert torch.equal(dec.x.view(torch.int16), x)
        assert all(torch.equal(torch.cat([c.keys, c.values]).view(torch.int16), b) for c, b in zip(lm.cache.layers, cache))
        dec.stack.skip = 1
        assert not torch.equal(_decode(lm, [9, 41], True)[0], want)
    finally:
        dec.stack.skip = 0
    assert torch.equal(_decode(lm, [9, 41], True)[0], want)
