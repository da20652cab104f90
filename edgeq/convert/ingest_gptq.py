"""GPTQ checkpoints as input to ``edgeq quantize``: planned from headers, repacked into tinygemm exactly.

Input: a Hugging Face directory whose config says ``quantization_config.quant_method == "gptq"`` (AutoGPTQ, GPTQModel,
the hub's "-GPTQ-Int4" models; or a bare ``quantize_config.json`` beside AutoGPTQ's tensors). Its settings are
``bits``, ``group_size`` (-1: one group over K), ``sym``, ``desc_act``, ``checkpoint_format`` (GPTQModel; older
writers say ``format``; absent means ``"gptq"``), and GPTQModel's per-module ``dynamic`` overrides
(``{"-:regex": {}}`` excludes modules, ``{"regex": {"bits": 8, "group_size": 32}}`` overrides settings; the first
pattern that matches from the start of the module name wins, as in GPTQModel). ``meta`` (quantizer, damping, ...) is
recorded in the manifest, never interpreted.

Per module ``M`` with ``M.qweight`` (tensors and decoding: edgeq/layouts/gptq.py, docs/gptq.md) the plan chooses:

- ``repack`` (exact): 4 bits and the scheme's group size equal to the checkpoint's (or dividing it when the
  configured one is no tinygemm group size, e.g. per-channel ``-1``: each group's parameters are repeated, still
  exact). ``decode_gptq -> to_tinygemm -> pack`` with the kernel's op; act-order layers (a ``g_idx`` that is not
  ``k // G``) also get ``M.perm`` (int64 [K]) and compute ``kernel(x[..., perm])``. The repacked weights are checked
  against GPTQ's own dequantisation, element by element, with the bf16 bound ``2^-8 |s| (|q - 8| + |8 - z|)``
  (<= |s|/16: a sixteenth of a quantisation step); a violation would be a bug and stops the conversion.
- ``requantize``: dequantised exactly (GPTQ's formula in fp32) and quantised again with the entry's method (the
  default RTN): always for an 8-bit head (GPTQModel's ``lm_head`` quantisation), and, with ``--requantize``, for any
  layer that cannot be repacked exactly (another group size, 8 bits, groups of unequal size). Without
  ``--requantize`` those are errors that list every such layer with its numbers.
- ``keep``: a recipe's ``keep_bf16`` layer, stored as its exact dequantisation in bf16.

Float weights in a GPTQ checkpoint (a bf16/fp16 head, layers GPTQModel excluded) are quantised with the default
method and reported; a missing head is tied to the embedding table as for float input; ``--head-from DIR`` takes the
head from the original float model instead (its ``lm_head.weight``, or its embedding table when tied). Every other
tensor is copied as bf16.

The plan reads headers and, for act-order detection, each layer's ``g_idx`` (K int32 values per layer, a few MB for
a 7B model). Streaming reads one layer's packed ``qweight`` at a time (N*K*bits/8 bytes) and works in row blocks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from edgeq.convert.plan import (
    GPTQSource, Plan, PlanEntry, assert_head_quantized, quantized_bytes, tensor_role, weight_rule,
)
from edgeq.io.hf import Checkpoint, open_checkpoint
from edgeq.convert.recipe import Recipe
from edgeq.io.safetensors import FLOAT_CODES, ShardedWriter
from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.layouts.gptq import FORMATS, GPTQLinear, decode_gptq, error_bound, to_tinygemm
from edgeq.quantize.rtn import quantize_groups
from edgeq.scheme import Scheme

METHOD = "gptq-ingest"
PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
BOUND = "|w_edgeq - w_gptq| <= 2^-8 * |s| * (|q - 8| + |8 - z|) <= |s| / 16 per element (bf16 scale and zero)"
ROW_BLOCK_ELEMENTS = 1 << 20  # outputs per block ~1M weights: the exactness check keeps a few fp32 copies of a block
_FOREIGN_SUFFIXES = (".scales_and_zeros", ".weight_packed", ".weight_scale", ".SCB", ".absmax")


# ---------------------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class GPTQConfig:
    """A GPTQ checkpoint's settings as its config states them (``where`` names the file, for messages)."""

    bits: Any
    group_size: Any
    sym: bool
    desc_act: bool
    checkpoint_format: str
    dynamic: tuple[tuple[str, bool, Any, tuple[tuple[str, Any], ...]], ...]  # (key, negative, regex, overrides)
    where: str
    record: tuple[tuple[str, Any], ...]  # for the manifest's "source"

    def for_module(self, module: str) -> dict | None:
        """bits / group_size / sym / desc_act of ``module`` after ``dynamic``; None if ``dynamic`` excludes it."""
        s = {"bits": self.bits, "group_size": self.group_size, "sym": self.sym, "desc_act": self.desc_act}
        for _, negative, rx, overrides in self.dynamic:
            if rx.match(module):
                if negative:
                    return None
                s.update({k: v for k, v in overrides if k in s})
                break
        return s


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise EdgeqError(f"{path}: cannot read it as JSON ({str(e)[:100]}); restore it from the model's source") from e
    if not isinstance(data, dict):
        raise EdgeqError(f"{path}: expected a JSON object")
    return data


def read_gptq_config(ckpt: Checkpoint) -> GPTQConfig | None:
    """The input's GPTQ settings; None for a float checkpoint. Any other quantised format is refused here."""
    q, where = ckpt.quantization_config, ckpt.root / "config.json"
    has_qweight = any(n.endswith(".qweight") for n in ckpt.tensors)
    if q is None:
        alt = ckpt.root / "quantize_config.json"  # AutoGPTQ's own file, when config.json lacks the block
        if not (alt.is_file() and has_qweight):
            return None
        q, where = _json(alt), alt
        q.setdefault("quant_method", "gptq")
    method = q.get("quant_method")
    if method != "gptq":
        raise EdgeqError(
            f"{where}: the input is already quantised (quant_method={method!r}); edgeq ingests GPTQ checkpoints "
            "(quant_method \"gptq\") and quantises float ones: give edgeq the original float checkpoint"
        )
    if not has_qweight:
        raise EdgeqError(
            f"{where}: the input is already quantised (quant_method='gptq') by its config, but its safetensors hold no "
            "GPTQ tensors (no *.qweight); restore the checkpoint's weights, or give edgeq the original float checkpoint"
        )
    fmt = q.get("checkpoint_format") or q.get("format") or "gptq"
    if q.get("is_marlin_format"):
        fmt = "marlin"
    if not isinstance(fmt, str) or fmt.lower() not in FORMATS:
        raise EdgeqError(
            f"{where}: checkpoint_format {fmt!r} is not readable (edgeq reads {' and '.join(FORMATS)}; marlin, bitblas "
            "and qqq are kernel-specific repackings); use the checkpoint in gptq format"
        )
    pack = q.get("pack_dtype", "int32")
    if pack != "int32":
        raise EdgeqError(f"{where}: pack_dtype {pack!r} is not supported (only int32 packing); re-export with pack_dtype int32")
    for key in ("sym", "desc_act"):
        if key in q and not isinstance(q[key], bool):
            raise EdgeqError(f"{where}: {key} must be true or false, got {q[key]!r}")
    dynamic = []
    raw = q.get("dynamic") or {}
    if not isinstance(raw, dict):
        raise EdgeqError(f"{where}: dynamic must be an object of {{pattern: overrides}}, got {type(raw).__name__}")
    for key, overrides in raw.items():
        negative = key.startswith("-:")
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise EdgeqError(f"{where}: dynamic pattern {key!r} is not a valid regex ({e})") from e
        if not negative and not isinstance(overrides, dict):
            raise EdgeqError(f"{where}: dynamic[{key!r}] must be an object of overrides, got {overrides!r}")
        dynamic.append((key, negative, rx, tuple(sorted((overrides or {}).items())) if not negative else ()))
    meta = q.get("meta") if isinstance(q.get("meta"), dict) else {}
    record = {"quant_method": "gptq", "config": where.name, "checkpoint_format": fmt.lower(), "bits": q.get("bits"),
              "group_size": q.get("group_size"), "sym": q.get("sym", True), "desc_act": q.get("desc_act", False)}
    for key in ("lm_head", "dynamic", "static_groups", "true_sequential", "damp_percent"):
        if key in q:
            record[key] = q[key]
    for key in ("quantizer", "uri", "static_groups", "damp_percent", "mse", "act_group_aware"):
        if key in meta:
            record[f"meta.{key}"] = meta[key]
    return GPTQConfig(
        bits=q.get("bits"), group_size=q.get("group_size"), sym=q.get("sym", True), desc_act=q.get("desc_act", False),
        checkpoint_format=fmt.lower(), dynamic=tuple(dynamic), where=str(where), record=tuple(record.items()),
    )


def default_scheme(cfg: GPTQConfig, recipe: Recipe) -> Scheme:
    """The checkpoint's own group size when tinygemm has it (an exact repack), else the recipe's scheme."""
    g = cfg.group_size
    if isinstance(g, int) and not isinstance(g, bool) and g in tinygemm.GROUP_SIZES:
        return Scheme(activation_bits=16, group_size=g)
    return Scheme.parse(recipe.scheme)


# ------------------------------------------------------------------------------------------------------------ plan
def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _module_source(ckpt: Checkpoint, cfg: GPTQConfig, module: str) -> tuple[GPTQSource | None, tuple[int, int] | None, str | None]:
    """(source, logical [N, K], problem) of one GPTQ module, from its headers."""
    s = cfg.for_module(module)
    if s is None:
        return None, None, f"{module}: the config's dynamic excludes it from quantisation, but it has {module}.qweight"
    bits, g, sym = s["bits"], s["group_size"], s["sym"]
    if not _int(bits) or bits not in (4, 8):
        return None, None, f"{module}: {bits}-bit GPTQ is not supported (4 or 8 bits); requantise from the original model"
    if not _int(g) or (g <= 0 and g != -1):
        return None, None, f"{module}: group_size {g!r} is invalid (a positive integer or -1)"
    t = ckpt.tensors
    names = {p: f"{module}{p}" for p in PARTS}
    missing = [names[p] for p in (".qzeros", ".scales") if names[p] not in t]
    if missing:
        return None, None, f"{module}: has .qweight but no {', '.join(missing)}; the checkpoint is incomplete"
    qw, qz, sc = t[names[".qweight"]], t[names[".qzeros"]], t[names[".scales"]]
    pf = 32 // bits
    if qw.dtype != "I32" or len(qw.shape) != 2 or qz.dtype != "I32" or len(qz.shape) != 2:
        return None, None, (f"{module}: qweight {qw.dtype} {list(qw.shape)} / qzeros {qz.dtype} {list(qz.shape)}: expected 2-D "
                            "int32 (only int32 packing is supported)")
    k, n = qw.shape[0] * pf, qw.shape[1]
    gg = k if g == -1 else g
    gc = -(-k // gg)
    if sc.dtype not in FLOAT_CODES or list(sc.shape) != [gc, n] or list(qz.shape) != [gc, n // pf] or n % pf:
        return None, None, (f"{module}: scales {sc.dtype} {list(sc.shape)}, qzeros {list(qz.shape)} do not fit K={k}, N={n}, "
                            f"bits={bits}, group_size={g} (expected scales [{gc}, {n}], qzeros [{gc}, {n // pf}]); is the "
                            f"config's bits/group_size right for this layer?")
    gi = t.get(names[".g_idx"])
    if gi is not None and (len(gi.shape) != 1 or gi.shape[0] != k or gi.dtype not in ("I32", "I64", "I16")):
        return None, None, f"{module}.g_idx: expected an integer vector [{k}] (K from qweight), got {gi.dtype} {list(gi.shape)}"
    src = GPTQSource(qweight=names[".qweight"], qzeros=names[".qzeros"], scales=names[".scales"],
                     g_idx=names[".g_idx"] if gi is not None else None, bits=bits, group_size=g, sym=bool(sym),
                     checkpoint_format=cfg.checkpoint_format)
    return src, (n, k), None


def _groups(ckpt: Checkpoint, src: GPTQSource, k: int) -> tuple[bool, str | None]:
    """(act_order, unequal-groups problem) from the layer's g_idx."""
    if src.g_idx is None:
        return False, None
    g = k if src.group_size == -1 else src.group_size
    gi = ckpt.read(src.g_idx).to(torch.int64)
    gc = -(-k // g)
    if int(gi.min()) < 0 or int(gi.max()) >= gc:
        return False, f"g_idx values {int(gi.min())}..{int(gi.max())} lie outside 0..{gc - 1}"
    counts = torch.bincount(gi, minlength=gc)
    bad = torch.nonzero(counts != g)
    if len(bad):
        j = int(bad[0])
        return False, f"g_idx group {j} has {int(counts[j])} input channels, tinygemm needs exactly {g} in every group"
    return not torch.equal(gi, torch.arange(k) // g), None


def _nbytes(ckpt: Checkpoint, src: GPTQSource) -> int:
    return sum(ckpt.tensors[n].nbytes for n in (src.qweight, src.qzeros, src.scales, src.g_idx) if n)


def _gptq_entry(ckpt, cfg, module, role, scheme, method, recipe, requantize) -> tuple[PlanEntry | None, str | None]:
    src, shape, problem = _module_source(ckpt, cfg, module)
    if problem:
        return None, problem
    n, k = shape
    g_src = k if src.group_size == -1 else src.group_size
    g = scheme.group_size
    where = f"{module} [{n}, {k}] GPTQ {src.bits}-bit g{src.group_size}"
    keep = recipe.keeps(f"{module}.weight") if role == "linear" else None
    base = dict(name=f"{module}.weight", source=src.qweight, shape=(n, k), dtype="I32", role=role,
                bytes_in=_nbytes(ckpt, src), gptq=src)
    if keep:
        return PlanEntry(**base, action="keep", bytes_out=n * k * 2,
                         reason=f"recipe {recipe.name}: keep_bf16 {keep!r} (stored as its exact dequantisation)"), None
    rule = weight_rule((n, k), "F32", scheme)
    if rule:
        return None, f"{where}: {rule}"
    why = []
    if src.bits != 4:
        why.append(f"{src.bits}-bit layers cannot be repacked into 4 bits")
    split = src.group_size not in tinygemm.GROUP_SIZES and g_src % g == 0  # per-channel (-1), 512, ...: only exact way
    if g_src != g and not split:
        why.append(f"the checkpoint's group size is {g_src}, the scheme's is {g}")
    act_order = False
    if not why:
        act_order, uneven = _groups(ckpt, src, k)
        if uneven:
            why.append(uneven)
    if not why:
        reason = "exact" + (f", groups of {g_src} split into {g}" if split else "") + (", act-order: M.perm" if act_order else "")
        return PlanEntry(**base, action="repack", bytes_out=quantized_bytes(n, k, g, act_order), reason=reason,
                         perm=act_order), None
    if (role == "head" and src.bits != 4) or requantize:
        flag = "" if role == "head" and src.bits != 4 else " (--requantize)"
        reason = f"{'; '.join(why)}: dequantised exactly and requantised with {method}{flag}"
        return PlanEntry(**base, action="requantize", bytes_out=quantized_bytes(n, k, g), reason=reason, method=method), None
    fix = f"use --scheme w4a16-g{g_src} to repack exactly, or --requantize" if g_src in tinygemm.GROUP_SIZES and src.bits == 4 \
        and g_src != g else "use --requantize (dequantise exactly, requantise with the default method)"
    return None, f"{where}: {'; '.join(why)}; {fix}"


def _head_from(origin: str | Path, recipe: Recipe, shape: tuple[int, ...] | None, method: str) -> PlanEntry:
    other = open_checkpoint(origin)
    name = recipe.head if recipe.head in other.tensors else next((e for e in recipe.embeddings if e in other.tensors), None)
    if name is None:
        raise EdgeqError(f"--head-from {origin}: has neither {recipe.head} nor an embedding table ({', '.join(recipe.embeddings)})")
    info = other.tensors[name]
    if info.dtype not in FLOAT_CODES or len(info.shape) != 2:
        raise EdgeqError(f"--head-from {origin}: {name} is {info.dtype} {list(info.shape)}; give the original float model")
    if shape is not None and tuple(info.shape) != tuple(shape):
        raise EdgeqError(f"--head-from {origin}: {name} is {list(info.shape)} but the input's head is {list(shape)}; "
                         "is it the original of this model?")
    return PlanEntry(recipe.head, name, info.shape, info.dtype, "head", "quantize", info.nbytes, 0,
                     f"--head-from {other.root}: {name} quantised with {method}", method=method, origin=str(other.root))


def build_gptq_plan(ckpt: Checkpoint, cfg: GPTQConfig, scheme: Scheme | None, method: str, recipe: Recipe, *,
                    requantize: bool = False, head_from: str | Path | None = None) -> Plan:
    """The plan for a GPTQ input (see the module docstring). ``method``: the RTN method for everything that is not
    repacked (float weights, requantised layers)."""
    scheme = scheme or default_scheme(cfg, recipe)
    head_module = recipe.head.removesuffix(".weight")
    modules = {n.removesuffix(".qweight") for n in ckpt.tensors if n.endswith(".qweight")}
    both = sorted(m for m in modules if f"{m}.weight" in ckpt.tensors)
    if both:
        raise EdgeqError(f"{ckpt.root}: {both[0]} has both a float weight and GPTQ tensors ({len(both)} such layers); "
                         "the checkpoint is inconsistent")
    dropped = _zero_biases_without_a_place(ckpt, modules)
    parts = {f"{m}{p}" for m in modules for p in PARTS} | set(dropped)
    entries: list[PlanEntry] = []
    problems: list[str] = []
    head_shape = None
    for name, info in ckpt.tensors.items():
        if name in parts:
            if not name.endswith(".qweight"):
                continue
            module = name.removesuffix(".qweight")
            role = "head" if module == head_module else "linear"
            if role == "head" and head_from is not None:  # replaced: only its shape is needed, to check the original's
                head_shape = _module_source(ckpt, cfg, module)[1]
                continue
            entry, problem = _gptq_entry(ckpt, cfg, module, role, scheme, method, recipe, requantize)
            if problem:
                problems.append(problem)
            if entry is not None:
                head_shape = entry.shape if role == "head" else head_shape
                entries.append(entry)
            continue
        if name.endswith(_FOREIGN_SUFFIXES):
            raise EdgeqError(f"{info.file}: tensor {name} is not part of a GPTQ layer (no {name.rsplit('.', 1)[0]}.qweight); "
                             "the checkpoint mixes quantisation formats")
        role = tensor_role(name, info.shape, recipe)
        if info.dtype not in FLOAT_CODES:
            raise EdgeqError(f"{info.file}: tensor {name} has dtype {info.dtype} and is not part of a GPTQ layer; edgeq "
                             "cannot interpret it")
        if role == "head" and head_from is not None:
            head_shape = info.shape
            continue
        if role in ("linear", "head"):
            keep = recipe.keeps(name) if role == "linear" else None
            if keep:
                entries.append(PlanEntry(name, name, info.shape, info.dtype, role, "keep", info.nbytes, info.numel * 2,
                                         f"recipe {recipe.name}: keep_bf16 {keep!r}"))
                continue
            head_shape = info.shape if role == "head" else head_shape
            rule = weight_rule(info.shape, info.dtype, scheme)
            if rule:
                problems.append(f"{name} {list(info.shape)} {info.dtype}: {rule}")
            what = f"{info.dtype} head" if role == "head" else f"{info.dtype} layer (not GPTQ-quantised in the input)"
            entries.append(PlanEntry(name, name, info.shape, info.dtype, role, "quantize", info.nbytes,
                                     0 if rule else quantized_bytes(*info.shape, scheme.group_size),
                                     f"{what}: quantised with {method}", method=method))
        else:
            entries.append(PlanEntry(name, name, info.shape, info.dtype, role, "copy", info.nbytes, info.numel * 2))
    tied = recipe.head not in ckpt.tensors and f"{head_module}.qweight" not in ckpt.tensors
    emb = next((e for e in entries if e.role == "embedding"), None)
    if head_from is not None:
        head = _head_from(head_from, recipe, head_shape or (emb.shape if emb else None), method)
        rule = weight_rule(head.shape, head.dtype, scheme)
        if rule:
            problems.append(f"{recipe.head} (--head-from) {list(head.shape)}: {rule}")
        entries.append(replace(head, bytes_out=0 if rule else quantized_bytes(*head.shape, scheme.group_size)))
    elif tied:
        if emb is None:
            raise EdgeqError(
                f"{ckpt.root}: no output head ({recipe.head} or {head_module}.qweight) and no embedding table "
                f"({', '.join(recipe.embeddings)}) to tie it to; the recipe's head/embeddings names do not match this checkpoint"
            )
        rule = weight_rule(emb.shape, emb.dtype, scheme)
        if rule:
            problems.append(f"{recipe.head} (tied to {emb.name}) {list(emb.shape)} {emb.dtype}: {rule}")
        entries.append(PlanEntry(recipe.head, emb.name, emb.shape, emb.dtype, "head", "quantize", emb.bytes_in,
                                 0 if rule else quantized_bytes(*emb.shape, scheme.group_size),
                                 f"untied from {emb.name}: quantised with {method}", method=method))
    if not any(e.quantized and e.role == "linear" for e in entries) and not problems:
        problems.append(f"no Linear layers found among {len(entries)} tensors: nothing to quantise besides the head")
    source = dict(cfg.record)
    source["requantize_method"] = method
    if dropped:
        source["dropped_zero_biases"] = sorted(dropped)
    plan = Plan(scheme, METHOD, recipe.name, tuple(entries), tuple(problems), tied, source=source)
    if not problems:
        assert_head_quantized(plan)  # assertion 1 of 3: at plan time
    return plan


def _zero_biases_without_a_place(ckpt: Checkpoint, modules: set[str]) -> list[str]:
    """``M.bias`` tensors of GPTQ layers whose architecture has no bias there (old AutoGPTQ exports stored one, all
    zeros, for every layer): returned so the plan leaves them out, and reported (``dropped_zero_biases``). Such a
    bias holding anything but zeros is an error naming it: the checkpoint then does not match its config.json."""
    biases = sorted(f"{m}.bias" for m in modules if f"{m}.bias" in ckpt.tensors)
    if not biases:
        return []
    from edgeq.io.skeleton import build_meta_model, load_config  # noqa: PLC0415 - only for such checkpoints

    config = load_config(ckpt.root)
    model = build_meta_model(config, torch.bfloat16)
    out = []
    for name in biases:
        module = name.removesuffix(".bias")
        try:
            has_bias = model.get_submodule(module).bias is not None
        except AttributeError:
            continue  # not a module of this architecture: the loader names it as unused
        if has_bias:
            continue
        nonzero = int(torch.count_nonzero(ckpt.read(name)))
        if nonzero:
            raise EdgeqError(f"{ckpt.tensors[name].file}: tensor {name} has {nonzero} nonzero values, but "
                             f"{config.model_type}'s {module} has no bias (config.json); the checkpoint does not match "
                             "its config (fix config.json, e.g. attention_bias/mlp_bias, or the checkpoint)")
        out.append(name)
    return out


# ------------------------------------------------------------------------------------------------------- streaming
@dataclass(frozen=True)
class EntryStats:
    """What streaming one GPTQ entry measured. rel_error: ||w_out - w_in|| / ||w_in|| against the input's exact
    dequantisation; for repacked layers also the largest |w_out - w_in| as a fraction of the bound and of |scale|."""

    rel_error: float
    max_over_bound: float = 0.0
    max_over_scale: float = 0.0


Progress = Callable[[int, str], None]


def _row_step(e: PlanEntry, layout: tinygemm.TinygemmLayout) -> int:
    n, k = e.shape
    return min(n, tinygemm.row_block(layout, ROW_BLOCK_ELEMENTS // k))


def _decode_rows(e: PlanEntry, t: tuple, a: int, b: int) -> GPTQLinear:
    """Outputs a..b of one GPTQ layer (a, b multiples of the 32/bits outputs per qzeros word)."""
    src = e.gptq
    qweight, qzeros, scales, g_idx = t
    pf = 32 // src.bits
    try:
        return decode_gptq(e.module, qweight[:, a:b].contiguous(), qzeros[:, a // pf : b // pf].contiguous(),
                           scales[:, a:b].contiguous(), g_idx, bits=src.bits, group_size=src.group_size, sym=src.sym,
                           checkpoint_format=src.checkpoint_format)
    except EdgeqError as err:
        if (a, b) == (0, e.shape[0]):
            raise
        raise EdgeqError(f"{err} [output indices relative to row {a} of {e.module}]") from None


def stream_entry(ckpt: Checkpoint, e: PlanEntry, scheme: Scheme, layout, writer: ShardedWriter, progress: Progress) -> EntryStats:
    """Write one GPTQ entry (repack / requantize / keep) in row blocks of whole layout blocks."""
    src = e.gptq
    t = (ckpt.read(src.qweight), ckpt.read(src.qzeros), ckpt.read(src.scales),
         ckpt.read(src.g_idx) if src.g_idx else None)
    n, k = e.shape
    g = scheme.group_size
    step = _row_step(e, layout)
    sq_err = sq_norm = 0.0
    worst_bound = worst_scale = 0.0
    sz_parts, perm = [], None
    for a in range(0, n, step):
        b = min(n, a + step)
        lin = _decode_rows(e, t, a, b)
        if e.action == "keep":
            writer.write(e.name, lin.dequantize(torch.bfloat16))
        elif e.action == "requantize":
            w = lin.dequantize()
            qt = quantize_groups(w, g, e.method, name=f"{e.module} rows {a}..{b}")
            tinygemm.check_values(qt.q, e.module)
            writer.write(f"{e.module}.qweight", tinygemm._op_pack(qt.q))
            sz_parts.append(qt.scales_and_zeros)
            sq_err += float(qt.sq_error.sum())
            sq_norm += float(qt.sq_norm.sum())
        else:
            tw = to_tinygemm(lin, g, allow_split=src.group_size not in tinygemm.GROUP_SIZES)
            if (tw.perm is not None) != e.perm or (perm is not None and not torch.equal(perm, tw.perm)):
                raise EdgeqError(f"{e.module}: the input permutation changed between the plan and the data; the checkpoint changed while being read?")
            perm = tw.perm
            tinygemm.check_values(tw.q, e.module)
            writer.write(f"{e.module}.qweight", tinygemm._op_pack(tw.q))
            sz_parts.append(tw.scales_and_zeros)
            stats = _check_exact(e.module, lin, tw, a)
            sq_err, sq_norm = sq_err + stats[0], sq_norm + stats[1]
            worst_bound, worst_scale = max(worst_bound, stats[2]), max(worst_scale, stats[3])
        progress(e.bytes_in * (b - a) // n, e.name)
    if e.action != "keep":
        writer.write(f"{e.module}.scales_and_zeros", torch.cat(sz_parts, dim=1))
    if perm is not None:
        writer.write(f"{e.module}.perm", perm.to(torch.int64).contiguous())
    rel = (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0
    return EntryStats(rel, worst_bound, worst_scale)


def _check_exact(module: str, lin: GPTQLinear, tw, row0: int) -> tuple[float, float, float, float]:
    """Check a repacked block against GPTQ's dequantisation, and measure it, from the parameters (O(K + N*K/G)).

    With d = q - 8 and c = 8 - z, GPTQ's weight is (d + c) s and edgeq's is d s' + z' (s', z' the stored bf16 scale
    and zero), so the error of every element is ``d (s' - s) + (z' - c s)``: it lives in the parameters alone, once
    the columns are grouped as g_idx says. Hence three checks cover every element exactly:

    1. ``g_idx[perm] == k // G_src``: after the permutation every column sits in its own group (q moves with it);
    2. ``|s' - s| <= 2^-8 |s|`` and ``|z' - c s| <= 2^-8 |c s|`` per (group, output), in float64 (exact here);
    3. then ``|d (s' - s) + (z' - c s)| <= 2^-8 |s| (|d| + |c|)``, the stated bound, for every d.

    A violation would be a bug and raises. Returns (sum sq error, sum sq norm, largest error / bound, largest error
    / |s|); the last two are upper bounds from the parameters (the error at the group's largest |q - 8|), the sums
    are exact, from per-group sums of d and d^2."""
    n, k = tw.q.shape
    g, g_src = tw.group_size, lin.group_size
    gi = lin.g_idx if tw.perm is None else lin.g_idx[tw.perm]
    if not torch.equal(gi, torch.arange(k) // g_src):
        raise EdgeqError(f"{module}: after the permutation some column is outside its group; this is a bug in edgeq, please report it")
    parent = torch.arange(k // g) * g // g_src  # the checkpoint's group of each tinygemm group (split: repeated)
    s, c = lin.scales.double()[parent], 8.0 - lin.zeros.double()[parent]  # [Gt, N]
    sz = tw.scales_and_zeros.double()
    es, ez = (sz[..., 0] - s).abs(), (sz[..., 1] - c * s).abs()
    unit = 2.0**-8 * s.abs()
    bad = (es > unit) | (ez > unit * c.abs())
    if bool(bad.any()):
        j, r = (int(v) for v in torch.nonzero(bad)[0])
        raise EdgeqError(
            f"{module}: stored scale/zero of group {j}, output {row0 + r} ({float(sz[j, r, 0])}, {float(sz[j, r, 1])}) are "
            f"not the bf16 roundings of GPTQ's ({float(s[j, r])}, {float(c[j, r] * s[j, r])}); this is a bug in edgeq, please report it"
        )
    d = tw.q.reshape(n, k // g, g).to(torch.int32) - 8
    s1, s2 = d.sum(-1).t().double(), (d * d).sum(-1).t().double()  # [Gt, N]
    dmax = d.abs().amax(-1).t().double() if d.numel() else s1
    sez = (sz[..., 1] - c * s)
    ses = (sz[..., 0] - s)
    sq_err = float((s2 * ses * ses + 2 * s1 * ses * sez + g * sez * sez).sum())
    sq_norm = float(((s2 + 2 * c * s1 + g * c * c) * s * s).sum())
    tiny = torch.finfo(torch.float64).tiny
    over_bound = float(torch.maximum(es / unit.clamp_min(tiny), ez / (unit * c.abs()).clamp_min(tiny)).max()) if es.numel() else 0.0
    over_scale = float(((dmax * es + ez) / s.abs().clamp_min(tiny)).max()) if es.numel() else 0.0
    return sq_err, sq_norm, over_bound, over_scale


def ingest_summary(plan: Plan, stats: dict[str, EntryStats]) -> dict:
    """The manifest's GPTQ-ingest record: source settings, exactness, what was requantised or kept, and why."""
    repacked = [e for e in plan.entries if e.action == "repack"]
    return {
        "source": plan.source,
        "exactness": {
            "bound": BOUND,
            "repacked_modules": len(repacked),
            "max_error_over_bound": max((stats[e.module].max_over_bound for e in repacked), default=0.0),
            "max_error_over_scale": max((stats[e.module].max_over_scale for e in repacked), default=0.0),
        },
        "requantized_modules": {e.module: e.reason for e in plan.entries if e.action == "requantize"},
        "float_quantized_modules": {e.module: e.reason for e in plan.entries if e.action == "quantize"},
    }


def describe(plan: Plan) -> list[str]:
    """One line per reported choice (the CLI prints them)."""
    lines = []
    src = plan.source
    rep = sum(e.action == "repack" for e in plan.entries)
    perm = sum(e.perm for e in plan.entries)
    lines.append(f"GPTQ input ({src.get('checkpoint_format')}, {src.get('bits')}-bit g{src.get('group_size')}, "
                 f"sym={src.get('sym')}, desc_act={src.get('desc_act')}): {rep} layers repacked exactly"
                 + (f", {perm} with an input permutation (M.perm)" if perm else ""))
    for e in plan.entries:
        if e.action == "quantize" or (e.gptq is not None and e.action in ("requantize", "keep")):
            lines.append(f"{e.module}: {e.action}: {e.reason}")
    dropped = src.get("dropped_zero_biases") or []
    if dropped:
        lines.append(f"left out {len(dropped)} all-zero bias tensor(s) of layers this architecture has no bias for "
                     f"(an old AutoGPTQ export habit), e.g. {dropped[0]}")
    return lines
