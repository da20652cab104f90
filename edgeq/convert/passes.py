"""Running one decoder layer of a Hugging Face model on a batch of windows, whole or up to one Linear's input.

:class:`LayerRunner` calls a layer with the causal mask and rotary embeddings it expects; :func:`group_input` stops
the layer (an exception from a forward pre-hook) as soon as a Linear has its input; :func:`discover_groups` finds, on
one batch, the Linears in the order they run, grouped by identical input tensor (q/k/v; gate/up), and the layer's
tails (:mod:`edgeq.convert.tails`). Used by the layer-streamed GPTQ driver, :mod:`edgeq.convert.calibrate`.
"""

from __future__ import annotations

import torch
from torch import nn

from edgeq.convert import tails
from edgeq.errors import EdgeqError


class _StopForward(Exception):
    """Raised from a pre-hook once the group being calibrated has its input: the rest of the layer is not needed."""


class LayerRunner:
    """Calls one decoder layer on a batch of windows with the causal mask and rotary embeddings."""

    def __init__(self, model, config, t: int, dtype: torch.dtype):
        rot = type(model.model.rotary_emb)(config=config)  # real buffers (the skeleton's are on meta)
        self.position_ids = torch.arange(t).unsqueeze(0)
        self.cos_sin = rot(torch.zeros(1, dtype=dtype), self.position_ids)
        mask = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype).triu_(1)
        self.mask = mask[None, None]

    def __call__(self, layer: nn.Module, h: torch.Tensor, params: dict | None = None) -> torch.Tensor:
        """The layer's output on ``h``; with ``params`` (name -> tensor) the layer runs with those weights instead."""
        kwargs = {"attention_mask": self.mask, "position_ids": self.position_ids, "position_embeddings": self.cos_sin}
        with torch.no_grad():
            if params is None:
                out = layer(h, **kwargs)
            else:
                out = torch.func.functional_call(layer, params, (h,), kwargs)
        return out[0] if isinstance(out, tuple) else out


def discover_groups(layer: nn.Module, run: LayerRunner, h: torch.Tensor, prefix: str) -> tuple[list[list[str]], dict]:
    """Linears of ``layer`` in the order they run, grouped by identical input tensor (q/k/v; gate/up), and the
    layer's tails (:class:`edgeq.convert.tails.TailFinder`)."""
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    order: list[tuple[str, torch.Tensor]] = []
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: order.append((n, args[0]))) for n, m in linears.items()]
    try:
        with tails.TailFinder(layer) as finder:
            run(layer, h)
    finally:
        for hd in handles:
            hd.remove()
    seen = [n for n, _ in order]
    missing = [n for n in linears if n not in seen]
    repeated = sorted({n for n in seen if seen.count(n) > 1})
    if missing or repeated:
        raise EdgeqError(
            f"{prefix}*: Linear(s) {missing or repeated} did not run exactly once per forward; "
            "GPTQ calibration cannot handle this layer (use --method rtn)"
        )
    groups: list[list[str]] = []
    prev = None
    for n, x in order:
        if prev is not None and x is prev:
            groups[-1].append(n)
        else:
            groups.append([n])
        prev = x
    return groups, finder.tails()


def group_input(layer: nn.Module, linear: nn.Linear, run: LayerRunner, h: torch.Tensor, params: dict | None = None) -> torch.Tensor:
    """The input ``linear`` receives when ``layer`` (with ``params`` in place of its own, if given) runs on ``h``;
    the rest of the layer is not run."""
    got = []

    def grab(mod, args):
        got.append(args[0])
        raise _StopForward

    handle = linear.register_forward_pre_hook(grab)
    try:
        try:
            run(layer, h, params)
        except _StopForward:
            pass
    finally:
        handle.remove()
    return got[0]
