"""The llama.cpp arm (``edgeq bench --vs-gguf``): the same request as the edgeq arm, through llama-cpp-python's C API
(mmap on, one sequence, the same threads and prompt ids), and the parent's helpers that set it up.

``EDGEQ_BENCH_LLAMA_REPACK=0`` (in the arm's environment) runs llama.cpp without its extra buffer types
(llama-bench ``--no-repack``): the weights stay in the mapped file instead of being repacked into anonymous memory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from edgeq.bench import measure
from edgeq.bench.ledger import gguf_ledger
from edgeq.bench.spec import PassSpec, cpu_clock, cpu_share, memory_record, prompt_ids, timing_record
from edgeq import env
from edgeq.keys import CONFIG


# ---------------------------------------------------------------------------------------------------- parent side


def default_context(checkpoint: str, kv_cache_bytes: str) -> int:
    """The context the runtime would choose for ``checkpoint`` (min of the model's maximum and the KV budget):
    given to llama.cpp as n_ctx so both arms hold the same KV cache."""
    from edgeq.memory import kv_geometry
    from edgeq.runtime.sizes import parse_bytes  # the runtime's own reading of the budget

    config = json.loads((Path(checkpoint) / CONFIG).read_text())
    g = kv_geometry(config)
    tokens = parse_bytes(kv_cache_bytes, "--kv-cache-bytes") // g.bytes_per_token
    return min(tokens, g.max_positions) if g.max_positions else tokens


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python (the optional extra) is installed; found, not imported."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


# ---------------------------------------------------------------------------------------------------- worker side


class LlamaCpp:
    """One llama.cpp model + context through llama-cpp-python's ctypes C API, driven like llama-bench: the prompt as
    one batch (``n_batch`` = prompt length), then one token per ``llama_decode``; greedy argmax in numpy. Built for
    the API of llama-cpp-python 0.3.x; older names are tried where they changed."""

    def __init__(self, path: Path, *, n_ctx: int, threads: int, batch: int):
        import llama_cpp as L  # optional extra: an ImportError fails this pass with its message

        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        # EDGEQ_BENCH_LLAMA_REPACK=0: no extra buffer types (llama-bench --no-repack): weights stay in the mapped
        # file instead of being repacked (CPU_REPACK / AMX) into anonymous memory.
        self.extra_bufts = env.raw(env.BENCH_LLAMA_REPACK, "1") != "0"
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = self.extra_bufts
        if hasattr(mp, "use_mmap"):
            mp.use_mmap = True
        elif hasattr(mp, "load_mode"):
            mp.load_mode = L.LLAMA_LOAD_MODE_MMAP
        load_model = getattr(L, "llama_model_load_from_file", None) or L.llama_load_model_from_file
        self.model = load_model(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"{path}: llama.cpp could not load the model (see the worker's stderr)")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, max(batch, 1), min(max(batch, 1), 512)
        cp.n_threads = cp.n_threads_batch = threads
        cp.n_seq_max = 1
        new_ctx = getattr(L, "llama_init_from_model", None) or L.llama_new_context_with_model
        self.ctx = new_ctx(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"{path}: llama.cpp could not create a context of {n_ctx} tokens")
        vocab = L.llama_model_get_vocab(self.model) if hasattr(L, "llama_model_get_vocab") else self.model
        self.n_vocab = int(L.llama_vocab_n_tokens(vocab) if hasattr(L, "llama_vocab_n_tokens") else L.llama_n_vocab(vocab))
        self.batch = L.llama_batch_init(max(batch, 1), 0, 1)
        self.threads = threads
        self.capacity = max(batch, 1)

    def effective(self) -> dict:
        L = self.L
        buf = ctypes_buffer(256)
        L.llama_model_desc(self.model, buf, 256)
        n_ctx = int(L.llama_n_ctx(self.ctx))
        layers, n_head, n_head_kv = (int(L.llama_model_n_layer(self.model)), int(L.llama_model_n_head(self.model)),
                                     int(L.llama_model_n_head_kv(self.model)))
        head_dim = int(L.llama_model_n_embd(self.model)) // n_head
        meta = ctypes_buffer(64)
        key_len = L.llama_model_meta_val_str(self.model, b"general.architecture", meta, 64)
        arch = meta.value.decode() if key_len > 0 else "?"
        hd = ctypes_buffer(32)
        if L.llama_model_meta_val_str(self.model, f"{arch}.attention.key_length".encode(), hd, 32) > 0:
            head_dim = int(hd.value.decode())
        return {
            "model_desc": buf.value.decode(errors="replace"), "architecture": arch,
            "model_bytes": int(L.llama_model_size(self.model)), "n_params": int(L.llama_model_n_params(self.model)),
            "n_ctx": n_ctx, "n_batch": int(L.llama_n_batch(self.ctx)), "n_ubatch": int(L.llama_n_ubatch(self.ctx)),
            "n_threads": int(L.llama_n_threads(self.ctx)), "n_threads_batch": int(L.llama_n_threads_batch(self.ctx)),
            # f16 K and V for every layer and position (llama.cpp's default cache type)
            "kv_cache_bytes": 2 * layers * n_ctx * n_head_kv * head_dim * 2,
            "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
            "llama_cpp_python": getattr(L, "__version__", "?"),
            "extra_bufts": self.extra_bufts,
        }

    def _clear(self) -> None:
        L = self.L
        if hasattr(L, "llama_get_memory"):
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        elif hasattr(L, "llama_kv_self_clear"):
            L.llama_kv_self_clear(self.ctx)
        else:
            L.llama_kv_cache_clear(self.ctx)

    def _decode(self, tokens: list[int], pos0: int) -> int:
        import numpy as np

        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = t, pos0 + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = i == len(tokens) - 1
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} at position {pos0} ({len(tokens)} tokens)")
        logits = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
        return int(logits.argmax())

    def request(self, ids: list[int], gen_len: int) -> dict:
        if len(ids) > self.capacity:
            raise RuntimeError(f"prompt of {len(ids)} tokens exceeds the batch of {self.capacity}")
        self._clear()
        c0 = cpu_clock()
        t0 = time.perf_counter()
        token = self._decode(ids, 0)
        t1 = time.perf_counter()
        c1 = cpu_clock()
        for i in range(gen_len):
            token = self._decode([token], len(ids) + i)
        t2 = time.perf_counter()
        c2 = cpu_clock()
        return {"prefill_s": t1 - t0, "ttft_s": t1 - t0, "decode_s": t2 - t1,
                "cpu": {"prefill": cpu_share(c0, c1, self.threads), "decode": cpu_share(c1, c2, self.threads)}}


def ctypes_buffer(n: int):
    import ctypes

    return ctypes.create_string_buffer(n)


def run_gguf(spec: PassSpec, t_start: float) -> dict:
    """The llama.cpp arm through llama-cpp-python's C API (mirrors llama-bench: one batch prefill, then one token at a
    time), with the same prompt ids, threads and lengths; ``t_start`` is when the worker started (for import_s)."""
    import llama_cpp  # noqa: F401 - the code, before the baseline (an ImportError fails the pass with its message)

    path = Path(spec.checkpoint)
    llama_cpp.llama_backend_init()
    t_imported = time.perf_counter()
    base = measure.status()
    cached_before = measure.file_cached_bytes(path)
    peak_reset = measure.reset_peak()
    t0 = time.perf_counter()
    n_ctx = spec.max_model_len or (spec.prompt_len + spec.gen_len + 8)
    llm = LlamaCpp(path, n_ctx=n_ctx, threads=spec.threads, batch=spec.prompt_len)
    load_s = time.perf_counter() - t0
    after_load = measure.status()
    effective = llm.effective()
    ids = prompt_ids(spec.prompt_len, llm.n_vocab, spec.seed)
    measure.reset_peak()
    ttft_cold = llm.request(ids, 2)["ttft_s"] if spec.warmup else None
    gen = llm.request(ids, spec.gen_len)
    steady = measure.status()
    ckpt = measure.mapped_residency(path)
    ledger = gguf_ledger(base, steady, ckpt, effective["kv_cache_bytes"])
    return {
        "kind": "gguf",
        "timing": timing_record(spec, t_imported - t_start, load_s, gen, ttft_cold),
        "paths": {"prefill": {"llama.cpp": 1}, "decode": {"llama.cpp": spec.gen_len}},
        "native_calls": None,
        "cpu": gen["cpu"],
        "path_problems": [],
        "effective": effective,
        "vocab": llm.n_vocab,
        "memory": memory_record(base, after_load, steady, peak_reset, cached_before, path.stat().st_size),
        "ledger": ledger,
    }
