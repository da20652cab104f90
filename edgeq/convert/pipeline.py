"""``edgeq quantize``: a Hugging Face checkpoint -> one edgeq checkpoint in the scheme's packed layout (W4A16:
tinygemm_w4a16; W4A8: amx_w4a8), streamed tensor by tensor.

Order of work (:func:`convert`): resolve the input, read headers, build and check the plan (no weight read yet:
edgeq/convert/plan.py), check the output and the disk, then per tensor: read a row block (positioned reads, no
mmap), quantise, pack into the kernel's layout, append to the output shard (edgeq/convert/stream.py); then the
manifest, config.json, the model card and the tokenizer files (edgeq/convert/records.py), and a re-check of what was
written (edgeq/convert/verify.py). Peak memory is one row block's working set, whatever the model size. What differs
between the layouts (tensors, bytes, shape rules, packing, the layout record, verification) is asked of the kernel's
layout (:func:`edgeq.layouts.base.get`) and packer (:func:`edgeq.convert.packers.packer`), never branched on here.

All output goes to a temporary sibling directory that is renamed into place (fsynced) only after the result has been
re-opened and checked (head quantised, shapes, shard hashes). Any failure, Ctrl-C or SIGTERM removes it; leftovers of
a killed run are removed by the next run to the same output; the input is only ever read, and an output that is,
contains or lies inside an input is refused (edgeq/io/writer.py).

Three inputs/methods share this pipeline:

- a float checkpoint with ``rtn`` (default) or ``minmax``: per tensor, per row block, as above (either layout);
- a GPTQ checkpoint (``quant_method: "gptq"``): planned by :mod:`edgeq.convert.ingest_gptq` and streamed by
  :mod:`edgeq.convert.ingest_stream` (exact repack onto tinygemm, method recorded as ``gptq-ingest``);
- a float checkpoint with ``gptq``: :func:`edgeq.convert.calibrate.gptq_model` calibrates one decoder layer at a
  time and :mod:`edgeq.convert.calibrated` writes its results in a declared order (tinygemm only).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from edgeq.convert.calibrated import GROUP_PARAMS, TARGETS, GPTQOptions, calibration, gptq_plan, stream_gptq, write_order
from edgeq.convert.embeddings import describe as describe_embeddings
from edgeq.convert.embeddings import format_version, pack_plan, resolve_head_levels, resolve_storage
from edgeq.convert.gptqmodel import METHOD as GPTQMODEL
from edgeq.convert.gptqmodel import gptqmodel_plan, quantized
from edgeq.convert.ingest_config import read_gptq_config
from edgeq.convert.ingest_gptq import build_gptq_plan
from edgeq.convert.packers import packer
from edgeq.convert.plan import Plan, build_plan, recipe_warnings
from edgeq.convert.recipe import Recipe, find_recipe
from edgeq.convert.records import copy_aux, manifest, notes, tokenizer_problem, write_config
from edgeq.convert.stream import Progress, check_finite, rss
from edgeq.convert.stream import stream as _stream  # a module global: tests replace it
from edgeq.convert.verify import verify_written
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint, open_checkpoint
from edgeq.io.safetensors import DTYPES, OutSpec, ShardedWriter
from edgeq.io.skeleton import config_model, config_problems, output_head
from edgeq.io.writer import prepare_output, say, staging
from edgeq.keys import Action, Role
from edgeq.quantize.rtn import METHODS
from edgeq.scheme import Scheme

DEFAULT_SHARD_BYTES = 2 << 30

# what callers outside edgeq/convert/ import from here (GPTQOptions lives in edgeq/convert/calibrated.py)
__all__ = ["ConvertReport", "convert", "prepare"]


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
    notes: tuple[str, ...] = ()  # reported choices (head handling, requantised layers, calibration), one line each
    details: dict = field(default_factory=dict)  # the manifest's method record (GPTQ ingest / calibration)
    layout: str = ""  # the packed layout written, and why (the kernel's Packer.describe)
    warnings: tuple[str, ...] = ()  # also printed on stderr (e.g. no tokenizer files)
    embeddings: dict = field(default_factory=dict)  # the input embedding as written (convert/embeddings.py describe)

    @property
    def ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else 0.0


def resolve_source(src: str | Path) -> Path:
    """A local directory, or a hub id (``org/name``): :func:`edgeq.io.hub.resolve_model`, the one resolver of every
    command (cache, offline mode, revision)."""
    from edgeq.io.hub import resolve_model

    return resolve_model(src)


def _check_config(ckpt: Checkpoint, recipe: Recipe, plan: Plan) -> None:
    """A float checkpoint whose tensors do not match its config.json is refused (the staging directory removed): the
    result would be a checkpoint that every loader refuses. For `rtn` checked after the write, not before: the
    meta-device model imports transformers' modeling code (~110 MiB resident), which would raise the streaming's peak
    memory, and the write takes ~2 minutes for a 1B model. Calibrated methods import that code anyway and run for
    minutes to hours (`--recipe quality --calib self`: 15-30 min for a 1B model on 2 cores): checked before them."""
    model = config_model(ckpt.root)
    actual = output_head(model)
    if actual is not None and actual != recipe.head:  # written under another name, no loader would find the head
        raise EdgeqError(f"recipe {recipe.name} ({recipe.source}): head = {recipe.head!r}, but the output head of the "
                         f"model {ckpt.root}/config.json describes is {actual!r}; set the recipe's head to it")
    linears = [e.source for e in plan.entries if e.action == Action.QUANTIZE and e.role == Role.LINEAR]
    problems = config_problems(model, {n: t.shape for n, t in ckpt.tensors.items()}, recipe.head, linears)
    if problems:
        raise EdgeqError(f"{ckpt.root}: the weights do not match config.json ({len(problems)} problem(s): "
                         f"{'; '.join(problems[:3])}); the checkpoint is incomplete or its config.json belongs to "
                         f"another model")


def refuse_quantized_input(ckpt: Checkpoint) -> None:
    """Any quantised input but GPTQ (which :func:`read_gptq_config` accepts first) is refused."""
    q = ckpt.quantization_config
    if q is not None:
        method = q.get("quant_method", "?")
        raise EdgeqError(
            f"{ckpt.root / 'config.json'}: the input is already quantised (quant_method={method!r}); "
            "give edgeq the original float checkpoint"
        )


def prepare(src: str | Path, scheme: Scheme | None, method: str | None, recipe_name: str | None, *,
            requantize: bool = False, head_from: str | Path | None = None,
            gptq: GPTQOptions | None = None, embeddings: str | None = None,
            head_levels: int | None = None) -> tuple[Checkpoint, Plan, Recipe]:
    """Headers -> recipe -> plan, with the embedding table packed or not (``embeddings``: ``--embeddings``, else
    the recipe's; edgeq/convert/embeddings.py) and the head's levels (``head_levels``: ``--head-levels``, else the
    recipe's). Nothing but headers and config is read (GPTQ input: also each layer's g_idx)."""
    ckpt, plan, recipe = _prepare(src, scheme, method, recipe_name, requantize=requantize, head_from=head_from, gptq=gptq)
    storage = resolve_storage(embeddings, recipe, plan.scheme)
    plan = pack_plan(plan, recipe, storage, explicit=embeddings is not None)
    return ckpt, resolve_head_levels(head_levels, recipe, plan), recipe


def _prepare(src: str | Path, scheme: Scheme | None, method: str | None, recipe_name: str | None, *,
             requantize: bool = False, head_from: str | Path | None = None,
             gptq: GPTQOptions | None = None) -> tuple[Checkpoint, Plan, Recipe]:
    """:func:`prepare` before the embedding choice. ``requantize`` / ``head_from`` apply to GPTQ input, ``gptq``
    (options) to ``method="gptq"``."""
    ckpt = open_checkpoint(resolve_source(src))
    gcfg = read_gptq_config(ckpt)  # refuses every other quantised format
    recipe = find_recipe(recipe_name, ckpt.config.get("model_type"))
    if gcfg is not None:
        if scheme is not None:
            packer(scheme.kernel).check_options(scheme, method or recipe.method, gptq_input=True)
        if method is not None and method not in METHODS + ("gptq", GPTQMODEL):
            raise EdgeqError(f"unknown method {method!r}; valid: {', '.join(METHODS)} (for what is requantised)")
        if method in ("gptq", GPTQMODEL) or gptq is not None:
            raise EdgeqError(f"{src}: the input is already GPTQ-quantised; edgeq repacks it exactly (drop --method gptq "
                             "and the calibration options), or calibrate the original float model")
        plan = build_gptq_plan(ckpt, gcfg, scheme, method or recipe.method, recipe, requantize=requantize,
                               head_from=head_from)
        return ckpt, plan, recipe
    if method is not None and method not in METHODS + ("gptq", GPTQMODEL):
        raise EdgeqError(f"unknown method {method!r}; valid: {', '.join(METHODS + ('gptq', GPTQMODEL))}")
    refuse_quantized_input(ckpt)
    if requantize or head_from is not None:
        raise EdgeqError(f"{src}: --requantize and --head-from apply to GPTQ input; this checkpoint is not quantised")
    method = method or recipe.method
    if gptq is not None and method not in ("gptq", GPTQMODEL):
        raise EdgeqError(f"--calib, --nsamples, --seqlen, --act-order, --damp, --gptq-params and --gptq-target apply to "
                         f"--method gptq (the first five also to gptqmodel), not to --method {method}")
    if gptq is not None and method == GPTQMODEL and (gptq.group_params, gptq.target) != (GROUP_PARAMS[0], TARGETS[0]):
        raise EdgeqError("--gptq-params and --gptq-target choose how edgeq's own GPTQ sweep works; GPTQModel "
                         "(--method gptqmodel) has its own: drop them, or use --method gptq")
    scheme = scheme or Scheme.parse(recipe.scheme)
    packer(scheme.kernel).check_options(scheme, method)
    if method == "gptq":
        return ckpt, gptq_plan(ckpt, scheme, recipe, gptq or GPTQOptions()), recipe
    if method == GPTQMODEL:  # GPTQModel's quantiser (the gptq extra), its output ingested exactly at convert time
        return ckpt, gptqmodel_plan(ckpt, scheme, recipe, gptq or GPTQOptions()), recipe
    return ckpt, build_plan(ckpt, scheme, method, recipe), recipe


HEADROOM = 64 << 20  # free space asked for beyond the checkpoint's bytes (the manifest, the card, the file system)


def _check_output(out: Path, force: bool, need: int) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise EdgeqError(f"{out}: exists and is not empty; choose another -o or pass --force to replace it")
    parent = out.parent if out.parent.exists() else None
    if parent is None:
        raise EdgeqError(f"{out.parent}: no such directory for the output")
    free = shutil.disk_usage(parent).free
    if free < need + HEADROOM:
        raise EdgeqError(f"{parent}: {free / 2**20:.0f} MiB free, the output needs {need / 2**20:.0f} MiB plus "
                         f"{HEADROOM >> 20} MiB of headroom; free space or choose another -o")


def _inputs(ckpt: Checkpoint, plan: Plan) -> list[Path]:
    """Everything the conversion reads, which no output may replace or contain: the model directory, its weight
    files (they may be symlinks into another directory, as in the hub cache), --head-from, --calib."""
    found = [ckpt.root, *ckpt.files, *(Path(e.origin) for e in plan.entries if e.origin)]
    if plan.method in ("gptq", GPTQMODEL) and plan.options.calib_file is not None:  # None: --calib self
        found.append(plan.options.calib_file)
    return found


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
    *,
    requantize: bool = False,
    head_from: str | Path | None = None,
    gptq: GPTQOptions | None = None,
    embeddings: str | None = None,
    head_levels: int | None = None,
) -> ConvertReport:
    """Quantise ``src`` into the directory ``out`` (see the module docstring); ``prepared``: :func:`prepare`'s
    result, when the caller already has it (the CLI's plan table)."""
    t0 = time.perf_counter()
    ckpt, plan, rec = prepared or prepare(src, scheme, method, recipe, requantize=requantize, head_from=head_from,
                                          gptq=gptq, embeddings=embeddings, head_levels=head_levels)
    plan.check()
    layout = packer(plan.scheme.kernel).record(plan.scheme)
    out = Path(out).resolve()
    prepare_output(out, _inputs(ckpt, plan))
    _check_output(out, force, plan.bytes_out)
    float_input = ckpt if not plan.source else None  # GPTQ input: its config describes another layout
    early = float_input is not None and plan.method in ("gptq", GPTQMODEL)
    if early:  # a calibrated conversion runs for minutes to hours and imports the modeling code anyway
        _check_config(float_input, rec, plan)
        check_finite(float_input, sorted({e.source for e in plan.entries if e.source in float_input.tensors}))
    windows, calib = calibration(ckpt, plan) if plan.method == "gptq" else (None, None)
    with staging(out, "tmp") as tmp:  # SIGTERM and Ctrl-C remove it; at the end: renamed to out, fsynced
        with quantized(ckpt, plan, rec, tmp) as (ckpt, plan):  # gptqmodel: GPTQModel's output in tmp, ingested exactly
            stats, digests = _write(ckpt, plan, layout, tmp, Progress(progress), max_shard_bytes, windows, calib)
        if float_input is not None and not early:
            _check_config(float_input, rec, plan)
    # after the write: an error stays the one stderr line
    warnings = recipe_warnings(plan, rec) + [w for w in (tokenizer_problem(ckpt.root),) if w]
    for w in warnings:
        say(f"warning: {w}")
    errs = stats["errors"]
    worst = max(errs, key=errs.get)
    return ConvertReport(
        out=str(out), scheme=str(plan.scheme), method=plan.method, recipe=rec.name, tensors=len(plan.entries),
        quantized=len(errs), bytes_in=plan.bytes_in, bytes_out=sum((out / f).stat().st_size for f in digests),
        seconds=time.perf_counter() - t0, peak_rss_bytes=rss()[1], peak_rss_anon_bytes=stats["anon_peak"],
        mean_relative_error=sum(errs.values()) / len(errs), worst_relative_error=errs[worst], worst_tensor=worst,
        head_source=plan.head.source, untied=plan.tied, layout_hash=layout.layout_hash, shards=digests,
        notes=tuple(notes(plan, stats["details"])), details=stats["details"],
        layout=packer(plan.scheme.kernel).describe(layout), warnings=tuple(warnings),
        embeddings={**describe_embeddings(plan), **stats.get("embeddings", {})},
    )


def _write(ckpt: Checkpoint, plan: Plan, layout, tmp: Path, progress: Progress, max_shard_bytes: int, windows,
           calib: dict | None) -> tuple[dict, dict]:
    """Everything into the staging directory ``tmp``: the shards (streamed), the manifest, config.json and the
    card, the tokenizer files; then the written result is re-opened and checked. Returns (stream stats, {shard:
    sha256}); a failure aborts the writer (the staging directory is removed by the caller)."""
    writer = None
    try:
        order = write_order(plan)
        specs = [OutSpec(n, DTYPES[d][0], s) for e in order for n, d, s in e.out_tensors(plan.scheme)]
        writer = ShardedWriter(tmp, specs, max_shard_bytes, metadata={"edgeq_format_version": str(format_version(plan))})
        if plan.method == "gptq":
            stats = stream_gptq(ckpt, plan, order, layout, writer, progress, windows)
            stats["details"] = {"gptq": {"calibration": calib, **stats["details"]}}
        else:
            stats = _stream(ckpt, plan, layout, writer, progress)
        digests = writer.close()
        written = manifest(plan, layout, digests, order, stats["details"])
        written.write(tmp)
        write_config(ckpt, tmp, plan, layout, written)
        copy_aux(ckpt.root, tmp)
        verify_written(tmp, plan.head_module)  # assertion 3 of 3 (2 was the plan's): re-open what was written
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return stats, digests
