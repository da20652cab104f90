"""edgeq: 4-bit checkpoints for edge CPUs, one measured packed layout, and proof they are the same model."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# libgomp's default waiting policy spins between parallel regions. On a 2-core machine that any other process also
# uses, a spinning thread holds the core the straggler needs, and every 2-thread matmul waits for a time slice:
# measured 10-20x slower decode. PASSIVE (sleep on a futex) costs nothing measurable on a quiet machine (bench_kernel,
# docs/kernel.md). libgomp reads the variable once, when torch loads it, so this only takes effect if edgeq is
# imported before torch; an explicit value from the user always wins. The user's original value (None = unset) is
# kept so that a llama.cpp benchmark arm (libggml also uses libgomp) runs with the environment the user gave it, as
# llama.cpp would run outside edgeq: its worker is started with EDGEQ_KEEP_OMP_ENV=1.
OMP_WAIT_POLICY_USER = _os.environ.get("OMP_WAIT_POLICY")
if "torch" not in _sys.modules and _os.environ.get("EDGEQ_KEEP_OMP_ENV") != "1":
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
