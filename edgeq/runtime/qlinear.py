"""edgeq's quantised Linear: one packed buffer, two compute paths.

- decode (M < crossover): the int4 kernel reads the packed bytes as they are (``tinygemm.mm``, or the native kernel
  when ``edgeq.runtime.native`` exists and supports the layout);
- prefill (M >= crossover): the weight is dequantised a row block at a time into a bf16 scratch buffer shared by
  every layer of the model, and each block goes through a bf16 GEMM. No second copy of any weight persists.

Dequantisation (the same numbers as ``tinygemm.dequantize``: fp32 arithmetic, one rounding to bf16)::

    w[n, k] = (q[n, k] - 8) * scale[k // G, n] + zero[k // G, n]

For the fast path the packed bytes of ``c`` full row blocks of ``s`` rows are viewed as ``[K, c, s/2]`` (they are
k-major within a block): the low nibbles hold the rows ``perm[0::2]``, the high nibbles ``perm[1::2]``. When the
measured permutation is "halves" (``perm = [0, s/2, 1, s/2+1, ...]``, AVX512/AVX2 full blocks) or "adjacent"
(``perm = [0, 1, 2, ...]``) the nibbles land in row order with two strided writes, so the block is produced directly
as W^T ``[K, rows]``, then ``addcmul(zero, q - 8, scale)`` in place (bf16 storage, fp32 arithmetic) and the GEMM
``x @ W^T``. Five elementwise passes per block, few enough that the path stays ahead of the kernel even when the
cores are shared. Any other permutation and tail blocks go through
``tinygemm.unpack`` (exact, slower). Worked example (AVX512, s = 64): byte 0 of a block is ``q[0, 0] | q[32, 0] << 4``,
so the fast path writes ``q[0, 0]`` to W^T[0, 0] and ``q[32, 0]`` to W^T[0, 32].

Head levels (``--head-levels 2``, manifest ``head.levels``): the output head also sums the packed embedding's residual
level, a second :class:`Int4Linear` over the residual's tensors (``Int4Linear.residual_levels``), each level through
the path its M selects (see :meth:`Int4Linear._linear2d_levels` for the formula and its tolerance).
"""

# size: the W4A16 module, its two paths, the head's levels and its swap (the layout's runtime_class.swap_in) are one
# unit; splitting the swap out would import Int4Linear back into it.

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from edgeq.errors import EdgeqError
from edgeq.io import skeleton
from edgeq.layouts import tinygemm
from edgeq.layouts.tinygemm import TinygemmLayout
from edgeq.runtime import crossover
from edgeq.runtime.embedding import stored_level
from edgeq.runtime.sizes import format_bytes
from edgeq.runtime.swap import SwapResult, packed_shape_error

# The block rule lives in edgeq.memory so that inspect's projection and the runtime cannot disagree.
from edgeq.memory import rows_per_block  # noqa: E402


def _native():
    """``edgeq.runtime.native`` if it exists and works here, else None (written by another engineer; optional)."""
    try:
        from edgeq.runtime import native  # noqa: PLC0415
    except ImportError:
        return None
    try:
        return native if native.available() else None
    except EdgeqError:  # a bad EDGEQ_NATIVE_ISA is the user's error: say so (exit 2), never fall back quietly
        raise
    except Exception:  # a broken build must not stop the aten path
        return None


class Scratch:
    """One set of reusable buffers for the prefill path, shared by all quantised layers of a model.

    Sized at load to the largest block any layer asks for (never more than that layer's whole weight), so the
    bound is ``max over layers of min(N, rows_per_block) * K`` elements times 3 bytes (bf16 + uint8 staging).
    """

    def __init__(self, elems: int):
        self.elems = elems
        self.bf16 = torch.empty(elems, dtype=torch.bfloat16)
        self.u8 = torch.empty(elems, dtype=torch.uint8)
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.elems * 3


@dataclass
class Runtime:
    """State shared by every quantised module of one loaded model (paths, threshold, counters, scratch)."""

    layout: TinygemmLayout
    prefill_threshold: int = 32
    counts: Counter = field(default_factory=Counter)
    scratch: Scratch | None = None
    native: object | None = None

    _gathered: tuple | None = None

    @property
    def decode_path(self) -> str:
        return "native_decode" if self.native is not None else "tinygemm_decode"

    def prepare(self, modules: list["Int4Linear"], head_name: str, override: int | None) -> tuple[int, str]:
        """Once every module is in place: the shared prefill scratch for ``modules``, and the crossover M at and above
        which the dequant path runs -- ``override``, else measured (or cached) on the largest non-head layer. The
        probe's calls are not the model's: the counts start at zero. Returns (M, "override" | "measured" | "cached")."""
        self.scratch = scratch_for(modules)
        if override is not None:
            if int(override) < 1:
                raise EdgeqError(f"prefill_threshold={override}: must be >= 1 (1 = always dequantise)")
            xover, source = int(override), "override"
        else:
            body = [m for m in modules if m.name != head_name] or modules
            probe_layer = max(body, key=lambda m: m.out_features * m.in_features)
            xover, source = crossover.crossover(probe_layer, self.decode_path)
        self.prefill_threshold = xover
        self.counts.clear()
        return xover, source

    def gather(self, x2: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """x2[:, perm], computed once for consecutive layers that read the same input with the same perm (q/k/v).

        The key is the input's storage and version: the lean loop rewrites one buffer in place every step, and the
        version counter tells the rewrites apart. Tensors created under ``torch.inference_mode`` have no version
        counter; those are fresh activations of the transformers forward, never rewritten between q, k and v.
        """
        try:
            version = x2._version
        except RuntimeError:  # an inference tensor
            version = None
        key = (x2.data_ptr(), version, tuple(x2.shape), perm.data_ptr())
        if self._gathered is None or self._gathered[0] != key:
            self.counts["input_gather"] += 1
            self._gathered = (key, x2.index_select(1, perm), x2)  # holding x2 keeps its storage from being reused
        return self._gathered[1]


def _ranges(n: int, rows: int, block_n: int | None) -> list[tuple[int, int]]:
    """Row ranges of at most ``rows`` rows covering [0, n); the tail block (n % block_n rows) is a range of its own."""
    full = n // block_n * block_n if block_n else n
    out = [(a, min(full, a + rows)) for a in range(0, full, rows)]
    return out + ([(full, n)] if full < n else [])


def _nibble_order(layout: TinygemmLayout) -> str | None:
    """How a full block's nibbles map to rows: "halves", "adjacent" or None (general)."""
    s = layout.block_n
    perm = layout.perm(s)
    if list(perm[0::2]) == list(range(s // 2)) and list(perm[1::2]) == list(range(s // 2, s)):
        return "halves"
    if list(perm) == list(range(s)):
        return "adjacent"
    return None


def forward_2d(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A quantised module's forward: x [..., K] (any float dtype) as contiguous bf16 rows through
    ``module.linear2d``, reshaped back to [..., N]. Shared by Int4Linear and W4A8Linear."""
    shape = x.shape
    x2 = x.reshape(-1, module.in_features)
    if x2.dtype != torch.bfloat16:
        x2 = x2.to(torch.bfloat16)
    return module.linear2d(x2.contiguous()).reshape(*shape[:-1], module.out_features)


class Int4Linear(nn.Module):
    """y = x @ dequant(W).T + bias, W stored tinygemm-packed (uint8 [N, K/2]) with bf16 scales_and_zeros [K/G, N, 2]."""

    edgeq_quantized = True

    def __init__(self, name: str, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, runtime: Runtime, perm: torch.Tensor | None = None):
        super().__init__()
        self.name = name
        self.out_features, self.in_features = tinygemm.check_shapes(name, qweight, scales_and_zeros, group_size)
        self.group_size = group_size
        # Plain attributes, not buffers: .to()/.state_dict() must never copy the mapped bytes.
        self.qweight = qweight
        self.scales_and_zeros = scales_and_zeros
        self.bias = bias
        self.runtime = runtime
        self.perm = perm  # act-order GPTQ: the packed K axis is x's K axis permuted (docs/format.md)
        self._order = _nibble_order(runtime.layout)
        self._rows = rows_per_block(self.out_features, self.in_features, runtime.layout.block_n)
        self._ranges = _ranges(self.out_features, self._rows, runtime.layout.block_n if self._order else None)
        # --head-levels 2: the residual level(s) the head adds (a plain tuple: not child modules, so the model's
        # modules(), its per-layer probes and the crossover probe see one head)
        self.residual_levels: tuple[Int4Linear, ...] = ()

    @classmethod
    def swap_in(cls, model: nn.Module, files, info, counts, *, strict_layout: bool = False) -> SwapResult:
        """The tinygemm_w4a16 swap (:func:`edgeq.runtime.swap.swap` calls it through the layout registry)."""
        return swap_tinygemm(model, files, info, counts, strict_layout)

    def extra_repr(self) -> str:
        more = "".join(f" + {lv.name} g{lv.group_size}" for lv in self.residual_levels)
        return f"{self.name}: in={self.in_features}, out={self.out_features}, group={self.group_size}{more}, int4 tinygemm"

    @property
    def scratch_elems(self) -> int:
        return max((self._rows * self.in_features, *(lv.scratch_elems for lv in self.residual_levels)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward_2d(self, x)

    def linear2d(self, x2: torch.Tensor) -> torch.Tensor:
        """y [M, N] (a new tensor) for a contiguous bf16 x2 [M, K]: the kernel below the crossover, the dequant path
        at and above it. The lean decode loop calls this directly (no reshapes, no module hooks). A head with
        residual levels sums them (:meth:`_linear2d_levels`)."""
        if self.perm is not None:
            x2 = self.runtime.gather(x2, self.perm)
        if self.residual_levels:
            return self._linear2d_levels(x2)
        if x2.shape[0] >= self.runtime.prefill_threshold:
            return self.forward_dequant(x2)  # adds the bias inside the GEMM, as nn.Linear does
        y = self.forward_kernel(x2)
        if self.bias is not None:
            y.add_(self.bias)  # y is the kernel's own new tensor; the same rounding as y + bias
        return y

    def _path(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 @ D^T without the bias, bf16 [M, N]: the kernel below the crossover, the dequant path at and above."""
        if x2.shape[0] >= self.runtime.prefill_threshold:
            return self.forward_dequant(x2, bias=False)
        return self.forward_kernel(x2)

    def _linear2d_levels(self, x2: torch.Tensor) -> torch.Tensor:
        """The head of ``--head-levels 2``: every level through the path M selects (the same for all: one M), summed
        in fp32 with one rounding, then the bias (if any) once::

            y = bf16( float32(path(x, level 0)) + float32(path(x, level 1)) )  (+ bias, one more bf16 rounding)

        Tolerance against the exact ``ref = x @ (D0 + D1)^T`` in fp64 (D_l the levels' fp32 dequantisations, the
        embedding contract's), elementwise with ``a_l = |x| @ |D_l|^T``::

            |y - ref| <= 2^-7 * (a_0 + a_1)

        because each level's path rounds twice (the dequant path its weights to bf16, the kernel's result to bf16:
        2^-9 * a_l each, 2^-8 * a_l together) and the sum once (2^-9 * (a_0 + a_1)): 1.5 * 2^-8 * (a_0 + a_1), plus
        fp32 accumulation, well inside 2^-7. Worked example: x = [1], D0 = 1.25, D1 = -0.015625: y = bf16(1.25 -
        0.015625) = 1.234375 (exact). Memory: the fp32 sum runs in chunks of SUM_CHUNK values into level 0's output."""
        y = self._path(x2)
        for level in self.residual_levels:
            _add_rounded(y, level._path(x2))
        if self.bias is not None:
            y.add_(self.bias)
        return y

    def forward_kernel(self, x2: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        rt.counts[rt.decode_path] += 1
        if rt.native is not None:
            return rt.native.int4_mm(x2, self.qweight, self.group_size, self.scales_and_zeros)
        return tinygemm.mm(x2, self.qweight, self.group_size, self.scales_and_zeros)

    def forward_dequant(self, x2: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """x2 @ W^T (+ the bias inside each GEMM unless ``bias`` is False), a row block of W at a time."""
        rt = self.runtime
        rt.counts["dequant_prefill"] += 1
        scratch = rt.scratch
        if scratch is None or scratch.elems < self.scratch_elems:
            raise RuntimeError(f"{self.name}: prefill scratch not sized for this layer (load() sizes it)")
        n = self.out_features
        out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
        with scratch.lock:
            for a, b in self._ranges:
                wt = self.dequantize_rows_t(a, b, scratch)
                b_ab = self.bias[a:b] if self.bias is not None and bias else None
                if b - a < n:
                    out[:, a:b] = x2 @ wt if b_ab is None else torch.addmm(b_ab, x2, wt)
                elif b_ab is None:
                    torch.mm(x2, wt, out=out)
                else:
                    torch.addmm(b_ab, x2, wt, out=out)
        return out

    def dequantize_rows_t(self, a: int, b: int, scratch: Scratch) -> torch.Tensor:
        """W[a:b].T as bf16 [K, b - a], a view of ``scratch.bf16``; (a, b) is one of ``self._ranges``."""
        k, s = self.in_features, self.runtime.layout.block_n
        wt = scratch.bf16[: k * (b - a)].view(k, b - a)
        if self._order and b <= self.out_features // s * s:
            self._fast_blocks(a, (b - a) // s, scratch, wt)
        else:  # the tail block, or an unmodelled permutation: the exact general unpack
            q = tinygemm.unpack(self.qweight, self.out_features, k, self.runtime.layout, rows=(a, b))
            wt.copy_(tinygemm.dequantize(q, self.scales_and_zeros[:, a:b], self.group_size, torch.bfloat16).t())
        return wt

    def _fast_blocks(self, a: int, c: int, scratch: Scratch, out_t: torch.Tensor) -> None:
        """Five passes: low nibbles, high nibbles (into W^T order), -8 in int8, int8 -> bf16, then
        ``addcmul(zero, q - 8, scale)`` (computed in fp32 and rounded once to bf16: equal to tinygemm.dequantize)."""
        k, g, s = self.in_features, self.group_size, self.runtime.layout.block_n
        rows = c * s
        packed = self.qweight.view(-1)[a * k // 2 : (a + rows) * k // 2].view(c, k, s // 2).permute(1, 0, 2)
        q = scratch.u8[: k * rows]
        if self._order == "halves":
            qv = q.view(k, c, 2, s // 2)
            torch.bitwise_and(packed, 15, out=qv[:, :, 0])
            torch.bitwise_right_shift(packed, 4, out=qv[:, :, 1])
        else:  # adjacent: even rows in low nibbles, odd rows in high nibbles
            qv = q.view(k, c, s // 2, 2)
            torch.bitwise_and(packed, 15, out=qv[..., 0])
            torch.bitwise_right_shift(packed, 4, out=qv[..., 1])
        q.view(torch.int8).sub_(8)
        out_t.copy_(q.view(torch.int8).view(k, rows))
        w = out_t.view(k // g, g, rows)
        sz = self.scales_and_zeros[:, a : a + rows]
        torch.addcmul(sz[:, None, :, 1], w, sz[:, None, :, 0], out=w)


SUM_CHUNK = 1 << 18  # values of the head levels' fp32 sum at a time (1 MiB per fp32 temporary)


def _add_rounded(y: torch.Tensor, other: torch.Tensor) -> None:
    """``y = bf16(float32(y) + float32(other))`` in place, both bf16 [M, N], in chunks of whole rows."""
    step = max(1, SUM_CHUNK // max(1, y.shape[1]))
    for a in range(0, y.shape[0], step):
        ya = y[a : a + step]
        ya.copy_(ya.to(torch.float32).add_(other[a : a + step]))  # fp32 add, one round to nearest even


def scratch_for(modules: list[Int4Linear]) -> Scratch:
    return Scratch(max((m.scratch_elems for m in modules), default=0))


# --- the swap ------------------------------------------------------------------------------------------------------


def make_runtime(counts: Counter) -> Runtime:
    """This machine's layout and kernel: edgeq's native kernel when it exists and supports the layout, else aten's."""
    here = tinygemm.probe()
    native = _native()
    if native is not None:
        try:
            native = native if native.supports(here) else None
        except Exception:  # noqa: BLE001 - a kernel that cannot say is not used
            native = None
    return Runtime(layout=here, counts=counts, native=native)


def swap_tinygemm(model: nn.Module, files, info, counts, strict: bool = False) -> SwapResult:
    """Every quantised Linear listed in ``info`` becomes an :class:`Int4Linear` over the mapped ``M.qweight`` /
    ``M.scales_and_zeros`` (and ``M.perm``, ``M.bias``). A checkpoint packed for another layout is repacked in memory
    (``copied_bytes``; the result carries the warning), or refused under ``strict``."""
    runtime = make_runtime(counts)
    here, stored = runtime.layout, info.layout
    foreign = not stored.is_compatible(here)
    if foreign and strict:
        raise EdgeqError(layout_refusal(stored, here))
    consumed, copied, mapped, t0 = set(), 0, 0, time.perf_counter()
    perms: dict[bytes, torch.Tensor] = {}  # equal permutations share one tensor, so q/k/v share one gather
    for name in info.quantized_modules:
        old = skeleton.quantized_target(model, name)
        qweight, sz = files.get(f"{name}.qweight"), files.get(f"{name}.scales_and_zeros")
        n, k = tinygemm.check_shapes(name, qweight, sz, info.group_size(name))
        if problem := packed_shape_error(name, (n, k), old):
            raise EdgeqError(problem)
        if foreign:
            qweight = tinygemm.pack(tinygemm.unpack(qweight, n, k, stored), here)
            copied += qweight.numel()
        else:
            mapped += qweight.numel()
        mapped += sz.numel() * sz.element_size()
        consumed.update({f"{name}.qweight", f"{name}.scales_and_zeros"})
        bias, bias_copied, bias_mapped = skeleton.quantized_bias(files, name, old)
        copied, mapped = copied + bias_copied, mapped + bias_mapped
        if bias is not None:
            consumed.add(f"{name}.bias")
        perm = _input_perm(files, name, k, perms)
        if perm is not None:
            consumed.add(f"{name}.perm")
        skeleton.set_module(model, name, Int4Linear(name, qweight, sz, info.group_size(name), bias, runtime, perm=perm))
    levels = info.manifest.head_levels[1:]
    for m, g in levels:  # --head-levels 2: the head also sums the packed table's residual level
        level, nbytes = _head_level(model, files, info, runtime, m, g, foreign)
        copied, mapped = (copied + nbytes, mapped) if foreign else (copied, mapped + nbytes)
        mapped += level.scales_and_zeros.numel() * 2
        consumed.update({f"{m}.qweight", f"{m}.scales_and_zeros"})
    tensors = len(info.quantized_modules) + len(levels)
    warning = repack_warning(stored, here, tensors, time.perf_counter() - t0, copied) if foreign else ""
    return SwapResult(scheme=str(info.scheme), consumed=frozenset(consumed), mapped_bytes=mapped, copied_bytes=copied,
                      layout="repacked" if foreign else "native", layout_hash=here.layout_hash,
                      decode_path=runtime.decode_path, prefill_path="dequant_prefill", warning=warning, runtime=runtime,
                      head_levels=1 + len(levels))


def _head_level(model: nn.Module, files, info, runtime: Runtime, module: str, g: int, foreign: bool):
    """(the Int4Linear of the head's residual level ``module`` at G=``g``, its qweight bytes), appended to the head's
    ``residual_levels``: the level's tensors checked as the packed embedding checks them (against the head's [V, K]
    and the manifest's records), mapped as stored, or repacked into this machine's layout like the head when the
    checkpoint's is foreign (the kernel reads only its own layout). The packed embedding then shares these tensors."""
    head = model.get_submodule(info.head_name)
    stored = stored_level(files, info, module, g, head.out_features, head.in_features)
    qweight = stored.qweight
    if foreign:
        qweight = tinygemm.pack(tinygemm.unpack(qweight, head.out_features, head.in_features, stored.layout),
                                runtime.layout)
    level = Int4Linear(module, qweight, stored.scales_and_zeros, g, None, runtime)
    head.residual_levels = (*head.residual_levels, level)
    return level, qweight.numel()


def layout_refusal(stored: TinygemmLayout, here: TinygemmLayout, strict_flag: str = "--strict-layout") -> str:
    """The strict-layout refusal of a checkpoint packed for ``stored`` on a machine whose kernel uses ``here``
    (shared with the vLLM plugin, whose strict setting is ``EDGEQ_STRICT_LAYOUT=1``)."""
    return (f"checkpoint packed for layout {stored.layout_hash[:12]} ({stored.cpu_capability}, torch "
            f"{stored.torch_version}, block {stored.block_n}) but this machine's kernel uses "
            f"{here.layout_hash[:12]} ({here.cpu_capability}, torch {here.torch_version}, block {here.block_n}); "
            f"run `edgeq repack` on it, or load without {strict_flag} to repack in memory")


def repack_warning(stored: TinygemmLayout, here: TinygemmLayout, tensors: int, seconds: float, copied: int) -> str:
    """The LayoutRepackWarning text after repacking ``tensors`` tensors in memory (also the vLLM plugin's)."""
    return (f"REPACKED IN MEMORY: checkpoint layout {stored.layout_hash[:12]} ({stored.cpu_capability}, "
            f"block {stored.block_n}) is not this machine's {here.layout_hash[:12]} ({here.cpu_capability}, "
            f"block {here.block_n}); repacking {tensors} tensors took {seconds:.2f} s and {format_bytes(copied)} "
            f"({copied} bytes) of anonymous memory. Run `edgeq repack` once to avoid this cost.")


def _input_perm(files, name: str, k: int, perms: dict) -> torch.Tensor | None:
    """``M.perm`` (int64 [K]) of an act-order GPTQ layer: the module computes kernel(x[..., perm]); None if absent."""
    if f"{name}.perm" not in files:
        return None
    perm = files.get(f"{name}.perm")
    if perm.dtype != torch.int64 or list(perm.shape) != [k]:
        raise EdgeqError(f"{name}.perm: expected int64 [{k}], got {perm.dtype} {list(perm.shape)}; re-convert the checkpoint")
    if not torch.equal(perm.sort().values, torch.arange(k)):
        raise EdgeqError(f"{name}.perm: not a permutation of 0..{k - 1} (repeated or missing indices); re-convert the checkpoint")
    key = perm.numpy().tobytes()
    return perms.setdefault(key, perm)
