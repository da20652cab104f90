"""The manifest: ``edgeq_manifest.json`` beside the weights, the record the runtime and inspect trust.

Keys (format_version 1, and 2 when an embedding is packed)::

    format_version  1, or 2 when ``embeddings`` has a packed entry (readers accept both: keys.FORMAT_VERSIONS)
    scheme          "w4a16-g128"             method  "rtn" | "minmax" | "gptq"
    kernel          "tinygemm_w4a16"         the path the runtime must use
    layout          TinygemmLayout.to_json(): op, torch_version, cpu_capability, block_n, layout_hash, perms
    head            {"name": "lm_head", "quantized": true, "source": <input tensor>, "untied": bool}; with
                    ``--head-levels 2`` also "levels": the packed embedding's levels (the head first), summed by
                    the output head too (docs/format.md, "Head levels"); absent = one level, the head's own tensors
    quantized_modules       [module names, head included]: a non-empty list, or the manifest is refused
    modules_not_converted   {module: reason} (a list of names, as early checkpoints wrote it, reads as reason "")
    shards          {file name: sha256}
    tensors         {output tensor: {"role", "source", "dtype", "shape"}}
    created_by      {"edgeq": version, "torch": version}
    group_sizes     {module: G} for quantised modules whose group size differs from the scheme's (a recipe's
                    group_sizes); absent when every module uses the scheme's, as in checkpoints written before it
    embeddings      {embedding module: {"storage": "packed", "source": <input tensor>, "levels": [{"module", "group_size"},
                    ...]}}: 4-bit levels summed at lookup (docs/format.md, "Packed embeddings"); absent (bf16 tables)
                    in format_version 1. Level 0 of the table the head was quantised from is the head itself; the other
                    level modules are not in quantized_modules nor in group_sizes

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

from edgeq.keys import FORMAT_VERSION  # noqa: F401 (the newest version, still importable from here)
from edgeq.keys import FORMAT_VERSION_BF16_EMBEDDINGS, FORMAT_VERSIONS, HEAD_MODULE, MANIFEST, EmbeddingStorage, Kernel

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
    embeddings: dict = field(default_factory=dict)  # {module: {"storage", "source", "levels"}}; {} = bf16 tables
    extra: dict = field(default_factory=dict)  # top-level keys this version does not model, kept as read

    @property
    def head_name(self) -> str:
        return str(self.head.get("name", HEAD_MODULE))

    def group_size(self, module: str) -> int:
        """The group size ``module`` was quantised with: its ``group_sizes`` entry, else the scheme's."""
        return int(self.group_sizes.get(module, Scheme.parse(self.scheme).group_size))

    def embedding_levels(self, module: str) -> list[tuple[str, int]]:
        """[(level module, group size), ...] of a packed embedding, in summation order (validated by from_json)."""
        return [(lv["module"], int(lv["group_size"])) for lv in self.embeddings[module]["levels"]]

    @property
    def head_levels(self) -> list[tuple[str, int]]:
        """[(level module, group size), ...] the output head sums (validated by from_json): the head record's
        ``levels`` (``--head-levels 2``: the packed table's levels, the head first), else the head alone."""
        levels = self.head.get("levels")
        if not levels:
            return [(self.head_name, self.group_size(self.head_name))]
        return [(lv["module"], int(lv["group_size"])) for lv in levels]

    def to_json(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        d["quantized_modules"] = list(self.quantized_modules)
        for key in ("group_sizes", "embeddings"):
            if not d[key]:
                del d[key]  # uniform checkpoints, bf16 embeddings: the original key set
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
        if isinstance(version, bool) or version not in FORMAT_VERSIONS:
            raise EdgeqError(f"{where}: format_version {version!r} is not supported (this edgeq reads "
                             f"{', '.join(map(str, FORMAT_VERSIONS))}); upgrade edgeq or re-quantise")
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
            manifest = cls(
                format_version=version, scheme=str(d["scheme"]), method=str(d["method"]), kernel=Kernel(d["kernel"]),
                layout=dict(d["layout"]), head=dict(head), quantized_modules=tuple(modules),
                modules_not_converted=dict.fromkeys(kept, "") if isinstance(kept, list) else dict(kept),
                shards=dict(d["shards"]),
                tensors=dict(d.get("tensors", {})), created_by=dict(d.get("created_by", {})),
                group_sizes=_group_sizes(where, d.get("group_sizes"), modules),
                embeddings=dict(d["embeddings"]) if isinstance(d.get("embeddings"), dict) else {},
                extra={k: v for k, v in d.items() if k not in _FIELDS},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise EdgeqError(f"{where}: malformed manifest (missing or bad key {e}); re-quantise the checkpoint") from e
        _check_embeddings(where, d.get("embeddings"), manifest)
        _check_head_levels(where, manifest)
        return manifest


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


def _check_embeddings(where: str, record, manifest: Manifest) -> None:
    """The optional ``embeddings`` record, checked (docs/format.md, "Packed embeddings"): an object of embedding
    module -> {"storage": "packed", "source": str, "levels": [{"module": str, "group_size": G}, ...]}, a non-empty
    list of levels with tinygemm group sizes; level 0 of the table the head was quantised from (head ``untied``,
    same ``source``, no ``from``, not in ``perm_modules``) is the head at its own group size; every other level module is its own tensors,
    named once, neither a quantised module nor in group_sizes; only in format_version 2 or later. ``record``: the
    key as read (``manifest.embeddings`` holds it)."""
    if record is None:
        return
    where = f"{where}: embeddings"
    fix = "; re-quantise the checkpoint"
    if not isinstance(record, dict):
        raise EdgeqError(f"{where} must be an object of embedding module -> record{fix}")
    if record and manifest.format_version == FORMAT_VERSION_BF16_EMBEDDINGS:
        raise EdgeqError(f"{where}: format_version 1 has no packed embeddings (they need 2); the checkpoint is inconsistent{fix}")
    if record and manifest.kernel != Kernel.W4A16:
        raise EdgeqError(f"{where}: packed embeddings are {Kernel.W4A16.value} levels, this checkpoint is "
                         f"{manifest.kernel.value}{fix}")
    head, head_name, modules = manifest.head, manifest.head_name, manifest.quantized_modules
    seen: set[str] = set()
    for module, rec in record.items():
        at = f"{where}[{module!r}]"
        packed = isinstance(rec, dict) and rec.get("storage") == EmbeddingStorage.PACKED
        if not packed or not isinstance(rec.get("source"), str):
            raise EdgeqError(f"{at} must be {{\"storage\": \"packed\", \"source\": <tensor>, \"levels\": [...]}} "
                             f"(this edgeq reads storage \"packed\"){fix}")
        levels = rec.get("levels")
        if not isinstance(levels, list) or not levels:
            raise EdgeqError(f"{at}.levels must be a non-empty list of {{\"module\", \"group_size\"}}{fix}")
        for i, lv in enumerate(levels):
            m, g = (lv.get("module"), lv.get("group_size")) if isinstance(lv, dict) else (None, None)
            if not isinstance(m, str) or not _tinygemm_group(g):
                raise EdgeqError(f"{at}.levels[{i}] = {lv!r}: needs a module name and a tinygemm group size "
                                 f"(32, 64, 128 or 256){fix}")
            if m == head_name and i == 0:
                if g != manifest.group_size(m):
                    raise EdgeqError(f"{at}.levels[0] is the head at group size {g}, but the head is quantised at "
                                     f"{manifest.group_size(m)}; the checkpoint is inconsistent{fix}")
                continue
            if m in modules or m in seen:
                raise EdgeqError(f"{at}.levels[{i}]: {m!r} is {'a quantised module' if m in modules else 'named twice'}; "
                                 f"a level other than the head's has its own tensors{fix}")
            seen.add(m)
        permuted = head_name in (manifest.extra.get("perm_modules") or [])  # act-order: the head's columns are permuted
        tied = head.get("untied") is True and head.get("source") == rec["source"] and "from" not in head and not permuted
        if tied and levels[0]["module"] != head_name:
            raise EdgeqError(f"{at}: the head {head_name!r} was quantised from {rec['source']}, so level 0 must be "
                             f"the head, not {levels[0]['module']!r}{fix}")


def _check_head_levels(where: str, manifest: Manifest) -> None:
    """The head record's optional ``levels`` (``--head-levels 2``): absent (one level), or exactly the ``levels`` list
    of the packed embedding whose level 0 is the head (so the head's own tensors first, then the table's residual
    level at its group size): logits = x @ (D0 + D1)^T (docs/format.md, "Head levels")."""
    if "levels" not in manifest.head:
        return
    levels, name = manifest.head["levels"], manifest.head_name
    at = f"{where}: head.levels"
    tables = [m for m, rec in manifest.embeddings.items() if rec["levels"][0].get("module") == name]
    if not tables:
        raise EdgeqError(f"{at}: the head sums a second level only with a packed embedding whose level 0 is the head "
                         f"{name!r} (none here); the checkpoint is inconsistent; re-quantise with --head-levels 1")
    if name in (manifest.extra.get("perm_modules") or []):
        raise EdgeqError(f"{at}: the head {name!r} is stored with an act-order permutation (perm_modules), so its "
                         f"columns are not the table's residual's; the checkpoint is inconsistent; re-quantise")
    want = manifest.embeddings[tables[0]]["levels"]
    if levels != want or len(levels) != 2:
        raise EdgeqError(f"{at} = {json.dumps(levels)} must equal {tables[0]}'s packed levels {json.dumps(want)} "
                         f"(2 levels); the checkpoint is inconsistent; re-quantise")


def _tinygemm_group(g) -> bool:
    """A group size the tinygemm layout takes (the w4a16 schemes' set, edgeq.scheme)."""
    if isinstance(g, bool) or not isinstance(g, int):
        return False
    try:
        Scheme(activation_bits=16, group_size=g)
    except EdgeqError:
        return False
    return True


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise EdgeqError(f"{directory}: no {MANIFEST}; not an edgeq checkpoint (quantise it with `edgeq quantize`)")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EdgeqError(f"{path}: not valid JSON ({e})") from e
    return Manifest.from_json(data, str(path))
