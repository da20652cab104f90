"""Tiny random models of every supported family, built from transformers configs with fixed seeds (no network).

Shapes are chosen so every group size 32..128 divides K (hidden 128, intermediate 256) and N is a multiple of 16.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2")


def make_config(family: str, tied: bool | None = None):
    import transformers as tf

    extra = {}
    if family == "qwen3" or family == "gemma2":
        extra["head_dim"] = 32
    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
           "phi3": tf.Phi3Config, "gemma2": tf.Gemma2Config}[family]
    cfg = cls(**COMMON, **extra)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0  # inside the tiny vocabulary
    if tied is not None:
        cfg.tie_word_embeddings = tied
    return cfg


def save_tiny(family: str, path: Path, tied: bool | None = None, dtype=torch.bfloat16, seed: int = 0,
              max_shard_size: str | None = None) -> Path:
    """Save a tiny random model of ``family`` as a safetensors HF checkpoint in ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, tied)).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return Path(path)
