"""Foreign quantised checkpoints (GPTQ, AWQ, compressed-tensors, torchao, bitsandbytes): what they are and their
traps, from the config and the tensor shapes.

The config's settings (bits, group size, symmetry, act-order) are read per format's keys and checked against what
the shapes give (docs/inspect.md has the table of layouts). The traps, each a problem: the output head left in
float or at another precision, Linear weights left in float beside quantised ones without the config declaring
them, bits that disagree with the shapes, a quant_method whose tensors are not there. The config and the
safetensors metadata are untrusted JSON: a value of the wrong type reads as unknown, never as an exception.
"""

from __future__ import annotations

import json
import math
import re

from edgeq.convert.recipe import Recipe
from edgeq.io.hf import Checkpoint
from edgeq.io.safetensors import FLOAT_CODES, TensorInfo, read_header
from edgeq.inspect.kinds import QUANT_PARTS, embedding, mib, quant_modules, rows, unquantized_linears, unquantized_params
from edgeq.inspect.schema import ForeignInfo, QModule

FOREIGN_METHODS = {"gptq": "gptq", "auto-round": "gptq", "awq": "awq", "compressed-tensors": "compressed-tensors",
                   "torchao": "torchao", "bitsandbytes": "bitsandbytes"}
_NOT_CONVERTED_KEYS = {"gptq": ("modules_to_not_convert",), "awq": ("modules_to_not_convert",),
                       "compressed-tensors": ("ignore",), "torchao": ("modules_to_not_convert",),
                       "bitsandbytes": ("llm_int8_skip_modules",)}
_ACT_ORDERS = ("true", "group", "weight", "dynamic", "static")  # values that permute the columns (g_idx)


def _not_converted(q: dict, fmt: str) -> list[str]:
    """Names or patterns the config declares unquantised (each format has its own key)."""
    out = [str(p) for k in _NOT_CONVERTED_KEYS.get(fmt, ()) for p in (q.get(k) if isinstance(q.get(k), list) else [])]
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


# -------------------------------------------------------------------------------------------------------- settings


def _dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def _gptq(q: dict) -> dict:
    return {"bits": q.get("bits"), "group_size": q.get("group_size"), "symmetric": q.get("sym"),
            "act_order": str(bool(q.get("desc_act"))).lower() if "desc_act" in q else None,
            "details": {k: q[k] for k in ("checkpoint_format", "lm_head", "dynamic", "true_sequential", "format")
                        if k in q}}


def _awq(q: dict) -> dict:
    zp = q.get("zero_point")
    return {"bits": q.get("bits", q.get("w_bit")), "group_size": q.get("group_size", q.get("q_group_size")),
            "symmetric": (not zp) if zp is not None else None, "act_order": "false",
            "details": {k: q[k] for k in ("version", "backend") if k in q}}


def _compressed_tensors(q: dict) -> dict:
    groups = _dict(q.get("config_groups"))
    first = _dict(next(iter(groups.values()), {}))
    w = _dict(first.get("weights"))
    act = w.get("actorder")
    return {"bits": w.get("num_bits"), "group_size": w.get("group_size"), "symmetric": w.get("symmetric"),
            "act_order": None if act is None else str(act).lower(),
            "details": {"format": q.get("format"), "strategy": w.get("strategy"), "type": w.get("type"),
                        "targets": first.get("targets"), "config_groups": len(groups),
                        "quantization_status": q.get("quantization_status")}}


def _torchao_bits(typ: str, default=None):
    """4 for an Int4 config or tensor type, 8 for Int8/Float8, else ``default``."""
    return 4 if "Int4" in typ else 8 if ("Int8" in typ or "Float8" in typ) else default


def _torchao(q: dict) -> dict:
    qt = _dict(q.get("quant_type", {}).get("default") if isinstance(q.get("quant_type"), dict) else {})
    typ, data = str(qt.get("_type", "")), _dict(qt.get("_data"))
    bits = _torchao_bits(typ)
    return {"bits": bits, "group_size": data.get("group_size"),
            "symmetric": False if "Int4" in typ else (True if bits == 8 else None), "act_order": None,
            "details": {"config": typ, "packing_format": data.get("int4_packing_format"),
                        "include_input_output_embeddings": q.get("include_input_output_embeddings")}}


def _bitsandbytes(q: dict) -> dict:
    four = bool(q.get("load_in_4bit")) or q.get("_load_in_4bit") is True
    return {"bits": 4 if four else 8, "group_size": None, "symmetric": True, "act_order": None,
            "details": {"quant_type": q.get("bnb_4bit_quant_type") if four else "llm.int8",
                        "double_quant": q.get("bnb_4bit_use_double_quant") if four else None,
                        "compute_dtype": q.get("bnb_4bit_compute_dtype") if four else None}}


def _unknown(q: dict) -> dict:
    return {"bits": q.get("bits"), "group_size": q.get("group_size"), "symmetric": None, "act_order": None, "details": {}}


_SETTINGS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "torchao": _torchao,
             "bitsandbytes": _bitsandbytes}


def foreign_settings(q: dict, fmt: str) -> dict:
    """bits, group_size, symmetric, act_order and details from a quantization_config, per its format's keys;
    values of the wrong JSON type read as unknown."""
    s = _SETTINGS.get(fmt, _unknown)(q)
    for key, kind in (("bits", int), ("group_size", int), ("symmetric", bool)):
        if not isinstance(s.get(key), kind) or (kind is int and isinstance(s.get(key), bool)):
            s[key] = None
    return s


# -------------------------------------------------------------------------------------------------------- geometry


def foreign_module(module: str, parts: dict[str, TensorInfo], fmt: str, s: dict, meta: dict) -> QModule:
    """Logical [N, K], bits and group size of one quantised module from its tensor shapes (per format layout).

    One branch per published layout, tried in order (docs/inspect.md's table); kept as one chain because a
    branch, once its tensors are there, decides the module even when the shapes leave a value unknown."""
    nbytes = sum(i.nbytes for i in parts.values())
    sh = {p: i.shape for p, i in parts.items()}
    n = k = bits = g = None
    cfg_bits, cfg_g = s.get("bits"), s.get("group_size")
    if ".qweight" in sh and ".scales" in sh and len(sh[".qweight"]) == 2 and len(sh[".scales"]) == 2:
        rows_, cols = sh[".qweight"]
        groups, n = sh[".scales"]
        if cols == n:  # GPTQ: qweight int32 [K * bits / 32, N]
            if ".g_idx" in sh:
                k = sh[".g_idx"][0]
            elif isinstance(cfg_g, int) and cfg_g > 0:
                k = groups * cfg_g
            elif cfg_bits:
                k = rows_ * 32 // cfg_bits
            bits = rows_ * 32 / k if k else None
        else:  # AWQ: qweight int32 [K, N * bits / 32]
            k = rows_
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
        bits = _torchao_bits(str(t.get("_type", "")), cfg_bits)
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
        return foreign_module(module, parts, fmt, s, meta)
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


# ---------------------------------------------------------------------------------------------------------- report


def inspect_foreign(ckpt: Checkpoint, recipe: Recipe, q: dict, problems: list[str], warnings: list[str]):
    """(ForeignInfo, rows, quantised modules' parts, parameters, bits per quantised weight) of a foreign checkpoint
    whose quantization_config is ``q``; every trap found is appended to ``problems``."""
    method = str(q.get("quant_method", "?")).lower()
    fmt = FOREIGN_METHODS.get(method, method)
    if fmt not in FOREIGN_METHODS.values():
        warnings.append(f"quant_method {method!r} is not one edgeq knows (GPTQ, AWQ, compressed-tensors, torchao, "
                        "bitsandbytes): settings are read from the config only")
    s = foreign_settings(q, fmt)
    qmods = quant_modules(ckpt)
    meta = _metadata(ckpt) if fmt == "torchao" else {}
    modules = {m: _foreign_module_safe(m, parts, fmt, s, meta, warnings) for m, parts in qmods.items()}
    rows_ = rows(ckpt, recipe, qmods)
    head_module = recipe.head.removesuffix(".weight")
    body = [m for name, m in modules.items() if name != head_module]
    bits_seen = sorted({round(m.bits, 3) for m in body if m.bits})
    groups_seen = sorted({m.group_size for m in body if m.group_size})
    if not modules:
        problems.append(f"config.json says quant_method={method!r} but no tensor has a quantisation suffix "
                        f"({', '.join(p.strip('.') for p in QUANT_PARTS[:4])}, ...): the checkpoint is not what it claims")
    if isinstance(s.get("bits"), int) and bits_seen and bits_seen != [s["bits"]]:
        problems.append(f"config.json says {s['bits']}-bit but the tensor shapes give {bits_seen} bits")
    head = _foreign_head(ckpt, recipe, modules, bits_seen, problems)
    unquantized = _float_linears(ckpt, rows_, _not_converted(q, fmt), bool(modules), problems, warnings)
    if s.get("act_order") in _ACT_ORDERS:
        warnings.append(f"act-order ({s['act_order']}): weights are quantised in a permuted column order (g_idx); "
                        "kernels must gather by g_idx")
    info = ForeignInfo(format=fmt, quant_method=method, bits=s.get("bits"), group_size=s.get("group_size"),
                       symmetric=s.get("symmetric"), act_order=s.get("act_order"), head=head,
                       quantized_modules=len(modules), bits_seen=tuple(bits_seen), group_sizes_seen=tuple(groups_seen),
                       unquantized_linears=unquantized, details=s.get("details", {}))
    q_bytes = sum(m.bytes for m in modules.values())
    q_weights = sum(m.numel for m in modules.values())
    params = q_weights + unquantized_params(rows_)
    return info, rows_, qmods, params, (8 * q_bytes / q_weights if q_weights else None)


def _float_linears(ckpt: Checkpoint, rows_, declared: list[str], quantized: bool, problems: list[str],
                   warnings: list[str]) -> tuple[str, ...]:
    """Linear weights stored in float: a problem beside quantised ones when the config does not declare them, a
    warning when it does. Returns them all, undeclared first."""
    silent, kept = [], []
    for r in unquantized_linears(rows_):
        (kept if _declared(r.name.removesuffix(".weight"), declared) else silent).append(r.name)
    if silent and quantized:
        total = sum(ckpt.tensors[n].nbytes for n in silent)
        problems.append(f"{len(silent)} Linear weight(s) left in {ckpt.tensors[silent[0]].dtype} beside quantised ones, "
                        f"not declared in the config ({mib(total)}): {', '.join(silent[:4])}"
                        + (" ..." if len(silent) > 4 else ""))
    if kept:
        warnings.append(f"{len(kept)} Linear weight(s) kept unquantised as the config declares: {', '.join(kept[:4])}")
    return tuple(silent + kept)


def _foreign_head(ckpt: Checkpoint, recipe: Recipe, modules: dict[str, QModule], bits_seen, problems) -> str:
    """How the output head is stored; a head in float or at another precision than the linears is a problem."""
    head_module = recipe.head.removesuffix(".weight")
    if head_module in modules:
        hb = modules[head_module].bits
        desc = f"quantised, {hb:g}-bit" if hb else "quantised"
        if hb and bits_seen and any(abs(hb - b) > 1e-6 for b in bits_seen):
            problems.append(f"output head {head_module} is stored at {hb:g} bits while the linears are "
                            f"{'/'.join(f'{b:g}' for b in bits_seen)}-bit ({mib(modules[head_module].bytes)}): "
                            "another precision than the rest of the model")
        return desc
    head = ckpt.tensors.get(recipe.head)
    if head is not None:
        problems.append(f"output head {recipe.head} left in {head.dtype} ({mib(head.nbytes)}, "
                        f"{100 * head.nbytes / ckpt.nbytes:.0f}% of the checkpoint): the largest matmul per token runs "
                        "unquantised")
        return f"{head.dtype}, unquantised"
    emb = embedding(ckpt, recipe)
    if emb is not None and emb.dtype in FLOAT_CODES:
        problems.append(f"output head tied to {emb.name} ({emb.dtype}, {mib(emb.nbytes)}): the head matmul runs "
                        "unquantised")
        return f"tied to {emb.name} ({emb.dtype})"
    return "not found"
