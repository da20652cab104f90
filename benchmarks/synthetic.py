"""Synthetic HF checkpoints of real model shapes with random weights (speed and memory do not depend on values).

Written tensor by tensor with edgeq's streaming writer, so building a multi-GB checkpoint needs little memory.

    python benchmarks/synthetic.py qwen2.5-1.5b /tmp/qwen-shape        # Qwen2.5-1.5B shapes, tied head
    python benchmarks/synthetic.py llama-3.2-1b /tmp/llama-shape
    python benchmarks/synthetic.py qwen3-1.7b --layers 8 /tmp/qwen3-shape  # Qwen3-1.7B layers (q/k head norms)
    python benchmarks/synthetic.py scaled --layers 8 /tmp/scaled-8     # hidden 1024, vocab 16384, untied
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from edgeq.io.safetensors import OutSpec, ShardedWriter

SHAPES = {
    "qwen2.5-1.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         hidden_act="silu", bos_token_id=151643, eos_token_id=151643),
    "llama-3.2-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         hidden_act="silu", head_dim=64, bos_token_id=128000, eos_token_id=128001),
    "qwen3-1.7b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, hidden_act="silu", bos_token_id=151643, eos_token_id=151645),
    "scaled": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=1024, intermediate_size=2816,
                   num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, vocab_size=16384,
                   tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                   hidden_act="silu", bos_token_id=1, eos_token_id=2),
}


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i))]
        if cfg["model_type"] == "qwen2":
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)), (p + "self_attn.v_proj.bias", (kv,))]
        if cfg["model_type"] == "qwen3":  # RMSNorm over each head of q and k
            out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h)))
    return out


def write(cfg: dict, path: Path, seed: int = 0) -> int:
    """Write config.json and sharded bf16 weights; returns bytes of weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}, indent=2))
    shapes = tensor_shapes(cfg)
    writer = ShardedWriter(path, [OutSpec(n, torch.bfloat16, s) for n, s in shapes], max_shard_bytes=2 << 30)
    g = torch.Generator().manual_seed(seed)
    for name, shape in shapes:
        if len(shape) == 1:
            writer.write(name, torch.ones(shape, dtype=torch.bfloat16))
            continue
        rows = max(1, (4 << 20) // shape[1])
        for a in range(0, shape[0], rows):
            b = min(shape[0], a + rows)
            writer.write(name, (torch.randn(b - a, shape[1], generator=g) * 0.02).to(torch.bfloat16))
    writer.close()
    return sum(2 * __import__("math").prod(s) for _, s in shapes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int)
    args = ap.parse_args()
    cfg = dict(SHAPES[args.shape])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    print(f"{args.out}: {write(cfg, args.out) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
