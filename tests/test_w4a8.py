"""W4A8: quantiser, the kernel's packed layout, exact FMA emulation, and the bit-exact portable path.

References here are written independently of the code under test: packed bytes from the layout's formula by plain
loops, activation quantisation with numpy float32, and the whole kernel arithmetic with exact rationals (Fraction)
rounded to fp32 by hand, so "bit for bit" is checked against arithmetic, not against the implementation.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.layouts import w4a8 as L
from edgeq.runtime import w4a8_compute as C
from edgeq.quantize.w4a8 import (
    dequantize_w4a8,
    fma_f32,
    group_sq_error,
    quantize_activations,
    quantize_w4a8,
)

# --- independent references -----------------------------------------------------------------------------------------


def round_f32(x: Fraction) -> float:
    """Round an exact rational to the nearest fp32 (ties to even), subnormals included."""
    if x == 0:
        return 0.0
    sign, a = (-1.0 if x < 0 else 1.0), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    q, r = divmod(a, ulp)
    if r > ulp / 2 or (r == ulp / 2 and q % 2 == 1):
        q += 1
    return sign * float(q * ulp)


def f32(v) -> float:
    return float(np.float32(v))


def exact_fma(a: float, b: float, c: float) -> float:
    return round_f32(Fraction(a) * Fraction(b) + Fraction(c))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, round to nearest even (finite values)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def ref_activations(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    xf = x.float().numpy()
    amax = np.maximum(np.abs(xf).max(axis=1), np.float32(1e-7))
    inv = np.float32(127) / amax
    return np.rint(xf * inv[:, None]).astype(np.int64), amax / np.float32(127)


def ref_kernel(x, q, zeros, scales, g, bias=None, fused=True) -> np.ndarray:
    """fp32 C [M, N] of the kernel arithmetic, one element at a time, with exact rationals for the FMA."""
    qa, sa = ref_activations(x)
    m, k = qa.shape
    n = q.shape[0]
    w = q.numpy().astype(np.int64) - np.repeat(zeros.numpy().astype(np.int64).T, g, axis=1)  # [N, K]
    s = scales.numpy()
    out = np.zeros((m, n), dtype=np.float32)
    for i in range(m):
        for j in range(n):
            c = float(bias[j]) if bias is not None else 0.0
            for kb in range(k // g):
                acc = int(qa[i, kb * g : (kb + 1) * g] @ w[j, kb * g : (kb + 1) * g])
                t = f32(np.float32(acc) * sa[i])
                sw = float(s[kb, j])
                c = exact_fma(t, sw, c) if fused else f32(np.float32(np.float32(t) * np.float32(sw)) + np.float32(c))
            out[i, j] = c
    return out


def quantised(n, k, g, seed=0, method="rtn"):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return w, quantize_w4a8(w, g, name="test.weight", method=method)


def packed(qw):
    return L.pack(qw.q, qw.scales, qw.zeros, qw.group_size)


# --- layout: hand-worked bytes ----------------------------------------------------------------------------------------


def test_pack_hand_worked_sparse_block():
    """32 x 32, G = 32, z = 3 everywhere, four nonzero weights: every byte of the 640-byte slot is known."""
    q = torch.zeros(32, 32, dtype=torch.uint8)
    q[17, 2], q[25, 2] = 5, 9  # rows 17 / 25 share byte j = 9 (c(9) = 17), k = 2: kg 0, ki 2 -> byte 9*4 + 2 = 38
    q[3, 29], q[11, 29] = 7, 12  # rows 3 / 11: j = 3, k = 29: kg 7, ki 1 -> byte 7*64 + 3*4 + 1 = 461
    zeros = torch.full((1, 32), 3, dtype=torch.int8)
    scales = torch.ones(1, 32)
    p = L.pack(q, scales, zeros, 32)
    assert list(p.qweight.shape) == [1, 1, 32 * 16 + 128]
    want = bytearray(512)
    want[38] = 0x95
    want[461] = 0xC7
    comp = [-96] * 32  # sum over 32 inputs of (q - 3)
    comp[17], comp[25], comp[3], comp[11] = -91, -87, -89, -84
    want += struct.pack("<32i", *comp)
    assert bytes(p.qweight.reshape(-1).tolist()) == bytes(want)


def test_pack_hand_worked_dense_bytes():
    """q[n, k] = (n + 2k) % 16 on one 32 x 32 block: spot bytes from the docstring's worked example."""
    n_idx, k_idx = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    q = ((n_idx + 2 * k_idx) % 16).to(torch.uint8)
    p = L.pack(q, torch.ones(1, 32), torch.zeros(1, 32, dtype=torch.int8), 32).qweight.reshape(-1)
    byte = lambda lo_n, hi_n, k: int(q[lo_n, k]) | int(q[hi_n, k]) << 4  # noqa: E731
    assert int(p[0]) == byte(0, 8, 0) == 0x80
    assert int(p[1]) == byte(0, 8, 1) == 0xA2
    assert int(p[4]) == byte(1, 9, 0) == 0x91
    assert int(p[28]) == byte(7, 15, 0) == 0xF7
    assert int(p[32]) == byte(16, 24, 0) == 0x80
    assert int(p[63]) == byte(23, 31, 3) == 0x5D
    assert int(p[64]) == byte(0, 8, 4) == 0x08
    assert int(p[511]) == byte(23, 31, 31) == 0xD5


def test_pack_matches_layout_formula_by_loops():
    """Every byte of a 64 x 256 (G = 64 and 128) packing against the formula written as plain loops."""
    gen = torch.Generator().manual_seed(3)
    for g in (64, 128):
        n, k = 64, 256
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        z = torch.randint(0, 16, (k // g, n), generator=gen).to(torch.int8)
        p = L.pack(q, torch.rand(k // g, n, generator=gen), z, g).qweight
        qn, zn, pn = q.numpy().astype(int), z.numpy().astype(int), p.numpy()
        bk = min(g, 128)
        for nb in range(n // 32):
            for kb in range(k // bk):
                slot = pn[nb, kb]
                for kg in range(bk // 4):
                    for j in range(16):
                        c = j if j < 8 else j + 8
                        for ki in range(4):
                            kk = kb * bk + 4 * kg + ki
                            want = qn[32 * nb + c, kk] | qn[32 * nb + c + 8, kk] << 4
                            assert slot[kg * 64 + j * 4 + ki] == want
                comp = np.frombuffer(slot[bk * 16 :].tobytes(), dtype="<i4")
                rows = qn[32 * nb : 32 * nb + 32, kb * bk : (kb + 1) * bk]
                assert comp.tolist() == (rows.sum(1) - bk * zn[kb * bk // g, 32 * nb : 32 * nb + 32]).tolist()


@pytest.mark.parametrize("g", [32, 64, 128])
def test_pack_unpack_round_trip(g):
    _, qw = quantised(96, 384, g, seed=g)
    p = packed(qw)
    assert list(p.qweight.shape) == [3, 384 // g, g * 16 + 128]
    assert list(p.scales.shape) == list(p.zeros.shape) == [3, 384 // g, 32]
    assert p.shape == (96, 384)
    assert torch.equal(L.unpack(p.qweight, g), qw.q)
    assert torch.equal(L.unpack(p.qweight, g, blocks=(1, 3)), qw.q[32:96])
    assert torch.equal(L.unpack(p.qweight, g, blocks=(2, 3)), qw.q[64:96])
    assert torch.equal(L.unpack_params(p.scales), qw.scales)
    assert torch.equal(L.unpack_params(p.zeros), qw.zeros)
    assert torch.equal(L.unpack_compensation(p.qweight, g), L.compensation(qw.q, qw.zeros, g))
    # a buffer at an odd byte offset (as inside a memory-mapped file) unpacks the same
    buf = torch.empty(p.qweight.numel() + 1, dtype=torch.uint8)
    buf[1:] = p.qweight.reshape(-1)
    assert torch.equal(L.unpack(buf[1:].view(p.qweight.shape), g, blocks=(1, 2)), qw.q[32:64])
    # row blocks pack independently: the bytes of rows 32a..32b are rows a..b of the whole packing
    part = L.pack(qw.q[32:64], qw.scales[:, 32:64], qw.zeros[:, 32:64], g)
    assert torch.equal(part.qweight, p.qweight[1:2]) and torch.equal(part.scales, p.scales[1:2])


def test_fingerprint():
    fp = L.fingerprint(128)
    assert fp["op"] == L.LAYOUT_NAME == "amx_w4a8" and L.KERNEL == "amx_w4a8"
    assert fp["block_n"] == 32 and fp["block_k"] == 128 and fp["vnni"] == 4 and fp["version"] == 1
    assert L.fingerprint(32)["block_k"] == 32
    assert len(fp["layout_hash"]) == 64 and fp["layout_hash"] == L.fingerprint(64)["layout_hash"]


# --- activations --------------------------------------------------------------------------------------------------------


def test_activation_quant_hand_worked():
    q, s = quantize_activations(torch.tensor([[0.5, 1.0, -2.0, 0.25], [127.0, 2.5, 3.5, -2.5], [0.0, 0.0, 0.0, 0.0]]))
    # row 0: 127/2 = 63.5: 1.0 -> 63.5, a tie, goes to the even 64; row 1: 127/127 = 1: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2
    assert q.tolist() == [[32, 64, -127, 16], [127, 2, 4, -2], [0, 0, 0, 0]]
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert s.tolist() == [f32(np.float32(2) / np.float32(127)), 1.0, f32(np.float32(1e-7) / np.float32(127))]


def test_activation_quant_matches_numpy_float32():
    x = (torch.randn(16, 256, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 2, 16).unsqueeze(1)).bfloat16()
    q, s = quantize_activations(x)
    qr, sr = ref_activations(x)
    assert np.array_equal(q.numpy().astype(np.int64), qr) and np.array_equal(s.numpy(), sr)
    assert int(q.abs().max()) == 127


# --- exact FMA ------------------------------------------------------------------------------------------------------------


def test_fma_differs_from_mul_then_add_and_is_exact():
    one = 1.0 + 2.0**-12  # one * one = 1 + 2^-11 + 2^-24, exactly half an fp32 ulp above 1 + 2^-11
    a = torch.tensor([one, one, 2.0**-75 * (1 + 2.0**-20)])
    b = torch.tensor([one, one, 2.0**-75 * (1 - 2.0**-20)])
    c = torch.tensor([-1.0, 2.0**-80, (2**22 + 1) * 2.0**-149])  # the last is an fp32 subnormal
    got = fma_f32(a, b, c).tolist()
    want = [exact_fma(float(a[i]), float(b[i]), float(c[i])) for i in range(3)]
    assert got == want
    assert want[0] == 2.0**-11 + 2.0**-24
    mul_add = (a * b + c).tolist()  # two roundings
    assert mul_add[0] == 2.0**-11 != want[0]
    naive64 = (a.double() * b.double() + c.double()).float().tolist()  # float64 then fp32: rounds twice
    assert naive64[1] != want[1] and naive64[2] != want[2]
    assert want[1] == 1.0 + 2.0**-11 + 2.0**-23 and want[2] == (2**22 + 1) * 2.0**-149


def test_fma_random_wide_range_against_rationals():
    g = torch.Generator().manual_seed(11)
    n = 3000
    def wide(lo, hi):
        return (torch.randn(n, generator=g) * torch.exp2(torch.randint(lo, hi, (n,), generator=g).float())).float()
    a, b, c = wide(-70, 30), wide(-70, 30), wide(-149, 40)
    c[::7] = -(a[::7].double() * b[::7].double()).float()  # near-cancellation
    got = fma_f32(a, b, c)
    want = torch.tensor([exact_fma(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_addcmul_probe_agrees_with_emulation():
    if not C.addcmul_is_fma():
        pytest.skip("this torch build's addcmul is not fused; the exact float64 emulation is used instead")
    t, sw, c = C._fma_probe_case(4, 300, torch.Generator().manual_seed(9))
    assert torch.equal(c.clone().addcmul_(t, sw), fma_f32(t, sw.expand(4, 300), c))


# --- the portable path, bit for bit -----------------------------------------------------------------------------------


def _variants():
    """Backends x FMA methods x product strategies (block-diagonal products for M * K/bk <= blockdiag_rows, else
    per K block)."""
    yield {"backend": "int_mm", "fma": "exact"}
    yield {"backend": "fp32", "fma": "exact", "blockdiag_rows": 0}
    if C.addcmul_is_fma():
        yield {"backend": "int_mm", "fma": "addcmul", "blockdiag_rows": 0}
        yield {"backend": "fp32", "fma": "addcmul", "scratch_bytes": 1}


@pytest.mark.parametrize("g", [32, 64, 128])
def test_portable_path_bit_exact_against_rational_reference(g):
    _, qw = quantised(64, 256, g, seed=20 + g)
    p = packed(qw)
    gen = torch.Generator().manual_seed(g)
    x = (torch.randn(3, 256, generator=gen) * torch.tensor([[1.0], [30.0], [0.01]])).bfloat16()
    bias = torch.randn(64, generator=gen).bfloat16() if g != 64 else None
    want32 = ref_kernel(x, qw.q, qw.zeros, qw.scales, g, bias=bias)
    for v in _variants():
        y32 = C.w4a8_linear(x, p.qweight, p.scales, p.zeros, g, bias, out_dtype=torch.float32, **v)
        assert np.array_equal(y32.numpy().view(np.uint32), want32.view(np.uint32)), v
        y = C.w4a8_linear(x, p.qweight, p.scales, p.zeros, g, bias, **v)
        assert y.dtype == torch.bfloat16 and np.array_equal(y.view(torch.int16).numpy().view(np.uint16), bf16_bits(want32)), v


def test_fused_multiply_add_matters_in_the_portable_path():
    _, qw = quantised(64, 512, 64, seed=4)
    p = packed(qw)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(8)).bfloat16()
    fused = C.w4a8_linear(x, p.qweight, p.scales, p.zeros, 64, out_dtype=torch.float32)
    unfused = C.w4a8_linear(x, p.qweight, p.scales, p.zeros, 64, out_dtype=torch.float32, fused=False)
    assert not torch.equal(fused, unfused)  # fp32 results differ in some last bits
    want = ref_kernel(x, qw.q, qw.zeros, qw.scales, 64, fused=False)
    assert np.array_equal(unfused.numpy().view(np.uint32), want.view(np.uint32))


def test_portable_path_fp32_input_and_leading_dims():
    _, qw = quantised(32, 128, 32, seed=6)
    p = packed(qw)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(1))
    y = C.w4a8_linear(x, p.qweight, p.scales, p.zeros, 32, out_dtype=torch.float32)
    assert list(y.shape) == [2, 3, 32]
    want = ref_kernel(x.reshape(6, 128), qw.q, qw.zeros, qw.scales, 32)
    assert np.array_equal(y.reshape(6, 32).numpy().view(np.uint32), want.view(np.uint32))


def test_portable_path_agrees_with_float_reference_within_activation_quantisation():
    """|y - x @ w_hat.T - b| <= 0.5 * s_a * sum_k |w_hat| (int8 rounding of x) + bf16 output rounding."""
    w, qw = quantised(256, 512, 128, seed=7)
    p = packed(qw)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 512, generator=gen).bfloat16()
    bias = torch.randn(256, generator=gen) * 0.1
    y = C.w4a8_linear(x, p.qweight, p.scales, p.zeros, 128, bias).double()
    w_hat = dequantize_w4a8(qw.q, qw.scales, qw.zeros, 128, dtype=torch.float64)
    ref = x.double() @ w_hat.T + bias.double()
    _, s_a = quantize_activations(x)
    bound = 0.5 * s_a.double().unsqueeze(1) * w_hat.abs().sum(1) + ref.abs() * 2.0**-8 + 1e-6
    assert bool(((y - ref).abs() <= bound).all())
    rel = float((y - ref).norm() / ref.norm())
    assert rel < 0.02
    # and the whole W4A8 error against the original float weights stays small
    assert float((y - (x.double() @ w.double().T + bias.double())).norm() / ref.norm()) < 0.15


def test_counters_name_the_path():
    _, qw = quantised(64, 128, 64, seed=9)
    p = packed(qw)
    x = torch.randn(2, 128).bfloat16()
    before = dict(C.PROCESS_COUNTS)
    C.w4a8_linear(x, p.qweight, p.scales, p.zeros, 64, backend="fp32", fma="exact")
    assert C.PROCESS_COUNTS["w4a8_linear"] == before.get("w4a8_linear", 0) + 1
    assert C.PROCESS_COUNTS["blocks_fp32"] == before.get("blocks_fp32", 0) + 2 * 2  # 2 row blocks x 2 K blocks
    assert C.PROCESS_COUNTS["fma_exact"] == before.get("fma_exact", 0) + 4
    own = Counter()  # a caller's own counter gets the same steps, and the process's none of them
    C.w4a8_linear(x, p.qweight, p.scales, p.zeros, 64, backend="fp32", fma="exact", counts=own)
    assert own == Counter({"w4a8_linear": 1, "blocks_fp32": 4, "fma_exact": 4})
    assert C.PROCESS_COUNTS["w4a8_linear"] == before.get("w4a8_linear", 0) + 1


# --- quantiser --------------------------------------------------------------------------------------------------------------


def test_quantiser_hand_worked_group():
    w = torch.tensor([-1.0, 0.0, 0.5, 2.0] * 8).unsqueeze(0)  # K = 32, one group
    qw = quantize_w4a8(w, 32, method="minmax")
    # s = 3/15, z = round(1/s) = 5; w/s = [-5, 0, 2.5, 10] -> ties to even: [-5, 0, 2, 10]
    assert qw.q[0, :4].tolist() == [0, 5, 7, 15] and qw.zeros.tolist() == [[5]]
    assert qw.scales.item() == f32(np.float32(3.0) / np.float32(15.0))


def test_quantiser_outputs_and_row_blocks():
    w = torch.randn(70, 256, generator=torch.Generator().manual_seed(12)).bfloat16()
    w[3, :64] = 0.0  # an all-zero group dequantises to exact zeros
    a = quantize_w4a8(w, 64)
    b = quantize_w4a8(w, 64, row_block=7)
    assert torch.equal(a.q, b.q) and torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)
    assert a.q.dtype == torch.uint8 and a.scales.dtype == torch.float32 and a.zeros.dtype == torch.int8
    assert list(a.q.shape) == [70, 256] and list(a.scales.shape) == list(a.zeros.shape) == [4, 70]
    assert int(a.q.max()) <= 15 and 0 <= int(a.zeros.min()) and int(a.zeros.max()) <= 15 and bool((a.scales > 0).all())
    w_hat = dequantize_w4a8(a.q, a.scales, a.zeros, 64)
    assert bool((w_hat[3, :64] == 0).all())
    assert bool((w_hat[w.float() == 0] == 0).all())  # zero lies on the grid: integer zero point


def test_clipping_never_worse_than_minmax_per_group():
    g = torch.Generator().manual_seed(13)
    w = torch.randn(128, 512, generator=g) * torch.exp(torch.randn(128, 512, generator=g))  # heavy tails
    clip = quantize_w4a8(w, 128)
    mm = quantize_w4a8(w, 128, method="minmax")
    e_clip, e_mm = group_sq_error(w, clip), group_sq_error(w, mm)
    assert bool((e_clip <= e_mm * (1 + 1e-12)).all())
    assert float(e_clip.sum()) < 0.97 * float(e_mm.sum())  # measured: 0.95
    assert bool((clip.scales <= mm.scales).all())


# --- errors ---------------------------------------------------------------------------------------------------------------


def test_quantiser_errors_name_the_tensor():
    w = torch.randn(8, 64)
    w[3, 5] = float("nan")
    with pytest.raises(EdgeqError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: NaN/Inf in the weight \(first at row 3; 1 in rows 0\.\.7\)"):
        quantize_w4a8(w, 32, name="model.layers.0.mlp.up_proj.weight")
    w[3, 5] = float("inf")
    with pytest.raises(EdgeqError, match=r"lm_head\.weight: NaN/Inf in the weight \(first at row 3; 1 in rows 2\.\.3\)"):
        quantize_w4a8(w, 32, name="lm_head.weight", row_block=2)
    with pytest.raises(EdgeqError, match=r"group size 256 is not supported"):
        quantize_w4a8(torch.randn(8, 256), 256, name="x")
    with pytest.raises(EdgeqError, match=r"x \[8, 96\]: K=96 is not a multiple of the group size 64"):
        quantize_w4a8(torch.randn(8, 96), 64, name="x")
    with pytest.raises(EdgeqError, match=r"unknown method 'gptq'"):
        quantize_w4a8(torch.randn(8, 64), 32, method="gptq")


def test_layout_shape_errors_give_the_numbers():
    q = torch.zeros(40, 64, dtype=torch.uint8)
    with pytest.raises(EdgeqError, match=r"w \[40, 64\]: N=40 is not a multiple of 32"):
        L.pack(q, torch.ones(2, 40), torch.zeros(2, 40, dtype=torch.int8), 32, name="w")
    q = torch.zeros(32, 96, dtype=torch.uint8)
    with pytest.raises(EdgeqError, match=r"w \[32, 96\]: K=96 is not a multiple of the K block 64 \(group size 64\)"):
        L.pack(q, torch.ones(1, 32), torch.zeros(1, 32, dtype=torch.int8), 64, name="w")
    q = torch.zeros(32, 64, dtype=torch.uint8)
    with pytest.raises(EdgeqError, match=r"w\.scales: expected \[2, 32\]"):
        L.pack(q, torch.ones(1, 32), torch.zeros(2, 32, dtype=torch.int8), 32, name="w")
    q[0, 0] = 16
    with pytest.raises(EdgeqError, match=r"w\.q: values must lie in 0\.\.15, got 0\.\.16"):
        L.pack(q, torch.ones(2, 32), torch.zeros(2, 32, dtype=torch.int8), 32, name="w")
    _, qw = quantised(32, 64, 32)
    p = packed(qw)
    with pytest.raises(EdgeqError, match=r"m\.scales: expected torch\.float32 \[1, 2, 32\] for N=32, K=64, G=32"):
        L.check_packed("m", p.qweight, p.scales[:, :1], p.zeros, 32)
    with pytest.raises(EdgeqError, match=r"m\.qweight: expected uint8 \[N/32, K/64, 1152\]"):
        L.check_packed("m", p.qweight, p.scales, p.zeros, 64)
    with pytest.raises(EdgeqError, match=r"expected x bf16/fp32 \[\.\.\., 64\], got torch\.bfloat16 \[1, 32\]"):
        C.w4a8_linear(torch.zeros(1, 32).bfloat16(), p.qweight, p.scales, p.zeros, 32)
    with pytest.raises(EdgeqError, match=r"bias: expected \[32\], got \[16\]"):
        C.w4a8_linear(torch.zeros(1, 64), p.qweight, p.scales, p.zeros, 32, torch.zeros(16))
