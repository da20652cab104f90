"""Does the clipping search pay? Weight reconstruction error and KLD, min/max RTN vs the default (RTN + clipping),
on the bundled trained model, for every group size.

Each arm is converted with `edgeq.convert.pipeline.convert` (what ships), read back from disk, unpacked with the stored
layout and dequantised into the transformers model in fp32; the reference is the same model with its bf16 weights
in fp32, so the difference is quantisation alone. Text: the bundled held-out text (never trained on), windows of
256 tokens, the second half of each window scored (as llama-perplexity does).

    python benchmarks/bench_clipping.py [--ctx 256] [--max-windows 40]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from edgeq.io.manifest import read_manifest
from edgeq.io.hf import open_checkpoint
from edgeq.convert.pipeline import convert
from edgeq.layouts import tinygemm as tg
from edgeq.scheme import Scheme

DATA = Path(__file__).resolve().parent.parent / "edgeq" / "data"


def dequantized_state(out: Path) -> dict[str, torch.Tensor]:
    ckpt, man = open_checkpoint(out), read_manifest(out)
    layout, g = tg.TinygemmLayout.from_json(man.layout), Scheme.parse(man.scheme).group_size
    state = {}
    for m in man.quantized_modules:
        n, half = ckpt.tensors[f"{m}.qweight"].shape
        q = tg.unpack(ckpt.read(f"{m}.qweight"), n, 2 * half, layout)
        state[f"{m}.weight"] = tg.dequantize(q, ckpt.read(f"{m}.scales_and_zeros"), g)
    return state


def windows(ctx: int, max_windows: int) -> list[torch.Tensor]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(DATA / "tiny-prose" / "tokenizer.json")).encode((DATA / "heldout-prose.txt").read_text()).ids
    return [torch.tensor(ids[i : i + ctx]) for i in range(0, len(ids) - ctx + 1, ctx)][:max_windows]


@torch.no_grad()
def score(model, ref_logp: list[torch.Tensor], wins: list[torch.Tensor]) -> tuple[float, float]:
    kld, same, n = 0.0, 0, 0
    for w, rp in zip(wins, ref_logp):
        lp = torch.log_softmax(model(w[None]).logits[0, len(w) // 2 :].double(), -1)
        kld += float((rp.exp() * (rp - lp)).sum())
        same += int((rp.argmax(-1) == lp.argmax(-1)).sum())
        n += rp.shape[0]
    return kld / n, same / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=40)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    src = DATA / "tiny-prose"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(base["lm_head.weight"].clone())  # untie: the head gets its own weights
    wins = windows(args.ctx, args.max_windows)
    with torch.no_grad():
        ref = [torch.log_softmax(model(w[None]).logits[0, len(w) // 2 :].double(), -1) for w in wins]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for g in (32, 64, 128, 256):
            for method in ("minmax", "rtn"):
                out = Path(tmp) / f"{g}-{method}"
                report = convert(src, out, scheme=Scheme.parse(f"w4a16-g{g}"), method=method)
                model.load_state_dict({**base, **dequantized_state(out)}, strict=False)
                kld, top1 = score(model, ref, wins)
                rows.append((g, method, report.mean_relative_error, kld, top1, report.bytes_out))
    ntok = sum(len(w) - len(w) // 2 for w in wins)
    print(f"# clipping search vs min/max on the bundled tiny-prose model ({ntok} scored tokens, ctx {args.ctx}); "
          f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, torch {torch.__version__}")
    print("| scheme | method | mean weight rel. error | mean KLD | same top-1 | size |")
    print("|---|---|---|---|---|---|")
    for g, method, err, kld, top1, size in rows:
        print(f"| w4a16-g{g} | {method} | {err:.4f} | {kld:.5f} | {top1 * 100:.2f}% | {size / 2**20:.2f} MiB |")
    print()
    for g in (32, 64, 128, 256):
        mm, rtn = [r for r in rows if r[0] == g]
        print(f"g{g}: clipping lowers weight error by {(1 - rtn[2] / mm[2]) * 100:.1f}% and KLD by {(1 - rtn[3] / mm[3]) * 100:.1f}%")


if __name__ == "__main__":
    main()
