"""``edgeq inspect`` for tinygemm W4A16 checkpoints (kernel ``tinygemm_w4a16``, edgeq/layouts/tinygemm.py).

Per quantised module M [N, K] at group size G: ``M.qweight`` U8 [N, K/2] (two nibbles per byte, rows permuted in
blocks as this torch packs them) and ``M.scales_and_zeros`` BF16 [K/G, N, 2]; act-order input adds ``M.perm`` I64
[K]. The layout record is *measured* (the probe packs known values and reads back where they land), so a
checkpoint written on another CPU or torch may be a different layout: load repacks it (or refuses it under
``--strict-layout``), and the memory projection counts the repacked qweights as anonymous memory.
"""

from __future__ import annotations

import torch

from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.manifest import Manifest
from edgeq.io.safetensors import read_tensor
from edgeq.keys import MANIFEST, Kernel
from edgeq.layouts import tinygemm
from edgeq.layouts.base import get as get_layout
from edgeq.memory import KVGeometry, MemoryProjection, project, scratch
from edgeq.memory import Tensor as MemTensor
from edgeq.runtime.qinfo import config_layout_mismatch
from edgeq.inspect.kinds import mib
from edgeq.inspect.kernels.base import LayoutVerdict
from edgeq.inspect.schema import QModule

LAYOUT = get_layout(Kernel.W4A16)
PERM = ".perm"  # an act-order module's input permutation, used in place by the loader like the packed tensors


def block_n() -> int:
    """The row-block size the runtime will use here (this machine's layout; it repacks foreign ones to it)."""
    try:
        return tinygemm.probe().block_n
    except EdgeqError:
        return 64


def _module(ckpt: Checkpoint, m: str, g: int | None, problems: list[str]) -> QModule | None:
    """M.qweight U8 [N, K/2] gives N and K; M.scales_and_zeros must then be the layout's [K/G, N, 2]."""
    qw, sz = ckpt.tensors.get(f"{m}.qweight"), ckpt.tensors.get(f"{m}.scales_and_zeros")
    if qw is None or sz is None:
        problems.append(f"{m}: quantised module without {'qweight' if qw is None else 'scales_and_zeros'}")
        return None
    if qw.dtype != "U8" or len(qw.shape) != 2:
        problems.append(f"{m}.qweight: expected U8 [N, K/2], got {qw.dtype} {list(qw.shape)}")
        return None
    n, k = qw.shape[0], 2 * qw.shape[1]
    if g:
        _, code, shape = LAYOUT.out_tensors(m, n, k, g)[1]
        if k % g or sz.dtype != code or list(sz.shape) != list(shape):
            problems.append(f"{m}.scales_and_zeros: expected {code} {list(shape)} for N={n}, K={k}, G={g}; got "
                            f"{sz.dtype} {list(sz.shape)} (the kernel does not check this and would read out of bounds)")
    if n % tinygemm.ROW_MULTIPLE:
        problems.append(f"{m}: N={n} is not a multiple of {tinygemm.ROW_MULTIPLE}; the kernel cannot use it")
    nbytes = qw.nbytes + sz.nbytes
    return QModule(m, n, k, n * k, 8 * nbytes / (n * k) if n * k else None, g, nbytes)


def _missing_blocks(stored: tinygemm.TinygemmLayout, modules: dict[str, QModule], problems: list[str]) -> None:
    """Every module needs a measured block for its tail rows (N % block_n) and, when N >= block_n, a whole one."""
    sizes = {s for s, _ in stored.perms}
    for m in modules.values():
        tail = m.n % stored.block_n
        if m.n % tinygemm.ROW_MULTIPLE == 0 and ((tail and tail not in sizes) or (m.n >= stored.block_n and stored.block_n not in sizes)):
            problems.append(f"{MANIFEST}: the layout record has no block of {tail or stored.block_n} rows, which "
                            f"{m.name} (N={m.n}) needs; it cannot be unpacked or repacked")
            break


class _W4A16Checks:
    kernel = Kernel.W4A16
    repacks_on_load = True

    def modules(self, ckpt, manifest, g, problems):
        found = {}
        for m in manifest.quantized_modules:
            mg = manifest.group_sizes.get(m, g) if g else g  # a recipe's finer groups for this module
            if (module := _module(ckpt, m, mg, problems)) is not None:
                found[m] = module
        return found

    def layout(self, ckpt, manifest, modules, g, strict_layout, problems, warnings) -> LayoutVerdict:
        stored_fp = {k: v for k, v in manifest.layout.items() if k != "perms"}
        try:
            stored = tinygemm.TinygemmLayout.from_json(manifest.layout)
        except EdgeqError as e:
            problems.append(f"{MANIFEST}: {e}")
            return LayoutVerdict(stored_fp, None, False, "refused: the stored layout record is unreadable")
        _missing_blocks(stored, modules, problems)
        try:
            machine = tinygemm.probe()
        except EdgeqError as e:
            warnings.append(f"this machine: {e}")
            return LayoutVerdict(stored_fp, None, False, "refused: torch's int4 packing cannot be measured here")
        if stored.is_compatible(machine):
            return LayoutVerdict(stored_fp, machine.fingerprint(), True,
                                 "zero-copy: the stored bytes are this machine's kernel layout")
        what = (f"layout {stored.layout_hash[:12]} ({stored.cpu_capability}, block {stored.block_n}, torch "
                f"{stored.torch_version}) differs from this machine's {machine.layout_hash[:12]} "
                f"({machine.cpu_capability}, block {machine.block_n}, torch {machine.torch_version})")
        if strict_layout:
            problems.append(f"{what}: load refuses it under --strict-layout; run `edgeq repack {ckpt.root}`")
            return LayoutVerdict(stored_fp, machine.fingerprint(), False, "refused (--strict-layout)")
        warnings.append(f"{what}: load repacks it (see on_load); `edgeq repack {ckpt.root}` rewrites it once")
        qbytes = sum(ckpt.tensors[f"{m}.qweight"].nbytes for m in modules)
        on_load = (f"repack: {len(modules)} qweight tensors ({mib(qbytes)}) read, unpacked and repacked into "
                   f"{mib(qbytes)} of anonymous memory at every load, with a warning; refused under --strict-layout")
        return LayoutVerdict(stored_fp, machine.fingerprint(), False, on_load)

    def config_layout_problem(self, record, manifest):
        try:
            layout = tinygemm.TinygemmLayout.from_json(manifest.layout)
        except EdgeqError:
            return None  # the manifest's record itself is reported by layout()
        return config_layout_mismatch(record, layout)

    def roundtrip(self, ckpt, manifest, modules, picks, problems):
        try:
            layout = tinygemm.TinygemmLayout.from_json(manifest.layout)
        except EdgeqError:
            return []  # already reported from the headers
        done = []
        for m in picks:
            mod, info = modules[m], ckpt.tensors[f"{m}.qweight"]
            try:
                stored = read_tensor(info)
                again = tinygemm.pack(tinygemm.unpack(stored, mod.n, mod.k, layout), layout)
            except EdgeqError as e:
                problems.append(f"{m}.qweight: unpack/repack failed ({e})")
                continue
            if not torch.equal(again, stored):
                diff = int((again != stored).sum())
                problems.append(f"{m}.qweight: unpack/repack with the stored layout changes {diff} byte(s); the layout "
                                "record does not describe these bytes")
                continue
            done.append(m)
        return done

    def memory(self, ckpt, modules, geometry: KVGeometry, kv_cache_bytes, max_model_len, repack) -> MemoryProjection:
        parts = {f"{m}{s}" for m in modules for s in (*LAYOUT.suffixes, PERM)}
        tensors = [MemTensor(n, i.dtype, i.numel, i.nbytes, packed=n in parts,
                             qweight=n.endswith(".qweight") and n in parts) for n, i in ckpt.tensors.items()]
        big = scratch(((m.name, m.n, m.k) for m in modules.values()), block_n())
        return project(geometry, tensors, big, kv_cache_bytes, max_model_len, repack)

    def describe_layout(self, stored: dict, matches: bool) -> tuple[str, str]:
        what = f"{stored.get('cpu_capability')}, block {stored.get('block_n')}, torch {stored.get('torch_version')}"
        return what, "matches this machine" if matches else "differs from this machine"


CHECKS = _W4A16Checks()
