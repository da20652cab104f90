"""Writers (quantize, repack) and the user's files: an output that would destroy an input, SIGTERM and SIGKILL
mid-write, leftovers of dead writers, durability of the commit, a model without tokenizer files, the layout named
on the summary line. Every test goes through the real CLI (in process, or ``python -m edgeq.cli.main`` for signals)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgeq.convert.pipeline import convert
from edgeq.inspect.report import inspect_checkpoint
from helpers.checkpoints import dir_digest, foreign_layout
from helpers.cli import run_cli
from helpers.models import save_tiny
from helpers.paths import FIXTURE

TINY_PROSE = FIXTURE  # large enough that its write lasts seconds


@pytest.fixture
def model(tmp_path):
    """A tiny llama (no tokenizer files) in tmp_path/p/m."""
    return save_tiny("llama", tmp_path / "p" / "m", tied=True)


def _temps(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if ".edgeq-" in p.name)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------------ output vs input paths


@pytest.mark.parametrize("where, relation", [("m", "is"), (".", "contains"), ("m/q", "is inside")])
@pytest.mark.parametrize("force", [True, False])
def test_output_that_is_contains_or_lies_inside_the_input_is_refused(model, capsys, where, relation, force):
    before = dir_digest(model)
    out = (model.parent / where).resolve()
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), "-q", *(["--force"] if force else [])], capsys)
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"the output directory {relation} the input {model}" in err and "choose an output directory outside" in err
    assert dir_digest(model) == before and not (model / "q").exists()
    assert _temps(model.parent) == [] and _temps(model) == []


@pytest.mark.parametrize("command", ["quantize", "repack"])
@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_an_output_that_is_not_a_directory_is_never_replaced(model, tmp_path, capsys, command, kind):
    """--force replaces an earlier output directory, nothing else: `-o /dev/null --force` once deleted the device."""
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("the user's notes")
    else:
        os.mkfifo(out)
    src = model
    if command == "repack":
        src = tmp_path / "q"
        convert(model, src)
    code, _, err = run_cli([command, str(src), "-o", str(out), *(["-q", "--force"] if command == "quantize" else [])],
                           capsys)
    line = err.splitlines()[-1]  # repack's source has no tokenizer files: a warning comes first
    assert code == 2 and line.startswith(f"error: {out}: exists and is ") and err.count("error:") == 1, err
    assert line.endswith("choose another output path")
    assert out.read_text() == "the user's notes" if kind == "file" else out.is_fifo()
    assert _temps(tmp_path) == []


def test_an_output_under_a_file_is_refused(model, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code, _, err = run_cli(["quantize", str(model), "-o", str(tmp_path / "f" / "sub"), "-q"], capsys)
    assert code == 2 and err == f"error: {tmp_path / 'f'}: is not a directory; choose an output path inside a directory\n"


def test_output_reached_through_a_symlink_is_refused(model, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(model)
    before = dir_digest(model)
    code, _, err = run_cli(["quantize", str(model), "-o", str(link), "-q", "--force"], capsys)
    assert code == 2 and f"the output directory is the input {model}" in err, err
    assert dir_digest(model) == before


def test_repack_output_inside_or_equal_to_the_input_is_refused(model, tmp_path, capsys):
    q = tmp_path / "q"
    convert(model, q)
    before = dir_digest(q)
    for out, relation in ((q / "sub", "is inside"), (q, "is")):
        code, _, err = run_cli(["repack", str(q), "-o", str(out)], capsys)
        assert code == 2 and f"the output directory {relation} the input {q}" in err, err
    assert dir_digest(q) == before and not (q / "sub").exists() and _temps(tmp_path) == []


# ---------------------------------------------------------------------------------------------- signals mid-write


def _start_and_freeze(src: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    """``python -m edgeq.cli.main quantize`` in a child, stopped (SIGSTOP) while its temporary directory exists."""
    proc = subprocess.Popen([sys.executable, "-m", "edgeq.cli", "quantize", str(src), "-o", str(out), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        tmps = list(out.parent.glob(f".{out.name}.edgeq-tmp-{proc.pid}"))
        if tmps:
            os.kill(proc.pid, signal.SIGSTOP)
            while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                time.sleep(0.001)  # SIGSTOP is asynchronous: wait until the child has really stopped
            if tmps[0].exists():  # frozen mid-write
                return proc, tmps[0]
            os.kill(proc.pid, signal.SIGCONT)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.001)
    proc.kill()
    raise AssertionError("the child never started writing")


@pytest.mark.slow
def test_sigterm_mid_write_removes_the_temporary_directory(tmp_path):
    src = tmp_path / "m"
    shutil.copytree(TINY_PROSE, src)
    before = dir_digest(src)
    proc, tmp = _start_and_freeze(src, tmp_path / "out")
    os.kill(proc.pid, signal.SIGTERM)  # what timeout, docker stop and systemd send
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err  # as Ctrl-C: exit 2
    assert "interrupted: nothing was written (partial output removed)" in err and "Traceback" not in err
    assert not tmp.exists() and _temps(tmp_path) == [] and not (tmp_path / "out").exists()
    assert dir_digest(src) == before


@pytest.mark.slow
def test_sigkill_leftover_is_removed_by_the_next_run(tmp_path, capsys):
    src = tmp_path / "m"
    shutil.copytree(TINY_PROSE, src)
    out = tmp_path / "out"
    proc, tmp = _start_and_freeze(src, out)
    os.kill(proc.pid, signal.SIGKILL)  # no handler runs: the directory stays
    proc.communicate(timeout=60)
    assert tmp.is_dir()
    other = tmp_path / f".out2.edgeq-tmp-{proc.pid}"  # another output's leftover: not this writer's to judge
    other.mkdir()
    small = save_tiny("llama", tmp_path / "small", tied=True)
    code, _, err = run_cli(["quantize", str(small), "-o", str(out), "-q"], capsys)
    assert code == 0, err
    assert f"removed {tmp}: left by process {proc.pid}, which is no longer running" in err
    assert not tmp.exists() and other.is_dir() and (out / "edgeq_manifest.json").is_file()


def test_sigterm_during_the_final_rename_is_held_until_it_is_done(model, tmp_path, capsys, monkeypatch):
    from edgeq.io import writer

    real = writer.replace_dir
    calls = []

    def signalled(tmp, out):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-commit: must neither tear it nor kill the process
        calls.append(out)
        real(tmp, out)

    monkeypatch.setattr(writer, "replace_dir", signalled)
    old_handler = signal.getsignal(signal.SIGTERM)
    code, _, err = run_cli(["quantize", str(model), "-o", str(tmp_path / "out"), "-q"], capsys)
    assert code == 0 and calls == [tmp_path / "out"], err
    assert f"SIGTERM arrived during the final rename; {tmp_path / 'out'} is complete" in err
    assert (tmp_path / "out" / "edgeq_manifest.json").is_file() and _temps(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is old_handler  # the writer's handler is gone again


def test_temporary_directory_of_a_live_writer_is_left_alone(model, tmp_path, capsys):
    live = subprocess.Popen(["sleep", "120"])
    try:
        busy = tmp_path / f".out.edgeq-tmp-{live.pid}"
        busy.mkdir()
        (busy / "model.safetensors").write_bytes(b"in progress")
        code, _, err = run_cli(["quantize", str(model), "-o", str(tmp_path / "out"), "-q"], capsys)
        assert code == 0, err
        assert (busy / "model.safetensors").read_bytes() == b"in progress" and "removed" not in err
    finally:
        live.kill()
        live.wait()


def test_previous_output_set_aside_by_a_dead_replacement_is_put_back(model, tmp_path, capsys):
    out = tmp_path / "out"
    convert(model, out)
    before = dir_digest(out)
    pid = _dead_pid()
    aside = tmp_path / f".out.edgeq-old-{pid}"
    out.rename(aside)  # what replace_dir does first; the process died before renaming the new one in
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), "-q"], capsys)
    assert f"restored {out} from {aside.name}: process {pid} had set it aside" in err
    assert code == 2 and "exists and is not empty" in err  # the user's output is back, and --force still rules
    assert dir_digest(out) == before and not aside.exists()


# --------------------------------------------------------------------------------------------------- durability


def test_commit_fsyncs_every_file_and_both_directories(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    synced: list[tuple[str, bool]] = []  # (path fsynced, whether out existed at that moment)
    real = os.fsync

    def record(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), out.exists()))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), "-q"], capsys)
    assert code == 0, err
    tmp = f"{tmp_path}/.out.edgeq-tmp-{os.getpid()}"
    before_rename = {p for p, done in synced if not done}
    assert {tmp, *(f"{tmp}/{f.name}" for f in out.iterdir())} <= before_rename  # every file, and the directory
    assert (str(tmp_path), True) in synced  # the parent, after the rename: the new name is on disk


def test_repack_commit_is_fsynced_too(model, tmp_path, monkeypatch):
    from edgeq.runtime.repacker import repack

    q = tmp_path / "q"
    convert(model, q)
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    assert repack(q, layout=foreign_layout()).changed
    tmp = f"{tmp_path}/.q.edgeq-repack-{os.getpid()}"
    assert {tmp, *(f"{tmp}/{f.name}" for f in q.iterdir())} <= set(synced) and str(tmp_path) in synced


# ------------------------------------------------------------------------------------------ tokenizer and layout


def test_missing_tokenizer_is_a_warning_at_quantize_and_a_problem_in_inspect(model, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run_cli(["quantize", str(model), "-o", str(out), "-q"], capsys)
    assert code == 0 and stdout.startswith("wrote ")
    assert f"warning: {model}: no tokenizer files (none of tokenizer.json, tokenizer.model, vocab.json)" in err
    assert "`edgeq generate` and `serve` cannot encode text" in err
    problems = inspect_checkpoint(out).problems
    assert any(p.startswith(f"{out}: no tokenizer files") for p in problems), problems
    # with one tokenizer file: neither
    shutil.copy(TINY_PROSE / "tokenizer.json", model / "tokenizer.json")
    code, _, err = run_cli(["quantize", str(model), "-o", str(tmp_path / "out2"), "-q"], capsys)
    assert code == 0 and "tokenizer" not in err
    assert not any("tokenizer" in p for p in inspect_checkpoint(tmp_path / "out2").problems)


@pytest.mark.slow
def test_summary_line_names_the_layout_forced_by_aten_cpu_capability(model, tmp_path):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    r = subprocess.run([sys.executable, "-m", "edgeq.cli", "quantize", str(model), "-o", str(tmp_path / "out"), "-q"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith(f"wrote {tmp_path / 'out'}") and "layout tinygemm AVX2 " in first, first
    assert "32-row blocks, because ATEN_CPU_CAPABILITY=avx2 is set" in first and "repack at every load" in first
    layout = json.loads((tmp_path / "out" / "edgeq_manifest.json").read_text())["layout"]
    assert layout["cpu_capability"] == "AVX2" and layout["layout_hash"][:12] in first


def test_summary_line_without_the_variable_says_torch_chose(model, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)  # read when the line is made
    code, stdout, _ = run_cli(["quantize", str(model), "-o", str(tmp_path / "out"), "-q", "--json"], capsys)
    report = json.loads(stdout)
    assert code == 0 and report["layout"].startswith("tinygemm ") and "torch's dispatch on this CPU" in report["layout"]
    assert report["warnings"] and "no tokenizer files" in report["warnings"][0]


# ------------------------------------------------------------------- interrupts while libraries load (audit 2026-12-04)

def test_interrupts_deferred_hold_a_real_signal_until_the_block_ends():
    from edgeq.io import writer

    writer.RECEIVED.clear()
    reached = []
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        with writer.interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler has run by now: it recorded, it did not raise
            reached.append(True)
    assert reached == [True] and writer.RECEIVED == [signal.SIGINT]


def test_ctrl_c_while_libraries_load_is_an_interruption_not_a_traceback(model, tmp_path, capsys, monkeypatch):
    """A Ctrl-C inside torch's import used to come out as an ImportError/RecursionError traceback (exit 1) from a
    half-imported numpy, or be lost (the conversion ran to the end, exit 0): both through the real entry point."""
    from edgeq.cli import main as cli_main

    def interrupted_import(args):
        with cli_main.interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)

    out = tmp_path / "out"
    monkeypatch.setattr(cli_main, "_load_libraries", interrupted_import)
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), "-q"], capsys)
    assert code == 2 and err == "interrupted: nothing was written (partial output removed)\n" and not out.exists()

    def library_turns_it_into_an_import_error(args):  # what numpy's half-initialised import did with the signal
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        except KeyboardInterrupt:
            raise ImportError("cannot load module more than once per process") from None

    monkeypatch.setattr(cli_main, "_load_libraries", library_turns_it_into_an_import_error)
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), "-q"], capsys)
    assert code == 2 and err == "interrupted: nothing was written (partial output removed)\n" and not out.exists()
