"""What one pass runs (:class:`PassSpec`, written by the parent as JSON) and the parts of its result that both arms,
edgeq's and llama.cpp's, measure the same way: the prompt ids, the CPU clocks of a phase, the timing and memory
records. No torch here: the parent imports this module too."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field

from edgeq.bench import measure


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


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` ids uniform in [0, vocab): the same list for any arm with the same vocabulary and seed."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def cpu_clock() -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process's threads, involuntary context switches so far)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), ru.ru_utime + ru.ru_stime, ru.ru_nivcsw


def cpu_share(start: tuple, end: tuple, threads: int) -> dict:
    """How much CPU the phase got: CPU seconds / (wall seconds x threads); 1.0 = every thread ran all the time.
    On an oversubscribed machine a parallel region waits for its preempted thread (its partner spins): the share
    drops towards 1/threads and involuntary context switches climb. Example: 2 threads, 1.0 s wall, 1.2 CPU s:
    share 0.6, below the parent's starvation bound (0.7)."""
    wall, cpu = end[0] - start[0], end[1] - start[1]
    return {"wall_s": wall, "cpu_s": cpu, "share": cpu / (wall * threads) if wall > 0 and threads else 0.0,
            "involuntary_switches": end[2] - start[2]}


def rusage_peaks() -> dict:
    """Whole-life peaks: this process, and the largest child it waited for (a helper a library spawned)."""
    import resource

    return {"maxrss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "maxrss_children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def timing_record(spec: PassSpec, import_s: float, load_s: float, gen: dict, ttft_cold: float | None) -> dict:
    """The pass's ``timing``: seconds of each phase of the timed request ``gen``, and the rates (tokens / seconds).
    ``ttft_cold`` is the warm-up request's time to first token (None without warm-up: the timed request's)."""
    return {
        "import_s": import_s, "load_s": load_s, "prefill_s": gen["prefill_s"],
        "ttft_s": gen["ttft_s"], "ttft_cold_s": ttft_cold if ttft_cold is not None else gen["ttft_s"],
        "decode_s": gen["decode_s"], "pp_tok_s": spec.prompt_len / gen["prefill_s"],
        "tg_tok_s": spec.gen_len / gen["decode_s"],
    }


def memory_record(base: measure.ProcMemory, after_load: measure.ProcMemory, steady: measure.ProcMemory,
                  peak_reset: bool, cached_before: int, file_bytes: int) -> dict:
    """The pass's ``memory``: the three readings (before load, after load, steady state), the phase peaks (VmHWM,
    reset before load and before the request), the checkpoint's page-cache state before load, the rusage peaks."""
    return {
        "baseline": asdict(base), "after_load": asdict(after_load), "steady": asdict(steady),
        "peak_load": after_load.hwm, "peak_run": steady.hwm, "peak_reset": peak_reset,
        "checkpoint_cached_before_load": cached_before, "checkpoint_file_bytes": file_bytes,
        **rusage_peaks(),
    }
