"""vLLM's CPU engine serving edgeq checkpoints: the ``edgeq`` quantization method (a vLLM plugin). docs/vllm.md.

``pip install "edgeq[vllm]"`` declares the ``vllm.general_plugins`` entry point :func:`register`; vLLM calls it in
every process it starts, which registers :class:`EdgeqConfig` under ``quant_method: "edgeq"``. Then
``python -m vllm.entrypoints.openai.api_server --model OUT --dtype bfloat16`` (or ``LLM(model=OUT)``) reads an edgeq
checkpoint with no code in vLLM:

- :class:`EdgeqConfig` validates the checkpoint exactly as :func:`edgeq.runtime.load` does (config.json + manifest,
  through the same readers) and compares the stored layout fingerprint with this machine's: a W4A16 checkpoint
  packed for another layout is repacked in memory with the runtime's :class:`LayoutRepackWarning`, or refused with
  the runtime's message when ``EDGEQ_STRICT_LAYOUT=1`` (the CLI's ``--strict-layout``).
- :class:`EdgeqLinearMethod` serves every quantised Linear *and* the output head (``ParallelLMHead`` takes a quant
  method; a tied head stays its own quantised layer). A packed input embedding (manifest ``embeddings``) is served by
  :class:`~edgeq.integrations.vllm_embedding.EdgeqEmbeddingMethod`; a bf16 one, and the norms, stay vLLM's, over the
  stored bf16 tensors. Parameters have the stored names, shapes
  and dtypes (``qweight`` + ``scales_and_zeros`` for ``tinygemm_w4a16``; ``qweight`` + ``scales`` + ``zeros`` for
  ``amx_w4a8``), each rank's slice copied in once as stored bytes (no bf16 copy; no repack unless the layout
  differs). The compute is the runtime's own modules over those parameters: :class:`~edgeq.runtime.qlinear.
  Int4Linear` (edgeq's native kernel or aten's below the prefill crossover, dequantise + GEMM at and above it) and
  :class:`~edgeq.runtime.w4a8linear.W4A8Linear` (edgeq's native W4A8 op or the portable path), wrapped in one
  opaque torch custom op so that vLLM's torch.compile sees a single node.
- Tensor parallel: column-parallel layers (fused QKV, gate/up, the head) split N on whole layout blocks,
  row-parallel layers split K on whole groups (:mod:`edgeq.integrations.vllm_slices`); anything else is one error
  naming the layer, its shape and the sizes that work.

Environment: ``EDGEQ_STRICT_LAYOUT=1`` refuses a foreign layout; ``EDGEQ_PREFILL_THRESHOLD=M`` fixes the W4A16
crossover (default: measured once per process on the largest non-head layer, as the runtime does, and cached).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import Parameter

from edgeq import env
from edgeq.env import STRICT_LAYOUT
from edgeq.errors import EdgeqError
from edgeq.integrations import vllm_embedding as packed_embedding
from edgeq.integrations import vllm_slices as cuts
from edgeq.integrations import vllm_state as state  # the per-process state and the edgeq_vllm::linear op
from edgeq.layouts import tinygemm
from edgeq.layouts import w4a8 as w4a8_layout
from edgeq.io.manifest import read_json
from edgeq.io.mapped import MappedFiles
from edgeq.io.safetensors import DTYPES
from edgeq.keys import CONFIG, MANIFEST
from edgeq.layouts.base import get
from edgeq.runtime.preflight import preflight
from edgeq.runtime.qinfo import KERNELS, QuantInfo, read_checkpoint
from edgeq.runtime import w4a8linear
from edgeq.runtime.qlinear import Int4Linear, Scratch, layout_refusal, repack_warning
from edgeq.runtime.swap import LayoutRepackWarning

from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.utils import set_weight_attrs

NAME = "edgeq"
W4A16, W4A8 = tinygemm.KERNEL, w4a8_layout.KERNEL


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Importing this module registered the config; nothing else to do."""


def _checkpoint_dir(model: str, revision: str | None) -> Path:
    """The local directory of ``model`` (a path, or a hub id already in the local cache)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download  # noqa: PLC0415

    return Path(snapshot_download(model, revision=revision, allow_patterns=["config.json", MANIFEST]))


# --- the config ----------------------------------------------------------------------------------------------------


@register_quantization_config(NAME)
class EdgeqConfig(QuantizationConfig):
    """``quant_method: "edgeq"``: config.json's quantization_config, completed by the checkpoint's manifest."""

    def __init__(self, qc: dict):
        super().__init__()
        self.qc = dict(qc)
        self.kernel = str(qc.get("kernel", W4A16))
        if self.kernel not in KERNELS:
            raise EdgeqError(f"quantization_config.kernel {self.kernel!r} is not one this edgeq serves ({', '.join(KERNELS)})")
        self.group_size = int(qc.get("group_size", 128))
        self.stored: tinygemm.TinygemmLayout | None = None  # the W4A16 checkpoint's layout (manifest)
        self.not_converted: frozenset[str] = frozenset()
        self.group_sizes: dict[str, int] = {}
        self.head_name = "lm_head"
        self.embeddings: dict[str, packed_embedding.PackedSpec] = {}  # packed input embeddings by module
        self.head_residuals: tuple[str, ...] = ()  # --head-levels 2: the embedding level modules the head adds

    def __repr__(self) -> str:
        return f"EdgeqConfig(kernel={self.kernel}, group_size={self.group_size})"

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]  # the kernels' activation type, as edgeq.runtime.load insists

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # a CPU method: no GPU capability needed (vLLM does not ask on CPU)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [MANIFEST]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "EdgeqConfig":
        return cls(config)

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Read and validate the checkpoint as the runtime does; check the layout fingerprint against this machine."""
        directory = _checkpoint_dir(model_name, revision)
        info = read_checkpoint(directory, read_json(directory / CONFIG))  # the runtime's reader, its refusals
        if info is None:
            raise EdgeqError(f"{directory}/config.json: no edgeq quantization_config")
        preflight(directory, MappedFiles(directory), info)  # here, not in the workers: the caller sees the line
        if _perm_modules(info):
            raise EdgeqError(f"{directory}: act-order layers (M.perm) are not served through vLLM by this edgeq; "
                             "re-quantise without --act-order, or serve it with `edgeq serve`")
        self.kernel, self.group_size = info.kernel, info.scheme.group_size
        self.group_sizes = dict(info.group_sizes)  # a recipe's per-module G
        self.not_converted = frozenset(name for name, _ in info.modules_not_converted)
        self.head_name = info.head_name
        self.embeddings = packed_embedding.packed_specs(info, directory)
        # --head-levels 2: the levels after the head's own; the manifest reader checked they are a packed table's
        # levels (edgeq.io.manifest._check_head_levels), which packed_specs just accepted
        self.head_residuals = tuple(m for m, _ in info.manifest.head_levels[1:])
        if isinstance(info.layout, tinygemm.TinygemmLayout):  # a measured layout: this machine's may differ
            self.stored = info.layout
            layout_check(info.layout, tinygemm.probe(), strict=env.flag(STRICT_LAYOUT))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, ParallelLMHead):
            return EdgeqLinearMethod(self, prefix)
        if isinstance(layer, VocabParallelEmbedding):
            spec = packed_embedding.spec_for(self.embeddings, prefix)
            return packed_embedding.EdgeqEmbeddingMethod(self, spec) if spec else None  # None: vLLM's, over bf16
        if not isinstance(layer, LinearBase):
            return None  # norms and everything else: vLLM's own methods over the stored bf16 tensors
        names = self._checkpoint_names(prefix)
        kept = [n for n in names if n in self.not_converted]
        if kept and len(kept) == len(names):
            return UnquantizedLinearMethod()
        if kept:
            raise EdgeqError(f"{prefix}: vLLM fuses {', '.join(names)} but the checkpoint kept only {', '.join(kept)} "
                             "in bf16; re-quantise with all or none of them kept")
        return EdgeqLinearMethod(self, prefix)

    def group_size_of(self, prefix: str) -> int:
        """The group size of the checkpoint modules a vLLM layer holds; fused shards must share one."""
        names = self._checkpoint_names(prefix)
        sizes = {n: self.group_sizes.get(n, self.group_size) for n in names}
        if len(set(sizes.values())) > 1:
            raise EdgeqError(f"{prefix}: vLLM fuses {', '.join(names)} into one layer but the checkpoint quantised them "
                             f"with different group sizes ({sizes}); re-quantise with one group size for all of them")
        return sizes[names[0]]

    def level_method(self, module: str, group_size: int) -> "EdgeqLinearMethod":
        """The method that creates and loads one packed embedding level's own tensors (``module``, quantised with
        ``group_size``) the way the head's are loaded: the vocabulary split of a ``VocabParallelEmbedding``."""
        return EdgeqLinearMethod(self, module, group_size)

    def layer_done(self) -> None:
        """One created layer processed after loading; after the last, the one repack warning (if any repacked)."""
        with state.STATE.lock:
            state.STATE.processed += 1
            done = state.STATE.processed == state.STATE.created
        if done and state.STATE.repacked:
            warnings.warn(repack_warning(self.stored, state.STATE.w4a16_runtime().layout, state.STATE.repacked,
                                         state.STATE.repack_seconds, state.STATE.repacked_bytes), LayoutRepackWarning,
                          stacklevel=3)

    def _checkpoint_names(self, prefix: str) -> list[str]:
        """The checkpoint modules a vLLM layer holds (``qkv_proj`` -> q/k/v_proj, via the model's mapping)."""
        head, _, last = prefix.rpartition(".")
        subs = self.packed_modules_mapping.get(last)
        return [f"{head}.{s}" if head else s for s in subs] if subs else [prefix]


def _perm_modules(info: QuantInfo) -> list:
    return list(info.manifest.extra.get("perm_modules") or [])


def layout_check(stored: tinygemm.TinygemmLayout, here: tinygemm.TinygemmLayout, *, strict: bool) -> bool:
    """True when the checkpoint must be repacked for ``here``; under ``strict`` a foreign layout is the runtime's
    refusal (:func:`edgeq.runtime.qlinear.layout_refusal`)."""
    foreign = not stored.is_compatible(here)
    if foreign and strict:
        raise EdgeqError(layout_refusal(stored, here, f"{STRICT_LAYOUT}=1"))
    return foreign


# --- the linear method ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Geometry:
    """Where this rank's part of a layer lies: global logical output sizes, the fused shard this rank's rows start
    at, and (row-parallel) its input range."""

    sizes: list[int]
    k: int
    k_range: tuple[int, int]
    row_parallel: bool
    tp: int
    rank: int


def _geometry(layer, input_size: int, k_local: int) -> _Geometry:
    if isinstance(layer, VocabParallelEmbedding):  # the head, or a packed input embedding's level
        tp, rank = layer.tp_size, layer.tp_rank
        return _Geometry([layer.num_embeddings_padded], input_size, (0, input_size), False, tp, rank)
    tp, rank = (1, 0) if isinstance(layer, ReplicatedLinear) else (layer.tp_size, layer.tp_rank)
    if isinstance(layer, RowParallelLinear):
        return _Geometry([layer.output_size], input_size, (rank * k_local, (rank + 1) * k_local), True, tp, rank)
    sizes = list(getattr(layer, "output_sizes", None) or [layer.output_size])
    return _Geometry(sizes, input_size, (0, input_size), False, tp, rank)


class EdgeqLinearMethod(LinearMethodBase):
    """One quantised layer (a Linear of any parallel kind, or the head) over the stored packed tensors."""

    def __init__(self, config: EdgeqConfig, prefix: str, group_size: int | None = None):
        self.config = config
        self.prefix = prefix
        self.group_size = group_size or config.group_size_of(prefix)

    # creation ------------------------------------------------------------------------------------------------------

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        self.add_params(layer, layer, input_size, input_size_per_partition, output_partition_sizes)
        layer.edgeq_key = self.prefix
        with state.STATE.lock:
            state.STATE.created += 1
            if isinstance(layer, ParallelLMHead):
                state.STATE.heads[self.prefix] = layer  # a tied packed embedding reads its level 0 here

    def add_params(self, layer, holder, input_size: int, input_size_per_partition: int,
                   output_partition_sizes: list[int]) -> None:
        """The stored tensors of this rank's part of ``layer`` as parameters of ``holder`` (``layer``, or the child
        module a packed embedding keeps a level in), each with the loader that copies its slice in."""
        geo = _geometry(layer, input_size, input_size_per_partition)
        cuts.check_split(self.prefix, geo.sizes, geo.k, geo.tp, row_parallel=geo.row_parallel, block_n=self._block_n(),
                         group_size=self.group_size)
        n, k = sum(output_partition_sizes), input_size_per_partition
        for name, shape, dtype in self._shapes(n, k):
            p = Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            holder.register_parameter(name, p)
            set_weight_attrs(p, {"weight_loader": self._loader(layer, name, geo, output_partition_sizes)})

    def tie_weights(self, layer, embed_tokens):
        """A tied model's head stays its own quantised layer (edgeq quantised it from the table): nothing is shared
        with ``embed_tokens``, whose bf16 ``weight`` (or packed levels, which read this head) stays its own."""
        return layer

    def _block_n(self) -> int:
        if self.config.kernel == W4A8:
            return cuts.W4A8_BLOCK_N
        here = tinygemm.probe().block_n
        return max(here, self.config.stored.block_n) if self.config.stored else here

    def _shapes(self, n: int, k: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The stored tensors of an [n, k] slice: the kernel's layout's own list (docs/format.md, docs/w4a8.md)."""
        specs = get(self.config.kernel).out_tensors("", n, k, self.group_size)
        return [(name.removeprefix("."), shape, DTYPES[code][0]) for name, code, shape in specs]

    # loading -------------------------------------------------------------------------------------------------------

    def _loader(self, layer, name: str, geo: _Geometry, partition_sizes: list[int]):
        def load(param: Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            self._load(layer, name, geo, partition_sizes, param, loaded, shard_id)
        return load

    def _rows(self, layer, geo: _Geometry, partition_sizes: list[int], shard_id) -> tuple[int, int, int, int]:
        """(destination row offset, source rows a..b, global rows of the source tensor) for one loaded tensor."""
        if isinstance(layer, VocabParallelEmbedding):  # the head or an embedding level: the vocabulary split
            s = layer.shard_indices
            return 0, s.org_vocab_start_index, s.org_vocab_end_index, layer.org_vocab_size
        if isinstance(layer, QKVParallelLinear) and shard_id in ("q", "k", "v"):
            size = layer._get_shard_size_mapping(shard_id)
            shard_rank = geo.rank if shard_id == "q" else geo.rank // layer.num_kv_head_replicas
            total = {"q": layer.total_num_heads * layer.head_size, "k": layer.total_num_kv_heads * layer.head_size,
                     "v": layer.total_num_kv_heads * layer.v_head_size}[shard_id]
            return layer._get_shard_offset_mapping(shard_id), shard_rank * size, (shard_rank + 1) * size, total
        if isinstance(layer, MergedColumnParallelLinear) and isinstance(shard_id, int):
            size = partition_sizes[shard_id]
            return sum(partition_sizes[:shard_id]), geo.rank * size, (geo.rank + 1) * size, geo.sizes[shard_id]
        if shard_id is not None or len(partition_sizes) > 1:
            raise EdgeqError(f"{self.prefix}: the checkpoint stores this fused layer as one tensor (shard {shard_id!r}); "
                             "the vLLM plugin reads fused layers from their separate modules only")
        if geo.row_parallel:
            return 0, 0, geo.sizes[0], geo.sizes[0]
        size = partition_sizes[0]
        return 0, geo.rank * size, (geo.rank + 1) * size, geo.sizes[0]

    def _load(self, layer, name: str, geo: _Geometry, partition_sizes, param, loaded, shard_id) -> None:
        off, a, b, n_src = self._rows(layer, geo, partition_sizes, shard_id)
        where = f"{self.prefix}.{name}" + (f" (shard {shard_id})" if shard_id is not None else "")
        if loaded.dtype != param.dtype or loaded.dim() != param.dim():
            raise EdgeqError(f"{where}: stored {loaded.dtype} {list(loaded.shape)}, expected {param.dtype} with "
                             f"{param.dim()} dims (docs/format.md); re-quantise the checkpoint")
        g, cols = self.group_size, geo.k_range
        rows = b - a
        if self.config.kernel == W4A8:
            got_n = loaded.shape[0] * cuts.W4A8_BLOCK_N
            self._check_source(where, got_n, n_src)
            dst = param.data[off // cuts.W4A8_BLOCK_N : (off + rows) // cuts.W4A8_BLOCK_N]
            dst.copy_(cuts.w4a8_cut(name, loaded, (a, b), cols, g))
        elif name == "scales_and_zeros":
            self._check_source(where, loaded.shape[1], n_src)
            param.data[:, off : off + rows].copy_(cuts.scales_and_zeros_cut(loaded, (a, b), cols, g))
        else:
            self._check_source(where, loaded.shape[0], n_src)
            self._load_qweight(param.data[off : off + rows], loaded, n_src, geo.k, (a, b), cols)

    def _check_source(self, where: str, got: int, want: int) -> None:
        if got != want:
            raise EdgeqError(f"{where}: the stored tensor has {got} output rows but config.json implies {want}; "
                             "the checkpoint does not match its config")

    def _load_qweight(self, dst, loaded, n: int, k: int, rows, cols) -> None:
        stored, rt = self.config.stored, state.STATE.w4a16_runtime()
        if stored is None or stored.is_compatible(rt.layout):
            cuts.copy_tinygemm(dst, loaded, n, k, rows, cols, stored or rt.layout)
            return
        t0 = time.perf_counter()
        dst.copy_(cuts.tinygemm_cut(loaded, n, k, rows, cols, stored, rt.layout))
        with state.STATE.lock:
            state.STATE.repacked += 1
            state.STATE.repacked_bytes += dst.numel()
            state.STATE.repack_seconds += time.perf_counter() - t0

    # after loading -------------------------------------------------------------------------------------------------

    def process_weights_after_loading(self, layer) -> None:
        head = isinstance(layer, ParallelLMHead)
        n_out = layer.qweight.shape[0] * (cuts.W4A8_BLOCK_N if self.config.kernel == W4A8 else 1)
        n = (layer.shard_indices.org_vocab_end_index - layer.shard_indices.org_vocab_start_index) if head else n_out
        module = self._module(layer, n)
        with state.STATE.lock:
            state.STATE.served[self.prefix] = state.Served(module, n_out, head,
                                                           self.config.head_residuals if head else ())
        self.config.layer_done()

    def _module(self, layer, n: int):
        """The runtime's module over this rank's parameters (the first ``n`` rows; the head's padding excluded)."""
        g = self.group_size
        if self.config.kernel == W4A8:
            nb = n // cuts.W4A8_BLOCK_N
            return w4a8linear.W4A8Linear(self.prefix, layer.qweight.data[:nb], layer.scales.data[:nb],
                                         layer.zeros.data[:nb], g, None, state.STATE.counts, state.STATE.choice(g))
        rt = state.STATE.w4a16_runtime()
        sz = layer.scales_and_zeros.data
        if n < sz.shape[1]:
            sz = sz[:, :n].contiguous()  # the kernel reads [K/G, n, 2] densely; only the head's padding is dropped
        module = Int4Linear(self.prefix, layer.qweight.data[:n], sz, g, None, rt)
        with state.STATE.lock:
            if rt.scratch is None or rt.scratch.elems < module.scratch_elems:
                rt.scratch = Scratch(module.scratch_elems)
        return module

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.edgeq_vllm.linear(x, layer.edgeq_key, bias)


