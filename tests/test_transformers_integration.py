"""transformers' from_pretrained on edgeq checkpoints after ``import edgeq`` (edgeq/integrations/transformers.py):
edgeq's modules over the mapped file, the same greedy tokens as edgeq.runtime.load, on both kernels."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.integrations import EdgeqIntegrationWarning, _state, register_transformers
from edgeq.runtime.embedding import PackedEmbedding
from edgeq.scheme import Scheme
from helpers.mapping import mapped_file
from helpers.models import save_tiny
from helpers.paths import REPO

PROMPTS = ("Once upon a time", "The function returns a list of")
KERNEL_MODULE = {"w4a16-g128": "Int4Linear", "w4a8-g128": "W4A8Linear"}


@pytest.fixture(scope="module")
def checkpoints(fixture_model, tmp_path_factory) -> dict[str, Path]:
    """The bundled model quantised by edgeq with both schemes (the tinygemm_w4a16 and amx_w4a8 kernels)."""
    from edgeq.convert.pipeline import convert

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for scheme in KERNEL_MODULE:
        out[scheme] = root / scheme
        convert(fixture_model, out[scheme], scheme=Scheme.parse(scheme))
    return out


def _from_pretrained(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.parametrize("scheme", list(KERNEL_MODULE))
def test_generate_matches_edgeq_runtime(checkpoints, scheme):
    from transformers import AutoTokenizer

    from edgeq.runtime import SamplingParams, generate, load

    path = checkpoints[scheme]
    model = _from_pretrained(path)
    manifest = json.loads((path / "edgeq_manifest.json").read_text())
    for name in manifest["quantized_modules"]:
        assert type(model.get_submodule(name)).__name__ == KERNEL_MODULE[scheme], name
    tok = AutoTokenizer.from_pretrained(str(path))
    # decode_ops="torch", prefill_attn="sdpa": the bit-identical ops (the native ones are bounded, not bit-equal to the
    # transformers forward, so a near-tie could part the greedy ids on some machine)
    lm = load(path, decode_ops="torch", prefill_attn="sdpa")
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            hf = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        ours = generate(lm, prompt, SamplingParams(max_tokens=16)).token_ids
        assert len(hf) == 16 and hf == ours, (prompt, hf, ours)
    counts = model.edgeq.path_counts
    assert counts and "bf16" not in counts  # every projection and the head ran an edgeq path
    assert set(counts) <= {"native_decode", "tinygemm_decode", "dequant_prefill", "w4a8_kernel", "w4a8_portable"}
    assert model.edgeq.kernel == manifest["kernel"] and model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="is quantized with edgeq and is not serializable"):
        model.save_pretrained(path.parent / f"{scheme}-saved")  # the checkpoint directory already is the saved form


@pytest.mark.parametrize("scheme", list(KERNEL_MODULE))
def test_quantised_modules_view_themapped_file(checkpoints, scheme):
    path = checkpoints[scheme]
    model = _from_pretrained(path)
    shard = str((path / "model.safetensors").resolve())
    quantised = [m for m in model.modules() if getattr(m, "edgeq_quantized", False)]
    assert len(quantised) == 4 * 7 + 1
    for m in quantised:
        assert not hasattr(m, "weight"), m.name  # no bf16 weight exists for a quantised module
        packed = [m.qweight, m.scales_and_zeros] if scheme.startswith("w4a16") else [m.qweight, m.scales, m.zeros]
        for t in packed:
            assert mapped_file(t.data_ptr()) == shard, m.name
    assert model.edgeq.copied_bytes == 0 and model.edgeq.layout == "native"
    for name, p in model.named_parameters():  # the rest, loaded by transformers: mapped too (safetensors' mmap)
        assert mapped_file(p.data_ptr()) == shard, name
    # the default stores the tied table packed for w4a16 (issue 16; w4a8 has no packed lookup: bf16): its own
    # residual level is mapped from the shard too, its level 0 is the head's tensors (counted with the head)
    emb = model.get_input_embeddings()
    own = [t for lv in getattr(emb, "levels", ()) if not lv.shared for t in (lv.qweight, lv.scales_and_zeros)]
    assert isinstance(emb, PackedEmbedding) == scheme.startswith("w4a16") and len(own) == (2 if scheme.startswith("w4a16") else 0)
    assert all(mapped_file(t.data_ptr()) == shard for t in own)
    assert model.edgeq.mapped_bytes == sum(t.numel() * t.element_size() for m in quantised for t in
                                           ([m.qweight, m.scales_and_zeros] if scheme.startswith("w4a16")
                                            else [m.qweight, m.scales, m.zeros])) + \
        sum(t.numel() * t.element_size() for t in own)


def test_checkpoint_with_todays_keys_still_loads(checkpoints, tmp_path):
    """A config.json written before bits/sym/modules_to_not_convert existed loads the same."""
    old = tmp_path / "old"
    shutil.copytree(checkpoints["w4a16-g128"], old)
    cfg = json.loads((old / "config.json").read_text())
    qc = cfg["quantization_config"]
    for key in ("bits", "sym", "zero_point_domain", "activation_bits"):
        del qc[key]
    qc["modules_not_converted"] = qc.pop("modules_to_not_convert")
    (old / "config.json").write_text(json.dumps(cfg))
    model = _from_pretrained(old)
    assert type(model.lm_head).__name__ == "Int4Linear"
    qc = model.config.quantization_config
    assert (qc.bits, qc.sym, qc.modules_to_not_convert) == (4, False, [])
    assert not hasattr(qc, "modules_not_converted")


def test_missing_manifest_is_an_error_naming_it(checkpoints, tmp_path):
    broken = tmp_path / "no-manifest"
    shutil.copytree(checkpoints["w4a16-g128"], broken)
    (broken / "edgeq_manifest.json").unlink()
    with pytest.raises(EdgeqError, match=r"no-manifest: no edgeq_manifest.json next to the weights"):
        _from_pretrained(broken)


def test_config_rejects_other_bits_and_reads_legacy_keys():
    from edgeq.integrations.transformers import EdgeqConfig

    cfg = EdgeqConfig.from_dict({"quant_method": "edgeq", "format_version": 1, "scheme": "w4a16-g128",
                                 "modules_not_converted": ["model.layers.0.mlp.down_proj"]})
    assert cfg.modules_to_not_convert == ["model.layers.0.mlp.down_proj"] and cfg.bits == 4 and cfg.sym is False
    assert cfg.to_dict()["scheme"] == "w4a16-g128"
    with pytest.raises(ValueError, match="bits 8: edgeq checkpoints store 4-bit weights"):
        EdgeqConfig.from_dict({"quant_method": "edgeq", "bits": 8})


def test_quantizer_refuses_gpu_and_on_the_fly_quantisation(monkeypatch):
    from edgeq.integrations.transformers import EdgeqConfig, EdgeqHfQuantizer

    q = EdgeqHfQuantizer(EdgeqConfig(), pre_quantized=True)
    q.validate_environment(device_map=None)
    q.validate_environment(device_map={"": "cpu"})
    with pytest.raises(ValueError, match=r"device_map=.*: cuda:0 is not the CPU; edgeq checkpoints run on the CPU only"):
        q.validate_environment(device_map={"model": "cpu", "lm_head": "cuda:0"})
    q.validate_environment(device_map="auto")  # no accelerator here: "auto" is the CPU (most snippets pass it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"device_map='auto': auto is not the CPU.*load without device_map$"):
        q.validate_environment(device_map="auto")
    with pytest.raises(ValueError, match="run `edgeq quantize MODEL -o OUT`"):
        EdgeqHfQuantizer(EdgeqConfig(), pre_quantized=False).validate_environment(device_map=None)
    assert q.update_dtype(torch.float32) == torch.bfloat16


def test_registration_failure_is_one_warning(monkeypatch):
    """A transformers whose registry refuses edgeq: import never fails, one warning says what to use instead."""
    from edgeq.integrations import transformers as integration

    def refuse():
        raise ValueError("Quantizer 'edgeq' already registered")

    monkeypatch.setattr(integration, "register", refuse)
    monkeypatch.setitem(_state, "registered", False)
    monkeypatch.setitem(_state, "warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert register_transformers() is False
        assert register_transformers() is False
    msgs = [str(w.message) for w in caught if issubclass(w.category, EdgeqIntegrationWarning)]
    assert len(msgs) == 1 and "Use edgeq.runtime.load(path) instead" in msgs[0] and "already registered" in msgs[0]


@pytest.mark.slow
def test_import_edgeq_is_cheap_and_registers_in_either_order():
    r = _run("import sys, edgeq; assert 'transformers' not in sys.modules, 'import edgeq imported transformers'\n"
             "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m; print(m['edgeq'].__name__)")
    assert r.returncode == 0 and r.stdout.strip() == "EdgeqHfQuantizer", r.stderr
    r = _run("import transformers.quantizers.auto as a, edgeq; print(a.AUTO_QUANTIZATION_CONFIG_MAPPING['edgeq'].__name__)")
    assert r.returncode == 0 and r.stdout.strip() == "EdgeqConfig", r.stderr
    # the integration module imported first: the hook fires while it is half-built, and it registers at its end
    r = _run("import warnings; warnings.simplefilter('error')\n"
             "from edgeq.integrations.transformers import EdgeqConfig\n"
             "import transformers.quantizers.auto as a; print(a.AUTO_QUANTIZER_MAPPING['edgeq'].__name__)")
    assert r.returncode == 0 and r.stdout.strip() == "EdgeqHfQuantizer", r.stderr


@pytest.mark.slow
def test_without_import_edgeq_transformers_skips_the_quantization(checkpoints):
    """What the docs and the model card warn about: transformers alone cannot load an edgeq checkpoint."""
    code = ("import sys\nfrom transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(checkpoints['w4a16-g128'])!r})\n"
            "assert 'edgeq' not in sys.modules\nprint(type(m.lm_head).__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRANSFORMERS_VERBOSITY": "warning"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "Linear"  # random weights, not edgeq's module
    assert "Unknown quantization type, got edgeq" in r.stderr



def test_biases_and_modules_kept_in_bf16(tmp_path):
    """Qwen2 (q/k/v biases inside the quantised modules) with down_proj kept in bf16 by a recipe: transformers
    reports no missing or unexpected key, the kept Linears are plain and mapped, and the logits are the runtime's."""
    from edgeq.convert.pipeline import convert
    from edgeq.runtime import load

    src = save_tiny("qwen2", tmp_path / "src")
    recipe = tmp_path / "keep.toml"
    recipe.write_text('name = "keepdown"\nmodel_types = ["qwen2"]\nkeep_bf16 = ["down_proj"]\n')
    out = tmp_path / "out"
    convert(src, out, scheme=Scheme.parse("w4a16-g32"), recipe=str(recipe))
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    kept = model.config.quantization_config.modules_to_not_convert
    assert kept == [f"model.layers.{i}.mlp.down_proj" for i in range(len(kept))] and kept
    for name in kept:
        m = model.get_submodule(name)
        assert type(m) is torch.nn.Linear and mapped_file(m.weight.data_ptr()) == str((out / "model.safetensors").resolve())
    q = model.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "Int4Linear" and q.bias is not None
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        ours = load(out, decode_ops="torch", prefill_attn="sdpa").forward(ids, use_cache=False)
        assert torch.equal(model(ids).logits, ours)


def test_what_transformers_did_with_an_edgeq_checkpoint_beyond_generate(checkpoints, tmp_path):
    """AutoModel blamed the checkpoint; a config.json saying tied crashed in transformers' tie_weights; backward ran
    and trained nothing (no gradient flows through the kernels): now a pointer to AutoModelForCausalLM, the tie
    ignored as the runtime and vLLM ignore it, and torch's own refusal of a backward with nothing to train."""
    from transformers import AutoModel

    path = checkpoints["w4a16-g128"]
    with pytest.raises(EdgeqError, match=r"LlamaModel has no lm_head; .* load them with AutoModelForCausalLM"):
        AutoModel.from_pretrained(str(path))
    tied = shutil.copytree(path, tmp_path / "tied")
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = _from_pretrained(tied)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, _from_pretrained(path)(ids).logits)
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(ids, labels=ids).loss.backward()


def test_strict_layout_is_honoured_as_in_vllm(checkpoints, tmp_path, monkeypatch):
    """transformers repacked a foreign layout even with EDGEQ_STRICT_LAYOUT=1, which the vLLM plugin honours."""
    from edgeq.runtime import repack
    from edgeq.runtime.swap import LayoutRepackWarning
    from helpers.checkpoints import foreign_layout

    foreign = tmp_path / "foreign"
    repack(checkpoints["w4a16-g128"], foreign, layout=foreign_layout())
    with pytest.warns(LayoutRepackWarning):
        _from_pretrained(foreign)
    monkeypatch.setenv("EDGEQ_STRICT_LAYOUT", "1")
    with pytest.raises(EdgeqError, match=r"run `edgeq repack` on it, or load without EDGEQ_STRICT_LAYOUT=1"):
        _from_pretrained(foreign)
