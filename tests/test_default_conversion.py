"""edgeq/convert/default.py: what `edgeq quantize MODEL` converts with when neither --recipe nor --method is given
(the quality recipe on ids sampled from the model, or the family recipe with the reason). Headers and config only;
the conversions themselves are in test_quality_recipe.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgeq.convert.default import base_group, default_choice
from edgeq.scheme import Scheme
from helpers.models import save_tiny
from helpers.paths import FIXTURE


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("d") / "llama", tied=True)


def _config(src: Path, tmp: Path, **change) -> Path:
    """A copy of ``src`` (weights symlinked) whose config.json has ``change`` applied (None deletes a key)."""
    out = tmp / "m"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    (out / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update({k: v for k, v in change.items() if v is not None})
    for k in [k for k, v in change.items() if v is None]:
        cfg.pop(k, None)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _ckpt(*shapes):
    return SimpleNamespace(tensors={f"t{i}": SimpleNamespace(shape=s) for i, s in enumerate(shapes)})


def test_base_group_is_the_largest_dividing_every_k():
    assert base_group(_ckpt((2048, 2048), (8192, 2048), (2048, 8192), (2048,))) == 256  # Llama-3.2-1B: 1-D skipped
    assert base_group(_ckpt((896, 896), (4864, 896), (896, 4864))) == 128  # Qwen2.5-0.5B: 896 = 3.5 x 256
    assert base_group(_ckpt((64, 96))) == 128  # nothing fits: the last, whose plan names the tensor


def test_the_bundled_model_gets_the_quality_recipe_at_g256():
    c = default_choice(FIXTURE, None)
    assert (c.recipe, str(c.scheme), c.calib, c.why) == ("quality", "w4a16-g256", "self", "")


def test_a_given_w4a16_scheme_is_the_base_group(llama):
    assert str(default_choice(llama, None).scheme) == "w4a16-g128"  # K = 128 here
    c = default_choice(llama, Scheme.parse("w4a16-g64"))
    assert (c.recipe, str(c.scheme)) == ("quality", "w4a16-g64")


def test_where_the_family_recipe_stays(llama, tmp_path):
    c = default_choice(llama, Scheme.parse("w4a8-g128"))
    assert (c.recipe, str(c.scheme)) == (None, "w4a8-g128")
    assert c.why == "w4a8-g128: the quality recipe writes W4A16 (tinygemm) only; converting with the family recipe (rtn)"
    gemma = save_tiny("gemma2", tmp_path / "g", tied=True)
    assert default_choice(gemma, None).why.startswith("model_type 'gemma2': GPTQ calibrates llama, mistral, qwen2")
    nothing = _config(llama, tmp_path, bos_token_id=None, eos_token_id=None)
    c = default_choice(nothing, None)
    assert c.recipe is None and c.why.startswith(f"{nothing / 'config.json'} has no bos_token_id or eos_token_id")


def test_an_eos_id_of_zero_or_a_list_is_a_start_token(llama, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert default_choice(_config(llama, tmp_path / "a", bos_token_id=None, eos_token_id=0), None).recipe == "quality"
    assert default_choice(_config(llama, tmp_path / "b", bos_token_id=None, eos_token_id=[2, 3]), None).recipe == "quality"


def test_quantised_input_is_left_to_the_ingest_path(llama, tmp_path):
    """GPTQ input is repacked exactly (other formats are refused by prepare()): no recipe chosen, nothing said."""
    src = _config(llama, tmp_path, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32})
    c = default_choice(src, None)
    assert (c.recipe, c.scheme, c.why) == (None, None, "")


@pytest.mark.parametrize("capability, flags, dtype, expected", [
    ("AVX2", {"amx_bf16", "avx512f"}, "bf16", "eager"),  # torch's bf16 SDPA packs for AMX, then refuses under avx2
    ("DEFAULT", {"amx_bf16"}, "bf16", "eager"),
    ("AVX512", {"amx_bf16"}, "bf16", "sdpa"),
    ("AVX2", {"amx_bf16"}, "fp32", "sdpa"),  # no AMX packing for fp32
    ("AVX2", {"avx512f", "avx512_bf16"}, "bf16", "sdpa"),  # Zen 4 forced to avx2: no AMX, no packing
])
def test_the_calibration_model_avoids_sdpa_where_torch_refuses_it(monkeypatch, capability, flags, dtype, expected):
    """The default command's sampling and GPTQ forward passes build transformers models with this attention; on an
    AMX CPU under ATEN_CPU_CAPABILITY=avx2 sdpa raised "pack_vnni2 is only supported when avx512 is supported" (the
    end-to-end case: test_faults_write.py's summary-line test, which runs the default command under avx2)."""
    import torch

    from edgeq import cpu
    from edgeq.io import skeleton

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu, "flags", lambda: frozenset(flags))
    assert skeleton.attention({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]) == expected
