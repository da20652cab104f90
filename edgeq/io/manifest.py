"""The manifest: ``edgeq_manifest.json`` beside the weights, the record the runtime and inspect trust.

Keys (format_version 1)::

    format_version  1
    scheme          "w4a16-g128"             method  "rtn" | "minmax" | "gptq"
    kernel          "tinygemm_w4a16"         the path the runtime must use
    layout          TinygemmLayout.to_json(): op, torch_version, cpu_capability, block_n, layout_hash, perms
    head            {"name": "lm_head", "quantized": true, "source": <input tensor>, "untied": bool}
    quantized_modules       [module names, head included]: a non-empty list, or the manifest is refused
    modules_not_converted   {module: reason} (a list of names, as early checkpoints wrote it, reads as reason "")
    shards          {file name: sha256}
    tensors         {output tensor: {"role", "source", "dtype", "shape"}}
    created_by      {"edgeq": version, "torch": version}
    group_sizes     {module: G} for quantised modules whose group size differs from the scheme's (a recipe's
                    group_sizes); absent when every module uses the scheme's, as in checkpoints written before it

Any other top-level key (the method's records, e.g. ``gptq``, ``perm_modules``) is kept in ``extra`` and written back
unchanged: reading a manifest and writing it again loses nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgeq.errors import EdgeqError
from edgeq.scheme import Scheme

from edgeq.keys import FORMAT_VERSION, HEAD_MODULE, MANIFEST, Kernel

KERNELS = tuple(k.value for k in Kernel)


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


def head_refusal(where: str, name: str) -> EdgeqError:
    """The refusal of a manifest whose output head ``name`` is not recorded as quantised (flag or module list)."""
    return EdgeqError(f"{where}: the output head {name!r} is not recorded as quantised; edgeq checkpoints always "
                      "quantise the head, re-quantise")


@dataclass(frozen=True)
class Manifest:
    format_version: int
    scheme: str
    method: str
    kernel: Kernel
    layout: dict
    head: dict
    quantized_modules: tuple[str, ...]
    modules_not_converted: dict
    shards: dict
    tensors: dict
    created_by: dict
    group_sizes: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # top-level keys this version does not model, kept as read

    @property
    def head_name(self) -> str:
        return str(self.head.get("name", HEAD_MODULE))

    def group_size(self, module: str) -> int:
        """The group size ``module`` was quantised with: its ``group_sizes`` entry, else the scheme's."""
        return int(self.group_sizes.get(module, Scheme.parse(self.scheme).group_size))

    def to_json(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        d["quantized_modules"] = list(self.quantized_modules)
        if not self.group_sizes:
            del d["group_sizes"]  # uniform checkpoints keep the original key set
        return {**d, **extra}

    def write(self, directory: Path) -> None:
        text = json.dumps(self.to_json(), indent=1)
        # one line per list of numbers (the layout permutations) keeps the file readable
        text = re.sub(r"\[\s*([-\d,\s]+?)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
        (Path(directory) / MANIFEST).write_text(text + "\n")

    @classmethod
    def from_json(cls, d: dict, where: str = MANIFEST) -> "Manifest":
        if not isinstance(d, dict):
            raise EdgeqError(f"{where}: not a JSON object")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise EdgeqError(f"{where}: format_version {version!r} is not supported (this edgeq reads {FORMAT_VERSION}); upgrade edgeq or re-quantise")
        if d.get("kernel") not in KERNELS:
            raise EdgeqError(f"{where}: unknown kernel {d.get('kernel')!r} (known: {', '.join(KERNELS)})")
        head = d.get("head") or {}
        if head.get("quantized") is not True:
            raise head_refusal(where, head.get("name", HEAD_MODULE))
        modules = d.get("quantized_modules")
        if not isinstance(modules, list) or not modules or not all(isinstance(x, str) for x in modules):
            raise EdgeqError(f"{where}: quantized_modules must be a non-empty list of module names")
        kept = d.get("modules_not_converted") or {}
        try:
            return cls(
                format_version=version, scheme=str(d["scheme"]), method=str(d["method"]), kernel=Kernel(d["kernel"]),
                layout=dict(d["layout"]), head=dict(head), quantized_modules=tuple(modules),
                modules_not_converted=dict.fromkeys(kept, "") if isinstance(kept, list) else dict(kept),
                shards=dict(d["shards"]),
                tensors=dict(d.get("tensors", {})), created_by=dict(d.get("created_by", {})),
                group_sizes=_group_sizes(where, d.get("group_sizes"), modules),
                extra={k: v for k, v in d.items() if k not in _FIELDS},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise EdgeqError(f"{where}: malformed manifest (missing or bad key {e}); re-quantise the checkpoint") from e


_FIELDS = frozenset(f for f in Manifest.__dataclass_fields__ if f != "extra")


def _group_sizes(where: str, record, modules: list[str]) -> dict[str, int]:
    """The optional ``{module: G}`` record, checked: an object whose keys are quantised modules and whose values are
    integers (whether the kernel takes that G is the layout's question: :func:`edgeq.runtime.qinfo.read_checkpoint`)."""
    if record is None:
        return {}
    where = f"{where}: group_sizes"
    if not isinstance(record, dict):
        raise EdgeqError(f"{where} must be an object of module -> group size; re-quantise the checkpoint")
    for module, g in record.items():
        if module not in modules:
            raise EdgeqError(f"{where} names {module!r}, which is not a quantised module; the checkpoint is inconsistent")
        if isinstance(g, bool) or not isinstance(g, int):
            raise EdgeqError(f"{where}[{module!r}] = {g!r} is not a group size (an integer); re-quantise the checkpoint")
    return dict(record)


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise EdgeqError(f"{directory}: no {MANIFEST}; not an edgeq checkpoint (quantise it with `edgeq quantize`)")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EdgeqError(f"{path}: not valid JSON ({e})") from e
    return Manifest.from_json(data, str(path))
