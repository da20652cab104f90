"""``edgeq fidelity`` on checkpoint paths: load both sides through the runtime, refuse REF and QUANT swapped.

Models are loaded by ``edgeq.runtime.load`` (an edgeq checkpoint or a Hugging Face one, local or a hub id already
resolved to a directory); everything below this module works on in-memory models.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

from edgeq.errors import EdgeqError
from edgeq.fidelity.loop import Progress
from edgeq.fidelity.reffile import DEFAULT_REF_TOPK, load_reference_file
from edgeq.fidelity.report import FidelityReport
from edgeq.fidelity.run import compare, compare_to_reference_file, save_reference_file
from edgeq.fidelity.text import DEFAULT_CTX, read_text
from edgeq.keys import MANIFEST


def _default_load(path: str | os.PathLike) -> Any:
    """One side from its checkpoint directory, through ``edgeq.runtime.load`` (tests replace this function)."""
    from edgeq.runtime import load  # the runtime is heavy and optional for the pure statistics

    # Scoring runs whole windows without the KV cache; 16 MiB is above any model's bytes per token, far below the
    # 256 MiB default that would otherwise sit unused twice.
    return load(path, kv_cache_bytes=16 << 20)


def run_fidelity(ref: Optional[str | os.PathLike], quant: Optional[str | os.PathLike], *,
                 text_path: Optional[str | os.PathLike] = None, ctx: Optional[int] = None,
                 score: Optional[str] = None, max_tokens: Optional[int] = None,
                 save_ref: Optional[str | os.PathLike] = None, ref_file: Optional[str | os.PathLike] = None,
                 per_layer: bool = False, top: int = 10, ref_topk: int = DEFAULT_REF_TOPK,
                 progress: Optional[Progress] = None,
                 load_fn: Optional[Callable[[Any], Any]] = None, allow_swapped: bool = False) -> FidelityReport:
    """``edgeq fidelity`` on checkpoint paths. ``load_fn(path)`` returns an object with ``.model``, ``.tokenizer``
    and ``.config`` (default: ``edgeq.runtime.load``). With ``ref_file`` the reference is not loaded (``ref`` must be
    None); the reference file is read before the quantised model is loaded so that a bad file fails fast.
    ``allow_swapped``: see :func:`check_order`."""
    load = load_fn or _default_load
    check_order(ref, quant, allow_swapped)
    text = read_text(text_path) if text_path is not None else None
    if quant is None:
        raise EdgeqError("fidelity: no quantised checkpoint given; usage: edgeq fidelity REF QUANT")
    if ref_file is not None:
        if ref is not None:
            raise EdgeqError("fidelity: --ref FILE replaces the REF checkpoint; give only QUANT")
        if per_layer:
            raise EdgeqError("--per-layer needs the reference model itself; drop --ref and give REF QUANT")
        if save_ref is not None:
            raise EdgeqError("fidelity: --save-ref and --ref together would copy the file; give one of them")
        cached = load_reference_file(ref_file)
        return compare_to_reference_file(cached, load(quant), text=text, ctx=ctx, score=score,
                                         max_tokens=max_tokens, progress=progress)
    if ref is None:
        raise EdgeqError("fidelity: no reference checkpoint; usage: edgeq fidelity REF QUANT (or QUANT --ref FILE)")
    ctx = DEFAULT_CTX if ctx is None else ctx  # 0 is refused by the windowing, not taken for the default
    return compare(load(ref), load(quant), text=text, ctx=ctx, score=score or "half", max_tokens=max_tokens,
                   per_layer=per_layer, top=top, save_ref=save_ref, ref_topk=ref_topk, progress=progress)


def save_reference_checkpoint(ref: str | os.PathLike, save_ref: str | os.PathLike, *,
                              text_path: Optional[str | os.PathLike] = None, ctx: Optional[int] = None,
                              score: Optional[str] = None, max_tokens: Optional[int] = None,
                              k: int = DEFAULT_REF_TOPK, progress: Optional[Progress] = None) -> tuple[int, float]:
    """``edgeq fidelity REF --save-ref FILE``: load REF, score it alone and write FILE (see
    :func:`~edgeq.fidelity.run.save_reference_file`); returns (positions, PPL of the reference)."""
    model = _default_load(ref)  # loaded before --text is read, as ever: a bad REF is reported first
    return save_reference_file(model, save_ref, text=read_text(text_path) if text_path else None,
                               ctx=DEFAULT_CTX if ctx is None else ctx, score=score or "half", max_tokens=max_tokens,
                               k=k, progress=progress)


def is_edgeq_checkpoint(path: str | os.PathLike) -> bool:
    """An edgeq checkpoint carries its manifest (every kernel's); a Hugging Face checkpoint does not."""
    return (Path(path) / MANIFEST).is_file()


def check_order(ref: Optional[str | os.PathLike], quant: Optional[str | os.PathLike],
                allow_swapped: bool = False) -> None:
    """Refuse REF and QUANT given the wrong way round: REF an edgeq checkpoint and QUANT not.

    Swapped, the comparison still runs and reports PPL(quant)/PPL(ref) = PPL(reference)/PPL(quantised), typically
    just below 1, which a ``--max-ppl-ratio`` gate passes: a broken quantisation would go green. Two edgeq
    checkpoints, or two plain ones, are taken as given; ``allow_swapped`` takes this case as given too."""
    if allow_swapped or ref is None or quant is None:
        return
    if is_edgeq_checkpoint(ref) and not is_edgeq_checkpoint(quant):
        raise EdgeqError(f"fidelity: REF {ref} is an edgeq checkpoint and QUANT {quant} is not; the order is "
                         f"REF QUANT (the reference first): run edgeq fidelity {quant} {ref}, or pass --allow-swapped "
                         "to score them as given")
