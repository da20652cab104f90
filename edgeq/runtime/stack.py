"""A decode step's decoder layers in one native call (issue 15): ``decode_layers`` (edgeq/csrc/decode_step.cpp).

The lean loop's native step (:meth:`edgeq.runtime.lean.LeanDecoder._step_native`) makes ~10 calls a layer from
Python: the norms, the grouped q/k/v and gate/up kernel calls, RoPE + cache write, attention, o and down, silu and
mul. ``decode_layers`` runs the same calls, in the same order, on the same buffers' values, from C++: one call for all
the layers and the final norm, so the logits are the same bits (tests/test_stack.py) and a step saves the Python
interpreter and dispatch between them (measured: docs/kernel.md, "Decode breakdown"). What stays in Python: the
embedding row, the position's RoPE rows, the head and the pick.

Qwen3's q/k head norms run inside too, with torch's own ops on the decoder's buffers (as the Python step runs them).
It runs when every layer's seven projections are W4A16 :class:`~edgeq.runtime.qlinear.Int4Linear` modules on the
native kernel of one runtime (so one layout), with no act-order permutation and no residual levels, or all
:class:`~edgeq.runtime.w4a8linear.W4A8Linear` modules on edgeq's native W4A8 op (called from C++ through the
dispatcher, one call per matrix as the Python step makes them); :func:`why_not` says otherwise. Checked again
every step: a runtime switched to aten's op (tests, benchmarks) or a crossover at one row runs the Python step.

The argument lists are built once and hold references (the mapped weights, the norms, the cache's buffers): nothing
is copied. The step's own buffers (q, k, v, the rotated q, the attention's output, o, gate, up, down: one token each)
are allocated here, once.
"""

from __future__ import annotations

import torch
from torch import nn

from edgeq.runtime import native
from edgeq.runtime.qlinear import Int4Linear
from edgeq.runtime.w4a8linear import NATIVE_PREFIX, W4A8Linear

MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # the op's order within a layer


def _modules(layer: nn.Module) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def why_not(layers: list[nn.Module]) -> str | None:
    """None when :class:`Stack` runs these decoder layers; otherwise why not (a phrase for the settings)."""
    if not layers:
        return "no layers"
    kind = type(_modules(layers[0])[0])
    rt = None
    for i, layer in enumerate(layers):
        for name, m in zip(MATRICES, _modules(layer)):
            where = f"model.layers.{i}.{name}_proj"
            if type(m) is not kind or kind not in (Int4Linear, W4A8Linear):
                return f"{where} is not a W4A16 Int4Linear or a W4A8Linear like the first projection"
            if kind is W4A8Linear:
                if not m.choice.source.startswith(NATIVE_PREFIX):
                    return f"{where} runs W4A8 on {m.choice.source}, not edgeq's native op"
                continue
            rt = m.runtime if rt is None else rt
            if m.runtime is not rt or rt.native is None:
                return f"{where} is not on the native kernel of the model's runtime"
            if m.perm is not None or m.residual_levels:
                return f"{where} has an act-order permutation or residual levels"
    return None


class Stack:
    """``stack(pos)``: every layer of the step at position ``pos`` and the final norm, in one call (module docstring).
    Reads the decoder's residual ``x`` and the position's ``cos_p``/``nsin_p``; writes ``x``, the final norm's output
    ``n`` and each layer's cache at ``pos``."""

    def __init__(self, decoder, layers: list[nn.Module], final_norm: torch.Tensor, final_eps: float):
        mods = [_modules(layer) for layer in layers]
        first = mods[0][0]
        self.w4a8 = type(first) is W4A8Linear
        self.runtime = None if self.w4a8 else first.runtime
        self.first = first
        self.decoder = decoder
        parts = (("qweight", "scales", "zeros") if self.w4a8 else ("qweight", "scales_and_zeros"))
        self.weights = [getattr(m, a) for ms in mods for a in parts for m in ms]
        self.group_sizes = [int(m.group_size) for ms in mods for m in ms]
        self.biases = [m.bias for ms in mods for m in ms]
        lean = decoder.layers
        self.norms = [w for L in lean for w in (L.w_in, L.w_post)] + [final_norm]
        self.eps = [e for L in lean for e in (L.eps_in_f, L.eps_post_f)] + [float(final_eps)]
        self.caches = [c for L in lean for c in (L.keys, L.values)]
        self.scales = [L.scale for L in lean]
        self.windows = [L.window or 0 for L in lean]
        h, kvh, d, dt = decoder.heads, decoder.kv_heads, decoder.head_dim, decoder.dtype
        inter = mods[0][4].out_features  # unused by W4A8 layers (their op returns its own outputs), checked alike
        self.scratch = [torch.empty(1, h * d, dtype=dt), torch.empty(1, kvh * d, dtype=dt),
                        torch.empty(1, kvh * d, dtype=dt), torch.empty(h, d, dtype=dt), torch.empty(h, d, dtype=dt),
                        torch.empty(1, decoder.hidden, dtype=dt), torch.empty(1, inter, dtype=dt),
                        torch.empty(1, inter, dtype=dt), torch.empty(1, decoder.hidden, dtype=dt)]
        self.calls = len(self.group_sizes)
        self.skip = 0  # benchmarks' ablations only: ops the call leaves out (native.decode_layers)
        self.qk_norms, self.qk_scratch = [], []
        if lean[0].w_qn is not None:  # Qwen3: the head norms' weights and eps, and the decoder's own buffers for them
            self.qk_norms = [t for L in lean for t in (L.w_qn, L.w_kn, L.eps_qk)]
            qn = decoder.qk_norm
            self.qk_scratch = [decoder.qk, qn.f, qn.sq, qn.var, qn.normed, qn.cols]

    @property
    def usable(self) -> bool:
        """Whether the op runs this step: the runtime is still on the native kernel and one row is below its
        crossover (both can be switched on a loaded model)."""
        if self.w4a8:  # its kernel choice is made at load; the decode ops' library must still run
            return self.first.choice.source.startswith(NATIVE_PREFIX) and native.available()
        rt = self.runtime
        return rt.native is not None and rt.prefill_threshold > 1

    def __call__(self, pos: int) -> None:
        dec = self.decoder
        native.decode_layers(dec.x, dec.n, self.weights, self.group_sizes, self.biases, self.norms, self.eps,
                             self.caches, self.scales, self.windows, dec.cos_p, dec.nsin_p, pos, self.scratch,
                             w4a8=self.w4a8, qk_norms=self.qk_norms, qk_scratch=self.qk_scratch, skip=self.skip)
        if self.w4a8:
            self.first.counts[self.first.path] += self.calls
        else:
            self.runtime.counts[self.runtime.decode_path] += self.calls
