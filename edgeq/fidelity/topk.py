"""The reference known only through its top k: what ``--save-ref`` keeps per position and the comparison against it.

A ``--ref`` file stores, per scored position, the reference's k most likely tokens with their log-probabilities and
the log of the mass outside them (:class:`RefRows`). Against it every statistic but KLD is exact; KLD is the KL of
the two distributions coarse-grained to {each top-k token, the rest}, a lower bound whose shortfall
:func:`position_stats_topk` bounds from above (docs/fidelity.md, "What is exact and what is approximate").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch

from edgeq.errors import EdgeqError
from edgeq.fidelity.metrics import TOP5, mask_ids, row_blocks, top_n_mask


@dataclass(frozen=True)
class RefRows:
    """What ``--save-ref`` keeps of the reference per scored position (see docs/fidelity.md, "`--save-ref FILE` / `--ref FILE`", its "Format").

    topk_ids int32 [S, k] and topk_logprobs float64 [S, k]: the k most likely tokens, most likely first;
    target_logprob float64 [S]: log p(target); tail_logmass float64 [S]: log of the probability outside the top k
    (logsumexp of the other V-k log-probs, -inf if none); top1 int32 [S]: argmax of the logits (first on ties);
    top5 int32 [S, 5]: the top-5 set of :func:`top_n_mask`, ascending ids.
    """

    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    target_logprob: torch.Tensor
    tail_logmass: torch.Tensor
    top1: torch.Tensor
    top5: torch.Tensor

    def slice(self, a: int, b: int) -> "RefRows":
        """Positions ``a .. b-1`` of every field."""
        return RefRows(*(getattr(self, f.name)[a:b] for f in fields(self)))

    @staticmethod
    def cat(parts: Sequence["RefRows"]) -> "RefRows":
        """The parts' positions one after another (window by window into one file)."""
        return RefRows(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(RefRows)))


def tail_mask(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [S, vocab]: True outside each row's ``ids`` (int [S, k]), i.e. on the tail of the top-k split."""
    mask = torch.ones(ids.shape[0], vocab, dtype=torch.bool)
    mask.scatter_(1, ids.long(), False)
    return mask


def ref_rows(ref_logits: torch.Tensor, targets: torch.Tensor, k: int) -> RefRows:
    """Reduce reference logits [S, V] to the :class:`RefRows` kept by ``--save-ref``."""
    S, V = ref_logits.shape
    parts = []
    for a, b in row_blocks(S, V):
        r = ref_logits[a:b]
        lr = torch.log_softmax(r.double(), dim=-1)
        top = torch.topk(lr, min(k, V), dim=-1)
        tail = torch.logsumexp(lr.masked_fill(~tail_mask(top.indices, V), -math.inf), dim=-1)
        n5 = min(TOP5, V)
        parts.append(RefRows(top.indices.int(), top.values, lr.gather(1, targets[a:b, None])[:, 0], tail,
                             r.argmax(-1).int(), mask_ids(top_n_mask(r, n5), n5).int()))
    return RefRows.cat(parts)


def worst_tail_kl(tail_logq: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Row-wise ``max KL(a || b)`` over distributions a with ``0 <= a_j <= m``, b the tail-conditional quant
    distribution given as log b_j (float64 [S, n]; entries outside the tail = +inf so they sort last), m float64 [S].

    KL is convex in a, so the maximum sits on a vertex of {0 <= a_j <= m, sum a = 1}: c = floor(1/m) entries equal
    to m and one equal to r = 1 - c m. All vertices share sum a log a, so the maximum puts those masses on the
    smallest b_j: ``c m log m + r log r - m sum_{c smallest} log b - r log b_(c+1)``.
    Example: b uniform over 4 tokens, m = 1/2: a = (1/2, 1/2, 0, 0) gives log 2.
    """
    S, n = tail_logq.shape
    zero = torch.zeros((), dtype=torch.float64)
    m = m.clamp(min=1e-300, max=1.0)
    size = (tail_logq != math.inf).sum(-1)  # tail length per row
    c = torch.minimum(torch.floor(1.0 / m), size.double()).long()
    r = (1.0 - c.double() * m).clamp(min=0.0)
    b = torch.sort(tail_logq, dim=-1).values  # ascending; a -inf (q_j = 0) makes the bound +inf, as it should
    rows = torch.arange(S)
    sum_c = torch.where(c > 0, torch.cumsum(b, dim=-1)[rows, (c - 1).clamp(min=0)], zero)
    nxt = b[rows, c.clamp(max=n - 1)]
    val = c.double() * m * torch.log(m) - m * sum_c
    has_next = (r > 0) & (c < size)
    return val + torch.where(has_next, r * torch.log(r.clamp(min=1e-300)) - r * nxt, zero)


def position_stats_topk(ref: RefRows, quant_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, np.ndarray]:
    """Like :func:`position_stats`, with the reference known only through its cached :class:`RefRows`.

    Exact: nll_ref, nll_quant, delta_p, top1_same, top5_overlap. KLD is the KL divergence of the two
    distributions coarse-grained to {each top-k token of the reference, everything else}:
    ``kld_k = sum_{i in K} p_i (log p_i - log q_i) + P_T (log P_T - log Q_T)``, with P_T, Q_T the tail masses.
    By the log-sum inequality ``0 <= kld - kld_k = P_T KL(p|T || q|T)``, and since every tail p_i <= p_(k)
    (the k-th largest), ``kld - kld_k <= P_T max{KL(a || q|T) : 0 <= a_i <= min(1, p_(k)/P_T)}`` =: ``kld_bound``,
    returned per position (see :func:`worst_tail_kl`).
    """
    S, V = quant_logits.shape
    if int(ref.topk_ids.max()) >= V:
        raise EdgeqError(f"--ref: token id {int(ref.topk_ids.max())} in the reference file is outside the quantised "
                         f"model's vocabulary of {V}; the two models do not share a vocabulary")
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("nll_ref", "nll_quant", "kld", "kld_bound", "tail_mass", "delta_p",
                                                          "top1_same", "top5_overlap")}
    for a, b in row_blocks(S, V):
        q, rr = quant_logits[a:b], ref.slice(a, b)
        lq = torch.log_softmax(q.double(), dim=-1)
        ids = rr.topk_ids.long()
        pk = rr.topk_logprobs.exp()
        head = torch.where(pk > 0, pk * (rr.topk_logprobs - lq.gather(1, ids)), torch.zeros((), dtype=torch.float64)).sum(-1)
        tail = tail_mask(ids, V)
        tail_q = lq.masked_fill(~tail, -math.inf)
        log_qt = torch.logsumexp(tail_q, dim=-1)
        p_t = rr.tail_logmass.exp()
        lump = torch.where(p_t > 0, p_t * (rr.tail_logmass - log_qt), torch.zeros((), dtype=torch.float64))
        cols["kld"].append(head + lump)
        # tail-conditional log q_j - log Q_T; top-k entries +inf so that they sort behind every tail entry
        tail_b = torch.where(tail, lq - log_qt[:, None], torch.full((), math.inf, dtype=torch.float64))
        m = (rr.topk_logprobs[:, -1] - rr.tail_logmass).exp()  # p_(k) / P_T bounds every tail p_j / P_T
        cols["tail_mass"].append(p_t)
        cols["kld_bound"].append(torch.where(p_t > 0, p_t * worst_tail_kl(tail_b, m), torch.zeros((), dtype=torch.float64)))
        tq = lq.gather(1, targets[a:b, None])[:, 0]
        cols["nll_ref"].append(-rr.target_logprob)
        cols["nll_quant"].append(-tq)
        cols["delta_p"].append(tq.exp() - rr.target_logprob.exp())
        cols["top1_same"].append((q.argmax(-1) == rr.top1.long()).double())
        n5 = rr.top5.shape[1]
        cols["top5_overlap"].append(top_n_mask(q, n5).gather(1, rr.top5.long()).sum(-1).double() / n5)
    return {k: torch.cat(v).numpy() for k, v in cols.items()}
