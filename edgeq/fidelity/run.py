"""The comparisons on in-memory models: :func:`compare` (reference against quantised), and the ``--save-ref`` /
``--ref`` pair (:func:`save_reference_file`, :func:`compare_to_reference_file`).

Each one checks its inputs (vocabulary, tokenizer, ctx), cuts the text into windows (:mod:`~edgeq.fidelity.text`),
streams them through the models (:mod:`~edgeq.fidelity.loop`) and summarises (:mod:`~edgeq.fidelity.stats`).
Models are sides (:mod:`~edgeq.fidelity.sides`).
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Optional, Sequence

from edgeq.errors import EdgeqError
from edgeq.fidelity.loop import Progress, run_windows
from edgeq.fidelity.probe import LayerProbe
from edgeq.fidelity.reffile import (
    DEFAULT_REF_TOPK,
    ReferenceFile,
    check_save_target,
    load_reference_file,
    write_reference,
)
from edgeq.fidelity.report import FidelityReport
from edgeq.fidelity.sides import Side
from edgeq.fidelity.stats import summarize
from edgeq.fidelity.text import DEFAULT_CTX, Windowing, make_windows, plan_counts, resolve_ids
from edgeq.fidelity.tokens import check_same_vocabulary, tokenizer_sha256


def compare(ref: Any, quant: Any, *, text: Optional[str] = None, input_ids: Optional[Sequence[int]] = None,
            tokenizer: Any = None, ctx: int = DEFAULT_CTX, score: str = "half", max_tokens: Optional[int] = None,
            per_layer: bool = False, top: int = 10, save_ref: Optional[str | os.PathLike] = None,
            ref_topk: int = DEFAULT_REF_TOPK, progress: Optional[Progress] = None) -> FidelityReport:
    """Compare two in-memory models on ``text`` (default: the bundled held-out text) or on ``input_ids``.

    ``ref``, ``quant``: sides (see :mod:`edgeq.fidelity.sides`). Refuses models whose vocabularies or tokenizers differ.
    ``save_ref``: also write the reference's per-position top-``ref_topk`` data to that file (see
    :func:`save_reference_file`). A KeyboardInterrupt after at least one window returns the statistics so far with
    ``partial=True`` (and writes no reference file).
    """
    win = Windowing(ctx, score)
    if save_ref and ref_topk < 1:
        raise EdgeqError(f"--ref-topk {ref_topk}: must be at least 1 (use {DEFAULT_REF_TOPK})")
    if save_ref:
        check_save_target(save_ref)
    r, q = Side(ref, "reference", tokenizer), Side(quant, "quantised", tokenizer)
    check_same_vocabulary(r, q)
    r.check_ctx(ctx)
    q.check_ctx(ctx)
    ids, bos, text_sha = resolve_ids(text, input_ids, (r, q), tokenizer)
    windows = make_windows(ids, ctx, bos)
    counts = plan_counts(windows.shape[0], win.per_window, max_tokens)
    probe = None
    if per_layer:
        if r.module is None or q.module is None:
            raise EdgeqError("--per-layer needs both models as nn.Modules, not scoring functions")
        probe = LayerProbe(r.module, q.module)
    try:
        cols, saved, done, interrupted, vocab = run_windows(windows, counts, win, ref=r, quant=q, ref_file=None,
                                                            save_k=ref_topk if save_ref else None, probe=probe,
                                                            progress=progress)
        layers, n_layers = probe.results(top) if probe else (None, None)
    finally:
        if probe is not None:
            probe.close()
    if save_ref and not interrupted:
        tok = r.tokenizer if r.tokenizer is not None else tokenizer
        write_reference(save_ref, windows[:done], saved, win, k=ref_topk, vocab=vocab, bos=bos,
                        tokenizer_sha=tokenizer_sha256(tok) if tok is not None else None, text_sha=text_sha)
    return summarize(cols, ctx=ctx, score=score, windows=done, partial=interrupted, per_layer=layers,
                     per_layer_count=n_layers)


def compare_to_reference_file(ref_file: str | os.PathLike | ReferenceFile, quant: Any, *, text: Optional[str] = None,
                              tokenizer: Any = None, ctx: Optional[int] = None, score: Optional[str] = None,
                              max_tokens: Optional[int] = None, progress: Optional[Progress] = None) -> FidelityReport:
    """Compare ``quant`` against a reference cached by ``--save-ref``, on the windows stored in the file.

    ``text``, ``ctx``, ``score``, when given, must match the file (else EdgeqError); the quantised tokenizer, when
    known, must hash the same as the reference's. KLD statistics are then top-k approximations (lower bounds; the
    report's ``kld_topk_bound`` bounds the mean's shortfall); everything else is exact.
    """
    ref = ref_file if isinstance(ref_file, ReferenceFile) else load_reference_file(ref_file)
    h, name = ref.header, ref.path
    for opt, mine, theirs in (("--ctx", ctx, h["ctx"]), ("--score", score, h["score"])):
        if mine is not None and mine != theirs:
            raise EdgeqError(f"{name}: made with {opt} {theirs}, asked for {opt} {mine}; drop {opt} or re-create "
                             f"the reference file")
    q = Side(quant, "quantised", tokenizer)
    q.check_ctx(h["ctx"])
    _check_fits(ref, q, text)
    win = Windowing(h["ctx"], h["score"])
    counts = ref.counts
    if max_tokens is not None:
        counts = plan_counts(len(counts), win.per_window, min(max_tokens, h["positions"]))
    cols, _, done, interrupted, _ = run_windows(ref.windows, counts, win, ref=None, quant=q, ref_file=ref,
                                                save_k=None, probe=None, progress=progress)
    return summarize(cols, ctx=win.ctx, score=win.score, windows=done, partial=interrupted, ref_topk=h["k"])


def _check_fits(ref: ReferenceFile, q: Side, text: Optional[str]) -> None:
    """Refuse a reference file made for another vocabulary, tokenizer or text than ``q`` and ``text``."""
    h, name = ref.header, ref.path
    if q.vocab_size is not None and q.vocab_size != h["vocab_size"]:
        raise EdgeqError(f"vocab size differs: the reference file was made with {h['vocab_size']}, the quantised "
                         f"model has {q.vocab_size}; use a reference file of the same model")
    if q.tokenizer is not None and h["tokenizer_sha256"] is not None:
        mine_sha = tokenizer_sha256(q.tokenizer)
        if mine_sha != h["tokenizer_sha256"]:
            raise EdgeqError(f"{name}: made with a different tokenizer (sha256 {h['tokenizer_sha256'][:12]}, the "
                             f"quantised model's is {mine_sha[:12]}); use a reference file of the same model")
    if text is not None:
        sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if h["text_sha256"] is None:
            raise EdgeqError(f"{name}: made from token ids, not from a text; drop --text (the file holds the tokens)")
        if sha != h["text_sha256"]:
            raise EdgeqError(f"{name}: made from another text (sha256 {str(h['text_sha256'])[:12]}, --text has "
                             f"{sha[:12]}); pass the same --text or re-create the reference file")


def save_reference_file(ref: Any, path: str | os.PathLike, *, text: Optional[str] = None,
                        input_ids: Optional[Sequence[int]] = None, tokenizer: Any = None, ctx: int = DEFAULT_CTX,
                        score: str = "half", max_tokens: Optional[int] = None, k: int = DEFAULT_REF_TOPK,
                        progress: Optional[Progress] = None) -> tuple[int, float]:
    """Score only the reference and write its ``--ref`` file; returns (positions, PPL of the reference).

    Interrupted runs write nothing (a KeyboardInterrupt propagates).
    """
    win = Windowing(ctx, score)
    if k < 1:
        raise EdgeqError(f"--ref-topk {k}: must be at least 1 (use {DEFAULT_REF_TOPK})")
    check_save_target(path)
    r = Side(ref, "reference", tokenizer)
    r.check_ctx(ctx)
    ids, bos, text_sha = resolve_ids(text, input_ids, (r,), tokenizer)
    windows = make_windows(ids, ctx, bos)
    counts = plan_counts(windows.shape[0], win.per_window, max_tokens)
    cols, saved, done, interrupted, vocab = run_windows(windows, counts, win, ref=r, quant=None, ref_file=None,
                                                        save_k=k, probe=None, progress=progress)
    if interrupted:
        raise KeyboardInterrupt
    tok = r.tokenizer if r.tokenizer is not None else tokenizer
    write_reference(path, windows[:done], saved, win, k=k, vocab=vocab, bos=bos,
                    tokenizer_sha=tokenizer_sha256(tok) if tok is not None else None, text_sha=text_sha)
    return int(cols["nll_ref"].size), math.exp(float(cols["nll_ref"].mean()))
