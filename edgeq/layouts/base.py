"""The Layout interface and its registry: what every packed format must say about itself, keyed by :class:`Kernel`.

A layout is the bytes one kernel reads. Everything above this package (the planner, the converter, inspect, the
loader, the vLLM plugin) asks the registry instead of branching on the kernel name::

    from edgeq.layouts import get
    lay = get(manifest.kernel)                    # Kernel.W4A16 -> the tinygemm layout
    lay.out_tensors("model.layers.0.mlp.up_proj", 8960, 1536, 128)
    # [('...up_proj.qweight', 'U8', (8960, 768)), ('...up_proj.scales_and_zeros', 'BF16', (12, 8960, 2))]
    lay.nbytes(8960, 1536, 128)                   # 6,881,280 + 430,080 = 7,311,360

Adding a layout: one new module in edgeq/layouts/ that defines ``LAYOUT`` (an object with the members below) and one
:class:`edgeq.keys.Kernel` member; :func:`get` discovers it. The W4A8 layout (edgeq/layouts/w4a8.py) is the worked
example in docs/architecture.md.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Protocol, runtime_checkable

from edgeq.errors import EdgeqError
from edgeq.keys import Kernel

TensorSpec = tuple[str, str, tuple[int, ...]]  # (tensor name, safetensors dtype code, shape)


@runtime_checkable
class Layout(Protocol):
    """One packed format. Shapes are the logical weight's [N, K] (out, in features) and its group size G."""

    kernel: Kernel
    group_sizes: tuple[int, ...]  # the G the kernel accepts
    suffixes: tuple[str, ...]  # what one quantised module ``M`` writes: M<suffix>, in write order
    summary: str  # one line for model cards and inspect, e.g. "4-bit weights, bf16 activations (W4A16)"
    runtime_class: str  # "module:Class" of the nn.Module the loader swaps in (imported only by the runtime)

    def out_tensors(self, module: str, n: int, k: int, group_size: int, perm: bool = False) -> list[TensorSpec]:
        """(name, dtype code, shape) of every tensor module ``module`` [N, K] is stored as, in write order."""

    def nbytes(self, n: int, k: int, group_size: int, perm: bool = False) -> int:
        """Bytes on disk (and mapped at run time) of one quantised [N, K] weight: the sum of :meth:`out_tensors`."""

    def rule(self, n: int, k: int, group_size: int) -> str | None:
        """Why [N, K] at group size G cannot be packed (with the numbers and the fix), or None when it can."""


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
