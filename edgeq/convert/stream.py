"""Streaming a plan's entries into the writer, one tensor at a time, in the plan's order (``rtn`` / ``minmax`` and
GPTQ ingest; ``--method gptq`` streams in the driver's order: edgeq/convert/calibrated.py).

Per entry: ``copy`` reads row blocks and casts them to bf16; ``quantize`` hands the kernel's packer
(:func:`edgeq.convert.packers.packer`) a row reader and the writer, and it quantises and packs a row block at a
time; a GPTQ entry (``repack`` / ``requantize`` / ``keep``) goes to :func:`edgeq.convert.ingest_stream.stream_entry`;
a packed embedding (``pack-embedding``, last) to :func:`edgeq.convert.embeddings.write_levels`.
Peak memory is one row block's working set (about ``ROW_BLOCK_ELEMENTS`` weights), whatever the model size.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any, Callable

import torch

from edgeq.convert import ingest_stream as ingest
from edgeq.convert.embeddings import write_levels
from edgeq.convert.packers import packer
from edgeq.convert.plan import Plan, PlanEntry
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint, open_checkpoint
from edgeq.io.safetensors import ShardedWriter
from edgeq.keys import Action

ROW_BLOCK_ELEMENTS = 4 << 20  # ~4M weights per copied block, as the packers' quantised row blocks


class Progress:
    """Callback sink: ``progress(nbytes, label)`` after each block read; nothing when no callback is given."""

    def __init__(self, callback: Callable[[int, str], None] | None):
        self.callback = callback

    def __call__(self, nbytes: int, label: str) -> None:
        if self.callback:
            self.callback(nbytes, label)


def rss() -> tuple[int, int]:
    """(current RssAnon, peak RSS) of this process in bytes."""
    anon = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _finite_blocks(ckpt: Checkpoint, name: str):
    """``name``'s row blocks (~16M elements each) as read; a block with NaN/Inf is refused, naming file and tensor."""
    info = ckpt.tensors[name]
    rows = info.shape[0] if info.shape else 1
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, info.numel // max(rows, 1))) if info.shape else 1
    for a in range(0, rows, step):
        block = ckpt.read(name, (a, min(rows, a + step)) if info.shape else None)
        if not bool(torch.isfinite(block).all()):
            raise EdgeqError(f"{info.file}: tensor {name} has NaN/Inf values; fix or re-export the checkpoint")
        yield block


def check_finite(ckpt: Checkpoint, names) -> None:
    """Every tensor of ``names`` finite, read once in row blocks. A calibrated conversion runs this first: sampling
    and the calibration forward passes would otherwise run minutes on a damaged model before its layer is reached
    (a 1B bf16 checkpoint reads in seconds)."""
    for name in names:
        for _ in _finite_blocks(ckpt, name):
            pass


def copy_entry(ckpt: Checkpoint, e: PlanEntry, writer: ShardedWriter, progress: Progress) -> None:
    """A tensor kept as it is, cast to bf16, in row blocks; NaN/Inf refused."""
    itemsize = ckpt.tensors[e.source].itemsize
    for block in _finite_blocks(ckpt, e.source):
        writer.write(e.name, block.to(torch.bfloat16))
        progress(block.numel() * itemsize, e.name)


def quantize_entry(ckpt: Checkpoint, e: PlanEntry, plan: Plan, record: Any, writer: ShardedWriter,
                   progress: Progress) -> float:
    """Quantise one float weight with the plan's kernel, read in row blocks (from ``e.origin`` for --head-from);
    returns its relative reconstruction error."""
    src = open_checkpoint(e.origin) if e.origin else ckpt  # --head-from: another model's head
    itemsize = src.tensors[e.source].itemsize
    n, k = e.shape
    return packer(plan.scheme.kernel).quantize(
        lambda a, b: src.read(e.source, (a, b)), n, k, e.group(plan.scheme), e.method or plan.method,
        name=e.source, module=e.module, record=record, write=writer.write,
        progress=lambda rows: progress(rows * k * itemsize, e.name))


def stream(ckpt: Checkpoint, plan: Plan, record: Any, writer: ShardedWriter, progress: Progress) -> dict:
    """Every entry in plan order. Returns {"errors": {module: relative error}, "anon_peak": bytes, "details": the
    manifest's method record (GPTQ ingest: :func:`edgeq.convert.ingest_stream.ingest_summary`, else empty),
    "embeddings": a packed embedding's errors (:func:`edgeq.convert.embeddings.write_levels`) or {}}."""
    errors: dict[str, float] = {}
    ingested: dict[str, ingest.EntryStats] = {}
    anon_peak = 0
    embeddings: dict = {}
    for e in plan.entries:
        if e.action == Action.PACK_EMBEDDING:  # last in the plan: its residual reads the head back
            embeddings = write_levels(ckpt, plan, e, record, writer, progress)
        elif e.gptq is not None:
            st = ingest.stream_entry(ckpt, e, plan.scheme, record, writer, progress)
            ingested[e.module] = st
            if e.quantized:
                errors[e.module] = st.rel_error
        elif e.action == Action.QUANTIZE:
            errors[e.module] = quantize_entry(ckpt, e, plan, record, writer, progress)
        else:
            copy_entry(ckpt, e, writer, progress)
        anon_peak = max(anon_peak, rss()[0])
    details = ingest.ingest_summary(plan, ingested) if ingested else {}  # GPTQ input (ingest, gptqmodel)
    return {"errors": errors, "anon_peak": anon_peak, "details": details, "embeddings": embeddings}
