"""The vLLM plugin's per-process state and its one custom op (no vLLM import: importable, and testable, anywhere).

vLLM builds every layer of a model in each worker process; what the layers share lives here, never pickled with
the config: the W4A16 runtime (layout, kernel choice, scratch, prefill threshold), the W4A8 kernel choice, the
served modules by prefix, the heads (a tied packed embedding's level 0 is the head's tensors), and the repack tally
behind the one :class:`LayoutRepackWarning`. Every served layer's forward is the opaque op
``torch.ops.edgeq_vllm.linear(x, prefix, bias)`` and every packed embedding's lookup the opaque op
``torch.ops.edgeq_vllm.embedding(ids, module)`` (one node each for vLLM's torch.compile), which run the runtime's
own modules (edgeq/integrations/vllm.py and vllm_embedding.py create them).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from edgeq import env
from edgeq.env import PREFILL_THRESHOLD
from edgeq.errors import EdgeqError
from edgeq.runtime import crossover, w4a8linear
from edgeq.runtime.qlinear import Int4Linear, Runtime, make_runtime


class Process:
    """What one vLLM worker process shares across layers: the W4A16 runtime (layout, kernel choice, scratch,
    threshold), the W4A8 kernel choice, the served modules by prefix, the head layers and packed embeddings, and the
    repack tally for the warning."""

    def __init__(self):
        self.lock = threading.Lock()
        self.runtime: Runtime | None = None
        self.w4a8_choice = None
        self.counts: Counter = Counter()
        self.served: dict[str, Served] = {}
        self.heads: dict[str, Any] = {}  # the vLLM head layers by prefix: their loaded qweight/scales_and_zeros
        self.embeddings: dict[str, Any] = {}  # the runtime's PackedEmbedding by embedding module
        self.created = self.processed = 0
        self.repacked = self.repacked_bytes = 0
        self.repack_seconds = 0.0

    def w4a16_runtime(self) -> Runtime:
        if self.runtime is None:
            self.runtime = make_runtime(self.counts)  # the loader's: this machine's layout, native kernel if it runs
            self.runtime.prefill_threshold = None  # set by threshold() before the first call
        return self.runtime

    def choice(self, group_size: int):
        if self.w4a8_choice is None:
            self.w4a8_choice = w4a8linear.choose_kernel(group_size)
        return self.w4a8_choice


STATE = Process()


@dataclass
class Served:
    """One served layer: the runtime module over its parameters, and the output width vLLM expects (the padded
    vocabulary slice for the head; the kernel computes ``n`` rows, the rest are zeros)."""

    module: Any
    n_out: int
    head: bool
    residuals: tuple[str, ...] = ()  # --head-levels 2: the packed embedding levels the head adds (attached at first use)


def attach_residuals(served: Served) -> None:
    """Give a two-level head its residual levels: Int4Linear modules over the packed embedding's loaded tensors of
    those levels (this rank's rows, the same as the head's; no copy), as edgeq.runtime.load does. At the head's first
    call, when every layer has loaded (the head and the embedding load in either order)."""
    levels = {lv.module: lv for emb in STATE.embeddings.values() for lv in emb.levels}
    head = served.module
    built = []
    for name in served.residuals:
        lv = levels.get(name)
        if lv is None or lv.qweight.shape[0] != head.out_features:
            raise EdgeqError(f"{name}: the head adds this level but this vLLM process holds "
                             f"{'no such level' if lv is None else f'{lv.qweight.shape[0]} of its rows, not {head.out_features}'}; "
                             "serve it with pipeline_parallel_size 1, or re-quantise with --head-levels 1")
        built.append(Int4Linear(name, lv.qweight, lv.scales_and_zeros, lv.group_size, None, head.runtime))
    head.residual_levels = tuple(built)


def threshold(rt: Runtime) -> int:
    """The W4A16 prefill crossover: ``$EDGEQ_PREFILL_THRESHOLD``, else measured (and cached) on the largest
    non-head layer of this process, as :func:`edgeq.runtime.load` does."""
    if rt.prefill_threshold is None:
        fixed = env.positive_int(PREFILL_THRESHOLD, "1 = always dequantise")
        if fixed is not None:
            rt.prefill_threshold = fixed
        else:
            body = [s.module for s in STATE.served.values() if isinstance(s.module, Int4Linear) and not s.head]
            layer = max(body or [s.module for s in STATE.served.values()], key=lambda m: m.out_features * m.in_features)
            rt.prefill_threshold = crossover.crossover(layer, rt.decode_path)[0]
            rt.counts.clear()
    return rt.prefill_threshold


@torch.library.custom_op("edgeq_vllm::linear", mutates_args=())
def linear(x: torch.Tensor, key: str, bias: torch.Tensor | None) -> torch.Tensor:
    """y [..., n_out] for the served layer ``key`` (its prefix): opaque to torch.compile."""
    served = STATE.served[key]
    m = served.module
    if served.residuals and not m.residual_levels:
        with STATE.lock:
            attach_residuals(served)
    if isinstance(m, Int4Linear):
        threshold(m.runtime)
    m.bias = bias  # vLLM passes the layer's bias (None with skip_bias_add); the module adds it as the runtime does
    y = m.forward(x)
    if served.n_out > m.out_features:
        y = torch.nn.functional.pad(y, (0, served.n_out - m.out_features))
    return y


@linear.register_fake
def _linear_shape(x: torch.Tensor, key: str, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], STATE.served[key].n_out)


@torch.library.custom_op("edgeq_vllm::embedding", mutates_args=())
def embedding(ids: torch.Tensor, key: str) -> torch.Tensor:
    """bf16 [..., K]: the rows ``ids`` (int64, this rank's local ids) of the packed embedding ``key`` (its module),
    decoded by the runtime's :class:`~edgeq.runtime.embedding.PackedEmbedding`: opaque to torch.compile."""
    return STATE.embeddings[key](ids)


@embedding.register_fake
def _embedding_shape(ids: torch.Tensor, key: str) -> torch.Tensor:
    return ids.new_empty(*ids.shape, STATE.embeddings[key].embedding_dim, dtype=torch.bfloat16)
