"""The output head is the recipe's (``Recipe.head``), not a hard-coded ``lm_head``: planned, written, recorded in the
manifest, verified after the write, and loaded under that name.

BioGPT's head is ``output_projection`` (its transformers module and its checkpoint tensor), so a recipe naming it
must give a checkpoint whose head is ``output_projection``, quantised, that the runtime loads: before the head came
from the plan, such a recipe passed planning and the written checkpoint was refused ("no quantised lm_head")."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from edgeq.convert.pipeline import convert, prepare
from edgeq.convert.verify import verify_written
from edgeq.errors import EdgeqError
from edgeq.io.hf import open_checkpoint
from edgeq.keys import Role
from helpers.embeddings import reference_table
from helpers.models import save_tiny, save_tiny_biogpt

HEAD = "output_projection"
RECIPE = f"""name = "biogpt-test"
model_types = ["biogpt"]
scheme = "w4a16-g32"
head = "{HEAD}.weight"
embeddings = ["biogpt.embed_tokens.weight", "biogpt.embed_positions.weight"]
"""


def test_a_recipe_naming_another_head(tmp_path):
    src, out, recipe = tmp_path / "src", tmp_path / "out", tmp_path / "biogpt.toml"
    model = save_tiny_biogpt(src, tied=False)
    recipe.write_text(RECIPE)
    _, plan, _ = prepare(src, None, None, str(recipe))
    assert plan.head_module == HEAD and plan.head.source == f"{HEAD}.weight"
    report = convert(src, out, recipe=str(recipe))
    man = json.loads((out / "edgeq_manifest.json").read_text())
    assert man["head"] == {"name": HEAD, "quantized": True, "source": f"{HEAD}.weight", "untied": False}
    assert HEAD in man["quantized_modules"] and report.head_source == plan.head.source
    names = set(open_checkpoint(out).tensors)
    assert {f"{HEAD}.qweight", f"{HEAD}.scales_and_zeros"} <= names and not any(n.startswith("lm_head") for n in names)
    verify_written(out)  # the head name from the manifest
    verify_written(out, HEAD)  # and from the plan
    with pytest.raises(EdgeqError, match=r"records the output head 'output_projection', the plan quantised 'lm_head'"):
        verify_written(out, "lm_head")

    from edgeq.runtime import load

    lm = load(out, max_model_len=64, kv_cache_bytes=4 << 20)
    assert getattr(lm.model.get_output_embeddings(), "edgeq_quantized", False)  # the quantised head is the model's
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    # the default packs the first recipe embedding (untied head: the table's own two levels; positions stay bf16);
    # BioGPT scales its rows by a Python float (not a buffer, as Gemma-2's): E's rows times that float, as the module does
    assert man["embeddings"]["biogpt.embed_tokens"]["levels"] == [
        {"module": "biogpt.embed_tokens", "group_size": 32}, {"module": "biogpt.embed_tokens.residual", "group_size": 32}]
    assert "biogpt.embed_positions.weight" in names and "biogpt.embed_tokens.weight" not in names
    scale = model.get_input_embeddings().embed_scale
    assert isinstance(scale, float) and scale != 1.0
    with torch.no_grad():
        assert torch.equal(lm.model.get_input_embeddings()(ids), reference_table(out)[ids] * scale)
    with torch.no_grad():
        got, want = lm.model(ids).logits.float(), model(ids).logits.float()
    assert float((got - want).abs().max()) <= 0.15 * float(want.abs().max())  # 4-bit rounding, not another head


def test_the_head_is_checked_under_the_recipes_name(tmp_path):
    """The plan-time assertion names the recipe's head: a plan whose head is kept is refused."""
    src, recipe = tmp_path / "src", tmp_path / "biogpt.toml"
    save_tiny_biogpt(src, tied=False)
    recipe.write_text(RECIPE)
    _, plan, _ = prepare(src, None, None, str(recipe))
    entries = tuple(replace(e, action="keep") if e.role == Role.HEAD else e for e in plan.entries)
    with pytest.raises(EdgeqError, match=r"plan does not quantise the output head \(\[\('output_projection.weight', 'keep'\)\]\)"):
        replace(plan, entries=entries).check()


def test_a_head_the_architecture_lacks_is_refused_by_the_converter_and_by_the_loader(tmp_path, monkeypatch):
    """A tied Llama with a recipe calling its head ``output``: the converter refuses it (a Llama's head is ``lm_head``;
    before, it wrote ``output.*`` and exit 0, and every loader refused the result), leaving nothing; and the runtime's
    own check, for such a checkpoint written anyway (the converter's check patched out), names the missing module."""
    import edgeq.convert.pipeline as pipeline

    src, out, recipe = tmp_path / "src", tmp_path / "out", tmp_path / "llama-output.toml"
    save_tiny("llama", src, tied=True)
    recipe.write_text('name = "llama-output"\nmodel_types = ["llama"]\nhead = "output.weight"\n')
    with pytest.raises(EdgeqError, match=r"head = 'output.weight', but the output head of the model .*config.json "
                                         r"describes is 'lm_head.weight'; set the recipe's head to it"):
        convert(src, out, recipe=str(recipe))
    assert not out.exists()
    monkeypatch.setattr(pipeline, "output_head", lambda model: None)
    convert(src, out, recipe=str(recipe))
    man = json.loads((out / "edgeq_manifest.json").read_text())
    assert man["head"] == {"name": "output", "quantized": True, "source": "model.embed_tokens.weight", "untied": True}
    assert {"output.qweight", "output.scales_and_zeros"} <= set(open_checkpoint(out).tensors)
    from edgeq.runtime import load

    with pytest.raises(EdgeqError, match="manifest lists quantised module output but the model built from config.json has no such module"):
        load(out, max_model_len=64, kv_cache_bytes=4 << 20)
