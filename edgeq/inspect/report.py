"""``edgeq inspect``: what is in a checkpoint, what serving it will cost, and what is wrong with it.

By default only ``config.json``, the index, the manifest and the safetensors headers are read, never tensor data
(``--verify`` reads the data too, in blocks). Three kinds of checkpoint:

- **edgeq** (``quantization_config.quant_method == "edgeq"``): scheme, method, kernel, the stored layout fingerprint
  against this machine's (the probe), the head, the embedding table (bf16 or packed levels: edgeq/inspect/
  embeddings.py), bytes by category and bits per weight, modules not converted,
  consistency of manifest, config and headers, and the memory projection (:mod:`edgeq.memory`).
- **hf** (a float checkpoint): what each w4a16 scheme would write and which tensors it cannot quantise, from
  :func:`edgeq.convert.plan.build_plan`, the very plan ``edgeq quantize`` builds; the memory projection is for
  the recipe's default scheme.
- **foreign** (GPTQ, AWQ, compressed-tensors, torchao, bitsandbytes): bits, group size, symmetry, act-order, read
  from the config and checked against the tensor shapes, and the known traps (head left in bf16 or at another
  precision, tied embeddings stored twice, Linear weights left in bf16 beside quantised ones).

This module assembles the :class:`InspectReport` from the package's parts (docs/inspect.md, "Where the code
lives"); the JSON schema is documented in docs/inspect.md and pinned by tests/test_inspect.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from edgeq.convert.recipe import Recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint, open_checkpoint, weight_files
from edgeq.io.manifest import Manifest
from edgeq.memory import DEFAULT_KV_CACHE_BYTES, MemoryProjection, kv_geometry
from edgeq.inspect.checks import inspect_edgeq
from edgeq.inspect.embeddings import packed_parts
from edgeq.inspect.foreign import inspect_foreign
from edgeq.inspect.hf import plan_memory, scheme_options
from edgeq.inspect.kinds import (by_category, detect_kind, files_info, model_info, quant_modules, recipe_for, rows,
                                 stored_twice, unquantized_params)
from edgeq.inspect.packed import packed_checks
from edgeq.inspect.render import render
from edgeq.inspect.schema import SCHEMA_VERSION, EdgeqInfo, ForeignInfo, InspectReport, SchemeOption, TensorRow
from edgeq.inspect.verify import config_problems, stored_twice_data, verify as verify_data

__all__ = ["InspectReport", "inspect_checkpoint", "render"]  # what other modules import from here


@dataclass(frozen=True)
class _KindReport:
    """The kind-specific part of a report (one of :func:`_edgeq`, :func:`_hf`, :func:`_foreign`)."""

    rows: list[TensorRow]
    params: int
    bits: Optional[float] = None
    memory: Optional[MemoryProjection] = None
    basis: str = ""
    edgeq: Optional[EdgeqInfo] = None
    foreign: Optional[ForeignInfo] = None
    schemes: Optional[tuple[SchemeOption, ...]] = None
    manifest: Optional[Manifest] = None
    modules: dict = field(default_factory=dict)


def inspect_checkpoint(
    path: str | Path,
    *,
    verify: bool = False,
    max_model_len: int | None = None,
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    strict_layout: bool = False,
    recipe: str | None = None,
    tensors: bool = False,
) -> InspectReport:
    """Inspect a checkpoint directory. Headers only unless ``verify``. Raises :class:`EdgeqError` for unreadable input
    (truncated or lying headers, missing shards); everything else wrong with it is a ``problem`` in the report."""
    if max_model_len is not None and max_model_len < 1:
        raise EdgeqError(f"--max-model-len {max_model_len}: must be at least 1 (omit it for the model's own)")
    ckpt = open_checkpoint(path)
    problems: list[str] = []
    warnings: list[str] = []
    rec, _ = recipe_for(ckpt.config, recipe, warnings)
    kind = detect_kind(ckpt)
    memory_args = (kv_geometry(ckpt.config), kv_cache_bytes, max_model_len)
    if kind == "edgeq":
        part = _edgeq(ckpt, rec, strict_layout, memory_args, problems, warnings)
    elif kind == "hf":
        part = _hf(ckpt, rec, memory_args, problems)
    else:
        part = _foreign(ckpt, rec, problems, warnings)
    stored_twice(ckpt, rec, quant_modules(ckpt), problems)
    if part.memory is not None:
        problems.extend(part.memory.problems)
    verified = None
    if verify:
        verified = verify_data(ckpt, kind, part.manifest, part.modules, problems)
        stored_twice_data(ckpt, rec, problems)
        if kind in ("edgeq", "hf"):
            problems.extend(config_problems(ckpt, part.modules))
    return InspectReport(
        schema_version=SCHEMA_VERSION, path=str(ckpt.root), kind=kind, model=model_info(ckpt.config, part.params),
        files=files_info(ckpt), bytes_by_category=by_category(part.rows), effective_bits=part.bits,
        bits_per_parameter=8 * ckpt.nbytes / part.params if part.params else 0.0, edgeq=part.edgeq,
        foreign=part.foreign, schemes=part.schemes, memory=part.memory, memory_basis=part.basis,
        problems=tuple(problems), warnings=tuple(warnings), verify=verified,
        tensors=tuple(part.rows) if tensors else None,
    )


def _edgeq(ckpt: Checkpoint, rec: Recipe, strict_layout: bool, memory_args: tuple, problems: list[str],
           warnings: list[str]) -> _KindReport:
    """An edgeq checkpoint: its checks, a missing tokenizer, and the memory as stored (repacked when load would)."""
    found = inspect_edgeq(ckpt, rec, strict_layout, problems, warnings)
    from edgeq.convert.records import tokenizer_problem  # noqa: PLC0415 (no tokenizer: generate/serve cannot encode text)
    from edgeq.runtime.qinfo import read_checkpoint  # noqa: PLC0415 (torch: only for edgeq checkpoints)

    try:  # what load itself refuses first: its shard files and config.json's quantization_config against the manifest
        weight_files(ckpt.root, any_name=False)
        read_checkpoint(ckpt.root, ckpt.config)
    except EdgeqError as e:
        problems.append(f"{e} (load refuses the checkpoint)")

    if no_tokenizer := tokenizer_problem(ckpt.root):
        problems.append(no_tokenizer)
    checks = packed_checks(found.info.kernel)
    repack = not found.info.layout_matches and checks.repacks_on_load
    tables = frozenset(packed_parts(found.manifest, found.info.embeddings))
    head_weights = frozenset(f"{m}.qweight" for m, _ in found.info.head_levels[1:])  # repacked with the head
    memory = checks.memory(ckpt, found.modules, *memory_args, repack=repack, embedding_parts=tables,
                           head_weights=head_weights)
    basis = "as stored" + ("; qweights repacked into anonymous memory at load" if repack else "")
    return _KindReport(found.rows, found.params, found.bits, memory, basis, edgeq=found.info,
                       manifest=found.manifest, modules=found.modules)


def _hf(ckpt: Checkpoint, rec: Recipe, memory_args: tuple, problems: list[str]) -> _KindReport:
    """A float checkpoint: every w4a16 scheme's plan, and the memory of the recipe's default scheme's output."""
    rows_ = rows(ckpt, rec, {})
    options, plan = scheme_options(ckpt, rec, problems)
    if plan is None:
        return _KindReport(rows_, unquantized_params(rows_), schemes=tuple(options),
                           basis="not projected: edgeq cannot plan a conversion of this checkpoint (see problems)")
    return _KindReport(rows_, unquantized_params(rows_), memory=plan_memory(plan, *memory_args),
                       basis=f"after `edgeq quantize --scheme {plan.scheme}` (recipe {rec.name}'s default)",
                       schemes=tuple(options))


def _foreign(ckpt: Checkpoint, rec: Recipe, problems: list[str], warnings: list[str]) -> _KindReport:
    """Another tool's quantised checkpoint (or quantised tensors without a quantization_config)."""
    q = ckpt.quantization_config or {"quant_method": "unknown (tensors look quantised, config has no "
                                                     "quantization_config)"}
    if ckpt.quantization_config is None:
        problems.append("tensors carry quantisation suffixes (qweight, scales, ...) but config.json has no "
                        "quantization_config: loaders will treat them as float weights and fail")
    info, rows_, _, params, bits = inspect_foreign(ckpt, rec, q, problems, warnings)
    return _KindReport(rows_, params, bits, foreign=info,
                       basis="not projected: edgeq serves edgeq checkpoints (quantise the original float model)")
