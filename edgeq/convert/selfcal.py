"""``--calib self``: GPTQ calibration windows sampled from the model being quantised (no user data, no text).

The float checkpoint is mapped (:class:`edgeq.io.mapped.MappedFiles`: file-backed, zero-copy views; tensors stored
in another dtype than the compute dtype are cast, a copy) under its transformers class built on the meta device
(:mod:`edgeq.io.skeleton`), and ``nsamples`` sequences are sampled with a KV cache, ``rows`` sequences per batch:

    start token s0 (config.json's bos_token_id, else its eos_token_id: a document boundary)
    step t = 1..seqlen: p = softmax(logits(x_<t) / temperature) in fp32, end-of-sequence ids get p = 0,
        x_t = the first id i with cumsum(p)[i] > u[row, t] * sum(p)      (inverse CDF, fp64)

``u`` is one table ``torch.rand(nsamples, seqlen, generator=torch.Generator().manual_seed(seed), dtype=float64)``
drawn up front, so a row's draws do not depend on which batch it falls in, except through the GEMMs' rounding, which
can change with the rows in a batch (a near-tie then resolves the other way). A window is the ``seqlen`` sampled ids
(the start token is not part of it, as text windows carry no BOS): int64 [nsamples, seqlen], straight into the
calibration (no decode/re-encode). Worked example: p = (0.5, 0.3, 0.2), u = 0.6 -> cumsum (0.5, 0.8, 1.0), the
first above 0.6 is id 1.

Determinism: the same ids on every run on one machine (the u table, the rows per batch and the sampling arithmetic
are fixed by (model, nsamples, seqlen, seed)). Across CPU classes the float forward rounds differently (bf16 GEMMs on
AMX, AVX512-BF16 or AVX2 accumulate in other orders), so a u that falls within that rounding of a CDF boundary can
pick the neighbouring id and the sequence continues differently from there; the record's ``ids_sha256`` says
whether two runs calibrated on the same ids. Measured on the bundled model (32 x 256, seed 0): forcing torch's AVX2
or default kernels (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``) on an AVX512 machine changes every row within
its first 3-40 tokens, and the checkpoint's KLD like another seed would (0.00352 vs 0.00355). Greedy decoding would
not avoid this: argmax ties and near-ties resolve by the same rounding.

Arithmetic: the stored dtype (bf16 for most checkpoints). Where the CPU has no bf16 dot products (no AVX512-BF16 or
AMX) and no dtype was named, every Linear runs :func:`edgeq.convert.upcast.linear`: the bf16 weights cast to fp32 a
cache-sized row block at a time, fp32 GEMMs, one rounding to bf16 at the output, the same values as a bf16 GEMM up to
the order of the fp32 sums, 3-4x as fast as PyTorch's emulated bf16 GEMMs and without a copy of the model. The
record's ``matmul`` says which ran.

Memory: the mapped weights (file-backed, shared with the page cache, not a second copy), the KV cache of one batch
(``rows`` is chosen from the config so that it stays under ``KV_BUDGET`` bytes) and one batch of logits (rows x V
fp32 and fp64). Released before GPTQ starts.

Threads: a step of a small model (2 * rows in a batch * parameters < ``SMALL_STEP_FLOPS``, e.g. the bundled
4M-parameter model) runs on one intra-op thread, as GPTQ's column sweep does: its matmuls are too small to gain from
a second thread, and on busy cores the pool's hand-offs cost more than the work (profiled on the bundled model on a
loaded 2-core machine: 13 ms per Linear call with 2 threads). Larger models keep the process's threads.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Callable

import torch

from edgeq import cpu
from edgeq.convert import upcast
from edgeq.errors import EdgeqError

SELF = "self"  # the --calib keyword
NSAMPLES, SEQLEN = 32, 256  # defaults for self: docs/gptq.md "Calibration without data" (KLD vs count, measured)
TOKENS_PER_K = 4  # the default asks at least this many tokens per input of the widest quantised Linear
SEED, TEMPERATURE = 0, 1.0
MAX_ROWS = 128  # sequences per batch at most: each step's GEMMs read the weights once for this many rows
KV_BUDGET = 1 << 30  # bytes of KV cache per batch (bf16), which bounds the rows of a batch on large models
UPCAST = "fp32 over bf16 row blocks"  # the record's matmul under auto on a CPU without bf16 dot products
SMALL_STEP_FLOPS = 1 << 30  # a batch step below this many FLOPs runs on one thread (module docstring)

Progress = Callable[[int, int], None]  # (tokens sampled, tokens asked)


def default_nsamples(k_max: int, seqlen: int) -> int:
    """Windows sampled when ``--nsamples`` is not given: ``max(NSAMPLES, ceil(TOKENS_PER_K * k_max / seqlen))``.
    A Linear's Hessian (K x K) has rank at most the token count, and GPTQ fits the tokens it saw when they are
    few against K. Bundled model (widest K 768, down_proj) at 256: 32 windows (8,192 tokens, 10.7 per input);
    Qwen2.5-1.5B (K 8960): 140 windows (35,840 tokens)."""
    return max(NSAMPLES, -(-TOKENS_PER_K * k_max // seqlen))


def rows_per_batch(config, seqlen: int) -> int:
    """Sequences sampled together: as many as fit ``KV_BUDGET`` (bf16 K and V of every layer for ``seqlen + 1``
    positions), 1..``MAX_ROWS``. A function of the config and seqlen only, so every machine batches alike.
    Example: Qwen2.5-1.5B (28 layers, 2 KV heads of 128) at seqlen 256: 28 * 2 * 2 * 128 * 2 = 28,672 bytes per
    token, 7.4 MB per sequence, 128 rows (946 MB, under the anonymous peak of the GPTQ phase that follows)."""
    layers = config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_row = layers * 2 * heads * head_dim * 2 * (seqlen + 1)
    return max(1, min(MAX_ROWS, KV_BUDGET // per_row))


def balanced_rows(rows: int, nsamples: int) -> int:
    """The rows of each batch when ``nsamples`` sequences are split into the fewest batches of at most ``rows``:
    ``ceil(nsamples / ceil(nsamples / rows))``, so the last batch is short by less than one row per batch (a short
    last batch would cost a whole pass over the weights per step for a few rows). Examples: 128 windows at 127 rows
    -> 2 batches of 64 (not 127 + 1); 140 at 128 -> 70 + 70; 32 at 128 -> 32."""
    batches = -(-nsamples // rows)
    return -(-nsamples // batches)


def start_and_suppressed(config, root: Path) -> tuple[int, list[int]]:
    """(start token, end-of-sequence ids given p = 0) from config.json: BOS, else EOS, as the start."""
    eos = config.eos_token_id
    eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    start = config.bos_token_id if config.bos_token_id is not None else (eos[0] if eos else None)
    if start is None:
        raise EdgeqError(f"{root / 'config.json'}: no bos_token_id or eos_token_id to start sampling from; "
                         "--calib self needs one (add it, or give --calib FILE)")
    return int(start), sorted(set(e for e in eos if 0 <= e < config.vocab_size))


def _mapped_model(root: Path, want: torch.dtype | None = None):
    """The float model over its mapped weights: (model, config, dtype, bytes copied by casts). ``want``: the compute
    dtype (weights stored in another dtype are cast: a copy); None: the stored dtype (bf16 if mixed)."""
    from edgeq.io import skeleton  # noqa: PLC0415 (transformers: only when sampling)
    from edgeq.io.mapped import MappedFiles  # noqa: PLC0415

    config = skeleton.load_config(root)
    files = MappedFiles(root)
    stored = {files.tensors[n].torch_dtype for n in files.names() if files.tensors[n].torch_dtype.is_floating_point}
    dtype = stored.pop() if len(stored) == 1 and stored <= {torch.bfloat16, torch.float32} else torch.bfloat16
    dtype = want or dtype
    model = skeleton.build_meta_model(config, dtype, attn=skeleton.attention(dtype))
    stats = skeleton.attach(model, files, dtype, set(), tie_head=bool(getattr(config, "tie_word_embeddings", False)))
    return model, config, dtype, stats["copied"]


def _cache_kwarg(model) -> str:
    """``cache`` in transformers 5.2x, ``past_key_values`` before; the other name would be swallowed by **kwargs."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: for each row the first id whose cumulative probability exceeds ``u * total``.
    ``probs`` [R, V] (any float; zeros never drawn), ``u`` [R] fp64 in [0, 1) -> int64 [R]."""
    cdf = probs.double().cumsum(-1)
    x = (u * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_windows(model_dir: str | Path, nsamples: int = NSAMPLES, seqlen: int = SEQLEN, seed: int = SEED,
                   temperature: float = TEMPERATURE, progress: Progress | None = None,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, dict]:
    """``nsamples`` sequences of ``seqlen`` ids sampled from the float model in ``model_dir`` (module docstring):
    (int64 [nsamples, seqlen], the record for the manifest). ``dtype``: compute in it (None: the stored dtype)."""
    root = Path(model_dir)
    if nsamples < 1 or seqlen < 2 or not temperature > 0:
        raise EdgeqError(f"--calib self: nsamples={nsamples}, seqlen={seqlen}, temperature={temperature}; "
                         "need >= 1, >= 2 and > 0")
    named = dtype is not None
    model, config, dtype, copied = _mapped_model(root, dtype)
    dtype_name = matmul = str(dtype).removeprefix("torch.")
    if not named and dtype == torch.bfloat16 and not cpu.has_bf16_dot():
        upcast.upcast_linears(model)  # bf16 weights, fp32 GEMMs by row blocks: no copy (module docstring)
        matmul = UPCAST
    start, suppressed = start_and_suppressed(config, root)
    rows = balanced_rows(rows_per_batch(config, seqlen), nsamples)
    u = torch.rand(nsamples, seqlen, generator=torch.Generator(device="cpu").manual_seed(seed), dtype=torch.float64)
    ids = torch.empty(nsamples, seqlen + 1, dtype=torch.int64)
    ids[:, 0] = start
    threads = torch.get_num_threads()
    if 2 * rows * sum(p.numel() for p in model.parameters()) < SMALL_STEP_FLOPS:
        torch.set_num_threads(1)
    try:
        _sample(model, config, ids, u, rows, temperature, suppressed, progress)
    finally:
        torch.set_num_threads(threads)
    windows = ids[:, 1:].contiguous()
    record = {"source": SELF, "seed": seed, "temperature": temperature, "top_k": None, "top_p": None,
              "start_token": start, "suppressed_tokens": suppressed, "dtype": dtype_name,
              "matmul": matmul, "rows_per_batch": rows, "windows": nsamples, "seqlen": seqlen, "tokens": nsamples * seqlen,
              "nsamples_asked": nsamples, "ids_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest(), "cast_bytes": copied}
    return windows, record


def _sample(model, config, ids: torch.Tensor, u: torch.Tensor, rows: int, temperature: float, suppressed: list[int],
            progress: Progress | None) -> None:
    """Fill ``ids[:, 1:]`` (column 0 holds the start token), ``rows`` sequences at a time, each batch with its own
    KV cache (released after the batch)."""
    from transformers import DynamicCache  # noqa: PLC0415 (transformers: only when sampling)

    n, steps = u.shape
    kw = _cache_kwarg(model)
    with torch.inference_mode():
        for a in range(0, n, rows):
            b = min(n, a + rows)
            cache = DynamicCache(config=config)
            for t in range(steps):
                out = model(input_ids=ids[a:b, t:t + 1], use_cache=True, logits_to_keep=1, **{kw: cache})
                logits = out.logits[:, -1].float()
                if suppressed:
                    logits[:, suppressed] = float("-inf")
                ids[a:b, t + 1] = draw(torch.softmax(logits / temperature, dim=-1), u[a:b, t])
                if progress:
                    progress(a * steps + (t + 1) * (b - a), n * steps)
            del cache


def describe(record: dict) -> str:
    """One phrase for the CLI note and the model card: where the calibration tokens came from."""
    if record.get("source") == SELF:
        return (f"{record.get('windows')} windows x {record.get('seqlen')} tokens sampled from the model itself (seed "
                f"{record.get('seed')}, temperature {record.get('temperature')}, no top-k/top-p)")
    return f"{record.get('windows')} windows x {record.get('seqlen')} tokens of {record.get('file')}"
