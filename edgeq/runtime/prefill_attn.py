"""The attention of the transformers forward (prefill, and decode when the lean loop does not run): edgeq's native
causal kernel (``native.prefill_attn``, edgeq/csrc/attn_prefill.h) where it applies, torch's SDPA otherwise.

Why: torch's flash-attention CPU kernel reaches ~40 GMAC/s on 2 cores for a 512-token causal prefill (Qwen2.5-1.5B
heads: 10.5 ms a layer, 12% of a W4A16 prefill and 21% of a W4A8 one on AMD Zen 5); the native kernel takes ~2 ms
(docs/kernel.md, "Prefill attention"; an avx2 path for CPUs without AVX512-BF16). Installed at load as a
transformers attention implementation (``"edgeq_native"``, registered with the SDPA mask builder). A call runs
natively when it is one sequence of bf16 heads of a multiple of 16, causal over keys that end at the last query (the
mask None, or exactly that causal mask), without dropout or softcapping, and with no sliding window narrower than its
keys; every other call goes to transformers' own SDPA function, and ``counts`` says how many went each way
(``prefill_attn_native`` / ``prefill_attn_sdpa``).

Numerics: fp32 scores (exact bf16 products), fp32 online softmax and sums, one rounding to bf16: the same math as
SDPA's, summed in another order, so logits are close to the SDPA forward's, not bit-equal (tests/test_prefill_attn.py
bounds both against fp64). ``prefill_attn="sdpa"`` (or ``$EDGEQ_PREFILL_ATTN=sdpa``) keeps transformers' SDPA.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch import nn

from edgeq.env import PREFILL_ATTN as ENV_PREFILL_ATTN, choice
from edgeq.errors import EdgeqError
from edgeq.runtime.native import ops

NAME = "edgeq_native"
CHOICES = ("auto", "native", "sdpa")


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415 - heavy import

    return sdpa_attention_forward


_checked: tuple = (lambda: None, False)  # (weak reference to the last mask checked, its verdict)


def _causal(mask: torch.Tensor | None, s: int, t: int) -> bool:
    """True when ``mask`` lets query i (at position t - s + i) see exactly keys [0, t - s + i]: None (transformers
    leaves it out when is_causal says it all) or a bool [1, 1, s, t] of that pattern. transformers builds one mask
    per forward and hands it to every layer: the verdict on that tensor is kept (by weak reference) and reused."""
    global _checked
    if mask is None:
        return s == t or s == 1
    if _checked[0]() is mask:
        return _checked[1]
    ok = mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, s, t)
    if ok:
        ok = torch.equal(mask[0, 0], torch.arange(t)[None, :] <= torch.arange(t - s, t)[:, None])
    _checked = (weakref.ref(mask), ok)
    return ok


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, S, D], key/value [1, KVH, T, D] -> ([1, S, H, D],
    None). The native kernel when the call fits (module docstring), else ``sdpa_attention_forward``."""
    counts: Counter | None = getattr(module, "_edgeq_counts", None)
    b, h, s, d = query.shape
    t = key.shape[2]
    fits = (b == 1 and query.dtype == key.dtype == value.dtype == torch.bfloat16 and d % 16 == 0 and t >= s
            and key.shape[1] > 0 and h % key.shape[1] == 0 and value.shape == key.shape and not dropout
            and is_causal is not False and getattr(module, "is_causal", True)
            and kwargs.get("softcap") is None and (kwargs.get("sliding_window") or t) >= t  # a window as wide: causal
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions")
            and key.stride(3) == value.stride(3) == 1 and key.stride(2) == value.stride(2)
            and key.stride(1) == value.stride(1) and _causal(attention_mask, s, t))
    if not fits:
        if counts is not None:
            counts["prefill_attn_sdpa"] += 1
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)
    if counts is not None:
        counts["prefill_attn_native"] += 1
    out = ops.prefill_attn(query[0].contiguous(), key, value, d**-0.5 if scaling is None else float(scaling))
    return out[None], None


_registered: str | None = None  # "" once registered; else why it cannot be (this transformers has no such interface)


def _register() -> str:
    """Register :func:`attention` with transformers (once): "" when done, else the reason it cannot be."""
    global _registered
    if _registered is None:
        try:
            from transformers import AttentionInterface  # noqa: PLC0415
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: PLC0415

            AttentionInterface.register(NAME, attention)
            AttentionMaskInterface.register(NAME, sdpa_mask)
            _registered = ""
        except (ImportError, AttributeError) as e:
            import transformers  # noqa: PLC0415

            _registered = f"transformers {transformers.__version__} has no attention registry edgeq can use ({e})"
    return _registered


def install(model: nn.Module, request: str | None, counts: Counter) -> tuple[str, str]:
    """("native" | the model's own attention, why): make ``model``'s forward use :func:`attention` when ``request``
    ("auto", None: ``$EDGEQ_PREFILL_ATTN``, default auto) allows and the native kernel runs here; "native" insists
    (an :class:`EdgeqError` naming the reason otherwise); "sdpa" leaves the model as transformers built it."""
    picked, source = choice(request, "prefill_attn", ENV_PREFILL_ATTN, CHOICES)
    current = getattr(model.config, "_attn_implementation", None) or "eager"
    if picked == "sdpa":
        return current, f"requested ({source}=sdpa)"
    why = None
    if current != "sdpa":
        why = f"the model runs {current} attention (transformers' choice for {model.config.model_type})"
    elif not ops.prefill_attn_available():
        why = "the native prefill attention needs the native library's avx2 or avx512 path, not available here"
    else:
        why = _register() or None
    if why is not None:
        if picked == "native":
            raise EdgeqError(f"{source}=native but {why}; use auto or sdpa")
        return current, why
    model.set_attn_implementation(NAME)
    for m in model.modules():
        if hasattr(m, "num_key_value_groups"):  # the attention modules: the function counts its calls on them
            m._edgeq_counts = counts
    return "native", "edgeq's causal attention kernel (fp32 online softmax; SDPA for calls it does not fit)"
