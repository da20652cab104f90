"""Where a 4-bit checkpoint's error comes from, layer by layer, and what finer groups in one layer buy (issue 16).

    python benchmarks/layer_sensitivity.py split [--method gptq|rtn] [--model DIR --text FILE]
    python benchmarks/layer_sensitivity.py arms [--arms NAME,...] [--nsamples N] [--seed S] [--model DIR --text FILE]
    python benchmarks/layer_sensitivity.py arms --method rtn [--arms NAME,...] [--model DIR --text FILE]

``split``: converts MODEL with the family recipe as it was before the first layer got g32 (``RTN_ARMS
["family-before"]``: head, q/k/v, down_proj at g32; ``--method gptq`` calibrates with ``--calib self``; bf16
embeddings so the head is one 4-bit level), dequantises every quantised weight (codes, bf16 scale and zero) into an
fp32 copy of the float model, and scores subsets against the float model: the head only, the decoder layers only, one
projection class at a time (every layer's), one layer at a time (all of its projections). Mean KLD over the second
halves of ctx-512 windows of TEXT (default: the bundled held-out prose), fp32 forward.

``arms``: real conversions (``edgeq.convert.pipeline.convert``: GPTQ on self-sampled windows, the two-level head,
packed embeddings, base w4a16-g256 as recipes/quality.toml) with per-tensor group sizes given as (regex, G) lists
(:data:`ARMS`), each scored by ``edgeq.fidelity.compare`` against the bf16 model; bytes are counted as
``benchmarks/quality_table.py`` counts them (quantised linears + head + embedding levels) and printed against
llama.cpp Q4_K_M's 2,747,904 bytes on the bundled model (its figure from quality_table.py, same counting).
``arms --method rtn``: the default's variants instead (:data:`RTN_ARMS`: `rtn`, g128 base, the head one level, packed
embeddings).
Statistics, not timings: the machine's load does not change them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's edgeq
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from edgeq import fidelity as F  # noqa: E402
from edgeq.convert.calibrated import GPTQOptions  # noqa: E402
from edgeq.convert.pipeline import convert  # noqa: E402
from edgeq.io.hf import open_checkpoint  # noqa: E402
from edgeq.io.manifest import read_manifest  # noqa: E402
from edgeq.keys import DATA  # noqa: E402
from edgeq.layouts import tinygemm as tg  # noqa: E402
from edgeq.runtime import load  # noqa: E402
from edgeq.scheme import Scheme  # noqa: E402
from bench_clipping import score  # noqa: E402  (mean KLD and same top-1 over the windows' second halves)
from quality_table import edgeq_bytes  # noqa: E402

FIXTURE = DATA / "tiny-prose"
Q4_K_M_BYTES = 2_747_904  # llama.cpp Q4_K_M on the bundled model, counted as edgeq_bytes counts (quality_table.py)
CLASSES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_L0 = r"layers\.0\."
ARMS = {  # name: [(tensor-name regex, group size)], first match wins; everything else at the base g256
    "quality-before": [(r"self_attn\.[kv]_proj\.weight$", 128), (r"mlp\.(gate|up|down)_proj\.weight$", 128)],
    "all-g256": [],
    "first-layer-g64": [(_L0, 64)],
    "first-layer-g32": [(_L0, 32)],
    "first-layer-attn-g32": [(_L0 + r"self_attn\.", 32)],
    "first-layer-mlp-g32": [(_L0 + r"mlp\.", 32)],
    "first-layer-down-g32-gate-up-g64": [(_L0 + r"mlp\.down_proj", 32), (_L0 + r"mlp\.", 64)],  # recipes/quality.toml
    "first-layer-gate-up-g32": [(_L0 + r"mlp\.(gate|up)_proj", 32)],
}
_KV_DOWN = [(r"lm_head\.weight$", 32), (r"self_attn\.[kv]_proj\.weight$", 32), (r"mlp\.down_proj\.weight$", 32)]
_FAMILY_BEFORE = [(r"lm_head\.weight$", 32), (r"self_attn\.[qkv]_proj\.weight$", 32), (r"mlp\.down_proj\.weight$", 32)]
RTN_ARMS = {  # everything else at the base g128
    "family-before": _FAMILY_BEFORE,
    "family-before+first-layer": [(_L0, 32)] + _FAMILY_BEFORE,  # recipes/llama.toml now
    "family-before+first-layer-mlp": [(_L0 + r"mlp\.", 32)] + _FAMILY_BEFORE,
    "first-layer,head,kv,down": [(_L0, 32)] + _KV_DOWN,  # q_proj apart from k/v: vLLM cannot serve it (fused qkv)
    "first-layer-mlp,head,kv,down": [(_L0 + r"mlp\.", 32)] + _KV_DOWN,
}


def _windows(model: Path, text: str, ctx: int = 512) -> list[torch.Tensor]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids
    return [torch.tensor(ids[i : i + ctx]) for i in range(0, len(ids) - ctx + 1, ctx)]


def module_codes(out: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """{module: (codes uint8 [N, K], scales_and_zeros bf16 [K/G, N, 2], G)} of every quantised module of the
    checkpoint at ``out`` (one level: bf16 embeddings). Also used by benchmarks/learned_rounding.py."""
    ckpt, man = open_checkpoint(out), read_manifest(out)
    layout = tg.TinygemmLayout.from_json(man.layout)
    res = {}
    for m in man.quantized_modules:
        n, half = ckpt.tensors[f"{m}.qweight"].shape
        res[m] = (tg.unpack(ckpt.read(f"{m}.qweight"), n, 2 * half, layout), ckpt.read(f"{m}.scales_and_zeros"),
                  man.group_size(m))
    return res


def _dequantised(out: Path) -> dict[str, torch.Tensor]:
    """{module: fp32 [N, K]} of every quantised module of the checkpoint at ``out``."""
    return {m: tg.dequantize(q, sz, g) for m, (q, sz, g) in module_codes(out).items()}


@torch.no_grad()
def split(model: Path, text: str, method: str) -> None:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "q"
        gptq = GPTQOptions(calib="self") if method == "gptq" else None
        recipe = _recipe(Path(tmp) / "r.toml", RTN_ARMS["family-before"], "w4a16-g128", method, 1)  # pinned
        convert(model, out, Scheme.parse("w4a16-g128"), method, str(recipe), gptq=gptq, embeddings="bf16")
        deq = _dequantised(out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    wins = _windows(model, text)
    ref_lp = [torch.log_softmax(ref(w[None]).logits[0, len(w) // 2 :].double(), -1) for w in wins]
    layers = sorted({int(m.split(".")[2]) for m in deq if m.startswith("model.layers.")})
    subsets = {"everything": lambda m: True, "head only": lambda m: m == "lm_head",
               "decoder layers only": lambda m: m != "lm_head"}
    subsets.update({f"{c} only (every layer)": (lambda m, c=c: m.endswith(c)) for c in CLASSES})
    subsets.update({f"layer {i} only": (lambda m, i=i: m.startswith(f"model.layers.{i}.")) for i in layers})
    print(f"| quantised ({method}, family-before recipe, g128 base) | mean KLD | same top-1 |\n|---|---|---|")
    for label, pick in subsets.items():
        q = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        q.lm_head.weight = torch.nn.Parameter(q.lm_head.weight.detach().clone())  # untie: the head is its own copy
        mods = dict(q.named_modules())
        for m, w in deq.items():
            if pick(m):
                mods[m].weight.data = w.clone()
        kld, same = score(q, ref_lp, wins)
        print(f"| {label} | {kld:.5f} | {same:.1%} |", flush=True)


def _recipe(path: Path, group_sizes: list[tuple[str, int]], scheme: str, method: str, head_levels: int) -> Path:
    table = ", ".join(f"{json.dumps(p)} = {g}" for p, g in group_sizes)
    path.write_text("\n".join([
        'name = "sensitivity-arm"', "model_types = []", f'scheme = "{scheme}"', f'method = "{method}"',
        'head = "lm_head.weight"', 'embeddings = ["model.embed_tokens.weight"]', "keep_bf16 = []",
        'embeddings_storage = "packed"', f"head_levels = {head_levels}", f"group_sizes = {{ {table} }}"]) + "\n")
    return path


def arms(model: Path, text: str | None, names: list[str], nsamples: int | None, seed: int, method: str) -> None:
    ref = load(model)
    gptq = method == "gptq"
    scheme, levels, table = ("w4a16-g256", 2, ARMS) if gptq else ("w4a16-g128", 1, RTN_ARMS)
    what = f"GPTQ --calib self seed {seed}{f', {nsamples} windows' if nsamples else ''}" if gptq else "rtn, g128 base"
    print(f"| arm ({what}) | bytes counted | vs Q4_K_M's | mean KLD (± se) | same top-1 |\n|---|---|---|---|---|")
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "q"
            opts = GPTQOptions(calib="self", seed=seed, **({"nsamples": nsamples} if nsamples else {})) if gptq else None
            convert(model, out, scheme=Scheme.parse(scheme), method=method, gptq=opts, embeddings="packed",
                    recipe=str(_recipe(Path(tmp) / "r.toml", table[name], scheme, method, levels)), head_levels=levels)
            nbytes, r = edgeq_bytes(out), F.compare(ref, load(out), text=text)
        print(f"| {name} | {nbytes:,} | {nbytes - Q4_K_M_BYTES:+,} | {r.kld_mean:.5f} ± {r.kld_mean_err:.5f} | "
              f"{r.top1_agreement:.1%} |", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["split", "arms"])
    ap.add_argument("--model", type=Path, default=FIXTURE)
    ap.add_argument("--text", type=Path, help="evaluation text (default: the bundled held-out prose)")
    ap.add_argument("--method", choices=["gptq", "rtn"], default="gptq")
    ap.add_argument("--arms", help="comma-separated names of ARMS (gptq) or RTN_ARMS (rtn); default: all")
    ap.add_argument("--nsamples", type=int)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    text = a.text.read_text(encoding="utf-8") if a.text else None
    if a.what == "split":
        split(a.model, text if text is not None else (DATA / "heldout-prose.txt").read_text(encoding="utf-8"), a.method)
    else:
        names = a.arms.split(",") if a.arms else list(ARMS if a.method == "gptq" else RTN_ARMS)
        arms(a.model, text, names, a.nsamples, a.seed, a.method)


if __name__ == "__main__":
    main()
