"""An edgeq checkpoint: manifest, config.json and the safetensors headers must tell the same story.

What every kernel shares is checked here: shards and tensors (dtype, shape) against the manifest, the config's
scheme/method/kernel and its copy of the layout record, the head, ``tie_word_embeddings``. What depends on the
packed format (packed shapes, the layout record against this machine) is asked of the kernel's layout through
:mod:`edgeq.inspect.packed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from edgeq.convert.recipe import Recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.manifest import Manifest, read_manifest
from edgeq.keys import HEAD_MODULE, MANIFEST, Role
from edgeq.layouts.base import get as get_layout
from edgeq.scheme import Scheme
from edgeq.inspect.embeddings import embedding_info, parameters
from edgeq.inspect.kinds import QUANT_PARTS, quant_modules, rows, unquantized_params
from edgeq.inspect.packed import packed_checks
from edgeq.inspect.schema import EdgeqInfo, QModule, TensorRow


@dataclass(frozen=True)
class EdgeqFindings:
    """What the headers say about an edgeq checkpoint (problems and warnings go to the caller's lists)."""

    info: EdgeqInfo
    rows: list[TensorRow]
    modules: dict[str, QModule]
    params: int
    bits: Optional[float]  # bits per quantised weight, scales and zeros included
    manifest: Manifest


def inspect_edgeq(ckpt: Checkpoint, recipe: Recipe, strict_layout: bool, problems: list[str],
                  warnings: list[str]) -> EdgeqFindings:
    manifest = read_manifest(ckpt.root)
    checks = packed_checks(manifest.kernel)
    qmods = _claim_parts(ckpt, manifest)
    roles = {name: t.get("role", Role.OTHER) for name, t in manifest.tensors.items() if isinstance(t, dict)}
    rows_ = rows(ckpt, recipe, qmods, roles)
    check_manifest(ckpt, manifest, problems)
    g = _group_size(manifest.scheme, problems)
    if HEAD_MODULE not in manifest.quantized_modules:
        problems.append(f"{MANIFEST}: {HEAD_MODULE} is not among the quantised modules; edgeq always quantises the head")
    modules = checks.modules(ckpt, manifest, g, problems)
    verdict = checks.record_verdict(ckpt, manifest, modules, g, strict_layout, problems, warnings)
    head = manifest.head
    tied_source = head.get("source", f"{HEAD_MODULE}.weight") != f"{HEAD_MODULE}.weight"
    params = sum(m.numel for m in modules.values() if not (m.name == HEAD_MODULE and tied_source))
    params += unquantized_params(rows_)
    embeddings = embedding_info(ckpt, manifest, recipe, problems)
    params += parameters(embeddings)  # a packed table's V*K, which its quantised parts encode
    if ckpt.config.get("tie_word_embeddings") is not False:
        problems.append(f"config.json: tie_word_embeddings is {ckpt.config.get('tie_word_embeddings')!r}; an edgeq "
                        "checkpoint stores its own quantised head and must say false (a loader would tie the head "
                        "to the bf16 embedding and ignore the quantised one)")
    q_bytes = sum(m.bytes for m in modules.values())
    q_weights = sum(m.numel for m in modules.values())
    info = EdgeqInfo(
        format_version=manifest.format_version, scheme=manifest.scheme, group_size=g or 0, method=manifest.method,
        kernel=manifest.kernel, layout_stored=verdict.stored, layout_machine=verdict.machine,
        layout_matches=verdict.matches, on_load=verdict.on_load,
        head_quantized=bool(head.get("quantized")) and HEAD_MODULE in modules, head_source=str(head.get("source")),
        untied=bool(head.get("untied")), quantized_modules=len(modules),
        modules_not_converted=dict(manifest.modules_not_converted), created_by=dict(manifest.created_by),
        group_sizes=tuple(sorted(manifest.group_sizes.items())), embeddings=embeddings,
        head_levels=tuple(manifest.head_levels) if "levels" in head else (),
    )
    bits = 8 * q_bytes / q_weights if q_weights else None
    return EdgeqFindings(info, rows_, modules, params, bits, manifest)


def _claim_parts(ckpt: Checkpoint, manifest: Manifest) -> dict:
    """The quantised modules by tensor suffix; a suffix of the kernel's that is no foreign format's (W4A8's
    ``.zeros``) is claimed for the manifest's modules only, so a float ``*.zeros`` elsewhere stays a plain tensor."""
    qmods = quant_modules(ckpt)
    own = [s for s in get_layout(manifest.kernel).suffixes if s not in QUANT_PARTS]
    for m in manifest.quantized_modules:
        for suffix in own:
            if f"{m}{suffix}" in ckpt.tensors:
                qmods.setdefault(m, {})[suffix] = ckpt.tensors[f"{m}{suffix}"]
    return qmods


def _group_size(scheme: str, problems: list[str]) -> int | None:
    try:
        return Scheme.parse(scheme).group_size
    except EdgeqError as e:
        problems.append(f"{MANIFEST}: {e}")
        return None


def check_manifest(ckpt: Checkpoint, manifest: Manifest, problems: list[str]) -> None:
    """Manifest, config and headers must tell the same story: same shards, tensors, dtypes, shapes, settings."""
    files = {f.name for f in ckpt.files}
    for shard in sorted(set(manifest.shards) - files):
        problems.append(f"{MANIFEST}: lists shard {shard}, which is not among the weight files")
    for shard in sorted(files - set(manifest.shards)):
        problems.append(f"{shard}: not listed in {MANIFEST}'s shards (no sha256 to check it against)")
    for name, t in manifest.tensors.items():
        info = ckpt.tensors.get(name)
        if info is None:
            problems.append(f"{MANIFEST}: tensor {name} is missing from the weight files")
        elif isinstance(t, dict) and (t.get("dtype") != info.dtype or list(t.get("shape", [])) != list(info.shape)):
            problems.append(f"{info.file.name}: tensor {name} is {info.dtype} {list(info.shape)} but the manifest says "
                            f"{t.get('dtype')} {t.get('shape')}")
    extra = sorted(set(ckpt.tensors) - set(manifest.tensors))
    if extra and manifest.tensors:
        problems.append(f"{len(extra)} tensor(s) not in {MANIFEST}: {', '.join(extra[:5])}")
    q = ckpt.quantization_config or {}
    for key in ("scheme", "method", "kernel"):
        want = str(getattr(manifest, key))  # str: the kernel is a Kernel, whose repr is not the file's spelling
        if q.get(key) != want:
            problems.append(f"config.json: quantization_config.{key} = {q.get(key)!r} but the manifest says {want!r}")
    if problem := packed_checks(manifest.kernel).config_layout_problem(q.get("layout"), manifest):
        problems.append(f"config.json: {problem} (load refuses the checkpoint)")
