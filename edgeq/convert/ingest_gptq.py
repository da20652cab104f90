"""GPTQ checkpoints as input to ``edgeq quantize``: planned from headers, repacked into tinygemm exactly.

Input: a Hugging Face directory whose config says ``quantization_config.quant_method == "gptq"`` (AutoGPTQ, GPTQModel,
the hub's "-GPTQ-Int4" models; or a bare ``quantize_config.json`` beside AutoGPTQ's tensors). Its settings (``bits``,
``group_size``, ``sym``, ``desc_act``, ``checkpoint_format``, GPTQModel's per-module ``dynamic`` overrides) are read
and validated by :mod:`edgeq.convert.ingest_config`; this module plans from them, and
:mod:`edgeq.convert.ingest_stream` writes the plan's GPTQ entries.

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
head from the original float model instead (its head tensor as the recipe names it, ``lm_head.weight`` in every
bundled recipe, or its embedding table when tied). Every other tensor is copied as bf16.

The plan reads headers and, for act-order detection, each layer's ``g_idx`` (K int32 values per layer, a few MB for
a 7B model). Streaming reads one layer's packed ``qweight`` at a time (N*K*bits/8 bytes) and works in row blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from edgeq.convert.ingest_config import GPTQConfig, default_scheme
from edgeq.convert.plan import (
    GPTQSource, Plan, PlanEntry, assert_head_quantized, packed_bytes, tensor_role, tied_embedding, weight_rule,
)
from edgeq.convert.recipe import Recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint, open_checkpoint
from edgeq.io.safetensors import FLOAT_CODES, TensorInfo
from edgeq.keys import Action, Role
from edgeq.layouts import tinygemm
from edgeq.scheme import Scheme

METHOD = "gptq-ingest"
PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
_FOREIGN_SUFFIXES = (".scales_and_zeros", ".weight_packed", ".weight_scale", ".SCB", ".absmax")
__all__ = ["METHOD", "build_gptq_plan"]


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
    """One GPTQ layer's entry (keep, repack or requantize; see the module docstring), or the problem that stops it."""
    src, shape, problem = _module_source(ckpt, cfg, module)
    if problem:
        return None, problem
    n, k = shape
    g_src = k if src.group_size == -1 else src.group_size
    # a 4-bit module given its own group size by GPTQModel's `dynamic` (e.g. g32 under g128) keeps it: tinygemm takes
    # G per module, as with a recipe's group_sizes (recorded in the entry and the manifest's group_sizes)
    own = src.bits == 4 and src.group_size != cfg.group_size and src.group_size in tinygemm.GROUP_SIZES
    g = g_src if own else scheme.group_size
    own_g = g if g != scheme.group_size else 0
    where = f"{module} [{n}, {k}] GPTQ {src.bits}-bit g{src.group_size}"
    keep = recipe.keeps(f"{module}.weight") if role == Role.LINEAR else None
    base = dict(name=f"{module}.weight", source=src.qweight, shape=(n, k), dtype="I32", role=role,
                bytes_in=_nbytes(ckpt, src), gptq=src)
    if keep:
        return PlanEntry(**base, action=Action.KEEP, bytes_out=n * k * 2,
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
        return PlanEntry(**base, action=Action.REPACK, bytes_out=packed_bytes((n, k), scheme, g, act_order), reason=reason,
                         perm=act_order, group_size=own_g), None
    if (role == Role.HEAD and src.bits != 4) or requantize:
        flag = "" if role == Role.HEAD and src.bits != 4 else " (--requantize)"
        reason = f"{'; '.join(why)}: dequantised exactly and requantised with {method}{flag}"
        return PlanEntry(**base, action=Action.REQUANTIZE, bytes_out=packed_bytes((n, k), scheme, g), reason=reason, method=method,
                         group_size=own_g), None
    fix = f"use --scheme w4a16-g{g_src} to repack exactly, or --requantize" if g_src in tinygemm.GROUP_SIZES and src.bits == 4 \
        and g_src != g else "use --requantize (dequantise exactly, requantise with the default method)"
    return None, f"{where}: {'; '.join(why)}; {fix}"


def _head_from(origin: str | Path, recipe: Recipe, shape: tuple[int, ...] | None, method: str) -> PlanEntry:
    """--head-from: the head entry read from the original float model ``origin`` (its head, else its embedding)."""
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
    return PlanEntry(recipe.head, name, info.shape, info.dtype, Role.HEAD, Action.QUANTIZE, info.nbytes, 0,
                     f"--head-from {other.root}: {name} quantised with {method}", method=method, origin=str(other.root))


@dataclass(frozen=True)
class _Inputs:
    """What one ingest plan is built from (the arguments of :func:`build_gptq_plan`, the scheme resolved)."""

    ckpt: Checkpoint
    cfg: GPTQConfig
    scheme: Scheme
    method: str
    recipe: Recipe
    requantize: bool
    head_from: str | Path | None

    @property
    def head_module(self) -> str:
        return self.recipe.head.removesuffix(".weight")


@dataclass
class _Found:
    """What the walk over the input's tensors collects: entries, problems, and the head's [N, K] (to check
    --head-from's against, or None)."""

    entries: list[PlanEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    head_shape: tuple[int, ...] | None = None


def build_gptq_plan(ckpt: Checkpoint, cfg: GPTQConfig, scheme: Scheme | None, method: str, recipe: Recipe, *,
                    requantize: bool = False, head_from: str | Path | None = None) -> Plan:
    """The plan for a GPTQ input (see the module docstring). ``method``: the RTN method for everything that is not
    repacked (float weights, requantised layers)."""
    x = _Inputs(ckpt, cfg, scheme or default_scheme(cfg, recipe), method, recipe, requantize, head_from)
    modules = {n.removesuffix(".qweight") for n in ckpt.tensors if n.endswith(".qweight")}
    both = sorted(m for m in modules if f"{m}.weight" in ckpt.tensors)
    if both:
        raise EdgeqError(f"{ckpt.root}: {both[0]} has both a float weight and GPTQ tensors ({len(both)} such layers); "
                         "the checkpoint is inconsistent")
    dropped = _zero_biases_without_a_place(ckpt, modules)
    parts = {f"{m}{p}" for m in modules for p in PARTS} | set(dropped)
    found = _Found()
    for name, info in ckpt.tensors.items():
        if name not in parts:
            _float_tensor(x, name, info, found)
        elif name.endswith(".qweight"):
            _gptq_layer(x, name.removesuffix(".qweight"), found)
    tied = recipe.head not in ckpt.tensors and f"{x.head_module}.qweight" not in ckpt.tensors
    _add_head(x, found, tied)
    if not any(e.quantized and e.role == Role.LINEAR for e in found.entries) and not found.problems:
        found.problems.append(f"no Linear layers found among {len(found.entries)} tensors: nothing to quantise besides the head")
    source = dict(cfg.record)
    source["requantize_method"] = method
    if dropped:
        source["dropped_zero_biases"] = sorted(dropped)
    plan = Plan(x.scheme, METHOD, recipe.name, tuple(found.entries), tuple(found.problems), tied, source=source)
    if not found.problems:
        assert_head_quantized(plan)  # assertion 1 of 3: at plan time
    return plan


def _gptq_layer(x: _Inputs, module: str, found: _Found) -> None:
    """A module with ``M.qweight``: its entry, or its problem (the head's, with --head-from, only its shape)."""
    role = Role.HEAD if module == x.head_module else Role.LINEAR
    if role == Role.HEAD and x.head_from is not None:  # replaced: only its shape is needed, to check the original's
        found.head_shape = _module_source(x.ckpt, x.cfg, module)[1]
        return
    entry, problem = _gptq_entry(x.ckpt, x.cfg, module, role, x.scheme, x.method, x.recipe, x.requantize)
    if problem:
        found.problems.append(problem)
    if entry is not None:
        found.head_shape = entry.shape if role == Role.HEAD else found.head_shape
        found.entries.append(entry)


def _float_tensor(x: _Inputs, name: str, info: TensorInfo, found: _Found) -> None:
    """A tensor outside the GPTQ layers: float weights are quantised with the method (reported), the rest copied."""
    if name.endswith(_FOREIGN_SUFFIXES):
        raise EdgeqError(f"{info.file}: tensor {name} is not part of a GPTQ layer (no {name.rsplit('.', 1)[0]}.qweight); "
                         "the checkpoint mixes quantisation formats")
    role = tensor_role(name, info.shape, x.recipe)
    if info.dtype not in FLOAT_CODES:
        raise EdgeqError(f"{info.file}: tensor {name} has dtype {info.dtype} and is not part of a GPTQ layer; edgeq "
                         "cannot interpret it")
    if role == Role.HEAD and x.head_from is not None:
        found.head_shape = info.shape
        return
    if role not in (Role.LINEAR, Role.HEAD):
        found.entries.append(PlanEntry(name, name, info.shape, info.dtype, role, Action.COPY, info.nbytes, info.numel * 2))
        return
    keep = x.recipe.keeps(name) if role == Role.LINEAR else None
    if keep:
        found.entries.append(PlanEntry(name, name, info.shape, info.dtype, role, Action.KEEP, info.nbytes,
                                       info.numel * 2, f"recipe {x.recipe.name}: keep_bf16 {keep!r}"))
        return
    found.head_shape = info.shape if role == Role.HEAD else found.head_shape
    rule = weight_rule(info.shape, info.dtype, x.scheme)
    if rule:
        found.problems.append(f"{name} {list(info.shape)} {info.dtype}: {rule}")
    what = f"{info.dtype} head" if role == Role.HEAD else f"{info.dtype} layer (not GPTQ-quantised in the input)"
    found.entries.append(PlanEntry(name, name, info.shape, info.dtype, role, Action.QUANTIZE, info.nbytes,
                                   0 if rule else packed_bytes(info.shape, x.scheme),
                                   f"{what}: quantised with {x.method}", method=x.method))


def _add_head(x: _Inputs, found: _Found, tied: bool) -> None:
    """The head entry when the walk did not add one: from --head-from, or untied from the embedding table."""
    recipe, method = x.recipe, x.method
    emb = next((e for e in found.entries if e.role == Role.EMBEDDING), None)
    if x.head_from is not None:
        head = _head_from(x.head_from, recipe, found.head_shape or (emb.shape if emb else None), method)
        rule = weight_rule(head.shape, head.dtype, x.scheme)
        if rule:
            found.problems.append(f"{recipe.head} (--head-from) {list(head.shape)}: {rule}")
        found.entries.append(replace(head, bytes_out=0 if rule else packed_bytes(head.shape, x.scheme)))
    elif tied:
        emb = tied_embedding(x.ckpt, found.entries, recipe, also=f"{x.head_module}.qweight")
        rule = weight_rule(emb.shape, emb.dtype, x.scheme)
        if rule:
            found.problems.append(f"{recipe.head} (tied to {emb.name}) {list(emb.shape)} {emb.dtype}: {rule}")
        found.entries.append(PlanEntry(recipe.head, emb.name, emb.shape, emb.dtype, Role.HEAD, Action.QUANTIZE,
                                       emb.bytes_in, 0 if rule else packed_bytes(emb.shape, x.scheme),
                                       f"untied from {emb.name}: quantised with {method}", method=method))


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
