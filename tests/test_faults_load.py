"""A damaged checkpoint never produces text with exit 0 (docs/failures.md, "Damaged checkpoints").

Each test copies the quantised bundled model, damages one thing the way a disk, a copy or an edit would, and checks
what the user sees: load refuses (cheap checks: non-finite scales, a shard longer than its header; ``verify=True``:
sha256), generation stops with an error naming the first module whose output is not finite, inspect reports what
load refuses. Errors go through the real CLI (exit code and the one stderr line)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgeq import env
from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.layouts import tinygemm
from edgeq.inspect.report import inspect_checkpoint
from edgeq.runtime import SamplingParams, generate, load, repack
from edgeq.runtime.generation import Generation, encode_prompt
from edgeq.io.mapped import MappedFiles
from helpers.checkpoints import prose_checkpoint, quantize
from helpers.cli import run_cli
from helpers.damage import poke
from helpers.paths import FIXTURE

PROMPT = "Once upon a time"
BF16_MAX = torch.finfo(torch.bfloat16).max  # finite, but 8 * it overflows: every logit of the head is +-inf


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    return prose_checkpoint(tmp_path_factory)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A private $EDGEQ_CACHE_DIR (the crossover probe of a CLI load writes there, never to ~/.cache) that reuses
    the built native kernels of the real one (a fresh build takes minutes)."""
    real = env.cache_dir()
    mine = tmp_path / "cache"
    mine.mkdir()
    for sub in ("native", "native_w4a8"):
        if (real / sub).is_dir():
            (mine / sub).symlink_to(real / sub)
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(mine))
    return mine


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: Path, fn) -> None:
    config = json.loads((directory / "config.json").read_text())
    fn(config)
    (directory / "config.json").write_text(json.dumps(config))


def _subprocess_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m edgeq.cli.main``: a fresh interpreter, so warnings are printed exactly as a user sees them."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # EDGEQ_CACHE_DIR: the cache_dir fixture's
    return subprocess.run([sys.executable, "-m", "edgeq.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


# -------------------------------------------------------------------------------------------------- load: cheap checks


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3.4e38])  # 3.4e38 rounds to +inf in bf16
@pytest.mark.parametrize("part", [0, 1], ids=["scale", "zero"])
def test_non_finite_scale_or_zero_is_refused_at_load(prose, tmp_path, value, part):
    bad = _copy(prose, tmp_path / "bad")
    name = "model.layers.1.mlp.down_proj.scales_and_zeros"
    poke(bad, name, lambda t: t[0, 5].__setitem__(part, value))
    with pytest.raises(DamagedCheckpointError, match=rf"model.safetensors: tensor {name}: 1 NaN/Inf value"):
        load(bad, prefill_threshold=4)


def test_a_shard_longer_than_its_header_is_refused(prose, tmp_path, capsys):
    bad = _copy(prose, tmp_path / "bad")
    with open(bad / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    code, out, err = run_cli(["generate", str(bad), PROMPT, "--max-tokens", "4"], capsys)
    assert code == 2 and out == ""
    assert "model.safetensors" in err and "but its header describes" in err and "(+8)" in err
    assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------------ verify=True


def test_verify_finds_flipped_bytes_in_packed_weights(prose, tmp_path, capsys):
    """Every byte pattern is a valid pair of nibbles: only the sha256 can tell; without --verify it loads."""
    bad = _copy(prose, tmp_path / "bad")
    poke(bad, "model.layers.0.self_attn.q_proj.qweight", lambda t: t[:4].bitwise_xor_(0xFF))
    load(bad, prefill_threshold=4)  # the cheap checks pass: the bytes are plausible
    with pytest.raises(DamagedCheckpointError, match=r"model.safetensors: sha256 [0-9a-f]{12}\.\.\. does not match"):
        load(bad, prefill_threshold=4, verify=True)
    code, out, err = run_cli(["generate", str(bad), PROMPT, "--verify"], capsys)
    assert code == 2 and out == "" and "sha256" in err and "re-copy it or re-quantise" in err
    assert load(prose, prefill_threshold=4, verify=True).settings.quantized  # an intact checkpoint passes


def test_verify_refuses_what_it_cannot_check(prose, tmp_path):
    with pytest.raises(EdgeqError, match="--verify needs edgeq_manifest.json"):
        load(FIXTURE, verify=True)
    extra = _copy(prose, tmp_path / "extra")
    shutil.copy(extra / "model.safetensors", extra / "model-00002.safetensors")
    with pytest.raises(DamagedCheckpointError, match="model-00002.safetensors: not listed in edgeq_manifest.json"):
        load(extra, verify=True)


# -------------------------------------------------------------------------------------------- generation: NaN/Inf


@pytest.fixture(scope="module")
def prose_bf16(tmp_path_factory):
    """The bundled model quantised as ``prose`` is, its table kept bf16 (--embeddings bf16)."""
    return quantize(FIXTURE, tmp_path_factory.mktemp("prose-bf16") / "q", group_size=128, embeddings="bf16")


@pytest.mark.slow
@pytest.mark.parametrize("storage, first", [("bf16", "lm_head"), ("packed", "model.embed_tokens")])
def test_head_scales_at_the_bf16_maximum_stop_generation_naming_the_head(prose, prose_bf16, tmp_path, storage, first):
    """Finite scales (the load check passes) whose products overflow: the first logits are +-inf. Before this
    check, greedy argmax over them streamed token 0 (empty text) with exit 0. With the default packed table the
    head's tensors are also the table's level 0, so the first module whose output is not finite is the embedding
    (it runs first); with a bf16 table it is the head."""
    bad = _copy(prose if storage == "packed" else prose_bf16, tmp_path / "bad")
    poke(bad, "lm_head.scales_and_zeros", lambda t: t[..., 0].fill_(BF16_MAX))
    lm = load(bad, prefill_threshold=4)
    with pytest.raises(DamagedCheckpointError, match=rf"logits of generated token 1 are not finite.*first non-finite output: {first}\."):
        generate(lm, PROMPT, SamplingParams(max_tokens=8))
    r = _subprocess_cli("generate", str(bad), PROMPT, "--max-tokens", "8")
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""  # no text at all
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"first non-finite output: {first}" in last and "edgeq inspect --verify" in last


def _damage_row(directory: Path, row: int) -> None:
    """One token's embedding row made non-finite with finite stored values where the load check cannot see it:
    a bf16 table's row NaN; a packed table's (the default) residual scales of that row at the bf16 maximum (finite,
    so load's NaN/Inf check on scales passes, but (q - 8) * scale overflows fp32 for |q - 8| >= 2: E's row is
    +-inf). scales_and_zeros is [K/G, V, 2], rows unpermuted."""
    if "model.embed_tokens.weight" in MappedFiles(directory).names():
        poke(directory, "model.embed_tokens.weight", lambda t: t[row].fill_(float("nan")))
    else:
        poke(directory, "model.embed_tokens.scales_and_zeros", lambda t: t[:, row, 0].fill_(BF16_MAX))


@pytest.mark.parametrize("storage", ["packed", "bf16"])
def test_a_damaged_embedding_row_stops_the_decode_loop_at_that_token(prose, prose_bf16, tmp_path, storage):
    """The fault shows only when a token whose embedding row is not finite is fed back (a decode step, the lean
    loop): generation streams the tokens before it, then stops naming the embedding, never a stream of empty
    tokens."""
    src = prose if storage == "packed" else prose_bf16
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    lm = load(src, prefill_threshold=4)
    clean = generate(lm, PROMPT, params)
    prompt_ids = encode_prompt(lm, PROMPT, chat=False)
    k = next(i for i, t in enumerate(clean.token_ids) if t not in prompt_ids and t not in clean.token_ids[:i])
    bad = _copy(src, tmp_path / "bad")
    _damage_row(bad, clean.token_ids[k])
    lm = load(bad, prefill_threshold=4)
    assert lm.settings.decode_loop == "lean"
    g = Generation(lm, prompt_ids, params)
    streamed = []
    with pytest.raises(DamagedCheckpointError, match=rf"generated token {k + 2} are not finite.*first non-finite output: model\.embed_tokens\."):
        for d in g:
            streamed.append(d)
    assert [t for d in streamed for t in d.token_ids] == clean.token_ids[: k + 1]  # the good prefix, nothing after


# --------------------------------------------------------------------------------------- config.json contradictions


def test_kernel_error_names_the_kernel_config_json_says(prose, tmp_path, capsys):
    bad = _copy(prose, tmp_path / "bad")
    _edit_config(bad, lambda c: c["quantization_config"].update(kernel="marlin"))
    code, out, err = run_cli(["generate", str(bad), PROMPT], capsys)
    assert code == 2 and out == ""
    assert "config.json: kernel 'marlin' is not one this runtime runs (tinygemm_w4a16, amx_w4a8)" in err


# values no machine's layout has (an edit to this machine's own value would be no edit)
@pytest.mark.parametrize("key, value", [("block_n", 48), ("cpu_capability", "NEON"), ("torch_version", "2.5.0"),
                                        ("op", "aten::other")])
def test_every_field_of_the_config_layout_record_is_checked(prose, tmp_path, capsys, key, value):
    bad = _copy(prose, tmp_path / "bad")
    _edit_config(bad, lambda c: c["quantization_config"]["layout"].update({key: value}))
    with pytest.raises(EdgeqError, match=rf"config.json quantization_config.layout.{key} .* differs from the manifest's"):
        load(bad, prefill_threshold=4)
    code, out, err = run_cli(["inspect", str(bad), "--strict"], capsys)
    assert code == 1 and f"quantization_config.layout.{key}" in out + err


def test_inspect_verify_strict_reports_a_hidden_size_load_refuses(prose, prose_bf16, tmp_path, capsys):
    bad = _copy(prose, tmp_path / "bad")
    _edit_config(bad, lambda c: c.update(hidden_size=128))
    with pytest.raises(EdgeqError, match="config.json implies"):
        load(bad, prefill_threshold=4)
    problems = inspect_checkpoint(bad, verify=True).problems
    # the default packed table: its level 0 is the head, and a plain tensor (the final norm) is named too
    assert any("lm_head: packed weight is [4096, 256] but config.json implies [4096, 128]" in p for p in problems)
    assert any("model.norm.weight: checkpoint shape [256] but config.json implies [128]" in p for p in problems)
    assert any("vocab_size 4096 x hidden_size 128, but the packed embedding model.embed_tokens is [4096, 256]" in p
               for p in problems), problems  # the table's own record, not only the head's
    bad_bf16 = _copy(prose_bf16, tmp_path / "bad-bf16")  # a bf16 table is a plain tensor: named by its shape
    _edit_config(bad_bf16, lambda c: c.update(hidden_size=128))
    problems = inspect_checkpoint(bad_bf16, verify=True).problems
    assert any("model.embed_tokens.weight: checkpoint shape [4096, 256] but config.json implies [4096, 128]" in p
               for p in problems), problems
    assert any("lm_head: packed weight is [4096, 256] but config.json implies [4096, 128]" in p for p in problems)
    code, _, err = run_cli(["inspect", str(bad), "--verify", "--strict"], capsys)
    assert code == 1 and "--strict" in err
    assert not [p for p in inspect_checkpoint(prose, verify=True).problems
                if "config.json implies" in p or "the packed embedding" in p]


# ------------------------------------------------------------------------------------------------------- log lines


@pytest.mark.slow
def test_the_repack_warning_is_one_message_without_source_paths(prose, tmp_path):
    foreign = tmp_path / "foreign"
    # 16-row blocks of adjacent rows: valid bytes, and no machine's own layout (so load repacks on every machine)
    repack(prose, foreign, layout=tinygemm.TinygemmLayout(block_n=16, perms=((16, tuple(range(16))),), cpu_capability="test"))
    r = _subprocess_cli("generate", str(foreign), PROMPT, "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    warning = [line for line in r.stderr.splitlines() if "REPACKED IN MEMORY" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: REPACKED IN MEMORY"), r.stderr
    assert ".py:" not in r.stderr and "warnings.warn" not in r.stderr


# ------------------------------------------------------------------------------ found by an audit (2026-12-04)

@pytest.mark.parametrize("value", [0.0, -0.01])
def test_a_scale_zero_or_negative_is_refused_at_load(prose, tmp_path, capsys, value):
    """A flipped sign bit in a scale gives plausible wrong text; the quantiser never writes a scale <= 0."""
    bad = _copy(prose, tmp_path / "bad")
    name = "model.layers.0.self_attn.q_proj.scales_and_zeros"
    poke(bad, name, lambda t: t[0, 3].__setitem__(0, value))
    code, out, err = run_cli(["generate", str(bad), PROMPT, "--max-tokens", "4"], capsys)
    assert code == 2 and out == ""
    assert err == (f"error: model.safetensors: tensor {name}: 1 scale(s) zero or negative; the file is damaged: "
                   "re-copy it or re-quantise (`edgeq inspect --verify` lists every damaged tensor)\n")


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", "256", "hidden_size is '256', must be a positive integer"),
    ("rms_norm_eps", "x", "transformers refuses it (Validation error for field 'rms_norm_eps': TypeError: Field "
                          "'rms_norm_eps' expected float, got str (value: 'x'))"),
    ("num_attention_heads", 0, "num_attention_heads is 0, must be a positive integer"),
    ("max_position_embeddings", -5, "max_position_embeddings is -5, must be a positive integer"),
    ("vocab_size", None, "transformers refuses it (Validation error for field 'vocab_size'"),
    ("quantization_config", "x", "quantization_config is str 'x', not an object"),
])
def test_a_config_field_of_the_wrong_type_or_value_is_one_line_not_a_traceback(prose, tmp_path, capsys, field, value,
                                                                                message):
    bad = _copy(prose, tmp_path / "bad")
    _edit_config(bad, lambda c: c.__setitem__(field, value))
    code, out, err = run_cli(["generate", str(bad), PROMPT, "--max-tokens", "4"], capsys)
    assert code == 2 and out == "" and err.startswith(f"error: {bad}/config.json: ") and message in err, err
    assert err.count("\n") == 1


def test_repack_refuses_a_damaged_source_instead_of_rehashing_it(prose, tmp_path, capsys):
    """repack writes new shards with new sha256s: copying flipped bytes would make them pass --verify afterwards."""
    bad = _copy(prose, tmp_path / "bad")
    poke(bad, "model.layers.0.mlp.down_proj.qweight", lambda t: t[:2].bitwise_xor_(0xFF))
    out = tmp_path / "out"
    code, _, err = run_cli(["repack", str(bad), "-o", str(out)], capsys)
    assert code == 2 and not out.exists()
    assert f"{bad / 'model.safetensors'}: sha256 " in err and "does not match the manifest's" in err


@pytest.mark.parametrize("side", ["quantised", "reference"])
def test_fidelity_of_a_model_with_nan_logits_is_an_error_not_a_report(prose, tmp_path, capsys, side):
    """NaN logits made a 'mean KLD nan' report on the quantised side and a perfect 'mean KLD 0.000000' on the
    reference side, both with exit 0."""
    bad = _copy(prose if side == "quantised" else Path(FIXTURE), tmp_path / "bad")
    poke(bad, "model.norm.weight", lambda t: t.__setitem__(7, float("nan")))
    text = tmp_path / "t.txt"
    text.write_text(Path(FIXTURE, "..", "heldout-prose.txt").resolve().read_text()[:4000])
    ref, quant = (FIXTURE, bad) if side == "quantised" else (bad, prose)
    code, out, err = run_cli(["fidelity", str(ref), str(quant), "--text", str(text), "--ctx", "128", "--json"], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith(f"error: the {side} model ({bad}): non-finite logits (NaN or Inf) "
                                                   "in window 1; its weights are damaged: "), err


def test_fidelity_save_ref_never_replaces_what_is_not_a_reference_file(prose, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(Path(FIXTURE, "..", "heldout-prose.txt").resolve().read_text()[:4000])
    before = text.read_bytes()
    code, _, err = run_cli(["fidelity", FIXTURE, "--text", str(text), "--ctx", "128", "--save-ref", str(text)], capsys)
    assert code == 2 and text.read_bytes() == before  # its own --text, once overwritten with the reference
    assert err.strip().splitlines()[-1] == (f"error: --save-ref {text}: exists and is not an edgeq reference file; "
                                            "edgeq replaces only its own reference files: choose another path")
    ref = tmp_path / "ref.safetensors"
    for _ in range(2):  # its own file it may replace
        code, _, err = run_cli(["fidelity", FIXTURE, "--text", str(text), "--ctx", "128", "--save-ref", str(ref), "-q"],
                               capsys)
        assert code == 0 and ref.is_file(), err


def test_a_path_the_system_refuses_is_one_line_naming_it(prose, tmp_path, capsys):
    """OSErrors (a directory given as a file, permissions, a read-only or full disk) reach the user as one line."""
    code, out, err = run_cli(["fidelity", FIXTURE, str(prose), "--text", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == f"error: {tmp_path}: Is a directory; give a file, not a directory", err
