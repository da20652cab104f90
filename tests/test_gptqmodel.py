"""``edgeq quantize --method gptqmodel`` (edgeq/convert/gptqmodel.py, docs/gptq.md): GPTQModel's quantiser, the
optional ``gptq`` extra, on the float model; its GPTQ checkpoint ingested exactly into the packed layout.

Without gptqmodel (the main environment): the missing extra is one line through the real CLI, exit 2, nothing
written; the ``dynamic`` overrides handed to GPTQModel give every module the group size edgeq's plan gives it, read
back the way edgeq's ingest reads a config; and a checkpoint laid out as GPTQModel writes one for that plan (built
here from known integers) is repacked exactly, module by module at its own group size, or refused when it differs
from the plan. With gptqmodel (the gptq environment of .ci/run): the bundled model converted end to end, its
manifest and exact-repack record, and its fidelity against the bf16 model and against RTN.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from edgeq import fidelity as F
from edgeq.convert.calibrated import GPTQOptions
from edgeq.convert.gptqmodel import EXTRA_HINT, METHOD, dynamic_overrides, ingest
from edgeq.convert.pipeline import convert
from edgeq.convert.plan import build_plan
from edgeq.convert.recipe import find_recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import open_checkpoint
from edgeq.io.manifest import read_manifest
from edgeq.keys import Action
from edgeq.layouts import tinygemm as tg
from edgeq.layouts.tinygemm import TinygemmLayout
from edgeq.runtime import load
from edgeq.scheme import Scheme
from helpers.cli import run_cli
from helpers.gptq import make_gptq, pack_gptq
from helpers.paths import FIXTURE

HAS_GPTQMODEL = importlib.util.find_spec("gptqmodel") is not None
needs_gptqmodel = pytest.mark.skipif(not HAS_GPTQMODEL, reason="gptqmodel is not installed (the optional gptq extra: "
                                     "pip install 'edgeq[gptq]'; .ci/run tests it in its own environment)")
SCHEME = Scheme.parse("w4a16-g128")  # the llama recipe's: the first layer, head, q/k/v and down_proj at g32, the rest at g128


def _plan(act_order: bool = False):
    recipe = find_recipe(None, "llama")
    plan = replace(build_plan(open_checkpoint(FIXTURE), SCHEME, METHOD, recipe), options=GPTQOptions())  # gptqmodel_plan's
    if act_order:
        plan = replace(plan, entries=tuple(replace(e, perm=e.quantized) for e in plan.entries))
    return plan, recipe


def _first_match(dynamic: dict, module: str):
    """The override GPTQModel and edgeq's ingest (edgeq/convert/ingest_config.py) both apply: the first pattern that
    matches from the start of the name; False for an exclusion, None for no match."""
    for key, overrides in dynamic.items():
        if re.match(key[2:] if key.startswith(("-:", "+:")) else key, module):
            return False if key.startswith("-:") else overrides
    return None


def test_missing_extra_is_one_line_through_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gptqmodel", None)  # not importable, whatever this environment has
    for extra in ([], ["--dry-run"], ["--nsamples", "4"]):
        code, out, err = run_cli(["quantize", FIXTURE, "-o", tmp_path / "out", "--method", "gptqmodel", *extra], capsys)
        assert code == 2 and out == "", extra
        assert err.strip() == f"error: {EXTRA_HINT}" == "error: --method gptqmodel needs the gptq extra: pip install 'edgeq[gptq]'"
    assert list(tmp_path.iterdir()) == []


def test_dynamic_overrides_give_every_module_the_plans_group_size():
    plan, _ = _plan()
    dynamic = dynamic_overrides(plan)
    assert len(dynamic) == 2  # the head, one pattern for the g32 modules (none kept in bf16)
    groups = {}
    for e in plan.entries:
        m = _first_match(dynamic, e.module)
        if not e.quantized:
            assert m is None, e.name
            continue
        groups[e.module] = (m or {}).get("group_size", SCHEME.group_size)
        assert groups[e.module] == e.group(SCHEME), e.module
    assert _first_match(dynamic, "lm_head") == {"bits": 4, "group_size": 32, "sym": False, "desc_act": False}
    assert sum(g == 32 for g in groups.values()) == 20 and len(groups) == 29  # 4 x (q,k,v,down), layer 0 o/gate/up, head
    assert _first_match(dynamic, "model.layers.1.self_attn.q_proj_x") is None  # whole names only
    keep = replace(plan, entries=tuple(replace(e, action=Action.KEEP) if e.module.endswith("o_proj") else e
                                       for e in plan.entries))
    assert _first_match(dynamic_overrides(keep), "model.layers.2.self_attn.o_proj") is False
    assert _first_match(dynamic_overrides(_plan(act_order=True)[0]), "lm_head")["desc_act"] is True


def _gptqmodel_like(out: Path, plan, groups: dict | None = None) -> dict:
    """A directory as GPTQModel saves one for ``plan`` (4-bit asymmetric v1 layers from known integers, at the
    plan's group sizes or ``groups``' overrides; the float tensors copied; config with the plan's ``dynamic``).
    Returns {module: (q, zeros, scales, group)}."""
    src = open_checkpoint(FIXTURE)
    out.mkdir()
    g0 = plan.scheme.group_size
    plan = replace(plan, entries=tuple(replace(e, group_size=0 if groups[e.module] == g0 else groups[e.module])
                                       if e.module in (groups or {}) else e for e in plan.entries))
    tensors, layers = {}, {}
    for i, e in enumerate(plan.entries):
        if not e.quantized:
            tensors[e.name] = src.read(e.source)
            continue
        n, k = e.shape
        g = e.group(plan.scheme)
        q, zeros, scales, g_idx = make_gptq(n, k, g, sym=False, seed=i)
        qweight, qzeros = pack_gptq(q, zeros, 4, "gptq")
        tensors.update({f"{e.module}.qweight": qweight.contiguous(), f"{e.module}.qzeros": qzeros.contiguous(),
                        f"{e.module}.scales": scales, f"{e.module}.g_idx": g_idx})
        layers[e.module] = (q, zeros, scales, g)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": plan.scheme.group_size, "sym": False, "desc_act": False,
          "lm_head": True, "pack_dtype": "int32", "checkpoint_format": "gptq", "dynamic": dynamic_overrides(plan),
          "meta": {"quantizer": ["gptqmodel:test"], "damp_percent": 0.01, "act_group_aware": True}}
    config = {**src.config, "tie_word_embeddings": False, "quantization_config": qc}
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return layers


def test_a_gptqmodel_checkpoint_for_the_plan_is_repacked_exactly(tmp_path):
    """The ingest half of --method gptqmodel, without GPTQModel: every module, the head included, repacked at its
    own group size (g32 under g128 through ``dynamic``), each weight within the bound of GPTQ's dequantisation."""
    plan, recipe = _plan()
    layers = _gptqmodel_like(tmp_path / "gm", plan)
    record = {"version": "test", "calibration": {"windows": 2, "seqlen": 8, "file": "x.txt"}, "cpu_workers": 2,
              "desc_act": False, "damp_percent": 0.01, "sym": False, "group_size": 128, "head": "untied view"}
    ckpt, gplan = ingest(open_checkpoint(FIXTURE), tmp_path / "gm", plan, recipe, record)
    assert gplan.method == METHOD and gplan.tied and ckpt.root == FIXTURE
    assert {e.module: e.group(SCHEME) for e in gplan.entries if e.quantized} == \
           {e.module: e.group(SCHEME) for e in plan.entries if e.quantized}
    assert all(e.action == Action.REPACK for e in gplan.entries if e.quantized)
    out = tmp_path / "out"
    report = convert(FIXTURE, out, prepared=(ckpt, gplan, recipe))
    assert report.method == METHOD and report.quantized == 29 and report.untied
    assert report.head_source == "model.embed_tokens.weight"  # through the untied view: the input's table
    assert report.notes[:2] == ("GPTQModel test: 2 windows x 8 tokens of x.txt, 4-bit asym g128, desc_act=False, "
                                "damp=0.01, 2 CPU workers; head: untied view",
                                "GPTQ input (gptq, 4-bit g128, sym=False, desc_act=False): 29 layers repacked exactly")
    m = read_manifest(out)
    assert m.method == METHOD and m.head_name == "lm_head" and "lm_head" in m.quantized_modules
    assert m.group_sizes == {mod: 32 for mod, (*_, g) in layers.items() if g == 32}
    assert m.extra["source"][METHOD] == record
    ex = m.extra["exactness"]
    assert ex["repacked_modules"] == 29 and 0 < ex["max_error_over_scale"] <= 1 / 16
    assert m.extra["requantized_modules"] == {} and m.extra["float_quantized_modules"] == {}
    written = open_checkpoint(out)
    layout = TinygemmLayout.from_json(m.layout)
    for mod in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.gate_proj", "lm_head"):
        q, zeros, scales, g = layers[mod]
        sz = written.read(f"{mod}.scales_and_zeros")
        n, k = q.shape
        assert sz.shape == (k // g, n, 2), mod
        qt = tg.unpack(written.read(f"{mod}.qweight"), n, k, layout)
        assert torch.equal(qt.long(), q.long()), mod  # the codes are GPTQ's, untouched
        s, z = (sz[..., i].double().t().repeat_interleave(g, 1) for i in (0, 1))
        s_ref = scales.double().t().repeat_interleave(g, 1)
        z_ref = zeros.double().t().repeat_interleave(g, 1)
        err = ((q.double() - 8) * s + z - s_ref * (q.double() - z_ref)).abs()
        assert bool((err <= 2.0**-8 * s_ref.abs() * ((q.double() - 8).abs() + (8 - z_ref).abs())).all()), mod
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gm", "out"]  # no staging directory left


def test_a_packed_embedding_is_carried_over_from_the_float_plan(tmp_path):
    """--embeddings packed with --method gptqmodel: the float plan's packed table (level 0: the tied head as written,
    here GPTQModel's, repacked) is written after the ingested head, from the input's table."""
    from edgeq.convert.embeddings import pack_plan
    from edgeq.keys import EmbeddingStorage

    plan, recipe = _plan()
    plan = pack_plan(plan, recipe, EmbeddingStorage.PACKED)
    _gptqmodel_like(tmp_path / "gm", plan)
    ckpt, gplan = ingest(open_checkpoint(FIXTURE), tmp_path / "gm", plan, recipe, {})
    assert gplan.entries[-1] == plan.packed_embedding and gplan.packed_embedding.source == "model.embed_tokens.weight"
    convert(FIXTURE, tmp_path / "out", prepared=(ckpt, gplan, recipe))
    m = read_manifest(tmp_path / "out")
    assert m.method == METHOD and m.embeddings["model.embed_tokens"]["storage"] == "packed"
    assert m.embedding_levels("model.embed_tokens") == [("lm_head", 32), ("model.embed_tokens", 128)]


def test_a_gptqmodel_checkpoint_unlike_the_plan_is_refused(tmp_path):
    plan, recipe = _plan()
    _gptqmodel_like(tmp_path / "gm", plan, groups={"model.layers.2.self_attn.k_proj": 128})
    with pytest.raises(EdgeqError, match=r"not an exact repack of the plan \(1 module\(s\)\), e\.g\. "
                                         r"model\.layers\.2\.self_attn\.k_proj: planned g32, GPTQModel wrote g128"):
        ingest(open_checkpoint(FIXTURE), tmp_path / "gm", plan, recipe, {})


@needs_gptqmodel
@pytest.mark.slow
def test_gptqmodel_converts_the_bundled_model(tmp_path, capsys, fixture_quantized, monkeypatch):
    """The real thing: GPTQModel on CPU (32 windows x 256 tokens of the bundled calibration text), the bundled tied
    model's head included, ingested exactly; fidelity on held-out text against bf16, and against RTN. Nothing is
    left behind: not GPTQModel's files, not its per-run log (it writes ./logs by default)."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    # from the package's metadata: a bare `import gptqmodel` needs torchvision, edgeq's import stands in for it
    version = importlib.metadata.version("gptqmodel")
    out = tmp_path / "gm"
    code, stdout, err = run_cli(["quantize", FIXTURE, "-o", out, "--method", "gptqmodel", "--nsamples", "32",
                                 "--seqlen", "256", "--json", "-q"], capsys)
    assert code == 0, err[-3000:]
    report = json.loads(stdout)  # GPTQModel's own logging went to stderr
    assert report["method"] == METHOD and report["quantized"] == 29 and report["untied"] is True
    assert report["head_source"] == "model.embed_tokens.weight"
    assert any(n.startswith(f"GPTQModel {version}: 32 windows x 256 tokens") for n in report["notes"])
    m = read_manifest(out)
    assert m.method == METHOD and m.head_name == "lm_head" and "lm_head" in m.quantized_modules and m.head["untied"]
    assert m.head["method"] == "repack" and m.group_sizes == read_manifest(fixture_quantized).group_sizes
    src = m.extra["source"]
    assert src["quant_method"] == "gptq" and src["sym"] is False and src["meta.quantizer"] == [f"gptqmodel:{version}"]
    assert src[METHOD]["calibration"]["windows"] == 32 and src[METHOD]["version"] == version
    assert "untied view" in src[METHOD]["head"]
    ex = m.extra["exactness"]
    assert ex["repacked_modules"] == 29 and ex["max_error_over_bound"] <= 1.0 and ex["max_error_over_scale"] <= 1 / 16
    assert m.extra["requantized_modules"] == {} and m.extra["float_quantized_modules"] == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "gm"]  # GPTQModel's files went with the staging dir
    assert list((tmp_path / "cwd").iterdir()) == []
    ref = load(FIXTURE, kv_cache_bytes=16 << 20)
    kld = {name: F.compare(ref, load(path, kv_cache_bytes=16 << 20), ctx=256, max_tokens=1500).kld_mean
           for name, path in (("gptqmodel", out), ("rtn", fixture_quantized))}
    assert kld["gptqmodel"] < 0.02 and kld["gptqmodel"] < 1.25 * kld["rtn"], kld
