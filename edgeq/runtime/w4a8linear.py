"""The runtime side of W4A8 (``kernel: amx_w4a8`` checkpoints): the kernel choice, the quantised module, the swap.

The checkpoint is read and validated by :func:`edgeq.runtime.qinfo.read_checkpoint`, as every kernel's: its layout
record must equal :func:`edgeq.layouts.w4a8.fingerprint` of the group size exactly (the bytes are fixed by the
kernel's source, so there is nothing to repack: a different record is refused with both records' versions).

- :class:`W4A8Linear`: ``y = W4A8(x)`` over the mapped ``M.qweight`` / ``M.scales`` / ``M.zeros`` (never copied),
  for every M through one path chosen at load: a compiled kernel when one is available **and** agrees with the
  portable path bit for bit on a probe -- first edgeq's own native op (:mod:`edgeq.runtime.native.w4a8`, built at
  first use; source ``edgeq native (<isa>)``), then a compiled ``int4_scaled_mm_cpu`` (sglang's ``sgl_kernel`` or
  vLLM's ``_C``) -- else the portable path :func:`edgeq.runtime.w4a8_compute.w4a8_linear` (bit-exact in bf16 to
  the kernel's arithmetic).
- :func:`swap_w4a8` (``W4A8Linear.swap_in``, which :func:`edgeq.runtime.swap.swap` calls for this kernel): a
  :class:`~edgeq.runtime.swap.SwapResult` whose ``decode_path`` / ``prefill_path`` are ``w4a8_portable`` or
  ``w4a8_kernel`` (any compiled op, edgeq's native one included; the same counter names in the runtime's Counter,
  one count per module call), ``compute`` names the op (e.g. ``compiled: edgeq native (amx)``).

The path is never chosen silently: the result's ``note`` says what was found and why it is or is not used.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from edgeq import cpu
from edgeq.cpu import has_vnni
from edgeq.errors import EdgeqError
from edgeq.io import skeleton
from edgeq.layouts import w4a8 as layout
from edgeq.runtime import w4a8_compute as compute
from edgeq.runtime.qlinear import forward_2d
from edgeq.runtime.swap import SwapResult, packed_shape_error

KERNEL = layout.KERNEL
PORTABLE = "w4a8_portable"
COMPILED = "w4a8_kernel"
PROBE_SHAPES = ((1, 64, 256), (5, 96, 256))  # (M, N, K): decode and a small prefill, several 32-row blocks


# --- the compiled kernel, when importable --------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelChoice:
    """What W4A8 runs here: ``fn`` (a compiled op with the portable path's signature) or None for the portable path,
    and one line saying why."""

    path: str  # PORTABLE | COMPILED
    fn: Callable | None
    source: str  # "portable" | "edgeq native (<isa>)" | "sgl_kernel" | "vllm._C"
    reason: str


NATIVE_PREFIX = "edgeq native"


def native_candidate() -> tuple[tuple[str, Callable] | None, str]:
    """(("edgeq native (<isa>)", fn), "") when edgeq's own W4A8 op is built and usable here, else (None, why not).
    ``fn`` already has the portable path's signature. A bad ``EDGEQ_W4A8_ISA`` raises :class:`EdgeqError`."""
    from edgeq.runtime.native import w4a8 as native_w4a8

    if not native_w4a8.available():  # raises on a user error (unknown or unsupported forced ISA)
        return None, f"edgeq native W4A8 kernel: {native_w4a8.status()['reason']}"
    return (native_w4a8.source_name(), native_w4a8.w4a8_mm), ""


EXTERNAL_OPS = (("sgl_kernel", "sgl_kernel", "sgl_kernel"), ("vllm._C", "vllm._C", "_C"))  # (source, module, ns)


def external_plan(flags: frozenset[str], op_names: frozenset[str]) -> list[tuple[str, str | None, str]]:
    """Which external ``int4_scaled_mm_cpu`` ops may be tried here, as (source, module to import or None, namespace).

    Both packages' CPU builds of this op need AVX512-BF16 (vLLM itself imports ``vllm._C`` only there; its
    ``_C_AVX2`` / ``_C_AVX512`` builds have no such op), and importing ``vllm._C`` on a CPU without it kills the
    process with SIGILL at import, which no ``except`` catches: without ``avx512_bf16`` nothing is tried. And when ops
    of the ``_C`` namespace are registered already (vLLM's engine loaded one of its builds), importing ``vllm._C``
    again aborts the process (a second ``TORCH_LIBRARY(_C)``): then the registered op is used if there is one, and
    nothing is imported. ``op_names`` is ``torch._C._dispatch_get_all_op_names()``.

        >>> external_plan(frozenset({"avx2"}), frozenset())                       # a Zen 3: nothing
        []
        >>> external_plan(frozenset({"avx512_bf16"}), frozenset({"_C::rms_norm"}))  # _C loaded, without the op
        [('sgl_kernel', 'sgl_kernel', 'sgl_kernel')]
    """
    if "avx512_bf16" not in flags:
        return []
    plan = []
    for source, module, ns in EXTERNAL_OPS:
        if any(n.startswith(f"{ns}::") for n in op_names):
            if f"{ns}::int4_scaled_mm_cpu" in op_names:
                plan.append((source, None, ns))
            continue
        plan.append((source, module, ns))
    return plan


def compiled_candidates() -> list[tuple[str, Callable]]:
    """Available compiled W4A8 ops as (source, op), best first: edgeq's native op (already in the portable path's
    signature), then ``int4_scaled_mm_cpu`` ops (sglang / vLLM argument order) where :func:`external_plan` allows.
    External packages are imported only when installed (``find_spec``), and any failure there means "not available",
    never an exception."""
    found = []
    native, _ = native_candidate()
    if native is not None:
        found.append(native)
    for source, module, ns in external_plan(cpu.flags(), frozenset(torch._C._dispatch_get_all_op_names())):
        try:
            if module is not None:
                if importlib.util.find_spec(module.split(".")[0]) is None:
                    continue
                importlib.import_module(module)
            found.append((source, getattr(getattr(torch.ops, ns), "int4_scaled_mm_cpu")))
        except Exception:  # noqa: BLE001 - a broken or CPU-less build is simply not available
            continue
    return found


def _as_linear(op: Callable) -> Callable:
    """The op's argument order (x, w, w_zeros, w_scales, fp32 bias) behind the portable path's (x, q, s, z, G, bias)."""
    def fn(x2, qweight, scales, zeros, group_size, bias=None):
        return op(x2, qweight, zeros, scales, bias.to(torch.float32) if bias is not None else None)
    return fn


def _probe_case(m: int, n: int, k: int, group_size: int, seed: int):
    from edgeq.quantize.w4a8 import quantize_w4a8

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-3, 3, (n, 1), generator=g).float())
    qw = quantize_w4a8(w, group_size, name="w4a8 probe")
    packed = layout.pack(qw.q, qw.scales, qw.zeros, group_size, name="w4a8 probe")
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    return x, packed, bias


def probe(fn: Callable, group_size: int) -> tuple[bool, str]:
    """Does ``fn`` give the portable path's bf16 bits (with the fused FMA, or the unfused multiply-add) on probe
    cases (decode and a small prefill, with and without bias)? Returns (agrees, what was compared)."""
    for i, (m, n, k) in enumerate(PROBE_SHAPES):
        x, p, bias = _probe_case(m, n, k, group_size, seed=1234 + i)
        for b in (None, bias):
            try:
                got = fn(x, p.qweight, p.scales, p.zeros, group_size, b)
            except Exception as e:  # noqa: BLE001 - a kernel that throws on the probe is not used
                return False, f"raised {type(e).__name__}: {str(e)[:120]} on M={m}, N={n}, K={k}"
            if not isinstance(got, torch.Tensor) or got.dtype != torch.bfloat16 or tuple(got.shape) != (m, n):
                return False, f"returned {getattr(got, 'dtype', type(got))} {list(getattr(got, 'shape', []))}, expected bf16 [{m}, {n}]"
            refs = [compute.w4a8_linear(x, p.qweight, p.scales, p.zeros, group_size, b, fused=f) for f in (True, False)]
            if not any(torch.equal(got.view(torch.int16), r.view(torch.int16)) for r in refs):
                diff = (got.float() - refs[0].float()).abs().max().item()
                return False, f"differs from the portable path on M={m}, N={n}, K={k} (max |diff| {diff:.3g})"
    return True, f"bit-equal to the portable path on {len(PROBE_SHAPES) * 2} probe cases"


def choose_kernel(group_size: int, use_compiled: bool = True,
                  candidates: Callable[[], list[tuple[str, Callable]]] | None = None) -> KernelChoice:
    """The compiled op when one is importable and passes :func:`probe`, else the portable path, with the reason."""
    if not use_compiled:
        return KernelChoice(PORTABLE, None, "portable", "compiled kernel not requested")
    found = (candidates or compiled_candidates)()
    if not found:
        why = native_candidate()[1] + "; " if candidates is None else ""
        return KernelChoice(PORTABLE, None, "portable",
                            f"{why}no compiled int4_scaled_mm_cpu importable (sgl_kernel, vllm._C); portable path")
    notes = []
    for source, op in found:
        fn = op if source.startswith(NATIVE_PREFIX) else _as_linear(op)
        label = source if source.startswith(NATIVE_PREFIX) else f"{source} int4_scaled_mm_cpu"
        ok, why = probe(fn, group_size)
        if ok:
            return KernelChoice(COMPILED, fn, source, f"{label}: {why}")
        notes.append(f"{label} {why}")
    return KernelChoice(PORTABLE, None, "portable", "; ".join(notes) + "; using the portable path")


def portable_description() -> str:
    """Which products and which FMA the portable path uses on this machine."""
    backend = "torch._int_mm (AVX512-VNNI/AMX)" if has_vnni() else "exact fp32 GEMM on integers"
    fma = "addcmul (checked single-rounding FMA)" if compute.addcmul_is_fma() else "exact float64 FMA emulation"
    return f"portable: {backend}, {fma}"


# --- the module ----------------------------------------------------------------------------------------------------


class W4A8Linear(nn.Module):
    """y = x @ W.T + bias with int8 per-token activations and the amx_w4a8 packed weight (docs/w4a8.md).

    ``qweight`` uint8 [N/32, K/bk, bk*16+128], ``scales`` fp32 [N/32, K/G, 32], ``zeros`` int8 [N/32, K/G, 32] are
    plain attributes (mapped views; ``.to()`` / ``state_dict()`` never copy them). Every call, whatever M, runs
    the path chosen at load (``path``) and adds one to ``counts[path]``. Output bf16.
    """

    edgeq_quantized = True

    def __init__(self, name: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, counts, choice: KernelChoice | None = None):
        super().__init__()
        self.name = name
        self.out_features, self.in_features = layout.check_packed(name, qweight, scales, zeros, group_size)
        self.group_size = group_size
        self.qweight = qweight
        self.scales = scales
        self.zeros = zeros
        if bias is not None and list(bias.shape) != [self.out_features]:
            raise EdgeqError(f"{name}.bias: expected [{self.out_features}], got {list(bias.shape)}")
        self.bias = bias
        self.counts = counts
        self.choice = choice or KernelChoice(PORTABLE, None, "portable", "default")
        self.path = self.choice.path

    @classmethod
    def swap_in(cls, model: nn.Module, files, info, counts, *, strict_layout: bool = False) -> SwapResult:
        """The amx_w4a8 swap (:func:`edgeq.runtime.swap.swap` calls it through the layout registry); the layout is
        fixed by the kernel's source, so ``strict_layout`` has nothing to refuse."""
        return swap_w4a8(model, files, info, counts)

    def extra_repr(self) -> str:
        return (f"{self.name}: in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"w4a8 {self.choice.source}")

    @property
    def scratch_elems(self) -> int:
        return 0  # both paths' scratch is per call (bounded, freed on return), nothing shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward_2d(self, x)

    def linear2d(self, x2: torch.Tensor) -> torch.Tensor:
        """y bf16 [M, N] (a new tensor) for a contiguous bf16 x2 [M, K]; the bias is the kernel's fp32 starting value.
        The lean decode loop (edgeq/runtime/lean.py) calls this directly, as it does Int4Linear's."""
        self.counts[self.path] += 1
        if self.choice.fn is not None:
            return self.choice.fn(x2, self.qweight, self.scales, self.zeros, self.group_size, self.bias)
        return compute.w4a8_linear(x2, self.qweight, self.scales, self.zeros, self.group_size, self.bias, name=self.name)


def swap_w4a8(model: nn.Module, files, info, counts, *, use_compiled: bool = True,
              choice: KernelChoice | None = None) -> SwapResult:
    """Replace every quantised ``nn.Linear`` listed in ``info`` (a validated amx_w4a8 :class:`~edgeq.runtime.qinfo.
    QuantInfo`) by a :class:`W4A8Linear` over the mapped tensors, all through one kernel choice.

    ``files`` is the loader's MappedFiles (``get(name)`` -> mapped tensor, ``name in files``). Refuses, naming the
    module: a module the model does not have or that is not a Linear, missing or mis-shaped tensors, a shape that
    differs from config.json, a bias the model needs but the checkpoint lacks, and ``M.perm`` (act-order is not
    supported with W4A8).
    """
    choice = choice or choose_kernel(info.scheme.group_size, use_compiled)
    consumed: set[str] = set()
    mapped = copied = 0
    for name in info.quantized_modules:
        g = info.group_size(name)
        old = skeleton.quantized_target(model, name)
        if f"{name}.perm" in files:
            raise EdgeqError(f"{name}.perm: an input permutation (act-order) is not supported with the amx_w4a8 "
                             "kernel; the checkpoint is inconsistent, re-quantise it")
        parts = {}
        for suffix in layout.LAYOUT.suffixes:
            if f"{name}{suffix}" not in files:
                raise EdgeqError(f"{name}: the checkpoint has no {name}{suffix} (amx_w4a8 modules store qweight, "
                                 "scales and zeros); it is incomplete, re-quantise it")
            parts[suffix] = files.get(f"{name}{suffix}")
        n, k = layout.check_packed(name, parts[".qweight"], parts[".scales"], parts[".zeros"], g)
        if problem := packed_shape_error(name, (n, k), old):
            raise EdgeqError(problem)
        mapped += sum(t.numel() * t.element_size() for t in parts.values())
        consumed.update(f"{name}{s}" for s in parts)
        bias, bias_copied, bias_mapped = skeleton.quantized_bias(files, name, old)
        copied, mapped = copied + bias_copied, mapped + bias_mapped
        if bias is not None:
            consumed.add(f"{name}.bias")
        skeleton.set_module(model, name, W4A8Linear(name, parts[".qweight"], parts[".scales"], parts[".zeros"], g,
                                                    bias, counts, choice))
    return SwapResult(
        scheme=str(info.scheme), consumed=frozenset(consumed), mapped_bytes=mapped, copied_bytes=copied,
        layout="native",  # fixed by the kernel's source: nothing to measure or repack
        layout_hash=str(info.layout["layout_hash"]), decode_path=choice.path, prefill_path=choice.path,
        note=choice.reason,
        compute=portable_description() if choice.fn is None else f"compiled: {choice.source}")
