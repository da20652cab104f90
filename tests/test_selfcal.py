"""``--calib self``: GPTQ calibration on token ids sampled from the model being quantised (edgeq/convert/selfcal.py).

The sampler is checked against hand-worked inverse-CDF draws and against the float model itself (each sampled id is
the draw of the reference forward's distribution for the recorded uniform, within the bf16 rounding of the cached
decode); determinism is checked within this machine only (other CPU classes round the float forward differently,
see the module docstring). The bundled model goes through the real CLI, and the result must beat a KLD bound that
the default RTN fails.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from edgeq import cpu
from edgeq.convert import selfcal
from edgeq.convert.calibrated import GPTQOptions
from edgeq.errors import EdgeqError
from edgeq.io.manifest import read_manifest
from helpers.cli import run_cli
from helpers.models import save_tiny
from helpers.paths import FIXTURE

# Mean KLD (6,120 held-out tokens) that --calib self at its default size must beat on the bundled model. Measured
# (docs/gptq.md, "Calibration without data"): 0.00344-0.00355 over seeds 0-2 at 32 x 256; the default RTN 0.0062.
KLD_BOUND = 0.0045


def test_draw_is_the_inverse_cdf():
    """p = (0.5, 0.3, 0.2): cumsum (0.5, 0.8, 1.0); u = 0.6 -> 1, u = 0 -> 0, u = 0.5 -> 1 (first cdf > 0.5),
    u -> 1 -> 2. A zero-probability id is never drawn; unnormalised rows are scaled by their sum."""
    p = torch.tensor([[0.5, 0.3, 0.2]] * 4)
    u = torch.tensor([0.6, 0.0, 0.5, 1 - 2**-40], dtype=torch.float64)
    assert selfcal.draw(p, u).tolist() == [1, 0, 1, 2]
    z = torch.tensor([[0.5, 0.0, 0.5]] * 3)
    assert selfcal.draw(z, torch.tensor([0.5, 0.4999, 0.0], dtype=torch.float64)).tolist() == [2, 0, 0]
    assert selfcal.draw(torch.tensor([[2.0, 6.0]]), torch.tensor([0.3], dtype=torch.float64)).tolist() == [1]


def test_rows_per_batch_fit_the_kv_budget():
    """Qwen2.5-1.5B at seqlen 256: 28 layers * 2 (K, V) * 2 heads * 128 * 2 bytes = 28,672 bytes per position,
    7.4 MB per sequence: 128 rows (the cap, 946 MB). A Llama-7B-like config (32 layers, 32 KV heads of 128) at 2048:
    524,288 bytes per position, 1,074 MB per sequence, over the 1 GiB budget: 1 row (no batch exceeds what one
    sequence needs); at 512, 269 MB per sequence: 3 rows. 8 KV heads at 256: 33.7 MB per sequence, 31 rows."""
    qwen = SimpleNamespace(num_hidden_layers=28, num_key_value_heads=2, num_attention_heads=12, head_dim=128, hidden_size=1536)
    assert selfcal.rows_per_batch(qwen, 256) == 128
    llama7b = SimpleNamespace(num_hidden_layers=32, num_key_value_heads=32, num_attention_heads=32, head_dim=None, hidden_size=4096)
    assert selfcal.rows_per_batch(llama7b, 2048) == 1
    assert selfcal.rows_per_batch(llama7b, 512) == 3
    mid = SimpleNamespace(num_hidden_layers=32, num_key_value_heads=8, num_attention_heads=32, head_dim=128, hidden_size=4096)
    per_row = 32 * 2 * 8 * 128 * 2 * 257
    assert selfcal.rows_per_batch(mid, 256) == selfcal.KV_BUDGET // per_row == 31


def test_batches_are_balanced():
    """The fewest batches of at most ``rows``, split evenly: no short last batch that re-reads every weight per step
    for a few rows."""
    assert selfcal.balanced_rows(127, 128) == 64  # Llama-3.2-1B at 256: 2 x 64, not 127 + 1
    assert selfcal.balanced_rows(128, 140) == 70  # Qwen2.5-1.5B's default 140 windows
    assert selfcal.balanced_rows(128, 32) == 32 and selfcal.balanced_rows(128, 128) == 128
    assert selfcal.balanced_rows(3, 7) == 3 and selfcal.balanced_rows(1, 5) == 1  # 7 at 3: 3 + 3 + 1
    for rows in range(1, 20):
        for n in range(1, 60):
            b = selfcal.balanced_rows(rows, n)
            batches = -(-n // rows)
            assert b <= rows and -(-n // b) == batches  # never more batches than the cap needs
            assert n - (batches - 1) * b > b - batches  # the last batch short by less than one row per batch


def test_start_token_and_suppressed_ids(tmp_path):
    cfg = SimpleNamespace(bos_token_id=None, eos_token_id=[7, 3, 99], vocab_size=50)
    assert selfcal.start_and_suppressed(cfg, tmp_path) == (7, [3, 7])  # no BOS: EOS starts; out-of-range ids dropped
    assert selfcal.start_and_suppressed(SimpleNamespace(bos_token_id=0, eos_token_id=1, vocab_size=50), tmp_path) == (0, [1])
    with pytest.raises(EdgeqError, match="no bos_token_id or eos_token_id"):
        selfcal.start_and_suppressed(SimpleNamespace(bos_token_id=None, eos_token_id=None, vocab_size=50), tmp_path)


def test_options_take_the_sources_defaults():
    assert (GPTQOptions(calib="self").nsamples, GPTQOptions(calib="self").seqlen) == (None, 256)  # None: from the model
    assert (GPTQOptions().nsamples, GPTQOptions().seqlen) == (128, 512)
    o = GPTQOptions(calib="self", nsamples=4, seqlen=16, seed=3)
    assert (o.nsamples, o.seqlen, o.seed, o.calib_file) == (4, 16, 3, None)
    assert GPTQOptions(calib=FIXTURE / "config.json").calib_file == FIXTURE / "config.json"


def test_default_nsamples_grow_with_the_widest_input():
    """max(32, ceil(4 K / seqlen)): the bundled model (K 768) keeps 32 windows of 256 (10.7 tokens per input);
    Qwen2.5-1.5B's down_proj (K 8960) asks 140 (35,840 tokens); K 2049 is the first to ask more than 32."""
    assert selfcal.default_nsamples(768, 256) == 32
    assert selfcal.default_nsamples(8960, 256) == 140
    assert (selfcal.default_nsamples(2048, 256), selfcal.default_nsamples(2049, 256)) == (32, 33)
    assert selfcal.default_nsamples(8960, 512) == 70


def _reference_draw_check(windows: torch.Tensor, seed: int, tol: float = 0.02) -> float:
    """The fraction of sampled positions whose id is the inverse-CDF draw, for the same uniform, of the bf16
    reference's distribution (transformers' own loading, one full forward per sequence, EOS suppressed) within
    ``tol`` of probability mass at the interval's ends."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.bfloat16).eval()
    n, t = windows.shape
    u = torch.rand(n, t, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    inputs = torch.cat([torch.zeros(n, 1, dtype=torch.int64), windows[:, :-1]], 1)  # BOS (id 0) first
    with torch.no_grad():
        logits = ref(input_ids=inputs).logits.float()
    logits[..., 1] = float("-inf")  # EOS (id 1)
    cdf = torch.softmax(logits, -1).double().cumsum(-1)
    x = u * cdf[..., -1]
    hi = cdf.gather(-1, windows.unsqueeze(-1)).squeeze(-1)
    lo = torch.where(windows > 0, cdf.gather(-1, (windows - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), torch.zeros_like(hi))
    return float(((lo - tol <= x) & (x < hi + tol)).double().mean())


@pytest.mark.slow
def test_samples_follow_the_model_and_are_deterministic():
    w, rec = selfcal.sample_windows(FIXTURE, 6, 48, seed=0)
    assert w.dtype == torch.int64 and tuple(w.shape) == (6, 48)
    assert int(w.min()) >= 0 and int(w.max()) < 4096 and not bool((w == 1).any())  # vocabulary, no EOS
    assert rec["ids_sha256"] and rec["source"] == "self" and rec["start_token"] == 0 and rec["suppressed_tokens"] == [1]
    again, rec2 = selfcal.sample_windows(FIXTURE, 6, 48, seed=0)
    assert torch.equal(w, again) and rec2 == rec  # same machine, same ids
    other, _ = selfcal.sample_windows(FIXTURE, 6, 48, seed=1)
    assert float((other != w).double().mean()) > 0.5
    assert _reference_draw_check(w, 0) > 0.99
    shifted = torch.roll(w, 1, dims=1)  # a sampler one position off would not pass
    assert _reference_draw_check(shifted, 0) < 0.5


def test_calib_self_needs_a_calibrated_method(tmp_path, capsys, monkeypatch):
    """--calib self goes with --method gptq, or with the default command where it takes the quality recipe; with
    another method, or on a family the default converts with rtn (gemma2), it is refused."""
    gemma = save_tiny("gemma2", tmp_path / "g", tied=True)
    for src, extra in ((FIXTURE, ["--method", "rtn"]), (gemma, [])):
        code, out, err = run_cli(["quantize", src, "-o", tmp_path / "o", "--calib", "self", *extra], capsys)
        assert code == 2 and err.count("\n") == 1 and "apply to --method gptq" in err and "--calib" in err, err
    assert not (tmp_path / "o").exists()
    code, out, err = run_cli(["quantize", FIXTURE, "--calib", "self", "--calib-seed", "3", "--dry-run", "--json"], capsys)
    assert code == 0 and (json.loads(out)["recipe"], json.loads(out)["method"]) == ("quality", "gptq"), err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "self").write_text("a file named self")
    code, _, err = run_cli(["quantize", FIXTURE, "-o", tmp_path / "o", "--method", "gptq", "--calib", "self"], capsys)
    assert code == 2 and err.count("\n") == 1 and "./self is a file here" in err and str(tmp_path / "self") in err, err


@pytest.mark.slow
@pytest.mark.timeout(1200)  # sampling, GPTQ and two fidelity runs: 4 min on a loaded 2-core machine, plus the RTN fixture
def test_calib_self_end_to_end_beats_rtn(tmp_path, capsys, fixture_quantized):
    """The CLI with the defaults of --calib self (32 x 256, seed 0), offline: exit 0, the manifest and card record
    the sampling, and the KLD to the bf16 model is below a bound the default RTN checkpoint fails."""
    from edgeq import fidelity as F
    from edgeq.runtime import load

    out = tmp_path / "self"
    code, stdout, err = run_cli(["quantize", FIXTURE, "-o", out, "--method", "gptq", "--calib", "self", "--json", "-q"], capsys)
    assert code == 0, err
    report = json.loads(stdout)
    assert any("32 windows x 256 tokens sampled from the model itself (seed 0, temperature 1.0" in n for n in report["notes"])
    cal = read_manifest(out).extra["gptq"]["calibration"]
    assert {k: cal[k] for k in ("source", "seed", "temperature", "top_k", "top_p", "start_token", "suppressed_tokens",
                                "windows", "seqlen", "tokens", "dtype")} == {
        "source": "self", "seed": 0, "temperature": 1.0, "top_k": None, "top_p": None, "start_token": 0,
        "suppressed_tokens": [1], "windows": 32, "seqlen": 256, "tokens": 8192, "dtype": "bfloat16"}
    assert (cal["nsamples_asked"], cal["widest_input"], len(cal["ids_sha256"])) == (None, 768, 64) and "file" not in cal
    assert "tokens sampled from the model itself" in (out / "README.md").read_text()
    ref = load(FIXTURE, kv_cache_bytes=16 << 20)
    kld_self = F.compare(ref, load(out, kv_cache_bytes=16 << 20)).kld_mean
    kld_rtn = F.compare(ref, load(fixture_quantized, kv_cache_bytes=16 << 20)).kld_mean
    assert kld_self < KLD_BOUND < kld_rtn, (kld_self, kld_rtn)


def test_calib_seed_is_for_calib_self_only(tmp_path, capsys):
    for extra, message in ((["--method", "gptq", "--calib-seed", "3"], "a calibration text has no seed"),
                           (["--method", "gptq", "--calib", "self", "--calib-seed", "-1"], "must be in [0, 2^63)")):
        code, _, err = run_cli(["quantize", FIXTURE, "-o", tmp_path / "o", *extra], capsys)
        assert code == 2 and err.count("\n") == 1 and "--calib-seed" in err and message in err, err
    assert not (tmp_path / "o").exists()


def test_calib_seed_picks_other_windows_and_is_recorded(tmp_path, capsys):
    """--calib-seed reaches the sampler: the manifest records it, and the sampled ids differ from seed 0's."""
    cals = {}
    for seed in (0, 5):
        out = tmp_path / f"s{seed}"
        code, _, err = run_cli(["quantize", FIXTURE, "-o", out, "--method", "gptq", "--calib", "self", "--calib-seed",
                                str(seed), "--nsamples", "2", "--seqlen", "16", "-q"], capsys)
        assert code == 0, err
        cals[seed] = read_manifest(out).extra["gptq"]["calibration"]
    assert (cals[0]["seed"], cals[5]["seed"]) == (0, 5)
    assert cals[0]["ids_sha256"] != cals[5]["ids_sha256"] and cals[0]["tokens"] == cals[5]["tokens"] == 32


def test_sampling_dtype_follows_calib_dtype_only_when_named(tmp_path, capsys, monkeypatch):
    """auto samples over the mapped bf16 weights (no copy); $EDGEQ_CALIB_DTYPE=fp32 casts them (a copy, recorded) and
    still draws from the model's distribution; the manifest records both dtypes."""
    w, rec = selfcal.sample_windows(FIXTURE, 3, 16, seed=0)
    assert rec["dtype"] == "bfloat16" and rec["cast_bytes"] == 0
    assert rec["matmul"] == ("bfloat16" if cpu.has_bf16_dot() else selfcal.UPCAST)
    w32, rec32 = selfcal.sample_windows(FIXTURE, 3, 16, seed=0, dtype=torch.float32)
    assert rec32["dtype"] == "float32" and rec32["cast_bytes"] >= 4 * 4_000_000  # ~4.2M parameters, 4 bytes each
    assert rec32["matmul"] == "float32"
    assert _reference_draw_check(w32, 0) > 0.95
    monkeypatch.setenv("EDGEQ_CALIB_DTYPE", "fp32")
    out = tmp_path / "o"
    code, _, err = run_cli(["quantize", FIXTURE, "-o", out, "--method", "gptq", "--calib", "self", "--nsamples", "2",
                            "--seqlen", "16", "-q"], capsys)
    assert code == 0, err
    g = json.loads((out / "edgeq_manifest.json").read_text())["gptq"]
    assert g["compute_dtype"] == "float32" and g["calibration"]["dtype"] == "float32"
    assert g["calibration"]["cast_bytes"] == rec32["cast_bytes"]


@pytest.mark.parametrize("bf16_dot", [False, True])
def test_auto_upcasts_the_linears_only_without_bf16_dot_products(monkeypatch, bf16_dot):
    """Under auto, a CPU without bf16 dot products samples with fp32 GEMMs over the mapped bf16 weights (no copy);
    one with them keeps bf16 GEMMs; a named bf16 always does. Either way the ids are the model's draws."""
    monkeypatch.setattr(cpu, "has_bf16_dot", lambda: bf16_dot)
    w, rec = selfcal.sample_windows(FIXTURE, 3, 16, seed=0)
    assert rec["matmul"] == ("bfloat16" if bf16_dot else selfcal.UPCAST) and rec["cast_bytes"] == 0
    assert _reference_draw_check(w, 0) > 0.95
    _, named = selfcal.sample_windows(FIXTURE, 1, 4, seed=0, dtype=torch.bfloat16)
    assert named["matmul"] == "bfloat16" and named["cast_bytes"] == 0


def test_batching_and_the_one_thread_rule_follow_the_rows_of_a_batch(monkeypatch):
    """A step's size is the rows actually in a batch: 2 windows of a model with P parameters make 4P FLOPs, under a
    6P threshold (one thread) although up to MAX_ROWS rows would fit; 4 windows make 8P (the process's threads).
    Batching 2 rows at a time instead of all at once draws the same ids (the u table is drawn up front) up to the
    GEMMs' rounding, which can change with the rows in a batch and flip a near-tie: >= 95% of them here."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURE)).parameters())
    monkeypatch.setattr(selfcal, "SMALL_STEP_FLOPS", 6 * params)
    calls, threads = [], torch.get_num_threads()
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    one, rec = selfcal.sample_windows(FIXTURE, 2, 8, seed=0)
    assert rec["rows_per_batch"] == 2 and calls == [1, threads]  # one thread, then restored
    calls.clear()
    whole, _ = selfcal.sample_windows(FIXTURE, 4, 8, seed=0)
    assert calls == [threads]  # only the restore: the step ran on the process's threads
    assert float((whole[:2] == one).double().mean()) > 0.95  # a larger nsamples extends the same set
    monkeypatch.setattr(selfcal, "MAX_ROWS", 2)
    pairs, rec2 = selfcal.sample_windows(FIXTURE, 4, 8, seed=0)
    assert rec2["rows_per_batch"] == 2 and float((pairs == whole).double().mean()) > 0.95


def test_sampling_progress_says_tokens_and_time_left_at_most_once_a_period(capsys):
    """The elapsed time scaled by the tokens left; nothing before the first period, nothing at the end."""
    from edgeq.convert.calibrated import sampling_progress

    now = [0.0]
    report = sampling_progress(every=60.0, clock=lambda: now[0])
    for t, done in ((30, 4096), (120, 8192), (150, 12288), (200, 16384), (270, 28672), (300, 32768)):
        now[0] = t
        report(done, 32768)
    assert capsys.readouterr().err.splitlines() == [
        "--calib self: 8,192 / 32,768 tokens (25%) in 120 s, about 6 min left",  # 120 s x 24,576 / 8,192 = 360 s
        "--calib self: 16,384 / 32,768 tokens (50%) in 200 s, about 3 min left",  # 200 s
        "--calib self: 28,672 / 32,768 tokens (88%) in 270 s, about 39 s left",  # 270 s x 4,096 / 28,672 = 38.6 s
    ]


def test_the_cli_reports_sampling_progress(tmp_path, capsys, monkeypatch):
    """`edgeq quantize --calib self` hands the sampler its progress lines (here every step: the period set to 0)."""
    from edgeq.convert import calibrated

    every_step = calibrated.sampling_progress
    monkeypatch.setattr(calibrated, "sampling_progress", lambda: every_step(every=0.0))
    code, _, err = run_cli(["quantize", FIXTURE, "-o", tmp_path / "o", "--method", "gptq", "--calib", "self",
                            "--nsamples", "2", "--seqlen", "16", "-q"], capsys)
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if " tokens (" in ln]
    assert len(lines) == 15 and lines[0].startswith("--calib self: 2 / 32 tokens (6%) in ") and \
        lines[-1].startswith("--calib self: 30 / 32 tokens (94%) in "), lines
