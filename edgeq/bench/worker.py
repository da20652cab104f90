"""One benchmark pass, in a fresh process: ``python -m edgeq.bench.worker SPEC.json``.

The parent (:mod:`edgeq.bench.run`) writes a :class:`PassSpec` as JSON, starts this module in a new interpreter, and
reads the result JSON it writes to ``spec.result``. Everything is measured here, in the process that runs the model:

1. import the runtime (torch, transformers), then read the **baseline** memory (the interpreter and libraries);
2. record how much of the checkpoint is already in the page cache (warm or cold load), reset the RSS peak, load;
   the **load peak** is VmHWM at the end of load;
3. read the **effective settings** back from the loaded runtime (``lm.settings``, ``torch.get_num_threads()``, the
   native kernel's status), never from the spec;
4. optional warm-up request (prefill + 2 decode steps; its time to first token is reported as ``ttft_cold_s``);
5. the timed request: ``forward(prompt)`` (prefill, ``logits_to_keep=1``), argmax = the first token; then ``gen_len``
   single-token forwards, each followed by argmax (greedy; EOS ignored: the length is fixed). Path counters are
   reset before the request and read after each phase;
6. the **memory ledger** at steady state (after the request, the model still loaded).

The prompt is ``prompt_len`` token ids drawn with ``random.Random(seed)`` from ``[0, vocab)``: the same ids for every
arm of the same vocabulary, no tokenizer needed (synthetic checkpoints have none).

``kind == "gguf"``: the same request through llama.cpp (llama-cpp-python's C API, mmap on, one sequence, the same
threads and prompt ids), for the ``--vs-gguf`` arm.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgeq.bench import measure

T_PROCESS_START = time.perf_counter()


@dataclass(frozen=True)
class PassSpec:
    """What one worker runs. ``checkpoint`` is a directory (edgeq or bf16 HF) or a .gguf file (``kind="gguf"``)."""

    checkpoint: str
    result: str
    kind: str = "edgeq"  # "edgeq" (edgeq.runtime.load, also for bf16 references) | "gguf" (llama.cpp)
    label: str = "A"
    pass_index: int = 0
    prompt_len: int = 512
    gen_len: int = 128
    threads: int = 2
    max_model_len: int | None = None
    kv_cache_bytes: str = "256MiB"
    prefill_threshold: int | None = None
    seed: int = 0
    warmup: bool = True
    env: dict = field(default_factory=dict)  # extra environment of this arm (set by the parent on the process)

    @classmethod
    def from_json(cls, text: str) -> "PassSpec":
        return cls(**json.loads(text))

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def cpu_clock() -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process's threads, involuntary context switches so far)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), ru.ru_utime + ru.ru_stime, ru.ru_nivcsw


def cpu_share(start: tuple, end: tuple, threads: int) -> dict:
    """How much CPU the phase got: CPU seconds / (wall seconds x threads); 1.0 = every thread ran all the time.
    On an oversubscribed machine a parallel region waits for its preempted thread (its partner spins): the share
    drops towards 1/threads and involuntary context switches climb."""
    wall, cpu = end[0] - start[0], end[1] - start[1]
    return {"wall_s": wall, "cpu_s": cpu, "share": cpu / (wall * threads) if wall > 0 and threads else 0.0,
            "involuntary_switches": end[2] - start[2]}


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` ids uniform in [0, vocab): the same list for any arm with the same vocabulary and seed."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


# ------------------------------------------------------------------------------------------------------ edgeq arm


def _generate(lm, ids: list[int], gen_len: int) -> dict:
    """One request through the runtime's forward: prefill, then gen_len single-token steps; timings and paths."""
    import torch

    lm.cache.reset()
    lm.reset_counts()
    native = lm.runtime.native if lm.runtime is not None else None
    n0 = native.call_count() if native is not None else 0
    x = torch.tensor([ids])
    threads = torch.get_num_threads()
    c0 = cpu_clock()
    t0 = time.perf_counter()
    logits = lm.forward(x, logits_to_keep=1)
    t1 = time.perf_counter()
    token = int(torch.argmax(logits[0, -1].float()))
    t2 = time.perf_counter()
    prefill_paths = dict(lm.path_counts)
    lm.reset_counts()
    n1 = native.call_count() if native is not None else 0
    c1 = cpu_clock()
    t3 = time.perf_counter()
    for _ in range(gen_len):
        logits = lm.forward(torch.tensor([[token]]), logits_to_keep=1)
        token = int(torch.argmax(logits[0, -1].float()))
    t4 = time.perf_counter()
    c2 = cpu_clock()
    decode_paths = dict(lm.path_counts)
    n2 = native.call_count() if native is not None else 0
    lm.reset_counts()
    return {
        "prefill_s": t1 - t0, "ttft_s": t2 - t0, "decode_s": t4 - t3,
        "paths": {"prefill": prefill_paths, "decode": decode_paths},
        "native_calls": {"prefill": n1 - n0, "decode": n2 - n1} if native is not None else None,
        "cpu": {"prefill": cpu_share(c0, c1, threads), "decode": cpu_share(c1, c2, threads)},
    }


def _effective(lm) -> dict:
    """Settings read back from the loaded runtime and the process, not from the spec."""
    import torch

    s = asdict(lm.settings)
    s["kernel_paths"] = [list(p) for p in s["kernel_paths"]]
    s["threads_now"] = torch.get_num_threads()
    s["interop_threads"] = torch.get_num_interop_threads()
    s["cache_capacity"] = lm.cache.capacity
    s["torch"] = torch.__version__
    s["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    native = lm.runtime.native if lm.runtime is not None else None
    if native is not None:
        st = native.status()
        s["native"] = {"isa": st["isa"], "reason": st["reason"], "forced": st["forced"], "built_now": st["built_now"],
                       "build_seconds": st["build_seconds"]}
    else:
        s["native"] = None
    s["env"] = {k: os.environ[k] for k in ("EDGEQ_NATIVE_ISA", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "EDGEQ_CACHE_DIR") if k in os.environ}
    return s


def _rusage_peaks() -> dict:
    """Whole-life peaks: this process, and the largest child it waited for (a helper a library spawned)."""
    import resource

    return {"maxrss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "maxrss_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def _tensors_residency(tensors) -> tuple[int, int]:
    alloc = touched = 0
    for t in tensors:
        a, r = measure.tensor_resident(t)
        alloc += a
        touched += r
    return alloc, touched


def _kv_tensors(lm):
    return [t for layer in lm.cache.layers for t in (layer.keys, layer.values)]


def _scratch_tensors(lm):
    """Every tensor buffer of the runtime's shared prefill scratch (whatever buffers the runtime gives it)."""
    import torch

    sc = lm.runtime.scratch if lm.runtime is not None else None
    return [v for v in vars(sc).values() if isinstance(v, torch.Tensor)] if sc is not None else []


def _check_paths(lm, gen: dict, prompt_len: int) -> list[str]:
    """Contradictions between the effective settings and the paths that were counted: each makes the pass fail."""
    s = lm.settings
    pre, dec = gen["paths"]["prefill"], gen["paths"]["decode"]
    problems = []
    if not s.quantized:
        for phase, counts in (("prefill", pre), ("decode", dec)):
            if counts.get("bf16", 0) == 0 or set(counts) - {"bf16"}:
                problems.append(f"bf16 reference: {phase} counted {counts or 'no calls'}, expected only bf16 calls")
        return problems
    if dec.get(s.decode_path, 0) == 0:
        problems.append(f"decode counted {dec or 'no calls'}, but the effective decode path is {s.decode_path}")
    if s.prefill_crossover is None:  # one path for every M (W4A8)
        expect_prefill = s.prefill_path
    else:
        expect_prefill = "dequant_prefill" if prompt_len >= s.prefill_crossover else s.decode_path
    if pre.get(expect_prefill, 0) == 0:
        problems.append(f"prefill of {prompt_len} tokens counted {pre or 'no calls'}, expected {expect_prefill} "
                        f"(crossover M = {s.prefill_crossover})")
    if pre.get("bf16", 0) or dec.get("bf16", 0):
        problems.append("a quantised checkpoint ran bf16 Linear calls")
    native = gen["native_calls"]
    if native is not None and s.decode_path == "native_decode" and native["decode"] != dec.get("native_decode", 0):
        problems.append(f"native kernel counted {native['decode']} calls in decode, the runtime {dec.get('native_decode', 0)}")
    return problems


def warm_code(root: Path) -> list[str]:
    """Import the code load() will need (the model class, the tokenizer library, the native kernel), so that the
    baseline holds all code and the load delta holds only the model. Importing a transformers model class alone adds
    ~100 MB of anonymous memory (measured: tiny-prose, transformers 5.24); counted in the model, it would hide the
    model's own costs. Returns what was warmed (anything that fails is left to load())."""
    warmed = []
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return warmed
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.get("model_type")])
        warmed.append("model class")
        from transformers import AutoTokenizer  # noqa: F401

        warmed.append("tokenizer library")
    except Exception:  # noqa: BLE001 - load() will import it (and say why if it cannot)
        pass
    if isinstance(config.get("quantization_config"), dict):
        try:
            from edgeq.layouts import tinygemm
            from edgeq.runtime import native

            tinygemm.probe()
            warmed.append("layout probe")
            if native.available():
                warmed.append("native kernel")
        except Exception:  # noqa: BLE001
            pass
    return warmed


def run_edgeq(spec: PassSpec) -> dict:
    import torch  # noqa: F401 - imported before the baseline on purpose

    from edgeq.errors import EdgeqError
    from edgeq.runtime import load

    root = Path(spec.checkpoint)
    shards = sorted(root.glob("*.safetensors"))
    warmed = warm_code(root)
    t_imported = time.perf_counter()
    base = measure.status()
    cached_before = sum(measure.file_cached_bytes(p) for p in shards)
    peak_reset = measure.reset_peak()
    t0 = time.perf_counter()
    lm = load(root, max_model_len=spec.max_model_len, kv_cache_bytes=spec.kv_cache_bytes, threads=spec.threads,
              prefill_threshold=spec.prefill_threshold)
    load_s = time.perf_counter() - t0
    after_load = measure.status()
    kv_at_load = _tensors_residency(_kv_tensors(lm))
    scratch_at_load = _tensors_residency(_scratch_tensors(lm))
    effective = _effective(lm)
    vocab = int(getattr(lm.config.get_text_config(decoder=True), "vocab_size"))
    need = spec.prompt_len + spec.gen_len + 1
    room = min(lm.settings.max_model_len, lm.cache.capacity)
    if need > room:
        raise EdgeqError(f"a pass needs {need} positions (prompt {spec.prompt_len} + gen {spec.gen_len} + 1) but the "
                         f"loaded runtime holds {room} (max_model_len={lm.settings.max_model_len}, KV cache "
                         f"{lm.cache.capacity} tokens); raise --max-model-len/--kv-cache-bytes or shorten the request")
    ids = prompt_ids(spec.prompt_len, vocab, spec.seed)
    measure.reset_peak()
    ttft_cold = None
    if spec.warmup:
        ttft_cold = _generate(lm, ids, 2)["ttft_s"]
    gen = _generate(lm, ids, spec.gen_len)
    if ttft_cold is None:
        ttft_cold = gen["ttft_s"]
    steady = measure.status()
    problems = _check_paths(lm, gen, spec.prompt_len)
    ledger = edgeq_ledger(lm, base, after_load, steady, kv_at_load, scratch_at_load)
    return {
        "kind": "edgeq",
        "timing": {
            "import_s": t_imported - T_PROCESS_START, "load_s": load_s, "prefill_s": gen["prefill_s"],
            "ttft_s": gen["ttft_s"], "ttft_cold_s": ttft_cold, "decode_s": gen["decode_s"],
            "pp_tok_s": spec.prompt_len / gen["prefill_s"], "tg_tok_s": spec.gen_len / gen["decode_s"],
        },
        "paths": gen["paths"],
        "native_calls": gen["native_calls"],
        "cpu": gen["cpu"],
        "path_problems": problems,
        "effective": effective,
        "vocab": vocab,
        "code_warmed": warmed,
        "memory": {
            "baseline": asdict(base), "after_load": asdict(after_load), "steady": asdict(steady),
            "peak_load": after_load.hwm, "peak_run": steady.hwm, "peak_reset": peak_reset,
            "checkpoint_cached_before_load": cached_before,
            "checkpoint_file_bytes": sum(p.stat().st_size for p in shards),
            **_rusage_peaks(),
        },
        "ledger": ledger,
    }


def edgeq_ledger(lm, base, after_load, steady, kv_at_load, scratch_at_load) -> dict:
    """Steady-state resident memory split by category; each explained category is measured on its own.

    anon:  baseline (RssAnon before load: interpreter, torch, transformers) + KV cache pages touched (mincore over the
           cache tensors) + prefill scratch pages touched (mincore over the scratch buffers) + weight copies (casts,
           repacks: the runtime's ``copied_bytes``) + copy-on-write pages of the mapped checkpoint (smaps Anonymous)
           + unattributed (allocated during load: model skeleton, imports, tokenizer; while running: activations,
           allocator caches), each the measured growth in its phase minus what was attributed in that phase.
    file:  baseline (RssFile + RssShmem before load: libraries) + checkpoint pages mapped (smaps Rss minus
           Anonymous of the checkpoint's mappings) + unattributed (libraries mapped after start).
    total = steady VmRSS; the categories sum to it exactly, the unattributed rows say how much is not explained.
    """
    kv_alloc, kv_touched = _tensors_residency(_kv_tensors(lm))
    sc_alloc, sc_touched = _tensors_residency(_scratch_tensors(lm))
    ckpt = measure.mapped_residency(lm.path)
    copies = int(lm.settings.copied_bytes)
    ckpt_pages = ckpt.rss_bytes - ckpt.anonymous_bytes
    anon_load_other = after_load.anon - base.anon - kv_at_load[1] - scratch_at_load[1] - copies - ckpt.anonymous_bytes
    anon_run_other = (steady.anon - after_load.anon - (kv_touched - kv_at_load[1]) - (sc_touched - scratch_at_load[1]))
    file_base = base.file + base.shmem
    rows = [
        ("anon", "runtime baseline (code, before load)", base.anon, "RssAnon before load"),
        ("anon", "KV cache (touched)", kv_touched, "mincore over the cache tensors"),
        ("anon", "prefill scratch (touched)", sc_touched, "mincore over the scratch buffers"),
        ("anon", "weight copies (casts, repacks)", copies, "runtime copied_bytes"),
        ("anon", "checkpoint copy-on-write", ckpt.anonymous_bytes, "smaps Anonymous of the checkpoint mappings"),
        ("anon", "unattributed, load (skeleton, imports, tokenizer)", anon_load_other, "remainder"),
        ("anon", "unattributed, run (activations, allocator)", anon_run_other, "remainder"),
        ("file", "runtime baseline (libraries)", file_base, "RssFile + RssShmem before load"),
        ("file", "checkpoint pages mapped", ckpt_pages, "smaps Rss - Anonymous of the checkpoint mappings"),
        ("file", "unattributed (libraries mapped later)", steady.file + steady.shmem - file_base - ckpt_pages, "remainder"),
    ]
    total = steady.rss
    explained = sum(r[2] for r in rows if r[3] != "remainder")
    return {
        "rows": [{"kind": k, "category": c, "bytes": int(b), "how": h} for k, c, b, h in rows],
        "total": total,
        "explained": explained,
        "unattributed": total - explained,
        "kv_allocated": kv_alloc, "kv_touched": kv_touched,
        "scratch_allocated": sc_alloc, "scratch_touched": sc_touched,
        "checkpoint": asdict(ckpt),
        "rss_anon": steady.anon, "rss_file": steady.file, "rss_shmem": steady.shmem,
    }


# ------------------------------------------------------------------------------------------------------- gguf arm


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
        self.extra_bufts = os.environ.get("EDGEQ_BENCH_LLAMA_REPACK", "1") != "0"
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


def run_gguf(spec: PassSpec) -> dict:
    """The llama.cpp arm through llama-cpp-python's C API (mirrors llama-bench: one batch prefill, then one token at a
    time), with the same prompt ids, threads and lengths."""
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
    ckpt_pages = ckpt.rss_bytes - ckpt.anonymous_bytes
    kv = effective["kv_cache_bytes"]
    file_base = base.file + base.shmem
    rows = [
        ("anon", "runtime baseline (before load)", base.anon, "RssAnon before load"),
        ("anon", "KV cache (allocated, computed)", kv, "n_ctx read back x per-token f16 K+V"),
        ("anon", "checkpoint copy-on-write", ckpt.anonymous_bytes, "smaps Anonymous of the gguf mapping"),
        ("anon", "unattributed (compute buffers, repacked weights, allocator)", steady.anon - base.anon - kv - ckpt.anonymous_bytes, "remainder"),
        ("file", "runtime baseline (libraries)", file_base, "RssFile + RssShmem before load"),
        ("file", "checkpoint pages mapped", ckpt_pages, "smaps Rss - Anonymous of the gguf mapping"),
        ("file", "unattributed (libraries mapped later)", steady.file + steady.shmem - file_base - ckpt_pages, "remainder"),
    ]
    explained = sum(r[2] for r in rows if r[3] != "remainder")
    return {
        "kind": "gguf",
        "timing": {
            "import_s": t_imported - T_PROCESS_START, "load_s": load_s, "prefill_s": gen["prefill_s"],
            "ttft_s": gen["ttft_s"], "ttft_cold_s": ttft_cold if ttft_cold is not None else gen["ttft_s"],
            "decode_s": gen["decode_s"], "pp_tok_s": spec.prompt_len / gen["prefill_s"],
            "tg_tok_s": spec.gen_len / gen["decode_s"],
        },
        "paths": {"prefill": {"llama.cpp": 1}, "decode": {"llama.cpp": spec.gen_len}},
        "native_calls": None,
        "cpu": gen["cpu"],
        "path_problems": [],
        "effective": effective,
        "vocab": llm.n_vocab,
        "memory": {
            "baseline": asdict(base), "after_load": asdict(after_load), "steady": asdict(steady),
            "peak_load": after_load.hwm, "peak_run": steady.hwm, "peak_reset": peak_reset,
            "checkpoint_cached_before_load": cached_before, "checkpoint_file_bytes": path.stat().st_size,
            **_rusage_peaks(),
        },
        "ledger": {
            "rows": [{"kind": k, "category": c, "bytes": int(b), "how": h} for k, c, b, h in rows],
            "total": steady.rss, "explained": explained, "unattributed": steady.rss - explained,
            "kv_allocated": kv, "kv_touched": None, "scratch_allocated": 0, "scratch_touched": 0,
            "checkpoint": asdict(ckpt), "rss_anon": steady.anon, "rss_file": steady.file, "rss_shmem": steady.shmem,
        },
    }


# ----------------------------------------------------------------------------------------------------------- main


def run_pass(spec: PassSpec) -> dict:
    if spec.kind == "edgeq":
        return run_edgeq(spec)
    if spec.kind == "gguf":
        return run_gguf(spec)
    raise ValueError(f"unknown pass kind {spec.kind!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m edgeq.bench.worker SPEC.json", file=sys.stderr)
        return 2
    spec = PassSpec.from_json(Path(argv[0]).read_text())
    try:
        result = {"ok": True, **run_pass(spec)}
        code = 0
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent, which suppresses the comparison
        result = {"ok": False, "error": f"{type(e).__name__}: {e}".strip(), "traceback": traceback.format_exc()[-6000:]}
        code = 1
    result.update(label=spec.label, pass_index=spec.pass_index, pid=os.getpid())
    tmp = Path(spec.result + ".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(spec.result)
    return code


if __name__ == "__main__":
    sys.exit(main())
