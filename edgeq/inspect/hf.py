"""A plain Hugging Face (float) checkpoint: what ``edgeq quantize`` would write with each w4a16 scheme, and what
serving the recipe's default scheme's output would cost.

Both come from :func:`edgeq.convert.plan.build_plan` (with the embedding table as the recipe stores it:
:func:`edgeq.convert.embeddings.pack_plan`), the plan the quantizer itself builds, so inspect and quantize
cannot disagree about which tensors can be quantised.
"""

from __future__ import annotations

import math

from edgeq.convert.embeddings import pack_plan, resolve_storage
from edgeq.convert.plan import Plan, build_plan, effective_bits
from edgeq.convert.recipe import Recipe
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.keys import Action, Kernel
from edgeq.layouts.base import get as get_layout
from edgeq.layouts.tinygemm import machine_block_n
from edgeq.memory import KVGeometry, MemoryProjection, project, scratch
from edgeq.memory import Tensor as MemTensor
from edgeq.scheme import Scheme
from edgeq.inspect.schema import SchemeOption


def scheme_options(ckpt: Checkpoint, recipe: Recipe, problems: list[str]) -> tuple[list[SchemeOption], Plan | None]:
    """Every w4a16 scheme's plan (the quantizer's own); returns the options and the default scheme's plan."""
    options, default_plan = [], None
    default = Scheme.parse(recipe.scheme)
    for g in get_layout(Kernel.W4A16).group_sizes:
        scheme = Scheme(activation_bits=16, group_size=g)
        try:  # the embedding table as the recipe stores it (edgeq/convert/embeddings.py), as quantize would
            plan = build_plan(ckpt, scheme, recipe.method, recipe)
            plan = pack_plan(plan, recipe, resolve_storage(None, recipe, scheme), explicit=False)
        except EdgeqError as e:
            problems.append(str(e))
            return [], None
        ok_out = plan.bytes_out
        options.append(SchemeOption(str(scheme), ok_out, plan.bytes_in / ok_out if ok_out else 0.0,
                                    effective_bits(plan), tuple(plan.problems)))
        if scheme == default:
            default_plan = plan
    if all(o.cannot_quantize for o in options):
        problems.append("no w4a16 scheme can quantise every weight (see the cannot-quantise lists); keep the "
                        "offending modules in bf16 with a recipe (keep_bf16)")
    return options, default_plan


def plan_memory(plan: Plan, geometry: KVGeometry, kv_cache_bytes: int, max_model_len: int | None) -> MemoryProjection:
    """What serving the quantised output of ``plan`` (a w4a16 one) would cost; a weight it cannot quantise counts as
    bf16. Each quantised [N, K] is its N*K/2 packed qweight plus the rest of its bytes as scales and zeros."""
    qweight, params = get_layout(Kernel.W4A16).suffixes
    tensors, quantized = [], []
    for e in plan.entries:
        if e.action == Action.PACK_EMBEDDING and e.bytes_out:  # its own levels, mapped as stored, never repacked
            tensors += [MemTensor(n, d, math.prod(s), math.prod(s) * (2 if d == "BF16" else 1), packed=True)
                        for n, d, s in e.out_tensors(plan.scheme)]
        elif e.action == Action.QUANTIZE and e.bytes_out:
            n, k = e.shape
            tensors += [MemTensor(f"{e.module}{qweight}", "U8", n * k // 2, n * k // 2, packed=True, qweight=True),
                        MemTensor(f"{e.module}{params}", "BF16", 0, e.bytes_out - n * k // 2, packed=True)]
            quantized.append((e.module, n, k))
        else:
            numel = math.prod(e.shape)
            tensors.append(MemTensor(e.name, "BF16", numel, numel * 2))
    return project(geometry, tensors, scratch(quantized, machine_block_n()), kv_cache_bytes, max_model_len)
