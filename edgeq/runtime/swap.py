"""Swapping an edgeq checkpoint's quantised modules into a model: one function and one result for every kernel.

:func:`swap` asks the kernel's layout for its runtime class (``edgeq.layouts.base.get(kernel).runtime_class``, e.g.
``edgeq.runtime.qlinear:Int4Linear``), whose ``swap_in`` classmethod replaces every quantised ``nn.Linear`` the
manifest lists with itself over the mapped packed bytes and says what it did in a :class:`SwapResult`. A repack in
memory (a W4A16 checkpoint packed for another machine's layout) is one :class:`LayoutRepackWarning`.
:func:`finish` then sizes what needs every module in place: a runtime with two compute paths (W4A16: kernel below
the crossover M, dequantise + GEMM at and above it) gets its shared prefill scratch and its crossover; a one-path
runtime (W4A8) comes back unchanged. The loader and the transformers integration call exactly these two.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, replace

from torch import nn

from edgeq.errors import EdgeqError
from edgeq.io import skeleton
from edgeq.layouts.base import get
from edgeq.runtime.crossover import NEVER as NEVER_CROSSOVER
from edgeq.runtime.embedding import swap_embeddings


class LayoutRepackWarning(UserWarning):
    """The checkpoint was packed for another kernel layout and was repacked in memory at load."""


@dataclass(frozen=True)
class SwapResult:
    """What a swap did and which compute paths run, read back from what it built."""

    scheme: str
    consumed: frozenset[str]  # checkpoint tensors the quantised modules hold (not attached again)
    mapped_bytes: int  # quantised-module bytes used in place from the mapped files
    copied_bytes: int  # bytes materialised in anonymous memory (a layout repack, a non-bf16 bias)
    layout: str  # "native" | "repacked"
    layout_hash: str  # the layout the modules run on (after any repack)
    decode_path: str
    prefill_path: str
    note: str = ""  # why this path runs when a choice was made (W4A8: the compiled kernel found, or why not)
    compute: str = ""  # what computes it (W4A8: "compiled: <source>" or the portable path's backend)
    warning: str = ""  # the LayoutRepackWarning text, when the swap repacked
    runtime: object | None = None  # shared state of a two-path runtime (qlinear.Runtime); None for one path
    prefill_crossover: int | None = None  # set by finish() for a two-path runtime
    crossover_source: str = "n/a"  # "override" | "measured" | "cached" | "n/a"
    scratch_bytes: int = 0
    embeddings: str = "bf16"  # "bf16" (the mapped table) or the packed levels: "packed 4-bit (head g32 + ...)"
    head_levels: int = 1  # 2: the head also sums the packed table's residual level (manifest head.levels)

    @property
    def kernel_paths(self) -> tuple[tuple[str, str], ...]:
        """(scheme, "decode path + prefill path"): one path for all M, or both around the crossover."""
        x = self.prefill_crossover
        if x is None:
            return ((self.scheme, f"{self.decode_path} (all M)"),)
        if x >= NEVER_CROSSOVER:
            return ((self.scheme, f"{self.decode_path} (all M; {self.prefill_path} never)"),)
        return ((self.scheme, f"{self.decode_path} (M < {x}) + {self.prefill_path} (M >= {x})"),)


def runtime_class(kernel) -> type:
    """The nn.Module class the runtime swaps in for ``kernel`` (its layout's ``runtime_class``, "module:Class")."""
    module, _, name = get(kernel).runtime_class.partition(":")
    return getattr(importlib.import_module(module), name)


def swap(model: nn.Module, files, info, counts, strict_layout: bool = False, stacklevel: int = 1) -> SwapResult:
    """Replace every quantised Linear of ``model`` (meta or real) listed in ``info`` (:class:`edgeq.runtime.qinfo.
    QuantInfo`) by the kernel's module over ``files`` (:class:`edgeq.io.mapped.MappedFiles`); calls are counted in
    ``counts``. ``strict_layout`` refuses a checkpoint that would need a repack in memory. A repack warns once,
    attributed ``stacklevel`` frames above this function's caller (1: the caller). A packed input embedding (manifest
    ``embeddings``) becomes a :class:`edgeq.runtime.embedding.PackedEmbedding` over the level tensors, after the head
    (a tied table's level 0 is the head's module)."""
    result = runtime_class(info.kernel).swap_in(model, files, info, counts, strict_layout=strict_layout)
    result = swap_embeddings(model, files, info, result)
    if result.warning:
        warnings.warn(result.warning, LayoutRepackWarning, stacklevel=stacklevel + 1)
    return result


def finish(result: SwapResult, model: nn.Module, info, override: int | None = None) -> SwapResult:
    """After every module is in place: a two-path runtime's prefill scratch and crossover (``override`` fixes it;
    else measured, or read from the cache, on the largest non-head layer); its call counts start at zero."""
    rt = result.runtime
    if rt is None:
        return result
    quantized = [m for m in model.modules() if getattr(m, "edgeq_quantized", False)]
    xover, source = rt.prepare(quantized, info.head_name, override)
    return replace(result, prefill_crossover=xover, crossover_source=source, scratch_bytes=rt.scratch.nbytes)


def packed_shape_error(name: str, nk: tuple[int, int], old: nn.Linear) -> str | None:
    """None when a packed weight of ``(N, K)`` fits the Linear ``old`` that config.json builds; else why not."""
    if tuple(nk) == (old.out_features, old.in_features):
        return None
    return f"{name}: packed weight is [{nk[0]}, {nk[1]}] but config.json implies [{old.out_features}, {old.in_features}]"


def config_mismatches(model: nn.Module, shapes: dict[str, tuple[int, ...]], quantized: dict[str, tuple[int, int]]) -> list[str]:
    """What load refuses when config.json contradicts the tensors: for each quantised module ``(N, K)`` against the
    Linear the config builds (:func:`packed_shape_error`), for each other stored tensor its shape against the
    parameter or buffer of that name. ``model`` is the meta model of config.json; headers only, nothing read."""
    problems = []
    for name, nk in quantized.items():
        try:
            problem = packed_shape_error(name, nk, skeleton.quantized_target(model, name))
        except EdgeqError as e:
            problem = str(e)
        if problem:
            problems.append(problem)
    expected = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    for name, shape in shapes.items():
        want = expected.get(name)
        if want is not None and tuple(shape) != want:
            problems.append(f"{name}: checkpoint shape {list(shape)} but config.json implies {list(want)}")
    return problems
