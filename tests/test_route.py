"""edgeq route: device class from flag sets (pure), the measured choice, the per-machine cache, the CLI output.

No timed assertions: timings are either synthetic (the choice rule) or only checked for structure."""

from __future__ import annotations

import json

import pytest
import torch

from edgeq import route as R
from edgeq.runtime.w4a8linear import KernelChoice
from helpers.cli import run_cli

SPR = {"fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
       "amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize("flags, cap, want", [
    (SPR, "AVX512", "AMX"),
    (SPR - {"amx_tile", "amx_int8", "amx_bf16"}, "AVX512", "AVX512-VNNI"),  # Ice Lake / Cascade Lake
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}, "AVX512", "AVX512"),  # Skylake-X
    ({"avx2", "fma", "avx_vnni"}, "AVX2", "AVX2"),  # Alder Lake: AVX-VNNI is not AVX512-VNNI
    ({"sse4_2", "avx"}, "DEFAULT", "other"),
    ({"asimd", "sve"}, None, "other"),  # aarch64 names
    (SPR, "AVX2", "AVX2"),  # ATEN_CPU_CAPABILITY=avx2: torch's own kernels run AVX2 code
    (SPR, "DEFAULT", "other"),
    ({"avx2", "fma"}, "AVX512", "AVX2"),  # torch cannot raise what the flags do not have
    ({"amx_tile", "amx_int8", "avx2", "fma"}, None, "AVX2"),  # AMX needs the AVX512 foundation too
])
def test_device_class(flags, cap, want):
    assert R.device_class(flags, cap) == want


def test_cpu_flags_parse(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma avx512f\n\nprocessor\t: 1\nflags\t: other\n")
    assert R.cpu_flags(f) == frozenset({"fpu", "avx2", "fma", "avx512f"})
    assert R.cpu_flags(tmp_path / "missing") == frozenset()


def _t(arm, m, ms, n=1536):
    return R.Timing(arm, n, 1536, m, ms, ms, ms)


def test_choice_comes_from_the_measurement():
    slow_w4a8 = [_t("tinygemm", 1, 1.0), _t("tinygemm", 512, 150.0), _t("dequant_prefill", 512, 40.0),
                 _t("w4a8_portable", 1, 9.0), _t("w4a8_portable", 512, 120.0)]
    costs, choice, reason = R.choose(slow_w4a8, {t.arm for t in slow_w4a8})
    w16, w8 = costs
    assert choice == "w4a16-g128" and (w16.decode_path, w16.prefill_path) == ("tinygemm", "dequant_prefill")
    assert w16.cost_ms == pytest.approx(40.0 + 128 * 1.0) and w8.cost_ms == pytest.approx(120.0 + 128 * 9.0)
    assert "w4a16-g128 is cheapest" in reason and "w4a8-g128 1272.0 ms" in reason
    # the same arms with a W4A8 path that is faster (a compiled kernel on another machine): w4a8 wins
    fast = slow_w4a8 + [_t("w4a8_kernel", 1, 0.5), _t("w4a8_kernel", 512, 20.0)]
    costs, choice, _ = R.choose(fast, {t.arm for t in fast})
    assert choice == "w4a8-g128" and costs[1].decode_path == "w4a8_kernel"
    # native decodes when it exists; prefill stays on the kernel when it beats the dequant path
    nat = slow_w4a8 + [_t("native", 1, 0.8), _t("native", 512, 30.0)]
    costs, _, _ = R.choose(nat, {t.arm for t in nat})
    assert (costs[0].decode_path, costs[0].prefill_path) == ("native", "native")
    # sums over shapes
    two = slow_w4a8 + [_t(t.arm, t.m, t.ms, n=8960) for t in slow_w4a8]
    costs, _, _ = R.choose(two, {t.arm for t in two})
    assert costs[0].decode_ms == pytest.approx(2.0)


def test_measure_times_every_available_arm_interleaved():
    found = {"native": None, "tinygemm": True, "w4a8": KernelChoice("w4a8_portable", None, "portable", "test")}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ts = R.measure(shapes=((64, 128),), prefill_m=8, passes=3, decode_calls=1, found=found)
    finally:
        torch.set_num_threads(before)
    arms = {(t.arm, t.m) for t in ts}
    assert arms == {("bf16", 1), ("tinygemm", 1), ("w4a8_portable", 1),
                    ("bf16", 8), ("tinygemm", 8), ("dequant_prefill", 8), ("w4a8_portable", 8)}
    assert all(t.ms_min <= t.ms <= t.ms_max and t.ms > 0 for t in ts)


def _fake_measurements(monkeypatch):
    calls = {"measure": 0}
    found = {"native": None, "tinygemm": True, "w4a8": KernelChoice("w4a8_portable", None, "portable", "none")}
    kernels = [R.Kernel("tinygemm", True, "x"), R.Kernel("w4a8_portable", True, "y"), R.Kernel("w4a8_kernel", False, "z")]

    def measure(*a, **k):
        calls["measure"] += 1
        return [_t("tinygemm", 1, 1.0), _t("tinygemm", 512, 50.0), _t("dequant_prefill", 512, 40.0),
                _t("w4a8_portable", 1, 3.0), _t("w4a8_portable", 512, 30.0)]

    monkeypatch.setattr(R, "kernels", lambda g=128: (kernels, found))
    monkeypatch.setattr(R, "measure", measure)
    return calls


def test_route_is_cached_per_machine_and_refreshable(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path))
    calls = _fake_measurements(monkeypatch)
    first = R.route()
    assert first.source == "measured" and calls["measure"] == 1 and first.choice == "w4a16-g128"
    assert first.device_class in R.CLASSES and first.threads == torch.get_num_threads()
    stored = json.loads((tmp_path / "route.json").read_text())
    assert list(stored) == [first.key] and f"torch={torch.__version__}" in first.key and "edgeq=" in first.key
    again = R.route()
    assert again.source == "cached" and calls["measure"] == 1 and again.choice == first.choice
    assert again.timings == first.timings and again.schemes == first.schemes and again.kernels == first.kernels
    assert R.auto_scheme() == "w4a16-g128" and R.resolve_scheme("auto") == "w4a16-g128" and calls["measure"] == 1
    assert R.resolve_scheme("w4a8-g64") == "w4a8-g64" and R.resolve_scheme(None) is None
    R.route(refresh=True)
    assert calls["measure"] == 2
    # another machine (other flags) or thread count is another key: measured again, both kept
    monkeypatch.setattr(R, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"avx2", "fma"}))
    other = R.route()
    assert other.source == "measured" and other.device_class == "AVX2" and calls["measure"] == 3
    assert len(json.loads((tmp_path / "route.json").read_text())) == 2
    # a native W4A8 build that starts working changes the route: the cached one must not be reused
    assert "kernels=tinygemm,w4a8_portable" in other.key
    kernels = R.kernels()[0]
    monkeypatch.setattr(R, "kernels", lambda g=128: (kernels[:2] + [R.Kernel("w4a8_kernel", True, "native")], {
        "native": None, "tinygemm": True, "w4a8": None}))
    newer = R.route()
    assert newer.source == "measured" and calls["measure"] == 4 and "w4a8_kernel" in newer.key


def test_route_command_prints_the_choice_and_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path))
    _fake_measurements(monkeypatch)
    code, out, err = run_cli(["route", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["choice"] == "w4a16-g128" and data["schemes"][1]["decode_path"] == "w4a8_portable"
    code, out, err = run_cli(["route"], capsys)
    assert code == 0 and "fastest here: w4a16-g128" in out and "w4a8_portable" in out
    code, out, err = run_cli(["route", "--refresh", "--passes", "2"], capsys)
    assert code == 2 and out == "" and err.startswith("error: --passes 2: need at least 3")
