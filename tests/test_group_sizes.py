"""Per-module group sizes: a recipe's ``group_sizes`` through plan -> convert -> manifest -> load -> generate."""

import json
from pathlib import Path

import pytest
import torch

from edgeq.io.manifest import read_manifest
from edgeq.convert.plan import build_plan
from edgeq.io.hf import open_checkpoint
from edgeq.convert.recipe import find_recipe, load_recipe
from edgeq.convert.pipeline import convert
from edgeq.layouts import tinygemm
from edgeq.quantize.rtn import quantize_groups
from edgeq.layouts.tinygemm import nbytes as quantized_bytes
from edgeq.scheme import Scheme
from helpers.checkpoints import write_reference
from helpers.cli import run_cli
from helpers.models import save_tiny

RECIPE = """name = "finer"
model_types = []
scheme = "w4a16-g128"
head = "lm_head.weight"
embeddings = ["model.embed_tokens.weight"]
group_sizes = { 'lm_head\\.weight$' = 32, 'v_proj\\.weight$' = 64, 'down_proj\\.weight$' = 256 }
"""


def _recipe(tmp_path: Path, text: str = RECIPE) -> Path:
    path = tmp_path / "finer.toml"
    path.write_text(text)
    return path


def test_recipe_group_sizes_are_never_coarser_than_the_scheme(tmp_path):
    r = load_recipe(_recipe(tmp_path))
    assert r.group_size("lm_head.weight", 128) == 32
    assert r.group_size("model.layers.1.self_attn.v_proj.weight", 128) == 64
    assert r.group_size("model.layers.1.self_attn.v_proj.weight", 32) == 32  # --scheme w4a16-g32 stays g32
    assert r.group_size("model.layers.1.mlp.down_proj.weight", 128) == 128  # 256 would be coarser: ignored
    assert r.group_size("model.layers.1.self_attn.o_proj.weight", 128) == 128


@pytest.mark.parametrize("line, message", [
    ("group_sizes = { 'v_proj' = 48 }", "group_sizes['v_proj'] = 48; valid group sizes: 32, 64, 128, 256"),
    ("group_sizes = { 'v_proj(' = 32 }", "group_sizes pattern 'v_proj(' is not a valid regex"),
    ("group_sizes = 32", "group_sizes must be a table of tensor-name regex = group size"),
])
def test_bad_group_sizes_refused_by_the_cli(tmp_path, capsys, line, message):
    src = save_tiny("llama", tmp_path / "src", tied=True)
    bad = _recipe(tmp_path, RECIPE.replace(RECIPE.splitlines()[-1], line))
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "out"), "--recipe", str(bad)], capsys)
    assert code == 2 and message in err and str(bad) in err
    assert not (tmp_path / "out").exists()


def test_plan_bytes_follow_each_entry_group(tmp_path):
    src = save_tiny("llama", tmp_path / "src", tied=True)
    plan = build_plan(open_checkpoint(src), Scheme.parse("w4a16-g128"), "rtn", load_recipe(_recipe(tmp_path)))
    by = {e.name: e for e in plan.entries}
    head, v = by["lm_head.weight"], by["model.layers.0.self_attn.v_proj.weight"]
    assert (head.group_size, v.group_size, by["model.layers.0.mlp.down_proj.weight"].group_size) == (32, 64, 0)
    assert head.bytes_out == quantized_bytes(*head.shape, 32) and v.bytes_out == quantized_bytes(*v.shape, 64)
    assert ("lm_head.scales_and_zeros", "BF16", (128 // 32, 256, 2)) in head.out_tensors(plan.scheme)


def test_per_module_groups_round_trip_quantize_load_generate(tmp_path, capsys):
    from edgeq.runtime import generate_ids, load
    from edgeq.runtime.qlinear import Int4Linear

    src = save_tiny("llama", tmp_path / "src", tied=True)
    out = tmp_path / "out"
    convert(src, out, recipe=str(_recipe(tmp_path)))
    man = read_manifest(out)
    assert man.scheme == "w4a16-g128"
    assert man.group_sizes == {"lm_head": 32, **{f"model.layers.{i}.self_attn.v_proj": 64 for i in range(2)}}
    raw = json.loads((out / "edgeq_manifest.json").read_text())
    assert raw["group_sizes"] == man.group_sizes
    ref, got = open_checkpoint(src), open_checkpoint(out)
    layout = tinygemm.TinygemmLayout.from_json(man.layout)
    for module in ("lm_head", "model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.o_proj"):
        g = {"lm_head": 32, "model.layers.1.self_attn.v_proj": 64}.get(module, 128)
        w = ref.read(man.tensors[f"{module}.qweight"]["source"])
        qt = quantize_groups(w, g, "rtn")
        assert got.tensors[f"{module}.scales_and_zeros"].shape == (w.shape[1] // g, w.shape[0], 2)
        assert torch.equal(tinygemm.unpack(got.read(f"{module}.qweight"), *w.shape, layout), qt.q), module
        assert torch.equal(got.read(f"{module}.scales_and_zeros"), qt.scales_and_zeros), module
    lm = load(out)
    groups = {n: m.group_size for n, m in lm.model.named_modules() if isinstance(m, Int4Linear)}
    assert groups["lm_head"] == 32 and groups["model.layers.0.self_attn.v_proj"] == 64
    assert groups["model.layers.0.mlp.down_proj"] == 128
    ids = torch.tensor([[1, 5, 9, 17, 33, 65]])
    with torch.inference_mode():
        logits = lm.model(input_ids=ids).logits[0].float()
    # the same logits from the dequantised weights in a plain HF model (per-module groups applied by hand)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(write_reference(out, tmp_path / "ref"), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        want = hf(input_ids=ids).logits[0].float()
    assert (logits - want).abs().max() < 0.05 * want.abs().max()
    new = generate_ids(lm, [1, 5, 9], 4)[0]
    assert len(new) == 4 and all(0 <= t < 256 for t in new)
    # inspect reports the per-module choice (report field and text)
    from edgeq.inspect.report import inspect_checkpoint

    r = inspect_checkpoint(out)
    from edgeq.convert.records import tokenizer_problem

    assert r.problems == (tokenizer_problem(out),)  # the tiny model has no tokenizer files; nothing else is wrong
    assert dict(r.edgeq.group_sizes) == man.group_sizes and r.edgeq.group_size == 128
    code, text, _ = run_cli(["inspect", str(out)], capsys)
    assert code == 0 and "group size 32 for 1 module(s): lm_head; the rest 128" in text
    assert "group size 64 for 2 module(s): model.layers.0.self_attn.v_proj" in text


def test_uniform_checkpoint_has_no_group_sizes_record(tmp_path):
    """--scheme w4a16-g32 with the family recipe: nothing is finer than g32, so the manifest keeps the old key set
    (and a checkpoint written before the record existed loads the same way: every module at the scheme's G)."""
    src = save_tiny("llama", tmp_path / "src", tied=True)
    convert(src, tmp_path / "out", scheme=Scheme.parse("w4a16-g32"))
    raw = json.loads((tmp_path / "out" / "edgeq_manifest.json").read_text())
    assert "group_sizes" not in raw and read_manifest(tmp_path / "out").group_size("lm_head") == 32


def test_family_recipes_name_finer_groups_for_the_sensitive_tensors():
    r = find_recipe(None, "llama")
    assert Scheme.parse(r.scheme).group_size == 128
    assert r.group_size("lm_head.weight", 128) == 32
    assert r.group_size("model.layers.1.self_attn.o_proj.weight", 128) == 128
    assert r.group_size("model.layers.1.self_attn.q_proj.weight", 128) == 32
    assert r.group_size("model.layers.1.self_attn.k_proj.weight", 128) == 32
    assert r.group_size("model.layers.1.mlp.down_proj.weight", 128) == 32
    # the whole first layer (about half of the error on the models trained here: docs/results.md "the first layer")
    assert {r.group_size(f"model.layers.0.{m}.weight", 128) for m in ("self_attn.q_proj", "self_attn.o_proj",
                                                                       "mlp.gate_proj", "mlp.up_proj")} == {32}
    assert r.group_size("model.layers.10.self_attn.o_proj.weight", 128) == 128


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "quality"])
def test_recipes_give_fused_projections_one_group_size(name):
    """vLLM fuses q/k/v and gate/up into one layer each and refuses members of unequal group sizes (the vLLM plugin's
    check; tests/test_vllm.py runs it in its own environment): every recipe must keep them equal, in every layer."""
    r = find_recipe(name if name == "quality" else None, name if name != "quality" else "llama")
    base = Scheme.parse(r.scheme).group_size
    for i in (0, 1, 10):
        for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            sizes = {r.group_size(f"model.layers.{i}.{m}.weight", base) for m in fused}
            assert len(sizes) == 1, (name, i, fused, sizes)


@pytest.mark.parametrize("embeddings", ["bf16", None])
def test_manifest_group_sizes_checked_at_load(tmp_path, embeddings):
    """A doctored head group size is refused at load. With a bf16 table (pinned: the group_sizes record is then the
    only place the head's G is written) by the layout's check; with the default packed table the head's G is also
    the table's level 0, so changing one alone is an inconsistent manifest, and changing both is refused as above."""
    from edgeq.errors import EdgeqError
    from edgeq.runtime import load

    src = save_tiny("llama", tmp_path / "src", tied=True)
    out = tmp_path / "out"
    convert(src, out, recipe=str(_recipe(tmp_path)), embeddings=embeddings)
    path = out / "edgeq_manifest.json"
    raw = json.loads(path.read_text())
    assert ("embeddings" in raw) == (embeddings is None)

    def doctor(g: int, level0: bool = True) -> None:
        raw["group_sizes"]["lm_head"] = g
        if embeddings is None and level0:  # tied: level 0 of the packed table is the head, at the head's G
            raw["embeddings"]["model.embed_tokens"]["levels"][0] = {"module": "lm_head", "group_size": g}
        path.write_text(json.dumps(raw))

    if embeddings is None:
        doctor(64, level0=False)
        with pytest.raises(EdgeqError, match=r"levels\[0\] is the head at group size 32, but the head is quantised at 64"):
            load(out)
    doctor(48)
    with pytest.raises(EdgeqError, match=r"group_sizes\['lm_head'\] = 48 is not a tinygemm group size" if embeddings
                       else r"levels\[0\] = \{'module': 'lm_head', 'group_size': 48\}: needs a module name and a "
                            r"tinygemm group size"):
        load(out)
    doctor(64)  # valid, but not what the stored scales_and_zeros hold
    with pytest.raises(EdgeqError, match=r"lm_head.scales_and_zeros: expected bf16 \[2, 256, 2\] for N=256, K=128, G=64"):
        load(out)
