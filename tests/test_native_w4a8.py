"""edgeq's native W4A8 kernel (edgeq/runtime/native/w4a8.py, edgeq/csrc/w4a8mm*): exact bits against the portable
path (edgeq.runtime.w4a8_compute.w4a8_linear, itself pinned to the kernel arithmetic in tests/test_w4a8.py) on every ISA path
this CPU runs (here scalar, avx2, avxvnni, vnni, amx), thread-count independence, the runtime choosing it, and the
environment switch.

No tolerance anywhere: the native op and the portable path do the same integer dot products and the same two fp32
roundings per K block, so the bf16 outputs must be identical (compared as int16 bit patterns).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.layouts import w4a8 as L
from edgeq.runtime import w4a8linear
from edgeq.runtime.native import w4a8 as native_w4a8
from edgeq.runtime.w4a8_compute import w4a8_linear

# (M, N, K, G): decode M 1..8 (both decode tiles and the 4-row split), prefill M 20..130 (VNNI 8-row tiles + tails;
# AMX 32-row steps with a full, partial (20, 50) or absent (33, 130) second 16-row tile);
# N from one 32-row block to a few hundred; K from one K block to many.
CASES = [
    (1, 32, 32, 32),
    (1, 320, 1024, 128),
    (2, 64, 128, 64),
    (3, 96, 384, 128),
    (7, 64, 256, 32),
    (8, 288, 512, 64),
    (20, 64, 256, 128),
    (33, 96, 512, 128),
    (50, 96, 256, 32),
    (130, 64, 192, 32),
    (130, 320, 256, 64),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _weights(n: int, k: int, g: int, gen: torch.Generator, scale_exp=(-12, 2)) -> L.W4A8Packed:
    """Random q / zeros in 0..15 and fp32 scales spread over 2^scale_exp (every code, wide magnitudes)."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    zeros = torch.randint(0, 16, (k // g, n), generator=gen).to(torch.int8)
    e = torch.randint(scale_exp[0], scale_exp[1], (k // g, n), generator=gen).float()
    scales = (torch.rand(k // g, n, generator=gen) + 0.5) * torch.exp2(e)
    return L.pack(q, scales, zeros, g)


def _acts(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 rows with per-row magnitudes from 2^-20 to 2^12, plus special rows: all zero, one tiny row below the
    1e-7 floor, one row with a single non-zero (ties of x * 127/amax at +-0.5 steps are frequent there)."""
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-20, 12, (m, 1), generator=gen).float())
    if m >= 3:
        x[0] = 0
        x[1] *= 1e-30
        x[2] = 0
        x[2, 0] = 2.0
        x[2, 1:5] = torch.tensor([0.5, 1.0, -0.25, 1.5]) * (2.0 / 127)  # exact halves after scaling
    return x.to(torch.bfloat16)


@pytest.fixture(scope="module")
def ready():
    """Build (or load the cached build) once; a failure fails here with the compiler's reason."""
    native_w4a8._state = None
    st = native_w4a8.status()
    assert st["available"], st["reason"]
    return st


@pytest.fixture
def isa_env(monkeypatch):
    """Set EDGEQ_W4A8_ISA and re-read it (the library stays loaded); restores the process state afterwards."""
    saved = native_w4a8._state

    def set_isa(value: str | None):
        if value is None:
            monkeypatch.delenv(native_w4a8.ENV_ISA, raising=False)
        else:
            monkeypatch.setenv(native_w4a8.ENV_ISA, value)
        native_w4a8._state = None

    yield set_isa
    native_w4a8._state = saved


@pytest.mark.parametrize("m,n,k,g", CASES)
def test_bits_equal_the_portable_path_on_every_isa(ready, m, n, k, g):
    gen = torch.Generator().manual_seed(1000 * m + n + k + g)
    p = _weights(n, k, g, gen)
    x = _acts(m, k, gen)
    bias = (torch.randn(n, generator=gen) * 4).to(torch.bfloat16)
    for b in (None, bias):
        want = w4a8_linear(x, p.qweight, p.scales, p.zeros, g, b)
        for isa in ready["cpu_isas"]:
            got = native_w4a8.w4a8_mm(x, p.qweight, p.scales, p.zeros, g, b, isa=isa)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert torch.equal(_bits(got), _bits(want)), (isa, b is not None, int((got != want).sum()))
        if m >= 3:  # the all-zero row: exactly the bias (bf16 -> fp32 -> bf16 is exact), or 0
            assert torch.equal(_bits(got[0]), _bits(b if b is not None else torch.zeros(n, dtype=torch.bfloat16)))


def test_subnormal_and_huge_outputs_and_fp32_inputs(ready):
    """Scales near 2^-126 give fp32-subnormal accumulators (bf16 rounding without flush-to-zero) and scales near 2^60
    large ones; fp32 activations are quantised from fp32, bias may be fp32."""
    gen = torch.Generator().manual_seed(7)
    for exp in ((-140, -120), (50, 60)):
        p = _weights(64, 256, 64, gen, scale_exp=exp)
        x = torch.randn(5, 256, generator=gen)
        bias = torch.randn(64, generator=gen) * (2.0 ** exp[0])
        for xx, b in ((x.to(torch.bfloat16), None), (x, bias)):
            want = w4a8_linear(xx, p.qweight, p.scales, p.zeros, 64, b)
            for isa in ready["cpu_isas"]:
                got = native_w4a8.w4a8_mm(xx, p.qweight, p.scales, p.zeros, 64, b, isa=isa)
                assert torch.equal(_bits(got), _bits(want)), (exp, isa)
            if exp[0] < 0:  # the case really produces subnormal outputs
                assert bool(((want.float().abs() < 2.0**-126) & (want != 0)).any())
            else:
                assert bool((want.float().abs() > 2.0**60).any())


def test_hand_checked_single_block(ready):
    """One 32 x 32 block, G = 32: x = e_0 * 2 (amax 2, q_a = 127 at k = 0, 0 elsewhere), so y[n] = bf16((127 *
    (q[n, 0] - z[n])) * (2 / 127) * s[n]) computed in fp32: with s = 0.25, y = (q - z) / 2 exactly."""
    q = torch.arange(32, dtype=torch.uint8).remainder(16).unsqueeze(1).expand(32, 32).contiguous()
    zeros = torch.full((1, 32), 3, dtype=torch.int8)
    p = L.pack(q, torch.full((1, 32), 0.25), zeros, 32)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 2.0
    want = (q[:, 0].float() - 3) * 0.5
    for isa in ready["cpu_isas"]:
        got = native_w4a8.w4a8_mm(x, p.qweight, p.scales, p.zeros, 32, None, isa=isa)
        assert torch.equal(got[0].float(), want), isa


def test_thread_counts_give_identical_bits(ready):
    gen = torch.Generator().manual_seed(11)
    p = _weights(320, 512, 128, gen)
    before = torch.get_num_threads()
    try:
        for m in (1, 8, 130):
            x = _acts(m, 512, gen)
            outs = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs[threads] = {isa: native_w4a8.w4a8_mm(x, p.qweight, p.scales, p.zeros, 128, None, isa=isa)
                                 for isa in ready["cpu_isas"]}
            for isa in ready["cpu_isas"]:
                assert torch.equal(_bits(outs[1][isa]), _bits(outs[2][isa])), (m, isa)
    finally:
        torch.set_num_threads(before)


def test_bad_inputs_are_errors_naming_the_tensor(ready):
    gen = torch.Generator().manual_seed(3)
    p = _weights(64, 128, 64, gen)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(EdgeqError, match=r"qweight holds K=128 but x has K=96"):
        native_w4a8.w4a8_mm(x[:, :96], p.qweight, p.scales, p.zeros, 64)
    with pytest.raises(EdgeqError, match=r"scales: expected contiguous fp32 \[2, 2, 32\]"):
        native_w4a8.w4a8_mm(x, p.qweight, p.scales.double(), p.zeros, 64)
    with pytest.raises(EdgeqError, match=r"bias: expected \[64\]"):
        native_w4a8.w4a8_mm(x, p.qweight, p.scales, p.zeros, 64, torch.zeros(32, dtype=torch.bfloat16))
    with pytest.raises(EdgeqError, match=r"qweight: expected contiguous uint8 \[N/32, K/32, 640\]"):
        native_w4a8.w4a8_mm(x, p.qweight, p.scales, p.zeros, 32)
    assert native_w4a8.w4a8_mm(x[:0], p.qweight, p.scales, p.zeros, 64).shape == (0, 64)


def test_runtime_chooses_the_native_op_after_the_probe(ready):
    choice = w4a8linear.choose_kernel(128)
    assert choice.path == w4a8linear.COMPILED
    assert choice.source == f"edgeq native ({ready['isa']})" and "bit-equal to the portable path" in choice.reason
    gen = torch.Generator().manual_seed(5)
    p = _weights(64, 256, 128, gen)
    counts: Counter = Counter()
    mod = w4a8linear.W4A8Linear("m", p.qweight, p.scales, p.zeros, 128, None, counts, choice)
    x = _acts(3, 256, gen)
    calls = native_w4a8.call_count()
    assert torch.equal(_bits(mod(x)), _bits(w4a8_linear(x, p.qweight, p.scales, p.zeros, 128)))
    assert counts == Counter({"w4a8_kernel": 1}) and native_w4a8.call_count() == calls + 1


def test_forced_off_falls_back_and_says_why(ready, isa_env):
    isa_env("off")
    assert native_w4a8.available() is False
    choice = w4a8linear.choose_kernel(64)
    assert choice.path == w4a8linear.PORTABLE and choice.fn is None
    assert "disabled by EDGEQ_W4A8_ISA=off" in choice.reason and "portable path" in choice.reason
    with pytest.raises(EdgeqError, match="native w4a8_mm is not available: disabled by EDGEQ_W4A8_ISA=off"):
        native_w4a8.w4a8_mm(torch.zeros(1, 64, dtype=torch.bfloat16), *_weights(32, 64, 64, torch.Generator()).__dict__
                            .values())


def test_forced_isa_is_used_or_refused(ready, isa_env, monkeypatch):
    isa_env("scalar")
    assert native_w4a8.status()["isa"] == "scalar" and "forced by EDGEQ_W4A8_ISA=scalar" in native_w4a8.status()["reason"]
    assert w4a8linear.choose_kernel(32).source == "edgeq native (scalar)"
    isa_env("bogus")
    with pytest.raises(EdgeqError, match="EDGEQ_W4A8_ISA='bogus' is not one of amx, vnni, avxvnni, avx2, scalar, off"):
        w4a8linear.choose_kernel(32)
    monkeypatch.setattr(native_w4a8, "_cpu_features", lambda: 0)  # a CPU without AVX2 (nor AVX512-VNNI)
    for isa in ("vnni", "avxvnni", "avx2"):
        isa_env(isa)
        with pytest.raises(EdgeqError, match=f"EDGEQ_W4A8_ISA={isa} but this CPU lacks it \\(has scalar; avx2 needs "
                                             "AVX2 \\+ FMA"):
            native_w4a8.available()
    isa_env(None)  # auto with only the scalar code: the portable path (faster than the scalar code), and why
    st = native_w4a8.status()
    assert st["available"] is False and st["isa"] is None and st["cpu_isas"] == ["scalar"]
    assert "neither AVX2 nor AVX512-VNNI" in st["reason"] and "EDGEQ_W4A8_ISA=scalar forces it" in st["reason"]
    choice = w4a8linear.choose_kernel(32)
    assert choice.fn is None and "neither AVX2 nor AVX512-VNNI" in choice.reason
    isa_env("scalar")
    assert native_w4a8.status()["isa"] == "scalar"
    with pytest.raises(EdgeqError, match="isa 'vnni' is not one this CPU runs \\(scalar\\)"):
        native_w4a8.w4a8_mm(torch.zeros(1, 32, dtype=torch.bfloat16), *_weights(32, 32, 32, torch.Generator())
                            .__dict__.values(), isa="vnni")


@pytest.mark.parametrize("bits,best", [(4, "avx2"), (4 | 8, "avxvnni")])
def test_avx2_class_cpu_gets_its_256_bit_path(ready, isa_env, monkeypatch, bits, best):
    """An AVX2-only CPU, and one with AVX-VNNI but no AVX512 (simulated flags): auto picks the best 256-bit path,
    its output is the portable path's bits, and the paths above it are refused, forced or per call. The simulated
    CPU's code really runs, so this machine must have it: AVX-VNNI (VEX vpdpbusd) is on Intel Alder Lake / Sapphire
    Rapids and later, not on AMD Zen 4 (which has AVX512-VNNI only); there the avxvnni case is skipped, saying so."""
    needed = {"avx2"} | ({"avxvnni"} if best == "avxvnni" else set())
    if not needed <= set(ready["cpu_isas"]):
        pytest.skip(f"this CPU cannot execute the {best} code (it runs {', '.join(ready['cpu_isas'])})")
    monkeypatch.setattr(native_w4a8, "_cpu_features", lambda: bits)
    isa_env(None)
    st = native_w4a8.status()
    have = ["scalar", "avx2"] + (["avxvnni"] if best == "avxvnni" else [])
    assert st["available"] and st["isa"] == best and st["cpu_isas"] == have and st["reason"] == "ok"
    assert w4a8linear.choose_kernel(64).source == f"edgeq native ({best})"
    gen = torch.Generator().manual_seed(17)
    p = _weights(96, 256, 64, gen)
    for m in (5, 12):
        x = _acts(m, 256, gen)
        want = w4a8_linear(x, p.qweight, p.scales, p.zeros, 64)
        assert torch.equal(_bits(native_w4a8.w4a8_mm(x, p.qweight, p.scales, p.zeros, 64)), _bits(want))
    with pytest.raises(EdgeqError, match=f"isa 'amx' is not one this CPU runs \\({', '.join(have)}\\)"):
        native_w4a8.w4a8_mm(x, p.qweight, p.scales, p.zeros, 64, isa="amx")
    for above in ("vnni",) + (("avxvnni",) if best == "avx2" else ()):
        isa_env(above)
        with pytest.raises(EdgeqError, match=f"EDGEQ_W4A8_ISA={above} but this CPU lacks it \\(has {', '.join(have)};"):
            native_w4a8.available()
    monkeypatch.undo()
    isa_env(best)  # the real CPU, path forced
    assert native_w4a8.status()["isa"] == best and f"forced by EDGEQ_W4A8_ISA={best}" in native_w4a8.status()["reason"]
    assert w4a8linear.choose_kernel(32).source == f"edgeq native ({best})"


# --- a loaded checkpoint ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_w4a8(tmp_path_factory) -> Path:
    from helpers.models import save_tiny

    from edgeq.convert.pipeline import convert
    from edgeq.scheme import Scheme

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops on busy cores: one thread is faster and the bits do not depend on it
    try:
        src = save_tiny("qwen2", tmp_path_factory.mktemp("src") / "qwen2", tied=True, seed=3)  # q/k/v biases
        out = tmp_path_factory.mktemp("w4a8") / "out"
        convert(src, out, scheme=Scheme.parse("w4a8-g64"), method="minmax")
    finally:
        torch.set_num_threads(before)
    return out


def _greedy(path: Path, prompt: list[int]):
    from edgeq.runtime import load
    from edgeq.runtime.generation import generate_ids

    lm = load(path, max_model_len=64, kv_cache_bytes=2 << 20)
    ids = generate_ids(lm, prompt, 12)[0]
    return ids, lm.settings, Counter(lm.path_counts)


def test_loaded_checkpoint_generates_the_same_ids_natively(ready, tiny_w4a8, isa_env):
    config = json.loads((tiny_w4a8 / "config.json").read_text())
    assert config["quantization_config"]["kernel"] == "amx_w4a8"
    prompt = [5, 17, 42, 99, 3, 250, 7]
    isa_env(None)
    ids_n, s_n, c_n = _greedy(tiny_w4a8, prompt)
    assert s_n.decode_path == s_n.prefill_path == "w4a8_kernel" and "edgeq native" in s_n.path_note
    assert c_n["w4a8_kernel"] > 0 and c_n["w4a8_portable"] == 0
    isa_env("off")
    ids_p, s_p, c_p = _greedy(tiny_w4a8, prompt)
    assert s_p.decode_path == "w4a8_portable" and "disabled by EDGEQ_W4A8_ISA=off" in s_p.path_note
    assert c_p["w4a8_portable"] > 0 and c_p["w4a8_kernel"] == 0
    assert len(ids_n) == 12 and ids_n == ids_p
