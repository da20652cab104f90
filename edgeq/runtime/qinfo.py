"""What the runtime needs from an edgeq checkpoint's config.json and edgeq_manifest.json, validated.

Anything this version does not understand is refused with the reason: an unknown ``format_version``, a ``kernel``
other than ``tinygemm_w4a16`` (``amx_w4a8`` is read by :mod:`edgeq.runtime.w4a8linear`), a malformed or
self-inconsistent layout record (config.json's copy must equal the manifest's in every field), a foreign
quantisation method.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm, w4a8
from edgeq.layouts.tinygemm import TinygemmLayout
from edgeq.scheme import Scheme

FORMAT_VERSIONS = (1,)
KERNELS = (tinygemm.KERNEL,)  # read here; amx_w4a8 checkpoints are read by edgeq.runtime.w4a8linear first
RUNTIME_KERNELS = (tinygemm.KERNEL, w4a8.KERNEL)
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
    group_sizes: tuple[tuple[str, int], ...] = ()  # (module, G) where G differs from the scheme's (recipe group_sizes)

    def group_size(self, module: str) -> int:
        """The group size ``module`` was quantised with (the manifest's ``group_sizes`` entry, else the scheme's)."""
        return dict(self.group_sizes).get(module, self.scheme.group_size)


def read_json(path: Path, missing_hint: str = "") -> dict:
    """The JSON object in ``path``; an :class:`EdgeqError` naming the file when it is missing (plus ``missing_hint``,
    e.g. "; run `edgeq quantize` first"), not JSON, or not an object."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise EdgeqError(f"{path}: missing{missing_hint}") from e
    except ValueError as e:
        raise EdgeqError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise EdgeqError(f"{path}: expected a JSON object")
    return data


def config_layout_mismatch(record, layout: TinygemmLayout) -> str | None:
    """None when config.json's layout record equals the manifest's fingerprint in every field (op, torch_version,
    cpu_capability, block_n, layout_hash); else which field differs. The manifest's record is the one whose hash is
    checked against its permutations; the copy in config.json has no permutations, so it is compared field by field
    (an edited ``block_n`` or ``cpu_capability`` there would otherwise pass unnoticed)."""
    record = record if isinstance(record, dict) else {}
    want = layout.fingerprint()
    for key in want:
        if record.get(key) != want[key]:
            return (f"config.json quantization_config.layout.{key} {str(record.get(key))[:16]!r} differs from the "
                    f"manifest's {str(want[key])[:16]!r}")
    return None


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
    kernel, cfg_kernel = m.get("kernel"), qc.get("kernel", m.get("kernel"))
    for where, named in ((f"{directory}/config.json", cfg_kernel), (f"{directory}/{MANIFEST}", kernel)):
        if named not in KERNELS:  # name the kernel the file really says (config.json first: the user edits it)
            raise EdgeqError(f"{where}: kernel {named!r} is not one this runtime runs ({', '.join(RUNTIME_KERNELS)}); "
                             f"re-quantise with `edgeq quantize` or upgrade edgeq")
    scheme = Scheme.parse(str(m.get("scheme", "")))
    if scheme.kernel != kernel or int(qc.get("group_size", scheme.group_size)) != scheme.group_size:
        raise EdgeqError(f"{directory}/{MANIFEST}: scheme {scheme} does not match kernel {kernel!r} / group_size "
                         f"{qc.get('group_size')!r} in config.json; the checkpoint is inconsistent")
    if not isinstance(m.get("layout"), dict):
        raise EdgeqError(f"{directory}/{MANIFEST}: no layout record; re-quantise or `edgeq repack` the checkpoint")
    layout = TinygemmLayout.from_json(m["layout"])
    if problem := config_layout_mismatch(qc.get("layout"), layout):
        raise EdgeqError(f"{directory}: {problem}; the checkpoint is inconsistent, re-quantise it")
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
        group_sizes=_group_sizes(directory, m.get("group_sizes"), modules),
    )


def _group_sizes(directory: Path, record, modules: list[str]) -> tuple[tuple[str, int], ...]:
    """The manifest's optional ``{module: G}`` record, validated: quantised modules, tinygemm group sizes."""
    if record is None:
        return ()
    where = f"{directory}/{MANIFEST}: group_sizes"
    if not isinstance(record, dict):
        raise EdgeqError(f"{where} must be an object of module -> group size; re-quantise the checkpoint")
    for module, g in record.items():
        if module not in modules:
            raise EdgeqError(f"{where} names {module!r}, which is not a quantised module; the checkpoint is inconsistent")
        if isinstance(g, bool) or g not in tinygemm.GROUP_SIZES:
            raise EdgeqError(f"{where}[{module!r}] = {g!r} is not a tinygemm group size "
                             f"({', '.join(map(str, tinygemm.GROUP_SIZES))}); re-quantise the checkpoint")
    return tuple(sorted((str(k), int(v)) for k, v in record.items()))
