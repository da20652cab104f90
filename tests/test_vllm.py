"""The vLLM plugin (edgeq/integrations/vllm.py, docs/vllm.md).

- Slicing and split rules (edgeq/integrations/vllm_slices.py): pure torch, run in every environment.
- Serving (skipped without vLLM; CI runs them in the second environment, .ci/run): the bundled model quantised with
  `edgeq quantize --method rtn --scheme w4a16-g128` and `--scheme w4a8-g128` (bf16 embeddings) and `--scheme
  w4a16-g128 --embeddings packed` (the table as the head's 4-bit level plus a residual, no bf16 copy; and, from an
  untied copy of the model, the table's own two levels), and by the plain `edgeq quantize` (the quality recipe: GPTQ,
  g256 with finer first-layer groups, a two-level head), served by vLLM's offline
  ``LLM(...)`` with greedy sampling for 32 tokens on four prompts, against ``edgeq.runtime.load``; every case also
  reads vLLM's input embedding of every token id back from the engine, which must equal the runtime's bit for bit
  (the stored bf16 table, or the packed table's E); tensor_parallel_size=2 against 1 (packed: the head, the
  embedding's levels and every Linear split); a checkpoint packed for another layout is repacked with the runtime's
  warning (the embedding's own level too), or refused under ``EDGEQ_STRICT_LAYOUT=1`` with the runtime's message,
  never run as is.

What "the same tokens" means. The quantised layers are the runtime's own modules on both sides, but vLLM runs its own
attention, RMSNorm, RoPE and SiLU kernels (and, at tp=2, sums partial products in a bf16 all-reduce), which round
differently; on this tiny model the greedy choice is often a near tie (top logprobs around -3.5). So the check is
teacher-forced, on vLLM's own tokens: every vLLM logprob is within TOL nats of the runtime's for the same token
and prefix (TOL = 0.1 for W4A16, measured at most 0.041; 0.25 for W4A8, whose int8 activations turn the small
differences into whole int8 steps, measured at most 0.134), every vLLM token is the runtime's best or within TOL
of it, and vLLM's tokens equal the runtime's greedy ones (tp=2: the tp=1 run's) up to the first position where the
runtime's best two are within TOL, where either pick is legitimate and the rest of the text may follow it.

Each engine runs in a child process (this file run as a script: vLLM's engine spawns processes and wants a
``__main__`` guard), which prints one ``EDGEQ_RESULT {json}`` line and saves the embedding rows (``LLM.apply_model``,
which ships tests/helpers/vllm_probe.py's function to the workers: ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, in the
child only); one engine serves all prompts of a case.
Both sides run the W4A16 kernel path for every M (``EDGEQ_PREFILL_THRESHOLD=1024`` / ``prefill_threshold=1024``):
vLLM batches the prompts of one call into one prefill and the decode steps of all sequences into one M, where
edgeq's runtime runs each prompt alone; the kernel computes each row independently of M, the dequantise + GEMM
path's bf16 GEMM does not promise that.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.layouts import w4a8 as w4a8_layout
from edgeq.quantize.w4a8 import quantize_w4a8

sys.path.insert(0, str(Path(__file__).parent))
from edgeq.integrations import vllm_slices as cuts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "edgeq" / "data" / "tiny-prose"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (pip install -e '.[vllm]'; CI's second environment)")
THRESHOLD = 1024  # the kernel path for every M on both sides (module docstring)
MAX_TOKENS = 32
# nats (module docstring). W4A16: vLLM's own attention/RMSNorm/RoPE/SiLU round differently (measured <= 0.041);
# W4A8 quantises those slightly different activations to int8 per token, and a value that lands on the other side of
# a rounding boundary moves by a whole int8 step (measured <= 0.134).
TOLS = {"w4a16-g128": 0.1, "w4a8-g128": 0.25, "w4a16-g128-packed": 0.1, "w4a16-g128-packed-untied": 0.1,
        "w4a16-g128-head2": 0.1, "default": 0.1}
# the checkpoints: `edgeq quantize` arguments after the model and -o; the embedding storage is always explicit (the
# recipe's default may change). "-untied": the bundled model with its own lm_head.weight (_untied_copy), whose
# packed table stores both levels (model.embed_tokens + model.embed_tokens.residual)
# "default": the plain command (since 2026-12-05 the quality recipe, GPTQ on ids sampled from the model: w4a16-g256
# with the first layer's MLP at g32/g64, packed table, two-level head); the others are the family recipe's rtn.
CHECKPOINTS = {"w4a16-g128": ["--scheme", "w4a16-g128", "--method", "rtn", "--embeddings", "bf16"],
               "w4a8-g128": ["--scheme", "w4a8-g128", "--method", "rtn", "--embeddings", "bf16"],
               "w4a16-g128-packed": ["--scheme", "w4a16-g128", "--method", "rtn", "--embeddings", "packed"],
               "w4a16-g128-packed-untied": ["--scheme", "w4a16-g128", "--method", "rtn", "--embeddings", "packed"],
               "w4a16-g128-head2": ["--scheme", "w4a16-g128", "--method", "rtn", "--embeddings", "packed",
                                    "--head-levels", "2"],
               "default": ["--nsamples", "8", "--seqlen", "64"]}  # a short sampling: what is served is the point
PACKED = "w4a16-g128-packed"
HEAD2 = "w4a16-g128-head2"  # the head adds the packed table's residual level: logits = x @ (D0 + D1)^T
TWO_LEVEL_HEADS = (HEAD2, "default")
PROMPTS = ["The cat", "Once upon a time, in a small village,", "def main():\n    return", "Python is"]


# --- slices: pure torch ----------------------------------------------------------------------------------------------


def _q(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _adjacent_tail_layout(block_n: int, full: str = "halves") -> tinygemm.TinygemmLayout:
    """A layout of ``block_n``-row blocks with interleaved halves and adjacent tails (AVX512/AVX2-like)."""
    halves = tuple(v for j in range(block_n // 2) for v in (j, j + block_n // 2))
    perms = [(s, tuple(range(s))) for s in range(16, block_n, 16)] + [(block_n, halves)]
    return tinygemm.TinygemmLayout(block_n=block_n, perms=tuple(perms), cpu_capability=f"test{block_n}")


@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("rows,cols", [((0, 208), (0, 256)), ((64, 208), (0, 256)), ((0, 192), (128, 256)),
                                       ((64, 208), (128, 384)), ((192, 208), (0, 128))])
def test_tinygemm_cut_equals_packing_the_cut(block_n, rows, cols):
    """Rows a..b (block starts, or N with the 16-row tail), inputs c..d of the packed bytes are the packing of
    q[a:b, c:d] alone; bytes outside the cut are never read (they are garbage here)."""
    layout = _adjacent_tail_layout(block_n)
    n, k = 208, 384  # 3 x 64 + a 16-row tail (6 x 32 + 16 on 32-row blocks)
    q = _q(n, k)
    packed = tinygemm.pack(q, layout)
    (a, b), (c, d) = rows, cols
    want = tinygemm.pack(q[a:b, c:d].contiguous(), layout)
    out = torch.empty(b - a, (d - c) // 2, dtype=torch.uint8)
    cuts.copy_tinygemm(out, packed, n, k, rows, cols, layout)
    assert torch.equal(out, want)
    # the bytes the cut needs: those holding a nibble of rows a..b, inputs c..d; poison every other byte, cut again
    inside = torch.zeros(n, k, dtype=torch.uint8)
    inside[a:b, c:d] = 1
    poisoned = packed.masked_fill(tinygemm.pack(inside, layout) == 0, 0xA5)
    out2 = torch.zeros_like(out)
    cuts.copy_tinygemm(out2, poisoned, n, k, rows, cols, layout)
    assert torch.equal(out2, want)


def test_tinygemm_cut_repacks_a_foreign_layout():
    stored, here = _adjacent_tail_layout(32), _adjacent_tail_layout(64)
    n, k = 208, 256
    q = _q(n, k, seed=1)
    got = cuts.tinygemm_cut(tinygemm.pack(q, stored), n, k, (64, 208), (128, 256), stored, here)
    assert torch.equal(got, tinygemm.pack(q[64:208, 128:256].contiguous(), here))


def test_tinygemm_cut_refuses_rows_off_the_blocks():
    layout = _adjacent_tail_layout(64)
    q = tinygemm.pack(_q(192, 128), layout)
    out = torch.empty(32, 64, dtype=torch.uint8)
    with pytest.raises(EdgeqError, match=r"rows 32\.\.64 of N=192 do not fall on the checkpoint's 64-row layout blocks"):
        cuts.copy_tinygemm(out, q, 192, 128, (32, 64), (0, 128), layout)


@pytest.mark.parametrize("g", [32, 128])
def test_w4a8_cut_equals_packing_the_cut(g):
    n, k = 128, 512
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
    qw = quantize_w4a8(w, g, name="t")
    whole = w4a8_layout.pack(qw.q, qw.scales, qw.zeros, g, name="t")
    a, b, c, d = 32, 96, 256, 512
    part = w4a8_layout.pack(qw.q[a:b, c:d].contiguous(), qw.scales[c // g : d // g, a:b].contiguous(),
                            qw.zeros[c // g : d // g, a:b].contiguous(), g, name="t")
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(cuts.w4a8_cut(name, getattr(whole, name), (a, b), (c, d), g), getattr(part, name)), name


def test_split_errors_name_the_layer_shape_and_sizes_that_work():
    with pytest.raises(EdgeqError) as e:
        cuts.check_split("model.layers.0.mlp.gate_up_proj", [768, 768], 256, 8, row_parallel=False, block_n=64,
                         group_size=128)
    assert str(e.value) == (
        "model.layers.0.mlp.gate_up_proj: [1536, 256] (column-parallel (N split), shards [768, 768]) cannot be split "
        "for tensor_parallel_size=8: shard 0 (768 rows) / 8 ranks = 96 rows is not a whole number of 64-row layout "
        "blocks; tensor_parallel_size 1, 2, 3, 4, 6, 12 works for this layer")
    with pytest.raises(EdgeqError, match=r"\[256, 768\] \(row-parallel \(K split\).*tensor_parallel_size=4: K=768 / 4 "
                                         r"ranks is not a whole number of 128-input groups; tensor_parallel_size 1, 2, 3, 6 works"):
        cuts.check_split("model.layers.0.mlp.down_proj", [256], 768, 4, row_parallel=True, block_n=64, group_size=128)
    # a fused layer whose first shard has a tail cannot be served even on one rank: the kernel reads one tail, last
    assert "shard 0 (80 rows) / 1 ranks = 80 rows" in cuts.split_problem([80, 64], 128, 1, row_parallel=False,
                                                                          block_n=64, group_size=128)
    assert cuts.split_problem([256, 128, 128], 256, 2, row_parallel=False, block_n=64, group_size=128) is None
    assert cuts.split_problem([4096], 256, 1, row_parallel=False, block_n=64, group_size=128) is None


def test_runtime_decode_matches_its_full_forward_under_this_transformers(fixture_quantized):
    """Greedy decoding through the static cache picks, at every step, the argmax of one full forward over the same
    tokens (no cache). Under transformers 5.19 (vLLM's pin) the forward's cache argument is ``past_key_values``; the
    runtime passed ``cache=``, which that version swallowed, and decoding degenerated (``[417, 417, 417, ...]``)."""
    from edgeq.runtime.generation import generate_ids
    from edgeq.runtime.loader import load

    lm = load(fixture_quantized, prefill_threshold=THRESHOLD, max_model_len=128)
    prompt = [1287, 290]  # "Python is"
    ids = generate_ids(lm, prompt, 12)[0]
    logits = lm.forward(torch.tensor([prompt + ids]), use_cache=False)[0]
    assert ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()


@needs_vllm
@pytest.mark.parametrize("engine_first", [False, True], ids=["alone", "after-vllm-kernels"])
def test_choosing_the_w4a8_kernel_beside_vllm_keeps_the_process_alive(engine_first):
    """With vLLM installed, the W4A8 kernel choice must not import a vLLM build this CPU cannot run (SIGILL at import
    on a CPU without AVX512-BF16) nor a second one after vLLM's engine loaded its own (abort: a second
    TORCH_LIBRARY(_C)); both killed vLLM's workers on a Zen 3. In a child: a dead process is the failure."""
    pre = "from vllm.platforms import current_platform; current_platform.import_kernels(); " if engine_first else ""
    code = pre + "from edgeq.runtime import w4a8linear as w; print('SOURCE', w.choose_kernel(128).source)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    source = proc.stdout.split("SOURCE ")[-1].strip()
    assert source.startswith("edgeq native") or source in ("vllm._C", "portable"), proc.stdout


@needs_vllm
def test_the_config_reads_packed_embeddings_and_refuses_what_it_cannot_hold(checkpoints, tmp_path):
    """The quant config finds the packed table (by vLLM's prefix; Llama's empty one names the only packed table),
    reads a tied level 0 from the head layer and the residual from the embedding layer itself; a bf16 checkpoint
    keeps vLLM's own embedding; a W4A8 checkpoint claiming packed embeddings is refused (by the manifest reader the
    plugin shares with the runtime)."""
    from edgeq.integrations import vllm_embedding as emb
    from edgeq.integrations.vllm import EdgeqConfig

    config = EdgeqConfig({"quant_method": "edgeq"})
    config.maybe_update_config(str(checkpoints[PACKED]))
    spec = config.embeddings["model.embed_tokens"]
    assert spec.levels == (emb.Level("lm_head", config.group_size_of("lm_head")), emb.Level("model.embed_tokens", 128))
    assert [spec.holder(level) for level in spec.levels] == [None, ""]
    assert emb.spec_for(config.embeddings, "model.embed_tokens") is spec and emb.spec_for(config.embeddings, "") is spec
    assert emb.spec_for(config.embeddings, "model.vision.embed_tokens") is None
    untied = EdgeqConfig({"quant_method": "edgeq"})
    untied.maybe_update_config(str(checkpoints["w4a16-g128-packed-untied"]))
    spec = untied.embeddings["model.embed_tokens"]
    assert [level.module for level in spec.levels] == ["model.embed_tokens", "model.embed_tokens.residual"]
    assert [spec.holder(level) for level in spec.levels] == ["", "residual"]  # the layer, and a child module of it
    bf16 = EdgeqConfig({"quant_method": "edgeq"})
    bf16.maybe_update_config(str(checkpoints["w4a16-g128"]))
    assert bf16.embeddings == {} and emb.spec_for(bf16.embeddings, "") is None

    doctored = tmp_path / "w4a8-packed"
    shutil.copytree(checkpoints["w4a8-g128"], doctored)
    manifest, cfg = json.loads((doctored / "edgeq_manifest.json").read_text()), json.loads((doctored / "config.json").read_text())
    manifest["format_version"] = cfg["quantization_config"]["format_version"] = 2
    head_g = manifest.get("group_sizes", {}).get("lm_head", 128)
    manifest["embeddings"] = {"model.embed_tokens": {"storage": "packed", "source": "model.embed_tokens.weight",
                                                     "levels": [{"module": "lm_head", "group_size": head_g},
                                                                {"module": "model.embed_tokens", "group_size": 128}]}}
    (doctored / "edgeq_manifest.json").write_text(json.dumps(manifest))
    (doctored / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EdgeqError, match=r"w4a8-packed/edgeq_manifest.json: embeddings: .*amx_w4a8"):  # the reader's
        EdgeqConfig({"quant_method": "edgeq"}).maybe_update_config(str(doctored))


@needs_vllm
@pytest.mark.parametrize("damage", ["nan-scale", "head-dropped", "one-layer-more"])
def test_the_config_refuses_a_damaged_checkpoint_in_the_callers_process(checkpoints, tmp_path, damage):
    """vLLM served a NaN scale, and zeros for missing tensors (it skips its own check under a quantization method):
    the quant config runs load()'s refusals where LLM(...) is called, so the caller gets edgeq's line, not a worker's."""
    from edgeq.integrations.vllm import EdgeqConfig
    from helpers.damage import DAMAGE

    broken = shutil.copytree(checkpoints["w4a16-g128"], tmp_path / damage)
    spoil, error, message = DAMAGE[damage]
    spoil(broken)
    with pytest.raises(error, match=message):
        EdgeqConfig({"quant_method": "edgeq"}).maybe_update_config(str(broken))


@needs_vllm
def test_the_config_reads_a_head_that_adds_the_tables_residual(checkpoints, tmp_path):
    """--head-levels 2: the plugin's head adds the packed embedding's residual level (the level's loaded tensors, read
    where the embedding holds them; a head level no packed table has is refused by the manifest reader first)."""
    from edgeq.integrations.vllm import EdgeqConfig

    config = EdgeqConfig({"quant_method": "edgeq"})
    config.maybe_update_config(str(checkpoints[HEAD2]))
    assert config.head_residuals == ("model.embed_tokens",)
    plain = EdgeqConfig({"quant_method": "edgeq"})
    plain.maybe_update_config(str(checkpoints[PACKED]))
    assert plain.head_residuals == ()


# --- serving: one vLLM engine per case, in a child process ----------------------------------------------------------


def _serve(path: Path, tp: int, prompts: list[list[int]], extra_env: dict | None = None) -> tuple[dict | None, str]:
    """Run this file as a script: one LLM(...) over ``path``; returns (result or None, the child's stderr). The
    result's "embedding" is the file of vLLM's input embedding rows for every token id (bf16 [V, K])."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "EDGEQ_PREFILL_THRESHOLD": str(THRESHOLD),
           "TOKENIZERS_PARALLELISM": "false", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(extra_env or {})}
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))  # one core per rank
    rows = path.parent / f"{path.name}.tp{tp}.embedding.pt"
    arg = json.dumps({"path": str(path), "tp": tp, "prompts": prompts, "max_tokens": MAX_TOKENS,
                      "embedding": str(rows)})
    proc = subprocess.run([sys.executable, __file__, arg], capture_output=True, text=True, env=env, timeout=900)
    levels = [json.loads(line.removeprefix("EDGEQ_HEAD_LEVELS ")) for line in proc.stdout.splitlines()
              if line.startswith("EDGEQ_HEAD_LEVELS ")]
    for line in proc.stdout.splitlines():
        if line.startswith("EDGEQ_RESULT "):
            return {"outputs": json.loads(line.removeprefix("EDGEQ_RESULT ")), "embedding": rows,
                    "head_levels": levels[0] if levels else None}, proc.stderr
    return None, proc.stderr + proc.stdout


def _child(arg: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(arg)
    llm = LLM(model=spec["path"], dtype="bfloat16", max_model_len=512, enforce_eager=True,
              tensor_parallel_size=spec["tp"], seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    result = [{"ids": list(o.outputs[0].token_ids),
               "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]}
              for o in outs]
    from helpers.vllm_probe import embedding_rows, head_levels  # pickled by reference: importable in vLLM's workers

    torch.save(llm.apply_model(embedding_rows)[0], spec["embedding"])
    print("EDGEQ_HEAD_LEVELS " + json.dumps(llm.apply_model(head_levels)), flush=True)
    print("EDGEQ_RESULT " + json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The bundled model quantised by the CLI: both schemes with bf16 embeddings, W4A16 with packed ones, tied and
    untied (once per module)."""
    from edgeq.cli.main import main

    root = tmp_path_factory.mktemp("vllm")
    out = {}
    for name, args in CHECKPOINTS.items():
        out[name] = root / name
        source = _untied_copy(root / "untied-source") if name.endswith("-untied") else FIXTURE
        try:
            main(["quantize", str(source), "-o", str(out[name]), *args])
        except SystemExit as e:
            assert e.code in (0, None), f"edgeq quantize {' '.join(args)} exited {e.code}"
    return out


def _untied_copy(out: Path) -> Path:
    """The bundled model with ``tie_word_embeddings: false`` and its own ``lm_head.weight`` (the table plus a little
    seeded noise, so the head is not the table): same tokenizer and prompts, an untied head."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(FIXTURE, out)
    tensors = load_file(out / "model.safetensors")
    table = tensors["model.embed_tokens.weight"]
    noise = torch.randn(table.shape, generator=torch.Generator().manual_seed(3)) * table.float().std() * 0.05
    tensors["lm_head.weight"] = (table.float() + noise).to(table.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    return out


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(FIXTURE))
    return [tok(p)["input_ids"] for p in PROMPTS]


def _reference(path: Path, prompts: list[list[int]], outputs: list[dict]) -> tuple[list[dict], torch.Tensor]:
    """Per prompt, from ``edgeq.runtime.load``: its own greedy tokens, and over vLLM's tokens (teacher-forced, one
    forward without cache) the log-probability of each vLLM token, its gap to the runtime's best, and the gap between
    the runtime's best two (small: a near tie, which kernels that differ legitimately may break either way); and the
    runtime's input embedding of every token id (the mapped bf16 table, or the PackedEmbedding's E)."""
    from edgeq.runtime.generation import generate_ids
    from edgeq.runtime.loader import load

    lm = load(path, prefill_threshold=THRESHOLD, max_model_len=512)
    out = []
    for p, r in zip(prompts, outputs):
        lp = lm.forward(torch.tensor([p + r["ids"]]), use_cache=False)[0, len(p) - 1 : -1].float().log_softmax(-1)
        chosen = lp.gather(1, torch.tensor(r["ids"])[:, None])[:, 0]
        top2 = lp.topk(2, dim=-1).values
        out.append({"greedy": generate_ids(lm, p, MAX_TOKENS)[0], "chosen": chosen, "gap": top2[:, 0] - chosen,
                    "tie": top2[:, 0] - top2[:, 1]})
    embed = lm.model.get_input_embeddings()
    with torch.no_grad():
        return out, embed(torch.arange(embed.num_embeddings))


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _check_served(result, log: str, path: Path, prompts: list[list[int]], others: list[list[int]] | None = None,
                  tol: float = TOLS["w4a16-g128"]) -> None:
    """vLLM's tokens against the runtime's (module docstring): every logprob within TOL of the runtime's for the same
    token and prefix; every token the runtime's best or within TOL of it; the same tokens as the runtime's greedy
    decoding (and as ``others``, another vLLM run) up to the first near tie (the runtime's best two within TOL).
    TOL is ``tol``: :data:`TOLS`. And vLLM's input embedding of every token id equals the runtime's, bit for bit."""
    assert result is not None, f"vLLM did not serve the checkpoint:\n{log[-4000:]}"
    refs, table = _reference(path, prompts, result["outputs"])
    for i, (r, ref) in enumerate(zip(result["outputs"], refs)):
        where = f"prompt {PROMPTS[i]!r}: vLLM {r['ids']}"
        assert len(r["ids"]) == MAX_TOKENS and len(r["logprobs"]) == MAX_TOKENS, where
        diff = (ref["chosen"] - torch.tensor(r["logprobs"])).abs().max().item()
        assert diff <= tol, f"{where}: logprob differs from edgeq.runtime's by {diff:.3f} > {tol}"
        assert ref["gap"].max().item() <= tol, f"{where}: a token {ref['gap'].max().item():.3f} below the runtime's best"
        for label, want in (("edgeq.runtime", ref["greedy"]), ("the other vLLM run", others[i] if others else None)):
            n = _common(r["ids"], want) if want is not None else MAX_TOKENS
            assert n == MAX_TOKENS or ref["tie"][n].item() <= tol, (
                f"{where} != {label} {want}: they part at token {n}, where the runtime's best two are "
                f"{ref['tie'][n].item():.3f} apart (> {tol}, not a near tie)")
    rows = torch.load(result["embedding"])
    assert rows.dtype == table.dtype == torch.bfloat16 and rows.shape == table.shape, (rows.dtype, rows.shape, table.shape)
    wrong = (rows != table).any(-1).nonzero()[:, 0].tolist()
    assert not wrong, (f"vLLM's input embedding differs from edgeq.runtime's for {len(wrong)} token ids, first "
                       f"{wrong[:8]}: max |diff| {(rows.float() - table.float()).abs().max().item():.3g}")


_SERVED: dict[tuple[str, int], dict] = {}


def _served(path: Path, tp: int, prompts: list[list[int]]) -> tuple[dict | None, str]:
    key = (str(path), tp)
    if key not in _SERVED:
        result, log = _serve(path, tp, prompts)
        if result is None:
            return None, log
        _SERVED[key] = result
    return _SERVED[key], ""


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(CHECKPOINTS))
def test_vllm_serves_the_runtimes_tokens(checkpoints, prompt_ids, scheme):
    """32 greedy tokens on every prompt, vLLM (tp=1) against edgeq.runtime.load, for both kernels, and for packed
    embeddings (vLLM's embedding layer decodes the head's level plus the residual, or an untied table's two levels:
    E of the runtime, bit for bit)."""
    result, log = _served(checkpoints[scheme], 1, prompt_ids)
    _check_served(result, log, checkpoints[scheme], prompt_ids, tol=TOLS[scheme])
    assert result["head_levels"] == [2 if scheme in TWO_LEVEL_HEADS else 1]  # the residual is summed, not dropped


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", [PACKED, HEAD2])
def test_tensor_parallel_2_gives_the_same_tokens_as_1(checkpoints, prompt_ids, case):
    """tp=2 splits every column-parallel layer on 64-row blocks and every row-parallel one on whole groups; its
    partial sums meet in vLLM's all-reduce, in bf16, so it may break a near tie the other way: nothing else. On the
    packed-embedding checkpoint: the head and the embedding's levels split the padded vocabulary alike, each rank
    decodes its own ids and the all-reduce adds zeros (the embedding stays E, bit for bit); a two-level head adds
    each rank's rows of the residual level to its own."""
    path = checkpoints[case]
    one, log1 = _served(path, 1, prompt_ids)
    assert one is not None, log1[-4000:]
    two, log = _served(path, 2, prompt_ids)
    _check_served(two, log, path, prompt_ids, others=[r["ids"] for r in one["outputs"]])
    assert two["head_levels"] == [2 if case == HEAD2 else 1] * 2  # every rank's head sums its rows of each level


def _foreign_layout() -> tinygemm.TinygemmLayout:
    """A valid layout that is not this machine's: 32-row blocks here on AVX512, 64-row ones on a 32-row machine."""
    here = tinygemm.probe()
    return _adjacent_tail_layout(32 if here.block_n != 32 else 64)


@needs_vllm
@pytest.mark.slow
def test_foreign_layout_is_repacked_with_the_warning_or_refused(checkpoints, prompt_ids, tmp_path):
    from edgeq.runtime.repacker import repack

    native = checkpoints[PACKED]  # every Linear, the head and the embedding's own level are repacked
    foreign = tmp_path / "foreign"
    report = repack(native, foreign, layout=_foreign_layout())
    assert report.changed
    result, log = _serve(foreign, 1, prompt_ids[:2], {"EDGEQ_STRICT_LAYOUT": "1"})
    assert result is None
    assert "run `edgeq repack` on it, or load without EDGEQ_STRICT_LAYOUT=1 to repack in memory" in log
    result, log = _serve(foreign, 1, prompt_ids[:2])
    assert "LayoutRepackWarning: REPACKED IN MEMORY: checkpoint layout" in log
    # 4 layers x (qkv as q, k, v + o + gate, up + down) + the head + the embedding's residual level
    assert "repacking 30 tensors took" in log
    _check_served(result, log, native, prompt_ids[:2])


if __name__ == "__main__":
    _child(sys.argv[1])
