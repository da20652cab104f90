"""Bad input: one line naming the file or tensor and the fix, exit code 2, input untouched, nothing left behind."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from edgeq.convert.pipeline import convert
from edgeq.errors import EdgeqError
from helpers.checkpoints import dir_digest
from helpers.cli import run_cli
from helpers.models import FAMILIES, save_tiny


@pytest.fixture
def src(tmp_path):
    return save_tiny("llama", tmp_path / "src", tied=True)


def expect_error(tmp_path, capsys, src, pattern, *extra):
    before = dir_digest(src) if Path(src).exists() else None
    code, out, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "out"), "-q", *extra], capsys)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and pattern in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert not list(tmp_path.glob(".out.edgeq-tmp-*"))
    if before:
        assert dir_digest(src) == before
    return err


def test_missing_config(tmp_path, capsys, src):
    (src / "config.json").unlink()
    expect_error(tmp_path, capsys, src, "no config.json")


def test_corrupt_config(tmp_path, capsys, src):
    (src / "config.json").write_text("{not json")
    expect_error(tmp_path, capsys, src, "config.json: not valid JSON")


def test_truncated_safetensors(tmp_path, capsys, src):
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    expect_error(tmp_path, capsys, src, "truncated file; re-download it")


def test_corrupt_header(tmp_path, capsys, src):
    f = src / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe!!"
    f.write_bytes(bytes(data))
    expect_error(tmp_path, capsys, src, "corrupt safetensors header (not JSON")


def test_header_length_past_file(tmp_path, capsys, src):
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 10**9) + data[8:])
    expect_error(tmp_path, capsys, src, "claims 1000000000 header bytes")


def test_index_points_at_missing_shard(tmp_path, capsys):
    s = save_tiny("llama", tmp_path / "src", tied=True, max_shard_size="100KB")
    shard = sorted(s.glob("model-*.safetensors"))[1]
    shard.unlink()
    expect_error(tmp_path, capsys, s, f"points at missing shard {shard.name}")


def _rewrite(src, fn):
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    fn(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("extra, message", [
    (["--method", "rtn"], "model.layers.1.mlp.up_proj.weight rows 0..256: 1 NaN/Inf value(s)"),
    # the default (quality recipe, GPTQ): refused before sampling from the damaged model, not in its layer minutes later
    ([], "model.safetensors: tensor model.layers.1.mlp.up_proj.weight has NaN/Inf values; fix or re-export"),
])
def test_nan_weights(tmp_path, capsys, src, monkeypatch, extra, message):
    import edgeq.convert.pipeline as conv

    def poison(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 7] = float("nan")

    _rewrite(src, poison)
    monkeypatch.setattr(conv, "calibration", lambda *a, **k: pytest.fail("sampled from a model with NaN weights"))
    expect_error(tmp_path, capsys, src, message, *extra)


def test_inf_in_norm(tmp_path, capsys, src):
    _rewrite(src, lambda t: t["model.norm.weight"].__setitem__(0, float("inf")))
    expect_error(tmp_path, capsys, src, "tensor model.norm.weight has NaN/Inf")


def test_integer_weights(tmp_path, capsys, src):
    _rewrite(src, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(256, 128, dtype=torch.int8)))
    expect_error(tmp_path, capsys, src, "model.layers.0.mlp.up_proj.weight [256, 128] I8: dtype I8 is not bf16/fp16/fp32")


def test_nothing_to_quantise(tmp_path, capsys, src):
    def strip(t):
        for name in [n for n in t if "layers" in n and n.endswith("proj.weight")]:
            del t[name]

    _rewrite(src, strip)
    expect_error(tmp_path, capsys, src, "no Linear projection weights found")


def test_already_quantised(tmp_path, capsys, src):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    expect_error(tmp_path, capsys, src, "already quantised (quant_method='gptq')")


def test_pickle_only(tmp_path, capsys, src):
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    err = expect_error(tmp_path, capsys, src, "only pickle weights (pytorch_model.bin); edgeq never unpickles")
    assert "save_pretrained" in err


def test_unsupported_architecture(tmp_path, capsys, src):
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (src / "config.json").write_text(json.dumps(cfg))
    expect_error(tmp_path, capsys, src, "unsupported architecture model_type='mamba'; supported: gemma2, llama")


def test_group_size_rule_lists_every_tensor(tmp_path, capsys, src):
    err = expect_error(tmp_path, capsys, src, "cannot be quantised with w4a16-g256", "--scheme", "w4a16-g256")
    # 2 layers x 6 + the head + the packed table's residual level (the default; tied: its level 0 is the head)
    assert err.count("K=128 is not a multiple of the group size 256") == 14
    assert ("model.embed_tokens.weight [256, 128] (--embeddings packed, level model.embed_tokens g256): K=128 is not "
            "a multiple of the group size 256; use a group size of 32, 64, 128; or --embeddings bf16") in err


def test_existing_output_needs_force(tmp_path, capsys, src):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(["quantize", str(src), "-o", str(out), "-q"], capsys)
    assert code == 2 and "exists and is not empty" in err and (out / "keep.txt").read_text() == "mine"
    code, _, _ = run_cli(["quantize", str(src), "-o", str(out), "-q", "--force"], capsys)
    assert code == 0 and not (out / "keep.txt").exists() and (out / "edgeq_manifest.json").exists()


def test_full_disk_checked_first(tmp_path, src, monkeypatch):
    import edgeq.convert.pipeline as conv

    monkeypatch.setattr(conv.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(EdgeqError, match=r": 0 MiB free, the output needs 0 MiB plus 64 MiB of headroom; free space "):
        convert(src, tmp_path / "out")  # the tiny model's output rounds to 0 MiB: the headroom is named, not hidden
    assert not (tmp_path / "out").exists()


def test_write_failure_leaves_nothing(tmp_path, src, monkeypatch):
    from edgeq.io import safetensors as safetensors_io

    def fail(self, data):
        raise EdgeqError("disk full (simulated)")

    monkeypatch.setattr(safetensors_io.ShardedWriter, "_emit", fail)
    with pytest.raises(EdgeqError, match="simulated"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.edgeq-tmp-*"))


def test_ctrl_c_leaves_nothing(tmp_path, src):
    before = dir_digest(src)
    calls = []

    def interrupt(nbytes, name):
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out", progress=interrupt)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.edgeq-tmp-*"))
    assert dir_digest(src) == before


def test_ctrl_c_cli_exit_code(tmp_path, capsys, src, monkeypatch):
    import edgeq.convert.pipeline as conv

    monkeypatch.setattr(conv, "_stream", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "out"), "-q", "--method", "rtn"], capsys)
    assert code == 2 and "interrupted" in err and not (tmp_path / "out").exists()


def test_ctrl_c_while_the_default_command_samples(tmp_path, capsys, src, monkeypatch):
    """The default command (the quality recipe) is interrupted where it spends its first minutes: sampling."""
    import edgeq.convert.pipeline as conv

    before = dir_digest(src)
    monkeypatch.setattr(conv, "calibration", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "out"), "-q"], capsys)
    assert code == 2 and "interrupted" in err and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.edgeq-tmp-*")) and dir_digest(src) == before


def test_recipe_keeping_the_head_is_rejected(tmp_path, capsys, src):
    recipe = tmp_path / "bad.toml"
    recipe.write_text('name = "bad"\nmodel_types = ["llama"]\nkeep_bf16 = ["lm_head"]\n')
    expect_error(tmp_path, capsys, src, "matches the output head lm_head.weight; the head is always quantised", "--recipe", str(recipe))


def test_recipe_keep_is_reported(tmp_path, capsys, src):
    recipe = tmp_path / "keep.toml"
    recipe.write_text('name = "keepdown"\nmodel_types = ["llama"]\nkeep_bf16 = ["down_proj"]\n')
    code, out, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "out"), "-q", "--recipe", str(recipe), "--json"], capsys)
    assert code == 0, err
    man = json.loads((tmp_path / "out" / "edgeq_manifest.json").read_text())
    assert man["modules_not_converted"] == {f"model.layers.{i}.mlp.down_proj": "recipe keepdown: keep_bf16 'down_proj'" for i in range(2)}
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["modules_to_not_convert"] == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]


def test_dry_run_reads_no_weights(tmp_path, capsys, src, monkeypatch):
    from edgeq.io import safetensors as safetensors_io

    monkeypatch.setattr(safetensors_io, "read_tensor", lambda *a, **k: pytest.fail("dry run read tensor data"))
    code, out, _ = run_cli(["quantize", str(src), "--dry-run", "--json"], capsys)  # the default: headers only too
    assert code == 0 and json.loads(out)["recipe"] == "quality"
    code, out, _ = run_cli(["quantize", str(src), "--dry-run", "--json", "--method", "rtn"], capsys)
    assert code == 0
    plan = json.loads(out)
    head = [r for r in plan["plan"] if r["role"] == "head"]
    assert head == [{"name": "lm_head.weight", "shape": [256, 128], "dtype": "BF16", "role": "head", "action": "quantize",
                     "bytes_in": 65536, "bytes_out": 256 * 64 + (128 // 32) * 256 * 4,  # the llama recipe's g32 head
                     "reason": "untied from model.embed_tokens.weight", "group_size": 32}]
    assert plan["tied"] is True and plan["problems"] == []


def test_hub_id_offline_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["quantize", "no-such-org/no-such-model", "-q"], capsys)
    assert code == 2 and "fetching it from the Hugging Face hub failed" in err


def test_recipes_command_lists_all(capsys):
    code, out, _ = run_cli(["recipes", "--json"], capsys)
    assert code == 0
    assert sorted(r["name"] for r in json.loads(out)) == ["gemma2", "llama", "mistral", "phi3", "quality", "qwen2", "qwen3"]


def _rewrite_weights(src: Path, fn) -> None:
    from safetensors.torch import load_file

    tensors = load_file(src / "model.safetensors")
    fn(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


def _edit_config(src: Path, **fields) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(fields)
    (src / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage, pattern", [
    (lambda s: _rewrite_weights(s, lambda t: t.pop("model.layers.0.mlp.down_proj.weight")),
     "(1 problem(s): model.layers.0.mlp.down_proj.weight: missing (the model needs it))"),
    (lambda s: _rewrite_weights(s, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:64].clone()})),
     "model.norm.weight: checkpoint shape [64] but config.json implies [128]"),
    (lambda s: _edit_config(s, num_hidden_layers=1), "model.layers.1.input_layernorm.weight: not in the model config.json "
                                                     "describes"),
    (lambda s: _edit_config(s, num_hidden_layers=3), "(9 problem(s): model.layers.2.self_attn.q_proj.weight: missing"),
], ids=["weight-missing", "wrong-shape", "fewer-layers", "more-layers"])
def test_weights_that_do_not_match_config_json_are_refused(tmp_path, capsys, src, damage, pattern):
    """Such a checkpoint converted, then every loader refused it (audit, 2026-12-04): nothing is written now."""
    damage(src)
    err = expect_error(tmp_path, capsys, src, pattern)
    assert err.startswith(f"error: {src}: the weights do not match config.json (") and err.endswith(
        "the checkpoint is incomplete or its config.json belongs to another model\n")


@pytest.mark.parametrize("args, pattern", [
    (["--scheme", ""], "unknown scheme ''; valid: w4a16-g32"),  # was taken for the default
    (["--max-shard-size", "0"], "--max-shard-size 0: must be a positive size"),  # wrote one file per tensor
])
def test_empty_and_zero_option_values_are_refused_not_defaulted(tmp_path, capsys, src, args, pattern):
    expect_error(tmp_path, capsys, src, pattern, *args)


def test_an_untied_head_that_is_missing_is_refused_not_made_from_the_table(tmp_path, capsys):
    """config.json says the head is its own tensor and it is not there: the conversion made one from the embedding
    table, exit 0, a checkpoint that is not the model the input describes (audit, 2026-12-05)."""
    src = save_tiny("llama", tmp_path / "untied", tied=False)
    _rewrite_weights(src, lambda t: t.pop("lm_head.weight"))
    expect_error(tmp_path, capsys, src, "lm_head.weight: missing (the model needs it: config.json's "
                                        "tie_word_embeddings is false)")


def test_a_table_a_recipe_does_not_name_is_not_quantised_as_a_linear(tmp_path, capsys):
    """A recipe whose embeddings name another tensor (Falcon's table under --recipe llama) quantised the table as a
    projection, exit 0, and every loader refused the checkpoint."""
    src = save_tiny("llama", tmp_path / "untied", tied=False)
    recipe = tmp_path / "other.toml"
    recipe.write_text('name = "other"\nmodel_types = ["llama"]\nhead = "lm_head.weight"\n'
                      'embeddings = ["transformer.word_embeddings.weight"]\n')
    expect_error(tmp_path, capsys, src, "model.embed_tokens.weight: quantised as a Linear, but its module in the "
                                        "model config.json describes is Embedding", "--recipe", str(recipe))


@pytest.mark.parametrize("tied", [True, False])
def test_a_recipe_head_the_model_does_not_have_is_refused(tmp_path, capsys, tied):
    """A recipe whose head names no module of the architecture (``model.output.weight`` for a Llama, whose head is
    ``lm_head``) wrote the head under that name, exit 0, and every loader refused the checkpoint ("manifest lists
    quantised module model.output but the model built from config.json has no such module")."""
    src = save_tiny("llama", tmp_path / "src", tied=tied)
    recipe = tmp_path / "head.toml"
    recipe.write_text('name = "head"\nmodel_types = ["llama"]\nhead = "model.output.weight"\n'
                      'embeddings = ["model.embed_tokens.weight"]\n')
    err = expect_error(tmp_path, capsys, src, f"head = 'model.output.weight', but the output head of the model "
                                              f"{src}/config.json describes is 'lm_head.weight'; set the recipe's head "
                                              f"to it", "--recipe", str(recipe))
    assert err.startswith(f"error: recipe head ({recipe}): "), err


def test_a_calibrated_conversion_checks_config_json_before_calibrating(tmp_path, capsys, src, monkeypatch):
    """--method gptq runs for minutes to hours: a checkpoint that does not match its config.json is refused before
    the calibration starts (rtn checks after its short write, to keep transformers' modeling code out of its peak)."""
    import edgeq.convert.pipeline as pipeline

    def no_calibration(*a, **k):
        raise AssertionError("calibrated before the config check")

    monkeypatch.setattr(pipeline, "calibration", no_calibration)
    _rewrite_weights(src, lambda t: t.update({"stray.bias": torch.zeros(4)}))
    expect_error(tmp_path, capsys, src, "(1 problem(s): stray.bias: not in the model config.json describes)",
                 "--method", "gptq", "--calib", "self")


@pytest.mark.parametrize("line, key", [('keep_bf16 = "proj"', "keep_bf16"), ('embeddings = "model.embed_tokens.weight"', "embeddings"),
                                       ('model_types = "llama"', "model_types")])
def test_a_recipe_list_given_as_a_string_is_refused_not_split_into_characters(tmp_path, capsys, src, line, key):
    """keep_bf16 = "proj" became the patterns p, r, o, j (every projection kept); embeddings as a string quantised the
    table as a Linear (audit, 2026-12-05)."""
    recipe = tmp_path / "str.toml"
    recipe.write_text(f'name = "str"\n{line}\n' + ('' if key == "model_types" else 'model_types = ["llama"]\n'))
    expect_error(tmp_path, capsys, src, f"str.toml: {key} must be a list of strings", "--recipe", str(recipe))


def test_an_empty_recipe_name_is_refused_not_the_default(tmp_path, capsys, src):
    """--recipe "" converted with the model's own recipe (audit, 2026-12-05)."""
    expect_error(tmp_path, capsys, src, "--recipe '': names no recipe; available: gemma2, llama", "--recipe", "")


def _plan(src, capsys, *extra) -> dict:
    code, out, err = run_cli(["quantize", str(src), "--dry-run", "--json", *extra], capsys)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_bundled_recipes_match_their_families_names(tmp_path, capsys, family):
    """Every pattern of a family's own recipe names tensors of that family (a warning here means a dead pattern)."""
    assert _plan(save_tiny(family, tmp_path / family), capsys)["warnings"] == []


def test_a_recipe_pattern_that_matches_nothing_is_said_not_silent(tmp_path, capsys, src):
    """A typo in keep_bf16 quantised what the user meant to keep, exit 0 and not a word (audit, 2026-12-05)."""
    recipe = tmp_path / "typo.toml"
    recipe.write_text('name = "typo"\nmodel_types = ["llama"]\nkeep_bf16 = ["down_prj", "up_proj"]\n'
                      "group_sizes = { 'q_prj' = 32, 'k_proj' = 64 }\n")
    warned = [f"recipe typo ({recipe}): keep_bf16 pattern 'down_prj' matches no tensor of this checkpoint, so it "
              "changes nothing; fix or remove it",
              f"recipe typo ({recipe}): group_sizes pattern 'q_prj' matches no tensor of this checkpoint, so it "
              "changes nothing; fix or remove it"]
    assert _plan(src, capsys, "--recipe", str(recipe))["warnings"] == warned
    # W4A8 keeps one group size per checkpoint: its group_sizes do not apply, so a pattern matching nothing is no news,
    # but the tensors that lose their finer groups are (`--scheme auto` may pick W4A8 without the user naming it)
    assert _plan(src, capsys, "--recipe", str(recipe), "--scheme", "w4a8-g128")["warnings"] == warned[:1] + [
        "recipe typo's group_sizes give 2 tensor(s) finer groups (e.g. model.layers.0.self_attn.k_proj.weight), which "
        "w4a8-g128 does not take (one group size per checkpoint): they are quantised at g128; a w4a16 scheme keeps them"]
    code, out, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "out"), "-q", "--recipe", str(recipe)], capsys)
    assert code == 0, err
    assert [line.removeprefix("warning: ") for line in err.splitlines() if line.startswith("warning: recipe")] == warned
    man = json.loads((tmp_path / "out" / "edgeq_manifest.json").read_text())
    assert sorted(man["modules_not_converted"]) == [f"model.layers.{i}.mlp.up_proj" for i in range(2)]  # the match still applies


def test_the_quality_recipe_on_fused_projections_says_which_pattern_does_not_apply(tmp_path, capsys):
    """The quality recipe's first-layer gate/up pattern names unfused projections; Phi-3 fuses them (and has no GPTQ
    calibration: the recipe's groups with --method rtn)."""
    warnings = _plan(save_tiny("phi3", tmp_path / "phi3"), capsys, "--recipe", "quality", "--method", "rtn",
                     "--scheme", "w4a16-g128")["warnings"]  # the tiny model's K = 128
    assert len(warnings) == 1 and "group_sizes pattern 'layers\\.0\\.mlp\\.(gate|up)_proj\\.weight$'" in warnings[0]
