"""The memory ledger of a pass: steady-state resident memory split by category, each explained category measured on
its own (mincore, smaps, the runtime's counters), the remainders named as such. The rows sum to VmRSS exactly.

A row is ``(kind, category, bytes, how)``: kind ``anon`` (RssAnon) or ``file`` (RssFile + RssShmem); ``how`` is
``"remainder"`` for the unattributed rows, which is how ``explained`` leaves them out.
"""

from __future__ import annotations

from dataclasses import asdict

from edgeq.bench import measure


def tensors_residency(tensors) -> tuple[int, int]:
    """(allocated, touched) bytes summed over CPU tensors (mincore over each storage)."""
    alloc = touched = 0
    for t in tensors:
        a, r = measure.tensor_resident(t)
        alloc += a
        touched += r
    return alloc, touched


def kv_tensors(lm):
    """The KV cache's key and value tensors of every layer."""
    return [t for layer in lm.cache.layers for t in (layer.keys, layer.values)]


def scratch_tensors(lm):
    """Every tensor buffer of the runtime's shared prefill scratch (whatever buffers the runtime gives it)."""
    import torch

    sc = lm.runtime.scratch if lm.runtime is not None else None
    return [v for v in vars(sc).values() if isinstance(v, torch.Tensor)] if sc is not None else []


def _file_rows(base, steady, ckpt, mapping: str) -> list[tuple]:
    """The file-backed rows: libraries before load, the checkpoint's mapped pages (``mapping`` names them), the rest."""
    file_base = base.file + base.shmem
    ckpt_pages = ckpt.rss_bytes - ckpt.anonymous_bytes
    return [
        ("file", "runtime baseline (libraries)", file_base, "RssFile + RssShmem before load"),
        ("file", "checkpoint pages mapped", ckpt_pages, f"smaps Rss - Anonymous of {mapping}"),
        ("file", "unattributed (libraries mapped later)", steady.file + steady.shmem - file_base - ckpt_pages, "remainder"),
    ]


def _record(rows: list[tuple], steady, ckpt, kv: tuple, scratch: tuple) -> dict:
    """The ledger as the worker writes it: ``kv`` and ``scratch`` are (allocated, touched) bytes (touched may be
    None: not measured)."""
    total = steady.rss
    explained = sum(r[2] for r in rows if r[3] != "remainder")
    return {
        "rows": [{"kind": k, "category": c, "bytes": int(b), "how": h} for k, c, b, h in rows],
        "total": total,
        "explained": explained,
        "unattributed": total - explained,
        "kv_allocated": kv[0], "kv_touched": kv[1],
        "scratch_allocated": scratch[0], "scratch_touched": scratch[1],
        "checkpoint": asdict(ckpt),
        "rss_anon": steady.anon, "rss_file": steady.file, "rss_shmem": steady.shmem,
    }


def edgeq_ledger(lm, base, after_load, steady, kv_at_load, scratch_at_load) -> dict:
    """Steady-state resident memory of an edgeq runtime ``lm`` split by category.

    anon:  baseline (RssAnon before load: interpreter, torch, transformers) + KV cache pages touched (mincore over the
           cache tensors) + prefill scratch pages touched (mincore over the scratch buffers) + weight copies (casts,
           repacks: the runtime's ``copied_bytes``) + copy-on-write pages of the mapped checkpoint (smaps Anonymous)
           + unattributed (allocated during load: model skeleton, imports, tokenizer; while running: activations,
           allocator caches), each the measured growth in its phase minus what was attributed in that phase.
    file:  baseline (RssFile + RssShmem before load: libraries) + checkpoint pages mapped (smaps Rss minus
           Anonymous of the checkpoint's mappings) + unattributed (libraries mapped after start).
    total = steady VmRSS; the categories sum to it exactly, the unattributed rows say how much is not explained.
    Worked example: RssAnon 100 MiB before load, 160 MiB after (KV 2 MiB touched, no copies), 170 MiB at steady
    state (KV 3 MiB touched) gives "unattributed, load" 58 MiB and "unattributed, run" 9 MiB.
    """
    kv_alloc, kv_touched = tensors_residency(kv_tensors(lm))
    sc_alloc, sc_touched = tensors_residency(scratch_tensors(lm))
    ckpt = measure.mapped_residency(lm.path)
    copies = int(lm.settings.copied_bytes)
    anon_load_other = after_load.anon - base.anon - kv_at_load[1] - scratch_at_load[1] - copies - ckpt.anonymous_bytes
    anon_run_other = (steady.anon - after_load.anon - (kv_touched - kv_at_load[1]) - (sc_touched - scratch_at_load[1]))
    rows = [
        ("anon", "runtime baseline (code, before load)", base.anon, "RssAnon before load"),
        ("anon", "KV cache (touched)", kv_touched, "mincore over the cache tensors"),
        ("anon", "prefill scratch (touched)", sc_touched, "mincore over the scratch buffers"),
        ("anon", "weight copies (casts, repacks)", copies, "runtime copied_bytes"),
        ("anon", "checkpoint copy-on-write", ckpt.anonymous_bytes, "smaps Anonymous of the checkpoint mappings"),
        ("anon", "unattributed, load (skeleton, imports, tokenizer)", anon_load_other, "remainder"),
        ("anon", "unattributed, run (activations, allocator)", anon_run_other, "remainder"),
    ] + _file_rows(base, steady, ckpt, "the checkpoint mappings")
    return _record(rows, steady, ckpt, (kv_alloc, kv_touched), (sc_alloc, sc_touched))


def gguf_ledger(base, steady, ckpt, kv: int) -> dict:
    """The same ledger for the llama.cpp arm: its KV cache is computed (``kv`` bytes, f16 K and V), not measured,
    and whatever llama.cpp allocates besides (compute buffers, repacked weights) is one remainder."""
    rows = [
        ("anon", "runtime baseline (before load)", base.anon, "RssAnon before load"),
        ("anon", "KV cache (allocated, computed)", kv, "n_ctx read back x per-token f16 K+V"),
        ("anon", "checkpoint copy-on-write", ckpt.anonymous_bytes, "smaps Anonymous of the gguf mapping"),
        ("anon", "unattributed (compute buffers, repacked weights, allocator)", steady.anon - base.anon - kv - ckpt.anonymous_bytes, "remainder"),
    ] + _file_rows(base, steady, ckpt, "the gguf mapping")
    return _record(rows, steady, ckpt, (kv, None), (0, 0))
