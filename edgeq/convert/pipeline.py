"""``edgeq quantize``: a Hugging Face checkpoint -> one tinygemm-packed W4A16 checkpoint, streamed tensor by tensor.

Order of work: resolve the input, read headers, build and check the plan (no weight read yet), check the output
and the disk, then per tensor: read a row block (positioned reads, no mmap), quantise, pack with the kernel's own
op, append to the output shard. Peak memory is one row block's working set, whatever the model size.

All output goes to a temporary sibling directory that is renamed into place (fsynced) only after the result has been
re-opened and checked (head quantised, shapes, shard hashes). Any failure, Ctrl-C or SIGTERM removes it; leftovers of
a killed run are removed by the next run to the same output; the input is only ever read, and an output that is,
contains or lies inside an input is refused (edgeq/io/writer.py).

Three inputs/methods share this pipeline:

- a float checkpoint with ``rtn`` (default) or ``minmax``: per tensor, per row block, as above;
- a GPTQ checkpoint (``quant_method: "gptq"``): planned and streamed by :mod:`edgeq.convert.ingest_gptq` (exact repack,
  method recorded as ``gptq-ingest``);
- a float checkpoint with ``gptq``: :func:`edgeq.convert.calibrate.gptq_model` calibrates one decoder layer at a time and
  yields results in execution order. The writer needs a declared order, so the quantised tensors are declared in
  the predicted execution order (layer by layer, q/k/v/o/gate/up/down, then the head) after every copied tensor; a
  result that arrives before its turn is held (packed, N*K/2 bytes) until it is due. Peak memory: the driver's
  (one layer, the calibration activations) plus whatever is held, normally nothing.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

import edgeq
from edgeq.io.manifest import FORMAT_VERSION, Manifest, read_manifest
from edgeq.convert.plan import HEAD_MODULE, Plan, PlanEntry, build_plan, quantized_bytes
from edgeq.convert.plan import group_sizes as plan_group_sizes
from edgeq.io.hf import TOKENIZER_FILES, Checkpoint, open_checkpoint
from edgeq.convert.recipe import Recipe, find_recipe
from edgeq.io.writer import prepare_output, say, staging
from edgeq.io.safetensors import DTYPES, OutSpec, ShardedWriter, read_header, sha256_file
from edgeq.convert import w4a8 as convert_w4a8
from edgeq.convert import ingest_gptq as ingest
from edgeq.keys import DATA
from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.quantize.rtn import METHODS, quantize_groups
from edgeq.scheme import Scheme

AUX_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
)
ROW_BLOCK_ELEMENTS = 4 << 20  # ~4M weights per block: the quantiser's fp32 working set stays ~100 MB
DEFAULT_SHARD_BYTES = 2 << 30
DEFAULT_CALIB = DATA / "calib-prose.txt"  # disjoint from heldout-prose.txt (fidelity's text)
_IN_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # the driver's execution order in the supported families
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class GPTQOptions:
    """``--method gptq`` settings: calibration text, windows, act-order, dampening (docs/gptq.md)."""

    calib: str = str(DEFAULT_CALIB)
    nsamples: int = 128
    seqlen: int = 512
    act_order: bool = False
    damp: float = 0.01
    block_size: int = 128

    def check(self) -> None:
        if self.nsamples < 1 or self.seqlen < 2:
            raise EdgeqError(f"--nsamples {self.nsamples} / --seqlen {self.seqlen}: need at least 1 window of at least 2 tokens")
        if not 0.0 < self.damp <= 1.0:
            raise EdgeqError(f"--damp {self.damp}: must be in (0, 1] (a fraction of the mean Hessian diagonal; default 0.01)")
        if not Path(self.calib).is_file():
            raise EdgeqError(f"--calib {self.calib}: no such file; give a UTF-8 text file")


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
    layout: str = ""  # the packed layout written, and why (describe_layout)
    warnings: tuple[str, ...] = ()  # also printed on stderr (e.g. no tokenizer files)

    @property
    def ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else 0.0


def resolve_source(src: str | Path) -> Path:
    """A local directory, or a hub id (``org/name``): :func:`edgeq.io.hub.resolve_model`, the one resolver of every
    command (cache, offline mode, revision)."""
    from edgeq.io.hub import resolve_model

    return resolve_model(src)


def refuse_quantized_input(ckpt: Checkpoint) -> None:
    q = ckpt.quantization_config
    if q is not None:
        method = q.get("quant_method", "?")
        raise EdgeqError(
            f"{ckpt.root / 'config.json'}: the input is already quantised (quant_method={method!r}); "
            "give edgeq the original float checkpoint"
        )


def prepare(src: str | Path, scheme: Scheme | None, method: str | None, recipe_name: str | None, *,
            requantize: bool = False, head_from: str | Path | None = None,
            gptq: GPTQOptions | None = None) -> tuple[Checkpoint, Plan, Recipe]:
    """Headers -> recipe -> plan. Nothing but headers and config is read (GPTQ input: also each layer's g_idx).

    ``requantize`` / ``head_from`` apply to GPTQ input, ``gptq`` (options) to ``method="gptq"``."""
    ckpt = open_checkpoint(resolve_source(src))
    gcfg = ingest.read_gptq_config(ckpt)  # refuses every other quantised format
    recipe = find_recipe(recipe_name, ckpt.config.get("model_type"))
    if gcfg is not None:
        if scheme is not None and convert_w4a8.is_w4a8(scheme):
            convert_w4a8.check_options(scheme, method or recipe.method, gptq_input=True)
        if method is not None and method not in METHODS + ("gptq",):
            raise EdgeqError(f"unknown method {method!r}; valid: {', '.join(METHODS)} (for what is requantised)")
        if method == "gptq" or gptq is not None:
            raise EdgeqError(f"{src}: the input is already GPTQ-quantised; edgeq repacks it exactly (drop --method gptq "
                             "and the calibration options), or calibrate the original float model")
        plan = ingest.build_gptq_plan(ckpt, gcfg, scheme, method or recipe.method, recipe, requantize=requantize,
                                      head_from=head_from)
        return ckpt, plan, recipe
    if method is not None and method not in METHODS + ("gptq",):
        raise EdgeqError(f"unknown method {method!r}; valid: {', '.join(METHODS + ('gptq',))}")
    refuse_quantized_input(ckpt)
    if requantize or head_from is not None:
        raise EdgeqError(f"{src}: --requantize and --head-from apply to GPTQ input; this checkpoint is not quantised")
    method = method or recipe.method
    if gptq is not None and method != "gptq":
        raise EdgeqError("--calib, --nsamples, --seqlen, --act-order and --damp apply to --method gptq")
    scheme = scheme or Scheme.parse(recipe.scheme)
    if convert_w4a8.is_w4a8(scheme):
        convert_w4a8.check_options(scheme, method)
    if method == "gptq":
        return ckpt, _gptq_plan(ckpt, scheme, recipe, gptq or GPTQOptions()), recipe
    return ckpt, build_plan(ckpt, scheme, method, recipe), recipe


def _gptq_plan(ckpt: Checkpoint, scheme: Scheme, recipe: Recipe, opts: GPTQOptions) -> Plan:
    """The float plan with method gptq; with act-order every quantised output also carries M.perm."""
    from edgeq.convert.calibrate import SUPPORTED_MODEL_TYPES

    opts.check()
    model_type = ckpt.config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise EdgeqError(f"{ckpt.root / 'config.json'}: model_type {model_type!r} is not supported by GPTQ calibration "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use --method rtn")
    plan = build_plan(ckpt, scheme, "gptq", recipe)
    if opts.act_order:
        entries = tuple(
            replace(e, perm=True, bytes_out=quantized_bytes(*e.shape, e.group(scheme), True)) if e.quantized and e.bytes_out else e
            for e in plan.entries
        )
        plan = replace(plan, entries=entries)
    return replace(plan, options=opts)


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
    *,
    requantize: bool = False,
    head_from: str | Path | None = None,
    gptq: GPTQOptions | None = None,
) -> ConvertReport:
    t0 = time.perf_counter()
    ckpt, plan, rec = prepared or prepare(src, scheme, method, recipe, requantize=requantize, head_from=head_from, gptq=gptq)
    plan.check()
    layout = convert_w4a8.layout_record(plan.scheme) if convert_w4a8.is_w4a8(plan.scheme) else tinygemm.probe()
    out = Path(out).resolve()
    prepare_output(out, _inputs(ckpt, plan))
    _check_output(out, force, plan.bytes_out + (64 << 20))
    windows, calib = _calibration(ckpt, plan) if plan.method == "gptq" else (None, None)
    with staging(out, "tmp") as tmp:  # SIGTERM and Ctrl-C remove it; at the end: renamed to out, fsynced
        writer = None
        try:
            order = write_order(plan)
            specs = [OutSpec(n, DTYPES[d][0], s) for e in order for n, d, s in e.out_tensors(plan.scheme)]
            writer = ShardedWriter(tmp, specs, max_shard_bytes, metadata={"edgeq_format_version": str(FORMAT_VERSION)})
            if plan.method == "gptq":
                stats = _stream_gptq(ckpt, plan, order, layout, writer, _Progress(progress), windows)
                stats["details"] = {"gptq": {"calibration": calib, **stats["details"]}}
            else:
                stats = _stream(ckpt, plan, layout, writer, _Progress(progress))
            digests = writer.close()
            manifest = _manifest(plan, layout, digests, order, stats["details"])
            manifest.write(tmp)
            _write_config(ckpt, tmp, plan, layout, manifest)
            _copy_aux(ckpt.root, tmp)
            verify_written(tmp)  # assertion 3 of 3 (2 was the plan's): re-open what was written
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
    warnings = [w for w in (tokenizer_problem(ckpt.root),) if w]  # after the write: an error stays the one stderr line
    for w in warnings:
        say(f"warning: {w}")
    anon_peak, rss_peak = stats["anon_peak"], _rss()[1]
    errs = stats["errors"]
    worst = max(errs, key=errs.get)
    return ConvertReport(
        out=str(out), scheme=str(plan.scheme), method=plan.method, recipe=rec.name, tensors=len(plan.entries),
        quantized=len(errs), bytes_in=plan.bytes_in, bytes_out=sum((out / f).stat().st_size for f in digests),
        seconds=time.perf_counter() - t0, peak_rss_bytes=rss_peak, peak_rss_anon_bytes=anon_peak,
        mean_relative_error=sum(errs.values()) / len(errs), worst_relative_error=errs[worst], worst_tensor=worst,
        head_source=plan.head.source, untied=plan.tied, layout_hash=layout.layout_hash, shards=digests,
        notes=tuple(_notes(plan, stats["details"])), details=stats["details"], layout=describe_layout(layout),
        warnings=tuple(warnings),
    )


def _inputs(ckpt: Checkpoint, plan: Plan) -> list[Path]:
    """Everything the conversion reads, which no output may replace or contain: the model directory, its weight
    files (they may be symlinks into another directory, as in the hub cache), --head-from, --calib."""
    found = [ckpt.root, *ckpt.files, *(Path(e.origin) for e in plan.entries if e.origin)]
    if plan.method == "gptq":
        found.append(Path(plan.options.calib))
    return found




def tokenizer_problem(directory: Path) -> str | None:
    """Why ``generate`` and ``serve`` could not encode text with this directory's files; None when they could.
    A warning at quantize time (token-id users such as fidelity and bench need no tokenizer), a problem in inspect."""
    if any((Path(directory) / f).is_file() for f in TOKENIZER_FILES):
        return None
    return (f"{directory}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); `edgeq generate` and `serve` "
            "cannot encode text without them; copy the original model's tokenizer files next to the weights")


def describe_layout(layout) -> str:
    """The packed layout written, and why: the summary line of ``edgeq quantize``. Under ATEN_CPU_CAPABILITY torch
    packs for the forced ISA (e.g. AVX2, 32-row blocks on an AVX512 CPU), and a process without it repacks at load."""
    if isinstance(layout, convert_w4a8.W4A8Layout):
        return f"amx_w4a8 {layout.layout_hash[:12]} (fixed bytes, the same on every CPU)"
    text = f"tinygemm {layout.cpu_capability} {layout.layout_hash[:12]} ({layout.block_n}-row blocks"
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if not forced:
        return text + ", torch's dispatch on this CPU)"
    return text + (f", because ATEN_CPU_CAPABILITY={forced} is set; a process without it may use another layout "
                   "and repack at every load: unset it and re-run, or `edgeq repack` where the model runs)")


def write_order(plan: Plan) -> list[PlanEntry]:
    """The order tensors are declared (and written) in: the plan's, except for ``gptq``, which writes every copied
    tensor first and then the quantised ones in the driver's predicted execution order, head last."""
    if plan.method != "gptq":
        return list(plan.entries)
    rest = [e for e in plan.entries if not e.quantized]
    return rest + sorted((e for e in plan.entries if e.quantized), key=_execution_key)


def _execution_key(e: PlanEntry) -> tuple:
    if e.role == "head":
        return (2, 0, 0, "")
    m = _LAYER.search(e.module)
    if m is None:
        return (0, 0, 0, e.module)  # outside the decoder layers: the driver never yields it, which is an error later
    tail = e.module[m.end():]
    return (1, int(m.group(1)), _IN_LAYER.index(tail) if tail in _IN_LAYER else len(_IN_LAYER), tail)


def _stream(ckpt: Checkpoint, plan: Plan, layout: tinygemm.TinygemmLayout, writer: ShardedWriter, progress: _Progress) -> dict:
    errors: dict[str, float] = {}
    ingested: dict[str, ingest.EntryStats] = {}
    anon_peak = 0
    for e in plan.entries:
        if e.gptq is not None:
            st = ingest.stream_entry(ckpt, e, plan.scheme, layout, writer, progress)
            ingested[e.module] = st
            if e.quantized:
                errors[e.module] = st.rel_error
        elif e.action == "quantize" and convert_w4a8.is_w4a8(plan.scheme):
            src = open_checkpoint(e.origin) if e.origin else ckpt
            itemsize = src.tensors[e.source].itemsize
            errors[e.module] = convert_w4a8.quantize_entry(
                lambda a, b: src.read(e.source, (a, b)), *e.shape, plan.scheme, e.method or plan.method, e.source,
                writer.write, progress=lambda rows: progress(rows * e.shape[1] * itemsize, e.name), module=e.module)
        elif e.action == "quantize":
            errors[e.module] = _quantize_entry(ckpt, e, plan, layout, writer, progress)
        else:
            _copy_entry(ckpt, e, writer, progress)
        anon_peak = max(anon_peak, _rss()[0])
    details = ingest.ingest_summary(plan, ingested) if plan.method == ingest.METHOD else {}
    return {"errors": errors, "anon_peak": anon_peak, "details": details}


def _copy_entry(ckpt: Checkpoint, e: PlanEntry, writer: ShardedWriter, progress: _Progress) -> None:
    info = ckpt.tensors[e.source]
    rows = info.shape[0] if info.shape else 1
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, info.numel // max(rows, 1))) if info.shape else 1
    for a in range(0, rows, step):
        block = ckpt.read(e.source, (a, min(rows, a + step)) if info.shape else None)
        if not bool(torch.isfinite(block).all()):
            raise EdgeqError(f"{info.file}: tensor {e.source} has NaN/Inf values; fix or re-export the checkpoint")
        writer.write(e.name, block.to(torch.bfloat16))
        progress(block.numel() * info.itemsize, e.name)


def _quantize_entry(ckpt: Checkpoint, e: PlanEntry, plan: Plan, layout, writer: ShardedWriter, progress: _Progress) -> float:
    """Quantise one weight in row blocks of whole layout blocks; returns its relative reconstruction error."""
    src = open_checkpoint(e.origin) if e.origin else ckpt  # --head-from: another model's head
    info = src.tensors[e.source]
    n, k = e.shape
    step = min(n, tinygemm.row_block(layout, ROW_BLOCK_ELEMENTS // k))
    sq_err = sq_norm = 0.0
    sz_parts = []
    for a in range(0, n, step):
        b = min(n, a + step)
        w = src.read(e.source, (a, b))
        qt = quantize_groups(w, e.group(plan.scheme), e.method or plan.method, name=f"{e.source} rows {a}..{b}")
        tinygemm.check_values(qt.q, e.source)
        writer.write(f"{e.module}.qweight", tinygemm._op_pack(qt.q))
        sz_parts.append(qt.scales_and_zeros)
        sq_err += float(qt.sq_error.sum())
        sq_norm += float(qt.sq_norm.sum())
        progress(w.numel() * info.itemsize, e.name)
    writer.write(f"{e.module}.scales_and_zeros", torch.cat(sz_parts, dim=1))
    return (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0


# --------------------------------------------------------------------------------------------------- --method gptq
def _calibration(ckpt: Checkpoint, plan: Plan) -> tuple[torch.Tensor, dict]:
    """Token windows from the --calib text (the model's tokenizer), and their record for the manifest."""
    import hashlib

    from edgeq.convert.calibrate import calibration_windows

    opts: GPTQOptions = plan.options
    path = Path(opts.calib)
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except OSError as e:
        raise EdgeqError(f"--calib {path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise EdgeqError(f"--calib {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    windows = calibration_windows(ckpt.root, text, opts.nsamples, opts.seqlen)
    record = {"file": path.name, "sha256": hashlib.sha256(raw).hexdigest(), "windows": int(windows.shape[0]),
              "seqlen": int(windows.shape[1]), "tokens": int(windows.numel()), "nsamples_asked": opts.nsamples}
    return windows, record


class _InOrder:
    """Writes each module's tensors in the writer's declared order; a module that arrives early is held until due.

    ``held_peak`` is the most bytes ever held (0 when the driver's order is the predicted one)."""

    def __init__(self, writer: ShardedWriter, modules: list[str]):
        self.writer, self.modules, self.i = writer, modules, 0
        self.pending: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self.held = self.held_peak = 0

    def put(self, module: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.pending[module] = tensors
        self.held += sum(t.numel() * t.element_size() for _, t in tensors)
        while self.i < len(self.modules) and self.modules[self.i] in self.pending:
            for name, t in self.pending.pop(self.modules[self.i]):
                self.writer.write(name, t)
                self.held -= t.numel() * t.element_size()
            self.i += 1
        self.held_peak = max(self.held_peak, self.held)

    def missing(self) -> list[str]:
        return self.modules[self.i:]


def _pack_result(e: PlanEntry, r, layout) -> list[tuple[str, torch.Tensor]]:
    """A GPTQResult as the tensors this entry declared: packed qweight (row blocks), scales_and_zeros, perm."""
    n, k = e.shape
    if tuple(r.q.shape) != (n, k):
        raise EdgeqError(f"{e.module}: GPTQ produced q {list(r.q.shape)}, the plan expects [{n}, {k}]")
    if (r.perm is not None) != e.perm:
        raise EdgeqError(f"{e.module}: GPTQ {'returned' if r.perm is not None else 'did not return'} an input permutation, "
                         f"the plan {'expects' if e.perm else 'does not expect'} one")
    tinygemm.check_values(r.q, e.module)
    step = min(n, tinygemm.row_block(layout, ROW_BLOCK_ELEMENTS // k))
    packed = torch.cat([tinygemm._op_pack(r.q[a : a + step]) for a in range(0, n, step)])
    out = [(f"{e.module}.qweight", packed), (f"{e.module}.scales_and_zeros", r.scales_and_zeros.contiguous())]
    if e.perm:
        out.append((f"{e.module}.perm", r.perm.to(torch.int64).contiguous()))
    return out


def _stream_gptq(ckpt: Checkpoint, plan: Plan, order: list[PlanEntry], layout, writer: ShardedWriter,
                 progress: _Progress, windows: torch.Tensor) -> dict:
    """Copies first, then every quantised module as the layer-streamed GPTQ driver yields it."""
    from edgeq.convert.calibrate import gptq_model

    opts: GPTQOptions = plan.options
    anon_peak = 0
    for e in order:
        if e.quantized:
            break
        _copy_entry(ckpt, e, writer, progress)
    quantized = [e for e in order if e.quantized]
    by_module = {e.module: e for e in quantized}
    sink = _InOrder(writer, [e.module for e in quantized])
    t0, layers = time.perf_counter(), {"done": 0, "total": 1}

    def layer_done(done: int, total: int, label: str) -> None:
        layers.update(done=done, total=total)
        progress(0, _eta_label(done, total, t0, label))

    errors, rel_out, damp_used = {}, {}, {}
    keep = frozenset(e.module for e in plan.entries if e.action == "keep")
    results = gptq_model(ckpt.root, windows, plan.scheme, damp=opts.damp, act_order=opts.act_order,
                         block_size=opts.block_size, keep=keep, head_source=plan.head.source,
                         group_sizes=plan_group_sizes(plan), progress=layer_done)
    try:
        for name, r in results:
            e = by_module.get(name)
            if e is None or name in errors:
                raise EdgeqError(f"{name}: GPTQ calibration produced a module the plan does not quantise (or twice); "
                                 "use --method rtn for this model")
            sink.put(name, _pack_result(e, r, layout))
            errors[name], rel_out[name] = r.relative_error, r.relative_output_error
            if r.damp != opts.damp:
                damp_used[name] = r.damp
            progress(e.bytes_in, _eta_label(layers["done"], layers["total"], t0, name))
            anon_peak = max(anon_peak, _rss()[0])
    finally:
        results.close()
    if sink.missing():
        miss = sink.missing()
        raise EdgeqError(f"GPTQ calibration did not produce {len(miss)} planned module(s), e.g. {miss[:3]}; "
                         "they are not Linears of the decoder layers; use --method rtn for this model")
    details = {"act_order": opts.act_order, "damp": opts.damp, "block_size": opts.block_size,
               "damp_escalated": damp_used, "relative_output_error": rel_out, "held_peak_bytes": sink.held_peak}
    return {"errors": errors, "anon_peak": anon_peak, "details": details}


def _eta_label(done: int, total: int, t0: float, what: str) -> str:
    elapsed = time.perf_counter() - t0
    eta = f", ETA {elapsed / done * (total - done):.0f}s" if done else ""
    return f"layer {min(done + 1, total)}/{total}{eta}: {what}"


# -------------------------------------------------------------------------------------------------------- records
def _manifest(plan: Plan, layout: tinygemm.TinygemmLayout, digests: dict, order: list[PlanEntry] | None = None,
              details: dict | None = None) -> Manifest:
    tensors = {}
    for e in order or plan.entries:
        for name, dtype, shape in e.out_tensors(plan.scheme):
            rec = {"role": "perm" if name.endswith(".perm") else e.role, "source": e.source, "dtype": dtype, "shape": list(shape)}
            if e.action in ("repack", "requantize") or e.origin:
                rec["action"] = e.action
            if e.origin:
                rec["from"] = e.origin
            tensors[name] = rec
    head = {"name": HEAD_MODULE, "quantized": True, "source": plan.head.source, "untied": plan.tied}
    if plan.method != _float_method(plan):
        head["method"] = _head_method(plan)
    if plan.head.origin:
        head["from"] = plan.head.origin
    extra = dict(details or {})
    perms = [e.module for e in plan.entries if e.perm]
    if perms:
        extra["perm_modules"] = perms
    fields = dict(
        format_version=FORMAT_VERSION,
        scheme=str(plan.scheme),
        method=plan.method,
        kernel=plan.scheme.kernel,
        layout=layout.to_json(),
        head=head,
        quantized_modules=tuple(e.module for e in plan.entries if e.quantized),
        modules_not_converted={e.module: e.reason for e in plan.entries if e.action == "keep"},
        shards=digests,
        tensors=tensors,
        created_by={"edgeq": edgeq.__version__, "torch": torch.__version__, "recipe": plan.recipe},
        group_sizes=plan_group_sizes(plan),
        extra=extra,  # the method's records as extra top-level keys (readers ignore keys they do not know)
    )
    return Manifest(**fields)


def _float_method(plan: Plan) -> str:
    return plan.method if plan.method in METHODS else ""


def _head_method(plan: Plan) -> str:
    """How the head was made: "repack" (exact, GPTQ), "<rtn|minmax> (requantised ...)", or the plan's method."""
    h = plan.head
    if h.action == "repack":
        return "repack"
    if h.action == "requantize":
        return f"{h.method} (requantised from {h.gptq.bits}-bit GPTQ)"
    return h.method or plan.method


def _notes(plan: Plan, details: dict) -> list[str]:
    if plan.method == ingest.METHOD:
        lines = ingest.describe(plan)
        ex = details.get("exactness", {})
        if ex.get("repacked_modules"):
            lines.append(f"exactness: largest repack error {ex['max_error_over_scale']:.4f} of a quantisation step "
                         f"({ex['max_error_over_bound']:.2f} of the bf16 bound, {BOUND_SHORT})")
        return lines
    if plan.method == "gptq":
        g = details.get("gptq", {})
        c = g.get("calibration", {})
        lines = [f"GPTQ calibration: {c.get('windows')} windows x {c.get('seqlen')} tokens of {c.get('file')}, "
                 f"act_order={g.get('act_order')}, damp={g.get('damp')}"]
        if g.get("damp_escalated"):
            lines.append(f"dampening raised for {len(g['damp_escalated'])} module(s): {g['damp_escalated']}")
        return lines
    return []


BOUND_SHORT = "<= |s|/16"


def quantization_config(manifest: Manifest, plan: Plan, layout: tinygemm.TinygemmLayout) -> dict:
    """config.json's ``quantization_config``: edgeq's keys plus those every Hugging Face quantizer has (``bits``,
    ``sym``, ``modules_to_not_convert``); docs/format.md maps them to GPTQ, compressed-tensors and torchao."""
    w4a8 = convert_w4a8.is_w4a8(plan.scheme)
    return {
        "quant_method": "edgeq",
        "format_version": FORMAT_VERSION,
        "bits": 4,
        "group_size": plan.scheme.group_size,
        "sym": False,  # both kernels store a zero point per (group, output row)
        # amx_w4a8: w = (q - z) * s, z an integer 0..15; tinygemm_w4a16: w = (q - 8) * s + z, z a bf16 float
        "zero_point_domain": "int" if w4a8 else "float",
        "activation_bits": 8 if w4a8 else 16,
        "scheme": str(plan.scheme),
        "method": plan.method,
        "kernel": plan.scheme.kernel,
        "layout": layout.fingerprint(),
        "head_quantized": True,
        "untied": plan.tied,
        "modules_to_not_convert": sorted(manifest.modules_not_converted),
    }


def _write_config(ckpt: Checkpoint, tmp: Path, plan: Plan, layout, manifest: Manifest) -> None:
    """config.json, then the model card README.md made from it and the manifest (edgeq/convert/card.py)."""
    from edgeq.convert import card

    config = dict(ckpt.config)
    config["tie_word_embeddings"] = False  # the head is its own quantised tensor now
    config["dtype"] = "bfloat16"
    if "torch_dtype" in config:
        config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = quantization_config(manifest, plan, layout)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    card.write_card(tmp, source=card.source_name(ckpt.root))


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
    if manifest.kernel == convert_w4a8.KERNEL:
        convert_w4a8.verify_modules(directory, manifest.quantized_modules, g, found)
        return
    for m in manifest.quantized_modules:
        g = manifest.group_size(m)
        qw, sz = found.get(f"{m}.qweight"), found.get(f"{m}.scales_and_zeros")
        if qw is None or sz is None:
            raise EdgeqError(f"{directory}: quantised module {m} is missing its qweight or scales_and_zeros")
        n, half_k = qw.shape
        if qw.dtype != "U8" or sz.dtype != "BF16" or list(sz.shape) != [2 * half_k // g, n, 2]:
            raise EdgeqError(f"{directory}: {m}: qweight {qw.dtype} {list(qw.shape)} / scales_and_zeros {sz.dtype} {list(sz.shape)} do not fit G={g}")
        perm = found.get(f"{m}.perm")
        if perm is not None and (perm.dtype != "I64" or list(perm.shape) != [2 * half_k]):
            raise EdgeqError(f"{directory}: {m}.perm is {perm.dtype} {list(perm.shape)}, expected I64 [{2 * half_k}]")
    stray = sorted(n for n in found if n.endswith(".perm") and n.removesuffix(".perm") not in manifest.quantized_modules)
    if stray:
        raise EdgeqError(f"{directory}: {stray[0]} belongs to no quantised module; the checkpoint is inconsistent")
