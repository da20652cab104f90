"""`edgeq quantize --head-levels 2`: the output head of a tied model with packed embeddings also sums the table's
residual level, logits = x @ (D0 + D1)^T, at no extra bytes (docs/format.md, "Head levels").

The runtime computes ``y = bf16(float32(path(x, level 0)) + float32(path(x, level 1)))`` (+ bias once), each level
through the path its M selects; against the fp64 reference ``x @ (D0 + D1)^T`` the stated bound is
``|y - ref| <= 2^-7 * (|x| @ |D0|^T + |x| @ |D1|^T)`` elementwise (edgeq/runtime/qlinear.py, Int4Linear).
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from edgeq.convert.pipeline import convert
from edgeq.errors import EdgeqError
from edgeq.io.manifest import Manifest
from edgeq.io.mapped import MappedFiles
from edgeq.layouts import tinygemm as tg
from edgeq.runtime import generate_ids, load, repack
from edgeq.runtime.embedding import PackedEmbedding
from edgeq.runtime.qlinear import Int4Linear, make_runtime, scratch_for
from helpers.checkpoints import dir_digest, foreign_layout
from helpers.cli import run_cli
from helpers.embeddings import TABLE, dequantized_level, reference_table
from helpers.mapping import greedy_both_loops
from helpers.models import save_tiny
from helpers.paths import FIXTURE

LEVELS = [{"module": "lm_head", "group_size": 32}, {"module": TABLE, "group_size": 128}]  # the llama recipe's


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[int, Path]:
    """{1: the bundled model, --embeddings packed (minmax: fast), 2: the same with --head-levels 2}."""
    root = tmp_path_factory.mktemp("hl")
    out = {}
    for n in (1, 2):
        out[n] = root / f"h{n}"
        convert(FIXTURE, out[n], method="minmax", embeddings="packed", head_levels=n if n == 2 else None)
    return out


def _manifest(path: Path) -> dict:
    return json.loads((path / "edgeq_manifest.json").read_text())


# --- the math, on hand-made modules ------------------------------------------------------------------------------


def _level(n: int, k: int, g: int, seed: int, runtime, bias=None, name="m") -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    sz = (torch.randn(k // g, n, 2, generator=gen) * torch.tensor([0.02, 0.1])).to(torch.bfloat16)
    return Int4Linear(name, tg.pack(q, runtime.layout), sz, g, bias, runtime)


def _d(lin: Int4Linear) -> torch.Tensor:
    """The level's D (fp32 [N, K]) by the contract, from the layout's unpack (not the module's paths)."""
    q = tg.unpack(lin.qweight, lin.out_features, lin.in_features, lin.runtime.layout)
    return tg.dequantize(q, lin.scales_and_zeros, lin.group_size, torch.float32)


def _bound(x: torch.Tensor, ds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ref = x @ (D0 + D1)^T in fp64, the stated tolerance 2^-7 * sum_l |x| @ |D_l|^T)."""
    xd = x.double()
    ref = xd @ sum(d.double() for d in ds).T
    tol = sum(xd.abs() @ d.double().abs().T for d in ds) * 2.0**-7
    return ref, tol


@pytest.mark.parametrize("m", [1, 3, 16])  # the kernel below the crossover (8), the dequant path at and above it
def test_two_levels_within_the_stated_bound(m):
    rt = make_runtime(Counter())
    n, k = 80, 256  # a tail block under both block sizes
    head, res = _level(n, k, 32, 1, rt, name="lm_head"), _level(n, k, 128, 2, rt, name=TABLE)
    head.residual_levels = (res,)
    rt.scratch, rt.prefill_threshold = scratch_for([head]), 8
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(torch.bfloat16)
    y = head.linear2d(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref, tol = _bound(x, [_d(head), _d(res)])
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), float((err / tol).max())
    level0 = _without_levels(head).linear2d(x)  # the head alone misses D1: outside the bound
    err0 = (level0.double() - ref).abs()
    assert (err0 > tol).any() and err.norm() < 0.1 * err0.norm()
    # exactly the formula: each level's own path, fp32 sum, one rounding
    want = (res.linear2d(x).float() + _without_levels(head).linear2d(x).float()).to(torch.bfloat16)
    assert torch.equal(y, want)
    path = "dequant_prefill" if m >= 8 else rt.decode_path
    assert rt.counts[path] >= 2


def _without_levels(head: Int4Linear) -> Int4Linear:
    """The same level-0 tensors as a plain one-level module."""
    return Int4Linear(head.name, head.qweight, head.scales_and_zeros, head.group_size, head.bias, head.runtime)


@pytest.mark.parametrize("m", [1, 16])
def test_the_bias_is_added_once(m):
    rt = make_runtime(Counter())
    n, k = 64, 128
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with_b, without_b = _level(n, k, 32, 1, rt, bias=bias), _level(n, k, 32, 1, rt)
    for h in (with_b, without_b):
        h.residual_levels = (_level(n, k, 64, 2, rt, name=TABLE),)
    rt.scratch, rt.prefill_threshold = scratch_for([with_b]), 8
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    assert torch.equal(with_b.linear2d(x), without_b.linear2d(x) + bias)  # after the levels' sum, one bf16 add


@pytest.mark.parametrize("m", [1, 8])
def test_worked_example(m):
    """x = e_0; D0 = (11 - 8) * 0.25 + 0.5 = 1.25, D1 = (6 - 8) * 2^-7 = -0.015625: y = bf16(1.234375) exactly."""
    rt = make_runtime(Counter())
    n, k = 16, 64

    def level(q, scale, zero, g, name):
        sz = torch.tensor([scale, zero], dtype=torch.bfloat16).expand(k // g, n, 2).contiguous()
        return Int4Linear(name, tg.pack(torch.full((n, k), q, dtype=torch.uint8), rt.layout), sz, g, None, rt)

    head = level(11, 0.25, 0.5, 32, "lm_head")
    head.residual_levels = (level(6, 0.0078125, 0.0, 64, TABLE),)
    rt.scratch, rt.prefill_threshold = scratch_for([head]), 8
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    x[:, 0] = 1
    assert torch.equal(head.linear2d(x), torch.full((m, n), 1.234375, dtype=torch.bfloat16))
    assert head.scratch_elems >= head.residual_levels[0].scratch_elems


# --- the CLI and the record --------------------------------------------------------------------------------------


def test_cli_writes_the_record_and_nothing_else(ckpts, tmp_path, capsys):
    out = tmp_path / "h2"
    code, stdout, err = run_cli(["quantize", FIXTURE, "-o", out, "-q", "--method", "minmax", "--embeddings", "packed",
                                 "--head-levels", "2"], capsys)
    assert code == 0, err
    assert "head levels 2 (the head adds the residual g128: logits = x @ (D0 + D1)^T)" in stdout
    m1, m2 = _manifest(ckpts[1]), _manifest(out)
    assert m2["head"]["levels"] == LEVELS == m2["embeddings"][TABLE]["levels"] and "levels" not in m1["head"]
    del m2["head"]["levels"]
    assert m1 == m2  # the record is the only change: no tensor, shard or layout differs
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (ckpts[1] / name).read_bytes(), name
    card = (out / "README.md").read_text()
    assert f"2 levels: logits = x @ (D0 + D1)^T, its own tensors + the embedding's residual level `{TABLE}` g128" in card
    assert "2 levels" not in (ckpts[1] / "README.md").read_text()
    one = tmp_path / "h1"  # --head-levels 1 is the checkpoint as before: the same bytes as without the flag
    code, _, err = run_cli(["quantize", FIXTURE, "-o", one, "-q", "--method", "minmax", "--embeddings", "packed",
                            "--head-levels", "1"], capsys)
    assert code == 0, err
    assert dir_digest(one) == dir_digest(ckpts[1])
    code, stdout, _ = run_cli(["quantize", FIXTURE, "--dry-run", "--json", "--embeddings", "packed", "--head-levels",
                               "2"], capsys)
    assert code == 0 and json.loads(stdout)["embeddings"]["head_levels"] == 2


@pytest.mark.parametrize("args, message", [
    (["--embeddings", "bf16"], "--head-levels 2: the embedding table is bf16, and the second level is a packed table's residual; add "
         "--embeddings packed, or use --head-levels 1"),
    (["--embeddings", "packed", "--method", "gptq", "--act-order"],
     "--head-levels 2: the head must be the packed table's level 0, and the head is written with an act-order "
     "permutation (--act-order); use --head-levels 1"),
    (["--embeddings", "packed", "--head-levels", "3"], "--head-levels 3: valid: 1 (the head's own tensors), 2"),
])
def test_cli_refuses(tmp_path, capsys, args, message):
    out = tmp_path / "o"
    code, stdout, err = run_cli(["quantize", FIXTURE, "-o", out, "-q", "--head-levels", "2", *args], capsys)
    assert code == 2 and stdout == "" and not out.exists()
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_refuses_an_untied_head(tmp_path, capsys):
    src = save_tiny("llama", tmp_path / "untied", tied=False)
    code, _, err = run_cli(["quantize", src, "-o", tmp_path / "o", "-q", "--embeddings", "packed", "--head-levels",
                            "2"], capsys)
    assert code == 2 and "--head-levels 2: the head must be the packed table's level 0, and the head has its own " \
        "lm_head.weight (an untied model); use --head-levels 1" in err and len(err.strip().splitlines()) == 1


def test_recipe_key(tmp_path, capsys):
    """A recipe's head_levels = 2 applies where it can (packed table: the default), means 1 where it cannot (bf16
    table)."""
    recipe = tmp_path / "h2.toml"
    recipe.write_text('name = "h2"\nmodel_types = ["llama"]\nhead_levels = 2\n'
                      "group_sizes = { 'lm_head\\.weight$' = 32 }\n")
    code, out, _ = run_cli(["quantize", FIXTURE, "--dry-run", "--json", "--recipe", recipe, "--embeddings", "packed"],
                           capsys)
    assert code == 0 and json.loads(out)["embeddings"]["head_levels"] == 2
    code, out, _ = run_cli(["quantize", FIXTURE, "--dry-run", "--json", "--recipe", recipe], capsys)
    assert code == 0 and json.loads(out)["embeddings"]["head_levels"] == 2  # the default table is packed
    code, out, _ = run_cli(["quantize", FIXTURE, "--dry-run", "--json", "--recipe", recipe, "--embeddings", "bf16"],
                           capsys)
    assert code == 0 and "head_levels" not in json.loads(out)["embeddings"]
    code, out, _ = run_cli(["quantize", FIXTURE, "--dry-run", "--json", "--recipe", recipe, "--embeddings", "packed",
                            "--head-levels", "1"], capsys)
    assert code == 0 and "head_levels" not in json.loads(out)["embeddings"]
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nhead_levels = 3\n')
    code, _, err = run_cli(["quantize", FIXTURE, "--dry-run", "--recipe", bad], capsys)
    assert code == 2 and "head_levels = 3; valid: 1" in err


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["head"]["levels"][1].update(group_size=64), "head.levels = .* must equal model.embed_tokens's packed"),
    (lambda m: m["head"].update(levels=LEVELS[:1]), "must equal"),
    (lambda m: m["head"].update(levels=LEVELS * 2), "must equal"),
    (lambda m: m.update(perm_modules=["lm_head"]), "act-order permutation"),
    (lambda m: (m.pop("embeddings"), m.update(format_version=1)), "only with a packed embedding whose level 0 is the head"),
])
def test_manifest_refuses_a_bad_record(ckpts, edit, message):
    m = _manifest(ckpts[2])
    edit(m)
    with pytest.raises(EdgeqError, match=message) as e:
        Manifest.from_json(m)
    assert "\n" not in str(e.value)


def test_manifest_round_trip(ckpts):
    m2, m1 = _manifest(ckpts[2]), _manifest(ckpts[1])
    assert Manifest.from_json(m2).to_json() == m2 and Manifest.from_json(m1).to_json() == m1
    assert Manifest.from_json(m2).head_levels == [("lm_head", 32), (TABLE, 128)]
    assert Manifest.from_json(m1).head_levels == [("lm_head", 32)]


# --- the runtime ---------------------------------------------------------------------------------------------------


def _reference(path: Path, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ (D0 + D1)^T in fp64, the stated bound) from the checkpoint's files (the layout's unpack, not the runtime)."""
    manifest, files = _manifest(path), MappedFiles(path)
    return _bound(x, [dequantized_level(files, manifest, lv["module"], lv["group_size"]) for lv in LEVELS])


def test_loaded_head_logits(ckpts):
    lm2 = load(ckpts[2], max_model_len=64, prefill_threshold=8)
    lm1 = load(ckpts[1], max_model_len=64, prefill_threshold=8)
    head, emb = lm2.model.lm_head, lm2.model.get_input_embeddings()
    assert lm2.settings.head_levels == 2 and lm1.settings.head_levels == 1 and lm1.model.lm_head.residual_levels == ()
    (res,) = head.residual_levels
    assert isinstance(emb, PackedEmbedding)  # one mapped copy of the residual, shared by both ends
    assert emb.levels[1].qweight is res.qweight and emb.levels[1].scales_and_zeros is res.scales_and_zeros
    assert emb.levels[0].qweight is head.qweight
    assert lm2.settings.mapped_bytes == lm1.settings.mapped_bytes and lm2.settings.copied_bytes == 0
    assert lm2.settings.scratch_bytes == lm1.settings.scratch_bytes
    assert torch.equal(emb(torch.arange(4096)), reference_table(ckpts[2]))  # the input side is unchanged
    for m in (1, 5, 8, 40):  # the kernel below the crossover, the dequant path at and above it
        x = (torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) * 4).to(torch.bfloat16)
        ref, tol = _reference(ckpts[2], x)
        y2, y1 = head.linear2d(x), lm1.model.lm_head.linear2d(x)
        err2, err1 = (y2.double() - ref).abs(), (y1.double() - ref).abs()
        assert (err2 <= tol).all(), (m, float((err2 / tol).max()))
        assert (err1 > tol).any() and err2.norm() < 0.1 * err1.norm(), m  # level 0 alone is far from it


def test_lean_decode_equals_transformers_forward_greedy(ckpts):
    lean, runs = greedy_both_loops(ckpts[2])
    assert runs[0] == runs[1] and len(runs[0][0]) == 32
    assert lean.loop_counts == {"transformers": 1, "lean": 31} and lean.settings.decode_loop == "lean"
    one = load(ckpts[1], prefill_threshold=4, decode_ops="torch", prefill_attn="sdpa")
    one.reset_counts()
    ids1, *_ = generate_ids(one, lean.tokenizer("Once upon a time")["input_ids"], 32)
    path = lean.settings.decode_path  # every token's head (M = 1: the prompt's last row, then each step) runs twice
    assert len(ids1) == 32 and runs[0][1][path] == one.path_counts[path] + 32
    assert runs[0][1]["dequant_prefill"] == one.path_counts["dequant_prefill"]


def test_transformers_generate_equals_edgeq(ckpts):
    from transformers import AutoModelForCausalLM

    from edgeq.runtime import SamplingParams, generate

    model = AutoModelForCausalLM.from_pretrained(str(ckpts[2]))
    (res,) = model.lm_head.residual_levels
    assert model.get_input_embeddings().levels[1].qweight is res.qweight and model.edgeq.swapped.head_levels == 2
    quantized = [n for n, m in model.named_modules() if getattr(m, "edgeq_quantized", False)]
    assert "lm_head" in quantized and TABLE not in quantized  # the level is no child module: one head per probe
    assert not any(n.startswith("lm_head.") for n, _ in model.named_modules())
    lm = load(ckpts[2], decode_ops="torch", prefill_attn="sdpa")
    ids = lm.tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.inference_mode():
        hf = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        logits = model(ids).logits[0, -1]
    out = generate(lm, "Once upon a time", SamplingParams(max_tokens=16))
    # transformers keeps the end-of-sequence id it stopped on; edgeq reports it as finish_reason "stop"
    eos = model.generation_config.eos_token_id
    stopped = [eos if isinstance(eos, int) else eos[0]] if out.finish_reason == "stop" else []
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) >= 8
    assert hf == out.token_ids + stopped
    lm.cache.reset()
    assert torch.equal(logits, lm.forward(ids)[0, -1])


def test_cli_generate_and_inspect(ckpts, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path))
    code, out, err = run_cli(["generate", ckpts[2], "Once upon a time", "--max-tokens", "4", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["settings"]["head_levels"] == 2
    code, _, err = run_cli(["generate", ckpts[2], "Once", "--max-tokens", "2"], capsys)
    assert code == 0 and f"embeddings packed 4-bit (head g32 + {TABLE} g128), head levels 2," in err
    code, _, err = run_cli(["generate", ckpts[1], "Once", "--max-tokens", "2"], capsys)
    assert code == 0 and "head levels" not in err
    code, out, err = run_cli(["inspect", ckpts[2]], capsys)
    assert code == 0, err
    assert f"head quantised (untied from {TABLE}.weight), 2 levels: lm_head g32 + {TABLE} g128" in out
    code, out, _ = run_cli(["inspect", ckpts[2], "--json"], capsys)
    assert json.loads(out)["edgeq"]["head_levels"] == [["lm_head", 32], [TABLE, 128]]
    code, out, _ = run_cli(["inspect", ckpts[1], "--json"], capsys)
    assert json.loads(out)["edgeq"]["head_levels"] == []


def test_foreign_layout_repacks_the_level_with_the_head(ckpts, tmp_path):
    """Packed for another machine: the residual is repacked in memory with the head (the kernel reads only this
    machine's layout) and the lookup shares that copy; logits and E are the native checkpoint's, bit for bit."""
    here = tg.probe()
    other = foreign_layout()
    foreign = tmp_path / "foreign"
    repack(ckpts[2], foreign, layout=other)
    native = load(ckpts[2], max_model_len=64, prefill_threshold=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = load(foreign, max_model_len=64, prefill_threshold=8)
    head, emb = lm.model.lm_head, lm.model.get_input_embeddings()
    (res,) = head.residual_levels
    assert lm.settings.layout == "repacked" and emb.levels[1].qweight is res.qweight and emb.levels[1].layout == here
    quantized = [m for m in lm.model.modules() if getattr(m, "edgeq_quantized", False)]
    assert lm.settings.copied_bytes == sum(m.qweight.numel() for m in quantized) + res.qweight.numel()
    assert torch.equal(emb(torch.arange(4096)), reference_table(ckpts[2]))
    for m in (1, 8):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        assert torch.equal(head.linear2d(x), native.model.lm_head.linear2d(x))
    with pytest.raises(EdgeqError, match="run `edgeq repack` on it"):
        load(foreign, strict_layout=True)


# --- what it buys ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kld_is_lower_with_two_levels(ckpts):
    """The real KLD (runtime logits, not fake-quant) on the held-out text: the residual in the head cuts it."""
    from edgeq.fidelity import compare

    ref = load(FIXTURE)
    kld = {n: compare(ref, load(ckpts[n]), max_tokens=2048).kld_mean for n in (1, 2)}
    assert kld[2] < 0.85 * kld[1], kld
