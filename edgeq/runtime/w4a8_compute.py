"""The W4A8 portable path: ``y = x @ W.T`` over the amx_w4a8 packed bytes with the kernel's arithmetic, bit for bit.

The bytes are :mod:`edgeq.layouts.w4a8`'s (pack, unpack, shapes); this module is the compute the runtime runs when
no compiled ``int4_scaled_mm_cpu`` passes the load-time probe (:mod:`edgeq.runtime.w4a8linear`), and the reference
the native kernel (:mod:`edgeq.runtime.native.w4a8`) is tested against.

Arithmetic of the kernel (what :func:`w4a8_linear` reproduces bit for bit; see docs/w4a8.md)::

    q_a, s_a = quantize_activations(x)                        per token, fp32 (edgeq.quantize.w4a8)
    C = bias (fp32) or 0
    for kb in 0 .. K/bk - 1:                                  in order
        acc = sum_{k in block kb} q_a[m, k] * (q[n, k] - z[g, n])       exact int32
        C   = fma(fp32(acc) * s_a[m], s[g, n], C)               one fp32 rounding for the product, one for the fma
    y = bf16(C)                                                round to nearest even

Worked example (one output, K = bk = 32, no bias): q_a = [2, 0, ..., 0], q[n, 0] = 9, z = 8, s_a = 0.5, s = 0.25:
acc = 2 * (9 - 8) = 2, C = fma(2.0 * 0.5, 0.25, 0) = 0.25, y = bf16(0.25) = 0.25.

The sglang source writes the multiply-add as separate ``_mm512_mul_ps`` / ``_mm512_add_ps``; it is fused only when
the compiler contracts it (GCC's default in GNU mode). :func:`w4a8_linear` takes ``fused`` so a load-time probe
against a compiled kernel can pick the one it does.

Counts: ``counts["w4a8_linear"]`` calls, ``counts["blocks_int_mm" | "blocks_fp32"]`` and
``counts["fma_addcmul" | "fma_exact" | "fma_unfused"]`` (32-row block x K block) steps by path, into the Counter
passed as ``counts=`` (default :data:`PROCESS_COUNTS`, the one benchmarks read), so a caller can show which path ran.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import torch

from edgeq.cpu import has_vnni
from edgeq.errors import EdgeqError
from edgeq.layouts import w4a8 as L
from edgeq.quantize.w4a8 import fma_f32, fma_into, quantize_activations

PROCESS_COUNTS: Counter = Counter()  # what w4a8_linear calls without their own ``counts=`` did (see the docstring)


def _centered_block(qweight, zeros, group_size: int, a: int, b: int, scratch: torch.Tensor, subtract: bool):
    """Row blocks a..b-1 unpacked into ``scratch`` as int8 [32*(b-a), K] (K contiguous per output row): q, or q - z
    when ``subtract``. Scratch holds 1.5 bytes per weight (the int8 rows, then the int32 transposition buffer)."""
    n, k = (b - a) * L.BLOCK_N, qweight.shape[1] * L.block_k(group_size)
    w = L.unpack_into(qweight, group_size, a, b, scratch[: n * k], scratch[n * k : n * k + n * k // 2].view(torch.int32))
    if subtract:
        gc = k // group_size
        w.view(n, gc, group_size).sub_(zeros[a:b].permute(0, 2, 1).reshape(n, gc, 1))
    return w


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "int_mm" if has_vnni() else "fp32"  # torch._int_mm runs on VNNI/AMX via oneDNN
    if backend not in ("int_mm", "fp32"):
        raise EdgeqError(f"w4a8_linear: unknown backend {backend!r}; use 'int_mm' or 'fp32'")
    return backend


def _fma_probe_case(m: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random fp32 (t [m, cols], s [cols], c [m, cols]) over wide magnitudes, plus planted cases where an FMA, a
    multiply-then-add and a double-rounded float64 FMA all give different answers."""
    def wide(*shape, lo, hi):
        e = torch.randint(lo, hi, shape, generator=g).to(torch.float32)
        return torch.randn(*shape, generator=g) * torch.exp2(e)
    t, sw, c = wide(m, cols, lo=-20, hi=20), wide(cols, lo=-20, hi=20), wide(m, cols, lo=-45, hi=45)
    one = 1.0 + 2.0**-12  # one*one = 1 + 2^-11 + 2^-24: a tie when rounded to fp32
    t[:, 0], sw[0], c[:, 0] = one, one, -1.0  # fma 2^-11 + 2^-24, mul-then-add 2^-11
    if cols > 1:
        t[:, -1], sw[-1], c[:, -1] = one, one, 2.0**-80  # fma rounds up; a float64 sum rounded again rounds down
    return t, sw, c


@lru_cache(maxsize=None)
def addcmul_is_fma() -> bool:
    """Does ``c.addcmul_(t, s)`` (ATen: ``self + value * t1 * t2``) round once, like an FMA, on this torch build?

    Compiled with contraction (GCC's default in GNU mode), every lane computes fma(t1, t2, self); otherwise it rounds
    twice. Checked against the exact float64 emulation on vector lanes and tails, in the layout the portable path
    uses (c and t contiguous [M, cols], s broadcast along M), including planted cases that separate the three
    candidate roundings. Only if every element agrees is addcmul used as the FMA.
    """
    g = torch.Generator().manual_seed(20240607)
    for m, cols in ((1, 1), (1, 37), (3, 64), (2, 1000), (7, 96)):
        t, sw, c = _fma_probe_case(m, cols, g)
        got = c.clone().addcmul_(t, sw)
        want = fma_f32(t, sw.expand(m, cols), c)
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            return False
    return True


def _pick_fma(fma: str | None) -> str:
    if fma is None:
        return "addcmul" if addcmul_is_fma() else "exact"
    if fma not in ("addcmul", "exact"):
        raise EdgeqError(f"w4a8_linear: unknown fma {fma!r}; use 'addcmul' or 'exact'")
    return fma


def _chunk_blocks(m: int, k: int, kc: int, nc: int, budget: int, backend: str, exact: bool, blockdiag: bool) -> int:
    """32-row blocks per chunk so the chunk's scratch fits ``budget`` bytes: the unpacked weights [cols, K] (1.5 bytes
    each, + an fp32 copy for the fp32 backend), and per output column int32 products, fp32 scaled products and the
    fp32 accumulator (+ two float64 temporaries for the exact FMA); block-diagonal products hold all K blocks."""
    per_col = k * 3 // 2 + (4 * k if backend == "fp32" else 0) + m * (4 + (16 if exact else 0))
    per_col += m * 8 * (kc if blockdiag else 1)
    return max(1, min(nc, budget // (per_col * L.BLOCK_N)))


def _block_products(q_a, s_a, w, z, bk: int, backend: str, blockdiag: bool):
    """Yield, for each K block in order, t = fp32(acc) * s_a as fp32 [M, cols], where acc is the exact int32 dot
    product of q_a [M, K] with w - z over the block. Per block, w [cols, K] holds q - z (``z is None``); for the
    block-diagonal product it holds q, and z [K/bk, cols] is applied as acc = q_a . q - z * sum(q_a over the block),
    the same integer, which saves a pass over the weights when M is small.

    ``blockdiag`` (small M * Kc): one GEMM of the block-diagonal [M*Kc, K] activation matrix (row m*Kc + kb holds
    q_a's block kb, zeros elsewhere) against all of w gives every block's products at once: Kc times the
    multiply-adds, but one call instead of Kc, which pays while M is small and reading the weight dominates.
    """
    m, k = q_a.shape
    kc = k // bk
    mm = torch._int_mm if backend == "int_mm" else torch.mm
    if blockdiag:
        a = torch.zeros(m, kc, kc, bk, dtype=q_a.dtype)
        a.diagonal(dim1=1, dim2=2).copy_(q_a.view(m, kc, bk).permute(0, 2, 1))
        acc = mm(a.view(m * kc, k), w.t()).view(m, kc, -1)
        if z is not None:
            acc -= q_a.view(m, kc, bk).sum(-1, dtype=acc.dtype).unsqueeze(2) * z
        t = acc.to(torch.float32).mul_(s_a.unsqueeze(2))  # int32 -> fp32 is exact below 2^24; one fp32 rounding
        for kb in range(kc):
            yield t[:, kb]
        return
    acc = torch.empty(m, w.shape[0], dtype=torch.int32 if backend == "int_mm" else torch.float32)
    t = torch.empty(m, w.shape[0])
    wt = w.t()  # [K, cols], column-major: each block is a plain slice of rows
    for kb in range(kc):
        ks = slice(kb * bk, (kb + 1) * bk)
        mm(q_a[:, ks], wt[ks], out=acc)
        yield t.copy_(acc).mul_(s_a)  # the same buffer each block: consumed before the next


def w4a8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    fused: bool = True,
    backend: str | None = None,
    fma: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    scratch_bytes: int = 2 << 20,
    blockdiag_rows: int = 128,
    name: str = "w4a8_linear",
    counts: Counter | None = None,
) -> torch.Tensor:
    """y = x @ W.T (+ bias) with the W4A8 kernel's arithmetic, bit for bit: x bf16/fp32 [..., K] -> bf16 [..., N].

    Reads the packed tensors directly, unpacking a chunk of 32-row blocks at a time into a bounded scratch
    (``scratch_bytes``, freed on return): no second copy of the weight persists. Integer block dot products run on
    ``torch._int_mm`` (``backend="int_mm"``, default where the CPU has AVX512-VNNI/AMX) or an fp32 GEMM on the
    integer values (``"fp32"``; exact: |q_a| <= 127, |q - z| <= 15, so every product and partial sum over
    bk <= 128 inputs is an integer below 127*15*128 = 243840 < 2^24). Both give identical bits.
    The FMA is ``torch.addcmul`` where :func:`addcmul_is_fma` holds on this build (``fma="addcmul"``), else the
    float64 emulation (``fma="exact"``); ``fused=False`` replaces it by a rounded multiply then a rounded add.
    ``out_dtype=torch.float32`` returns the fp32 accumulator (the kernel's fp32 output). Products are computed per
    K block, or all at once through a block-diagonal activation matrix when M * K/bk <= ``blockdiag_rows``
    (decode); both give the same integers. Steps are counted into ``counts`` (the module docstring).
    """
    n, k = L.check_packed(name, qweight, scales, zeros, group_size)
    if x.dtype not in (torch.bfloat16, torch.float32) or x.shape[-1] != k:
        raise EdgeqError(f"{name}: expected x bf16/fp32 [..., {k}], got {x.dtype} {list(x.shape)}")
    if bias is not None and list(bias.shape) != [n]:
        raise EdgeqError(f"{name}.bias: expected [{n}], got {list(bias.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise EdgeqError(f"{name}: out_dtype must be bfloat16 or float32, got {out_dtype}")
    backend, fma = _pick_backend(backend), _pick_fma(fma)
    counts = PROCESS_COUNTS if counts is None else counts
    counts["w4a8_linear"] += 1
    lead, x2 = x.shape[:-1], x.reshape(-1, k)
    out = torch.empty(x2.shape[0], n, dtype=out_dtype)
    if x2.shape[0] == 0:
        return out.reshape(*lead, n)
    q_a, s_a = quantize_activations(x2)
    run = _Run(q_a.to(torch.float32) if backend == "fp32" else q_a, s_a.unsqueeze(1), qweight, scales, zeros,
               group_size, backend, fma, fused, x2.shape[0] * (k // L.block_k(group_size)) <= blockdiag_rows)
    nc = n // L.BLOCK_N
    step = _chunk_blocks(x2.shape[0], k, run.kc, nc, scratch_bytes, backend, run.exact, run.blockdiag)
    scratch = torch.empty(k * step * L.BLOCK_N * 3 // 2, dtype=torch.int8)
    b32 = bias.to(torch.float32) if bias is not None else None
    for a in range(0, nc, step):
        b = min(nc, a + step)
        out[:, a * L.BLOCK_N : b * L.BLOCK_N] = run.chunk(a, b, scratch, b32)
        counts[f"blocks_{backend}"] += run.kc * (b - a)
        counts[f"fma_{fma if fused else 'unfused'}"] += run.kc * (b - a)
    return out.reshape(*lead, n)


class _Run:
    """One call's fixed inputs (quantised activations, packed weight, chosen backend and FMA), and the work on one
    chunk of 32-row blocks: unpack, block products, accumulate in fp32."""

    def __init__(self, q_a, s_a, qweight, scales, zeros, group_size: int, backend: str, fma: str, fused: bool,
                 blockdiag: bool):
        self.q_a, self.s_a, self.qweight, self.scales, self.zeros = q_a, s_a, qweight, scales, zeros
        self.group_size, self.backend, self.fused, self.blockdiag = group_size, backend, fused, blockdiag
        self.exact = fused and fma == "exact"
        self.bk = L.block_k(group_size)
        self.kc = q_a.shape[1] // self.bk

    def chunk(self, a: int, b: int, scratch: torch.Tensor, b32: torch.Tensor | None) -> torch.Tensor:
        """fp32 [M, 32*(b-a)]: C for output rows 32a .. 32b-1, starting from the bias (or 0)."""
        g, m, cols = self.group_size, self.q_a.shape[0], (b - a) * L.BLOCK_N
        w = _centered_block(self.qweight, self.zeros, g, a, b, scratch, subtract=not self.blockdiag)
        if self.backend == "fp32":
            w = w.to(torch.float32)
        s_w = L.unpack_params(self.scales[a:b])
        z = None
        if self.blockdiag:
            z = L.unpack_params(self.zeros[a:b]).to(self.q_a.dtype if self.backend == "fp32" else torch.int32)
        c = torch.zeros(m, cols)
        if b32 is not None:
            c.copy_(b32[a * L.BLOCK_N : b * L.BLOCK_N].expand(m, cols))
        p = s = None
        if self.exact:
            p, s = torch.empty(m, cols, dtype=torch.float64), torch.empty(m, cols, dtype=torch.float64)
        for kb, t in enumerate(_block_products(self.q_a, self.s_a, w, z, self.bk, self.backend, self.blockdiag)):
            sw = s_w[kb * self.bk // g]
            if not self.fused:
                c.add_(t * sw)
            elif self.exact:
                fma_into(t, sw.to(torch.float64), c, p, s)
            else:
                c.addcmul_(t, sw)  # fma(t, sw, c) on this build: checked by addcmul_is_fma()
        return c
