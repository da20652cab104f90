"""Settings that may come from an argument or from an ``EDGEQ_*`` environment variable, read in one way.

Every ``EDGEQ_*`` variable edgeq reads (the constants below name them), its default, and what it sets:

- ``EDGEQ_CACHE_DIR`` (``~/.cache/edgeq``, :func:`cache_dir`): built native kernels, the crossover and route caches.
- ``EDGEQ_NATIVE_ISA`` (auto): the W4A16 kernel's path, scalar|avx2|avx512|amx, or off (runtime/native).
- ``EDGEQ_NATIVE_PREFILL`` (auto: measured): the W4A16 kernel's avx512 tiles for M > 8, bf16|fp32 (runtime/native).
- ``EDGEQ_W4A8_ISA`` (auto): the W4A8 kernel's path, scalar|avx2|avxvnni|vnni|amx, or off (runtime/native).
- ``EDGEQ_DECODE_LOOP`` (auto): lean|transformers decode loop (runtime/loader, through :func:`choice`).
- ``EDGEQ_DECODE_OPS`` (auto): native|torch ops around the projections (runtime/lean, through :func:`choice`).
- ``EDGEQ_PREFILL_ATTN`` (auto): native|sdpa attention in the transformers forward (runtime/prefill_attn).
- ``EDGEQ_STRICT_LAYOUT`` (off): ``1`` refuses weights packed for another machine's layout (vLLM plugin, transformers' from_pretrained).
- ``EDGEQ_PREFILL_THRESHOLD`` (measured): the W4A16 prefill crossover M (vLLM plugin).
- ``EDGEQ_CALIB_DTYPE`` (auto: bf16 where the CPU has bf16 dot products, else fp32): the GPTQ sweep's compute dtype,
  bf16|fp32; a named one also casts ``--calib self``'s sampling model (convert/calibrated, through :func:`choice`).
- ``EDGEQ_BENCH_LLAMA_REPACK`` (1): ``0`` runs the llama.cpp arm without repacked weights (bench worker).

Every variable is read when it is needed, never cached at import: tests and ``bench --vs-env`` set them per call.
"""

from __future__ import annotations

import os
from pathlib import Path

from edgeq.errors import EdgeqError

CACHE_DIR = "EDGEQ_CACHE_DIR"
NATIVE_ISA = "EDGEQ_NATIVE_ISA"
NATIVE_PREFILL = "EDGEQ_NATIVE_PREFILL"
W4A8_ISA = "EDGEQ_W4A8_ISA"
DECODE_LOOP = "EDGEQ_DECODE_LOOP"
DECODE_OPS = "EDGEQ_DECODE_OPS"
PREFILL_ATTN = "EDGEQ_PREFILL_ATTN"
STRICT_LAYOUT = "EDGEQ_STRICT_LAYOUT"
PREFILL_THRESHOLD = "EDGEQ_PREFILL_THRESHOLD"
BENCH_LLAMA_REPACK = "EDGEQ_BENCH_LLAMA_REPACK"
CALIB_DTYPE = "EDGEQ_CALIB_DTYPE"


def raw(name: str, default: str = "") -> str:
    """``$name`` stripped, or ``default`` when it is unset or blank: the one place an ``EDGEQ_*`` value is read."""
    return (os.environ.get(name) or "").strip() or default


def flag(name: str) -> bool:
    """True when ``$name`` is ``1``, ``true``, ``yes`` or ``on`` (any case); unset or anything else is False."""
    return raw(name).lower() in ("1", "true", "yes", "on")


def positive_int(name: str, hint: str = "") -> int | None:
    """``$name`` as an integer >= 1, None when unset; an :class:`EdgeqError` naming the variable otherwise, e.g.
    ``EDGEQ_PREFILL_THRESHOLD=0`` -> "$EDGEQ_PREFILL_THRESHOLD='0': expected an integer >= 1"."""
    value = raw(name)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise EdgeqError(f"${name}={value!r}: expected an integer >= 1" + (f" ({hint})" if hint else ""))
    return int(value)


def cache_dir() -> Path:
    """``$EDGEQ_CACHE_DIR``, or ``~/.cache/edgeq`` when it is unset or empty (not created here)."""
    return Path(raw(CACHE_DIR) or Path.home() / ".cache" / "edgeq")


def choice(arg: str | None, name: str, env_var: str, choices: tuple[str, ...]) -> tuple[str, str]:
    """(the lower-cased choice, where it came from): ``arg`` when given (source ``name``), else ``$env_var``, else
    "auto" (source ``$env_var``). A value outside ``choices`` is an :class:`EdgeqError` naming the source, e.g.
    ``choice(None, "decode_loop", "EDGEQ_DECODE_LOOP", ("auto", "lean"))`` with the variable set to "fast" raises
    "$EDGEQ_DECODE_LOOP='fast': expected one of auto, lean"."""
    source = name
    if arg is None:
        arg, source = raw(env_var, "auto"), f"${env_var}"
    picked = str(arg).strip().lower()
    if picked not in choices:
        raise EdgeqError(f"{source}={arg!r}: expected one of {', '.join(choices)}")
    return picked, source
