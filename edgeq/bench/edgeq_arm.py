"""The edgeq arm of a pass (an edgeq checkpoint, or a bf16 Hugging Face one as the reference), run inside the worker:
warm the code, take the baseline, load with ``edgeq.runtime.load``, read the effective settings back, one optional
warm-up request and the timed one (counted paths checked against the settings), then the memory ledger."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from edgeq.bench import measure
from edgeq.bench.ledger import edgeq_ledger, kv_tensors, scratch_tensors, tensors_residency
from edgeq.bench.spec import PassSpec, cpu_clock, cpu_share, memory_record, prompt_ids, timing_record
from edgeq.errors import EdgeqError
from edgeq.keys import CONFIG


def _pick(logits) -> int:
    """The greedy id as edgeq's generation picks it (one native pass that also checks finiteness); damaged weights
    end the pass with an error instead of timing garbage."""
    from edgeq.errors import EdgeqError
    from edgeq.runtime.generation import greedy

    token = greedy(logits)
    if token < 0:
        raise EdgeqError("the logits are not finite (NaN/Inf): the checkpoint is damaged; run edgeq inspect --verify")
    return token


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
    token = _pick(logits[0, -1])
    t2 = time.perf_counter()
    prefill_paths, prefill_attn = dict(lm.path_counts), dict(lm.attn_counts)
    lm.reset_counts()
    n1 = native.call_count() if native is not None else 0
    c1 = cpu_clock()
    t3 = time.perf_counter()
    for _ in range(gen_len):
        logits = lm.forward(torch.tensor([[token]]), logits_to_keep=1)
        token = _pick(logits[0, -1])
    t4 = time.perf_counter()
    c2 = cpu_clock()
    decode_paths, decode_attn = dict(lm.path_counts), dict(lm.attn_counts)
    n2 = native.call_count() if native is not None else 0
    lm.reset_counts()
    return {
        "prefill_s": t1 - t0, "ttft_s": t2 - t0, "decode_s": t4 - t3,
        "paths": {"prefill": prefill_paths, "decode": decode_paths},
        "attn_calls": {"prefill": prefill_attn, "decode": decode_attn},
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
    s["env"] = {k: os.environ[k] for k in ("EDGEQ_NATIVE_ISA", "EDGEQ_PREFILL_ATTN", "EDGEQ_DECODE_OPS", "OMP_NUM_THREADS",
                                           "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "EDGEQ_CACHE_DIR") if k in os.environ}
    return s



def check_paths(lm, gen: dict, prompt_len: int) -> list[str]:
    """Contradictions between the effective settings and the paths that were counted: each makes the pass fail."""
    s = lm.settings
    pre, dec = gen["paths"]["prefill"], gen["paths"]["decode"]
    problems = []
    if s.prefill_attn == "native" and not gen["attn_calls"]["prefill"].get("prefill_attn_native", 0):
        problems.append(f"the effective prefill attention is native, but the prefill counted "
                        f"{gen['attn_calls']['prefill'] or 'no attention calls'}")
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
        config = json.loads((root / CONFIG).read_text())
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


def run_edgeq(spec: PassSpec, t_start: float) -> dict:
    """One pass of an edgeq (or bf16 reference) checkpoint; ``t_start`` is when the worker started (for import_s)."""
    import torch  # noqa: F401 - imported before the baseline on purpose

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
    kv_at_load = tensors_residency(kv_tensors(lm))
    scratch_at_load = tensors_residency(scratch_tensors(lm))
    effective = _effective(lm)
    vocab = int(getattr(lm.config.get_text_config(decoder=True), "vocab_size"))
    _check_room(lm, spec)
    ids = prompt_ids(spec.prompt_len, vocab, spec.seed)
    measure.reset_peak()
    ttft_cold = _generate(lm, ids, 2)["ttft_s"] if spec.warmup else None
    gen = _generate(lm, ids, spec.gen_len)
    steady = measure.status()
    problems = check_paths(lm, gen, spec.prompt_len)
    ledger = edgeq_ledger(lm, base, after_load, steady, kv_at_load, scratch_at_load)
    return {
        "kind": "edgeq",
        "timing": timing_record(spec, t_imported - t_start, load_s, gen, ttft_cold),
        "paths": gen["paths"],
        "attn_calls": gen["attn_calls"],
        "native_calls": gen["native_calls"],
        "cpu": gen["cpu"],
        "path_problems": problems,
        "effective": effective,
        "vocab": vocab,
        "code_warmed": warmed,
        "memory": memory_record(base, after_load, steady, peak_reset, cached_before,
                                sum(p.stat().st_size for p in shards)),
        "ledger": ledger,
    }


def _check_room(lm, spec: PassSpec) -> None:
    """A pass that would not fit the loaded runtime's context is refused before the first request."""
    need = spec.prompt_len + spec.gen_len + 1
    room = min(lm.settings.max_model_len, lm.cache.capacity)
    if need > room:
        raise EdgeqError(f"a pass needs {need} positions (prompt {spec.prompt_len} + gen {spec.gen_len} + 1) but the "
                         f"loaded runtime holds {room} (max_model_len={lm.settings.max_model_len}, KV cache "
                         f"{lm.cache.capacity} tokens); raise --max-model-len/--kv-cache-bytes or shorten the request")
