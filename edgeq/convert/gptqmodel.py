"""``edgeq quantize --method gptqmodel``: GPTQModel's quantiser (the optional ``gptq`` extra) on the float model,
its GPTQ checkpoint then ingested exactly into the packed layout (edgeq/convert/ingest_gptq.py; docs/gptq.md).

Order of work, all inside the output's staging directory (removed on failure, Ctrl-C or SIGTERM like every
conversion; the GPTQ files are removed before the result is renamed into place):

1. :func:`gptqmodel_plan` (headers only, as ``--dry-run`` shows it): the float plan with method ``gptqmodel``; it
   refuses early, with one line, when gptqmodel cannot be found (``pip install 'edgeq[gptq]'``).
2. :func:`quantized`: calibration windows cut from ``--calib`` exactly as for ``--method gptq``
   (:func:`edgeq.convert.calibrated.calibration`), then GPTQModel's ``QuantizeConfig``: 4 bits, ``sym=False``
   (tinygemm stores a zero per group and output), ``group_size`` the scheme's, ``desc_act`` = ``--act-order``,
   ``damp_percent`` = ``--damp`` (the same quantity: a fraction of the mean Hessian diagonal), ``lm_head=True``, and
   ``dynamic`` overrides that give every module the group size the plan gives it (a recipe's group_sizes, e.g. the
   head and q/k/v/down at g32 under g128: one ``"(?:a|b)$"`` pattern per group size) and exclude the recipe's
   keep_bf16 modules. GPTQModel refuses a tied ``lm_head``: a tied model is handed to it as an untied *view* (the
   input's files symlinked, config.json with ``tie_word_embeddings: false``, the head written once from the
   embedding table, as edgeq's own rule unties it). GPTQModel's other settings are its defaults (recorded by the
   ingest from its config: damp_auto_increment, act_group_aware, mse, ...).
3. The GPTQ checkpoint GPTQModel saved is planned by :func:`edgeq.convert.ingest_gptq.build_gptq_plan` and every
   quantised module, head included, must be an exact ``repack`` at the group size the float plan gave it; anything
   else stops the conversion (it would not be GPTQModel's result). The pipeline then streams that plan as for any
   GPTQ input (exactness bound checked per block, recorded in the manifest's ``exactness``), with method
   ``gptqmodel``; the run's own record is the manifest's ``source.gptqmodel``.

GPTQModel 7.3.6 on a small machine: its CPU thread pool has a ``model_loader:cpu`` pool of 2 workers inside a
``cpu`` pool of ``(cpu_count + 1) // 2`` workers, which fails with 1 (2 cores); ``GPTQMODEL_CPU_WORKERS`` is set to
``max(2, torch threads)`` unless the user set it. It imports torchvision at import time for one vision model's
image preprocessing (InternVL); PyPI's torchvision wheels are CUDA builds that cannot load beside torch+cpu, so
when torchvision is absent that one GPTQModel module is replaced by a stand-in that refuses to be used.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import sys
import types
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from edgeq.convert.calibrated import GPTQOptions, calibrated_plan, calibration
from edgeq.convert.ingest_config import read_gptq_config
from edgeq.convert.ingest_gptq import build_gptq_plan
from edgeq.convert.plan import Plan, PlanEntry, build_plan
from edgeq.convert.recipe import Recipe
from edgeq.convert.selfcal import describe as describe_calibration
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint, open_checkpoint
from edgeq.io.safetensors import OutSpec, ShardedWriter
from edgeq.keys import CONFIG, WEIGHTS, WEIGHTS_INDEX, Action, Role
from edgeq.scheme import Scheme

METHOD = "gptqmodel"
EXTRA_HINT = "--method gptqmodel needs the gptq extra: pip install 'edgeq[gptq]'"
WORK_DIR = "_gptqmodel"  # inside the staging directory: GPTQModel's input view, its offload and its output
WORKERS_ENV = "GPTQMODEL_CPU_WORKERS"
_VIEW_WEIGHTS = "model-input.safetensors"  # the input's single weight file, linked under a name the index uses
_VIEW_HEAD = "model-untied-head.safetensors"
_ROW_BLOCK_ELEMENTS = 4 << 20  # the untied head is copied in row blocks of ~4M values
_STAND_IN = "gptqmodel.models.definitions.internvl_chat"

__all__ = ["EXTRA_HINT", "METHOD", "describe", "gptqmodel_plan", "quantized"]


def require() -> None:
    """Refuse ``--method gptqmodel`` without the gptq extra, before anything is read (a lookup, no import)."""
    try:
        found = importlib.util.find_spec("gptqmodel") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise EdgeqError(EXTRA_HINT)


def gptqmodel_plan(ckpt: Checkpoint, scheme: Scheme, recipe: Recipe, opts: GPTQOptions) -> Plan:
    """The float plan with method gptqmodel (what ``--dry-run`` shows); with act-order every quantised output also
    carries M.perm. The GPTQ checkpoint GPTQModel writes replaces it at conversion time (:func:`quantized`)."""
    require()
    opts.check()
    return calibrated_plan(build_plan(ckpt, scheme, METHOD, recipe), scheme, opts)


@contextlib.contextmanager
def quantized(ckpt: Checkpoint, plan: Plan, recipe: Recipe, staging: Path) -> Iterator[tuple[Checkpoint, Plan]]:
    """For a gptqmodel plan: run GPTQModel into ``staging/_gptqmodel`` and yield (the input with GPTQModel's
    tensors: :func:`ingest`, the exact ingest plan with method gptqmodel); the directory is removed when the block
    ends. Any other plan: yielded unchanged."""
    if plan.method != METHOD or METHOD in plan.source:  # not gptqmodel, or already GPTQModel's output, ingested
        yield ckpt, plan
        return
    work = staging / WORK_DIR
    work.mkdir()
    try:
        gptq_dir, record = _run(ckpt, plan, work)
        yield ingest(ckpt, gptq_dir, plan, recipe, record)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(ckpt: Checkpoint, plan: Plan, work: Path) -> tuple[Path, dict]:
    """GPTQModel on the input (or its untied view), saved to ``work/gptq``; returns (that directory, the record)."""
    opts: GPTQOptions = plan.options
    windows, calib = calibration(ckpt, plan)
    source = _untied_view(ckpt, plan.head, work / "untied") if plan.tied else ckpt.root
    workers = _set_workers()
    dynamic = dynamic_overrides(plan)
    out = work / "gptq"
    rows = [{"input_ids": w.tolist(), "attention_mask": [1] * len(w)} for w in windows]
    with contextlib.redirect_stdout(sys.stderr):  # GPTQModel logs on stdout (from its import on): stdout is edgeq's
        gptqmodel = _import()
        _logs_into(work / "logs")
        qc = gptqmodel.QuantizeConfig(bits=4, group_size=plan.scheme.group_size, sym=False, desc_act=opts.act_order,
                                      damp_percent=opts.damp, lm_head=True, dynamic=dynamic,
                                      offload_to_disk_path=str(work / "offload"))
        try:
            model = gptqmodel.GPTQModel.load(str(source), qc, device="cpu")
            model.quantize(rows, batch_size=1)
            model.save(str(out))
        except Exception as e:  # noqa: BLE001 - a third-party engine: its failure becomes one line, named
            first = str(e).splitlines()[0][:300] if str(e) else ""
            raise EdgeqError(f"{ckpt.root}: GPTQModel {gptqmodel.__version__} failed: {type(e).__name__}: {first}; "
                             "try --method gptq (edgeq's own)") from e
    head = (f"untied view: {plan.head.name} written from {plan.head.source} (GPTQModel refuses a tied lm_head)"
            if plan.tied else f"the input's {plan.head.source}")
    record = {"version": gptqmodel.__version__, "calibration": calib, "cpu_workers": workers,
              "desc_act": opts.act_order, "damp_percent": opts.damp, "sym": False, "group_size": plan.scheme.group_size,
              "head": head}
    return out, record


def dynamic_overrides(plan: Plan) -> dict:
    """GPTQModel's ``dynamic`` for this plan: the head at 4 bits, asymmetric, at its group size (GPTQModel's own
    default for a head is 8 bits); every module whose group size differs from the scheme's, one pattern per group
    size; the recipe's keep_bf16 modules excluded (``-:``). Patterns match whole module names (``re.escape``,
    ``$``); GPTQModel and edgeq's ingest both take the first pattern that matches from the start of the name.

    Example (llama recipe, w4a16-g128, a 1-layer model): ``{"lm_head$": {"bits": 4, "group_size": 32, "sym":
    false, "desc_act": false}, "(?:model\\.layers\\.0\\.self_attn\\.q_proj|...)$": {"group_size": 32}}``."""
    g = plan.scheme.group_size
    head = plan.head
    act = bool(head.perm)
    dynamic = {f"{re.escape(head.module)}$": {"bits": 4, "group_size": head.group(plan.scheme), "sym": False,
                                              "desc_act": act}}
    keep = [e.module for e in plan.entries if e.action == Action.KEEP]
    if keep:
        dynamic[f"-:(?:{'|'.join(map(re.escape, keep))})$"] = {}
    by_group: dict[int, list[str]] = {}
    for e in plan.entries:
        if e.quantized and e is not head and e.group(plan.scheme) != g:
            by_group.setdefault(e.group(plan.scheme), []).append(e.module)
    for size, modules in sorted(by_group.items()):
        dynamic[f"(?:{'|'.join(map(re.escape, modules))})$"] = {"group_size": size}
    return dynamic


def ingest(ckpt: Checkpoint, gptq_dir: Path, plan: Plan, recipe: Recipe, record: dict) -> tuple[Checkpoint, Plan]:
    """GPTQModel's checkpoint ``gptq_dir`` (made from the input ``ckpt``) planned for the exact ingest: every module
    the float plan quantises must be repacked exactly at the same group size (and with M.perm exactly when act-order
    asked for it); else an EdgeqError naming the first difference. The result has method gptqmodel, the float plan's
    ``tied`` (the output head was untied from the input's table) and ``source.gptqmodel`` = ``record``."""
    saved = open_checkpoint(gptq_dir)
    if saved.quantization_config is None:
        raise EdgeqError(f"{gptq_dir}: GPTQModel wrote no GPTQ quantization_config; cannot ingest its output")
    # the input as the rest of the conversion sees it: its directory (tokenizer, generation config, model card
    # source) and config.json, with GPTQModel's tensors and quantization_config (GPTQModel rewrites the generation
    # config and tokenizer config it saves; those are not the model's)
    config = {**ckpt.config, "quantization_config": saved.quantization_config}
    gckpt = Checkpoint(root=ckpt.root, config=config, tensors=saved.tensors, files=saved.files, index=saved.index)
    gcfg = read_gptq_config(gckpt)
    gplan = build_gptq_plan(gckpt, gcfg, plan.scheme, "rtn", recipe)
    gplan.check()
    want = {e.module: (e.group(plan.scheme), e.perm) for e in plan.entries if e.quantized}
    got = {e.module: (e.group(plan.scheme), e.perm) for e in gplan.entries if e.quantized}
    problems = [f"{e.module}: {e.action} ({e.reason})" for e in gplan.entries
                if e.quantized and e.action != Action.REPACK]
    problems += [f"{m}: planned g{w[0]}{' + perm' if w[1] else ''}, GPTQModel wrote "
                 f"{'nothing' if m not in got else f'g{got[m][0]}' + (' + perm' if got[m][1] else '')}"
                 for m, w in want.items() if got.get(m) != w]
    problems += [f"{m}: quantised by GPTQModel, not in edgeq's plan" for m in got if m not in want]
    if problems:
        raise EdgeqError(f"{gptq_dir}: GPTQModel's output is not an exact repack of the plan ({len(problems)} "
                         f"module(s)), e.g. {problems[0]}; try --method gptq (edgeq's own)")
    # what the float plan writes in its own way beyond copy/keep (a packed embedding, last: it reads the head back)
    # is carried over as planned: the tensors it reads are the same in GPTQModel's checkpoint
    carried = [e for e in plan.entries if not e.quantized and e.action not in (Action.COPY, Action.KEEP)]
    names = {e.name for e in carried}
    entries = tuple(e for e in gplan.entries if e.name not in names) + tuple(carried)
    if plan.tied:  # the head GPTQModel quantised is the input's table (the untied view): say so, as for any method
        entries = tuple(replace(e, source=plan.head.source) if e.role == Role.HEAD else e for e in entries)
    source = {**gplan.source, METHOD: record}
    return gckpt, replace(gplan, entries=entries, method=METHOD, tied=plan.tied, source=source, options=plan.options)


def describe(plan: Plan) -> list[str]:
    """The CLI's line about the GPTQModel run of a gptqmodel plan (after :func:`ingest`); [] for any other plan."""
    r = plan.source.get(METHOD) if plan.method == METHOD else None
    if not r:
        return []
    return [f"GPTQModel {r['version']}: {describe_calibration(r['calibration'])}, 4-bit asym "
            f"g{r['group_size']}, desc_act={r['desc_act']}, damp={r['damp_percent']}, {r['cpu_workers']} CPU workers; "
            f"head: {r['head']}"]


def _untied_view(ckpt: Checkpoint, head: PlanEntry, view: Path) -> Path:
    """A directory GPTQModel loads as the input with an own head: every input file symlinked (the single weight
    file as ``model-input.safetensors``, named by an index), config.json with ``tie_word_embeddings: false``, and
    ``head.name`` written from ``head.source`` (the embedding table) in row blocks into its own file."""
    view.mkdir()
    weights = {info.file for info in ckpt.tensors.values()}
    for f in sorted(ckpt.root.iterdir()):
        if f.is_file() and f.name not in (CONFIG, WEIGHTS_INDEX) and f not in weights:
            (view / f.name).symlink_to(f.resolve())
    links = {f: (_VIEW_WEIGHTS if f.name == WEIGHTS else f.name) for f in weights}
    for f, name in links.items():
        (view / name).symlink_to(f.resolve())
    (view / CONFIG).write_text(json.dumps({**ckpt.config, "tie_word_embeddings": False}, indent=2) + "\n")
    info = ckpt.tensors[head.source]
    part = view / "head"
    part.mkdir()
    writer = ShardedWriter(part, [OutSpec(head.name, info.torch_dtype, tuple(info.shape))])
    rows, step = info.shape[0], max(1, _ROW_BLOCK_ELEMENTS // max(1, info.shape[1]))
    for a in range(0, rows, step):
        writer.write(head.name, ckpt.read(head.source, (a, min(rows, a + step))))
    writer.close()
    (part / WEIGHTS).rename(view / _VIEW_HEAD)
    part.rmdir()
    weight_map = {name: links[t.file] for name, t in ckpt.tensors.items()} | {head.name: _VIEW_HEAD}
    (view / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1) + "\n")
    return view


def _set_workers() -> int:
    """GPTQModel's CPU worker count: the user's ``GPTQMODEL_CPU_WORKERS``, else on a machine where GPTQModel's
    default (``(cpu_count + 1) // 2``) is below the 2 its model loader needs, ``max(2, torch threads)``."""
    if WORKERS_ENV not in os.environ and ((os.cpu_count() or 1) + 1) // 2 < 2:
        os.environ[WORKERS_ENV] = str(max(2, torch.get_num_threads()))
    try:
        return int(os.environ.get(WORKERS_ENV, ((os.cpu_count() or 1) + 1) // 2))
    except ValueError:
        value = os.environ[WORKERS_ENV]
        raise EdgeqError(f"{WORKERS_ENV}={value!r}: not an integer; unset it or give a count") from None


def _logs_into(directory: Path) -> None:
    """GPTQModel 7.3.6 writes a log file per run under ``./logs`` (``looper.loop_processor._PROJECT_LOG_DIR``), i.e.
    into the caller's working directory: pointed into the staging directory instead, so it goes with it."""
    try:  # imported by GPTQModel only when quantize() runs
        module = importlib.import_module("gptqmodel.looper.loop_processor")
    except ImportError:
        return
    if hasattr(module, "_PROJECT_LOG_DIR"):
        module._PROJECT_LOG_DIR = directory


def _import():
    """``import gptqmodel`` (a stand-in for its InternVL definition when torchvision is absent: see the module
    docstring); an EdgeqError with the install hint when it cannot be imported."""
    if _STAND_IN not in sys.modules and importlib.util.find_spec("torchvision") is None:
        stand_in = types.ModuleType(_STAND_IN, "stand-in: torchvision is not installed (text models never need it)")

        class InternVLChatQModel:  # noqa: D401 - the name GPTQModel's model table expects
            def __init__(self, *args, **kwargs):
                raise EdgeqError("GPTQModel's InternVL support needs torchvision, which is not installed")

        stand_in.InternVLChatQModel = InternVLChatQModel
        sys.modules[_STAND_IN] = stand_in
    try:
        import gptqmodel  # noqa: PLC0415 - optional, heavy (seconds): only when the method runs
    except ImportError as e:
        raise EdgeqError(f"{EXTRA_HINT} (import failed: {e})") from e
    return gptqmodel
