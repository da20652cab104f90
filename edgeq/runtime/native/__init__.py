"""edgeq's native CPU kernels, compiled from ``edgeq/csrc/`` at first use.

- :mod:`.build`: the one build + ISA state machine (cache directory, build key, ``EDGEQ_NATIVE_ISA`` /
  ``EDGEQ_W4A8_ISA``, status) both libraries share;
- :mod:`.w4a16`: the W4A16 decode kernel ``int4_mm`` (the aten tinygemm op's signature), the layouts it reads and
  its measured prefill tiles (``prefill_tiles``);
- :mod:`.ops`: the small ops in the same library (``decode_attn``, ``prefill_attn``, ``add_rms_norm``,
  ``rope_to_cache``, ``argmax_finite``) and ``decode_layers``, a whole decode step's layers in one call;
- :mod:`.w4a8`: the W4A8 kernel ``w4a8_mm`` (its own library and namespace);
- :mod:`.command`: both kernels' status, :func:`~edgeq.runtime.native.command.kernels_status` (``edgeq native``
  prints it: edgeq/cli/native.py).

This package's own names are the W4A16 library's (what the runtime passes around as "the native kernel")::

    from edgeq.runtime import native
    native.available(), native.status()["isa"]      # True, 'avx512' (a bad EDGEQ_NATIVE_ISA raises EdgeqError)
    y = native.int4_mm(x, qweight, 128, scales_and_zeros)
"""

from edgeq.runtime.native.build import build_or_load, cache_dir, isa_request, source_key
from edgeq.runtime.native.ops import (
    add_rms_norm,
    argmax_finite,
    decode_attn,
    decode_layers,
    prefill_attn,
    prefill_attn_available,
    rope_to_cache,
)
from edgeq.runtime.native.w4a16 import (
    ADJACENT,
    BLOCK_NS,
    ENV_ISA,
    HALVES,
    ISAS,
    Plan,
    available,
    build_key,
    call_count,
    int4_mm,
    int4_mm_multi,
    plan,
    prefill_tiles,
    reset_call_count,
    status,
    supports,
)

__all__ = [
    "ADJACENT", "BLOCK_NS", "ENV_ISA", "HALVES", "ISAS", "Plan", "add_rms_norm", "argmax_finite", "available", "build_key",
    "build_or_load", "cache_dir", "call_count", "decode_attn", "decode_layers", "int4_mm", "int4_mm_multi", "isa_request", "plan", "prefill_attn",
    "prefill_attn_available", "prefill_tiles", "reset_call_count", "rope_to_cache", "source_key", "status", "supports",
]
