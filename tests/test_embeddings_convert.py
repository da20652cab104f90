"""`edgeq quantize --embeddings packed` (issue 16, the convert side): tensors, manifest, the contract's E bit for bit,
the residual's worth, bf16 output unchanged, refusals through the real CLI, dry-run, GPTQ input and --method gptq.

E (docs/format.md, "Packed embeddings"): D_l = (float32(q_l) - 8) * float32(scale_l) + float32(zero_l) in fp32,
E = bfloat16(D_0 + D_1) (fp32 add, one round-to-nearest-even).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from edgeq.convert.pipeline import convert
from edgeq.errors import EdgeqError
from edgeq.io.hf import open_checkpoint
from edgeq.io.manifest import Manifest, read_manifest
from edgeq.io.safetensors import read_header
from edgeq.layouts import tinygemm as tg
from edgeq.layouts.tinygemm import TinygemmLayout
from edgeq.quantize.rtn import quantize_groups
from helpers.cli import run_cli
from helpers.gptq import make_gptq, pack_gptq
from helpers.models import make_config, save_tiny
from helpers.paths import FIXTURE

GOLDEN = Path(__file__).parent / "golden" / "tiny-prose-w4a16-g128.json"
TABLE = "model.embed_tokens"


# ---------------------------------------------------------------------------------------------------------------
# the contract's E, by hand (numpy float32 scalars, bf16 rounding on the bits) and from the written tensors


def bf16_rne(x: np.float32) -> float:
    """float32 -> bfloat16 by round-to-nearest-even on the bits (no torch)."""
    bits = struct.unpack("<I", struct.pack("<f", float(x)))[0]
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def hand_d(q: int, scale: float, zero: float) -> np.float32:
    """D = (float32(q) - 8) * float32(scale) + float32(zero): fp32 multiply, then fp32 add."""
    return np.float32(np.float32(np.float32(q) - np.float32(8)) * np.float32(scale)) + np.float32(zero)


def hand_e(levels, r: int, k: int) -> float:
    """E[r, k] from [(q uint8 [V, K], scales_and_zeros bf16 [K/G, V, 2], G), ...] by hand."""
    total = np.float32(0)
    for q, sz, g in levels:
        total = np.float32(total + hand_d(int(q[r, k]), float(sz[k // g, r, 0]), float(sz[k // g, r, 1])))
    return bf16_rne(total)


def read_level(out: Path, module: str, g: int):
    """(q uint8 [V, K], scales_and_zeros bf16 [K/G, V, 2], G) of one level as written."""
    ck, layout = open_checkpoint(out), TinygemmLayout.from_json(read_manifest(out).layout)
    qw, sz = ck.read(f"{module}.qweight"), ck.read(f"{module}.scales_and_zeros")
    return tg.unpack(qw, qw.shape[0], 2 * qw.shape[1], layout), sz, g


def levels_of(out: Path) -> list:
    man = read_manifest(out)
    (module,) = man.embeddings
    return [read_level(out, m, g) for m, g in man.embedding_levels(module)]


def formula_e(levels, rows=None) -> torch.Tensor:
    """E (bf16) from the levels, vectorised: the contract's expression with tinygemm.dequantize in fp32."""
    total = None
    for q, sz, g in levels:
        q, sz = (q, sz) if rows is None else (q[rows], sz[:, rows])
        d = tg.dequantize(q, sz, g, torch.float32)
        total = d if total is None else total + d
    return total.to(torch.bfloat16)


def test_contract_worked_example():
    """q0 = 11, scale0 = 0.25, zero0 = 0.5 -> D0 = 1.25; q1 = 6, scale1 = 0.0078125, zero1 = 0 -> D1 = -0.015625;
    E = bf16(1.234375) = 1.234375, by hand and through tinygemm.dequantize (what the writer uses)."""
    assert hand_d(11, 0.25, 0.5) == np.float32(1.25) and hand_d(6, 0.0078125, 0.0) == np.float32(-0.015625)
    sz0 = torch.tensor([[[0.25, 0.5]]], dtype=torch.bfloat16).expand(1, 16, 2).contiguous()
    sz1 = torch.tensor([[[0.0078125, 0.0]]], dtype=torch.bfloat16).expand(1, 16, 2).contiguous()
    q0, q1 = torch.full((16, 32), 11, dtype=torch.uint8), torch.full((16, 32), 6, dtype=torch.uint8)
    levels = [(q0, sz0, 32), (q1, sz1, 32)]
    assert hand_e(levels, 3, 7) == 1.234375
    assert bool((formula_e(levels) == 1.234375).all())
    # one rounding of the fp32 sum, to nearest even: 1 + 2^-8 lies halfway between two bf16 values, 1 is the even
    assert bf16_rne(np.float32(1 + 2**-8)) == 1.0 and bf16_rne(np.float32(1 + 3 * 2**-8)) == 1 + 2**-6


# ---------------------------------------------------------------------------------------------------------------
# the bundled model (tied): level 0 is the head


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = tmp_path_factory.mktemp("emb") / "packed"
    report = convert(FIXTURE, out, embeddings="packed")
    return out, report


@pytest.fixture(scope="module")
def bf16_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("emb") / "bf16"
    convert(FIXTURE, out, embeddings="bf16")
    return out


@pytest.mark.slow
def test_tied_tensors_manifest_and_config(packed, bf16_out):
    """The packed checkpoint is the bf16 one with model.embed_tokens.weight replaced by the residual level's two
    tensors; the manifest records the levels (head first) and format_version 2, everywhere it is written."""
    out, report = packed
    got, ref = open_checkpoint(out), open_checkpoint(bf16_out)
    assert set(got.tensors) == (set(ref.tensors) - {f"{TABLE}.weight"}) | {f"{TABLE}.qweight", f"{TABLE}.scales_and_zeros"}
    assert (got.tensors[f"{TABLE}.qweight"].dtype, got.tensors[f"{TABLE}.qweight"].shape) == ("U8", (4096, 128))
    assert (got.tensors[f"{TABLE}.scales_and_zeros"].dtype, got.tensors[f"{TABLE}.scales_and_zeros"].shape) == ("BF16", (2, 4096, 2))
    for name in ref.tensors:  # everything else, the head included, is what the bf16 conversion writes
        if name != f"{TABLE}.weight":
            assert torch.equal(got.read(name), ref.read(name)), name
    man, man_ref = (json.loads((d / "edgeq_manifest.json").read_text()) for d in (out, bf16_out))
    assert man["format_version"] == 2 and man_ref["format_version"] == 1 and "embeddings" not in man_ref
    assert man["embeddings"] == {TABLE: {"storage": "packed", "source": f"{TABLE}.weight", "levels": [
        {"module": "lm_head", "group_size": 32}, {"module": TABLE, "group_size": 128}]}}
    assert man["tensors"][f"{TABLE}.qweight"] == {"role": "embedding", "source": f"{TABLE}.weight", "dtype": "U8", "shape": [4096, 128]}
    assert man["tensors"][f"{TABLE}.scales_and_zeros"]["role"] == "embedding"
    assert TABLE not in man["quantized_modules"] and TABLE not in man.get("group_sizes", {})
    for key in ("scheme", "method", "kernel", "layout", "head", "quantized_modules", "group_sizes", "modules_not_converted"):
        assert man[key] == man_ref[key], key
    assert {k: v for k, v in man["tensors"].items() if not k.startswith(TABLE)} == \
        {k: v for k, v in man_ref["tensors"].items() if not k.startswith(TABLE)}
    config, config_ref = (json.loads((d / "config.json").read_text()) for d in (out, bf16_out))
    assert config["quantization_config"].pop("format_version") == 2
    assert config_ref["quantization_config"].pop("format_version") == 1 and config == config_ref
    assert read_header(out / "model.safetensors")[1] == {"format": "pt", "edgeq_format_version": "2"}
    emb = report.embeddings
    assert (emb["storage"], emb["bytes"], emb["bf16_bytes"]) == ("packed", 4096 * 128 + 2 * 4096 * 4, 4096 * 256 * 2)


@pytest.mark.slow
def test_tied_residual_is_the_contract_bit_for_bit(packed, fixture_model):
    """Level 0 is the head as written; level 1 is exactly quantize_groups(float32(W) - D_0, 128, "rtn"); E of chosen
    rows computed by hand from the written tensors equals the vectorised formula; and the residual is worth it."""
    out, report = packed
    levels = levels_of(out)
    (q0, sz0, g0), (q1, sz1, g1) = levels
    assert (g0, g1) == (32, 128)
    assert torch.equal((q0, sz0)[0], read_level(out, "lm_head", 32)[0])
    w = open_checkpoint(fixture_model).read(f"{TABLE}.weight").to(torch.float32)
    d0 = tg.dequantize(q0, sz0, g0, torch.float32)
    want = quantize_groups(w - d0, 128, "rtn")
    assert torch.equal(q1, want.q) and torch.equal(sz1, want.scales_and_zeros)
    rows = [0, 1, 63, 64, 1234, 4095]
    e = formula_e(levels, rows)
    for i, r in enumerate(rows):
        for k in range(0, 256, 5):
            assert float(e[i, k]) == hand_e(levels, r, k), (r, k)
    e_all, e0 = formula_e(levels).float(), d0.to(torch.bfloat16).float()
    err, err0 = (e_all - w).abs().max(), (e0 - w).abs().max()
    assert float(err) < 0.25 * float(err0)
    rel, rel0 = float((e_all - w).norm() / w.norm()), float((e0 - w).norm() / w.norm())
    assert rel < 0.2 * rel0
    assert report.embeddings["max_error"] == pytest.approx(float(err)) and report.embeddings["relative_error"] == pytest.approx(rel, rel=1e-3)
    assert report.embeddings["level0_max_error"] == pytest.approx(float(err0))


@pytest.mark.slow
def test_bf16_is_written_as_before(bf16_out):
    """--embeddings bf16 writes what format_version 1 did: the golden header and manifest, metadata "1", no
    embeddings key (the golden was written before packed embeddings existed)."""
    tensors, meta = read_header(bf16_out / "model.safetensors")
    man = json.loads((bf16_out / "edgeq_manifest.json").read_text())
    golden = json.loads(GOLDEN.read_text())
    assert {n: [t.dtype, list(t.shape), t.start, t.nbytes] for n, t in tensors.items()} == golden["header"]
    assert meta == {"format": "pt", "edgeq_format_version": "1"}
    assert {k: v for k, v in man.items() if k not in ("layout", "shards", "created_by")} == golden["manifest"]
    assert json.loads((bf16_out / "config.json").read_text())["quantization_config"]["format_version"] == 1


# ---------------------------------------------------------------------------------------------------------------
# an untied Llama: both levels are the table's own


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    root = tmp_path_factory.mktemp("untied")
    src = save_tiny("llama", root / "src", tied=False, seed=3)
    report = convert(src, root / "out", embeddings="packed")
    return src, root / "out", report


def test_untied_levels_are_rtn_then_the_residual(untied):
    src, out, report = untied
    got, man = open_checkpoint(out), json.loads((out / "edgeq_manifest.json").read_text())
    own = {n: (t.dtype, t.shape) for n, t in got.tensors.items() if n.startswith(TABLE)}
    assert own == {f"{TABLE}.qweight": ("U8", (256, 64)), f"{TABLE}.scales_and_zeros": ("BF16", (4, 256, 2)),
                   f"{TABLE}.residual.qweight": ("U8", (256, 64)), f"{TABLE}.residual.scales_and_zeros": ("BF16", (1, 256, 2))}
    assert man["embeddings"][TABLE]["levels"] == [{"module": TABLE, "group_size": 32},
                                                   {"module": f"{TABLE}.residual", "group_size": 128}]
    assert man["head"]["untied"] is False and man["head"]["source"] == "lm_head.weight" and man["format_version"] == 2
    assert all(n["role"] == "embedding" for k, n in man["tensors"].items() if k.startswith(TABLE))
    w = open_checkpoint(src).read(f"{TABLE}.weight")
    (q0, sz0, _), (q1, sz1, _) = levels = levels_of(out)
    first = quantize_groups(w, 32, "rtn")
    assert torch.equal(q0, first.q) and torch.equal(sz0, first.scales_and_zeros)
    d0 = tg.dequantize(q0, sz0, 32, torch.float32)
    second = quantize_groups(w.float() - d0, 128, "rtn")
    assert torch.equal(q1, second.q) and torch.equal(sz1, second.scales_and_zeros)
    e = formula_e(levels)
    for r in (0, 17, 255):
        for k in range(0, 128, 3):
            assert float(e[r, k]) == hand_e(levels, r, k)
    err, err0 = float((e.float() - w.float()).abs().max()), float((d0.to(torch.bfloat16).float() - w.float()).abs().max())
    assert err < 0.25 * err0
    assert report.embeddings["bytes"] == (256 * 64 + 4 * 256 * 4) + (256 * 64 + 256 * 4)


# ---------------------------------------------------------------------------------------------------------------
# the command: summary line, --json, --dry-run, refusals


def test_cli_reports_what_it_wrote(untied, tmp_path, capsys):
    src = untied[0]
    code, out, err = run_cli(["quantize", src, "--method", "rtn", "-o", tmp_path / "o", "-q", "--embeddings", "packed"], capsys)
    assert code == 0, err
    assert "embeddings: packed 4-bit (g32 + residual g128), 0.04 MiB (bf16: 0.06 MiB); relative error" in out
    code, out, err = run_cli(["quantize", src, "--method", "rtn", "-o", tmp_path / "j", "-q", "--json", "--embeddings", "packed"], capsys)
    emb = json.loads(out)["embeddings"]
    assert code == 0 and emb["storage"] == "packed" and emb["bytes"] == 37888 and emb["bf16_bytes"] == 65536
    assert emb["levels"] == [{"module": TABLE, "group_size": 32, "own": True},
                             {"module": f"{TABLE}.residual", "group_size": 128, "own": True}]
    code, out, err = run_cli(["quantize", src, "--method", "rtn", "-o", tmp_path / "b", "-q", "--embeddings", "bf16"], capsys)
    assert code == 0 and f"embeddings: bf16 ({TABLE}.weight), 0.06 MiB" in out


def test_dry_run_shows_the_levels(capsys):
    code, out, err = run_cli(["quantize", FIXTURE, "--method", "rtn", "--dry-run", "--json", "--embeddings", "packed"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    row = doc["plan"][-1]  # last: written after the head, whose stored bytes it reads back
    assert row["name"] == f"{TABLE}.weight" and row["action"] == "pack-embedding" and row["bytes_out"] == 557056
    assert row["levels"] == [{"module": "lm_head", "group_size": 32}, {"module": TABLE, "group_size": 128}]
    assert doc["embeddings"]["storage"] == "packed" and doc["embeddings"]["bf16_bytes"] == 2 << 20
    code, out, _ = run_cli(["quantize", FIXTURE, "--method", "rtn", "--dry-run", "--embeddings", "packed"], capsys)
    assert code == 0 and "embeddings: packed 4-bit (lm_head + residual g128), 0.53 MiB (bf16: 2.00 MiB)" in out
    code, out, _ = run_cli(["quantize", FIXTURE, "--method", "rtn", "--dry-run", "--json", "--embeddings", "bf16"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["embeddings"]["storage"] == "bf16"
    assert [r["action"] for r in doc["plan"] if r["name"] == f"{TABLE}.weight"] == ["copy"]


def test_w4a8_with_packed_is_refused(tmp_path, capsys):
    out = tmp_path / "o"
    code, stdout, err = run_cli(["quantize", FIXTURE, "-o", out, "-q", "--scheme", "w4a8-g128", "--embeddings", "packed"], capsys)
    assert code == 2 and stdout == "" and not out.exists()
    assert "--embeddings packed: scheme w4a8-g128 (amx_w4a8) has no packed embedding lookup; use a w4a16 scheme, or " \
           "--embeddings bf16" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(["quantize", FIXTURE, "--dry-run", "--embeddings", "int8"], capsys)
    assert code == 2 and "--embeddings 'int8': valid: bf16, packed" in err


def test_recipe_default_and_w4a8_fallback(tmp_path, capsys):
    """A recipe's embeddings_storage is the default; a w4a8 scheme writes bf16 whatever the recipe says."""
    recipe = tmp_path / "packed.toml"
    recipe.write_text('name = "packedllama"\nmodel_types = ["llama"]\nembeddings_storage = "packed"\n'
                      "group_sizes = { 'lm_head\\.weight$' = 32 }\n")
    code, out, _ = run_cli(["quantize", FIXTURE, "--dry-run", "--json", "--recipe", recipe], capsys)
    assert code == 0 and json.loads(out)["embeddings"]["storage"] == "packed"
    code, out, _ = run_cli(["quantize", FIXTURE, "--dry-run", "--json", "--recipe", recipe, "--scheme", "w4a8-g128"], capsys)
    assert code == 0 and json.loads(out)["embeddings"]["storage"] == "bf16"
    code, out, _ = run_cli(["quantize", FIXTURE, "--dry-run", "--json", "--recipe", recipe, "--embeddings", "bf16"], capsys)
    assert code == 0 and json.loads(out)["embeddings"]["storage"] == "bf16"
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nembeddings_storage = "int4"\n')
    code, _, err = run_cli(["quantize", FIXTURE, "--dry-run", "--recipe", bad], capsys)
    assert code == 2 and "embeddings_storage = 'int4'; valid: 'bf16', 'packed'" in err


def test_a_level_the_layout_cannot_take_is_a_plan_problem(tmp_path, capsys):
    """Hidden 128 cannot take a residual at g256 (--scheme w4a16-g256 cannot take the Linears either): listed."""
    src = save_tiny("llama", tmp_path / "src", tied=True)
    code, _, err = run_cli(["quantize", src, "-o", tmp_path / "o", "-q", "--scheme", "w4a16-g256", "--embeddings", "packed"], capsys)
    assert code == 2 and f"{TABLE}.weight [256, 128] (--embeddings packed, level {TABLE} g256): K=128 is not a multiple of " \
        "the group size 256" in err and "or --embeddings bf16" in err


# ---------------------------------------------------------------------------------------------------------------
# the manifest record is validated where it is read


def _manifest(packed) -> dict:
    return json.loads((packed[0] / "edgeq_manifest.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("edit, message", [
    (lambda m: m["embeddings"][TABLE].update(levels=[]), "levels must be a non-empty list"),
    (lambda m: m["embeddings"][TABLE]["levels"][1].update(group_size=48), "needs a module name and a tinygemm group size"),
    (lambda m: m["embeddings"][TABLE]["levels"][0].update(group_size=128), "the head is quantised at 32"),
    (lambda m: m["embeddings"][TABLE].update(levels=[{"module": TABLE, "group_size": 128}]), "level 0 must be the head"),
    (lambda m: m["embeddings"][TABLE]["levels"][1].update(module="model.layers.0.mlp.up_proj"), "is a quantised module"),
    (lambda m: m["embeddings"][TABLE].update(storage="int8"), 'this edgeq reads storage "packed"'),
    (lambda m: m.update(format_version=1), "format_version 1 has no packed embeddings"),
    (lambda m: m.update(format_version=3), "format_version 3 is not supported"),
    (lambda m: m.update(embeddings=[1]), "embeddings must be an object"),
])
def test_manifest_refuses_a_bad_record(packed, edit, message):
    m = _manifest(packed)
    edit(m)
    with pytest.raises(EdgeqError, match=message):
        Manifest.from_json(m)


@pytest.mark.slow
def test_manifest_reads_and_writes_the_record_back(packed):
    m = _manifest(packed)
    man = Manifest.from_json(m)
    assert man.to_json() == m and man.embedding_levels(TABLE) == [("lm_head", 32), (TABLE, 128)]
    m2 = dict(m, format_version=2)
    del m2["embeddings"]
    assert Manifest.from_json(m2).embeddings == {} and "embeddings" not in Manifest.from_json(m2).to_json()


# ---------------------------------------------------------------------------------------------------------------
# GPTQ input and --method gptq: the residual is against the head as written


BODY = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128), "self_attn.v_proj": (64, 128),
        "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
        "mlp.down_proj": (128, 256)}


def write_gptq_tied(path: Path, g: int = 32) -> Path:
    """A tiny Llama whose Linears are 4-bit GPTQ layers (v1 zeros) and whose head is tied to a float embedding."""
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for i in range(2):
        for j, (m, (n, k)) in enumerate(BODY.items()):
            q, zeros, scales, g_idx = make_gptq(n, k, g, seed=10 * i + j)
            qweight, qzeros = pack_gptq(q, zeros, 4, "gptq")
            tensors.update({f"model.layers.{i}.{m}.qweight": qweight, f"model.layers.{i}.{m}.qzeros": qzeros,
                            f"model.layers.{i}.{m}.scales": scales, f"model.layers.{i}.{m}.g_idx": g_idx})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(128, dtype=torch.float16)
    tensors["model.norm.weight"] = torch.ones(128, dtype=torch.float16)
    tensors[f"{TABLE}.weight"] = (torch.randn(256, 128, generator=gen) * 0.5).half()
    config = make_config("llama", tied=True).to_dict()
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": g, "sym": False,
                                     "desc_act": False, "lm_head": False}
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def check_residual_against_the_head(src: Path, out: Path, g0: int, g1: int) -> None:
    """Level 0 is the head as written, level 1 the rtn residual against it, E closer to W than the head alone."""
    man = read_manifest(out)
    assert man.embedding_levels(TABLE) == [("lm_head", g0), (TABLE, g1)] and man.format_version == 2
    (q0, sz0, _), (q1, sz1, _) = levels = levels_of(out)
    w = open_checkpoint(src).read(f"{TABLE}.weight").float()
    d0 = tg.dequantize(q0, sz0, g0, torch.float32)
    want = quantize_groups(w - d0, g1, "rtn")
    assert torch.equal(q1, want.q) and torch.equal(sz1, want.scales_and_zeros)
    e = formula_e(levels).float()
    assert float((e - w).abs().max()) < 0.25 * float((d0.to(torch.bfloat16).float() - w).abs().max())


def test_gptq_ingest_tied(tmp_path, capsys):
    src = write_gptq_tied(tmp_path / "gptq")
    code, out, err = run_cli(["quantize", src, "-o", tmp_path / "o", "-q", "--json", "--embeddings", "packed"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["method"] == "gptq-ingest" and report["embeddings"]["storage"] == "packed"
    check_residual_against_the_head(src, tmp_path / "o", 32, 32)
    assert f"{TABLE}.weight" not in open_checkpoint(tmp_path / "o").tensors


@pytest.mark.slow
def test_method_gptq_tied(tmp_path, capsys):
    """The head comes from calibration (GPTQ); the residual reads it back as written, after it."""
    code, out, err = run_cli(["quantize", FIXTURE, "-o", tmp_path / "o", "-q", "--json", "--method", "gptq",
                              "--nsamples", "2", "--seqlen", "32", "--embeddings", "packed"], capsys)
    assert code == 0, err
    assert json.loads(out)["embeddings"]["storage"] == "packed"
    check_residual_against_the_head(FIXTURE, tmp_path / "o", 32, 128)
    header = read_header(tmp_path / "o" / "model.safetensors")[0]
    assert header[f"{TABLE}.qweight"].start > header["lm_head.scales_and_zeros"].start  # written after the head


# ---------------------------------------------------------------------------------------------------------------
# inspect and the model card


def _poke(ckpt: Path, tensor: str, offset: int, data: bytes) -> None:
    info = open_checkpoint(ckpt).tensors[tensor]
    with open(info.file, "r+b") as f:
        f.seek(info.start + offset)
        f.write(data)


@pytest.mark.slow
def test_inspect_reports_the_packed_table(packed, bf16_out):
    from rich.console import Console

    from edgeq.inspect.report import inspect_checkpoint, render

    r, r0 = inspect_checkpoint(packed[0], verify=True), inspect_checkpoint(bf16_out)
    assert r.problems == () and r.warnings == () and r0.problems == ()
    assert (r.edgeq.format_version, r0.edgeq.format_version) == (2, 1)
    head_bytes = 4096 * 128 + (256 // 32) * 4096 * 4
    assert r.edgeq.embeddings == {TABLE: {"storage": "packed", "source": f"{TABLE}.weight", "levels": [
        {"module": "lm_head", "group_size": 32, "bytes": head_bytes, "shared": True},
        {"module": TABLE, "group_size": 128, "bytes": 557056, "shared": False}], "bytes": 557056, "bf16_bytes": 2 << 20}}
    assert r0.edgeq.embeddings == {TABLE: {"storage": "bf16", "source": f"{TABLE}.weight", "levels": [],
                                           "bytes": 2 << 20, "bf16_bytes": 2 << 20}}
    cats, cats0 = dict(r.bytes_by_category), dict(r0.bytes_by_category)
    assert (cats.pop("embeddings"), cats0.pop("embeddings")) == (557056, 2 << 20) and cats == cats0
    assert r.model["parameters"] == r0.model["parameters"]  # the packed parts encode the same V x K parameters
    assert r.memory.mapped_weights == r.files["tensor_bytes"] and r.memory.anon_weights == 0  # mapped as stored
    assert r0.memory.mapped_weights - r.memory.mapped_weights == (2 << 20) - 557056
    assert TABLE in r.verify.roundtrip  # the residual's bytes unpack and pack back to themselves
    con = Console(record=True, width=200)
    render(r, con)
    assert (f"embeddings: {TABLE} packed 4-bit = lm_head g32 (the head's) + {TABLE} g128, 544.0 KiB (bf16: 2.0 MiB)"
            in con.export_text())
    con = Console(record=True, width=200)
    render(r0, con)
    assert f"embeddings: {TABLE} bf16 ({TABLE}.weight), 2.0 MiB" in con.export_text()


@pytest.mark.slow
def test_inspect_finds_a_broken_table(packed, tmp_path):
    from edgeq.inspect.report import inspect_checkpoint

    ck = tmp_path / "c"
    shutil.copytree(packed[0], ck)
    _poke(ck, f"{TABLE}.scales_and_zeros", 0, b"\xc0\x7f")  # the residual's scale of row 0, group 0: NaN
    p = inspect_checkpoint(ck, verify=True).problems
    assert f"model.safetensors: tensor {TABLE}.scales_and_zeros: 1 NaN/Inf scales" in p
    assert f"packed embedding {TABLE}: 1 row(s) decode to NaN/Inf (E = bf16(sum of the levels)); a level's scales or " \
           "zeros are not finite" in p
    man = json.loads((ck / "edgeq_manifest.json").read_text())  # a record whose group size the tensors do not fit
    man["embeddings"][TABLE]["levels"][1]["group_size"] = 64
    (ck / "edgeq_manifest.json").write_text(json.dumps(man))
    p = inspect_checkpoint(ck).problems
    assert f"edgeq_manifest.json: packed embedding {TABLE}: level {TABLE} g64: {TABLE}.scales_and_zeros is BF16 " \
           "[2, 4096, 2], expected BF16 [4, 4096, 2] (the table is [4096, 256])" in p


@pytest.mark.slow
def test_card_states_the_packed_table(packed, bf16_out):
    row = ("| embeddings | `model.embed_tokens` packed 4-bit, decoded per token: `lm_head` g32 (the head's own tensors) "
           "+ `model.embed_tokens` g128 (a residual level); 0.53 MiB instead of 2.00 MiB in bf16 |")
    assert row in (packed[0] / "README.md").read_text().splitlines()
    assert "| embeddings |" not in (bf16_out / "README.md").read_text()  # a bf16 table: the card as before


def test_untied_inspect_and_card(untied):
    from edgeq.inspect.report import inspect_checkpoint

    out = untied[1]
    r = inspect_checkpoint(out, verify=True)
    assert [p for p in r.problems if "no tokenizer files" not in p] == []  # a random model without a tokenizer
    levels = r.edgeq.embeddings[TABLE]["levels"]
    assert [(lv["module"], lv["group_size"], lv["shared"]) for lv in levels] == [(TABLE, 32, False),
                                                                              (f"{TABLE}.residual", 128, False)]
    assert r.edgeq.embeddings[TABLE]["bytes"] == 37888 and r.bytes_by_category["embeddings"] == 37888
    assert {TABLE, f"{TABLE}.residual"} <= set(r.verify.roundtrip) and r.memory.anon_weights == 0
    assert "`model.embed_tokens` g32 + `model.embed_tokens.residual` g128 (a residual level); 0.04 MiB instead of " \
           "0.06 MiB in bf16" in (out / "README.md").read_text()


@pytest.mark.slow
def test_the_written_check_refuses_levels_that_do_not_fit(packed, tmp_path):
    """convert/verify.py re-opens what was written: a level whose tensors do not fit the record is refused."""
    from edgeq.convert.verify import verify_written

    ck = tmp_path / "c"
    shutil.copytree(packed[0], ck)
    verify_written(ck, "lm_head")
    man = json.loads((ck / "edgeq_manifest.json").read_text())
    man["embeddings"][TABLE]["levels"][1]["group_size"] = 64
    (ck / "edgeq_manifest.json").write_text(json.dumps(man))
    with pytest.raises(EdgeqError, match=rf"packed embedding {TABLE}: {TABLE}.scales_and_zeros is BF16 \[2, 4096, 2\], "
                                         r"expected BF16 \[4, 4096, 2\]"):
        verify_written(ck, "lm_head")


@pytest.mark.slow
def test_method_gptq_act_order_head_gets_own_levels(tmp_path, capsys):
    """An act-order head stores its columns permuted (M.perm), so it is not the table's level 0: the table gets its
    own rtn level at the head's G and a residual (and the manifest reader takes that for a tied table)."""
    code, out, err = run_cli(["quantize", FIXTURE, "-o", tmp_path / "o", "-q", "--json", "--method", "gptq",
                              "--nsamples", "2", "--seqlen", "32", "--act-order", "--embeddings", "packed"], capsys)
    assert code == 0, err
    man = read_manifest(tmp_path / "o")
    assert "lm_head" in man.extra["perm_modules"] and man.head["untied"] is True
    assert man.embedding_levels(TABLE) == [(TABLE, 32), (f"{TABLE}.residual", 128)]
    (q0, sz0, _), (q1, sz1, _) = levels_of(tmp_path / "o")
    w = open_checkpoint(FIXTURE).read(f"{TABLE}.weight")
    first = quantize_groups(w, 32, "rtn")
    assert torch.equal(q0, first.q) and torch.equal(sz0, first.scales_and_zeros)
