"""What the runtime needs from an edgeq checkpoint's config.json and edgeq_manifest.json, validated.

Anything this version does not understand is refused with the reason: an unknown ``format_version``, a ``kernel``
other than ``tinygemm_w4a16``, a malformed or self-inconsistent layout record, a foreign quantisation method.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm
from edgeq.layouts.tinygemm import TinygemmLayout
from edgeq.scheme import Scheme

FORMAT_VERSIONS = (1,)
KERNELS = (tinygemm.KERNEL,)
MANIFEST = "edgeq_manifest.json"


@dataclass(frozen=True)
class QuantInfo:
    format_version: int
    scheme: Scheme
    kernel: str
    layout: TinygemmLayout
    quantized_modules: tuple[str, ...]
    head_name: str
    head_source: str
    untied: bool
    modules_not_converted: tuple[tuple[str, str], ...]


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise EdgeqError(f"{path}: missing") from e
    except ValueError as e:
        raise EdgeqError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise EdgeqError(f"{path}: expected a JSON object")
    return data


def read_quant_info(directory: Path, config: dict) -> QuantInfo | None:
    """None for a plain (unquantised) HF checkpoint; a validated QuantInfo for an edgeq one."""
    qc = config.get("quantization_config")
    if not qc:
        if (directory / MANIFEST).exists():
            raise EdgeqError(f"{directory}: has {MANIFEST} but config.json has no quantization_config; the checkpoint is inconsistent")
        return None
    method = qc.get("quant_method")
    if method != "edgeq":
        raise EdgeqError(f"{directory}/config.json: quant_method {method!r} is not edgeq's; convert it with `edgeq quantize` first")
    m = read_json(directory / MANIFEST)
    version = m.get("format_version")
    if version not in FORMAT_VERSIONS or qc.get("format_version") != version:
        raise EdgeqError(f"{directory}/{MANIFEST}: format_version {version!r} (config.json says {qc.get('format_version')!r}); "
                         f"this edgeq reads {list(FORMAT_VERSIONS)}: upgrade edgeq or re-quantise")
    kernel = m.get("kernel")
    if kernel not in KERNELS or qc.get("kernel", kernel) != kernel:
        raise EdgeqError(f"{directory}/{MANIFEST}: kernel {kernel!r} is not one this runtime runs ({', '.join(KERNELS)}); "
                         f"re-quantise with a w4a16 scheme or upgrade edgeq")
    scheme = Scheme.parse(str(m.get("scheme", "")))
    if scheme.kernel != kernel or int(qc.get("group_size", scheme.group_size)) != scheme.group_size:
        raise EdgeqError(f"{directory}/{MANIFEST}: scheme {scheme} does not match kernel {kernel!r} / group_size "
                         f"{qc.get('group_size')!r} in config.json; the checkpoint is inconsistent")
    if not isinstance(m.get("layout"), dict):
        raise EdgeqError(f"{directory}/{MANIFEST}: no layout record; re-quantise or `edgeq repack` the checkpoint")
    layout = TinygemmLayout.from_json(m["layout"])
    stored_hash = (qc.get("layout") or {}).get("layout_hash")
    if stored_hash != layout.layout_hash:
        raise EdgeqError(f"{directory}: config.json layout_hash {str(stored_hash)[:12]}... differs from the manifest's "
                         f"{layout.layout_hash[:12]}...; the checkpoint is inconsistent, re-quantise it")
    modules = m.get("quantized_modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(x, str) for x in modules):
        raise EdgeqError(f"{directory}/{MANIFEST}: quantized_modules must be a non-empty list of module names")
    head = m.get("head") or {}
    head_name = head.get("name", "lm_head")
    if not head.get("quantized", False) or head_name not in modules:
        raise EdgeqError(f"{directory}/{MANIFEST}: the output head {head_name!r} is not recorded as quantised; "
                         f"edgeq checkpoints always quantise the head, re-quantise")
    mnc = m.get("modules_not_converted") or {}
    if isinstance(mnc, list):
        mnc = {name: "" for name in mnc}
    return QuantInfo(
        format_version=version, scheme=scheme, kernel=kernel, layout=layout, quantized_modules=tuple(modules),
        head_name=head_name, head_source=str(head.get("source", "")), untied=bool(head.get("untied", False)),
        modules_not_converted=tuple(sorted((str(k), str(v)) for k, v in mnc.items())),
    )
