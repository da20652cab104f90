"""The streaming loop: one window through both models, reduced to a few numbers per position, logits dropped.

Memory is one window of logits per model plus 48 bytes per scored position (64 with a reference file): six (eight)
float64 statistics. A KeyboardInterrupt after the first window keeps the windows already complete.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
import torch

from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.fidelity.metrics import position_stats
from edgeq.fidelity.probe import LayerProbe
from edgeq.fidelity.reffile import ReferenceFile
from edgeq.fidelity.sides import Side
from edgeq.fidelity.text import Windowing
from edgeq.fidelity.topk import RefRows, position_stats_topk, ref_rows

Progress = Callable[[int, int, Optional[float]], None]
"""``progress(windows_done, windows_total, eta_seconds_or_None)``, called after every window."""


def window_logits(ids: torch.Tensor, keep: int, count: int, ref: Optional[Side], quant: Optional[Side],
                  probe: Optional[LayerProbe]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Scored rows [count, V] of both models for one window; the quantised model first (the probe needs it so)."""
    out: dict[str, Optional[torch.Tensor]] = {"quant": None, "ref": None}
    for phase, s in (("quant", quant), ("ref", ref)):
        if s is None:
            continue
        if probe is not None:
            probe.phase = phase
        logits = s.logits(ids, keep)
        out[phase] = logits[logits.shape[0] - keep:][:count]
    if probe is not None:
        probe.phase = ""
        probe.stash.clear()
    return out["ref"], out["quant"]


def run_windows(windows: torch.Tensor, counts: list[int], win: Windowing, *, ref: Optional[Side],
                quant: Optional[Side], ref_file: Optional[ReferenceFile], save_k: Optional[int],
                probe: Optional[LayerProbe], progress: Optional[Progress]
                ) -> tuple[dict[str, np.ndarray], list[RefRows], int, bool, int]:
    """Score window by window; return (per-position arrays, saved ref rows, windows done, interrupted, vocab).

    A window counts only once all of its results are in, so that an interrupt leaves consistent statistics.
    """
    cols: list[dict[str, np.ndarray]] = []
    saved: list[RefRows] = []
    done, interrupted, vocab, offset = 0, False, -1, 0
    keep = win.ctx - win.first
    t0 = time.monotonic()
    try:
        for w, count in enumerate(counts):
            ids = windows[w: w + 1]
            targets = ids[0, win.first + 1: win.first + 1 + count]
            if probe is not None:
                probe.rows = (keep, keep - count)
            r, q = window_logits(ids, keep, count, ref, quant, probe)
            check_finite(r, ref, w)
            check_finite(q, quant, w)
            vocab = check_vocab(q, r, ref_file, vocab)
            rows = ref_rows(r, targets, save_k) if save_k is not None else None
            if r is not None and q is not None:
                stats = position_stats(r, q, targets)
            elif q is not None:
                stats = position_stats_topk(ref_file.rows.slice(offset, offset + count), q, targets)
            else:
                stats = {"nll_ref": (-rows.target_logprob).numpy()}
            del q, r
            cols.append(stats)
            if rows is not None:
                saved.append(rows)
            if probe is not None:
                probe.commit()
            offset += count
            done += 1
            if progress is not None:
                progress(done, len(counts), (time.monotonic() - t0) / done * (len(counts) - done))
    except KeyboardInterrupt:
        interrupted = True
        if probe is not None:
            probe.phase = ""
        if done == 0:
            raise
    del cols[done:], saved[done:]
    merged = {k: np.concatenate([c[k] for c in cols]) for k in cols[0]} if cols else {}
    return merged, saved, done, interrupted, vocab


def check_finite(logits: Optional[torch.Tensor], side: Optional[Side], window: int) -> None:
    """Statistics of NaN logits are NaN, or, on the reference side, a KLD of exactly 0: either model's non-finite
    logits are an error naming the side, never a report."""
    if logits is not None and not bool(torch.isfinite(logits).all()):
        where = f" ({side.path})" if side.path is not None else ""
        raise DamagedCheckpointError(f"the {side.label} model{where}: non-finite logits (NaN or Inf) in window "
                                     f"{window + 1}; its weights are damaged: "
                                     + ("re-copy or re-download it" if side.label == "reference" else
                                        "check it with `edgeq inspect --verify`, or re-convert it"))


def check_vocab(q: Optional[torch.Tensor], r: Optional[torch.Tensor], ref_file: Optional[ReferenceFile],
                seen: int) -> int:
    """The vocabulary width of the logits, checked once (``seen`` < 0 on the first window) against the other side."""
    if seen >= 0:
        return seen
    if q is not None and r is not None and q.shape[-1] != r.shape[-1]:
        raise EdgeqError(f"vocab size differs: the reference model has {r.shape[-1]} logits, the quantised model "
                         f"{q.shape[-1]}; compare a quantised model only with the model it was made from")
    if q is not None and ref_file is not None and q.shape[-1] != ref_file.header["vocab_size"]:
        raise EdgeqError(f"vocab size differs: the reference file was made with {ref_file.header['vocab_size']} "
                         f"logits, the quantised model has {q.shape[-1]}; use a reference file of the same model")
    return (q if q is not None else r).shape[-1]
