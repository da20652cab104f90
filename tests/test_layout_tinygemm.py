"""The measured tinygemm layout: exact inverse of the op, hand-worked nibbles, other ISAs in subprocesses."""

import json
import subprocess
import sys

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm as tg

SHAPES = [(16, 64), (48, 128), (64, 256), (80, 96), (176, 256), (1024 + 48, 512), (256, 32)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_matches_op_and_unpack_inverts(n, k):
    layout = tg.probe()
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n + k), dtype=torch.uint8)
    packed = tg._op_pack(q)
    assert torch.equal(tg.pack(q, layout), packed)
    assert torch.equal(tg.unpack(packed, n, k, layout), q)


def test_row_blocks_pack_independently():
    """The converter packs row blocks of whole layout blocks: their bytes must be the rows of the whole packing."""
    layout = tg.probe()
    n, k = 5 * layout.block_n + 48 if layout.block_n > 48 else 5 * layout.block_n + 16, 128
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    whole = tg._op_pack(q)
    step = tg.row_block(layout, 2 * layout.block_n)
    for a in range(0, n, step):
        b = min(n, a + step)
        assert torch.equal(tg._op_pack(q[a:b]), whole[a:b])
        assert torch.equal(tg.unpack(whole, n, k, layout, rows=(a, b)), q[a:b])


def test_hand_worked_tail_nibbles():
    """A tail block (N % block_n rows) holds adjacent rows: byte j of k-row 0 is q[n0 + 2j, 0] | q[n0 + 2j + 1, 0] << 4."""
    layout = tg.probe()
    n, k = layout.block_n + 16, 2
    q = torch.zeros(n, k, dtype=torch.uint8)
    n0 = layout.block_n
    q[n0, 0], q[n0 + 1, 0], q[n0 + 2, 1] = 7, 12, 9
    packed = tg._op_pack(q).reshape(-1)
    tail = n0 * k // 2  # the tail block starts after the full block's bytes
    assert packed[tail] == 7 | (12 << 4)
    assert packed[tail + 8 + 1] == 9  # k=1 starts 16/2 = 8 bytes later; rows 2,3 are byte 1
    assert int(packed.sum()) == (7 | 12 << 4) + 9


def test_hand_worked_avx512_bytes():
    layout = tg.probe()
    if layout.block_n != 64:
        pytest.skip("this machine's tinygemm is not the AVX512 layout")
    q = torch.zeros(64, 2, dtype=torch.uint8)
    q[0, 0], q[32, 0], q[1, 1], q[33, 1], q[31, 0], q[63, 0] = 1, 2, 3, 4, 5, 6
    packed = tg._op_pack(q).reshape(-1)
    assert packed[0] == 0x21  # q[0,0] | q[32,0] << 4
    assert packed[31] == 0x65  # q[31,0] | q[63,0] << 4
    assert packed[32 + 1] == 0x43  # k=1 starts at byte 32; byte 1 holds rows 1 and 33
    assert int(packed.sum()) == 0x21 + 0x65 + 0x43


def test_kernel_matches_dequant_reference():
    """_weight_int4pack_mm_for_cpu vs x @ dequant(W).T in fp32: within bf16 output rounding (2^-8 relative)."""
    g = torch.Generator().manual_seed(0)
    for n, k, gs, m in [(96, 256, 32, 1), (176, 512, 128, 3), (64, 256, 256, 7), (128, 512, 64, 33)]:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        sz = torch.stack([torch.rand(k // gs, n, generator=g) * 0.05 + 0.01, torch.randn(k // gs, n, generator=g) * 0.05], -1).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        ref = x.float() @ tg.dequantize(q, sz, gs).T
        y = tg.mm(x, tg._op_pack(q), gs, sz).float()
        assert torch.allclose(y, ref, rtol=2**-7, atol=1e-2 * float(ref.abs().mean())), (n, k, gs, m)


def test_layout_json_roundtrip_and_tamper():
    layout = tg.probe()
    d = layout.to_json()
    assert tg.TinygemmLayout.from_json(d) == layout
    bad = json.loads(json.dumps(d))
    bad["perms"][str(layout.block_n)][0], bad["perms"][str(layout.block_n)][1] = bad["perms"][str(layout.block_n)][1], bad["perms"][str(layout.block_n)][0]
    with pytest.raises(EdgeqError, match="layout_hash does not match"):
        tg.TinygemmLayout.from_json(bad)


def test_value_and_shape_checks():
    with pytest.raises(EdgeqError, match="0..15"):
        tg.check_values(torch.tensor([[0, 16]]), "w")
    qw = torch.zeros(64, 64, dtype=torch.uint8)
    with pytest.raises(EdgeqError, match=r"scales_and_zeros: expected bf16 \[4, 64, 2\]"):
        tg.check_shapes("m", qw, torch.zeros(3, 64, 2, dtype=torch.bfloat16), 32)  # wrong K/G: the op reads out of bounds
    with pytest.raises(EdgeqError, match="multiple of the group size"):
        tg.check_shapes("m", qw, torch.zeros(1, 64, 2, dtype=torch.bfloat16), 256)
    assert tg.check_shapes("m", qw, torch.zeros(4, 64, 2, dtype=torch.bfloat16), 32) == (64, 128)


PROBE_SCRIPT = """
import json, torch
from edgeq.layouts import tinygemm as tg
L = tg.probe()
out = {"block_n": L.block_n, "cap": L.cpu_capability, "hash": L.layout_hash, "perms": L.to_json()["perms"]}
for n, k in [(16, 64), (80, 96), (208, 128), (240, 256)]:
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    assert torch.equal(tg.pack(q, L), tg._op_pack(q)), (n, k)
    assert torch.equal(tg.unpack(tg._op_pack(q), n, k, L), q), (n, k)
print(json.dumps(out))
"""


@pytest.mark.parametrize("cap,block_n,interleaved", [("avx2", 32, True), ("default", 32, False)])
@pytest.mark.slow
def test_other_isas_in_subprocess(cap, block_n, interleaved):
    env = {**__import__("os").environ, "ATEN_CPU_CAPABILITY": cap}
    res = subprocess.run([sys.executable, "-c", PROBE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["cap"].lower() == cap
    assert got["block_n"] == block_n
    full = got["perms"][str(block_n)]
    assert (full[1] == block_n // 2) == interleaved
    assert got["perms"]["16"] == list(range(16))  # tails: adjacent rows
    assert got["hash"] != tg.probe().layout_hash or tg.probe().cpu_capability.lower() == cap
