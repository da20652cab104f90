"""A GPTQ checkpoint's settings, read from its ``config.json`` ``quantization_config`` (or AutoGPTQ's own
``quantize_config.json``) and validated: what :mod:`edgeq.convert.ingest_gptq` plans from.

Keys read: ``quant_method`` (must be ``"gptq"``; any other quantised format is refused here), ``bits``,
``group_size`` (-1: one group over K), ``sym``, ``desc_act``, ``checkpoint_format`` (GPTQModel; older writers say
``format``; absent means ``"gptq"``; ``is_marlin_format`` means marlin, which is refused), ``pack_dtype`` (int32
only), GPTQModel's per-module ``dynamic`` overrides (``{"-:regex": {}}`` excludes modules, ``{"regex": {"bits": 8,
"group_size": 32}}`` overrides settings; the first pattern that matches from the start of the module name wins, as
in GPTQModel), and ``meta`` (quantizer, damping, ...), which is recorded in the manifest, never interpreted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeq.convert.recipe import Recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.layouts import tinygemm
from edgeq.layouts.gptq import FORMATS
from edgeq.scheme import Scheme

_RECORDED = ("lm_head", "dynamic", "static_groups", "true_sequential", "damp_percent")  # kept in the manifest
_RECORDED_META = ("quantizer", "uri", "static_groups", "damp_percent", "mse", "act_group_aware")


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
    fmt = _checkpoint_format(q, where)
    dynamic = _dynamic(q.get("dynamic") or {}, where)
    return GPTQConfig(
        bits=q.get("bits"), group_size=q.get("group_size"), sym=q.get("sym", True), desc_act=q.get("desc_act", False),
        checkpoint_format=fmt, dynamic=dynamic, where=str(where), record=tuple(_record(q, where, fmt).items()),
    )


def _checkpoint_format(q: dict, where: Path) -> str:
    """``checkpoint_format`` (lower case) after checking it, ``pack_dtype`` and the booleans are readable."""
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
    return fmt.lower()


def _dynamic(raw: Any, where: Path) -> tuple:
    """GPTQModel's ``dynamic`` as (key, negative, compiled regex, sorted overrides) in the config's order."""
    if not isinstance(raw, dict):
        raise EdgeqError(f"{where}: dynamic must be an object of {{pattern: overrides}}, got {type(raw).__name__}")
    dynamic = []
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
    return tuple(dynamic)


def _record(q: dict, where: Path, fmt: str) -> dict:
    """The manifest's ``source`` record: the settings as stated, plus the recorded extras and ``meta`` keys."""
    meta = q.get("meta") if isinstance(q.get("meta"), dict) else {}
    record = {"quant_method": "gptq", "config": where.name, "checkpoint_format": fmt, "bits": q.get("bits"),
              "group_size": q.get("group_size"), "sym": q.get("sym", True), "desc_act": q.get("desc_act", False)}
    for key in _RECORDED:
        if key in q:
            record[key] = q[key]
    for key in _RECORDED_META:
        if key in meta:
            record[f"meta.{key}"] = meta[key]
    return record


def default_scheme(cfg: GPTQConfig, recipe: Recipe) -> Scheme:
    """The checkpoint's own group size when tinygemm has it (an exact repack), else the recipe's scheme."""
    g = cfg.group_size
    if isinstance(g, int) and not isinstance(g, bool) and g in tinygemm.GROUP_SIZES:
        return Scheme(activation_bits=16, group_size=g)
    return Scheme.parse(recipe.scheme)
