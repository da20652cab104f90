"""The evaluation text and its token windows.

The text is tokenised once (no special tokens) and cut into consecutive, non-overlapping windows of ``ctx`` tokens.
When the tokenizer has a BOS token, each window is ``[BOS] + ctx-1`` text tokens. The logits at window positions
``first .. ctx-2`` predict the tokens at ``first+1 .. ctx-1``; ``first = ctx // 2`` for ``score="half"``
(llama-perplexity's choice: every scored token has at least ctx/2 tokens of context) and ``0`` for ``score="all"``.
A tail shorter than a window is not scored. ``max_tokens`` stops after that many scored positions (the last window is
then scored only in part).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from edgeq.errors import EdgeqError
from edgeq.fidelity.tokens import check_same_encoding, encode
from edgeq.keys import DATA

if TYPE_CHECKING:
    from edgeq.fidelity.sides import Side

DEFAULT_TEXT = DATA / "heldout-prose.txt"  # docs/fidelity.md, "The bundled evaluation text"
SCORE_MODES = ("half", "all")
DEFAULT_CTX = 512


@dataclass(frozen=True)
class Windowing:
    """Which logits of a ``ctx``-token window are scored: rows ``first .. ctx-2`` (targets one position later)."""

    ctx: int
    score: str

    def __post_init__(self) -> None:
        if self.score not in SCORE_MODES:
            raise EdgeqError(f"--score {self.score!r}: unknown mode; use one of {', '.join(SCORE_MODES)}")
        if self.ctx < 3:
            raise EdgeqError(f"--ctx {self.ctx}: a window needs at least 3 tokens to score any; use --ctx 512")

    @property
    def first(self) -> int:
        return self.ctx // 2 if self.score == "half" else 0

    @property
    def per_window(self) -> int:
        """Scored positions per full window: ``ctx - 1 - first`` (255 for ctx 512, half)."""
        return self.ctx - 1 - self.first


def make_windows(ids: Sequence[int], ctx: int, bos_id: Optional[int]) -> torch.Tensor:
    """Cut token ids into int64 windows ``[W, ctx]``; with a BOS id each window is ``[bos] + ctx-1`` text tokens.

    Example: ids 0..9, ctx 4, bos 99 -> [[99,0,1,2],[99,3,4,5],[99,6,7,8]] (token 9 is a short tail, not used).
    """
    step = ctx - 1 if bos_id is not None else ctx
    n = len(ids) // step
    if n == 0:
        raise EdgeqError(f"text: tokenises to {len(ids)} tokens, fewer than one window of --ctx {ctx} needs ({step}); "
                         f"use a longer --text or a smaller --ctx")
    body = torch.as_tensor(list(ids[: n * step]), dtype=torch.long).view(n, step)
    if bos_id is None:
        return body
    return torch.cat([torch.full((n, 1), int(bos_id), dtype=torch.long), body], dim=1)


def plan_counts(n_windows: int, per_window: int, max_tokens: Optional[int]) -> list[int]:
    """Scored positions per window: ``per_window`` each, cut so the total is at most ``max_tokens``."""
    if max_tokens is not None and max_tokens < 1:
        raise EdgeqError(f"--max-tokens {max_tokens}: must be at least 1")
    counts, left = [], (max_tokens if max_tokens is not None else n_windows * per_window)
    for _ in range(n_windows):
        if left <= 0:
            break
        counts.append(min(per_window, left))
        left -= counts[-1]
    return counts


def resolve_ids(text: Optional[str], input_ids: Optional[Sequence[int]], sides: Sequence[Side],
                tokenizer: Any) -> tuple[list[int], Optional[int], Optional[str]]:
    """Token ids of the evaluation text, the BOS id to start windows with, and the text's sha256."""
    tok = tokenizer if tokenizer is not None else next((s.tokenizer for s in sides if s.tokenizer is not None), None)
    if input_ids is not None:
        return [int(i) for i in input_ids], (getattr(tok, "bos_token_id", None) if tok is not None else None), None
    if text is None:
        text = DEFAULT_TEXT.read_text(encoding="utf-8")
    if tok is None:
        raise EdgeqError("fidelity: no tokenizer to turn the text into tokens; pass models with a .tokenizer, "
                         "tokenizer=..., or input_ids=...")
    ids = encode(tok, text)
    for s in sides:
        if s.tokenizer is not None and s.tokenizer is not tok:
            check_same_encoding(ids, encode(s.tokenizer, text))
    return ids, getattr(tok, "bos_token_id", None), hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of ``--text``; a missing or undecodable file is an EdgeqError that says what to pass."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EdgeqError(f"{p}: text file not found; pass an existing UTF-8 file to --text") from None
    except UnicodeDecodeError as e:
        raise EdgeqError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None
