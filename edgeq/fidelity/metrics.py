"""Per-position comparison of two next-token distributions over the full vocabulary (KLD, NLL, top-1, top-5, Δp).

KLD is ``KL(P_ref || P_quant) = sum_i p_i (log p_i - log q_i)``, computed in float64 from log-softmax of the float32
logits, in blocks of rows so that a 150k vocabulary does not need a [ctx, V] float64 copy. Worked example
(V = 2): p = (0.5, 0.5), q = (0.9, 0.1) gives 0.5 log(0.5/0.9) + 0.5 log(0.5/0.1) = 0.5108 nats; p = q gives 0.
"""

from __future__ import annotations

import numpy as np
import torch

TOP5 = 5
# Rows of float64 [rows, V] work arrays per block: 2**22 elements = 32 MiB each, whatever the vocabulary.
_BLOCK_ELEMENTS = 1 << 22


def row_blocks(rows: int, vocab: int) -> list[tuple[int, int]]:
    """[a, b) row ranges whose float64 [b - a, vocab] work arrays stay near _BLOCK_ELEMENTS elements."""
    step = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def top_n_mask(logits: torch.Tensor, n: int) -> torch.Tensor:
    """bool [S, V]: the n largest entries of each row, ties at the boundary going to the lowest token ids.

    bf16 logits tie often; torch.topk breaks ties arbitrarily, which would make the top-5 overlap depend on the
    kernel. Example: logits (1, 3, 3, 3, 0), n = 2 -> ids {1, 2}.
    """
    n = min(n, logits.shape[-1])
    nth = torch.topk(logits, n, dim=-1).values[:, -1:]
    above = logits > nth
    room = n - above.sum(-1, keepdim=True)
    tied = logits == nth
    if bool((tied.sum(-1, keepdim=True) == room).all()):  # no row has more tied candidates than free places
        return above | tied
    return above | (tied & (torch.cumsum(tied, dim=-1) <= room))


def mask_ids(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Ids of the true entries of each row of a mask with exactly n per row, ascending: int64 [S, n]."""
    return mask.nonzero()[:, 1].view(mask.shape[0], n)


def position_stats(ref_logits: torch.Tensor, quant_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-position comparison of two models' next-token distributions, exact over the full vocabulary.

    ``ref_logits``, ``quant_logits``: float [S, V]; ``targets``: int64 [S], the token that followed each row.
    Returns float64 arrays [S]: ``nll_ref = -log p(target)``, ``nll_quant = -log q(target)``,
    ``kld = sum_i p_i (log p_i - log q_i)`` (terms with p_i = 0 are 0), ``delta_p = q(target) - p(target)``,
    ``top1_same`` (argmax of both logits equal, first index on ties) and ``top5_overlap`` (|top5_p & top5_q| / 5,
    sets from :func:`top_n_mask`).
    Example: p = q gives kld 0, delta_p 0, top1_same 1, top5_overlap 1 exactly.
    """
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("nll_ref", "nll_quant", "kld", "delta_p", "top1_same", "top5_overlap")}
    S, V = ref_logits.shape
    for a, b in row_blocks(S, V):
        r, q, t = ref_logits[a:b], quant_logits[a:b], targets[a:b, None]
        lr = torch.log_softmax(r.double(), dim=-1)
        lq = torch.log_softmax(q.double(), dim=-1)
        pr = lr.exp()
        # p_i = 0 contributes nothing even where log q_i = -inf (masked vocabulary entries)
        out["kld"].append(torch.where(pr > 0, pr * (lr - lq), torch.zeros((), dtype=torch.float64)).sum(-1))
        tr, tq = lr.gather(1, t)[:, 0], lq.gather(1, t)[:, 0]
        out["nll_ref"].append(-tr)
        out["nll_quant"].append(-tq)
        out["delta_p"].append(tq.exp() - tr.exp())
        out["top1_same"].append((r.argmax(-1) == q.argmax(-1)).double())
        n5 = min(TOP5, V)
        out["top5_overlap"].append((top_n_mask(r, n5) & top_n_mask(q, n5)).sum(-1).double() / n5)
    return {k: torch.cat(v).numpy() for k, v in out.items()}
