"""A model as the comparison sees it ("side"): a scoring function, and when known its module, tokenizer, vocab size.

A side is a callable ``input_ids [1, T] (int64) -> logits [1, T, V]`` (or the last L >= T - first positions of
them), an ``nn.Module`` whose ``forward(input_ids=...)`` returns ``.logits`` (a transformers causal LM), or an object
with ``.model`` (such a module) and ``.tokenizer`` (e.g. ``edgeq.runtime.load(path)``).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from edgeq.errors import EdgeqError


def is_quantized(module: torch.nn.Module) -> bool:
    """A linear edgeq's runtime swapped in (its class says ``edgeq_quantized = True``), whatever its kernel."""
    return getattr(type(module), "edgeq_quantized", False) is True


def _config_int(config: Any, key: str) -> Optional[int]:
    """An int setting of a config object or dict; ``None`` when absent or not an int (a bool is not one)."""
    v = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _from_configs(obj: Any, module: Any, key: str) -> Optional[int]:
    """``key`` from the side's own config, else from its module's."""
    return _config_int(getattr(obj, "config", None), key) or _config_int(getattr(module, "config", None), key)


class Side:
    """One model as the comparison sees it: a scoring function, and (when known) its module, tokenizer, vocab size."""

    def __init__(self, obj: Any, label: str, tokenizer: Any = None):
        self.label = label
        self.path = getattr(obj, "path", None)  # a loaded checkpoint's directory, named in errors about its weights
        self.module: Optional[torch.nn.Module] = None
        if isinstance(obj, torch.nn.Module):
            self.module = obj
        elif isinstance(getattr(obj, "model", None), torch.nn.Module):
            self.module = obj.model
            tokenizer = tokenizer if tokenizer is not None else getattr(obj, "tokenizer", None)
        elif not callable(obj):
            raise EdgeqError(f"{label}: expected a model (nn.Module, an object with .model) or a scoring function, "
                             f"got {type(obj).__name__}")
        self.tokenizer = tokenizer
        self.vocab_size = _from_configs(obj, self.module, "vocab_size")
        self.max_positions = _from_configs(obj, self.module, "max_position_embeddings")
        self._fn = obj if self.module is None else None
        if self.module is not None:
            self.module.eval()  # dropout would make a model differ from itself
            params = inspect.signature(self.module.forward).parameters
            self._kwargs = {k: v for k, v in (("use_cache", False),) if k in params}
            self._keep = "logits_to_keep" in params

    def check_ctx(self, ctx: int) -> None:
        """Refuse windows longer than the model's ``max_position_embeddings`` (when it is known)."""
        if self.max_positions is not None and ctx > self.max_positions:
            raise EdgeqError(f"--ctx {ctx}: the {self.label} model has max_position_embeddings {self.max_positions}; "
                             f"use --ctx {self.max_positions} or less")

    def logits(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """float32 logits [T', V] of window ``ids`` [1, T], aligned to the window's end (T' >= ``keep``)."""
        T = ids.shape[1]
        with torch.inference_mode():
            if self.module is None:
                out = self._fn(ids)
            else:
                kw = dict(self._kwargs, logits_to_keep=keep) if self._keep else self._kwargs
                out = self.module(input_ids=ids, **kw)
            out = getattr(out, "logits", out)
            if isinstance(out, (tuple, list)):
                out = out[0]
        if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[0] != 1 or not keep <= out.shape[1] <= T:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise EdgeqError(f"{self.label}: the model returned logits of shape {shape} for input [1, {T}]; "
                             f"expected [1, T', V] with {keep} <= T' <= {T}")
        return out[0].float()
