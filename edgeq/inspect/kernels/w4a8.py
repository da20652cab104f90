"""``edgeq inspect`` for AMX/VNNI W4A8 checkpoints (kernel ``amx_w4a8``, edgeq/layouts/w4a8.py, docs/w4a8.md).

Per quantised module M [N, K] at group size G (K block bk = min(G, 128)): ``M.qweight`` U8 [N/32, K/bk, 16 bk +
128] (each slot: 32 rows x bk nibbles, then 32 int32 compensations), ``M.scales`` F32 and ``M.zeros`` I8
[N/32, K/G, 32]. The layout is fixed by the kernel's source, not measured: the record must equal this edgeq's
fingerprint for G, and there is no repack (load refuses any other record). Nothing is copied at load, so the
memory projection has no anonymous weights and no dequantisation scratch.
"""

from __future__ import annotations

import torch

from edgeq.errors import EdgeqError
from edgeq.io.safetensors import read_tensor
from edgeq.keys import MANIFEST, Kernel
from edgeq.layouts import w4a8 as w4a8_layout
from edgeq.layouts.base import get as get_layout
from edgeq.memory import MemoryProjection, project, w4a8_scratch
from edgeq.memory import Tensor as MemTensor
from edgeq.inspect.kernels.base import LayoutVerdict
from edgeq.inspect.schema import QModule

LAYOUT = get_layout(Kernel.W4A8)
NAME = w4a8_layout.LAYOUT_NAME


def _module(ckpt, m: str, g: int | None, bk: int | None, problems: list[str]) -> QModule | None:
    """M.qweight's first two dims give N = 32 * dim0 and K = bk * dim1; scales and zeros must be the layout's."""
    parts = [ckpt.tensors.get(f"{m}{s}") for s in LAYOUT.suffixes]
    qw, sc, zp = parts
    if None in parts:
        missing = [s.lstrip(".") for s, t in zip(LAYOUT.suffixes, parts) if t is None]
        problems.append(f"{m}: quantised module without {', '.join(missing)} ({NAME} stores qweight, scales, zeros)")
        return None
    slot = (bk or 0) * 16 + w4a8_layout.COMP_BYTES
    if bk is None or qw.dtype != "U8" or len(qw.shape) != 3 or qw.shape[2] != slot:
        problems.append(f"{m}.qweight: expected U8 [N/32, K/{bk}, {slot}] for G={g}, got {qw.dtype} {list(qw.shape)}")
        return None
    n, k = qw.shape[0] * w4a8_layout.BLOCK_N, qw.shape[1] * bk
    for info, (_, code, shape) in zip((sc, zp), LAYOUT.out_tensors(m, n, k, g)[1:]):
        if info.dtype != code or list(info.shape) != list(shape):
            problems.append(f"{info.name}: expected {code} {list(shape)} for N={n}, K={k}, G={g}; got {info.dtype} "
                            f"{list(info.shape)} (the kernel does not check this and would read out of bounds)")
    nbytes = qw.nbytes + sc.nbytes + zp.nbytes
    return QModule(m, n, k, n * k, 8 * nbytes / (n * k) if n * k else None, g, nbytes)


class _W4A8Checks:
    kernel = Kernel.W4A8
    repacks_on_load = False  # the layout is the kernel's source: another record is refused, never repacked

    def modules(self, ckpt, manifest, g, problems):
        bk = w4a8_layout.block_k(g) if g in w4a8_layout.GROUP_SIZES else None
        found = {}
        for m in manifest.quantized_modules:
            if (module := _module(ckpt, m, g, bk, problems)) is not None:
                found[m] = module
        return found

    def layout(self, ckpt, manifest, modules, g, strict_layout, problems, warnings) -> LayoutVerdict:
        """The record must equal this edgeq's fingerprint; the path load will take is the one the runtime chooses
        here (a compiled kernel only after its probe)."""
        stored = dict(manifest.layout)
        if g not in w4a8_layout.GROUP_SIZES:
            return LayoutVerdict(stored, None, False, "refused: the scheme's group size is not a W4A8 one")
        want = w4a8_layout.fingerprint(g)
        if stored != want:
            problems.append(f"{MANIFEST}: {NAME} layout record (version {stored.get('version')!r}, block_k "
                            f"{stored.get('block_k')!r}, hash {str(stored.get('layout_hash'))[:12]}) is not the one "
                            f"this edgeq reads (version {want['version']}, block_k {want['block_k']}, hash "
                            f"{want['layout_hash'][:12]}); load refuses it, re-quantise")
            return LayoutVerdict(stored, want, False, f"refused: unknown {NAME} layout record")
        from edgeq.runtime.w4a8linear import choose_kernel  # noqa: PLC0415 - torch only; no transformers

        choice = choose_kernel(g)
        return LayoutVerdict(stored, want, True, "zero-copy: the layout is fixed by the kernel's source; every M runs "
                                                 f"{choice.path} ({choice.reason})")

    def config_layout_problem(self, record, manifest):
        """No permutations in the record: config.json's copy must be the same dict."""
        return None if record == manifest.layout else "quantization_config.layout differs from the manifest's layout record"

    def roundtrip(self, ckpt, manifest, modules, picks, problems):
        """unpack + pack must give back the stored bytes, the int32 compensation after every slot included (a stale
        compensation would shift every output of the kernel)."""
        done = []
        for m in picks:
            g = modules[m].group_size
            qw, sc, zp = (read_tensor(ckpt.tensors[f"{m}{s}"]) for s in LAYOUT.suffixes)
            try:
                again = w4a8_layout.pack(w4a8_layout.unpack(qw, g), w4a8_layout.unpack_params(sc),
                                         w4a8_layout.unpack_params(zp), g, name=m)
            except EdgeqError as e:
                problems.append(f"{m}: unpack/repack failed ({e})")
                continue
            if not torch.equal(again.qweight, qw):
                diff = int((again.qweight != qw).sum())
                problems.append(f"{m}.qweight: unpack/repack changes {diff} byte(s) (nibbles or the int32 compensation "
                                "after each slot do not agree with the zeros); the kernel would compute wrong outputs")
                continue
            done.append(m)
        return done

    def memory(self, ckpt, modules, geometry, kv_cache_bytes, max_model_len, repack) -> MemoryProjection:
        parts = {f"{m}{s}" for m in modules for s in LAYOUT.suffixes}
        tensors = [MemTensor(n, i.dtype, i.numel, i.nbytes, packed=n in parts) for n, i in ckpt.tensors.items()]
        return project(geometry, tensors, w4a8_scratch(), kv_cache_bytes, max_model_len, repack)

    def describe_layout(self, stored: dict, matches: bool) -> tuple[str, str]:
        what = (f"{NAME} v{stored.get('version')}, block {stored.get('block_n')} x {stored.get('block_k')}, "
                f"VNNI-{stored.get('vnni')}")
        return what, "read by this edgeq" if matches else "not one this edgeq reads"


CHECKS = _W4A8Checks()
