"""What ``edgeq quantize`` writes beside the weights: the manifest, config.json (with ``quantization_config``), the
model card, the tokenizer and generation files; and the lines it reports about them.

Formats: edgeq/io/manifest.py (the manifest's keys), docs/format.md (both files, and how ``quantization_config``
maps to GPTQ, compressed-tensors and torchao). Per-kernel facts (the layout record, the zero-point domain) come from
the kernel's packer (:func:`edgeq.convert.packers.packer`); the head's name from the plan (the recipe's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from edgeq.convert import card
from edgeq.convert.embeddings import format_version, head_record, manifest_record
from edgeq.convert.gptqmodel import METHOD as GPTQMODEL
from edgeq.convert.gptqmodel import describe as describe_gptqmodel
from edgeq.convert.ingest_gptq import METHOD as INGEST_METHOD
from edgeq.convert.ingest_stream import describe as describe_ingest
from edgeq.convert.packers import packer
from edgeq.convert.plan import Plan, PlanEntry, group_sizes
from edgeq.convert.selfcal import describe as describe_calibration
from edgeq.io.hf import TOKENIZER_FILES, Checkpoint
from edgeq.io.manifest import Manifest
from edgeq.keys import CONFIG, QUANT_METHOD, VERSION, Action, Kernel, Role
from edgeq.quantize.rtn import METHODS

AUX_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
)
BOUND_SHORT = "<= |s|/16"


def manifest(plan: Plan, layout, digests: dict, order: list[PlanEntry] | None = None,
             details: dict | None = None) -> Manifest:
    """The manifest of a written plan: ``layout`` is the kernel's record, ``digests`` {shard: sha256}, ``order``
    the declared tensor order (default: the plan's), ``details`` the method's records (extra top-level keys)."""
    extra = dict(details or {})
    perms = [e.module for e in plan.entries if e.perm]
    if perms:
        extra["perm_modules"] = perms
    return Manifest(
        format_version=format_version(plan),  # 1 unless an embedding is packed: bf16 checkpoints keep their bytes
        scheme=str(plan.scheme),
        method=plan.method,
        kernel=plan.scheme.kernel,
        layout=layout.to_json(),
        head=_head_record(plan),
        quantized_modules=tuple(e.module for e in plan.entries if e.quantized),
        modules_not_converted={e.module: e.reason for e in plan.entries if e.action == Action.KEEP},
        shards=digests,
        tensors=_tensor_records(plan, order or plan.entries),
        created_by={"edgeq": VERSION, "torch": torch.__version__, "recipe": plan.recipe},
        group_sizes=group_sizes(plan),
        embeddings=manifest_record(plan),
        extra=extra,  # the method's records as extra top-level keys (readers ignore keys they do not know)
    )


def _tensor_records(plan: Plan, order) -> dict:
    """{output tensor: {"role", "source", "dtype", "shape"} (+ "action" for GPTQ layers, "from" for --head-from)}."""
    tensors = {}
    for e in order:
        for name, dtype, shape in e.out_tensors(plan.scheme):
            rec = {"role": Role.PERM if name.endswith(".perm") else e.role, "source": e.source, "dtype": dtype,
                   "shape": list(shape)}
            if e.action in (Action.REPACK, Action.REQUANTIZE) or e.origin:
                rec["action"] = e.action
            if e.origin:
                rec["from"] = e.origin
            tensors[name] = rec
    return tensors


def _head_record(plan: Plan) -> dict:
    """{"name": the recipe's head module, "quantized": true, "source", "untied"} (+ "method", "from", and "levels"
    with --head-levels 2)."""
    head = {"name": plan.head_module, "quantized": True, "source": plan.head.source, "untied": plan.tied}
    if plan.method not in METHODS:  # GPTQ ingest or calibration: say how the head was made
        head["method"] = _head_method(plan)
    if plan.head.origin:
        head["from"] = plan.head.origin
    if levels := head_record(plan):  # absent for one level: the files of --head-levels 1 are unchanged
        head["levels"] = levels
    return head


def _head_method(plan: Plan) -> str:
    """How the head was made: "repack" (exact, GPTQ), "<rtn|minmax> (requantised ...)", or the plan's method."""
    h = plan.head
    if h.action == Action.REPACK:
        return "repack"
    if h.action == Action.REQUANTIZE:
        return f"{h.method} (requantised from {h.gptq.bits}-bit GPTQ)"
    return h.method or plan.method


def notes(plan: Plan, details: dict) -> list[str]:
    """The choices ``edgeq quantize`` reports, one line each (GPTQ ingest and calibration; none for rtn/minmax)."""
    if plan.method in (INGEST_METHOD, GPTQMODEL):
        lines = describe_gptqmodel(plan) + describe_ingest(plan)
        ex = details.get("exactness", {})
        if ex.get("repacked_modules"):
            lines.append(f"exactness: largest repack error {ex['max_error_over_scale']:.4f} of a quantisation step "
                         f"({ex['max_error_over_bound']:.2f} of the bf16 bound, {BOUND_SHORT})")
        return lines
    if plan.method == "gptq":
        g = details.get("gptq", {})
        c = g.get("calibration", {})
        lines = [f"GPTQ calibration: {describe_calibration(c)}, act_order={g.get('act_order')}, damp={g.get('damp')}, "
                 f"group parameters {g.get('group_params', 'minmax')}, target {g.get('target', 'layer')}"]
        if g.get("damp_escalated"):
            lines.append(f"dampening raised for {len(g['damp_escalated'])} module(s): {g['damp_escalated']}")
        return lines
    return []


def quantization_config(manifest: Manifest, plan: Plan, layout) -> dict:
    """config.json's ``quantization_config``: edgeq's keys plus those every Hugging Face quantizer has (``bits``,
    ``sym``, ``modules_to_not_convert``); docs/format.md maps them to GPTQ, compressed-tensors and torchao."""
    return {
        "quant_method": QUANT_METHOD,
        "format_version": manifest.format_version,
        "bits": plan.scheme.weight_bits,
        "group_size": plan.scheme.group_size,
        "sym": False,  # both kernels store a zero point per (group, output row)
        # amx_w4a8: w = (q - z) * s, z an integer 0..15; tinygemm_w4a16: w = (q - 8) * s + z, z a bf16 float
        "zero_point_domain": packer(plan.scheme.kernel).zero_point_domain,
        "activation_bits": plan.scheme.activation_bits,
        "scheme": str(plan.scheme),
        "method": plan.method,
        "kernel": plan.scheme.kernel,
        "layout": layout.fingerprint(),
        "head_quantized": True,
        "untied": plan.tied,
        "modules_to_not_convert": sorted(manifest.modules_not_converted),
    }


def write_config(ckpt: Checkpoint, tmp: Path, plan: Plan, layout, manifest: Manifest) -> None:
    """config.json, then the model card README.md made from it and the manifest (edgeq/convert/card.py)."""
    config = dict(ckpt.config)
    config["tie_word_embeddings"] = False  # the head is its own quantised tensor now
    config["dtype"] = "bfloat16"
    if "torch_dtype" in config:
        config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = quantization_config(manifest, plan, layout)
    (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    card.write_card(tmp, source=card.source_name(ckpt.root))


def copy_aux(src: Path, dst: Path) -> None:
    """The tokenizer, chat template and generation files the input has, copied as they are."""
    for name in AUX_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def tokenizer_problem(directory: Path) -> str | None:
    """Why ``generate`` and ``serve`` could not encode text with this directory's files; None when they could.
    A warning at quantize time (token-id users such as fidelity and bench need no tokenizer), a problem in inspect."""
    if any((Path(directory) / f).is_file() for f in TOKENIZER_FILES):
        return None
    return (f"{directory}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); `edgeq generate` and `serve` "
            "cannot encode text without them; copy the original model's tokenizer files next to the weights")


def describe_layout(layout) -> str:
    """The packed layout written, and why: the summary line of ``edgeq quantize`` (the record's kernel's packer; a
    :class:`edgeq.layouts.tinygemm.TinygemmLayout` carries no kernel attribute: it is the W4A16 record)."""
    return packer(getattr(layout, "kernel", Kernel.W4A16)).describe(layout)
