"""Per-family quantisation recipes: data files (TOML) in ``recipes/``, validated when loaded.

A recipe names the default scheme and method, where the head and the embeddings are, which Linear weights to
keep in bf16, and which quantised weights get finer groups (``group_sizes``). A recipe whose ``keep_bf16`` would match
the head is rejected: the head is always quantised.

``group_sizes`` maps regexes of tensor names (``re.search``, first match wins) to a group size; a matching tensor is
quantised with ``min(that, the scheme's group size)`` in the same tinygemm layout (the kernel takes G per call), so
the scheme name keeps meaning the base group size and ``--scheme w4a16-g32`` still means g32 everywhere. W4A8
schemes ignore it (one group size per checkpoint there; a warning counts the tensors that lose their finer groups).
A ``keep_bf16`` or ``group_sizes`` pattern that matches no tensor is said in a warning too
(:func:`unmatched_patterns`).

``embeddings_storage`` (``"bf16"`` or ``"packed"``, default :data:`DEFAULT_EMBEDDINGS`) is how the input embedding
table is written when ``--embeddings`` is not given (docs/format.md, "Packed embeddings"); a W4A8 scheme writes bf16
whatever the recipe says (its kernel has no packed embedding path).

``head_levels`` (1 or 2, default 1) is ``--head-levels`` when the flag is not given: 2 makes the output head also sum
the packed table's residual level (docs/format.md, "Head levels"); where that cannot apply (a bf16 table, a head
that is not the table's level 0) the recipe's 2 means 1, while the flag is refused.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from edgeq.errors import EdgeqError
from edgeq.keys import EmbeddingStorage
from edgeq.scheme import Scheme

_KEYS = {"name", "model_types", "scheme", "method", "head", "embeddings", "keep_bf16", "group_sizes", "notes",
         "embeddings_storage", "head_levels"}
# How the input embedding table is stored when neither the recipe nor --embeddings says (edgeq.keys.EmbeddingStorage).
# Packed: as good as bf16 on the bundled model (mean KLD 0.00623 vs 0.00621, se 0.00006) for 0.53 MiB instead of 2.00
# MiB (docs/results.md, "Quality per byte"); the runtime, transformers and vLLM all read it.
DEFAULT_EMBEDDINGS = EmbeddingStorage.PACKED
_GROUP_CHOICES = (32, 64, 128, 256)  # tinygemm's qGroupSize values (edgeq.scheme)


@dataclass(frozen=True)
class Recipe:
    name: str
    model_types: tuple[str, ...]
    scheme: str
    method: str
    head: str
    embeddings: tuple[str, ...]
    keep_bf16: tuple[str, ...]
    notes: str
    source: str
    group_sizes: tuple[tuple[str, int], ...] = ()
    embeddings_storage: str = DEFAULT_EMBEDDINGS  # "bf16" | "packed" (--embeddings overrides; W4A8 schemes: bf16)
    head_levels: int = 1  # 2: the head also sums the packed table's residual level (--head-levels overrides)

    def keeps(self, tensor_name: str) -> str | None:
        """The keep_bf16 pattern matching this tensor, if any."""
        return next((p for p in self.keep_bf16 if re.search(p, tensor_name)), None)

    def group_size(self, tensor_name: str, base: int) -> int:
        """The group size for this tensor: the first matching ``group_sizes`` entry, never coarser than ``base``."""
        return min(base, next((g for p, g in self.group_sizes if re.search(p, tensor_name)), base))


def unmatched_patterns(recipe: Recipe, names: Iterable[str], groups_apply: bool) -> list[str]:
    """One line per ``keep_bf16`` pattern (and ``group_sizes`` pattern, where ``groups_apply``: a layout that takes G
    per module, float input) that matches none of ``names``, the planned tensor names. Such a pattern changes nothing
    (a typo, or a recipe written for another family's names, e.g. the ``quality`` recipe's ``mlp.(gate|up)_proj`` on
    Phi-3's fused ``mlp.gate_up_proj``), which the user should hear rather than find out from the output."""
    names = list(names)
    keys = [("keep_bf16", p) for p in recipe.keep_bf16] + [("group_sizes", p) for p, _ in recipe.group_sizes if groups_apply]
    return [f"recipe {recipe.name} ({recipe.source}): {key} pattern '{p}' matches no tensor of this checkpoint, so it "
            "changes nothing; fix or remove it" for key, p in keys if not any(re.search(p, n) for n in names)]


def recipes_dir() -> Path:
    """Installed wheels carry recipes/ as edgeq/_recipes; an editable install reads the repository's recipes/."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_recipes", here.parent / "recipes"):
        if candidate.is_dir():
            return candidate
    raise EdgeqError(f"recipes not found next to {here}; reinstall edgeq")


def load_recipe(path: Path) -> Recipe:
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise EdgeqError(f"{path}: cannot read recipe ({e.strerror})") from e
    except tomllib.TOMLDecodeError as e:
        raise EdgeqError(f"{path}: not valid TOML ({e})") from e
    unknown = set(data) - _KEYS
    if unknown:
        raise EdgeqError(f"{path}: unknown recipe keys {sorted(unknown)}; valid: {sorted(_KEYS)}")
    try:
        recipe = Recipe(
            name=str(data["name"]),
            model_types=_strings(path, data, "model_types", []),
            scheme=str(data.get("scheme", "w4a16-g128")),
            method=str(data.get("method", "rtn")),
            head=str(data.get("head", "lm_head.weight")),
            embeddings=_strings(path, data, "embeddings", ["model.embed_tokens.weight"]),
            keep_bf16=_strings(path, data, "keep_bf16", []),
            notes=str(data.get("notes", "")),
            source=str(path),
            group_sizes=_group_sizes(path, data.get("group_sizes", {})),
            embeddings_storage=_storage(path, data.get("embeddings_storage", DEFAULT_EMBEDDINGS)),
            head_levels=_head_levels(path, data.get("head_levels", 1)),
        )
    except KeyError as e:
        raise EdgeqError(f"{path}: recipe needs the key {e}") from e
    Scheme.parse(recipe.scheme)
    for p in recipe.keep_bf16:
        try:
            re.compile(p)
        except re.error as e:
            raise EdgeqError(f"{path}: keep_bf16 pattern {p!r} is not a valid regex ({e})") from e
    hit = recipe.keeps(recipe.head)
    if hit:
        raise EdgeqError(f"{path}: keep_bf16 pattern {hit!r} matches the output head {recipe.head}; the head is always quantised")
    return recipe


def _strings(path: Path, data: dict, key: str, default: list) -> tuple[str, ...]:
    """A list-of-strings key: a lone string was split into its characters (``keep_bf16 = "proj"`` kept every
    projection through the patterns p, r, o, j)."""
    value = data.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise EdgeqError(f"{path}: {key} must be a list of strings, e.g. {key} = [{json.dumps(default[0] if default else 'x')}]; "
                         f"got {type(value).__name__} {value!r}")
    return tuple(value)


def _group_sizes(path: Path, table) -> tuple[tuple[str, int], ...]:
    """``group_sizes = { "regex" = G, ... }`` validated: a table of valid regexes to tinygemm group sizes."""
    if not isinstance(table, dict):
        raise EdgeqError(f"{path}: group_sizes must be a table of tensor-name regex = group size")
    out = []
    for p, g in table.items():
        try:
            re.compile(p)
        except re.error as e:
            raise EdgeqError(f"{path}: group_sizes pattern {p!r} is not a valid regex ({e})") from e
        if isinstance(g, bool) or g not in _GROUP_CHOICES:
            raise EdgeqError(f"{path}: group_sizes[{p!r}] = {g!r}; valid group sizes: {', '.join(map(str, _GROUP_CHOICES))}")
        out.append((p, int(g)))
    return tuple(out)


def _storage(path: Path, value) -> EmbeddingStorage:
    """``embeddings_storage = "bf16" | "packed"`` validated."""
    try:
        return EmbeddingStorage(value)
    except ValueError:
        raise EdgeqError(f"{path}: embeddings_storage = {value!r}; valid: "
                         f"{', '.join(repr(str(v)) for v in EmbeddingStorage)}") from None


def _head_levels(path: Path, value) -> int:
    """``head_levels = 1 | 2`` validated (2 applies only where the table is packed with the head as its level 0)."""
    if isinstance(value, bool) or value not in (1, 2):
        raise EdgeqError(f"{path}: head_levels = {value!r}; valid: 1 (the head's own tensors), 2 (plus the packed "
                         "embedding's residual level)")
    return int(value)


def all_recipes() -> list[Recipe]:
    return [load_recipe(p) for p in sorted(recipes_dir().glob("*.toml"))]


def find_recipe(name_or_file: str | None, model_type: str | None) -> Recipe:
    """``--recipe NAME|FILE``, or the recipe whose model_types contain the config's model_type."""
    if name_or_file == "":  # Path("") is the working directory: it read as "cannot read recipe ."
        raise EdgeqError(f"--recipe '': names no recipe; available: {', '.join(r.name for r in all_recipes())} "
                         "(or a .toml file), or drop --recipe for the model's own")
    if name_or_file is not None:
        p = Path(name_or_file)
        if p.suffix == ".toml" or p.exists():
            return load_recipe(p)
        for r in all_recipes():
            if r.name == name_or_file:
                return r
        raise EdgeqError(f"unknown recipe {name_or_file!r}; available: {', '.join(r.name for r in all_recipes())} (or a .toml file)")
    for r in all_recipes():
        if model_type in r.model_types:
            return r
    families = sorted(t for r in all_recipes() for t in r.model_types)
    raise EdgeqError(
        f"unsupported architecture model_type={model_type!r}; supported: {', '.join(families)}. "
        "For another decoder-only family with plain Linear projections, write a recipe and pass --recipe FILE"
    )
