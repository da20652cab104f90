"""Runtime: loading (zero-copy, layouts, refusals), both compute paths against a dequantised bf16 reference on every
supported architecture, the KV budget, the crossover probe, generation. Tolerances are stated where they are used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.runtime import LayoutRepackWarning, SamplingParams, generate, load, parse_bytes, repack
from edgeq.cli.generate import generate_command
from edgeq.runtime.embedding import PackedEmbedding
from edgeq.runtime.generation import Generation, encode_prompt
from helpers.checkpoints import (adjacent_layout, avx2_like_layout, foreign_layout, prose_checkpoint, quantize,
                                 synthetic_checkpoint, write_reference)
from helpers.models import ARCHS, save_hf, tiny_model
from helpers.paths import FIXTURE

ROOT = Path(__file__).resolve().parents[1]
# Relative to the largest |logit| of the reference. Prefill: the dequant path feeds the bf16 GEMM exactly the
# reference's bf16 weights (observed difference 0). Decode: the int4 kernel accumulates in fp32 while the reference
# bf16 GEMM rounds differently; observed <= 1.1% on these models, the same size as bf16 decode-vs-prefill noise.
PREFILL_TOL = 0.01
DECODE_TOL = 0.03


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{arch: (edgeq dir, reference dir)} through the real quantize pipeline (minmax, g32)."""
    root = tmp_path_factory.mktemp("arch")
    out = {}
    for arch in ARCHS:
        hf = save_hf(tiny_model(arch), root / f"{arch}-hf")
        q = quantize(hf, root / f"{arch}-q")
        out[arch] = (q, write_reference(q, root / f"{arch}-ref"))
    return out


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    return prose_checkpoint(tmp_path_factory)


def _decode(lm, ids, split):
    lm.cache.reset()
    lm.forward(ids[:, :split])
    return torch.cat([lm.forward(ids[:, i : i + 1]) for i in range(split, ids.shape[1])], dim=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_dequantised_reference(ckpts, arch):
    q, ref_dir = ckpts[arch]
    lm = load(q, prefill_threshold=16, kv_cache_bytes="1MiB")
    ref = load(ref_dir, kv_cache_bytes="1MiB")
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(1))  # > Gemma-2's window of 48
    want = ref.forward(ids)
    lm.cache.reset()
    got = lm.forward(ids)
    assert lm.path_counts["dequant_prefill"] > 0 and ref.path_counts["bf16"] > 0
    assert rel_err(got, want) <= PREFILL_TOL
    want_dec = _decode(ref, ids, 58)
    lm.reset_counts()
    got_dec = _decode(lm, ids, 58)
    assert lm.path_counts[lm.runtime.decode_path] > 0
    assert rel_err(got_dec, want_dec) <= DECODE_TOL
    if lm.runtime.native is not None:  # the aten kernel path too, when the native one is the default
        lm.runtime.native = None
        lm.reset_counts()
        assert rel_err(_decode(lm, ids, 58), want_dec) <= DECODE_TOL
        assert lm.path_counts["tinygemm_decode"] > 0
    # the two paths over the same packed bytes agree on the whole sequence
    lm.runtime.prefill_threshold = 1
    lm.cache.reset()
    all_dequant = lm.forward(ids)
    lm.runtime.prefill_threshold = 10**9
    lm.cache.reset()
    all_kernel = lm.forward(ids)
    assert rel_err(all_kernel, all_dequant) <= DECODE_TOL


def test_settings_read_back_and_untied_head(ckpts):
    q, _ = ckpts["gemma2"]
    lm = load(q, prefill_threshold=7, kv_cache_bytes="64KiB")
    s = lm.settings
    assert s.quantized and s.scheme == "w4a16-g32" and s.prefill_crossover == 7 and s.crossover_source == "override"
    assert s.layout == "native" and s.copied_bytes == 0 and s.threads == torch.get_num_threads()
    assert getattr(lm.model.lm_head, "edgeq_quantized", False)  # Gemma-2's tied head runs as its own int4 tensor
    # the default packed table (issue 16) reads the head's own mapped int4 tensors as its level 0 (shared, not a
    # copy) plus its own residual level
    emb = lm.model.model.embed_tokens
    assert isinstance(emb, PackedEmbedding) and emb.levels[0].qweight is lm.model.lm_head.qweight
    assert emb.levels[1].qweight.data_ptr() != lm.model.lm_head.qweight.data_ptr()
    # nothing quantised is a plain Linear any more
    assert not [n for n, m in lm.model.named_modules() if isinstance(m, torch.nn.Linear)]


def test_kv_budget_is_exact_and_enforced(ckpts):
    q, _ = ckpts["llama"]
    per_token = 2 * 2 * 2 * 32 * 2  # layers * (k, v) * kv heads * head_dim * bf16
    budget = 150 * per_token + per_token - 1
    lm = load(q, kv_cache_bytes=budget, prefill_threshold=16)
    allocated = sum(t.numel() * t.element_size() for layer in lm.cache.layers for t in (layer.keys, layer.values))
    assert allocated == lm.settings.kv_cache_bytes == 150 * per_token
    assert 0 <= budget - allocated < per_token
    assert lm.settings.max_cached_tokens == 150 and lm.settings.max_model_len == 150  # budget < model max (256)
    lm.forward(torch.ones(1, 150, dtype=torch.long))
    with pytest.raises(EdgeqError, match="needs 151 tokens of KV cache but it holds 150"):
        lm.forward(torch.ones(1, 1, dtype=torch.long))
    assert lm.cache.layers[0].keys.shape[2] == 150  # never reallocated
    # max_model_len below the budget allocates only what it can use; above the budget or the model is refused
    small = load(q, kv_cache_bytes="1MiB", max_model_len=64, prefill_threshold=16)
    assert small.settings.max_cached_tokens == 64 and small.settings.kv_cache_bytes == 64 * per_token
    assert load(q, kv_cache_bytes="1GiB", prefill_threshold=16).settings.max_model_len == 256
    with pytest.raises(EdgeqError, match="raise --kv-cache-bytes"):
        load(q, kv_cache_bytes=budget, max_model_len=200)
    with pytest.raises(EdgeqError, match="exceeds the model's maximum of 256"):
        load(q, max_model_len=300)


def _edit(src: Path, dst: Path, fn) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "edgeq_manifest.json").read_text())
    config = json.loads((dst / "config.json").read_text())
    fn(manifest, config)
    (dst / "edgeq_manifest.json").write_text(json.dumps(manifest))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda m, c: (m.update(format_version=3), c["quantization_config"].update(format_version=3)), "format_version 3"),
    (lambda m, c: m.update(kernel="amx_w4a8"), "config.json says kernel 'tinygemm_w4a16' but edgeq_manifest.json says 'amx_w4a8'"),
    (lambda m, c: m["layout"].update(layout_hash="0" * 64), "layout_hash does not match its permutations"),
    (lambda m, c: m["layout"].update(perms={"64": [0] * 64}), "layout_hash does not match|not a permutation"),
    (lambda m, c: m["layout"].pop("block_n"), "malformed"),
    (lambda m, c: c["quantization_config"]["layout"].update(layout_hash="f" * 64), "differs from the manifest"),
    (lambda m, c: c["quantization_config"].update(quant_method="gptq"), "quant_method 'gptq' is not edgeq's"),
    (lambda m, c: m["head"].update(quantized=False), "head 'lm_head' is not recorded as quantised"),
    (lambda m, c: m["quantized_modules"].append("model.layers.9.mlp.up_proj"), "has no such module"),
])
def test_refuses_what_it_does_not_understand(ckpts, tmp_path, edit, message):
    bad = _edit(ckpts["llama"][0], tmp_path / "bad", edit)
    with pytest.raises(EdgeqError, match=message):
        load(bad, prefill_threshold=16)


def test_foreign_layout_is_repacked_with_warning_or_refused(ckpts, tmp_path):
    q, _ = ckpts["qwen2"]
    foreign = tmp_path / "avx2"
    # valid bytes of another machine + a consistent manifest: AVX2-style, or 64-row adjacent blocks where AVX2's is
    # this machine's own layout (ATEN_CPU_CAPABILITY=avx2)
    layout = foreign_layout()
    report = repack(q, foreign, layout=layout)
    # 7 linears a layer x 2 layers, the head, and the packed table's two levels (Qwen2 here is untied:
    # model.embed_tokens at the head's G + model.embed_tokens.residual)
    assert report.changed and report.tensors == 2 * 7 + 1 + 2
    meta = json.loads((foreign / "edgeq_manifest.json").read_text())
    assert meta["layout"]["block_n"] == layout.block_n
    with pytest.raises(EdgeqError, match="run `edgeq repack`"):
        load(foreign, strict_layout=True)
    with pytest.warns(LayoutRepackWarning, match=r"REPACKED IN MEMORY.*took [\d.]+ s and .*bytes"):
        lm = load(foreign, prefill_threshold=16)
    assert lm.settings.layout == "repacked" and lm.settings.copied_bytes > 0
    native = load(q, prefill_threshold=16)
    ids = torch.arange(3, 40)[None]
    assert torch.equal(lm.forward(ids), native.forward(ids))
    # and repack() on disk makes it this machine's again: no warning
    repack(foreign)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutRepackWarning)
        again = load(foreign, strict_layout=True, prefill_threshold=16)
    assert again.settings.layout == "native"
    assert not list(tmp_path.glob(".avx2.edgeq-*"))  # no temporary directories left behind


@pytest.mark.skipif(tinygemm.probe().block_n == 32, reason="this machine already packs in 32-row blocks")
@pytest.mark.slow
def test_checkpoint_packed_under_avx2_elsewhere(ckpts, tmp_path):
    """Quantise in a child process that dispatches to AVX2 (another machine, as far as the layout goes)."""
    hf = save_hf(tiny_model("llama"), tmp_path / "hf")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})
        from helpers.checkpoints import quantize
        from pathlib import Path
        quantize(Path({str(hf)!r}), Path({str(tmp_path / 'q-avx2')!r}))
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)
    fp = json.loads((tmp_path / "q-avx2" / "config.json").read_text())["quantization_config"]["layout"]
    assert fp["block_n"] == 32 and fp["layout_hash"] != tinygemm.probe().layout_hash
    with pytest.raises(EdgeqError, match="packed for layout"):
        load(tmp_path / "q-avx2", strict_layout=True)
    with pytest.warns(LayoutRepackWarning):
        lm = load(tmp_path / "q-avx2", prefill_threshold=16)
    here = load(ckpts["llama"][0], prefill_threshold=16)  # the same model quantised here: the same q values
    ids = torch.arange(3, 30)[None]
    assert torch.equal(lm.forward(ids), here.forward(ids))


_MEMORY_CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
def status():
    d = {{}}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile"):
            d[k] = int(v.split()[0]) * 1024
    return d
import transformers.models.llama.modeling_llama  # imports are not the model
from edgeq.runtime import load
from edgeq.layouts import tinygemm
tinygemm.probe()
before = status()
lm = load({path!r}, kv_cache_bytes={kv}, prefill_threshold=10**6)
loaded = status()
lm.forward(torch.arange(1, 5)[None])  # decode path: the kernel reads every packed byte
after = status()
print(json.dumps({{"before": before, "loaded": loaded, "after": after, "kv": lm.settings.kv_cache_bytes,
                  "scratch": lm.settings.scratch_bytes, "mapped": lm.settings.mapped_bytes}}))
"""


@pytest.mark.slow
def test_packed_bytes_are_mapped_not_copied(tmp_path):
    sizes = synthetic_checkpoint(tmp_path / "syn")  # ~106 MB packed with scales, 34 MB of bf16 embedding
    kv = 16 << 20
    code = _MEMORY_CHILD.format(tests=str(ROOT / "tests"), path=str(tmp_path / "syn"), kv=kv)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    slack = 48 << 20  # Python objects of the model, transformers' per-call buffers, allocator slack
    anon_growth = r["after"]["RssAnon"] - r["before"]["RssAnon"]
    assert anon_growth <= sizes["unquantized"] + r["kv"] + r["scratch"] + slack, r
    assert anon_growth < sizes["packed"] - slack, r  # a copy of the packed bytes could not fit under the bound
    file_growth = r["after"]["RssFile"] - r["before"]["RssFile"]
    assert file_growth >= 0.9 * sizes["packed"], r  # the packed bytes are resident as file pages
    assert r["mapped"] == sizes["packed"] + sizes["unquantized"]


def test_crossover_is_measured_then_cached(ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path))
    q, _ = ckpts["llama"]
    first = load(q, kv_cache_bytes="1MiB")
    from edgeq.runtime.crossover import NEVER
    x = first.settings.prefill_crossover  # measured: an M in [2, 1024], or NEVER where the kernel wins at every M
    assert first.settings.crossover_source == "measured" and (2 <= x <= 1024 or x == NEVER), x
    assert not first.path_counts  # the probe's calls are not counted as the model's
    table = json.loads((tmp_path / "crossover.json").read_text())
    assert list(table.values()) == [first.settings.prefill_crossover]
    assert "N=352|K=128|G=32" in next(iter(table))
    second = load(q, kv_cache_bytes="1MiB")
    assert second.settings.crossover_source == "cached"
    assert second.settings.prefill_crossover == first.settings.prefill_crossover


@pytest.fixture(scope="module")
def prose_reference(prose, tmp_path_factory):
    return write_reference(prose, tmp_path_factory.mktemp("prose-ref") / "ref")


# A greedy token's logit under the bf16 reference may fall short of that step's maximum by this much of the step's
# largest |logit| (kernel rounding at a near-tie; observed <= 0.52% on the fixture on Zen 4, while the median gap
# between the two most likely tokens is 3.5%, so a token that is not a near-tie winner fails).
GREEDY_TOL = 0.015


def assert_near_greedy(ref, prompt_ids: list[int], token_ids: list[int]) -> None:
    """Each generated token's logit under the bf16 reference (teacher-forced on prompt + generated) is within
    GREEDY_TOL x the largest |logit| of that step's maximum: greedy up to kernel rounding."""
    logits = ref.forward(torch.tensor([prompt_ids + token_ids]), use_cache=False)[0].float()
    steps = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(token_ids)]
    chosen = steps.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    slack = steps.max(dim=1).values - chosen
    assert bool((slack <= GREEDY_TOL * steps.abs().max(dim=1).values).all()), slack.tolist()


def test_greedy_generation_is_deterministic(prose, prose_reference):
    # No pinned ids: the prefill GEMM (oneDNN: AMX tiles, AVX512-BF16, AVX2) and the decode kernel round differently
    # per ISA and greedy decoding meets near-ties on this fixture, so a recorded sequence only holds on the machine
    # class and code it came from (one recorded on an AMX host in session 2 stopped matching there by session 28).
    # Every machine checks the machine-independent property instead: deterministic, and each greedy token is the
    # reference's argmax up to GREEDY_TOL.
    lm = load(prose, prefill_threshold=4, prefill_attn="sdpa")
    ref = load(prose_reference, prefill_attn="sdpa")
    prompt_ids = encode_prompt(lm, "Once upon a time", chat=False)
    paths = ["native_decode", "tinygemm_decode"] if lm.runtime.native is not None else ["tinygemm_decode"]
    for path in paths:
        lm.runtime.native = lm.runtime.native if path == "native_decode" else None
        lm.reset_counts()
        a = generate(lm, "Once upon a time", SamplingParams(max_tokens=24))
        b = generate(lm, "Once upon a time", SamplingParams(max_tokens=24))
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == "length"
        assert_near_greedy(ref, prompt_ids, a.token_ids)
        assert a.text == lm.tokenizer.decode(a.token_ids, skip_special_tokens=True)
        assert a.prefill_tokens_per_s > 0 and a.decode_tokens_per_s > 0
        assert lm.path_counts["dequant_prefill"] > 0 and lm.path_counts[path] > 0


def test_sampling_stop_strings_streaming_and_logprobs(prose):
    lm = load(prose, prefill_threshold=4)
    greedy = generate(lm, "The", SamplingParams(max_tokens=16, logprobs=3))
    for lp in greedy.logprobs:  # greedy picks a most likely token (ties happen); logprobs are the model's own
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.token_id in [t for t, v in lp.top if v == lp.top[0][1]]
    assert len(greedy.logprobs) == len(greedy.token_ids)
    tiny_p = generate(lm, "The", SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, seed=5))
    assert tiny_p.token_ids == greedy.token_ids  # top-p that keeps one token is greedy
    s1 = generate(lm, "The", SamplingParams(max_tokens=16, temperature=1.0, seed=1))
    s1b = generate(lm, "The", SamplingParams(max_tokens=16, temperature=1.0, seed=1))
    s2 = generate(lm, "The", SamplingParams(max_tokens=16, temperature=1.0, seed=2))
    assert s1.token_ids == s1b.token_ids and s1.token_ids != s2.token_ids
    # a stop string taken from the greedy text cuts it there, and streaming never shows it
    stop = greedy.text[5:8]
    g = Generation(lm, encode_prompt(lm, "The", chat=False), SamplingParams(max_tokens=16, stop=(stop,)))
    streamed = "".join(d.text for d in g)
    assert g.result.finish_reason == "stop" and g.result.text == greedy.text[: greedy.text.find(stop)]
    assert streamed == g.result.text
    with pytest.raises(EdgeqError, match="needs 1030 tokens"):
        Generation(lm, [5] * 30, SamplingParams(max_tokens=1000))


def test_generate_command_streams_and_reports(prose, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path))  # its crossover probe must not write to ~/.cache
    generate_command(str(prose), "Once upon a time", max_tokens=8)
    out = capsys.readouterr()
    assert out.out.strip() and "tok/s" in out.err and "decode" in out.err
    with pytest.raises(EdgeqError, match="no chat template"):
        generate_command(str(prose), "hi", chat=True)


def test_bf16_reference_loads_mapped_and_tied():
    from transformers import AutoModelForCausalLM

    lm = load(FIXTURE, prefill_attn="sdpa")  # transformers' own attention: the forward is transformers' bit for bit
    assert not lm.settings.quantized and lm.settings.copied_bytes == 0 and lm.settings.decode_path == "bf16"
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()  # tied, one copy
    hf = AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.bfloat16).eval()
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        assert torch.equal(lm.forward(ids, use_cache=False), hf(ids).logits)


@pytest.mark.parametrize("text, value", [("256MiB", 256 << 20), ("1.5GiB", 3 << 29), ("500MB", 500_000_000),
                                         ("4096", 4096), ("64k", 65536), (123, 123)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "12 parsecs", "-5", "MiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(EdgeqError, match="byte size"):
        parse_bytes(text)


def _odd_layout() -> tinygemm.TinygemmLayout:  # a permutation neither "halves" nor "adjacent": the general unpack
    return tinygemm.TinygemmLayout(block_n=32, perms=((16, tuple(range(16))), (32, tuple(reversed(range(32))))))


@pytest.mark.parametrize("layout_fn", [tinygemm.probe, avx2_like_layout, lambda: adjacent_layout(32), _odd_layout],
                         ids=["here", "avx2-halves", "adjacent", "general"])
def test_prefill_dequant_is_exact_for_every_layout_kind(layout_fn):
    from edgeq.runtime.qlinear import Int4Linear, Runtime, scratch_for

    layout = layout_fn()
    gen = torch.Generator().manual_seed(3)
    n, k, g = 3 * layout.block_n + 16, 256, 64  # full blocks and a 16-row tail
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    sz = (torch.randn(k // g, n, 2, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    rt = Runtime(layout=layout, prefill_threshold=1)
    lin = Int4Linear("t", tinygemm.pack(q, layout), sz, g, bias, rt)
    lin._rows = lin._rows if layout.block_n == 64 else 64  # several row blocks, so the scratch is reused
    from edgeq.runtime.qlinear import _ranges, _nibble_order
    lin._ranges = _ranges(n, lin._rows, layout.block_n if _nibble_order(layout) else None)
    rt.scratch = scratch_for([lin])
    w = tinygemm.dequantize(q, sz, g, torch.bfloat16)
    got = torch.cat([lin.dequantize_rows_t(a, b, rt.scratch).t().clone() for a, b in lin._ranges])  # one shared scratch
    assert torch.equal(got, w)  # bit for bit the reference dequantisation
    x = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    assert rel_err(lin(x), torch.nn.functional.linear(x, w, bias)) <= PREFILL_TOL
    assert rt.counts["dequant_prefill"] == 1


def _linear_times(kernel, dequant, calls=None):
    """A timing model for crossover.solve: t(M) = a + b * M per path, optionally with a per-path override."""
    def time_at(path, m):
        if calls is not None:
            calls.append((path, m))
        a, b = kernel if path == "kernel" else dequant
        return a(m) if callable(a) else a + b * m
    return time_at


def test_crossover_solve_meets_the_lines_and_checks_an_extrapolation():
    from edgeq.runtime import crossover

    # the docstring's worked example: lines meet at 22.5 -> 22, inside the timed range, so no check is made
    calls = []
    assert crossover.solve(_linear_times((0.10, 0.050), (1.00, 0.010), calls)) == 22
    assert {m for _, m in calls} == {crossover.M_SMALL, crossover.M_LARGE}
    # the kernel is never slower per row and faster at M = 0: never the dequantise path (an AVX2-only CPU, where the
    # bf16 GEMM is ~100x the kernel's time); slower at M = 0 but not per row: up to the probe's ceiling
    assert crossover.solve(_linear_times((0.10, 0.010), (1.00, 0.010))) == crossover.NEVER
    assert crossover.solve(_linear_times((0.10, 0.010), (1.00, 0.500))) == crossover.NEVER
    assert crossover.solve(_linear_times((1.00, 0.010), (0.10, 0.010))) == crossover.HIGH
    assert crossover.describe(crossover.NEVER) == "never" and crossover.describe(512) == "M >= 512"
    assert crossover.phrase(512) == "at M >= 512" and crossover.phrase(None) == ""
    assert crossover.phrase(crossover.NEVER) == "never (the kernel runs every prefill)"
    # lines meet at 450 (beyond M_LARGE = 64), but the kernel's per-row cost falls at large M (it tiles x): it still
    # wins at 450 (4.24 vs 6.17 ms), not at 900 (8.29 vs 7.97), so the crossover is 900, every claim beyond M_LARGE timed
    kernel = (lambda m: 0.0 + 0.012 * m if m <= 64 else 0.768 + 0.009 * (m - 64), None)
    dequant = (lambda m: 4.5 + 0.002 * m if m <= 64 else 4.628 + 0.004 * (m - 64), None)
    calls = []
    assert crossover.solve(_linear_times(kernel, dequant, calls)) == 900
    assert {m for _, m in calls} == {8, 64, 450, 900}
    # where the dequant path really wins at the extrapolated M, the line estimate stands
    assert crossover.solve(_linear_times((0.0, 0.012), (4.5, 0.002))) == 450
    # lines meeting beyond HIGH are checked at HIGH: a kernel still faster there runs every prefill (AMX's folded
    # prefill: HIGH sent 1024+ token prompts to a path 1.11x slower), one slower there keeps HIGH
    calls = []
    assert crossover.solve(_linear_times((0.0, 0.0100), (2.0, 0.0095), calls)) == crossover.NEVER
    assert ("kernel", crossover.HIGH) in calls and ("dequant", crossover.HIGH) in calls
    kernel = (lambda m: 0.010 * m if m < crossover.HIGH else 12.0, None)  # slower than its line at HIGH
    assert crossover.solve(_linear_times(kernel, (2.0, 0.0095))) == crossover.HIGH
