"""vLLM's ``VocabParallelEmbedding`` over a packed (4-bit) input embedding: the plugin's embedding method.

An edgeq checkpoint with a packed ``embeddings`` entry in its manifest (docs/format.md, format_version 2) stores no
bf16 table: the table is the sum of 4-bit *levels* in the checkpoint's tinygemm layout. A tied model's level 0 is the
head's own ``lm_head.qweight`` / ``lm_head.scales_and_zeros`` and level 1 the residual ``model.embed_tokens.*``; an
untied model stores both (``model.embed_tokens.*`` and ``model.embed_tokens.residual.*``). For token rows r::

    D_l[r, k] = (float32(q_l[r, k]) - 8) * float32(scale_l[k // G_l, r]) + float32(zero_l[k // G_l, r])
    E[r, k]   = bfloat16(D_0[r, k] + D_1[r, k])

computed by the runtime's own :class:`~edgeq.runtime.embedding.PackedEmbedding` (the same function
``edgeq.runtime.load`` uses, so both read the same E bit for bit), inside the opaque op
``torch.ops.edgeq_vllm.embedding`` (edgeq/integrations/vllm_state.py).

vLLM's side:

- the quant config gives the ``VocabParallelEmbedding`` this method (:func:`spec_for`: by the layer's prefix; vLLM's
  Llama builds its embedding without one, which names the checkpoint's only packed embedding);
- a level with its own tensors gets parameters with the stored names, dtypes and shapes (``qweight`` uint8
  [V_rank, K/2], ``scales_and_zeros`` bf16 [K/G, V_rank, 2]) on the embedding layer, or on a child module for
  ``model.embed_tokens.residual``; they load exactly as the head's do (``EdgeqConfig.level_method``): this rank's
  vocabulary rows ``[org_vocab_start, org_vocab_end)`` copied in as stored bytes (repacked only for a foreign
  layout), the padding to vLLM's multiple of 64 rows left zero and never read;
- a tied level 0 is the head layer's loaded parameters (no second copy): vLLM ties ``lm_head`` to ``embed_tokens``
  for ``tie_word_embeddings`` models, and the plugin's ``tie_weights`` keeps the head its own quantised layer; the
  head and the embedding split the (identically padded) vocabulary the same way, so each rank's head rows are its
  embedding rows;
- tensor parallel: each rank decodes its own vocabulary slice from vLLM's masked local ids; vLLM zeroes the ids
  other ranks own and sums the ranks' rows in its all-reduce (one non-zero term per row: exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from edgeq.errors import EdgeqError
from edgeq.integrations import vllm_state as state
from edgeq.keys import MANIFEST
from edgeq.runtime.embedding import EmbeddingLevel, PackedEmbedding, entries

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase


@dataclass(frozen=True)
class Level:
    """One level of a packed embedding: the checkpoint module holding its tensors and its group size."""

    module: str
    group_size: int


@dataclass(frozen=True)
class PackedSpec:
    """A packed input embedding as the manifest records it (picklable: it travels in the config to the workers)."""

    module: str  # the embedding module, e.g. "model.embed_tokens"
    levels: tuple[Level, ...]  # summed in this order
    head: str  # the head module: a level naming it is the head's own tensors

    def holder(self, level: Level) -> str | None:
        """Where a level's own parameters live, relative to the embedding layer: "" (the layer itself), a child
        path ("residual"), or None for the head's tensors (read from the head layer)."""
        if level.module == self.head:
            return None
        if level.module == self.module:
            return ""
        return level.module.removeprefix(self.module + ".")


def packed_specs(info, directory: Path) -> dict[str, PackedSpec]:
    """The checkpoint's packed embeddings by module (:func:`edgeq.runtime.embedding.entries`; the manifest reader
    validated their records and refuses them in a W4A8 checkpoint), refused unless the plugin can hold every level:
    each level module is the head, the embedding or a module below it (its parameters live on the embedding layer)."""
    specs = {}
    for name in entries(info):
        levels = tuple(Level(m, g) for m, g in info.manifest.embedding_levels(name))
        for i, level in enumerate(levels):
            if level.module not in (info.head_name, name) and not level.module.startswith(name + "."):
                raise EdgeqError(f"{directory}/{MANIFEST}: embeddings[{name!r}].levels[{i}] is {level.module!r}; the "
                                 f"vLLM plugin reads levels held by the head {info.head_name}, by {name} or by a "
                                 "module below it; re-quantise with --embeddings bf16 to serve it on vLLM")
        specs[name] = PackedSpec(name, levels, info.head_name)
    return specs


def spec_for(specs: dict[str, PackedSpec], prefix: str) -> PackedSpec | None:
    """The packed embedding a ``VocabParallelEmbedding`` built with ``prefix`` serves, or None (vLLM's own bf16
    method). vLLM's Llama passes no prefix: an empty one names the checkpoint's only packed embedding."""
    if prefix in specs:
        return specs[prefix]
    return next(iter(specs.values())) if prefix == "" and len(specs) == 1 else None


def _holder(layer: nn.Module, path: str) -> nn.Module:
    """The module at ``path`` below ``layer`` ("" is the layer), created empty where missing."""
    module = layer
    for part in filter(None, path.split(".")):
        if not hasattr(module, part):
            module.register_module(part, nn.Module())
        module = getattr(module, part)
    return module


class EdgeqEmbeddingMethod(QuantizeMethodBase):
    """A ``VocabParallelEmbedding`` over a packed embedding's levels: ``embedding(layer, ids)`` is E for those ids."""

    def __init__(self, config, spec: PackedSpec):
        self.config = config  # an EdgeqConfig (edgeq/integrations/vllm.py): level_method, layer_done
        self.spec = spec

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        for level in self.spec.levels:
            path = self.spec.holder(level)
            if path is not None:
                self.config.level_method(level.module, level.group_size).add_params(
                    layer, _holder(layer, path), input_size, input_size_per_partition, output_partition_sizes)
        layer.edgeq_key = self.spec.module
        with state.STATE.lock:
            state.STATE.created += 1

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise EdgeqError(f"{self.spec.module}: a packed embedding is looked up by token id, never multiplied (the head "
                         f"{self.spec.head} is its own quantised layer)")

    def embedding(self, layer, input_: torch.Tensor) -> torch.Tensor:
        return torch.ops.edgeq_vllm.embedding(input_, layer.edgeq_key)

    def process_weights_after_loading(self, layer) -> None:
        """The runtime's PackedEmbedding over this rank's real rows of every level (the padding excluded)."""
        s = layer.shard_indices
        n = s.org_vocab_end_index - s.org_vocab_start_index
        layout = state.STATE.w4a16_runtime().layout  # every level was loaded in (or repacked to) this machine's layout
        levels = []
        for level in self.spec.levels:
            path = self.spec.holder(level)
            src = self._head(layer, level) if path is None else _holder(layer, path)
            levels.append(EmbeddingLevel(level.module, src.qweight.data[:n], src.scales_and_zeros.data[:, :n],
                                         level.group_size, layout, shared=path is None))
        with state.STATE.lock:
            state.STATE.embeddings[self.spec.module] = PackedEmbedding(self.spec.module, tuple(levels))
        self.config.layer_done()

    def _head(self, layer, level: Level):
        """The head layer whose loaded tensors are ``level`` (a tied level 0), checked to hold this rank's rows."""
        head = state.STATE.heads.get(level.module)
        if head is None:
            raise EdgeqError(f"{self.spec.module}: its level {level.module} is the head's packed tensors, which this "
                             "vLLM process does not hold (a pipeline stage without the head); serve it with "
                             "pipeline_parallel_size 1, or re-quantise with --embeddings bf16")
        ours, theirs = layer.shard_indices, head.shard_indices
        if (ours.org_vocab_start_index, ours.org_vocab_end_index, layer.embedding_dim) != (
                theirs.org_vocab_start_index, theirs.org_vocab_end_index, head.embedding_dim):
            raise EdgeqError(f"{self.spec.module}: vocabulary rows {ours.org_vocab_start_index}..{ours.org_vocab_end_index}"
                             f" x {layer.embedding_dim} on this rank, but the head {level.module} holds "
                             f"{theirs.org_vocab_start_index}..{theirs.org_vocab_end_index} x {head.embedding_dim}; "
                             "the checkpoint does not match config.json")
        return head
