"""What :func:`edgeq.runtime.load` checks before it builds anything, for the loaders that build their own modules
(the transformers and vLLM integrations): neither may compute text from damaged or missing weights where
``edgeq generate`` refuses them (docs/failures.md)."""

from __future__ import annotations

import torch

from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.io import skeleton
from edgeq.io.mapped import MappedFiles
from edgeq.runtime import embedding
from edgeq.runtime.swap import config_mismatches

SCALE_SUFFIXES = (".scales_and_zeros", ".scales")  # tinygemm W4A16 (bf16 scale and zero), amx_w4a8 (fp32 scales)


def check_scales(files: MappedFiles, modules) -> None:
    """Every scale and zero of the quantised ``modules`` (packed embedding levels included) must be finite: one NaN/Inf
    scale turns every output of its group into NaN/Inf (then the logits); and a tinygemm scale must be positive (the
    quantiser gives a constant group the smallest positive one, GPTQ's are positive: a scale <= 0 is damage, e.g. a
    flipped sign bit, which would otherwise generate plausible wrong text). Reads only the scales (about 3% of a g128
    checkpoint). W4A8 zero points are int8, finite by construction."""
    for name in modules:
        for suffix in SCALE_SUFFIXES:
            if f"{name}{suffix}" not in files:
                continue
            t = files.get(f"{name}{suffix}")
            bad = int(t.numel() - torch.isfinite(t).sum()) if t.is_floating_point() else 0
            what = "NaN/Inf value(s) in the scales/zeros"
            if not bad and suffix == ".scales_and_zeros":
                bad, what = int((t[..., 0] <= 0).sum()), "scale(s) zero or negative"
            if bad:
                shard = files.tensors[f"{name}{suffix}"].file.name
                raise DamagedCheckpointError(
                    f"{shard}: tensor {name}{suffix}: {bad} {what}; the file is damaged: "
                    f"re-copy it or re-quantise (`edgeq inspect --verify` lists every damaged tensor)")


def check_complete(directory, files, info) -> None:
    """Every tensor the model config.json describes is in ``files``, of its shape: a quantised module (or packed
    embedding level) its ``qweight`` and scales, every other parameter itself. transformers would fill a missing one
    with random values and vLLM with zeros, both silently; ``load()`` finds the same in :func:`skeleton.attach`.
    Headers and a meta-device model only."""
    missing = _packed_missing(files, (*info.quantized_modules, *embedding.level_modules(info)))
    skip = set(info.quantized_modules) | set(embedding.entries(info))
    model = skeleton.build_meta_model(skeleton.load_config(directory), torch.bfloat16)
    missing += [name for name, _ in model.named_parameters() if name.rpartition(".")[0] not in skip and name not in files]
    wrong = config_mismatches(model, {n: tuple(t.shape) for n, t in files.tensors.items()}, {})  # load's shape check
    if missing:
        raise EdgeqError(f"{directory}: checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:4]}; it "
                         f"is incomplete or does not match config.json")
    if wrong:
        raise EdgeqError(f"{directory}: {wrong[0]}" + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))


def _packed_missing(files: MappedFiles, modules) -> list[str]:
    """The packed tensors of ``modules`` not in ``files``: each needs its ``qweight`` and its scales."""
    out = []
    for m in modules:
        out += [f"{m}.qweight"] if f"{m}.qweight" not in files else []
        out += [] if any(f"{m}{x}" in files for x in SCALE_SUFFIXES) else [f"{m}{SCALE_SUFFIXES[0]}"]
    return out


def preflight(directory, files, info) -> None:
    """load()'s refusals before building: scales finite and positive, nothing missing (:func:`check_complete`)."""
    check_scales(files, (*info.quantized_modules, *embedding.level_modules(info)))
    check_complete(directory, files, info)
