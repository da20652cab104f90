"""Each calibration stream runs a decoder layer about once, not once per Hessian group.

GPTQ's true-sequential order (:mod:`edgeq.convert.calibrate`) gives each group of Linears its inputs behind the
groups quantised before it. Re-running the layer from its start for every group and once more for its outputs
costs, on a Llama layer (groups q/k/v, o, gate/up, down), the attention four times and gate/up twice per stream:
about twice one forward's flops.

A *tail* is the last Linear a direct child of the layer runs when the child's output is that Linear's output
(``self_attn`` -> ``o_proj``, ``mlp`` -> ``down_proj``), found on one batch by object identity: an architecture that
changes the Linear's output before returning it has no tail there and simply runs as before. The pass that gives
a tail its Hessian captures its inputs anyway; kept for every batch, they give the child's output once the tail's
weights are final: one call of the tail in each stream with that stream's weights (quantised, or the float copy).
From then on the child does not run: its ``forward`` returns that output for the batch being run, until
:meth:`Cache.release`. Worked example, one Llama layer per stream: q/k/v's pass runs the input norm; o's pass the
attention (its inputs kept), then o once; gate/up's pass only the norms; down's pass gate/up (its inputs kept),
then down once; the outputs' pass adds the residuals: each Linear runs once.

Identical arithmetic: the same Linear on the same batch tensors the child would give it, so the Hessians, the
checkpoint and the layer outputs are bit-identical with or without the cache (tests/test_gptq_driver.py).

Memory: a tail's inputs for every calibration token in each stream (tokens x in_features x the compute dtype's
bytes), then its outputs (tokens x out_features), kept to the end of the layer. The tails are planned in the order
they run while their sum fits ``CACHE_BYTES`` (or a quarter of the available memory, if less), so on a large model
the attention's tail (hidden-size wide) can be cached when the MLP's (intermediate-size) is not. Example:
Llama-3.2-1B, 32,768 tokens, fp32, two streams: o_proj 2 x 256 MiB, down_proj 2 x 1 GiB: 2.5 GiB, both cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch
from torch import nn

CACHE_BYTES = 4 << 30  # activations kept per layer for both streams' tails (module docstring)


@dataclass(frozen=True)
class Tail:
    """``linear`` (e.g. ``mlp.down_proj``) gives the output of the layer's child ``child`` (``mlp``); the child
    returns that tensor itself (``extra`` None) or a tuple of it and ``extra`` Nones (attention weights)."""

    child: str
    linear: str
    extra: int | None


class TailFinder:
    """Hooks on a layer while one batch runs through it (``with TailFinder(layer) as f: run(layer, h)``); then
    :meth:`tails`: ``{linear name: Tail}``."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.linear_out: list[tuple[str, object]] = []
        self.child_out: dict[str, object] = {}
        self.handles = []

    def __enter__(self) -> "TailFinder":
        for n, m in self.layer.named_modules():
            if isinstance(m, nn.Linear):
                self.handles.append(m.register_forward_hook(lambda mod, a, o, n=n: self.linear_out.append((n, o))))
        for n, c in self.layer.named_children():
            self.handles.append(c.register_forward_hook(lambda mod, a, o, n=n: self.child_out.__setitem__(n, o)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def tails(self) -> dict[str, Tail]:
        found = {}
        for child, out in self.child_out.items():
            first, rest = (out[0], out[1:]) if isinstance(out, tuple) and out else (out, None)
            if rest is not None and any(r is not None for r in rest):
                continue  # e.g. attention weights returned: the output is more than the Linear's
            mine = [(n, o) for n, o in self.linear_out if n.startswith(child + ".")]
            if mine and mine[-1][1] is first:
                found[mine[-1][0]] = Tail(child, mine[-1][0], None if rest is None else len(rest))
        return found


def plan(layer: nn.Module, tails: dict[str, Tail], tokens: int, streams: int, elem: int) -> dict[str, Tail]:
    """The tails to cache, in the order given, while their bytes (``tokens * max(in, out) * elem * streams``) sum
    to at most the budget: :data:`CACHE_BYTES`, or a quarter of the memory available now if that is less (a
    small machine converts as before, only slower). Example: 1,024 tokens in bf16, two streams, o_proj 256 -> 256
    (1 MiB) and down_proj 768 -> 256 (3 MiB): both under 4 MiB, only o_proj under 2 MiB."""
    budget, chosen, used = min(CACHE_BYTES, psutil.virtual_memory().available // 4), {}, 0
    for name, tail in tails.items():
        lin = layer.get_submodule(name)
        need = tokens * max(lin.in_features, lin.out_features) * elem * streams
        if used + need <= budget:
            chosen[name], used = tail, used + need
    return chosen


class Cache:
    """One layer's tail activations per stream (0: the quantised model's, 1: the float model's).

    ``keep`` stores a tail's inputs batch by batch; ``freeze`` turns them into the child's outputs (the tail's
    weights now final) and replaces the child's ``forward``, which then serves the batch chosen by ``select``."""

    def __init__(self, layer: nn.Module, tails: dict[str, Tail], batches: list[slice]):
        self.layer, self.tails, self.batches = layer, tails, batches
        self.data: dict[str, list[torch.Tensor | None]] = {}
        self.frozen: list[str] = []
        self.at: tuple[int, slice] = (0, slice(None))

    def select(self, stream: int, sl: slice) -> None:
        self.at = (stream, sl)

    def keep(self, linear: str, stream: int, sl: slice, x: torch.Tensor) -> None:
        if linear not in self.tails:
            return
        bufs = self.data.setdefault(linear, [None, None])
        if bufs[stream] is None:
            s = self.batches[-1].stop
            bufs[stream] = torch.empty(s, *x.shape[1:], dtype=x.dtype)
        bufs[stream][sl] = x

    def freeze(self, linear: str, float_params: dict[str, torch.Tensor] | None) -> None:
        """The child's outputs from the kept inputs (stream 0 with the Linear's own weights, stream 1 with
        ``float_params[linear + '.weight']`` etc.), then the child stops running."""
        if linear not in self.data:
            return
        lin = self.layer.get_submodule(linear)
        bufs = self.data[linear]
        for stream, x in enumerate(bufs):
            if x is None:
                continue
            params = None if stream == 0 else {n: float_params[f"{linear}.{n}"] for n, _ in lin.named_parameters()}
            out = None
            with torch.no_grad():
                for sl in self.batches:
                    y = lin(x[sl]) if params is None else torch.func.functional_call(lin, params, (x[sl],))
                    if out is None:
                        out = torch.empty(x.shape[0], *y.shape[1:], dtype=y.dtype)
                    out[sl] = y
            bufs[stream] = out  # the inputs are released
        self._install(self.tails[linear])

    def _install(self, tail: Tail) -> None:
        bufs = self.data[tail.linear]

        def forward(*args, **kwargs):
            stream, sl = self.at
            y = bufs[stream][sl]
            return y if tail.extra is None else (y,) + (None,) * tail.extra

        self.layer.get_submodule(tail.child).forward = forward
        self.frozen.append(tail.child)

    def release(self) -> None:
        """The children run their own ``forward`` again; the activations are dropped."""
        for child in self.frozen:
            del self.layer.get_submodule(child).forward
        self.frozen.clear()
        self.data.clear()
