"""The memory a served checkpoint costs: the one formula ``edgeq inspect`` reports and the benchmarks check.

It models what ``edgeq.runtime.load`` allocates (edgeq/runtime/loader.py), split by kind of memory because the two
behave differently:

- **mapped** (file-backed, ``RssFile``; shared with the page cache, droppable under pressure, never copied): every
  tensor the runtime uses as stored, through a private read-only mapping of the shards. That is the packed tensors
  (``*.qweight`` uint8 [N, K/2], ``*.scales_and_zeros`` bf16 [K/G, N, 2]), a packed embedding's levels (the same two
  tensors per level, read in place with the stored layout even when the linears are repacked; a tied table's level 0
  is the head's), every unquantised tensor already in bf16 (embeddings, norms, biases: all of an edgeq checkpoint's)
  and every non-float tensor. Pages count once touched; the projection assumes
  all are (the whole model runs every token).
- **anonymous** (``RssAnon``), allocated by the runtime:
    - casts: an unquantised float tensor not stored in bf16 is copied to bf16 (``numel * 2``);
    - repacks: when the stored layout is not this machine's, every quantised module's ``qweight`` is repacked into
      a copy of its size (a packed embedding's own levels are not: they are read with the stored layout);
    - the static KV cache, preallocated at load::

          bytes_per_token = 2 (K and V) * num_hidden_layers * num_key_value_heads * head_dim * 2 (bf16)
          budget_tokens   = kv_cache_bytes // bytes_per_token
          kv_tokens       = min(max_model_len, budget_tokens)
          kv_bytes        = kv_tokens * bytes_per_token

      ``max_model_len`` defaults to ``min(budget_tokens, max_position_embeddings)``, as the runtime's does;
    - the prefill scratch, shared by all quantised layers: the largest row block any of them dequantises,
      ``max over modules of rows_per_block(N, K, block_n) * K`` elements, 3 bytes each (a bf16 and a uint8
      buffer). ``rows_per_block`` is the runtime's rule: about 4M weights, whole layout blocks, at most N.

amx_w4a8 checkpoints (docs/w4a8.md): ``M.qweight`` / ``M.scales`` / ``M.zeros`` are mapped as stored; the layout is
fixed by the kernel's source, so nothing is ever repacked; the runtime keeps no shared prefill scratch
(:func:`w4a8_scratch` is 0 bytes: the portable path's ~2 MiB is allocated per call and freed on return).

``total = mapped + anonymous``. Not included: the interpreter, torch's and the tokenizer's own allocations, and
activations, which the benchmark reports as the measured remainder.

Worked example, the bundled tiny-prose model quantised w4a16-g128 (4 layers, 2 KV heads, head_dim 64, all tensors
bf16) at ``max_model_len=1024`` and a 256 MiB budget: ``bytes_per_token = 2 * 4 * 2 * 64 * 2 = 2048``,
``budget_tokens = 131072``, ``kv_tokens = 1024``, ``kv_bytes = 2 MiB``; the largest block is the head's
(N = 4096 <= rows_per_block, K = 256): ``4096 * 256 * 3 = 3 MiB`` of scratch; mapped = all 4,329,984 tensor bytes.

The constants below mirror edgeq/runtime/qlinear.py; tests/test_inspect.py pins them equal and compares the whole
projection with what ``edgeq.runtime.load`` reports it allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from edgeq.errors import EdgeqError

BF16_BYTES = 2
DEFAULT_KV_CACHE_BYTES = 256 << 20
SCRATCH_BYTES_PER_ELEM = 3  # edgeq.runtime.qlinear.Scratch: a bf16 and a uint8 buffer of the same length
SCRATCH_TARGET_ELEMS = 1 << 22  # ~4M weights per dequantised block of the runtime's prefill scratch


@dataclass(frozen=True)
class KVGeometry:
    """What sizes a KV cache: decoder layers, key/value heads, head dimension (from config.json)."""

    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int | None

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES


@dataclass(frozen=True)
class Tensor:
    """One tensor as the runtime will hold it: ``packed`` for qweight/scales_and_zeros, ``qweight`` for the part a
    layout repack copies; ``dtype`` the stored safetensors code (BF16 is used in place, other floats are cast)."""

    name: str
    dtype: str
    numel: int
    nbytes: int
    packed: bool = False
    qweight: bool = False


@dataclass(frozen=True)
class MemoryProjection:
    """Bytes the runtime will hold for one served model; see the module docstring for each term."""

    max_model_len: int
    kv_cache_bytes: int  # the budget asked for
    kv_bytes_per_token: int
    kv_budget_tokens: int
    kv_tokens: int  # what is allocated
    kv_bytes: int
    mapped_weights: int  # file-backed
    anon_weights: int  # casts to bf16 + repacked qweights
    prefill_scratch: int
    prefill_scratch_tensor: str
    repack: bool
    anon_total: int
    total: int
    problems: tuple[str, ...] = ()


def is_float(code: str) -> bool:
    """A floating safetensors dtype code (F16, BF16, F32, F64, F8_*): the runtime casts those to bf16; it uses every
    other tensor as stored (a packed embedding level's U8 ``qweight``, an int64 ``M.perm``)."""
    return code.startswith("F") or code == "BF16"


def text_config(config: dict) -> dict:
    """The language model's part of a config.json dict: its nested ``text_config`` when there is one (VLMs), else
    the dict itself."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


# Other names of the same config fields, as transformers' ``attribute_map``s spell them (GPT-2: n_layer, n_head,
# n_embd, n_positions; MPT: n_layers, n_heads, d_model, max_seq_len): a headers-only reader cannot ask transformers.
_ALIASES = {"num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
            "num_attention_heads": ("n_head", "n_heads"),
            "hidden_size": ("n_embd", "d_model"),
            "max_position_embeddings": ("n_positions", "max_seq_len")}


_REQUIRED = object()


def _field(cfg: dict, name: str, default=_REQUIRED):
    """``cfg[name]``, else its first alias present, else ``default`` (KeyError naming ``name`` without one)."""
    for key in (name, *_ALIASES.get(name, ())):
        if key in cfg:
            return cfg[key]
    if default is _REQUIRED:
        raise KeyError(name)
    return default


def kv_geometry(config: dict) -> KVGeometry:
    """Layers, KV heads and head_dim from a config.json dict (a nested ``text_config`` wins, as for VLMs); GPT-2's and
    MPT's names for the same fields are read too (``_ALIASES``)."""
    cfg = text_config(config)
    try:
        layers = int(_field(cfg, "num_hidden_layers"))
        heads = int(_field(cfg, "num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(_field(cfg, "hidden_size")) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise EdgeqError(f"config.json: cannot size the KV cache (missing or bad {e}); the config needs "
                         "num_hidden_layers, num_attention_heads, hidden_size (or head_dim)") from e
    positions = _field(cfg, "max_position_embeddings", None)
    return KVGeometry(layers, kv_heads, head_dim, int(positions) if isinstance(positions, int) and positions > 0 else None)


def rows_per_block(n: int, k: int, block_n: int) -> int:
    """Rows the runtime's prefill dequantises at a time: about SCRATCH_TARGET_ELEMS weights, a whole number of
    layout blocks, at most N. The same rule as ``edgeq.runtime.qlinear.rows_per_block`` (a test pins the two equal;
    importing the runtime here would pull transformers into a headers-only command)."""
    rows = max(block_n, (SCRATCH_TARGET_ELEMS // max(k, 1)) // block_n * block_n)
    return min(rows, n)


def scratch(modules: Iterable[tuple[str, int, int]], block_n: int) -> tuple[str, int]:
    """(module, bytes) of the prefill scratch for quantised modules given as (name, N, K): the runtime's sizing."""
    best = ("", 0)
    for name, n, k in modules:
        size = rows_per_block(n, k, block_n) * k * SCRATCH_BYTES_PER_ELEM
        if size > best[1]:
            best = (name, size)
    return best


W4A8_CALL_SCRATCH = 2 << 20  # edgeq.runtime.w4a8_compute.w4a8_linear's default scratch_bytes


def w4a8_scratch() -> tuple[str, int]:
    """amx_w4a8 checkpoints: the runtime allocates no shared scratch at load (0 bytes); the portable path allocates
    about W4A8_CALL_SCRATCH per call (at least one 32-row block) and frees it on return, so it is not resident."""
    return (f"none at load; the W4A8 portable path takes ~{W4A8_CALL_SCRATCH >> 20} MiB per call, freed on return", 0)


def project(
    geometry: KVGeometry,
    tensors: Iterable[Tensor],
    scratch: tuple[str, int],
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    max_model_len: int | None = None,
    repack: bool = False,
) -> MemoryProjection:
    """The projection. ``scratch`` comes from :func:`scratch`; ``repack`` when the stored layout is not this
    machine's. Settings the runtime would refuse (a context longer than the budget or the model allows) are returned
    as ``problems`` with the numbers, not raised: inspect reports them beside everything else."""
    mapped = anon_weights = 0
    for t in tensors:
        if t.qweight and repack:
            anon_weights += t.nbytes
        elif t.packed or t.dtype == "BF16" or not is_float(t.dtype):
            mapped += t.nbytes
        else:
            anon_weights += t.numel * BF16_BYTES
    per_token = geometry.bytes_per_token
    budget_tokens = kv_cache_bytes // per_token if per_token else 0
    problems = []
    if budget_tokens < 1:
        problems.append(f"--kv-cache-bytes {kv_cache_bytes} holds no token ({per_token} bytes a token); raise it")
    if max_model_len is None:
        max_model_len = min(budget_tokens, geometry.max_positions) if geometry.max_positions else budget_tokens
    else:
        if geometry.max_positions and max_model_len > geometry.max_positions:
            problems.append(f"--max-model-len {max_model_len} exceeds the model's {geometry.max_positions} positions "
                            "(max_position_embeddings); the runtime refuses it")
        if max_model_len > budget_tokens:
            problems.append(f"--max-model-len {max_model_len} needs {max_model_len * per_token} bytes of KV cache "
                            f"({per_token} a token) but --kv-cache-bytes {kv_cache_bytes} holds {budget_tokens} "
                            "tokens; the runtime refuses it")
    kv_tokens = min(max_model_len, budget_tokens)
    kv_bytes = kv_tokens * per_token
    anon_total = anon_weights + kv_bytes + scratch[1]
    return MemoryProjection(
        max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes, kv_bytes_per_token=per_token,
        kv_budget_tokens=budget_tokens, kv_tokens=kv_tokens, kv_bytes=kv_bytes, mapped_weights=mapped,
        anon_weights=anon_weights, prefill_scratch=scratch[1], prefill_scratch_tensor=scratch[0], repack=repack,
        anon_total=anon_total, total=mapped + anon_total, problems=tuple(problems),
    )
