"""A static KV cache preallocated from a byte budget.

Per token the cache holds, for every decoder layer, one key and one value vector per KV head::

    bytes_per_token = num_layers * 2 * num_kv_heads * head_dim * itemsize(bf16 = 2)

so a budget of B bytes holds ``floor(B / bytes_per_token)`` tokens. Example: Qwen2.5-1.5B (28 layers, 2 KV heads,
head_dim 128) needs 28 * 2 * 2 * 128 * 2 = 28672 bytes a token; 256 MiB holds 9362 tokens (268,426,240 bytes).

The buffers are allocated once, at load, and never grow: writing past the end raises :class:`EdgeqError`. They are
allocated with ``torch.empty``, not ``torch.zeros``: the pages of a large allocation are mapped but not resident until
written, so the cache costs resident memory only for the positions requests have actually used (a 20-token request
on a 256 MiB budget touches a few pages per layer), growing to at most the budget. This is safe because a position is
always written before anything attends to it: both the transformers path (``_Layer.update``) and the lean decoder
write position p and then attend over ``[:p + 1]`` (or a window inside it); a reset only rewinds ``length``.
tests/test_lean.py fills a cache with NaN and checks that nothing changes. Unlike
transformers' ``StaticCache`` (which attends over the whole buffer every step), each layer hands attention only the
filled prefix ``[:, :, :length]``, so a short request does not pay for a long cache. Sliding-window layers (Gemma-2)
keep every token; the sliding mask built by transformers from the layer's true kv length limits what they attend to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from edgeq.errors import EdgeqError


@dataclass(frozen=True)
class KVPlan:
    """How many tokens a budget buys for one model, and what is actually allocated."""

    bytes_per_token: int
    budget_bytes: int
    budget_tokens: int  # floor(budget / bytes_per_token)
    tokens: int  # allocated = min(budget_tokens, max_model_len)
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def allocated_bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) from a transformers text config."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return layers, kv_heads, head_dim


def plan_kv(config, budget_bytes: int, max_model_len: int | None, dtype=torch.bfloat16) -> tuple[KVPlan, int]:
    """Return (plan, effective max_model_len). max_model_len defaults to min(model maximum, budget tokens)."""
    layers, kv_heads, head_dim = kv_geometry(config)
    per_token = layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    budget_tokens = budget_bytes // per_token
    model_max = int(getattr(config, "max_position_embeddings", 0) or 0) or None
    if budget_tokens < 1:
        raise EdgeqError(f"kv_cache_bytes={budget_bytes}: less than one token of KV cache ({per_token} bytes a token "
                         f"for this model); raise --kv-cache-bytes")
    if max_model_len is None:
        max_model_len = min(budget_tokens, model_max) if model_max else budget_tokens
    elif max_model_len < 1:
        raise EdgeqError(f"max_model_len={max_model_len}: must be at least 1")
    elif model_max and max_model_len > model_max:
        raise EdgeqError(f"max_model_len={max_model_len} exceeds the model's maximum of {model_max} positions "
                         f"(config.json max_position_embeddings); lower --max-model-len")
    elif max_model_len > budget_tokens:
        need = max_model_len * per_token
        raise EdgeqError(f"max_model_len={max_model_len} needs {need} bytes of KV cache ({per_token} a token) but "
                         f"kv_cache_bytes={budget_bytes} holds {budget_tokens} tokens; raise --kv-cache-bytes to at "
                         f"least {need} or lower --max-model-len")
    plan = KVPlan(per_token, budget_bytes, budget_tokens, max_model_len, layers, kv_heads, head_dim)
    return plan, max_model_len


class _Layer(CacheLayerMixin):
    """One decoder layer's keys and values, [1, kv_heads, capacity, head_dim], filled front to back."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.capacity = keys.shape[2]
        self.length = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        end = self.length + n
        if key_states.shape[0] != 1:
            raise EdgeqError(f"KV cache: batch size {key_states.shape[0]}; edgeq runs one sequence at a time")
        if end > self.capacity:
            raise EdgeqError(f"KV cache full: {self.length} + {n} tokens exceed its {self.capacity} tokens; "
                             f"raise --kv-cache-bytes/--max-model-len or shorten the request")
        self.keys[:, :, self.length : end].copy_(key_states)
        self.values[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0  # stale values are overwritten before they are ever attended to

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)


class StaticKVCache(Cache):
    """All layers' preallocated buffers. ``allocated_bytes`` reads back what was really allocated."""

    def __init__(self, plan: KVPlan, dtype=torch.bfloat16):
        shape = (1, plan.kv_heads, plan.tokens, plan.head_dim)
        # empty, not zeros: untouched pages stay non-resident (module docstring: positions are written before read)
        layers = [_Layer(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for _ in range(plan.layers)]
        super().__init__(layers=layers)
        self.plan = plan

    @property
    def capacity(self) -> int:
        return self.plan.tokens

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))

    def check_room(self, tokens: int, what: str = "request") -> None:
        if self.length + tokens > self.capacity:
            raise EdgeqError(
                f"{what} needs {self.length + tokens} tokens of KV cache but it holds {self.capacity} "
                f"({self.allocated_bytes} bytes, {self.plan.bytes_per_token} a token); shorten the prompt, lower "
                f"max_tokens, or raise --kv-cache-bytes/--max-model-len"
            )
