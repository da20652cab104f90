"""The per-kernel part of ``edgeq inspect``, and its registry keyed by :class:`edgeq.keys.Kernel`.

What every kernel's checkpoint shares (manifest, config, shards, tensor dtypes and shapes against the manifest, the
head, the shard digests, NaN/Inf) is checked once in edgeq/inspect/checks.py and verify.py. What differs is here:
how a module's logical [N, K] is read back from its packed shapes, what the stored layout record must be and what
load does with it, how bytes are unpacked and packed again, the memory load allocates, and the layout's line in
the human report. The expected dtypes and shapes themselves come from the layout registry
(:func:`edgeq.layouts.base.get`), so they cannot disagree with what the converter writes.

A new kernel adds one module here defining ``CHECKS`` (an object with the members below); :func:`get` finds it.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Optional, Protocol

from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.manifest import Manifest
from edgeq.keys import Kernel
from edgeq.memory import KVGeometry, MemoryProjection
from edgeq.inspect.schema import QModule


@dataclass(frozen=True)
class LayoutVerdict:
    """The stored layout record against what this edgeq on this machine reads, and what load will do with it."""

    stored: dict  # the manifest's record (tinygemm: without its permutations)
    machine: Optional[dict]  # this machine's / this edgeq's record; None when it cannot be told
    matches: bool
    on_load: str  # "zero-copy: ...", "repack: ...", "refused: ..."


class KernelChecks(Protocol):
    kernel: Kernel
    repacks_on_load: bool  # load rewrites a stored layout that is not this machine's (else it refuses it)

    def modules(self, ckpt: Checkpoint, manifest: Manifest, g: int | None, problems: list[str]) -> dict[str, QModule]:
        """Every module the manifest lists, its [N, K] from the packed shapes, checked as the runtime checks it."""

    def layout(self, ckpt: Checkpoint, manifest: Manifest, modules: dict[str, QModule], g: int | None,
               strict_layout: bool, problems: list[str], warnings: list[str]) -> LayoutVerdict:
        """The stored layout record against this machine's, and what load will do."""

    def config_layout_problem(self, record, manifest: Manifest) -> str | None:
        """Why config.json's copy of the layout record (``record``) is not the manifest's, or None."""

    def roundtrip(self, ckpt: Checkpoint, manifest: Manifest, modules: dict[str, QModule], picks: list[str],
                  problems: list[str]) -> list[str]:
        """The modules of ``picks`` whose stored bytes unpack and pack back to themselves (reads tensor data)."""

    def memory(self, ckpt: Checkpoint, modules: dict[str, QModule], geometry: KVGeometry, kv_cache_bytes: int,
               max_model_len: int | None, repack: bool) -> MemoryProjection:
        """What serving the checkpoint as stored costs (:func:`edgeq.memory.project`)."""

    def describe_layout(self, stored: dict, matches: bool) -> tuple[str, str]:
        """For the human report's layout line: (what the stored record says, the verdict on it)."""


def _discover() -> dict[Kernel, KernelChecks]:
    import edgeq.inspect.kernels as package  # noqa: PLC0415 - this package's own modules, found on first use

    names = (f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__))
    checks = (getattr(importlib.import_module(name), "CHECKS", None) for name in names)
    return {Kernel(c.kernel): c for c in checks if c is not None}


_REGISTRY: dict[Kernel, KernelChecks] = {}


def get(kernel: str | Kernel) -> KernelChecks:
    """The inspect checks of ``kernel`` (a manifest's, so already a known :class:`Kernel`)."""
    if not _REGISTRY:
        _REGISTRY.update(_discover())
    try:
        return _REGISTRY[Kernel(kernel)]
    except (ValueError, KeyError):
        raise EdgeqError(f"edgeq inspect has no checks for kernel {str(kernel)!r}") from None
