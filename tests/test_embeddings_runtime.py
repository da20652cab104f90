"""The runtime side of packed (4-bit) input embeddings (edgeq/runtime/embedding.py, docs/format.md "Packed
embeddings"): the row decoder bit-exact with the layout's unpack, the lookup bit-exact with the contract's formula
computed independently, a loaded packed checkpoint bit-identical to the same checkpoint with the table materialised,
the lean loop, transformers' from_pretrained, the CLI, a foreign layout and `edgeq repack`, damage refused."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgeq.convert.pipeline import convert
from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.layouts import tinygemm as tg
from edgeq.memory import KVGeometry, Tensor, project
from edgeq.runtime import embedding, load, repack
from edgeq.runtime.embedding import EmbeddingLevel, PackedEmbedding
from edgeq.scheme import Scheme
from helpers.checkpoints import avx2_like_layout, foreign_layout, quantize
from helpers.cli import run_cli
from helpers.embeddings import TABLE, pack_by_hand, reference_table, with_table
from helpers.mapping import greedy_both_loops, mapped_file
from helpers.models import save_tiny
from helpers.paths import FIXTURE

PROMPT = list(range(5, 29))


def _halves(s: int) -> tuple[int, ...]:
    return tuple(v for j in range(s // 2) for v in (j, j + s // 2))


def avx512_like_layout() -> tg.TinygemmLayout:
    """64-row blocks of interleaved halves, adjacent tails of 16/32/48 rows (what the AVX512 path packs)."""
    perms = ((16, tuple(range(16))), (32, tuple(range(32))), (48, tuple(range(48))), (64, _halves(64)))
    return tg.TinygemmLayout(block_n=64, perms=perms, cpu_capability="AVX512")


LAYOUTS = {"avx2-like": avx2_like_layout, "avx512-like": avx512_like_layout, "this machine": tg.probe}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the row decoder -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("n,k", [(16, 64), (48, 32), (64, 96), (80, 64), (176, 128), (1024 + 48, 32)])
def test_unpack_rows_equals_unpack_for_every_row(layout, n, k):
    lay = LAYOUTS[layout]()
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n * k), dtype=torch.uint8)
    packed = tg.pack(q, lay)
    whole = tg.unpack(packed, n, k, lay)
    assert torch.equal(whole, q)
    assert torch.equal(tg.unpack_rows(packed, torch.arange(n), n, k, lay), whole)  # every row, tails included
    rows = torch.randint(0, n, (57,), generator=torch.Generator().manual_seed(1))
    rows[:3] = torch.tensor([n - 1, 0, n - 1])  # repeats, the last row (in the tail block when there is one)
    assert torch.equal(tg.unpack_rows(packed, rows, n, k, lay), whole[rows])
    for r in range(n):  # one row at a time: the decode step's strided view
        assert torch.equal(tg.unpack_rows(packed, torch.tensor([r]), n, k, lay), whole[r : r + 1]), r
    assert tg.unpack_rows(packed, torch.empty(0, dtype=torch.long), n, k, lay).shape == (0, k)


def test_unpack_rows_hand_worked_avx512_halves():
    """Row 33 of a 64-row halves block is nibble position 3: byte 1's high nibble at k = 0, byte 33's at k = 1."""
    lay = avx512_like_layout()
    q = torch.zeros(64, 2, dtype=torch.uint8)
    q[33] = torch.tensor([5, 9])
    q[1, 0] = 7
    packed = tg.pack(q, lay).reshape(-1)
    assert int(packed[1]) == 7 | 5 << 4 and int(packed[33]) == 9 << 4
    assert tg.unpack_rows(packed.view(64, 1), torch.tensor([33, 1]), 64, 2, lay).tolist() == [[5, 9], [7, 0]]
    with pytest.raises(EdgeqError, match="row 64 is outside 0..63"):
        tg.unpack_rows(packed.view(64, 1), torch.tensor([64]), 64, 2, lay)


# --- the lookup -------------------------------------------------------------------------------------------------


def _random_level(module: str, v: int, k: int, g: int, layout, seed: int, shared: bool = False) -> EmbeddingLevel:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (v, k), generator=gen, dtype=torch.uint8)
    sz = (torch.randn(k // g, v, 2, generator=gen) * torch.tensor([0.02, 0.1])).to(torch.bfloat16)
    return EmbeddingLevel(module, tg.pack(q, layout), sz, g, layout, shared)


def contract_rows(levels, ids: torch.Tensor) -> torch.Tensor:
    """E[ids] by the contract, from whole-table fp32 dequantisations (tinygemm.unpack + tinygemm.dequantize)."""
    total = None
    for lv in levels:
        v, k = lv.qweight.shape[0], lv.qweight.shape[1] * 2
        d = tg.dequantize(tg.unpack(lv.qweight, v, k, lv.layout), lv.scales_and_zeros, lv.group_size, torch.float32)
        total = d if total is None else total + d
    return total.to(torch.bfloat16)[ids]


@pytest.mark.parametrize("chunk", [embedding.CHUNK_ELEMS, 3 * 256])
def test_lookup_is_the_contract_formula(monkeypatch, chunk):
    monkeypatch.setattr(embedding, "CHUNK_ELEMS", chunk)  # 3 rows a chunk: the chunked path
    v, k = 80, 256  # a tail block under both block sizes
    levels = (_random_level("lm_head", v, k, 32, tg.probe(), 1, shared=True),
              _random_level(TABLE, v, k, 128, avx2_like_layout(), 2))  # each level read with its own layout
    emb = PackedEmbedding(TABLE, levels)
    every = torch.arange(v)
    assert torch.equal(emb(every), contract_rows(levels, every))
    for r in range(v):  # one token, as a decode step looks it up
        assert torch.equal(emb(torch.tensor([r])), contract_rows(levels, torch.tensor([r]))), r
    ids = torch.randint(0, v, (2, 7), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    out = emb(ids)
    assert out.shape == (2, 7, k) and out.dtype == torch.bfloat16
    assert torch.equal(out, contract_rows(levels, ids.long()))
    buf = torch.empty(1, k, dtype=torch.bfloat16)
    assert emb.lookup(torch.tensor([v - 1]), out=buf) is buf and torch.equal(buf[0], contract_rows(levels, v - 1))
    assert emb.stored_bytes == v * k // 2 + (k // 128) * v * 4  # the shared head level is counted with the head
    with pytest.raises(IndexError, match="outside 0..79"):
        emb(torch.tensor([v]))


def test_contract_worked_example():
    """q0 = 11, scale0 = 0.25, zero0 = 0.5 -> 1.25; q1 = 6, scale1 = 2^-7, zero1 = 0 -> -0.015625; E = 1.234375."""
    v, k, lay = 16, 64, tg.probe()

    def level(q, scale, zero, g):
        sz = torch.tensor([scale, zero], dtype=torch.bfloat16).expand(k // g, v, 2).contiguous()
        return EmbeddingLevel("m", tg.pack(torch.full((v, k), q, dtype=torch.uint8), lay), sz, g, lay)

    emb = PackedEmbedding(TABLE, (level(11, 0.25, 0.5, 32), level(6, 0.0078125, 0.0, 64)))
    assert torch.equal(emb(torch.tensor([0, 15])), torch.full((2, k), 1.234375, dtype=torch.bfloat16))


# --- packed checkpoints -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{tied, untied, gemma2}: (bf16-table checkpoint, its packed twin, the packed one with E materialised as the
    table). Gemma-2: a tied head and a scaled embedding (its rows times sqrt(hidden) in bf16)."""
    root = tmp_path_factory.mktemp("emb")
    out = {}
    srcs = {"tied": FIXTURE, "untied": save_tiny("llama", root / "untied-hf", tied=False),
            "gemma2": save_tiny("gemma2", root / "gemma2-hf", tied=True)}
    for name, src in srcs.items():
        q = quantize(src, root / f"{name}-q", group_size=32, embeddings="bf16")  # the bf16-table twin, explicitly
        p = root / f"{name}-p"
        convert(src, p, Scheme.parse("w4a16-g32"), method="minmax", force=True, embeddings="packed")
        out[name] = (q, p, with_table(q, reference_table(p), root / f"{name}-e"))
    return out


@pytest.mark.parametrize("name", ["tied", "untied", "gemma2"])
def test_converted_levels_are_the_contract(ckpts, name, tmp_path):
    """What `edgeq quantize --embeddings packed` writes equals the contract implemented independently here (from the
    bf16-table twin: R = float32(W) - D0, rtn at the base G, packed in the checkpoint's layout), byte for byte."""
    q, p, _ = ckpts[name]
    by_hand = pack_by_hand(q, tmp_path / "by-hand")
    ours, theirs = load_file(str(p / "model.safetensors")), load_file(str(by_hand / "model.safetensors"))
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[n], theirs[n]) for n in ours)
    m_ours, m_theirs = (json.loads((d / "edgeq_manifest.json").read_text()) for d in (p, by_hand))
    assert m_ours["embeddings"] == m_theirs["embeddings"] and m_ours["format_version"] == 2


def _logits(lm, lean: bool) -> torch.Tensor:
    """Prefill PROMPT, then 12 decode steps through one loop; the prefill's and every step's logits."""
    decoder = lm.decoder
    lm.decoder = decoder if lean else None
    try:
        lm.cache.reset()
        rows = [lm.forward(torch.tensor([PROMPT]))[0]]
        rows += [lm.decode_step(t)[None].clone() for t in range(40, 52)]
        return torch.cat(rows)
    finally:
        lm.decoder = decoder


@pytest.mark.parametrize("name", ["tied", "untied", "gemma2"])
def test_loaded_packed_equals_the_materialised_table(ckpts, name):
    _, p, e = ckpts[name]
    packed, table = (load(d, max_model_len=64, prefill_threshold=8, decode_ops="torch", prefill_attn="sdpa")
                     for d in (p, e))
    emb = packed.model.get_input_embeddings()
    assert isinstance(emb, PackedEmbedding) and packed.settings.embeddings.startswith("packed 4-bit (")
    assert table.settings.embeddings == "bf16"
    if name == "gemma2":  # the transformers loop (softcapping), and the scale is applied as Gemma-2's module does
        assert packed.settings.decode_loop == "transformers" and emb.scale is not None
    else:
        assert packed.settings.decode_loop == "lean" and emb.scale is None
        assert packed.decoder.embed is emb and packed.settings.lean_bytes == table.settings.lean_bytes  # no copy
    if name == "tied":  # level 0 is the head's own mapped tensors: shared, not copied
        head = packed.model.lm_head
        assert emb.levels[0].qweight is head.qweight and emb.levels[0].scales_and_zeros is head.scales_and_zeros
    assert torch.equal(emb.lookup(torch.arange(emb.num_embeddings)), table.model.get_input_embeddings().weight)
    for lean in (True, False):
        assert torch.equal(_logits(packed, lean), _logits(table, lean)), lean
    header = sum(t.numel() * t.element_size() for t in load_file(str(p / "model.safetensors")).values())
    assert packed.settings.mapped_bytes == header and packed.settings.copied_bytes == 0  # every tensor mapped
    shard = str((p / "model.safetensors").resolve())
    assert all(mapped_file(t.data_ptr()) == shard for lv in emb.levels for t in (lv.qweight, lv.scales_and_zeros))


def test_lean_decode_equals_transformers_forward_greedy(ckpts):
    _, p, _ = ckpts["tied"]
    lean, runs = greedy_both_loops(p)
    assert runs[0] == runs[1] and len(runs[0][0]) == 32
    assert lean.loop_counts == {"transformers": 1, "lean": 31}


def test_transformers_generate_equals_edgeq(ckpts):
    from transformers import AutoModelForCausalLM

    from edgeq.runtime import SamplingParams, generate

    _, p, _ = ckpts["tied"]
    model = AutoModelForCausalLM.from_pretrained(str(p))
    emb = model.get_input_embeddings()
    assert isinstance(emb, PackedEmbedding) and emb.levels[0].qweight is model.lm_head.qweight
    assert model.edgeq.swapped.embeddings.startswith("packed 4-bit")
    assert not any("embed_tokens" in n for n, _ in model.named_parameters())
    lm = load(p, decode_ops="torch", prefill_attn="sdpa")
    ids = lm.tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.inference_mode():
        hf = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    assert hf == generate(lm, "Once upon a time", SamplingParams(max_tokens=16)).token_ids


@pytest.mark.parametrize("name", ["untied", "gemma2"])
def test_transformers_forward_equals_the_materialised_table(ckpts, name):
    """from_pretrained builds PackedEmbedding on the meta model (Gemma-2's scale read before transformers fills the
    buffer): the logits equal the E-table checkpoint's through transformers, bit for bit."""
    from transformers import AutoModelForCausalLM

    _, p, e = ckpts[name]
    packed, table = (AutoModelForCausalLM.from_pretrained(str(d)) for d in (p, e))
    assert isinstance(packed.get_input_embeddings(), PackedEmbedding)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        assert torch.equal(packed(ids).logits, table(ids).logits)


def test_cli_generate_and_fidelity(ckpts, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EDGEQ_DECODE_OPS", "torch")  # bit-identical ops, so both runs pick the same greedy ids
    _, p, e = ckpts["tied"]
    runs = {}
    for d in (p, e):
        code, out, err = run_cli(["generate", d, "Once upon a time", "--max-tokens", "8", "--json"], capsys)
        assert code == 0, err
        runs[d] = json.loads(out)
    assert runs[p]["token_ids"] == runs[e]["token_ids"] and len(runs[p]["token_ids"]) == 8
    assert runs[p]["settings"]["embeddings"].startswith("packed 4-bit (head g32 + ")
    assert runs[e]["settings"]["embeddings"] == "bf16"
    code, _, err = run_cli(["generate", p, "Once", "--max-tokens", "2"], capsys)
    assert code == 0 and ", embeddings packed 4-bit (head g32 + model.embed_tokens g32)" in err
    code, out, err = run_cli(["fidelity", e, p, "--ctx", "64", "--max-tokens", "64", "--json", "-q"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["kld_mean"] == 0.0 and report["top1_agreement"] == 1.0  # the same embedding values: same logits


def test_foreign_layout_and_repack(ckpts, tmp_path):
    """Packed under another machine's layout: the head is repacked in memory, the residual level read as stored
    (zero copy); `edgeq repack` rewrites both; E is the same throughout."""
    _, p, _ = ckpts["tied"]
    here = tg.probe()
    other = foreign_layout()
    foreign = tmp_path / "foreign"
    assert repack(p, foreign, layout=other).tensors == 4 * 7 + 2  # linears, head, the residual level
    want = reference_table(p)
    assert torch.equal(reference_table(foreign), want)  # the repacked bytes decode to the same table
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = load(foreign, max_model_len=64)
    emb = lm.model.get_input_embeddings()
    assert lm.settings.layout == "repacked" and emb.levels[0].layout == here and emb.levels[1].layout == other
    assert torch.equal(emb(torch.arange(emb.num_embeddings)), want)
    assert lm.settings.copied_bytes == sum(m.qweight.numel() for m in lm.model.modules()
                                           if getattr(m, "edgeq_quantized", False))  # the level was not copied
    repack(foreign)
    again = load(foreign, max_model_len=64, strict_layout=True)
    assert torch.equal(again.model.get_input_embeddings()(torch.arange(emb.num_embeddings)), want)


def _edit_tensor(path, name, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors[name])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_damaged_level_is_refused_in_one_line(ckpts, tmp_path, capsys):
    _, p, _ = ckpts["tied"]
    bad = tmp_path / "bad"
    shutil.copytree(p, bad)
    _edit_tensor(bad, f"{TABLE}.scales_and_zeros", lambda t: t[1, 7, 0].fill_(float("nan")))
    with pytest.raises(DamagedCheckpointError) as e:
        load(bad)
    assert f"tensor {TABLE}.scales_and_zeros: 1 NaN/Inf" in str(e.value) and "\n" not in str(e.value)
    code, out, err = run_cli(["generate", bad, "hi", "--max-tokens", "2"], capsys)
    assert code == 2 and f"{TABLE}.scales_and_zeros" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["embeddings"][TABLE]["levels"][1].update(group_size=64),
     f"{TABLE}.scales_and_zeros: expected bfloat16 [4, 4096, 2]"),
    (lambda m: m["embeddings"][TABLE]["levels"][1].update(module="model.embed_tokens.other"),
     "model.embed_tokens.other.qweight is missing"),
])
def test_level_records_are_checked_against_the_tensors(ckpts, tmp_path, edit, message):
    _, p, _ = ckpts["tied"]
    bad = tmp_path / "bad"
    shutil.copytree(p, bad)
    manifest = json.loads((bad / "edgeq_manifest.json").read_text())
    edit(manifest)
    (bad / "edgeq_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EdgeqError, match=message.replace("[", r"\[")) as e:
        load(bad)
    assert "\n" not in str(e.value)


def test_memory_projection_maps_the_levels():
    """A packed level's U8 qweight is used as stored (mapped), like every non-float tensor; floats not in bf16 are
    cast (anonymous). With a repack only the quantised modules' qweights are copied: the levels are read as stored."""
    geo = KVGeometry(layers=1, kv_heads=1, head_dim=64, max_positions=16)
    tensors = [Tensor(f"{TABLE}.qweight", "U8", 1000, 1000), Tensor(f"{TABLE}.scales_and_zeros", "BF16", 100, 200),
               Tensor("lm_head.qweight", "U8", 1000, 1000, packed=True, qweight=True), Tensor("x", "F32", 10, 40)]
    proj = project(geo, tensors, ("", 0), kv_cache_bytes=1 << 20, repack=True)
    assert proj.mapped_weights == 1200 and proj.anon_weights == 1000 + 20
