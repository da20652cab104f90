"""edgeq inspect: every kind of checkpoint built here (tiny), each trap, the memory projection by hand, --verify,
the no-data-read property, bad input, the JSON schema, and a hypothesis fuzz of the header parser."""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from edgeq.convert.embeddings import pack_plan, resolve_storage
from edgeq.convert.plan import build_plan
from edgeq.io.hf import open_checkpoint
from edgeq.convert.recipe import find_recipe
from edgeq.io.safetensors import read_header
from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.memory import SCRATCH_BYTES_PER_ELEM, KVGeometry, kv_geometry, project, rows_per_block, scratch
from edgeq.memory import Tensor as MemTensor
from edgeq.inspect.report import inspect_checkpoint, render
from edgeq.scheme import Scheme

from helpers.paths import FIXTURE as TINY_PROSE

# tiny-prose: Llama, 4 layers, hidden 256, intermediate 768, 4 heads (head_dim 64), 2 KV heads, vocab 4096, tied.
TP_LAYER_MODULES = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 256),
                    "gate_proj": (768, 256), "up_proj": (768, 256), "down_proj": (256, 768)}
# The default output stores the tied table packed (issue 16): level 0 is the head's own tensors, the residual level
# model.embed_tokens g128 is U8 [4096, 128] + BF16 [2, 4096, 2]: 4096 * 256 / 2 + (256 / 128) * 4096 * 4 bytes.
TP_RESIDUAL = 4096 * 256 // 2 + (256 // 128) * 4096 * 4  # 557056, instead of the bf16 table's 4096 * 256 * 2
# Every tensor of the default w4a16-g128 output: 4329984 bytes at g128 everywhere, + 264192 for the llama recipe's
# g32 first layer, head, q/k/v and down_proj scales/zeros, with the bf16 table (2097152) replaced by the residual level.
TP_TENSOR_BYTES = 4329984 + 264192 - 4096 * 256 * 2 + TP_RESIDUAL  # 3054080


@pytest.fixture(scope="module")
def edgeq_ckpt(fixture_quantized) -> Path:
    """tiny-prose quantised w4a16-g128 (rtn) once per session (conftest); tests that modify it work on a copy."""
    return fixture_quantized


@pytest.fixture(scope="module")
def edgeq_bf16_ckpt(tmp_path_factory) -> Path:
    """tiny-prose quantised w4a16-g128 (rtn) with its table kept bf16 (--embeddings bf16): what only a bf16 table
    can show (the table stored twice beside a tied head)."""
    from edgeq.convert.pipeline import convert

    out = tmp_path_factory.mktemp("q-bf16") / "tiny-prose-w4a16-g128-bf16"
    convert(TINY_PROSE, out, embeddings="bf16")
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------------- edgeq checkpoint


def test_edgeq_checkpoint_report(edgeq_ckpt):
    r = inspect_checkpoint(edgeq_ckpt)
    assert r.kind == "edgeq" and r.problems == () and r.warnings == ()
    e = r.edgeq
    assert (e.scheme, e.group_size, e.method, e.kernel) == ("w4a16-g128", 128, "rtn", "tinygemm_w4a16")
    assert e.layout_matches and e.on_load.startswith("zero-copy")
    assert e.layout_stored["layout_hash"] == tinygemm.probe().layout_hash
    assert e.head_quantized and e.untied and e.head_source == "model.embed_tokens.weight"
    assert e.quantized_modules == 4 * 7 + 1 and e.modules_not_converted == {}
    # parameters: those of the source model (the untied head is a copy of the embedding, not new parameters)
    src = open_checkpoint(TINY_PROSE)
    assert r.model["parameters"] == sum(t.numel for t in src.tensors.values()) == 4196608
    assert r.model["architecture"] == "LlamaForCausalLM" and r.model["layers"] == 4
    # bytes by category, by hand: N*K/2 + (K/G)*N*2*2 per quantised weight; the llama recipe's group_sizes put the
    # whole first layer, the head, q/k/v and down_proj at G = 32, the rest at the scheme's 128
    fine = {"q_proj", "k_proj", "v_proj", "down_proj"}
    q = lambda n, k, g=128: n * k // 2 + (k // g) * n * 4  # noqa: E731
    assert r.bytes_by_category == {
        "quantized_linears": sum(q(n, k, 32 if m in fine or i == 0 else 128) for i in range(4)
                                 for m, (n, k) in TP_LAYER_MODULES.items()),
        "linears_unquantized": 0,
        "head": q(4096, 256, 32),
        "embeddings": TP_RESIDUAL,  # the table's own level only: its level 0 is the head, counted above
        "norms": (4 * 2 + 1) * 256 * 2,
        "other": 0,
    }
    assert sum(r.bytes_by_category.values()) == r.files["tensor_bytes"]
    quantized = r.bytes_by_category["quantized_linears"] + r.bytes_by_category["head"]
    weights = 4 * sum(n * k for n, k in TP_LAYER_MODULES.values()) + 4096 * 256
    assert r.effective_bits == pytest.approx(8 * quantized / weights)
    assert e.format_version == 2 and e.embeddings == {"model.embed_tokens": {
        "storage": "packed", "source": "model.embed_tokens.weight", "bytes": TP_RESIDUAL, "bf16_bytes": 4096 * 256 * 2,
        "levels": [{"module": "lm_head", "group_size": 32, "bytes": q(4096, 256, 32), "shared": True},
                   {"module": "model.embed_tokens", "group_size": 128, "bytes": TP_RESIDUAL, "shared": False}]}}


def test_memory_projection_by_hand(edgeq_ckpt):
    r = inspect_checkpoint(edgeq_ckpt, max_model_len=512, kv_cache_bytes=3 << 20)
    m = r.memory
    per_token = 2 * 4 * 2 * 64 * 2  # K and V * layers * kv heads * head_dim * bf16
    assert m.kv_bytes_per_token == per_token == 2048
    assert m.kv_budget_tokens == (3 << 20) // 2048 == 1536
    assert (m.kv_tokens, m.kv_bytes) == (512, 512 * 2048)
    # every tensor is bf16 or packed: all used in place from the mapping, nothing copied
    assert (m.mapped_weights, m.anon_weights) == (TP_TENSOR_BYTES, 0) and m.mapped_weights == r.files["tensor_bytes"]
    # scratch: the largest row block, the head's 4096 rows (fewer than ~4M / K = 16384) x K = 256, at 3 bytes
    assert (m.prefill_scratch_tensor, m.prefill_scratch) == ("lm_head", 4096 * 256 * 3)
    assert m.anon_total == 512 * 2048 + 4096 * 256 * 3 and m.total == TP_TENSOR_BYTES + m.anon_total and m.problems == ()
    # defaults as the runtime's: min(model maximum, budget tokens)
    d = inspect_checkpoint(edgeq_ckpt).memory
    assert (d.max_model_len, d.kv_tokens, d.kv_cache_bytes) == (1024, 1024, 256 << 20)
    # settings the runtime refuses are problems with the numbers
    bad = inspect_checkpoint(edgeq_ckpt, max_model_len=1024, kv_cache_bytes=1 << 20)
    assert any("needs 2097152 bytes of KV cache" in p and "holds 512 tokens" in p for p in bad.problems)
    assert any("exceeds the model's 1024 positions" in p for p in inspect_checkpoint(edgeq_ckpt, max_model_len=4096).problems)


def test_memory_formula_worked_example():
    g = KVGeometry(layers=28, kv_heads=2, head_dim=128, max_positions=32768)  # Qwen2.5-1.5B
    tensors = [MemTensor("a.qweight", "U8", 1600, 800, packed=True, qweight=True),
               MemTensor("a.scales_and_zeros", "BF16", 100, 200, packed=True),
               MemTensor("emb", "BF16", 150, 300), MemTensor("norm", "F32", 10, 40)]
    m = project(g, tensors, ("w", 50), kv_cache_bytes=256 << 20)
    assert g.bytes_per_token == 28672 and m.kv_budget_tokens == 9362 and m.kv_bytes == 9362 * 28672
    assert (m.mapped_weights, m.anon_weights) == (1300, 20)  # the fp32 norm is cast to bf16: 10 * 2 bytes
    r = project(g, tensors, ("w", 50), 256 << 20, max_model_len=100, repack=True)
    assert (r.mapped_weights, r.anon_weights, r.kv_bytes) == (500, 820, 100 * 28672)
    assert r.total == 500 + 820 + 100 * 28672 + 50
    assert kv_geometry({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128}).bytes_per_token == 2 * 2 * 4 * 32 * 2
    with pytest.raises(EdgeqError, match="cannot size the KV cache"):
        kv_geometry({"hidden_size": 128})
    # scratch: rows_per_block (~4M weights, whole 64-row blocks, at most N) * K * 3 bytes
    assert rows_per_block(14336, 4096, 64) == 1024 and rows_per_block(151936, 1536, 64) == 2688
    assert rows_per_block(256, 768, 64) == 256 and rows_per_block(4096, 1 << 20, 64) == 64
    assert scratch([("small", 256, 768), ("big", 14336, 4096), ("head", 151936, 1536)], 64) == ("big", 1024 * 4096 * 3)
    from edgeq.runtime import qlinear

    assert qlinear.Scratch(10).nbytes == 10 * SCRATCH_BYTES_PER_ELEM
    assert qlinear.rows_per_block is rows_per_block  # the runtime blocks its scratch by the projection's own rule


def test_gpt2_style_config_names_are_read_and_inspect_says_what_is_wrong(tmp_path, capsys):
    """GPT-2's config.json spells the fields n_layer, n_head, n_embd, n_positions (MPT: n_layers, n_heads, d_model,
    max_seq_len): `edgeq inspect` of a GPT-2 checkpoint stopped at "cannot size the KV cache (missing or bad
    'num_hidden_layers')" instead of reporting it; now it sizes the cache and names the unsupported architecture."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers.cli import run_cli

    gpt2 = {"n_layer": 2, "n_head": 4, "n_embd": 128, "n_positions": 64}
    g = kv_geometry(gpt2)
    assert (g.layers, g.kv_heads, g.head_dim, g.max_positions) == (2, 4, 32, 64)
    mpt = kv_geometry({"n_layers": 3, "n_heads": 2, "d_model": 64, "max_seq_len": 128})
    assert (mpt.layers, mpt.kv_heads, mpt.head_dim, mpt.max_positions) == (3, 2, 32, 128)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=256, bos_token_id=0, eos_token_id=0, **gpt2)).to(torch.bfloat16).save_pretrained(tmp_path / "g")
    code, out, err = run_cli(["inspect", str(tmp_path / "g")], capsys)
    assert code == 0 and "GPT2LMHeadModel (gpt2)" in out, (out, err)
    assert "cannot size the KV cache" not in err and "unsupported architecture model_type='gpt2'" in err, err


def test_projection_equals_what_the_runtime_allocates(edgeq_ckpt, monkeypatch):
    """The projection against edgeq.runtime.load's own read-back of what it built (KV cache, scratch, mapped)."""
    monkeypatch.setenv("EDGEQ_NATIVE_ISA", "off")  # memory does not depend on the decode kernel; skip its build
    from edgeq.runtime import load
    from edgeq.runtime.native import w4a16

    monkeypatch.setattr(w4a16, "_state", None)  # read the variable now; the process's kernel state comes back after

    model = load(edgeq_ckpt, max_model_len=300, kv_cache_bytes=1 << 20, prefill_threshold=32)
    s = model.settings
    m = inspect_checkpoint(edgeq_ckpt, max_model_len=300, kv_cache_bytes=1 << 20).memory
    assert (s.max_model_len, s.kv_bytes_per_token, s.max_cached_tokens) == (m.max_model_len, m.kv_bytes_per_token, m.kv_tokens)
    assert s.kv_cache_bytes == m.kv_bytes and s.scratch_bytes == m.prefill_scratch
    assert (s.mapped_bytes, s.copied_bytes) == (m.mapped_weights, m.anon_weights)


def _other_layout() -> tinygemm.TinygemmLayout:
    """A layout that is not this machine's: every block in adjacent-row order, as the default path packs."""
    here = tinygemm.probe()
    perms = tuple((s, tuple(range(s))) for s, _ in here.perms)
    if perms == here.perms:  # this machine packs adjacent rows already: reverse them instead
        perms = tuple((s, tuple(reversed(range(s)))) for s, _ in here.perms)
    return tinygemm.TinygemmLayout(block_n=here.block_n, perms=perms, torch_version="2.99", cpu_capability="OTHER")


def _set_layout(ckpt: Path, layout: tinygemm.TinygemmLayout) -> None:
    man = json.loads((ckpt / "edgeq_manifest.json").read_text())
    man["layout"] = layout.to_json()
    (ckpt / "edgeq_manifest.json").write_text(json.dumps(man))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["layout"] = layout.fingerprint()
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_layout_mismatch_says_what_load_will_do(edgeq_ckpt, tmp_path):
    ckpt = _copy(edgeq_ckpt, tmp_path)
    _set_layout(ckpt, _other_layout())
    r = inspect_checkpoint(ckpt)
    assert not r.edgeq.layout_matches and r.problems == ()
    assert r.edgeq.on_load.startswith("repack: 29 qweight tensors") and "--strict-layout" in r.edgeq.on_load
    assert any("differs from this machine" in w and "edgeq repack" in w for w in r.warnings)
    # the linears' and the head's qweights are repacked; the packed table's residual level is read in its stored
    # layout by the lookup (edgeq/runtime/embedding.py), so it stays mapped
    qweight = sum(n * k // 2 for n, k in TP_LAYER_MODULES.values()) * 4 + 4096 * 128
    assert r.memory.repack and (r.memory.mapped_weights, r.memory.anon_weights) == (TP_TENSOR_BYTES - qweight, qweight)
    strict = inspect_checkpoint(ckpt, strict_layout=True)
    assert strict.edgeq.on_load == "refused (--strict-layout)"
    assert any("load refuses it under --strict-layout" in p for p in strict.problems)


def test_edgeq_inconsistencies_are_problems(edgeq_ckpt, edgeq_bf16_ckpt, tmp_path):
    ckpt = _copy(edgeq_ckpt, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    cfg["quantization_config"]["scheme"] = "w4a16-g64"
    cfg["quantization_config"]["kernel"] = "amx_w4a8"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    man = json.loads((ckpt / "edgeq_manifest.json").read_text())
    man["tensors"]["model.norm.weight"]["shape"] = [255]
    (ckpt / "edgeq_manifest.json").write_text(json.dumps(man))
    p = "\n".join(inspect_checkpoint(ckpt).problems)
    assert "tie_word_embeddings is True" in p
    assert "quantization_config.scheme = 'w4a16-g64' but the manifest says 'w4a16-g128'" in p
    assert "quantization_config.kernel = 'amx_w4a8' but the manifest says 'tinygemm_w4a16'" in p  # the file's spelling
    assert "model.norm.weight is BF16 [256] but the manifest says BF16 [255]" in p
    # the default packed table stores no bf16 table beside the head: nothing is stored twice
    assert "stored twice" not in p
    bf16 = _copy(edgeq_bf16_ckpt, tmp_path / "bf16")
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (bf16 / "config.json").write_text(json.dumps(cfg))
    p = "\n".join(inspect_checkpoint(bf16).problems)
    assert "tie_word_embeddings is True" in p and "tied embeddings stored twice: config.json says " \
        "tie_word_embeddings=true but lm_head is stored too" in p and "beside model.embed_tokens.weight (2.0 MiB)" in p


def test_what_load_refuses_first_is_a_problem(edgeq_ckpt, tmp_path):
    """An audit found inspect passing checkpoints that generate refused: config.json's group size edited, a sharded
    checkpoint without its index; and a --max-model-len of 0 projected a negative KV cache."""
    ckpt = _copy(edgeq_ckpt, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 64
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert any(p.endswith("group_size 64; the checkpoint is inconsistent (load refuses the checkpoint)")
               for p in inspect_checkpoint(ckpt).problems)
    sharded = tmp_path / "sharded"
    from edgeq.convert.pipeline import convert

    convert(TINY_PROSE, sharded, max_shard_bytes=1 << 20)
    assert inspect_checkpoint(sharded).problems == ()
    (sharded / "model.safetensors.index.json").unlink()
    assert inspect_checkpoint(sharded).problems == (
        f"{sharded}: no model.safetensors or model.safetensors.index.json (load refuses the checkpoint)",)
    with pytest.raises(EdgeqError, match=r"--max-model-len 0: must be at least 1"):
        inspect_checkpoint(edgeq_ckpt, max_model_len=0)


def test_every_kernel_has_a_layout_with_the_whole_protocol():
    """A Kernel member without a registered Layout, or with one that lacks a member, would make inspect (and plan
    and load) refuse its checkpoints: every kernel's layout is that kernel's and has every member of the protocol,
    its methods callable, its runtime class one the loader can swap in."""
    from edgeq.keys import Kernel
    from edgeq.layouts.base import Layout, get
    from edgeq.runtime.swap import runtime_class

    data = set(Layout.__annotations__)
    methods = {name for name, v in vars(Layout).items() if callable(v) and not name.startswith("_")}
    assert {"kernel", "runtime_class", "measured"} <= data and {"read_record", "logical_shape", "roundtrip"} <= methods
    for k in Kernel:
        layout = get(k)
        assert isinstance(layout, Layout) and layout.kernel is k
        assert sorted(m for m in data | methods if not hasattr(layout, m)) == []
        assert all(callable(getattr(layout, m)) for m in methods)
        assert callable(getattr(runtime_class(k), "swap_in", None))


# ------------------------------------------------------------------------------------------------------- --verify


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _poke(ckpt: Path, tensor: str, offset: int, data: bytes) -> None:
    info = open_checkpoint(ckpt).tensors[tensor]
    with open(info.file, "r+b") as f:
        f.seek(info.start + offset)
        f.write(data)


def test_verify_clean(edgeq_ckpt):
    r = inspect_checkpoint(edgeq_ckpt, verify=True)
    assert r.problems == () and r.verify.shards == {"model.safetensors": "ok"}
    # 4 layers x 7 linears x (qweight, scales_and_zeros) + the head's 2 + 9 norms + the residual level's 2
    assert r.verify.tensors_checked == 4 * 7 * 2 + 2 + 9 + 2 == 69 and r.verify.bytes_read >= 2 * r.files["tensor_bytes"]
    # the head and one module of each distinct shape went through unpack -> pack with the stored layout, and the
    # packed table's own level
    assert r.verify.roundtrip[0] == "lm_head" and len(r.verify.roundtrip) == 5
    assert r.verify.roundtrip[-1] == "model.embed_tokens"


def test_verify_catches_a_flipped_byte(edgeq_ckpt, tmp_path, capsys):
    ckpt = _copy(edgeq_ckpt, tmp_path)
    assert inspect_checkpoint(ckpt).problems == ()  # headers cannot see it
    _poke(ckpt, "model.layers.1.mlp.up_proj.qweight", 1000, bytes([0x5A ^ 0xFF]))
    r = inspect_checkpoint(ckpt, verify=True)
    assert r.verify.shards == {"model.safetensors": "sha256 mismatch"}
    assert len(r.problems) == 1 and "does not match the manifest" in r.problems[0]
    code, _, err = _main(capsys, ckpt, "--verify", "--strict")  # a ThresholdError: exit 1
    assert code == 1 and err.splitlines()[-1].startswith("threshold broken: --strict: 1 problem(s) found in ")


def test_verify_catches_bad_scales(edgeq_ckpt, tmp_path):
    ckpt = _copy(edgeq_ckpt, tmp_path)
    sz = "model.layers.0.self_attn.q_proj.scales_and_zeros"  # bf16 [K/G, N, 2]: (scale, zero) pairs
    _poke(ckpt, sz, 0, b"\xc0\x7f")  # scale 0: NaN
    _poke(ckpt, sz, 4, b"\x00\x00")  # scale 1: zero
    _poke(ckpt, sz, 8, b"\x80\xbf")  # scale 2: -1.0
    _poke(ckpt, sz, 14, b"\x80\x7f")  # zero 3: +Inf
    _poke(ckpt, "model.norm.weight", 0, b"\x80\xff")  # -Inf in a norm
    p = inspect_checkpoint(ckpt, verify=True).problems
    assert f"model.safetensors: tensor {sz}: 1 NaN/Inf scales" in p
    assert f"model.safetensors: tensor {sz}: 2 scale(s) zero or negative" in p
    assert f"model.safetensors: tensor {sz}: 1 NaN/Inf zero point(s)" in p
    assert "model.safetensors: tensor model.norm.weight: 1 NaN/Inf values" in p


def test_verify_roundtrip_catches_a_layout_that_does_not_fit(edgeq_ckpt, tmp_path):
    """A layout record without the tail block a tensor needs cannot unpack it: verify says so."""
    ckpt = _copy(edgeq_ckpt, tmp_path)
    here = tinygemm.probe()
    _set_layout(ckpt, tinygemm.TinygemmLayout(block_n=here.block_n * 16, perms=((here.block_n * 16, tuple(range(here.block_n * 16))),)))
    assert any("the layout record has no block of 256 rows, which model.layers.0.mlp.down_proj (N=256) needs" in p
               for p in inspect_checkpoint(ckpt).problems)
    r = inspect_checkpoint(ckpt, verify=True)
    assert "lm_head" in r.verify.roundtrip  # 4096 rows: four whole blocks of 1024, which the record does describe
    assert any(p.startswith("model.layers.0.self_attn.k_proj.qweight: unpack/repack failed (layout has no measured "
                            "block of 128 rows") for p in r.problems)


# --------------------------------------------------------------------------------------------------- plain HF input


def _write(path: Path, config: dict, tensors: dict, metadata: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata=metadata)
    return path


def _llama_config(hidden, inter, layers=2, heads=4, kv=2, vocab=512, tie=False, **extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 2048,
            "tie_word_embeddings": tie, **extra}


def _linear_shapes(hidden, inter, heads=4, kv=2) -> dict[str, tuple[int, int]]:
    hd = hidden // heads
    return {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv * hd, hidden),
            "self_attn.v_proj": (kv * hd, hidden), "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}


def _float_model(hidden, inter, layers=2, vocab=512, head=True, dtype=torch.bfloat16, skip=()) -> dict:
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).to(dtype),
         "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    if head:
        t["lm_head.weight"] = torch.randn(vocab, hidden, generator=g).to(dtype)
    for i in range(layers):
        t[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        for m, (n, k) in _linear_shapes(hidden, inter).items():
            if f"model.layers.{i}.{m}" not in skip:
                t[f"model.layers.{i}.{m}.weight"] = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    return t


def test_hf_tiny_prose_every_scheme():
    r = inspect_checkpoint(TINY_PROSE)
    assert r.kind == "hf" and r.problems == ()
    assert [o.scheme for o in r.schemes] == ["w4a16-g32", "w4a16-g64", "w4a16-g128", "w4a16-g256"]
    assert all(o.cannot_quantize == () for o in r.schemes)
    ckpt = open_checkpoint(TINY_PROSE)
    recipe = find_recipe(None, "llama")
    for o in r.schemes:  # the quantizer's own plan (the table stored as the default says), so the two cannot disagree
        scheme = Scheme.parse(o.scheme)
        bf16_table = build_plan(ckpt, scheme, "rtn", recipe)
        plan = pack_plan(bf16_table, recipe, resolve_storage(None, recipe, scheme), explicit=False)
        assert o.bytes_out == plan.bytes_out and o.ratio == pytest.approx(plan.bytes_in / plan.bytes_out)
        G = plan.scheme.group_size  # the recipe's group_sizes: layer 0, head, q/k/v, down_proj at min(32, G)
        # the default packs the tied table: its bf16 bytes become the residual level at G (level 0 is the head)
        assert plan.bytes_out == bf16_table.bytes_out - 4096 * 256 * 2 + 4096 * 256 // 2 + (256 // G) * 4096 * 4
        sized = [(n * k, min(32, G) if m in ("q_proj", "k_proj", "v_proj", "down_proj") or i == 0 else G)
                 for i in range(4) for m, (n, k) in TP_LAYER_MODULES.items()] + [(4096 * 256, min(32, G))]
        want = sum(w * (4 + 32 / g) for w, g in sized) / sum(w for w, _ in sized)
        assert o.effective_bits == pytest.approx(want)
    assert r.memory_basis.startswith("after `edgeq quantize --scheme w4a16-g128`")
    assert r.bytes_by_category["linears_unquantized"] == 4 * sum(n * k * 2 for n, k in TP_LAYER_MODULES.values())


def test_memory_of_hf_input_is_that_of_its_quantised_output(edgeq_ckpt):
    want = inspect_checkpoint(edgeq_ckpt, max_model_len=256).memory
    got = inspect_checkpoint(TINY_PROSE, max_model_len=256).memory
    assert asdict(got) == asdict(want)


def test_hf_which_tensors_cannot_be_quantised_and_why(tmp_path):
    # K = 192 divides by 32 and 64 only; K = 320 (down_proj) by 32 and 64 only; k_proj N = 96 is a multiple of 16
    ck = _write(tmp_path / "odd", _llama_config(192, 320, layers=1), _float_model(192, 320, layers=1))
    r = inspect_checkpoint(ck)
    cannot = {o.scheme: o.cannot_quantize for o in r.schemes}
    assert cannot["w4a16-g32"] == () and cannot["w4a16-g64"] == ()
    # 7 linears + the head + the default packed table's residual level (at the scheme's G)
    assert len(cannot["w4a16-g128"]) == 9 and len(cannot["w4a16-g256"]) == 9
    assert "model.embed_tokens.weight [512, 192] (--embeddings packed, level model.embed_tokens.residual g128): " \
           "K=192 is not a multiple of the group size 128; use a group size of 32, 64; or --embeddings bf16" \
           in cannot["w4a16-g128"]
    assert "model.layers.0.mlp.down_proj.weight [192, 320] BF16: K=320 is not a multiple of the group size 128; " \
           "use a group size of 32, 64" in cannot["w4a16-g128"]
    assert "lm_head.weight [512, 192] BF16: K=192 is not a multiple of the group size 256; use a group size of 32, 64" \
           in cannot["w4a16-g256"]
    recipe, g128 = find_recipe(None, "llama"), Scheme.parse("w4a16-g128")
    plan = pack_plan(build_plan(open_checkpoint(ck), g128, "rtn", recipe), recipe, resolve_storage(None, recipe, g128),
                     explicit=False)  # the quantizer's own plan, the table stored as the default says
    assert cannot["w4a16-g128"] == plan.problems
    assert r.problems == ()  # g32 and g64 work: not a problem of the checkpoint
    # N = 40 rows cannot be packed at any group size: then it is a problem
    t = _float_model(192, 320, layers=1)
    t["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(40, 192, dtype=torch.bfloat16)
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(40, 192, dtype=torch.bfloat16)
    t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(192, 40, dtype=torch.bfloat16)
    r = inspect_checkpoint(_write(tmp_path / "odder", _llama_config(192, 40, layers=1), t))
    assert any("no w4a16 scheme can quantise every weight" in p for p in r.problems)
    assert any("N=40 is not a multiple of 16" in c for c in r.schemes[0].cannot_quantize)


def test_hf_head_stored_although_tied_is_a_trap(tmp_path):
    ck = _write(tmp_path / "twice", _llama_config(256, 512, tie=True), _float_model(256, 512))
    r = inspect_checkpoint(ck)
    assert any(p.startswith("tied embeddings stored twice") for p in r.problems)


def test_verify_finds_a_head_that_is_a_copy_of_the_embedding(tmp_path):
    t = _float_model(256, 512)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    ck = _write(tmp_path / "copy", _llama_config(256, 512, tie=False), t)
    assert inspect_checkpoint(ck).problems == ()
    assert any("byte-for-byte copy of model.embed_tokens.weight" in p for p in inspect_checkpoint(ck, verify=True).problems)


# -------------------------------------------------------------------------------------------- foreign checkpoints
# Tensors follow each format's published layout; values are random (inspect reads shapes; --verify reads values).

H, I, V, L = 256, 512, 512, 2
I32 = torch.int32


def _r(*shape, dtype=torch.float16):
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(sum(shape))) + 0.5).to(dtype)


def _int(*shape, dtype=I32):
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int64, generator=torch.Generator().manual_seed(1)).to(dtype)


def gptq_module(n, k, bits=4, g=128) -> dict:
    """GPTQ (AutoGPTQ/GPTQModel): qweight int32 [K*bits/32, N], qzeros int32 [K/G, N*bits/32], scales fp16 [K/G, N],
    g_idx int32 [K]."""
    return {"qweight": _int(k * bits // 32, n), "qzeros": _int(k // g, n * bits // 32), "scales": _r(k // g, n),
            "g_idx": (torch.arange(k, dtype=I32) // g)}


def awq_module(n, k, bits=4, g=128) -> dict:
    """AWQ (GEMM): qweight int32 [K, N*bits/32], qzeros int32 [K/G, N*bits/32], scales fp16 [K/G, N]."""
    return {"qweight": _int(k, n * bits // 32), "qzeros": _int(k // g, n * bits // 32), "scales": _r(k // g, n)}


def ct_module(n, k, bits=4, g=128) -> dict:
    """compressed-tensors pack-quantized, asymmetric group: weight_packed int32 [N, K*bits/32], weight_scale [N, K/G],
    weight_zero_point int32 [N*bits/32, K/G] (packed along N), weight_shape int64 [2]."""
    return {"weight_packed": _int(n, k * bits // 32), "weight_scale": _r(n, k // g, dtype=torch.bfloat16),
            "weight_zero_point": _int(n * bits // 32, k // g), "weight_shape": torch.tensor([n, k])}


def torchao_module(n, k, g=128) -> dict:
    """torchao Int4Tensor flattened for safetensors: _weight_qdata uint8 [N, K/2], _weight_scale and
    _weight_zero_point [K/G, N] (bf16); type, logical shape and block size live in the file metadata."""
    return {"_weight_qdata": _int(n, k // 2, dtype=torch.uint8), "_weight_scale": _r(k // g, n, dtype=torch.bfloat16),
            "_weight_zero_point": _r(k // g, n, dtype=torch.bfloat16)}


def bnb4_module(n, k, blocksize=64) -> dict:
    """bitsandbytes nf4 with double quant: weight uint8 [N*K/2, 1], absmax uint8 (quantised, one per block),
    nested_absmax fp32 (one per 256 blocks), quant_map fp32 [16], nested_quant_map fp32 [256], quant_state (JSON bytes)."""
    blocks = n * k // blocksize
    state = json.dumps({"quant_type": "nf4", "blocksize": blocksize, "dtype": "bfloat16", "shape": [n, k],
                        "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.01}).encode()
    return {"weight": _int(n * k // 2, 1, dtype=torch.uint8), "weight.absmax": _int(blocks, dtype=torch.uint8),
            "weight.nested_absmax": _r(max(1, blocks // 256), dtype=torch.float32),
            "weight.quant_map": _r(16, dtype=torch.float32), "weight.nested_quant_map": _r(256, dtype=torch.float32),
            "weight.quant_state.bitsandbytes__nf4": torch.frombuffer(bytearray(state), dtype=torch.uint8)}


def bnb8_module(n, k) -> dict:
    """bitsandbytes LLM.int8: weight int8 [N, K], SCB fp32 [N] (per-row absmax), weight_format uint8."""
    return {"weight": _int(n, k, dtype=torch.int8), "SCB": _r(n, dtype=torch.float32),
            "weight_format": torch.zeros(1, dtype=torch.uint8)}


def _foreign(path: Path, qcfg: dict, make, *, head: str = "bf16", tie=False, skip=(), head_make=None, dtype=torch.float16,
             metadata=None) -> Path:
    """A tiny Llama whose Linear weights are ``make(n, k)`` parts; head: 'bf16' (float lm_head), 'quant', 'none'."""
    t = {}
    for name, x in _float_model(H, I, L, V, head=head == "bf16", dtype=dtype).items():
        if name.endswith(("_proj.weight",)) and name.removesuffix(".weight") not in skip:
            mod = name.removesuffix(".weight")
            n, k = x.shape
            t.update({f"{mod}.{p}" if not p.startswith("_") else f"{mod}.{p}": v for p, v in make(n, k).items()})
        else:
            t[name] = x
    if head == "quant":
        t.update({f"lm_head.{p}": v for p, v in (head_make or make)(V, H).items()})
    return _write(path, _llama_config(H, I, L, vocab=V, tie=tie, quantization_config=qcfg), t, metadata)


GPTQ_CFG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True,
            "checkpoint_format": "gptq", "lm_head": False}


def test_gptq_traps_head_bf16_tied_twice_and_silent_bf16_linear(tmp_path):
    ck = _foreign(tmp_path / "gptq", GPTQ_CFG, gptq_module, head="bf16", tie=True,
                  skip=("model.layers.1.mlp.down_proj",))
    r = inspect_checkpoint(ck)
    f = r.foreign
    assert r.kind == "foreign" and (f.format, f.bits, f.group_size, f.symmetric, f.act_order) == ("gptq", 4, 128, True, "true")
    assert f.bits_seen == (4.0,) and f.group_sizes_seen == (128,) and f.quantized_modules == 2 * 7 - 1
    assert f.head == "F16, unquantised" and f.unquantized_linears == ("model.layers.1.mlp.down_proj.weight",)
    p = "\n".join(r.problems)
    assert "output head lm_head.weight left in F16 (256.0 KiB" in p
    assert "tied embeddings stored twice" in p
    assert "1 Linear weight(s) left in F16 beside quantised ones, not declared in the config (256.0 KiB): " \
           "model.layers.1.mlp.down_proj.weight" in p
    assert any("act-order" in w for w in r.warnings)
    assert r.memory is None and r.schemes is None
    # parameters: logical N*K of each quantised module + the float tensors
    lin = sum(n * k for n, k in _linear_shapes(H, I).values())
    assert r.model["parameters"] == L * lin + V * H * 2 + H * (2 * L + 1)


def test_gptqmodel_head_at_8_bits(tmp_path):
    cfg = {**GPTQ_CFG, "desc_act": False, "lm_head": True, "dynamic": {"lm_head": {"bits": 8}}}
    ck = _foreign(tmp_path / "gptqm", cfg, gptq_module, head="quant", head_make=lambda n, k: gptq_module(n, k, bits=8))
    r = inspect_checkpoint(ck)
    assert r.foreign.head == "quantised, 8-bit" and r.foreign.act_order == "false"
    assert any("output head lm_head is stored at 8 bits while the linears are 4-bit" in p for p in r.problems)
    assert not any("left in" in p for p in r.problems)


def test_gptq_all_clean_has_no_problems(tmp_path):
    ck = _foreign(tmp_path / "ok", {**GPTQ_CFG, "lm_head": True}, gptq_module, head="quant")
    r = inspect_checkpoint(ck, verify=True)
    assert r.problems == () and r.foreign.head == "quantised, 4-bit"
    # per module: qweight K*N/2 + qzeros (K/G)*N/2 + fp16 scales (K/G)*N*2 + g_idx int32 K*4 bytes
    shapes = [*_linear_shapes(H, I).values()] * L + [(V, H)]
    stored = sum(k * n // 2 + k // 128 * n // 2 + k // 128 * n * 2 + 4 * k for n, k in shapes)
    assert r.effective_bits == pytest.approx(8 * stored / sum(n * k for n, k in shapes))


def test_awq(tmp_path):
    cfg = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
           "modules_to_not_convert": ["down_proj"]}
    ck = _foreign(tmp_path / "awq", cfg, awq_module, skip=("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"))
    r = inspect_checkpoint(ck)
    f = r.foreign
    assert (f.format, f.bits, f.group_size, f.symmetric, f.act_order) == ("awq", 4, 128, False, "false")
    assert f.bits_seen == (4.0,) and f.group_sizes_seen == (128,) and f.details == {"version": "gemm"}
    assert any("output head lm_head.weight left in F16" in p for p in r.problems)
    assert not any("not declared" in p for p in r.problems)  # down_proj is declared unquantised
    assert any("2 Linear weight(s) kept unquantised as the config declares" in w for w in r.warnings)


def test_compressed_tensors(tmp_path):
    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
               "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128,
               "actorder": "group", "dynamic": False}, "input_activations": None}},
           "ignore": ["lm_head"]}
    ck = _foreign(tmp_path / "ct", cfg, ct_module, dtype=torch.bfloat16)
    r = inspect_checkpoint(ck)
    f = r.foreign
    assert (f.format, f.bits, f.group_size, f.symmetric, f.act_order) == ("compressed-tensors", 4, 128, False, "group")
    assert f.bits_seen == (4.0,) and f.group_sizes_seen == (128,) and f.details["format"] == "pack-quantized"
    assert any("output head lm_head.weight left in BF16" in p for p in r.problems)  # "ignore" does not make it less so


def test_torchao(tmp_path):
    cfg = {"quant_method": "torchao", "include_input_output_embeddings": False, "untie_embedding_weights": False,
           "modules_to_not_convert": None, "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_version": 2,
                                                                      "_data": {"group_size": 128, "int4_packing_format": "plain"}}}}
    meta = {}
    for i in range(L):
        for m, (n, k) in _linear_shapes(H, I).items():
            meta[f"model.layers.{i}.{m}.weight"] = json.dumps(
                {"_type": "Int4Tensor", "_data": {"block_size": [1, 128], "shape": [n, k]},
                 "_tensor_data_names": ["qdata", "scale", "zero_point"]})
    meta["tensor_names"] = json.dumps(sorted(meta))
    ck = _foreign(tmp_path / "ao", cfg, torchao_module, head="none", tie=True, dtype=torch.bfloat16, metadata=meta)
    r = inspect_checkpoint(ck)
    f = r.foreign
    assert (f.format, f.bits, f.group_size, f.symmetric, f.act_order) == ("torchao", 4, 128, False, None)
    assert f.bits_seen == (4.0,) and f.group_sizes_seen == (128,) and f.quantized_modules == 14
    assert f.head == "tied to model.embed_tokens.weight (BF16)"
    assert any("output head tied to model.embed_tokens.weight (BF16" in p for p in r.problems)
    lin = sum(n * k for n, k in _linear_shapes(H, I).values())
    assert r.model["parameters"] == L * lin + V * H + H * (2 * L + 1)


def test_bitsandbytes_4bit_and_8bit(tmp_path):
    cfg4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "llm_int8_skip_modules": None}
    r = inspect_checkpoint(_foreign(tmp_path / "nf4", cfg4, bnb4_module, dtype=torch.bfloat16), verify=True)
    f = r.foreign
    assert (f.format, f.bits, f.symmetric) == ("bitsandbytes", 4, True)
    assert f.bits_seen == (4.0,) and f.group_sizes_seen == (64,) and f.details["quant_type"] == "nf4"
    assert f.quantized_modules == 14 and f.unquantized_linears == ()
    assert [p for p in r.problems if "left in BF16" in p]  # bitsandbytes never quantises the head
    assert not [p for p in r.problems if "NaN" in p or "negative" in p]  # uint8 absmax (double quant) is not a float
    cfg8 = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0,
            "llm_int8_skip_modules": None}
    r8 = inspect_checkpoint(_foreign(tmp_path / "int8", cfg8, bnb8_module))
    assert (r8.foreign.bits, r8.foreign.bits_seen, r8.foreign.details["quant_type"]) == (8, (8.0,), "llm.int8")
    assert r8.foreign.group_sizes_seen == (256, 512)  # per output row: the whole K


def test_quantised_tensors_without_config_and_lying_config(tmp_path):
    ck = _foreign(tmp_path / "nocfg", GPTQ_CFG, gptq_module)
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["quantization_config"]
    (ck / "config.json").write_text(json.dumps(cfg))
    r = inspect_checkpoint(ck)
    assert r.kind == "foreign" and any("config.json has no quantization_config" in p for p in r.problems)
    ck2 = _foreign(tmp_path / "lie", {**GPTQ_CFG, "bits": 8}, gptq_module)
    assert any("config.json says 8-bit but the tensor shapes give [4.0] bits" in p for p in inspect_checkpoint(ck2).problems)


# --------------------------------------------------------------------------------------------- output, JSON, CLI


def _keys(x, prefix="") -> set[str]:
    """Key paths of a JSON value; list items collapse to [] and open maps (shards, details...) to {}."""
    out = set()
    if isinstance(x, dict):
        for k, v in x.items():
            out |= {prefix + "." + k} | _keys(v, prefix + "." + k)
    elif isinstance(x, list) and x and isinstance(x[0], dict):
        out |= _keys(x[0], prefix + "[]")
    return out


OPEN_MAPS = (".edgeq.modules_not_converted", ".edgeq.created_by", ".edgeq.layout_stored", ".edgeq.layout_machine",
             ".edgeq.embeddings", ".foreign.details", ".verify.shards")
GOLDEN_TOP = {"schema_version", "path", "kind", "model", "files", "bytes_by_category", "effective_bits",
              "bits_per_parameter", "edgeq", "foreign", "schemes", "memory", "memory_basis", "problems", "warnings",
              "verify", "tensors"}
GOLDEN = {
    ".model": {"architecture", "model_type", "parameters", "layers", "hidden_size", "vocab_size", "tie_word_embeddings"},
    ".files": {"shards", "bytes", "tensor_bytes", "tensors"},
    ".bytes_by_category": {"quantized_linears", "linears_unquantized", "head", "embeddings", "norms", "other"},
    ".edgeq": {"format_version", "scheme", "group_size", "group_sizes", "method", "kernel", "layout_stored", "layout_machine",
               "layout_matches", "on_load", "head_quantized", "head_source", "untied", "quantized_modules",
               "modules_not_converted", "created_by", "embeddings", "head_levels"},
    ".foreign": {"format", "quant_method", "bits", "group_size", "symmetric", "act_order", "head", "quantized_modules",
                 "bits_seen", "group_sizes_seen", "unquantized_linears", "details"},
    ".schemes[]": {"scheme", "bytes_out", "ratio", "effective_bits", "cannot_quantize"},
    ".memory": {"max_model_len", "kv_cache_bytes", "kv_bytes_per_token", "kv_budget_tokens", "kv_tokens", "kv_bytes",
                "mapped_weights", "anon_weights", "prefill_scratch", "prefill_scratch_tensor", "repack", "anon_total",
                "total", "problems"},
    ".verify": {"tensors_checked", "bytes_read", "seconds", "shards", "roundtrip"},
    ".tensors[]": {"name", "shape", "dtype", "role", "quantized", "bytes", "file"},
}


def _json(path, capsys, *flags: str) -> dict:
    """``edgeq inspect PATH --json FLAGS``'s document."""
    code, out, err = _main(capsys, path, "--json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_json_schema_is_pinned(edgeq_ckpt, tmp_path, capsys):
    ck = _foreign(tmp_path / "gptq", GPTQ_CFG, gptq_module)
    docs = [_json(edgeq_ckpt, capsys, "--tensors", "--verify"), _json(TINY_PROSE, capsys), _json(ck, capsys)]
    assert [d["kind"] for d in docs] == ["edgeq", "hf", "foreign"]
    seen: dict[str, set[str]] = {}
    for d in docs:
        assert set(d) == GOLDEN_TOP and d["schema_version"] == 1
        for path in _keys(d):
            parent, _, leaf = path.rpartition(".")
            if not any(parent.startswith(o) for o in OPEN_MAPS) and parent:
                seen.setdefault(parent, set()).add(leaf)
    assert seen == GOLDEN
    assert docs[0]["tensors"][0].keys() == GOLDEN[".tensors[]"] and docs[1]["tensors"] is None
    row = next(t for t in docs[0]["tensors"] if t["name"] == "lm_head.qweight")
    assert row == {"name": "lm_head.qweight", "shape": [4096, 128], "dtype": "U8", "role": "head", "quantized": True,
                   "bytes": 4096 * 128, "file": "model.safetensors"}


def test_human_output(edgeq_ckpt, tmp_path):
    from rich.console import Console

    con = Console(record=True, width=200)
    render(inspect_checkpoint(edgeq_ckpt, tensors=True), con)
    text = con.export_text()
    assert "edgeq checkpoint · LlamaForCausalLM (llama) · 4.2M parameters" in text
    assert "matches this machine" in text and "lm_head.scales_and_zeros" in text and "no problems found" in text
    ck = _foreign(tmp_path / "gptq", GPTQ_CFG, gptq_module)
    con = Console(record=True, width=200, force_terminal=True)
    render(inspect_checkpoint(ck), con)
    ansi = con.export_text(styles=True)
    assert "\x1b[31mproblem: output head lm_head.weight left in F16" in ansi  # problems in red


def _main(capsys, *args) -> tuple[int, str, str]:
    """``edgeq inspect ARGS`` through the real entry point (edgeq.cli.main.main, its error handling included):
    (exit code, stdout, stderr)."""
    from edgeq.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["inspect", *map(str, args)])
    captured = capsys.readouterr()
    return e.value.code, captured.out, captured.err


def test_bad_input_is_one_line_exit_2(edgeq_ckpt, tmp_path, capsys):
    ck = _copy(edgeq_ckpt, tmp_path)
    code, out, _ = _main(capsys, str(ck), "--max-model-len", "64")
    assert code == 0 and "no problems found" in out and "64 tokens" in out
    shard = ck / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 10)  # the last tensor's data ends past the file
    code, out, err = _main(capsys, str(ck))
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "truncated file" in err
    os.truncate(shard, 20)  # header cut short
    code, out, err = _main(capsys, str(ck), "--json")
    assert code == 2 and out == "" and "corrupt safetensors header" in err
    # exit 1 under --strict when a problem is found
    code, out, err = _main(capsys, str(_foreign(tmp_path / "g", GPTQ_CFG, gptq_module)), "--strict")
    assert code == 1 and "problem: output head" in err and "--strict: " in err


def _lie(ckpt: Path, edit) -> None:
    """Rewrite the header of model.safetensors after ``edit(header)`` (offsets are relative to the data section)."""
    path = ckpt / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


@pytest.mark.parametrize("edit, message", [
    (lambda h: h["model.norm.weight"].update(shape=[512]), "model.norm.weight: header says BF16 [512] (1024 bytes) but data_offsets span 512 bytes"),
    (lambda h: h["model.norm.weight"].update(dtype="F32"), "model.norm.weight: header says F32 [256] (1024 bytes) but data_offsets span 512 bytes"),
    (lambda h: h["model.norm.weight"].update(dtype="Q4"), "model.norm.weight: unsupported dtype 'Q4'"),
    (lambda h: h["model.norm.weight"].update(dtype=["BF16"]), "model.norm.weight: unsupported dtype ['BF16']"),
    (lambda h: h["model.norm.weight"].update(data_offsets=[10**12, 10**12 + 512]), "truncated file"),
    (lambda h: h["model.norm.weight"].update(data_offsets=[0, 512]), "overlap"),
])
def test_lying_headers(tmp_path, edit, message):
    ck = _write(tmp_path / "m", _llama_config(256, 512), _float_model(256, 512))
    _lie(ck, edit)
    with pytest.raises(EdgeqError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        inspect_checkpoint(ck)


def test_missing_shard_and_broken_index(tmp_path):
    ck = _write(tmp_path / "m", _llama_config(256, 512), _float_model(256, 512))
    names = list(open_checkpoint(ck).tensors)
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EdgeqError, match="points at missing shard model-00002-of-00002.safetensors"):
        inspect_checkpoint(ck)
    for bad in ('["weight_map"]', '{"weight_map": {"a": 3}}', '{"weight_map": {"a": ["x"]}}', "{" * 100000):
        (ck / "model.safetensors.index.json").write_text(bad)
        with pytest.raises(EdgeqError, match="malformed index"):
            inspect_checkpoint(ck)
    (ck / "model.safetensors.index.json").unlink()
    (ck / "config.json").write_text("[" * 100000)
    with pytest.raises(EdgeqError, match="config.json: not valid JSON"):
        inspect_checkpoint(ck)


# ------------------------------------------------------------------------------------------- headers only, fuzzing


def _io() -> dict[str, int]:
    return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


def test_default_mode_reads_no_tensor_data(edgeq_ckpt):
    """rchar counts every byte this process asks read() for: the headers, config and manifest only, while each
    shard holds over 3 MB of tensor data (benchmarks/bench_inspect.py does the same on a 10 GB checkpoint)."""
    for target in (edgeq_ckpt, TINY_PROSE):
        inspect_checkpoint(target)  # imports, the layout probe, recipes: everything but the target's own bytes
        meta = sum((target / f).stat().st_size for f in ("config.json", "edgeq_manifest.json") if (target / f).exists())
        header = _data_start(target / "model.safetensors")
        data = (target / "model.safetensors").stat().st_size - header
        before = _io()
        inspect_checkpoint(target)
        got = {k: _io()[k] - before[k] for k in ("rchar", "syscr")}
        assert data > 3_000_000  # the packed default's 3054080 bytes (TP_TENSOR_BYTES); tiny-prose's 8.4 MB
        assert got["rchar"] < 3 * (meta + header) + 65536 < data / 10, got


def _header_file(raw: bytes) -> None:
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(raw)
        f.flush()
        try:
            read_header(Path(f.name))
        except EdgeqError:
            pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_fuzz_header_random_bytes(raw):
    _header_file(raw)
    _header_file(struct.pack("<Q", len(raw)) + raw)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["dtype", "shape", "data_offsets", None, "__metadata__", "entry"]), value=_json_values,
       extra=st.binary(max_size=64), cut=st.integers(min_value=0, max_value=400))
def test_fuzz_header_mutated_valid(field, value, extra, cut):
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]},
              "b": {"dtype": "U8", "shape": [16], "data_offsets": [64, 80]}}
    if field == "__metadata__":
        header["__metadata__"] = value
    elif field == "entry":
        header["b"] = value
    elif field is not None:
        header["a"][field] = value
    raw = json.dumps(header, allow_nan=True).encode()
    blob = struct.pack("<Q", len(raw)) + raw + bytes(80) + extra
    _header_file(blob)
    _header_file(blob[:cut])


def test_header_parser_edge_cases(tmp_path):
    for raw, message in [
        (b"\x01", "truncated safetensors file"),
        (struct.pack("<Q", 10**9) + b"{}", "claims 1000000000 header bytes"),
        (struct.pack("<Q", 200000) + b"[" * 200000, "not JSON"),  # nesting deep enough for a RecursionError
        (struct.pack("<Q", 20) + b'{"a": ' + b"1" * 13 + b"}", "corrupt header entry"),
        (struct.pack("<Q", 5010) + b'{"a":' + b"1" * 5004 + b"}", "not JSON"),  # int too long for Python to parse
    ]:
        path = tmp_path / "x.safetensors"
        path.write_bytes(raw)
        with pytest.raises(EdgeqError, match=message):
            read_header(path)


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory) -> Path:
    return _foreign(tmp_path_factory.mktemp("fz") / "g", GPTQ_CFG, gptq_module)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["gptq", "awq", "compressed-tensors", "torchao", "bitsandbytes", "fp8", 3]),
       extra=st.dictionaries(st.sampled_from(["bits", "group_size", "sym", "desc_act", "zero_point", "config_groups",
                                              "quant_type", "modules_to_not_convert", "ignore", "dynamic",
                                              "llm_int8_skip_modules", "load_in_4bit"]), _json_values, max_size=6))
def test_fuzz_foreign_config(gptq_dir, method, extra):
    """quantization_config is untrusted JSON: any value gives a report (or EdgeqError), never another exception."""
    cfg = json.loads((gptq_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, **extra}
    (gptq_dir / "config.json").write_text(json.dumps(cfg))
    r = inspect_checkpoint(gptq_dir)
    assert r.kind == "foreign"
