"""A test-side GPTQ writer: strided sums of shifted fields (the decoder, edgeq.layouts.gptq, uses shifts and masks),
so a shared misreading of the format cannot cancel out."""

from __future__ import annotations

import torch


def to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, bits: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q int [N, K], true zeros int [Gc, N] -> (qweight int32 [K/pf, N], qzeros int32 [Gc, N/pf]) as GPTQModel
    writes them (v1: the constant 0x11111111 / 0x01010101 subtracted from each zero word, modulo 2^32)."""
    pf = 32 // bits
    qt = q.t().to(torch.int64)
    qweight = sum(qt[j::pf] << (bits * j) for j in range(pf))
    z = zeros.to(torch.int64)
    qzeros = sum(z[:, j::pf] << (bits * j) for j in range(pf))
    if fmt == "gptq":
        qzeros = qzeros - sum(1 << (bits * j) for j in range(pf))
    return to_int32(qweight), to_int32(qzeros)


def act_order_g_idx(k: int, g: int, seed: int) -> torch.Tensor:
    """A g_idx as GPTQModel writes with desc_act: group = position in a random column order // G."""
    p = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[p] = (torch.arange(k) // g).to(torch.int32)
    return g_idx


def make_gptq(n, k, g, bits=4, sym=False, seed=0, act_order=False, zero_extremes=True):
    gen = torch.Generator().manual_seed(seed)
    gc = k // g
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    if sym:
        zeros = torch.full((gc, n), 2 ** (bits - 1))
    else:
        zeros = torch.randint(0, 2**bits, (gc, n), generator=gen)
        if zero_extremes:  # the v1 borrow case (true zero 0) and the top value, in every position of a word
            zeros[0, :] = 0
            zeros[-1, : n // 2] = 2**bits - 1
    scales = (torch.rand(gc, n, generator=gen) * 0.02 + 1e-3).to(torch.float16)
    g_idx = act_order_g_idx(k, g, seed) if act_order else (torch.arange(k) // g).to(torch.int32)
    return q, zeros, scales, g_idx
