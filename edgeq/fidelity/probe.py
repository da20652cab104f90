"""``--per-layer``: the relative output error of every quantised linear, measured with forward hooks.

For a module named n, ``rel_err = ||y_q - y_ref|| / ||y_ref||`` (Frobenius norms over all scored positions) with y_q
its output inside the quantised model and y_ref the same-named module's output inside the reference; the local error
feeds the reference's input of n to the quantised module instead. Example: y_ref = (3, 4), y_q = (3, 4.5) gives
0.5 / 5 = 10%.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from edgeq.errors import EdgeqError
from edgeq.fidelity.report import LayerError
from edgeq.fidelity.sides import is_quantized


class LayerProbe:
    """Forward hooks measuring each quantised linear against the same-named reference module, one window at a time.

    The quantised model runs first: its hooks keep the outputs at the scored rows of the current window (float32).
    Then the reference model runs: its hooks accumulate, in float64, ``||y_q - y_ref||^2``, ``||y_ref||^2`` and,
    feeding the reference input to the quantised module, ``||quant(x_ref) - y_ref||^2``. Nothing else is stored.
    """

    def __init__(self, ref: torch.nn.Module, quant: torch.nn.Module):
        self.names = [n for n, m in quant.named_modules() if is_quantized(m)]
        if not self.names:
            raise EdgeqError("--per-layer: the quantised model has no module marked edgeq_quantized; "
                             "it needs an edgeq checkpoint loaded by edgeq.runtime")
        ref_modules = dict(ref.named_modules())
        missing = [n for n in self.names if n not in ref_modules]
        if missing:
            raise EdgeqError(f"--per-layer: quantised module {missing[0]} has no same-named module in the reference "
                             f"model ({len(missing)} missing); compare against the model it was quantised from")
        quant_modules = dict(quant.named_modules())
        self.quant_modules = {n: quant_modules[n] for n in self.names}
        self.sums = {n: np.zeros(3) for n in self.names}  # [e2e diff^2, local diff^2, ref^2]
        self.pending = {n: np.zeros(3) for n in self.names}  # the current window's, added by commit()
        self.phase, self.rows = "", (0, 0)
        self.stash: dict[str, list[torch.Tensor]] = {}
        self.dtype: dict[str, torch.dtype] = {}
        self.handles = [self.quant_modules[n].register_forward_hook(self._quant_hook(n)) for n in self.names]
        self.handles += [ref_modules[n].register_forward_hook(self._ref_hook(n)) for n in self.names]

    def _rows(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """The current window's scored rows of a module's [1, T, N] input or output."""
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise EdgeqError(f"--per-layer: module {name} produced {type(t).__name__} "
                             f"{tuple(getattr(t, 'shape', ()))}; expected a [1, T, N] tensor")
        a, b = self.rows  # positions counted from the window end, since logits_to_keep may trim the head's input
        T = t.shape[1]
        return t[:, T - a: T - b if b else None]

    def _quant_hook(self, name: str):
        """Stash the quantised module's output (float32) for the reference run to compare against."""
        def hook(module, inputs, output):
            if self.phase == "quant":
                self.stash.setdefault(name, []).append(self._rows(output, name).float().clone())
                self.dtype[name] = inputs[0].dtype
        return hook

    def _ref_hook(self, name: str):
        """Compare the reference module's output with the stashed quantised one, and with the quantised module run
        on the reference's input; add the squared norms to this window's pending sums."""
        def hook(module, inputs, output):
            if self.phase != "ref":
                return
            y_ref = self._rows(output, name).double()
            queue = self.stash.get(name)
            if not queue:
                raise EdgeqError(f"--per-layer: module {name} ran in the reference model but not in the quantised one")
            y_q = queue.pop(0).double()
            if y_q.shape != y_ref.shape:
                raise EdgeqError(f"--per-layer: module {name} output {tuple(y_q.shape)} in the quantised model, "
                                 f"{tuple(y_ref.shape)} in the reference")
            self.phase = "local"  # the quantised module's own hook must not stash this call
            x = self._rows(inputs[0], name).to(self.dtype.get(name, inputs[0].dtype)).contiguous()
            y_local = self.quant_modules[name](x).double()
            self.phase = "ref"
            s = self.pending[name]
            s[0] += float(((y_q - y_ref) ** 2).sum())
            s[1] += float(((y_local - y_ref) ** 2).sum())
            s[2] += float((y_ref ** 2).sum())
        return hook

    def commit(self) -> None:
        """Count the current window (called once all of its results are in)."""
        for n, p in self.pending.items():
            self.sums[n] += p
            p[:] = 0

    def close(self) -> None:
        """Remove the hooks from both models."""
        for h in self.handles:
            h.remove()
        self.stash.clear()

    def results(self, top: int) -> tuple[tuple[LayerError, ...], int]:
        """The ``top`` worst layers (largest end-to-end error first, then by name) and how many were measured."""
        def rel(num: float, den: float) -> float:
            return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
        errs = [LayerError(n, rel(s[0], s[2]), rel(s[1], s[2])) for n, s in self.sums.items()]
        errs.sort(key=lambda e: (-e.rel_err, e.name))
        return tuple(errs[: max(top, 0)]), len(errs)
