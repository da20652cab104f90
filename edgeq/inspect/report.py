"""``edgeq inspect``: what is in a checkpoint, what serving it will cost, and what is wrong with it.

By default only ``config.json``, the index, the manifest and the safetensors headers are read, never tensor data
(``--verify`` reads the data too, in blocks). Three kinds of checkpoint:

- **edgeq** (``quantization_config.quant_method == "edgeq"``): scheme, method, kernel, the stored layout fingerprint
  against this machine's (the probe), the head, bytes by category and bits per weight, modules not converted,
  consistency of manifest, config and headers, and the memory projection (:mod:`edgeq.memory`).
- **hf** (a float checkpoint): what each w4a16 scheme would write and which tensors it cannot quantise, from
  :func:`edgeq.convert.plan.build_plan`, the very plan ``edgeq quantize`` builds; the memory projection is for
  the recipe's default scheme.
- **foreign** (GPTQ, AWQ, compressed-tensors, torchao, bitsandbytes): bits, group size, symmetry, act-order, read
  from the config and checked against the tensor shapes, and the known traps (head left in bf16 or at another
  precision, tied embeddings stored twice, Linear weights left in bf16 beside quantised ones).

The JSON schema of :class:`InspectReport` is documented in docs/inspect.md and pinned by tests/test_inspect.py.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

from edgeq.io.manifest import MANIFEST, Manifest, read_manifest
from edgeq.convert.plan import HEAD_MODULE, Plan, _role as plan_role, build_plan, effective_bits
from edgeq.io.hf import Checkpoint, open_checkpoint
from edgeq.convert.recipe import Recipe, find_recipe
from edgeq.io.safetensors import DTYPES, FLOAT_CODES, TensorInfo, read_header, read_tensor, sha256_file
from edgeq.errors import EdgeqError, ThresholdError
from edgeq.io.hub import REVISION_HELP, resolve_model
from edgeq.layouts import tinygemm
from edgeq.layouts import w4a8 as w4a8_layout
from edgeq.memory import DEFAULT_KV_CACHE_BYTES, MemoryProjection, kv_geometry, project, scratch, w4a8_scratch
from edgeq.memory import Tensor as MemTensor
from edgeq.runtime.qinfo import config_layout_mismatch
from edgeq.scheme import Scheme

SCHEMA_VERSION = 1
CATEGORIES = ("quantized_linears", "linears_unquantized", "head", "embeddings", "norms", "other")
FOREIGN_METHODS = {"gptq": "gptq", "auto-round": "gptq", "awq": "awq", "compressed-tensors": "compressed-tensors",
                   "torchao": "torchao", "bitsandbytes": "bitsandbytes"}
# Tensor-name suffixes that belong to a quantised module (longest first when matching).
_QUANT_PARTS = tuple(sorted((
    ".qweight", ".qzeros", ".scales", ".g_idx", ".scales_and_zeros",  # edgeq, GPTQ, AWQ
    ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx", ".input_scale",  # c-t
    "._weight_qdata", "._weight_scale", "._weight_zero_point", "._weight_scale_and_zero", "._weight_act_pre_scale",
    ".weight.absmax", ".weight.quant_map", ".weight.nested_absmax", ".weight.nested_quant_map",  # bnb 4-bit
    ".weight.quant_state.bitsandbytes__nf4", ".weight.quant_state.bitsandbytes__fp4",
    ".SCB", ".weight_format",  # bnb 8-bit
), key=len, reverse=True))
VERIFY_BLOCK_BYTES = 16 << 20
ROUNDTRIP_SAMPLE = 4


@dataclass(frozen=True)
class TensorRow:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # linear | head | embedding | norm | bias | other
    quantized: bool  # part of a quantised module (packed weight, scales, zeros, indices)
    bytes: int
    file: str


@dataclass(frozen=True)
class QModule:
    """One quantised Linear as the tensor shapes describe it (n, k None when the shapes do not tell)."""

    name: str
    n: Optional[int]
    k: Optional[int]
    numel: int
    bits: Optional[float]
    group_size: Optional[int]
    bytes: int


@dataclass(frozen=True)
class EdgeqInfo:
    format_version: int
    scheme: str
    group_size: int
    method: str
    kernel: str
    layout_stored: dict
    layout_machine: Optional[dict]
    layout_matches: bool
    on_load: str
    head_quantized: bool
    head_source: str
    untied: bool
    quantized_modules: int
    modules_not_converted: dict
    created_by: dict
    group_sizes: tuple = ()  # ((module, G), ...) where a recipe made G finer than the scheme's


@dataclass(frozen=True)
class ForeignInfo:
    format: str
    quant_method: str
    bits: Optional[int]
    group_size: Optional[int]
    symmetric: Optional[bool]
    act_order: Optional[str]
    head: str  # how the output head is stored
    quantized_modules: int
    bits_seen: tuple[float, ...]  # from the tensor shapes, over all quantised modules
    group_sizes_seen: tuple[int, ...]
    unquantized_linears: tuple[str, ...]
    details: dict


@dataclass(frozen=True)
class SchemeOption:
    scheme: str
    bytes_out: int
    ratio: float
    effective_bits: float
    cannot_quantize: tuple[str, ...]


@dataclass(frozen=True)
class VerifyResult:
    tensors_checked: int
    bytes_read: int
    seconds: float
    shards: dict  # shard file -> "ok" | "sha256 mismatch" | "not in manifest" | "not checked (no manifest)"
    roundtrip: tuple[str, ...]  # modules whose unpack/repack reproduced the stored bytes


@dataclass(frozen=True)
class InspectReport:
    schema_version: int
    path: str
    kind: str  # edgeq | hf | foreign
    model: dict
    files: dict
    bytes_by_category: dict
    effective_bits: Optional[float]  # bits per quantised weight, scales and zeros included
    bits_per_parameter: float  # all stored bytes over all parameters
    edgeq: Optional[EdgeqInfo]
    foreign: Optional[ForeignInfo]
    schemes: Optional[tuple[SchemeOption, ...]]
    memory: Optional[MemoryProjection]
    memory_basis: str
    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    verify: Optional[VerifyResult] = None
    tensors: Optional[tuple[TensorRow, ...]] = None


# ----------------------------------------------------------------------------------------------------------- common


def split_module(name: str) -> tuple[str, str]:
    """``model.layers.0.mlp.up_proj.qweight`` -> (``model.layers.0.mlp.up_proj``, ``.qweight``); ('name', '') when
    the tensor is not a quantisation part."""
    for suffix in _QUANT_PARTS:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return name, ""


def _default_recipe() -> Recipe:
    return Recipe(name="default", model_types=(), scheme="w4a16-g128", method="rtn", head="lm_head.weight",
                  embeddings=("model.embed_tokens.weight",), keep_bf16=(), notes="", source="")


def _recipe(config: dict, name: str | None, warnings: list[str]) -> tuple[Recipe, bool]:
    """(recipe, found). An unknown architecture still gets the default tensor names, with a warning."""
    try:
        return find_recipe(name, config.get("model_type")), True
    except EdgeqError as e:
        if name:
            raise
        warnings.append(f"{e}; tensor roles below use the default names (lm_head, model.embed_tokens)")
        return _default_recipe(), False


def _quant_modules(ckpt: Checkpoint) -> dict[str, dict[str, TensorInfo]]:
    """Module -> {part suffix: tensor}; a module's own ``.weight`` joins it when it has quantisation parts
    (bitsandbytes and fp8 keep the packed data under ``.weight``)."""
    mods: dict[str, dict[str, TensorInfo]] = {}
    for name, info in ckpt.tensors.items():
        module, part = split_module(name)
        if part:
            mods.setdefault(module, {})[part] = info
    for module, parts in mods.items():
        w = ckpt.tensors.get(f"{module}.weight")
        if w is not None:
            parts[".weight"] = w
    return mods


def _rows(ckpt: Checkpoint, recipe: Recipe, qmods: dict, roles: dict[str, str] | None = None) -> list[TensorRow]:
    head_module = recipe.head.removesuffix(".weight")
    emb_modules = {e.removesuffix(".weight") for e in recipe.embeddings}
    in_qmod = {info.name: m for m, parts in qmods.items() for info in parts.values()}
    rows = []
    for name, info in ckpt.tensors.items():
        module = in_qmod.get(name)
        if roles and name in roles:
            role = roles[name]
        elif module is not None:
            role = "head" if module == head_module else "embedding" if module in emb_modules else "linear"
        else:
            role = plan_role(name, info.shape, recipe)
        rows.append(TensorRow(name, info.shape, info.dtype, role, module is not None, info.nbytes, info.file.name))
    return rows


def _category(row: TensorRow) -> str:
    if row.role == "head":
        return "head"
    if row.role == "embedding":
        return "embeddings"
    if row.role == "norm":
        return "norms"
    if row.role == "linear":
        return "quantized_linears" if row.quantized else "linears_unquantized"
    if row.role == "perm":  # an act-order layer's input permutation (M.perm): read by that quantised linear
        return "quantized_linears"
    return "other"


def _by_category(rows: list[TensorRow]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for r in rows:
        out[_category(r)] += r.bytes
    return out


def _model(config: dict, parameters: int) -> dict:
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    arch = config.get("architectures")
    return {
        "architecture": arch[0] if isinstance(arch, list) and arch else None,
        "model_type": config.get("model_type"),
        "parameters": parameters,
        "layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "tie_word_embeddings": config.get("tie_word_embeddings"),
    }


def _files(ckpt: Checkpoint) -> dict:
    return {"shards": [f.name for f in ckpt.files], "bytes": sum(f.stat().st_size for f in ckpt.files),
            "tensor_bytes": ckpt.nbytes, "tensors": len(ckpt.tensors)}


def _mib(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


def _stored_twice(ckpt: Checkpoint, recipe: Recipe, qmods: dict, problems: list[str]) -> None:
    """``tie_word_embeddings: true`` while the head is stored as well: the bytes are there twice, and a loader
    that ties silently drops one of them (a quantised head is discarded for the bf16 embedding)."""
    if ckpt.config.get("tie_word_embeddings") is not True:
        return
    head_module = recipe.head.removesuffix(".weight")
    head_bytes = sum(i.nbytes for i in qmods.get(head_module, {}).values()) or (
        ckpt.tensors[recipe.head].nbytes if recipe.head in ckpt.tensors else 0)
    emb = next((ckpt.tensors[e] for e in recipe.embeddings if e in ckpt.tensors), None)
    if head_bytes and emb is not None:
        problems.append(f"tied embeddings stored twice: config.json says tie_word_embeddings=true but {head_module} is "
                        f"stored too ({_mib(head_bytes)}) beside {emb.name} ({_mib(emb.nbytes)}); a loader that ties "
                        "keeps only one of them")


def _unquantized_linears(rows: list[TensorRow]) -> list[TensorRow]:
    return [r for r in rows if r.role == "linear" and not r.quantized and r.name.endswith(".weight") and len(r.shape) == 2]


# ------------------------------------------------------------------------------------------------------------ edgeq


def _edgeq(ckpt: Checkpoint, recipe: Recipe, strict_layout: bool, problems: list[str], warnings: list[str]):
    manifest = read_manifest(ckpt.root)
    qmods = {m: p for m, p in _quant_modules(ckpt).items()}
    if manifest.kernel == w4a8_layout.KERNEL:  # ".zeros" is no foreign format's suffix: claim it for listed modules only
        for m in manifest.quantized_modules:
            if f"{m}.zeros" in ckpt.tensors:
                qmods.setdefault(m, {})[".zeros"] = ckpt.tensors[f"{m}.zeros"]
    roles = {name: t.get("role", "other") for name, t in manifest.tensors.items() if isinstance(t, dict)}
    rows = _rows(ckpt, recipe, qmods, roles)
    _check_manifest(ckpt, manifest, problems)
    g = _group_size(manifest.scheme, problems)
    modules = _edgeq_modules(ckpt, manifest, g, problems)
    stored, machine, matches, on_load = _layout(ckpt, manifest, modules, strict_layout, problems, warnings)
    head = manifest.head
    tied_source = head.get("source", "lm_head.weight") != f"{HEAD_MODULE}.weight"
    params = sum(m.numel for m in modules.values() if not (m.name == HEAD_MODULE and tied_source))
    params += sum(r.bytes // _itemsize(r.dtype) for r in rows if not r.quantized and r.role != "perm")
    if ckpt.config.get("tie_word_embeddings") is not False:
        problems.append(f"config.json: tie_word_embeddings is {ckpt.config.get('tie_word_embeddings')!r}; an edgeq "
                        "checkpoint stores its own quantised head and must say false (a loader would tie the head "
                        "to the bf16 embedding and ignore the quantised one)")
    q_bytes = sum(m.bytes for m in modules.values())
    q_weights = sum(m.numel for m in modules.values())
    info = EdgeqInfo(
        format_version=manifest.format_version, scheme=manifest.scheme, group_size=g or 0, method=manifest.method,
        kernel=manifest.kernel, layout_stored=stored, layout_machine=machine, layout_matches=matches, on_load=on_load,
        head_quantized=bool(head.get("quantized")) and HEAD_MODULE in modules, head_source=str(head.get("source")),
        untied=bool(head.get("untied")), quantized_modules=len(modules),
        modules_not_converted=dict(manifest.modules_not_converted), created_by=dict(manifest.created_by),
        group_sizes=tuple(sorted(manifest.group_sizes.items())),
    )
    bits = 8 * q_bytes / q_weights if q_weights else None
    return info, rows, modules, params, bits, manifest


def _itemsize(code: str) -> int:
    return DTYPES[code][1]


def _group_size_or_none(scheme: str) -> int | None:
    try:
        return Scheme.parse(scheme).group_size
    except EdgeqError:
        return None


def _group_size(scheme: str, problems: list[str]) -> int | None:
    try:
        return Scheme.parse(scheme).group_size
    except EdgeqError as e:
        problems.append(f"{MANIFEST}: {e}")
        return None


def _check_manifest(ckpt: Checkpoint, manifest: Manifest, problems: list[str]) -> None:
    """Manifest, config and headers must tell the same story: same shards, tensors, dtypes, shapes, settings."""
    files = {f.name for f in ckpt.files}
    for shard in sorted(set(manifest.shards) - files):
        problems.append(f"{MANIFEST}: lists shard {shard}, which is not among the weight files")
    for shard in sorted(files - set(manifest.shards)):
        problems.append(f"{shard}: not listed in {MANIFEST}'s shards (no sha256 to check it against)")
    for name, t in manifest.tensors.items():
        info = ckpt.tensors.get(name)
        if info is None:
            problems.append(f"{MANIFEST}: tensor {name} is missing from the weight files")
        elif isinstance(t, dict) and (t.get("dtype") != info.dtype or list(t.get("shape", [])) != list(info.shape)):
            problems.append(f"{info.file.name}: tensor {name} is {info.dtype} {list(info.shape)} but the manifest says "
                            f"{t.get('dtype')} {t.get('shape')}")
    extra = sorted(set(ckpt.tensors) - set(manifest.tensors))
    if extra and manifest.tensors:
        problems.append(f"{len(extra)} tensor(s) not in {MANIFEST}: {', '.join(extra[:5])}")
    q = ckpt.quantization_config or {}
    for key in ("scheme", "method", "kernel"):
        if q.get(key) != getattr(manifest, key):
            problems.append(f"config.json: quantization_config.{key} = {q.get(key)!r} but the manifest says {getattr(manifest, key)!r}")
    if problem := _config_layout_problem(q.get("layout"), manifest):
        problems.append(f"config.json: {problem} (load refuses the checkpoint)")


def _config_layout_problem(record, manifest: Manifest) -> str | None:
    """config.json's copy of the layout record must equal the manifest's in every field (the runtime's check,
    :func:`edgeq.runtime.qinfo.config_layout_mismatch`); amx_w4a8 records have no permutations: equal dicts."""
    if manifest.kernel == w4a8_layout.KERNEL:
        return None if record == manifest.layout else "quantization_config.layout differs from the manifest's layout record"
    try:
        layout = tinygemm.TinygemmLayout.from_json(manifest.layout)
    except EdgeqError:
        return None  # the manifest's record itself is reported by _layout
    return config_layout_mismatch(record, layout)


def _edgeq_modules(ckpt: Checkpoint, manifest: Manifest, g0: int | None, problems: list[str]) -> dict[str, QModule]:
    """Every module the manifest says is quantised, checked from the headers as the runtime will check it."""
    modules = {}
    if HEAD_MODULE not in manifest.quantized_modules:
        problems.append(f"{MANIFEST}: {HEAD_MODULE} is not among the quantised modules; edgeq always quantises the head")
    if manifest.kernel == w4a8_layout.KERNEL:
        return _w4a8_modules(ckpt, manifest, g0, problems)
    for m in manifest.quantized_modules:
        qw, sz = ckpt.tensors.get(f"{m}.qweight"), ckpt.tensors.get(f"{m}.scales_and_zeros")
        if qw is None or sz is None:
            problems.append(f"{m}: quantised module without {'qweight' if qw is None else 'scales_and_zeros'}")
            continue
        if qw.dtype != "U8" or len(qw.shape) != 2:
            problems.append(f"{m}.qweight: expected U8 [N, K/2], got {qw.dtype} {list(qw.shape)}")
            continue
        n, k = qw.shape[0], 2 * qw.shape[1]
        g = manifest.group_sizes.get(m, g0) if g0 else g0  # a recipe's finer groups for this module
        want = [k // g, n, 2] if g else None
        if g and (k % g or sz.dtype != "BF16" or list(sz.shape) != want):
            problems.append(f"{m}.scales_and_zeros: expected BF16 {want} for N={n}, K={k}, G={g}; got "
                            f"{sz.dtype} {list(sz.shape)} (the kernel does not check this and would read out of bounds)")
        if n % tinygemm.ROW_MULTIPLE:
            problems.append(f"{m}: N={n} is not a multiple of {tinygemm.ROW_MULTIPLE}; the kernel cannot use it")
        modules[m] = QModule(m, n, k, n * k, 8 * (qw.nbytes + sz.nbytes) / (n * k) if n * k else None, g,
                             qw.nbytes + sz.nbytes)
    return modules


def _w4a8_modules(ckpt: Checkpoint, manifest: Manifest, g: int | None, problems: list[str]) -> dict[str, QModule]:
    """amx_w4a8 modules (docs/w4a8.md): qweight U8 [N/32, K/bk, bk*16+128], scales F32 and zeros I8 [N/32, K/G, 32]."""
    modules = {}
    bk = w4a8_layout.block_k(g) if g in w4a8_layout.GROUP_SIZES else None
    for m in manifest.quantized_modules:
        parts = [ckpt.tensors.get(f"{m}{s}") for s in (".qweight", ".scales", ".zeros")]
        qw, sc, zp = parts
        if None in parts:
            missing = [s for s, t in zip(("qweight", "scales", "zeros"), parts) if t is None]
            problems.append(f"{m}: quantised module without {', '.join(missing)} (amx_w4a8 stores qweight, scales, zeros)")
            continue
        if bk is None or qw.dtype != "U8" or len(qw.shape) != 3 or qw.shape[2] != bk * 16 + w4a8_layout.COMP_BYTES:
            problems.append(f"{m}.qweight: expected U8 [N/32, K/{bk}, {(bk or 0) * 16 + w4a8_layout.COMP_BYTES}] for "
                            f"G={g}, got {qw.dtype} {list(qw.shape)}")
            continue
        n, k = qw.shape[0] * w4a8_layout.BLOCK_N, qw.shape[1] * bk
        want = [qw.shape[0], k // g, w4a8_layout.BLOCK_N]
        for info, code in ((sc, "F32"), (zp, "I8")):
            if info.dtype != code or list(info.shape) != want:
                problems.append(f"{info.name}: expected {code} {want} for N={n}, K={k}, G={g}; got {info.dtype} "
                                f"{list(info.shape)} (the kernel does not check this and would read out of bounds)")
        nbytes = qw.nbytes + sc.nbytes + zp.nbytes
        modules[m] = QModule(m, n, k, n * k, 8 * nbytes / (n * k) if n * k else None, g, nbytes)
    return modules


def _w4a8_layout(manifest: Manifest, g: int | None, problems: list[str]):
    """amx_w4a8: the layout is fixed by the kernel's source, so the record must equal this edgeq's fingerprint; the
    path load will take is the one the runtime chooses here (a compiled kernel only after its probe)."""
    stored = dict(manifest.layout)
    if g not in w4a8_layout.GROUP_SIZES:
        return stored, None, False, "refused: the scheme's group size is not a W4A8 one"
    want = w4a8_layout.fingerprint(g)
    if stored != want:
        problems.append(f"{MANIFEST}: amx_w4a8 layout record (version {stored.get('version')!r}, block_k "
                        f"{stored.get('block_k')!r}, hash {str(stored.get('layout_hash'))[:12]}) is not the one this "
                        f"edgeq reads (version {want['version']}, block_k {want['block_k']}, hash "
                        f"{want['layout_hash'][:12]}); load refuses it, re-quantise")
        return stored, want, False, "refused: unknown amx_w4a8 layout record"
    from edgeq.runtime.w4a8linear import choose_kernel  # noqa: PLC0415 - torch only; no transformers

    choice = choose_kernel(g)
    return stored, want, True, f"zero-copy: the layout is fixed by the kernel's source; every M runs {choice.path} ({choice.reason})"


def _layout(ckpt, manifest, modules, strict_layout, problems, warnings):
    """(stored fingerprint, machine fingerprint, matches, what load will do)."""
    if manifest.kernel == w4a8_layout.KERNEL:
        return _w4a8_layout(manifest, _group_size_or_none(manifest.scheme), problems)
    stored_fp = {k: v for k, v in manifest.layout.items() if k != "perms"}
    try:
        stored = tinygemm.TinygemmLayout.from_json(manifest.layout)
    except EdgeqError as e:
        problems.append(f"{MANIFEST}: {e}")
        return stored_fp, None, False, "refused: the stored layout record is unreadable"
    sizes = {s for s, _ in stored.perms}
    for m in modules.values():
        tail = m.n % stored.block_n
        if m.n % tinygemm.ROW_MULTIPLE == 0 and ((tail and tail not in sizes) or (m.n >= stored.block_n and stored.block_n not in sizes)):
            problems.append(f"{MANIFEST}: the layout record has no block of {tail or stored.block_n} rows, which "
                            f"{m.name} (N={m.n}) needs; it cannot be unpacked or repacked")
            break
    try:
        machine = tinygemm.probe()
    except EdgeqError as e:
        warnings.append(f"this machine: {e}")
        return stored_fp, None, False, "refused: torch's int4 packing cannot be measured here"
    if stored.is_compatible(machine):
        return stored_fp, machine.fingerprint(), True, "zero-copy: the stored bytes are this machine's kernel layout"
    qbytes = sum(ckpt.tensors[f"{m}.qweight"].nbytes for m in modules)
    what = (f"layout {stored.layout_hash[:12]} ({stored.cpu_capability}, block {stored.block_n}, torch "
            f"{stored.torch_version}) differs from this machine's {machine.layout_hash[:12]} ({machine.cpu_capability}, "
            f"block {machine.block_n}, torch {machine.torch_version})")
    if strict_layout:
        problems.append(f"{what}: load refuses it under --strict-layout; run `edgeq repack {ckpt.root}`")
        return stored_fp, machine.fingerprint(), False, "refused (--strict-layout)"
    warnings.append(f"{what}: load repacks it (see on_load); `edgeq repack {ckpt.root}` rewrites it once")
    on_load = (f"repack: {len(modules)} qweight tensors ({_mib(qbytes)}) read, unpacked and repacked into "
               f"{_mib(qbytes)} of anonymous memory at every load, with a warning; refused under --strict-layout")
    return stored_fp, machine.fingerprint(), False, on_load


# --------------------------------------------------------------------------------------------------------------- hf


def _hf(ckpt: Checkpoint, recipe: Recipe, problems: list[str]) -> tuple[list[SchemeOption], Plan | None]:
    """Every w4a16 scheme's plan (the quantizer's own); returns the options and the default scheme's plan."""
    options, default_plan = [], None
    default = Scheme.parse(recipe.scheme)
    for g in tinygemm.GROUP_SIZES:
        scheme = Scheme(activation_bits=16, group_size=g)
        try:
            plan = build_plan(ckpt, scheme, recipe.method, recipe)
        except EdgeqError as e:
            problems.append(str(e))
            return [], None
        ok_out = plan.bytes_out
        options.append(SchemeOption(str(scheme), ok_out, plan.bytes_in / ok_out if ok_out else 0.0,
                                    effective_bits(plan), tuple(plan.problems)))
        if scheme == default:
            default_plan = plan
    if all(o.cannot_quantize for o in options):
        problems.append("no w4a16 scheme can quantise every weight (see the cannot-quantise lists); keep the "
                        "offending modules in bf16 with a recipe (keep_bf16)")
    return options, default_plan


# ---------------------------------------------------------------------------------------------------------- foreign


def _not_converted(q: dict, fmt: str) -> list[str]:
    """Names or patterns the config declares unquantised (each format has its own key)."""
    keys = {"gptq": ("modules_to_not_convert",), "awq": ("modules_to_not_convert",), "compressed-tensors": ("ignore",),
            "torchao": ("modules_to_not_convert",), "bitsandbytes": ("llm_int8_skip_modules",)}.get(fmt, ())
    out = [str(p) for k in keys for p in (q.get(k) if isinstance(q.get(k), list) else [])]
    if fmt == "gptq" and isinstance(q.get("dynamic"), dict):  # GPTQModel: "-:regex" = skip these modules
        out += [k for k in q["dynamic"] if str(k).startswith("-:")]
    return out


def _declared(module: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith(("re:", "-:")):
            try:
                if re.search(p[2:] if p.startswith("-:") else p[3:], module):
                    return True
            except re.error:
                continue
        elif p == module or module.endswith("." + p) or p in module:
            return True
    return False


def _foreign_settings(q: dict, fmt: str) -> dict:
    """bits, group_size, symmetric, act_order and details from a quantization_config, per its format's keys;
    values of the wrong JSON type read as unknown."""
    s = _foreign_settings_raw(q, fmt)
    for key, kind in (("bits", int), ("group_size", int), ("symmetric", bool)):
        if not isinstance(s.get(key), kind) or (kind is int and isinstance(s.get(key), bool)):
            s[key] = None
    return s


def _foreign_settings_raw(q: dict, fmt: str) -> dict:
    if fmt == "gptq":
        return {"bits": q.get("bits"), "group_size": q.get("group_size"), "symmetric": q.get("sym"),
                "act_order": str(bool(q.get("desc_act"))).lower() if "desc_act" in q else None,
                "details": {k: q[k] for k in ("checkpoint_format", "lm_head", "dynamic", "true_sequential", "format")
                            if k in q}}
    if fmt == "awq":
        zp = q.get("zero_point")
        return {"bits": q.get("bits", q.get("w_bit")), "group_size": q.get("group_size", q.get("q_group_size")),
                "symmetric": (not zp) if zp is not None else None, "act_order": "false",
                "details": {k: q[k] for k in ("version", "backend") if k in q}}
    if fmt == "compressed-tensors":
        groups = q.get("config_groups") if isinstance(q.get("config_groups"), dict) else {}
        first = next(iter(groups.values()), {})
        first = first if isinstance(first, dict) else {}
        w = first.get("weights") if isinstance(first.get("weights"), dict) else {}
        act = w.get("actorder")
        return {"bits": w.get("num_bits"), "group_size": w.get("group_size"), "symmetric": w.get("symmetric"),
                "act_order": None if act is None else str(act).lower(),
                "details": {"format": q.get("format"), "strategy": w.get("strategy"), "type": w.get("type"),
                            "targets": first.get("targets"), "config_groups": len(groups),
                            "quantization_status": q.get("quantization_status")}}
    if fmt == "torchao":
        qt = q.get("quant_type", {}).get("default") if isinstance(q.get("quant_type"), dict) else {}
        qt = qt if isinstance(qt, dict) else {}
        typ, data = str(qt.get("_type", "")), qt.get("_data") if isinstance(qt.get("_data"), dict) else {}
        bits = 4 if "Int4" in typ else 8 if ("Int8" in typ or "Float8" in typ) else None
        return {"bits": bits, "group_size": data.get("group_size"),
                "symmetric": False if "Int4" in typ else (True if bits == 8 else None), "act_order": None,
                "details": {"config": typ, "packing_format": data.get("int4_packing_format"),
                            "include_input_output_embeddings": q.get("include_input_output_embeddings")}}
    if fmt == "bitsandbytes":
        four = bool(q.get("load_in_4bit")) or q.get("_load_in_4bit") is True
        return {"bits": 4 if four else 8, "group_size": None, "symmetric": True, "act_order": None,
                "details": {"quant_type": q.get("bnb_4bit_quant_type") if four else "llm.int8",
                            "double_quant": q.get("bnb_4bit_use_double_quant") if four else None,
                            "compute_dtype": q.get("bnb_4bit_compute_dtype") if four else None}}
    return {"bits": q.get("bits"), "group_size": q.get("group_size"), "symmetric": None, "act_order": None, "details": {}}


def _foreign_module(module: str, parts: dict[str, TensorInfo], fmt: str, s: dict, meta: dict) -> QModule:
    """Logical [N, K], bits and group size of one quantised module from its tensor shapes (per format layout)."""
    nbytes = sum(i.nbytes for i in parts.values())
    sh = {p: i.shape for p, i in parts.items()}
    n = k = bits = g = None
    cfg_bits, cfg_g = s.get("bits"), s.get("group_size")
    if ".qweight" in sh and ".scales" in sh and len(sh[".qweight"]) == 2 and len(sh[".scales"]) == 2:
        rows, cols = sh[".qweight"]
        groups, n = sh[".scales"]
        if cols == n:  # GPTQ: qweight int32 [K * bits / 32, N]
            if ".g_idx" in sh:
                k = sh[".g_idx"][0]
            elif isinstance(cfg_g, int) and cfg_g > 0:
                k = groups * cfg_g
            elif cfg_bits:
                k = rows * 32 // cfg_bits
            bits = rows * 32 / k if k else None
        else:  # AWQ: qweight int32 [K, N * bits / 32]
            k = rows
            bits = cols * 32 / n if n else None
        g = k // groups if k and groups else None
    elif ".weight_packed" in sh and len(sh[".weight_packed"]) == 2:  # compressed-tensors: int32 [N, K * bits / 32]
        n, packed = sh[".weight_packed"]
        bits = cfg_bits
        k = packed * 32 // bits if bits else None
        sc = sh.get(".weight_scale")
        g = k // sc[1] if k and sc and len(sc) == 2 and sc[1] else None
    elif "._weight_qdata" in sh:  # torchao: per-tensor metadata carries the logical shape and block size
        t = meta.get(f"{module}.weight") or {}
        data = t.get("_data") or {}
        shape, block = data.get("shape"), data.get("block_size")
        if isinstance(shape, list) and len(shape) == 2:
            n, k = shape
        typ = str(t.get("_type", ""))
        bits = 4 if "Int4" in typ else 8 if ("Int8" in typ or "Float8" in typ) else cfg_bits
        g = block[-1] if isinstance(block, list) and block else cfg_g
    elif ".weight.absmax" in sh and ".weight" in sh:  # bnb 4-bit: uint8 [ceil(N*K/2), 1], one absmax per block
        numel = 2 * math.prod(sh[".weight"])
        blocks = math.prod(sh[".weight.absmax"])
        return QModule(module, None, None, numel, 4, numel // blocks if blocks else None, nbytes)
    elif ".SCB" in sh and ".weight" in sh and len(sh[".weight"]) == 2:  # bnb LLM.int8: int8 [N, K] + per-row absmax
        n, k = sh[".weight"]
        bits, g = 8, k
    elif ".weight" in sh and len(sh[".weight"]) == 2:  # fp8 / int8 "float-quantized" / "int-quantized": weight as is
        n, k = sh[".weight"]
        bits = 8 * parts[".weight"].itemsize
        sc = sh.get(".weight_scale")
        g = k // sc[1] if sc and len(sc) == 2 and sc[1] > 1 else None
    numel = n * k if n and k else 0
    return QModule(module, n, k, numel, bits, g, nbytes)


def _foreign_module_safe(module, parts, fmt, s, meta, warnings) -> QModule:
    """The config and metadata are untrusted JSON: values of the wrong type give an unknown geometry and a warning,
    never an exception."""
    try:
        return _foreign_module(module, parts, fmt, s, meta)
    except (TypeError, ValueError, ZeroDivisionError, IndexError, AttributeError) as e:
        warnings.append(f"{module}: tensor shapes and config do not fit the {fmt} layout ({type(e).__name__}: {e}); "
                        "its bits and group size are unknown")
        return QModule(module, None, None, 0, None, None, sum(i.nbytes for i in parts.values()))


def _metadata(ckpt: Checkpoint) -> dict:
    """torchao keeps each tensor's type, logical shape and block size as JSON strings in the safetensors metadata."""
    meta = {}
    for f in ckpt.files:
        for key, value in read_header(f)[1].items():
            try:
                meta[key] = json.loads(value)
            except (ValueError, RecursionError):
                continue
    return meta


def _foreign(ckpt: Checkpoint, recipe: Recipe, q: dict, problems: list[str], warnings: list[str]):
    method = str(q.get("quant_method", "?")).lower()
    fmt = FOREIGN_METHODS.get(method, method)
    if fmt not in FOREIGN_METHODS.values():
        warnings.append(f"quant_method {method!r} is not one edgeq knows (GPTQ, AWQ, compressed-tensors, torchao, "
                        "bitsandbytes): settings are read from the config only")
    s = _foreign_settings(q, fmt)
    qmods = _quant_modules(ckpt)
    meta = _metadata(ckpt) if fmt == "torchao" else {}
    modules = {m: _foreign_module_safe(m, parts, fmt, s, meta, warnings) for m, parts in qmods.items()}
    rows = _rows(ckpt, recipe, qmods)
    head_module = recipe.head.removesuffix(".weight")
    body = [m for name, m in modules.items() if name != head_module]
    bits_seen = sorted({round(m.bits, 3) for m in body if m.bits})
    groups_seen = sorted({m.group_size for m in body if m.group_size})
    if not modules:
        problems.append(f"config.json says quant_method={method!r} but no tensor has a quantisation suffix "
                        f"({', '.join(p.strip('.') for p in _QUANT_PARTS[:4])}, ...): the checkpoint is not what it claims")
    if isinstance(s.get("bits"), int) and bits_seen and bits_seen != [s["bits"]]:
        problems.append(f"config.json says {s['bits']}-bit but the tensor shapes give {bits_seen} bits")
    head = _foreign_head(ckpt, recipe, modules, bits_seen, problems)
    declared = _not_converted(q, fmt)
    silent, kept = [], []
    for r in _unquantized_linears(rows):
        (kept if _declared(r.name.removesuffix(".weight"), declared) else silent).append(r.name)
    if silent and modules:
        total = sum(ckpt.tensors[n].nbytes for n in silent)
        problems.append(f"{len(silent)} Linear weight(s) left in {ckpt.tensors[silent[0]].dtype} beside quantised ones, "
                        f"not declared in the config ({_mib(total)}): {', '.join(silent[:4])}"
                        + (" ..." if len(silent) > 4 else ""))
    if kept:
        warnings.append(f"{len(kept)} Linear weight(s) kept unquantised as the config declares: {', '.join(kept[:4])}")
    if s.get("act_order") in ("true", "group", "weight", "dynamic", "static"):
        warnings.append(f"act-order ({s['act_order']}): weights are quantised in a permuted column order (g_idx); "
                        "kernels must gather by g_idx")
    info = ForeignInfo(format=fmt, quant_method=method, bits=s.get("bits"), group_size=s.get("group_size"),
                       symmetric=s.get("symmetric"), act_order=s.get("act_order"), head=head,
                       quantized_modules=len(modules), bits_seen=tuple(bits_seen), group_sizes_seen=tuple(groups_seen),
                       unquantized_linears=tuple(silent + kept), details=s.get("details", {}))
    q_bytes = sum(m.bytes for m in modules.values())
    q_weights = sum(m.numel for m in modules.values())
    params = q_weights + sum(r.bytes // _itemsize(r.dtype) for r in rows if not r.quantized)
    return info, rows, qmods, params, (8 * q_bytes / q_weights if q_weights else None)


def _foreign_head(ckpt: Checkpoint, recipe: Recipe, modules: dict[str, QModule], bits_seen, problems) -> str:
    head_module = recipe.head.removesuffix(".weight")
    total = ckpt.nbytes
    if head_module in modules:
        hb = modules[head_module].bits
        desc = f"quantised, {hb:g}-bit" if hb else "quantised"
        if hb and bits_seen and any(abs(hb - b) > 1e-6 for b in bits_seen):
            problems.append(f"output head {head_module} is stored at {hb:g} bits while the linears are "
                            f"{'/'.join(f'{b:g}' for b in bits_seen)}-bit ({_mib(modules[head_module].bytes)}): "
                            "another precision than the rest of the model")
        return desc
    head = ckpt.tensors.get(recipe.head)
    if head is not None:
        problems.append(f"output head {recipe.head} left in {head.dtype} ({_mib(head.nbytes)}, "
                        f"{100 * head.nbytes / total:.0f}% of the checkpoint): the largest matmul per token runs "
                        "unquantised")
        return f"{head.dtype}, unquantised"
    emb = next((ckpt.tensors[e] for e in recipe.embeddings if e in ckpt.tensors), None)
    if emb is not None and emb.dtype in FLOAT_CODES:
        problems.append(f"output head tied to {emb.name} ({emb.dtype}, {_mib(emb.nbytes)}): the head matmul runs "
                        "unquantised")
        return f"tied to {emb.name} ({emb.dtype})"
    return "not found"


# ----------------------------------------------------------------------------------------------------------- verify


def _blocks(info: TensorInfo):
    """The tensor in row blocks of about VERIFY_BLOCK_BYTES (one block for a 0-d tensor)."""
    if not info.shape:
        yield read_tensor(info)
        return
    rows = info.shape[0]
    row_bytes = info.nbytes // rows if rows else 0
    step = max(1, VERIFY_BLOCK_BYTES // max(row_bytes, 1))
    for a in range(0, rows, step):
        yield read_tensor(info, (a, min(rows, a + step)))


def _check_values(info: TensorInfo, kind: str) -> list[str]:
    """NaN/Inf in any float tensor; scales must be positive and nonzero, zeros finite."""
    if info.nbytes == 0:
        return []
    if info.dtype not in FLOAT_CODES + ("F64", "F8_E4M3", "F8_E5M2"):
        for _ in _blocks(info):  # packed and integer tensors: every bit pattern is a valid value; read them all
            pass
        return []
    bad = nonpos = badzero = 0
    sz = info.name.endswith((".scales_and_zeros", "._weight_scale_and_zero")) and info.shape and info.shape[-1] == 2
    scale = info.name.endswith((".scales", ".weight_scale", "._weight_scale", ".weight.absmax", ".SCB"))
    nonneg_only = info.name.endswith((".weight.absmax", ".SCB"))  # absmax of an all-zero block is 0
    for block in _blocks(info):
        x = block.float()
        if sz:
            s, z = x[..., 0], x[..., 1]
            bad += int((~torch.isfinite(s)).sum())
            nonpos += int((torch.isfinite(s) & (s <= 0)).sum())
            badzero += int((~torch.isfinite(z)).sum())
        else:
            bad += int((~torch.isfinite(x)).sum())
            if scale:
                nonpos += int((torch.isfinite(x) & ((x < 0) if nonneg_only else (x <= 0))).sum())
    out = []
    what = "scales" if (sz or scale) else "values"
    if bad:
        out.append(f"{info.file.name}: tensor {info.name}: {bad} NaN/Inf {what}")
    if nonpos:
        out.append(f"{info.file.name}: tensor {info.name}: {nonpos} scale(s) {'negative' if nonneg_only else 'zero or negative'}")
    if badzero:
        out.append(f"{info.file.name}: tensor {info.name}: {badzero} NaN/Inf zero point(s)")
    return out


def _roundtrip(ckpt: Checkpoint, manifest: Manifest, modules: dict[str, QModule], problems: list[str]) -> list[str]:
    """Unpack then pack with the stored layout must give back the stored bytes, on a sample of modules."""
    if manifest.kernel == w4a8_layout.KERNEL:
        return _w4a8_roundtrip(ckpt, manifest, modules, problems)
    try:
        layout = tinygemm.TinygemmLayout.from_json(manifest.layout)
    except EdgeqError:
        return []  # already reported from the headers
    picks = _roundtrip_picks(modules)
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


def _roundtrip_picks(modules: dict[str, QModule]) -> list[str]:
    """The head, then one module of each distinct shape (different N exercise different tail blocks), at most
    ROUNDTRIP_SAMPLE."""
    picks = [HEAD_MODULE] if HEAD_MODULE in modules else []
    shapes = {(modules[m].n, modules[m].k) for m in picks}
    for m in sorted(modules):
        if len(picks) < ROUNDTRIP_SAMPLE and (modules[m].n, modules[m].k) not in shapes:
            picks.append(m)
            shapes.add((modules[m].n, modules[m].k))
    return picks


def _w4a8_roundtrip(ckpt: Checkpoint, manifest: Manifest, modules: dict[str, QModule], problems: list[str]) -> list[str]:
    """amx_w4a8: unpack + pack must give back the stored bytes, the int32 compensation after every slot included
    (a stale compensation would shift every output of the kernel), on the head and one module of each shape."""
    picks = _roundtrip_picks(modules)
    done = []
    for m in picks:
        g = modules[m].group_size
        qw, sc, zp = (read_tensor(ckpt.tensors[f"{m}{s}"]) for s in (".qweight", ".scales", ".zeros"))
        try:
            again = w4a8_layout.pack(w4a8_layout.unpack(qw, g), w4a8_layout.unpack_params(sc),
                                     w4a8_layout.unpack_params(zp), g, name=m)
        except EdgeqError as e:
            problems.append(f"{m}: unpack/repack failed ({e})")
            continue
        if not torch.equal(again.qweight, qw):
            diff = int((again.qweight != qw).sum())
            problems.append(f"{m}.qweight: unpack/repack changes {diff} byte(s) (nibbles or the int32 compensation after "
                            "each slot do not agree with the zeros); the kernel would compute wrong outputs")
            continue
        done.append(m)
    return done


def _verify(ckpt: Checkpoint, kind: str, manifest: Manifest | None, modules: dict, problems: list[str]) -> VerifyResult:
    t0 = time.perf_counter()
    shards, read = {}, 0
    for f in ckpt.files:
        if manifest is None:
            shards[f.name] = "not checked (no manifest)"
            continue
        want = manifest.shards.get(f.name)
        if want is None:
            shards[f.name] = "not in manifest"
            continue
        got = sha256_file(f)
        read += f.stat().st_size
        shards[f.name] = "ok" if got == want else "sha256 mismatch"
        if got != want:
            problems.append(f"{f.name}: sha256 {got[:12]}... does not match the manifest's {want[:12]}...; the file "
                            "changed after it was written (disk, copy or edit); re-quantise or re-copy it")
    for info in ckpt.tensors.values():
        problems.extend(_check_values(info, kind))
        read += info.nbytes
    roundtrip = _roundtrip(ckpt, manifest, modules, problems) if manifest is not None else []
    return VerifyResult(len(ckpt.tensors), read, time.perf_counter() - t0, shards, tuple(roundtrip))


def _config_problems(ckpt: Checkpoint, modules: dict[str, QModule]) -> list[str]:
    """With --verify: the model config.json builds (on the meta device, as load builds it) must fit the tensors;
    a hidden_size or layer geometry that contradicts them is refused at load, so it is a problem here too."""
    from edgeq.runtime import loader  # noqa: PLC0415 - transformers; only under --verify
    from edgeq.io import skeleton

    try:
        model = skeleton.build_meta_model(skeleton.load_config(ckpt.root), torch.bfloat16)
    except EdgeqError as e:
        return [str(e)]
    shapes = {name: tuple(info.shape) for name, info in ckpt.tensors.items()}
    return [f"{p} (load refuses it)" for p in loader.config_mismatches(model, shapes, {m: (q.n, q.k) for m, q in modules.items()})]


def _stored_twice_data(ckpt: Checkpoint, recipe: Recipe, problems: list[str]) -> None:
    """With --verify: an untied float head that is a byte-for-byte copy of the embedding is the same tensor twice."""
    head = ckpt.tensors.get(recipe.head)
    emb = next((ckpt.tensors[e] for e in recipe.embeddings if e in ckpt.tensors), None)
    if head is None or emb is None or ckpt.config.get("tie_word_embeddings") is True:
        return
    if head.dtype != emb.dtype or head.shape != emb.shape:
        return
    if all(torch.equal(a, b) for a, b in zip(_blocks(head), _blocks(emb))):
        problems.append(f"{recipe.head} is a byte-for-byte copy of {emb.name} ({_mib(head.nbytes)} stored twice); "
                        "set tie_word_embeddings=true and drop the copy, or quantise the head")


# ------------------------------------------------------------------------------------------------------------ entry


def detect_kind(ckpt: Checkpoint) -> str:
    q = ckpt.quantization_config
    if (q and str(q.get("quant_method", "")).lower() == "edgeq") or (ckpt.root / MANIFEST).is_file():
        return "edgeq"
    if q is not None:
        return "foreign"
    if _quant_modules(ckpt):
        return "foreign"
    return "hf"


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
    ckpt = open_checkpoint(path)
    problems: list[str] = []
    warnings: list[str] = []
    rec, _ = _recipe(ckpt.config, recipe, warnings)
    kind = detect_kind(ckpt)
    info = foreign = schemes = memory = None
    manifest, modules, basis = None, {}, ""
    geometry = kv_geometry(ckpt.config)
    if kind == "edgeq":
        info, rows, modules, params, bits, manifest = _edgeq(ckpt, rec, strict_layout, problems, warnings)
        from edgeq.convert.pipeline import tokenizer_problem  # noqa: PLC0415 (no tokenizer: generate/serve cannot encode text)

        if no_tokenizer := tokenizer_problem(ckpt.root):
            problems.append(no_tokenizer)
        w4 = info.kernel == w4a8_layout.KERNEL
        memory = _edgeq_memory(ckpt, modules, geometry, kv_cache_bytes, max_model_len,
                               repack=not info.layout_matches and not w4, kernel=info.kernel)
        basis = "as stored" + ("" if info.layout_matches or w4 else "; qweights repacked into anonymous memory at load")
    elif kind == "hf":
        rows = _rows(ckpt, rec, {})
        params = sum(r.bytes // _itemsize(r.dtype) for r in rows)
        options, plan = _hf(ckpt, rec, problems)
        schemes = tuple(options)
        bits = None
        if plan is not None:
            memory = _plan_memory(plan, geometry, kv_cache_bytes, max_model_len)
            basis = f"after `edgeq quantize --scheme {plan.scheme}` (recipe {rec.name}'s default)"
        else:
            basis = "not projected: edgeq cannot plan a conversion of this checkpoint (see problems)"
    else:
        q = ckpt.quantization_config or {"quant_method": "unknown (tensors look quantised, config has no "
                                                         "quantization_config)"}
        if ckpt.quantization_config is None:
            problems.append("tensors carry quantisation suffixes (qweight, scales, ...) but config.json has no "
                            "quantization_config: loaders will treat them as float weights and fail")
        foreign, rows, _, params, bits = _foreign(ckpt, rec, q, problems, warnings)
        basis = "not projected: edgeq serves edgeq checkpoints (quantise the original float model)"
    _stored_twice(ckpt, rec, _quant_modules(ckpt), problems)
    if memory is not None:
        problems.extend(memory.problems)
    verified = None
    if verify:
        verified = _verify(ckpt, kind, manifest, modules, problems)
        _stored_twice_data(ckpt, rec, problems)
        if kind in ("edgeq", "hf"):
            problems.extend(_config_problems(ckpt, modules))
    total = ckpt.nbytes
    return InspectReport(
        schema_version=SCHEMA_VERSION, path=str(ckpt.root), kind=kind, model=_model(ckpt.config, params),
        files=_files(ckpt), bytes_by_category=_by_category(rows), effective_bits=bits,
        bits_per_parameter=8 * total / params if params else 0.0, edgeq=info, foreign=foreign, schemes=schemes,
        memory=memory, memory_basis=basis, problems=tuple(problems), warnings=tuple(warnings), verify=verified,
        tensors=tuple(rows) if tensors else None,
    )


def _block_n() -> int:
    """The row-block size the runtime will use here (this machine's layout; it repacks foreign ones to it)."""
    try:
        return tinygemm.probe().block_n
    except EdgeqError:
        return 64


def _edgeq_memory(ckpt, modules, geometry, kv_cache_bytes, max_model_len, repack, kernel: str = "") -> MemoryProjection:
    if kernel == w4a8_layout.KERNEL:
        parts = {f"{m}{s}" for m in modules for s in (".qweight", ".scales", ".zeros")}
        tensors = [MemTensor(n, i.dtype, i.numel, i.nbytes, packed=n in parts) for n, i in ckpt.tensors.items()]
        return project(geometry, tensors, w4a8_scratch(), kv_cache_bytes, max_model_len, False)
    # M.perm (int64, act-order GPTQ) is used in place by the loader, like the packed tensors: mapped, not cast
    parts = {f"{m}{s}" for m in modules for s in (".qweight", ".scales_and_zeros", ".perm")}
    tensors = [MemTensor(n, i.dtype, i.numel, i.nbytes, packed=n in parts, qweight=n.endswith(".qweight") and n in parts)
               for n, i in ckpt.tensors.items()]
    big = scratch(((m.name, m.n, m.k) for m in modules.values()), _block_n())
    return project(geometry, tensors, big, kv_cache_bytes, max_model_len, repack)


def _plan_memory(plan: Plan, geometry, kv_cache_bytes, max_model_len) -> MemoryProjection:
    """What serving the quantised output of ``plan`` would cost (a weight it cannot quantise counted as bf16)."""
    tensors, quantized = [], []
    for e in plan.entries:
        if e.action == "quantize" and e.bytes_out:
            n, k = e.shape
            tensors += [MemTensor(f"{e.module}.qweight", "U8", n * k // 2, n * k // 2, packed=True, qweight=True),
                        MemTensor(f"{e.module}.scales_and_zeros", "BF16", 0, e.bytes_out - n * k // 2, packed=True)]
            quantized.append((e.module, n, k))
        else:
            numel = math.prod(e.shape)
            tensors.append(MemTensor(e.name, "BF16", numel, numel * 2))
    return project(geometry, tensors, scratch(quantized, _block_n()), kv_cache_bytes, max_model_len)


# ---------------------------------------------------------------------------------------------------------- render


def render(report: InspectReport, console=None, err_console=None) -> None:
    """The compact human report: a headline, the kind-specific block, bytes, memory, then problems in red."""
    from rich.console import Console
    from rich.table import Table

    out = console or Console()
    err = err_console or out
    m, f = report.model, report.files
    params = f"{m['parameters'] / 1e6:,.1f}M parameters" if m["parameters"] >= 1e5 else f"{m['parameters']:,} parameters"
    out.print(f"[bold]{report.path}[/bold]  {report.kind} checkpoint · {m['architecture']} ({m['model_type']}) · "
              f"{params} · {len(f['shards'])} shard(s), {_mib(f['bytes'])}, {f['tensors']} tensors", highlight=False)
    if report.edgeq:
        _render_edgeq(report, out)
    if report.foreign:
        _render_foreign(report.foreign, out)
    if report.schemes is not None:
        if not report.bytes_by_category["head"]:
            out.print("  head: tied to the embedding; `edgeq quantize` writes its own quantised head from it (untied)",
                      highlight=False)
        _render_schemes(report, out, Table)
    _render_bytes(report, out, Table)
    if report.memory:
        _render_memory(report, out, Table)
    elif report.memory_basis:
        out.print(f"memory: {report.memory_basis}", highlight=False)
    if report.verify:
        v = report.verify
        out.print(f"verify: {v.tensors_checked} tensors, {_mib(v.bytes_read)} read in {v.seconds:.1f} s; shards: "
                  + ", ".join(f"{k} {s}" for k, s in v.shards.items())
                  + (f"; unpack/repack exact on {', '.join(v.roundtrip)}" if v.roundtrip else ""), highlight=False)
    if report.tensors is not None:
        t = Table(title="tensors", title_justify="left")
        for col in ("name", "shape", "dtype", "role", "bytes"):
            t.add_column(col, justify="right" if col == "bytes" else "left")
        for r in report.tensors:
            t.add_row(r.name, "x".join(map(str, r.shape)) or "scalar", r.dtype, r.role + (" (q)" if r.quantized else ""),
                      f"{r.bytes:,}")
        out.print(t)
    for w in report.warnings:
        err.print(f"[yellow]warning:[/yellow] {w}", highlight=False, soft_wrap=True)
    for p in report.problems:
        err.print(f"[red]problem: {p}[/red]", highlight=False, soft_wrap=True)
    if not report.problems:
        out.print("[green]no problems found[/green]" + ("" if report.verify else " (headers only; --verify reads the data)"))


def _render_edgeq(report: InspectReport, out) -> None:
    e = report.edgeq
    out.print(f"  {e.scheme} · method {e.method} · kernel {e.kernel} · {report.effective_bits or 0:.2f} bits per "
              f"quantised weight, {report.bits_per_parameter:.2f} bits per parameter overall", highlight=False)
    for g in sorted({g for _, g in e.group_sizes}):  # a recipe's finer groups (docs/format.md)
        names = [m for m, mg in e.group_sizes if mg == g]
        out.print(f"  group size {g} for {len(names)} module(s): {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}; "
                  f"the rest {e.group_size}", highlight=False)
    s = e.layout_stored
    color = "green" if e.layout_matches else "yellow"
    if e.kernel == w4a8_layout.KERNEL:
        out.print(f"  layout {str(s.get('layout_hash'))[:12]} (amx_w4a8 v{s.get('version')}, block {s.get('block_n')} x "
                  f"{s.get('block_k')}, VNNI-{s.get('vnni')}): [{color}]"
                  f"{'read by this edgeq' if e.layout_matches else 'not one this edgeq reads'}[/{color}]; load: {e.on_load}",
                  highlight=False)
    else:
        out.print(f"  layout {str(s.get('layout_hash'))[:12]} ({s.get('cpu_capability')}, block {s.get('block_n')}, torch "
                  f"{s.get('torch_version')}): [{color}]{'matches this machine' if e.layout_matches else 'differs from this machine'}"
                  f"[/{color}]; load: {e.on_load}", highlight=False)
    head = f"head quantised ({'untied from ' + e.head_source if e.untied else 'from ' + e.head_source})"
    mnc = ", ".join(f"{k} ({v})" for k, v in e.modules_not_converted.items()) or "none"
    out.print(f"  {head} · {e.quantized_modules} quantised modules · not converted: {mnc}", highlight=False)


def _render_foreign(fi: ForeignInfo, out) -> None:
    sym = {True: "symmetric", False: "asymmetric", None: "symmetry ?"}[fi.symmetric]
    method = f" ({fi.quant_method})" if fi.quant_method != fi.format else ""
    out.print(f"  {fi.format}{method} · {fi.bits}-bit · group {fi.group_size} · {sym} · act-order "
              f"{fi.act_order or 'n/a'} · {fi.quantized_modules} quantised modules · shapes give "
              f"{'/'.join(f'{b:g}' for b in fi.bits_seen) or '?'}-bit, groups {list(fi.group_sizes_seen) or '?'}",
              highlight=False)
    details = ", ".join(f"{k}={v}" for k, v in fi.details.items() if v is not None)
    out.print(f"  head: {fi.head}" + (f" · {details}" if details else ""), highlight=False)


def _render_schemes(report: InspectReport, out, Table) -> None:
    t = Table(title="what `edgeq quantize` would write", title_justify="left")
    for col in ("scheme", "size", "ratio", "bits/weight", "cannot quantise"):
        t.add_column(col, justify="left" if col in ("scheme", "cannot quantise") else "right")
    for o in report.schemes:
        cannot = "\n".join(o.cannot_quantize) if o.cannot_quantize else "-"
        t.add_row(o.scheme, _mib(o.bytes_out), f"{o.ratio:.2f}x", f"{o.effective_bits:.2f}",
                  f"[red]{cannot}[/red]" if o.cannot_quantize else cannot)
    out.print(t)


def _render_bytes(report: InspectReport, out, Table) -> None:
    t = Table(title="bytes by category", title_justify="left")
    t.add_column("category")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    total = sum(report.bytes_by_category.values()) or 1
    for k, v in report.bytes_by_category.items():
        if v:
            t.add_row(k.replace("_", " "), _mib(v), f"{100 * v / total:.1f}%")
    out.print(t)


def _render_memory(report: InspectReport, out, Table) -> None:
    mem = report.memory
    t = Table(title=f"memory to serve it at max_model_len {mem.max_model_len:,}, KV budget {_mib(mem.kv_cache_bytes)}: "
                    f"{report.memory_basis}", title_justify="left")
    t.add_column("")
    t.add_column("bytes", justify="right")
    t.add_column("", style="dim")
    t.add_row("mapped weights (file-backed)", _mib(mem.mapped_weights), "used as stored, shared with the page cache")
    t.add_row("copied weights (anon)", _mib(mem.anon_weights),
              "repacked qweights" if mem.repack else "casts of non-bf16 tensors")
    t.add_row("KV cache (anon)", _mib(mem.kv_bytes), f"{mem.kv_tokens:,} tokens x {mem.kv_bytes_per_token:,} B")
    t.add_row("prefill scratch (anon)", _mib(mem.prefill_scratch), mem.prefill_scratch_tensor)
    t.add_row("[bold]total[/bold]", f"[bold]{_mib(mem.total)}[/bold]", f"anonymous {_mib(mem.anon_total)}")
    out.print(t)


# ------------------------------------------------------------------------------------------------------------- CLI


def inspect_command(
    path: Path = typer.Argument(..., help="Checkpoint directory or hub id (org/name): edgeq, plain Hugging Face, or GPTQ/AWQ/compressed-tensors/torchao/bitsandbytes."),
    revision: Annotated[Optional[str], typer.Option("--revision", help=REVISION_HELP)] = None,
    tensors: bool = typer.Option(False, "--tensors", help="Per-tensor table: name, shape, dtype, role, bytes."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (schema: docs/inspect.md)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context for the memory projection [default: min(model maximum, what the KV budget holds)]."),
    kv_cache_bytes: str = typer.Option("256MiB", "--kv-cache-bytes", help="KV cache budget for the memory projection, e.g. 512MiB."),
    verify: bool = typer.Option(False, "--verify", help="Also read all tensor data: NaN/Inf, scales, shard sha256, unpack/repack round trip."),
    strict: bool = typer.Option(False, "--strict", help="Exit code 1 when any problem is found."),
    strict_layout: bool = typer.Option(False, "--strict-layout", help="A layout that load would repack is a problem (load refuses it under the same flag)."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Recipe NAME or .toml FILE for tensor roles and the plan [default: by model_type]."),
) -> None:
    """Show what is in a checkpoint, what serving it costs, and what is wrong with it (headers only by default)."""
    from edgeq.cli.main import parse_bytes
    from edgeq.console import emit, err, out

    report = inspect_checkpoint(resolve_model(path, revision), verify=verify, max_model_len=max_model_len,
                                kv_cache_bytes=parse_bytes(kv_cache_bytes, "--kv-cache-bytes"), strict_layout=strict_layout,
                                recipe=recipe, tensors=tensors)
    emit(report, as_json, lambda r: render(r, out, err))
    if strict and report.problems:
        raise ThresholdError(f"--strict: {len(report.problems)} problem(s) found in {report.path}")
