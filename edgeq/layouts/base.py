"""The Layout interface and its registry: what every packed format must say about itself, keyed by :class:`Kernel`.

A layout is the bytes one kernel reads. Everything above this package (the planner, the converter, inspect, the
loader, the vLLM plugin) asks the registry instead of branching on the kernel name::

    from edgeq.layouts.base import get
    lay = get(manifest.kernel)                    # Kernel.W4A16 -> the tinygemm layout
    lay.out_tensors("model.layers.0.mlp.up_proj", 8960, 1536, 128)
    # [('...up_proj.qweight', 'U8', (8960, 768)), ('...up_proj.scales_and_zeros', 'BF16', (12, 8960, 2))]
    lay.nbytes(8960, 1536, 128)                   # 6,881,280 + 430,080 = 7,311,360

Adding a layout: one new module in edgeq/layouts/ that defines ``LAYOUT`` (an object with every member of
:class:`Layout`), one :class:`edgeq.keys.Kernel` member, and the compute module in edgeq/runtime/ that
``runtime_class`` names; :func:`get` discovers the layout. The planner, the loader's record check and swap,
``edgeq inspect`` (shapes, record, round trip, memory, its report line), the model card and the vLLM plugin then
know the new format; none of them branches on a kernel. (Writing it also takes a packer in edgeq/convert/packers.py
until pack and verify live here.) The W4A8 layout (edgeq/layouts/w4a8.py) is the worked
example in docs/architecture.md.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from edgeq.errors import EdgeqError
from edgeq.keys import Kernel

TensorSpec = tuple[str, str, tuple[int, ...]]  # (tensor name, safetensors dtype code, shape)


class StoredHeader(Protocol):
    """What a layout reads of one stored tensor's header (:class:`edgeq.io.safetensors.TensorInfo` is one)."""

    dtype: str  # safetensors dtype code, e.g. "U8"
    shape: Sequence[int]


@dataclass(frozen=True)
class StoredShape:
    """A quantised module's logical [N, K] read back from its stored tensors' headers (:meth:`Layout.logical_shape`),
    and what is wrong with those tensors. ``n`` and ``k`` are None when the headers cannot tell them (``problems``
    then says why, naming the tensor)."""

    n: int | None
    k: int | None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class RecordCheck:
    """A stored layout record against what this edgeq on this machine reads (:meth:`Layout.check_record`).

    ``on_load`` says what load does when the record alone decides it ("zero-copy: ...", "refused: ..."). ``differs``
    is set instead when the record is readable but another machine's (a measured layout): it says what differs, and
    load repacks such a checkpoint in memory (or refuses it under ``--strict-layout``)."""

    stored: dict  # the record as reported (what the fingerprint holds; tinygemm: without its permutations)
    machine: dict | None  # this machine's / this edgeq's record; None when it cannot be told
    matches: bool
    on_load: str = ""
    differs: str | None = None
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@runtime_checkable
class Layout(Protocol):
    """One packed format. Shapes are the logical weight's [N, K] (out, in features) and its group size G.

    A layout holds facts about bytes only: it imports nothing above edgeq/layouts/ (no runtime, no consumer). What
    computes with the bytes is named by a string (``runtime_class``, ``runtime_choice``) and imported only by the
    runtime and the consumers."""

    kernel: Kernel
    group_sizes: tuple[int, ...]  # the G the kernel accepts
    suffixes: tuple[str, ...]  # what one quantised module ``M`` writes: M<suffix>, in write order; the first is the
    # packed weight itself (the one a layout repack rewrites)
    optional_suffixes: tuple[str, ...]  # what M may store besides (tinygemm: ".perm", act-order input), used in place
    summary: str  # one line for model cards and inspect, e.g. "4-bit weights, bf16 activations (W4A16)"
    runtime_class: str  # "module:Class" of the nn.Module the loader swaps in; the class has a classmethod
    # ``swap_in(model, files, info, counts, *, strict_layout=False) -> SwapResult`` (edgeq/runtime/swap.py calls it)
    runtime_choice: str | None  # "module:function" the runtime calls with G to choose the one compute path every M
    # runs (returns an object with ``.path`` and ``.reason``); None when the path depends on M (tinygemm: kernel
    # below the crossover, dequantise + GEMM above)
    measured: bool  # the packing is measured on each machine, so a record may be another machine's: load repacks
    # it (False: the layout is fixed by the kernel's source, and any other record is refused)
    per_module_groups: bool  # the kernel takes G per module (a manifest's group_sizes apply), else one G per checkpoint

    def out_tensors(self, module: str, n: int, k: int, group_size: int, perm: bool = False) -> list[TensorSpec]:
        """(name, dtype code, shape) of every tensor module ``module`` [N, K] is stored as, in write order."""

    def nbytes(self, n: int, k: int, group_size: int, perm: bool = False) -> int:
        """Bytes on disk (and mapped at run time) of one quantised [N, K] weight: the sum of :meth:`out_tensors`."""

    def rule(self, n: int, k: int, group_size: int) -> str | None:
        """Why [N, K] at group size G cannot be packed (with the numbers and the fix), or None when it can."""

    def read_record(self, stored: Any, config_copy: Any, group_size: int, directory: Any) -> Any:
        """The layout record the runtime loads with: the manifest's ``stored`` checked (and parsed) together with
        config.json's copy ``config_copy`` for a checkpoint of group size ``group_size``; an :class:`EdgeqError`
        naming ``directory``, the file and the field otherwise (the refusal load prints)."""

    def parse_record(self, stored: dict) -> Any:
        """The manifest's record in the form :meth:`roundtrip` and :meth:`config_problem` take (tinygemm: a parsed,
        hash-checked ``TinygemmLayout``); an :class:`EdgeqError` saying why when it is malformed."""

    def check_record(self, stored: dict, group_size: int | None, rows: Sequence[tuple[str, int]]) -> RecordCheck:
        """The manifest's record against this machine's (or this edgeq's) for a checkpoint of group size
        ``group_size`` whose quantised modules have ``rows`` = (name, N): what load does with it, and its problems."""

    def config_problem(self, config_copy: Any, record: Any) -> str | None:
        """Why config.json's copy of the record (``quantization_config.layout``) is not the manifest's parsed
        ``record`` (load refuses such a checkpoint), or None."""

    def logical_shape(self, module: str, tensors: Mapping[str, StoredHeader], group_size: int | None) -> StoredShape:
        """[N, K] of quantised module ``module`` read back from the headers of its stored tensors (``tensors``: the
        checkpoint's, by name), each checked against :meth:`out_tensors` as the runtime checks it."""

    def roundtrip(self, module: str, read: Callable[[str], Any], n: int, k: int, group_size: int,
                  record: Any) -> str | None:
        """Unpack module ``module``'s stored bytes (``read(suffix)`` reads tensor M<suffix>) and pack them again with
        the parsed ``record``: None when that gives back the stored bytes exactly, else what differs."""

    def scratch(self, modules: Iterable[tuple[str, int, int]]) -> tuple[str, int]:
        """(what, bytes) of the scratch the runtime allocates at load for quantised modules (name, N, K): the memory
        projection's (:mod:`edgeq.memory`)."""

    def describe(self, stored: dict, matches: bool) -> tuple[str, str]:
        """For inspect's layout line: (what the stored record says, the verdict on it) given whether it matches."""


def stored_mismatches(layout: Layout, module: str, tensors: Mapping[str, StoredHeader], n: int, k: int,
                      group_size: int) -> list[str]:
    """Each of module ``module``'s stored tensors after the first (whose shape gave N and K) that is not the
    ``out_tensors`` dtype and shape for [N, K] at G, or whose K is not a multiple of G: kernels do not check these
    and would read out of bounds. E.g. a tinygemm [256, 128] at G = 32 needs ``M.scales_and_zeros`` BF16 [4, 256, 2]."""
    problems = []
    for name, code, shape in layout.out_tensors(module, n, k, group_size)[1:]:
        got = tensors[name]
        if k % group_size or got.dtype != code or list(got.shape) != list(shape):
            problems.append(f"{name}: expected {code} {list(shape)} for N={n}, K={k}, G={group_size}; got {got.dtype} "
                            f"{list(got.shape)} (the kernel does not check this and would read out of bounds)")
    return problems


def _discover() -> dict[Kernel, Layout]:
    import edgeq.layouts as package  # noqa: PLC0415

    found: dict[Kernel, Layout] = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name == "base":
            continue
        layout = getattr(importlib.import_module(f"edgeq.layouts.{info.name}"), "LAYOUT", None)
        if layout is not None:
            found[Kernel(layout.kernel)] = layout
    return found


_REGISTRY: dict[Kernel, Layout] = {}


def registry() -> dict[Kernel, Layout]:
    """Every layout edgeq knows, by kernel (imported once, on first use)."""
    if not _REGISTRY:
        _REGISTRY.update(_discover())
    return _REGISTRY


def get(kernel: str | Kernel) -> Layout:
    """The layout of ``kernel`` (a :class:`Kernel` or its string, as read from a manifest); an :class:`EdgeqError`
    naming the known kernels otherwise."""
    try:
        return registry()[Kernel(kernel)]
    except (ValueError, KeyError):
        known = ", ".join(k.value for k in Kernel)
        raise EdgeqError(f"unknown kernel {str(kernel)!r} (known: {known}); re-quantise or upgrade edgeq") from None
