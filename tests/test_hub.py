"""Hub ids (org/name) for every command, through one resolver (edgeq.io.hub): the Hugging Face cache, offline mode,
--revision, and errors that name their cause. No network: a fake cache laid out like huggingface_hub's
(models--org--name/refs/<ref>, snapshots/<commit>/files), and a refused local port standing in for a dead network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgeq.bench import run as bench
from edgeq.io import hub
from edgeq.errors import EdgeqError
from helpers.cli import run_cli
from helpers.paths import FIXTURE, REPO

BF16, W4 = "edgeq-test/tiny-prose", "edgeq-test/tiny-prose-w4"
REV_BF16, REV_W4 = "1" * 40, "2" * 40


def _snapshot(cache: Path, repo_id: str, commit: str, files_from: Path, refs: tuple[str, ...]) -> Path:
    """One snapshot of a cached repo: files symlinked (as the real cache links snapshots to blobs), refs -> commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in files_from.iterdir():
        (snap / f.name).symlink_to(f)
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snap


@pytest.fixture(scope="module")
def cache(tmp_path_factory, fixture_quantized) -> Path:
    """BF16: main -> the bundled bf16 model, tag w4 -> its w4a16 checkpoint; W4: main -> the w4a16 checkpoint."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    _snapshot(root, BF16, REV_BF16, FIXTURE, ("main",))
    _snapshot(root, BF16, REV_W4, fixture_quantized, ("w4",))
    _snapshot(root, W4, REV_W4, fixture_quantized, ("main",))
    return root


def _snap(cache: Path, repo_id: str, commit: str) -> str:
    return str(cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit)


@pytest.fixture
def offline_hub(cache, monkeypatch, tmp_path):
    """HF_HUB_CACHE=cache, HF_HUB_OFFLINE=1. huggingface_hub reads both at import, so its constants are set too."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local directory shadows the hub ids
    return cache


@pytest.fixture
def dead_network(offline_hub, monkeypatch):
    """Offline mode off, and the hub endpoint a local port nobody listens on: every request fails to connect."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    return offline_hub


def _ok(args, capsys) -> tuple[str, str]:
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    return out, err


def _refused(args, capsys) -> str:
    code, out, err = run_cli(args, capsys)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------------------- every command
def test_inspect_reads_hub_ids_and_revisions_from_the_cache(offline_hub, capsys):
    report = json.loads(_ok(["inspect", BF16, "--json"], capsys)[0])
    assert report["path"] == _snap(offline_hub, BF16, REV_BF16) and report["kind"] == "hf"
    for rev in ("w4", REV_W4):  # a tag, and a commit
        report = json.loads(_ok(["inspect", BF16, "--revision", rev, "--json"], capsys)[0])
        assert report["path"] == _snap(offline_hub, BF16, REV_W4) and report["kind"] == "edgeq"


def test_quantize_and_generate_read_hub_ids(offline_hub, capsys):
    plan = json.loads(_ok(["quantize", BF16, "--dry-run", "--json"], capsys)[0])
    assert plan["problems"] == [] and plan["bytes_out"] < plan["bytes_in"]
    out, err = _ok(["generate", W4, "Once upon a time", "--max-tokens", "2"], capsys)
    assert f"loaded {_snap(offline_hub, W4, REV_W4)} in" in err and out.strip()


def test_serve_reads_hub_ids_and_names_the_model_by_its_id(offline_hub, capsys, monkeypatch):
    import edgeq.runtime.serve as serve

    seen = {}
    monkeypatch.setattr(serve, "serve_command", lambda path, **kw: seen.update(path=path, name=kw["model_name"]))
    _ok(["serve", BF16, "--revision", "w4"], capsys)
    assert seen == {"path": _snap(offline_hub, BF16, REV_W4), "name": BF16}


def test_fidelity_reads_hub_ids_and_refuses_them_swapped(offline_hub, capsys):
    common = ["--ctx", "32", "--max-tokens", "16", "--json"]
    report = json.loads(_ok(["fidelity", BF16, W4, *common], capsys)[0])
    assert report["tokens_scored"] == 16 and report["kld_mean"] > 0
    err = _refused(["fidelity", W4, BF16, *common], capsys)
    assert "is an edgeq checkpoint and QUANT" in err and "the order is REF QUANT" in err


def test_bench_reads_hub_ids_for_both_arms(offline_hub, capsys, monkeypatch):
    seen = {}

    def stop(arms, cfg, progress=None):  # the arms as they would be measured; no pass is run
        seen["arms"] = [a.checkpoint for a in arms]
        raise EdgeqError("stopped before measuring")

    monkeypatch.setattr(bench, "run_bench", stop)
    assert "stopped before measuring" in _refused(["bench", W4, "--vs", BF16], capsys)
    assert seen["arms"] == [_snap(offline_hub, W4, REV_W4), _snap(offline_hub, BF16, REV_BF16)]


# ------------------------------------------------------------------------------------------------ failures
MISSING = "no-org/no-model"


@pytest.mark.parametrize("args", [["inspect", MISSING], ["quantize", MISSING, "-q"], ["generate", MISSING, "hi"],
                                  ["serve", MISSING], ["fidelity", MISSING, str(FIXTURE)], ["bench", MISSING]])
def test_missing_id_offline_says_offline_mode_for_every_command(offline_hub, capsys, args):
    err = _refused(args, capsys)
    assert err.startswith("error: no-org/no-model: no such local directory, and fetching it from the Hugging Face "
                          "hub failed: not in the local cache")
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in err and "could not be reached" not in err


def test_network_failure_is_named_and_the_cache_still_serves(dead_network, capsys):
    err = _refused(["inspect", "no-org/no-model"], capsys)
    assert "the hub could not be reached (ConnectError" in err and "offline mode is on" not in err
    assert "HF_HUB_OFFLINE=1 to use only the cache" in err
    # a model already in the cache is used when the hub cannot be asked for a newer revision
    assert json.loads(_ok(["inspect", W4, "--json"], capsys)[0])["path"] == _snap(dead_network, W4, REV_W4)


def test_revision_of_a_local_directory_and_a_missing_path_are_refused(offline_hub, capsys):
    err = _refused(["inspect", str(FIXTURE), "--revision", "main"], capsys)
    assert "--revision main: applies to hub ids" in err and "is a local path; drop --revision" in err
    err = _refused(["inspect", "no/such/dir"], capsys)
    assert "no/such/dir: no such directory (nor a hub id of the form org/name)" in err


def test_hub_errors_name_their_cause():
    """The remaining causes, from the exceptions huggingface_hub raises for them."""
    from huggingface_hub import errors

    def raised(cls):  # the instance without its HTTP response: only its type matters here
        return cls.__new__(cls)

    assert "no such repository on the hub, or it is private" in hub.explain(raised(errors.RepositoryNotFoundError))
    assert "gated" in hub.explain(raised(errors.GatedRepoError))
    assert "no revision 'v9'" in hub.explain(raised(errors.RevisionNotFoundError), "v9")


@pytest.mark.slow
def test_environment_variables_in_a_fresh_process(cache, tmp_path):
    """The documented way: HF_HUB_CACHE and HF_HUB_OFFLINE in the environment of the real command."""
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "edgeq.cli", "inspect", W4, "--json"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["path"] == _snap(cache, W4, REV_W4)


def test_repack_refuses_a_hub_id_naming_the_fix(capsys, tmp_path, monkeypatch):
    """repack writes in place: a hub id (never a directory here) is refused before anything is read or written."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["repack", "org/some-model"], capsys)
    assert code == 2 and out == ""
    assert err.strip() == ("error: org/some-model: repack rewrites a local checkpoint directory, and this is a hub id; "
                           "download it first (huggingface-cli download org/some-model --local-dir DIR), then run "
                           "edgeq repack DIR")
    assert list(tmp_path.iterdir()) == []
