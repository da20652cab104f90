"""Streaming one GPTQ entry of an ingest plan (edgeq/convert/ingest_gptq.py) into the tinygemm layout, with the
exactness check of every repacked block, and the manifest's and CLI's record of what was done.

Per entry, in row blocks of whole layout blocks (about ``ROW_BLOCK_ELEMENTS`` outputs: the exactness check keeps a
few fp32 copies of a block): the layer's packed ``qweight`` is read once (N*K*bits/8 bytes), each block decoded
exactly (:func:`edgeq.layouts.gptq.decode_gptq`), then

- ``repack``: :func:`edgeq.layouts.gptq.to_tinygemm` (q kept, ``scale = s``, ``zero = (8 - z) s`` in bf16), packed
  with the kernel's op, and checked against GPTQ's dequantisation within :data:`BOUND` (:func:`_check_exact`);
- ``requantize``: dequantised exactly and quantised again with the entry's method;
- ``keep``: stored as its exact dequantisation in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from edgeq.convert.plan import Plan, PlanEntry
from edgeq.errors import EdgeqError
from edgeq.io.hf import Checkpoint
from edgeq.io.safetensors import ShardedWriter
from edgeq.keys import Action
from edgeq.layouts import tinygemm
from edgeq.layouts.gptq import GPTQLinear, decode_gptq, to_tinygemm
from edgeq.quantize.rtn import quantize_groups
from edgeq.scheme import Scheme

BOUND = "|w_edgeq - w_gptq| <= 2^-8 * |s| * (|q - 8| + |8 - z|) <= |s| / 16 per element (bf16 scale and zero)"
ROW_BLOCK_ELEMENTS = 1 << 20  # outputs per block ~1M weights: the exactness check keeps a few fp32 copies of a block

Progress = Callable[[int, str], None]


@dataclass(frozen=True)
class EntryStats:
    """What streaming one GPTQ entry measured. rel_error: ||w_out - w_in|| / ||w_in|| against the input's exact
    dequantisation; for repacked layers also the largest |w_out - w_in| as a fraction of the bound and of |scale|."""

    rel_error: float
    max_over_bound: float = 0.0
    max_over_scale: float = 0.0


def _row_step(e: PlanEntry, layout: tinygemm.TinygemmLayout) -> int:
    n, k = e.shape
    return min(n, tinygemm.row_block(layout, ROW_BLOCK_ELEMENTS // k))


def _decode_rows(e: PlanEntry, t: tuple, a: int, b: int) -> GPTQLinear:
    """Outputs a..b of one GPTQ layer (a, b multiples of the 32/bits outputs per qzeros word)."""
    src = e.gptq
    qweight, qzeros, scales, g_idx = t
    pf = 32 // src.bits
    try:
        return decode_gptq(e.module, qweight[:, a:b].contiguous(), qzeros[:, a // pf : b // pf].contiguous(),
                           scales[:, a:b].contiguous(), g_idx, bits=src.bits, group_size=src.group_size, sym=src.sym,
                           checkpoint_format=src.checkpoint_format)
    except EdgeqError as err:
        if (a, b) == (0, e.shape[0]):
            raise
        raise EdgeqError(f"{err} [output indices relative to row {a} of {e.module}]") from None


def stream_entry(ckpt: Checkpoint, e: PlanEntry, scheme: Scheme, layout: tinygemm.TinygemmLayout, writer: ShardedWriter,
                 progress: Progress) -> EntryStats:
    """Write one GPTQ entry (repack / requantize / keep) in row blocks of whole layout blocks."""
    src = e.gptq
    t = (ckpt.read(src.qweight), ckpt.read(src.qzeros), ckpt.read(src.scales),
         ckpt.read(src.g_idx) if src.g_idx else None)
    n, k = e.shape
    g = e.group(scheme)  # a module's own group size (GPTQModel's dynamic), else the scheme's
    step = _row_step(e, layout)
    sq_err = sq_norm = 0.0
    worst_bound = worst_scale = 0.0
    sz_parts, perm = [], None
    for a in range(0, n, step):
        b = min(n, a + step)
        lin = _decode_rows(e, t, a, b)
        if e.action == Action.KEEP:
            writer.write(e.name, lin.dequantize(torch.bfloat16))
        elif e.action == Action.REQUANTIZE:
            w = lin.dequantize()
            qt = quantize_groups(w, g, e.method, name=f"{e.module} rows {a}..{b}")
            tinygemm.check_values(qt.q, e.module)
            writer.write(f"{e.module}.qweight", tinygemm._op_pack(qt.q))
            sz_parts.append(qt.scales_and_zeros)
            sq_err += float(qt.sq_error.sum())
            sq_norm += float(qt.sq_norm.sum())
        else:
            tw = to_tinygemm(lin, g, allow_split=src.group_size not in tinygemm.GROUP_SIZES)
            if (tw.perm is not None) != e.perm or (perm is not None and not torch.equal(perm, tw.perm)):
                raise EdgeqError(f"{e.module}: the input permutation changed between the plan and the data; the checkpoint changed while being read?")
            perm = tw.perm
            tinygemm.check_values(tw.q, e.module)
            writer.write(f"{e.module}.qweight", tinygemm._op_pack(tw.q))
            sz_parts.append(tw.scales_and_zeros)
            stats = _check_exact(e.module, lin, tw, a)
            sq_err, sq_norm = sq_err + stats[0], sq_norm + stats[1]
            worst_bound, worst_scale = max(worst_bound, stats[2]), max(worst_scale, stats[3])
        progress(e.bytes_in * (b - a) // n, e.name)
    if e.action != Action.KEEP:
        writer.write(f"{e.module}.scales_and_zeros", torch.cat(sz_parts, dim=1))
    if perm is not None:
        writer.write(f"{e.module}.perm", perm.to(torch.int64).contiguous())
    rel = (sq_err / sq_norm) ** 0.5 if sq_norm > 0 else 0.0
    return EntryStats(rel, worst_bound, worst_scale)


def _check_exact(module: str, lin: GPTQLinear, tw, row0: int) -> tuple[float, float, float, float]:
    """Check a repacked block against GPTQ's dequantisation, and measure it, from the parameters (O(K + N*K/G)).

    With d = q - 8 and c = 8 - z, GPTQ's weight is (d + c) s and edgeq's is d s' + z' (s', z' the stored bf16 scale
    and zero), so the error of every element is ``d (s' - s) + (z' - c s)``: it lives in the parameters alone, once
    the columns are grouped as g_idx says. Hence three checks cover every element exactly:

    1. ``g_idx[perm] == k // G_src``: after the permutation every column sits in its own group (q moves with it);
    2. ``|s' - s| <= 2^-8 |s|`` and ``|z' - c s| <= 2^-8 |c s|`` per (group, output), in float64 (exact here);
    3. then ``|d (s' - s) + (z' - c s)| <= 2^-8 |s| (|d| + |c|)``, the stated bound, for every d.

    A violation would be a bug and raises. Returns (sum sq error, sum sq norm, largest error / bound, largest error
    / |s|); the last two are upper bounds from the parameters (the error at the group's largest |q - 8|), the sums
    are exact, from per-group sums of d and d^2."""
    n, k = tw.q.shape
    g, g_src = tw.group_size, lin.group_size
    gi = lin.g_idx if tw.perm is None else lin.g_idx[tw.perm]
    if not torch.equal(gi, torch.arange(k) // g_src):
        raise EdgeqError(f"{module}: after the permutation some column is outside its group; this is a bug in edgeq, please report it")
    parent = torch.arange(k // g) * g // g_src  # the checkpoint's group of each tinygemm group (split: repeated)
    s, c = lin.scales.double()[parent], 8.0 - lin.zeros.double()[parent]  # [Gt, N]
    sz = tw.scales_and_zeros.double()
    es, ez = (sz[..., 0] - s).abs(), (sz[..., 1] - c * s).abs()
    unit = 2.0**-8 * s.abs()
    bad = (es > unit) | (ez > unit * c.abs())
    if bool(bad.any()):
        j, r = (int(v) for v in torch.nonzero(bad)[0])
        raise EdgeqError(
            f"{module}: stored scale/zero of group {j}, output {row0 + r} ({float(sz[j, r, 0])}, {float(sz[j, r, 1])}) are "
            f"not the bf16 roundings of GPTQ's ({float(s[j, r])}, {float(c[j, r] * s[j, r])}); this is a bug in edgeq, please report it"
        )
    d = tw.q.reshape(n, k // g, g).to(torch.int32) - 8
    s1, s2 = d.sum(-1).t().double(), (d * d).sum(-1).t().double()  # [Gt, N]
    dmax = d.abs().amax(-1).t().double() if d.numel() else s1
    sez = (sz[..., 1] - c * s)
    ses = (sz[..., 0] - s)
    sq_err = float((s2 * ses * ses + 2 * s1 * ses * sez + g * sez * sez).sum())
    sq_norm = float(((s2 + 2 * c * s1 + g * c * c) * s * s).sum())
    tiny = torch.finfo(torch.float64).tiny
    over_bound = float(torch.maximum(es / unit.clamp_min(tiny), ez / (unit * c.abs()).clamp_min(tiny)).max()) if es.numel() else 0.0
    over_scale = float(((dmax * es + ez) / s.abs().clamp_min(tiny)).max()) if es.numel() else 0.0
    return sq_err, sq_norm, over_bound, over_scale


def ingest_summary(plan: Plan, stats: dict[str, EntryStats]) -> dict:
    """The manifest's GPTQ-ingest record: source settings, exactness, what was requantised or kept, and why."""
    repacked = [e for e in plan.entries if e.action == Action.REPACK]
    return {
        "source": plan.source,
        "exactness": {
            "bound": BOUND,
            "repacked_modules": len(repacked),
            "max_error_over_bound": max((stats[e.module].max_over_bound for e in repacked), default=0.0),
            "max_error_over_scale": max((stats[e.module].max_over_scale for e in repacked), default=0.0),
        },
        "requantized_modules": {e.module: e.reason for e in plan.entries if e.action == Action.REQUANTIZE},
        "float_quantized_modules": {e.module: e.reason for e in plan.entries if e.action == Action.QUANTIZE},
    }


def describe(plan: Plan) -> list[str]:
    """One line per reported choice (the CLI prints them)."""
    lines = []
    src = plan.source
    rep = sum(e.action == Action.REPACK for e in plan.entries)
    perm = sum(e.perm for e in plan.entries)
    lines.append(f"GPTQ input ({src.get('checkpoint_format')}, {src.get('bits')}-bit g{src.get('group_size')}, "
                 f"sym={src.get('sym')}, desc_act={src.get('desc_act')}): {rep} layers repacked exactly"
                 + (f", {perm} with an input permutation (M.perm)" if perm else ""))
    for e in plan.entries:
        if e.action == Action.QUANTIZE or (e.gptq is not None and e.action in (Action.REQUANTIZE, Action.KEEP)):
            lines.append(f"{e.module}: {e.action}: {e.reason}")
    dropped = src.get("dropped_zero_biases") or []
    if dropped:
        lines.append(f"left out {len(dropped)} all-zero bias tensor(s) of layers this architecture has no bias for "
                     f"(an old AutoGPTQ export habit), e.g. {dropped[0]}")
    return lines
