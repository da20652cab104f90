"""How long `edgeq inspect` takes on large checkpoints, and proof that it reads no tensor data.

Two synthetic checkpoints whose files are only headers plus ``ftruncate`` (sparse: they cost no disk):

- ``hf``: a Llama-style bf16 checkpoint of ~10 GB (hidden 4096, intermediate 11008, 24 layers, vocab 128256),
  three shards and an index: inspect builds the quantizer's plan for all four w4a16 schemes;
- ``edgeq``: what ``edgeq quantize`` writes for a ~10 GB output (hidden 6144, intermediate 16384, 48 layers, vocab
  152064), with the manifest written by the converter's own code from the plan.

Reported: the first call in a fresh process (layout probe included), the median of 5 warm in-process calls
(spread shown), the whole ``python -m edgeq.cli inspect`` command (median of 3, wall and CPU seconds: Python and
torch start-up included), and the bytes the inspecting process read (``rchar`` from /proc/self/io: everything
read() returned) against the tensor bytes in the files.

    python benchmarks/bench_inspect.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgeq.convert.plan import build_plan
from edgeq.io.hf import open_checkpoint
from edgeq.convert.recipe import find_recipe
from edgeq.io.safetensors import DTYPES, OutSpec, ShardedWriter, _header_bytes
from edgeq.convert import records
from edgeq.layouts import tinygemm
from edgeq.inspect.report import inspect_checkpoint
from edgeq.runtime.crossover import cache_capability
from edgeq.scheme import Scheme

import torch

HF = dict(hidden=4096, inter=11008, layers=24, heads=32, kv=8, vocab=128256)
EQ = dict(hidden=6144, inter=16384, layers=48, heads=48, kv=8, vocab=152064)


def _config(g: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": g["hidden"],
            "intermediate_size": g["inter"], "num_hidden_layers": g["layers"], "num_attention_heads": g["heads"],
            "num_key_value_heads": g["kv"], "vocab_size": g["vocab"], "max_position_embeddings": 8192,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _specs(g: dict) -> list[OutSpec]:
    h, hd = g["hidden"], g["hidden"] // g["heads"]
    bf = torch.bfloat16
    specs = [OutSpec("model.embed_tokens.weight", bf, (g["vocab"], h))]
    for i in range(g["layers"]):
        p = f"model.layers.{i}."
        specs += [OutSpec(p + "input_layernorm.weight", bf, (h,)), OutSpec(p + "post_attention_layernorm.weight", bf, (h,))]
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (g["kv"] * hd, h)),
                            ("self_attn.v_proj", (g["kv"] * hd, h)), ("self_attn.o_proj", (h, h)),
                            ("mlp.gate_proj", (g["inter"], h)), ("mlp.up_proj", (g["inter"], h)),
                            ("mlp.down_proj", (h, g["inter"]))):
            specs.append(OutSpec(p + name + ".weight", bf, shape))
    specs += [OutSpec("model.norm.weight", bf, (h,)), OutSpec("lm_head.weight", bf, (g["vocab"], h))]
    return specs


def _write_sparse(out: Path, specs: list[OutSpec], max_shard: int) -> list[str]:
    """Headers as the writer lays them out, data as holes; returns the shard names."""
    layout = ShardedWriter(out, specs, max_shard)  # only its shard split and names are used
    for name, shard in zip(layout.names, layout.shards):
        header = _header_bytes(shard, {"format": "pt"})
        with open(out / name, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(s.nbytes for s in shard))
    if len(layout.names) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: layout.names[i] for i, shard in enumerate(layout.shards) for s in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return layout.names


def make_hf(out: Path, g: dict = HF) -> Path:
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(_config(g)))
    _write_sparse(out, _specs(g), 4 << 30)
    return out


def make_edgeq(out: Path, g: dict = EQ) -> Path:
    """The float checkpoint's plan (headers only) -> the converter's tensor list, manifest and config, data as holes."""
    src = make_hf(out.parent / (out.name + "-src"), g)
    plan = build_plan(open_checkpoint(src), Scheme.parse("w4a16-g128"), "rtn", find_recipe(None, "llama"))
    plan.check()
    specs = [OutSpec(n, DTYPES[d][0], s) for e in plan.entries for n, d, s in e.out_tensors(plan.scheme)]
    out.mkdir(parents=True)
    names = _write_sparse(out, specs, 2 << 30)
    layout = tinygemm.probe()
    manifest = records.manifest(plan, layout, {n: "0" * 64 for n in names})  # hashes of holes are never checked here
    manifest.write(out)
    config = {**_config(g), "quantization_config": records.quantization_config(manifest, plan, layout)}
    (out / "config.json").write_text(json.dumps(config))
    return out


PROBE = """
import json, sys, time
from edgeq.inspect.report import inspect_checkpoint
def io():
    return {k: int(v) for k, v in (l.split(": ") for l in open("/proc/self/io").read().splitlines())}
io0 = io(); t0 = time.perf_counter()
r = inspect_checkpoint(sys.argv[1])  # the first call: the layout probe and any lazy import included
seconds = time.perf_counter() - t0
io1 = io()
inspect_checkpoint(sys.argv[1])  # the second call reads only what inspecting needs
io2 = io()
print(json.dumps({"seconds": seconds, "problems": len(r.problems), "tensors": r.files["tensors"],
                  "rchar_first": io1["rchar"] - io0["rchar"],
                  **{k: io2[k] - io1[k] for k in ("rchar", "read_bytes", "syscr")}}))
"""
def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:8.1f} ms (min {min(xs) * 1000:.1f}, max {max(xs) * 1000:.1f})"


def bench(path: Path) -> dict:
    ckpt = open_checkpoint(path)
    data = ckpt.nbytes
    files = sum(f.stat().st_size for f in ckpt.files)
    first = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, check=True)
    cold = json.loads(first.stdout)  # a fresh process: the first call includes the layout probe
    inspect_checkpoint(path)
    warm = []
    for _ in range(5):
        t0 = time.perf_counter()
        inspect_checkpoint(path)
        warm.append(time.perf_counter() - t0)
    tens = []
    for _ in range(3):
        t0 = time.perf_counter()
        inspect_checkpoint(path, tensors=True)
        tens.append(time.perf_counter() - t0)
    whole, cpu = [], []
    for _ in range(3):
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-m", "edgeq.cli", "inspect", str(path)], capture_output=True, check=True)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        whole.append(time.perf_counter() - t0)
        cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    return {"files": files, "data": data, "cold": cold, "warm": warm, "tensors": tens, "whole": whole, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", type=Path, help="build the checkpoints here and keep them")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-inspect-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, capability {cache_capability()}; checkpoints in {root} (sparse)")
    cases = {"hf": make_hf(root / "hf"), "edgeq": make_edgeq(root / "edgeq")}
    for kind, path in cases.items():
        r = bench(path)
        c = r["cold"]
        print(f"\n{kind}: {r['files'] / 1e9:.2f} GB in {len(open_checkpoint(path).files)} shard(s), "
              f"{c['tensors']} tensors, problems {c['problems']}")
        print(f"  first call in a fresh process (incl. layout probe) {c['seconds'] * 1000:8.1f} ms")
        print(f"  warm call, median of 5                           {_median(r['warm'])}")
        print(f"  warm call with --tensors, median of 3            {_median(r['tensors'])}")
        print(f"  `python -m edgeq.cli inspect`, median of 3       {_median(r['whole'])}  wall, "
              f"{statistics.median(r['cpu']):.2f} s CPU (Python + torch start-up included)")
        print(f"  read by an inspecting call: rchar {c['rchar']:,} bytes in {c['syscr']} read() calls, disk "
              f"read_bytes {c['read_bytes']:,}; tensor data in the files {r['data']:,} bytes "
              f"({c['rchar'] / r['data'] * 100:.5f}%); the first call, lazy imports included: {c['rchar_first']:,}")
        assert c["rchar"] < 16 << 20, "inspect read more than headers"


if __name__ == "__main__":
    main()
