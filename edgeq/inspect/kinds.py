"""What a checkpoint is, from its config and tensor names alone: its kind (edgeq, hf, foreign), which tensors form
a quantised module, each tensor's role and byte category, and the traps every kind can have.

Nothing here reads tensor data.

    >>> split_module("model.layers.0.mlp.up_proj.qweight")
    ('model.layers.0.mlp.up_proj', '.qweight')
"""

from __future__ import annotations

from edgeq.convert.plan import tensor_role
from edgeq.convert.recipe import Recipe, find_recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.safetensors import DTYPES, TensorInfo
from edgeq.keys import HEAD_MODULE, MANIFEST, QUANT_METHOD, Role
from edgeq.memory import text_config
from edgeq.inspect.schema import CATEGORIES, TensorRow

# Tensor-name suffixes that belong to a quantised module (longest first when matching).
QUANT_PARTS = tuple(sorted((
    ".qweight", ".qzeros", ".scales", ".g_idx", ".scales_and_zeros",  # edgeq, GPTQ, AWQ
    ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx", ".input_scale",  # c-t
    "._weight_qdata", "._weight_scale", "._weight_zero_point", "._weight_scale_and_zero", "._weight_act_pre_scale",
    ".weight.absmax", ".weight.quant_map", ".weight.nested_absmax", ".weight.nested_quant_map",  # bnb 4-bit
    ".weight.quant_state.bitsandbytes__nf4", ".weight.quant_state.bitsandbytes__fp4",
    ".SCB", ".weight_format",  # bnb 8-bit
), key=len, reverse=True))
PERM_ROLE = "perm"  # the manifest's role of an act-order layer's input permutation M.perm (not an input Role)
_CATEGORY = {Role.HEAD: "head", Role.EMBEDDING: "embeddings", Role.NORM: "norms", PERM_ROLE: "quantized_linears"}


def split_module(name: str) -> tuple[str, str]:
    """``model.layers.0.mlp.up_proj.qweight`` -> (``model.layers.0.mlp.up_proj``, ``.qweight``); ('name', '') when
    the tensor is not a quantisation part."""
    for suffix in QUANT_PARTS:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return name, ""


def quant_modules(ckpt: Checkpoint) -> dict[str, dict[str, TensorInfo]]:
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


def detect_kind(ckpt: Checkpoint) -> str:
    """``edgeq`` (its quant_method, or a manifest), ``foreign`` (another quantization_config, or quantisation
    suffixes without one) or ``hf`` (a float checkpoint)."""
    q = ckpt.quantization_config
    if (q and str(q.get("quant_method", "")).lower() == QUANT_METHOD) or (ckpt.root / MANIFEST).is_file():
        return "edgeq"
    if q is not None:
        return "foreign"
    if quant_modules(ckpt):
        return "foreign"
    return "hf"


def _default_recipe() -> Recipe:
    return Recipe(name="default", model_types=(), scheme="w4a16-g128", method="rtn", head=f"{HEAD_MODULE}.weight",
                  embeddings=("model.embed_tokens.weight",), keep_bf16=(), notes="", source="")


def recipe_for(config: dict, name: str | None, warnings: list[str]) -> tuple[Recipe, bool]:
    """(recipe, found). An unknown architecture still gets the default tensor names, with a warning."""
    try:
        return find_recipe(name, config.get("model_type")), True
    except EdgeqError as e:
        if name:
            raise
        warnings.append(f"{e}; tensor roles below use the default names (lm_head, model.embed_tokens)")
        return _default_recipe(), False


def rows(ckpt: Checkpoint, recipe: Recipe, qmods: dict, roles: dict[str, str] | None = None) -> list[TensorRow]:
    """One row per tensor; its role from ``roles`` (the manifest's), else from the module it belongs to, else as
    the planner names it."""
    head_module = recipe.head.removesuffix(".weight")
    emb_modules = {e.removesuffix(".weight") for e in recipe.embeddings}
    in_qmod = {info.name: m for m, parts in qmods.items() for info in parts.values()}
    out = []
    for name, info in ckpt.tensors.items():
        module = in_qmod.get(name)
        if roles and name in roles:
            role = roles[name]
        elif module is not None:
            role = Role.HEAD if module == head_module else Role.EMBEDDING if module in emb_modules else Role.LINEAR
        else:
            role = tensor_role(name, info.shape, recipe)
        out.append(TensorRow(name, info.shape, info.dtype, role, module is not None, info.nbytes, info.file.name))
    return out


def category(row: TensorRow) -> str:
    """The byte category of a row (:data:`edgeq.inspect.schema.CATEGORIES`); an act-order M.perm is read by its
    quantised linear, so it counts as one."""
    if row.role == Role.LINEAR:
        return "quantized_linears" if row.quantized else "linears_unquantized"
    return _CATEGORY.get(row.role, "other")


def by_category(rows_: list[TensorRow]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for r in rows_:
        out[category(r)] += r.bytes
    return out


def unquantized_params(rows_: list[TensorRow]) -> int:
    """Parameters stored as plain tensors (bytes over item size); quantised parts and M.perm are not parameters."""
    return sum(r.bytes // DTYPES[r.dtype][1] for r in rows_ if not r.quantized and r.role != PERM_ROLE)


def unquantized_linears(rows_: list[TensorRow]) -> list[TensorRow]:
    return [r for r in rows_ if r.role == Role.LINEAR and not r.quantized and r.name.endswith(".weight")
            and len(r.shape) == 2]


def model_info(config: dict, parameters: int) -> dict:
    cfg = text_config(config)
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


def files_info(ckpt: Checkpoint) -> dict:
    return {"shards": [f.name for f in ckpt.files], "bytes": sum(f.stat().st_size for f in ckpt.files),
            "tensor_bytes": ckpt.nbytes, "tensors": len(ckpt.tensors)}


def mib(n: float) -> str:
    """Bytes for a message: ``mib(7311360) == "7.0 MiB"``, ``mib(512) == "512 B"`` (one decimal, binary units)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


def embedding(ckpt: Checkpoint, recipe: Recipe) -> TensorInfo | None:
    """The first of the recipe's embedding tensors the checkpoint stores."""
    return next((ckpt.tensors[e] for e in recipe.embeddings if e in ckpt.tensors), None)


def stored_twice(ckpt: Checkpoint, recipe: Recipe, qmods: dict, problems: list[str]) -> None:
    """``tie_word_embeddings: true`` while the head is stored as well: the bytes are there twice, and a loader
    that ties silently drops one of them (a quantised head is discarded for the bf16 embedding)."""
    if ckpt.config.get("tie_word_embeddings") is not True:
        return
    head_module = recipe.head.removesuffix(".weight")
    head_bytes = sum(i.nbytes for i in qmods.get(head_module, {}).values()) or (
        ckpt.tensors[recipe.head].nbytes if recipe.head in ckpt.tensors else 0)
    emb = embedding(ckpt, recipe)
    if head_bytes and emb is not None:
        problems.append(f"tied embeddings stored twice: config.json says tie_word_embeddings=true but {head_module} is "
                        f"stored too ({mib(head_bytes)}) beside {emb.name} ({mib(emb.nbytes)}); a loader that ties "
                        "keeps only one of them")
