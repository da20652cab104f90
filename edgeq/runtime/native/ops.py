"""The native ops around the projections: for the lean decoder's ``decode_ops="native"`` attention over the KV
cache, residual add + RMSNorm, RoPE + cache write; for the transformers forward the causal prefill attention
(edgeq/runtime/prefill_attn.py). They live in the W4A16 kernel's library (:mod:`.w4a16`: its build,
its ISA choice, its ``EDGEQ_NATIVE_ISA``); the C++ and the roundings are in ``edgeq/csrc/attn_*`` and
``edgeq/csrc/decode_ops.cpp``.
"""

from __future__ import annotations

import torch

from edgeq.errors import EdgeqError
import edgeq.runtime.native.w4a16 as w4a16


def decode_attn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, end: int, scale: float,
                out: torch.Tensor, *, isa: str | None = None) -> None:
    """Single-query attention over the KV cache into ``out`` (bf16 [H, D]); the same library as ``int4_mm``.

    ``q`` bf16 [H, D], ``keys``/``values`` the cache's bf16 [1, KVH, CAP, D] buffers read in place over positions
    ``[start, end)``; query head h attends with kv head ``h // (H // KVH)`` (GQA). fp32 scores, softmax and sums,
    one rounding to bf16 (edgeq/csrc/attn_decode.h has the formula and a worked example). The ISA is the process's
    choice for ``int4_mm`` (``EDGEQ_NATIVE_ISA``) unless ``isa`` names one for this call (tests). Raises
    :class:`EdgeqError` when the library is unavailable or the arguments are wrong.
    """
    st = w4a16.state()
    isa_code = w4a16.isa_code(st, isa) if st.available else 0  # unavailable: _small_op raises with the reason
    _small_op("decode_attn", q, keys, values, start, end, scale, out, isa_code)
    _written(out)


def prefill_attn_available(isa: str | None = None) -> bool:
    """Whether :func:`prefill_attn` runs here: the library is available and its ISA (the process's, or ``isa``) is
    avx2 or better (the kernel has no scalar path; callers use torch's SDPA there)."""
    st = w4a16.state()
    return st.available and w4a16.isa_code(st, isa) >= 1


def prefill_attn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, *,
                 isa: str | None = None) -> torch.Tensor:
    """Causal attention of S queries over T >= S keys: bf16 [S, H, D] (a new tensor), query i at position T - S + i.

    ``q`` bf16 [H, S, D] contiguous; ``keys``/``values`` bf16 [1, KVH, T, D], each row of D contiguous, heads and rows
    strided alike (a view of the KV cache, or a fresh projection transposed); query head h attends with kv head
    ``h // (H // KVH)``; D a multiple of 16. fp32 scores (exact bf16 products), online softmax and sums, one rounding
    to bf16 (edgeq/csrc/attn_prefill.h has the formula and a worked example). avx2 and avx512 paths, not scalar
    (:func:`prefill_attn_available`). Raises :class:`EdgeqError`.
    """
    st = w4a16.state()
    isa_code = w4a16.isa_code(st, isa) if st.available else 0
    return _small_op("prefill_attn", q, keys, values, scale, isa_code)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    """``x += delta`` (when given, bf16, in place), then ``out = weight * bf16(x * rsqrt(mean(x^2) + eps))`` per row:
    transformers' RMSNorm in one call (edgeq/csrc/decode_ops.cpp has the roundings). Raises :class:`EdgeqError`."""
    _small_op("add_rms_norm", x, delta, weight, eps, out)
    _written(out)


def rope_to_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, nsin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, pos: int, rot_q: torch.Tensor) -> None:
    """RoPE of one token's q and k (transformers' roundings, bit for bit) into ``rot_q`` and the cache at ``pos``,
    and v into the cache: edgeq/csrc/decode_ops.cpp. Raises :class:`EdgeqError`."""
    _small_op("rope_to_cache", q, k, v, cos, nsin, keys, values, pos, rot_q)


def argmax_finite(logits: torch.Tensor) -> int:
    """The index of the first largest of ``logits`` (contiguous bf16 or fp32, any shape, read flat), or -1 when any
    value is NaN or infinite: ``torch.argmax`` (same tie rule) and ``isfinite().all()`` in one native call
    (edgeq/csrc/decode_ops.cpp). Raises :class:`EdgeqError` when the library is unavailable or the tensor is not
    one it reads."""
    return _small_op("argmax_finite", logits)


_SMALL_OPS: dict = {}


def _written(t: torch.Tensor) -> None:
    """Bump ``t``'s version counter after an op wrote it: the ops write through raw pointers, which the counter does
    not see, and an act-order projection reading ``t`` keys its cached input gather on it
    (:meth:`edgeq.runtime.qlinear.Runtime.gather`; a stale key reused the previous step's gather, tests/test_stack.py).
    Only the outputs a projection reads (a norm's output, the attention's) are bumped: 0.7 us each."""
    torch.autograd.graph.increment_version(t)


def _small_op(name: str, *args):
    """Call ``torch.ops.edgeq.<name>`` (looked up once) when the library is available here (checked every call, as
    ``int4_mm`` does), with its argument errors as :class:`EdgeqError`."""
    st = w4a16.state()
    if not st.available:
        raise EdgeqError(f"native {name} is not available: {st.reason}")
    op = _SMALL_OPS.get(name) or _SMALL_OPS.setdefault(name, getattr(torch.ops.edgeq, name).default)
    try:
        return op(*args)
    except RuntimeError as e:
        raise EdgeqError(f"native {name}: {str(e).splitlines()[0]}") from e


def decode_layers(x: torch.Tensor, n: torch.Tensor, weights: list, group_sizes: list, biases: list, norms: list,
                  eps: list, caches: list, scales: list, windows: list, cos: torch.Tensor, nsin: torch.Tensor, pos: int,
                  scratch: list, *, w4a8: bool = False, qk_norms: list = (), qk_scratch: list = (),
                  skip: int = 0) -> None:
    """Every decoder layer of one decode step in one call, then the final norm into ``n``: the lean loop's native
    step op for op (edgeq/csrc/decode_step.cpp lists the arguments and the order; :mod:`edgeq.runtime.stack` builds
    them), with the W4A16 kernel's arguments of this process (its layout plan and ISA) and, for W4A8 layers
    (``w4a8``), the W4A8 op's ISA; ``qk_norms``/``qk_scratch``: Qwen3's head norms (empty: none). ``skip``: ops left
    out, for benchmarks' ablations only (bit 0 attention, 1 norms + RoPE, 2 silu * up; the logits are then wrong).
    Raises :class:`EdgeqError`."""
    from edgeq.runtime.native import w4a8 as native_w4a8  # noqa: PLC0415 (its library loads only for W4A8 models)

    block_n, full_mode, tails, isa = w4a16._ready_args(None, None)
    w4a8_isa = native_w4a8.isa_code() if w4a8 else -1
    _small_op("decode_layers", x, n, weights, group_sizes, biases, norms, eps, caches, scales, windows, cos, nsin, pos,
              scratch, block_n, full_mode, tails, isa & 15, w4a8_isa, list(qk_norms), list(qk_scratch), skip)
    # one kernel call per matrix, as the Python step counts them
    (native_w4a8 if w4a8 else w4a16).count_calls(len(group_sizes))
    _written(n)
