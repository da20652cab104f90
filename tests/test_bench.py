"""edgeq bench: the harness's judgement (a failing pass suppresses the comparison, identical arms are flagged), the
worker's path counters and settings read back, the memory ledger, mincore residency, conversion mode. No timing is
asserted anywhere: only what was counted, allocated or touched.

Worker processes are expensive on a loaded 2-core machine (each imports torch and transformers), so the judgement
is tested with a stub runner and only three tests start real workers: a failing arm through the CLI, the ledger,
and a conversion.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from pathlib import Path

import pytest
import torch

from edgeq.bench import measure, process
from edgeq.bench import run as bench
from edgeq.bench.edgeq_arm import check_paths
from edgeq.bench.records import Arm, BenchConfig, PassResult, Stat
from edgeq.bench.render import render, to_json
from edgeq.bench.schedule import run_bench, schedule
from edgeq.bench.spec import PassSpec, prompt_ids
from edgeq.bench.summary import summarize
from edgeq.bench.worker import run_pass
from helpers.cli import run_cli

from helpers.paths import FIXTURE
TINY_LINEARS = 4 * 7 + 1  # tiny-prose: 4 layers x (q, k, v, o, gate, up, down) + the head
MiB = 1 << 20


# ------------------------------------------------------------------------------------------------- stub results


def _settings(**over) -> dict:
    s = {"quantized": True, "scheme": "w4a16-g128", "dtype": "bfloat16", "max_model_len": 1024,
         "kv_cache_budget": 2 * MiB, "kv_cache_bytes": 2 * MiB, "threads": 2, "threads_now": 2,
         "decode_path": "native_decode", "prefill_path": "dequant_prefill", "prefill_crossover": 32,
         "crossover_source": "cached", "layout": "native", "native": {"isa": "avx512"}, "env": {},
         "copied_bytes": 0}
    s.update(over)
    return s


def _data(settings: dict, tg: float = 10.0) -> dict:
    rows = [{"kind": "anon", "category": "runtime baseline (code, before load)", "bytes": 100 * MiB, "how": "x"},
            {"kind": "anon", "category": "KV cache (touched)", "bytes": 2 * MiB, "how": "x"}]
    ckpt = {"files": [], "mapped_bytes": 4 * MiB, "resident_bytes": 4 * MiB, "rss_bytes": 4 * MiB, "anonymous_bytes": 0}
    mem = {"rss": 106 * MiB, "anon": 102 * MiB, "file": 4 * MiB, "shmem": 0, "hwm": 106 * MiB, "size": 1 << 30}
    return {
        "ok": True, "kind": "edgeq",
        "timing": {"import_s": 1.0, "load_s": 0.5, "prefill_s": 1.0, "ttft_s": 1.0, "ttft_cold_s": 1.2,
                   "decode_s": 1.0, "pp_tok_s": 100.0, "tg_tok_s": tg},
        "paths": {"prefill": {"dequant_prefill": 28, "native_decode": 1}, "decode": {"native_decode": 29}},
        "native_calls": None, "path_problems": [], "effective": settings, "vocab": 4096,
        "memory": {"baseline": mem, "after_load": mem, "steady": mem, "peak_load": mem["rss"], "peak_run": mem["rss"],
                   "peak_reset": True, "checkpoint_cached_before_load": 4 * MiB, "checkpoint_file_bytes": 4 * MiB},
        "ledger": {"rows": rows, "total": 106 * MiB, "explained": 102 * MiB, "unattributed": 4 * MiB,
                   "kv_allocated": 2 * MiB, "kv_touched": 2 * MiB, "scratch_allocated": 0, "scratch_touched": 0,
                   "checkpoint": ckpt},
    }


class StubRunner:
    """Returns canned worker results; ``fail`` = {(label, pass): error}; records the order of the passes."""

    def __init__(self, settings: dict[str, dict], fail: dict | None = None):
        self.settings, self.fail, self.calls = settings, fail or {}, []

    def __call__(self, arm: Arm, spec: PassSpec, workdir: Path, timeout: float) -> PassResult:
        self.calls.append((arm.label, spec.pass_index))
        error = self.fail.get((arm.label, spec.pass_index))
        data = _data(self.settings[arm.label], tg=10.0 + spec.pass_index) if error is None else \
            {"ok": False, "error": error}
        return PassResult(arm.label, spec.pass_index, error is None, error, 0 if error is None else 1, 1.0,
                          100 * MiB, data, "Traceback: boom" if error else "")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Path:
    from edgeq.convert.pipeline import convert

    out = tmp_path_factory.mktemp("bench") / "tiny-q"
    convert(FIXTURE, out, method="minmax")  # the bench measures paths and memory, not fidelity: the fast method
    return out


# -------------------------------------------------------------------------------------------------- judgement


def test_arms_are_interleaved():
    arms = [Arm("A", "a"), Arm("B", "b")]
    assert [(a.label, p) for p, a in schedule(arms, 3)] == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2)]


def test_failing_pass_suppresses_comparison(quantized, tmp_path):
    stub = StubRunner({"A": _settings(), "B": _settings(quantized=False)}, fail={("B", 1): "RuntimeError: KV cache full"})
    arms = [Arm("A", str(quantized)), Arm("B", str(FIXTURE))]
    report = run_bench(arms, BenchConfig(passes=3), runner=stub, workdir=tmp_path)
    assert stub.calls == [("A", 0), ("B", 0), ("A", 1), ("B", 1)]  # interleaved, stopped at the failure
    assert not report.ok and report.comparisons is None and report.arms == ()
    assert report.failures[0]["label"] == "B" and "KV cache full" in report.failures[0]["error"]
    assert report.not_run == ("A#2", "B#2")
    from rich.console import Console

    console = Console(record=True, width=200)
    render(report, console, console)
    text = console.export_text()
    assert "FAILED: arm B pass 2: RuntimeError: KV cache full" in text and "no comparison" in text
    assert "A vs B" not in text and "decode tok/s" not in text
    as_json = json.loads(to_json(report))
    assert as_json["ok"] is False and as_json["comparisons"] is None and as_json["arms"] == []


def test_success_compares_with_medians_and_spread(quantized, tmp_path):
    stub = StubRunner({"A": _settings(), "B": _settings(quantized=False, scheme=None, decode_path="bf16",
                                                         prefill_path="bf16", prefill_crossover=None, native=None)})
    report = run_bench([Arm("A", str(quantized)), Arm("B", str(FIXTURE))], BenchConfig(passes=3), runner=stub,
                       workdir=tmp_path)
    assert report.ok and report.flags == ()
    a = report.arms[0]
    assert a.timing["tg_tok_s"] == Stat(11.0, 10.0, 12.0, 3)  # passes 0, 1, 2 gave 10, 11, 12
    (cmp_,) = report.comparisons
    tg = next(r for r in cmp_.rows if r["metric"] == "tg_tok_s")
    assert tg["ratio"] == 1.0 and tg["overlap"]


def test_too_few_passes_refused(tmp_path):
    with pytest.raises(Exception, match="at least 3"):
        run_bench([Arm("A", "x")], BenchConfig(passes=2), runner=StubRunner({}), workdir=tmp_path)


def test_identical_effective_settings_flagged(quantized, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(quantized, copy)  # the same checkpoint under another name is the same checkpoint
    same = StubRunner({"A": _settings(), "B": _settings()})
    report = run_bench([Arm("A", str(quantized)), Arm("B", str(copy))], BenchConfig(passes=3), runner=same,
                       workdir=tmp_path / "w1")
    assert any("identical effective settings" in f for f in report.flags)
    # Same checkpoint, but the B arm really ran another kernel path (read back): a legitimate comparison.
    other = StubRunner({"A": _settings(), "B": _settings(decode_path="tinygemm_decode", native=None,
                                                         env={"EDGEQ_NATIVE_ISA": "off"})})
    report = run_bench([Arm("A", str(quantized)), Arm("B", str(copy))], BenchConfig(passes=3), runner=other,
                       workdir=tmp_path / "w2")
    assert report.ok and report.flags == ()
    # Two checkpoints that also differ in threads: the ratio would mix two effects.
    threads = StubRunner({"A": _settings(), "B": _settings(quantized=False, threads_now=1)})
    report = run_bench([Arm("A", str(quantized)), Arm("B", str(FIXTURE))], BenchConfig(passes=3), runner=threads,
                       workdir=tmp_path / "w3")
    assert any("differ in threads" in f for f in report.flags)


def test_settings_changing_between_passes_flagged(quantized, tmp_path):
    class Drift(StubRunner):
        def __call__(self, arm, spec, workdir, timeout):
            self.settings["A"] = _settings(prefill_crossover=32 + spec.pass_index)
            return super().__call__(arm, spec, workdir, timeout)

    report = run_bench([Arm("A", str(quantized))], BenchConfig(passes=3), runner=Drift({"A": None}), workdir=tmp_path)
    assert any("prefill_crossover changed between passes" in f for f in report.flags)


def test_starved_passes_flagged(quantized, tmp_path):
    class Starved(StubRunner):
        def __call__(self, arm, spec, workdir, timeout):
            r = super().__call__(arm, spec, workdir, timeout)
            share = 0.45 if spec.pass_index == 1 else 0.97  # one pass shared its cores with another job
            r.data["cpu"] = {ph: {"wall_s": 1.0, "cpu_s": 2 * share, "share": share, "involuntary_switches": 0}
                             for ph in ("prefill", "decode")}
            return r

    report = run_bench([Arm("A", str(quantized))], BenchConfig(passes=3), runner=Starved({"A": _settings()}),
                       workdir=tmp_path)
    assert report.ok and report.arms[0].timing["cpu_share_decode"] == Stat(0.97, 0.45, 0.97, 3)
    assert any("decode got only 45%-97%" in f and "OMP_WAIT_POLICY=PASSIVE" in f for f in report.flags)


def test_vs_gguf_skipped_cleanly_without_llama_cpp(quantized, tmp_path, monkeypatch, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    seen = {}

    def fake_run_bench(arms, cfg, progress=None):
        seen["arms"] = arms
        return run_bench(arms, cfg, runner=StubRunner({"A": _settings()}), workdir=tmp_path / "w")

    monkeypatch.setattr(bench, "llama_cpp_available", lambda: False)
    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    code, out, err = run_cli(["bench", quantized, "--vs-gguf", gguf, "--json"], capsys)
    assert code == 0, out + err
    assert [a.label for a in seen["arms"]] == ["A"]
    assert "llama-cpp-python is not installed" in err




# ---------------------------------------------------------------------------------------- worker, in process


def _run_here(checkpoint: Path, tmp_path: Path, **spec) -> dict:
    threads = torch.get_num_threads()
    try:
        return run_pass(PassSpec(checkpoint=str(checkpoint), result=str(tmp_path / "r.json"), threads=1,
                                 kv_cache_bytes="1MiB", warmup=False, **spec))
    finally:
        torch.set_num_threads(threads)  # the pass sets this process's threads; give them back


@pytest.mark.slow
def test_path_counters_count(quantized, tmp_path):
    # A prompt at or above the crossover goes through dequant+GEMM; the head (logits_to_keep=1) and every decode
    # step through the int4 kernel, one call per quantised Linear per step.
    r = _run_here(quantized, tmp_path, prompt_len=40, gen_len=5, prefill_threshold=16, max_model_len=100)
    s = r["effective"]
    decode = s["decode_path"]
    assert decode in ("native_decode", "tinygemm_decode")
    assert r["paths"]["prefill"] == {"dequant_prefill": TINY_LINEARS - 1, decode: 1}
    assert r["paths"]["decode"] == {decode: 5 * TINY_LINEARS}
    assert r["path_problems"] == []
    assert r["cpu"]["decode"]["wall_s"] > 0 and r["cpu"]["decode"]["cpu_s"] >= 0
    if decode == "native_decode":  # the kernel's own counter agrees with the runtime's
        assert r["native_calls"] == {"prefill": 1, "decode": 5 * TINY_LINEARS}
    # effective settings are read back from the runtime, not echoed
    assert (s["threads_now"], s["max_model_len"], s["kv_cache_bytes"], s["prefill_crossover"]) == (1, 100, 100 * 2048, 16)
    # a prompt below the crossover never touches the dequant path
    short = _run_here(quantized, tmp_path, prompt_len=8, gen_len=2, prefill_threshold=16)
    assert short["paths"]["prefill"] == {decode: TINY_LINEARS}


def test_bf16_reference_counts_bf16_calls(tmp_path):
    r = _run_here(FIXTURE, tmp_path, prompt_len=12, gen_len=3)
    assert r["paths"] == {"prefill": {"bf16": TINY_LINEARS}, "decode": {"bf16": 3 * TINY_LINEARS}}
    assert r["effective"]["decode_path"] == "bf16" and r["path_problems"] == []


def test_contradicting_paths_fail_the_pass():
    class S:
        quantized, decode_path, prefill_crossover, prefill_attn = True, "native_decode", 32, "native"

    class LM:
        settings = S()

    gen = {"paths": {"prefill": {"tinygemm_decode": 29}, "decode": {"tinygemm_decode": 29}}, "native_calls": None,
           "attn_calls": {"prefill": {"prefill_attn_sdpa": 4}, "decode": {}}}
    problems = check_paths(LM(), gen, prompt_len=512)
    assert any("effective decode path is native_decode" in p for p in problems)
    assert any("expected dequant_prefill" in p for p in problems)
    assert any("prefill attention is native, but the prefill counted {'prefill_attn_sdpa': 4}" in p for p in problems)
    gen["attn_calls"]["prefill"] = {"prefill_attn_native": 4}
    assert not any("prefill attention" in p for p in check_paths(LM(), gen, prompt_len=512))


def test_children_run_the_parents_edgeq(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = process.child_env({"X": "1"})
    here = str(Path(process.__file__).resolve().parents[2])  # edgeq/bench/process.py -> the directory holding edgeq/
    assert env["PYTHONPATH"].split(os.pathsep) == [here, "/elsewhere"] and env["X"] == "1"


def test_prompt_ids_are_the_same_for_every_arm():
    assert prompt_ids(16, 4096, 0) == prompt_ids(16, 4096, 0) != prompt_ids(16, 4096, 1)
    assert all(0 <= i < 4096 for i in prompt_ids(1000, 4096, 3))


# ------------------------------------------------------------------------------------------- real workers


@pytest.mark.slow
def test_failing_worker_gives_no_comparison_and_exit_1(quantized, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # header OK, no tensors
    code, out, err = run_cli(["bench", broken, "--vs", quantized, "--prompt-len", "8", "--gen-len", "2",
                            "--threads", "1", "--kv-cache-bytes", "1MiB"], capsys)
    output = out + err
    assert code == 1, output
    assert "FAILED: arm A pass 1" in output and "no comparison" in output
    assert "A vs B" not in output and "decode tok/s" not in output


@pytest.mark.slow
def test_ledger_sums_to_measured_total(quantized, tmp_path):
    # A context of 32768 tokens makes the KV cache 64 MiB (2048 bytes a token): allocated, whatever of it is touched.
    ckpt = tmp_path / "long"
    shutil.copytree(quantized, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    arm = Arm("A", str(ckpt), threads=1, kv_cache_bytes="64MiB", prefill_threshold=16)
    spec = PassSpec(checkpoint=str(ckpt), result=str(tmp_path / "A-0.result.json"), prompt_len=48, gen_len=4,
                    threads=1, kv_cache_bytes="64MiB", prefill_threshold=16)
    r = process.run_worker(arm, spec, tmp_path, timeout_s=900)
    assert r.ok, (r.error, r.stderr_tail)
    led = r.data["ledger"]
    assert sum(row["bytes"] for row in led["rows"]) == led["total"] == r.data["memory"]["steady"]["rss"]
    assert led["kv_allocated"] == 64 * MiB and led["kv_touched"] <= led["kv_allocated"]
    assert led["kv_touched"] >= (48 + 4 + 1) * 2048  # at least the positions written (prompt, decode, warm-up)
    unattributed = [row["bytes"] for row in led["rows"] if row["how"] == "remainder"]
    assert all(abs(b) < 32 * MiB for b in unattributed), led["rows"]  # explained within 32 MiB per remainder row
    assert abs(led["unattributed"]) < 48 * MiB
    ck = led["checkpoint"]
    weights = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert ck["mapped_bytes"] >= weights and ck["resident_bytes"] <= ck["mapped_bytes"]
    # Every Linear weight and the head were used, so their pages are mapped in. The default (packed) embedding's own
    # residual level (4096 x 256 at g128: 4096 * 128 + 2 * 4096 * 4 = 557,056 bytes) is read where the prompt's rows
    # are, and one row spans its whole 64-row block (k-major, docs/kernel.md), so it may be all resident: between
    # everything but that level and the whole file, rounded up to whole pages (rss counts pages).
    manifest = json.loads((ckpt / "edgeq_manifest.json").read_text())
    assert manifest["embeddings"]["model.embed_tokens"]["storage"] == "packed"
    residual, page = 4096 * 128 + 2 * 4096 * 4, os.sysconf("SC_PAGE_SIZE")
    assert weights - residual <= ck["rss_bytes"] <= -(-weights // page) * page
    assert ck["anonymous_bytes"] == 0  # the mapped weights were never written (no copy-on-write)
    # inspect's projection agrees with what was allocated (same formula as the runtime)
    summary = summarize(arm, [r])
    rows = {row["category"]: row for row in summary.projection["rows"]}
    assert rows["KV cache"]["diff"] == 0 and rows["prefill scratch"]["diff"] == 0
    assert rows["weight copies (anon)"]["measured"] == 0


@pytest.mark.slow
def test_convert_mode_measures_a_child(tmp_path):
    r = bench.run_convert(str(FIXTURE), "w4a16-g128", "minmax", passes=1, workdir=tmp_path)
    assert r.failures == ()
    assert r.bytes_in > r.bytes_out > 0
    assert r.peak_rss.median > 50 * MiB  # the child imported torch: its own peak, from wait4
    assert r.seconds.n == 1 and r.seconds.median > 0
    assert not any(tmp_path.iterdir())  # the output was removed


# ------------------------------------------------------------------------------------------------- mincore


def test_mincore_residency_of_a_mapped_file_before_and_after_touching(tmp_path):
    path = tmp_path / "weights.bin"
    size, touched = 8 * MiB, 1 * MiB
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())  # clean pages can be dropped from the page cache
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert measure.file_cached_bytes(path) < 256 * 1024
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    m.madvise(mmap.MADV_RANDOM)  # no read-ahead: only touched pages are read
    try:
        before = measure.mapped_residency(tmp_path)
        assert before.files == (str(path.resolve()),) and before.mapped_bytes == size
        assert before.resident_bytes < 256 * 1024 and before.rss_bytes < 256 * 1024  # allocated is not resident
        for i in range(0, touched, mmap.PAGESIZE):
            m[i]
        after = measure.mapped_residency(tmp_path)
        assert touched <= after.resident_bytes < size
        assert touched <= after.rss_bytes < size and after.anonymous_bytes == 0
        m[0:1] = b"x"  # a write to a private mapping makes one anonymous copy-on-write page
        assert measure.mapped_residency(tmp_path).anonymous_bytes == mmap.PAGESIZE
    finally:
        m.close()


def test_tensor_residency_allocated_vs_touched():
    t = torch.empty(64 * MiB, dtype=torch.uint8)  # above glibc's largest mmap threshold: fresh, untouched pages
    allocated, resident = measure.tensor_resident(t)
    assert allocated == 64 * MiB and resident < 4 * MiB
    t[: 16 * MiB].fill_(1)
    _, resident = measure.tensor_resident(t)
    assert 16 * MiB <= resident < 24 * MiB


def test_resident_bytes_clips_partial_pages():
    m = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    m[:] = b"\x01" * len(m)
    base = measure.address_of(m)
    assert measure.resident_bytes(base + 100, 2 * mmap.PAGESIZE) == 2 * mmap.PAGESIZE
    assert measure.resident_bytes(base + 100, 10) == 10
    m.close()


def test_status_fields_add_up():
    s = measure.status()
    assert s.rss == s.anon + s.file + s.shmem and s.hwm >= s.rss > 0


# ------------------------------------------------------------------------------------- llama.cpp (optional extra)


def test_llama_cpp_arm_runs_and_reads_settings_back(tmp_path):
    """Only where the optional extras are installed (llama-cpp-python compiles llama.cpp; CI does not have it)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from gguf_synthetic import build_q4_k_m

    gguf_path = build_q4_k_m(FIXTURE, tmp_path / "tiny-Q4_K_M.gguf", threads=1)
    arm = Arm("G", str(gguf_path), kind="gguf", threads=1, max_model_len=256, env=(("EDGEQ_BENCH_LLAMA_REPACK", "0"),))
    spec = PassSpec(checkpoint=str(gguf_path), result=str(tmp_path / "G-0.result.json"), kind="gguf", prompt_len=16,
                    gen_len=4, threads=1, max_model_len=256)
    r = process.run_worker(arm, spec, tmp_path, timeout_s=600)
    assert r.ok, (r.error, r.stderr_tail)
    e = r.data["effective"]
    assert (e["n_threads"], e["n_threads_batch"], e["n_batch"]) == (1, 1, 16) and e["n_ctx"] >= 256
    assert e["extra_bufts"] is False and "Q4_K" in e["model_desc"]
    led = r.data["ledger"]
    assert sum(row["bytes"] for row in led["rows"]) == led["total"]
    assert led["checkpoint"]["mapped_bytes"] >= e["model_bytes"]  # every weight stays mapped without repack


SMAPS = """7f0000000000-7f0000600000 r--p 00000000 fd:00 42    /ckpt/model.safetensors
Size:               6144 kB
Rss:                6144 kB
FilePmdMapped:      4096 kB
VmFlags: rd mr mw me ac hg
7f0000600000-7f0000601000 rw-p 00000000 00:00 0
Rss:                   4 kB
FilePmdMapped:         0 kB
"""


def test_pmd_mapped_reads_each_vmas_field():
    assert measure.parse_pmd_mapped(SMAPS) == {0x7F0000000000: 4 * MiB, 0x7F0000600000: 0}


def test_a_checkpoint_edgeq_wrote_is_mapped_with_huge_pages_where_the_filesystem_allows(tmp_path):
    """edgeq's writer fills the page cache in 2 MiB-aligned 4 MiB writes and the runtime advises MADV_HUGEPAGE:
    where the filesystem keeps large folios (ext4 on Linux >= 6.16, tmpfs with huge=...), the mapped tensor is mostly
    PMD-mapped; the ledger reports it. Skipped where the kernel maps none (nothing to measure there)."""
    from edgeq.io import mapped, safetensors as st

    t = torch.arange(16 * MiB // 2, dtype=torch.int16).view(torch.bfloat16).reshape(4096, -1)
    w = st.ShardedWriter(tmp_path, [st.OutSpec("w", t.dtype, tuple(t.shape))])
    w.write("w", t)
    w.close()
    files = mapped.MappedFiles(tmp_path)
    view = files.get("w")
    assert torch.equal(view.view(torch.int16), t.view(torch.int16))  # touches every page
    res = measure.mapped_residency(tmp_path)
    if res.pmd_mapped_bytes == 0:
        pytest.skip("this kernel/filesystem maps the file with 4 KiB pages only")
    assert res.pmd_mapped_bytes % (2 * MiB) == 0 and 8 * MiB <= res.pmd_mapped_bytes <= res.rss_bytes
