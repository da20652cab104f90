"""recipes/quality.toml: the named recipe that matches llama.cpp Q4_K_M's bytes with GPTQ and a two-level head
(docs/results.md, "Quality per byte"). Asked for by name only; what it writes; where it refuses."""

from __future__ import annotations

from edgeq.convert.recipe import find_recipe
from edgeq.io.manifest import read_manifest
from edgeq.runtime import generate_ids, load
from helpers.cli import run_cli
from helpers.models import save_tiny
from helpers.paths import FIXTURE


def test_never_picked_by_model_type():
    assert find_recipe(None, "llama").name == "llama" and find_recipe(None, "qwen2").name == "qwen2"
    r = find_recipe("quality", "llama")
    assert (r.model_types, r.scheme, r.method, r.embeddings_storage, r.head_levels) == \
        ((), "w4a16-g256", "gptq", "packed", 2)


def test_only_the_first_layer_gets_finer_groups():
    """The first layer's MLP patterns must not catch layers 10, 20, 100 (``layers.10.`` contains ``0.``)."""
    r = find_recipe("quality", "llama")
    g = {i: (r.group_size(f"model.layers.{i}.mlp.down_proj.weight", 256), r.group_size(f"model.layers.{i}.mlp.up_proj.weight", 256))
         for i in (0, 1, 10, 20, 100)}
    assert g == {0: (32, 64), 1: (256, 256), 10: (256, 256), 20: (256, 256), 100: (256, 256)}
    assert r.group_size("lm_head.weight", 256) == 256


def test_converts_the_bundled_model(tmp_path, capsys):
    """GPTQ (self-sampled windows), the head summing both packed levels, g256 with the first layer's down_proj at g32
    and gate/up at g64 (only the first layer's: layer 1 stays at g256); the checkpoint loads and generates."""
    out = tmp_path / "q"
    code, _, err = run_cli(["quantize", FIXTURE, "-o", out, "--recipe", "quality", "--calib", "self", "--nsamples", "2",
                            "--seqlen", "16", "-q"], capsys)
    assert code == 0, err
    m = read_manifest(out)
    assert (m.scheme, m.method, m.extra["gptq"]["calibration"]["source"]) == ("w4a16-g256", "gptq", "self")
    assert m.head_levels == [("lm_head", 256), ("model.embed_tokens", 256)]  # level 0 is the head, level 1 the residual
    mods = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")
    groups = {i: {p: m.group_size(f"model.layers.{i}.{p}") for p in mods} for i in (0, 1)}
    assert groups[0] == {"self_attn.q_proj": 256, "self_attn.k_proj": 256, "self_attn.v_proj": 256,
                         "self_attn.o_proj": 256, "mlp.gate_proj": 64, "mlp.up_proj": 64, "mlp.down_proj": 32}
    assert groups[1] == {p: 256 for p in mods}
    lm = load(out, kv_cache_bytes=16 << 20)
    assert len(generate_ids(lm, [1, 2, 3], 4)) >= 3


def test_a_family_gptq_cannot_calibrate_is_refused(tmp_path, capsys):
    src = save_tiny("gemma2", tmp_path / "g2", tied=True)
    code, _, err = run_cli(["quantize", src, "-o", tmp_path / "o", "--recipe", "quality", "-q"], capsys)
    assert code == 2 and "model_type 'gemma2' is not supported by GPTQ calibration" in err, err
    assert not (tmp_path / "o").exists()


SAID = "default conversion: recipe quality, GPTQ on ids sampled from the model itself"
FAST = ["--nsamples", "2", "--seqlen", "16"]  # still the default command (no --recipe, no --method); a quick sampling


def test_the_default_command_takes_the_recipe_where_it_applies(tmp_path, capsys):
    """The plain command converts a float llama/mistral/qwen2/qwen3 checkpoint with the quality recipe on ids sampled
    from the model, and says so on stderr after its summary; a family GPTQ cannot calibrate keeps its family recipe and
    says why; a chosen method or recipe is the user's; -q and --json print nothing more (stdout stays one JSON)."""
    llama, gemma = save_tiny("llama", tmp_path / "l", tied=True), save_tiny("gemma2", tmp_path / "g", tied=True)

    def run(*args):
        code, stdout, err = run_cli(["quantize", *args, "-o", tmp_path / "o", "--force"], capsys)
        assert code == 0, err
        m = read_manifest(tmp_path / "o")
        return stdout, " ".join(err.split()), (m.created_by["recipe"], m.method, m.scheme)

    stdout, said, made = run(llama, *FAST)
    assert SAID in said and "`--method rtn` is the quick conversion" in said and stdout.startswith("wrote ")
    assert made == ("quality", "gptq", "w4a16-g128")  # K = 128 here: the base group falls back from 256 to 128
    assert read_manifest(tmp_path / "o").extra["gptq"]["calibration"]["source"] == "self"
    stdout, said, made = run(gemma)
    assert made == ("gemma2", "rtn", "w4a16-g128") and SAID not in said
    assert "default conversion: model_type 'gemma2': GPTQ calibrates llama, mistral, qwen2, qwen3 only; converting " \
           "with the family recipe (rtn)" in said
    assert run(llama, "--method", "rtn")[2] == ("llama", "rtn", "w4a16-g128")
    assert run(llama, "--recipe", "llama")[2] == ("llama", "rtn", "w4a16-g128")
    stdout, said, made = run(llama, "-q", *FAST)
    assert made[0] == "quality" and SAID not in said
    stdout, said, _ = run(llama, "--json", *FAST)
    assert SAID not in said and stdout.lstrip().startswith("{")
