"""Layer-streamed GPTQ calibration: one decoder layer in memory at a time, inputs from the quantised layers before.

For a Hugging Face causal LM directory (Llama, Mistral, Qwen2, Qwen3 families), calibration token windows
[S, T] and a :class:`Scheme`, :func:`gptq_model` yields ``(module_name, GPTQResult)`` for every Linear of every
decoder layer, in execution order, then for the head (``head_module``: the recipe's, ``lm_head`` by default):

1. The model skeleton is built from its transformers class on the meta device (no weights). The embedding rows the
   windows use are read (in row blocks) into the hidden states ``h [S, T, D]`` (compute dtype: bf16 by default here;
   `edgeq quantize` passes `calibrated.compute_dtype()`, fp32 on CPUs without bf16 dot products).
2. For each decoder layer: its weights are read from the safetensors files into a materialised copy of that layer.
   A discovery pass on one batch finds the order in which its Linears run and which of them read the same input
   tensor (q/k/v, gate/up): each such group shares one Hessian. Group by group, in order ("true sequential"), a
   forward pass over all windows accumulates the group's Hessian ``2/n X^T X`` with a forward pre-hook and stops the
   layer right there; every member is quantised with :func:`gptq_quantize` under one :func:`prepare_hessian`, and
   its weight in the layer is replaced by the dequantised weight, so later groups see quantised inputs. A last pass
   computes the layer's outputs, which are the next layer's inputs. The layer is then released (back to meta).
   The passes do not re-run what is already final: once o_proj (down_proj) is quantised, the attention's (MLP's)
   output for every batch is o_proj (down_proj) applied to the inputs its own pass kept, and later passes read it
   instead of running the child (:mod:`edgeq.convert.tails`: bit-identical; within its memory budget each Linear
   runs once per stream).
3. The head's Hessian comes from the final norm applied to the last layer's (quantised) outputs; the head weight
   (``<head_module>.weight``, or the embedding table when tied) is quantised in row blocks under one factorisation.

With the float target (the default, ``target="float"``) a second stream runs beside the first: the float model's
activations, through a copy of each layer's float weights, give each group a cross term beside its Hessian, and each
Linear is quantised towards the float model's outputs (:func:`edgeq.quantize.hessian.asymmetric_shift`; where a
group has fewer than half as many outputs as inputs, down_proj, from the cross term's output form,
:func:`edgeq.quantize.hessian.target_delta`, the same target for fewer flops).

Peak memory: one layer's weights (compute dtype, plus one Linear in fp32 while it is quantised), the layer's
Hessians (4 K^2 bytes each), two copies of the calibration activations (S * T * D in the compute dtype) and one
batch's intermediate activations; the float target adds a copy of the layer's weights, two more copies of the
activations and, per group, the cross term and the shift (4 K^2 bytes each; 4 K N each for down_proj, whose cross
term is kept in its output form: :func:`edgeq.quantize.hessian.target_delta`); the tails' activations, per stream
tokens x (hidden + intermediate) in the compute dtype, up to :data:`edgeq.convert.tails.CACHE_BYTES` a layer. The
head is processed in row blocks of ~``ROW_BLOCK_ELEMENTS`` weights.

Attention runs through PyTorch SDPA with an explicit causal mask; windows longer than a model's sliding window are
refused rather than silently mis-masked.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from edgeq.convert import passes, tails
from edgeq.io.hf import Checkpoint, open_checkpoint
from edgeq.io.skeleton import attention
from edgeq.errors import EdgeqError
from edgeq.keys import HEAD_MODULE
from edgeq.quantize.gptq import GROUP_PARAMS, GPTQResult, concat_rows, gptq_quantize
from edgeq.quantize.hessian import HessianAccumulator, PreparedHessian, asymmetric_shift, prepare_hessian, target_delta
from edgeq.scheme import Scheme

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROW_BLOCK_ELEMENTS = 16 << 20  # head row blocks: ~16M weights (64 MB fp32 per working copy)
BATCH_TOKENS = 2048  # tokens per forward batch (whole windows)
TARGETS = ("float", "layer")  # what each Linear is fitted to (gptq_model); the first is the default

Progress = Callable[[int, int, str], None]  # (done, total, label): layers done of n_layers + 1 (the head)
Observer = Callable[[str, torch.Tensor], None]  # (module name of a Hessian group's first member, H [K, K] fp32)


def calibration_windows(model_dir: str | Path, text: str, nsamples: int = 128, seqlen: int = 512) -> torch.Tensor:
    """Tokenise ``text`` with the model's ``tokenizer.json`` and cut it into consecutive, non-overlapping windows:
    int64 [min(nsamples, available), seqlen]. Deterministic (no sampling), so runs are reproducible."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise EdgeqError(f"{path}: not found; GPTQ calibration needs the model's tokenizer.json")
    if nsamples < 1 or seqlen < 2:
        raise EdgeqError(f"calibration: nsamples={nsamples} and seqlen={seqlen} must be >= 1 and >= 2")
    ids = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids
    count = min(nsamples, len(ids) // seqlen)
    if count == 0:
        raise EdgeqError(
            f"calibration text has {len(ids)} tokens, fewer than one window of {seqlen}; give a longer --calib file or a smaller --seqlen"
        )
    return torch.tensor(ids[: count * seqlen], dtype=torch.int64).reshape(count, seqlen)


def _build_skeleton(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise EdgeqError(
            f"{model_dir / 'config.json'}: model_type {config.model_type!r} is not supported by GPTQ calibration "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use --method rtn"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention(dtype), dtype=dtype)
    model.requires_grad_(False)
    return config, model


def _check_windows(windows: torch.Tensor, config) -> None:
    if windows.dim() != 2 or windows.dtype not in (torch.int64, torch.int32) or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise EdgeqError(f"calibration windows: expected int64 [S, T] with S >= 1, T >= 2, got {windows.dtype} {list(windows.shape)}")
    lo, hi = int(windows.min()), int(windows.max())
    if lo < 0 or hi >= config.vocab_size:
        raise EdgeqError(f"calibration windows: token ids {lo}..{hi} outside the vocabulary 0..{config.vocab_size - 1}; wrong tokenizer?")
    sw = getattr(config, "sliding_window", None)
    if sw and getattr(config, "use_sliding_window", True) and windows.shape[1] > sw:
        raise EdgeqError(f"calibration windows of {windows.shape[1]} tokens exceed the model's sliding window {sw}; use --seqlen {sw} or less")


def _read_into(ckpt: Checkpoint, module: nn.Module, prefix: str, dtype: torch.dtype) -> None:
    """Materialise ``module`` on the CPU and fill its parameters from the checkpoint tensors ``prefix + name``."""
    module.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = prefix + name
            info = ckpt.tensors.get(full)
            if info is None:
                raise EdgeqError(f"{ckpt.root}: tensor {full} not found; the checkpoint does not match its config's architecture")
            if tuple(info.shape) != tuple(p.shape):
                raise EdgeqError(f"{info.file}: tensor {full} has shape {list(info.shape)}, the architecture expects {list(p.shape)}")
            p.copy_(ckpt.read(full).to(dtype))


def _embed(ckpt: Checkpoint, name: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gather embedding rows for ``ids`` [S, T] reading the table in row blocks -> [S, T, D]."""
    info = ckpt.tensors.get(name)
    if info is None:
        raise EdgeqError(f"{ckpt.root}: embedding table {name} not found")
    v, d = info.shape
    flat = ids.reshape(-1)
    out = torch.empty(flat.numel(), d, dtype=dtype)
    step = max(1, ROW_BLOCK_ELEMENTS // d)
    for a in range(0, v, step):
        b = min(v, a + step)
        sel = (flat >= a) & (flat < b)
        if bool(sel.any()):
            out[sel] = ckpt.read(name, (a, b))[flat[sel] - a].to(dtype)
    return out.reshape(*ids.shape, d)


def _batches(s: int, t: int) -> list[slice]:
    b = max(1, BATCH_TOKENS // t)
    return [slice(a, min(s, a + b)) for a in range(0, s, b)]


def _hessian_for(layer: nn.Module, member: str, run: passes.LayerRunner, h: torch.Tensor, name: str, cache: tails.Cache,
                 hf: torch.Tensor | None = None, float_params: dict | None = None,
                 weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(H, C)``: ``H = 2/n X~^T X~`` over the inputs X~ the Linear ``member`` (its name in the layer) receives in
    the layer as it is (earlier groups quantised) on ``h``; with the float stream (``hf``, the float model's inputs to
    this layer, and the layer's float weights ``float_params``) also ``C = 2/n X~^T X`` against the inputs X the
    float model gives it, or given the group's float ``weight`` W [N, K] its output form ``2/n X~^T (X - X~) W^T``
    (else None). ``cache`` serves the children already frozen and keeps a tail's inputs."""
    linear = layer.get_submodule(member)
    acc = HessianAccumulator(linear.in_features, name, cross=hf is not None, weight=weight)
    for sl in _batches(h.shape[0], h.shape[1]):
        xf = None
        if hf is not None:
            cache.select(1, sl)
            xf = passes.group_input(layer, linear, run, hf[sl], float_params)
            cache.keep(member, 1, sl, xf)
        cache.select(0, sl)
        x = passes.group_input(layer, linear, run, h[sl])
        cache.keep(member, 0, sl, x)
        acc.add(x, xf)
    return acc.hessian(), (acc.cross() if hf is not None else None)


def _quantize_rows(ckpt: Checkpoint, tensor: str, module_name: str, H: torch.Tensor, scheme: Scheme, opts: dict, keep_w_hat: bool,
                   prep: PreparedHessian | None = None, shift: torch.Tensor | None = None,
                   delta: torch.Tensor | None = None) -> GPTQResult:
    """GPTQ one weight (read from the checkpoint) in row blocks under one factorisation of H (``prep``, shared by
    the modules that read one input; made here if None). ``shift`` (fp32 [K, K], :func:`asymmetric_shift`): each
    row block ``w`` is quantised as ``v = w + w @ shift``, the target that makes up for the quantised inputs; or
    ``delta`` (fp32 [N, K], :func:`target_delta`): as ``v = w + delta[rows]``, the same target. The result's output
    error is then GPTQ's fit to v under H, its per-row squared errors those against w."""
    info = ckpt.tensors.get(tensor)
    if info is None:
        raise EdgeqError(f"{ckpt.root}: tensor {tensor} not found")
    n, k = info.shape
    if prep is None:
        prep = prepare_hessian(H, opts["damp"], opts["act_order"], name=module_name)
    step = max(64, (ROW_BLOCK_ELEMENTS // k) // 64 * 64)
    parts = []
    for a in range(0, n, step):
        b = min(n, a + step)
        w = ckpt.read(tensor, (a, b)) if (a, b) != (0, n) else ckpt.read(tensor)
        w32 = w.to(torch.float32) if shift is not None or delta is not None else None
        v = w if w32 is None else (w32.addmm(w32, shift) if shift is not None else w32 + delta[a:b])
        r = gptq_quantize(
            v, H, opts["group_sizes"].get(module_name, scheme.group_size), act_order=opts["act_order"], block_size=opts["block_size"],
            static_groups=opts["static_groups"], name=module_name, keep_dequantized=keep_w_hat or w32 is not None,
            prepared=prep, group_params=opts["group_params"],
        )
        if w32 is not None:  # the weight error against the checkpoint's weights, not against the target
            err = (w32 - _natural_w_hat(r)).square_()
            r = replace(r, sq_error=err.sum(-1, dtype=torch.float64), sq_norm=w32.square().sum(-1, dtype=torch.float64),
                        w_hat=r.w_hat if keep_w_hat else None)
            del err
        parts.append(r)
    return parts[0] if len(parts) == 1 else concat_rows(parts)


def _natural_w_hat(r: GPTQResult) -> torch.Tensor:
    return r.w_hat if r.perm is None else r.w_hat[:, torch.argsort(r.perm)]


def gptq_model(
    model_dir: str | Path,
    windows: torch.Tensor,
    scheme: Scheme,
    *,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = False,
    block_size: int = 128,
    group_params: str = GROUP_PARAMS[0],
    keep: frozenset[str] | set[str] = frozenset(),
    head_source: str | None = None,
    head_module: str = HEAD_MODULE,
    group_sizes: dict[str, int] | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    target: str = "float",
    progress: Progress | None = None,
    observe: Observer | None = None,
) -> Iterator[tuple[str, GPTQResult]]:
    """Yield ``(module_name, GPTQResult)`` for every decoder-layer Linear (execution order) and then the head.

    ``keep``: module names (e.g. ``model.layers.0.mlp.down_proj``) left in float (not yielded; later layers see their
    float outputs). ``head_module``: the head's name as the plan knows it (the recipe's; ``lm_head`` by default),
    under which its result is yielded. ``head_source``: the tensor the head is quantised from (default
    ``<head_module>.weight`` if present, else the embedding table). ``progress(done, total, label)`` is called after
    the embeddings (0), each layer and the head (total = layers + 1). ``observe(name, H)`` sees each Hessian (for
    tests and diagnostics). ``group_sizes``: ``{module: G}`` for modules quantised with another group size than the
    scheme's. ``group_params``: how GPTQ picks each group's (scale, zero) (:data:`edgeq.quantize.gptq.GROUP_PARAMS`).
    ``target`` (:data:`TARGETS`): ``"float"`` fits each Linear, on its quantised inputs, to the float model's outputs
    (a second stream of activations, :func:`asymmetric_shift`); ``"layer"`` to its own float weights (GPTQ as published).
    """
    _check_target(target)
    t0, root = time.perf_counter(), Path(model_dir)
    ckpt = open_checkpoint(root)
    config, model = _build_skeleton(root, compute_dtype)
    _check_windows(windows, config)
    names = {id(m): n for n, m in model.named_modules()}
    base = model.model
    embed_name = names[id(base.embed_tokens)] + ".weight"
    head_tensor = head_source or (f"{head_module}.weight" if f"{head_module}.weight" in ckpt.tensors else embed_name)
    opts = {"damp": damp, "act_order": act_order, "static_groups": static_groups, "block_size": block_size,
            "group_params": group_params, "group_sizes": dict(group_sizes or {})}
    run = passes.LayerRunner(model, config, windows.shape[1], compute_dtype)
    total = len(base.layers) + 1
    report = progress or (lambda done, total, label: None)

    h = _embed(ckpt, embed_name, windows.long(), compute_dtype)
    hf = h.clone() if target == "float" else None  # the float model's stream (the embeddings are read unquantised)
    report(0, total, "embeddings")
    for i, layer in enumerate(base.layers):
        prefix = names[id(layer)] + "."
        h, hf = yield from _calibrate_layer(ckpt, layer, prefix, h, run, scheme, opts, keep, observe, compute_dtype, hf)
        report(i + 1, total, f"layer {i + 1}/{total - 1} ({time.perf_counter() - t0:.0f}s)")

    H, shift = _head_hessian(ckpt, base.norm, names[id(base.norm)] + ".", h, head_module, compute_dtype, hf, damp)
    del h, hf
    if observe:
        observe(head_module, H)
    yield head_module, _quantize_rows(ckpt, head_tensor, head_module, H, scheme, opts, keep_w_hat=False, shift=shift)
    report(total, total, f"{head_module} ({time.perf_counter() - t0:.0f}s)")


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise EdgeqError(f"GPTQ target {target!r} is not one of {', '.join(TARGETS)}")


def _head_hessian(ckpt: Checkpoint, norm: nn.Module, prefix: str, h: torch.Tensor, head_module: str,
                  compute_dtype: torch.dtype, hf: torch.Tensor | None, damp: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step 3 of the module docstring: the head's Hessian from the final norm of the last layer's outputs ``h``, and
    with the float stream ``hf`` the shift towards the float model's logits (:func:`asymmetric_shift`; else None)."""
    s, t = h.shape[:2]
    _read_into(ckpt, norm, prefix, compute_dtype)
    acc = HessianAccumulator(h.shape[-1], head_module, cross=hf is not None)
    with torch.no_grad():
        for sl in _batches(s, t):
            acc.add(norm(h[sl]), norm(hf[sl]) if hf is not None else None)
    H = acc.hessian()
    return H, (asymmetric_shift(H, acc.cross(), damp, acc.n, name=head_module) if hf is not None else None)


def _calibrate_layer(ckpt: Checkpoint, layer: nn.Module, prefix: str, h: torch.Tensor, run: passes.LayerRunner,
                     scheme: Scheme, opts: dict, keep, observe: Observer | None, compute_dtype: torch.dtype,
                     hf: torch.Tensor | None = None):
    """One decoder layer (step 2 of the module docstring): yields its ``(module, GPTQResult)`` group by group and
    returns its outputs on ``h`` (the next layer's inputs) and, with a float stream ``hf``, the float layer's outputs
    on ``hf``; the layer is released (back to meta) at the end."""
    s, t = h.shape[:2]
    tokens = s * t
    _read_into(ckpt, layer, prefix, compute_dtype)
    float_params = {n: p.detach().clone() for n, p in layer.named_parameters()} if hf is not None else None
    groups, found = passes.discover_groups(layer, run, h[_batches(s, t)[0]], prefix)
    planned = tails.plan(layer, found, tokens, 1 if hf is None else 2, h.element_size())
    cache = tails.Cache(layer, planned, _batches(s, t))
    try:
        yield from _calibrate_groups(ckpt, layer, prefix, groups, h, run, scheme, opts, keep, observe, cache, hf,
                                     float_params)
        out, out_f = _layer_outputs(layer, run, h, hf, float_params, cache)
    finally:
        cache.release()
    layer.to_empty(device="meta")  # release this layer's weights
    return out, out_f


def _calibrate_groups(ckpt: Checkpoint, layer: nn.Module, prefix: str, groups: list[list[str]], h: torch.Tensor,
                      run: passes.LayerRunner, scheme: Scheme, opts: dict, keep, observe: Observer | None,
                      cache: tails.Cache, hf: torch.Tensor | None, float_params: dict | None):
    """GPTQ each group of the layer in order (step 2 of the module docstring), yielding ``(module, GPTQResult)``;
    a group that is a tail freezes its child in ``cache`` once its weights are in place."""
    linears = dict(layer.named_modules())
    compute_dtype, tokens = h.dtype, h.shape[0] * h.shape[1]
    for group in groups:
        todo = [n for n in group if prefix + n not in keep]
        if not todo:
            continue
        rows = {n: linears[n].out_features for n in todo}
        weight = _output_form_weight(rows, linears[group[0]].in_features, float_params)
        H, C = _hessian_for(layer, group[0], run, h, prefix + group[0], cache, hf, float_params, weight)
        if observe:
            observe(prefix + group[0], H)
        # the float target's solve before GPTQ's factorisation: their [K, K] copies are never held at once
        shift, deltas = _float_targets(H, C, rows, weight is not None, opts["damp"], tokens, prefix + group[0])
        del C, weight  # consumed by the shift
        prep = prepare_hessian(H, opts["damp"], opts["act_order"], name=prefix + group[0])  # once for the group
        for n in todo:
            r = _quantize_rows(ckpt, prefix + n + ".weight", prefix + n, H, scheme, opts, keep_w_hat=True, prep=prep,
                               shift=shift, delta=deltas.get(n))
            with torch.no_grad():
                linears[n].weight.copy_(_natural_w_hat(r).to(compute_dtype))
            yield prefix + n, replace(r, w_hat=None)
        del H, prep, shift, deltas
        if todo == group:
            cache.freeze(group[0], float_params)


def _output_form_weight(rows: dict[str, int], k: int, float_params: dict | None) -> torch.Tensor | None:
    """The members' float weights stacked in ``rows``' order (fp32 [N, K]; ``rows``: member -> output rows, K their
    inputs) where the float target's cross term is cheaper in its output form (:meth:`HessianAccumulator.cross`:
    4 n K N flops against 2 n K^2, and a solve with N instead of K right-hand sides), i.e. where 2 N < K: down_proj
    (K = 8192, N = 2048 on Llama-3.2-1B). None elsewhere and without the float stream. The weights are the layer's
    float parameters, in the compute dtype: a bf16 copy of fp32 weights rounds the correction D by 2^-9 of itself."""
    if float_params is None or 2 * sum(rows.values()) >= k:
        return None
    return torch.cat([float_params[n + ".weight"].to(torch.float32) for n in rows])


def _float_targets(H: torch.Tensor, C: torch.Tensor | None, rows: dict[str, int], output_form: bool,
                   damp: float, tokens: int, name: str) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """What moves each member (``rows``: its output rows, in the order its weight was stacked) to the float target:
    (the shared shift S, {}) from the cross term C, or (None, {member: its rows of the correction D}) from its output
    form; (None, {}) without C."""
    if C is None:
        return None, {}
    if not output_form:
        return asymmetric_shift(H, C, damp, tokens, name=name), {}
    d = target_delta(H, C, damp, tokens, name=name)
    return None, dict(zip(rows, d.split(list(rows.values()))))


def _layer_outputs(layer: nn.Module, run: passes.LayerRunner, h: torch.Tensor, hf: torch.Tensor | None,
                   float_params: dict | None, cache: tails.Cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's outputs on ``h`` (and with its float weights on ``hf``): the next layer's inputs."""
    out = torch.empty_like(h)
    out_f = torch.empty_like(hf) if hf is not None else None
    for sl in _batches(h.shape[0], h.shape[1]):
        cache.select(0, sl)
        out[sl] = run(layer, h[sl])
        if out_f is not None:
            cache.select(1, sl)
            out_f[sl] = run(layer, hf[sl], float_params)
    return out, out_f
