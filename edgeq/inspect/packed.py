"""The packed part of ``edgeq inspect``: one implementation for every kernel, asking the kernel's layout.

What every kernel's checkpoint shares (manifest, config, shards, tensor dtypes and shapes against the manifest, the
head, the shard digests, NaN/Inf) is checked in edgeq/inspect/checks.py and verify.py. What depends on the packed
format is asked of :func:`edgeq.layouts.base.get` (the :class:`~edgeq.layouts.base.Layout` protocol): how a
module's logical [N, K] is read back from its packed shapes (``logical_shape``), the stored layout record against
this machine's (``check_record``) and config.json's copy of it (``config_problem``), the unpack -> pack round trip
(``roundtrip``), the scratch load allocates (``scratch``). This module turns those answers into what inspect
reports: problems, warnings, what load will do with the record, the memory projection.

    checks = packed_checks(manifest.kernel)   # PackedChecks(layout=get(manifest.kernel))
    modules = checks.modules(ckpt, manifest, g, problems)
    verdict = checks.record_verdict(ckpt, manifest, modules, g, strict_layout, problems, warnings)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.manifest import Manifest
from edgeq.io.safetensors import read_tensor
from edgeq.keys import Kernel
from edgeq.layouts.base import Layout, get
from edgeq.memory import KVGeometry, MemoryProjection, project
from edgeq.memory import Tensor as MemTensor
from edgeq.inspect.kinds import mib
from edgeq.inspect.schema import QModule


@dataclass(frozen=True)
class LayoutVerdict:
    """The stored layout record against what this edgeq on this machine reads, and what load will do with it."""

    stored: dict  # the manifest's record (tinygemm: without its permutations)
    machine: Optional[dict]  # this machine's / this edgeq's record; None when it cannot be told
    matches: bool
    on_load: str  # "zero-copy: ...", "repack: ...", "refused: ..."


def _named(spec: str):
    """The object a layout names as "module:attribute" (imported here, on use: the layout itself never imports it)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class PackedChecks:
    """Inspect's questions about the quantised modules of one checkpoint, answered through its kernel's layout."""

    layout: Layout

    @property
    def kernel(self) -> Kernel:
        return self.layout.kernel

    @property
    def repacks_on_load(self) -> bool:
        """Load rewrites a stored layout that is not this machine's (a measured layout), else it refuses it."""
        return self.layout.measured

    def modules(self, ckpt: Checkpoint, manifest: Manifest, g: int | None, problems: list[str]) -> dict[str, QModule]:
        """Every module the manifest lists, its [N, K] from the packed shapes, checked as the runtime checks it, at
        its own group size where the kernel takes one per module (a recipe's finer groups), else the scheme's."""
        found = {}
        for m in manifest.quantized_modules:
            mg = manifest.group_sizes.get(m, g) if g and self.layout.per_module_groups else g
            shape = self.layout.logical_shape(m, ckpt.tensors, mg)
            problems.extend(shape.problems)
            if shape.n is None or shape.k is None:
                continue
            n, k = shape.n, shape.k
            nbytes = sum(ckpt.tensors[f"{m}{s}"].nbytes for s in self.layout.suffixes)
            found[m] = QModule(m, n, k, n * k, 8 * nbytes / (n * k) if n * k else None, mg, nbytes)
        return found

    def record_verdict(self, ckpt: Checkpoint, manifest: Manifest, modules: dict[str, QModule], g: int | None,
                       strict_layout: bool, problems: list[str], warnings: list[str]) -> LayoutVerdict:
        """The stored layout record against this machine's, and what load will do: as the record decides, with the
        runtime's one compute path when it chooses one at load; a measured record of another machine is repacked at
        every load (refused under ``--strict-layout``)."""
        lay = self.layout
        rc = lay.check_record(manifest.layout, g, [(m.name, m.n) for m in modules.values()])
        problems.extend(rc.problems)
        warnings.extend(rc.warnings)
        if rc.differs is None:
            on_load = rc.on_load
            if rc.matches and lay.runtime_choice:
                choice = _named(lay.runtime_choice)(g)  # e.g. a compiled kernel, only after its probe agrees
                on_load += f"; every M runs {choice.path} ({choice.reason})"
            return LayoutVerdict(rc.stored, rc.machine, rc.matches, on_load)
        if strict_layout:
            problems.append(f"{rc.differs}: load refuses it under --strict-layout; run `edgeq repack {ckpt.root}`")
            return LayoutVerdict(rc.stored, rc.machine, False, "refused (--strict-layout)")
        warnings.append(f"{rc.differs}: load repacks it (see on_load); `edgeq repack {ckpt.root}` rewrites it once")
        weight = lay.suffixes[0]
        qbytes = sum(ckpt.tensors[f"{m}{weight}"].nbytes for m in modules)
        on_load = (f"repack: {len(modules)} {weight.lstrip('.')} tensors ({mib(qbytes)}) read, unpacked and repacked "
                   f"into {mib(qbytes)} of anonymous memory at every load, with a warning; refused under --strict-layout")
        return LayoutVerdict(rc.stored, rc.machine, False, on_load)

    def config_layout_problem(self, record, manifest: Manifest) -> str | None:
        """Why config.json's copy of the layout record (``record``) is not the manifest's, or None (also when the
        manifest's record is unreadable: :meth:`record_verdict` reports that)."""
        try:
            parsed = self.layout.parse_record(manifest.layout)
        except EdgeqError:
            return None
        return self.layout.config_problem(record, parsed)

    def roundtrip(self, ckpt: Checkpoint, manifest: Manifest, modules: dict[str, QModule], picks: list[str],
                  problems: list[str]) -> list[str]:
        """The modules of ``picks`` whose stored bytes unpack and pack back to themselves (reads tensor data); none
        when the record is unreadable (already reported from the headers)."""
        try:
            record = self.layout.parse_record(manifest.layout)
        except EdgeqError:
            return []
        done = []
        for m in picks:
            mod = modules[m]
            read = lambda suffix, m=m: read_tensor(ckpt.tensors[f"{m}{suffix}"])  # noqa: E731
            if problem := self.layout.roundtrip(m, read, mod.n, mod.k, mod.group_size, record):
                problems.append(problem)
            else:
                done.append(m)
        return done

    def memory(self, ckpt: Checkpoint, modules: dict[str, QModule], geometry: KVGeometry, kv_cache_bytes: int,
               max_model_len: int | None, repack: bool, embedding_parts: frozenset[str] = frozenset(),
               head_weights: frozenset[str] = frozenset()) -> MemoryProjection:
        """What serving the checkpoint as stored costs (:func:`edgeq.memory.project`): every module's packed tensors
        mapped, its packed weight copied when load repacks it, the layout's scratch; ``embedding_parts`` (a packed
        embedding's own levels) are mapped as stored and never repacked (the lookup reads the stored layout), except
        ``head_weights``: the qweight of a level the head also sums (--head-levels 2), repacked with the head."""
        lay = self.layout
        parts = {f"{m}{s}" for m in modules for s in (*lay.suffixes, *lay.optional_suffixes)} | set(embedding_parts)
        weights = {f"{m}{lay.suffixes[0]}" for m in modules} | set(head_weights)
        tensors = [MemTensor(n, i.dtype, i.numel, i.nbytes, packed=n in parts, qweight=n in weights)
                   for n, i in ckpt.tensors.items()]
        big = lay.scratch((m.name, m.n, m.k) for m in modules.values())
        return project(geometry, tensors, big, kv_cache_bytes, max_model_len, repack)


def packed_checks(kernel: str | Kernel) -> PackedChecks:
    """Inspect's checks of ``kernel``'s quantised modules (a manifest's kernel, so already a known one)."""
    return PackedChecks(get(kernel))
