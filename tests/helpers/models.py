"""Tiny random models of every supported family, built from transformers configs with fixed seeds (no network).

Two factories, for two jobs:
- ``save_tiny`` saves a quantizer input: hidden 128, intermediate 256, so every group size 32..128 divides K and N
  is a multiple of 16 (``save_tiny_biogpt``: the same shapes, a head named ``output_projection``).
- ``tiny_model`` returns a runtime test model (bf16, eval): intermediate 352 (11 groups of 32), vocabulary 512,
  head_dim 32, random biases where the family has them (Qwen2's q/k/v), Gemma2 with a 48-token sliding window and a
  tied head; ``save_hf`` writes it as an HF checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2")
ARCHS = FAMILIES

COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


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


def save_tiny_biogpt(path: Path, tied: bool) -> nn.Module:
    """A tiny random BioGPT (``save_tiny``'s shapes; its head is ``output_projection``, not ``lm_head``) saved in
    ``path``; returned for reference logits."""
    import transformers as tf

    shapes = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}  # BioGPT has no grouped-query attention
    cfg = tf.BioGptConfig(**shapes, tie_word_embeddings=tied)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    return model


_COMMON = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False,
               initializer_range=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_EXTRA = {
    "llama": dict(head_dim=32),
    "mistral": dict(head_dim=32, sliding_window=None),
    "qwen2": dict(use_sliding_window=False),  # q/k/v carry biases
    "qwen3": dict(head_dim=32),  # q_norm / k_norm
    "phi3": dict(),  # fused qkv_proj and gate_up_proj
    "gemma2": dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=48, tie_word_embeddings=True),
}


def tiny_model(arch: str, seed: int = 0, **overrides) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **{**_COMMON, **_EXTRA[arch], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers initialises biases to 0; give Qwen2's q/k/v biases something to carry
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.05)
    return model.to(torch.bfloat16).eval()


def save_hf(model: nn.Module, out: Path) -> Path:
    model.save_pretrained(str(out), safe_serialization=True)
    return out
