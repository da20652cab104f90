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

Where each part lives: :mod:`edgeq.bench.spec` (the spec, prompt ids, CPU clocks, the timing and memory records),
:mod:`edgeq.bench.edgeq_arm` (steps 1-5 for edgeq), :mod:`edgeq.bench.gguf_arm` (llama.cpp),
:mod:`edgeq.bench.ledger` (step 6). This module is the entry point: it runs one pass and writes its JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from edgeq.bench.edgeq_arm import run_edgeq
from edgeq.bench.gguf_arm import run_gguf
from edgeq.bench.spec import PassSpec

T_PROCESS_START = time.perf_counter()  # the worker's start, after its own (light) imports: import_s counts from here


def run_pass(spec: PassSpec) -> dict:
    """One pass of ``spec.kind``'s arm, in this process."""
    if spec.kind == "edgeq":
        return run_edgeq(spec, T_PROCESS_START)
    if spec.kind == "gguf":
        return run_gguf(spec, T_PROCESS_START)
    raise ValueError(f"unknown pass kind {spec.kind!r}")


def main(argv: list[str] | None = None) -> int:
    """Run the pass of ``SPEC.json`` and write its result (``ok`` false with the error when it failed); exit 1 on
    failure, 2 on a usage error."""
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
