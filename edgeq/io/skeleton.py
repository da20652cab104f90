"""Build a transformers model with no weights (meta device) and attach mapped tensors to it.

The transformers class is only the model definition: parameters are created on the meta device (no memory), then
every parameter is replaced by a tensor viewing the mapped safetensors file, and every quantised Linear by an
:class:`~edgeq.runtime.qlinear.Int4Linear` over its mapped packed bytes. Buffers that are not stored in checkpoints
(rotary ``inv_freq``) are recomputed on the CPU by rebuilding their module from the config: they are small and do
not depend on ``max_position_embeddings``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from edgeq import cpu
from edgeq.errors import EdgeqError
from edgeq.io.manifest import read_json

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # stored by some old checkpoints; always recomputed


# Sizes every causal LM's config must give as positive integers (when present): 0 or "256" otherwise surface as a
# ZeroDivisionError or "negative dimension" deep inside transformers.
POSITIVE_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "head_dim", "max_position_embeddings")


def load_config(directory):
    """config.json through transformers, its sizes checked first (transformers itself divides by them); every defect
    an EdgeqError naming the file and field."""
    raw = read_json(Path(directory) / "config.json")
    for name in POSITIVE_SIZES:
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise EdgeqError(f"{directory}/config.json: {name} is {value!r}, must be a positive integer; fix it or "
                             f"re-copy config.json from the source model")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EdgeqError(f"{directory}/config.json: transformers cannot read it ({e})") from e
    except Exception as e:  # huggingface_hub's strict dataclasses: a field of the wrong type (null for an int)
        detail = " ".join(line.strip() for line in str(e).splitlines()) or type(e).__name__
        raise EdgeqError(f"{directory}/config.json: transformers refuses it ({detail}); fix the field or re-copy "
                         f"config.json from the source model") from e


def attention(dtype: torch.dtype) -> str:
    """The attention transformers should build: "sdpa", or "eager" where torch's bf16 SDPA fails. It fails on a CPU
    with AMX-BF16 whose torch dispatch is forced below AVX512 (``ATEN_CPU_CAPABILITY=avx2`` or ``default``): the
    flash-attention kernel still packs its blocks for AMX, and the packing routine of the lower capability refuses
    ("pack_vnni2 is only supported when avx512 is supported"). Measured with torch 2.13.0 on an Intel Xeon with AMX:
    bf16 [2, 4, 64, 32] and every larger shape fail under avx2 and default, pass under avx512; [1, 1, 16, 32] passes."""
    forced_low = torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")
    return "eager" if dtype == torch.bfloat16 and forced_low and "amx_bf16" in cpu.flags() else "sdpa"


def build_meta_model(config, dtype: torch.dtype, attn: str = "sdpa") -> nn.Module:
    """The model class for ``config`` with every parameter on the meta device; ``attn`` attention where supported,
    else eager. The converter's sampler asks :func:`attention` for it (its forward passes run transformers'
    attention); the runtime keeps sdpa, which its own prefill attention replaces where it runs."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # edgeq's own; transformers must not try to apply a quantizer
    last = None
    for attn in dict.fromkeys((attn, "eager")):
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
            break
        except ValueError as e:  # e.g. Gemma-2: "does not support sdpa" (softcapping)
            last = e
    else:
        raise EdgeqError(f"config.json: transformers cannot build {config.model_type} ({last})")
    model.eval()
    model.requires_grad_(False)
    _rebuild_meta_buffer_modules(model)
    return model


def _rebuild_meta_buffer_modules(model: nn.Module) -> None:
    """Non-persistent buffers left on meta (rotary ``inv_freq``, Gemma-2's ``embed_scale``) are materialised on the
    CPU and filled by the model's own ``_init_weights``; a buffer it does not fill (still NaN) is an error."""
    for name, module in list(model.named_modules()):
        meta = [b for b, t in module.named_buffers(recurse=False) if t.is_meta]
        if not meta:
            continue
        for b in meta:
            t = module._buffers[b]
            fill = float("nan") if t.is_floating_point() else 0
            module._buffers[b] = torch.full(t.shape, fill, dtype=t.dtype, device="cpu")
        model._init_weights(module)
        for b in meta:
            t = module._buffers[b]
            if t.is_meta or (t.is_floating_point() and bool(torch.isnan(t).any())):
                raise EdgeqError(f"{name}.{b}: this buffer is not stored in checkpoints and transformers does not "
                                 f"compute it; {type(module).__name__} is not supported")


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def quantized_target(model: nn.Module, name: str) -> nn.Linear:
    """The Linear that the manifest's quantised module ``name`` replaces; an error when the model has no such Linear."""
    try:
        old = model.get_submodule(name)
    except AttributeError as e:
        raise EdgeqError(f"manifest lists quantised module {name} but the model built from config.json has no such module") from e
    if not isinstance(old, nn.Linear):
        raise EdgeqError(f"{name}: listed as quantised but is a {type(old).__name__}, not a Linear")
    return old


def quantized_bias(files, name: str, old: nn.Module) -> tuple[torch.Tensor | None, int, int]:
    """The bias of quantised module ``name`` when the model's Linear ``old`` has one: (bf16 tensor or None, bytes
    copied, bytes used mapped). A bf16 bias is used as stored; another float dtype is cast (a copy)."""
    if old.bias is None:
        return None, 0, 0
    if f"{name}.bias" not in files:
        raise EdgeqError(f"{name}: the model has a bias but the checkpoint has no {name}.bias")
    bias = files.get(f"{name}.bias")
    if bias.dtype != torch.bfloat16:
        return bias.to(torch.bfloat16), bias.numel() * 2, 0
    return bias, 0, bias.numel() * 2


def config_model(directory) -> nn.Module:
    """The model ``directory``'s config.json describes, on the meta device (bf16): cheap, no weights."""
    return build_meta_model(load_config(directory), torch.bfloat16)


def config_problems(model: nn.Module, shapes: dict[str, tuple[int, ...]], head: str, linears=()) -> list[str]:
    """What a float checkpoint's tensors (``shapes``: name -> shape, from its headers) and the model its config.json
    describes disagree on: tensors missing, of another shape, or not in the model; and a tensor quantised as a Linear
    (``linears``: weight names) that is not a Linear's weight there (an embedding, GPT-2's transposed Conv1D).
    ``head`` may be absent only where config.json ties it (edgeq quantises it from the embedding then), and may be
    present although the config ties it. ``model``: :func:`config_model`."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    expected = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta}
    problems = [f"{n}: checkpoint shape {list(shapes[n])} but config.json implies {list(want)}"
                for n, want in expected.items() if n in shapes and tuple(shapes[n]) != want]
    problems += [f"{n}: missing (the model needs it" + (": config.json's tie_word_embeddings is false)" if n == head else ")")
                 for n in expected if n not in shapes and (n != head or not tied)]
    problems += [f"{n}: not in the model config.json describes" for n in shapes
                 if n not in expected and n != head and not n.endswith(IGNORED_SUFFIXES)]
    modules = dict(model.named_modules())
    problems += [f"{n}: quantised as a Linear, but its module in the model config.json describes is "
                 f"{type(modules.get(n.rpartition('.')[0])).__name__}" for n in linears
                 if n in expected and not isinstance(modules.get(n.rpartition(".")[0]), nn.Linear)]
    return problems


def output_head(model: nn.Module) -> str | None:
    """The weight name of ``model``'s output head (``lm_head.weight`` for the Llama family; ``model``:
    :func:`config_model`); None where the class has none."""
    out = model.get_output_embeddings()
    return next((f"{n}.weight" for n, m in model.named_modules() if m is out), None) if out is not None else None


def attach(model: nn.Module, files, dtype: torch.dtype, skip: set[str], tie_head: bool) -> dict:
    """Replace every meta parameter/buffer by the mapped tensor of the same name.

    Tensors already in ``dtype`` are used as mapped views; others are cast (a copy, counted in the result). Returns
    ``{"mapped": bytes, "copied": bytes, "tied": [names]}``. Every checkpoint tensor must be consumed (``skip``
    holds those consumed elsewhere); leftovers are an error, never silently dropped.
    """
    stats = {"mapped": 0, "copied": 0, "tied": []}
    used = set(skip)
    for mod_name, module in model.named_modules():
        for kind, store in (("param", module._parameters), ("buffer", module._buffers)):
            for pname, current in list(store.items()):
                if current is None or not current.is_meta:
                    continue
                full = f"{mod_name}.{pname}" if mod_name else pname
                if full not in files:
                    continue  # tied or missing: resolved below
                t = files.get(full)
                if tuple(t.shape) != tuple(current.shape):
                    raise EdgeqError(f"{full}: checkpoint shape {list(t.shape)} but config.json implies {list(current.shape)}")
                if t.dtype != dtype and t.is_floating_point():
                    t = t.to(dtype)
                    stats["copied"] += t.numel() * t.element_size()
                else:
                    stats["mapped"] += t.numel() * t.element_size()
                store[pname] = nn.Parameter(t, requires_grad=False) if kind == "param" else t
                used.add(full)
    if tie_head:
        _tie(model, stats)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise EdgeqError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:4]}; it is incomplete "
                         f"or does not match config.json")
    unused = [n for n in files.names() if n not in used and not n.endswith(IGNORED_SUFFIXES)]
    if unused:
        raise EdgeqError(f"checkpoint has {len(unused)} tensors the model does not use, e.g. {unused[:4]}; it does "
                         f"not match config.json (edgeq never drops weights silently)")
    return stats


def _tie(model: nn.Module, stats: dict) -> None:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if isinstance(out, nn.Linear) and out.weight.is_meta and not inp.weight.is_meta:
        out.weight = inp.weight
        stats["tied"].append("lm_head.weight")
