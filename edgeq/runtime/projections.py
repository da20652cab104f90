"""Projections that read the same input, in one native kernel call per decode step (issue 15).

A decoder layer's q, k and v read the same normed activation, and so do its gate and up. The lean decode loop
(:mod:`edgeq.runtime.lean`) computes each such group of W4A16 projections with one ``int4_mm_multi`` call
(edgeq/csrc/int4mm_ops.cpp; it also adds Qwen2's q/k/v biases, one op each before) instead of one ``int4_mm`` call
per matrix::

    [y_q, y_k, y_v] = int4_mm_multi(n, [(Wq, Gq, SZq, bq), (Wk, Gk, SZk, bk), (Wv, Gv, SZv, bv)])
    y_i = bf16(float(int4_mm(n, W_i)) + float(b_i))     # each output: the same bits as the separate calls

The weights stay where they are (each its own mapped tensor with its own group size: nothing is concatenated or
copied, the checkpoint and its manifest do not change); what the call saves is per matrix after the first: the
dispatch, x's fp32 copy and group sums, an OpenMP region and the bias op. Measured in docs/kernel.md ("Decode
breakdown"): 0.6-0.8 ms a token on the Qwen2.5-1.5B shape, 0.2 ms on Llama-3.2-1B's (AMD Zen 3). The same grouping
for W4A8 (x quantised once for q/k/v) measured no gain and was not kept. Counters: each matrix still counts one
decode call.

A group is fused only when every member is an :class:`~edgeq.runtime.qlinear.Int4Linear` on the native kernel with
one runtime (so one layout), no act-order permutation and no residual levels; otherwise (W4A8 modules, bf16
Linears), and whenever the rows reach the prefill crossover, each member's own ``linear2d`` runs, so the result never
depends on the grouping.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from edgeq.runtime.qlinear import Int4Linear

Group = Callable[[torch.Tensor], list[torch.Tensor]]
MAX_ROWS = 2  # int4_mm_multi takes 1..2 rows (decode); more run the members one by one


def fusable(modules: list[nn.Module]) -> bool:
    """Whether ``modules`` can share one native call (module docstring)."""
    if len(modules) < 2 or not all(type(m) is Int4Linear for m in modules):
        return False
    rt = modules[0].runtime
    return rt.native is not None and all(
        m.runtime is rt and m.perm is None and not m.residual_levels and m.in_features == modules[0].in_features
        for m in modules)


def separate(fns: list[Callable[[torch.Tensor], torch.Tensor]]) -> Group:
    """``x -> [fn(x) for fn in fns]``: one call per projection."""
    return lambda x: [fn(x) for fn in fns]


def group(modules: list[nn.Module], fns: list[Callable[[torch.Tensor], torch.Tensor]]) -> Group:
    """``x -> [y_i]`` for projections that read the same x: one native call when :func:`fusable`, else
    :func:`separate` over ``fns`` (each member's own call, as the decode loop makes it)."""
    one_each = separate(fns)
    if not fusable(modules):
        return one_each
    rt = modules[0].runtime
    weights = [(m.qweight, m.group_size, m.scales_and_zeros, m.bias) for m in modules]

    def call(x: torch.Tensor) -> list[torch.Tensor]:
        # rt.native is read per call: benchmarks and tests switch a loaded model to aten's op by clearing it
        if rt.native is None or x.shape[0] > MAX_ROWS or x.shape[0] >= rt.prefill_threshold:
            return one_each(x)
        rt.counts[rt.decode_path] += len(weights)
        return rt.native.int4_mm_multi(x, weights)

    return call

