"""The CLI keeps its promises: every default in --help, --version, --json on generate/serve/repack, one error format.

Everything runs through the real entry point (``edgeq.cli.main.main``, or ``python -m edgeq.cli`` for the server).
"""

import json
import os
import re
import select
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import typer

from edgeq import __version__
from edgeq.cli import main as cli

from helpers.paths import FIXTURE


def run(args, capsys):
    """(exit code, stdout, stderr) of ``edgeq ARGS``."""
    with pytest.raises(SystemExit) as e:
        cli.main(list(map(str, args)))
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


def flat(text: str) -> str:
    return " ".join(text.split())  # help is wrapped to the terminal width


def commands():
    return typer.main.get_command(cli.app).commands  # every command is registered when edgeq.cli.main is imported


@pytest.mark.parametrize("command, expected", [
    ("quantize", ["Output directory [default: MODEL-<scheme>]",
                  "calibration text, or 'self': token ids sampled from the model itself",
                  "of them) [default: self for the default command's quality recipe; with --method gptq or --recipe, "
                  "the bundled edgeq/data/calib-prose.txt]",
                  "[default: quality (--calib self) for float llama, mistral, qwen2, qwen3 at W4A16 unless --method is "
                  "given; else the recipe for config.json's model_type]",
                  "calibration windows [default: 128 for a text; for --calib self, max(32, ceil(4 x the widest "
                  "Linear input / --seqlen))]", "tokens per window [default: 512 for a text; 256 for --calib self]",
                  "[default: 0.01]", "e.g. 2GiB, 500MB. [default: 2GiB]"]),
    ("generate", ["[default: 64]", "0 = greedy. [default: 0.0]", "[default: random]", "[default: 256MiB]",
                  "[default: torch's default, one per physical core]"]),
    ("serve", ["[default: 127.0.0.1]", "[default: 8000]", "[default: 1MiB]", "[default: 8]",
               "[default: the checkpoint directory's name]"]),
    ("demo", ["[default: as edgeq quantize: w4a16-g256 for the bundled model]", "[default: 32]", "[default: 4096]"]),
])
def test_help_shows_the_defaults(command, expected, capsys):
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    for text in expected:
        assert text in flat(out), text


def test_quantize_help_states_the_calibration_defaults_the_code_uses():
    """The numbers in --nsamples/--seqlen help are the code's (the CLI module cannot import them: no torch at --help)."""
    from edgeq.convert import calibrated, selfcal

    assert (calibrated.TEXT_NSAMPLES, calibrated.TEXT_SEQLEN) == (128, 512)
    assert (selfcal.NSAMPLES, selfcal.TOKENS_PER_K, selfcal.SEQLEN) == (32, 4, 256)
    assert calibrated.GPTQOptions(calib="self").seqlen == 256 and calibrated.GPTQOptions().nsamples == 128
    assert selfcal.default_nsamples(768, 256) == 32 and selfcal.default_nsamples(8960, 256) == 140  # ceil(35840/256)
    assert selfcal.default_nsamples(8960, 512) == 70  # over --seqlen, not a fixed 256


@pytest.mark.parametrize("command", ["quantize", "recipes", "generate", "serve", "repack", "demo", "native",
                                     "inspect", "bench", "route", "fidelity"])
def test_help_is_click_style_and_no_default_vanishes(command, capsys):
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    text = flat(out)
    assert not re.search(r" \.( |$)", text)  # "calibration text ." is the trace of a [default: ...] eaten as markup
    for internal in ("<str>", "<int>", "<bool>", "<path>", "<float>", "<list", "{"):
        assert internal not in text, internal
    cmd = commands()[command]
    ctx = cmd.make_context(command, ["--help"], resilient_parsing=True)
    for p in cmd.params:  # every option that has a value by default says which
        if isinstance(p, typer.core.TyperOption) and not p.is_flag and p.default not in (None, [], ()):
            assert "default:" in p.get_help_record(ctx)[1], p.opts


def test_help_names_types_and_arguments_as_click_does(capsys):
    _, out, _ = run(["generate", "--help"], capsys)
    assert "Usage: edgeq generate [OPTIONS] MODEL PROMPT" in out
    assert "--max-tokens INTEGER" in out and "--temperature FLOAT" in out and "--stop TEXT" in out
    _, out, _ = run(["quantize", "--help"], capsys)
    assert "-o, --output PATH" in out


def test_every_command_is_registered_at_import_in_help_order():
    assert list(commands()) == ["quantize", "recipes", "generate", "serve", "repack", "demo", "native", "inspect",
                                "bench", "route", "fidelity"]


def test_help_imports_neither_torch_nor_transformers():
    """`edgeq --help` stays fast: the command modules import the heavy packages inside the commands' bodies."""
    code = ("import sys; from edgeq.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
            "    print(e.code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "0 False False"
    assert "Usage: edgeq [OPTIONS] COMMAND [ARGS]..." in r.stdout


def test_python_m_edgeq_cli_is_the_command():
    r = subprocess.run([sys.executable, "-m", "edgeq.cli", "recipes", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stderr == ""
    assert {"llama"} <= {x["name"] for x in json.loads(r.stdout)}


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads 0: must be between 1 and this machine's"),
    (["--threads", "100000"], "--threads 100000: must be between 1 and this machine's"),  # was a SIGSEGV, no message
    (["--seed", str(2**70)], f"seed={2**70}: must be in [-2^63, 2^64)"),
    (["--temperature", "inf"], "temperature=inf: must be a finite number >= 0"),
])
def test_generate_refuses_option_values_torch_cannot_take(fixture_quantized, capsys, args, message):
    code, out, err = run(["generate", fixture_quantized, "Once", "--max-tokens", "2", *args], capsys)
    assert code == 2 and out == "" and err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_generate_refuses_a_prompt_that_is_not_utf8(fixture_quantized, capsys):
    prompt = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv
    code, out, err = run(["generate", fixture_quantized, prompt, "--max-tokens", "2"], capsys)
    assert code == 2 and out == ""
    assert err == "error: PROMPT: not valid UTF-8 (position 3); pass the prompt as UTF-8 text\n"


def test_fidelity_interrupted_prints_the_partial_report_and_one_line(fixture_quantized, capsys, monkeypatch):
    from edgeq.fidelity import loop

    calls, window_logits = [], loop.window_logits

    def interrupted_at_the_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return window_logits(*a, **k)

    monkeypatch.setattr(loop, "window_logits", interrupted_at_the_third)
    code, out, err = run(["fidelity", FIXTURE, fixture_quantized, "--ctx", "64", "--json"], capsys)
    report = json.loads(out)
    assert code == 2 and report["partial"] is True and report["windows"] == 2
    assert err.strip().splitlines() == ["interrupted: the statistics above are partial"]


def test_an_error_is_one_line_also_where_a_progress_bar_would_run(fixture_quantized, tmp_path, capsys):
    """Without -q a progress bar ran on a non-terminal stderr too, and stopping it left a blank line first."""
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    code, _, err = run(["quantize", FIXTURE, "-o", tmp_path / "busy"], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, repr(err)
    code, _, err = run(["fidelity", FIXTURE, fixture_quantized, "--ctx", "2"], capsys)
    assert code == 2 and err.startswith("error: --ctx 2: ") and err.count("\n") == 1, repr(err)


def test_messages_name_what_is_wrong_with_the_path(fixture_quantized, tmp_path, capsys):
    """A file given as a checkpoint, a directory as --ref, an unreadable tokenizer.json: each said something vaguer."""
    (tmp_path / "notes.txt").write_text("x")
    code, _, err = run(["generate", tmp_path / "notes.txt", "hi"], capsys)
    assert code == 2 and err == (f"error: {tmp_path / 'notes.txt'}: is a file, not a checkpoint directory; give the "
                                 "directory that holds config.json\n")
    code, _, err = run(["fidelity", fixture_quantized, "--ref", tmp_path], capsys)
    assert code == 2 and err.strip().endswith(f"{tmp_path}: is a directory; --ref takes the file --save-ref wrote")
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(fixture_quantized, broken)
    (broken / "tokenizer.json").write_text("{bad")
    code, _, err = run(["generate", broken, "hi", "--max-tokens", "2"], capsys)
    assert code == 2 and err.startswith(f"error: {broken}: tokenizer files present but unreadable (tokenizer.json")
    assert err.endswith("re-copy them from the source model\n")


def test_fidelity_ctx_0_is_refused_not_the_default(fixture_quantized, capsys):
    code, out, err = run(["fidelity", FIXTURE, fixture_quantized, "--ctx", "0"], capsys)
    assert code == 2 and out == "" and err.strip().endswith("--ctx 0: a window needs at least 3 tokens to score any; "
                                                            "use --ctx 512"), err


def test_fidelity_help_default_is_the_reference_files_k():
    """cli/fidelity.py writes DEFAULT_REF_TOPK itself (the fidelity package imports torch): the two agree."""
    from edgeq.cli import fidelity as command
    from edgeq.fidelity.reffile import DEFAULT_REF_TOPK

    assert command.DEFAULT_REF_TOPK == DEFAULT_REF_TOPK


def test_version_is_one_line_with_versions_and_kernel_state(capsys):
    from importlib.metadata import version

    code, out, err = run(["--version"], capsys)
    assert code == 0 and err == ""
    assert out.count("\n") == 1
    assert out.startswith(f"edgeq {__version__}, torch {torch.__version__}, transformers {version('transformers')}; ")
    assert "native kernels: w4a16 " in out and ", w4a8 " in out
    assert all(state in ("built", "not built yet (`edgeq native`)")
               for state in (out.split("w4a16 ")[1].split(", w4a8")[0], out.split("w4a8 ")[1].strip()))


def test_generate_json_is_one_record_and_nothing_else(capsys):
    code, out, err = run(["generate", FIXTURE, "The module", "--max-tokens", "6", "--json"], capsys)
    assert code == 0
    assert err == ""  # no load line, no speed line
    record = json.loads(out)  # the whole stdout: no streamed text before it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FIXTURE)
    assert 1 <= len(record["token_ids"]) <= 6
    assert record["text"] == tok.decode(record["token_ids"], skip_special_tokens=True)
    assert record["prompt_tokens"] == len(tok("The module")["input_ids"])
    assert record["finish_reason"] in ("stop", "length")
    t = record["timings"]
    assert t["load_s"] > 0 and t["prefill_s"] > 0 and t["prefill_tokens_per_s"] > 0
    paths = record["paths"]
    assert paths["scheme"] == "bf16" and paths["prefill_crossover"] is None
    assert sum(paths["calls"].values()) > 0 and sum(paths["loop_calls"].values()) == len(record["token_ids"])


def test_generate_streams_text_and_bf16_names_no_crossover(capsys):
    code, out, err = run(["generate", FIXTURE, "The module", "--max-tokens", "4"], capsys)
    assert code == 0 and out.strip()
    assert "prefill bf16," in err and "None" not in err
    code, out2, err = run(["generate", FIXTURE, "The module", "--max-tokens", "4", "-q"], capsys)
    assert code == 0 and out2 == out and err == ""  # greedy: the same text; -q: nothing on stderr


@pytest.mark.slow
def test_serve_json_startup_line(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "edgeq.cli", "serve", str(FIXTURE), "--host", "127.0.0.1",
                             "--port", "0", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready, "no startup line within 300 s"
        record = json.loads(proc.stdout.readline())
        assert record["event"] == "listening" and record["host"] == "127.0.0.1" and record["port"] > 0
        assert record["url"] == f"http://127.0.0.1:{record['port']}" and record["pid"] == proc.pid
        assert record["scheme"] == "bf16" and record["model_name"] == "tiny-prose"
        # the socket was bound before the line was printed: the server answers at once
        with urllib.request.urlopen(f"{record['url']}/health", timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["model"] == "tiny-prose"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.stdout.read() == ""  # nothing after the startup line (no access log on stdout)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_serve_stops_on_a_signal_at_once_and_says_so(sig):
    """SIGTERM (docker stop, systemd) and Ctrl-C end a generation in progress (503 to its client) instead of waiting
    for it, and a requested stop is success: exit 0, one line, no traceback."""
    import signal
    import threading

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "edgeq.cli", "serve", str(FIXTURE), "--port", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready, "no startup line within 300 s"
        url = json.loads(proc.stdout.readline())["url"]
        answer = {}
        body = json.dumps({"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})

        def stream():
            with urllib.request.urlopen(request, timeout=60) as r:
                answer["first"] = r.readline()  # the first event: the generation is running
                started.set()
                answer["rest"] = r.read().decode()

        started = threading.Event()
        client = threading.Thread(target=stream)
        client.start()
        assert started.wait(120) and answer["first"].startswith(b"data: {")
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(timeout=30) == 0
        client.join(30)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert f"edgeq serve: stopped ({sig})" in err and "Traceback" not in err, err
    assert '"code": "server_shutting_down"' in answer["rest"] and answer["rest"].endswith("data: [DONE]\n\n")


def test_serve_port_in_use_names_the_flag(capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, out, err = run(["serve", FIXTURE, "--port", port, "--json"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: --host 127.0.0.1 --port") and "--port 0 picks a free one" in err


def test_repack_says_what_it_did(fixture_quantized, tmp_path, capsys):
    """Already this machine's layout: in place nothing happens; with -o a copy is still written, and it says so."""
    out_dir = tmp_path / "copy"
    code, _, err = run(["repack", fixture_quantized, "-o", out_dir], capsys)
    assert code == 0 and (out_dir / "config.json").is_file()
    assert err.startswith(f"{out_dir}: copied from {fixture_quantized}, already packed for this machine (layout ")
    code, _, err = run(["repack", out_dir], capsys)
    assert code == 0 and err.startswith(f"{out_dir}: already packed for this machine (") and "nothing to do" in err


def test_repack_json_summary(fixture_quantized, tmp_path, capsys):
    out_dir = tmp_path / "repacked"
    code, out, err = run(["repack", fixture_quantized, "-o", out_dir, "--json"], capsys)
    assert code == 0
    r = json.loads(out)
    assert r["path"] == str(out_dir.resolve()) and (out_dir / "config.json").exists()
    assert set(r) >= {"changed", "tensors", "bytes_repacked", "seconds", "old_layout_hash", "new_layout_hash"}
    assert r["changed"] is False  # packed on this machine: the layout already matches


@pytest.mark.parametrize("args, message", [
    (["quantiz"], "error: No such command 'quantiz'. Did you mean 'quantize'? (see 'edgeq --help')"),
    (["quantize", "m", "--sceme", "w4a16-g128"], "error: No such option: --sceme. Did you mean '--scheme'"),
    (["generate"], "error: Missing argument 'MODEL' (see 'edgeq generate --help')"),
    (["generate", "m", "p", "--max-tokens", "x"], "error: Invalid value for '--max-tokens'"),
])
def test_usage_errors_look_like_edgeq_errors(args, message, capsys):
    code, out, err = run(args, capsys)
    assert code == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1  # one line, as for an EdgeqError


@pytest.mark.parametrize("args, message", [
    (["--scheme", "w4a16-g12"], "error: unknown scheme 'w4a16-g12'; valid: "),
    (["--method", "gtpq"], "error: unknown --method 'gtpq'; valid: "),
])
def test_scheme_and_method_typos_suggest_the_name(args, message, capsys):
    code, out, err = run(["quantize", FIXTURE, "--dry-run", *args], capsys)
    assert code == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1
    assert err.rstrip().endswith("did you mean 'w4a16-g128' or 'w4a16-g32'?" if "scheme" in message
                                 else "did you mean 'gptq'?")


def test_scheme_suggestion_only_when_close():
    from edgeq.errors import EdgeqError
    from edgeq.scheme import Scheme

    with pytest.raises(EdgeqError, match=r"did you mean 'w4a16-g128'"):
        Scheme.parse("w4a16g128")
    with pytest.raises(EdgeqError) as e:
        Scheme.parse("int4")
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize("args, flag", [
    (["generate", FIXTURE, "hi", "--kv-cache-bytes", "12XB"], "--kv-cache-bytes"),
    (["serve", FIXTURE, "--max-body-bytes", "1 MiBs"], "--max-body-bytes"),
    (["quantize", FIXTURE, "--dry-run", "--max-shard-size", "12XB"], "--max-shard-size"),
    (["inspect", FIXTURE, "--kv-cache-bytes", "12XB"], "--kv-cache-bytes"),
])
def test_bad_size_names_its_flag(args, flag, capsys):
    code, out, err = run(args, capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"error: {flag}: cannot read ") and "as a byte size; use e.g. 256MiB" in err


@pytest.mark.slow
def test_demo_reports_progress_and_labels_single_shot_speeds(capsys):
    code, out, err = run(["demo", "--max-tokens", "4", "--fidelity-tokens", "256"], capsys)
    assert code == 0
    steps = [line for line in err.splitlines() if line.startswith("[")]
    assert [s[:5] for s in steps] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"]
    assert "warm up" in steps[3] and "(timed)" in steps[4] and "window 1/" in err
    assert "single shot: one timed generation after one untimed warm-up" in out
    assert "s (one run)" in out
    assert "-> w4a16-g256 (gptq, recipe quality)" in out  # as the plain `edgeq quantize` converts it
