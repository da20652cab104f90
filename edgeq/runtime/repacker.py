"""``repack(path)``: rewrite an edgeq checkpoint's packed weights for this machine's kernel layout.

Every ``*.qweight`` (of the quantised modules and of a packed embedding's levels) is unpacked with the layout
recorded in the manifest and packed with the target layout (this machine's :func:`~edgeq.layouts.tinygemm.probe` by
default); every other tensor and file is copied unchanged. The result is written into a temporary sibling directory
and renamed into place (fsynced; the old directory is renamed aside first and removed last), so an interruption
(Ctrl-C, SIGTERM, SIGKILL, power loss) leaves either the old or the new checkpoint, never a mix. An explicit output
may not be, contain or lie inside the input (edgeq/io/writer.py).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from edgeq.errors import EdgeqError
from edgeq.io.manifest import read_json
from edgeq.io.mapped import MappedFiles
from edgeq.io.safetensors import read_header, sha256_file
from edgeq.io.writer import prepare_output, staging
from edgeq.keys import CONFIG, MANIFEST, Kernel
from edgeq.layouts import tinygemm
from edgeq.layouts.tinygemm import TinygemmLayout
from edgeq.runtime.embedding import level_modules
from edgeq.runtime.loader import verify_shards
from edgeq.runtime.qinfo import KERNELS, QuantInfo, read_checkpoint


@dataclass(frozen=True)
class RepackReport:
    path: str
    changed: bool
    tensors: int
    bytes_repacked: int
    seconds: float
    old_layout_hash: str
    new_layout_hash: str


def _metadata(shard: Path) -> dict | None:
    import struct  # noqa: PLC0415

    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)).get("__metadata__")


def _tinygemm_info(directory: Path, config: dict) -> QuantInfo | None:
    """:func:`~edgeq.runtime.qinfo.read_checkpoint` of a tinygemm_w4a16 checkpoint, the only kernel repack rewrites
    (the only one whose layout is measured per machine); any other kernel is refused with the reader's words."""
    info = read_checkpoint(directory, config)
    if info is not None and info.kernel is not Kernel.W4A16:
        raise EdgeqError(f"{directory}/{CONFIG}: kernel {info.kernel.value!r} is not one this runtime runs "
                         f"({', '.join(KERNELS)}); re-quantise with `edgeq quantize` or upgrade edgeq")
    return info


def repack(path, out=None, *, layout: TinygemmLayout | None = None) -> RepackReport:
    """Repack ``path`` in place (or into ``out``) for ``layout`` (default: this machine's)."""
    from edgeq.io.hub import is_hub_id  # noqa: PLC0415

    if is_hub_id(path):  # repack writes files: never into the hub cache, whose snapshots other programs share
        raise EdgeqError(f"{path}: repack rewrites a local checkpoint directory, and this is a hub id; download it "
                         f"first (huggingface-cli download {path} --local-dir DIR), then run edgeq repack DIR")
    src = Path(path).resolve()
    dst = Path(out).resolve() if out is not None else src
    config = read_json(src / "config.json")
    info = _tinygemm_info(src, config)
    if info is None:
        raise EdgeqError(f"{src}: not an edgeq checkpoint (no quantization_config); nothing to repack")
    target = layout or tinygemm.probe()
    changed = not info.layout.is_compatible(target)
    prepare_output(dst, [src] if out is not None else [])  # in place is the default; an -o may not be the input
    if not changed and dst == src:
        return RepackReport(str(dst), False, 0, 0, 0.0, info.layout.layout_hash, target.layout_hash)
    if dst != src and dst.exists() and any(dst.iterdir()):
        raise EdgeqError(f"{dst}: exists and is not empty; choose another output directory")
    verify_shards(src)  # new shards get new sha256s: damaged bytes must not be blessed with them
    t0 = time.perf_counter()
    files = MappedFiles(src)
    quantized = set(info.quantized_modules) | set(level_modules(info))  # a packed embedding's levels: same layout
    count = nbytes = 0
    with staging(dst, "repack") as tmp:  # SIGTERM and Ctrl-C remove it; at the end: renamed to dst, fsynced
        shards = sorted({i.file for i in files.tensors.values()})
        digests = {}
        for shard in shards:
            header, _ = read_header(shard)
            tensors = {}
            for name in header:
                t = files.get(name)
                module = name.removesuffix(".qweight")
                if changed and name.endswith(".qweight") and module in quantized:
                    n, k = t.shape[0], t.shape[1] * 2
                    t = tinygemm.pack(tinygemm.unpack(t, n, k, info.layout), target)
                    count, nbytes = count + 1, nbytes + t.numel()
                tensors[name] = t
            save_file(tensors, str(tmp / shard.name), metadata=_metadata(shard))
            digests[shard.name] = sha256_file(tmp / shard.name)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", MANIFEST):
                shutil.copy2(f, tmp / f.name)
        manifest = read_json(src / MANIFEST)
        manifest["layout"] = target.to_json()
        manifest["shards"] = digests
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        config["quantization_config"]["layout"] = target.fingerprint()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        del files, tensors  # unmapped before the rename (in place: the old files are removed)
    return RepackReport(str(dst), changed, count, nbytes, time.perf_counter() - t0, info.layout.layout_hash, target.layout_hash)
