"""``edgeq quantize``: a Hugging Face checkpoint -> one tinygemm-packed W4A16 checkpoint, streamed tensor by tensor.

Order of work: resolve the input, read headers, build and check the plan (no weight read yet), check the output
and the disk, then per tensor: read a row block (positioned reads, no mmap), quantise, pack with the kernel's own
op, append to the output shard. Peak memory is one row block's working set, whatever the model size.

All output goes to a temporary sibling directory that is renamed into place only after the result has been
re-opened and checked (head quantised, shapes, shard hashes). Any failure or Ctrl-C removes it; the input is
only ever read.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import edgeq
from edgeq.checkpoint.manifest import FORMAT_VERSION, MANIFEST, Manifest, read_manifest
from edgeq.checkpoint.plan import HEAD_MODULE, Plan, PlanEntry, build_plan
from edgeq.checkpoint.reader import Checkpoint, open_checkpoint
from edgeq.checkpoint.recipe import Recipe, find_recipe
from edgeq.checkpoint.safetensors_io import DTYPES, OutSpec, ShardedWriter, read_header, sha256_file
from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.quantize.rtn import quantize_groups
from edgeq.scheme import Scheme

AUX_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
)
ROW_BLOCK_ELEMENTS = 4 << 20  # ~4M weights per block: the quantiser's fp32 working set stays ~100 MB
DEFAULT_SHARD_BYTES = 2 << 30


@dataclass(frozen=True)
class ConvertReport:
    out: str
    scheme: str
    method: str
    recipe: str
    tensors: int
    quantized: int
    bytes_in: int
    bytes_out: int
    seconds: float
    peak_rss_bytes: int
    peak_rss_anon_bytes: int
    mean_relative_error: float
    worst_relative_error: float
    worst_tensor: str
    head_source: str
    untied: bool
    layout_hash: str
    shards: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else 0.0


def resolve_source(src: str | Path) -> Path:
    """A local directory, or a hub id (``org/name``) resolved with huggingface_hub when online."""
    p = Path(src)
    if p.exists():
        return p
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(src)):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(src), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
        except Exception as e:  # any hub failure (offline, 404, auth) becomes one line
            raise EdgeqError(
                f"{src}: not a local directory, and fetching it from the Hugging Face hub failed ({type(e).__name__}); "
                "check the path, or download the model first when online"
            ) from None
    raise EdgeqError(f"{src}: no such directory")


def refuse_quantized_input(ckpt: Checkpoint) -> None:
    q = ckpt.quantization_config
    if q is not None:
        method = q.get("quant_method", "?")
        raise EdgeqError(
            f"{ckpt.root / 'config.json'}: the input is already quantised (quant_method={method!r}); "
            "give edgeq the original float checkpoint"
        )


def prepare(src: str | Path, scheme: Scheme | None, method: str | None, recipe_name: str | None) -> tuple[Checkpoint, Plan, Recipe]:
    """Headers -> recipe -> plan. Nothing but headers and config is read."""
    ckpt = open_checkpoint(resolve_source(src))
    refuse_quantized_input(ckpt)
    recipe = find_recipe(recipe_name, ckpt.config.get("model_type"))
    scheme = scheme or Scheme.parse(recipe.scheme)
    if scheme.activation_bits != 16:
        raise EdgeqError(f"scheme {scheme}: the W4A8 layout is not available in this version; use a w4a16 scheme")
    plan = build_plan(ckpt, scheme, method or recipe.method, recipe)
    return ckpt, plan, recipe


def _rss() -> tuple[int, int]:
    """(current RssAnon, peak RSS) of this process in bytes."""
    anon = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _check_output(out: Path, force: bool, need: int) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise EdgeqError(f"{out}: exists and is not empty; choose another -o or pass --force to replace it")
    parent = out.parent if out.parent.exists() else None
    if parent is None:
        raise EdgeqError(f"{out.parent}: no such directory for the output")
    free = shutil.disk_usage(parent).free
    if free < need:
        raise EdgeqError(f"{parent}: {free / 2**20:.0f} MiB free, the output needs {need / 2**20:.0f} MiB; free space or choose another -o")


class _Progress:
    """Callback sink: ``advance(nbytes, label)``."""

    def __init__(self, callback: Callable[[int, str], None] | None):
        self.callback = callback

    def __call__(self, nbytes: int, label: str) -> None:
        if self.callback:
            self.callback(nbytes, label)


def convert(
    src: str | Path,
    out: str | Path,
    scheme: Scheme | None = None,
    method: str | None = None,
    recipe: str | None = None,
    force: bool = False,
    progress: Callable[[int, str], None] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    prepared: tuple[Checkpoint, Plan, Recipe] | None = None,
) -> ConvertReport:
    t0 = time.perf_counter()
    ckpt, plan, rec = prepared or prepare(src, scheme, method, recipe)
    plan.check()
    layout = tinygemm.probe()
    out = Path(out).resolve()
    _check_output(out, force, plan.bytes_out + (64 << 20))
    tmp = out.parent / f".{out.name}.edgeq-tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    writer = None
    try:
        specs = [OutSpec(n, DTYPES[d][0], s) for e in plan.entries for n, d, s in e.out_tensors(plan.scheme)]
        writer = ShardedWriter(tmp, specs, max_shard_bytes, metadata={"edgeq_format_version": str(FORMAT_VERSION)})
        stats = _stream(ckpt, plan, layout, writer, _Progress(progress))
        digests = writer.close()
        manifest = _manifest(plan, layout, digests)
        manifest.write(tmp)
        _write_config(ckpt, tmp, plan, layout, manifest)
        _copy_aux(ckpt.root, tmp)
        verify_written(tmp)  # assertion 3 of 3 (2 was the plan's): re-open what was written
        _replace(tmp, out)
    except BaseException:
        if writer is not None:
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    anon_peak, rss_peak = stats["anon_peak"], _rss()[1]
    errs = stats["errors"]
    worst = max(errs, key=errs.get)
    return ConvertReport(
        out=str(out), scheme=str(plan.scheme), method=plan.method, recipe=rec.name, tensors=len(plan.entries),
        quantized=len(errs), bytes_in=plan.bytes_in, bytes_out=sum((out / f).stat().st_size for f in digests),
        seconds=time.perf_counter() - t0, peak_rss_bytes=rss_peak, peak_rss_anon_bytes=anon_peak,
        mean_relative_error=sum(errs.values()) / len(errs), worst_relative_error=errs[worst], worst_tensor=worst,
        head_source=plan.head.source, untied=plan.tied, layout_hash=layout.layout_hash, shards=digests,
    )


def _stream(ckpt: Checkpoint, plan: Plan, layout: tinygemm.TinygemmLayout, writer: ShardedWriter, progress: _Progress) -> dict:
    errors: dict[str, float] = {}
    anon_peak = 0
    for e in plan.entries:
        info = ckpt.tensors[e.source]
        if e.action == "quantize":
            errors[e.module] = _quantize_entry(ckpt, e, plan, layout, writer, progress)
        else:
            rows = info.shape[0] if info.shape else 1
            step = max(1, ROW_BLOCK_ELEMENTS // max(1, info.numel // max(rows, 1))) if info.shape else 1
            for a in range(0, rows, step):
                block = ckpt.read(e.source, (a, min(rows, a + step)) if info.shape else None)
                if not bool(torch.isfinite(block).all()):
                    raise EdgeqError(f"{info.file}: tensor {e.source} has NaN/Inf values; fix or re-export the checkpoint")
                writer.write(e.name, block.to(torch.bfloat16))
                progress(block.numel() * info.itemsize, e.name)
        anon_peak = max(anon_peak, _rss()[0])
    return {"errors": errors, "anon_peak": anon_peak}


def _quantize_entry(ckpt: Checkpoint, e: PlanEntry, plan: Plan, layout, writer: ShardedWriter, progress: _Progress) -> float:
    """Quantise one weight in row blocks of whole layout blocks; returns its relative reconstruction error."""
    info = ckpt.tensors[e.source]
    n, k = e.shape
    step = min(n, tinygemm.row_block(layout, ROW_BLOCK_ELEMENTS // k))
    sq_err = sq_norm = 0.0
    sz_parts = []
    for a in range(0, n, step):
        b = min(n, a + step)
        w = ckpt.read(e.source, (a, b))
        qt = quantize_groups(w, plan.scheme.group_size, plan.method, name=f"{e.source} rows {a}..{b}")
        tinygemm.check_values(qt.q, e.source)
        writer.write(f"{e.module}.qweight", tinygemm._op_pack(qt.q))
        sz_parts.append(qt.scales_and_zeros)
        sq_err += float(qt.sq_error.sum())
        sq_norm += float(qt.sq_norm.sum())
        progress(w.numel() * info.itemsize, e.name)
    writer.write(f"{e.module}.scales_and_zeros", torch.cat(sz_parts, dim=1))
    return (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0


def _manifest(plan: Plan, layout: tinygemm.TinygemmLayout, digests: dict) -> Manifest:
    tensors = {}
    for e in plan.entries:
        for name, dtype, shape in e.out_tensors(plan.scheme):
            tensors[name] = {"role": e.role, "source": e.source, "dtype": dtype, "shape": list(shape)}
    return Manifest(
        format_version=FORMAT_VERSION,
        scheme=str(plan.scheme),
        method=plan.method,
        kernel=plan.scheme.kernel,
        layout=layout.to_json(),
        head={"name": HEAD_MODULE, "quantized": True, "source": plan.head.source, "untied": plan.tied},
        quantized_modules=tuple(e.module for e in plan.entries if e.action == "quantize"),
        modules_not_converted={e.module: e.reason for e in plan.entries if e.action == "keep"},
        shards=digests,
        tensors=tensors,
        created_by={"edgeq": edgeq.__version__, "torch": torch.__version__, "recipe": plan.recipe},
    )


def quantization_config(manifest: Manifest, plan: Plan, layout: tinygemm.TinygemmLayout) -> dict:
    return {
        "quant_method": "edgeq",
        "format_version": FORMAT_VERSION,
        "scheme": str(plan.scheme),
        "group_size": plan.scheme.group_size,
        "method": plan.method,
        "kernel": plan.scheme.kernel,
        "layout": layout.fingerprint(),
        "head_quantized": True,
        "untied": plan.tied,
        "modules_not_converted": sorted(manifest.modules_not_converted),
    }


def _write_config(ckpt: Checkpoint, tmp: Path, plan: Plan, layout, manifest: Manifest) -> None:
    config = dict(ckpt.config)
    config["tie_word_embeddings"] = False  # the head is its own quantised tensor now
    config["dtype"] = "bfloat16"
    if "torch_dtype" in config:
        config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = quantization_config(manifest, plan, layout)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _copy_aux(src: Path, dst: Path) -> None:
    for name in AUX_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def verify_written(directory: Path) -> None:
    """Re-open a written checkpoint from its headers: manifest, head, every quantised tensor's shapes, hashes."""
    manifest = read_manifest(directory)
    found = {}
    for shard, digest in manifest.shards.items():
        path = Path(directory) / shard
        tensors, _ = read_header(path)
        found.update(tensors)
        if sha256_file(path) != digest:
            raise EdgeqError(f"{path}: sha256 does not match the manifest; the write was corrupted (disk?)")
    if f"{HEAD_MODULE}.qweight" not in found or HEAD_MODULE not in manifest.quantized_modules:
        raise EdgeqError(f"{directory}: the written checkpoint has no quantised {HEAD_MODULE}; refusing it")
    g = Scheme.parse(manifest.scheme).group_size
    for m in manifest.quantized_modules:
        qw, sz = found.get(f"{m}.qweight"), found.get(f"{m}.scales_and_zeros")
        if qw is None or sz is None:
            raise EdgeqError(f"{directory}: quantised module {m} is missing its qweight or scales_and_zeros")
        n, half_k = qw.shape
        if qw.dtype != "U8" or sz.dtype != "BF16" or list(sz.shape) != [2 * half_k // g, n, 2]:
            raise EdgeqError(f"{directory}: {m}: qweight {qw.dtype} {list(qw.shape)} / scales_and_zeros {sz.dtype} {list(sz.shape)} do not fit G={g}")


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished directory into place; an existing output (--force) is removed only after that succeeds."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.edgeq-old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
